"""
llmc/emulator/cudnn.py: cuDNN's fused attention for the emulated CUDA device, the subset of the
cuDNN frontend Python package (module `cudnn`, nvidia-cudnn-frontend 1.32's keyword names) that
llmc/cudnn_attention.py calls: pygraph, graph.tensor with dims and strides, sdpa (with the
softmax statistics), sdpa_backward, the build steps, get_workspace_size and execute with a
variant pack of integer pointers. llmc.cuda.library("cudnn") returns this module on the
emulated device and the real package on a GPU, so llmc/cudnn_attention.py runs unchanged on both.

The contract, as cuDNN's: each tensor is read or written at its variant-pack address, element
(i0, i1, i2, i3) of its dims at ptr + itemsize * sum(i * stride), in the data type the graph
declares for it (bf16 as its bits, fp16, fp32), so a wrong stride, pointer or offset reads or
writes the wrong elements, as on a GPU. q, k, v are (B,NH,T,HS), o and dO like q, stats
(B,NH,T,1). The math is gpt2_cpu's attention (imported, the one definition of it, in float64):
    forward   o = softmax(attn_scale q k^T + causal mask) v     gpt2_cpu.attention_forward
              stats = log sum_j exp(S_ij), S = attn_scale q k^T  (natural log, max included)
    backward  from the stats, as FlashAttention-2 does (Dao 2023, algorithm 2):
              P = exp(S - stats)                                 the softmax, recomputed
              dq, dk, dv = gpt2_cpu.attention_backward with att = P, plus the term its
              D = rowsum(dO * (P v)) misses when D is taken from the o passed in, as cuDNN does:
              D_cudnn = rowsum(dO * o), dS += P (D - D_cudnn)
gpt2_cpu's attention scales by 1/sqrt(HS); another attn_scale is passed to it by scaling q.
Each output is rounded once from float64 to its declared type (bf16: nearest even).

What it deliberately is not: cuDNN's tiling, engines, or summation order (no heuristics: every
supported graph has PLANS ranked "plans", which all compute the same way with no workspace, enough
for llmc/cudnn_attention.py's autotuning to time each through the frontend's at-index calls and
select one), and only the graphs llmc/cudnn_attention.py
builds: one sdpa or sdpa_backward node, causal mask (top-left diagonal, right bound 0), T_q =
T_kv, fp16/bf16 q, k, v, o, no dropout, bias, padding, paged caches or GQA; anything else
raises cudnnGraphNotSupportedError from validate(), as cuDNN does for what it does not support.

Run its tests: python -m pytest -q tests/test_vendor_emulation.py -k cudnn
Legend: B batch, T time, NH heads, HS head size, C = NH * HS.
"""

import collections
import ctypes
import enum
import itertools
import math

import numpy as np

from llmc.emulator.device import enqueue, stream_at
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

__version__ = "1.32.0"                   # the frontend whose Python signatures this follows
BACKEND_VERSION = 91300                  # cudnnGetVersion() of the cuDNN whose SDPA this follows (9.13.0)
MAX_HEAD_SIZE = 256                      # cuDNN's SDPA: head sizes up to 256 (Hopper), multiples of 8
HEAD_SIZE_MULTIPLE = 8


class data_type(enum.Enum):              # noqa: N801 (the frontend's name)
    FLOAT = "float"
    HALF = "half"
    BFLOAT16 = "bfloat16"


class heur_mode(enum.Enum):              # noqa: N801
    A = "a"
    B = "b"
    FALLBACK = "fallback"


class diagonal_alignment(enum.Enum):     # noqa: N801
    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


STORAGE = {data_type.FLOAT: np.dtype(np.float32), data_type.HALF: np.dtype(np.float16),
           data_type.BFLOAT16: np.dtype(np.uint16)}                       # bf16 as its bit patterns
PLANS = 2                                # the ranked plans every supported graph has (they compute alike)
BUILD_STEPS = ("validate", "build_operation_graph", "create_execution_plans", "check_support", "build_plans")


class cudnnGraphNotSupportedError(RuntimeError):     # noqa: N801
    """The graph is one this cuDNN (here: the emulation) does not support."""


