"""Tests of llmc/cublaslt.py: the linear layers through cuBLASLt with fused epilogues.

Part 1, no GPU needed:
- epilogue_for: the table of which cuBLASLt epilogue (and bias / aux arguments) each product
  takes, and the combinations it refuses;
- our cublasLt.h constants against nvmath-python's own enums and attribute types (where
  nvmath-python imports; it does without a GPU), and unavailable_reason's one-liners;
- matmul_forward_lt / matmul_backward_lt run on the emulated device's cuBLASLt
  (llmc/emulator/cublaslt.py, reached through llmc.cuda.library("cublaslt") with the device
  "cpu"), which takes every argument literally: the matrices are read from and written to the
  raw pointers through the (rows, cols, ld) layouts and the TRANSA/TRANSB attributes, and the
  epilogue is applied as cuBLASLt documents it (BIAS adds a per-row bias; GELU_AUX(_BIAS) stores
  the GELU input in aux with its ld; DGELU multiplies by gelu' of aux; BGRADB writes the sums of
  op(B) over k). A Recorder wraps its functions to record each call's attributes and layouts (read
  back through the getters). The results are compared with plain row-major NumPy products and
  gpt2_cpu's layers, in fp32 and bf16;
- the cache: one descriptor, four layouts and one heuristic query per (shape, epilogue,
  precision, compute type); one handle and one workspace; clear_cache destroys what was made;
- the fallback when cuBLASLt has no BGRADB algorithm, and the argument checks.
Part 2, GPU (marked gpu; skipped without a GPU, and with unavailable_reason() where nvmath-python
or libcublasLt is missing): each function against gpt2_cpu's matmul_forward / matmul_backward /
gelu_forward / gelu_backward at small shapes and at GPT-2 124M shapes (B*T=4096, C=768, OC=3072),
fp32, TF32 and bf16, tolerances from llmc.check.TOLERANCES.
Run: python -m pytest -q tests/test_cublaslt.py   (part 1: about a second)
"""

import ctypes
import math
import sys
import types

import numpy as np
import pytest

import gpt2_cpu
import llmc.cuda
from emulated_gpu import record_launches
from llmc import cublaslt
from llmc.check import TOLERANCES, check_tensor
from llmc.cublaslt import (EPILOGUE_BGRADB, EPILOGUE_BIAS, EPILOGUE_DEFAULT, EPILOGUE_DGELU, EPILOGUE_DGELU_BGRAD,
                           EPILOGUE_GELU_AUX, EPILOGUE_GELU_AUX_BIAS, matmul_backward_lt, matmul_forward_lt)
from llmc.cuda import CUBLAS_OP_N, CUBLAS_OP_T
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

# ----------------------------------------------------------------------------
# part 1a: the epilogue table


@pytest.mark.parametrize("has_bias,gelu,backward,bgrad,expected", [
    (False, False, False, False, (EPILOGUE_DEFAULT, None, None)),           # classifier (no bias)
    (True, False, False, False, (EPILOGUE_BIAS, "add", None)),              # qkv, attproj, fcproj
    (True, True, False, False, (EPILOGUE_GELU_AUX_BIAS, "add", "write")),   # fc + gelu
    (False, True, False, False, (EPILOGUE_GELU_AUX, None, "write")),
    (False, False, True, False, (EPILOGUE_DEFAULT, None, None)),            # dinp, or dweight without dbias
    (False, True, True, False, (EPILOGUE_DGELU, None, "read")),             # fcproj's dinp through gelu
    (False, False, True, True, (EPILOGUE_BGRADB, "grad", None)),            # dweight and dbias
    (False, True, True, True, (EPILOGUE_DGELU_BGRAD, "grad", "read")),      # fcproj's dinp and the fc's dbias
])
def test_epilogue_for_table(has_bias, gelu, backward, bgrad, expected):
    e = cublaslt.epilogue_for(has_bias, gelu, backward, bgrad)
    assert (e.code, e.bias, e.aux) == expected
    assert e.name == cublaslt.EPILOGUE_NAMES[e.code]


@pytest.mark.parametrize("has_bias,gelu,backward,bgrad", [
    (True, False, True, False),          # a backward product adds no bias
    (False, False, False, True),         # a bias gradient in a forward product
])
def test_epilogue_for_refuses(has_bias, gelu, backward, bgrad):
    with pytest.raises(ValueError):
        cublaslt.epilogue_for(has_bias, gelu, backward, bgrad)


# ----------------------------------------------------------------------------
# part 1b: constants against nvmath-python, and unavailable_reason

def _nvmath_cublaslt():
    try:
        from nvmath.bindings import cublasLt
    except ImportError as e:
        pytest.skip(f"nvmath-python not installed ({e})")
    return cublasLt


def test_constants_match_nvmath_enums():
    lt = _nvmath_cublaslt()
    from nvmath.bindings import cublas
    E = lt.Epilogue
    assert (cublaslt.EPILOGUE_DEFAULT, cublaslt.EPILOGUE_BIAS, cublaslt.EPILOGUE_GELU_AUX, cublaslt.EPILOGUE_GELU_AUX_BIAS,
            cublaslt.EPILOGUE_DGELU, cublaslt.EPILOGUE_DGELU_BGRAD, cublaslt.EPILOGUE_BGRADB) == \
        (E.DEFAULT, E.BIAS, E.GELU_AUX, E.GELU_AUX_BIAS, E.DGELU, E.DGELU_BGRAD, E.BGRADB)
    D = lt.MatmulDescAttribute
    ours = {cublaslt.DESC_TRANSA: D.TRANSA, cublaslt.DESC_TRANSB: D.TRANSB, cublaslt.DESC_EPILOGUE: D.EPILOGUE,
            cublaslt.DESC_BIAS_POINTER: D.BIAS_POINTER, cublaslt.DESC_EPILOGUE_AUX_POINTER: D.EPILOGUE_AUX_POINTER,
            cublaslt.DESC_EPILOGUE_AUX_LD: D.EPILOGUE_AUX_LD, cublaslt.DESC_BIAS_DATA_TYPE: D.BIAS_DATA_TYPE}
    assert set(ours) == set(cublaslt.DESC_ATTRIBUTE_DTYPES)
    for value, member in ours.items():
        assert value == member, member
        assert np.dtype(cublaslt.DESC_ATTRIBUTE_DTYPES[value]) == np.dtype(lt.get_matmul_desc_attribute_dtype(member))
    P = lt.MatmulPreferenceAttribute
    ours = {cublaslt.PREF_MAX_WORKSPACE_BYTES: P.MAX_WORKSPACE_BYTES, cublaslt.PREF_MIN_ALIGNMENT_A_BYTES:
            P.MIN_ALIGNMENT_A_BYTES, cublaslt.PREF_MIN_ALIGNMENT_B_BYTES: P.MIN_ALIGNMENT_B_BYTES,
            cublaslt.PREF_MIN_ALIGNMENT_C_BYTES: P.MIN_ALIGNMENT_C_BYTES,
            cublaslt.PREF_MIN_ALIGNMENT_D_BYTES: P.MIN_ALIGNMENT_D_BYTES}
    assert set(ours) == set(cublaslt.PREF_ATTRIBUTE_DTYPES)
    for value, member in ours.items():
        assert value == member, member
        assert np.dtype(cublaslt.PREF_ATTRIBUTE_DTYPES[value]) == np.dtype(lt.get_matmul_preference_attribute_dtype(member))
    # the heuristic result starts with its algorithm (we pass the struct's address as the algo pointer)
    assert lt.matmul_heuristic_result_dtype.fields["algo"][1] == 0
    # the cuBLAS enums llmc/cuda.py defines, which this module passes too
    assert (llmc.cuda.CUBLAS_OP_N, llmc.cuda.CUBLAS_OP_T) == (cublas.Operation.N, cublas.Operation.T)
    assert llmc.cuda.CUBLAS_COMPUTE_32F == cublas.ComputeType.COMPUTE_32F
    assert llmc.cuda.CUBLAS_COMPUTE_32F_FAST_TF32 == cublas.ComputeType.COMPUTE_32F_FAST_TF32
    assert cublaslt.CUBLAS_STATUS_SUCCESS == cublas.Status.SUCCESS


