"""Tests of the emulated device's vendor libraries (llmc/emulator/cublaslt.py, cudnn.py, nccl.py),
each called directly with host addresses and checked against independent float64 NumPy (or
gpt2_cpu) computations; and, for each, that a wrong leading dimension, stride, offset, pointer
or epilogue gives a result the check rejects (or an error), so that the emulations can catch the
bugs they stand in for.
- cuBLASLt: D = alpha op(A) op(B) + beta C with padded leading dimensions, every transpose, fp32
  and bf16, separate C and D; the epilogues BIAS, GELU_AUX_BIAS (aux with its own ld), DGELU,
  DGELU_BGRAD, BGRADB; TF32 rounding on a hand-computed case; what it refuses; its constants against
  llmc/cublaslt.py's (and nvmath-python's where installed).
- cuDNN: SDPA forward (out, stats) and backward through strided tensors in two layouts (the
  fused (B,T,3C) qkv and separate (B,NH,T,HS) arrays), bf16 and fp16, against gpt2_cpu and a
  float64 log-sum-exp and FlashAttention-2 backward written here; the backward follows the
  stats and o it is given; the graphs it refuses.
- NCCL: allReduce, reduceScatter and allGather (in place at NCCL's offsets and out of place,
  SUM and AVG, fp32 and bf16) against NumPy sums in rank order, with K = 2, 3 ranks as threads
  and as MPI processes (mpiexec -n 2, -n 3, running this file as a script), llmc.comm.NcclComm
  included, and as processes started without MPI (multiprocessing spawn), which meet through the
  emulation's files and leave none behind; a wrong in-place offset is refused; without MPI a rank
  that never comes gives its timeout's one error, and abort() stops the waiting ranks at once.
Run: python -m pytest -q tests/test_vendor_emulation.py   ("28 passed" in about 15 s on 2 cores, the
mpiexec runs, which skip where mpich's mpiexec is not installed)
"""

import math
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

if __name__ == "__main__":                 # run by mpiexec as the NCCL worker: the repo root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpt2_cpu                            # noqa: E402
from llmc.check import check_tensor        # noqa: E402
from llmc.emulator import cublaslt as lt   # noqa: E402
from llmc.emulator import cudnn            # noqa: E402
from llmc.emulator import nccl             # noqa: E402
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits   # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32_RTOL = 1e-6                           # one float32 rounding of the result (2^-24) and a margin
BF16_RTOL = 2 ** -8                        # one bf16 rounding (2^-9) and a margin


def to_f64(x):
    return (bfloat16_bits_to_float32(x) if x.dtype == np.uint16 else x).astype(np.float64)


def stored(x, precision):
    """float values as the storage of `precision`: bf16 bits (nearest even), fp16 or float32."""
    x = np.asarray(x, np.float32)
    return {"bf16": float32_to_bfloat16_bits, "fp16": lambda v: v.astype(np.float16), "fp32": lambda v: v}[precision](x)


def close(got, ref, precision, label):
    """check_tensor with a bound relative to max|ref|: one rounding to the stored type."""
    rtol = {"fp32": FP32_RTOL, "bf16": BF16_RTOL, "fp16": 2 ** -10}[precision]
    return check_tensor(to_f64(got), ref, label, rtol * np.abs(ref).max(), rtol)


# ----------------------------------------------------------------------------
# cuBLASLt

DATA_TYPE = {"fp32": lt.CUDA_R_32F, "bf16": lt.CUDA_R_16BF}


def padded(rng, rows, cols, ld, precision):
    """A column-major (rows, cols) matrix stored with leading dimension ld >= rows: a (cols, ld)
    row-major host array whose padding (rows..ld-1 of each column) holds NaN-free garbage that a
    wrong ld would read. Returns (storage, its float64 values (rows, cols))."""
    mem = stored(rng.standard_normal((cols, ld)) * 100, precision)       # padding: large values
    values = rng.standard_normal((cols, rows))
    mem[:, :rows] = stored(values, precision)
    return mem, to_f64(mem[:, :rows]).T


def set_attr(obj, attr, value, setter=lt.matmul_desc_set_attribute, dtypes=lt.DESC_DTYPES):
    buf = np.array([value], dtype=dtypes[attr])
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


def lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, transa=lt.OP_N, transb=lt.OP_N, alpha=1.0, beta=0.0,
              epilogue=lt.Epilogue.DEFAULT, bias=None, aux=None, aux_ld=0, compute=lt.COMPUTE_32F, d_layout=None):
    """One product through the emulated bindings as llmc/cublaslt.py makes it: descriptor,
    layouts ((rows, cols, ld) each, D's like C's unless d_layout), preference, heuristic, matmul."""
    D = lt.MatmulDescAttribute
    handle, desc = lt.create(), lt.matmul_desc_create(compute, lt.CUDA_R_32F)
    set_attr(desc, D.TRANSA, transa)
    set_attr(desc, D.TRANSB, transb)
    set_attr(desc, D.EPILOGUE, epilogue)
    if bias is not None:
        set_attr(desc, D.BIAS_POINTER, bias.ctypes.data)
    if aux is not None:
        set_attr(desc, D.EPILOGUE_AUX_POINTER, aux.ctypes.data)
        set_attr(desc, D.EPILOGUE_AUX_LD, aux_ld)
    layouts = [lt.matrix_layout_create(DATA_TYPE[precision], *shape) for shape in (la, lb, lc, d_layout or lc)]
    pref = lt.matmul_preference_create()
    for attr in list(lt.MatmulPreferenceAttribute)[1:]:
        set_attr(pref, attr, 16, lt.matmul_preference_set_attribute, lt.PREF_DTYPES)
    result, count = np.zeros(1, lt.matmul_heuristic_result_dtype), np.zeros(1, np.int32)
    lt.matmul_algo_get_heuristic(handle, desc, *layouts, pref, 1, result.ctypes.data, count.ctypes.data)
    assert count[0] == 1 and result["state"][0] == lt.Status.SUCCESS
    scalars = np.array([alpha, beta], np.float32)
    lt.matmul(handle, desc, scalars.ctypes.data, a.ctypes.data, layouts[0], b.ctypes.data, layouts[1],
              scalars[1:].ctypes.data, c.ctypes.data, layouts[2], d.ctypes.data, layouts[3], result.ctypes.data, 0, 0, 0)
    for layout in layouts:
        lt.matrix_layout_destroy(layout)
    lt.matmul_preference_destroy(pref)
    lt.matmul_desc_destroy(desc)
    lt.destroy(handle)


