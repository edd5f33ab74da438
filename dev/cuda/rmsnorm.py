"""
dev/cuda/rmsnorm.py: RMSNorm forward and backward (Llama 3), from naive ports to kernels/rmsnorm.cu.

rmsnorm_forward, out = inp * rstd * weight, rstd = 1/sqrt(mean(inp^2) + eps), per row of C (N = B*T rows):
  version 1 (dev/cuda/rmsnorm.cu rmsnorm_forward_v1) is the naive port of
            llama3_cpu.rmsnorm_forward: one thread per row, looping over C twice. Slow: a warp's 32
            threads read 32 rows C elements apart, so every load instruction touches 32 cache
            lines, and only N threads exist.
  version 2 (kernels/rmsnorm.cu rmsnorm_forward, production) gives each row a warp: lanes read
            consecutive x128 groups (one coalesced access of 16 bytes per lane), sum the squares
            with warp shuffles, and stream the output: 32x the threads, 4-8x fewer load
            instructions. (dev/cuda/layernorm.py separates these two steps as its versions 2 and
            3; RMSNorm has nothing new to show between them.)
rmsnorm_backward, dinp += ..., dweight += ... (llama3_cpu.rmsnorm_backward):
  version 1 (rmsnorm_backward_v1) is the naive port: one thread per row, every element's dweight
            term atomically added to one fp32 (C,) scratch, then rmsnorm_param_reduce over that
            one slot: uncoalesced rows, N contending atomics per channel, a run-to-run order.
  version 2 (kernels/rmsnorm.cu rmsnorm_backward + rmsnorm_param_reduce, production): one warp
            per row with x128 loads, and no atomics: each of a fixed number of blocks
            (llama3_cuda's RMSNORM_BACKWARD_GRID) writes its rows' dweight sums to its own
            scratch slot, a second kernel adds the slots in order: bit-reproducible.

Napkin math (minimum traffic; N rows, C channels): forward reads N*C and writes N*C floatX plus N
floats; backward reads dout, inp and dinp, writes dinp (4N*C floatX) and reads rstd.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/rmsnorm.py         # both progressions, every version, bf16
    python dev/cuda/rmsnorm.py 2 -p fp32
writes dev/results/dev_cuda_rmsnorm.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import llama3_cpu  # noqa: E402  (common put the repository root on sys.path)
from llama3_cuda import rmsnorm_backward_grid  # noqa: E402  (the production scratch slots)
from llmc.cuda import BLOCK_SIZE, ceil_div, elementwise_grid, warp_row_grid  # noqa: E402

OP = "rmsnorm"
RMSNORM_FORWARD_V1 = dev_kernel(OP, "rmsnorm_forward_v1")
RMSNORM_BACKWARD_V1 = dev_kernel(OP, "rmsnorm_backward_v1")
RMSNORM_FORWARD = production_kernel("rmsnorm", "rmsnorm_forward")
RMSNORM_BACKWARD = production_kernel("rmsnorm", "rmsnorm_backward")
RMSNORM_PARAM_REDUCE = production_kernel("rmsnorm", "rmsnorm_param_reduce")


# ----------------------------------------------------------------------------
# problems: inputs, references from llama3_cpu.py

def layer_inputs(case, rng, B, T, C):
    """Scalars N, C; inputs inp (B,T,C) ~ 2 N(0,1) + 0.5, weight (C,). Returns the float64 values
    the kernels see."""
    case.scalar("N", B * T)
    case.scalar("C", C)
    return case.input("inp", rng.standard_normal((B, T, C)) * 2 + 0.5), case.input("weight", rng.standard_normal(C))


def make_forward_case(rng, precision, B, T, C):
    """out, rstd = llama3_cpu.rmsnorm_forward(inp, weight, NORM_EPS)."""
    case = common.Case(precision)
    x, w = layer_inputs(case, rng, B, T, C)
    out, rstd = llama3_cpu.rmsnorm_forward(x, w, llama3_cpu.NORM_EPS)
    case.output("out", (B, T, C))
    case.check("out", out, "rmsnorm_forward")
    case.output("rstd", (B, T), "f32")
    case.check("rstd", rstd, "rmsnorm_forward")
    case.bytes = common.napkin_bytes(precision, floatX=2 * B * T * C + C, float32=B * T)
    return case


def make_backward_case(rng, precision, B, T, C):
    """dinp and dweight accumulate llama3_cpu.rmsnorm_backward's gradients."""
    case = common.Case(precision)
    x, w = layer_inputs(case, rng, B, T, C)
    rstd = case.input("rstd", llama3_cpu.rmsnorm_forward(x, w, llama3_cpu.NORM_EPS)[1], "f32")   # fp32, as the forward's
    dout = case.input("dout", rng.standard_normal((B, T, C)))
    dinp = case.input("dinp", rng.standard_normal((B, T, C)))                           # both accumulate
    dweight = case.input("dweight", rng.standard_normal(C))
    dinp = dinp + llama3_cpu.rmsnorm_backward(dweight, dout, x, w, rstd)
    case.check("dinp", dinp, "rmsnorm_backward")
    case.check("dweight", dweight, "rmsnorm_backward")
    G = rmsnorm_backward_grid(B * T)
    case.scalar("G", G)
    case.scratch("scratch", G * C)             # production: (G, C) slots; version 1 uses one (C,)
    case.bytes = common.napkin_bytes(precision, floatX=4 * B * T * C + 3 * C, float32=B * T)
    return case


