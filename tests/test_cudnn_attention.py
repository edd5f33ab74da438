"""Tests of llmc/cudnn_attention.py, cuDNN fused attention through the cuDNN frontend package.

Part 1, no GPU (a fake `cudnn` module in sys.modules records every graph call; CuPy is replaced by
NumPy, so a "device pointer" is a host address):
- unavailable_reason: fp32, bad head sizes, the package missing, the frontend too old, the library
  not loadable, too old or a known-broken version, each with its one line; None when all is well;
- the graph: built once per (direction, B, T, NH, HS, training), reused, the build steps in order,
  bf16 io with fp32 compute, causal, attn_scale 1/sqrt(HS), stats only when training;
- the layouts: for every tensor handed to cuDNN (q, k, v, o, stats, dO, dq, dk, dv), the address
  that its declared dims/strides/dtype and its variant-pack pointer give element (b,h,t,s) equals
  the address NumPy indexing of our buffer gives (qkv[b, t, j*C + h*HS + s], out[b, t, h*HS + s],
  stats[b, h, t]), for every element;
- the workspace sized from get_workspace_size (grown, kept) and execution on the current stream;
  prepare() builds every graph of the run and allocates the largest workspace once; a replaced
  workspace is retired, never freed (a captured CUDA graph may point at it);
- a failing build is one InputError line naming the shape, with no chained traceback;
- end to end: a fake whose execute computes SDPA (the FlashAttention-2 forward and the backward
  from the statistics, in float64) straight from the declared strides at the passed pointers,
  against gpt2_cpu.attention_forward/attention_backward;
- where the real package imports (skipped otherwise): its pygraph takes our graph description
  (keyword names, dims, strides) through validate(), which needs neither a GPU nor the library.
Part 2, GPU (marked gpu; also skipped with unavailable_reason when cuDNN is missing): forward,
statistics and backward against gpt2_cpu at T = 64, 70, 1024 in bf16 (llmc.check's cuda_bf16
tolerances), on a non-default stream; the backward deterministic.
Run: pytest tests/test_cudnn_attention.py   (part 1: about a second)
"""

import ctypes
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import gpt2_cpu
import llmc.cuda
from llmc import cudnn_attention as ca
from llmc.check import TOLERANCES, check_against, check_tensor
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from llmc.utils import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STREAM_PTR = 0x5EED                      # the fake current stream's handle
BF16, FLOAT = "BFLOAT16", "FLOAT"        # the fake cudnn.data_type members
ITEMSIZE = {BF16: 2, FLOAT: 4}


# ----------------------------------------------------------------------------
# the fake cudnn module: records the graph API calls (keyword names as in nvidia-cudnn-frontend
# 1.32's pygraph / backend_graph signatures), and optionally executes SDPA on host memory

class FakeGraphNotSupported(Exception):
    pass


class FakeTensor:
    def __init__(self, name, dim=None, stride=None, data_type=None):
        self.name, self.dim, self.stride, self.data_type, self.output = name, dim, stride, data_type, False

    def set_output(self, value):
        self.output = value
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, data_type):
        self.data_type = data_type
        return self