def gemm_case(rng, precision, m, n, k, transa, transb, pad=3):
    """Operands of D (m,n) = op(A) op(B) + C, each with ld = rows + pad: (arrays, layouts, values)."""
    a_shape = (m, k) if transa == lt.OP_N else (k, m)                      # A as stored
    b_shape = (k, n) if transb == lt.OP_N else (n, k)
    a, A = padded(rng, *a_shape, a_shape[0] + pad, precision)
    b, B = padded(rng, *b_shape, b_shape[0] + pad, precision)
    c, C = padded(rng, m, n, m + pad, precision)
    d = np.full_like(c, 0x7FC0 if precision == "bf16" else np.nan)          # NaN: unwritten stays NaN
    layouts = ((*a_shape, a_shape[0] + pad), (*b_shape, b_shape[0] + pad), (m, n, m + pad))
    op_a = A if transa == lt.OP_N else A.T
    op_b = B if transb == lt.OP_N else B.T
    return (a, b, c, d), layouts, (op_a, op_b, C)


def d_values(d, m):
    """The (m, n) values of a D stored as (n, ld)."""
    return to_f64(d[:, :m]).T


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("transa,transb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_cublaslt_product_follows_layouts_and_transposes(precision, transa, transb):
    m, n, k = 8, 5, 7
    rng = np.random.default_rng(10 * transa + transb)
    (a, b, c, d), (la, lb, lc), (op_a, op_b, C) = gemm_case(rng, precision, m, n, k, transa, transb)
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, transa, transb, alpha=0.5, beta=2.0)
    ref = 0.5 * op_a @ op_b + 2.0 * C
    assert close(d_values(d, m), ref, precision, f"D {precision} op {transa}{transb}")
    assert np.all(np.isnan(to_f64(d[:, m:])))                             # the padding is never written
    # a wrong leading dimension for A (one less) reads the wrong elements: the check rejects it
    d[...] = 0
    lt_matmul(precision, m, n, k, a, (la[0], la[1], la[2] - 1), b, lb, c, lc, d, transa, transb, alpha=0.5, beta=2.0)
    assert not close(d_values(d, m), ref, precision, "D with A's ld off by one")
    # and leaving out beta C
    d[...] = 0
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, transa, transb, alpha=0.5, beta=0.0)
    assert not close(d_values(d, m), ref, precision, "D without beta C")


def test_cublaslt_wrong_transpose_fails():
    m = n = k = 6
    rng = np.random.default_rng(1)
    (a, b, c, d), (la, lb, lc), (op_a, op_b, C) = gemm_case(rng, "fp32", m, n, k, lt.OP_N, lt.OP_N)
    lt_matmul("fp32", m, n, k, a, la, b, lb, c, lc, d, lt.OP_T, lt.OP_N)
    assert not close(d_values(d, m), op_a @ op_b, "fp32", "A transposed by mistake")
    assert close(d_values(d, m), op_a.T @ op_b, "fp32", "what op(A) = A^T gives")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cublaslt_epilogues(precision):
    m, n, k, aux_ld = 8, 6, 5, 16                                          # aux ld > m: its own padding
    rng = np.random.default_rng(2)
    (a, b, c, d), (la, lb, lc), (op_a, op_b, _) = gemm_case(rng, precision, m, n, k, lt.OP_N, lt.OP_T)
    bias = stored(rng.standard_normal(m + 1), precision)                   # one spare element after it
    product = op_a @ op_b
    # BIAS: one value per row of D
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.BIAS, bias=bias)
    ref = product + to_f64(bias[:m])[:, None]
    assert close(d_values(d, m), ref, precision, "BIAS")
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.BIAS, bias=bias[1:])
    assert not close(d_values(d, m), ref, precision, "BIAS with the bias pointer one element off")
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T)
    assert not close(d_values(d, m), ref, precision, "DEFAULT where BIAS was meant")
    # GELU_AUX_BIAS: aux (m,n) with ld aux_ld = the pre-activation, D = gelu(aux)
    aux = np.full((n, aux_ld), 0x7FC0 if precision == "bf16" else np.nan, d.dtype)
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.GELU_AUX_BIAS,
              bias=bias, aux=aux, aux_ld=aux_ld)
    assert close(to_f64(aux[:, :m]).T, ref, precision, "GELU_AUX_BIAS aux")
    assert np.all(np.isnan(to_f64(aux[:, m:])))
    assert close(d_values(d, m), gpt2_cpu.gelu_forward(ref), precision, "GELU_AUX_BIAS D")
    # DGELU: D = product * gelu'(aux), aux read with its ld
    pre = rng.standard_normal((m, n))
    aux[:, :m] = stored(pre.T, precision)
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.DGELU,
              aux=aux, aux_ld=aux_ld)
    ref_dgelu = gpt2_cpu.gelu_backward(product, to_f64(aux[:, :m]).T)
    assert close(d_values(d, m), ref_dgelu, precision, "DGELU")
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.DGELU,
              aux=aux, aux_ld=aux_ld - 8)
    assert not close(d_values(d, m), ref_dgelu, precision, "DGELU with the aux ld off by 8")
    # DGELU_BGRAD: D as DGELU, bias (m,) = each row of D summed over its n columns, written
    dgelu_bgrad = stored(np.full(m + 1, 7.0), precision)                    # a spare element: left as it is
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.DGELU_BGRAD,
              bias=dgelu_bgrad, aux=aux, aux_ld=aux_ld)
    assert close(d_values(d, m), ref_dgelu, precision, "DGELU_BGRAD D")
    assert close(dgelu_bgrad[:m], ref_dgelu.sum(axis=1), precision, "DGELU_BGRAD bias gradient")
    assert not close(dgelu_bgrad[:m], ref_dgelu.sum(axis=0)[:m], precision, "columns summed instead of rows")
    assert to_f64(dgelu_bgrad[m:])[0] == 7.0
    # BIAS with beta C out of place (the residual stream): D = product + C + bias, C only read
    c_before = c.copy()
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, beta=1.0, epilogue=lt.Epilogue.BIAS,
              bias=bias)
    assert close(d_values(d, m), ref + to_f64(c[:, :m]).T, precision, "BIAS + C")
    np.testing.assert_array_equal(c, c_before)
    # BGRADB: D = the product, bias (n,) = column sums of op(B) over k, written
    bgrad = stored(np.full(n, 7.0), precision)
    lt_matmul(precision, m, n, k, a, la, b, lb, c, lc, d, lt.OP_N, lt.OP_T, epilogue=lt.Epilogue.BGRADB, bias=bgrad)
    assert close(d_values(d, m), product, precision, "BGRADB D")
    assert close(bgrad, op_b.sum(axis=0), precision, "BGRADB bias gradient")


