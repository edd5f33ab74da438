"""
llmc/debugger/kerneltrace.py: one kernel launch's memory accesses, thread by thread, for the
page's "a kernel's threads" view (--kernel-trace FILE).

The file (JSON, format "llmc-kernel-trace-1") describes one launch on the emulated device:
    {"format": "llmc-kernel-trace-1",
     "kernel": "layernorm_forward_kernel3", "source": "kernels/layernorm.cu",
     "grid": [gx, gy, gz], "block": [bx, by, bz], "warp_size": 32,
     "buffers":  [{"name": "inp", "space": "global" | "shared", "elements": N, "element_bytes": 4,
                   "row": 256}, ...],                  row: elements per row of its picture (optional)
     "accesses": [{"block": [x, y, z], "warp": w, "line": 41, "op": "read" | "write", "buffer": "inp",
                   "lanes": [0, 1, ...], "elements": [e0, e1, ...]}, ...],
                  one warp-level request: one instruction of one warp, each active lane's element
     "warps":    [{"block": [x, y, z], "warp": w, "requests": n, "sectors_per_request": s,
                   "bank_conflicts": k}, ...]}         the counters per warp (global sectors per
                                                       request; shared-memory extra wavefronts)
dev/kernel_trace.py writes it from the emulated device's memory counters (llmc/emulator/memory.py,
kernel_trace); the page draws each buffer's elements coloured by the thread that touched them, and
the warps' counters as a table.

What it is: the reader and checker of that file (a bad file is one error line at start-up).
What it is not: the recorder (dev/kernel_trace.py).
"""

import json

from llmc.utils import InputError

TRACE_FORMAT = "llmc-kernel-trace-1"
MAX_ACCESSES = 1 << 20                 # warp requests of one launch the page is sent
# what the page says without --kernel-trace
NO_TRACE = ("No kernel trace loaded. This view shows one launch's memory accesses, thread by thread, from a JSON "
            "file given with --kernel-trace FILE. Record one on the emulated device with, for example, "
            "python dev/kernel_trace.py layernorm_forward -o trace.json -- -e d2 -b 1 -t 32 -x 1 "
            "(format: doc/visual_debugger.md, 'A kernel's threads').")


class KernelTrace:
    """A checked kernel trace, or none (path None)."""

    def __init__(self, path=None):
        self.path, self.trace = path, None
        if path is None:
            return
        try:
            with open(path) as f:
                trace = json.load(f)
        except (OSError, ValueError) as e:
            raise InputError(f"--kernel-trace {path}: {type(e).__name__}: {e}") from None
        self.trace = check_trace(trace, path)

    def as_json(self):
        if self.trace is None:
            return {"loaded": False, "message": NO_TRACE}
        return {"loaded": True, "path": self.path, **self.trace}


def _is_int_list(v, n=None):
    return isinstance(v, list) and (n is None or len(v) == n) and all(isinstance(x, int) and x >= 0 for x in v)


def check_trace(t, path):
    """The trace t (parsed JSON) if it follows the format; InputError naming the first fault."""
    def fail(what):
        raise InputError(f"--kernel-trace {path}: {what}")
    if not isinstance(t, dict) or t.get("format") != TRACE_FORMAT:
        fail(f"not a kernel trace (format must be {TRACE_FORMAT!r})")
    for key in ("kernel", "source"):
        if not isinstance(t.get(key), str):
            fail(f"{key!r} must be a string")
    if not (_is_int_list(t.get("grid"), 3) and _is_int_list(t.get("block"), 3)):
        fail("grid and block must be three non-negative integers each")
    if not isinstance(t.get("warp_size", 32), int):
        fail("warp_size must be an integer")
    buffers = t.get("buffers")
    if not isinstance(buffers, list) or not buffers:
        fail("buffers must be a non-empty list")
    sizes = {}
    for b in buffers:
        if not (isinstance(b, dict) and isinstance(b.get("name"), str) and b.get("space") in ("global", "shared")
                and isinstance(b.get("elements"), int) and b["elements"] > 0):
            fail(f"bad buffer {str(b)[:80]}: needs name, space global|shared and elements > 0")
        sizes[b["name"]] = b["elements"]
    accesses = t.get("accesses")
    if not isinstance(accesses, list) or len(accesses) > MAX_ACCESSES:
        fail(f"accesses must be a list of at most {MAX_ACCESSES} warp requests")
    for i, a in enumerate(accesses):
        if not (isinstance(a, dict) and _is_int_list(a.get("block"), 3) and isinstance(a.get("warp"), int)
                and a.get("op") in ("read", "write") and a.get("buffer") in sizes
                and _is_int_list(a.get("lanes")) and _is_int_list(a.get("elements"))
                and len(a["lanes"]) == len(a["elements"]) and isinstance(a.get("line", 0), int)):
            fail(f"access {i} is malformed (block, warp, line, op read|write, a known buffer, lanes and elements "
                 f"of equal length)")
        if any(e >= sizes[a["buffer"]] for e in a["elements"]):
            fail(f"access {i} reads past buffer {a['buffer']!r} ({sizes[a['buffer']]} elements)")
    warps = t.get("warps", [])
    if not isinstance(warps, list) or not all(isinstance(w, dict) and _is_int_list(w.get("block"), 3)
                                              and isinstance(w.get("warp"), int) for w in warps):
        fail("warps must be a list of {block, warp, requests, sectors_per_request, bank_conflicts}")
    return t