class FakeGraph:
    def __init__(self, fake, io_data_type, intermediate_data_type, compute_data_type, handle):
        self.fake = fake
        self.types = (io_data_type, intermediate_data_type, compute_data_type)
        self.handle = handle
        self.steps, self.op, self.params, self.executions = [], None, {}, []
        fake.graphs.append(self)

    def tensor(self, name, dim, stride, data_type):
        return FakeTensor(name, list(dim), list(stride), data_type)

    def sdpa(self, q, k, v, name, generate_stats, attn_scale, diagonal_alignment, diagonal_band_right_bound):
        self.op, self.inputs = "sdpa", dict(Q=q, K=k, V=v)
        self.params = dict(generate_stats=generate_stats, attn_scale=attn_scale, diagonal_alignment=diagonal_alignment,
                           diagonal_band_right_bound=diagonal_band_right_bound)
        self.outputs = dict(O=FakeTensor("O"), Stats=FakeTensor("Stats") if generate_stats else None)
        return [self.outputs["O"], self.outputs["Stats"]]

    def sdpa_backward(self, q, k, v, o, dO, stats, name, attn_scale, use_deterministic_algorithm,
                      diagonal_alignment, diagonal_band_right_bound):
        self.op, self.inputs = "sdpa_backward", dict(Q=q, K=k, V=v, O=o, dO=dO, Stats=stats)
        self.params = dict(attn_scale=attn_scale, use_deterministic_algorithm=use_deterministic_algorithm,
                           diagonal_alignment=diagonal_alignment, diagonal_band_right_bound=diagonal_band_right_bound)
        self.outputs = dict(dQ=FakeTensor("dQ"), dK=FakeTensor("dK"), dV=FakeTensor("dV"))
        return [self.outputs["dQ"], self.outputs["dK"], self.outputs["dV"]]

    def _step(self, name, *args):
        self.steps.append((name,) + args)
        if name == self.fake.fail_at:
            raise FakeGraphNotSupported("no engine supports this graph\nsecond line of the library's message")

    def validate(self):
        self._step("validate")

    def build_operation_graph(self):
        self._step("build_operation_graph")

    def create_execution_plans(self, modes):
        self._step("create_execution_plans", list(modes))

    def check_support(self):
        self._step("check_support")

    def build_plans(self):
        self._step("build_plans")

    def get_workspace_size(self):
        return self.fake.workspace_bytes[self.op]

    def execute(self, variant_pack, workspace, handle=None):
        assert all(type(p) is int for p in variant_pack.values()) and type(workspace) is int
        self.fake.calls.append(("execute", self, handle))
        self.executions.append((dict(variant_pack), workspace))
        if self.fake.emulate:
            emulate_sdpa(self, variant_pack)


def fake_cudnn_module(version="1.32.0", backend=91300):
    fake = types.ModuleType("cudnn")
    fake.__version__ = version
    fake.backend_version = backend if callable(backend) else (lambda: backend)
    fake.data_type = types.SimpleNamespace(BFLOAT16=BF16, FLOAT=FLOAT)
    fake.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
    fake.diagonal_alignment = types.SimpleNamespace(TOP_LEFT="TOP_LEFT", BOTTOM_RIGHT="BOTTOM_RIGHT")
    fake.cudnnGraphNotSupportedError = FakeGraphNotSupported
    fake.graphs, fake.calls, fake.handles, fake.buffers = [], [], [], []
    fake.fail_at, fake.emulate = None, False
    fake.workspace_bytes = {"sdpa": 3000, "sdpa_backward": 5000}

    def create_handle():
        fake.handles.append(object())
        return fake.handles[-1]

    fake.create_handle = create_handle
    fake.set_stream = lambda handle, stream: fake.calls.append(("set_stream", handle, stream))
    fake.pygraph = lambda **kwargs: FakeGraph(fake, **kwargs)
    return fake


@pytest.fixture
def fake_cudnn(monkeypatch):
    """The fake cudnn in sys.modules, empty caches, and NumPy in place of CuPy."""
    fake = fake_cudnn_module()
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(ca, "GRAPHS", {})
    monkeypatch.setattr(ca, "_RESOURCES", {})
    stream = types.SimpleNamespace(ptr=STREAM_PTR)
    cupy = types.SimpleNamespace(zeros=lambda shape, dtype=np.float32: np.zeros(shape, dtype),
                                 cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    monkeypatch.setattr(llmc.cuda, "cupy", lambda: cupy)
    return fake


# ----------------------------------------------------------------------------
# the emulated SDPA: reads and writes host memory exactly where the declared dims, strides and
# dtype of each tensor put it, after checking every access stays inside one of the test's buffers

def _address(arr):
    return arr.__array_interface__["data"][0]


def _span_bytes(tensor):
    return (1 + sum((d - 1) * s for d, s in zip(tensor.dim, tensor.stride))) * ITEMSIZE[tensor.data_type]


def strided_view(ptr, tensor, buffers):
    nbytes = _span_bytes(tensor)
    assert any(_address(b) <= ptr and ptr + nbytes <= _address(b) + b.nbytes for b in buffers), \
        f"{tensor.name}: bytes [{ptr:#x}, {ptr + nbytes:#x}) are outside every buffer"
    dtype = np.dtype(np.uint16 if tensor.data_type == BF16 else np.float32)
    flat = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, shape=tuple(tensor.dim),
                                           strides=tuple(s * dtype.itemsize for s in tensor.stride))


