"""
dev/cuda/common.py: the harness every kernel progression in dev/cuda/ shares (llm.c's
dev/cuda/common.h, in Python). A progression is one op's kernels from a naive port of its
gpt2_cpu.py layer to the production kernel of kernels/; this module validates every version and
block size against gpt2_cpu.py, then times them and prints (and saves) one table per op.

What it deliberately is not: a test framework or an autotuner. It measures and prints; tests
(tests/test_dev_cuda.py) call its validation, and nothing here changes what gpt2_cuda.py launches.

The API (what an op script dev/cuda/<op>.py uses; tests/test_dev_cuda.py lists the scripts):

    Kernel(path, name)                  one extern "C" kernel of a .cu file (repo-relative path);
      dev_kernel(op, name)              ... of dev/cuda/<op>.cu (an intermediate version)
      production_kernel(file, name)     ... of kernels/<file>.cu (the trainer's, by its real name)
      kernel.launch(precision, grid, block, args, shared_mem=0)
    Case(precision)                     one problem instance, built by a progression's make_case:
      case.input(name, values, kind)    host values -> uploaded (kind "X" floatX, "f32", "i32", "i64", "u32")
                                        before every validation run; returns what the kernel
                                        sees, in float64, for the reference
      case.output(name, shape, kind)    allocated, and poisoned with NaN before every run
      case.scratch(name, shape, kind)   allocated, never checked (atomics accumulators, slots)
      case.scalar(name, value)          a Python number the launch functions read
      case.check(name, ref, tolerance, scale=1.0)
                                        after the run, array `name` must match `ref` within
                                        TOLERANCES["kernel_<p>"][tolerance] (atol * scale), where
                                        p is the run's precision for floatX arrays, fp32 for
                                        float32 ones
      case.bytes, case.flops            the napkin math: the op's minimum DRAM traffic (the same
                                        numerator for every version, so GB/s ranks versions like
                                        time does) and its FLOPs (0: memory-bound, no FLOP column)
    Version(number, about, kernels, launch, block_sizes)
                                        launch(d, block_size) enqueues the version, reading the
                                        case's device arrays and scalars as attributes of d
    Progression(name, make_case, versions, sizes, test_sizes)
                                        make_case(rng, precision, **sizes) -> Case
    main(op, progressions, argv)        the command line every script ends with
    validate(progression, precision, sizes, versions=None) -> bool    (GPU tests call it)

Napkin helpers, pure host (tested without a GPU): napkin_bytes, gemm_flops, throughput,
tolerance, format_table.

How a run goes (per progression, one precision):
1. make_case draws fresh random inputs (fixed seed) and computes the reference with gpt2_cpu.py
   in float64 on the floatX-rounded inputs.
2. Validation: for every version and block size, the inputs are uploaded again from the host
   copy (in-place and accumulating kernels start from the same values), every output is poisoned
   with NaN (an element a kernel forgets to write stays NaN and fails), the version runs, every
   check is compared (llmc.check.check_tensor). Any failure: its detail is printed and the script
   exits 1 before timing anything (a wrong kernel's time means nothing).
3. Limits, measured in the same run: DRAM bandwidth from a large device-to-device copy (bytes
   read + written / time), and, for progressions that count FLOPs, a large cuBLAS GEMM
   (llmc.cuda.gemm) in the run's precision.
4. Timing: WARMUP_RUNS untimed launches, then `repeats` timed ones, each after an L2 flush (a
   memset of a buffer L2_FLUSH_FACTOR times the L2 size, so every version starts from DRAM); CUDA
   events around the launch only, the median is reported. The flush also gives the Python launch
   calls time to queue the kernels while it runs. Timed runs do not restore the inputs: in-place
   kernels then run on their own output, which costs the same.
5. One table per progression: version, kernel, block size, time, GB/s, % of the copy
   bandwidth (and TFLOP/s, % of the GEMM when FLOPs are counted); printed, and (when every version
   ran) written with the date, device, CuPy and CUDA versions to dev/results/dev_cuda_<op>.md.

Run an op (without a CUDA GPU or CuPy it says so in one line and exits 2):
    python dev/cuda/layernorm.py          # every version, bf16
    python dev/cuda/layernorm.py 2 -p fp32
    python dev/cuda/run_all.py            # every op (make dev-cuda)
"""

