"""
llmc/emulator/cublaslt.py: cuBLASLt for the emulated CUDA device, the subset of
`nvmath.bindings.cublasLt` that llmc/cublaslt.py calls, with the same function names, arguments
and integer handles, computing on host addresses. llmc.cuda.library("cublaslt") returns this
module on the emulated device and nvmath's on a GPU, so llmc/cublaslt.py runs unchanged on both.

The contract is cuBLASLt's, taken literally (cuBLAS documentation, "cuBLASLt API"):
    D (m,n) = epilogue(alpha op(A) (m,k) @ op(B) (k,n) + beta C (m,n))
every matrix column-major as its layout says: element (r, c) of a (rows, cols, ld) layout sits at
ptr + (r + c*ld) * itemsize; op(X) = X or X^T from the descriptor's TRANSA / TRANSB; alpha and
beta are float32 host scalars (scale type CUDA_R_32F, pointer mode host); beta = 0 reads nothing
of C. In place, C == D, the two layouts must be the same (cuBLASLt: "C == D and Cdesc == Ddesc");
out of place, C != D, C is only read: the same type, rows and columns as D, its own leading
dimension. The epilogue applies to the whole alpha op(A) op(B) + beta C, so with BIAS an
out-of-place C is a residual added beside the bias: D = op(A) op(B) + C + bias at alpha = beta = 1.
The epilogues:
    BIAS             D = result + bias, bias (m,) one value per row of D, broadcast over columns
    GELU             D = gelu(result)                (GELU_BIAS: gelu(result + bias))
    GELU_AUX         aux = result, D = gelu(aux)     (GELU_AUX_BIAS: aux = result + bias)
    DGELU            D = result * gelu'(aux)         aux read
    DGELU_BGRAD      D = result * gelu'(aux), bias (m,) = sums of each row of D over its n
                     columns (before D is rounded to its type), written: "each row summed"
    BGRADB           D = result, bias (n,) = sums of op(B) over k, one per column of D, written
the bias and the aux at BIAS_POINTER / EPILOGUE_AUX_POINTER, the aux (m,n) with leading dimension
EPILOGUE_AUX_LD (a multiple of 8, >= m), both in D's type. GELU is the tanh form, computed by
gpt2_cpu.gelu_forward / gelu_backward (imported, the one definition of it).
So a wrong leading dimension, transpose, pointer or epilogue gives a wrong D, as on a GPU.

Numerics: the operands are read exactly (bf16 bits widened to float32, to float64 for the
arithmetic; fp32 inputs rounded to TF32, nearest with ties away from zero, under
COMPUTE_32F_FAST_TF32); alpha op(A) op(B) + beta C is summed in float64 and rounded once to
float32 (cuBLASLt's fp32 accumulation, with its summation error left out); the bias is added in
float32; the result is rounded once to D's type (bf16: nearest even).

Streams: matmul is issued on the stream it is given (llmc/emulator/device.py enqueue): run at
once, or recorded while that stream captures, with the descriptor's attributes, the layouts and
alpha, beta as they were at the call (a graph keeps the bias and aux pointers it captured).

What it deliberately is not: cuBLASLt's algorithms, tiling or summation order (the heuristic
answers up to ALGORITHMS "algorithms", which all compute the same way, with no workspace: enough
for llmc/cublaslt.py's autotuning to time each and keep one), batched or row-major layouts, FP8,
or another epilogue (the heuristic answers NOT_SUPPORTED). Pointers are not checked against
allocations: a pointer must lie in host memory that holds its whole matrix, as a device pointer
must on a GPU.

Run its tests: python -m pytest -q tests/test_vendor_emulation.py -k cublaslt
Legend: m, n, k the product's dimensions; ld a leading dimension, in elements.
"""

import ctypes
import enum
import itertools

import numpy as np

from llmc.emulator.device import enqueue, stream_at
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

# ----------------------------------------------------------------------------
# enums and C types (values from cublasLt.h, cublas_api.h and library_types.h)

VERSION = 120400                        # cublasLtGetVersion() of the CUDA 12.4 documentation followed here


class Status(enum.IntEnum):
    SUCCESS = 0
    NOT_INITIALIZED = 1
    INVALID_VALUE = 7
    NOT_SUPPORTED = 15