def _load(view):
    return (bfloat16_bits_to_float32(view) if view.dtype == np.uint16 else view).astype(np.float64)


def _store(view, values):
    values = np.asarray(values, dtype=np.float32)
    view[...] = float32_to_bfloat16_bits(values) if view.dtype == np.uint16 else values


def emulate_sdpa(graph, variant_pack):
    """Causal SDPA with the graph's parameters, float64 math. Forward: S = scale q k^T, masked
    above the diagonal; stats = rowmax + log(rowsum exp) (natural log); O = softmax(S) v. Backward
    (FlashAttention-2, from the statistics): P = exp(S - stats), dV = P^T dO, dP = dO V^T,
    D = rowsum(dO * O), dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q."""
    assert graph.params["diagonal_alignment"] == "TOP_LEFT" and graph.params["diagonal_band_right_bound"] == 0
    tensors = {**graph.inputs, **{k: v for k, v in graph.outputs.items() if v is not None}}
    views = {name: strided_view(variant_pack[t], t, graph.fake.buffers) for name, t in tensors.items()}
    q, k, v = _load(views["Q"]), _load(views["K"]), _load(views["V"])           # (B,NH,T,HS)
    T = q.shape[2]
    scale = graph.params["attn_scale"]
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    S = scale * q @ k.swapaxes(-1, -2)                                        # (B,NH,T,T)
    S[..., future] = -np.inf
    if graph.op == "sdpa":
        m = S.max(axis=-1, keepdims=True)
        P = np.exp(S - m)
        l = P.sum(axis=-1, keepdims=True)
        _store(views["O"], (P / l) @ v)
        if "Stats" in views:
            _store(views["Stats"], m + np.log(l))                             # (B,NH,T,1)
        return
    o, dO, stats = _load(views["O"]), _load(views["dO"]), _load(views["Stats"])
    P = np.exp(S - stats)
    dP = dO @ v.swapaxes(-1, -2)
    dS = P * (dP - (dO * o).sum(axis=-1, keepdims=True))
    _store(views["dV"], P.swapaxes(-1, -2) @ dO)
    _store(views["dQ"], scale * dS @ k)
    _store(views["dK"], scale * dS.swapaxes(-1, -2) @ q)


# ----------------------------------------------------------------------------
# helpers: bf16 test tensors and the reference

def bf16_normal(rng, shape):
    """(uint16 bf16 bits, the same values as float32) of N(0,1) draws."""
    bits = float32_to_bfloat16_bits(rng.standard_normal(shape).astype(np.float32))
    return bits, bfloat16_bits_to_float32(bits)


def run_forward_backward(B, T, NH, HS, rng, training=True):
    """Random bf16 qkv and dout, poisoned outputs; returns the arrays after both calls."""
    C = NH * HS
    qkv, qkv_f = bf16_normal(rng, (B, T, 3 * C))
    dout, dout_f = bf16_normal(rng, (B, T, C))
    out = np.full((B, T, C), 0x7FC0, np.uint16)                               # bf16 NaN
    stats = np.full((B, NH, T), np.nan, np.float32)
    dqkv = np.full((B, T, 3 * C), 0x7FC0, np.uint16)
    ca.attention_forward_cudnn(out, stats, qkv, B, T, NH, HS, training=training)
    ca.attention_backward_cudnn(dqkv, dout, qkv, out, stats, B, T, NH, HS)
    return dict(qkv=qkv, qkv_f=qkv_f, dout=dout, dout_f=dout_f, out=out, stats=stats, dqkv=dqkv)


