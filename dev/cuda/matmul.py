"""
dev/cuda/matmul.py: the linear layer's matmul, from a naive kernel to tensor cores, beside cuBLAS
and cuBLASLt.

matmul_forward, out (N,OC) = inp (N,C) @ weight^T + bias, N = B*T rows, weight (OC,C) (nn.Linear),
at GPT-2 124M's four layer shapes with B = 16, T = 1024 (N = 16384 rows): qkv (C -> 3C), attproj
(C -> C), fc (C -> 4C), fcproj (4C -> C):
  version 1 (dev/cuda/matmul.cu matmul_forward_v1) is the naive port: one thread per output
            element, the dot-product loop of gpt2_cpu.matmul_forward for one (n, o); every FMA
            loads its two operands from the caches.
  version 2 (matmul_forward_v2) tiles through shared memory: a tile x tile block loads a tile of
            inp and of weight once and every thread reuses them tile times, so global traffic
            drops by the factor tile (block 64, 256, 1024 = tiles 8, 16, 32); now shared memory
            (two loads per FMA) is the bottleneck.
  version 3 (matmul_forward_v3) tiles through registers: each of 256 threads owns an 8 x 8 tile
            of a 128 x 128 output block and, per step, turns 8 + 8 shared-memory values into 64
            FMAs (an outer product): 4 FMAs per shared-memory load instead of 0.5. The larger a
            thread's tile, the higher this arithmetic intensity, until registers run out.
  version 4 (library call: cuBLAS, llmc.matmul.matmul_forward itself, the production path): the
            GEMM writes out (beta = 0), then kernels/bias.cu add_bias adds the bias in place with
            16-byte accesses (an earlier form copied the bias into out and accumulated the GEMM
            onto it: a CuPy broadcast copy plus a GEMM that reads C); tensor cores in bf16, fp32
            FMA units in fp32 (llmc.cuda.gemm, no TF32 unless the trainer's -f asks for it).
  version 5 (library call: cuBLASLt through llmc.cublaslt.matmul_forward_lt) adds the bias in the
            GEMM's epilogue: one launch, no bias copy. Skipped with its reason where
            llmc/cublaslt.py or nvmath-python is missing.
  version 6 (matmul_forward_v6) moves v3's 128 x 128 block tile onto the tensor cores: 4 warps of
            64 x 64 outputs, each a 4 x 8 grid of mma.sync.m16n8k16 accumulators fed by ldmatrix.x4
            from shared memory (kernels/tensor_core.cuh); one instruction does 2048 FMAs. Loads are
            synchronous and the tiles stored plainly: a 4-way bank conflict on every ldmatrix.
  version 7 (matmul_forward_v7) streams the K sum through a 4-stage cp.async pipeline (the next
            three slices in flight while one is computed, fragments double-buffered in registers)
            and stores each tile row's 16-byte chunks XOR-swizzled: no bank conflicts, no padding.
  version 8 (matmul_forward_<tile>_v8) picks the block tile per shape (block 128: 128 x 128 outputs,
            4 stages, two blocks an SM; block 256: 128 x 256, 3 stages, one block an SM; the table
            times both), orders the blocks in groups of 16 tile rows (operands stay in L2), and
            stores through shared memory with 16-byte stores, the bias added there: one launch.
matmul_forward_gelu_fc, the MLP's first layer with its GELU (pre_gelu = inp @ weight^T + bias, out
= gelu(pre_gelu)): version 4 cuBLAS + kernels/gelu.cu (the production path), 5 cuBLASLt's
GELU_AUX_BIAS epilogue, 8 the tensor-core GEMM with the bias and GELU in its epilogue.
matmul_backward (the same products transposed):
  version 4 (llmc.matmul.matmul_backward): dinp = dout @ weight and dweight += dout^T @ inp with
            cuBLAS, dbias += column sums of dout with kernels/bias.cu.
  version 5 (llmc.cublaslt.matmul_backward_lt): the same with dbias summed in dweight's epilogue
            (BGRADB; kernels/bias.cu where cuBLASLt has no algorithm for it).
  version 8 (matmul_backward_dinp_<tile>_v8, matmul_backward_dweight_<tile>_v8,
            matmul_split_k_reduce_v8): dinp with v8's kernel reading weight (OC,C) as a (K, N)
            matrix through ldmatrix .trans; dweight with both dout and inp read through .trans and
            the sum over tokens split across blocks (its outputs are few tiles: 36 for 768 x 768
            on 132 SMs) into fp32 partials, added in order by the reduction; dbias as version 4.
The classifier's shapes (C -> the vocabulary; versions 4, 5, 8 forward and backward): GPT-2's
(768 -> Vp = 50304), llama3:d4's (256 -> V = 50257, odd) and d4's padded (256 -> 50304), to
measure what an unpadded vocabulary costs cuBLAS (llama3_cuda.py pads nothing).

Versions 1-3 compute in fp32 from floatX inputs and round each output once, as our kernels do;
versions 6-8 multiply bf16 on the tensor cores with fp32 accumulators and also round once. They
are bf16 only (the fp32 build of matmul.cu has versions 1-3; with -p fp32 versions 6-8 are skipped
with that reason) and take C and OC multiples of 8 (every row whole 16-byte chunks; the odd
classifier skips them, their launchers refuse it); N may be anything. A Hopper version (wgmma,
TMA) is not here: wgmma's operands come from shared-memory descriptors with hardware swizzle modes
and TMA's copies from tensor maps built by the driver, which the emulated device (sm_80) does not
have, so such a kernel could neither be validated in `make test` nor stepped through in gdb.
Napkin math: FLOPs = 2 N C OC per GEMM (one multiply and one add per term; the bias's N*OC adds
are not counted); bytes = each operand read once and out written once, the least any version
can move. The table shows TFLOP/s and their share of the cuBLAS GEMM the harness measures in the
same run (8192^3, same precision). Inputs: inp, bias ~ N(0,1) and weight ~ N(0,1/C), so every
output is ~ N(0,1) like a real layer's, whatever C: the kernel tolerances mean the same at
every shape.

Run (needs a CUDA GPU; without one it says so in one line and exits 2):
    python dev/cuda/matmul.py            # every version, every shape, bf16
    python dev/cuda/matmul.py 3 -p fp32  # version 3 only, fp32
    python dev/cuda/matmul.py --versions 3-8 --exclude '*llama3*'   # skip the slow naive versions
    python dev/cuda/matmul.py --device cpu    # validate every version on the emulated device (~10 s)
prints a validation line per (version, block size), then one table per progression (time,
TFLOP/s, % of the measured cuBLAS GEMM), written to dev/results/dev_cuda_matmul.md (with
--versions too: the table then has those versions only).
"""