def test_cublaslt_tf32_rounds_the_inputs():
    # 1 + 2^-12 is a float32 but not a TF32 (10 mantissa bits): TF32 sees 1, FP32 sees it exactly
    x = np.array([[1 + 2 ** -12]], np.float32)
    one = np.ones((1, 1), np.float32)
    for compute, expected in ((lt.COMPUTE_32F, 1 + 2 ** -12), (lt.COMPUTE_32F_FAST_TF32, 1.0)):
        d = np.zeros((1, 1), np.float32)
        lt_matmul("fp32", 1, 1, 1, x, (1, 1, 1), one, (1, 1, 1), d, (1, 1, 1), d, compute=compute)
        assert d[0, 0] == np.float32(expected)


def test_cublaslt_refuses_what_cublaslt_refuses():
    rng = np.random.default_rng(3)
    (a, b, c, d), (la, lb, lc), _ = gemm_case(rng, "fp32", 8, 4, 4, lt.OP_N, lt.OP_N)
    with pytest.raises(lt.cuBLASLtError, match="INVALID_VALUE"):         # op(A) is 8x4, op(B) 5x4
        lt_matmul("fp32", 8, 4, 4, a, la, b, (5, 4, 8), c, lc, d)
    with pytest.raises(lt.cuBLASLtError, match="leading dimension"):     # ld < rows
        lt_matmul("fp32", 8, 4, 4, a, (8, 4, 7), b, lb, c, lc, d)
    aux = np.zeros((4, 16), np.float32)
    with pytest.raises(lt.cuBLASLtError, match="aux leading dimension"):  # not a multiple of 8
        lt_matmul("fp32", 8, 4, 4, a, la, b, lb, c, lc, d, epilogue=lt.Epilogue.GELU_AUX, aux=aux, aux_ld=12)
    with pytest.raises(lt.cuBLASLtError, match="BIAS_POINTER"):
        lt_matmul("fp32", 8, 4, 4, a, la, b, lb, c, lc, d, epilogue=lt.Epilogue.BIAS)
    with pytest.raises(lt.cuBLASLtError, match="DGELU_BGRAD without BIAS_POINTER"):  # where its sums go
        lt_matmul("fp32", 8, 4, 4, a, la, b, lb, c, lc, d, epilogue=lt.Epilogue.DGELU_BGRAD, aux=np.zeros((4, 8),
                  np.float32), aux_ld=8)
    with pytest.raises(lt.cuBLASLtError, match="aligned"):               # 4 bytes in: the heuristic was told 16
        lt_matmul("fp32", 8, 4, 4, a.reshape(-1)[1:], la, b, lb, c, lc, d)
    with pytest.raises(lt.cuBLASLtError, match="in place"):                 # C == D needs Cdesc == Ddesc
        lt_matmul("fp32", 8, 4, 4, a, la, b, lb, d, (8, 4, 9), d, d_layout=(8, 4, 8), beta=1.0)
    with pytest.raises(lt.cuBLASLtError, match="NOT_INITIALIZED"):
        lt.matmul_desc_destroy(12345)


def test_cublaslt_constants_match_llmc_and_nvmath():
    from llmc import cublaslt as ours
    from llmc import cuda
    assert (ours.EPILOGUE_DEFAULT, ours.EPILOGUE_BIAS, ours.EPILOGUE_GELU_AUX, ours.EPILOGUE_GELU_AUX_BIAS,
            ours.EPILOGUE_DGELU, ours.EPILOGUE_DGELU_BGRAD, ours.EPILOGUE_BGRADB) == \
        (lt.Epilogue.DEFAULT, lt.Epilogue.BIAS, lt.Epilogue.GELU_AUX, lt.Epilogue.GELU_AUX_BIAS, lt.Epilogue.DGELU,
         lt.Epilogue.DGELU_BGRAD, lt.Epilogue.BGRADB)
    for attr, dtype in ours.DESC_ATTRIBUTE_DTYPES.items():
        assert lt.get_matmul_desc_attribute_dtype(attr) == np.dtype(dtype), attr
    for attr, dtype in ours.PREF_ATTRIBUTE_DTYPES.items():
        assert lt.get_matmul_preference_attribute_dtype(attr) == np.dtype(dtype), attr
    assert (cuda.CUDA_R_32F, cuda.CUDA_R_16BF, cuda.CUBLAS_COMPUTE_32F, cuda.CUBLAS_COMPUTE_32F_FAST_TF32) == \
           (lt.CUDA_R_32F, lt.CUDA_R_16BF, lt.COMPUTE_32F, lt.COMPUTE_32F_FAST_TF32)
    assert lt.get_version() >= ours.MIN_CUBLASLT_VERSION
    try:
        from nvmath.bindings import cublasLt as real
    except ImportError:
        return                                                           # the rest needs nvmath-python
    for ours_enum, real_enum in ((lt.Epilogue, real.Epilogue), (lt.MatmulDescAttribute, real.MatmulDescAttribute),
                                 (lt.MatmulPreferenceAttribute, real.MatmulPreferenceAttribute),
                                 (lt.MatrixLayoutAttribute, real.MatrixLayoutAttribute)):
        for member in ours_enum:
            assert member.value == real_enum[member.name].value, member
    assert lt.matmul_heuristic_result_dtype.itemsize == real.matmul_heuristic_result_dtype.itemsize