def reference_stats(qkv_f, NH):
    """(B,NH,T) natural-log max + log sum exp of the scaled, causally masked scores, float64."""
    B, T, C3 = qkv_f.shape
    HS = C3 // 3 // NH
    heads = qkv_f.astype(np.float64).reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)   # (3,B,NH,T,HS)
    S = heads[0] @ heads[1].swapaxes(-1, -2) / math.sqrt(HS)
    S[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    m = S.max(axis=-1)
    return m + np.log(np.exp(S - m[..., None]).sum(axis=-1))


# ----------------------------------------------------------------------------
# part 1a: availability

def test_import_needs_neither_cudnn_nor_cupy():
    code = "import sys, llmc.cudnn_attention; assert 'cudnn' not in sys.modules and 'cupy' not in sys.modules"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("number,version", [(90100, (9, 1, 0)), (91002, (9, 10, 2)), (8907, (8, 9, 7)),
                                            (90000, (9, 0, 0)), (8600, (8, 6, 0))])
def test_cudnn_version_tuple(number, version):
    # cudnn_version.h: CUDNN_VERSION = MAJOR*10000 + MINOR*100 + PATCH from 9.0, MAJOR*1000 + ... before
    assert ca.cudnn_version_tuple(number) == version


def test_unavailable_reason_precision_and_head_size(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn_module())
    reason = ca.unavailable_reason("fp32", 64)
    assert "bf16" in reason and "fp32" in reason and "\n" not in reason
    for HS in (60, 136, 4, 0):
        reason = ca.unavailable_reason("bf16", HS)
        assert reason and str(HS) in reason and "multiple of 8" in reason and "at most 128" in reason
    for HS in (8, 64, 120, 128):
        assert ca.unavailable_reason("bf16", HS) is None


def test_unavailable_reason_package_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)                         # `import cudnn` raises ImportError
    reason = ca.unavailable_reason("bf16", 64)
    assert reason.startswith("the cuDNN frontend is not importable (ModuleNotFoundError")
    assert "pip install nvidia-cudnn-frontend" in reason and "\n" not in reason


@pytest.mark.parametrize("version,backend,words", [
    ("1.12.0", 91300, ["nvidia-cudnn-frontend 1.12.0 is too old", ">= 1.13.0", "pip install -U nvidia-cudnn-frontend"]),
    ("1.32.0", 8907, ["cuDNN 8.9.7 found", ">= 9.0.0", "pip install -U nvidia-cudnn-cu12"]),
    ("1.32.0", 91000, ["cuDNN 9.10.0 has known", "9.10.2 or newer"]),
    ("1.29.0.dev66254195", 91001, ["cuDNN 9.10.1 has known"]),
])
def test_unavailable_reason_versions(monkeypatch, version, backend, words):
    monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn_module(version, backend))
    reason = ca.unavailable_reason("bf16", 64)
    assert reason and "\n" not in reason
    for word in words:
        assert word in reason, reason


def test_unavailable_reason_library_not_loadable_and_ok(monkeypatch):
    def missing():                                                          # what the real package raises
        raise RuntimeError("Unable to find symbol cudnnGetVersion")
    monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn_module(backend=missing))
    reason = ca.unavailable_reason("bf16", 64)
    assert reason == ("the cuDNN library is not loadable (RuntimeError: Unable to find symbol cudnnGetVersion): "
                      "pip install nvidia-cudnn-cu12 (nvidia-cudnn-cu13 for CUDA 13)")
    for backend in (90000, 91002, 92100):
        monkeypatch.setitem(sys.modules, "cudnn", fake_cudnn_module(backend=backend))
        assert ca.unavailable_reason("bf16", 64) is None


# ----------------------------------------------------------------------------
# part 1b: the graphs

def _forward(B, T, NH, HS, training=True, rng=None):
    rng = rng or np.random.default_rng(0)
    C = NH * HS
    qkv = bf16_normal(rng, (B, T, 3 * C))[0]
    out = np.zeros((B, T, C), np.uint16)
    stats = np.zeros((B, NH, T), np.float32)
    ca.attention_forward_cudnn(out, stats if training else None, qkv, B, T, NH, HS, training=training)
    return qkv, out, stats


