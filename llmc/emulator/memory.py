"""llmc/emulator/memory.py: the emulated device's memory counters, per kernel and per source line, as
NVIDIA's profiler defines them: global loads and stores in requests, 32-byte sectors and 128-byte
lines, shared memory in wavefronts and bank conflicts. What Nsight Compute shows on a GPU, on a
laptop, from the unmodified kernel source.

How it works: while tracing() is active, kernel modules compiled by the emulated device are traced
builds (llmc/emulator/build.py's mode "trace"): the kernel's code is compiled with g++'s
ThreadSanitizer instrumentation, whose calls before every load and store go to
llmc/emulator/shim/tracer.cpp instead of ThreadSanitizer's runtime. The tracer groups each warp's
accesses into requests and counts them (its docstring has the rules); here the counters are read
back after each launch, summed per site and mapped to the kernel's source lines with the library's
debug line table (addr2line).

The definitions (each counter is per warp-level memory instruction, a "request"):
- global requests, sectors, sectors/request: NVIDIA, Nsight Compute Kernel Profiling Guide, metrics
  l1tex__t_requests_pipe_lsu_mem_global_op_{ld,st} and l1tex__t_sectors_pipe_lsu_mem_global_op_{ld,st}:
  a sector is an aligned 32-byte piece of a 128-byte cache line; a request fetches every sector
  any of its lanes touches. Ideal for 32 lanes loading consecutive 4-byte words: 4 sectors per
  request (CUDA C++ Programming Guide, "Coalesced Access to Global Memory").
- bytes requested against bytes moved (32 x sectors): the share of the moved bytes the lanes use
  (distinct bytes: lanes reading the same word count it once, so a broadcast is not over 100%).
- shared wavefronts and bank conflicts: metrics l1tex__data_pipe_lsu_wavefronts_mem_shared_op_{ld,st}
  and l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}; the banks as the CUDA C++
  Programming Guide describes them ("Shared Memory", compute capability 5.x and later): 32 banks of
  successive 4-byte words; lanes reading the same word share it (a broadcast); distinct words in
  one bank are served one after another. 8-byte accesses are served by half-warps and 16-byte
  ones by quarter-warps (128 bytes a wavefront), so their ideal is 2 or 4 wavefronts for a warp.

What it is not: a timing model, or the hardware's exact grouping: accesses are grouped by site and
by how often each lane has executed it (a lane that skips an access in divergent code shifts the
grouping), g++'s scalar copies of 16-byte vectors are merged back (tracer.cpp, rule 1), atomics and
the constant cache are not counted, and L1/L2 hits are not modeled (every sector counts as moved).

Use:
    from llmc.emulator import memory
    with memory.tracing() as report:       # before the kernels are compiled and launched
        ...launch kernels on the emulated device (llmc.cuda.use_device("cpu"))...
    print(report.format())
Learners meet it as `python dev/cuda/<op>.py --device cpu --memory` and
`python gpt2_cuda.py --device cpu --memory-report`.
"""

import contextlib
import ctypes
import dataclasses
import os
import re
import subprocess

from llmc.emulator import device

SPACES = ("global", "shared")
ACCESSES = ("load", "store")
SECTOR_BYTES = 32
RAW_CAPACITY = 2_000_000               # accesses kept for one launch's raw trace (the visual debugger)


class _Site(ctypes.Structure):
    _fields_ = [("pc_offset", ctypes.c_ulonglong), ("space", ctypes.c_int), ("write", ctypes.c_int),
                ("requests", ctypes.c_ulonglong), ("lanes", ctypes.c_ulonglong), ("sectors", ctypes.c_ulonglong),
                ("lines", ctypes.c_ulonglong), ("bytes", ctypes.c_ulonglong), ("unique_bytes", ctypes.c_ulonglong),
                ("wavefronts", ctypes.c_ulonglong),
                ("ideal_wavefronts", ctypes.c_ulonglong)]


class _Raw(ctypes.Structure):
    _fields_ = [("pc_offset", ctypes.c_ulonglong), ("addr", ctypes.c_ulonglong), ("block_x", ctypes.c_uint),
                ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint), ("thread", ctypes.c_int),
                ("size", ctypes.c_int), ("space", ctypes.c_int), ("write", ctypes.c_int)]


