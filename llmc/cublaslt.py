"""
llmc/cublaslt.py: the linear layers' matmuls through cuBLASLt with fused epilogues (a library
call, llm.c's llmc/matmul.cuh `matmul_cublaslt`), reached through NVIDIA's nvmath-python
(`nvmath.bindings.cublasLt`, thin Python bindings of the C API). One cuBLASLt call does what the
plain cuBLAS path of gpt2_cuda.py does in two or three launches:

    forward   out = inp @ weight^T + bias              EPILOGUE_BIAS (no bias copy first)
    forward   out = inp @ weight^T + bias + residual   EPILOGUE_BIAS with C = the residual, beta = 1
                                                       (the attention and MLP output projections)
    forward   out = gelu(inp @ weight^T + bias)        EPILOGUE_GELU_AUX_BIAS, and the pre-activation
              pre_gelu = inp @ weight^T + bias         is stored too (the "aux" output)
    backward  dinp = (dout @ weight) * gelu'(pre_gelu) EPILOGUE_DGELU (reads pre_gelu as aux)
    backward  dweight += dout^T @ inp                  EPILOGUE_BGRADB: the same pass over dout
              dbias = column sums of dout              also sums its columns
    backward  dinp as DGELU, and the bias gradient     EPILOGUE_DGELU_BGRAD (the fcproj layer's input
              of the layer before the GELU             gradient is the fc layer's pre-activation
              = column sums of dinp                    gradient: its sums are the fc's dbias)

Which algorithm: cuBLASLt's heuristic ranks its algorithms for a product (a kernel, a tile, a
split of k, ...) from the shapes alone; by default each product takes the first, as llm.c does.
With autotune = N > 1 (gpt2_cuda.py --autotune N) the first call of each product asks for
the heuristic's N best instead, times each on the real operands (CUDA events, AUTOTUNE_REPEATS
calls after one untimed) and keeps the fastest for the rest of the run, as PyTorch's
TunableOp does for its GEMMs. The trial calls write D (restored where the product reads it:
an accumulation, or a residual added in place) and the epilogue's outputs, which the real call
then writes again. Two algorithms may sum in different orders, so a tuned run can differ from an
untuned one in the last bits, and from another tuned run where the timings rank two algorithms
differently; within a run every call of a product uses one algorithm. A product first met while a
stream captures a CUDA graph keeps the heuristic's first (a capture records, it runs nothing to
time); gpt2_cuda.py runs every product eagerly before its first capture. tuning_report() lists
each tuned product's timings.

What it deliberately is not: a general GEMM wrapper. No batched products (attention keeps
llmc.cuda.gemm), no FP8, one GPU per process (llmc.cuda.select_device binds it), not wired into
gpt2_cuda.py by this module.

Why the low-level bindings and not nvmath.linalg.advanced.Matmul: our bf16 tensors are CuPy
uint16 arrays holding bf16 bit patterns (CuPy has no bfloat16 dtype; llmc/cuda.py), and Matmul
takes each operand's type from its dtype, so it would see CUDA_R_16U integers, not CUDA_R_16BF.
Matmul also allocates its epilogue outputs itself (the GELU aux, the bias gradient) and returns
them, where the trainer needs them written into its preallocated activation buffers. The bindings
take raw pointers (arr.data.ptr) and cudaDataType_t values, which is exactly what we have.

Which GELU cuBLASLt applies: the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
the same as kernels/gelu.cu and gpt2_cpu.gelu_forward. The cuBLAS documentation names the epilogue
"GELU" without printing its formula; the evidence is that the libraries built on these epilogues
treat them as the tanh form: llm.c fuses its (tanh) GELU into GELU_AUX_BIAS / DGELU (train_gpt2.cu
-ge, llmc/matmul.cuh), and flash-attention's FusedMLP (csrc/fused_dense_lib, cuBLASLt epilogues)
accepts only activation="gelu_approx". tests/test_cublaslt.py checks it on a GPU: in fp32 the
fused result must sit 10x closer to the tanh form than the exact erf GELU lies from it (they
differ by up to 4.7e-4, at |x| = 2.7).

The bias gradient: BGRADB *writes* (=) the column sums into the bias pointer (beta applies only to
D), while our parameter gradients accumulate (+=) over micro-batches. So BGRADB writes into a
floatX scratch vector of OC values owned by this module, and kernels/layernorm.cu's
residual_forward adds it into dbias (dbias = dbias + scratch, one tiny launch). In bf16 the sum is
thus rounded twice (the scratch, then dbias), where kernels/bias.cu rounds once. In the step's first
micro-batch the gradients were just set to 0, and the model says so (bias_grads_zero): BGRADB then
writes into dbias itself, the same bits as 0 + scratch, without the launch (48 of them in GPT-2
124M's step, 0.20 ms of its 30.6 on an H200). cuBLASLt supports
BGRADB only with B transposed (nvmath.linalg.advanced transposes B itself to use it), which our
dweight product is (op(B) = T, below); where a cuBLASLt build still finds no algorithm
for it, matmul_backward_lt falls back to a plain dweight product, leaves dbias alone and returns
False, and the caller runs its own bias kernel.

Setup: pip install "nvmath-python[cu12]" (optional; the cu12 extra pins cuda-bindings 12 and
brings nvidia-cublas-cu12, matching cupy-cuda12x). nvmath.bindings.cublasLt imports without a GPU;
the library is loaded at the first call, which without a CUDA driver raises NotSupportedError
("CUDA driver is not found"). unavailable_reason() says in one line what is missing.

Run the tests: python -m pytest -q tests/test_cublaslt.py
    without a GPU: "87 passed, 25 skipped" in a few seconds (the host logic, on the emulated
    device's cuBLASLt, llmc/emulator/cublaslt.py); on a GPU with nvmath-python the GPU tests run too

Dimensions: B, T, C, OC as in gpt2_cpu.py, N = B*T rows. Column-major: llmc/cuda.py explains once
why a row-major (R, K) matrix is the column-major (K, R) matrix with leading dimension K; each
product below works out its transposes next to the call. A cuBLASLt layout describes a matrix as
stored (rows, cols, ld); TRANSA/TRANSB say whether the product uses it or its transpose.
"""

