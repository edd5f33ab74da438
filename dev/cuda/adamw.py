"""
dev/cuda/adamw.py: one AdamW step over n parameters, from a naive port to kernels/adamw.cu.

adamw_update (gpt2_cpu.adamw_update: moments, bias correction, decoupled weight decay):
  version 1 (dev/cuda/adamw.cu adamw_moments_v1 + adamw_params_v1) is the naive port, one
            kernel per half of the NumPy function: the moments, then the parameter. m and v make
            a round trip to DRAM between the two: 16 extra bytes per parameter.
  version 2 (adamw_update_v2) fuses both halves: each array is read once and written once,
            the parameter update uses the new m and v from registers. It moves the napkin
            minimum, so it runs at close to the copy bandwidth.
  version 3 (adamw_update_v3) is version 2 plus what the trainer needs rather than speed: a
            grid-stride loop (any grid), optional fp32 master weights (run here without:
            master_params = NULL, as with -w 0) and stochastic rounding of the bf16 parameter (a
            hash per element and step). Its time should equal version 2's; a gap would be the
            price of the rounding's integer hashing. Launched once per parameter tensor (16 for
            GPT-2), with the learning rate, bias corrections, gradient scale and seed as launch
            arguments, which change every step: a CUDA graph of the step could not replay it.
  version 4 (kernels/adamw.cu adamw_update, production): one launch over a table of tensors
            (here one tensor; GPT-2's 16 in the trainer), each block one tensor's share, so no
            launch per tensor and no idle block; the per-step values read from the device
            (the table, the seeds, [learning rate, corrections], the gradient scale that the
            norm's kernel computes), so the launch is the same every step and the whole training
            step is one CUDA graph; and 16-byte loads and stores: one x128 of params and grads
            and the matching f128s of m and v per thread (two each in bf16), where version 3 made
            a 2-byte and two 4-byte scalar accesses per element (a warp's bf16 access is then 64
            bytes, a quarter of what a 16-byte-per-lane access moves per instruction). It
            rounds every element as version 3 does, bit for bit.
Scalar loads (versions 1-3): consecutive threads read consecutive elements, so every warp access is
coalesced; version 4 widens each access to 16 bytes per lane, the way the other elementwise kernels
reached their bandwidth (llm.c's Packed128).

Napkin math (minimum traffic, bytes per parameter): params read + written and grads read
(floatX: 3 x 2 in bf16), m and v read + written (fp32: 16): 22 bytes in bf16 without master
weights, as timed here (SIZES: 33.5M parameters, 738 MB). The trainer's bf16 step with fp32 master
weights (-w 1) reads the master copy instead of the bf16 params and writes both: master read +
written (8), params written (2), grads read (2), m, v (16): 28 bytes per parameter, 3.49 GB for
GPT-2 124M's 124.5M parameters, 1.16 ms at the H100's measured copy bandwidth of 3,010 GB/s (the
trainer's step measured 1.40 ms for AdamW with version 3's 16 launches: 83% of that).

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
from llmc.cuda import ceil_div, elementwise_grid, vector_size  # noqa: E402

OP = "adamw"
ADAMW_MOMENTS_V1 = dev_kernel(OP, "adamw_moments_v1")
ADAMW_PARAMS_V1 = dev_kernel(OP, "adamw_params_v1")
ADAMW_UPDATE_V2 = dev_kernel(OP, "adamw_update_v2")
ADAMW_UPDATE_V3 = dev_kernel(OP, "adamw_update_v3")
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
    # version 4 reads the step's values from the device: its table of one tensor (offsets 0, n
    # elements, first block 0, decayed), the seed, [learning rate, corrections], the gradient scale
    case.input("table", [[0, 0, n, 0, 1]], "i64")
    case.input("seeds", [SEED_STOCHASTIC_ROUNDING], "u32")
    case.input("step_scalars", [LEARNING_RATE, *corrections()], "f32")
    case.input("grad_scale", [GRAD_SCALE], "f32")
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
    null = np.uint64(0)                          # master_params = NULL, as with -w 0
    ADAMW_UPDATE_V3.launch(d.precision, elementwise_grid(d.n, block_size), block_size,
                           (d.params, null, d.grads, d.m, d.v, np.uint64(d.n), np.float32(LEARNING_RATE),
                            np.float32(ADAMW_BETA1), np.float32(ADAMW_BETA2), bc1, bc2, np.float32(ADAMW_EPS),
                            np.float32(WEIGHT_DECAY), np.float32(GRAD_SCALE), np.uint32(SEED_STOCHASTIC_ROUNDING)))


def v4(d, block_size):
    """gpt2_cuda.adamw_update over the case's one-tensor table (its blocks of block_size vectors),
    the step's values read from the case's device arrays."""
    num_blocks = ceil_div(d.n, block_size * vector_size(d.precision))
    ADAMW_UPDATE.launch(d.precision, num_blocks, block_size,
                        (d.params, np.uint64(0), d.grads, d.m, d.v, d.table, np.int32(1), np.int64(num_blocks),
                         d.seeds, d.step_scalars, d.grad_scale, np.float32(ADAMW_BETA1), np.float32(ADAMW_BETA2),
                         np.float32(ADAMW_EPS), np.float32(WEIGHT_DECAY)))


SIZES = dict(n=1 << 25)                          # 33.5M parameters: a quarter of GPT-2 124M
TEST_SIZES = dict(n=1003)                        # not a multiple of any block size
PROGRESSIONS = [
    Progression("adamw_update", make_case, [
        Version(1, "naive port, two kernels: moments, then parameters", (ADAMW_MOMENTS_V1, ADAMW_PARAMS_V1), v1),
        Version(2, "fused: one pass, each array read and written once", (ADAMW_UPDATE_V2,), v2),
        Version(3, "fused, grid-stride, stochastic rounding, one launch per tensor", (ADAMW_UPDATE_V3,), v3),
        Version(4, "production: one launch over a table of tensors, per-step values on the device, 16-byte "
                   "accesses", (ADAMW_UPDATE,), v4),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