# ----------------------------------------------------------------------------
# cuDNN

DTYPE = {"bf16": cudnn.data_type.BFLOAT16, "fp16": cudnn.data_type.HALF}


def sdpa_graph(direction, B, T, NH, HS, layouts, precision, training=True, band=0):
    """A built graph of the emulated frontend, as llmc/cudnn_attention.py builds it. layouts:
    name -> (dims, strides). Returns (graph, tensors by name)."""
    io = DTYPE[precision]
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=cudnn.create_handle())
    t = {n: graph.tensor(name=n, dim=layouts[n][0], stride=layouts[n][1], data_type=io) for n in "QKV"}
    mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=band)
    if direction == "forward":
        o, stats = graph.sdpa(name="sdpa", q=t["Q"], k=t["K"], v=t["V"], generate_stats=training,
                              attn_scale=1 / math.sqrt(HS), **mask)
        t["O"] = o.set_output(True).set_dim(layouts["O"][0]).set_stride(layouts["O"][1]).set_data_type(io)
        if training:
            t["Stats"] = stats.set_output(True).set_dim([B, NH, T, 1]).set_stride([NH * T, T, 1, 1]).set_data_type(
                cudnn.data_type.FLOAT)
    else:
        for n in ("O", "dO"):
            t[n] = graph.tensor(name=n, dim=layouts["O"][0], stride=layouts["O"][1], data_type=io)
        t["Stats"] = graph.tensor(name="Stats", dim=[B, NH, T, 1], stride=[NH * T, T, 1, 1],
                                  data_type=cudnn.data_type.FLOAT)
        grads = graph.sdpa_backward(name="bwd", q=t["Q"], k=t["K"], v=t["V"], o=t["O"], dO=t["dO"], stats=t["Stats"],
                                    attn_scale=1 / math.sqrt(HS), use_deterministic_algorithm=True, **mask)
        for n, g in zip(("dQ", "dK", "dV"), grads):
            t[n] = g.set_output(True).set_dim(layouts[n[1]][0]).set_stride(layouts[n[1]][1]).set_data_type(io)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A])
    graph.check_support()
    graph.build_plans()
    return graph, t


def fused_layout(B, T, NH, HS):
    """q, k, v as (B,NH,T,HS) views of a (B,T,3C) array at element offsets 0, C, 2C; o of (B,T,C)."""
    C = NH * HS
    qkv = ([B, NH, T, HS], [T * 3 * C, HS, 3 * C, 1])
    return {"Q": qkv, "K": qkv, "V": qkv, "O": ([B, NH, T, HS], [T * C, HS, C, 1])}, (0, C, 2 * C)


def separate_layout(B, T, NH, HS):
    """q, k, v, o each a contiguous (B,NH,T,HS) array, stacked in one (3, B,NH,T,HS) array."""
    x = ([B, NH, T, HS], [NH * T * HS, T * HS, HS, 1])
    n = B * NH * T * HS
    return {"Q": x, "K": x, "V": x, "O": x}, (0, n, 2 * n)


def reference_stats(q, k):
    """(B,NH,T,1) log sum_j exp(S_ij) of S = q k^T / sqrt(HS), causally masked, float64."""
    T, HS = q.shape[2], q.shape[3]
    S = q @ k.swapaxes(-1, -2) / math.sqrt(HS)
    S[..., np.triu(np.ones((T, T), bool), k=1)] = -np.inf
    m = S.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(S - m).sum(axis=-1, keepdims=True))


def reference_backward(q, k, v, o, dO, stats):
    """FlashAttention-2's backward (Dao 2023, algorithm 2) from the given o and stats, float64:
    P = exp(S - stats), dV = P^T dO, dP = dO V^T, D = rowsum(dO o), dS = P (dP - D),
    dQ = dS K / sqrt(HS), dK = dS^T Q / sqrt(HS)."""
    T, HS = q.shape[2], q.shape[3]
    S = q @ k.swapaxes(-1, -2) / math.sqrt(HS)
    S[..., np.triu(np.ones((T, T), bool), k=1)] = -np.inf
    P = np.exp(S - stats)
    dS = P * (dO @ v.swapaxes(-1, -2) - (dO * o).sum(axis=-1, keepdims=True))
    return dS @ k / math.sqrt(HS), dS.swapaxes(-1, -2) @ q / math.sqrt(HS), P.swapaxes(-1, -2) @ dO


def as_heads(view_dims_strides, mem, offset):
    """The (B,NH,T,HS) float64 values a (dims, strides) tensor at element `offset` of mem holds."""
    dims, strides = view_dims_strides
    flat = mem.reshape(-1)[offset:]
    view = np.lib.stride_tricks.as_strided(flat, shape=dims, strides=[s * mem.itemsize for s in strides])
    return to_f64(view)