import argparse
import dataclasses
import fnmatch
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Kernel, Progression, Version, dev_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
import gpt2_cuda  # noqa: E402  (imports CuPy only when a launcher runs)
import llmc.matmul  # noqa: E402
from llmc import cuda  # noqa: E402
from llmc.cuda import ceil_div, require  # noqa: E402

OP = "matmul"
LIBRARY_BLOCK_SIZES = (0,)          # "block 0" in the table: the library picks its own launch
MAX_GRID_Y = 65535                  # CUDA's limit on gridDim.y (v1 puts the N rows there)
V1_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
V2_TILES = {64: 8, 256: 16, 1024: 32}   # block size -> tile (tile x tile threads)
V3_THREADS = 256                    # matmul.cu V3_THREADS: 16 x 16 threads of 8 x 8 outputs
V3_BLOCK_TILE = 128                 # matmul.cu V3_BLOCK_ROWS = V3_BLOCK_COLS

BF16_BYTES = 2
FP32_BYTES = 4
TENSOR_CORE_ROW_MULTIPLE = 8        # bf16 per 16 bytes: C and OC rows must be whole 16-byte chunks
DEFAULT_DYNAMIC_SHARED_BYTES = 48 * 1024    # what a launch may ask for without the opt-in (CUDA's rule)


@dataclasses.dataclass(frozen=True)
class TensorCoreTile:
    """A tensor-core version's block tile, as matmul.cu's constants: bm x bn outputs per block of
    `threads` threads, bk columns of the K sum per stage, `stages` stages of shared memory (1: v6's
    single static tile). `name` is the v8 kernels' infix (matmul_forward_<name>_v8)."""
    bm: int
    bn: int
    bk: int
    stages: int
    threads: int
    name: str = ""

    @property
    def shared_bytes(self):
        """Dynamic shared memory of a launch: every stage holds a (bm, bk) and a (bn, bk) bf16 tile."""
        return self.stages * (self.bm + self.bn) * self.bk * BF16_BYTES


V6_TILE = TensorCoreTile(128, 128, 32, 1, 128)              # matmul.cu V6_*
V7_TILE = TensorCoreTile(128, 128, 32, 4, 128)              # matmul.cu V7Config: 64 KiB
V8_TILES = {128: TensorCoreTile(128, 128, 32, 4, 128, "128x128"),     # matmul.cu V8SmallConfig: 64 KiB
            256: TensorCoreTile(128, 256, 32, 3, 256, "128x256")}     # V8LargeConfig: 72 KiB