from collections import namedtuple

import numpy as np

from llmc import cuda
from llmc.cuda import (BLOCK_SIZE, CUBLAS_DATA_TYPES, CUBLAS_OP_N, CUBLAS_OP_T, CUDA_R_32F, ceil_div, check_launch,
                       elementwise_grid, require, vector_size)

# ----------------------------------------------------------------------------
# constants (values from cublasLt.h; tests/test_cublaslt.py checks them against nvmath's enums)

WORKSPACE_BYTES = 32 * 1024 * 1024     # llm.c's cublaslt_workspace_size: Hopper's kernels want 32 MiB
MIN_ALIGNMENT_BYTES = 16               # every pointer we pass is 16-byte aligned (checked), so we tell the
                                       # heuristic: it must not pick an algorithm that needs 256 (its default)
AUX_LD_MULTIPLE = 8                    # cuBLASLt: the GELU aux leading dimension must be a multiple of 8
MIN_CUBLASLT_VERSION = 111103          # CUDA 11.8: first with DGELU and BGRADB (nvmath's epilog version table)
NVMATH_PIP_PACKAGE = "nvmath-python[cu12]"
HEURISTIC_ALGORITHMS = 1               # by default ask the heuristic for its best algorithm only, as llm.c does
MAX_AUTOTUNE = 16                      # autotune: at most this many of the heuristic's algorithms are timed
AUTOTUNE_REPEATS = 5                   # autotune: timed calls per algorithm (after one untimed call)
CUBLAS_STATUS_SUCCESS = 0

# cublasLtEpilogue_t
EPILOGUE_DEFAULT = 1                   # D = alpha op(A) op(B) + beta C
EPILOGUE_BIAS = 4                      # ... + bias, bias (rows of D,) broadcast over the columns
EPILOGUE_GELU_AUX = 160                # aux = the result, D = gelu(aux)
EPILOGUE_GELU_AUX_BIAS = 164           # aux = the result + bias, D = gelu(aux)
EPILOGUE_DGELU = 192                   # D = the result * gelu'(aux), aux read
EPILOGUE_DGELU_BGRAD = 208             # D as DGELU; bias (rows of D,) = each row of D summed, written
EPILOGUE_BGRADB = 512                  # D = the result; bias (cols of D,) = sums of op(B) over k, written
EPILOGUE_NAMES = {EPILOGUE_DEFAULT: "DEFAULT", EPILOGUE_BIAS: "BIAS", EPILOGUE_GELU_AUX: "GELU_AUX",
                  EPILOGUE_GELU_AUX_BIAS: "GELU_AUX_BIAS", EPILOGUE_DGELU: "DGELU",
                  EPILOGUE_DGELU_BGRAD: "DGELU_BGRAD", EPILOGUE_BGRADB: "BGRADB"}

