"""
doc/layernorm_demo.py: one call of gpt2_cuda.layernorm_forward on the emulated device, small
enough to stop inside the kernel with gdb (doc/from_numpy_to_cuda.md, section 6).

What it is: 4 rows of C = 64 random inputs (seed 0), weight 1 and bias 0, launched through the
real launcher onto kernels/layernorm.cu compiled by g++ (llmc/emulator/); it prints the rstd the
kernel wrote, one value per row. What it is not: a test or a benchmark (tests/test_gdb_walkthrough.py
runs it under gdb and compares the output with the tutorial).

Run under gdb, with the kernel libraries built at -O0 so that every local can be printed:
    LLMC_EMULATOR_DEBUG=1 gdb -q -batch -x doc/layernorm_demo.gdb --args python doc/layernorm_demo.py
(`python` must be the interpreter itself, not a pyenv shim script: gdb runs the file it is given.)
Without gdb it only prints the last line:
    python doc/layernorm_demo.py
    rstd [[...]]
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

import gpt2_cuda  # noqa: E402
from llmc import cuda  # noqa: E402

B, T, C = 1, 4, 64        # 4 rows: one warp per row, so thread 37 is lane 5 of warp 1, row 1
SEED = 0


def main():
    cuda.use_device("cpu")
    cp = cuda.cupy()
    inp_host = np.random.default_rng(SEED).standard_normal((B, T, C)).astype(np.float32)
    inp = cp.asarray(inp_host)
    weight = cp.ones(C, dtype=cp.float32)
    bias = cp.zeros(C, dtype=cp.float32)
    out = cp.empty((B, T, C), dtype=cp.float32)
    mean = cp.empty((B, T), dtype=cp.float32)
    rstd = cp.empty((B, T), dtype=cp.float32)
    cuda.load_modules(["layernorm"], "fp32")
    gpt2_cuda.layernorm_forward(out, mean, rstd, inp, weight, bias, B, T, C)
    print("rstd", rstd.get())


if __name__ == "__main__":
    main()
