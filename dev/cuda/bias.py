"""
dev/cuda/bias.py: the gradient of a linear layer's bias, from a naive port to kernels/bias.cu.

bias_backward, dbias (OC,) += the column sums of dout (N,OC) (gpt2_cpu.matmul_backward's dbias;
N = B*T rows; in the trainer once per linear layer, four per block: OC = 3C, C, 4C, C):
  version 1 (dev/cuda/bias.cu bias_backward_v1) is the naive port: one thread per column walks
            all N rows and accumulates into dbias. Only OC threads: a few blocks for the whole GPU.
  version 2 (bias_backward_v2, then bias_reduce_v2) is llm.c's deterministic plan
            (dev/cuda/matmul_backward_bias.cu, version 9): the rows in num_chunks fixed chunks, a
            block row per chunk writing its column sums into a float scratch (num_chunks, OC),
            then a second kernel adding the chunks in order. One column per thread, 2-byte loads.
            The production kernel until 2026-11-27: on an H100 its 48 calls took 1.38 ms of
            GPT-2 124M's step at B=16 (2.7 GB read, 65% of the copy bandwidth).
  version 3 (kernels/bias.cu bias_backward, then bias_reduce_v2) keeps the chunks and the
            reduce, and gives each lane 16 bytes of a row (8 bf16 columns): a warp reads 512
            contiguous bytes of a row per load, the block's warps take its rows in turn, and
            their sums meet in shared memory in a fixed order. 8x the bytes per load instruction
            (as the x128 step of every elementwise kernel here), and every block keeps 8 warps
            streaming. On an H200 (2026-11-27, at the sizes below): 0.0306 ms, 38.5% of the copy
            bandwidth, against version 2's 0.0371 ms (both with the reduce).
  version 4 (kernels/bias.cu bias_backward + bias_reduce, production since 2026-11-27) is version
            3 with a reduce that keeps 16 running sums per column instead of one: bias_reduce_v2
            adds the chunks' partials one after another, each add waiting for its load's round
            trip to L2 (the partials were just written), with only OC threads to hide it; on an
            H200 it took 10.6 us a call in the step, 0.51 ms for the 48 biases at B=16, half of
            bias_backward's own 1.03 ms. Now 16 loads are in flight per thread. Untimed: it
            replaced bias_reduce_v2 without a GPU, which goes back if a GPU times it slower.
  version 5 (candidate: dev/cuda/bias.cu bias_backward_v5, then the production bias_reduce) is
            version 4 with each lane loading 4 of its warp's rows before adding any (64 registers
            in bf16 against 32: half the threads an SM, twice the bytes in flight). The same adds
            in the same order: version 4's bits. In the B=16 step bias_backward read 2.7 GB in
            1.03 ms for the 48 biases, about 62% of the H200's copy bandwidth; with the reduce at
            its bandwidth too, plain dweight GEMMs plus these kernels would beat the BGRADB
            epilogue (1.36 ms slower than plain). `dev/bench.py --bias-grad-epilogue 0
            --candidate bias:5` times the step with it.

Napkin math (minimum traffic): read dout once (N*OC floatX: 50 MB in bf16 at the sizes below,
0.017 ms at the H100's measured copy bandwidth of 3,010 GB/s); the chunk partials (num_chunks*OC
floats, 3 MB here) are written and read once more.

Why it matters: with cuBLASLt (gpt2_cuda.py's GPU default) the bias gradient rides in the dweight
GEMM's BGRADB epilogue instead, and on an H100 the three large BGRADB products of a step took
0.18-0.59 ms more each (12 calls) than the same plain products (dev/results/: 1.48-1.91 ms
against 1.06-1.31), 1.2-1.3 ms in all, against version 2's 1.38 ms for all four biases: a faster
kernel here makes the plain products plus this kernel the better pair (gpt2_cuda.py
--bias-grad-epilogue 0). On an H200 (2026-11-27) the pair tied the epilogue: the plain products
took 1.36 ms less, version 3 1.03 ms and bias_reduce 0.51 ms for the 48 biases at B=16.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/bias.py          # every version, bf16
    python dev/cuda/bias.py 3 -p fp32
writes dev/results/dev_cuda_bias.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
from llmc.cuda import WARP_SIZE, ceil_div, vector_size  # noqa: E402
from llmc.matmul import bias_backward_chunks  # noqa: E402  (the production's fixed chunks)

OP = "bias"
BIAS_BACKWARD_V1 = dev_kernel(OP, "bias_backward_v1")
BIAS_BACKWARD_V2 = dev_kernel(OP, "bias_backward_v2")
BIAS_BACKWARD = production_kernel("bias", "bias_backward")
BIAS_REDUCE_V2 = dev_kernel(OP, "bias_reduce_v2")
BIAS_BACKWARD_V5 = dev_kernel(OP, "bias_backward_v5")
BIAS_REDUCE = production_kernel("bias", "bias_reduce")


# ----------------------------------------------------------------------------
# the problem: inputs, the reference from gpt2_cpu.py

def make_backward_case(rng, precision, N, OC):
    """dout (N,OC) ~ N(0,1), dbias (OC,) accumulated into -> dbias + the column sums of dout, as
    gpt2_cpu.matmul_backward computes them (with a one-row input, whose dinp is not checked)."""
    case = common.Case(precision)
    case.scalar("N", N)
    case.scalar("OC", OC)
    case.scalar("chunks", bias_backward_chunks(N))
    dout = case.input("dout", rng.standard_normal((N, OC)))
    dbias = case.input("dbias", rng.standard_normal(OC))
    ref = dbias.copy()
    gpt2_cpu.matmul_backward(None, ref, dout.reshape(1, N, OC), np.zeros((1, N, 1)), np.zeros((OC, 1)))
    case.check("dbias", ref, "matmul")
    case.scratch("partial", (bias_backward_chunks(N), OC))
    case.bytes = common.napkin_bytes(precision, floatX=N * OC + 2 * OC)       # read dout; read, write dbias
    return case


# ----------------------------------------------------------------------------
# launchers: grids as llmc/matmul.py's bias_backward computes them

def reduce_chunks(d, block_size, kernel=BIAS_REDUCE):
    kernel.launch(d.precision, ceil_div(d.OC, block_size), block_size,
                  (d.dbias, d.partial, np.int32(d.chunks), np.int32(d.OC)))


def backward_v1(d, block_size):
    BIAS_BACKWARD_V1.launch(d.precision, ceil_div(d.OC, block_size), block_size,
                            (d.dbias, d.dout, np.int32(d.N), np.int32(d.OC)))


def backward_v2(d, block_size):
    BIAS_BACKWARD_V2.launch(d.precision, (ceil_div(d.OC, block_size), d.chunks), block_size,
                            (d.partial, d.dout, np.int32(d.N), np.int32(d.OC)))
    reduce_chunks(d, block_size, BIAS_REDUCE_V2)


def backward_v3(d, block_size, reduce_kernel=BIAS_REDUCE_V2, backward_kernel=BIAS_BACKWARD):
    width = vector_size(d.precision) if d.OC % vector_size(d.precision) == 0 else 1
    backward_kernel.launch(d.precision, (ceil_div(d.OC, WARP_SIZE * width), d.chunks), block_size,
                           (d.partial, d.dout, np.int32(d.N), np.int32(d.OC)), shared_mem=block_size * width * 4)
    reduce_chunks(d, block_size, reduce_kernel)


def backward_v4(d, block_size):
    backward_v3(d, block_size, BIAS_REDUCE)


def backward_v5(d, block_size):
    backward_v3(d, block_size, BIAS_REDUCE, BIAS_BACKWARD_V5)      # launched as llmc.matmul.bias_backward launches ours


SIZES = dict(N=8 * 1024, OC=3072)                # the MLP's fc bias at B=8, T=1024 (GPT-2 124M)
TEST_SIZES = dict(N=3003, OC=40)                 # 12 rows per chunk, the last chunks short or empty
PROGRESSIONS = [
    Progression("bias_backward", make_backward_case, [
        Version(1, "naive port, one thread per column over all rows", (BIAS_BACKWARD_V1,), backward_v1),
        Version(2, "row chunks into fp32 partials, one column per thread, then the reduce",
                (BIAS_BACKWARD_V2, BIAS_REDUCE_V2), backward_v2),
        Version(3, "x128 loads, a warp per row, warps' sums in shared memory, then the reduce",
                (BIAS_BACKWARD, BIAS_REDUCE_V2), backward_v3),
        Version(4, "production: version 3 with 16 running sums per column in the reduce",
                (BIAS_BACKWARD, BIAS_REDUCE), backward_v4),
        Version(5, "candidate: version 4 with 4 of a lane's row loads in flight",
                (BIAS_BACKWARD_V5, BIAS_REDUCE), backward_v5, drop_in=True),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
