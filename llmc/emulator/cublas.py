"""llmc/emulator/cublas.py: cuBLAS through CuPy's bindings on the emulated device, the calls of
llmc.cuda.gemm's CupyCublas (the binding used where nvmath-python is missing) with the same
functions and arguments as cupy_backends.cuda.libs.cublas, on host addresses; and the GEMM itself
(_check_gemm, _gemm_on_host), which llmc/emulator/nvmath_cublas.py shares.

The contract is cuBLAS's, exactly: matrices are column-major; op(A) is m x k, stored as A (m x k,
leading dimension lda >= m) for CUBLAS_OP_N or as its transpose (k x m, lda >= k) for
CUBLAS_OP_T; op(B) is k x n the same way (ldb); C is m x n (ldc >= m). C = alpha op(A) op(B) +
beta C, with alpha and beta read from host memory (pointer mode host) when the call is made; C is
not read when beta == 0 (it may hold NaN). The strided-batched call repeats this for `batch`
matrices that start stride_a, stride_b, stride_c elements apart. A leading dimension below the
stored matrix's rows, a negative size or an unknown enum raises CUBLASError
(CUBLAS_STATUS_INVALID_VALUE, as cuBLAS returns it); a wrong but legal leading dimension reads
the memory that cuBLAS would read, so the result is wrong in the same way.

Numerics: inputs (fp32, or bf16 converted exactly) are multiplied in fp32 by NumPy's matmul (fp32
accumulation, in the BLAS's order, not cuBLAS's); CUBLAS_COMPUTE_32F_FAST_TF32 first rounds fp32
inputs to TF32 (10 mantissa bits, to nearest even); a bf16 C is rounded to nearest even.

Streams, as CuPy 14.2 binds them (cupy_backends/cuda/libs/cublas.pyx at v14.2.0): every BLAS
call first sets the handle's stream to the current CuPy stream (_setStream, lines 666-668), and
setStream raises NotImplementedError('calling cuBLAS API during stream capture is currently
unsupported') when that stream captures (lines 642-655; cupy/cupy#6290). So here too a gemmEx
or gemmStridedBatchedEx issued while the current stream captures raises that, before anything
else, and records nothing. cuBLAS itself can be captured: llmc/emulator/nvmath_cublas.py
(nvmath-python's bindings, which check nothing of the kind) is the capturable path.

What it is not: cuBLAS's numerics (its summation order and tensor-core rounding differ), its
speed, or its other calls.
"""

import ctypes
import threading

import numpy as np

from llmc.emulator.device import cublas_stream, cuda, enqueue, set_cublas_stream, stream_at
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

# enums (cublas_api.h, library_types.h), the values llmc.cuda uses
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_OP_C = 2
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_POINTER_MODE_DEVICE = 1
CUBLAS_STATUS_INVALID_VALUE = 7
CUBLAS_STATUS_NOT_SUPPORTED = 15

DATA_TYPES = {CUDA_R_32F: np.dtype(np.float32), CUDA_R_16BF: np.dtype(np.uint16)}   # bf16 as its bits
COMPUTE_TYPES = (CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32)
TF32_DROPPED_BITS = 13                 # fp32 has 23 mantissa bits, TF32 10

_POINTER_MODE = {}                     # handle -> pointer mode


class CUBLASError(RuntimeError):
    """A call cuBLAS would refuse; .status is the cublasStatus_t it would return."""

    def __init__(self, status, message):
        super().__init__(f"CUBLAS_STATUS {status}: {message}")
        self.status = status


def setPointerMode(handle, mode):
    if mode not in (CUBLAS_POINTER_MODE_HOST, CUBLAS_POINTER_MODE_DEVICE):
        raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE, f"setPointerMode: unknown mode {mode}")
    _POINTER_MODE[handle] = mode


def getPointerMode(handle):
    return _POINTER_MODE.get(handle, CUBLAS_POINTER_MODE_HOST)


def setStream(handle, stream):
    """The stream the handle's calls run on. Raises NotImplementedError while that stream
    captures, as CuPy 14's setStream (it checks cudaStreamIsCapturing first). The handle's
    stream is kept with the handle, in llmc.emulator.device, whose cp.matmul sets it too."""
    set_cublas_stream(handle, stream)


def getStream(handle):
    return cublas_stream(handle)


def _setStream(handle):
    """CuPy's first step of every BLAS call: the handle onto the current stream."""
    setStream(handle, cuda.get_current_stream().ptr)


def _read_scalar(ptr):
    """The fp32 scalar at host (or, the same here, device) address ptr."""
    return ctypes.c_float.from_address(ptr).value