def _raise(exc):
    def f(*args):
        raise exc
    return f


def test_unavailable_reason_one_liners(monkeypatch):
    monkeypatch.setattr(cublaslt, "bindings", _raise(ImportError("No module named 'nvmath'")))
    reason = cublaslt.unavailable_reason()
    assert "pip install" in reason and "nvmath-python" in reason and "\n" not in reason
    monkeypatch.setattr(cublaslt, "bindings", _raise(RuntimeError("cuda-bindings 14 is not supported\nmore")))
    reason = cublaslt.unavailable_reason()
    assert "fails to import" in reason and "cuda-bindings 14" in reason and "\n" not in reason
    broken = types.SimpleNamespace(get_version=_raise(RuntimeError("libcublasLt.so.12: cannot open\nsecond line")))
    monkeypatch.setattr(cublaslt, "bindings", lambda: broken)
    reason = cublaslt.unavailable_reason()
    assert "not loadable" in reason and "libcublasLt.so.12" in reason and "\n" not in reason
    monkeypatch.setattr(cublaslt, "bindings", lambda: types.SimpleNamespace(get_version=lambda: 110902))
    assert "older than 111103" in cublaslt.unavailable_reason()
    monkeypatch.setattr(cublaslt, "bindings", lambda: types.SimpleNamespace(get_version=lambda: 120905))
    assert cublaslt.unavailable_reason() is None


def fake_nvmath(root, imports):
    """A package `nvmath` under root whose bindings.cublasLt import runs `imports` first (as the real
    nvmath/__init__.py imports cuda.core, cuda.bindings and cuda.pathfinder)."""
    (root / "nvmath" / "bindings").mkdir(parents=True)
    (root / "nvmath" / "__init__.py").write_text(imports + "\n")
    (root / "nvmath" / "bindings" / "__init__.py").write_text("")
    (root / "nvmath" / "bindings" / "cublasLt.py").write_text("def get_version():\n    return 130000\n")


@pytest.fixture
def real_import(monkeypatch):
    """unavailable_reason importing the GPU's module (nvmath.bindings.cublasLt), with sys.path and
    sys.modules restored afterwards."""
    monkeypatch.setattr(llmc.cuda, "_device", "cuda")
    for name in [m for m in sys.modules if m == "nvmath" or m.startswith(("nvmath.", "cuda.core", "cuda.bindings"))]:
        monkeypatch.delitem(sys.modules, name)
    yield monkeypatch
    for name in [m for m in sys.modules if m == "nvmath" or m.startswith("nvmath.")]:
        del sys.modules[name]


def test_unavailable_reason_names_nvmaths_missing_dependency(real_import, tmp_path):
    """nvmath-python without cuda-core (which neither torch nor cupy-cuda13x brings): the reason
    names cuda-core, not nvmath-python."""
    fake_nvmath(tmp_path, "from cuda.core import Stream")
    (tmp_path / "cuda" / "bindings").mkdir(parents=True)                # cuda.bindings is there
    (tmp_path / "cuda" / "bindings" / "__init__.py").write_text("")
    real_import.syspath_prepend(str(tmp_path))
    reason = cublaslt.unavailable_reason()
    assert reason.startswith("nvmath-python is installed but cuda-core is missing"), reason
    assert "not installed" not in reason and "cuda-bindings" not in reason and "\n" not in reason


def test_unavailable_reason_without_nvmath_says_so(real_import):
    real_import.setitem(sys.modules, "nvmath", None)                   # hidden, also where it is installed
    assert cublaslt.unavailable_reason().startswith("nvmath-python is not installed")


def test_unavailable_reason_here_is_none_or_one_line():
    reason = cublaslt.unavailable_reason()      # the real bindings: no GPU here, or a working cuBLASLt
    assert reason is None or (isinstance(reason, str) and "\n" not in reason and reason)


# ----------------------------------------------------------------------------
# part 1c: the layers run on the emulated cuBLASLt (llmc/emulator/cublaslt.py, which computes
# what cuBLASLt documents on host memory), every binding call recorded on the way

CUDA_R_32F, CUDA_R_16BF = 0, 14                           # cudaDataType_t (library_types.h)
# the C type of each attribute the module may set (cublasLt.h), written out here independently
DESC_C_TYPES = {3: np.int32, 4: np.int32, 7: np.uint32, 8: np.int64, 11: np.int64, 12: np.int64, 26: np.int32}
PREF_C_TYPES = {1: np.uint64, 5: np.uint32, 6: np.uint32, 7: np.uint32, 8: np.uint32}
LAYOUT_ROWS, LAYOUT_COLS, LAYOUT_LD, LAYOUT_TYPE = 2, 3, 4, 0          # cublasLtMatrixLayoutAttribute_t
DESC_COMPUTE_TYPE, DESC_SCALE_TYPE = 0, 1
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
GELU_CUBIC = 0.044715


def gelu_tanh(x):
    """GELU, tanh form (what cuBLASLt's GELU epilogues compute), float64."""
    return 0.5 * x * (1.0 + np.tanh(SQRT_2_OVER_PI * (x + GELU_CUBIC * x ** 3)))


def _host_read(ptr, size, dtype):
    """One value of `dtype` at a host address (an attribute buffer or alpha/beta), checking its size."""
    assert size == np.dtype(dtype).itemsize, f"attribute passed with {size} bytes, its C type has {np.dtype(dtype).itemsize}"
    return np.frombuffer(ctypes.string_at(ptr, size), dtype=dtype)[0]


def _get_attribute(getter, obj, attr, dtype):
    """A descriptor's or layout's attribute through the bindings' own getter."""
    buf, written = np.zeros(1, dtype), np.zeros(1, np.uint64)
    getter(obj, attr, buf.ctypes.data, buf.itemsize, written.ctypes.data)
    assert written[0] == buf.itemsize
    return buf[0].item()