class Epilogue(enum.IntEnum):
    DEFAULT = 1
    BIAS = 4
    GELU = 32
    GELU_BIAS = 36
    GELU_AUX = 160
    GELU_AUX_BIAS = 164
    DGELU = 192
    DGELU_BGRAD = 208
    BGRADB = 512


class MatmulDescAttribute(enum.IntEnum):
    COMPUTE_TYPE = 0
    SCALE_TYPE = 1
    POINTER_MODE = 2
    TRANSA = 3
    TRANSB = 4
    EPILOGUE = 7
    BIAS_POINTER = 8
    EPILOGUE_AUX_POINTER = 11
    EPILOGUE_AUX_LD = 12
    BIAS_DATA_TYPE = 26


class MatmulPreferenceAttribute(enum.IntEnum):
    MAX_WORKSPACE_BYTES = 1
    MIN_ALIGNMENT_A_BYTES = 5
    MIN_ALIGNMENT_B_BYTES = 6
    MIN_ALIGNMENT_C_BYTES = 7
    MIN_ALIGNMENT_D_BYTES = 8


class MatrixLayoutAttribute(enum.IntEnum):
    TYPE = 0
    ORDER = 1
    ROWS = 2
    COLS = 3
    LD = 4


OP_N, OP_T = 0, 1                       # cublasOperation_t
CUDA_R_32F, CUDA_R_16BF = 0, 14         # cudaDataType_t
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
STORAGE = {CUDA_R_32F: np.dtype(np.float32), CUDA_R_16BF: np.dtype(np.uint16)}   # bf16 as its bits
BIAS_TYPE_OF_D = -1                     # BIAS_DATA_TYPE's default: the bias has D's type
AUX_LD_MULTIPLE = 8
TF32_DROPPED_BITS = 13                  # TF32 keeps 10 of float32's 23 mantissa bits

DESC_DTYPES = {MatmulDescAttribute.COMPUTE_TYPE: np.int32, MatmulDescAttribute.SCALE_TYPE: np.int32,
               MatmulDescAttribute.POINTER_MODE: np.int32, MatmulDescAttribute.TRANSA: np.int32,
               MatmulDescAttribute.TRANSB: np.int32, MatmulDescAttribute.EPILOGUE: np.uint32,
               MatmulDescAttribute.BIAS_POINTER: np.int64, MatmulDescAttribute.EPILOGUE_AUX_POINTER: np.int64,
               MatmulDescAttribute.EPILOGUE_AUX_LD: np.int64, MatmulDescAttribute.BIAS_DATA_TYPE: np.int32}
PREF_DTYPES = {MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES: np.uint64,
               MatmulPreferenceAttribute.MIN_ALIGNMENT_A_BYTES: np.uint32,
               MatmulPreferenceAttribute.MIN_ALIGNMENT_B_BYTES: np.uint32,
               MatmulPreferenceAttribute.MIN_ALIGNMENT_C_BYTES: np.uint32,
               MatmulPreferenceAttribute.MIN_ALIGNMENT_D_BYTES: np.uint32}
LAYOUT_DTYPES = {MatrixLayoutAttribute.TYPE: np.uint32, MatrixLayoutAttribute.ORDER: np.int32,
                 MatrixLayoutAttribute.ROWS: np.uint64, MatrixLayoutAttribute.COLS: np.uint64,
                 MatrixLayoutAttribute.LD: np.int64}
# cublasLtMatmulHeuristicResult_t: 96 bytes, starting with its 64-byte cublasLtMatmulAlgo_t
matmul_heuristic_result_dtype = np.dtype([("algo", np.uint64, (8,)), ("workspace_size", np.uint64),
                                          ("state", np.int32), ("waves_count", np.float32),
                                          ("reserved", np.int32, (4,))])


def get_matmul_desc_attribute_dtype(attr):
    return np.dtype(DESC_DTYPES[attr])


def get_matmul_preference_attribute_dtype(attr):
    return np.dtype(PREF_DTYPES[attr])


def get_matrix_layout_attribute_dtype(attr):
    return np.dtype(LAYOUT_DTYPES[attr])


class cuBLASLtError(Exception):
    """A cuBLASLt call that returns a status other than SUCCESS (nvmath raises the same)."""

    def __init__(self, status, why=""):
        self.status = Status(status)
        super().__init__(f"{self.status.name}" + (f": {why}" if why else ""))


def _require(condition, why, status=Status.INVALID_VALUE):
    if not condition:
        raise cuBLASLtError(status, why)