def run_sdpa(B, T, NH, HS, precision, layout, rng):
    """Forward and backward of the emulated SDPA on random inputs in `layout`; returns everything."""
    layouts, offsets = layout(B, T, NH, HS)
    C, n = NH * HS, B * NH * T * HS
    qkv = stored(rng.standard_normal(3 * n), precision)                    # big enough for both layouts
    out = np.full(n, np.nan, np.float16) if precision == "fp16" else np.full(n, 0x7FC0, np.uint16)   # NaN
    stats = np.full(B * NH * T, np.nan, np.float32)
    fwd, t = sdpa_graph("forward", B, T, NH, HS, layouts, precision)
    pack = {t[name]: qkv.ctypes.data + off * qkv.itemsize for name, off in zip("QKV", offsets)}
    pack.update({t["O"]: out.ctypes.data, t["Stats"]: stats.ctypes.data})
    fwd.execute(pack, 0, handle=fwd.handle)
    q, k, v = (as_heads(layouts[name], qkv, off) for name, off in zip("QKV", offsets))
    o = as_heads(layouts["O"], out, 0)
    return dict(layouts=layouts, offsets=offsets, qkv=qkv, out=out, stats=stats, q=q, k=k, v=v, o=o, C=C)


def backward(r, B, T, NH, HS, precision, dO_mem, o_mem=None, stats=None, o_offset=0):
    """The emulated backward of run_sdpa's forward into a fresh dqkv; returns (dq, dk, dv) float64."""
    layouts, offsets, qkv = r["layouts"], r["offsets"], r["qkv"]
    o_mem = r["out"] if o_mem is None else o_mem
    stats = r["stats"] if stats is None else stats
    dqkv = np.zeros_like(qkv)
    bwd, t = sdpa_graph("backward", B, T, NH, HS, layouts, precision)
    pack = {t[name]: qkv.ctypes.data + off * qkv.itemsize for name, off in zip("QKV", offsets)}
    pack.update({t["d" + name]: dqkv.ctypes.data + off * qkv.itemsize for name, off in zip("QKV", offsets)})
    pack.update({t["O"]: o_mem.ctypes.data + o_offset * o_mem.itemsize, t["dO"]: dO_mem.ctypes.data,
                 t["Stats"]: stats.ctypes.data})
    bwd.execute(pack, 0, handle=bwd.handle)
    return tuple(as_heads(layouts[name], dqkv, off) for name, off in zip("QKV", offsets))


@pytest.mark.parametrize("layout", [fused_layout, separate_layout])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cudnn_sdpa_matches_gpt2_cpu(layout, precision):
    B, T, NH, HS = 2, 7, 3, 8
    rng = np.random.default_rng(4)
    r = run_sdpa(B, T, NH, HS, precision, layout, rng)
    q, k, v = r["q"], r["k"], r["v"]
    qkv = np.concatenate([x.transpose(0, 2, 1, 3).reshape(B, T, NH * HS) for x in (q, k, v)], axis=-1)
    ref_out, att = gpt2_cpu.attention_forward(qkv, NH)
    assert close(r["o"], ref_out.reshape(B, T, NH, HS).transpose(0, 2, 1, 3), precision, "O")
    assert check_tensor(r["stats"].reshape(B, NH, T, 1), reference_stats(q, k), "stats (float32)", 1e-6, 1e-6)
    dO_mem = stored(rng.standard_normal(B * NH * T * HS), precision)
    dO = as_heads(r["layouts"]["O"], dO_mem, 0)
    dq, dk, dv = backward(r, B, T, NH, HS, precision, dO_mem)
    dout = dO.transpose(0, 2, 1, 3).reshape(B, T, NH * HS)
    ref = gpt2_cpu.attention_backward(dout, qkv, att, NH)                  # the exact o and stats
    for j, (got, name) in enumerate(((dq, "dQ"), (dk, "dK"), (dv, "dV"))):
        ref_j = ref[..., j * NH * HS:(j + 1) * NH * HS].reshape(B, T, NH, HS).transpose(0, 2, 1, 3)
        assert check_tensor(got, ref_j, name, 2e-2 * np.abs(ref_j).max(), 2e-2)   # o, stats rounded on the way
    # cuDNN's backward reads the o and stats it is given: FlashAttention-2's formula on them, closely
    for got, want, name in zip((dq, dk, dv), reference_backward(q, k, v, r["o"], dO, to_f64(r["stats"]).reshape(
            B, NH, T, 1)), ("dQ", "dK", "dV")):
        assert close(got, want, precision, f"{name} from the o and stats passed")


def test_cudnn_wrong_strides_offsets_and_inputs_fail():
    B, T, NH, HS = 2, 6, 2, 8
    rng = np.random.default_rng(5)
    r = run_sdpa(B, T, NH, HS, "bf16", fused_layout, rng)
    dO_mem = stored(rng.standard_normal(B * NH * T * HS), "bf16")
    dq, dk, dv = backward(r, B, T, NH, HS, "bf16", dO_mem)
    # stats off by 0.5: P = exp(S - stats) scaled by e^-0.5: every gradient moves
    shifted = (r["stats"] + 0.5).astype(np.float32)
    dq2, _, dv2 = backward(r, B, T, NH, HS, "bf16", dO_mem, stats=shifted)
    assert not close(dv2, dv, "bf16", "dV with the stats off by 0.5")
    # o read one head later: D = rowsum(dO o) is wrong, so dQ is (dV does not use o)
    o_shifted = np.concatenate([r["out"], r["out"][:HS]])
    dq3, _, dv3 = backward(r, B, T, NH, HS, "bf16", dO_mem, o_mem=o_shifted, o_offset=HS)
    assert not close(dq3, dq, "bf16", "dQ with o read at the wrong offset")
    np.testing.assert_array_equal(dv3, dv)
    # the forward with K read at the wrong offset (C - HS: another head's keys)
    layouts, _ = fused_layout(B, T, NH, HS)
    C = NH * HS
    out = np.zeros(B * T * C, np.uint16)
    fwd, t = sdpa_graph("forward", B, T, NH, HS, layouts, "bf16", training=False)
    base = r["qkv"].ctypes.data
    fwd.execute({t["Q"]: base, t["K"]: base + (C - HS) * 2, t["V"]: base + 2 * C * 2, t["O"]: out.ctypes.data}, 0)
    assert not close(to_f64(out), to_f64(r["out"]), "bf16", "O with K at the wrong offset")
    # the forward with q's strides those of a contiguous (B,NH,T,HS) array instead of the fused (B,T,3C)
    wrong = dict(layouts, Q=separate_layout(B, T, NH, HS)[0]["Q"])
    fwd, t = sdpa_graph("forward", B, T, NH, HS, wrong, "bf16", training=False)
    fwd.execute({t["Q"]: base, t["K"]: base + C * 2, t["V"]: base + 2 * C * 2, t["O"]: out.ctypes.data}, 0)
    assert not close(to_f64(out), to_f64(r["out"]), "bf16", "O with q's strides wrong")
    # and right again: the same bits
    fwd, t = sdpa_graph("forward", B, T, NH, HS, layouts, "bf16", training=False)
    fwd.execute({t["Q"]: base, t["K"]: base + C * 2, t["V"]: base + 2 * C * 2, t["O"]: out.ctypes.data}, 0)
    np.testing.assert_array_equal(out, r["out"])