import argparse
import contextlib
import dataclasses
import datetime
import os
import sys
import types
from collections.abc import Callable

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from llmc import cuda  # noqa: E402  (imports CuPy only when called)
from llmc.check import TOLERANCES, check_tensor  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.formats import BF16_QUIET_NAN, bfloat16_bits_to_float32, float32_to_bfloat16_bits  # noqa: E402

# ----------------------------------------------------------------------------
# constants

RESULTS_DIR = os.path.join(REPO_ROOT, "dev", "results")
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)      # llm.c's sweep; warp kernels need multiples of 32
WARMUP_RUNS = 2                                  # untimed: module load, first-touch of the pages
DEFAULT_REPEATS = 20                             # timed runs per (version, block size); median
L2_FLUSH_FACTOR = 2                              # flush buffer = 2 x L2: every line is evicted
BANDWIDTH_COPY_BYTES = 1 << 30                   # 1 GiB device-to-device copy for the DRAM limit
GEMM_LIMIT_SIZE = 8192                           # (8192 x 8192) @ (8192 x 8192) for the FLOP limit
LIMIT_REPEATS = 5                                # the limits take the best of these
SEED = 1337                                      # inputs are reproducible run to run
NO_GPU_EXIT = 2
KINDS = {"X": None, "f32": np.dtype(np.float32), "f64": np.dtype(np.float64), "i32": np.dtype(np.int32),  # X: floatX
         "i64": np.dtype(np.int64), "u32": np.dtype(np.uint32)}   # tables and seeds (adamw)
INTEGER_KINDS = ("i32", "i64", "u32")


# ----------------------------------------------------------------------------
# kernels, versions, progressions

@dataclasses.dataclass(frozen=True)
class Kernel:
    """One extern "C" kernel: the .cu file (path relative to the repository root) and its name."""
    path: str
    name: str

    def launch(self, precision, grid, block, args, shared_mem=0):
        """Launch on the current stream. grid: int or tuple; block: threads per block; args: CuPy
        arrays and NumPy scalars typed as the C signature (CuPy does not check them)."""
        grid = grid if isinstance(grid, tuple) else (grid,)
        load_function(self, precision)(grid, (block,), args, shared_mem=shared_mem)


def dev_kernel(op, name):
    """A kernel of dev/cuda/<op>.cu: an intermediate version."""
    return Kernel(f"dev/cuda/{op}.cu", name)


def production_kernel(file, name):
    """A kernel of kernels/<file>.cu, the one gpt2_cuda.py launches: the production version's."""
    return Kernel(f"kernels/{file}.cu", name)


def is_candidate(version):
    """Whether a version comes after the production one: a faster kernel proposed for production
    and not yet adopted (its about starts with "candidate:"), timed beside the one it would replace."""
    return version.about.startswith("candidate:")


def production_version(progression):
    """The version the trainers launch: the last one that is not a candidate."""
    return [v for v in progression.versions if not is_candidate(v)][-1]


@dataclasses.dataclass
class Version:
    """Version `number` of a progression. about: what it changes and why that is faster;
    kernels: every Kernel its launch uses; launch(d, block_size): enqueue it (d holds the case's
    device arrays and scalars as attributes, and d.precision). drop_in: a candidate whose kernels
    (as many as the production version's, in its order) each take the production kernel's
    arguments, grid, block and shared memory as they are, so that dev/bench.py --candidate can
    launch them in the trainer's place and time the whole step."""
    number: int
    about: str
    kernels: tuple
    launch: Callable
    block_sizes: tuple = BLOCK_SIZES
    drop_in: bool = False


@dataclasses.dataclass
class Progression:
    """One op's versions. make_case(rng, precision, **sizes) -> Case; sizes: the benchmark
    problem (GPT-2 124M shapes); test_sizes: a small, awkward problem for the GPU tests."""
    name: str
    make_case: Callable
    versions: list
    sizes: dict
    test_sizes: dict