class Recorder:
    """Wraps the emulated bindings' functions (monkeypatched, so llmc/cublaslt.py calls the
    wrappers): counts what is created and destroyed, records each heuristic query and each matmul
    with its descriptor's attributes and layouts read back through the getters, checks the
    attribute buffers' sizes against the C types above, and can make the heuristic find no
    algorithm for some epilogues (`refuse`, as a zero count or as NOT_SUPPORTED)."""

    def __init__(self, lt, monkeypatch):
        self.lt = lt
        self.created, self.destroyed = {}, {}
        self.heuristic_calls, self.calls, self.prefs = [], [], {}
        self.refuse, self.refuse_by = set(), "count"
        self.alive = []
        for kind, make, kill in (("handle", "create", "destroy"), ("desc", "matmul_desc_create", "matmul_desc_destroy"),
                                 ("layout", "matrix_layout_create", "matrix_layout_destroy"),
                                 ("pref", "matmul_preference_create", "matmul_preference_destroy")):
            monkeypatch.setattr(lt, make, self._counting(getattr(lt, make), self.created, kind))
            monkeypatch.setattr(lt, kill, self._counting(getattr(lt, kill), self.destroyed, kind))
        for name in ("matmul_desc_set_attribute", "matmul_preference_set_attribute", "matmul_algo_get_heuristic",
                     "matmul"):
            monkeypatch.setattr(lt, name, getattr(self, "_" + name).__get__(self)(getattr(lt, name)))

    @staticmethod
    def _counting(fn, counts, kind):
        def wrapper(*args):
            counts[kind] = counts.get(kind, 0) + 1
            return fn(*args)
        return wrapper

    def _matmul_desc_set_attribute(self, real):
        def wrapper(desc, attr, buf, size):
            _host_read(buf, size, DESC_C_TYPES[attr])
            return real(desc, attr, buf, size)
        return wrapper

    def _matmul_preference_set_attribute(self, real):
        def wrapper(pref, attr, buf, size):
            self.prefs.setdefault(pref, {})[attr] = _host_read(buf, size, PREF_C_TYPES[attr])
            return real(pref, attr, buf, size)
        return wrapper

    def _epilogue(self, desc):
        return _get_attribute(self.lt.matmul_desc_get_attribute, desc, 7, np.uint32)

    def _matmul_algo_get_heuristic(self, real):
        def wrapper(handle, desc, adesc, bdesc, cdesc, ddesc, pref, requested, results, count):
            prefs = self.prefs[pref]
            assert prefs[1] == cublaslt.WORKSPACE_BYTES and all(prefs[a] == 16 for a in (5, 6, 7, 8)), prefs
            epilogue = self._epilogue(desc)
            self.heuristic_calls.append((desc, epilogue))
            if epilogue in self.refuse:
                if self.refuse_by == "error":
                    raise self.lt.cuBLASLtError(self.lt.Status.NOT_SUPPORTED)
                ctypes.memmove(count, np.zeros(1, np.int32).ctypes.data, 4)
                return None
            return real(handle, desc, adesc, bdesc, cdesc, ddesc, pref, requested, results, count)
        return wrapper

    def _layout(self, layout):
        get = self.lt.matrix_layout_get_attribute
        return dict(rows=_get_attribute(get, layout, LAYOUT_ROWS, np.uint64),
                    cols=_get_attribute(get, layout, LAYOUT_COLS, np.uint64),
                    ld=_get_attribute(get, layout, LAYOUT_LD, np.int64),
                    type=_get_attribute(get, layout, LAYOUT_TYPE, np.uint32))

    def _matmul(self, real):
        def wrapper(handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, workspace,
                    workspace_size, stream):
            attr = lambda code, dtype: _get_attribute(self.lt.matmul_desc_get_attribute, desc, code, dtype)  # noqa: E731
            self.calls.append(dict(
                desc=desc, compute=attr(DESC_COMPUTE_TYPE, np.int32), scale=attr(DESC_SCALE_TYPE, np.int32),
                transa=attr(3, np.int32), transb=attr(4, np.int32), epilogue=attr(7, np.uint32),
                bias=attr(8, np.int64), aux=attr(11, np.int64), aux_ld=attr(12, np.int64),
                a=self._layout(adesc), b=self._layout(bdesc), c=self._layout(cdesc), d=self._layout(ddesc),
                alpha=_host_read(alpha, 4, np.float32), beta=_host_read(beta, 4, np.float32),
                stream=stream, workspace=workspace, workspace_size=workspace_size, pointers=(a, b, c, d),
                algo=_host_read(algo, 8, np.uint64).item()))
            assert self.calls[-1]["c"] == self.calls[-1]["d"], "C has D's layout (C is D, or a residual of its shape)"
            return real(handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, workspace,
                        workspace_size, stream)
        return wrapper


def _to_f64(x):
    """A host or device array (fp32, or bf16 bits) as a host float64 array: a device one is copied
    with .get(), as CuPy needs (it refuses implicit device-to-host conversion)."""
    x = x.get() if hasattr(x, "get") else x
    return (bfloat16_bits_to_float32(x) if x.dtype == np.uint16 else x).astype(np.float64)


def _store(x, storage):
    x = np.asarray(x, dtype=np.float32)
    return float32_to_bfloat16_bits(x) if storage == np.uint16 else x


@pytest.fixture
def fake(monkeypatch):
    """llmc.cublaslt on the emulated device: its cuBLASLt (llmc.cuda.library("cublaslt") with the
    device "cpu") with every call recorded (a Recorder), its memory (lt.allocations: the (shape,
    dtype) of each empty()) and its kernels (lt.launches: the launches, which still run)."""
    monkeypatch.setattr(llmc.cuda, "_device", llmc.cuda.device())  # restored after the test
    llmc.cuda.use_device("cpu")
    lt = Recorder(llmc.cuda.library("cublaslt"), monkeypatch)
    assert cublaslt.bindings() is lt.lt and lt.lt.__name__ == "llmc.emulator.cublaslt"
    lt.cupy = llmc.cuda.cupy()
    lt.allocations = []
    empty = lt.cupy.empty

    def recording_empty(shape, dtype=np.float32, order="C"):
        lt.allocations.append((shape, np.dtype(dtype)))
        return empty(shape, dtype, order)
    monkeypatch.setattr(lt.cupy, "empty", recording_empty)
    lt.launches = record_launches(monkeypatch)
    cublaslt.clear_cache()
    yield lt
    cublaslt.clear_cache()


def floatx(precision):
    """The storage dtype of a floatX array: bf16 bit patterns in uint16, or float32."""
    return llmc.cuda.FLOATX_DTYPES[precision]


def dev(lt, x, precision):
    """A host array as a floatX 'device' array (bf16: rounded to nearest even), kept alive for
    the whole test (so that no two arrays of a test share an address)."""
    lt.alive.append(lt.cupy.asarray(_store(np.ascontiguousarray(x, dtype=np.float32), floatx(precision))))
    return lt.alive[-1]


def poisoned(lt, shape, precision):
    """A floatX array of NaN, kept alive like dev's: any element a product fails to write stays NaN."""
    cp = lt.cupy
    lt.alive.append(cp.full(shape, 0x7FC0, np.uint16) if precision == "bf16" else cp.full(shape, np.nan, np.float32))
    return lt.alive[-1]


def as_input(x, precision):
    """What the product sees: x rounded to floatX, in float64 for the reference."""
    return _to_f64(_store(np.asarray(x, dtype=np.float32), floatx(precision)))


def assert_close(got, ref, precision, label, kind="matmul"):
    if precision == "fp32":
        atol, rtol = 1e-5, 1e-5            # fp32 sums of <= 64 terms of ~N(0,1) values, vs float64
    else:
        atol, rtol = TOLERANCES["kernel_bf16"][kind]
    assert check_tensor(_to_f64(got), ref, f"{label} [{precision}]", atol, rtol), label


SHAPES = pytest.mark.parametrize("B,T,C,OC", [(1, 1, 8, 8), (2, 3, 16, 24), (3, 5, 24, 64)])
PRECISIONS = pytest.mark.parametrize("precision", ["fp32", "bf16"])


# ----------------------------------------------------------------------------
# part 1d: the layers through the fake