def test_cudnn_execute_runs_on_the_handles_stream_and_is_recorded_while_it_captures():
    """As cuDNN: execute is issued on the handle's stream; while that stream captures, nothing runs,
    and each replay of the graph computes from what the pointers hold then (gpt2_cuda.py and
    llama3_cuda.py with --attention cudnn --cuda-graph 1). Work on the legacy stream while a
    blocking stream captures is CUDA's error, as for every emulated call."""
    from llmc.emulator import device
    B, T, NH, HS = 1, 5, 2, 8
    rng = np.random.default_rng(6)
    r = run_sdpa(B, T, NH, HS, "bf16", fused_layout, rng)                # eager, on the legacy stream
    eager_out = r["out"].copy()
    fwd, t = sdpa_graph("forward", B, T, NH, HS, r["layouts"], "bf16")
    qkv, out, stats = r["qkv"], np.full_like(r["out"], 0x7FC0), np.full_like(r["stats"], np.nan)
    pack = {t[name]: qkv.ctypes.data + off * qkv.itemsize for name, off in zip("QKV", r["offsets"])}
    pack.update({t["O"]: out.ctypes.data, t["Stats"]: stats.ctypes.data})
    stream = device.cuda.Stream()
    stream.begin_capture()
    with pytest.raises(device.cuda.runtime.CUDARuntimeError, match="legacy stream"):
        fwd.execute(pack, 0, handle=fwd.handle)                        # the handle is on stream 0
    cudnn.set_stream(fwd.handle, stream.ptr)
    fwd.execute(pack, 0, handle=fwd.handle)
    graph = stream.end_capture()
    assert np.all(out == 0x7FC0) and np.all(np.isnan(stats))          # recorded, not run
    graph.launch()
    np.testing.assert_array_equal(out, eager_out)
    qkv[:] = stored(rng.standard_normal(qkv.size), "bf16")             # new inputs at the same address
    graph.launch()
    assert not np.array_equal(out, eager_out)
    q, k, v = (as_heads(r["layouts"][name], qkv, off) for name, off in zip("QKV", r["offsets"]))
    qkv_btc = np.concatenate([x.transpose(0, 2, 1, 3).reshape(B, T, NH * HS) for x in (q, k, v)], axis=-1)
    ref_out, _ = gpt2_cpu.attention_forward(qkv_btc, NH)
    assert close(as_heads(r["layouts"]["O"], out, 0), ref_out.reshape(B, T, NH, HS).transpose(0, 2, 1, 3), "bf16",
                 "O replayed")
    replayed = out.copy()
    out[:] = 0x7FC0
    fwd.execute(pack, 0)                                               # handle=None: the graph's own, not capturing
    np.testing.assert_array_equal(out, replayed)                       # runs at once, the same result


def test_cudnn_refuses_graphs_outside_the_subset():
    B, T, NH, HS = 1, 4, 2, 8
    layouts, _ = fused_layout(B, T, NH, HS)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="causal"):
        sdpa_graph("forward", B, T, NH, HS, layouts, "bf16", band=None)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="head size"):
        sdpa_graph("forward", B, T, NH, 12, fused_layout(B, T, NH, 12)[0], "bf16")
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    q = graph.tensor(name="Q", dim=layouts["Q"][0], stride=layouts["Q"][1], data_type=cudnn.data_type.FLOAT)
    graph.sdpa(q=q, k=q, v=q, attn_scale=0.5, generate_stats=False, diagonal_band_right_bound=0)
    with pytest.raises(cudnn.cudnnGraphNotSupportedError, match="fp16/bf16"):
        graph.validate()
    fwd, t = sdpa_graph("forward", B, T, NH, HS, layouts, "bf16")
    with pytest.raises(RuntimeError, match="no pointer"):
        fwd.execute({t["Q"]: 16}, 0)
    unbuilt = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16)
    with pytest.raises(RuntimeError, match="before the plans are built"):
        unbuilt.execute({}, 0)


# ----------------------------------------------------------------------------
# NCCL: one check of the three collectives, run by K ranks (threads here, then processes without
# MPI, then MPI processes)

COUNT = 37                                 # elements per rank's slice: odd, so no vector size hides a bug
NCCL_CHECKS = 2 * (2 * 4 + 2) + 1          # 2 precisions x (2 ops x 4 checks + 2 all-gathers) + the refusal


def rank_data(rank, precision, size):
    """Rank `rank`'s send values (size,), as stored, reproducible on every rank."""
    return stored(np.random.default_rng(1000 + rank).standard_normal(size) * (rank + 1), precision)


