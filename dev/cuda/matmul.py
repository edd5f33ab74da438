"""
dev/cuda/matmul.py: the linear layer's matmul, from a naive kernel to cuBLAS and cuBLASLt.

matmul_forward, out (N,OC) = inp (N,C) @ weight^T + bias, N = B*T rows, weight (OC,C) (nn.Linear),
at GPT-2 124M's three shapes (B*T = 8192 rows): qkv (C -> 3C), fc (C -> 4C), fcproj (4C -> C):
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
matmul_backward (the same products transposed; library calls only):
  version 4 (llmc.matmul.matmul_backward): dinp = dout @ weight and dweight += dout^T @ inp with
            cuBLAS, dbias += column sums of dout with kernels/bias.cu.
The classifier's shapes (C -> the vocabulary; versions 4 and 5 forward, 4 backward): GPT-2's
(768 -> Vp = 50304), llama3:d4's (256 -> V = 50257, odd) and d4's padded (256 -> 50304), to
measure what an unpadded vocabulary costs cuBLAS (llama3_cuda.py pads nothing).

Versions 1-3 compute in fp32 from floatX inputs and round each output once, as our kernels do.
Napkin math: FLOPs = 2 N C OC per GEMM (one multiply and one add per term; the bias's N*OC adds
are not counted); bytes = each operand read once and out written once, the least any version
can move. The table shows TFLOP/s and their share of the cuBLAS GEMM the harness measures in the
same run (8192^3, same precision). Inputs: inp, bias ~ N(0,1) and weight ~ N(0,1/C), so every
output is ~ N(0,1) like a real layer's, whatever C: the kernel tolerances mean the same at
every shape.

Run (needs a CUDA GPU; without one it says so in one line and exits 2):
    python dev/cuda/matmul.py            # every version, every shape, bf16
    python dev/cuda/matmul.py 3 -p fp32  # version 3 only, fp32
prints a validation line per (version, block size), then one table per progression (time,
TFLOP/s, % of the measured cuBLAS GEMM), written to dev/results/dev_cuda_matmul.md.
"""

import dataclasses
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
MATMUL_V1 = dev_kernel(OP, "matmul_forward_v1")
MATMUL_V2 = dev_kernel(OP, "matmul_forward_v2")
MATMUL_V3 = dev_kernel(OP, "matmul_forward_v3")
# a library call launches kernels of its own choosing: these name the call in the table only
CUBLAS_GEMM = Kernel("llmc/cuda.py", "cublas_gemm")
CUBLASLT_MATMUL = Kernel("llmc/cublaslt.py", "cublaslt_matmul")

LIBRARY_BLOCK_SIZES = (0,)          # "block 0" in the table: the library picks its own launch
MAX_GRID_Y = 65535                  # CUDA's limit on gridDim.y (v1 puts the N rows there)
V1_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024)
V2_TILES = {64: 8, 256: 16, 1024: 32}   # block size -> tile (tile x tile threads)
V3_THREADS = 256                    # matmul.cu V3_THREADS: 16 x 16 threads of 8 x 8 outputs
V3_BLOCK_TILE = 128                 # matmul.cu V3_BLOCK_ROWS = V3_BLOCK_COLS


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
    dinp = gpt2_cpu.matmul_backward(dweight, dbias, dout.reshape(B, T, OC), inp.reshape(B, T, C), weight)  # += in place
    case.check("dinp", dinp.reshape(N, C), "matmul")
    case.check("dweight", dweight, "matmul", scale=math.sqrt(N))
    case.check("dbias", dbias, "matmul", scale=math.sqrt(N))
    # read dout, inp, weight; write dinp; read and write dweight, dbias
    case.bytes = common.napkin_bytes(precision, floatX=N * OC + 2 * N * C + 3 * OC * C + 2 * OC)
    case.flops = matmul_backward_flops(N, C, OC)
    return case


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


def backward_v4(d, block_size):
    llmc.matmul.matmul_backward(d.dinp, d.dweight, d.dbias, d.dout, d.inp, d.weight, d.scratch, d.B, d.T, d.C, d.OC)


# ----------------------------------------------------------------------------
# versions that need an optional library: skipped, with the reason, where it is missing

def cublaslt_unavailable_reason(precision, sizes):
    """None if llmc.cublaslt can run here, else one line (its own reason, or why it does not import)."""
    try:
        from llmc import cublaslt
    except ImportError as e:
        return f"llmc.cublaslt is not importable ({e})"
    return cublaslt.unavailable_reason()


OPTIONAL_VERSIONS = {5: cublaslt_unavailable_reason}    # version number -> reason(precision, sizes)


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
ROWS_124M = dict(B=8, T=1024)                  # N = 8192
SHAPES = {"qkv": (C_124M, 3 * C_124M), "fc": (C_124M, 4 * C_124M), "fcproj": (4 * C_124M, C_124M)}
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
]
BACKWARD_VERSIONS = [
    Version(4, "library call: cuBLAS dinp, dweight + kernels/bias.cu (llmc.matmul.matmul_backward, production)",
            (CUBLAS_GEMM,), backward_v4, LIBRARY_BLOCK_SIZES),
]
# The classifier, library calls only (the hand-written versions would take seconds a call): GPT-2's
# (C -> Vp = 50304, padded to a multiple of 128), llama3:d4's (C = 256 -> V = 50257: Llama 3 pads
# nothing, and with GPT-2's tokenizer V is odd), and d4's padded to 50304. On the H100 (2026-11-26,
# dev/results/) llama3:d4's three classifier GEMMs ran at 85-146 TFLOP/s and GPT-2's at 720-830:
# these three shapes tell the odd leading dimension's share from the small C's.
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
    Progression(f"matmul_{direction}_{name}", make_case, versions, dict(ROWS_124M, C=C, OC=OC),
                CLASSIFIER_TEST_SIZES[name])
    for name, (C, OC) in CLASSIFIER_SHAPES.items()
    for direction, make_case, versions in (("forward", make_forward_case, FORWARD_VERSIONS[3:]),
                                           ("backward", make_backward_case, BACKWARD_VERSIONS))
]


def main(argv=None):
    """common.main on the versions that can run here (without a GPU: its one-line exit 2)."""
    if cuda.cuda_unavailable_reason() is not None:
        return common.main(OP, PROGRESSIONS, argv)
    precision = common.parse_args(OP, PROGRESSIONS, argv).precision
    return common.main(OP, without_unavailable(PROGRESSIONS, OPTIONAL_VERSIONS, precision), argv)


if __name__ == "__main__":
    sys.exit(main())