@PRECISIONS
@SHAPES
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("with_gelu", [False, True])
def test_forward_through_fake(fake, precision, B, T, C, OC, with_bias, with_gelu):
    rng = np.random.default_rng(B * 100 + OC)
    inp, w, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal(OC)
    x, wx, bx = as_input(inp, precision), as_input(w, precision), as_input(bias, precision) if with_bias else None
    out = poisoned(fake, (B, T, OC), precision)
    pre = poisoned(fake, (B, T, OC), precision) if with_gelu else None
    matmul_forward_lt(out, dev(fake, inp, precision), dev(fake, w, precision),
                      dev(fake, bias, precision) if with_bias else None, B, T, C, OC, pre_gelu=pre)
    ref_pre = gpt2_cpu.matmul_forward(x, wx, bx)
    if with_gelu:
        assert_close(pre, ref_pre, precision, "pre_gelu (aux)")
        assert_close(out, gpt2_cpu.gelu_forward(ref_pre), precision, "gelu(out)")
    else:
        assert_close(out, ref_pre, precision, "out")
    # the call itself: out^T (OC,N) = op_T(weight stored (C,OC), ld C) @ inp stored (C,N), ld C
    (call,) = fake.calls
    N = B * T
    dtype = CUDA_R_16BF if precision == "bf16" else CUDA_R_32F
    assert (call["transa"], call["transb"]) == (CUBLAS_OP_T, CUBLAS_OP_N)
    assert [(L["rows"], L["cols"], L["ld"], L["type"]) for L in (call["a"], call["b"], call["d"])] == \
           [(C, OC, C, dtype), (C, N, C, dtype), (OC, N, OC, dtype)]
    expected = cublaslt.epilogue_for(with_bias, with_gelu, backward=False).code
    assert call["epilogue"] == expected and call["aux_ld"] == (OC if with_gelu else 0)    # 0: unset
    assert (call["alpha"], call["beta"]) == (1.0, 0.0)
    assert call["compute"] == llmc.cuda.CUBLAS_COMPUTE_32F and call["scale"] == CUDA_R_32F
    assert call["stream"] == fake.cupy.cuda.get_current_stream().ptr and call["workspace_size"] == cublaslt.WORKSPACE_BYTES
    assert call["workspace"] == cublaslt._CONTEXT["workspace"].data.ptr


@PRECISIONS
@SHAPES
@pytest.mark.parametrize("in_place", [False, True])
def test_forward_with_residual_through_fake(fake, precision, B, T, C, OC, in_place):
    """out = inp @ weight^T + bias + residual: EPILOGUE_BIAS with C = the residual and beta = 1,
    out of place (D != C) or in place (out is the residual)."""
    rng = np.random.default_rng(B * 10 + C)
    inp, w, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal(OC)
    res = rng.standard_normal((B, T, OC))
    residual = dev(fake, res, precision)
    out = residual if in_place else poisoned(fake, (B, T, OC), precision)
    matmul_forward_lt(out, dev(fake, inp, precision), dev(fake, w, precision), dev(fake, bias, precision), B, T, C, OC,
                      residual=residual)
    ref = gpt2_cpu.matmul_forward(as_input(inp, precision), as_input(w, precision), as_input(bias, precision))
    assert_close(out, ref + as_input(res, precision), precision, "out = inp @ w^T + bias + residual")
    (call,) = fake.calls
    assert call["epilogue"] == EPILOGUE_BIAS and (call["alpha"], call["beta"]) == (1.0, 1.0)
    a, b, c, d = call["pointers"]
    assert (c, d) == (residual.data.ptr, out.data.ptr)
    if not in_place:                                           # the residual is only read
        np.testing.assert_array_equal(_to_f64(residual), as_input(res, precision))
    with pytest.raises(ValueError, match="GELU and a residual"):
        matmul_forward_lt(out, dev(fake, inp, precision), dev(fake, w, precision), None, B, T, C, OC,
                          pre_gelu=poisoned(fake, (B, T, OC), precision), residual=residual)


@PRECISIONS
@SHAPES
@pytest.mark.parametrize("with_dbias", [True, False])
@pytest.mark.parametrize("with_gelu", [False, True])
def test_backward_through_fake(fake, precision, B, T, C, OC, with_dbias, with_gelu):
    rng = np.random.default_rng(B * 100 + OC + 1)
    pre = rng.standard_normal((B, T, C))                  # the fcproj layer: inp = gelu(pre)
    inp = gelu_tanh(pre) if with_gelu else rng.standard_normal((B, T, C))
    w, dout = rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal((B, T, OC))
    dw0, db0 = rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dinp = poisoned(fake, (B, T, C), precision)
    dw, db = dev(fake, dw0, precision), dev(fake, db0, precision) if with_dbias else None
    handled = matmul_backward_lt(dinp, dw, db, dev(fake, dout, precision), dev(fake, inp, precision),
                                 dev(fake, w, precision), B, T, C, OC,
                                 pre_gelu=dev(fake, pre, precision) if with_gelu else None)
    assert handled == with_dbias
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = gpt2_cpu.matmul_backward(ref_dw, ref_db if with_dbias else None, as_input(dout, precision),
                                        as_input(inp, precision), as_input(w, precision))
    if with_gelu:
        ref_dinp = gpt2_cpu.gelu_backward(ref_dinp, as_input(pre, precision))
    assert_close(dinp, ref_dinp, precision, "dinp (written)")
    assert_close(dw, ref_dw, precision, "dweight (accumulated)")
    if with_dbias:
        assert_close(db, ref_db, precision, "dbias (accumulated, via BGRADB + residual_forward)")
    # the calls: dinp^T (C,N) = weight stored (C,OC) @ dout stored (OC,N); dweight^T (C,OC) = inp
    # stored (C,N) @ op_T(dout stored (OC,N)), accumulated
    N = B * T
    dinp_call, dweight_call = fake.calls
    assert (dinp_call["transa"], dinp_call["transb"]) == (CUBLAS_OP_N, CUBLAS_OP_N)
    assert [(L["rows"], L["cols"], L["ld"]) for L in (dinp_call["a"], dinp_call["b"], dinp_call["d"])] == \
           [(C, OC, C), (OC, N, OC), (C, N, C)]
    assert dinp_call["epilogue"] == (EPILOGUE_DGELU if with_gelu else EPILOGUE_DEFAULT) and dinp_call["beta"] == 0.0
    assert (dweight_call["transa"], dweight_call["transb"]) == (CUBLAS_OP_N, CUBLAS_OP_T)
    assert [(L["rows"], L["cols"], L["ld"]) for L in (dweight_call["a"], dweight_call["b"], dweight_call["d"])] == \
           [(C, N, C), (OC, N, OC), (C, OC, C)]
    assert dweight_call["epilogue"] == (EPILOGUE_BGRADB if with_dbias else EPILOGUE_DEFAULT)
    assert dweight_call["beta"] == 1.0
    assert len(fake.launches) == int(with_dbias)