@dataclasses.dataclass
class Counters:
    """The counters of some requests (one site, line or kernel): requests, active lanes, sectors and
    128-byte lines touched (global), bytes the lanes asked for (lanes x access size) and the
    distinct ones among them, shared-memory wavefronts and the ideal number of them (one per active
    phase of a request)."""
    requests: int = 0
    lanes: int = 0
    sectors: int = 0
    lines: int = 0
    bytes: int = 0
    unique_bytes: int = 0
    wavefronts: int = 0
    ideal_wavefronts: int = 0

    def add(self, other):
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    @property
    def sectors_per_request(self):
        return self.sectors / self.requests if self.requests else 0.0

    @property
    def bytes_moved(self):
        """Global: 32 bytes per sector touched."""
        return SECTOR_BYTES * self.sectors

    @property
    def efficiency(self):
        """Global: the share of the moved bytes that some lane asked for (1.0 = no byte wasted)."""
        return self.unique_bytes / self.bytes_moved if self.sectors else 1.0

    @property
    def wavefronts_per_request(self):
        return self.wavefronts / self.requests if self.requests else 0.0

    @property
    def bank_conflicts(self):
        """Shared: wavefronts beyond the ideal (Nsight Compute's l1tex__data_bank_conflicts...)."""
        return self.wavefronts - self.ideal_wavefronts


@dataclasses.dataclass(frozen=True)
class Site:
    """Where an access was made: the kernel launched, the source line, the memory space and
    whether it loads or stores."""
    kernel: str
    line: str                          # "path:line" in the kernel's source (relative to the repository)
    space: str                         # "global" or "shared"
    access: str                        # "load" or "store"


class MemoryReport:
    """The counters of every traced launch: .launches (kernel name -> count), .sites (Site ->
    Counters), .raw (one launch's accesses when asked for)."""

    def __init__(self):
        self.launches = {}
        self.sites = {}
        self.raw = None

    def kernel_counters(self, kernel, space, access):
        """Counters of one kernel's loads or stores in one space, summed over its lines."""
        total = Counters()
        for site, counters in self.sites.items():
            if site.kernel == kernel and site.space == space and site.access == access:
                total.add(counters)
        return total

    def worst_lines(self, kernel=None, n=5):
        """The lines that waste the most, worst first: global ones by the bytes moved but never used,
        shared ones by their bank conflicts, each as (Site, Counters, waste)."""
        ranked = []
        for site, c in self.sites.items():
            if kernel is not None and site.kernel != kernel:
                continue
            waste = c.bytes_moved - c.unique_bytes if site.space == "global" else c.bank_conflicts
            if waste > 0:
                ranked.append((site, c, waste))
        ranked.sort(key=lambda item: (-item[2], item[0].line))
        return ranked[:n]

    def format(self, worst=1):
        """One table, a row per kernel (launches; global loads and stores: requests, sectors per
        request, share of moved bytes used; shared: requests, wavefronts per request, bank
        conflicts), then each kernel's `worst` worst lines."""
        header = (f"{'kernel':34s} {'launches':>8s} | {'global ld req':>13s} {'sect/req':>8s} {'used':>5s} | "
                  f"{'global st req':>13s} {'sect/req':>8s} {'used':>5s} | {'shared req':>10s} {'wavef/req':>9s} "
                  f"{'conflicts':>9s}")
        lines = ["memory counters on the emulated device (definitions: llmc/emulator/memory.py)", header,
                 "-" * len(header)]
        for kernel in sorted(self.launches):
            ld, st = self.kernel_counters(kernel, "global", "load"), self.kernel_counters(kernel, "global", "store")
            shared = self.kernel_counters(kernel, "shared", "load")
            shared.add(self.kernel_counters(kernel, "shared", "store"))
            lines.append(f"{kernel:34s} {self.launches[kernel]:8d} | {ld.requests:13d} {ld.sectors_per_request:8.1f} "
                         f"{ld.efficiency:5.0%} | {st.requests:13d} {st.sectors_per_request:8.1f} {st.efficiency:5.0%} | "
                         f"{shared.requests:10d} {shared.wavefronts_per_request:9.2f} {shared.bank_conflicts:9d}")
        if worst:
            lines.append("")
            lines.append("worst line of each kernel (global: bytes moved but unused; shared: bank conflicts):")
            for kernel in sorted(self.launches):
                ranked = self.worst_lines(kernel, worst)
                lines += ["  " + describe(site, c) for site, c, _ in ranked]
                if not ranked:
                    lines.append(f"  {kernel}: every moved byte used, no bank conflict")
        return "\n".join(lines)