# ----------------------------------------------------------------------------
# host memory and the opaque objects (handles, descriptors, layouts, preferences: integer ids)

_OBJECTS = {}                            # id -> {"kind": ..., fields}
_IDS = itertools.count(0x1000)
_ALGORITHMS = {}                         # algorithm id -> what the heuristic answered it for
ALGORITHMS = 3                          # the most algorithms one heuristic call answers


def _host(ptr, nbytes):
    """A writable uint8 view of the nbytes at host address ptr (the emulated device's memory)."""
    _require(ptr, "null pointer")
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def _read_value(buf, size, dtype):
    _require(size == np.dtype(dtype).itemsize, f"attribute of {size} bytes, its C type has {np.dtype(dtype).itemsize}")
    return _host(buf, size).view(dtype)[0].item()


def _write_value(buf, size, size_written, value, dtype):
    dtype = np.dtype(dtype)
    _require(size >= dtype.itemsize, f"buffer of {size} bytes for an attribute of {dtype.itemsize}")
    _host(buf, dtype.itemsize)[...] = np.array([value], dtype).view(np.uint8)
    if size_written:
        _host(size_written, 8)[...] = np.array([dtype.itemsize], np.uint64).view(np.uint8)


def _new(kind, **fields):
    handle = next(_IDS)
    _OBJECTS[handle] = dict(kind=kind, **fields)
    return handle


def _get(handle, kind):
    obj = _OBJECTS.get(handle)
    _require(obj is not None and obj["kind"] == kind, f"{handle:#x} is not a live {kind}", Status.NOT_INITIALIZED)
    return obj


def _destroy(handle, kind):
    _get(handle, kind)
    del _OBJECTS[handle]


def _matrix(ptr, layout):
    """The (rows, cols) column-major matrix of `layout` at ptr, as a writable strided view of host
    memory in its storage dtype: element (r, c) at ptr + (r + c*ld) * itemsize."""
    rows, cols, ld, dtype = layout["rows"], layout["cols"], layout["ld"], STORAGE[layout["type"]]
    _require(ld >= max(1, rows), f"leading dimension {ld} < rows {rows}")
    span = ld * (cols - 1) + rows                                     # elements from the first to the last
    flat = _host(ptr, span * dtype.itemsize).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, shape=(rows, cols), strides=(dtype.itemsize, ld * dtype.itemsize))


def _load(x):
    """Stored values (bf16 bits or float32) -> float64, exactly."""
    return (bfloat16_bits_to_float32(x) if x.dtype == np.uint16 else x).astype(np.float64)


def _store(view, values):
    """Round float64 values once to float32, then (bf16) to nearest even, into `view`."""
    values = np.asarray(values, dtype=np.float32)
    view[...] = float32_to_bfloat16_bits(values) if view.dtype == np.uint16 else values


