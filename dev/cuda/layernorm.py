"""
dev/cuda/layernorm.py: LayerNorm forward, the fused residual + LayerNorm, and LayerNorm backward,
from naive ports to kernels/layernorm.cu.

layernorm_forward, out = (x - mean) * rstd * weight + bias per row of C (N = B*T rows):
  version 1 (dev/cuda/layernorm.cu layernorm_forward_v1) is the naive port of
            gpt2_cpu.layernorm_forward: one thread per row, looping over C three times. Slow:
            a warp's 32 threads read 32 rows, C elements apart, so every load instruction
            touches 32 cache lines, and only N threads exist.
  version 2 (layernorm_forward_v2) gives each row a warp: lanes read consecutive channels
            (one coalesced 64/128-byte access per load) and sum with warp shuffles; 32x more
            threads share the work.
  version 3 (kernels/layernorm.cu layernorm_forward, production) keeps the warp per row and
            loads x128 groups (16 bytes per lane: 4-8x fewer load instructions), with
            streaming hints on the last read of the row and the output.
fused_residual_forward, residual = inp1 + inp2, then the LayerNorm of it, in one kernel:
  versions 1, 2, 3 are the same three steps (thread per row; warp per row; production x128).
  Fusing saves re-reading the residual from DRAM for the LayerNorm (it is still in L1/L2).
  Version 3 also takes the bias of the projection that wrote inp2 (gpt2_cuda runs the
  attention and MLP projections' GEMMs without theirs); here it gets NULL, the math of 1 and 2.
layernorm_backward, dinp += ..., dweight += ..., dbias += ... (gpt2_cpu.layernorm_backward):
  version 1 (layernorm_backward_v1) is the naive port: one thread per row, and every element's
            dweight/dbias term atomically added to one fp32 (2, C) scratch: uncoalesced rows,
            and N contending atomics per channel.
  version 2 (layernorm_backward_v2): one warp per row (coalesced, shuffles); each block sums
            its rows' dweight/dbias in shared memory first, so the global atomics drop from one
            per element to one per channel per block.
  version 3 (kernels/layernorm.cu layernorm_backward + dev/cuda/layernorm.cu
            layernorm_param_reduce_v3): x128 loads, and no atomics: each of a fixed number of
            blocks (gpt2_cuda's LAYERNORM_BACKWARD_GRID) writes its partial sums to its own scratch
            slot, and a second kernel adds the slots in order, so the result is bit-reproducible.
            That second kernel gives each of the C channels one thread summing its G slots one
            after the other: C = 768 threads on a GPU of 132 SMs, each with 2G dependent loads.
            On the H100 this version took 26% longer than version 2 (0.056 against 0.044 ms at
            B=8, T=1024, C=768), whose reduction sums one slot: the slots' sum was the cost.
  version 4 (kernels/layernorm.cu layernorm_backward + layernorm_param_reduce, production):
            version 3's backward, its slots summed by blocks of warps: a block owns 32 adjacent
            columns of the 2C (dbias, then dweight), its W warps share the slots (lane l of warp w
            sums column l over slots w, w + W, ...: one coalesced 128-byte segment per warp and
            slot), and warp 0 adds the W warp sums in warp order. 2C/32 = 48 blocks of 16 warps
            for GPT-2: 24x the threads of version 3, each with 1/16 of the dependent loads. The
            order of the sums is fixed by G and the block size (gpt2_cuda's
            LAYERNORM_PARAM_REDUCE_BLOCK_SIZE), so it is still deterministic. Measured on the H100
            at block 512: 0.039 ms, 30% faster than version 3 and 12% faster than version 2.
  Versions 1 and 2 also finish with the production layernorm_param_reduce, over their one slot.
  version 5 (candidate; kernels/layernorm.cu layernorm_backward + dev/cuda/layernorm.cu
            layernorm_param_reduce_v5): version 4, each lane of the reduce keeping 8 running sums,
            so that 8 of its slot loads are in flight at once. On the H200 (2026-11-27) version 4
            took 0.0345 ms here, and in the B=16 step its reduce took 14 us a call (0.35 ms of the
            step for 25 LayerNorms) to sum 3.1 MB of slots: each lane's 32 loads waited one by one.
  version 6 (candidate; layernorm_backward_v6 + layernorm_param_reduce_v5): version 5, and the
            backward's partial sums with x128 loads: thread t sums the group t % 96 (GPT-2 in bf16)
            over every 5th row of the block (5 row phases of 96 groups at 512 threads), the phases
            added in shared memory in phase order. Version 4 gives a thread one channel (2-byte
            loads, 8x the load instructions) and all the block's rows, and at C = 768 half of its
            512 threads take two channels. The input gradient is the same code
            (kernels/layernorm.cuh).
  Both candidates launch exactly as version 4 (grid, blocks, slots): `dev/bench.py --candidate
  layernorm:5` (or 6) times the whole step with them in its place.
layernorm_backward_projection_bias, the same with dprojb += the column sums of dinp as it leaves
(gpt2_cuda.py --ln-bias-grad 1: dinp is then the whole gradient of a residual stream that a
projection's output, bias included, was added into, so these are that bias's gradient, and the
projection's dweight GEMM runs without its BGRADB epilogue, or without a bias_backward):
  version 1 (layernorm_backward's version 4, then kernels/bias.cu's bias_backward over dinp):
            the option off at --bias-grad-epilogue 0, the bias gradient a pass over (N,C) of its own.
  version 2 (kernels/layernorm.cu layernorm_backward with sum_dinp = 1 + layernorm_param_reduce
            given dprojb, production): version 4 with a third partial sum a slot; its threads
            read back the dinp rows that part 1's warps wrote, after a barrier (from L2, not DRAM).
  version 3 (candidate) and version 4 (candidate): candidates 5 and 6 with the third sum. Against
            layernorm_backward's table, the difference is what the option costs the LayerNorm.

Napkin math (minimum traffic; N rows, C channels): forward reads N*C and writes N*C floatX plus
2N floats of statistics; fused reads 2N*C, writes 2N*C; backward reads dout, inp and dinp, writes
dinp (4N*C) and reads the statistics.

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/layernorm.py         # all three progressions, every version, bf16
    python dev/cuda/layernorm.py 2 -p fp32
writes dev/results/dev_cuda_layernorm.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
from gpt2_cuda import (LAYERNORM_PARAM_REDUCE_BLOCK_SIZE, layernorm_backward_grid,  # noqa: E402  (production's grids)
                       layernorm_param_reduce_grid)
from llmc.cuda import BLOCK_SIZE, ceil_div, elementwise_grid, warp_row_grid  # noqa: E402
from llmc.matmul import bias_backward, bias_backward_chunks  # noqa: E402

OP = "layernorm"
LAYERNORM_FORWARD_V1 = dev_kernel(OP, "layernorm_forward_v1")
LAYERNORM_FORWARD_V2 = dev_kernel(OP, "layernorm_forward_v2")
FUSED_RESIDUAL_FORWARD_V1 = dev_kernel(OP, "fused_residual_forward_v1")
FUSED_RESIDUAL_FORWARD_V2 = dev_kernel(OP, "fused_residual_forward_v2")
LAYERNORM_BACKWARD_V1 = dev_kernel(OP, "layernorm_backward_v1")
LAYERNORM_BACKWARD_V2 = dev_kernel(OP, "layernorm_backward_v2")
LAYERNORM_PARAM_REDUCE_V3 = dev_kernel(OP, "layernorm_param_reduce_v3")
LAYERNORM_PARAM_REDUCE_V5 = dev_kernel(OP, "layernorm_param_reduce_v5")
LAYERNORM_BACKWARD_V6 = dev_kernel(OP, "layernorm_backward_v6")
LAYERNORM_FORWARD = production_kernel("layernorm", "layernorm_forward")
FUSED_RESIDUAL_FORWARD = production_kernel("layernorm", "fused_residual_forward")
LAYERNORM_BACKWARD = production_kernel("layernorm", "layernorm_backward")
LAYERNORM_PARAM_REDUCE = production_kernel("layernorm", "layernorm_param_reduce")
BIAS_BACKWARD = production_kernel("bias", "bias_backward")
BIAS_REDUCE = production_kernel("bias", "bias_reduce")


# ----------------------------------------------------------------------------
# problems: inputs, references from gpt2_cpu.py

def layer_inputs(case, rng, B, T, C):
    """Scalars N, C; inputs inp (B,T,C) ~ 2 N(0,1) + 0.5 (a nonzero mean), weight, bias (C,).
    Returns the float64 values the kernels see."""
    case.scalar("N", B * T)
    case.scalar("C", C)
    x = case.input("inp", rng.standard_normal((B, T, C)) * 2 + 0.5)
    return x, case.input("weight", rng.standard_normal(C)), case.input("bias", rng.standard_normal(C))


def make_forward_case(rng, precision, B, T, C):
    """out, mean, rstd = gpt2_cpu.layernorm_forward(inp, weight, bias)."""
    case = common.Case(precision)
    x, w, b = layer_inputs(case, rng, B, T, C)
    out, mean, rstd = gpt2_cpu.layernorm_forward(x, w, b)
    for name, shape, kind, ref in (("out", (B, T, C), "X", out), ("mean", (B, T), "f32", mean),
                                   ("rstd", (B, T), "f32", rstd)):
        case.output(name, shape, kind)
        case.check(name, ref, "layernorm_forward")
    case.bytes = common.napkin_bytes(precision, floatX=2 * B * T * C + 2 * C, float32=2 * B * T)
    return case


def make_fused_case(rng, precision, B, T, C):
    """residual = inp + inp2 (rounded to floatX), then gpt2_cpu.layernorm_forward of it."""
    case = common.Case(precision)
    x, w, b = layer_inputs(case, rng, B, T, C)
    x2 = case.input("inp2", rng.standard_normal((B, T, C)))
    residual = common.to_float64(common.to_device_dtype(gpt2_cpu.residual_forward(x, x2), "X", precision), "X", precision)
    normed, mean, rstd = gpt2_cpu.layernorm_forward(residual, w, b)
    for name, shape, kind, ref, key in (("residual", (B, T, C), "X", residual, "residual_forward"),
                                        ("normed", (B, T, C), "X", normed, "layernorm_forward"),
                                        ("mean", (B, T), "f32", mean, "layernorm_forward"),
                                        ("rstd", (B, T), "f32", rstd, "layernorm_forward")):
        case.output(name, shape, kind)
        case.check(name, ref, key)
    case.bytes = common.napkin_bytes(precision, floatX=4 * B * T * C + 2 * C, float32=2 * B * T)
    return case


def make_backward_case(rng, precision, B, T, C, projection_bias=False):
    """dinp, dweight, dbias accumulate gpt2_cpu.layernorm_backward's gradients; with
    projection_bias, dprojb also accumulates the column sums of dinp as it leaves (the bias
    gradient of the projection whose output is this residual: gpt2_cuda.py --ln-bias-grad)."""
    case = common.Case(precision)
    x, w, _ = layer_inputs(case, rng, B, T, C)
    _, mean, rstd = gpt2_cpu.layernorm_forward(x, w, np.zeros(C))
    mean, rstd = case.input("mean", mean, "f32"), case.input("rstd", rstd, "f32")   # as fp32, like the forward's
    dout = case.input("dout", rng.standard_normal((B, T, C)))
    dinp = case.input("dinp", rng.standard_normal((B, T, C)))                         # all accumulate
    dweight, dbias = case.input("dweight", rng.standard_normal(C)), case.input("dbias", rng.standard_normal(C))
    dinp = dinp + gpt2_cpu.layernorm_backward(dweight, dbias, dout, x, w, mean, rstd)
    for name, ref in (("dinp", dinp), ("dweight", dweight), ("dbias", dbias)):
        case.check(name, ref, "layernorm_backward")
    sums = 2
    if projection_bias:
        dprojb = case.input("dprojb", rng.standard_normal(C))
        # the kernel sums dinp as stored: rounded to floatX (bf16's rounding, summed over B*T rows, would
        # exceed the tolerance in the float64 sum), as the BGRADB epilogue and bias_backward read it
        stored = common.to_float64(common.to_device_dtype(dinp, "X", precision), "X", precision)
        case.check("dprojb", dprojb + stored.reshape(-1, C).sum(axis=0), "layernorm_backward")
        case.scratch("bias_partial", bias_backward_chunks(B * T) * C)    # version 1's bias_backward
        sums = 3
    G = layernorm_backward_grid(B * T)
    case.scalar("G", G)
    case.scalar("sums", sums)
    case.scratch("scratch", G * sums * C)       # production: (G, sums, C) slots; versions 1, 2 use (2, C)
    case.bytes = common.napkin_bytes(precision, floatX=(4 + (sums - 2)) * B * T * C + (sums + 3) * C,
                                     float32=2 * B * T)
    return case


def make_projection_bias_case(rng, precision, B, T, C):
    """make_backward_case with the projection's bias gradient summed too."""
    return make_backward_case(rng, precision, B, T, C, projection_bias=True)