def _matrices(ptr, dtype, rows, cols, ld, batch=1, stride=0, writeable=False):
    """The `batch` column-major rows x cols matrices at address ptr with leading dimension ld,
    matrix b starting b*stride elements after ptr, as a (batch, cols, rows) strided NumPy view of
    exactly the memory cuBLAS reads: element (i, j) of matrix b at ptr + (b*stride + i + j*ld) *
    itemsize. A column-major matrix read row-major is its transpose, so view[b] is matrix b
    transposed, and nothing is copied."""
    if rows == 0 or cols == 0 or batch == 0:
        return np.zeros((batch, cols, rows), dtype)
    first = min(0, (batch - 1) * stride)                       # a negative stride reads below ptr
    extent = max(0, (batch - 1) * stride) + (cols - 1) * ld + rows - first
    buffer = (ctypes.c_char * (extent * dtype.itemsize)).from_address(ptr + first * dtype.itemsize)
    view = np.ndarray((batch, cols, rows), dtype, buffer=buffer, offset=-first * dtype.itemsize,
                      strides=(stride * dtype.itemsize, ld * dtype.itemsize, dtype.itemsize))
    view.flags.writeable = writeable
    return view


def _to_float32(x, dtype, tf32):
    """x (bf16 bits or fp32, any strides) as fp32, rounded to TF32 when tf32; fp32 is not copied."""
    x = bfloat16_bits_to_float32(x) if dtype == np.uint16 else np.asarray(x, dtype=np.float32)
    if tf32:                           # round to nearest even at bit 13, then clear the dropped bits
        bits = x.view(np.uint32)
        half = np.uint32(1 << (TF32_DROPPED_BITS - 1)) - np.uint32(1)
        bits = (bits + half + ((bits >> TF32_DROPPED_BITS) & np.uint32(1))) & ~np.uint32((1 << TF32_DROPPED_BITS) - 1)
        finite = np.isfinite(x)
        x = np.where(finite, bits.view(np.float32), x)
    return x


_scratch = threading.local()            # per host thread: the fp32 product buffer of _gemm_on_host


def _product_buffer(shape):
    """An fp32 array of `shape` in a buffer kept for the next GEMM (grown when too small), for a
    product that is scaled, accumulated or converted before it reaches C. A new array each call
    would be a fresh mapping for a large product (the 51 MB gradient of wte at d4), whose page
    faults cost twice the product itself."""
    size = int(np.prod(shape))
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _scratch.buffer = np.empty(size, np.float32)
    return buffer[:size].reshape(shape)


def _check_gemm(name, transa, transb, m, n, k, Atype, lda, Btype, ldb, Ctype, ldc, compute, batch=1):
    """cuBLAS's argument checks of a GEMM: raises CUBLASError with the status cuBLAS returns for an
    unknown op, a negative size, a leading dimension below the stored rows, an unknown or mixed
    data type, or an unsupported compute type. Returns the stored rows of A and B."""
    for label, op in (("transa", transa), ("transb", transb)):
        if op not in (CUBLAS_OP_N, CUBLAS_OP_T):
            raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE, f"{name}: {label}={op} (N=0 and T=1 are emulated)")
    if min(m, n, k, batch) < 0:
        raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE, f"{name}: negative size m={m} n={n} k={k} batch={batch}")
    a_rows = m if transa == CUBLAS_OP_N else k
    b_rows = k if transb == CUBLAS_OP_N else n
    for label, ld, rows in (("lda", lda, a_rows), ("ldb", ldb, b_rows), ("ldc", ldc, m)):
        if ld < max(1, rows):
            raise CUBLASError(CUBLAS_STATUS_INVALID_VALUE, f"{name}: {label}={ld} < {max(1, rows)}, the rows of the "
                                                           f"stored matrix")
    for label, t in (("Atype", Atype), ("Btype", Btype), ("Ctype", Ctype)):
        if t not in DATA_TYPES:
            raise CUBLASError(CUBLAS_STATUS_NOT_SUPPORTED, f"{name}: {label}={t} (CUDA_R_32F and CUDA_R_16BF are emulated)")
    if not Atype == Btype == Ctype:
        raise CUBLASError(CUBLAS_STATUS_NOT_SUPPORTED, f"{name}: mixed data types {Atype}, {Btype}, {Ctype}")
    if compute not in COMPUTE_TYPES:
        raise CUBLASError(CUBLAS_STATUS_NOT_SUPPORTED, f"{name}: compute type {compute}")
    if compute == CUBLAS_COMPUTE_32F_FAST_TF32 and Atype != CUDA_R_32F:
        raise CUBLASError(CUBLAS_STATUS_NOT_SUPPORTED, f"{name}: TF32 compute with non-fp32 data")
    return a_rows, b_rows


