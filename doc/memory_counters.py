"""
doc/memory_counters.py: the numbers of doc/memory_counters.md, measured by the emulated device's
memory counters (llmc/emulator/memory.py): doc/transpose.cu's three transposes, and one launch of
the production layernorm_forward (kernels/layernorm.cu) at GPT-2's width.

What it is: each kernel compiled as a traced build and launched once on the emulated device; its
global loads and stores (sectors per request, share of the moved bytes used) and shared-memory
accesses (wavefronts per request, bank conflicts), as the tutorial quotes them. What it is not: a
GPU measurement (the counters count, they do not time).

Run:
    python doc/memory_counters.py     # prints every number the tutorial quotes (~20 s the first time)
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))      # the repository root
sys.path.insert(0, HERE)

import gpt2_cuda  # noqa: E402
from llmc import cuda  # noqa: E402
from llmc.emulator import memory  # noqa: E402
from tutorial import print_numbers  # noqa: E402

N = 64                      # the transposed matrix: 2 x 2 tiles of 32 x 32
LN_ROWS, LN_C = 16, 768     # layernorm_forward: 16 rows of GPT-2's width, bf16


def transpose_counters():
    """Each transpose once, traced: {kernel: (load, store, shared load) Counters}."""
    cp = cuda.cupy()
    with open(os.path.join(HERE, "transpose.cu")) as f:
        code = f'#line 1 "{os.path.join(HERE, "transpose.cu")}"\n' + f.read()
    inp = cp.asarray(np.arange(N * N, dtype=np.float32).reshape(N, N))
    counters = {}
    with memory.tracing():
        module = cp.RawModule(code=code, options=("-DENABLE_FP32",))
        for name in ("transpose_naive", "transpose_shared", "transpose_padded"):
            out = cp.zeros((N, N), np.float32)
            with memory.tracing() as report:
                module.get_function(name)((N // 32, N // 32), (32, 32), (out, inp, np.int32(N)))
            assert np.array_equal(out.get(), inp.get().T), name
            counters[name] = (report.kernel_counters(name, "global", "load"),
                              report.kernel_counters(name, "global", "store"),
                              report.kernel_counters(name, "shared", "load"))
    return counters


def layernorm_counters():
    """One launch of kernels/layernorm.cu's layernorm_forward (bf16, LN_ROWS rows of LN_C), traced.
    The inputs are bf16 zeros: the counters depend on the addresses, not on the values."""
    cp = cuda.cupy()
    with memory.tracing() as report:
        cuda.load_modules(["layernorm"], "bf16")
        inp = cp.zeros(LN_ROWS * LN_C, np.uint16)                     # floatX bf16 is uint16 bits
        weight, bias = cp.zeros(LN_C, np.uint16), cp.zeros(LN_C, np.uint16)
        out = cp.empty(LN_ROWS * LN_C, np.uint16)
        mean, rstd = cp.empty(LN_ROWS, np.float32), cp.empty(LN_ROWS, np.float32)
        gpt2_cuda.layernorm_forward(out, mean, rstd, inp, weight, bias, 1, LN_ROWS, LN_C)
    return report


QUOTED = {"naive": ("load_sectors", "store_sectors", "store_used"),
          "shared": ("load_sectors", "store_sectors", "store_used", "shared_wavefronts", "shared_conflicts",
                     "shared_requests"),
          "padded": ("load_sectors", "store_sectors", "shared_wavefronts", "shared_conflicts")}


def compute(fig_dir):
    """Run the kernels traced on the emulated device; return {key: formatted number} (no figures)."""
    previous = cuda.device()
    cuda.use_device("cpu")
    try:
        numbers = {}
        for name, (load, store, shared) in transpose_counters().items():
            key = name.removeprefix("transpose_")
            values = {"load_sectors": f"{load.sectors_per_request:.1f}",
                      "store_sectors": f"{store.sectors_per_request:.1f}", "store_used": f"{store.efficiency:.1%}",
                      "shared_wavefronts": f"{shared.wavefronts_per_request:.1f}",
                      "shared_conflicts": f"{shared.bank_conflicts:,}", "shared_requests": f"{shared.requests}"}
            numbers |= {f"{key}_{v}": values[v] for v in QUOTED[key]}
        load = layernorm_counters().kernel_counters("layernorm_forward", "global", "load")
        numbers |= {"ln_load_sectors": f"{load.sectors_per_request:.1f}", "ln_load_used": f"{load.efficiency:.0%}",
                    "ln_load_requests": f"{load.requests}"}
        return numbers
    finally:
        cuda.use_device(previous)


if __name__ == "__main__":
    print_numbers(compute)