@pytest.mark.parametrize("refuse_by", ["count", "error"])
def test_bgradb_without_algorithm_leaves_dbias_to_the_caller(fake, refuse_by):
    fake.refuse, fake.refuse_by = {EPILOGUE_BGRADB}, refuse_by
    B, T, C, OC = 2, 3, 16, 24
    rng = np.random.default_rng(5)
    inp, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)), rng.standard_normal((B, T, OC))
    dw0, db0 = rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dw, db = dev(fake, dw0, "fp32"), dev(fake, db0, "fp32")
    for step in (1, 2):                                   # twice: the refusal is cached, not asked again
        dinp = poisoned(fake, (B, T, C), "fp32")
        assert matmul_backward_lt(dinp, dw, db, dev(fake, dout, "fp32"), dev(fake, inp, "fp32"), dev(fake, w, "fp32"),
                                  B, T, C, OC) is False
        np.testing.assert_array_equal(db.get(), db0.astype(np.float32))                 # untouched
        np.testing.assert_allclose(dinp.get(), dout @ w, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(dw.get(), dw0 + step * dout.reshape(-1, OC).T @ inp.reshape(-1, C), rtol=1e-5, atol=1e-5)
    assert [e for _, e in fake.heuristic_calls].count(EPILOGUE_BGRADB) == 1
    assert [c["epilogue"] for c in fake.calls] == [EPILOGUE_DEFAULT] * 4 and not fake.launches


def test_bias_grad_epilogue_off_leaves_dbias_to_the_caller(fake):
    """bias_grad_epilogue=False (gpt2_cuda.py --bias-grad-epilogue 0): no BGRADB is asked for or
    run, dweight is accumulated by a plain product, dbias is untouched and the call says so."""
    B, T, C, OC = 2, 3, 16, 24
    rng = np.random.default_rng(6)
    inp, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)), rng.standard_normal((B, T, OC))
    dw0, db0 = rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dinp, dw, db = poisoned(fake, (B, T, C), "fp32"), dev(fake, dw0, "fp32"), dev(fake, db0, "fp32")
    assert matmul_backward_lt(dinp, dw, db, dev(fake, dout, "fp32"), dev(fake, inp, "fp32"), dev(fake, w, "fp32"),
                              B, T, C, OC, bias_grad_epilogue=False) is False
    np.testing.assert_array_equal(db.get(), db0.astype(np.float32))
    np.testing.assert_allclose(dw.get(), dw0 + dout.reshape(-1, OC).T @ inp.reshape(-1, C), rtol=1e-5, atol=1e-5)
    assert EPILOGUE_BGRADB not in [e for _, e in fake.heuristic_calls]
    assert [c["epilogue"] for c in fake.calls] == [EPILOGUE_DEFAULT] * 2 and not fake.launches


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_dgelu_bgrad_sums_the_fc_bias_gradient_through_fake(fake, precision):
    """pre_gelu_dbias (the fcproj layer's backward, --bias-grad-epilogue 2): the dinp product is
    DGELU_BGRAD, dinp = (dout @ weight) * gelu'(pre_gelu), and pre_gelu_dbias += its column sums
    (the fc layer's bias gradient), through the scratch and one accumulate launch."""
    B, T, C, OC = 2, 4, 24, 16                            # C: the fc's 4C, a multiple of 8 (the aux's ld)
    rng = np.random.default_rng(8)
    pre, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), \
        rng.standard_normal((B, T, OC))
    inp = gelu_tanh(pre)
    dw0, dfcb0 = rng.standard_normal((OC, C)), rng.standard_normal(C)
    dinp, dw, dfcb = poisoned(fake, (B, T, C), precision), dev(fake, dw0, precision), dev(fake, dfcb0, precision)
    assert matmul_backward_lt(dinp, dw, None, dev(fake, dout, precision), dev(fake, inp, precision),
                              dev(fake, w, precision), B, T, C, OC, pre_gelu=dev(fake, pre, precision),
                              pre_gelu_dbias=dfcb) is False               # no dbias of its own asked for
    ref_dinp = gpt2_cpu.gelu_backward(gpt2_cpu.matmul_backward(None, None, as_input(dout, precision),
                                                               as_input(inp, precision), as_input(w, precision)),
                                      as_input(pre, precision))
    assert_close(dinp, ref_dinp, precision, "dinp (DGELU_BGRAD)")
    assert_close(dfcb, as_input(dfcb0, precision) + ref_dinp.sum(axis=(0, 1)), precision, "the fc's dbias (accumulated)")
    assert [c["epilogue"] for c in fake.calls] == [EPILOGUE_DGELU_BGRAD, EPILOGUE_DEFAULT]
    assert len(fake.launches) == 1                                        # the accumulate into dfcb
    with pytest.raises(ValueError, match="pre_gelu_dbias without pre_gelu"):
        matmul_backward_lt(dinp, dw, None, dev(fake, dout, precision), dev(fake, inp, precision),
                           dev(fake, w, precision), B, T, C, OC, pre_gelu_dbias=dfcb)


def test_no_algorithm_for_a_forward_raises(fake):
    fake.refuse = {EPILOGUE_BIAS}
    out, inp, w, b = (fake.cupy.zeros(s, np.float32) for s in ((1, 2, 8), (1, 2, 8), (8, 8), (8,)))
    with pytest.raises(cublaslt.CublasLtUnsupported, match="BIAS m=8 n=2 k=8 fp32"):
        matmul_forward_lt(out, inp, w, b, 1, 2, 8, 8)


# ----------------------------------------------------------------------------
# part 1e: the cache

def test_plans_are_built_once_per_shape_epilogue_and_precision(fake, monkeypatch):
    rng = np.random.default_rng(3)

    def forward(B, T, C, OC, precision="fp32", gelu=False, tf32=False):
        inp, w, b = (dev(fake, rng.standard_normal(s), precision) for s in ((B, T, C), (OC, C), (OC,)))
        out = poisoned(fake, (B, T, OC), precision)
        pre = poisoned(fake, (B, T, OC), precision) if gelu else None
        matmul_forward_lt(out, inp, w, b, B, T, C, OC, pre_gelu=pre, tf32=tf32)
        ref = gpt2_cpu.matmul_forward(as_input(_to_f64(inp), precision), _to_f64(w), _to_f64(b))
        rounded = precision == "fp32" and tf32                # inputs rounded to 10 bits: bf16's bounds
        assert_close(pre if gelu else out, ref, "bf16" if rounded else precision, "cached plan, fresh pointers")

    forward(2, 4, 16, 8)
    forward(2, 4, 16, 8)                                  # same plan; new bias and aux pointers
    assert (fake.created["desc"], fake.created["layout"], len(fake.heuristic_calls)) == (1, 4, 1)
    assert fake.calls[0]["bias"] != fake.calls[1]["bias"]  # the per-call pointer was updated
    forward(2, 4, 16, 8, gelu=True)                       # another epilogue
    forward(1, 4, 16, 8)                                  # another shape (n = 4)
    forward(2, 4, 16, 8, precision="bf16")                # another precision
    forward(2, 4, 16, 8, tf32=True)                       # fp32 with TF32: another compute type
    forward(2, 4, 16, 8, precision="bf16", tf32=True)     # bf16 ignores the TF32 flag: the cached plan
    assert fake.created["desc"] == 5 and fake.created["layout"] == 20 and len(fake.heuristic_calls) == 5
    assert fake.calls[5]["compute"] == llmc.cuda.CUBLAS_COMPUTE_32F_FAST_TF32
    assert fake.calls[6]["compute"] == llmc.cuda.CUBLAS_COMPUTE_32F
    # one handle and one 32 MiB workspace for all of it; preferences are not kept
    assert fake.created["handle"] == 1
    assert fake.allocations == [(cublaslt.WORKSPACE_BYTES, np.dtype(np.uint8))]
    assert fake.created["pref"] == fake.destroyed["pref"] == 5
    cublaslt.clear_cache()
    assert fake.destroyed["desc"] == 5 and fake.destroyed["layout"] == 20 and fake.destroyed["handle"] == 1
    assert not cublaslt._PLANS and not cublaslt._CONTEXT


def test_bgrad_scratch_is_allocated_once_per_size(fake):
    B, T, C, OC = 1, 4, 8, 16
    args = [fake.cupy.zeros(s, np.float32) for s in ((B, T, C), (OC, C), (OC,), (B, T, OC), (B, T, C), (OC, C))]
    for _ in range(3):
        assert matmul_backward_lt(*args, B, T, C, OC)
    assert fake.allocations.count((OC, np.dtype(np.float32))) == 1