def _gemm_on_host(transa, transb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc, dtype, tf32, batch=1,
                 stride_a=0, stride_b=0, stride_c=0):
    """`batch` column-major products C_i (m,n) = alpha op(A_i) (m,k) op(B_i) (k,n) + beta C_i on
    host addresses A, B, C (matrix i at i*stride elements); alpha, beta are floats. Computed on
    row-major views of cuBLAS's memory, which hold the transposes: C^T = op(B)^T op(A)^T, written
    straight into C when there is nothing to scale or convert."""
    if m == 0 or n == 0 or batch == 0:
        return
    if batch > 1 and abs(stride_c) < (n - 1) * ldc + m:        # C_i overlap: write them in order, as cuBLAS
        size = dtype.itemsize
        for i in range(batch):
            _gemm_on_host(transa, transb, m, n, k, alpha, A + i * stride_a * size, lda, B + i * stride_b * size,
                         ldb, beta, C + i * stride_c * size, ldc, dtype, tf32)
        return
    ct = _matrices(C, dtype, m, n, ldc, batch, stride_c, writeable=True)         # (batch,n,m) = C^T
    direct = dtype == np.float32 and not tf32 and alpha == 1.0 and beta == 0.0
    if k == 0:
        product = np.zeros((batch, n, m), np.float32)
    else:
        at = _matrices(A, dtype, m if transa == CUBLAS_OP_N else k, k if transa == CUBLAS_OP_N else m, lda,
                       batch, stride_a)                                            # A^T as stored
        bt = _matrices(B, dtype, k if transb == CUBLAS_OP_N else n, n if transb == CUBLAS_OP_N else k, ldb,
                       batch, stride_b)                                            # B^T as stored
        if not direct:
            at, bt = _to_float32(at, dtype, tf32), _to_float32(bt, dtype, tf32)
        op_at = at if transa == CUBLAS_OP_N else at.transpose(0, 2, 1)           # op(A)^T (batch,k,m)
        op_bt = bt if transb == CUBLAS_OP_N else bt.transpose(0, 2, 1)           # op(B)^T (batch,n,k)
        if direct:
            np.matmul(op_bt, op_at, out=ct)                                        # (n,k) @ (k,m) -> (n,m), fp32
            return
        product = np.matmul(op_bt, op_at, out=_product_buffer((batch, n, m)))     # (batch,n,m), fp32
    if alpha != 1.0:
        product *= np.float32(alpha)
    if beta == 1.0 and dtype == np.float32:                                        # C += product: the gradients'
        ct += product                                                              # accumulation, in one pass
        return
    if beta != 0.0:                                                                # beta == 0: C is not read
        product += np.float32(beta) * _to_float32(ct, dtype, False)
    ct[...] = float32_to_bfloat16_bits(product) if dtype == np.uint16 else product


def _scalars(handle, name, alpha, beta):
    if getPointerMode(handle) != CUBLAS_POINTER_MODE_HOST:
        raise CUBLASError(CUBLAS_STATUS_NOT_SUPPORTED, f"{name}: device pointer mode is not emulated")
    return _read_scalar(alpha), _read_scalar(beta)


def gemmEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
           computeType, algo):
    """C (m,n) = alpha op(A) (m,k) op(B) (k,n) + beta C, column-major, on host addresses, on the
    current stream (refused while it captures, see the module docstring)."""
    _setStream(handle)
    _check_gemm("gemmEx", transa, transb, m, n, k, Atype, lda, Btype, ldb, Ctype, ldc, computeType)
    a, b = _scalars(handle, "gemmEx", alpha, beta)             # read now, as cuBLAS does
    tf32 = computeType == CUBLAS_COMPUTE_32F_FAST_TF32
    enqueue(lambda: _gemm_on_host(transa, transb, m, n, k, a, A, lda, B, ldb, b, C, ldc, DATA_TYPES[Ctype], tf32),
            stream_at(getStream(handle)))


def gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB,
                         beta, C, Ctype, ldc, strideC, batchCount, computeType, algo):
    """gemmEx repeated for batchCount products; matrix i of A starts i*strideA elements after A
    (likewise B, C)."""
    _setStream(handle)
    _check_gemm("gemmStridedBatchedEx", transa, transb, m, n, k, Atype, lda, Btype, ldb, Ctype, ldc, computeType,
               batchCount)
    a, b = _scalars(handle, "gemmStridedBatchedEx", alpha, beta)
    dtype = DATA_TYPES[Ctype]
    tf32 = computeType == CUBLAS_COMPUTE_32F_FAST_TF32

    enqueue(lambda: _gemm_on_host(transa, transb, m, n, k, a, A, lda, B, ldb, b, C, ldc, dtype, tf32, batchCount,
                                 strideA, strideB, strideC), stream_at(getStream(handle)))
