"""
gpt2_cuda.py: GPT-2 training on one or more NVIDIA GPUs, in Python: CuPy for memory and kernel
launches, our own CUDA kernels (kernels/*.cu) for everything but the matmuls, cuBLAS for those.

NOT YET RUN ON A GPU (as of this commit): it was written and tested on a machine without one.
Its CPU tests (tests/test_cuda.py, part 1) run the whole orchestration with NumPy stand-ins for
CuPy, the kernels and cuBLAS, and dev/cuda/nvrtc_compile.py compiles every kernel with NVRTC;
neither proves a kernel computes the right thing. On a GPU, run, in this order:
    make test-gpu          # dev/run_gpu_tests.py: `pytest -m gpu -v` (every kernel against
                           # gpt2_cpu, the 124M model, ten steps, CPU <-> CUDA resume) and
                           # the two --check runs below; log in dev/results/
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16
    make bench             # dev/bench.py: tokens/s and MFU against the PyTorch twin
and only then trust its numbers (CHECK_TOLERANCES are provisional until then).

This is the Python twin of llm.c's train_gpt2.cu, as gpt2_cpu.py is the twin of train_gpt2.c.
It follows gpt2_cpu.py section by section (layers, model, optimizer, ..., training loop), with
the same function names and argument order, and imports every host-side piece from it (config,
parameter table, file formats, data loader, tokenizer, sampler, schedules, logger, MPI) instead
of copying them. A layer here is a thin *launcher*: it checks shapes, dtypes and alignment,
computes the grid and launches a kernel that writes into preallocated arrays, outputs first,
like llm.c: `layernorm_forward(out, mean, rstd, inp, weight, bias, B, T, C)`.

What it deliberately is not: a framework. No autograd, no graph capture, no cuDNN flash
attention (the (T,T) attention matrix is materialized, as in llm.c without cuDNN), no ZeRO
sharding. All device memory is allocated once, before the first step; a step's only
device-to-host synchronizations are reading the gradient norm and the loss.

Precision (`--precision`): "bf16" (default where the GPU has compute capability >= 8.0) stores
parameters, gradients and activations as bfloat16 with fp32 arithmetic inside every kernel,
fp32 AdamW moments and (`-w 1`, the default) fp32 master weights; "fp32" stores everything as
float32 (`-f 1` lets cuBLAS use TF32 tensor cores). CuPy has no bfloat16 dtype, so bf16 tensors
live in CuPy as uint16 arrays holding the raw bit patterns; only the kernels and cuBLAS see them
as __nv_bfloat16.

Run it (after `make data`; needs CuPy and a CUDA GPU, else it says so in one line and exits 2):
    python gpt2_cuda.py                         # d4 on Shakespeare, same defaults as gpt2_cpu.py
    python gpt2_cuda.py -e d12 -b 16 -t 1024 -x 200
prints a few lines about the device, model and memory, then one line per step in gpt2_cpu.py's
format plus the model FLOPs utilization (the numbers depend on the GPU):
    step    1/400 | loss <loss> | norm <norm> | lr 3.00e-04 | <ms> ms | <n> tok/s | MFU <x>%
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0
runs one batch through gpt2_cpu.py and through this file and prints, for every activation and
every parameter gradient, its maximum error and `TENSOR OK` / `TENSOR NOT OK` (exit 1 if any
fails). Several GPUs: `mpirun -np 8 python gpt2_cuda.py ...` (NCCL all-reduces the gradients).
Every flag of gpt2_cpu.py works here with the same meaning (`python gpt2_cuda.py --help` shows
them and the GPU flags in one list), among them `-h 1` (HellaSwag every -v steps),
`--eval-only`, and `--generate N --prompt TEXT`, which streams N sampled tokens: the same
tokens as gpt2_cpu.py from the same checkpoint and --sample-seed, up to float rounding of the
logits (exactly the same in a tiny fp32 model; bf16 rounding can change a close draw).

Dimension legend (as in gpt2_cpu.py):
    B     batch size (sequences per micro-batch)     T     sequence length, T <= maxT
    C     channels                                   V     vocabulary size (50257 for GPT-2)
    Vp    V padded to a multiple of 128 (50304)      L     number of layers
    NH    number of attention heads                  HS    head size, C // NH
    OC    output channels of a matmul                N     rows of a matmul, B*T
    maxT  longest sequence the position embedding covers (1024 for GPT-2)

Gradient convention (as in llm.c, slightly different from gpt2_cpu.py, whose backward functions
return fresh arrays): a launcher *writes* (=) the gradient of its input into the `dinp` it is
given, except LayerNorm's backward, which *accumulates* (+=) into dinp because its dinp is the
residual stream's gradient; parameter gradients always accumulate (+=), so gradient
accumulation over micro-batches is just calling backward again.
"""

import hashlib
import math
import os
import sys
import time
import types

import numpy as np

import gpt2_cpu
from gpt2_cpu import (ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, DECAYED_PARAMETERS, GPT2_EOT, NUM_COMPLETIONS, PAD_TOKEN,
                      Comm, DataLoader, InputError, Logger, SamplerRNG, Tokenizer, bfloat16_bits_to_float32,
                      build_model, check_tensor, checkpoint_paths, evaluate_multiple_choice, float32_to_bfloat16_bits,
                      generate, latest_checkpoint_step, layer_params, learning_rate_at, num_elements, parameter_shapes,
                      read_hellaswag, read_model, read_state, sample_from_prompt, tensor_views, write_done_marker,
                      write_model, write_state)

# ----------------------------------------------------------------------------
# constants: precisions, launch configuration, cuBLAS enums

KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
PRECISIONS = ("bf16", "fp32")
PRECISION_DEFINES = {"bf16": "-DENABLE_BF16", "fp32": "-DENABLE_FP32"}
# floatX as CuPy sees it: bf16 values are kept as their raw 16-bit patterns (CuPy has no bfloat16)
FLOATX_DTYPES = {"bf16": np.dtype(np.uint16), "fp32": np.dtype(np.float32)}
FLOATX_PRECISION = {np.dtype(np.uint16): "bf16", np.dtype(np.float32): "fp32"}
BF16_NAN_BITS = 0x7FC0                 # a quiet NaN in bf16 (tests poison outputs with it)
VECTOR_BYTES = 16                      # kernels/common.cuh Packed128: one 128-bit load or store
BF16_MIN_COMPUTE_CAPABILITY = 80       # sm_80 (Ampere) added bf16 tensor cores

WARP_SIZE = 32
BLOCK_SIZE = 256                       # elementwise and grid-stride kernels
WARP_ROW_BLOCK_SIZE = 256              # warp-per-row kernels (LayerNorm, softmax): 8 rows per block
LAYERNORM_BACKWARD_BLOCK_SIZE = 512
LAYERNORM_BACKWARD_GRID = 512          # scratch slots of layernorm_backward: fixed, so results reproduce
BIAS_BACKWARD_CHUNKS = 256             # row chunks (scratch slots) of bias_backward: fixed, likewise
CLASSIFIER_BLOCK_SIZE = 1024           # one block per row of Vp logits (llm.c's fused_classifier)
GLOBAL_NORM_GRID = 1024                # partial sums of the gradient norm: fixed, likewise
GLOBAL_NORM_BLOCK_SIZE = 512
MAX_THREADS_PER_BLOCK = 1024

UPDATE_SEED = 13371337                 # llm.c's initial rng_state, the seeds of stochastic rounding

# cuBLAS / CUDA library enums (cublas_api.h, library_types.h); tests/test_cuda.py checks them
# against CuPy's copies
CUBLAS_OP_N = 0                        # use the matrix as stored
CUBLAS_OP_T = 1                        # use its transpose
CUDA_R_32F = 0                         # cudaDataType_t: float
CUDA_R_16BF = 14                       # cudaDataType_t: __nv_bfloat16
CUBLAS_COMPUTE_32F = 68                # fp32 accumulation (bf16 inputs still use tensor cores)
CUBLAS_COMPUTE_32F_FAST_TF32 = 77      # fp32 inputs rounded to TF32 for tensor cores
CUBLAS_GEMM_DEFAULT = -1               # let cuBLAS pick the algorithm
CUBLAS_POINTER_MODE_HOST = 0           # alpha and beta are read from host memory
CUBLAS_DATA_TYPES = {"bf16": CUDA_R_16BF, "fp32": CUDA_R_32F}
# TF32 is a process-wide choice, like llm.c's global cublas_compute (set by train() from -f)
MATMUL_OPTIONS = {"tf32": False}