# Resident blocks per SM of each v8 tile, for the split of dweight's K sum: ptxas gives the
# kernels up to 255 registers a thread (tests/test_dev_cuda_matmul_attention.py), so 128 threads
# take 32768 of an SM's 65536 registers (two blocks) and 256 take all of them (one block); the
# shared memory (64 and 72 KiB a block) allows as many on an A100 (164 KiB) and an H100 (228 KiB).
V8_BLOCKS_PER_SM = {128: 2, 256: 1}
# dweight's split-K partial sums (fp32, splits x OC x C) stay below this: about two thirds of an
# H100's 50 MiB L2, so the partials the GEMM writes are mostly still in L2 when the reduction
# reads them back.
SPLIT_K_BUDGET_BYTES = 32 * 1024 * 1024
MAX_SPLITS = 16
REDUCE_BLOCK_SIZE = 256

MATMUL_V1 = dev_kernel(OP, "matmul_forward_v1")
MATMUL_V2 = dev_kernel(OP, "matmul_forward_v2")
MATMUL_V3 = dev_kernel(OP, "matmul_forward_v3")
MATMUL_V6 = dev_kernel(OP, "matmul_forward_v6")
MATMUL_V7 = dev_kernel(OP, "matmul_forward_v7")
MATMUL_FORWARD_V8 = {t: dev_kernel(OP, f"matmul_forward_{tile.name}_v8") for t, tile in V8_TILES.items()}
MATMUL_FORWARD_GELU_V8 = {t: dev_kernel(OP, f"matmul_forward_gelu_{tile.name}_v8") for t, tile in V8_TILES.items()}
DINP_V8 = {t: dev_kernel(OP, f"matmul_backward_dinp_{tile.name}_v8") for t, tile in V8_TILES.items()}
DWEIGHT_V8 = {t: dev_kernel(OP, f"matmul_backward_dweight_{tile.name}_v8") for t, tile in V8_TILES.items()}
SPLIT_K_REDUCE_V8 = dev_kernel(OP, "matmul_split_k_reduce_v8")
# a library call launches kernels of its own choosing: these name the call in the table only
CUBLAS_GEMM = Kernel("llmc/cuda.py", "cublas_gemm")
CUBLASLT_MATMUL = Kernel("llmc/cublaslt.py", "cublaslt_matmul")


# ----------------------------------------------------------------------------
# napkin math

def matmul_forward_flops(N, C, OC):
    """FLOPs of out (N,OC) = inp (N,C) @ weight^T: 2 N C OC (the bias's N*OC adds not counted)."""
    return common.gemm_flops(N, OC, C)


def matmul_backward_flops(N, C, OC):
    """FLOPs of the backward's two GEMMs, dinp = dout @ weight and dweight = dout^T @ inp:
    2 x 2 N C OC (the bias gradient's N*OC adds not counted)."""
    return 2 * common.gemm_flops(N, C, OC)


# ----------------------------------------------------------------------------
# problems: inputs, references from gpt2_cpu.py

def make_forward_case(rng, precision, B, T, C, OC):
    """inp (N,C), weight (OC,C), bias (OC,) -> out (N,OC) = gpt2_cpu.matmul_forward(...)."""
    N = B * T
    case = common.Case(precision)
    for name, value in dict(B=B, T=T, N=N, C=C, OC=OC).items():
        case.scalar(name, value)
    inp = case.input("inp", rng.standard_normal((N, C)))
    weight = case.input("weight", rng.standard_normal((OC, C)) / math.sqrt(C))   # out ~ N(0,1)
    bias = case.input("bias", rng.standard_normal(OC))
    case.output("out", (N, OC))
    case.check("out", gpt2_cpu.matmul_forward(inp.reshape(B, T, C), weight, bias).reshape(N, OC), "matmul")
    case.bytes = common.napkin_bytes(precision, floatX=N * C + OC * C + OC + N * OC)
    case.flops = matmul_forward_flops(N, C, OC)
    return case