def backend_version():
    return BACKEND_VERSION


# ----------------------------------------------------------------------------
# handles and tensors

_HANDLES = itertools.count(0x2000)


class Handle:
    """A cuDNN handle: which stream its graphs execute on (a cudaStream_t; 0, the legacy stream,
    until set_stream). Execution is issued there: run at once, or recorded while it captures."""

    def __init__(self):
        self.id, self.stream = next(_HANDLES), 0


def create_handle():
    return Handle()


def destroy_handle(handle):
    handle.stream = None


def set_stream(handle, stream):
    handle.stream = int(stream)


class tensor:                            # noqa: N801 (the frontend's name)
    """A graph tensor: name, dims, strides (in elements) and data type; outputs are marked."""

    def __init__(self, name, dim=None, stride=None, data_type=None):
        self.name, self.output = name, False
        self.dim = None if dim is None else [int(d) for d in dim]
        self.stride = None if stride is None else [int(s) for s in stride]
        self.data_type = data_type

    def set_output(self, value):
        self.output = bool(value)
        return self

    def set_dim(self, dim):
        self.dim = [int(d) for d in dim]
        return self

    def set_stride(self, stride):
        self.stride = [int(s) for s in stride]
        return self

    def set_data_type(self, value):
        self.data_type = value
        return self

    def get_name(self):
        return self.name

    def get_dim(self):
        return list(self.dim)

    def get_stride(self):
        return list(self.stride)

    def get_data_type(self):
        return self.data_type


def _packed_strides(dim):
    """Strides of a contiguous tensor of these dims (the frontend's default for outputs)."""
    strides = [1] * len(dim)
    for i in range(len(dim) - 2, -1, -1):
        strides[i] = strides[i + 1] * dim[i + 1]
    return strides


def _view(ptr, t):
    """The host memory of tensor t at address ptr as a writable strided NumPy view of its storage
    dtype: element i at ptr + itemsize * (i @ stride)."""
    dtype = STORAGE[t.data_type]
    span = 1 + sum((d - 1) * s for d, s in zip(t.dim, t.stride))            # elements first to last
    if not ptr:
        raise RuntimeError(f"cuDNN: {t.name}: null pointer in the variant pack")
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * (span * dtype.itemsize)).from_address(ptr)).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, shape=tuple(t.dim), strides=tuple(s * dtype.itemsize for s in t.stride))


def _load(view):
    """Stored values -> float64, exactly."""
    return (bfloat16_bits_to_float32(view) if view.dtype == np.uint16 else view).astype(np.float64)


def _store(view, values):
    """float64 values rounded once to the view's type (bf16: to float32, then nearest even)."""
    if view.dtype == np.uint16:
        view[...] = float32_to_bfloat16_bits(np.asarray(values, np.float32))
    else:
        view[...] = np.asarray(values, view.dtype)


# ----------------------------------------------------------------------------
# the graph