# cublasLtMatmulDescAttributes_t, and the C type of each value we set
DESC_TRANSA = 3
DESC_TRANSB = 4
DESC_EPILOGUE = 7
DESC_BIAS_POINTER = 8
DESC_EPILOGUE_AUX_POINTER = 11
DESC_EPILOGUE_AUX_LD = 12
DESC_BIAS_DATA_TYPE = 26
DESC_ATTRIBUTE_DTYPES = {DESC_TRANSA: np.int32, DESC_TRANSB: np.int32, DESC_EPILOGUE: np.uint32,
                         DESC_BIAS_POINTER: np.int64, DESC_EPILOGUE_AUX_POINTER: np.int64,
                         DESC_EPILOGUE_AUX_LD: np.int64, DESC_BIAS_DATA_TYPE: np.int32}

# cublasLtMatmulPreferenceAttributes_t, and their C types
PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT_A_BYTES = 5
PREF_MIN_ALIGNMENT_B_BYTES = 6
PREF_MIN_ALIGNMENT_C_BYTES = 7
PREF_MIN_ALIGNMENT_D_BYTES = 8
PREF_ATTRIBUTE_DTYPES = {PREF_MAX_WORKSPACE_BYTES: np.uint64, PREF_MIN_ALIGNMENT_A_BYTES: np.uint32,
                         PREF_MIN_ALIGNMENT_B_BYTES: np.uint32, PREF_MIN_ALIGNMENT_C_BYTES: np.uint32,
                         PREF_MIN_ALIGNMENT_D_BYTES: np.uint32}


class CublasLtUnsupported(RuntimeError):
    """cuBLASLt has no algorithm for this product and epilogue (the heuristic found none)."""


# ----------------------------------------------------------------------------
# the bindings, imported lazily (llmc.cuda.library picks the GPU's or the emulated device's)

def bindings():
    """The cuBLASLt bindings of the device (imported on first use): nvmath.bindings.cublasLt on a
    GPU, llmc/emulator/cublaslt.py (the same calls on host memory) on the emulated device."""
    return cuda.library("cublaslt")