# ----------------------------------------------------------------------------
# launchers: grids as gpt2_cuda.py computes them

def forward_args(d):
    return (d.out, d.mean, d.rstd, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C))


def forward_v1(d, block_size):
    LAYERNORM_FORWARD_V1.launch(d.precision, ceil_div(d.N, block_size), block_size, forward_args(d))


def forward_v2(d, block_size):
    LAYERNORM_FORWARD_V2.launch(d.precision, warp_row_grid(d.N, block_size), block_size, forward_args(d))


def forward_v3(d, block_size):
    LAYERNORM_FORWARD.launch(d.precision, warp_row_grid(d.N, block_size), block_size, forward_args(d))


def fused_args(d):
    return (d.residual, d.normed, d.mean, d.rstd, d.inp, d.inp2, d.weight, d.bias, np.int32(d.N), np.int32(d.C))


def fused_v1(d, block_size):
    FUSED_RESIDUAL_FORWARD_V1.launch(d.precision, ceil_div(d.N, block_size), block_size, fused_args(d))


def fused_v2(d, block_size):
    FUSED_RESIDUAL_FORWARD_V2.launch(d.precision, warp_row_grid(d.N, block_size), block_size, fused_args(d))


def fused_v3(d, block_size):
    args = fused_args(d)                  # the production kernel also folds in inp2's projection bias:
    FUSED_RESIDUAL_FORWARD.launch(d.precision, warp_row_grid(d.N, block_size), block_size,
                                  args[:6] + (np.uint64(0),) + args[6:])   # NULL, the math of versions 1-2