def _tf32(x):
    """float32 values rounded to TF32 (10 mantissa bits), nearest, ties away from zero."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    half = np.uint32(1 << (TF32_DROPPED_BITS - 1))
    return ((bits + half) & np.uint32(~((1 << TF32_DROPPED_BITS) - 1) & 0xFFFFFFFF)).view(np.float32)


# ----------------------------------------------------------------------------
# the API: handle, descriptors, layouts, preferences

def get_version():
    return VERSION


def create():
    return _new("handle")


def destroy(handle):
    _destroy(handle, "handle")


def matmul_desc_create(compute_type, scale_type):
    _require(compute_type in (COMPUTE_32F, COMPUTE_32F_FAST_TF32), f"compute type {compute_type}", Status.NOT_SUPPORTED)
    _require(scale_type == CUDA_R_32F, f"scale type {scale_type}", Status.NOT_SUPPORTED)
    attrs = {MatmulDescAttribute.COMPUTE_TYPE: compute_type, MatmulDescAttribute.SCALE_TYPE: scale_type,
             MatmulDescAttribute.POINTER_MODE: 0, MatmulDescAttribute.TRANSA: OP_N, MatmulDescAttribute.TRANSB: OP_N,
             MatmulDescAttribute.EPILOGUE: Epilogue.DEFAULT, MatmulDescAttribute.BIAS_POINTER: 0,
             MatmulDescAttribute.EPILOGUE_AUX_POINTER: 0, MatmulDescAttribute.EPILOGUE_AUX_LD: 0,
             MatmulDescAttribute.BIAS_DATA_TYPE: BIAS_TYPE_OF_D}
    return _new("desc", attrs=attrs)


def matmul_desc_set_attribute(desc, attr, buf, size_in_bytes):
    _require(attr in DESC_DTYPES, f"matmul descriptor attribute {attr}", Status.NOT_SUPPORTED)
    _get(desc, "desc")["attrs"][MatmulDescAttribute(attr)] = _read_value(buf, size_in_bytes, DESC_DTYPES[attr])


def matmul_desc_get_attribute(desc, attr, buf, size_in_bytes, size_written):
    _require(attr in DESC_DTYPES, f"matmul descriptor attribute {attr}", Status.NOT_SUPPORTED)
    value = _get(desc, "desc")["attrs"][MatmulDescAttribute(attr)]
    _write_value(buf, size_in_bytes, size_written, value, DESC_DTYPES[attr])


def matmul_desc_destroy(desc):
    _destroy(desc, "desc")


def matrix_layout_create(type, rows, cols, ld):                       # noqa: A002 (nvmath's argument name)
    _require(type in STORAGE, f"data type {type}", Status.NOT_SUPPORTED)
    _require(rows >= 0 and cols >= 0, f"{rows} x {cols}")
    return _new("layout", type=type, rows=rows, cols=cols, ld=ld)


def matrix_layout_get_attribute(layout, attr, buf, size_in_bytes, size_written):
    obj = _get(layout, "layout")
    values = {MatrixLayoutAttribute.TYPE: obj["type"], MatrixLayoutAttribute.ORDER: 0,   # CUBLASLT_ORDER_COL
              MatrixLayoutAttribute.ROWS: obj["rows"], MatrixLayoutAttribute.COLS: obj["cols"],
              MatrixLayoutAttribute.LD: obj["ld"]}
    _require(attr in values, f"matrix layout attribute {attr}", Status.NOT_SUPPORTED)
    _write_value(buf, size_in_bytes, size_written, values[MatrixLayoutAttribute(attr)], LAYOUT_DTYPES[attr])


def matrix_layout_destroy(layout):
    _destroy(layout, "layout")


DEFAULT_ALIGNMENT_BYTES = 256           # a preference's MIN_ALIGNMENT_*_BYTES until set (cuBLASLt's default)


def matmul_preference_create():
    attrs = {a: DEFAULT_ALIGNMENT_BYTES for a in PREF_DTYPES}
    attrs[MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES] = 0
    return _new("pref", attrs=attrs)


def matmul_preference_set_attribute(pref, attr, buf, size_in_bytes):
    _require(attr in PREF_DTYPES, f"preference attribute {attr}", Status.NOT_SUPPORTED)
    _get(pref, "pref")["attrs"][MatmulPreferenceAttribute(attr)] = _read_value(buf, size_in_bytes, PREF_DTYPES[attr])


def matmul_preference_destroy(pref):
    _destroy(pref, "pref")


# ----------------------------------------------------------------------------
# the heuristic and the product

BIAS_READ = (Epilogue.BIAS, Epilogue.GELU_BIAS, Epilogue.GELU_AUX_BIAS)
AUX_WRITTEN = (Epilogue.GELU_AUX, Epilogue.GELU_AUX_BIAS)
AUX_READ = (Epilogue.DGELU, Epilogue.DGELU_BGRAD)
BIAS_WRITTEN = (Epilogue.BGRADB, Epilogue.DGELU_BGRAD)
GELU_APPLIED = (Epilogue.GELU, Epilogue.GELU_BIAS, Epilogue.GELU_AUX, Epilogue.GELU_AUX_BIAS)


def _check_problem(attrs, layouts, in_place=False):
    """(m, n, k, epilogue) of a descriptor and its four layouts; raises cuBLASLtError where
    cuBLASLt would refuse them: shapes that do not chain, mixed types, an epilogue without its
    pointer, an aux leading dimension that is not a multiple of 8 or is < m, and (in_place: the
    C and D pointers are one) C's layout other than D's."""
    la, lb, lc, ld_ = layouts
    _require(la["type"] == lb["type"] == lc["type"] == ld_["type"], "A, B, C, D of different types", Status.NOT_SUPPORTED)
    _require(attrs[MatmulDescAttribute.COMPUTE_TYPE] == COMPUTE_32F or la["type"] == CUDA_R_32F,
             "TF32 compute with non-fp32 data", Status.NOT_SUPPORTED)
    a_rows, a_cols = (la["rows"], la["cols"]) if attrs[MatmulDescAttribute.TRANSA] == OP_N else (la["cols"], la["rows"])
    b_rows, b_cols = (lb["rows"], lb["cols"]) if attrs[MatmulDescAttribute.TRANSB] == OP_N else (lb["cols"], lb["rows"])
    m, n = ld_["rows"], ld_["cols"]
    _require((a_rows, b_cols, lc["rows"], lc["cols"]) == (m, n, m, n) and a_cols == b_rows,
             f"op(A) {a_rows}x{a_cols} @ op(B) {b_rows}x{b_cols} -> C {lc['rows']}x{lc['cols']}, D {m}x{n}")
    _require(not in_place or lc["ld"] == ld_["ld"], f"in place (C == D) with C's ld {lc['ld']} != D's {ld_['ld']}")
    try:
        epilogue = Epilogue(attrs[MatmulDescAttribute.EPILOGUE])
    except ValueError:
        raise cuBLASLtError(Status.NOT_SUPPORTED, f"epilogue {attrs[MatmulDescAttribute.EPILOGUE]}") from None
    bias_type = attrs[MatmulDescAttribute.BIAS_DATA_TYPE]
    if epilogue in BIAS_READ or epilogue in BIAS_WRITTEN:
        _require(attrs[MatmulDescAttribute.BIAS_POINTER], f"{epilogue.name} without BIAS_POINTER")
        _require(bias_type in (BIAS_TYPE_OF_D, ld_["type"]), f"bias type {bias_type}", Status.NOT_SUPPORTED)
    if epilogue in AUX_WRITTEN or epilogue in AUX_READ:
        aux_ld = attrs[MatmulDescAttribute.EPILOGUE_AUX_LD]
        _require(attrs[MatmulDescAttribute.EPILOGUE_AUX_POINTER], f"{epilogue.name} without EPILOGUE_AUX_POINTER")
        _require(aux_ld >= m and aux_ld % AUX_LD_MULTIPLE == 0, f"aux leading dimension {aux_ld} (m = {m})")
    return m, n, a_cols, epilogue


def matmul_algo_get_heuristic(light_handle, operation_desc, adesc, bdesc, cdesc, ddesc, preference,
                              requested_algo_count, heuristic_results_array, return_algo_count):
    """Writes min(requested_algo_count, ALGORITHMS) cublasLtMatmulHeuristicResult_t, each with
    an algorithm id of its own (they compute alike, no workspace), and that count, as cuBLASLt
    writes its best algorithms first and their count; raises cuBLASLtError where cuBLASLt has no
    algorithm (NOT_SUPPORTED) or the problem is invalid."""
    _get(light_handle, "handle")
    attrs = _get(operation_desc, "desc")["attrs"]
    layouts = [_get(x, "layout") for x in (adesc, bdesc, cdesc, ddesc)]
    prefs = dict(_get(preference, "pref")["attrs"])
    _require(requested_algo_count >= 1, "requested_algo_count < 1")
    _check_problem(attrs, layouts)
    count = min(requested_algo_count, ALGORITHMS)
    result = np.zeros(count, matmul_heuristic_result_dtype)
    for i in range(count):
        algo_id = next(_IDS)
        _ALGORITHMS[algo_id] = dict(desc=operation_desc, layouts=(adesc, bdesc, cdesc, ddesc), prefs=prefs)
        result["algo"][i, 0] = algo_id
    result["state"] = Status.SUCCESS
    result["waves_count"] = 1.0
    _host(heuristic_results_array, result.nbytes)[...] = result.view(np.uint8)
    _host(return_algo_count, 4)[...] = np.array([count], np.int32).view(np.uint8)


def matmul(light_handle, compute_desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, workspace,
           workspace_size_in_bytes, stream):
    """D = epilogue(alpha op(A) op(B) + beta C) on host memory, as the module docstring says.
    `algo` points at an algorithm the heuristic chose for this descriptor and these layouts; every
    matrix pointer must have the alignment that the heuristic's preference promised. Issued on
    `stream` (a cudaStream_t): run now, or recorded while it captures. Everything but the matrices'
    values is read when the call is made (the descriptor's attributes and pointers, alpha, beta),
    as a captured graph keeps them: a later change of the descriptor does not reach it."""
    _get(light_handle, "handle")
    attrs = dict(_get(compute_desc, "desc")["attrs"])
    layouts = [dict(_get(x, "layout")) for x in (adesc, bdesc, cdesc, ddesc)]
    _, _, _, epilogue = _check_problem(attrs, layouts, in_place=c == d)
    chosen = _ALGORITHMS.get(int(_host(algo, 8).view(np.uint64)[0]))
    _require(chosen is not None and chosen["desc"] == compute_desc and chosen["layouts"] == (adesc, bdesc, cdesc, ddesc),
             "the algorithm was not chosen by the heuristic for this descriptor and layouts")
    P = MatmulPreferenceAttribute
    for ptr, pref, name in ((a, P.MIN_ALIGNMENT_A_BYTES, "A"), (b, P.MIN_ALIGNMENT_B_BYTES, "B"),
                            (c, P.MIN_ALIGNMENT_C_BYTES, "C"), (d, P.MIN_ALIGNMENT_D_BYTES, "D")):
        _require(ptr % max(1, chosen["prefs"][pref]) == 0, f"{name} at {ptr:#x} is not {chosen['prefs'][pref]}-byte aligned")
    alpha_value = _read_value(alpha, 4, np.float32)
    beta_value = _read_value(beta, 4, np.float32)
    enqueue(lambda: _matmul_on_host(attrs, layouts, epilogue, alpha_value, a, b, beta_value, c, d),
            stream_at(stream))


def _matmul_on_host(attrs, layouts, epilogue, alpha_value, a, b, beta_value, c, d):
    """The arithmetic of matmul, with the attributes, layouts and scalars it read at its call."""
    la, lb, lc, ld_ = layouts
    m, n = ld_["rows"], ld_["cols"]
    A, B = _matrix(a, la), _matrix(b, lb)
    if attrs[MatmulDescAttribute.COMPUTE_TYPE] == COMPUTE_32F_FAST_TF32:
        A, B = _tf32(A), _tf32(B)
    op_a = _load(A) if attrs[MatmulDescAttribute.TRANSA] == OP_N else _load(A).T     # (m,k)
    op_b = _load(B) if attrs[MatmulDescAttribute.TRANSB] == OP_N else _load(B).T     # (k,n)
    result = alpha_value * (op_a @ op_b)                                            # (m,k) @ (k,n) -> (m,n)
    if beta_value != 0:                                                             # beta = 0: C is not read
        result = result + beta_value * _load(_matrix(c, lc))
    result = result.astype(np.float32).astype(np.float64)                           # fp32 accumulation
    storage = STORAGE[ld_["type"]]

    if epilogue in BIAS_READ:
        bias = _host(attrs[MatmulDescAttribute.BIAS_POINTER], m * storage.itemsize).view(storage)
        result = (result + _load(bias)[:, None]).astype(np.float32).astype(np.float64)   # per row, over columns
    if epilogue in AUX_WRITTEN or epilogue in AUX_READ:
        aux = _matrix(attrs[MatmulDescAttribute.EPILOGUE_AUX_POINTER],
                      dict(ld_, ld=attrs[MatmulDescAttribute.EPILOGUE_AUX_LD]))
    import gpt2_cpu                                                    # the one GELU (tanh form) of the project
    if epilogue in AUX_WRITTEN:
        _store(aux, result)                                            # the GELU input, in D's type
    if epilogue in GELU_APPLIED:
        result = gpt2_cpu.gelu_forward(result)
    elif epilogue in AUX_READ:
        result = gpt2_cpu.gelu_backward(result, _load(aux))            # result * gelu'(aux)
        if epilogue == Epilogue.DGELU_BGRAD:                           # each row of D summed, written (=)
            bgrad = _host(attrs[MatmulDescAttribute.BIAS_POINTER], m * storage.itemsize).view(storage)
            _store(bgrad, result.astype(np.float32).astype(np.float64).sum(axis=1))
    elif epilogue == Epilogue.BGRADB:                                  # sums of op(B) over k, written (=)
        bgrad = _host(attrs[MatmulDescAttribute.BIAS_POINTER], n * storage.itemsize).view(storage)
        _store(bgrad, op_b.sum(axis=0))
    _store(_matrix(d, ld_), result)