def test_graph_built_once_per_shape_and_reused(fake_cudnn):
    _forward(2, 64, 4, 64)
    _forward(2, 64, 4, 64)
    assert list(ca.GRAPHS) == [("forward", 2, 64, 4, 64, True)] and len(fake_cudnn.graphs) == 1
    graph = fake_cudnn.graphs[0]
    assert graph.steps == [("validate",), ("build_operation_graph",), ("create_execution_plans", ["A", "FALLBACK"]),
                           ("check_support",), ("build_plans",)]
    assert len(graph.executions) == 2
    _forward(2, 70, 4, 64)                                                  # another T: another graph
    _forward(2, 64, 4, 64, training=False)                                  # inference: another graph
    _forward(1, 64, 4, 64)
    _forward(2, 64, 4, 64)                                                  # the first one again
    assert sorted(ca.GRAPHS) == sorted([("forward", 2, 64, 4, 64, True), ("forward", 2, 70, 4, 64, True),
                                        ("forward", 2, 64, 4, 64, False), ("forward", 1, 64, 4, 64, True)])
    assert len(fake_cudnn.graphs) == 4 and len(graph.executions) == 3
    assert all(len(g.steps) == 5 for g in fake_cudnn.graphs)
    assert len(fake_cudnn.handles) == 1                                     # one handle for every graph
    assert all(g.handle is fake_cudnn.handles[0] for g in fake_cudnn.graphs)


def test_graph_attributes(fake_cudnn):
    B, T, NH, HS = 2, 64, 4, 64
    qkv, out, stats = _forward(B, T, NH, HS)
    ca.attention_backward_cudnn(np.zeros_like(qkv), np.zeros_like(out), qkv, out, stats, B, T, NH, HS)
    _forward(B, T, NH, HS, training=False)
    forward, backward, inference = fake_cudnn.graphs
    for g in fake_cudnn.graphs:
        assert g.types == (BF16, FLOAT, FLOAT)                              # bf16 io, fp32 scores and math
        assert g.params["attn_scale"] == 0.125                              # 1/sqrt(64)
        assert (g.params["diagonal_alignment"], g.params["diagonal_band_right_bound"]) == ("TOP_LEFT", 0)
    assert (forward.op, forward.params["generate_stats"]) == ("sdpa", True)
    assert forward.outputs["O"].output and forward.outputs["Stats"].output
    assert (inference.params["generate_stats"], inference.outputs["Stats"]) == (False, None)
    assert set(inference.executions[0][0]) == {inference.inputs[n] for n in "QKV"} | {inference.outputs["O"]}
    assert backward.op == "sdpa_backward" and backward.params["use_deterministic_algorithm"] is True
    assert all(t.output for t in backward.outputs.values())
    assert sorted(ca.GRAPHS[("backward", B, T, NH, HS, True)].tensors) == sorted(
        ["Q", "K", "V", "O", "dO", "Stats", "dQ", "dK", "dV"])


def _declared_addresses(tensor, ptr):
    """Byte address of every element of `tensor` as cuDNN reads it: ptr + itemsize * sum(i * stride)."""
    index = np.indices(tensor.dim).reshape(len(tensor.dim), -1).T          # every (b,h,t,s)
    return ptr + ITEMSIZE[tensor.data_type] * (index @ np.array(tensor.stride))


def _buffer_addresses(buf, view):
    """Byte address of each element of `view`, an index-arithmetic view of buf's flat positions."""
    return _address(buf) + buf.itemsize * view.reshape(-1)


