"""
dev/cuda/adamw.py: one AdamW step over n parameters, from a naive port to kernels/adamw.cu.

adamw_update (gpt2_cpu.adamw_update: moments, bias correction, decoupled weight decay):
  version 1 (dev/cuda/adamw.cu adamw_moments_v1 + adamw_params_v1) is the naive port, one
            kernel per half of the NumPy function: the moments, then the parameter. m and v make
            a round trip to DRAM between the two: 16 extra bytes per parameter.
  version 2 (adamw_update_v2) fuses both halves: each array is read once and written once,
            the parameter update uses the new m and v from registers. It moves the napkin
            minimum, so it runs at close to the copy bandwidth.
  version 3 (kernels/adamw.cu adamw_update, production) is version 2 plus what the trainer
            needs rather than speed: a grid-stride loop (any grid), optional fp32 master weights
            (run here without: master_params = NULL, as with -w 0) and stochastic rounding of
            the bf16 parameter (a hash per element and step). Its time should equal version 2's;
            a gap would be the price of the rounding's integer hashing.
Scalar loads throughout: consecutive threads read consecutive elements, so every warp access is
coalesced, and at 24 bytes of traffic per parameter (bf16) the arithmetic is free.

Napkin math (minimum traffic): params read + written, grads read (floatX), m and v read +
written (fp32): 3 floatX + 16 bytes per parameter.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/adamw.py             # every version, bf16
    python dev/cuda/adamw.py 2 -p fp32
writes dev/results/dev_cuda_adamw.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
from gpt2_cpu import ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS  # noqa: E402
from llmc.cuda import ceil_div, elementwise_grid  # noqa: E402

OP = "adamw"
ADAMW_MOMENTS_V1 = dev_kernel(OP, "adamw_moments_v1")
ADAMW_PARAMS_V1 = dev_kernel(OP, "adamw_params_v1")
ADAMW_UPDATE_V2 = dev_kernel(OP, "adamw_update_v2")
ADAMW_UPDATE = production_kernel("adamw", "adamw_update")
# the step's hyperparameters: llm.c's defaults, step t = 3 (bias corrections far from 1),
# a clipping factor != 1 so that grad_scale is exercised
LEARNING_RATE, WEIGHT_DECAY, STEP, GRAD_SCALE = 1e-3, 0.1, 3, 0.7
SEED_STOCHASTIC_ROUNDING = 1234


# ----------------------------------------------------------------------------
# problem: inputs, references from gpt2_cpu.py

def make_case(rng, precision, n):
    """params, grads (n,) floatX; m, v (n,) fp32 -> all but grads updated by gpt2_cpu.adamw_update."""
    case = common.Case(precision)
    case.scalar("n", n)
    p = case.input("params", rng.standard_normal(n))
    g = case.input("grads", rng.standard_normal(n))
    m = case.input("m", rng.standard_normal(n) * 0.1, "f32")
    v = case.input("v", np.abs(rng.standard_normal(n)), "f32")       # a running mean of squares: >= 0
    gpt2_cpu.adamw_update(p, g, m, v, LEARNING_RATE, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, WEIGHT_DECAY, STEP,
                          GRAD_SCALE)                                  # in place on the float64 copies
    for name, ref in (("params", p), ("m", m), ("v", v)):
        case.check(name, ref, "adamw")
    case.bytes = common.napkin_bytes(precision, floatX=3 * n, float32=4 * n)
    return case


# ----------------------------------------------------------------------------
# launchers: grids as gpt2_cuda.py computes them

def corrections():
    """Adam's bias corrections 1 - beta^t of the two moments (Kingma & Ba 2015)."""
    return np.float32(1.0 - ADAMW_BETA1 ** STEP), np.float32(1.0 - ADAMW_BETA2 ** STEP)


def v1(d, block_size):
    bc1, bc2 = corrections()
    grid = ceil_div(d.n, block_size)
    ADAMW_MOMENTS_V1.launch(d.precision, grid, block_size, (d.m, d.v, d.grads, np.int32(d.n), np.float32(ADAMW_BETA1),
                                                            np.float32(ADAMW_BETA2), np.float32(GRAD_SCALE)))
    ADAMW_PARAMS_V1.launch(d.precision, grid, block_size,
                           (d.params, d.m, d.v, np.int32(d.n), np.float32(LEARNING_RATE), bc1, bc2,
                            np.float32(ADAMW_EPS), np.float32(WEIGHT_DECAY)))


def v2(d, block_size):
    bc1, bc2 = corrections()
    ADAMW_UPDATE_V2.launch(d.precision, ceil_div(d.n, block_size), block_size,
                           (d.params, d.grads, d.m, d.v, np.int32(d.n), np.float32(LEARNING_RATE),
                            np.float32(ADAMW_BETA1), np.float32(ADAMW_BETA2), bc1, bc2, np.float32(ADAMW_EPS),
                            np.float32(WEIGHT_DECAY), np.float32(GRAD_SCALE)))


def v3(d, block_size):
    bc1, bc2 = corrections()
    null = np.uint64(0)                          # master_params = NULL, as gpt2_cuda.adamw_update passes it
    ADAMW_UPDATE.launch(d.precision, elementwise_grid(d.n, block_size), block_size,
                        (d.params, null, d.grads, d.m, d.v, np.uint64(d.n), np.float32(LEARNING_RATE),
                         np.float32(ADAMW_BETA1), np.float32(ADAMW_BETA2), bc1, bc2, np.float32(ADAMW_EPS),
                         np.float32(WEIGHT_DECAY), np.float32(GRAD_SCALE), np.uint32(SEED_STOCHASTIC_ROUNDING)))


SIZES = dict(n=1 << 25)                          # 33.5M parameters: a quarter of GPT-2 124M
TEST_SIZES = dict(n=1003)                        # not a multiple of any block size
PROGRESSIONS = [
    Progression("adamw_update", make_case, [
        Version(1, "naive port, two kernels: moments, then parameters", (ADAMW_MOMENTS_V1, ADAMW_PARAMS_V1), v1),
        Version(2, "fused: one pass, each array read and written once", (ADAMW_UPDATE_V2,), v2),
        Version(3, "production: fused, grid-stride, stochastic rounding", (ADAMW_UPDATE,), v3),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
