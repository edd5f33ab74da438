"""
dev/cuda/global_norm.py: the global L2 norm of the gradients (for clipping), from a naive port to
kernels/global_norm.cu.

global_norm, out[0] = sqrt(sum of data^2) over n floatX values (gpt2_cpu.gpt2_grad_norm), and
out[1] = the gradient clipping factor (gpt2_cpu.train's grad_clip / norm above grad_clip, else 1),
which the trainer's AdamW reads on the device:
  version 1 (dev/cuda/global_norm.cu global_norm_v1 + global_norm_sqrt_v1) is the naive port of
            the float64 dot product: one thread per element, each atomically adding its square to
            one double. All n atomics hit one address and are serialized in L2: it runs at the
            atomic unit's rate, far below the memory bandwidth.
  version 2 (global_norm_v2 + global_norm_sqrt_v2) reduces before it communicates: a
            grid-stride loop with a float partial sum per thread, a block reduction (warp
            shuffles, then shared memory), one atomicAdd per block (gpt2_cuda's
            GLOBAL_NORM_GRID blocks): a thousand atomics instead of n. Not reproducible to the
            last bit, since the atomics land in a different order each run.
  version 3 (kernels/global_norm.cu global_norm_squared + global_norm_finalize, production)
            has the same shape with x128 loads (streaming hint), and replaces the atomics by one
            slot per block that a second one-block kernel sums in order: deterministic, which
            the trainer needs so that the clipping factor (and so the run) is reproducible. Its
            block reduction takes one barrier: each thread's sum goes to shared memory and warp
            0 adds them (common.cuh blockSumToThread0); the other warps are done.
  version 4 (candidate: dev/cuda/global_norm.cu global_norm_squared_v4, then the production
            finalize): each thread issues 4 of its x128 loads before it sums any, 4x the bytes in
            flight. Version 3 read at 68% of the H100's copy bandwidth (a read-only kernel needs
            more loads outstanding than a copy, which also has its stores in flight); the timing
            shows whether that is the gap.

Napkin math (minimum traffic): read n floatX values once (2n bytes in bf16: 249 MB for GPT-2
124M's gradients, 0.083 ms at the H100's measured copy bandwidth of 3,010 GB/s, which moves
bytes both ways; a read-only kernel may exceed that share); the outputs are two floats. In the
training step the norm is one pass over the gradients, between the last backward kernel and
AdamW, which reads them again: it cannot join AdamW, which needs the finished norm before its
first element.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/global_norm.py       # every version, bf16
    python dev/cuda/global_norm.py 2 -p fp32
writes dev/results/dev_cuda_global_norm.md.
"""

import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
from gpt2_cuda import GLOBAL_NORM_GRID, NORM_VALUES  # noqa: E402  (the production's partial sums, outputs)
from llmc.cuda import MAX_THREADS_PER_BLOCK, ceil_div  # noqa: E402

OP = "global_norm"
CLIP_FRACTION = 0.5                      # grad_clip = half the norm: the factor must come out 0.5
GLOBAL_NORM_V1 = dev_kernel(OP, "global_norm_v1")
GLOBAL_NORM_SQRT_V1 = dev_kernel(OP, "global_norm_sqrt_v1")
GLOBAL_NORM_V2 = dev_kernel(OP, "global_norm_v2")
GLOBAL_NORM_SQRT_V2 = dev_kernel(OP, "global_norm_sqrt_v2")
GLOBAL_NORM_SQUARED_V4 = dev_kernel(OP, "global_norm_squared_v4")
GLOBAL_NORM_SQUARED = production_kernel("global_norm", "global_norm_squared")
GLOBAL_NORM_FINALIZE = production_kernel("global_norm", "global_norm_finalize")


# ----------------------------------------------------------------------------
# problem: inputs, reference from gpt2_cpu.py