def make_backward_case(rng, precision, B, T, C, OC):
    """dout (N,OC), inp (N,C), weight (OC,C) -> dinp (N,C) written; dweight (OC,C), dbias (OC,)
    accumulated onto random starting values as large as the sums (so a version that writes
    instead of adding fails).
    dweight and dbias are sums over N rows of O(1) terms, ~ sqrt(N) large: their atol is scaled
    by sqrt(N) (common.Case.check's scale)."""
    N = B * T
    case = common.Case(precision)
    for name, value in dict(B=B, T=T, N=N, C=C, OC=OC).items():
        case.scalar(name, value)
    inp = case.input("inp", rng.standard_normal((N, C)))
    weight = case.input("weight", rng.standard_normal((OC, C)) / math.sqrt(C))
    dout = case.input("dout", rng.standard_normal((N, OC)))
    dweight = case.input("dweight", rng.standard_normal((OC, C)) * math.sqrt(N))   # as large as what is added
    dbias = case.input("dbias", rng.standard_normal(OC) * math.sqrt(N))
    case.output("dinp", (N, C))
    case.scratch("scratch", llmc.matmul.bias_backward_chunks(N) * OC, "f32")      # bias_backward's slots
    case.scratch("partial", split_k_partial_floats(C, OC), "f32")                 # version 8's dweight splits
    dinp = gpt2_cpu.matmul_backward(dweight, dbias, dout.reshape(B, T, OC), inp.reshape(B, T, C), weight)  # += in place
    case.check("dinp", dinp.reshape(N, C), "matmul")
    case.check("dweight", dweight, "matmul", scale=math.sqrt(N))
    case.check("dbias", dbias, "matmul", scale=math.sqrt(N))
    # read dout, inp, weight; write dinp; read and write dweight, dbias
    case.bytes = common.napkin_bytes(precision, floatX=N * OC + 2 * N * C + 3 * OC * C + 2 * OC)
    case.flops = matmul_backward_flops(N, C, OC)
    return case


def make_forward_gelu_case(rng, precision, B, T, C, OC):
    """The MLP's first layer: inp (N,C), weight (OC,C), bias (OC,) -> pre_gelu (N,OC) =
    gpt2_cpu.matmul_forward(...) and out (N,OC) = gpt2_cpu.gelu_forward(pre_gelu)."""
    case = make_forward_case(rng, precision, B, T, C, OC)
    N = B * T
    (_, pre_gelu, _, _), = case.checks                           # make_forward_case's reference for out
    case.checks.clear()
    case.output("pre_gelu", (N, OC))
    case.check("pre_gelu", pre_gelu, "matmul")
    case.check("out", gpt2_cpu.gelu_forward(pre_gelu), "matmul")
    case.bytes = common.napkin_bytes(precision, floatX=N * C + OC * C + OC + 2 * N * OC)   # two outputs
    return case


def split_k_partial_floats(C, OC):
    """fp32 values of version 8's dweight partial sums: one (OC, C) product per split, as many
    splits as SPLIT_K_BUDGET_BYTES holds (at most MAX_SPLITS), and at least one."""
    return OC * C * max(1, min(MAX_SPLITS, SPLIT_K_BUDGET_BYTES // (FP32_BYTES * OC * C)))


# ----------------------------------------------------------------------------
# launchers

def forward_v1(d, block_size):
    require(d.N <= MAX_GRID_Y, f"matmul_forward_v1: N={d.N} rows > gridDim.y limit {MAX_GRID_Y}")
    MATMUL_V1.launch(d.precision, (ceil_div(d.OC, block_size), d.N), block_size,
                     (d.out, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C), np.int32(d.OC)))


def forward_v2(d, block_size):
    tile = V2_TILES[block_size]
    shared_bytes = 2 * tile * (tile + 1) * np.dtype(np.float32).itemsize      # two padded fp32 tiles
    MATMUL_V2.launch(d.precision, (ceil_div(d.OC, tile), ceil_div(d.N, tile)), block_size,
                     (d.out, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C), np.int32(d.OC), np.int32(tile)),
                     shared_mem=shared_bytes)


def forward_v3(d, block_size):
    grid = (ceil_div(d.OC, V3_BLOCK_TILE), ceil_div(d.N, V3_BLOCK_TILE))
    MATMUL_V3.launch(d.precision, grid, block_size,
                     (d.out, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C), np.int32(d.OC)))


def forward_v4(d, block_size):
    llmc.matmul.matmul_forward(d.out, d.inp, d.weight, d.bias, d.B, d.T, d.C, d.OC)


def forward_v5(d, block_size):
    from llmc import cublaslt
    cublaslt.matmul_forward_lt(d.out, d.inp, d.weight, d.bias, d.B, d.T, d.C, d.OC)


# the tensor-core versions (bf16; rows of whole 16-byte chunks)