# ----------------------------------------------------------------------------
# host side: precision, tolerances, napkin math, tables (no GPU needed)

def itemsize(kind, precision):
    """Bytes per element of an array kind: "X" floatX (2 in bf16, 4 in fp32), "f32", "f64", "i32"."""
    return cuda.FLOATX_DTYPES[precision].itemsize if kind == "X" else KINDS[kind].itemsize


def dtype_of(kind, precision):
    """The NumPy/CuPy dtype of an array kind (floatX bf16 is uint16 bits)."""
    return cuda.FLOATX_DTYPES[precision] if kind == "X" else KINDS[kind]


def to_device_dtype(values, kind, precision):
    """Host values -> a host array in the device dtype (bf16: rounded to nearest even bits)."""
    if kind in INTEGER_KINDS:
        return np.ascontiguousarray(values, dtype=KINDS[kind])
    x = np.ascontiguousarray(values, dtype=np.float32)
    return float32_to_bfloat16_bits(x) if kind == "X" and precision == "bf16" else x


def to_float64(host, kind, precision):
    """A host array in the device dtype -> float64 values (bf16 bits decoded)."""
    if kind == "X" and precision == "bf16":
        return bfloat16_bits_to_float32(host).astype(np.float64)
    return np.asarray(host, dtype=np.float64)


def tolerance(key, precision, scale=1.0):
    """(atol, rtol) of TOLERANCES["kernel_<precision>"][key], atol times scale (for outputs that
    are a known factor times an O(1) quantity, e.g. dlogits = dloss * (p - onehot))."""
    atol, rtol = TOLERANCES[f"kernel_{precision}"][key]
    return atol * scale, rtol


def napkin_bytes(precision, floatX=0, float32=0, int32=0):
    """Bytes an op must move at least: element counts of each kind read or written (count an
    array twice if it is read and written) times their sizes."""
    return floatX * itemsize("X", precision) + 4 * float32 + 4 * int32


def gemm_flops(m, n, k):
    """FLOPs of an (m,k) @ (k,n) product: one multiply and one add per term."""
    return 2 * m * n * k


def throughput(amount, ms):
    """amount (bytes or FLOPs) per millisecond -> per second, in units of 1e9 (GB/s, GFLOP/s)."""
    return amount / (ms * 1e-3) / 1e9


@dataclasses.dataclass
class Timing:
    """One row of a table: median time of `version` at `block_size`."""
    version: int
    kernel: str
    block_size: int
    ms: float


