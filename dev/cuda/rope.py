"""
dev/cuda/rope.py: RoPE forward and backward (Llama 3), from naive ports to kernels/rope.cu.

rope_forward, the q and k heads of the qkv projection (B,T,NH+2NKV,HS) rotated pair by pair by the
angles of their position, the v heads copied (llama3_cpu.rope_forward on q and k):
  version 1 (dev/cuda/rope.cu rope_forward_v1) is the naive port: one thread per channel pair,
            scalar loads of the two values, of cos and of sin, scalar stores.
  version 2 (kernels/rope.cu rope_forward, production) gives each thread an x128 group (2 or 4
            pairs, 16 bytes) in a grid-stride loop: one load and one store instruction per group
            instead of two of each per pair, the group's position and head computed once, and the
            streaming hint on the input read once.
rope_backward, the rotation by minus the angle (llama3_cpu.rope_backward):
  version 1 (rope_backward_v1) the naive port; version 2 (kernels/rope.cu rope_backward) the x128
  rewrite, the same code as the forward with sin negated.

Napkin math: each reads and writes B*T*(NH+2NKV)*HS floatX values and reads the (T,HS/2) fp32 cos
and sin tables (cached: every batch row and head reuses them). Memory-bound.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/rope.py         # both progressions, every version, bf16
    python dev/cuda/rope.py 2 -p fp32
writes dev/results/dev_cuda_rope.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import llama3_cpu  # noqa: E402  (common put the repository root on sys.path)
from llmc.cuda import ceil_div, elementwise_grid, vector_size  # noqa: E402

OP = "rope"
ROPE_FORWARD_V1 = dev_kernel(OP, "rope_forward_v1")
ROPE_BACKWARD_V1 = dev_kernel(OP, "rope_backward_v1")
ROPE_FORWARD = production_kernel("rope", "rope_forward")
ROPE_BACKWARD = production_kernel("rope", "rope_backward")


# ----------------------------------------------------------------------------
# problems: inputs, references from llama3_cpu.py

def make_case(rng, precision, B, T, NH, NKV, HS, backward):
    """inp (B,T,NH+2NKV,HS) ~ N(0,1); out = its q and k heads through llama3_cpu.rope_forward (or
    rope_backward), its v heads as they are."""
    nh, n_rot = NH + 2 * NKV, NH + NKV
    case = common.Case(precision)
    for name, value in (("B", B), ("T", T), ("nh", nh), ("n_rot", n_rot), ("HS", HS)):
        case.scalar(name, value)
    cos, sin = llama3_cpu.precompute_freqs_cis(HS, T, llama3_cpu.ROPE_THETA, True)     # (T,HS/2) float64
    cos, sin = case.input("freqs_cos", cos, "f32"), case.input("freqs_sin", sin, "f32")
    x = case.input("inp", rng.standard_normal((B, T, nh, HS)))
    out = x.copy()
    qk = x[:, :, :n_rot]                                                               # (B,T,NH+NKV,HS)
    out[:, :, :n_rot] = llama3_cpu.rope_backward(qk, cos, sin) if backward else llama3_cpu.rope_forward(qk, cos, sin)
    case.output("out", (B, T, nh, HS))
    case.check("out", out, "rope")
    case.bytes = common.napkin_bytes(precision, floatX=2 * B * T * nh * HS, float32=T * HS)
    return case


def make_forward_case(rng, precision, B, T, NH, NKV, HS):
    return make_case(rng, precision, B, T, NH, NKV, HS, backward=False)


def make_backward_case(rng, precision, B, T, NH, NKV, HS):
    return make_case(rng, precision, B, T, NH, NKV, HS, backward=True)


# ----------------------------------------------------------------------------
# launchers: grids as llama3_cuda.py computes them

def args(d):
    return (d.out, d.inp, d.freqs_cos, d.freqs_sin, np.int32(d.B), np.int32(d.T), np.int32(d.nh), np.int32(d.n_rot),
            np.int32(d.HS))


def pairs(d):
    return d.B * d.T * d.nh * d.HS // 2


def forward_v1(d, block_size):
    ROPE_FORWARD_V1.launch(d.precision, ceil_div(pairs(d), block_size), block_size, args(d))


def forward_v2(d, block_size):
    grid = elementwise_grid(2 * pairs(d) // vector_size(d.precision), block_size)   # llama3_cuda.rope_forward
    ROPE_FORWARD.launch(d.precision, grid, block_size, args(d))


def backward_v1(d, block_size):
    ROPE_BACKWARD_V1.launch(d.precision, ceil_div(pairs(d), block_size), block_size, args(d))


def backward_v2(d, block_size):
    grid = elementwise_grid(2 * pairs(d) // vector_size(d.precision), block_size)
    ROPE_BACKWARD.launch(d.precision, grid, block_size, args(d))


SIZES = dict(B=4, T=1024, NH=32, NKV=8, HS=128)          # Llama 3 8B's attention
TEST_SIZES = dict(B=2, T=5, NH=4, NKV=2, HS=16)          # 320 pairs: a partial block
PROGRESSIONS = [
    Progression("rope_forward", make_forward_case, [
        Version(1, "naive port, one thread per channel pair, scalar loads", (ROPE_FORWARD_V1,), forward_v1),
        Version(2, "production: x128 groups of pairs, grid-stride, streaming hint", (ROPE_FORWARD,), forward_v2),
    ], SIZES, TEST_SIZES),
    Progression("rope_backward", make_backward_case, [
        Version(1, "naive port, one thread per channel pair, scalar loads", (ROPE_BACKWARD_V1,), backward_v1),
        Version(2, "production: x128 groups of pairs, grid-stride", (ROPE_BACKWARD,), backward_v2),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
