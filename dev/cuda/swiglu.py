"""
dev/cuda/swiglu.py: SwiGLU forward and backward (Llama 3), from naive ports to kernels/swiglu.cu.

swiglu_forward, out = fch * silu(fch2) over n = B*T*H values (the MLP's hidden layer):
  version 1 (dev/cuda/swiglu.cu swiglu_forward_v1) is the naive port of llama3_cpu.swiglu_forward:
            one thread per element, scalar loads and stores.
  version 2 (kernels/swiglu.cu swiglu_forward, production) loads and stores 16 bytes per thread
            (x128: 8 bf16 or 4 floats) in a grid-stride loop, with the streaming hint on the inputs
            it reads once: 4-8x fewer memory instructions for the same bytes in flight.
swiglu_backward, dfch and dfch2 from dout (llama3_cpu.swiglu_backward):
  version 1 (swiglu_backward_v1) naive port, one thread per element;
  version 2 (kernels/swiglu.cu swiglu_backward) the same x128 rewrite.

Napkin math: forward reads 2n and writes n floatX values; backward reads 3n and writes 2n. Both are
memory-bound (an expf per element is cheap next to 6-10 bytes of traffic).

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/swiglu.py         # both progressions, every version, bf16
    python dev/cuda/swiglu.py 1 -p fp32
writes dev/results/dev_cuda_swiglu.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import llama3_cpu  # noqa: E402  (common put the repository root on sys.path)
from llmc.cuda import ceil_div, elementwise_grid, vector_size  # noqa: E402

OP = "swiglu"
SWIGLU_FORWARD_V1 = dev_kernel(OP, "swiglu_forward_v1")
SWIGLU_BACKWARD_V1 = dev_kernel(OP, "swiglu_backward_v1")
SWIGLU_FORWARD = production_kernel("swiglu", "swiglu_forward")
SWIGLU_BACKWARD = production_kernel("swiglu", "swiglu_backward")


# ----------------------------------------------------------------------------
# problems: inputs, references from llama3_cpu.py

def hidden_inputs(case, rng, B, T, H):
    """Scalar n = B*T*H; inputs fch, fch2 (n,) ~ 3 N(0,1) (silu's curved part and both tails)."""
    n = B * T * H
    case.scalar("n", n)
    return case.input("fch", rng.standard_normal(n) * 3), case.input("fch2", rng.standard_normal(n) * 3)


def make_forward_case(rng, precision, B, T, H):
    """out = llama3_cpu.swiglu_forward(fch, fch2)."""
    case = common.Case(precision)
    fch, fch2 = hidden_inputs(case, rng, B, T, H)
    case.output("out", fch.size)
    case.check("out", llama3_cpu.swiglu_forward(fch, fch2), "swiglu")
    case.bytes = common.napkin_bytes(precision, floatX=3 * fch.size)          # read fch, fch2; write out
    return case


def make_backward_case(rng, precision, B, T, H):
    """dfch, dfch2 = llama3_cpu.swiglu_backward(dout, fch, fch2)."""
    case = common.Case(precision)
    fch, fch2 = hidden_inputs(case, rng, B, T, H)
    dout = case.input("dout", rng.standard_normal(fch.size))
    dfch, dfch2 = llama3_cpu.swiglu_backward(dout, fch, fch2)
    for name, ref in (("dfch", dfch), ("dfch2", dfch2)):
        case.output(name, fch.size)
        case.check(name, ref, "swiglu")
    case.bytes = common.napkin_bytes(precision, floatX=5 * fch.size)          # read 3, write 2
    return case


# ----------------------------------------------------------------------------
# launchers: grids as llama3_cuda.py computes them

def forward_v1(d, block_size):
    SWIGLU_FORWARD_V1.launch(d.precision, ceil_div(d.n, block_size), block_size, (d.out, d.fch, d.fch2, np.int32(d.n)))


def forward_v2(d, block_size):
    grid = elementwise_grid(ceil_div(d.n, vector_size(d.precision)), block_size)   # llama3_cuda.swiglu_forward
    SWIGLU_FORWARD.launch(d.precision, grid, block_size, (d.out, d.fch, d.fch2, np.uint64(d.n)))


def backward_args(d):
    return (d.dfch, d.dfch2, d.dout, d.fch, d.fch2)


def backward_v1(d, block_size):
    SWIGLU_BACKWARD_V1.launch(d.precision, ceil_div(d.n, block_size), block_size, backward_args(d) + (np.int32(d.n),))


def backward_v2(d, block_size):
    grid = elementwise_grid(ceil_div(d.n, vector_size(d.precision)), block_size)
    SWIGLU_BACKWARD.launch(d.precision, grid, block_size, backward_args(d) + (np.uint64(d.n),))


SIZES = dict(B=4, T=1024, H=14336)               # Llama 3 8B's MLP: n = 58,720,256
TEST_SIZES = dict(B=1, T=3, H=37)                # n = 111: not a multiple of 8, exercises the tail
PROGRESSIONS = [
    Progression("swiglu_forward", make_forward_case, [
        Version(1, "naive port, one thread per element, scalar loads", (SWIGLU_FORWARD_V1,), forward_v1),
        Version(2, "production: x128 loads/stores, grid-stride, streaming hint", (SWIGLU_FORWARD,), forward_v2),
    ], SIZES, TEST_SIZES),
    Progression("swiglu_backward", make_backward_case, [
        Version(1, "naive port, one thread per element, scalar loads", (SWIGLU_BACKWARD_V1,), backward_v1),
        Version(2, "production: x128 loads/stores, grid-stride", (SWIGLU_BACKWARD,), backward_v2),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