def format_table(title, timings, bytes_moved, bandwidth_gbs, flops=0, gemm_tflops=None):
    """A Markdown table: version, kernel, block, time (ms), GB/s, % of the measured copy
    bandwidth, and TFLOP/s, % of the measured GEMM when flops > 0. Returns the text."""
    header = ["version", "kernel", "block", "time (ms)", "GB/s", "% of copy BW"]
    if flops:
        header += ["TFLOP/s", "% of GEMM"]
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for t in timings:
        gbs = throughput(bytes_moved, t.ms)
        cells = [str(t.version), t.kernel, str(t.block_size), f"{t.ms:.4f}", f"{gbs:.1f}",
                 f"{100 * gbs / bandwidth_gbs:.1f}"]
        if flops:
            tflops = throughput(flops, t.ms) / 1e3
            cells += [f"{tflops:.2f}", f"{100 * tflops / gemm_tflops:.1f}" if gemm_tflops else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------
# a problem instance

class Case:
    """The arrays of one problem instance (see the module docstring for the methods)."""

    def __init__(self, precision):
        self.precision = precision
        self.inputs = {}          # name -> (host array in the device dtype, kind)
        self.outputs = {}         # name -> (shape, kind), poisoned before every run
        self.scratches = {}       # name -> (shape, kind), left as they are
        self.scalars = {}
        self.checks = []          # (name, float64 reference, tolerance key, atol scale)
        self.bytes = 0
        self.flops = 0

    def input(self, name, values, kind="X"):
        host = to_device_dtype(values, kind, self.precision)
        self.inputs[name] = (host, kind)
        return host if kind in INTEGER_KINDS else to_float64(host, kind, self.precision)

    def output(self, name, shape, kind="X"):
        self.outputs[name] = (tuple(np.atleast_1d(shape)), kind)

    def scratch(self, name, shape, kind="f32"):
        self.scratches[name] = (tuple(np.atleast_1d(shape)), kind)

    def scalar(self, name, value):
        self.scalars[name] = value

    def check(self, name, ref, key, scale=1.0):
        self.checks.append((name, np.asarray(ref, dtype=np.float64), key, scale))

    def kind_of(self, name):
        if name in self.inputs:
            return self.inputs[name][1]
        return self.outputs[name][1] if name in self.outputs else self.scratches[name][1]


# ----------------------------------------------------------------------------
# device side: modules, buffers

_FUNCTIONS = {}          # (device, path, precision, name) -> cupy.RawKernel


def load_function(kernel, precision):
    """The compiled kernel (each file compiled once per process, device and precision, with the
    trainer's options, llmc.cuda.kernel_compile_options; CuPy also caches it on disk, the emulated
    device, llmc.cuda.use_device("cpu"), its g++ build)."""
    key = (cuda.device(), kernel.path, precision, cuda.build_variant(), kernel.name)
    if key not in _FUNCTIONS:
        directory, file = os.path.split(kernel.path)
        if directory == "kernels":                   # the trainer's own module and cache
            module = cuda.load_module(file[:-len(".cu")], precision)
        else:
            cp = cuda.cupy()
            path = os.path.join(REPO_ROOT, kernel.path)
            with open(path, encoding="utf-8") as f:
                code = f.read()
            if cuda.device() == "cpu":               # g++'s messages and gdb's breakpoints name the real file
                code = f'#line 1 "{path}"\n' + code
            module = cp.RawModule(code=code, options=cuda.kernel_compile_options(precision))
            try:
                module.compile()
            except cp.cuda.compiler.CompileException as e:
                compiler = "g++ (the emulated device)" if cuda.device() == "cpu" else "NVRTC"
                raise cuda.KernelCompileError(f"{kernel.path}: {compiler} failed ({precision}):\n"
                                              f"{e.get_message()}") from None
        _FUNCTIONS[key] = module.get_function(kernel.name)
    return _FUNCTIONS[key]


def allocate(case):
    """Device arrays for every input, output and scratch of the case: a namespace d with one
    attribute per array and per scalar, plus d.precision."""
    cp = cuda.cupy()
    d = types.SimpleNamespace(precision=case.precision, **case.scalars)
    for name, (host, _) in case.inputs.items():
        setattr(d, name, cp.asarray(host))
    for name, (shape, kind) in {**case.outputs, **case.scratches}.items():
        setattr(d, name, cp.zeros(shape, dtype_of(kind, case.precision)))
    return d


def reset(case, d):
    """Before a validation run: inputs back to the host values, outputs poisoned with NaN."""
    for name, (host, _) in case.inputs.items():
        getattr(d, name).set(host)
    for name, (_, kind) in case.outputs.items():
        nan = BF16_QUIET_NAN if kind == "X" and case.precision == "bf16" else np.nan
        getattr(d, name).fill(nan)


# ----------------------------------------------------------------------------
# validation

def check_case(case, d, label):
    """Compare every check of the case with the device array. Prints one line with the largest
    differences; on failure check_tensor's detail too. Returns True/False."""
    ok, summary = True, []
    for name, ref, key, scale in case.checks:
        kind = case.kind_of(name)
        group = case.precision if kind == "X" else "fp32"
        atol, rtol = tolerance(key, group, scale)
        got = to_float64(getattr(d, name).get(), kind, case.precision).reshape(ref.shape)
        if check_tensor(got, ref, f"{label} {name}", atol, rtol, verbose=False):
            summary.append(f"{name} {np.abs(got - ref).max():.1e}")
        else:
            ok = False
            check_tensor(got, ref, f"{label} {name}", atol, rtol, verbose=True)
    print(f"{label}: {'OK' if ok else 'FAILED'}  (max |diff|: {', '.join(summary) or '-'})")
    return ok


def validate(progression, precision, sizes, versions=None, case=None, d=None):
    """Run every (version, block size) once on fresh inputs and check it against gpt2_cpu.py.
    versions: the version numbers to run (default all). Returns True when all pass."""
    if case is None:
        case = progression.make_case(np.random.default_rng(SEED), precision, **sizes)
        d = allocate(case)
    ok = True
    for version in selected(progression, versions):
        for block_size in version.block_sizes:
            reset(case, d)
            version.launch(d, block_size)
            cuda.cupy().cuda.get_current_stream().synchronize()
            ok &= check_case(case, d, f"{progression.name} v{version.number} block {block_size:4d}")
    return ok


def selected(progression, versions):
    """The progression's versions whose number is in `versions` (all when None)."""
    return [v for v in progression.versions if versions is None or v.number in versions]


# ----------------------------------------------------------------------------
# timing and the device's limits

def time_ms(launch, flush, repeats):
    """Median milliseconds of launch() over `repeats` runs after WARMUP_RUNS, each run after
    flush() (the L2 flush), measured with CUDA events around launch() only."""
    cp = cuda.cupy()
    for _ in range(WARMUP_RUNS):
        launch()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        flush()
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def l2_flush(device_props):
    """A function that overwrites a buffer L2_FLUSH_FACTOR times the L2 size (cudaMemsetAsync)."""
    cp = cuda.cupy()
    nbytes = L2_FLUSH_FACTOR * max(int(device_props["l2CacheSize"]), 1 << 20)
    buffer = cp.empty(nbytes, np.uint8)
    stream = cp.cuda.get_current_stream()
    return lambda: cp.cuda.runtime.memsetAsync(buffer.data.ptr, 0, nbytes, stream.ptr)


def measure_bandwidth():
    """Best GB/s of a BANDWIDTH_COPY_BYTES device-to-device copy, counting read + write."""
    cp = cuda.cupy()
    src, dst = cp.ones(BANDWIDTH_COPY_BYTES, np.uint8), cp.empty(BANDWIDTH_COPY_BYTES, np.uint8)
    stream = cp.cuda.get_current_stream()

    def copy():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, BANDWIDTH_COPY_BYTES,
                                    cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)
    best = min(time_ms(copy, lambda: None, 1) for _ in range(LIMIT_REPEATS))
    return throughput(2 * BANDWIDTH_COPY_BYTES, best)