@pytest.mark.parametrize("B,T,NH,HS", [(2, 5, 3, 8), (1, 7, 2, 16), (3, 4, 1, 8)])
def test_layouts_address_our_buffers(fake_cudnn, B, T, NH, HS):
    C = NH * HS
    qkv, out, stats = _forward(B, T, NH, HS)
    dqkv, dout = np.zeros_like(qkv), np.zeros_like(out)
    ca.attention_backward_cudnn(dqkv, dout, qkv, out, stats, B, T, NH, HS)
    # flat positions, by NumPy index arithmetic on gpt2_cpu's layouts: qkv (B,T,3,NH,HS) -> (3,B,NH,T,HS)
    in_qkv = np.arange(qkv.size).reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)
    in_out = np.arange(out.size).reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B,NH,T,HS)
    in_stats = np.arange(stats.size).reshape(B, NH, T, 1)
    expected = {"Q": (qkv, in_qkv[0]), "K": (qkv, in_qkv[1]), "V": (qkv, in_qkv[2]), "O": (out, in_out),
                "Stats": (stats, in_stats), "dO": (dout, in_out),
                "dQ": (dqkv, in_qkv[0]), "dK": (dqkv, in_qkv[1]), "dV": (dqkv, in_qkv[2])}
    checked = 0
    for graph in fake_cudnn.graphs:
        pack = graph.executions[0][0]
        for tensor, ptr in pack.items():
            buf, view = expected[tensor.name]
            assert tensor.data_type == (FLOAT if buf.dtype == np.float32 else BF16), tensor.name
            assert tensor.dim == list(view.shape), tensor.name
            np.testing.assert_array_equal(_declared_addresses(tensor, ptr), _buffer_addresses(buf, view), tensor.name)
            checked += 1
    assert checked == 5 + 9
    # and plainly: q, k, v start 0, C, 2C bf16 elements into qkv
    pack = fake_cudnn.graphs[0].executions[0][0]
    starts = {t.name: p - _address(qkv) for t, p in pack.items() if t.name in "QKV"}
    assert starts == {"Q": 0, "K": 2 * C, "V": 4 * C}


def test_workspace_sized_from_the_plans_and_stream(fake_cudnn):
    B, T, NH, HS = 2, 64, 4, 64
    qkv, out, stats = _forward(B, T, NH, HS)
    workspace = ca._RESOURCES["workspace"]
    assert workspace.dtype == np.uint8 and workspace.nbytes == 3000        # the forward plan's size
    assert fake_cudnn.graphs[0].executions[0][1] == _address(workspace)
    ca.attention_backward_cudnn(np.zeros_like(qkv), np.zeros_like(out), qkv, out, stats, B, T, NH, HS)
    grown = ca._RESOURCES["workspace"]
    assert grown.nbytes == 5000 and fake_cudnn.graphs[1].executions[0][1] == _address(grown)
    fake_cudnn.workspace_bytes["sdpa"] = 100                                # a smaller plan keeps the big one
    _forward(1, 8, 4, 64)
    assert ca._RESOURCES["workspace"] is grown and fake_cudnn.graphs[2].executions[0][1] == _address(grown)
    # every execute runs on the current stream, set on the one handle just before it
    handle = fake_cudnn.handles[0]
    kinds = [c[0] for c in fake_cudnn.calls]
    assert kinds == ["set_stream", "execute"] * 3
    assert all(c[1:] == (handle, STREAM_PTR) for c in fake_cudnn.calls if c[0] == "set_stream")
    assert all(c[2] is handle for c in fake_cudnn.calls if c[0] == "execute")


def test_prepare_allocates_the_largest_workspace_once(fake_cudnn, monkeypatch):
    # a training (B,T) and a larger evaluation batch: four graphs, one workspace of the largest
    allocated = []
    zeros = ca.cuda.cupy().zeros

    def counting_zeros(shape, dtype):
        allocated.append(shape)
        return zeros(shape, dtype)
    monkeypatch.setattr(ca.cuda.cupy(), "zeros", counting_zeros)
    workspace = ca.prepare([(2, 64), (4, 64)], 4, 64)
    assert allocated == [(5000,)] and workspace is ca._RESOURCES["workspace"]
    assert len(fake_cudnn.graphs) == 4 and len(ca.GRAPHS) == 4
    _forward(4, 64, 4, 64)                                                 # built already: nothing new
    assert allocated == [(5000,)] and fake_cudnn.graphs[2].executions[0][1] == _address(workspace)


def test_a_grown_workspace_keeps_the_old_one_alive(fake_cudnn):
    # a graph built after prepare that needs more: the old workspace is retired, not freed
    first = ca.prepare([(2, 64)], 4, 64)
    fake_cudnn.workspace_bytes["sdpa"] = 9000
    _forward(1, 32, 4, 64)
    assert ca._RESOURCES["workspace"].nbytes == 9000 and ca._RESOURCES["retired"] == [first]