class pygraph:                           # noqa: N801 (the frontend's name)
    """An operation graph of one sdpa or sdpa_backward node. Attributes (read by the tests):
    types (io, intermediate, compute data types), handle, op ("sdpa" / "sdpa_backward"), params
    (the node's options), inputs and outputs (name -> tensor), steps (the build steps run, in
    order; each needs the one before, and execute needs them all)."""

    def __init__(self, io_data_type=None, intermediate_data_type=None, compute_data_type=None, handle=None,
                 name=""):
        self.types = (io_data_type, intermediate_data_type, compute_data_type)
        self.handle, self.name = handle, name
        self.op, self.params, self.inputs, self.outputs, self.steps = None, {}, {}, {}, []
        self.selected = 0                # the plan execute() runs: the first that builds, or build_plan_at_index's
        self.built = set()               # the plan indices built
        self.executed = collections.Counter()   # plan index -> how many times it ran

    def tensor(self, name, dim, stride, data_type=None):
        return tensor(name, dim, stride, data_type if data_type is not None else self.types[0])

    def _output(self, name, like, dim=None, data_type=None):
        dim = list(like.dim if dim is None else dim)
        return tensor(name, dim, _packed_strides(dim), data_type or self.types[0])

    def _node(self, op):
        if self.op is not None:
            raise cudnnGraphNotSupportedError(f"the emulation takes one node per graph, not {self.op} and {op}")
        self.op = op

    def sdpa(self, q, k, v, attn_scale=None, generate_stats=None, is_inference=None, use_causal_mask=False,
             diagonal_alignment=diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=None, name=""):
        """Scaled dot product attention: returns [o, stats] (stats None unless generate_stats, or
        is_inference=False in the older form)."""
        self._node("sdpa")
        stats = bool(generate_stats) if generate_stats is not None else is_inference is False
        self.params = dict(attn_scale=attn_scale, generate_stats=stats, use_causal_mask=use_causal_mask,
                           diagonal_alignment=diagonal_alignment, diagonal_band_right_bound=diagonal_band_right_bound)
        self.inputs = dict(Q=q, K=k, V=v)
        o = self._output(f"{name}::O", q, dim=q.dim[:-1] + v.dim[-1:])
        s = self._output(f"{name}::Stats", q, dim=q.dim[:-1] + [1], data_type=self.types[1]) if stats else None
        self.outputs = dict(O=o, Stats=s)                                    # Stats None for inference
        return [o, s]

    def sdpa_backward(self, q, k, v, o, dO, stats, attn_scale=None, use_causal_mask=False,  # noqa: N803
                      diagonal_alignment=diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=None,
                      use_deterministic_algorithm=False, name=""):
        """The backward of sdpa from the forward's q, k, v, o, stats and dO: returns [dq, dk, dv],
        each shaped (and by default strided) like its input."""
        self._node("sdpa_backward")
        self.params = dict(attn_scale=attn_scale, use_causal_mask=use_causal_mask,
                           diagonal_alignment=diagonal_alignment, diagonal_band_right_bound=diagonal_band_right_bound,
                           use_deterministic_algorithm=use_deterministic_algorithm)
        self.inputs = dict(Q=q, K=k, V=v, O=o, dO=dO, Stats=stats)
        grads = [tensor(f"{name}::d{x.name}", x.dim, x.stride, self.types[0]) for x in (q, k, v)]
        self.outputs = dict(zip(("dQ", "dK", "dV"), grads))
        return grads

    def tensors(self):
        """Every tensor of the graph by its role (Q, K, V, O, Stats, dO, dQ, dK, dV): inputs, then outputs."""
        return {key: t for key, t in {**self.inputs, **self.outputs}.items() if t is not None}

    # the build steps, in cuDNN's order

    def _step(self, step):
        done = len(self.steps)
        if done >= len(BUILD_STEPS) or BUILD_STEPS[done] != step:
            raise RuntimeError(f"cuDNN: {step} called after {self.steps or 'nothing'} (the order is {BUILD_STEPS})")
        self.steps.append(step)

    def validate(self):
        """Raises cudnnGraphNotSupportedError for a graph outside the emulated subset."""
        self._step("validate")
        if self.op is None:
            raise cudnnGraphNotSupportedError("empty graph")
        tensors = self.tensors()
        for key, t in tensors.items():
            if t.dim is None or t.stride is None or len(t.dim) != 4 or len(t.stride) != 4 or t.data_type not in STORAGE:
                raise cudnnGraphNotSupportedError(f"{key}: needs 4 dims, 4 strides and a data type")
        q, k, v = self.inputs["Q"].dim, self.inputs["K"].dim, self.inputs["V"].dim
        B, NH, T, HS = q
        if k != q or v != q or any(tensors[n].dim != q for n in ("O", "dO", "dQ", "dK", "dV") if n in tensors):
            raise cudnnGraphNotSupportedError(f"q, k, v, o and their gradients must share dims; q {q}, k {k}, v {v}")
        if "Stats" in tensors and tensors["Stats"].dim != [B, NH, T, 1]:
            raise cudnnGraphNotSupportedError(f"Stats dims {tensors['Stats'].dim}, expected {[B, NH, T, 1]}")
        if HS % HEAD_SIZE_MULTIPLE or not 0 < HS <= MAX_HEAD_SIZE:
            raise cudnnGraphNotSupportedError(f"head size {HS}: a multiple of {HEAD_SIZE_MULTIPLE} up to {MAX_HEAD_SIZE}")
        for key, t in tensors.items():
            if key != "Stats" and (t.data_type not in (data_type.BFLOAT16, data_type.HALF) or t.stride[-1] != 1):
                raise cudnnGraphNotSupportedError(f"{key}: fused attention takes fp16/bf16 with a unit last stride")
        causal = self.params["use_causal_mask"] or (self.params["diagonal_band_right_bound"] == 0)
        if not causal or self.params["diagonal_alignment"] != diagonal_alignment.TOP_LEFT:
            raise cudnnGraphNotSupportedError("the emulation supports the causal mask (top-left, right bound 0) only")

    def build_operation_graph(self):
        self._step("build_operation_graph")

    def create_execution_plans(self, modes):
        self._step("create_execution_plans")
        if not modes:
            raise cudnnGraphNotSupportedError("no heuristic mode")

    def check_support(self):
        self._step("check_support")

    def build_plans(self, *policy):
        """Build the first plan of the ranked list and select it (the frontend's default policy)."""
        self._step("build_plans")
        self.built.add(0)
        self.selected = 0

    def get_workspace_size(self):
        """Bytes of workspace the plan needs: none, the emulation keeps no scratch on the device."""
        return 0

    # the ranked plans by index (the frontend's autotuning calls)

    def _plan_index(self, index):
        if "create_execution_plans" not in self.steps:
            raise RuntimeError("cuDNN: no plans before create_execution_plans")
        if not 0 <= index < PLANS:
            raise IndexError(f"plan index {index} out of range for {PLANS} plan(s)")
        return index

    def get_execution_plan_count(self):
        return PLANS if "create_execution_plans" in self.steps else 0

    def get_plan_name_at_index(self, index):
        return f"emulated_sdpa_plan_{self._plan_index(index)}"

    def build_plan_at_index(self, index):
        """Build the plan at `index` and select it: execute() runs it from now on."""
        self.built.add(self._plan_index(index))
        self.selected = index
        return self

    def get_workspace_size_plan_at_index(self, index, handle=None, *overrides):
        self._plan_index(index)
        return 0

    def execute_plan_at_index(self, variant_pack, workspace=None, index=0, handle=None):
        """Run the plan at `index` (built first), leaving the selection as it is."""
        if self._plan_index(index) not in self.built:
            raise RuntimeError(f"cuDNN: plan {index} executed before it was built")
        self._run(variant_pack, index, handle)

    # execution

    def execute(self, variant_pack, workspace, handle=None):
        """Issue the built graph on the stream of `handle` (default: the graph's own handle), as
        cuDNN does: it runs at once, or, while that stream captures, it is recorded with the
        variant pack's pointers and runs at each replay on the data there then (a CUDA graph
        holds pointers, not values). variant_pack maps each of the graph's tensors to an integer
        host address. Raises RuntimeError before the graph is built or when a tensor has no
        pointer; CUDARuntimeError for a stream that is not live."""
        if self.steps != list(BUILD_STEPS):
            raise RuntimeError(f"cuDNN: execute before the plans are built (steps run: {self.steps})")
        self._run(variant_pack, self.selected, handle)

    def _run(self, variant_pack, index, handle):
        """Issue plan `index` (they all compute alike) with the variant pack's pointers."""
        self.executed[index] += 1
        tensors = self.tensors()
        missing = [key for key, t in tensors.items() if t not in variant_pack]
        if missing:
            raise RuntimeError(f"cuDNN: no pointer in the variant pack for {missing}")
        views = {key: _view(int(variant_pack[t]), t) for key, t in tensors.items()}
        scale = self.params["attn_scale"] if self.params["attn_scale"] is not None else 1.0
        run = _sdpa_forward if self.op == "sdpa" else _sdpa_backward
        handle = handle if handle is not None else self.handle
        enqueue(lambda: run(views, scale), stream_at(handle.stream if handle is not None else 0))