def check_tensor_core_launch(name, d, arrays):
    """The shapes and precision versions 6-8 take: bf16, C and OC multiples of 8 (every row of
    inp, weight, out, dout, dinp and dweight is whole 16-byte chunks: cp.async and ldmatrix move
    chunks, and the epilogue stores them). N (the tokens) may be anything. arrays: the names of
    d's bf16 arrays the kernels read or write, each contiguous, 16-byte aligned, of its shape's size.
    Raises ValueError (TypeError for an array of the wrong kind)."""
    require(d.precision == "bf16", f"{name}: the tensor-core kernels take bf16 (mma.sync .bf16), not {d.precision}")
    require(d.C % TENSOR_CORE_ROW_MULTIPLE == 0 and d.OC % TENSOR_CORE_ROW_MULTIPLE == 0,
            f"{name}: C={d.C} and OC={d.OC} must be multiples of {TENSOR_CORE_ROW_MULTIPLE} "
            f"(rows of whole 16-byte chunks)")
    sizes = {"inp": d.N * d.C, "dinp": d.N * d.C, "out": d.N * d.OC, "pre_gelu": d.N * d.OC, "dout": d.N * d.OC,
             "weight": d.OC * d.C, "dweight": d.OC * d.C, "bias": d.OC, "dbias": d.OC}
    cuda.check_launch(name, [(a, getattr(d, a), sizes[a]) for a in arrays], aligned=True)


def launch_tiled(kernel, d, grid, tile, args):
    """Launch with tile.shared_bytes of dynamic shared memory, opting the kernel in first where that
    is more than a launch may ask for by default (CuPy's RawKernel.max_dynamic_shared_size_bytes,
    cuFuncSetAttribute's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)."""
    shared = tile.shared_bytes if tile.stages > 1 else 0          # v6's one tile is static shared memory
    if shared > DEFAULT_DYNAMIC_SHARED_BYTES:
        function = common.load_function(kernel, d.precision)
        if function.max_dynamic_shared_size_bytes < shared:
            function.max_dynamic_shared_size_bytes = shared
    kernel.launch(d.precision, grid, tile.threads, args, shared_mem=shared)


def forward_v6(d, block_size):
    check_tensor_core_launch("matmul_forward_v6", d, ("out", "inp", "weight", "bias"))
    grid = (ceil_div(d.OC, V6_TILE.bn), ceil_div(d.N, V6_TILE.bm))
    launch_tiled(MATMUL_V6, d, grid, V6_TILE, (d.out, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C),
                                               np.int32(d.OC)))


def forward_v7(d, block_size):
    check_tensor_core_launch("matmul_forward_v7", d, ("out", "inp", "weight", "bias"))
    grid = (ceil_div(d.OC, V7_TILE.bn), ceil_div(d.N, V7_TILE.bm))
    launch_tiled(MATMUL_V7, d, grid, V7_TILE, (d.out, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C),
                                               np.int32(d.OC)))


def tile_count(tile, M, N):
    """Blocks of a (M, N) output: v8's grid is one dimension, in its grouped order."""
    return ceil_div(M, tile.bm) * ceil_div(N, tile.bn)


def forward_v8(d, block_size):
    check_tensor_core_launch("matmul_forward_v8", d, ("out", "inp", "weight", "bias"))
    tile = V8_TILES[block_size]
    launch_tiled(MATMUL_FORWARD_V8[block_size], d, (tile_count(tile, d.N, d.OC),), tile,
                 (d.out, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C), np.int32(d.OC)))


def forward_gelu_v8(d, block_size):
    check_tensor_core_launch("matmul_forward_gelu_v8", d, ("out", "pre_gelu", "inp", "weight", "bias"))
    tile = V8_TILES[block_size]
    launch_tiled(MATMUL_FORWARD_GELU_V8[block_size], d, (tile_count(tile, d.N, d.OC),), tile,
                 (d.out, d.pre_gelu, d.inp, d.weight, d.bias, np.int32(d.N), np.int32(d.C), np.int32(d.OC)))


def dweight_splits(tiles, k_tiles, slots, partial_bytes):
    """(splits, k-tiles per split) of dweight's K sum (the tokens) for a GEMM of `tiles` output
    blocks, `k_tiles` k-tiles each, on `slots` resident blocks (SMs x blocks per SM). The time of
    one split count S is about (waves of blocks) x (k-tiles per block) = ceil(tiles S / slots) x
    ceil(k_tiles / S); the S with the least, and the fewest splits among equals, with S x
    partial_bytes (one fp32 (OC, C) partial per split) within SPLIT_K_BUDGET_BYTES. Every split gets
    at least one k-tile (the count of splits is that of the whole k-tiles per split)."""
    best = None
    for splits in range(1, min(MAX_SPLITS, k_tiles) + 1):
        if splits > 1 and splits * partial_bytes > SPLIT_K_BUDGET_BYTES:
            break
        per_split = ceil_div(k_tiles, splits)
        cost = ceil_div(tiles * splits, slots) * per_split
        if best is None or cost < best[0]:
            best = (cost, ceil_div(k_tiles, per_split), per_split)
    return best[1], best[2]