def backward_args(d):
    """gpt2_cuda.layernorm_backward's arguments to layernorm_backward: sum_dinp = 1 with dprojb."""
    return (d.dinp, d.scratch, d.dout, d.inp, d.weight, d.mean, d.rstd, np.int32(d.N), np.int32(d.C),
            np.int32(d.sums - 2))


def reduce_args(d, num_slots):
    """The reduce's arguments: dprojb, or NULL (np.uint64(0)) for two sums a slot."""
    return (d.dweight, d.dbias, d.dprojb if d.sums == 3 else np.uint64(0), d.scratch, np.int32(num_slots),
            np.int32(d.C))


def param_reduce(d, num_slots, block_size=LAYERNORM_PARAM_REDUCE_BLOCK_SIZE):
    """dweight, dbias (, dprojb) += the sum of the first num_slots slots of the scratch: production's reduce."""
    LAYERNORM_PARAM_REDUCE.launch(d.precision, layernorm_param_reduce_grid(d.C, d.sums), block_size,
                                  reduce_args(d, num_slots))


def backward_v1(d, block_size):
    d.scratch[:2 * d.C].fill(0)
    LAYERNORM_BACKWARD_V1.launch(d.precision, ceil_div(d.N, block_size), block_size, backward_args(d)[:-1])
    param_reduce(d, 1)


