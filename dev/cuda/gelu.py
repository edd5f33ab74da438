"""
dev/cuda/gelu.py: GELU forward and backward, from a naive port to kernels/gelu.cu.

gelu_forward, out = gelu(inp) over n = B*T*4C values (the MLP's hidden layer):
  version 1 (dev/cuda/gelu.cu gelu_forward_v1) is the naive port of gpt2_cpu.gelu_forward: one
            thread per element, one scalar load and store each.
  version 2 (kernels/gelu.cu gelu_forward, the production kernel) loads and stores 16 bytes per
            thread (x128: 8 bf16 or 4 floats) in a grid-stride loop, with the streaming hint on
            the input it reads once. Faster because each memory instruction moves 4-8x more bytes,
            so far fewer instructions (and fewer warps) keep the same bytes in flight. It can also
            add the bias of the matmul that wrote inp into inp first (gpt2_cuda's MLP does; here
            NULL, the math of version 1).
gelu_backward, d = d * gelu'(inp), in place on the incoming gradient:
  version 1 (gelu_backward_v1) naive port of gpt2_cpu.gelu_backward, one thread per element;
  version 2 (kernels/gelu.cu gelu_backward_inplace) the same x128 rewrite.

Napkin math: forward reads n and writes n floatX values; backward reads 2n and writes n. Both
are memory-bound (a tanh per element is cheap next to 2-3 bytes x 3 per element of traffic).

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/gelu.py          # both progressions, every version, bf16
    python dev/cuda/gelu.py 1 -p fp32
prints a validation line per (version, block size), then a table per progression, written to
dev/results/dev_cuda_gelu.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
from llmc.cuda import ceil_div, elementwise_grid, vector_size  # noqa: E402

OP = "gelu"
GELU_FORWARD_V1 = dev_kernel(OP, "gelu_forward_v1")
GELU_BACKWARD_V1 = dev_kernel(OP, "gelu_backward_v1")
GELU_FORWARD = production_kernel("gelu", "gelu_forward")
GELU_BACKWARD = production_kernel("gelu", "gelu_backward_inplace")


# ----------------------------------------------------------------------------
# problems: inputs, references from gpt2_cpu.py

def make_forward_case(rng, precision, B, T, C):
    """inp (B,T,4C) ~ N(0,1) -> out = gpt2_cpu.gelu_forward(inp)."""
    n = B * T * 4 * C
    case = common.Case(precision)
    case.scalar("n", n)
    x = case.input("inp", rng.standard_normal(n))
    case.output("out", n)
    case.check("out", gpt2_cpu.gelu_forward(x), "gelu")
    case.bytes = common.napkin_bytes(precision, floatX=2 * n)          # read inp, write out
    return case


def make_backward_case(rng, precision, B, T, C):
    """dout, inp (B,T,4C) -> d_in_out = gpt2_cpu.gelu_backward(dout, inp), in place."""
    n = B * T * 4 * C
    case = common.Case(precision)
    case.scalar("n", n)
    x = case.input("inp", rng.standard_normal(n))
    dout = case.input("d_in_out", rng.standard_normal(n))
    case.check("d_in_out", gpt2_cpu.gelu_backward(dout, x), "gelu")
    case.bytes = common.napkin_bytes(precision, floatX=3 * n)          # read inp, d; write d
    return case


# ----------------------------------------------------------------------------
# launchers: grids as gpt2_cuda.py computes them

def forward_v1(d, block_size):
    GELU_FORWARD_V1.launch(d.precision, ceil_div(d.n, block_size), block_size, (d.out, d.inp, np.int32(d.n)))


def forward_v2(d, block_size):
    grid = elementwise_grid(ceil_div(d.n, vector_size(d.precision)), block_size)   # llmc.matmul.gelu_forward
    GELU_FORWARD.launch(d.precision, grid, block_size,           # NULL inp_bias: no matmul bias to fold
                        (d.out, d.inp, np.uint64(0), np.uint64(d.n), np.int32(0)))


def backward_v1(d, block_size):
    GELU_BACKWARD_V1.launch(d.precision, ceil_div(d.n, block_size), block_size, (d.d_in_out, d.inp, np.int32(d.n)))


def backward_v2(d, block_size):
    grid = elementwise_grid(ceil_div(d.n, vector_size(d.precision)), block_size)
    GELU_BACKWARD.launch(d.precision, grid, block_size, (d.d_in_out, d.inp, np.uint64(d.n)))


SIZES = dict(B=8, T=1024, C=768)                 # GPT-2 124M's MLP: n = 25,165,824
TEST_SIZES = dict(B=1, T=3, C=37)                # n = 444: not a multiple of 8, exercises the tail
PROGRESSIONS = [
    Progression("gelu_forward", make_forward_case, [
        Version(1, "naive port, one thread per element, scalar loads", (GELU_FORWARD_V1,), forward_v1),
        Version(2, "production: x128 loads/stores, grid-stride, streaming hint", (GELU_FORWARD,), forward_v2),
    ], SIZES, TEST_SIZES),
    Progression("gelu_backward", make_backward_case, [
        Version(1, "naive port, one thread per element, scalar loads", (GELU_BACKWARD_V1,), backward_v1),
        Version(2, "production: x128 loads/stores, grid-stride, in place", (GELU_BACKWARD,), backward_v2),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