@pytest.mark.parametrize("step", ["validate", "check_support", "build_plans"])
def test_build_failure_is_one_input_error_line(fake_cudnn, step):
    fake_cudnn.fail_at = step
    with pytest.raises(InputError) as info:
        _forward(2, 64, 4, 64)
    message = str(info.value)
    assert message == ("cuDNN attention: cannot build the forward graph for B=2, T=64, NH=4, HS=64 (training): "
                       "FakeGraphNotSupported: no engine supports this graph")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert ca.GRAPHS == {} and not any(c[0] == "execute" for c in fake_cudnn.calls)


def test_argument_checks(fake_cudnn):
    B, T, NH, HS = 2, 8, 2, 8
    C = NH * HS
    qkv, out = np.zeros((B, T, 3 * C), np.uint16), np.zeros((B, T, C), np.uint16)
    stats = np.zeros((B, NH, T), np.float32)
    with pytest.raises(TypeError, match="qkv"):
        ca.attention_forward_cudnn(out, stats, qkv.astype(np.float32), B, T, NH, HS)
    with pytest.raises(ValueError, match="out"):
        ca.attention_forward_cudnn(out[:, :-1], stats, qkv, B, T, NH, HS)
    with pytest.raises(TypeError, match="stats"):
        ca.attention_forward_cudnn(out, stats.astype(np.float64), qkv, B, T, NH, HS)
    with pytest.raises(ValueError, match="dout"):
        ca.attention_backward_cudnn(qkv, out[:1], qkv, out, stats, B, T, NH, HS)
    assert fake_cudnn.graphs == []                                          # nothing built for bad arguments


# ----------------------------------------------------------------------------
# part 1c: end to end through the emulated SDPA, against gpt2_cpu

@pytest.mark.parametrize("B,T,NH,HS", [(2, 7, 2, 8), (1, 16, 3, 16), (2, 5, 1, 8)])
def test_emulated_forward_backward_match_gpt2_cpu(fake_cudnn, B, T, NH, HS):
    C = NH * HS
    fake_cudnn.emulate = True
    rng = np.random.default_rng(T)
    qkv, qkv_f = bf16_normal(rng, (B, T, 3 * C))
    dout, dout_f = bf16_normal(rng, (B, T, C))
    out = np.full((B, T, C), 0x7FC0, np.uint16)
    stats = np.full((B, NH, T), np.nan, np.float32)
    dqkv = np.full((B, T, 3 * C), 0x7FC0, np.uint16)
    fake_cudnn.buffers = [qkv, dout, out, stats, dqkv]
    ca.attention_forward_cudnn(out, stats, qkv, B, T, NH, HS)
    ca.attention_backward_cudnn(dqkv, dout, qkv, out, stats, B, T, NH, HS)
    ref_out, att = gpt2_cpu.attention_forward(qkv_f.astype(np.float64), NH)
    ref_dqkv = gpt2_cpu.attention_backward(dout_f.astype(np.float64), qkv_f.astype(np.float64), att, NH)
    atol, rtol = TOLERANCES["kernel_bf16"]["attention"]
    assert check_tensor(bfloat16_bits_to_float32(out), ref_out, "out", atol, rtol)
    assert check_tensor(stats, reference_stats(qkv_f, NH), "stats", 1e-5, 1e-5)
    assert check_tensor(bfloat16_bits_to_float32(dqkv), ref_dqkv, "dqkv", atol, rtol)


