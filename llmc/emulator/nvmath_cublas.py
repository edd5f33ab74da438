"""llmc/emulator/nvmath_cublas.py: cuBLAS through nvmath-python's bindings on the emulated device,
the subset of `nvmath.bindings.cublas` that llmc.cuda.gemm calls, with the same function names,
positional arguments and integer handles, on host addresses. llmc.cuda.library("nvmath_cublas")
returns this module on the emulated device and nvmath's on a GPU.

Why a second cuBLAS binding: CuPy's (llmc/emulator/cublas.py) sets the handle's stream before
every call and refuses while that stream captures; nvmath's are thin wrappers of the C API that
check nothing of the kind, so a call made while the stream captures is recorded into the graph,
as cuBLAS itself allows. The library and its numerics are the same: the GEMM contract, the
argument checks and the arithmetic are llmc/emulator/cublas.py's (_check_gemm, _gemm_on_host).

The handle, as cuBLAS's: created with the legacy stream (0) and host pointer mode; every call
runs on the stream last given to set_stream, not on the caller's current stream. So a GEMM on a
handle left on another stream runs outside the capture (the graph then lacks it), and one left
on the legacy stream while a blocking stream captures fails, as CUDA's
cudaErrorStreamCaptureImplicit does (raised here as cuBLASError EXECUTION_FAILED). alpha and beta
are read from host memory when the call is made (pointer mode host), so a graph keeps the
values they had at capture time, as cuBLAS documents for CUDA graphs.

What it is not: nvmath's other calls (no workspace, math mode or atomics settings), device
pointer mode, or cuBLAS's numerics (see llmc/emulator/cublas.py).

Run its tests: python -m pytest -q tests/test_cuda_graph.py -k nvmath
Legend: m, n, k the product's dimensions; ld a leading dimension, in elements.
"""

import enum
import itertools

from llmc.emulator import cublas
from llmc.emulator.device import cuda, enqueue, stream_at

VERSION = 120400                        # cublasGetVersion() of the CUDA 12.4 documentation followed here


# ----------------------------------------------------------------------------
# enums (values from cublas_api.h; the names nvmath gives them)

class Status(enum.IntEnum):
    SUCCESS = 0
    NOT_INITIALIZED = 1
    INVALID_VALUE = 7
    EXECUTION_FAILED = 13
    NOT_SUPPORTED = 15


class Operation(enum.IntEnum):
    N = cublas.CUBLAS_OP_N
    T = cublas.CUBLAS_OP_T
    C = cublas.CUBLAS_OP_C


class PointerMode(enum.IntEnum):
    HOST = cublas.CUBLAS_POINTER_MODE_HOST
    DEVICE = cublas.CUBLAS_POINTER_MODE_DEVICE


class ComputeType(enum.IntEnum):
    COMPUTE_32F = cublas.CUBLAS_COMPUTE_32F
    COMPUTE_32F_FAST_TF32 = cublas.CUBLAS_COMPUTE_32F_FAST_TF32


class GemmAlgo(enum.IntEnum):
    DEFAULT = -1


class cuBLASError(Exception):
    """A cuBLAS call that returns a status other than SUCCESS (nvmath raises the same class)."""

    def __init__(self, status, why=""):
        self.status = Status(status)
        super().__init__(f"{self.status.name}" + (f": {why}" if why else ""))


# ----------------------------------------------------------------------------
# handles: integer ids, each with the stream and pointer mode its calls use

_HANDLES = {}                           # id -> {"stream": cudaStream_t, "pointer_mode": int}
_IDS = itertools.count(0x2000)


def _handle(handle):
    state = _HANDLES.get(handle)
    if state is None:
        raise cuBLASError(Status.NOT_INITIALIZED, f"{handle:#x} is not a live cuBLAS handle")
    return state


def create():
    handle = next(_IDS)
    _HANDLES[handle] = {"stream": 0, "pointer_mode": PointerMode.HOST}
    return handle


def destroy(handle):
    _handle(handle)
    del _HANDLES[handle]


def get_version(handle):
    _handle(handle)
    return VERSION


def set_stream(handle, stream_id):
    """Every later call of the handle runs on stream_id (0: the legacy stream). Allowed while a
    stream captures: it only changes the handle."""
    _handle(handle)["stream"] = stream_at(stream_id).ptr


def get_stream(handle):
    return _handle(handle)["stream"]


def set_pointer_mode(handle, mode):
    if mode not in tuple(PointerMode):
        raise cuBLASError(Status.INVALID_VALUE, f"set_pointer_mode: unknown mode {mode}")
    _handle(handle)["pointer_mode"] = mode


def get_pointer_mode(handle):
    return _handle(handle)["pointer_mode"]


# ----------------------------------------------------------------------------
# the GEMMs

def _issue(state, name, work):
    """Run or record `work` on the handle's stream; CUDA's refusal of the legacy stream during a
    blocking capture comes back as the failed launch cuBLAS reports."""
    try:
        enqueue(work, stream_at(state["stream"]))
    except cuda.runtime.CUDARuntimeError as e:
        raise cuBLASError(Status.EXECUTION_FAILED, f"{name}: {e}") from None


def _prepare(handle, name, alpha, beta, *checked):
    """The handle's state and the host scalars alpha, beta, after cuBLAS's argument checks."""
    state = _handle(handle)
    try:
        cublas._check_gemm(name, *checked)
    except cublas.CUBLASError as e:
        raise cuBLASError(e.status, str(e)) from None
    if state["pointer_mode"] != PointerMode.HOST:
        raise cuBLASError(Status.NOT_SUPPORTED, f"{name}: device pointer mode is not emulated")
    return state, cublas._read_scalar(alpha), cublas._read_scalar(beta)


def gemm_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c, ctype, ldc, compute_type,
            algo):
    """cublasGemmEx: c (m,n) = alpha op(a) (m,k) op(b) (k,n) + beta c, column-major, on host
    addresses, on the handle's stream."""
    state, alpha_value, beta_value = _prepare(handle, "gemm_ex", alpha, beta, transa, transb, m, n, k, atype, lda,
                                              btype, ldb, ctype, ldc, compute_type)
    tf32 = compute_type == ComputeType.COMPUTE_32F_FAST_TF32
    dtype = cublas.DATA_TYPES[ctype]
    _issue(state, "gemm_ex", lambda: cublas._gemm_on_host(transa, transb, m, n, k, alpha_value, a, lda, b, ldb,
                                                         beta_value, c, ldc, dtype, tf32))


def gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, stride_a, b, btype, ldb, stride_b,
                            beta, c, ctype, ldc, stride_c, batch_count, compute_type, algo):
    """cublasGemmStridedBatchedEx: gemm_ex repeated for batch_count products, matrix i of a
    starting i*stride_a elements after a (likewise b, c), on the handle's stream."""
    state, alpha_value, beta_value = _prepare(handle, "gemm_strided_batched_ex", alpha, beta, transa, transb, m, n, k,
                                              atype, lda, btype, ldb, ctype, ldc, compute_type, batch_count)
    tf32 = compute_type == ComputeType.COMPUTE_32F_FAST_TF32
    dtype = cublas.DATA_TYPES[ctype]
    _issue(state, "gemm_strided_batched_ex",
           lambda: cublas._gemm_on_host(transa, transb, m, n, k, alpha_value, a, lda, b, ldb, beta_value, c, ldc,
                                       dtype, tf32, batch_count, stride_a, stride_b, stride_c))