def measure_gemm_tflops(precision):
    """Best TFLOP/s of a GEMM_LIMIT_SIZE^3 cuBLAS GEMM in `precision` (library call)."""
    cp = cuda.cupy()
    n = GEMM_LIMIT_SIZE
    one = to_device_dtype(np.ones(1), "X", precision)[0]
    A, B = cp.full((n, n), one, dtype_of("X", precision)), cp.full((n, n), one, dtype_of("X", precision))
    C = cp.empty((n, n), dtype_of("X", precision))

    def gemm():
        cuda.gemm(cuda.CUBLAS_OP_N, cuda.CUBLAS_OP_N, n, n, n, A, n, B, n, C, n)
    best = min(time_ms(gemm, lambda: None, 1) for _ in range(LIMIT_REPEATS))
    return throughput(gemm_flops(n, n, n), best) / 1e3


def device_description():
    """(device properties, one line: device, SMs, L2, driver, CuPy and CUDA runtime versions)."""
    cp = cuda.cupy()
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    runtime, driver = cp.cuda.runtime.runtimeGetVersion(), cp.cuda.runtime.driverGetVersion()
    line = (f"{name}, {props['multiProcessorCount']} SMs, L2 {props['l2CacheSize'] / 2**20:.0f} MiB; "
            f"CuPy {cp.__version__}, CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}, "
            f"driver API {driver // 1000}.{driver % 1000 // 10}")
    return props, line