# ----------------------------------------------------------------------------
# the math: gpt2_cpu's attention on the strided views

def _qkv(q, k, v, scale):
    """(B,T,3C) float64 [q | k | v] for gpt2_cpu from (B,NH,T,HS) views; q multiplied by
    scale * sqrt(HS), so that gpt2_cpu's 1/sqrt(HS) scaling gives attn_scale. Returns (qkv, that factor)."""
    B, NH, T, HS = q.shape
    factor = scale * math.sqrt(HS)
    heads = [_load(x) for x in (q, k, v)]
    heads[0] = heads[0] * factor
    return np.concatenate([h.transpose(0, 2, 1, 3).reshape(B, T, NH * HS) for h in heads], axis=-1), factor


def _heads(x, NH):
    """(B,T,C) -> (B,NH,T,HS)."""
    B, T, C = x.shape
    return x.reshape(B, T, NH, C // NH).transpose(0, 2, 1, 3)


def _log_sum_exp(att, q, k, scale):
    """stats (B,NH,T,1) from the softmax att (B,NH,T,T): att_ij = exp(S_ij - stats_i) for every
    unmasked j, so stats_i = S_ij - log att_ij, taken at the row's largest att (>= 1/T: no
    underflow), with S_ij = scale q_i . k_j."""
    j = att.argmax(axis=-1)[..., None]                                        # (B,NH,T,1)
    k_j = np.take_along_axis(k, np.broadcast_to(j, j.shape[:-1] + (k.shape[-1],)), axis=2)   # (B,NH,T,HS)
    S_ij = scale * (q * k_j).sum(axis=-1, keepdims=True)
    return S_ij - np.log(np.take_along_axis(att, j, axis=-1))


def _sdpa_forward(views, scale):
    import gpt2_cpu                                                           # the one attention of the project
    NH = views["Q"].shape[1]
    qkv, _ = _qkv(views["Q"], views["K"], views["V"], scale)
    out, att = gpt2_cpu.attention_forward(qkv, NH)                           # (B,T,C), (B,NH,T,T)
    if "Stats" in views:
        _store(views["Stats"], _log_sum_exp(att, _load(views["Q"]), _load(views["K"]), scale))
    _store(views["O"], _heads(out, NH))


def _sdpa_backward(views, scale):
    """dq, dk, dv from q, k, v, o, dO and the stats, cuDNN's way (module docstring)."""
    import gpt2_cpu
    q, k, v = (_load(views[n]) for n in ("Q", "K", "V"))                     # (B,NH,T,HS)
    B, NH, T, HS = q.shape
    qkv, factor = _qkv(views["Q"], views["K"], views["V"], scale)
    _, att = gpt2_cpu.attention_forward(qkv, NH)                             # the softmax, to get S - lse
    lse = _log_sum_exp(att, q, k, scale)                                      # (B,NH,T,1)
    P = att * np.exp(lse - _load(views["Stats"]))                             # = exp(S - stats): the stats as passed
    dO = _load(views["dO"])                                                   # (B,NH,T,HS)
    dout = dO.transpose(0, 2, 1, 3).reshape(B, T, NH * HS)
    dqkv = gpt2_cpu.attention_backward(dout, qkv, P, NH)                      # (B,T,3C), D = rowsum(dO * (P v))
    dq, dk, dv = (_heads(dqkv[..., j * NH * HS:(j + 1) * NH * HS], NH) for j in range(3))
    dq = dq * factor                                                          # q was scaled by factor
    # cuDNN's D is rowsum(dO * o) with the o passed in: dS gains P (D_gpt2_cpu - D_cudnn)
    delta = (dO * (P @ v - _load(views["O"]))).sum(axis=-1, keepdims=True)  # (B,NH,T,1)
    dS_extra = P * delta                                                      # (B,NH,T,T)
    dq = dq + scale * dS_extra @ k
    dk = dk + scale * dS_extra.swapaxes(-1, -2) @ q
    _store(views["dQ"], dq)
    _store(views["dK"], dk)
    _store(views["dV"], dv)