# ----------------------------------------------------------------------------
# launchers: grids as llama3_cuda.py computes them

def forward_args(d):
    return (d.out, d.rstd, d.inp, d.weight, np.int32(d.N), np.int32(d.C))


def forward_v1(d, block_size):
    RMSNORM_FORWARD_V1.launch(d.precision, ceil_div(d.N, block_size), block_size, forward_args(d))


def forward_v2(d, block_size):
    RMSNORM_FORWARD.launch(d.precision, warp_row_grid(d.N, block_size), block_size, forward_args(d))


def backward_args(d):
    return (d.dinp, d.scratch, d.dout, d.inp, d.weight, d.rstd, np.int32(d.N), np.int32(d.C))


def param_reduce(d, num_slots):
    """dweight += the sum of the first num_slots (C,) slots of the scratch."""
    RMSNORM_PARAM_REDUCE.launch(d.precision, elementwise_grid(d.C), BLOCK_SIZE,
                                (d.dweight, d.scratch, np.int32(num_slots), np.int32(d.C)))


def backward_v1(d, block_size):
    d.scratch[:d.C].fill(0)
    RMSNORM_BACKWARD_V1.launch(d.precision, ceil_div(d.N, block_size), block_size, backward_args(d))
    param_reduce(d, 1)


def backward_v2(d, block_size):
    RMSNORM_BACKWARD.launch(d.precision, d.G, block_size, backward_args(d))     # llama3_cuda.rmsnorm_backward
    param_reduce(d, d.G)


SIZES = dict(B=4, T=1024, C=4096)                # Llama 3 8B's width
TEST_SIZES = dict(B=2, T=37, C=96)               # 74 rows: partial blocks; C = 3 warps of 32
PROGRESSIONS = [
    Progression("rmsnorm_forward", make_forward_case, [
        Version(1, "naive port, one thread per row", (RMSNORM_FORWARD_V1,), forward_v1),
        Version(2, "production: warp per row, x128 loads, shuffle reduction, streaming hints", (RMSNORM_FORWARD,),
                forward_v2),
    ], SIZES, TEST_SIZES),
    Progression("rmsnorm_backward", make_backward_case, [
        Version(1, "naive port, one thread per row, global fp32 atomics",
                (RMSNORM_BACKWARD_V1, RMSNORM_PARAM_REDUCE), backward_v1),
        Version(2, "production: warp per row, x128, per-block scratch slots, deterministic",
                (RMSNORM_BACKWARD, RMSNORM_PARAM_REDUCE), backward_v2),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