def benchmark(progression, precision, versions, repeats, flush, limits):
    """Validate, then time, one progression. Returns the table's text, or None if validation
    failed. limits: {"bandwidth": GB/s, "gemm": TFLOP/s or None}, filled on first need."""
    case = progression.make_case(np.random.default_rng(SEED), precision, **progression.sizes)
    d = allocate(case)
    print(f"\n== {progression.name} [{precision}] {progression.sizes}: validating")
    if not validate(progression, precision, progression.sizes, versions, case, d):
        return None
    if case.flops and limits.get("gemm") is None:
        limits["gemm"] = measure_gemm_tflops(precision)
    timings = []
    for version in selected(progression, versions):
        for block_size in version.block_sizes:
            ms = time_ms(lambda: version.launch(d, block_size), flush, repeats)
            timings.append(Timing(version.number, version.kernels[0].name, block_size, ms))
    table = format_table(f"{progression.name} [{precision}], {progression.sizes}", timings, case.bytes,
                         limits["bandwidth"], case.flops, limits.get("gemm"))
    print(table)
    return table


# ----------------------------------------------------------------------------
# the command line of every dev/cuda/<op>.py

def parse_args(op, progressions, argv):
    """The flags of every op script; --help lists each version's one-line summary."""
    lines = [f"version {v.number} of {p.name}: {v.about}" for p in progressions for v in p.versions]
    parser = ArgumentParser(prog=f"dev/cuda/{op}.py", description=f"kernel progression(s) of {op}",
                                     epilog="\n".join(lines), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("version", nargs="?", type=int, help="run only this version (default: all)")
    parser.add_argument("-p", "--precision", default="bf16", choices=cuda.PRECISIONS,
                        help="storage precision (default bf16)")
    parser.add_argument("-r", "--repeats", type=int, default=DEFAULT_REPEATS,
                        help=f"timed runs per version and block size (default {DEFAULT_REPEATS})")
    parser.add_argument("-o", "--output-dir", default=RESULTS_DIR,
                        help="where dev_cuda_<op>.md goes (default dev/results)")
    parser.add_argument("-d", "--device", default="cuda", choices=cuda.DEVICES,
                        help="cuda: validate, then time on a GPU (default); cpu: validate every version on the "
                             "emulated device at the progression's small test size (no timing: it is a CPU)")
    parser.add_argument("--memory", action="store_true",
                        help="with --device cpu: print each version's memory counters (global sectors per request, "
                             "shared-memory bank conflicts, as Nsight Compute defines them: llmc/emulator/memory.py)")
    return parser.parse_args(argv)


def results_header(op, precision, description, limits):
    """The results file's opening lines: what ran, when, where, against which limits."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# dev/cuda/{op}.py [{precision}]", "", f"- date: {now}", f"- device: {description}",
             f"- measured copy bandwidth: {limits['bandwidth']:.1f} GB/s (device-to-device, read + write)"]
    if limits.get("gemm"):
        lines.append(f"- measured GEMM: {limits['gemm']:.1f} TFLOP/s (cuBLAS, {GEMM_LIMIT_SIZE}^3, {precision})")
    lines.append("- time: median of the timed runs, each after an L2 flush; GB/s counts each op's minimum traffic")
    return "\n".join(lines) + "\n"


def shown_path(path):
    """How a written file is named to the reader: relative to the repository when inside it
    (dev/results/dev_cuda_gelu.md), else absolute ($OUT on the device machine, not ../../root/out)."""
    path = os.path.abspath(path)
    return os.path.relpath(path, REPO_ROOT) if path.startswith(REPO_ROOT + os.sep) else path


def validate_emulated(op, progressions, precision, versions, memory_counters=False):
    """--device cpu: every selected version of every progression validated on the emulated device
    (llmc/emulator/: the very kernel sources, compiled by g++) at the progression's test sizes;
    with memory_counters (--memory), each version's memory counters after its validation lines
    (llmc/emulator/memory.py). Returns 0 when all pass, 1 otherwise (2 without a C++ compiler)."""
    cuda.use_device("cpu")
    reason = cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/cuda/{op}.py: the emulated device cannot run ({reason})", file=sys.stderr)
        return NO_GPU_EXIT
    from llmc.emulator import memory             # the emulated device's counters (its kernels are traced builds)
    ok = True
    with memory.tracing() if memory_counters else contextlib.nullcontext():
        for progression in progressions:
            if not selected(progression, versions):
                continue
            print(f"== {progression.name} [{precision}] {progression.test_sizes} on the emulated device: validating")
            for version in selected(progression, versions):
                with memory.tracing() if memory_counters else contextlib.nullcontext() as report:
                    ok &= validate(progression, precision, progression.test_sizes, {version.number})
                if memory_counters:
                    print(memory_summary(version, report))
    print(f"dev/cuda/{op}.py: every version {'validated' if ok else 'did NOT validate'} on the emulated device "
          "(times need a GPU: run without --device cpu there)")
    return 0 if ok else 1


def memory_summary(version, report):
    """The lines --memory prints after a version's validation: per kernel, its global loads and
    stores (sectors per request, share of the moved bytes used) and shared memory (wavefronts per
    request, bank conflicts), then its worst line."""
    if not report.launches:
        return f"   v{version.number} memory: no kernel of ours ran (a library call)"
    lines = []
    for kernel in sorted(report.launches):
        parts = []
        for access in ("load", "store"):
            c = report.kernel_counters(kernel, "global", access)
            if c.requests:
                parts.append(f"global {access}s {c.sectors_per_request:.1f} sectors/request ({c.efficiency:.0%} used)")
        shared = report.kernel_counters(kernel, "shared", "load")
        shared.add(report.kernel_counters(kernel, "shared", "store"))
        if shared.requests:
            parts.append(f"shared {shared.wavefronts_per_request:.2f} wavefronts/request "
                         f"({shared.bank_conflicts} bank conflicts)")
        lines.append(f"   v{version.number} memory, {kernel}: " + "; ".join(parts or ["no memory access counted"]))
        lines += [f"      worst: {memory_line(site, c)}" for site, c, _ in report.worst_lines(kernel, 1)]
    return "\n".join(lines)


def memory_line(site, c):
    """A worst line, without the kernel's name (it heads the line above)."""
    if site.space == "global":
        return (f"{site.line} global {site.access}: {c.sectors_per_request:.1f} sectors/request, "
                f"{c.efficiency:.0%} of the moved bytes used")
    return f"{site.line} shared {site.access}: {c.wavefronts_per_request:.2f} wavefronts/request, {c.bank_conflicts} conflicts"


def main(op, progressions, argv=None):
    """Validate and time every progression of dev/cuda/<op>.py. Returns the exit status: 0; 1 a
    version failed validation or does not exist; 2 no CUDA GPU (one line, no traceback)."""
    args = parse_args(op, progressions, argv)
    numbers = {v.number for p in progressions for v in p.versions}
    if args.version is not None and args.version not in numbers:
        print(f"dev/cuda/{op}.py: no version {args.version} (versions: {sorted(numbers)})", file=sys.stderr)
        return 1
    versions = None if args.version is None else {args.version}
    if args.memory and args.device != "cpu":
        print(f"dev/cuda/{op}.py: --memory counts on the emulated device: add --device cpu "
              "(on a GPU, Nsight Compute's ncu counts them)", file=sys.stderr)
        return 1
    if args.device == "cpu":
        return validate_emulated(op, progressions, args.precision, versions, args.memory)
    reason = cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/cuda/{op}.py: no CUDA GPU found ({reason}); nothing to run "
              f"(--device cpu validates every version on the emulated device; "
              f"python dev/cuda/nvrtc_compile.py dev/cuda/{op}.cu compiles it)", file=sys.stderr)
        return NO_GPU_EXIT
    props, description = device_description()
    print(f"dev/cuda/{op}.py on {description}")
    limits = {"bandwidth": measure_bandwidth()}
    print(f"measured copy bandwidth: {limits['bandwidth']:.1f} GB/s")
    flush = l2_flush(props)
    tables = []
    for progression in progressions:
        if not selected(progression, versions):
            continue
        table = benchmark(progression, args.precision, versions, args.repeats, flush, limits)
        if table is None:
            print(f"dev/cuda/{op}.py: {progression.name} failed validation; nothing timed", file=sys.stderr)
            return 1
        tables.append(table)
    if versions is None:
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, f"dev_cuda_{op}.md")
        with open(path, "w", encoding="utf-8") as f:
            f.write(results_header(op, args.precision, description, limits) + "\n" + "\n".join(tables))
        print(f"wrote {shown_path(path)}")
    return 0

