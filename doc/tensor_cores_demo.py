"""
doc/tensor_cores_demo.py: one call of dev/cuda/matmul.py's version 6 (mma.sync + ldmatrix) on the
emulated device, small enough to stop at an mma with gdb and read one lane's fragments
(doc/tensor_cores.md, section 7).

What it is: out (16, 8) = inp (16, 16) @ weight^T + bias through matmul.py's own launcher onto
dev/cuda/matmul.cu's matmul_forward_v6 compiled by g++ (llmc/emulator/). The inputs name their
place: inp[n, c] = n + c/16 (exact in bf16: 4 integer and 4 fraction bits), weight (8, 16) the
first 8 rows of the identity (so B = weight^T is the identity and out = inp[:, :8]), bias 0. It
prints rows 2 and 10 of out. What it is not: a test or a benchmark (tests/test_tensor_cores_doc.py
runs it under gdb and compares the output with the tutorial).

Run under gdb, with the kernel libraries built at -O0 so that every local can be printed:
    LLMC_EMULATOR_DEBUG=1 gdb -q -batch -x doc/tensor_cores_demo.gdb --args python doc/tensor_cores_demo.py
(`python` must be the interpreter itself, not a pyenv shim script: gdb runs the file it is given.)
Without gdb it only prints the last two lines:
    python doc/tensor_cores_demo.py
    out[2, :4]  [2.     2.0625 2.125  2.1875]
    out[10, :4] [10.     10.0625 10.125  10.1875]
"""

import os
import sys
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev", "cuda"))

import matmul  # noqa: E402  (dev/cuda/matmul.py)
from llmc import cuda  # noqa: E402
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits  # noqa: E402

N, C, OC = 16, 16, 8      # one m16n8k16 tile of out: warp 0's first mma computes all of it
PRECISION = "bf16"


def main():
    cuda.use_device("cpu")
    cp = cuda.cupy()
    rows, cols = np.meshgrid(np.arange(N), np.arange(C), indexing="ij")
    inp = rows + cols / 16.0                                     # inp[n, c] = n + c/16
    weight = np.eye(OC, C)                                       # B = weight^T: the identity
    d = types.SimpleNamespace(precision=PRECISION, N=N, C=C, OC=OC,
                              inp=cp.asarray(float32_to_bfloat16_bits(inp.astype(np.float32))),
                              weight=cp.asarray(float32_to_bfloat16_bits(weight.astype(np.float32))),
                              bias=cp.zeros(OC, np.uint16), out=cp.zeros((N, OC), np.uint16))
    matmul.forward_v6(d, matmul.V6_TILE.threads)
    out = bfloat16_bits_to_float32(d.out.get())
    print("out[2, :4] ", out[2, :4])
    print("out[10, :4]", out[10, :4])


if __name__ == "__main__":
    main()