def multiprocessor_count():
    """The current device's SMs (the emulated device: its CPU cores), asked once per device: a
    launcher that queried the driver at every call would put that time between its kernels."""
    cp = cuda.cupy()
    key = (cuda.device(), cp.cuda.Device().id)
    if key not in _MULTIPROCESSORS:
        _MULTIPROCESSORS[key] = cp.cuda.runtime.getDeviceProperties(key[1])["multiProcessorCount"]
    return _MULTIPROCESSORS[key]


_MULTIPROCESSORS = {}     # (llmc.cuda.device(), device id) -> SMs


def backward_v8(d, block_size):
    """dinp = dout @ weight (weight read transposed), dweight += dout^T @ inp (both read transposed,
    the K sum over tokens split in fp32 partials, then added in order), dbias += column sums of
    dout (kernels/bias.cu, as version 4)."""
    check_tensor_core_launch("matmul_backward_v8", d, ("dinp", "dweight", "dbias", "dout", "inp", "weight"))
    tile = V8_TILES[block_size]
    launch_tiled(DINP_V8[block_size], d, (tile_count(tile, d.N, d.C),), tile,
                 (d.dinp, d.dout, d.weight, np.int32(d.N), np.int32(d.C), np.int32(d.OC)))
    tiles = tile_count(tile, d.OC, d.C)
    slots = multiprocessor_count() * V8_BLOCKS_PER_SM[block_size]
    splits, per_split = dweight_splits(tiles, ceil_div(d.N, tile.bk), slots, d.OC * d.C * FP32_BYTES)
    require(d.partial.size >= splits * d.OC * d.C, f"matmul_backward_v8: partial holds {d.partial.size} floats, "
                                                   f"{splits} splits need {splits * d.OC * d.C}")
    launch_tiled(DWEIGHT_V8[block_size], d, (tiles, 1, splits), tile,
                 (d.partial, d.dout, d.inp, np.int32(d.N), np.int32(d.C), np.int32(d.OC), np.int32(per_split)))
    groups = d.OC * d.C // TENSOR_CORE_ROW_MULTIPLE
    SPLIT_K_REDUCE_V8.launch(d.precision, ceil_div(groups, REDUCE_BLOCK_SIZE), REDUCE_BLOCK_SIZE,
                             (d.dweight, d.partial, np.int32(splits), np.int32(d.OC * d.C)))
    llmc.matmul.bias_backward(d.dbias, d.dout, d.scratch, d.N, d.OC)


def backward_v4(d, block_size):
    llmc.matmul.matmul_backward(d.dinp, d.dweight, d.dbias, d.dout, d.inp, d.weight, d.scratch, d.B, d.T, d.C, d.OC)


def backward_v5(d, block_size):
    from llmc import cublaslt
    if not cublaslt.matmul_backward_lt(d.dinp, d.dweight, d.dbias, d.dout, d.inp, d.weight, d.B, d.T, d.C, d.OC):
        llmc.matmul.bias_backward(d.dbias, d.dout, d.scratch, d.N, d.OC)     # no BGRADB for this shape


def forward_gelu_v4(d, block_size):
    llmc.matmul.Cublas().forward(d.out, d.inp, d.weight, d.bias, d.B, d.T, d.C, d.OC, pre_gelu=d.pre_gelu)


def forward_gelu_v5(d, block_size):
    from llmc import cublaslt
    cublaslt.matmul_forward_lt(d.out, d.inp, d.weight, d.bias, d.B, d.T, d.C, d.OC, pre_gelu=d.pre_gelu)


# ----------------------------------------------------------------------------
# versions that need an optional library: skipped, with the reason, where it is missing

def cublaslt_unavailable_reason(precision, sizes):
    """None if llmc.cublaslt can run here, else one line (its own reason, or why it does not import)."""
    try:
        from llmc import cublaslt
    except ImportError as e:
        return f"llmc.cublaslt is not importable ({e})"
    return cublaslt.unavailable_reason()


def tensor_core_unavailable_reason(precision, sizes):
    """None if versions 6-8 can run this precision and shape, else why not (check_tensor_core_launch's
    rules, said before anything runs)."""
    if precision != "bf16":
        return f"bf16 only: the tensor-core kernels take bf16 operands (an {precision} build has none)"
    if sizes["C"] % TENSOR_CORE_ROW_MULTIPLE or sizes["OC"] % TENSOR_CORE_ROW_MULTIPLE:
        return (f"C={sizes['C']} and OC={sizes['OC']} must be multiples of {TENSOR_CORE_ROW_MULTIPLE} "
                f"(rows of whole 16-byte chunks)")
    return None


