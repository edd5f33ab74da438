"""
dev/cuda/repeat_kv.py: grouped-query attention's K/V repeat (Llama 3), forward and backward, from
naive ports to kernels/repeat_kv.cu.

repeat_kv_forward, qkv (B,T,NH+2NKV,HS) -> GPT-2's attention input (B,T,3,NH,HS), each key and
value head repeated for its n_rep = NH/NKV query heads (llama3_cpu.repeat_kv_forward):
  version 1 (dev/cuda/repeat_kv.cu repeat_kv_forward_v1) is the naive port: one thread per
            output element, one scalar copy each.
  version 2 (kernels/repeat_kv.cu repeat_kv_forward, production) copies one x128 group (16
            bytes) per thread in a grid-stride loop: the index arithmetic done once per group and
            4-8x fewer memory instructions for the same bytes.
repeat_kv_backward, each kv head's gradient the sum of its n_rep query heads' (llama3_cpu.repeat_kv_backward):
  version 1 (repeat_kv_backward_v1) one thread per element of dinp, scalar loads;
  version 2 (kernels/repeat_kv.cu repeat_kv_backward) the same x128 rewrite, summing in fp32.

Napkin math: the forward reads B*T*(NH+2NKV)*HS (from cache: the kv heads are read n_rep times)
and writes B*T*3*NH*HS floatX values; the backward the other way round.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/repeat_kv.py         # both progressions, every version, bf16
    python dev/cuda/repeat_kv.py 2 -p fp32
writes dev/results/dev_cuda_repeat_kv.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import llama3_cpu  # noqa: E402  (common put the repository root on sys.path)
from llmc.cuda import ceil_div, elementwise_grid, vector_size  # noqa: E402

OP = "repeat_kv"
REPEAT_KV_FORWARD_V1 = dev_kernel(OP, "repeat_kv_forward_v1")
REPEAT_KV_BACKWARD_V1 = dev_kernel(OP, "repeat_kv_backward_v1")
REPEAT_KV_FORWARD = production_kernel("repeat_kv", "repeat_kv_forward")
REPEAT_KV_BACKWARD = production_kernel("repeat_kv", "repeat_kv_backward")


# ----------------------------------------------------------------------------
# problems: inputs, references from llama3_cpu.py

def shape_scalars(case, B, T, NH, NKV, HS):
    for name, value in (("B", B), ("T", T), ("NH", NH), ("NKV", NKV), ("HS", HS)):
        case.scalar(name, value)


def make_forward_case(rng, precision, B, T, NH, NKV, HS):
    """out = [q, repeat(k), repeat(v)] of inp (B,T,(NH+2NKV)*HS) ~ N(0,1), through llama3_cpu's split_qkv,
    repeat_kv_forward and merge_heads."""
    case = common.Case(precision)
    shape_scalars(case, B, T, NH, NKV, HS)
    x = case.input("inp", rng.standard_normal((B, T, (NH + 2 * NKV) * HS)))
    q, k, v = llama3_cpu.split_qkv(x, NH, NKV)
    n_rep = NH // NKV
    case.output("out", (B, T, 3 * NH * HS))
    case.check("out", llama3_cpu.merge_heads(q, llama3_cpu.repeat_kv_forward(k, n_rep),
                                             llama3_cpu.repeat_kv_forward(v, n_rep)), "repeat_kv")
    case.bytes = common.napkin_bytes(precision, floatX=B * T * (4 * NH + 2 * NKV) * HS)
    return case


def make_backward_case(rng, precision, B, T, NH, NKV, HS):
    """dinp = [dq, sum over repeats of dk, of dv] from dout (B,T,3*NH*HS) ~ N(0,1)
    (llama3_cpu.repeat_kv_backward on the k and v parts)."""
    case = common.Case(precision)
    shape_scalars(case, B, T, NH, NKV, HS)
    d = case.input("dout", rng.standard_normal((B, T, 3 * NH * HS)))
    dq, dk, dv = llama3_cpu.split_qkv(d, NH, NH)
    n_rep = NH // NKV
    case.output("dinp", (B, T, (NH + 2 * NKV) * HS))
    case.check("dinp", llama3_cpu.merge_heads(dq, llama3_cpu.repeat_kv_backward(dk, n_rep),
                                              llama3_cpu.repeat_kv_backward(dv, n_rep)), "repeat_kv")
    case.bytes = common.napkin_bytes(precision, floatX=B * T * (4 * NH + 2 * NKV) * HS)
    return case


# ----------------------------------------------------------------------------
# launchers: grids as llama3_cuda.py computes them

def sizes(d):
    return (np.int32(d.B), np.int32(d.T), np.int32(d.NH), np.int32(d.NKV), np.int32(d.HS))


def forward_v1(d, block_size):
    n = d.B * d.T * 3 * d.NH * d.HS
    REPEAT_KV_FORWARD_V1.launch(d.precision, ceil_div(n, block_size), block_size, (d.out, d.inp) + sizes(d))


def forward_v2(d, block_size):
    grid = elementwise_grid(d.B * d.T * 3 * d.NH * d.HS // vector_size(d.precision), block_size)
    REPEAT_KV_FORWARD.launch(d.precision, grid, block_size, (d.out, d.inp) + sizes(d))


def backward_v1(d, block_size):
    n = d.B * d.T * (d.NH + 2 * d.NKV) * d.HS
    REPEAT_KV_BACKWARD_V1.launch(d.precision, ceil_div(n, block_size), block_size, (d.dinp, d.dout) + sizes(d))


def backward_v2(d, block_size):
    grid = elementwise_grid(d.B * d.T * (d.NH + 2 * d.NKV) * d.HS // vector_size(d.precision), block_size)
    REPEAT_KV_BACKWARD.launch(d.precision, grid, block_size, (d.dinp, d.dout) + sizes(d))


SIZES = dict(B=4, T=1024, NH=32, NKV=8, HS=128)          # Llama 3 8B's attention
TEST_SIZES = dict(B=2, T=5, NH=6, NKV=2, HS=16)          # n_rep = 3; partial blocks
PROGRESSIONS = [
    Progression("repeat_kv_forward", make_forward_case, [
        Version(1, "naive port, one thread per element, scalar copies", (REPEAT_KV_FORWARD_V1,), forward_v1),
        Version(2, "production: x128 groups, grid-stride", (REPEAT_KV_FORWARD,), forward_v2),
    ], SIZES, TEST_SIZES),
    Progression("repeat_kv_backward", make_backward_case, [
        Version(1, "naive port, one thread per element, scalar loads", (REPEAT_KV_BACKWARD_V1,), backward_v1),
        Version(2, "production: x128 groups, fp32 sums in order, grid-stride", (REPEAT_KV_BACKWARD,), backward_v2),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