def describe(site, c):
    """One line about one site's counters."""
    where = f"{site.kernel}  {site.line}  {site.space} {site.access}"
    if site.space == "global":
        return (f"{where}: {c.requests} requests, {c.sectors_per_request:.1f} sectors/request, "
                f"{c.unique_bytes:,} distinct bytes asked for of {c.bytes_moved:,} moved ({c.efficiency:.0%})")
    return (f"{where}: {c.requests} requests, {c.wavefronts_per_request:.2f} wavefronts/request "
            f"(ideal {c.ideal_wavefronts / max(1, c.requests):.2f}), {c.bank_conflicts} bank conflicts")


# ----------------------------------------------------------------------------
# source lines

_LINES = {}                            # (library path, pc offset) -> "path:line"


def source_lines(library_path, offsets):
    """{offset: "path:line"} for return addresses in a traced library: the line of the call just
    before each (offset - 1), the innermost frame of the inlined chain that lies in a .cu file (the
    kernel's own line, not the header helper it called), else the innermost frame. Paths are
    relative to the repository when inside it."""
    missing = sorted({o for o in offsets if (library_path, o) not in _LINES})
    if missing:
        result = subprocess.run(["addr2line", "-e", library_path, "-i", "-f", "-C", "-a"]
                                + [hex(o - 1) for o in missing], capture_output=True, text=True)
        blocks, current = [], None
        for text in result.stdout.splitlines():
            if text.startswith("0x") and " " not in text:
                current = []
                blocks.append(current)
            elif current is not None:
                current.append(text)
        for offset, block in zip(missing, blocks):
            frames = [block[i + 1] for i in range(0, len(block) - 1, 2)]       # (function, file:line) pairs
            frames = [f.split(" (discriminator")[0] for f in frames]
            chosen = next((f for f in frames if f.rsplit(":", 1)[0].endswith(".cu")), frames[0] if frames else "??:0")
            path, _, line = chosen.rpartition(":")
            _LINES[(library_path, offset)] = f"{_shown(path)}:{line}"
    return {o: _LINES[(library_path, o)] for o in offsets}