def rank_order_sum(parts, precision, average=False):
    """NumPy: the float32 sum in rank order (the emulation's documented arithmetic), divided by K
    for the average, rounded once to the buffer's type."""
    acc = to_f64(parts[0]).astype(np.float32)
    for p in parts[1:]:
        acc = acc + to_f64(p).astype(np.float32)
    if average:
        acc = acc / np.float32(len(parts))
    return stored(acc, precision)


def check_collectives(communicator, rank, K):
    """The three collectives on this rank against NumPy, fp32 and bf16, in place and not.
    Returns the number of checks made."""
    checks = 0
    for precision, datatype in (("fp32", nccl.NCCL_FLOAT32), ("bf16", nccl.NCCL_BFLOAT16)):
        n = K * COUNT
        parts = [rank_data(r, precision, n) for r in range(K)]
        for op, average in ((nccl.NCCL_SUM, False), (nccl.NCCL_AVG, True)):
            want = rank_order_sum(parts, precision, average)
            # and within one rounding of the float64 sum: the reference above is not the answer by fiat
            exact = sum(to_f64(p) for p in parts) / (K if average else 1)
            assert np.all(np.abs(to_f64(want) - exact) <= 2 ** -7 * np.abs(exact) + 1e-6)
            # allReduce, out of place then in place
            send, recv = parts[rank].copy(), np.zeros_like(parts[rank])
            communicator.allReduce(send.ctypes.data, recv.ctypes.data, n, datatype, op, 0)
            np.testing.assert_array_equal(recv, want)
            np.testing.assert_array_equal(send, parts[rank])                    # the send buffer is only read
            communicator.allReduce(send.ctypes.data, send.ctypes.data, n, datatype, op, 0)
            np.testing.assert_array_equal(send, want)
            # reduceScatter in place: recv = send + rank*COUNT; the other slices keep this rank's values
            buf = parts[rank].copy()
            mine = slice(rank * COUNT, (rank + 1) * COUNT)
            communicator.reduceScatter(buf.ctypes.data, buf.ctypes.data + rank * COUNT * buf.itemsize, COUNT,
                                       datatype, op, 0)
            np.testing.assert_array_equal(buf[mine], want[mine])
            np.testing.assert_array_equal(np.delete(buf, np.arange(n)[mine]), np.delete(parts[rank], np.arange(n)[mine]))
            # out of place
            recv = np.zeros(COUNT, buf.dtype)
            communicator.reduceScatter(parts[rank].ctypes.data, recv.ctypes.data, COUNT, datatype, op, 0)
            np.testing.assert_array_equal(recv, want[mine])
            checks += 4
        # allGather in place: send = recv + rank*COUNT
        buf = np.zeros(n, parts[0].dtype)
        buf[rank * COUNT:(rank + 1) * COUNT] = parts[rank][:COUNT]
        communicator.allGather(buf.ctypes.data + rank * COUNT * buf.itemsize, buf.ctypes.data, COUNT, datatype, 0)
        np.testing.assert_array_equal(buf, np.concatenate([p[:COUNT] for p in parts]))
        recv = np.zeros(n, parts[0].dtype)
        communicator.allGather(parts[rank].ctypes.data, recv.ctypes.data, COUNT, datatype, 0)
        np.testing.assert_array_equal(recv, np.concatenate([p[:COUNT] for p in parts]))
        checks += 2
    # a wrong in-place offset (the slice of rank 0 on every rank) is refused, on the ranks it is wrong for
    buf = rank_data(rank, "fp32", K * COUNT)
    if rank > 0:
        with pytest.raises(nccl.NcclError, match="in-place"):
            communicator.reduceScatter(buf.ctypes.data, buf.ctypes.data, COUNT, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    return checks + 1


def run_thread_ranks(K, uid, fn):
    """fn(rank, communicator) on K threads, one rank of the communicator `uid` each; returns the
    results in rank order, or raises the first error (the failing rank aborts the communicator,
    so that the others stop waiting for it)."""
    results, errors = [None] * K, []

    def one(rank):
        communicator = nccl.NcclCommunicator(K, uid, rank)
        try:
            results[rank] = fn(rank, communicator)
            communicator.destroy()
        except BaseException as e:                                  # noqa: B036 (reported below)
            errors.append(e)
            communicator.abort()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(K)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (first or errors)[0]
    return results


@pytest.mark.parametrize("K", [2, 3])
def test_nccl_collectives_on_thread_ranks(K):
    uid = nccl.get_unique_id()

    results = run_thread_ranks(K, uid, lambda rank, communicator: check_collectives(communicator, rank, K))
    assert results == [NCCL_CHECKS] * K


def test_nccl_collectives_are_recorded_while_the_stream_captures_and_run_at_each_replay():
    """As NCCL's kernels: a collective issued on a capturing stream does nothing then; each rank's
    replay of its graph runs it, meeting the other ranks, on what the buffers hold at the replay."""
    from llmc.emulator import device
    K = 2

    def captured(rank, communicator):
        stream = device.cuda.Stream()
        send = rank_data(rank, "fp32", K * COUNT)
        summed, gathered = np.zeros(K * COUNT, np.float32), np.zeros(K * COUNT, np.float32)
        stream.begin_capture()
        communicator.allReduce(send.ctypes.data, summed.ctypes.data, K * COUNT, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                               stream.ptr)
        communicator.allGather(send.ctypes.data, gathered.ctypes.data, COUNT, nccl.NCCL_FLOAT32, stream.ptr)
        graph = stream.end_capture()
        untouched = not summed.any() and not gathered.any()
        replays = []
        for scale in (1.0, 3.0):
            send[:] = rank_data(rank, "fp32", K * COUNT) * np.float32(scale)
            graph.launch()
            replays.append((summed.copy(), gathered.copy()))
        return untouched, replays

    results = run_thread_ranks(K, nccl.get_unique_id(), captured)
    for i, scale in enumerate((1.0, 3.0)):
        sends = [rank_data(r, "fp32", K * COUNT) * np.float32(scale) for r in range(K)]
        for untouched, replays in results:
            assert untouched
            np.testing.assert_array_equal(replays[i][0], rank_order_sum(sends, "fp32"))
            np.testing.assert_array_equal(replays[i][1], np.concatenate([p[:COUNT] for p in sends]))


def process_rank(K, uid, rank, folder, timeout_s, mode, queue):
    """One rank in a process of its own, started by multiprocessing's spawn without MPI (so it meets
    the others through the emulation's files): check_collectives, and in mode "abort" rank K-1
    aborts instead. Puts (rank, result or the error's text) on queue."""
    os.environ.update(LLMC_NCCL_EMULATION_DIR=folder, LLMC_NCCL_EMULATION_TIMEOUT_S=str(timeout_s))
    for name in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        os.environ.pop(name, None)
    communicator = nccl.NcclCommunicator(K, uid, rank)
    try:
        if mode == "abort" and rank == K - 1:
            time.sleep(0.5)
            communicator.abort()
            queue.put((rank, "aborted"))
            return
        queue.put((rank, check_collectives(communicator, rank, K)))
        communicator.destroy()
    except Exception as e:                                            # noqa: BLE001 (reported to the test)
        queue.put((rank, f"{type(e).__name__}: {e}"))
        communicator.destroy()                                       # not abort: each rank reports its own error


def run_process_ranks(K, ranks, folder, timeout_s=60, mode="check"):
    """process_rank in one spawned process for each of `ranks` (of K); returns {rank: result}."""
    import multiprocessing
    context = multiprocessing.get_context("spawn")
    queue, uid = context.Queue(), nccl.get_unique_id()
    procs = [context.Process(target=process_rank, args=(K, uid, r, str(folder), timeout_s, mode, queue))
             for r in ranks]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in ranks)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("K", [2, 3])