# ----------------------------------------------------------------------------
# part 1f: autotuning (--autotune): the heuristic's best few algorithms timed, the fastest kept

def _algo_id(algo):
    """The emulated algorithm id at the start of a cublasLtMatmulHeuristicResult_t's address."""
    return int(np.frombuffer(ctypes.string_at(algo, 8), np.uint64)[0])


def test_autotune_times_each_candidate_and_keeps_the_fastest(fake, monkeypatch):
    """Three candidates made to take 6, 0 and 3 ms a call: each is called once untimed, then
    AUTOTUNE_REPEATS times timed, and the second is kept, for this call and the next; the result is
    the product's."""
    delays = {}                                            # algorithm id -> seconds per call
    matmul = fake.lt.matmul

    def slow_matmul(*args):
        import time
        time.sleep(delays.get(_algo_id(args[12]), 0.0))
        return matmul(*args)
    monkeypatch.setattr(fake.lt, "matmul", slow_matmul)
    heuristic = fake.lt.matmul_algo_get_heuristic

    def delaying_heuristic(handle, desc, adesc, bdesc, cdesc, ddesc, pref, requested, results, count):
        heuristic(handle, desc, adesc, bdesc, cdesc, ddesc, pref, requested, results, count)
        answered = np.frombuffer(ctypes.string_at(results, requested * 96), np.uint64).reshape(requested, 12)
        assert requested == 3 and int(np.frombuffer(ctypes.string_at(count, 4), np.int32)[0]) == 3
        delays.update({int(answered[i, 0]): d for i, d in enumerate((0.006, 0.0, 0.003))})
    monkeypatch.setattr(fake.lt, "matmul_algo_get_heuristic", delaying_heuristic)
    B, T, C, OC = 2, 3, 16, 24
    rng = np.random.default_rng(8)
    inp, w, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / 4, rng.standard_normal(OC)
    for call in range(2):
        out = poisoned(fake, (B, T, OC), "fp32")
        matmul_forward_lt(out, dev(fake, inp, "fp32"), dev(fake, w, "fp32"), dev(fake, bias, "fp32"), B, T, C, OC,
                          autotune=3)
        assert_close(out, gpt2_cpu.matmul_forward(inp, w, bias), "fp32", "the product, through the kept algorithm")
    (plan,) = cublaslt._PLANS.values()
    ids = [int(i) for i in plan.candidates["algo"][:, 0]]
    used = [call["algo"] for call in fake.calls]
    repeats = 1 + cublaslt.AUTOTUNE_REPEATS
    assert used == [ids[0]] * repeats + [ids[1]] * repeats + [ids[2]] * repeats + [ids[1], ids[1]]
    assert plan.chosen == 1 and plan.timings_ms[1] < plan.timings_ms[2] < plan.timings_ms[0]
    assert plan.timings_ms[0] >= 5.0 and len(fake.heuristic_calls) == 1
    (line,) = cublaslt.tuning_report()
    assert line.startswith(f"{OC}x{B * T}x{C} TN BIAS fp32: heuristic's first ") and "kept #2 of 3" in line


@PRECISIONS
@pytest.mark.parametrize("with_dbias", [True, False])
def test_autotune_restores_what_the_product_reads(fake, precision, with_dbias):
    """The trials write D: where the product reads it (dweight accumulated, the residual added in
    place) it is restored, so a tuned call leaves exactly what an untuned one does (the emulated
    algorithms compute alike); without the restore dweight would hold 1 + 3 x 6 accumulations."""
    B, T, C, OC = 2, 3, 16, 24
    rng = np.random.default_rng(9)
    inp, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / 4, rng.standard_normal((B, T, OC))
    dw0, db0, res, bias = (rng.standard_normal(s) for s in ((OC, C), (OC,), (B, T, OC), (OC,)))
    results = {}
    for autotune in (1, 3):
        dinp, dw = poisoned(fake, (B, T, C), precision), dev(fake, dw0, precision)
        db = dev(fake, db0, precision) if with_dbias else None
        matmul_backward_lt(dinp, dw, db, dev(fake, dout, precision), dev(fake, inp, precision), dev(fake, w, precision),
                           B, T, C, OC, autotune=autotune)
        residual = dev(fake, res, precision)
        matmul_forward_lt(residual, dev(fake, inp, precision), dev(fake, w, precision), dev(fake, bias, precision),
                          B, T, C, OC, residual=residual, autotune=autotune)            # in place
        results[autotune] = [x.get() for x in (dinp, dw, residual) + ((db,) if with_dbias else ())]
    for untuned, tuned in zip(results[1], results[3]):
        np.testing.assert_array_equal(tuned, untuned)
    assert all(len(plan.timings_ms) == 3 for key, plan in cublaslt._PLANS.items() if key[-1] == 3)


def test_a_product_first_met_in_a_capture_keeps_the_heuristics_first(fake):
    """While the stream captures, a product runs nothing to time: its plan keeps the heuristic's
    first algorithm and is never tuned afterwards (a graph may hold it); the graph computes the
    product."""
    B, T, C, OC = 1, 4, 8, 16
    rng = np.random.default_rng(10)
    inp, w = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C))
    out = poisoned(fake, (B, T, OC), "fp32")
    args = (out, dev(fake, inp, "fp32"), dev(fake, w, "fp32"), None, B, T, C, OC)
    stream = fake.cupy.cuda.Stream()
    with stream:
        stream.begin_capture()
        matmul_forward_lt(*args, autotune=3)
        graph = stream.end_capture()
        (plan,) = cublaslt._PLANS.values()
        assert plan.timings_ms == [] and plan.chosen == 0 and len(plan.candidates) == 3
        assert [call["algo"] for call in fake.calls] == [int(plan.candidates["algo"][0, 0])]
        graph.launch()
        matmul_forward_lt(*args, autotune=3)               # eager now: still not tuned
    assert len(fake.calls) == 2 and plan.timings_ms == [] and cublaslt.tuning_report() == []
    assert_close(out, inp @ w.T, "fp32", "the product, from the graph")


def test_autotune_count_is_checked(fake):
    z = lambda *s: fake.cupy.zeros(s, np.float32)                                  # noqa: E731
    for count in (0, cublaslt.MAX_AUTOTUNE + 1):
        with pytest.raises(ValueError, match="autotune"):
            matmul_forward_lt(z(1, 2, 8), z(1, 2, 8), z(8, 8), None, 1, 2, 8, 8, autotune=count)
    assert not fake.calls


# ----------------------------------------------------------------------------
# part 1g: argument checks (before any library call)

def test_argument_checks(fake):
    B, T, C, OC = 1, 2, 8, 12
    z = lambda *s, dtype=np.float32: fake.cupy.zeros(s, dtype)                  # noqa: E731
    with pytest.raises(ValueError, match="multiple of 8"):                     # aux ld = OC = 12
        matmul_forward_lt(z(B, T, OC), z(B, T, C), z(OC, C), z(OC), B, T, C, OC, pre_gelu=z(B, T, OC))
    with pytest.raises(TypeError):                                              # bf16 weight, fp32 rest
        matmul_forward_lt(z(B, T, OC), z(B, T, C), z(OC, C, dtype=np.uint16), None, B, T, C, OC)
    with pytest.raises(ValueError, match="elements"):                          # wrong size
        matmul_forward_lt(z(B, T, OC), z(B, T, C + 4), z(OC, C), None, B, T, C, OC)
    with pytest.raises(ValueError, match="aligned"):                           # a view 4 bytes in
        matmul_forward_lt(z(B, T, OC), z(B * T * C + 1)[1:], z(OC, C), None, B, T, C, OC)
    with pytest.raises(ValueError, match="bias must be given"):
        cublaslt.matmul_cublaslt(z(8, 8), z(8, 8), z(8, 8), 8, 8, 8, CUBLAS_OP_N, CUBLAS_OP_N,
                                 cublaslt.epilogue_for(True, False, False))
    assert not fake.calls and "desc" not in fake.created