def _shown(path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


# ----------------------------------------------------------------------------
# tracing launches

class Tracer:
    """What device.MEMORY_TRACE holds while tracing: runs each launch of a traced build between
    the tracer's begin and end, then adds its counters to the report. raw_launch: the index
    (0, 1, ...) of the launch whose every access is also kept (report.raw), or None; raw_kernel:
    (kernel name, n) keeps the n-th launch of that kernel instead."""

    def __init__(self, report, raw_launch=None, raw_kernel=None):
        self.report, self.raw_launch, self.raw_kernel, self.count = report, raw_launch, raw_kernel, 0
        self.kernel_counts = {}

    def launch(self, kernel, grid, block, storage, pointers):
        lib = kernel.library.library
        ranges = sorted(device.ALLOCATIONS.items())
        n = len(ranges)
        begins = (ctypes.c_ulonglong * max(1, n))(*[a for a, _ in ranges])
        ends = (ctypes.c_ulonglong * max(1, n))(*[a + size for a, size in ranges])
        nth = self.kernel_counts.get(kernel.name, 0)
        self.kernel_counts[kernel.name] = nth + 1
        keep_raw = ((self.raw_launch is not None and self.count == self.raw_launch)
                    or self.raw_kernel == (kernel.name, nth))
        self.count += 1
        self.arguments = [s.value if isinstance(s, ctypes.c_void_p) else None for s in storage]
        lib.llmc_emu_trace_begin(ctypes.c_int(n), begins, ends, ctypes.c_long(RAW_CAPACITY if keep_raw else 0))
        try:
            kernel.launch(grid, block, storage, pointers)
        finally:
            lib.llmc_emu_trace_end()
        self._collect(kernel, lib, keep_raw, grid, block, ranges)

    def _collect(self, kernel, lib, keep_raw, grid, block, ranges):
        lib.llmc_emu_trace_sites.restype = ctypes.c_long
        n = lib.llmc_emu_trace_sites(None, ctypes.c_long(0))
        sites = (_Site * max(1, n))()
        lib.llmc_emu_trace_sites(sites, ctypes.c_long(n))
        lines = source_lines(kernel.library.path, [s.pc_offset for s in sites[:n]])
        report = self.report
        report.launches[kernel.name] = report.launches.get(kernel.name, 0) + 1
        for s in sites[:n]:
            site = Site(kernel.name, lines[s.pc_offset], SPACES[s.space], ACCESSES[s.write])
            report.sites.setdefault(site, Counters()).add(
                Counters(s.requests, s.lanes, s.sectors, s.lines, s.bytes, s.unique_bytes, s.wavefronts,
                         s.ideal_wavefronts))
        if keep_raw:
            lib.llmc_emu_trace_raw.restype = ctypes.c_long
            dropped = ctypes.c_long(0)
            count = lib.llmc_emu_trace_raw(None, ctypes.c_long(0), ctypes.byref(dropped))
            raw = (_Raw * max(1, count))()
            lib.llmc_emu_trace_raw(raw, ctypes.c_long(count), ctypes.byref(dropped))
            where = source_lines(kernel.library.path, [r.pc_offset for r in raw[:count]])
            report.raw = {"kernel": kernel.name, "grid": list(grid), "block": list(block), "dropped": dropped.value,
                          "allocations": [[a, size] for a, size in ranges], "arguments": self.arguments,
                          "source": kernel.library.source_path,
                          "accesses": [{"block": [r.block_x, r.block_y, r.block_z], "thread": r.thread,
                                        "warp": r.thread // 32, "lane": r.thread % 32, "addr": r.addr,
                                        "size": r.size, "space": SPACES[r.space], "access": ACCESSES[r.write],
                                        "line": where[r.pc_offset]} for r in raw[:count]]}


@contextlib.contextmanager
def tracing(raw_launch=None, raw_kernel=None):
    """Count the memory accesses of every kernel launched on the emulated device inside the block;
    yields the MemoryReport. Modules compiled inside it are traced builds (cached apart from the
    untraced ones): enter it before the kernels are loaded. raw_launch: keep every access of that
    launch (0 = the first) in report.raw; raw_kernel: (name, n), the n-th launch of kernel `name`."""
    report = MemoryReport()
    previous = device.MEMORY_TRACE
    device.MEMORY_TRACE = Tracer(report, raw_launch, raw_kernel)
    try:
        yield report
    finally:
        device.MEMORY_TRACE = previous


# ----------------------------------------------------------------------------
# one launch, thread by thread: the visual debugger's kernel trace (llmc/debugger/kerneltrace.py)

KERNEL_TRACE_FORMAT = "llmc-kernel-trace-1"
# bytes of one element of a pointer parameter, by the type it points to (floatX by the build's precision)
ELEMENT_BYTES = {"float": 4, "int": 4, "unsigned": 4, "unsigned int": 4, "uint32_t": 4, "int32_t": 4,
                 "__nv_bfloat16": 2, "nv_bfloat16": 2, "unsigned short": 2, "double": 8, "long": 8,
                 "size_t": 8, "float4": 16, "int4": 16, "char": 1}


def kernel_parameters(source, kernel):
    """[(name, element type)] of the kernel's pointer parameters in its source text, in order
    (non-pointer parameters as (name, None))."""
    match = re.search(rf'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?{kernel}\s*\(([^)]*)\)',
                      source)
    if match is None:
        return []
    parameters = []
    for declaration in match.group(1).split(","):
        declaration = re.sub(r"\b(const|__restrict__|volatile)\b", " ", declaration).strip()
        name = re.findall(r"\w+", declaration)[-1]
        kind = declaration[:declaration.rfind(name)].strip()
        parameters.append((name, " ".join(kind.rstrip("*").split()) if kind.endswith("*") else None))
    return parameters


def kernel_trace(raw, precision):
    """report.raw (one launch's accesses, tracing(raw_kernel=...)) as the visual debugger's kernel
    trace (format KERNEL_TRACE_FORMAT, llmc/debugger/kerneltrace.py): each global buffer named by
    the pointer parameter that points into it, element indices counted from that pointer, the
    accesses regrouped into warp-level requests (a lane's n-th access of a source line in its warp
    joins the warp's n-th request of that line, as tracer.cpp groups them), and per warp its
    requests, global sectors per request and shared-memory bank conflicts. Shared accesses are one
    buffer, "shared", in 4-byte words."""
    with open(raw["source"]) as f:
        source = f.read()
    floatx_bytes = 2 if precision == "bf16" else 4
    pointers = []                      # (pointer, name, element bytes, end of its allocation)
    for (name, kind), pointer in zip(kernel_parameters(source, raw["kernel"]), raw["arguments"]):
        if kind is None or pointer is None:
            continue
        end = next((base + size for base, size in raw["allocations"] if base <= pointer < base + size), None)
        if end is not None and all(p != pointer for p, *_ in pointers):
            pointers.append((pointer, name, floatx_bytes if kind == "floatX" else ELEMENT_BYTES.get(kind, 4), end))
    pointers.sort()
    # each buffer runs from its pointer to the next pointer into the same allocation, or to its end
    owners, buffers = [], []
    for i, (pointer, name, eb, end) in enumerate(pointers):
        if i + 1 < len(pointers) and pointers[i + 1][0] < end:
            end = pointers[i + 1][0]
        owners.append((pointer, end, name, eb))
        buffers.append({"name": name, "space": "global", "elements": max(1, (end - pointer) // eb), "element_bytes": eb})
    shared = [a["addr"] for a in raw["accesses"] if a["space"] == "shared"]
    shared_base = min(shared) if shared else 0
    if shared:
        words = (max(a["addr"] + a["size"] for a in raw["accesses"] if a["space"] == "shared") - shared_base + 3) // 4
        buffers.append({"name": "shared", "space": "shared", "elements": words, "element_bytes": 4})
    requests, occurrences = {}, {}
    for a in raw["accesses"]:
        if a["space"] == "shared":
            buffer, first, eb = "shared", shared_base, 4
        else:
            owner = next(((n, p, e) for p, end, n, e in owners if p <= a["addr"] < end), None)
            if owner is None:
                continue                                   # outside every pointer argument's range
            buffer, first, eb = owner
        line = int(a["line"].rsplit(":", 1)[1]) if a["line"].rsplit(":", 1)[-1].isdigit() else 0
        key = (tuple(a["block"]), a["warp"], line, a["access"], buffer)
        lane_key = key + (a["lane"],)
        n = occurrences.get(lane_key, 0)
        occurrences[lane_key] = n + 1
        request = requests.setdefault(key + (n,), {"block": list(a["block"]), "warp": a["warp"], "line": line,
                                                   "op": "read" if a["access"] == "load" else "write",
                                                   "buffer": buffer, "lanes": [], "elements": [], "bytes": []})
        for e in range((a["addr"] - first) // eb, (a["addr"] + a["size"] - 1 - first) // eb + 1):
            request["lanes"].append(a["lane"])
            request["elements"].append(e)
        request["bytes"].append((a["lane"], a["addr"], a["size"]))
    warps = {}
    for r in requests.values():
        w = warps.setdefault((tuple(r["block"]), r["warp"]), {"block": r["block"], "warp": r["warp"], "requests": 0,
                                                              "sectors": 0, "global_requests": 0, "bank_conflicts": 0})
        w["requests"] += 1
        spans = r.pop("bytes")
        if r["buffer"] == "shared":
            w["bank_conflicts"] += _bank_conflicts(spans)
        else:
            w["global_requests"] += 1
            w["sectors"] += len({s for _, addr, size in spans for s in range(addr >> 5, ((addr + size - 1) >> 5) + 1)})
    warp_rows = [{"block": w["block"], "warp": w["warp"], "requests": w["requests"],
                  "sectors_per_request": round(w["sectors"] / w["global_requests"], 2) if w["global_requests"] else 0.0,
                  "bank_conflicts": w["bank_conflicts"]} for w in warps.values()]
    return {"format": KERNEL_TRACE_FORMAT, "kernel": raw["kernel"], "source": _shown(_real_source(source, raw["source"])),
            "grid": raw["grid"], "block": raw["block"], "warp_size": 32, "buffers": buffers,
            "accesses": list(requests.values()), "warps": warp_rows}


def _bank_conflicts(spans):
    """Extra wavefronts of one shared request, spans [(lane, address, size)] (tracer.cpp's rule):
    phases of 32, 16 or 8 lanes by the access size, per phase the most distinct 4-byte words of one
    bank, minus one per active phase."""
    size = max(s for _, _, s in spans)
    phase = 8 if size > 8 else (16 if size > 4 else 32)
    extra = 0
    for p in range(0, 32, phase):
        words = {w for lane, addr, s in spans if p <= lane < p + phase
                 for w in range(addr >> 2, ((addr + s - 1) >> 2) + 1)}
        if words:
            banks = {}
            for w in words:
                banks[w % 32] = banks.get(w % 32, 0) + 1
            extra += max(banks.values()) - 1
    return extra


def _real_source(text, path):
    """The file a cached kernel source names in its leading #line directive, else the path itself."""
    match = re.match(r'#line 1 "([^"]+)"', text)
    return match.group(1) if match else path