def ceil_div(a, b):
    """Smallest integer >= a / b, for positive ints (grid sizes)."""
    return -(-a // b)


def vector_size(precision):
    """Elements per 16-byte vector (x128::size in kernels/common.cuh): 8 bf16 or 4 floats."""
    return VECTOR_BYTES // FLOATX_DTYPES[precision].itemsize


# ----------------------------------------------------------------------------
# CuPy: imported lazily, so that this file can be imported (for its host logic) without it

def cuda_unavailable_reason():
    """None if CuPy imports and sees a CUDA device, else a short reason (for the one-line exit)."""
    try:
        import cupy
    except Exception as e:                 # ImportError, or a CUDA library that fails to load
        return f"CuPy is not importable: {type(e).__name__}: {e}".splitlines()[0]
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                 # no driver, driver too old, no device
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None if count > 0 else "the CUDA runtime reports 0 devices"


def _cupy():
    import cupy
    return cupy


def _address(arr):
    """Device (CuPy) or host (NumPy) address of an array's first element."""
    return arr.ctypes.data if isinstance(arr, np.ndarray) else arr.data.ptr


# ----------------------------------------------------------------------------
# kernel modules: each kernels/<file>.cu compiled once per process per precision

class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernels/*.cu file; the message names the file and carries NVRTC's log."""


_MODULES = {}      # (file, precision) -> cupy.RawModule, compiled
_FUNCTIONS = {}    # (file, precision, kernel name) -> cupy.RawKernel


CUDA_HEADER = "cuda_bf16.h"            # the one CUDA header the kernels include (via common.cuh)
CXX_STANDARD = "--std=c++17"           # `if constexpr` in common.cuh


def cuda_include_dirs():
    """Candidate directories for the CUDA headers, in order: the pip CUDA runtime
    (nvidia-cuda-runtime-cu12/13, via cuda.pathfinder where installed, else the `nvidia` namespace
    package), then $CUDA_PATH/include, $CUDA_HOME/include, /usr/local/cuda/include."""
    dirs = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
        if found:
            dirs.append(found)
    except Exception:                      # cuda.pathfinder missing or too old: look ourselves
        pass
    try:
        import nvidia
        dirs += [os.path.join(d, "cuda_runtime", "include") for d in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    dirs += [os.path.join(root, "include") for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"),
                                                        "/usr/local/cuda") if root]
    return list(dict.fromkeys(dirs))       # unique, in order


def cuda_include_dir():
    """The first of cuda_include_dirs() that holds cuda_bf16.h. Raises KernelCompileError (saying
    where it looked and what to install) when none does."""
    candidates = cuda_include_dirs()
    for d in candidates:
        if os.path.isfile(os.path.join(d, CUDA_HEADER)):
            return d
    raise KernelCompileError(f"{CUDA_HEADER} not found (looked in {', '.join(candidates)}): "
                             "pip install nvidia-cuda-runtime-cu12")


def common_header_digest():
    """First 16 hex digits of the SHA-256 of kernels/common.cuh."""
    with open(os.path.join(KERNELS_DIR, "common.cuh"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def kernel_compile_options(precision):
    """NVRTC options for kernels/*.cu in `precision` ("bf16" or "fp32"), without -arch (CuPy adds
    it for the current device). The one source of these options: cupy.RawModule gets this tuple
    here, and dev/cuda/nvrtc_compile.py imports this function, so the CI compile check compiles
    exactly what runs (and CuPy's on-disk cache serves both). C++17, the floatX define, the
    kernels directory (for common.cuh), the CUDA headers (cuda_bf16.h), and an unused macro
    holding common.cuh's digest, because CuPy keys its cache on the source text and the
    options, not on included headers: without it an edit of common.cuh would keep serving
    stale kernels. Raises ValueError for an unknown precision, KernelCompileError without the
    CUDA headers."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    return (CXX_STANDARD, PRECISION_DEFINES[precision], f"-I{KERNELS_DIR}", f"-I{cuda_include_dir()}",
            f"-DCOMMON_CUH_DIGEST=sha256_{common_header_digest()}")


def load_module(file, precision):
    """kernels/<file>.cu compiled for `precision`, once per process (CuPy also caches the binary
    on disk). Raises KernelCompileError naming the file, with NVRTC's log."""
    key = (file, precision)
    if key not in _MODULES:
        cp = _cupy()
        path = os.path.join(KERNELS_DIR, f"{file}.cu")
        with open(path) as f:
            code = f.read()
        module = cp.RawModule(code=code, options=kernel_compile_options(precision))
        try:
            module.compile()               # RawModule compiles lazily; do it here, once
        except cp.cuda.compiler.CompileException as e:
            raise KernelCompileError(f"{path}: NVRTC failed to compile it with {PRECISION_DEFINES[precision]}:\n"
                                     f"{e.get_message()}") from None
        _MODULES[key] = module
    return _MODULES[key]


KERNEL_FILES = ("encoder", "layernorm", "attention", "gelu", "bias", "classifier", "adamw", "global_norm", "cast")


def load_all_modules(precision):
    """Compile (or fetch from CuPy's disk cache) every kernel file before training starts, so that
    a compile error surfaces at once and the first step's time does not include NVRTC."""
    for file in KERNEL_FILES:
        load_module(file, precision)


def _launch(file, precision, name, grid, block, args):
    """Launch kernel `name` of kernels/<file>.cu. grid: int or (x, y); args: CuPy arrays and
    NumPy scalars typed exactly as the C signature (np.int32, np.float32, np.uint64, ...)."""
    key = (file, precision, name)
    if key not in _FUNCTIONS:
        _FUNCTIONS[key] = load_module(file, precision).get_function(name)
    grid = grid if isinstance(grid, tuple) else (grid,)
    _FUNCTIONS[key](grid, (block,), args)


def _precision_of(arr):
    """'bf16' or 'fp32' from a floatX array's dtype (uint16 bits or float32)."""
    try:
        return FLOATX_PRECISION[np.dtype(arr.dtype)]
    except KeyError:
        raise TypeError(f"floatX arrays are uint16 (bf16 bits) or float32, not {arr.dtype}") from None


def _check(arr, dtype, size, name, aligned=True):
    """Raise unless arr has `dtype`, is C-contiguous, holds exactly `size` elements and (for
    kernels with 16-byte vector loads) starts 16-byte aligned."""
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: dtype {arr.dtype}, expected {np.dtype(dtype).name}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if arr.size != size:
        raise ValueError(f"{name}: has {arr.size} elements, expected {size}")
    if aligned and _address(arr) % VECTOR_BYTES:
        raise ValueError(f"{name}: not {VECTOR_BYTES}-byte aligned (address {_address(arr):#x})")


def _require(condition, message):
    if not condition:
        raise ValueError(message)


def elementwise_grid(n, block_size=BLOCK_SIZE):
    """Blocks for a grid-stride kernel over n work items: one item per thread, at least 1 block."""
    return max(1, ceil_div(n, block_size))


def warp_row_grid(num_rows, block_size=WARP_ROW_BLOCK_SIZE):
    """Blocks for a warp-per-row kernel: block_size // 32 rows per block."""
    return max(1, ceil_div(num_rows, block_size // WARP_SIZE))


def layernorm_backward_grid(N):
    """Scratch slots of layernorm_backward (blocks, each owning ceil(N/G) rows): fixed per N."""
    return min(LAYERNORM_BACKWARD_GRID, N)


def bias_backward_chunks(N):
    """Row chunks (scratch slots) of bias_backward: fixed per N."""
    return min(BIAS_BACKWARD_CHUNKS, N)


def scratch_floats(config):
    """fp32 scratch the backward's partial sums need: LayerNorm (G, 2, C) or bias (chunks, OC<=4C)."""
    C = config.channels
    return max(LAYERNORM_BACKWARD_GRID * 2 * C, BIAS_BACKWARD_CHUNKS * 4 * C)


# ----------------------------------------------------------------------------
# matmuls: cuBLAS (library call) on raw pointers
#
# cuBLAS is column-major; our tensors are row-major. A row-major (R, K) matrix is, byte for byte,
# the column-major (K, R) matrix with leading dimension K: its transpose. So every row-major
# product out = X @ Y is computed as the column-major product out^T = Y^T X^T, where each ^T
# costs nothing (it is how cuBLAS reads our memory) and an explicit op T undoes a transpose.

def _gemm(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, accumulate=False,
          batch=1, stride_a=0, stride_b=0, stride_c=0):
    """Library call: C (m,n) = op(A) (m,k) @ op(B) (k,n) [+ C], column-major, one or `batch`
    strided products. A, B, C are floatX CuPy arrays whose first elements start the matrices; all
    three have the same precision; fp32 accumulation (CUBLAS_COMPUTE_32F, or TF32 inputs when
    MATMUL_OPTIONS["tf32"] is set in fp32 mode). alpha = 1, beta = 1 if accumulate else 0, both
    host floats (pointer mode host)."""
    cp = _cupy()
    from cupy_backends.cuda.libs import cublas
    precision = _precision_of(C)
    for arr, name in ((A, "A"), (B, "B")):
        if _precision_of(arr) != precision:
            raise TypeError(f"gemm: {name} is {arr.dtype} but C is {C.dtype}")
    data_type = CUBLAS_DATA_TYPES[precision]
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if precision == "fp32" and MATMUL_OPTIONS["tf32"] else CUBLAS_COMPUTE_32F
    alpha = np.ones(1, np.float32)
    beta = np.full(1, 1.0 if accumulate else 0.0, np.float32)
    handle = cp.cuda.device.get_cublas_handle()     # CuPy binds it to the current stream per call
    cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
    if batch == 1:
        cublas.gemmEx(handle, transa, transb, m, n, k, alpha.ctypes.data,
                      A.data.ptr, data_type, lda, B.data.ptr, data_type, ldb,
                      beta.ctypes.data, C.data.ptr, data_type, ldc, compute, CUBLAS_GEMM_DEFAULT)
    else:
        cublas.gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha.ctypes.data,
                                    A.data.ptr, data_type, lda, stride_a, B.data.ptr, data_type, ldb, stride_b,
                                    beta.ctypes.data, C.data.ptr, data_type, ldc, stride_c,
                                    batch, compute, CUBLAS_GEMM_DEFAULT)


def matmul_forward(out, inp, weight, bias, B, T, C, OC):
    """out (B,T,OC) = inp (B,T,C) @ weight^T + bias, weight (OC,C) (nn.Linear layout), bias (OC,)
    or None. Column-major, out^T (OC,N) = weight (OC,C) @ inp^T (C,N): weight's memory is the
    column-major (C,OC) matrix weight^T, so op(A) = T; inp's memory is already inp^T, op(B) = N.
    The bias is added by cuBLAS itself: out is first filled with the bias broadcast over the N
    rows (a copy kernel), then the gemm accumulates onto it (beta = 1): no add-bias kernel."""
    N = B * T
    X = out.dtype
    _check(out, X, N * OC, "out", aligned=False)
    _check(inp, X, N * C, "inp", aligned=False)
    _check(weight, X, OC * C, "weight", aligned=False)
    if bias is not None:
        _check(bias, X, OC, "bias", aligned=False)
        out.reshape(N, OC)[...] = bias                                  # (OC,) broadcast to (N,OC)
    _gemm(CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, weight, C, inp, C, out, OC, accumulate=bias is not None)


def matmul_backward(dinp, dweight, dbias, dout, inp, weight, scratch, B, T, C, OC):
    """Backward of out = inp @ weight^T + bias (shapes as matmul_forward). Writes dinp (B,T,C);
    accumulates dweight (OC,C) and dbias (OC,) (dbias may be None). scratch: fp32 for bias_backward.
        dinp     = dout @ weight     column-major: dinp^T (C,N) = weight^T (C,OC) @ dout^T (OC,N), both as stored
        dweight += dout^T @ inp      column-major: dweight^T (C,OC) = inp^T (C,N) @ dout (N,OC), op(B) = T
        dbias   += sum over rows of dout   (kernels/bias.cu)"""
    N = B * T
    X = dout.dtype
    _check(dinp, X, N * C, "dinp", aligned=False)
    _check(dweight, X, OC * C, "dweight", aligned=False)
    _check(dout, X, N * OC, "dout", aligned=False)
    _check(inp, X, N * C, "inp", aligned=False)
    _check(weight, X, OC * C, "weight", aligned=False)
    _gemm(CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, weight, C, dout, OC, dinp, C)
    _gemm(CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, inp, C, dout, OC, dweight, C, accumulate=True)
    if dbias is not None:
        bias_backward(dbias, dout, scratch, N, OC)


def bias_backward(dbias, dout, scratch, N, OC):
    """dbias (OC,) += column sums of dout (N,OC): kernels/bias.cu, per-chunk partial sums into
    scratch (chunks, OC) fp32, then a second kernel adds the chunks in order (deterministic)."""
    precision = _precision_of(dout)
    X = FLOATX_DTYPES[precision]
    chunks = bias_backward_chunks(N)
    _check(dbias, X, OC, "dbias", aligned=False)
    _check(dout, X, N * OC, "dout", aligned=False)
    _require(scratch.dtype == np.float32 and scratch.size >= chunks * OC, f"bias scratch needs {chunks * OC} floats")
    columns = ceil_div(OC, BLOCK_SIZE)
    _launch("bias", precision, "bias_backward", (columns, chunks), BLOCK_SIZE,
            (scratch, dout, np.int32(N), np.int32(OC)))
    _launch("bias", precision, "bias_reduce", columns, BLOCK_SIZE,
            (dbias, scratch, np.int32(chunks), np.int32(OC)))


# ----------------------------------------------------------------------------
# layers: launchers, forward/backward pairs, in gpt2_cpu.py's order

def encoder_forward(out, inp, wte, wpe, B, T, C):
    """out (B,T,C) = wte[inp] + wpe[:T]. inp (B,T) int32 on the device; wte (Vp,C); wpe (maxT,C).
    Token ids must be in [0, V): checked on the host before upload (gpt2_forward)."""
    precision = _precision_of(out)
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    _require(C % vec == 0, f"encoder_forward: C={C} must be a multiple of {vec}")
    _check(out, X, B * T * C, "out")
    _check(inp, np.int32, B * T, "inp", aligned=False)
    _check(wte, X, wte.size, "wte")
    _check(wpe, X, wpe.size, "wpe")
    _require(wte.size % C == 0 and wpe.size >= T * C, "encoder_forward: wte/wpe shapes do not fit C and T")
    _launch("encoder", precision, "encoder_forward", elementwise_grid(B * T * C // vec), BLOCK_SIZE,
            (out, inp, wte, wpe, np.int32(B), np.int32(T), np.int32(C)))


def encoder_backward_segments(inp):
    """Host side of the deterministic dwte scatter-add: inp (B,T) token ids -> int32 arrays
        positions (N,)    flat positions b*T+t, stably sorted by token id
        seg_start (S+1,)  segment s is positions[seg_start[s]:seg_start[s+1]]; seg_start[S] = N
        seg_token (S,)    the (distinct) token id of segment s
    so that dwte[seg_token[s]] += sum of dout[positions[j]] over segment s: np.add.at semantics,
    with one GPU block per distinct token and no atomics."""
    flat = np.ascontiguousarray(inp, dtype=np.int32).ravel()
    positions = np.argsort(flat, kind="stable").astype(np.int32)
    sorted_tokens = flat[positions]
    starts = np.flatnonzero(np.diff(sorted_tokens, prepend=np.int32(-1)))   # token ids are >= 0
    seg_start = np.append(starts, flat.size).astype(np.int32)
    seg_token = sorted_tokens[starts].astype(np.int32)
    return positions, seg_start, seg_token


def encoder_backward(dwte, dwpe, dout, positions, seg_start, seg_token, num_segments, B, T, C):
    """Accumulate dwte (Vp,C) and dwpe (maxT,C) from dout (B,T,C); positions, seg_start, seg_token
    are device int32 arrays from encoder_backward_segments (seg_start with num_segments+1 entries).
        out[b,t] = wte[inp[b,t]] + wpe[t]  =>  dwte[v] += sum of dout[b,t] where inp[b,t] == v,
                                               dwpe[t] += sum_b dout[b,t]"""
    precision = _precision_of(dout)
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    N = B * T
    _require(C % vec == 0, f"encoder_backward: C={C} must be a multiple of {vec}")
    _check(dwte, X, dwte.size, "dwte")
    _check(dwpe, X, dwpe.size, "dwpe")
    _check(dout, X, N * C, "dout")
    _check(positions, np.int32, N, "positions", aligned=False)
    _check(seg_start, np.int32, num_segments + 1, "seg_start", aligned=False)
    _check(seg_token, np.int32, num_segments, "seg_token", aligned=False)
    _launch("encoder", precision, "encoder_backward_wpe", elementwise_grid(T * C // vec), BLOCK_SIZE,
            (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))
    groups_per_row = C // vec                                  # threads of a block stride over these
    block = min(MAX_THREADS_PER_BLOCK, ceil_div(groups_per_row, WARP_SIZE) * WARP_SIZE)
    _launch("encoder", precision, "encoder_backward_wte", max(1, num_segments), block,
            (dwte, dout, positions, seg_start, seg_token, np.int32(num_segments), np.int32(C)))


def layernorm_forward(out, mean, rstd, inp, weight, bias, B, T, C):
    """out (B,T,C) = (inp - mean) * rstd * weight + bias over the last axis; mean, rstd (B,T) fp32
    are written for the backward. One warp per row (kernels/layernorm.cu)."""
    precision = _precision_of(out)
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    N = B * T
    _require(C % vec == 0, f"layernorm_forward: C={C} must be a multiple of {vec}")
    for arr, name, size in ((out, "out", N * C), (inp, "inp", N * C), (weight, "weight", C), (bias, "bias", C)):
        _check(arr, X, size, name)
    _check(mean, np.float32, N, "mean", aligned=False)
    _check(rstd, np.float32, N, "rstd", aligned=False)
    _launch("layernorm", precision, "layernorm_forward", warp_row_grid(N), WARP_ROW_BLOCK_SIZE,
            (out, mean, rstd, inp, weight, bias, np.int32(N), np.int32(C)))


def fused_residual_forward(residual, normed, mean, rstd, inp1, inp2, weight, bias, N, C):
    """residual (N,C) = inp1 + inp2 (rounded to floatX), then normed, mean, rstd = layernorm of it:
    residual_forward and the next layernorm_forward in one pass over the rows."""
    precision = _precision_of(residual)
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    _require(C % vec == 0, f"fused_residual_forward: C={C} must be a multiple of {vec}")
    for arr, name, size in ((residual, "residual", N * C), (normed, "normed", N * C), (inp1, "inp1", N * C),
                            (inp2, "inp2", N * C), (weight, "weight", C), (bias, "bias", C)):
        _check(arr, X, size, name)
    _check(mean, np.float32, N, "mean", aligned=False)
    _check(rstd, np.float32, N, "rstd", aligned=False)
    _launch("layernorm", precision, "fused_residual_forward", warp_row_grid(N), WARP_ROW_BLOCK_SIZE,
            (residual, normed, mean, rstd, inp1, inp2, weight, bias, np.int32(N), np.int32(C)))


def layernorm_backward(dinp, dweight, dbias, scratch, dout, inp, weight, mean, rstd, B, T, C):
    """Accumulate dinp (B,T,C) (the residual stream's gradient), dweight, dbias (C,), from dout:
        dinp += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),  dnorm = dout * weight
    (derivation: gpt2_cpu.layernorm_backward, doc/layernorm.md). Two kernels: per-block partial
    sums of dbias/dweight into scratch (G, 2, C) fp32, then their in-order sum."""
    precision = _precision_of(dinp)
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    N = B * T
    G = layernorm_backward_grid(N)
    _require(C % vec == 0, f"layernorm_backward: C={C} must be a multiple of {vec}")
    for arr, name, size in ((dinp, "dinp", N * C), (dout, "dout", N * C), (inp, "inp", N * C),
                            (weight, "weight", C), (dweight, "dweight", C), (dbias, "dbias", C)):
        _check(arr, X, size, name, aligned=name not in ("dweight", "dbias"))
    _check(mean, np.float32, N, "mean", aligned=False)
    _check(rstd, np.float32, N, "rstd", aligned=False)
    _require(scratch.dtype == np.float32 and scratch.size >= G * 2 * C, f"layernorm scratch needs {G * 2 * C} floats")
    _launch("layernorm", precision, "layernorm_backward", G, LAYERNORM_BACKWARD_BLOCK_SIZE,
            (dinp, scratch, dout, inp, weight, mean, rstd, np.int32(N), np.int32(C)))
    _launch("layernorm", precision, "layernorm_param_reduce", elementwise_grid(C), BLOCK_SIZE,
            (dweight, dbias, scratch, np.int32(G), np.int32(C)))


def attention_scores(preatt, q, k, BNH, T, HS):
    """Library call: preatt (BNH,T,T) = q @ k^T for each of the BNH heads, q, k (BNH,T,HS).
    Column-major: preatt^T (T,T) = k (T,HS) @ q^T (HS,T); k's memory is k^T (HS,T) so op(A) = T."""
    _gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, k, HS, q, HS, preatt, T,
          batch=BNH, stride_a=T * HS, stride_b=T * HS, stride_c=T * T)


def attention_values(out, att, v, BNH, T, HS):
    """Library call: out (BNH,T,HS) = att (BNH,T,T) @ v (BNH,T,HS).
    Column-major: out^T (HS,T) = v^T (HS,T) @ att^T (T,T), both as stored."""
    _gemm(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, v, HS, att, T, out, HS,
          batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS)


def attention_values_backward(datt, dv, dout, att, v, BNH, T, HS):
    """Library calls, the backward of out = att @ v (shapes as attention_values); both written:
        datt = dout @ v^T     column-major: datt^T (T,T) = v (T,HS) @ dout^T (HS,T), op(A) = T
        dv   = att^T @ dout   column-major: dv^T (HS,T) = dout^T (HS,T) @ att (T,T), op(B) = T"""
    _gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, v, HS, dout, HS, datt, T,
          batch=BNH, stride_a=T * HS, stride_b=T * HS, stride_c=T * T)
    _gemm(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, dout, HS, att, T, dv, HS,
          batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS)


def attention_scores_backward(dq, dk, dpreatt, q, k, BNH, T, HS):
    """Library calls, the backward of preatt = q @ k^T (the 1/sqrt(HS) scale is already inside
    dpreatt, see softmax_backward); both written:
        dq = dpreatt @ k      column-major: dq^T (HS,T) = k^T (HS,T) @ dpreatt^T (T,T), both as stored
        dk = dpreatt^T @ q    column-major: dk^T (HS,T) = q^T (HS,T) @ dpreatt (T,T), op(B) = T"""
    _gemm(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, k, HS, dpreatt, T, dq, HS,
          batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS)
    _gemm(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, q, HS, dpreatt, T, dk, HS,
          batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS)


def _attention_checks(precision, B, T, C, NH):
    vec = vector_size(precision)
    _require(C % NH == 0, f"attention: C={C} is not a multiple of NH={NH}")
    _require((C // NH) % vec == 0, f"attention: head size {C // NH} must be a multiple of {vec}")
    return C // NH


def attention_forward(out, qkvr, att, scratch, B, T, C, NH):
    """Causal multi-head self-attention (Vaswani et al. 2017), llm.c's attention_forward:
    scratch (>= B*T*max(3C, NH*T) floatX) holds on entry the qkv projection (B,T,3C) in its first
    B*T*3C elements, and is then reused for preatt and the per-head outputs (clobbered).
    Writes qkvr (3,B,NH,T,HS) = q, k, v per head and att (B,NH,T,T) (both kept for the backward),
    and out (B,T,C) = the heads of softmax(q k^T / sqrt(HS), causal) @ v side by side."""
    precision = _precision_of(out)
    X = FLOATX_DTYPES[precision]
    HS = _attention_checks(precision, B, T, C, NH)
    BNH = B * NH
    _check(out, X, B * T * C, "out")
    _check(qkvr, X, 3 * B * T * C, "qkvr")
    # the softmax reads rows of att with 16-byte loads only when T is a multiple of the vector
    # size (then every row, and every layer's att, starts aligned); otherwise element by element
    _check(att, X, BNH * T * T, "att", aligned=T % vector_size(precision) == 0)
    _require(scratch.size >= B * T * max(3 * C, NH * T), "attention scratch too small")
    q, k, v = (qkvr.reshape(3, BNH * T * HS)[i] for i in range(3))     # each (B,NH,T,HS), contiguous
    qkv = _prefix(scratch, (B, T, 3 * C))
    _launch("attention", precision, "permute_qkv", elementwise_grid(B * T * C // vector_size(precision)), BLOCK_SIZE,
            (q, k, v, qkv, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))
    preatt = _prefix(scratch, (BNH, T, T))                              # qkv is dead now
    attention_scores(preatt, q, k, BNH, T, HS)                         # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    _launch("attention", precision, "softmax_forward", warp_row_grid(BNH * T), WARP_ROW_BLOCK_SIZE,
            (att, preatt, np.float32(1.0 / math.sqrt(HS)), np.int32(BNH), np.int32(T)))
    y = _prefix(scratch, (BNH, T, HS))                                  # preatt is dead now
    attention_values(y, att, v, BNH, T, HS)                            # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    _launch("attention", precision, "unpermute", elementwise_grid(B * T * C // vector_size(precision)), BLOCK_SIZE,
            (out, y, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))


def attention_backward(dinp, dqkvr, datt_scratch, dy, dout, qkvr, att, B, T, C, NH):
    """Backward of attention_forward: writes dinp (B,T,3C), the gradient of the qkv projection,
    from dout (B,T,C) and the forward's qkvr (3,B,NH,T,HS) and att (B,NH,T,T). Scratch: dqkvr
    (3,B,NH,T,HS), datt_scratch (>= B*NH*T*T), dy (B,NH,T,HS). Undoing the forward in reverse:
        out = unpermute(y)     =>  dy = unpermute_backward(dout)
        y = att @ v            =>  datt = dy @ v^T,  dv = att^T @ dy
        att = softmax(s preatt) => dpreatt = s att (datt - sum_j datt att)   (in place on datt)
        preatt = q @ k^T       =>  dq = dpreatt @ k,  dk = dpreatt^T @ q
        q, k, v = permute(qkv) =>  dinp = permute_backward(dq, dk, dv)"""
    precision = _precision_of(dinp)
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    HS = _attention_checks(precision, B, T, C, NH)
    BNH = B * NH
    _check(dinp, X, 3 * B * T * C, "dinp")
    _check(dqkvr, X, 3 * B * T * C, "dqkvr")
    _check(dy, X, B * T * C, "dy")
    _check(dout, X, B * T * C, "dout")
    _check(qkvr, X, 3 * B * T * C, "qkvr")
    _check(att, X, BNH * T * T, "att", aligned=T % vec == 0)
    _require(datt_scratch.size >= BNH * T * T, "attention datt scratch too small")
    q, k, v = (qkvr.reshape(3, BNH * T * HS)[i] for i in range(3))
    dq, dk, dv = (dqkvr.reshape(3, BNH * T * HS)[i] for i in range(3))
    datt = _prefix(datt_scratch, (BNH, T, T))
    _launch("attention", precision, "unpermute_backward", elementwise_grid(B * T * C // vec), BLOCK_SIZE,
            (dy, dout, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))
    attention_values_backward(datt, dv, dy, att, v, BNH, T, HS)
    _launch("attention", precision, "softmax_backward", warp_row_grid(BNH * T), WARP_ROW_BLOCK_SIZE,
            (datt, datt, att, np.float32(1.0 / math.sqrt(HS)), np.int32(BNH), np.int32(T)))
    attention_scores_backward(dq, dk, datt, q, k, BNH, T, HS)           # datt now holds dpreatt
    _launch("attention", precision, "permute_qkv_backward", elementwise_grid(B * T * C // vec), BLOCK_SIZE,
            (dinp, dq, dk, dv, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))


def gelu_forward(out, inp, n):
    """out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), elementwise over n values."""
    precision = _precision_of(out)
    X = FLOATX_DTYPES[precision]
    _check(out, X, n, "out")
    _check(inp, X, n, "inp")
    _launch("gelu", precision, "gelu_forward", elementwise_grid(ceil_div(n, vector_size(precision))), BLOCK_SIZE,
            (out, inp, np.uint64(n)))


def gelu_backward_inplace(d_in_out, inp, n):
    """d_in_out = d_in_out * gelu'(inp): the gradient of gelu's output in, of its input out."""
    precision = _precision_of(d_in_out)
    X = FLOATX_DTYPES[precision]
    _check(d_in_out, X, n, "d_in_out")
    _check(inp, X, n, "inp")
    _launch("gelu", precision, "gelu_backward_inplace", elementwise_grid(ceil_div(n, vector_size(precision))),
            BLOCK_SIZE, (d_in_out, inp, np.uint64(n)))


def residual_forward(out, inp1, inp2, n):
    """out = inp1 + inp2, n values (the model uses fused_residual_forward instead)."""
    precision = _precision_of(out)
    X = FLOATX_DTYPES[precision]
    for arr, name in ((out, "out"), (inp1, "inp1"), (inp2, "inp2")):
        _check(arr, X, n, name)
    _launch("layernorm", precision, "residual_forward", elementwise_grid(ceil_div(n, vector_size(precision))),
            BLOCK_SIZE, (out, inp1, inp2, np.uint64(n)))


def fused_classifier(logits, losses, targets, dloss, B, T, V, Vp, write_dlogits):
    """Softmax + cross-entropy over the first V of Vp columns, per row of logits (B,T,Vp):
    losses (B,T) fp32 = logsumexp - logit[target]; with write_dlogits the logits are overwritten
    in place by dlogits = (softmax - onehot(target)) * dloss (0 in the padded columns), so the
    (B,T,Vp) probabilities never exist. Replaces gpt2_cpu's softmax_forward, crossentropy_forward
    and crossentropy_softmax_backward. targets (B,T) int32 in [0, V)."""
    precision = _precision_of(logits)
    X = FLOATX_DTYPES[precision]
    N = B * T
    _check(logits, X, N * Vp, "logits")
    _check(losses, np.float32, N, "losses", aligned=False)
    _check(targets, np.int32, N, "targets", aligned=False)
    _require(0 < V <= Vp, f"fused_classifier: need 0 < V={V} <= Vp={Vp}")
    _launch("classifier", precision, "fused_classifier", max(1, N), CLASSIFIER_BLOCK_SIZE,
            (logits, losses, targets, np.float32(dloss), np.int32(N), np.int32(V), np.int32(Vp),
             np.int32(1 if write_dlogits else 0)))


def _prefix(buf, shape):
    """View of the first prod(shape) elements of a contiguous buffer, reshaped (no copy)."""
    return buf.reshape(-1)[:math.prod(shape)].reshape(shape)


# ----------------------------------------------------------------------------
# optimizer and gradient-norm launchers

def adamw_update(params, master_params, grads, m, v, n, learning_rate, beta1, beta2, beta1_correction,
                 beta2_correction, eps, weight_decay, grad_scale, seed):
    """One AdamW step on one tensor of n values (see gpt2_cpu.gpt2_update for the math). params,
    grads floatX; master_params fp32 or None; m, v fp32. In bf16 the new value is stochastically
    rounded with bits hashed from (element index, seed): pass a different seed per tensor and step."""
    precision = _precision_of(params)
    X = FLOATX_DTYPES[precision]
    _check(params, X, n, "params", aligned=False)
    _check(grads, X, n, "grads", aligned=False)
    _check(m, np.float32, n, "m", aligned=False)
    _check(v, np.float32, n, "v", aligned=False)
    if master_params is not None:
        _check(master_params, np.float32, n, "master_params", aligned=False)
    null = np.uint64(0)                    # a NULL float*: 8 zero bytes in the argument buffer
    _launch("adamw", precision, "adamw_update", elementwise_grid(n), BLOCK_SIZE,
            (params, null if master_params is None else master_params, grads, m, v, np.uint64(n),
             np.float32(learning_rate), np.float32(beta1), np.float32(beta2), np.float32(beta1_correction),
             np.float32(beta2_correction), np.float32(eps), np.float32(weight_decay), np.float32(grad_scale),
             np.uint32(seed)))


def global_norm(out, partial, data, n):
    """out[0] (fp32, on the device) = sqrt(sum of data^2) over n floatX values, in two fixed-order
    steps: GLOBAL_NORM_GRID per-block partial sums into partial, then one block sums those."""
    precision = _precision_of(data)
    _check(data, FLOATX_DTYPES[precision], n, "data")
    _require(partial.dtype == np.float32 and partial.size >= GLOBAL_NORM_GRID, "global_norm: partial too small")
    _require(out.dtype == np.float32 and out.size >= 1, "global_norm: out must be fp32")
    _launch("global_norm", precision, "global_norm_squared", GLOBAL_NORM_GRID, GLOBAL_NORM_BLOCK_SIZE,
            (partial, data, np.uint64(n), np.int32(0)))
    _launch("global_norm", precision, "global_norm_finalize", 1, MAX_THREADS_PER_BLOCK,
            (out, partial, np.int32(GLOBAL_NORM_GRID)))


def cast_float_to_floatX(out, inp, n):
    """out (n,) floatX = inp (n,) fp32, round to nearest even (a copy in fp32 mode)."""
    precision = _precision_of(out)
    _check(out, FLOATX_DTYPES[precision], n, "out", aligned=False)
    _check(inp, np.float32, n, "inp", aligned=False)
    _launch("cast", precision, "cast_float_to_floatX", elementwise_grid(n), BLOCK_SIZE, (out, inp, np.uint64(n)))


def cast_floatX_to_float(out, inp, n):
    """out (n,) fp32 = inp (n,) floatX (exact)."""
    precision = _precision_of(inp)
    _check(out, np.float32, n, "out", aligned=False)
    _check(inp, FLOATX_DTYPES[precision], n, "inp", aligned=False)
    _launch("cast", precision, "cast_floatX_to_float", elementwise_grid(n), BLOCK_SIZE, (out, inp, np.uint64(n)))


# ----------------------------------------------------------------------------
# the model: parameters, activations, forward, backward, zero_grad, update

def activation_shapes(config, B, T, recompute=True):
    """Every device buffer one forward + backward pass uses, in forward order: (name, shape, kind),
    kind "X" = floatX, "f32" = float32, "i32" = int32. Allocated once (gpt2_allocate), each buffer
    as large as the largest of its sizes over the (B,T) the run uses; a (B,T) uses the first
    elements of each buffer.
    Names follow gpt2_cpu.activation_shapes where the tensor is the same. Differences, as in llm.c:
      - qkvr holds q, k, v already split into heads (3,B,NH,T,HS) (gpt2_cpu keeps qkv (B,T,3C))
      - attproj and fcproj are not kept: the fused residual+LayerNorm consumes them at once
      - fch_gelu is kept for one layer only with recompute (the backward recomputes it)
      - logits live in `output`, a scratch shared with the qkv projection and attention's
        preatt and per-head outputs; probs are never materialized (fused_classifier)
      - scratch_*: reused by every layer of the backward (llm.c's scratch_btc, scratch_bt4c)."""
    C, L, NH, Vp = config.channels, config.num_layers, config.num_heads, config.padded_vocab_size
    HS = C // NH
    return [
        ("inputs", (B, T), "i32"), ("targets", (B, T), "i32"),
        ("encoded", (B, T, C), "X"),
        ("ln1", (L, B, T, C), "X"), ("ln1_mean", (L, B, T), "f32"), ("ln1_rstd", (L, B, T), "f32"),
        ("qkvr", (L, 3, B, NH, T, HS), "X"), ("att", (L, B, NH, T, T), "X"), ("atty", (L, B, T, C), "X"),
        ("residual2", (L, B, T, C), "X"),
        ("ln2", (L, B, T, C), "X"), ("ln2_mean", (L, B, T), "f32"), ("ln2_rstd", (L, B, T), "f32"),
        ("fch", (L, B, T, 4 * C), "X"), ("fch_gelu", (1 if recompute else L, B, T, 4 * C), "X"),
        ("residual3", (L, B, T, C), "X"),
        ("lnf", (B, T, C), "X"), ("lnf_mean", (B, T), "f32"), ("lnf_rstd", (B, T), "f32"),
        ("losses", (B, T), "f32"), ("loss_accum", (B, T), "f32"),
        # scratch, shared across layers
        ("output", (B * T * max(3 * C, NH * T, Vp),), "X"),   # qkv | preatt | per-head y | logits | datt
        ("scratch_btc", (B, T, C), "X"),       # attproj / fcproj; in the backward dlnf, dln2, datty, dln1
        ("scratch_bt4c", (B, T, 4 * C), "X"),  # in the backward dfch, then dqkv (B,T,3C)
        ("dresidual", (B, T, C), "X"),         # the residual stream's gradient
        ("dqkvr", (3, B, NH, T, HS), "X"),     # attention backward: dq, dk, dv per head
        ("dy", (B, NH, T, HS), "X"),           # attention backward: dout per head
        ("positions", (B * T,), "i32"), ("seg_start", (B * T + 1,), "i32"), ("seg_token", (B * T,), "i32"),
    ]


class GPT2:
    """A GPT-2 on the GPU: flat floatX parameter and gradient buffers with named views (the order
    and shapes of gpt2_cpu.parameter_shapes, so the file loader, AdamW and the CPU model all agree),
    fp32 AdamW moments m, v, optional fp32 master weights, and the activation buffers (allocated
    by gpt2_allocate, once). precision is "bf16" or "fp32"."""

    def __init__(self, config, precision="bf16", master_weights=True, recompute=True):
        cp = _cupy()
        if precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision}")
        vec = vector_size(precision)
        if config.channels % config.num_heads or (config.channels // config.num_heads) % vec:
            raise InputError(f"the CUDA kernels need the head size C/NH = {config.channels}/{config.num_heads} "
                             f"to be a whole multiple of {vec} in {precision}")
        self.config = config
        self.precision = precision
        self.recompute = bool(recompute)
        self.floatX = FLOATX_DTYPES[precision]
        self.param_shapes = parameter_shapes(config)
        self.num_parameters = num_elements(self.param_shapes)
        n = self.num_parameters
        self.params = cp.zeros(n, dtype=self.floatX)
        self.grads = cp.zeros(n, dtype=self.floatX)
        self.P = tensor_views(self.params, self.param_shapes)        # name -> view into params
        self.G = tensor_views(self.grads, self.param_shapes)         # name -> view into grads
        # fp32 master weights only make sense when the parameters themselves are not fp32
        self.master = cp.zeros(n, dtype=np.float32) if master_weights and precision == "bf16" else None
        self.m = cp.zeros(n, dtype=np.float32)                       # AdamW moments, fp32 always
        self.v = cp.zeros(n, dtype=np.float32)
        self.scratch = cp.zeros(scratch_floats(config), dtype=np.float32)
        self.norm_partial = cp.zeros(GLOBAL_NORM_GRID, dtype=np.float32)
        self.norm = cp.zeros(1, dtype=np.float32)
        self.update_rng = SamplerRNG(UPDATE_SEED)    # seeds of stochastic rounding, one per tensor per step
        self.rng_state_last_update = self.update_rng.state
        self.buffers = None                          # name -> flat device buffer (gpt2_allocate)
        self.allocated = []                          # the (B,T) sizes the buffers were sized for
        self.views = {}                              # (B,T) -> name -> view
        self.BT = None                               # (B,T) of the last forward
        self.num_segments = 0
        self.has_targets = False


def gpt2_allocate(model, *sizes):
    """Allocate every activation buffer, once (before training), big enough for each micro-batch
    size (B,T) in `sizes`: a buffer gets the largest of its sizes over their activation_shapes
    tables, and a (B,T) then uses the first elements of each (gpt2_activations). The trainer
    passes its (B,T), the sampler's (1, window) and HellaSwag's (rows, T): one set of buffers,
    no allocation inside the training loop. Returns the number of bytes allocated."""
    cp = _cupy()
    dtypes = {"X": model.floatX, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}
    sizes = list(dict.fromkeys(sizes))                                # unique, in order
    tables = [activation_shapes(model.config, B, T, model.recompute) for B, T in sizes]
    model.buffers = model.views = None                                # free the old set first
    model.buffers = {name: cp.zeros(max(math.prod(table[i][1]) for table in tables), dtype=dtypes[kind])
                     for i, (name, _, kind) in enumerate(tables[0])}
    model.allocated = sizes
    model.views = {}
    return sum(buf.nbytes for buf in model.buffers.values())


def gpt2_activations(model, B, T):
    """Named views of the activation buffers shaped for (B,T) (cached): the first elements of each
    buffer. If nothing is allocated, or some buffer is too small for (B,T), everything is
    reallocated for (B,T) and the sizes allocated before (views fetched earlier are then stale:
    fetch them again)."""
    if (B, T) not in model.views:
        table = activation_shapes(model.config, B, T, model.recompute)
        if model.buffers is None or any(math.prod(shape) > model.buffers[name].size for name, shape, _ in table):
            gpt2_allocate(model, *model.allocated, (B, T))
        model.views[(B, T)] = {name: _prefix(model.buffers[name], shape) for name, shape, _ in table}
    return model.views[(B, T)]


def upload_parameters(model, params):
    """Set the model's parameters from a flat fp32 host array (a checkpoint, or gpt2_cpu's init):
    the master weights get it exactly; bf16 parameters get it rounded to nearest even (the same
    rounding as cast_float_to_floatX, done on the host to need no fp32 copy on the device)."""
    params = np.ascontiguousarray(params, dtype=np.float32)
    if params.size != model.num_parameters:
        raise InputError(f"{params.size} parameters do not fit a model of {model.num_parameters}")
    if model.master is not None:
        model.master.set(params)
    model.params.set(float32_to_bfloat16_bits(params) if model.precision == "bf16" else params)


def download_parameters(model, master=True):
    """The parameters as a flat fp32 host array: the master weights when there are some and
    `master`, else the floatX parameters upcast (exact). Checkpoints use the former; --check the
    latter (the values the kernels actually compute with)."""
    if master and model.master is not None:
        return model.master.get()
    return as_float32(model.params.get())


def as_float32(host):
    """A host array of floatX (uint16 bf16 bits or float32) as float32."""
    return bfloat16_bits_to_float32(host) if host.dtype == np.uint16 else np.asarray(host, dtype=np.float32)


def gpt2_forward(model, inputs, targets=None):
    """Forward pass. inputs (B,T) int token ids (host numpy); targets (B,T) or None. Returns the
    logits (B,T,Vp) floatX on the device (a view into the `output` scratch: valid until the next
    forward or backward, which overwrites it with dlogits). With targets, the per-position losses
    (B,T) fp32 are computed too (model.buffers' `losses`; gpt2_mean_loss reads their mean).
    Raises InputError if T > maxT or a token id is out of range."""
    cp = _cupy()
    cfg = model.config
    inputs = np.asarray(inputs)
    B, T = inputs.shape
    C, L, NH, V, Vp = cfg.channels, cfg.num_layers, cfg.num_heads, cfg.vocab_size, cfg.padded_vocab_size
    if T > cfg.max_seq_len:
        raise InputError(f"sequence length T={T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    for name, ids in (("token", inputs), ("target", targets)):
        if ids is not None and (ids.min() < 0 or ids.max() >= V):
            raise InputError(f"{name} id out of range [0, {V}): {ids.min()}..{ids.max()}")
    P, A = model.P, gpt2_activations(model, B, T)
    stream = cp.cuda.get_current_stream()
    # host -> device: asynchronous (pageable memory is staged at once, so the host arrays may go)
    A["inputs"].set(np.ascontiguousarray(inputs, dtype=np.int32), stream=stream)
    model.BT, model.has_targets = (B, T), targets is not None
    if targets is not None:
        A["targets"].set(np.ascontiguousarray(targets, dtype=np.int32), stream=stream)
        positions, seg_start, seg_token = encoder_backward_segments(inputs)   # for the backward
        model.num_segments = seg_token.size
        A["positions"].set(positions, stream=stream)
        A["seg_start"][:seg_start.size].set(seg_start, stream=stream)
        A["seg_token"][:seg_token.size].set(seg_token, stream=stream)

    encoder_forward(A["encoded"], A["inputs"], P["wte"], P["wpe"], B, T, C)        # (B,T,C)
    layernorm_forward(A["ln1"][0], A["ln1_mean"][0], A["ln1_rstd"][0], A["encoded"], P["ln1w"][0], P["ln1b"][0], B, T, C)
    for l in range(L):
        p = layer_params(P, l)
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]               # (B,T,C)
        fch_gelu = A["fch_gelu"][0 if model.recompute else l]
        # forward pass 1: attention block (ln1[l] was written by the previous fused residual)
        qkv = _prefix(A["output"], (B, T, 3 * C))
        matmul_forward(qkv, A["ln1"][l], p["qkvw"], p["qkvb"], B, T, C, 3 * C)      # (B,T,3C)
        attention_forward(A["atty"][l], A["qkvr"][l], A["att"][l], A["output"], B, T, C, NH)
        attproj = A["scratch_btc"]
        matmul_forward(attproj, A["atty"][l], p["attprojw"], p["attprojb"], B, T, C, C)
        # residual2 = residual + attproj, and ln2 = layernorm(residual2), in one kernel
        fused_residual_forward(A["residual2"][l], A["ln2"][l], A["ln2_mean"][l], A["ln2_rstd"][l],
                               residual, attproj, p["ln2w"], p["ln2b"], B * T, C)
        # forward pass 2: MLP block
        matmul_forward(A["fch"][l], A["ln2"][l], p["fcw"], p["fcb"], B, T, C, 4 * C)  # (B,T,4C)
        gelu_forward(fch_gelu, A["fch"][l], B * T * 4 * C)
        fcproj = A["scratch_btc"]
        matmul_forward(fcproj, fch_gelu, p["fcprojw"], p["fcprojb"], B, T, 4 * C, C)  # (B,T,C)
        # residual3 = residual2 + fcproj, and the next LayerNorm: layer l+1's ln1, or the final lnf
        if l + 1 < L:
            norm = (A["ln1"][l + 1], A["ln1_mean"][l + 1], A["ln1_rstd"][l + 1], P["ln1w"][l + 1], P["ln1b"][l + 1])
        else:
            norm = (A["lnf"], A["lnf_mean"], A["lnf_rstd"], P["lnfw"], P["lnfb"])
        fused_residual_forward(A["residual3"][l], norm[0], norm[1], norm[2], A["residual2"][l], fcproj,
                               norm[3], norm[4], B * T, C)
    # forward pass 3: classifier tied to wte (lnf was written by the last fused residual), loss
    logits = _prefix(A["output"], (B, T, Vp))
    matmul_forward(logits, A["lnf"], P["wte"], None, B, T, C, Vp)                  # (B,T,C) @ (C,Vp) -> (B,T,Vp)
    if targets is not None:
        fused_classifier(logits, A["losses"], A["targets"], 0.0, B, T, V, Vp, write_dlogits=False)
    return logits


def gpt2_mean_loss(model):
    """Mean of the last forward's per-position losses, as a Python float (a device sync)."""
    A = gpt2_activations(model, *model.BT)
    return float(A["losses"].sum(dtype=np.float64)) / A["losses"].size


def gpt2_zero_grad(model):
    """Set every parameter gradient to 0 (before the first micro-batch of a step)."""
    model.grads.fill(0)                    # 0 bits are +0.0 in bf16 as in fp32


def gpt2_backward(model, loss_scale=1.0):
    """Backward pass of the last gpt2_forward (which must have had targets): accumulates the
    gradient of loss_scale * mean(losses) into model.grads (loss_scale = 1/n over n micro-batches)."""
    if not model.has_targets:
        raise RuntimeError("gpt2_backward needs a forward pass with targets")
    cfg = model.config
    B, T = model.BT
    C, L, NH, V, Vp = cfg.channels, cfg.num_layers, cfg.num_heads, cfg.vocab_size, cfg.padded_vocab_size
    P, G, A = model.P, model.G, gpt2_activations(model, B, T)
    scratch = model.scratch

    # backward pass 3: cross-entropy and softmax (one kernel), classifier, final LayerNorm.
    # The fused classifier runs again, now writing dlogits over the logits in place (the forward
    # left them intact for sampling and validation; llm.c fuses this into the forward).
    dloss = loss_scale / (B * T)                                                    # d(mean loss)/d(losses)
    logits = _prefix(A["output"], (B, T, Vp))
    fused_classifier(logits, A["losses"], A["targets"], dloss, B, T, V, Vp, write_dlogits=True)
    dlogits = logits
    dlnf = A["scratch_btc"]
    matmul_backward(dlnf, G["wte"], None, dlogits, A["lnf"], P["wte"], scratch, B, T, C, Vp)
    dresidual = A["dresidual"]                                                      # gradient of the residual stream
    dresidual.fill(0)                                                               # layernorm_backward accumulates
    layernorm_backward(dresidual, G["lnfw"], G["lnfb"], scratch, dlnf, A["residual3"][L - 1], P["lnfw"],
                       A["lnf_mean"], A["lnf_rstd"], B, T, C)
    for l in reversed(range(L)):
        p, g = layer_params(P, l), layer_params(G, l)
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
        fch_gelu = A["fch_gelu"][0 if model.recompute else l]
        if model.recompute:                                                         # fch_gelu = gelu(fch), again
            gelu_forward(fch_gelu, A["fch"][l], B * T * 4 * C)
        # backward pass 2: MLP block. residual3 = residual2 + fcproj: dfcproj = dresidual, and
        # dresidual flows on unchanged into residual2, where LayerNorm 2 adds its part
        dfch = A["scratch_bt4c"]
        matmul_backward(dfch, g["fcprojw"], g["fcprojb"], dresidual, fch_gelu, p["fcprojw"], scratch, B, T, 4 * C, C)
        gelu_backward_inplace(dfch, A["fch"][l], B * T * 4 * C)                    # dfch_gelu -> dfch
        dln2 = A["scratch_btc"]
        matmul_backward(dln2, g["fcw"], g["fcb"], dfch, A["ln2"][l], p["fcw"], scratch, B, T, C, 4 * C)
        layernorm_backward(dresidual, g["ln2w"], g["ln2b"], scratch, dln2, A["residual2"][l], p["ln2w"],
                           A["ln2_mean"][l], A["ln2_rstd"][l], B, T, C)
        # backward pass 1: attention block. residual2 = residual + attproj: dattproj = dresidual
        datty = A["scratch_btc"]
        matmul_backward(datty, g["attprojw"], g["attprojb"], dresidual, A["atty"][l], p["attprojw"], scratch, B, T, C, C)
        dqkv = _prefix(A["scratch_bt4c"], (B, T, 3 * C))
        attention_backward(dqkv, A["dqkvr"], A["output"], A["dy"], datty, A["qkvr"][l], A["att"][l], B, T, C, NH)
        dln1 = A["scratch_btc"]                                                     # datty was consumed above
        matmul_backward(dln1, g["qkvw"], g["qkvb"], dqkv, A["ln1"][l], p["qkvw"], scratch, B, T, C, 3 * C)
        layernorm_backward(dresidual, g["ln1w"], g["ln1b"], scratch, dln1, residual, p["ln1w"],
                           A["ln1_mean"][l], A["ln1_rstd"][l], B, T, C)
    # backward of the encoder: encoded = wte[inputs] + wpe
    S = model.num_segments
    encoder_backward(G["wte"], G["wpe"], dresidual, A["positions"], A["seg_start"][:S + 1], A["seg_token"][:S], S,
                     B, T, C)


def gpt2_grad_norm(model):
    """Global L2 norm of all parameter gradients, as a Python float (a device sync)."""
    global_norm(model.norm, model.norm_partial, model.grads, model.num_parameters)
    return float(model.norm.get()[0])


def gpt2_update(model, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step (the math of gpt2_cpu.gpt2_update; t is the 1-based step count), one kernel
    launch per parameter tensor so that weight decay applies to DECAYED_PARAMETERS only. Each
    launch gets its own stochastic-rounding seed from model.update_rng."""
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    offset = 0
    for name, shape in model.param_shapes:
        n = math.prod(shape)
        wd = weight_decay if name in DECAYED_PARAMETERS else 0.0
        part = slice(offset, offset + n)
        master = model.master[part] if model.master is not None else None
        adamw_update(model.params[part], master, model.grads[part], model.m[part], model.v[part], n,
                     learning_rate, beta1, beta2, bc1, bc2, eps, wd, grad_scale, model.update_rng.random_u32())
        offset += n
    model.rng_state_last_update = model.update_rng.state


# ----------------------------------------------------------------------------
# model FLOPs utilization (MFU)

# Dense (no sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets: (substring of the
# device name, bf16, tf32, fp32 without tensor cores). First match wins, so more specific names
# come first ("H100 PCIe" before "H100", "A100" before "A10", "L40S" before "L40" before "L4").
# None: the GPU has no such mode.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 378.0, 51.2),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100", 989.4, 494.7, 66.9),           # SXM5 ("NVIDIA H100 80GB HBM3"); GH200 has the same
    ("H200", 989.4, 494.7, 66.9),           # H100's compute with more memory
    ("A100", 312.0, 156.0, 19.5),
    ("A10", 125.0, 62.5, 31.2),
    ("L40S", 362.1, 183.0, 91.6),
    ("L40", 181.0, 90.5, 90.5),
    ("L4", 121.0, 60.0, 30.3),
    ("RTX 4090", 165.2, 82.6, 82.6),
    ("RTX 3090", 71.0, 35.6, 35.6),
    ("V100", None, None, 15.7),
    ("T4", None, None, 8.1),
)


def peak_flops(device_name, precision, tf32):
    """Peak FLOP/s of this GPU for the matmuls of `precision` (bf16; fp32 with or without TF32),
    or None when the GPU is not in PEAK_TFLOPS."""
    column = 1 if precision == "bf16" else 2 if tf32 else 3
    for row in PEAK_TFLOPS:
        if row[0].lower() in device_name.lower():
            return None if row[column] is None else row[column] * 1e12
    return None


def flops_per_token(num_parameters, L, C, T):
    """Training FLOPs per token, llm.c's estimate (Kaplan et al. 2020, sec. 2.1): 6 per parameter
    (2 forward, 4 backward; N includes the tied wte once, and the small LayerNorm/bias/wpe terms)
    plus 6*L*C*T for the attention scores and values, which have no parameters."""
    return 6 * num_parameters + 6 * L * C * T


def mfu(num_parameters, L, C, T, tokens_per_second, device_name, precision, tf32):
    """Model FLOPs utilization in [0, 1]: achieved FLOP/s over the GPU's peak, or None if unknown."""
    peak = peak_flops(device_name, precision, tf32)
    if peak is None:
        return None
    return flops_per_token(num_parameters, L, C, T) * tokens_per_second / peak


# ----------------------------------------------------------------------------
# sampler: gpt2_cpu.generate and gpt2_cpu.sample_from_prompt, with a forward pass on the GPU
#
# gpt2_cpu.generate runs forward(x) on a fixed window of min(maxT, len(prompt) + new tokens)
# tokens and draws from one row of the logits with the shared SamplerRNG: given a forward that
# runs this model, the CUDA trainer samples exactly as the CPU one. The window's (1, window)
# activations fit in the training buffers when B*T^2 >= window^2; train() allocates for both.

class HostLogits:
    """The (B,T,Vp) logits of the last forward pass, left on the device; indexing copies just the
    part asked for to the host, as float32. gpt2_cpu.generate reads one row of Vp per token, so
    each token moves Vp values instead of window*Vp (100 MB in bf16 at window 1024). Valid
    until the next forward pass (the logits live in a scratch buffer). np.asarray copies all."""

    def __init__(self, logits):
        self.logits = logits                                    # (B,T,Vp) floatX, on the device
        self.shape = logits.shape

    def __getitem__(self, index):
        return as_float32(self.logits[index].get())

    def __array__(self, dtype=None, copy=None):
        return as_float32(self.logits.get()).astype(dtype or np.float32, copy=False)


def sampling_forward(model):
    """The forward for gpt2_cpu.generate / sample_from_prompt: x (1,window) int32 token ids on
    the host -> HostLogits (1,window,Vp), from a forward pass of this model without targets."""
    def forward(x):
        return HostLogits(gpt2_forward(model, x))
    return forward


# ----------------------------------------------------------------------------
# checking against gpt2_cpu.py (--check, tests/test_cuda.py)

# Tolerances of check_against_cpu, per kind of tensor and precision: (atol as a fraction of the
# tensor's max |reference|, rtol), i.e. ok where |gpu - cpu| <= atol * max|cpu| + rtol * |cpu|.
# Scaling atol by the tensor's own magnitude lets one row serve gradients of 1e-6 and
# activations of 10. fp32: summation order differs (cuBLAS, warp reductions vs NumPy), a few
# float eps per op compounded over L layers. bf16: every stored tensor is rounded to 8 bits of
# mantissa (2^-9 relative), so activations carry ~1% and gradients several % of error; TF32
# (10 bits) uses the bf16 column. Provisional: to be tightened from a GPU run of --check.
CHECK_TOLERANCES = {
    "activation": {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 5e-2)},
    "statistic": {"fp32": (1e-4, 1e-3), "bf16": (3e-2, 5e-2)},    # LayerNorm mean, rstd (fp32 in both)
    "logits": {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 5e-2)},
    "loss": {"fp32": (0.0, 1e-5), "bf16": (0.0, 1e-2)},
    "grad": {"fp32": (1e-3, 1e-2), "bf16": (1e-1, 1e-1)},
}


def tolerance_column(model):
    """'fp32' for full fp32 matmuls, else 'bf16' (bf16 storage, or TF32 matmuls)."""
    return "fp32" if model.precision == "fp32" and not MATMUL_OPTIONS["tf32"] else "bf16"


def check_against_cpu(model, inputs, targets, cpu_dtype=np.float32, verbose=True):
    """Run one batch through gpt2_cpu (in cpu_dtype, with exactly the GPU's parameter values) and
    through this model, and compare every activation (forward order), the loss, then every
    parameter gradient (backward order) with check_tensor and CHECK_TOLERANCES. Returns True if
    all are within tolerance. Overwrites the model's gradients."""
    cfg = model.config
    B, T = inputs.shape
    L, NH, C, V = cfg.num_layers, cfg.num_heads, cfg.channels, cfg.vocab_size
    column = tolerance_column(model)
    cpu = gpt2_cpu.GPT2(cfg, cpu_dtype)
    cpu.params[...] = download_parameters(model, master=False)
    gpt2_cpu.gpt2_forward(cpu, inputs, targets)
    gpt2_cpu.gpt2_zero_grad(cpu)
    gpt2_cpu.gpt2_backward(cpu)
    gpt2_zero_grad(model)
    gpt2_forward(model, inputs, targets)
    A = gpt2_activations(model, B, T)
    results = []

    def compare(label, gpu, ref, kind):
        atol_frac, rtol = CHECK_TOLERANCES[kind][column]
        scale = float(np.abs(ref).max()) if np.size(ref) else 0.0
        results.append(check_tensor(gpu, ref, label, atol_frac * scale, rtol, verbose=verbose))

    CA = cpu.acts
    fetch = {name: as_float32(A[name].get()) for name in
             ("encoded", "ln1", "ln1_mean", "ln1_rstd", "qkvr", "att", "atty", "residual2", "ln2", "ln2_mean",
              "ln2_rstd", "fch", "fch_gelu", "residual3", "lnf", "lnf_mean", "lnf_rstd", "losses")}
    logits = as_float32(_prefix(A["output"], (B, T, cfg.padded_vocab_size)).get())
    cpu_qkvr = CA["qkv"].reshape(L, B, T, 3, NH, C // NH).transpose(0, 3, 1, 4, 2, 5)  # -> (L,3,B,NH,T,HS)
    if verbose:
        print(f"forward: {B}x{T} tokens, {model.precision} vs gpt2_cpu {np.dtype(cpu_dtype).name}, tolerances '{column}'")
    for name in ("encoded", "ln1", "ln1_mean", "ln1_rstd", "qkvr", "att", "atty", "residual2", "ln2", "ln2_mean",
                 "ln2_rstd", "fch", "fch_gelu", "residual3", "lnf", "lnf_mean", "lnf_rstd"):
        if name == "fch_gelu" and model.recompute:
            continue                       # kept for one layer only: the next check (residual3) covers it
        ref = cpu_qkvr if name == "qkvr" else CA[name]
        kind = "statistic" if name.endswith(("_mean", "_rstd")) else "activation"
        compare(name, fetch[name], ref, kind)
    compare("logits", logits[..., :V], CA["logits"][..., :V], "logits")
    compare("losses", fetch["losses"], CA["losses"], "loss")
    compare("mean loss", np.array([fetch["losses"].mean(dtype=np.float64)]), np.array([cpu.mean_loss]), "loss")
    gpt2_backward(model)
    grads = tensor_views(as_float32(model.grads.get()), model.param_shapes)
    if verbose:
        print("backward:")
    backward_order = ("lnfw", "lnfb", "fcprojw", "fcprojb", "fcw", "fcb", "ln2w", "ln2b", "attprojw", "attprojb",
                      "qkvw", "qkvb", "ln1w", "ln1b", "wpe", "wte")
    for name in backward_order:
        compare(f"d{name}", grads[name], cpu.G[name], "grad")
    return all(results)


# ----------------------------------------------------------------------------
# data parallelism: NCCL for the gradients, MPI (gpt2_cpu.Comm) for everything else

class NcclComm:
    """All-reduce (mean) of device arrays across the processes of `comm` (a gpt2_cpu.Comm), one GPU
    each: rank 0 makes the NCCL unique id, MPI broadcasts it, every rank joins the communicator."""

    def __init__(self, comm):
        from cupy.cuda import nccl
        self.nccl = nccl
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.comm.bcast(uid, root=0)
        self.communicator = nccl.NcclCommunicator(comm.size, uid, comm.rank)

    def mean_(self, arr):
        """In place: arr = mean of arr over all ranks (NCCL_AVG), on the current stream."""
        cp = _cupy()
        dtype = {np.dtype(np.uint16): self.nccl.NCCL_BFLOAT16,
                 np.dtype(np.float32): self.nccl.NCCL_FLOAT32}[np.dtype(arr.dtype)]
        self.communicator.allReduce(arr.data.ptr, arr.data.ptr, arr.size, dtype, self.nccl.NCCL_AVG,
                                    cp.cuda.get_current_stream().ptr)


def select_device(comm):
    """Bind this process to one GPU: its local rank (MPI launchers set it) modulo the GPU count."""
    cp = _cupy()
    local = (os.environ.get("MPI_LOCALRANKID") or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
             or os.environ.get("PMI_LOCAL_RANK") or comm.rank)
    device = int(local) % cp.cuda.runtime.getDeviceCount()
    cp.cuda.Device(device).use()
    props = cp.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return device, name, props["major"] * 10 + props["minor"]


# ----------------------------------------------------------------------------
# training state: checkpoints in gpt2_cpu's files, so either trainer resumes the other's

def host_copy(model):
    """What gpt2_cpu.write_model / write_state read from a model: config, fp32 params (master
    weights, or the parameters upcast), num_parameters, fp32 m and v; on the host."""
    return types.SimpleNamespace(config=model.config, params=download_parameters(model), num_parameters=model.num_parameters,
                                 m=model.m.get(), v=model.v.get())


def save_checkpoint(out_dir, step, model, loader, sample_rng_state, process_rank=0, num_processes=1):
    """Write model_<step>.bin (fp32, rank 0), state_<step>_<rank>.bin (with the master weights
    when there are some, so that the exact fp32 values resume), and return the DONE_<step> path,
    which the caller writes last (after a barrier). Same files as gpt2_cpu.save_checkpoint."""
    model_path, state_path, done_path = checkpoint_paths(out_dir, step, process_rank)
    host = host_copy(model)
    if process_rank == 0:
        write_model(model_path, host)
    write_state(state_path, host, step, process_rank, num_processes, loader, sample_rng_state,
                rng_state_last_update=model.rng_state_last_update,
                master_weights=host.params if model.master is not None else None)
    return done_path


def load_checkpoint(out_dir, step, model, loader, process_rank, num_processes):
    """Resume from the checkpoint of `step` in out_dir (written by either trainer): the parameters
    (from the state's master weights if present, else the fp32 model file), AdamW's m and v, the
    loader position, the stochastic-rounding RNG. Returns (step, sample_rng_state, state_path).
    bf16 parameters are the master weights rounded to nearest: at most 1 bf16 ulp away from the
    stochastically rounded values the run had (llm.c re-derives those with the last update's seed)."""
    model_path, state_path, _ = checkpoint_paths(out_dir, step, process_rank)
    saved = read_model(model_path)
    if saved.config != model.config:
        raise InputError(f"{model_path}: model {saved.config} does not match {model.config}")
    st = read_state(state_path, model.num_parameters, process_rank, num_processes)
    upload_parameters(model, st["master_weights"] if st["master_weights"] is not None else saved.params)
    model.m.set(np.ascontiguousarray(st["m"], dtype=np.float32))
    model.v.set(np.ascontiguousarray(st["v"], dtype=np.float32))
    if st["rng_state_last_update"]:                   # 0 from gpt2_cpu: keep the initial seed
        model.update_rng.state = st["rng_state_last_update"]
        model.rng_state_last_update = st["rng_state_last_update"]
    loader.restore(st["loader"])
    return st["step"], st["sample_rng_state"], state_path


# ----------------------------------------------------------------------------
# training loop

GPU_FLAGS_TITLE = "GPU options (gpt2_cuda.py only)"


def build_parser(prog="gpt2_cuda.py"):
    """gpt2_cpu.py's parser (every flag with the same letters, defaults and meaning) with the GPU
    flags added in their own group (llm.c's -f, -w, -r letters): one --help lists them all."""
    p = gpt2_cpu.build_parser(prog)
    p.description = "Train GPT-2 on NVIDIA GPUs (CuPy, our CUDA kernels, cuBLAS); gpt2_cpu.py's flags plus GPU options."
    a = p.add_argument_group(GPU_FLAGS_TITLE).add_argument
    a("--precision", default="auto", choices=("auto",) + PRECISIONS,
      help="storage precision; auto: bf16 on compute capability >= 8.0, else fp32")
    a("-f", "--tf32", type=int, default=1, choices=(0, 1), help="1: TF32 tensor cores for fp32 matmuls")
    a("-w", "--master-weights", type=int, default=1, choices=(0, 1), help="1: fp32 master weights in bf16")
    a("-r", "--recompute", type=int, default=1, choices=(0, 1), help="1: recompute GELU in the backward (saves L-1 (B,T,4C) buffers)")
    a("--check", action="store_true", help="compare one batch with gpt2_cpu.py, print per-tensor errors, exit 1 on failure")
    a("--check-dtype", default="float32", choices=("float32", "float64"), help="gpt2_cpu's dtype for --check")
    return p


def parse_args(argv=None):
    """gpt2_cpu.py's flags plus the GPU options -> argparse.Namespace."""
    return build_parser().parse_args(argv)


def validate(model, val_loader, val_max_steps, comm):
    """Mean validation loss over val_max_steps batches (-1: the whole split), averaged across ranks."""
    val_loader.reset()
    steps = val_max_steps if val_max_steps > 0 else val_loader.shard_num_samples * len(val_loader.files)
    total = 0.0
    for _ in range(steps):
        x, y = val_loader.next_batch()
        gpt2_forward(model, x, y)
        total += gpt2_mean_loss(model)
    return comm.mean(total / steps)


def setup_model(args, compute_capability, spec=None):
    """The model on the GPU from `spec` (default -e: a checkpoint or a descriptor), in the
    precision of the flags. Sets the process-wide TF32 choice."""
    precision = args.precision
    if precision == "auto":
        precision = "bf16" if compute_capability >= BF16_MIN_COMPUTE_CAPABILITY else "fp32"
    if precision == "bf16" and compute_capability < BF16_MIN_COMPUTE_CAPABILITY:
        raise InputError(f"--precision bf16 needs compute capability >= 8.0 (this GPU: {compute_capability / 10:.1f})")
    MATMUL_OPTIONS["tf32"] = bool(args.tf32) and compute_capability >= BF16_MIN_COMPUTE_CAPABILITY
    host = build_model(spec or args.model, args.seed)                           # fp32 on the host
    model = GPT2(host.config, precision, bool(args.master_weights), bool(args.recompute))
    upload_parameters(model, host.params)
    return model


def run_check(args, model):
    """--check: one batch (the first of -i) through gpt2_cpu and the GPU; 0 if all tensors agree."""
    loader = DataLoader(args.input_bin, args.batch_size, args.seq_len)
    x, y = loader.next_batch()
    ok = check_against_cpu(model, x, y, np.dtype(args.check_dtype).type)
    print("check: all tensors OK" if ok else "check: SOME TENSORS NOT OK")
    return 0 if ok else 1


def eval_rows(B):
    """Rows of a HellaSwag forward pass: B, or NUM_COMPLETIONS if B is smaller (one example's
    completions always go through together, as in gpt2_cpu.evaluate_multiple_choice)."""
    return max(B, NUM_COMPLETIONS)


def eval_forward_losses(model, B, T):
    """forward_losses for gpt2_cpu.evaluate_multiple_choice: inputs, targets (R,T) int32 on the
    host, R <= eval_rows(B) -> per-position losses (R,T) float32 on the host. The batch is padded
    to eval_rows(B) rows of PAD_TOKEN, so that every call has the same shape (a ragged last
    batch runs the same kernels and cuBLAS algorithms as the others); the padding's losses are
    dropped."""
    rows = eval_rows(B)

    def forward_losses(inputs, targets):
        R = inputs.shape[0]
        if R > rows or inputs.shape[1] != T:
            raise ValueError(f"forward_losses: got {inputs.shape}, at most ({rows},{T})")
        x = np.full((rows, T), PAD_TOKEN, dtype=np.int32)
        y = np.full((rows, T), PAD_TOKEN, dtype=np.int32)
        x[:R], y[:R] = inputs, targets
        gpt2_forward(model, x, y)
        return gpt2_activations(model, rows, T)["losses"][:R].get()       # (R,T) to the host
    return forward_losses


def sample_window(config, prompt_length, max_new_tokens):
    """Tokens per forward pass of gpt2_cpu.generate (its window), for allocating it up front."""
    return min(config.max_seq_len, prompt_length + max_new_tokens)


def train(args):
    """The training loop, gpt2_cpu.train's on the GPU: validate / HellaSwag / sample / checkpoint
    at the top of each step, then zero_grad, micro-batch forward+backward with accumulation,
    all-reduce, clip, update. --generate and --eval-only as in gpt2_cpu.train. Returns the model
    (the sampled ids with --generate)."""
    cp = _cupy()
    comm = Comm()
    master = comm.rank == 0
    say = print if master else (lambda *a, **k: None)
    device, device_name, capability = select_device(comm)
    B, T = args.batch_size, args.seq_len
    if B <= 0 or T <= 0:
        raise InputError(f"batch size and sequence length must be positive (got -b {B} -t {T})")
    if args.generate > 0:                                          # -e's model, as gpt2_cpu.train
        model = setup_model(args, capability)
        load_all_modules(model.precision)
        return sample_from_prompt(args, model, sampling_forward(model))  # allocates (1, window) itself
    if args.resume and not args.output_dir:
        raise InputError("-y 1 needs -o DIR to find the checkpoint in")
    resuming = bool(args.resume) and not args.eval_only           # --eval-only evaluates -e, as gpt2_cpu
    resume_step = latest_checkpoint_step(args.output_dir) if resuming else None
    if resuming and resume_step is None:
        raise InputError(f"{args.output_dir}: no complete checkpoint (DONE_* marker) to resume from")
    # resuming, the model (its shape too) comes from the checkpoint, as in gpt2_cpu.train
    spec = checkpoint_paths(args.output_dir, resume_step, comm.rank)[0] if resuming else None
    model = setup_model(args, capability, spec)
    cfg = model.config
    if T > cfg.max_seq_len:
        raise InputError(f"-t {T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    tokens_per_micro = B * T * comm.size
    total_batch = args.total_batch_size if args.total_batch_size > 0 else tokens_per_micro
    if total_batch % tokens_per_micro:
        raise InputError(f"-d {total_batch} is not a multiple of B*T*processes = {tokens_per_micro}")
    grad_accum_steps = total_batch // tokens_per_micro
    train_loader = DataLoader(args.input_bin, B, T, comm.rank, comm.size, bool(args.shuffle), args.seed)
    val_loader = DataLoader(args.input_val_bin, B, T, comm.rank, comm.size) if args.input_val_bin else None
    num_steps = args.max_steps if args.max_steps > 0 else train_loader.num_tokens // total_batch
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)

    examples = read_hellaswag(args.hellaswag_file) if args.hellaswag else None
    forward_losses = eval_forward_losses(model, B, T)
    sampling = master and args.sample_every > 0 and not args.eval_only
    sizes = [(B, T)] + ([(eval_rows(B), T)] if examples else [])
    if sampling:                                                   # the samples start from one token
        sizes.append((1, sample_window(cfg, 1, args.gen_tokens)))
    load_all_modules(model.precision)
    activation_bytes = gpt2_allocate(model, *sizes)                # every activation, once

    if args.eval_only:
        if val_loader:
            say(f"val loss {validate(model, val_loader, args.val_max_steps, comm):.6f}")
        if examples:
            acc, n = evaluate_multiple_choice(forward_losses, examples, B, T, comm)
            say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")
        return model

    tokenizer = None
    if sampling:
        try:
            tokenizer = Tokenizer(args.tokenizer)
        except InputError as e:
            say(f"note: {e}; samples will print token ids")

    say(f"device: {device_name} (cuda:{device}, compute capability {capability / 10:.1f}) | {model.precision}"
        f"{' + fp32 master weights' if model.master is not None else ''}"
        f"{' | TF32 matmuls' if model.precision == 'fp32' and MATMUL_OPTIONS['tf32'] else ''}"
        f" | recompute {int(model.recompute)}")
    say(f"model: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} maxT={cfg.max_seq_len} "
        f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} | {model.num_parameters:,} parameters")
    say(f"batch: B={B} T={T} processes={comm.size} grad_accum={grad_accum_steps} -> {total_batch} tokens/step | "
        f"train {train_loader.num_tokens:,} tokens in {len(train_loader.files)} shard(s) | {num_steps} steps")
    say(f"memory: activations {activation_bytes / 2**30:.2f} GiB, total in use "
        f"{cp.get_default_memory_pool().total_bytes() / 2**30:.2f} GiB")

    nccl = NcclComm(comm) if comm.size > 1 else None
    start_step = 0
    sample_rng = SamplerRNG(args.sample_seed)
    if resuming:
        start_step, sample_rng.state, state_path = load_checkpoint(args.output_dir, resume_step, model, train_loader,
                                                                   comm.rank, comm.size)
        say(f"resumed from {state_path} at step {start_step}")
    logger = Logger(args.output_dir if master else None, resuming=resuming)
    tokens_per_step_per_gpu = total_batch // comm.size

    for step in range(start_step, num_steps + 1):
        last_step = step == num_steps
        if val_loader and args.val_every > 0 and (step % args.val_every == 0 or last_step):
            val_loss = validate(model, val_loader, args.val_max_steps, comm)
            say(f"val loss {val_loss:.6f}")
            logger.log_val(step, val_loss)
        if examples and args.val_every > 0 and ((step > 0 and step % args.val_every == 0) or last_step):
            acc, n = evaluate_multiple_choice(forward_losses, examples, B, T, comm)
            say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")
            logger.log_eval(step, acc)
        if sampling and ((step > 0 and step % args.sample_every == 0) or last_step):
            say("generating:\n---")
            ids = generate(model, [tokenizer.eot_token if tokenizer else GPT2_EOT], args.gen_tokens, sample_rng,
                           forward=sampling_forward(model))
            say(tokenizer.decode(ids) if tokenizer else " ".join(map(str, ids)))
            say("---")
        if args.output_dir and args.checkpoint_every > 0 and step > start_step and \
                (step % args.checkpoint_every == 0 or last_step):
            done = save_checkpoint(args.output_dir, step, model, train_loader, sample_rng.state, comm.rank, comm.size)
            comm.barrier()
            if master:
                write_done_marker(done)
                say(f"checkpoint written: step {step} in {args.output_dir}")
        if last_step:
            break

        t0 = time.perf_counter()
        A = gpt2_activations(model, B, T)          # (cached) fetched per step: valid even if a sample reallocated
        gpt2_zero_grad(model)
        A["loss_accum"].fill(0)
        for _ in range(grad_accum_steps):
            if args.overfit_single_batch:
                train_loader.reset()
            x, y = train_loader.next_batch()
            gpt2_forward(model, x, y)
            cp.add(A["loss_accum"], A["losses"], out=A["loss_accum"])          # on the device, no sync
            gpt2_backward(model, loss_scale=1.0 / grad_accum_steps)
        if nccl is not None:
            nccl.mean_(model.grads)
        norm = gpt2_grad_norm(model)                                          # sync 1 of 2
        grad_scale = args.grad_clip / norm if 0 < args.grad_clip < norm else 1.0
        lr = learning_rate_at(step, args.lr_schedule, args.learning_rate, args.warmup_iters, num_steps, args.final_lr_frac)
        gpt2_update(model, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, step + 1, grad_scale)
        loss = float(A["loss_accum"].sum(dtype=np.float64)) / (B * T * grad_accum_steps)   # sync 2 of 2 (after the update)
        loss = comm.mean(loss)
        dt = time.perf_counter() - t0
        tokens_per_second = total_batch / dt
        util = mfu(model.num_parameters, cfg.num_layers, cfg.channels, T, tokens_per_step_per_gpu / dt,
                   device_name, model.precision, MATMUL_OPTIONS["tf32"])
        say(f"step {step + 1:4d}/{num_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.2e} | "
            f"{dt * 1000:.1f} ms | {tokens_per_second:.0f} tok/s | MFU {'n/a' if util is None else f'{100 * util:.1f}%'}")
        logger.log_train(step, loss, lr, norm)
    return model


def main(argv=None):
    """CLI entry point. Returns the exit code: 0; 1 for bad input (one `error:` line); 2 without a CUDA GPU or CuPy."""
    args = parse_args(argv)
    reason = cuda_unavailable_reason()
    if reason:
        print(f"gpt2_cuda.py: no CUDA GPU found ({reason}); use gpt2_cpu.py", file=sys.stderr)
        return 2
    try:
        if args.check:
            _, _, capability = select_device(Comm())
            return run_check(args, setup_model(args, capability))
        train(args)
    except (InputError, KernelCompileError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