# ----------------------------------------------------------------------------
# part 2: on a GPU

def _gpu():
    reason = cublaslt.unavailable_reason()
    if reason:
        pytest.skip(reason)
    import cupy
    return cupy


def to_device(x, precision):
    x = np.ascontiguousarray(x, dtype=np.float32)
    return _gpu().asarray(float32_to_bfloat16_bits(x) if precision == "bf16" else x)


def gpu_poisoned(shape, precision):
    cp = _gpu()
    return cp.full(shape, 0x7FC0, np.uint16) if precision == "bf16" else cp.full(shape, np.nan, np.float32)


def gpu_check(got, ref, group, kind, label):
    atol, rtol = TOLERANCES[group][kind]
    got = got.get()
    assert check_tensor(_to_f64(got), ref, f"{label} [{group}]", atol, rtol), label


# (precision, TF32, tolerance group): TF32 keeps 10 mantissa bits, so it takes bf16's tolerances
GPU_PRECISIONS = pytest.mark.parametrize("precision,tf32,group", [("fp32", False, "kernel_fp32"),
                                                                  ("fp32", True, "kernel_bf16"),
                                                                  ("bf16", False, "kernel_bf16")])


@pytest.fixture
def gpu_lt(monkeypatch):
    _gpu()
    cublaslt.clear_cache()
    yield
    _gpu().cuda.get_current_stream().synchronize()
    cublaslt.clear_cache()


@pytest.mark.gpu
@GPU_PRECISIONS
@pytest.mark.parametrize("B,T,C,OC", [(2, 8, 64, 192), (4, 1024, 768, 3072)])    # small; GPT-2 124M's fc
@pytest.mark.parametrize("gelu", [False, True])
def test_gpu_matmul_forward_lt(gpu_lt, monkeypatch, precision, tf32, group, B, T, C, OC, gelu):
    rng = np.random.default_rng(B * T + OC)
    inp, w, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal(OC)
    x, wx, bx = as_input(inp, precision), as_input(w, precision), as_input(bias, precision)
    out, pre = gpu_poisoned((B, T, OC), precision), gpu_poisoned((B, T, OC), precision) if gelu else None
    args = (to_device(inp, precision), to_device(w, precision), to_device(bias, precision), B, T, C, OC)
    matmul_forward_lt(out, *args, pre_gelu=pre, tf32=tf32)
    ref_pre = gpt2_cpu.matmul_forward(x, wx, bx)
    if not gelu:
        gpu_check(out, ref_pre, group, "matmul", "out = inp @ weight^T + bias (BIAS epilogue)")
    else:
        gpu_check(pre, ref_pre, group, "matmul", "pre_gelu (GELU_AUX_BIAS aux)")
        ref_out = gpt2_cpu.gelu_forward(ref_pre)
        gpu_check(out, ref_out, group, "matmul", "gelu(out) (GELU_AUX_BIAS)")
        if precision == "fp32" and not tf32:             # the tanh GELU, not the exact (erf) one
            sample = slice(0, 1 << 16)                      # math.erf is per element: a sample is plenty
            p, r = ref_pre.reshape(-1)[sample], ref_out.reshape(-1)[sample]
            erf_gap = np.abs(r - 0.5 * p * (1 + np.vectorize(math.erf)(p / math.sqrt(2)))).max()
            assert np.abs(out.get().reshape(-1)[sample] - r).max() < erf_gap / 10, "cuBLASLt's GELU is not the tanh form"
    first = out.get()
    matmul_forward_lt(out, *args, pre_gelu=pre, tf32=tf32)   # the cached plan gives the same bits again
    np.testing.assert_array_equal(out.get(), first)


@pytest.mark.gpu
@GPU_PRECISIONS
@pytest.mark.parametrize("B,T,C,OC,gelu", [(2, 8, 64, 192, False), (2, 8, 192, 64, True),
                                           (4, 1024, 768, 3072, False),      # GPT-2 124M fc
                                           (4, 1024, 3072, 768, True)])      # GPT-2 124M fcproj, through gelu
def test_gpu_matmul_backward_lt(gpu_lt, monkeypatch, precision, tf32, group, B, T, C, OC, gelu):
    rng = np.random.default_rng(B * T + OC + 1)
    pre = rng.standard_normal((B, T, C))
    inp = gelu_tanh(pre) if gelu else rng.standard_normal((B, T, C))
    w, dout = rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal((B, T, OC))
    dw0, db0 = rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dinp, dw, db = gpu_poisoned((B, T, C), precision), to_device(dw0, precision), to_device(db0, precision)
    handled = matmul_backward_lt(dinp, dw, db, to_device(dout, precision), to_device(inp, precision),
                                 to_device(w, precision), B, T, C, OC,
                                 pre_gelu=to_device(pre, precision) if gelu else None, tf32=tf32)
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = gpt2_cpu.matmul_backward(ref_dw, ref_db, as_input(dout, precision), as_input(inp, precision),
                                        as_input(w, precision))
    if gelu:
        ref_dinp = gpt2_cpu.gelu_backward(ref_dinp, as_input(pre, precision))
    gpu_check(dinp, ref_dinp, group, "matmul", "dinp" + (" (DGELU)" if gelu else ""))
    gpu_check(dw, ref_dw, group, "matmul", "dweight (accumulated)")
    if handled:
        gpu_check(db, ref_db, group, "matmul", "dbias (BGRADB, accumulated)")
    else:                                                # documented fallback: dbias is the caller's
        np.testing.assert_array_equal(db.get(), to_device(db0, precision).get())
        pytest.xfail("this cuBLASLt has no BGRADB algorithm for the shape: dbias left to the caller")


@pytest.mark.gpu
@GPU_PRECISIONS
@pytest.mark.parametrize("C,OC", [(768, 2304), (768, 3072), (3072, 768)])     # GPT-2 124M's qkv, fc, fcproj
def test_gpu_bias_grad_outside_the_epilogue_matches_gpt2_cpu(gpu_lt, precision, tf32, group, C, OC):
    """gpt2_cuda.py --bias-grad-epilogue 0 on a GPU (B=4, T=1024): the linear layer's backward
    through CublasLt with plain dweight products and kernels/bias.cu's bias_backward for dbias."""
    import llmc.matmul
    from gpt2_cuda import partial_floats
    from gpt2_cpu import GPT2Config
    B, T = 4, 1024
    rng = np.random.default_rng(OC + 7)
    inp, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), \
        rng.standard_normal((B, T, OC))
    dw0, db0 = rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dinp, dw, db = gpu_poisoned((B, T, C), precision), to_device(dw0, precision), to_device(db0, precision)
    partial = llmc.cuda.cupy().zeros(partial_floats(GPT2Config(channels=max(C, OC))), np.float32)
    llmc.matmul.CublasLt(tf32, bias_grad_epilogue=False).backward(
        dinp, dw, db, to_device(dout, precision), to_device(inp, precision), to_device(w, precision), partial,
        B, T, C, OC)
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = gpt2_cpu.matmul_backward(ref_dw, ref_db, as_input(dout, precision), as_input(inp, precision),
                                        as_input(w, precision))
    gpu_check(dinp, ref_dinp, group, "matmul", "dinp")
    gpu_check(dw, ref_dw, group, "matmul", "dweight (accumulated, plain product)")
    gpu_check(db, ref_db, group, "matmul", "dbias (accumulated, bias_backward)")