def unavailable_reason():
    """None if nvmath-python imports and loads a cuBLASLt with the epilogues we use, else one line
    saying what is missing: nvmath-python, or the dependency it lacks (its metadata's cuda-core,
    cuda-bindings, cuda-pathfinder: neither torch nor CuPy brings cuda-core), the library (or the
    CUDA driver), or the version."""
    import importlib.util
    dependencies = {"cuda-core": "cuda.core", "cuda-bindings": "cuda.bindings", "cuda-pathfinder": "cuda.pathfinder"}

    def present(module):
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):      # a parent package missing, or one in sys.modules without a spec
            return False
    try:
        lt = bindings()
    except ImportError as e:
        if not present("nvmath"):
            return f"nvmath-python is not installed ({e}): pip install \"{NVMATH_PIP_PACKAGE}\" (optional, GPU only)"
        missing = [name for name, module in dependencies.items() if not present(module)]
        if missing:
            return (f"nvmath-python is installed but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                    f"missing ({e}): pip install {' '.join(missing)} (a machine without network: make gpu-wheels)")
        return f"nvmath-python fails to import: {type(e).__name__}: {e}".splitlines()[0]
    except Exception as e:                 # installed but broken, e.g. a cuda-bindings it does not support
        return f"nvmath-python fails to import: {type(e).__name__}: {e}".splitlines()[0]
    try:
        version = int(lt.get_version())
    except Exception as e:                 # nvmath raises when libcublasLt or the driver cannot be loaded
        message = f"{type(e).__name__}: {e}".splitlines()[0]
        return f"cuBLASLt is not loadable through nvmath-python: {message}"
    if version < MIN_CUBLASLT_VERSION:
        return f"cuBLASLt {version} is older than {MIN_CUBLASLT_VERSION} (CUDA 11.8), the first with DGELU and BGRADB"
    return None


# ----------------------------------------------------------------------------
# which epilogue a layer needs (pure)

Epilogue = namedtuple("Epilogue", "code name bias aux")
Epilogue.__doc__ = """A cuBLASLt epilogue and the extra arguments it takes.
code: cublasLtEpilogue_t value. bias: None, "add" (BIAS_POINTER is read: one value per row of D)
or "grad" (BIAS_POINTER is written: BGRADB's sums of op(B) over k, one per column of D, or
DGELU_BGRAD's sums of each row of D). aux: None,
"write" (the GELU input is stored at EPILOGUE_AUX_POINTER) or "read" (it is read there for gelu')."""


def epilogue_for(has_bias, gelu, backward, bgrad=False):
    """The epilogue a linear layer's product needs:
        forward (backward=False): has_bias adds the bias, gelu applies GELU and stores its input
        backward, dinp product:   gelu multiplies by gelu'(the stored input) (DGELU); with bgrad
                                  also sums each row of D, dinp^T, into a bias gradient
                                  (DGELU_BGRAD: the fc layer's, whose output the GELU took)
        backward, dweight product: bgrad also sums op(B) = dout over rows into the bias gradient
    Raises ValueError for what no layer here needs: a bias added in a backward product, or a bias
    gradient in a forward one."""
    if not backward:
        require(not bgrad, "a bias gradient (BGRAD) belongs to a backward product")
        if gelu:
            code = EPILOGUE_GELU_AUX_BIAS if has_bias else EPILOGUE_GELU_AUX
            return Epilogue(code, EPILOGUE_NAMES[code], "add" if has_bias else None, "write")
        code = EPILOGUE_BIAS if has_bias else EPILOGUE_DEFAULT
        return Epilogue(code, EPILOGUE_NAMES[code], "add" if has_bias else None, None)
    require(not has_bias, "a backward product adds no bias (pass bgrad=True for the bias gradient)")
    if gelu:
        return Epilogue(EPILOGUE_DGELU_BGRAD, "DGELU_BGRAD", "grad", "read") if bgrad else \
            Epilogue(EPILOGUE_DGELU, "DGELU", None, "read")
    if bgrad:
        return Epilogue(EPILOGUE_BGRADB, "BGRADB", "grad", None)
    return Epilogue(EPILOGUE_DEFAULT, "DEFAULT", None, None)


NO_EPILOGUE = epilogue_for(False, False, False)


# ----------------------------------------------------------------------------
# the handle, the workspace and the cached plans

_CONTEXT = {}      # "handle": cublasLtHandle_t, "workspace": CuPy uint8 array of WORKSPACE_BYTES
_PLANS = {}        # (precision, compute type, m, n, k, transa, transb, epilogue code) -> Plan
_BGRAD = {}        # (precision, OC) -> floatX scratch that BGRADB writes the bias gradient into


class Plan:
    """One cached product: its matmul descriptor, the layouts of A, B, C and D (C's is D's: C is D
    itself, or a residual of D's shape), and the algorithm it runs (`heuristic`: one
    cublasLtMatmulHeuristicResult_t held in a NumPy array; None until the first call, `unsupported`
    says why when there is none). autotune: how many of the heuristic's algorithms to ask for;
    `candidates` holds those it returned (the first is its choice), `timings_ms` each one's time
    per call once timed (inf where a trial failed; [] where the plan was first used inside a graph
    capture and never timed), `chosen` the index of the one kept."""

    def __init__(self, desc, layouts, autotune=HEURISTIC_ALGORITHMS):
        self.desc, self.layouts, self.autotune = desc, layouts, autotune
        self.heuristic = None
        self.unsupported = None
        self.candidates = None
        self.timings_ms = None
        self.chosen = 0


def _set_attribute(setter, obj, attr, value, dtypes):
    """Call a cublasLt*SetAttribute binding with `value` in the attribute's C type (a host buffer)."""
    buf = np.array(value, dtype=dtypes[attr])
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


def _context():
    """The process's cuBLASLt handle and workspace, created on first use."""
    if not _CONTEXT:
        _CONTEXT["handle"] = bindings().create()
        _CONTEXT["workspace"] = cuda.cupy().empty(WORKSPACE_BYTES, dtype=np.uint8)
    return _CONTEXT["handle"], _CONTEXT["workspace"]


def stored_shape(rows, cols, trans):
    """(rows, cols, ld) of a column-major operand as stored, when the product uses the (rows, cols)
    matrix op(X): X itself (ld = rows), or, with trans, its transpose (stored cols x rows, ld = cols).
    Our operands are contiguous, so ld is always the stored row count."""
    return (cols, rows, cols) if trans == CUBLAS_OP_T else (rows, cols, rows)


def _plan(precision, m, n, k, transa, transb, epilogue, tf32, autotune=HEURISTIC_ALGORITHMS):
    """The cached Plan of D (m,n) = op(A) (m,k) @ op(B) (k,n) with `epilogue`, built on first use;
    tf32: fp32 inputs rounded to TF32 (llmc.cuda.compute_type, as llmc.cuda.gemm); autotune: how
    many of the heuristic's algorithms it times (a plan of its own per count)."""
    compute = cuda.compute_type(precision, tf32)
    key = (precision, compute, m, n, k, transa, transb, epilogue.code, autotune)
    if key not in _PLANS:
        lt = bindings()
        data_type = CUBLAS_DATA_TYPES[precision]
        desc = lt.matmul_desc_create(compute, CUDA_R_32F)                  # scale type: fp32 alpha, beta
        setter = lt.matmul_desc_set_attribute
        _set_attribute(setter, desc, DESC_TRANSA, transa, DESC_ATTRIBUTE_DTYPES)
        _set_attribute(setter, desc, DESC_TRANSB, transb, DESC_ATTRIBUTE_DTYPES)
        _set_attribute(setter, desc, DESC_EPILOGUE, epilogue.code, DESC_ATTRIBUTE_DTYPES)
        if epilogue.bias:
            _set_attribute(setter, desc, DESC_BIAS_DATA_TYPE, data_type, DESC_ATTRIBUTE_DTYPES)
        if epilogue.aux:
            _set_attribute(setter, desc, DESC_EPILOGUE_AUX_LD, m, DESC_ATTRIBUTE_DTYPES)   # aux is (m,n) like D
        layouts = (lt.matrix_layout_create(data_type, *stored_shape(m, k, transa)),      # A
                   lt.matrix_layout_create(data_type, *stored_shape(k, n, transb)),      # B
                   lt.matrix_layout_create(data_type, m, n, m),                          # C
                   lt.matrix_layout_create(data_type, m, n, m))                          # D
        _PLANS[key] = Plan(desc, layouts, autotune)
    return _PLANS[key]


def _choose_algorithm(plan):
    """Ask cuBLASLt's heuristic for the plan's algorithms, once: up to plan.autotune of them,
    within our workspace and for 16-byte aligned pointers. Sets plan.candidates and plan.heuristic
    (the first), or plan.unsupported (why there is none)."""
    lt = bindings()
    handle, _ = _context()
    pref = lt.matmul_preference_create()
    try:
        setter = lt.matmul_preference_set_attribute
        _set_attribute(setter, pref, PREF_MAX_WORKSPACE_BYTES, WORKSPACE_BYTES, PREF_ATTRIBUTE_DTYPES)
        for attr in (PREF_MIN_ALIGNMENT_A_BYTES, PREF_MIN_ALIGNMENT_B_BYTES, PREF_MIN_ALIGNMENT_C_BYTES,
                     PREF_MIN_ALIGNMENT_D_BYTES):
            _set_attribute(setter, pref, attr, MIN_ALIGNMENT_BYTES, PREF_ATTRIBUTE_DTYPES)
        result = np.zeros(plan.autotune, dtype=lt.matmul_heuristic_result_dtype)
        count = np.zeros(1, dtype=np.int32)
        try:
            lt.matmul_algo_get_heuristic(handle, plan.desc, *plan.layouts, pref, plan.autotune,
                                         result.ctypes.data, count.ctypes.data)
        except lt.cuBLASLtError as e:      # CUBLAS_STATUS_NOT_SUPPORTED: no algorithm for this configuration
            plan.unsupported = f"cublasLtMatmulAlgoGetHeuristic: {e}"
            return
    finally:
        lt.matmul_preference_destroy(pref)
    returned = result[:max(0, int(count[0]))]
    usable = returned[returned["state"] == CUBLAS_STATUS_SUCCESS]
    if len(usable) < 1:
        plan.unsupported = "cublasLtMatmulAlgoGetHeuristic returned no algorithm"
    else:
        plan.candidates = usable.copy()
        plan.heuristic = plan.candidates[:1].copy()


def _autotune(plan, product, d, d_read):
    """Time each of plan.candidates through `product(algo)` (one cuBLASLt call with that
    cublasLtMatmulHeuristicResult_t) and keep the fastest in plan.heuristic: one untimed call, then
    AUTOTUNE_REPEATS calls between two CUDA events on the current stream. A candidate whose call
    fails (cuBLASLtError) is skipped (inf). d: the product's D, saved first and restored after
    when d_read (the product reads D: an accumulation, or C is D), since every trial writes it."""
    cp = cuda.cupy()
    lt = bindings()
    saved = d.copy() if d_read else None
    timings = []
    for i in range(len(plan.candidates)):
        algo = plan.candidates[i:i + 1]
        try:
            product(algo)                                  # untimed: first-call costs
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(AUTOTUNE_REPEATS):
                product(algo)
            end.record()
            end.synchronize()
            timings.append(cp.cuda.get_elapsed_time(start, end) / AUTOTUNE_REPEATS)
        except lt.cuBLASLtError:
            timings.append(float("inf"))
    if saved is not None:
        d[...] = saved
    plan.timings_ms = timings
    plan.chosen = int(np.argmin(timings))
    plan.heuristic = plan.candidates[plan.chosen:plan.chosen + 1].copy()


def tuning_report():
    """One line per autotuned product (every cached plan that timed more than one algorithm): its
    shape m x n x k, op(A) and op(B) (N or T), epilogue, the time per call of the heuristic's first
    and of the one kept, and all the timings in the heuristic's order."""
    lines = []
    for (precision, _, m, n, k, transa, transb, code, _), plan in _PLANS.items():
        if plan.timings_ms:
            first, best = plan.timings_ms[0], plan.timings_ms[plan.chosen]
            ops = "".join("T" if op == CUBLAS_OP_T else "N" for op in (transa, transb))
            lines.append(f"{m}x{n}x{k} {ops} {EPILOGUE_NAMES.get(code, code)} {precision}: "
                         f"heuristic's first {first:.4f} ms, "
                         f"kept #{plan.chosen + 1} of {len(plan.timings_ms)} {best:.4f} ms "
                         f"({first / best:.3f}x); all: " + " ".join(f"{t:.4f}" for t in plan.timings_ms))
    return lines


def clear_cache():
    """Destroy every cached descriptor, layout and the handle, and drop the workspace and the bias
    scratch (tests; call it only while the GPU is idle)."""
    if _PLANS or _CONTEXT:
        lt = bindings()
        for plan in _PLANS.values():
            lt.matmul_desc_destroy(plan.desc)
            for layout in plan.layouts:
                lt.matrix_layout_destroy(layout)
        if "handle" in _CONTEXT:
            lt.destroy(_CONTEXT["handle"])
    _PLANS.clear()
    _CONTEXT.clear()
    _BGRAD.clear()


# ----------------------------------------------------------------------------
# one product (llm.c's matmul_cublaslt)

def matmul_cublaslt(d, a, b, m, n, k, transa, transb, epilogue=NO_EPILOGUE, bias=None, aux=None,
                    accumulate=False, tf32=False, c=None, autotune=HEURISTIC_ALGORITHMS):
    """Library call: D (m,n) = epilogue(op(A) (m,k) @ op(B) (k,n) [+ C]), column-major, on the
    trainer's current CuPy stream. C is D itself with accumulate (in place), or `c`, another
    (m,n) matrix of D's layout (out of place: D = op(A) op(B) + c, the bias, if any, added too:
    cuBLASLt applies the epilogue to alpha op(A) op(B) + beta C); d, a, b, c, bias, aux: floatX
    arrays of one precision (CuPy, or host arrays on the emulated device), contiguous, 16-byte
    aligned (the callers check); `epilogue` from epilogue_for, with `bias` given iff epilogue.bias
    and `aux` ((m,n), ld m) iff epilogue.aux. alpha = 1, beta = 1 if accumulate or c is given else
    0 (beta scales C only, never the bias gradient); tf32: fp32 inputs rounded to TF32; autotune:
    how many of the heuristic's algorithms the first call times (the module docstring: 1 takes its
    first). Raises CublasLtUnsupported when cuBLASLt has no algorithm, ValueError on misuse."""
    require(not (accumulate and c is not None), "accumulate (C = D) and another C are exclusive")
    require((bias is not None) == (epilogue.bias is not None), f"{epilogue.name}: bias must be given iff it uses one")
    require((aux is not None) == (epilogue.aux is not None), f"{epilogue.name}: aux must be given iff it uses one")
    require(aux is None or m % AUX_LD_MULTIPLE == 0,
            f"{epilogue.name}: the GELU aux has leading dimension m={m}, which cuBLASLt needs to be a multiple of 8")
    require(1 <= autotune <= MAX_AUTOTUNE, f"autotune={autotune}: between 1 and {MAX_AUTOTUNE} algorithms")
    lt = bindings()
    precision = cuda.precision_of(d)
    plan = _plan(precision, m, n, k, transa, transb, epilogue, tf32, autotune)
    setter = lt.matmul_desc_set_attribute
    if bias is not None:                   # the pointers change per call; the rest of the descriptor does not
        _set_attribute(setter, plan.desc, DESC_BIAS_POINTER, cuda.address(bias), DESC_ATTRIBUTE_DTYPES)
    if aux is not None:
        _set_attribute(setter, plan.desc, DESC_EPILOGUE_AUX_POINTER, cuda.address(aux), DESC_ATTRIBUTE_DTYPES)
    if plan.heuristic is None and plan.unsupported is None:
        _choose_algorithm(plan)            # after the pointers: cuBLASLt checks that an epilogue's are set
    if plan.unsupported:
        raise CublasLtUnsupported(f"{epilogue.name} m={m} n={n} k={k} {precision}: {plan.unsupported}")
    handle, workspace = _context()
    alpha = np.ones(1, np.float32)                                       # host scalars (pointer mode host)
    beta = np.full(1, 1.0 if accumulate or c is not None else 0.0, np.float32)
    stream = cuda.cupy().cuda.get_current_stream()
    layout_a, layout_b, layout_c, layout_d = plan.layouts

    def product(algo):
        lt.matmul(handle, plan.desc, alpha.ctypes.data, cuda.address(a), layout_a, cuda.address(b), layout_b,
                  beta.ctypes.data, cuda.address(d if c is None else c), layout_c, cuda.address(d), layout_d,
                  algo.ctypes.data,                # the struct starts with its cublasLtMatmulAlgo_t
                  cuda.address(workspace), WORKSPACE_BYTES, stream.ptr)

    if plan.timings_ms is None and len(plan.candidates) > 1:
        if stream.is_capturing():
            plan.timings_ms = []                   # recorded, not run: nothing to time; keep the first
        else:
            _autotune(plan, product, d, d_read=accumulate or (c is not None and cuda.address(c) == cuda.address(d)))
    product(plan.heuristic)


# ----------------------------------------------------------------------------
# the linear layer (llmc.matmul.matmul_forward / matmul_backward, fused)

def matmul_forward_lt(out, inp, weight, bias, B, T, C, OC, pre_gelu=None, tf32=False, residual=None,
                      autotune=HEURISTIC_ALGORITHMS):
    """out (B,T,OC) = inp (B,T,C) @ weight^T + bias; weight (OC,C) (nn.Linear layout), bias (OC,)
    or None. With pre_gelu (B,T,OC) given: pre_gelu = inp @ weight^T + bias and out = gelu(pre_gelu),
    in the same call (the MLP's fc layer). With residual (B,T,OC) given instead: out = inp @ weight^T
    + bias + residual (the attention and MLP output projections adding into the residual stream:
    cuBLASLt's C input with beta = 1; out may be residual itself, in place). floatX arrays of one
    precision, contiguous, 16-byte aligned.
    Column-major: out^T (OC,N) = weight (OC,C) @ inp^T (C,N). weight's memory is the column-major
    (C,OC) matrix weight^T, so op(A) = T; inp's memory is already inp^T, op(B) = N. The bias has one
    value per row of out^T (per output channel), broadcast over its N columns (the tokens), which is
    exactly the epilogue's broadcast; the aux (pre_gelu) and the residual are (OC,N) with ld OC, like
    out^T. tf32: fp32 inputs rounded to TF32; autotune as in matmul_cublaslt."""
    N = B * T
    floatX = [("out", out, N * OC), ("inp", inp, N * C), ("weight", weight, OC * C)]
    floatX += [("bias", bias, OC)] if bias is not None else []
    floatX += [("pre_gelu", pre_gelu, N * OC)] if pre_gelu is not None else []
    floatX += [("residual", residual, N * OC)] if residual is not None else []
    check_launch("matmul_forward_lt", floatX, aligned=True)
    require(pre_gelu is None or residual is None, "matmul_forward_lt: GELU and a residual in one product: no layer has it")
    epilogue = epilogue_for(bias is not None, pre_gelu is not None, backward=False)
    matmul_cublaslt(out, weight, inp, OC, N, C, CUBLAS_OP_T, CUBLAS_OP_N, epilogue, bias=bias, aux=pre_gelu, tf32=tf32,
                    c=residual, autotune=autotune)


def matmul_backward_lt(dinp, dweight, dbias, dout, inp, weight, B, T, C, OC, pre_gelu=None, tf32=False,
                       autotune=HEURISTIC_ALGORITHMS, bias_grad_epilogue=True, pre_gelu_dbias=None,
                       bias_grads_zero=False):
    """Backward of out = inp @ weight^T + bias (shapes as matmul_forward_lt). Writes dinp (B,T,C);
    accumulates dweight (OC,C); accumulates dbias (OC,) when it can (see the return value).
    With pre_gelu (B,T,C) given, inp was gelu(pre_gelu) (the fcproj layer) and dinp is the gradient
    of pre_gelu instead: dinp = (dout @ weight) * gelu'(pre_gelu), the DGELU epilogue.
        dinp     = dout @ weight    column-major: dinp^T (C,N) = weight^T (C,OC) @ dout^T (OC,N), both as stored
        dweight += dout^T @ inp     column-major: dweight^T (C,OC) = inp^T (C,N) @ dout (N,OC), op(B) = T
        dbias   += sum over rows of dout: BGRADB on the dweight product sums op(B) = dout (N,OC) over
                   k = N, one value per column of dweight^T (per output channel)
    With pre_gelu_dbias (C,) given too (the fc layer's bias gradient), the dinp product also sums
    its rows into it: pre_gelu_dbias += column sums of dinp (DGELU_BGRAD: dinp^T's rows), the
    gradient of the bias that pre_gelu = inp_fc @ w_fc^T + b_fc included. Raises CublasLtUnsupported,
    before anything is written, where cuBLASLt has no DGELU_BGRAD algorithm for the shape.
    Returns True when dbias was accumulated here, False when the caller must do it (dbias is None,
    bias_grad_epilogue is False, or cuBLASLt has no BGRADB algorithm for this shape; dweight is then
    still accumulated, by a plain product). tf32 and autotune as in matmul_forward_lt.
    bias_grads_zero: the caller knows dbias and pre_gelu_dbias hold 0 (the step's first micro-batch,
    just after zero_grad): the epilogue then writes its column sums straight into them, 0 + x = x
    bit for bit, and the scratch's accumulate launch is skipped (PyTorch's first backward, too,
    writes .grad where later ones add to it)."""
    N = B * T
    floatX = [("dinp", dinp, N * C), ("dweight", dweight, OC * C), ("dout", dout, N * OC), ("inp", inp, N * C),
              ("weight", weight, OC * C)]
    floatX += [("dbias", dbias, OC)] if dbias is not None else []
    floatX += [("pre_gelu", pre_gelu, N * C)] if pre_gelu is not None else []
    floatX += [("pre_gelu_dbias", pre_gelu_dbias, C)] if pre_gelu_dbias is not None else []
    precision = check_launch("matmul_backward_lt", floatX, aligned=True)
    require(pre_gelu_dbias is None or pre_gelu is not None, "matmul_backward_lt: pre_gelu_dbias without pre_gelu")
    epilogue = epilogue_for(False, pre_gelu is not None, backward=True, bgrad=pre_gelu_dbias is not None)
    # where the gradient holds 0 the epilogue writes it directly, else into the scratch, then added
    pre_bgrad = None if pre_gelu_dbias is None else pre_gelu_dbias if bias_grads_zero else _bgrad_scratch(precision, C)
    matmul_cublaslt(dinp, weight, dout, C, N, OC, CUBLAS_OP_N, CUBLAS_OP_N, epilogue, bias=pre_bgrad, aux=pre_gelu,
                    tf32=tf32, autotune=autotune)
    if pre_gelu_dbias is not None and not bias_grads_zero:
        _accumulate(pre_gelu_dbias, pre_bgrad, C, precision)
    if dbias is not None and bias_grad_epilogue:
        bgrad = dbias if bias_grads_zero else _bgrad_scratch(precision, OC)
        try:
            matmul_cublaslt(dweight, inp, dout, C, OC, N, CUBLAS_OP_N, CUBLAS_OP_T,
                            epilogue_for(False, False, backward=True, bgrad=True), bias=bgrad, accumulate=True,
                            tf32=tf32, autotune=autotune)
        except CublasLtUnsupported:
            pass                           # the plain product below; the caller sums dbias
        else:
            if not bias_grads_zero:
                _accumulate(dbias, bgrad, OC, precision)
            return True
    matmul_cublaslt(dweight, inp, dout, C, OC, N, CUBLAS_OP_N, CUBLAS_OP_T, accumulate=True, tf32=tf32,
                    autotune=autotune)
    return False


def _bgrad_scratch(precision, OC):
    """The floatX (OC,) vector BGRADB writes into, allocated once per (precision, OC)."""
    key = (precision, OC)
    if key not in _BGRAD:
        _BGRAD[key] = cuda.cupy().empty(OC, dtype=cuda.FLOATX_DTYPES[precision])
    return _BGRAD[key]


def _accumulate(dbias, bgrad, OC, precision):
    """dbias += bgrad, OC values: kernels/layernorm.cu residual_forward with out = inp1 = dbias
    (each thread reads its 16-byte group of both inputs before writing it, so the alias is safe)."""
    cuda.launch("layernorm", precision, "residual_forward", elementwise_grid(ceil_div(OC, vector_size(precision))),
                BLOCK_SIZE, (dbias, dbias, bgrad, np.uint64(OC)))
