"""gpt2_cuda.py with --cublaslt 1, without a GPU: the whole model through tests/test_cuda.py's
emulated GPU with llmc/cublaslt.py's two entry points replaced by NumPy stand-ins that do what
their epilogues do (bias; GELU with the pre-activation stored; DGELU; the bias gradient), checked
tensor by tensor against gpt2_cpu.py. This checks the wiring (which layer passes which buffer as
the GELU pre-activation, that the separate GELU kernels are skipped, the bias-gradient fallback),
not cuBLASLt itself: tests/test_cublaslt.py checks the module's calls, a GPU the library.
Run: pytest tests/test_cublaslt_wiring.py   (a few seconds)
"""

import sys
import types

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc
from test_cuda import TINY, _from_f32, _to_f32, emulated_gpu  # noqa: F401  (emulated_gpu is a fixture)


def _numpy_cublaslt(calls, bgrad):
    """Stand-ins for matmul_forward_lt / matmul_backward_lt (signatures of llmc/cublaslt.py)."""

    def precision(arr):
        return "bf16" if arr.dtype == np.uint16 else "fp32"

    def forward(out, inp, weight, bias, B, T, C, OC, pre_gelu=None):
        calls.append(("forward", OC, pre_gelu is not None))
        x = _to_f32(np.asarray(inp)).reshape(B * T, C).astype(np.float64)
        y = x @ _to_f32(np.asarray(weight)).reshape(OC, C).T.astype(np.float64)
        if bias is not None:
            y += _to_f32(np.asarray(bias))
        if pre_gelu is not None:                                        # GELU_AUX(_BIAS)
            pre_gelu.reshape(-1)[:B * T * OC] = _from_f32(y.ravel().astype(np.float32), precision(pre_gelu))
            y = gpt2_cpu.gelu_forward(y)
        out.reshape(-1)[:B * T * OC] = _from_f32(y.ravel().astype(np.float32), precision(out))

    def backward(dinp, dweight, dbias, dout, inp, weight, B, T, C, OC, pre_gelu=None):
        calls.append(("backward", OC, pre_gelu is not None))
        d = _to_f32(np.asarray(dout)).reshape(B * T, OC).astype(np.float64)
        w = _to_f32(np.asarray(weight)).reshape(OC, C).astype(np.float64)
        x = _to_f32(np.asarray(inp)).reshape(B * T, C).astype(np.float64)
        dx = d @ w
        if pre_gelu is not None:                                        # DGELU
            dx = gpt2_cpu.gelu_backward(dx, _to_f32(np.asarray(pre_gelu)).reshape(B * T, C).astype(np.float64))
        dinp.reshape(-1)[:B * T * C] = _from_f32(dx.ravel().astype(np.float32), precision(dinp))
        dw = _to_f32(np.asarray(dweight)).reshape(OC, C) + d.T @ x
        dweight.reshape(-1)[:OC * C] = _from_f32(dw.ravel().astype(np.float32), precision(dweight))
        if dbias is None or not bgrad:
            return False                                                # the caller's bias_backward
        db = _to_f32(np.asarray(dbias)) + d.sum(axis=0)
        dbias[...] = _from_f32(db.astype(np.float32), precision(dbias))
        return True

    return types.SimpleNamespace(matmul_forward_lt=forward, matmul_backward_lt=backward,
                                 unavailable_reason=lambda: None)


@pytest.mark.parametrize("precision,bgrad", [("fp32", True), ("fp32", False), ("bf16", True)])
def test_emulated_model_with_cublaslt_matches_gpt2_cpu(emulated_gpu, monkeypatch, precision, bgrad):
    calls = []
    fake = _numpy_cublaslt(calls, bgrad)
    monkeypatch.setattr(llmc, "cublaslt", fake, raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", fake)
    monkeypatch.setitem(gpt2_cuda.MATMUL_OPTIONS, "cublaslt", True)
    # the separate GELU kernels must not run: their work is in the epilogues
    monkeypatch.setattr(gpt2_cuda, "gelu_backward_inplace", lambda *a: pytest.fail("gelu_backward_inplace ran"))
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, recompute=False)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(TINY, 42).params)
    rng = np.random.default_rng(2)
    x = rng.integers(0, TINY.vocab_size, (2, 16)).astype(np.int32)
    y = rng.integers(0, TINY.vocab_size, (2, 16)).astype(np.int32)
    assert gpt2_cuda.check_against_cpu(model, x, y, np.float64)
    C, L = TINY.channels, TINY.num_layers
    # per layer: qkv, attproj, fc (with GELU), fcproj; then the classifier (no bias)
    assert calls[:4] == [("forward", 3 * C, False), ("forward", C, False), ("forward", 4 * C, True),
                         ("forward", C, False)]
    backward = [c for c in calls if c[0] == "backward"]
    assert backward[:3] == [("backward", TINY.padded_vocab_size, False), ("backward", C, True),
                            ("backward", 4 * C, False)]                   # wte; fcproj through DGELU; fc
    assert len(backward) == 1 + 4 * L


def test_cublaslt_flag_falls_back_with_one_line(monkeypatch, capsys):
    fake = types.SimpleNamespace(unavailable_reason=lambda: "nvmath-python is not installed")
    monkeypatch.setattr(llmc, "cublaslt", fake, raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", fake)
    monkeypatch.setitem(gpt2_cuda.MATMUL_OPTIONS, "cublaslt", True)
    monkeypatch.setattr(gpt2_cuda, "GPT2", lambda *a, **k: types.SimpleNamespace())
    monkeypatch.setattr(gpt2_cuda, "upload_parameters", lambda *a: None)
    lines = []
    gpt2_cuda.setup_model(gpt2_cuda.parse_args(["-e", "d2", "--cublaslt", "1"]), 90, say=lines.append)
    assert lines == ["gpt2_cuda.py: cuBLASLt unavailable (nvmath-python is not installed): using cuBLAS"]
    assert gpt2_cuda.MATMUL_OPTIONS["cublaslt"] is False