# version number -> reason(precision, sizes)
OPTIONAL_VERSIONS = {5: cublaslt_unavailable_reason, 6: tensor_core_unavailable_reason,
                     7: tensor_core_unavailable_reason, 8: tensor_core_unavailable_reason}


def without_unavailable(progressions, optional, precision):
    """The progressions minus the versions that cannot run here, each one announced in a line
    `<progression> v<N> skipped: <reason>`. optional: {version number: reason(precision,
    sizes) -> None or a line}. attention.py uses this too."""
    kept = []
    for progression in progressions:
        versions = []
        for version in progression.versions:
            reason = optional[version.number](precision, progression.sizes) if version.number in optional else None
            if reason:
                print(f"{progression.name} v{version.number} skipped: {reason}")
            else:
                versions.append(version)
        kept.append(dataclasses.replace(progression, versions=versions))
    return kept


# ----------------------------------------------------------------------------
# the progressions

C_124M = 768
ROWS_124M = dict(B=16, T=1024)                 # N = 16384: GPT-2 124M (d12) at B = 16, T = 1024
SHAPES = {"qkv": (C_124M, 3 * C_124M), "attproj": (C_124M, C_124M), "fc": (C_124M, 4 * C_124M),
          "fcproj": (4 * C_124M, C_124M)}
TEST_SIZES = dict(B=2, T=37, C=40, OC=72)      # N = 74: no dimension a multiple of a tile or slice
FORWARD_VERSIONS = [
    Version(1, "naive: one thread per output, the dot product from global memory", (MATMUL_V1,), forward_v1,
            V1_BLOCK_SIZES),
    Version(2, "shared-memory tiles: each loaded value reused tile times", (MATMUL_V2,), forward_v2,
            tuple(V2_TILES)),
    Version(3, "register tiles: 8x8 outputs per thread, 64 FMAs per 16 shared loads", (MATMUL_V3,), forward_v3,
            (V3_THREADS,)),
    Version(4, "library call: cuBLAS (llmc.matmul.matmul_forward, production): GEMM + add_bias", (CUBLAS_GEMM,),
            forward_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "library call: cuBLASLt, bias in the epilogue (llmc.cublaslt)", (CUBLASLT_MATMUL,), forward_v5,
            LIBRARY_BLOCK_SIZES),
    Version(6, "tensor cores: mma.sync + ldmatrix, 4 warps of 64x64 outputs, synchronous loads", (MATMUL_V6,),
            forward_v6, (V6_TILE.threads,)),
    Version(7, "a 4-stage cp.async pipeline and an XOR-swizzled shared memory", (MATMUL_V7,), forward_v7,
            (V7_TILE.threads,)),
    Version(8, "tile per shape (block 128: 128x128, 256: 128x256), bias epilogue through shared memory",
            tuple(MATMUL_FORWARD_V8.values()), forward_v8, tuple(V8_TILES)),
]
BACKWARD_VERSIONS = [
    Version(4, "library call: cuBLAS dinp, dweight + kernels/bias.cu (llmc.matmul.matmul_backward, production)",
            (CUBLAS_GEMM,), backward_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "library call: cuBLASLt, dbias in dweight's epilogue (llmc.cublaslt.matmul_backward_lt)",
            (CUBLASLT_MATMUL,), backward_v5, LIBRARY_BLOCK_SIZES),
    Version(8, "tensor cores: dinp with weight read .trans, dweight split over tokens + reduction, "
               "kernels/bias.cu", tuple(DINP_V8.values()) + tuple(DWEIGHT_V8.values()) + (SPLIT_K_REDUCE_V8,),
            backward_v8, tuple(V8_TILES)),
]
# the MLP's first layer with its GELU: pre_gelu = inp @ weight^T + bias, out = gelu(pre_gelu)
GELU_VERSIONS = [
    Version(4, "library call: cuBLAS GEMM, then kernels/gelu.cu adds the bias and takes GELU "
               "(llmc.matmul.Cublas, production)", (CUBLAS_GEMM,), forward_gelu_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "library call: cuBLASLt GELU_AUX_BIAS epilogue (llmc.cublaslt)", (CUBLASLT_MATMUL,), forward_gelu_v5,
            LIBRARY_BLOCK_SIZES),
    Version(8, "tensor cores, bias and GELU in the epilogue, pre_gelu and out stored together",
            tuple(MATMUL_FORWARD_GELU_V8.values()), forward_gelu_v8, tuple(V8_TILES)),
]
# The classifier, library calls and version 8, the fastest hand-written one (versions 1-3 would
# take seconds a call, and validating a (16384, 50304) output takes seconds of its own): GPT-2's
# (C -> Vp = 50304, padded to a multiple of 128), llama3:d4's (C = 256 -> V = 50257: Llama 3 pads
# nothing, and with GPT-2's tokenizer V is odd, which versions 6-8 refuse), and d4's padded to 50304. On the H100 (2026-11-26, dev/results/) llama3:d4's three classifier GEMMs ran at
# 85-146 TFLOP/s and GPT-2's at 720-830: these three shapes tell the odd leading dimension's share
# from the small C's.
CLASSIFIER_FORWARD_VERSIONS = [v for v in FORWARD_VERSIONS if v.number in (4, 5, 8)]
CLASSIFIER_SHAPES = {"classifier_gpt2": (C_124M, 50304), "classifier_llama3_d4": (256, 50257),
                     "classifier_llama3_d4_padded": (256, 50304)}