@pytest.mark.gpu
@GPU_PRECISIONS
def test_gpu_bias_grad_dgelu_bgrad_matches_gpt2_cpu(gpu_lt, precision, tf32, group):
    """gpt2_cuda.py --bias-grad-epilogue 2 on a GPU at GPT-2 124M's fcproj (B=4, T=1024, C=3072,
    OC=768): dinp through DGELU_BGRAD, whose row sums accumulate into the fc's bias gradient
    (bias_backward where this cuBLASLt has no algorithm for it: the test says which ran)."""
    import llmc.matmul
    from gpt2_cuda import partial_floats
    from gpt2_cpu import GPT2Config
    B, T, C, OC = 4, 1024, 3072, 768
    rng = np.random.default_rng(9)
    pre, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), \
        rng.standard_normal((B, T, OC))
    inp = gelu_tanh(pre)
    dw0, db0, dfcb0 = rng.standard_normal((OC, C)), rng.standard_normal(OC), rng.standard_normal(C)
    dinp, dw = gpu_poisoned((B, T, C), precision), to_device(dw0, precision)
    db, dfcb = to_device(db0, precision), to_device(dfcb0, precision)
    partial = llmc.cuda.cupy().zeros(partial_floats(GPT2Config(channels=C)), np.float32)
    matmul = llmc.matmul.CublasLt(tf32, bias_grad_epilogue=2)
    assert matmul.pre_gelu_bias_grad
    matmul.backward(dinp, dw, db, to_device(dout, precision), to_device(inp, precision), to_device(w, precision),
                    partial, B, T, C, OC, pre_gelu=to_device(pre, precision), pre_gelu_dbias=dfcb)
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = gpt2_cpu.gelu_backward(gpt2_cpu.matmul_backward(ref_dw, ref_db, as_input(dout, precision),
                                                               as_input(inp, precision), as_input(w, precision)),
                                      as_input(pre, precision))
    gpu_check(dinp, ref_dinp, group, "matmul", "dinp (DGELU)")
    gpu_check(dw, ref_dw, group, "matmul", "dweight (accumulated, plain product)")
    gpu_check(db, ref_db, group, "matmul", "dbias (accumulated, bias_backward)")
    gpu_check(dfcb, as_input(dfcb0, precision) + ref_dinp.sum(axis=(0, 1)), group, "matmul",
              "the fc's dbias (accumulated from dinp's column sums)")
    print("DGELU_BGRAD plans:", [p.heuristic is not None for key, p in cublaslt._PLANS.items()
                                 if key[7] == cublaslt.EPILOGUE_DGELU_BGRAD])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layer", ["fc", "fcproj"])
def test_gpu_bias_grads_zero_writes_what_accumulating_adds(gpu_lt, precision, layer):
    """The step's first micro-batch on a GPU (bias_grads_zero=True): BGRADB, at the fc with bias_grad_epilogue
    1, and DGELU_BGRAD, at the fcproj with level 2 (the fc's bias gradient), write straight into the zeroed
    dbias (here poisoned with NaN first: every value must be written) what the accumulating path (scratch,
    then dbias = 0 + scratch) leaves there: bit for bit, and dinp, dweight too. GPT-2 124M's shapes, B=4,
    T=1024. A cuBLASLt build without the epilogue's algorithm skips (the fallback never writes here)."""
    B, T = 4, 1024
    C, OC = (768, 3072) if layer == "fc" else (3072, 768)
    rng = np.random.default_rng(12)
    pre, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), \
        rng.standard_normal((B, T, OC))
    inp = gelu_tanh(pre) if layer == "fcproj" else rng.standard_normal((B, T, C))
    args = (to_device(dout, precision), to_device(inp, precision), to_device(w, precision), B, T, C, OC)
    results = []
    for zero in (False, True):
        cublaslt.clear_cache()
        dinp, dw = gpu_poisoned((B, T, C), precision), to_device(np.zeros((OC, C)), precision)
        # the bias gradient under test: zeros for the accumulating path, NaN for the one that writes
        db = gpu_poisoned((OC if layer == "fc" else C,), precision) if zero else \
            to_device(np.zeros(OC if layer == "fc" else C), precision)
        try:
            if layer == "fc":
                handled = matmul_backward_lt(dinp, dw, db, *args, bias_grads_zero=zero)
                if not handled:
                    pytest.skip("this cuBLASLt has no BGRADB algorithm for the fc's dweight product")
            else:
                matmul_backward_lt(dinp, dw, None, *args, pre_gelu=to_device(pre, precision), pre_gelu_dbias=db,
                                   bias_grads_zero=zero)
        except cublaslt.CublasLtUnsupported as e:
            pytest.skip(f"this cuBLASLt has no algorithm for the epilogue: {e}")
        results.append((dinp.get(), dw.get(), db.get()))
    for name, accumulated, written in zip(("dinp", "dweight", "dbias"), *results):
        assert np.array_equal(accumulated, written), name


@pytest.mark.gpu
def test_gpu_autotuned_products_match_gpt2_cpu(gpu_lt):
    """--autotune 8 on a GPU at GPT-2 124M's fc shape (bf16): the forward with GELU_AUX_BIAS and
    the backward (dinp, and dweight accumulated with BGRADB) each time the heuristic's algorithms,
    keep one, and give gpt2_cpu's results; dweight accumulated once shows the trials were undone."""
    B, T, C, OC, precision, group = 4, 1024, 768, 3072, "bf16", "kernel_bf16"
    rng = np.random.default_rng(21)
    inp, w, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal(OC)
    dout, dw0, db0 = rng.standard_normal((B, T, OC)), rng.standard_normal((OC, C)), rng.standard_normal(OC)
    x, wx, bx = as_input(inp, precision), as_input(w, precision), as_input(bias, precision)
    out, pre = gpu_poisoned((B, T, OC), precision), gpu_poisoned((B, T, OC), precision)
    matmul_forward_lt(out, to_device(inp, precision), to_device(w, precision), to_device(bias, precision), B, T, C, OC,
                      pre_gelu=pre, autotune=8)
    ref_pre = gpt2_cpu.matmul_forward(x, wx, bx)
    gpu_check(pre, ref_pre, group, "matmul", "pre_gelu (autotuned GELU_AUX_BIAS)")
    gpu_check(out, gpt2_cpu.gelu_forward(ref_pre), group, "matmul", "gelu(out) (autotuned GELU_AUX_BIAS)")
    dinp, dw, db = gpu_poisoned((B, T, C), precision), to_device(dw0, precision), to_device(db0, precision)
    handled = matmul_backward_lt(dinp, dw, db, to_device(dout, precision), to_device(inp, precision),
                                 to_device(w, precision), B, T, C, OC, autotune=8)
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = gpt2_cpu.matmul_backward(ref_dw, ref_db, as_input(dout, precision), x, wx)
    gpu_check(dinp, ref_dinp, group, "matmul", "dinp (autotuned)")
    gpu_check(dw, ref_dw, group, "matmul", "dweight accumulated once (autotuned)")
    if handled:                                             # BGRADB found an algorithm (else the caller sums dbias)
        gpu_check(db, ref_db, group, "matmul", "dbias accumulated once (autotuned BGRADB)")
    report = cublaslt.tuning_report()
    assert report and all(np.isfinite(min(p.timings_ms)) for p in cublaslt._PLANS.values() if p.timings_ms), report
    print("\n".join(report))