def backward_v2(d, block_size):
    d.scratch[:2 * d.C].fill(0)
    LAYERNORM_BACKWARD_V2.launch(d.precision, warp_row_grid(d.N, block_size), block_size, backward_args(d)[:-1],
                                 shared_mem=2 * d.C * 4)
    param_reduce(d, 1)


def backward_v3(d, block_size):
    LAYERNORM_BACKWARD.launch(d.precision, d.G, block_size, backward_args(d))
    LAYERNORM_PARAM_REDUCE_V3.launch(d.precision, elementwise_grid(d.C), BLOCK_SIZE,    # one thread per channel
                                     (d.dweight, d.dbias, d.scratch, np.int32(d.G), np.int32(d.C)))


def backward_v4(d, block_size):
    LAYERNORM_BACKWARD.launch(d.precision, d.G, block_size, backward_args(d))     # gpt2_cuda.layernorm_backward
    param_reduce(d, d.G, block_size)


def backward_then_bias(d, block_size):
    """The projection's bias gradient the unfused way: production's two kernels with two sums, then
    gpt2_cuda's bias_backward over the dinp they left (as at --bias-grad-epilogue 0)."""
    LAYERNORM_BACKWARD.launch(d.precision, d.G, block_size, backward_args(d)[:-1] + (np.int32(0),))
    LAYERNORM_PARAM_REDUCE.launch(d.precision, layernorm_param_reduce_grid(d.C), LAYERNORM_PARAM_REDUCE_BLOCK_SIZE,
                                  (d.dweight, d.dbias, np.uint64(0), d.scratch, np.int32(d.G), np.int32(d.C)))
    bias_backward(d.dprojb, d.dinp, d.bias_partial, d.N, d.C)