def make_case(rng, precision, n):
    """data (n,) floatX -> out (2,) fp32 = gpt2_cpu.gpt2_grad_norm of a model whose one gradient is
    data, and the clipping factor at a grad_clip of half that norm (so that it clips)."""
    case = common.Case(precision)
    case.scalar("n", n)
    data = case.input("data", rng.standard_normal(n))
    model = types.SimpleNamespace(param_shapes=[("data", (n,))], G={"data": data}, grads=data.reshape(-1))
    norm = gpt2_cpu.gpt2_grad_norm(model)
    case.scalar("grad_clip", CLIP_FRACTION * norm)
    case.output("out", NORM_VALUES, "f32")
    case.check("out", [norm, CLIP_FRACTION], "global_norm")
    case.scratch("sum_sq64", 1, "f64")                  # version 1's accumulator
    case.scratch("sum_sq", 1, "f32")                    # version 2's
    case.scratch("partial", GLOBAL_NORM_GRID, "f32")    # version 3's slots
    case.bytes = common.napkin_bytes(precision, floatX=n)
    return case


# ----------------------------------------------------------------------------
# launchers: grids as gpt2_cuda.py computes them

def v1(d, block_size):
    d.sum_sq64.fill(0)
    GLOBAL_NORM_V1.launch(d.precision, ceil_div(d.n, block_size), block_size, (d.sum_sq64, d.data, np.int32(d.n)))
    GLOBAL_NORM_SQRT_V1.launch(d.precision, 1, 1, (d.out, d.sum_sq64, np.float32(d.grad_clip)))


def v2(d, block_size):
    d.sum_sq.fill(0)
    GLOBAL_NORM_V2.launch(d.precision, GLOBAL_NORM_GRID, block_size, (d.sum_sq, d.data, np.uint64(d.n)))
    GLOBAL_NORM_SQRT_V2.launch(d.precision, 1, 1, (d.out, d.sum_sq, np.float32(d.grad_clip)))


def v3(d, block_size):
    GLOBAL_NORM_SQUARED.launch(d.precision, GLOBAL_NORM_GRID, block_size,              # gpt2_cuda.global_norm
                               (d.partial, d.data, np.uint64(d.n), np.int32(0)))
    GLOBAL_NORM_FINALIZE.launch(d.precision, 1, MAX_THREADS_PER_BLOCK,
                                (d.out, d.partial, np.int32(GLOBAL_NORM_GRID), np.float32(d.grad_clip)))


def v4(d, block_size):
    GLOBAL_NORM_SQUARED_V4.launch(d.precision, GLOBAL_NORM_GRID, block_size, (d.partial, d.data, np.uint64(d.n)))
    GLOBAL_NORM_FINALIZE.launch(d.precision, 1, MAX_THREADS_PER_BLOCK,
                                (d.out, d.partial, np.int32(GLOBAL_NORM_GRID), np.float32(d.grad_clip)))


SIZES = dict(n=1 << 25)                          # 33.5M values: a quarter of GPT-2 124M's gradients
# a tail after the x128 groups; more groups than 3 grid strides at block 32 (1024 x 32 threads), so
# that version 4's unrolled loop runs there, and fewer than a stride at block 1024
TEST_SIZES = dict(n=(1 << 20) + 3)
PROGRESSIONS = [
    Progression("global_norm", make_case, [
        Version(1, "naive port: one float64 atomicAdd per element", (GLOBAL_NORM_V1, GLOBAL_NORM_SQRT_V1), v1),
        Version(2, "grid-stride partial sums, block reduction, one atomic per block",
                (GLOBAL_NORM_V2, GLOBAL_NORM_SQRT_V2), v2),
        Version(3, "production: x128 loads, per-block slots summed in order (deterministic)",
                (GLOBAL_NORM_SQUARED, GLOBAL_NORM_FINALIZE), v3),
        Version(4, "candidate: version 3 with 4 x128 loads in flight per thread, deterministic",
                (GLOBAL_NORM_SQUARED_V4, GLOBAL_NORM_FINALIZE), v4),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