CLASSIFIER_TEST_SIZES = {"classifier_gpt2": TEST_SIZES, "classifier_llama3_d4": dict(TEST_SIZES, OC=73),
                         "classifier_llama3_d4_padded": TEST_SIZES}            # OC = 73: odd, as V
PROGRESSIONS = [
    Progression(f"matmul_forward_{name}", make_forward_case, FORWARD_VERSIONS, dict(ROWS_124M, C=C, OC=OC), TEST_SIZES)
    for name, (C, OC) in SHAPES.items()
] + [
    Progression(f"matmul_backward_{name}", make_backward_case, BACKWARD_VERSIONS, dict(ROWS_124M, C=C, OC=OC),
                TEST_SIZES)
    for name, (C, OC) in SHAPES.items()
] + [
    Progression("matmul_forward_gelu_fc", make_forward_gelu_case, GELU_VERSIONS, dict(ROWS_124M, C=C_124M,
                                                                                      OC=4 * C_124M), TEST_SIZES),
] + [
    Progression(f"matmul_{direction}_{name}", make_case, versions, dict(ROWS_124M, C=C, OC=OC),
                CLASSIFIER_TEST_SIZES[name])
    for name, (C, OC) in CLASSIFIER_SHAPES.items()
    for direction, make_case, versions in (("forward", make_forward_case, CLASSIFIER_FORWARD_VERSIONS),
                                           ("backward", make_backward_case, BACKWARD_VERSIONS))
]


# ----------------------------------------------------------------------------
# the command line: common.main's, plus a choice of versions and progressions

def version_list(text):
    """'3,6-8' -> {3, 6, 7, 8}."""
    numbers = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        numbers.update(range(int(first), int(last or first) + 1))
    return numbers


def selection_parser():
    parser = argparse.ArgumentParser(prog="dev/cuda/matmul.py", add_help=False,
                                     description="matmul.py's own options (before common's below):")
    parser.add_argument("--versions", type=version_list, default=None, metavar="LIST",
                        help="run only these versions, e.g. 3-8 or 3,6,8, and still write the table (default: all)")
    parser.add_argument("--exclude", default="", metavar="GLOBS",
                        help="leave out the progressions matching these comma-separated globs, e.g. "
                             "'*llama3*' (default: none)")
    return parser


def select(progressions, versions, exclude):
    """The progressions not matching an `exclude` glob, each with only the versions in `versions`
    (all when None); progressions left without a version are dropped."""
    globs = [g for g in exclude.split(",") if g]
    kept = []
    for progression in progressions:
        chosen = [v for v in progression.versions if versions is None or v.number in versions]
        if chosen and not any(fnmatch.fnmatchcase(progression.name, g) for g in globs):
            kept.append(dataclasses.replace(progression, versions=chosen))
    return kept


def main(argv=None):
    """common.main on the chosen versions that can run here (without a GPU: its one-line exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    selection, rest = selection_parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(selection_parser().format_help())
    progressions = select(PROGRESSIONS, selection.versions, selection.exclude)
    args = common.parse_args(OP, progressions, rest)
    if args.device == "cpu":
        cuda.use_device("cpu")                       # the optional versions' reasons are the emulated device's
    elif cuda.cuda_unavailable_reason() is not None:
        return common.main(OP, progressions, rest)
    return common.main(OP, without_unavailable(progressions, OPTIONAL_VERSIONS, args.precision), rest)


if __name__ == "__main__":
    sys.exit(main())