def test_nccl_collectives_on_process_ranks(K, tmp_path):
    results = run_process_ranks(K, range(K), tmp_path)
    assert results == {rank: NCCL_CHECKS for rank in range(K)}
    assert os.listdir(tmp_path) == []                                # the last rank out removed the folder


def test_nccl_missing_process_rank_times_out(tmp_path):
    start = time.monotonic()
    results = run_process_ranks(3, [0, 1], tmp_path, timeout_s=2)   # rank 2 never comes
    for rank in (0, 1):
        assert results[rank] == f"NcclError: NCCL error 2: rank {rank}: rank(s) [2] of 3 did not reach collective #1 " \
                                f"within 2 s (LLMC_NCCL_EMULATION_TIMEOUT_S)"
    assert time.monotonic() - start < 60
    assert os.listdir(tmp_path) == []


def test_nccl_abort_stops_the_waiting_process_ranks(tmp_path):
    start = time.monotonic()
    results = run_process_ranks(3, range(3), tmp_path, timeout_s=300, mode="abort")
    assert results[2] == "aborted"
    for rank in (0, 1):
        assert results[rank].startswith(f"NcclAborted: NCCL error 6: rank {rank}: another rank aborted")
    assert time.monotonic() - start < 60                             # not the 300 s timeout
    assert os.listdir(tmp_path) == []


MPIEXEC = shutil.which("mpiexec")


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec (mpich) is not installed")
@pytest.mark.parametrize("K", [2, 3])
def test_nccl_collectives_on_mpi_ranks(K, tmp_path):
    # this file as a script under mpiexec: each process one rank (see the end of the file), each
    # writing its report to a file of its own (mpiexec may interleave the ranks' stdout)
    r = subprocess.run([MPIEXEC, "-n", str(K), sys.executable, os.path.abspath(__file__), "nccl-worker", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    reports = [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(K)]
    assert reports == [f"nccl rank {rank}/{K}: {NCCL_CHECKS} checks, NcclComm ok" for rank in range(K)]


def mpi_worker(report_dir):
    """One MPI rank: the collectives through the emulation, then llmc.comm.NcclComm (mean_,
    reduce_scatter_mean_, all_gather_) on the emulated device against NumPy; the report goes to
    report_dir/rank<r>.txt."""
    from llmc import comm as llmc_comm
    from llmc import cuda
    cuda.use_device("cpu")
    cp = cuda.cupy()                                                 # the emulated device's arrays
    world = llmc_comm.Comm()
    rank, K = world.rank, world.size
    uid = world.comm.bcast(nccl.get_unique_id() if rank == 0 else None, root=0)
    checks = check_collectives(nccl.NcclCommunicator(K, uid, rank), rank, K)
    nc = llmc_comm.NcclComm(world)
    assert nc.nccl is nccl
    for precision in ("fp32", "bf16"):
        parts = [rank_data(r, precision, K * COUNT) for r in range(K)]
        want = rank_order_sum(parts, precision, average=True)
        arr = cp.asarray(parts[rank])
        nc.mean_(arr)
        np.testing.assert_array_equal(arr.get(), want)
        arr = cp.asarray(parts[rank])
        nc.reduce_scatter_mean_(arr)
        mine = slice(rank * COUNT, (rank + 1) * COUNT)
        np.testing.assert_array_equal(arr.get()[mine], want[mine])
        nc.all_gather_(arr)
        np.testing.assert_array_equal(arr.get(), want)
    with open(os.path.join(report_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"nccl rank {rank}/{K}: {checks} checks, NcclComm ok")


if __name__ == "__main__" and sys.argv[1:2] == ["nccl-worker"]:
    try:
        mpi_worker(sys.argv[2])
    except BaseException:
        import traceback
        traceback.print_exc()
        from llmc.comm import abort_all_ranks
        abort_all_ranks(1)                                           # the other ranks may wait in a collective
        raise