def backward_candidate(backward_kernel):
    """A candidate launched as gpt2_cuda.layernorm_backward launches production's two kernels (the
    grid G, the reduce's grid and fixed block), backward_kernel and layernorm_param_reduce_v5 in their
    places: a drop-in for dev/bench.py --candidate."""
    def launch(d, block_size):
        backward_kernel.launch(d.precision, d.G, block_size, backward_args(d))
        LAYERNORM_PARAM_REDUCE_V5.launch(d.precision, layernorm_param_reduce_grid(d.C, d.sums),
                                         LAYERNORM_PARAM_REDUCE_BLOCK_SIZE, reduce_args(d, d.G))
    return launch


SIZES = dict(B=8, T=1024, C=768)                 # GPT-2 124M
TEST_SIZES = dict(B=2, T=37, C=96)               # 74 rows: partial blocks; C = 3 warps of 32
PROGRESSIONS = [
    Progression("layernorm_forward", make_forward_case, [
        Version(1, "naive port, one thread per row", (LAYERNORM_FORWARD_V1,), forward_v1),
        Version(2, "one warp per row, coalesced loads, shuffle reductions", (LAYERNORM_FORWARD_V2,), forward_v2),
        Version(3, "production: warp per row with x128 loads, streaming hints", (LAYERNORM_FORWARD,), forward_v3),
    ], SIZES, TEST_SIZES),
    Progression("fused_residual_forward", make_fused_case, [
        Version(1, "naive port, one thread per row", (FUSED_RESIDUAL_FORWARD_V1,), fused_v1),
        Version(2, "one warp per row, coalesced loads, shuffle reductions", (FUSED_RESIDUAL_FORWARD_V2,), fused_v2),
        Version(3, "production: warp per row with x128 loads", (FUSED_RESIDUAL_FORWARD,), fused_v3),
    ], SIZES, TEST_SIZES),
    Progression("layernorm_backward", make_backward_case, [
        Version(1, "naive port, one thread per row, global fp32 atomics",
                (LAYERNORM_BACKWARD_V1, LAYERNORM_PARAM_REDUCE), backward_v1),
        Version(2, "one warp per row, per-block sums in shared memory, fewer atomics",
                (LAYERNORM_BACKWARD_V2, LAYERNORM_PARAM_REDUCE), backward_v2),
        Version(3, "x128, per-block scratch slots summed one thread per channel, deterministic",
                (LAYERNORM_BACKWARD, LAYERNORM_PARAM_REDUCE_V3), backward_v3),
        Version(4, "production: version 3's slots summed by blocks of warps, deterministic",
                (LAYERNORM_BACKWARD, LAYERNORM_PARAM_REDUCE), backward_v4),
        Version(5, "candidate: version 4, its reduce with 8 of a lane's slot loads in flight",
                (LAYERNORM_BACKWARD, LAYERNORM_PARAM_REDUCE_V5), backward_candidate(LAYERNORM_BACKWARD),
                drop_in=True),
        Version(6, "candidate: version 5, the partial sums with x128 loads over row phases",
                (LAYERNORM_BACKWARD_V6, LAYERNORM_PARAM_REDUCE_V5), backward_candidate(LAYERNORM_BACKWARD_V6),
                drop_in=True),
    ], SIZES, TEST_SIZES),
    Progression("layernorm_backward_projection_bias", make_projection_bias_case, [
        Version(1, "unfused: layernorm_backward's version 4, then bias_backward over dinp, a pass of its own",
                (LAYERNORM_BACKWARD, LAYERNORM_PARAM_REDUCE, BIAS_BACKWARD, BIAS_REDUCE), backward_then_bias),
        Version(2, "production: layernorm_backward's version 4, also summing dinp's columns into dprojb",
                (LAYERNORM_BACKWARD, LAYERNORM_PARAM_REDUCE), backward_v4),
        Version(3, "candidate: layernorm_backward's candidate 5 with the third sum",
                (LAYERNORM_BACKWARD, LAYERNORM_PARAM_REDUCE_V5), backward_candidate(LAYERNORM_BACKWARD)),
        Version(4, "candidate: layernorm_backward's candidate 6 with the third sum",
                (LAYERNORM_BACKWARD_V6, LAYERNORM_PARAM_REDUCE_V5), backward_candidate(LAYERNORM_BACKWARD_V6)),
    ], SIZES, TEST_SIZES),
]

if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