def test_emulated_inference_forward_matches_training_forward(fake_cudnn):
    B, T, NH, HS = 2, 9, 2, 8
    fake_cudnn.emulate = True
    qkv = bf16_normal(np.random.default_rng(3), (B, T, 3 * NH * HS))[0]
    out_train, out_infer = (np.full((B, T, NH * HS), 0x7FC0, np.uint16) for _ in range(2))
    stats = np.full((B, NH, T), np.nan, np.float32)
    fake_cudnn.buffers = [qkv, out_train, out_infer, stats]
    ca.attention_forward_cudnn(out_train, stats, qkv, B, T, NH, HS)
    ca.attention_forward_cudnn(out_infer, None, qkv, B, T, NH, HS, training=False)
    np.testing.assert_array_equal(out_infer, out_train)


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_real_frontend_accepts_the_graph_description(direction):
    # where the real package imports (no GPU or library needed for this part): our keyword
    # arguments are its own, and validate() accepts the graph; skipped where it is not installed
    try:
        import cudnn
    except Exception as e:
        pytest.skip(f"the cuDNN frontend is not importable ({type(e).__name__})")
    B, T, NH, HS = 2, 70, 4, 64
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    tensors = ca.DESCRIBE[direction](cudnn, graph, B, T, NH, HS, True)
    graph.validate()
    layouts = {"O": ca.out_layout(B, T, NH, HS), "dO": ca.out_layout(B, T, NH, HS), "Stats": ca.stats_layout(B, T, NH)}
    for name, tensor in tensors.items():
        dim, stride = layouts.get(name, ca.qkv_layout(B, T, NH, HS))
        assert (list(tensor.get_dim()), list(tensor.get_stride())) == (dim, stride), name


# ----------------------------------------------------------------------------
# part 2: on a GPU with cuDNN, against gpt2_cpu

def _cudnn_skip_reason():
    try:
        return ca.unavailable_reason("bf16", 64)
    except Exception as e:                                                  # never let the check itself fail collection
        return f"{type(e).__name__}: {e}"


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,NH,HS", [(2, 64, 4, 64), (2, 70, 4, 64), (1, 1024, 4, 64)])
def test_gpu_matches_gpt2_cpu(B, T, NH, HS):
    reason = _cudnn_skip_reason()
    if reason:
        pytest.skip(reason)
    import cupy as cp
    C = NH * HS
    rng = np.random.default_rng(T)
    qkv, qkv_f = bf16_normal(rng, (B, T, 3 * C))
    dout, dout_f = bf16_normal(rng, (B, T, C))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:                                                            # cuDNN must follow the current stream
        d_qkv, d_dout = cp.asarray(qkv), cp.asarray(dout)
        d_out, d_out_infer = cp.full((B, T, C), 0x7FC0, cp.uint16), cp.full((B, T, C), 0x7FC0, cp.uint16)
        d_stats = cp.full((B, NH, T), np.nan, cp.float32)
        d_dqkv, d_dqkv2 = cp.full((B, T, 3 * C), 0x7FC0, cp.uint16), cp.full((B, T, 3 * C), 0x7FC0, cp.uint16)
        ca.attention_forward_cudnn(d_out, d_stats, d_qkv, B, T, NH, HS)
        ca.attention_forward_cudnn(d_out_infer, None, d_qkv, B, T, NH, HS, training=False)
        ca.attention_backward_cudnn(d_dqkv, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS)
        ca.attention_backward_cudnn(d_dqkv2, d_dout, d_qkv, d_out, d_stats, B, T, NH, HS)
        out, out_infer, stats = d_out.get(stream=stream), d_out_infer.get(stream=stream), d_stats.get(stream=stream)
        dqkv, dqkv2 = d_dqkv.get(stream=stream), d_dqkv2.get(stream=stream)
    stream.synchronize()
    ref_out, att = gpt2_cpu.attention_forward(qkv_f.astype(np.float64), NH)
    ref_dqkv = gpt2_cpu.attention_backward(dout_f.astype(np.float64), qkv_f.astype(np.float64), att, NH)
    assert check_against(bfloat16_bits_to_float32(out), ref_out, f"out T={T}", "cuda_bf16", "activation")
    assert check_against(bfloat16_bits_to_float32(out_infer), ref_out, f"out (inference) T={T}", "cuda_bf16",
                         "activation")
    assert check_against(stats, reference_stats(qkv_f, NH), f"stats T={T}", "cuda_bf16", "statistic")
    assert check_against(bfloat16_bits_to_float32(dqkv), ref_dqkv, f"dqkv T={T}", "cuda_bf16", "grad")
    np.testing.assert_array_equal(dqkv2, dqkv)                              # the deterministic backward
    assert ("forward", B, T, NH, HS, True) in ca.GRAPHS and ("backward", B, T, NH, HS, True) in ca.GRAPHS
