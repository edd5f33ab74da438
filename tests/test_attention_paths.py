"""The three attention paths of gpt2_cuda.py (--attention naive | flash | cudnn), without a GPU:
- the activation table: the flash and cuDNN paths hold no (T,T) buffer, and at GPT-2 124M,
  T=1024, B=64 their activations are smaller than the naive path's by exactly the buffers they
  drop (counted by hand here from the shapes, not from the table);
- resolve_attention: the fallbacks (cuDNN missing -> flash, no flash kernel for the head size ->
  naive), each with its one line, and --attention on the command line;
- the whole model on the cuDNN path on the emulated CUDA device (tests/emulated_gpu.py's fixture:
  the real kernels, llmc/cudnn_attention.py itself on the emulated cuDNN, llmc/emulator/cudnn.py),
  bf16 as cuDNN's fused attention needs: every activation, the log-sum-exp and every gradient
  against gpt2_cpu.py, and which entry points run when. This checks the wiring of the fused path
  (which buffers, which layouts, the backward's arguments), not cuDNN, which only a GPU can run.
The flash path's kernels run emulated in tests/test_flash_attention_host.py and tests/test_cuda.py,
which also runs the model on that path.
Run: pytest tests/test_attention_paths.py   (a few seconds once the emulated kernels are built)
"""

import dataclasses
import math
import sys
import types

import numpy as np
import pytest

import gpt2_cuda
import llmc.attention
import llmc
from llmc import cuda_check
from gpt2_cpu import model_config
from emulated_gpu import TINY, emulated_gpu, tiny_model_parameters  # noqa: F401  (emulated_gpu is a fixture)


# ----------------------------------------------------------------------------
# the activation table

@pytest.mark.parametrize("attention", ["flash", "cudnn"])
def test_fused_paths_hold_no_TxT_buffer(attention):
    # T prime: a buffer whose size is a multiple of T*T holds a (T,T) matrix (no other dimension
    # is a multiple of T); the naive path has one, att (its output scratch holds preatt too, but at
    # this T the logits, B*T*Vp, are larger)
    cfg = model_config("d12")
    B, T = 2, 1021
    for path, count in (("naive", 1), (attention, 0)):
        table = gpt2_cuda.activation_shapes(cfg, B, T, True, llmc.attention.attention_path(path))
        assert sum(math.prod(shape) % (T * T) == 0 for _, shape, _ in table) == count, path


def test_fused_paths_save_exactly_the_dropped_buffers_at_124M():
    cfg = model_config("d12")
    B, T, L, NH, C, Vp = 64, 1024, cfg.num_layers, cfg.num_heads, cfg.channels, cfg.padded_vocab_size
    X, F = 2, 4                                                                     # bytes: bf16, fp32
    size = {"X": X, "f32": F, "i32": 4}

    def nbytes(attention):
        return sum(math.prod(shape) * size[kind] for _, shape, kind in gpt2_cuda.activation_shapes(cfg, B, T, True,
                                                                                      llmc.attention.attention_path(attention)))

    naive, flash = nbytes("naive"), nbytes("flash")
    HS = C // NH
    # naive keeps att (L,B,NH,T,T), its output scratch also holds preatt/datt (B*T*NH*T > B*T*Vp at
    # T=1024), and it has the per-head dq,dk,dv and dy; qkvr is as big as the fused paths' qkv
    dropped = (L * B * NH * T * T * X + (B * T * max(3 * C, NH * T, Vp) - B * T * Vp) * X
               + 3 * B * NH * T * HS * X + B * NH * T * HS * X)
    added = L * B * NH * T * F + B * NH * T * F                                    # lse, and D
    assert naive - flash == dropped - added
    assert nbytes("cudnn") == flash
    assert L * B * NH * T * T * X / 2**30 == 18.0                                  # att alone: 18 GiB of the 39.2


# ----------------------------------------------------------------------------
# choosing the path

def _fake_cudnn_module(reason):
    return types.SimpleNamespace(unavailable_reason=lambda precision, HS: reason)


def test_resolve_attention_fallbacks(monkeypatch):
    monkeypatch.setattr(llmc, "cudnn_attention", _fake_cudnn_module(None), raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cudnn_attention", llmc.cudnn_attention)
    assert llmc.attention.resolve_attention("cudnn", "bf16", 64) == ("cudnn", None)
    assert llmc.attention.resolve_attention("naive", "bf16", 64) == ("naive", None)
    monkeypatch.setattr(llmc.attention, "flash_attention_supported", lambda HS: HS == 64)
    assert llmc.attention.resolve_attention("flash", "fp32", 64) == ("flash", None)
    path, line = llmc.attention.resolve_attention("flash", "bf16", 48)
    assert path == "naive" and line == "flash attention has no kernel for head size 48: using naive attention"
    monkeypatch.setattr(llmc, "cudnn_attention", _fake_cudnn_module("no module named cudnn"))
    monkeypatch.setitem(sys.modules, "llmc.cudnn_attention", llmc.cudnn_attention)
    assert llmc.attention.resolve_attention("cudnn", "bf16", 64) == (
        "flash", "cuDNN attention unavailable (no module named cudnn): using flash attention")
    assert llmc.attention.resolve_attention("cudnn", "bf16", 48)[0] == "naive"


def test_auto_is_cudnn_on_a_gpu_where_it_runs_else_naive(monkeypatch):
    """--attention auto: cuDNN's on a GPU where it can run (the fastest path measured on an H100),
    else naive with the reason in one line; naive and silent on the emulated device."""
    monkeypatch.setattr(llmc.cuda, "_device", "cuda")
    monkeypatch.setattr(llmc, "cudnn_attention", _fake_cudnn_module(None), raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cudnn_attention", llmc.cudnn_attention)
    assert llmc.attention.resolve_attention("auto", "bf16", 64) == ("cudnn", None)
    monkeypatch.setattr(llmc, "cudnn_attention", _fake_cudnn_module("needs bf16"))
    monkeypatch.setitem(sys.modules, "llmc.cudnn_attention", llmc.cudnn_attention)
    assert llmc.attention.resolve_attention("auto", "fp32", 64) == (
        "naive", "naive attention (--attention auto; cuDNN attention unavailable: needs bf16)")
    monkeypatch.setattr(llmc, "cudnn_attention", _fake_cudnn_module(None))
    monkeypatch.setitem(sys.modules, "llmc.cudnn_attention", llmc.cudnn_attention)
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")
    assert llmc.attention.resolve_attention("auto", "bf16", 64) == ("naive", None)


def test_attention_flag():
    assert gpt2_cuda.parse_args([]).attention == llmc.attention.DEFAULT_ATTENTION == "auto"   # since the H100 run
    assert gpt2_cuda.parse_args(["--attention", "flash"]).attention == "flash"
    with pytest.raises(SystemExit):
        gpt2_cuda.parse_args(["--attention", "fast"])


# ----------------------------------------------------------------------------
# the model on the cuDNN path, on the emulated cuDNN

def _heads(qkv, NH):
    """(B,T,3C) -> q, k, v each (B,NH,T,HS), float64."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    return [qkv[..., i * C:(i + 1) * C].reshape(B, T, NH, C // NH).transpose(0, 2, 1, 3).astype(np.float64)
            for i in range(3)]


def _record_cudnn_calls(monkeypatch, calls):
    """llmc.cudnn_attention's entry points, each call appended to calls ("prepare", "forward",
    "backward") before it runs."""
    from llmc import cudnn_attention
    for name, label in (("prepare", "prepare"), ("attention_forward_cudnn", "forward"),
                        ("attention_backward_cudnn", "backward")):
        def recording(*args, _call=getattr(cudnn_attention, name), _label=label, **kwargs):
            calls.append(_label)
            return _call(*args, **kwargs)
        monkeypatch.setattr(cudnn_attention, name, recording)


@pytest.mark.parametrize("B,T", [(3, 16), (1, 13)])
def test_emulated_model_on_cudnn_path_matches_gpt2_cpu(emulated_gpu, monkeypatch, B, T):
    calls = []
    _record_cudnn_calls(monkeypatch, calls)
    model = gpt2_cuda.GPT2(TINY, "bf16", master_weights=True, recompute=True, attention="cudnn")
    gpt2_cuda.upload_parameters(model, tiny_model_parameters(TINY, 42).params)
    rng = np.random.default_rng(11)
    x = rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32)
    assert cuda_check.check_against_cpu(gpt2_cuda, model, x, y, np.float64)
    assert calls == ["prepare"] + ["forward"] * TINY.num_layers + ["backward"] * TINY.num_layers   # prepare: at allocation
    A = gpt2_cuda.gpt2_activations(model, B, T)
    assert "att" not in A and "qkvr" not in A and A["lse"].shape == (TINY.num_layers, B, TINY.num_heads, T)


def test_attention_lse_is_the_log_sum_exp():
    rng = np.random.default_rng(0)
    B, T, NH, HS = 2, 5, 3, 4
    qkv = rng.standard_normal((B, T, 3 * NH * HS))
    lse = cuda_check.attention_lse(qkv, NH)
    q, k, _ = _heads(qkv, NH)
    for b, h, t in [(0, 0, 0), (1, 2, 4), (0, 1, 3)]:
        scores = [q[b, h, t] @ k[b, h, j] / math.sqrt(HS) for j in range(t + 1)]   # keys 0..t only
        assert lse[b, h, t] == pytest.approx(math.log(sum(math.exp(s) for s in scores)), rel=1e-12)


@pytest.mark.parametrize("B,T", [(1, 1), (3, 5), (1, 1023), (5, 63)])
@pytest.mark.parametrize("path", ["flash", "cudnn"])
def test_every_layers_lse_starts_16_byte_aligned_at_d48(emulated_gpu, B, T, path):
    """d48 (GPT-2 1.5B): NH = 25, so one layer's lse is B*25*T floats, a multiple of 16 bytes only
    when B*T is a multiple of 4. Every layer's slice must still start 16-byte aligned (cuDNN's stats
    tensor, the kernels' fp32 loads): the buffer and its views as gpt2_allocate and
    gpt2_activations carve them, for the table's lse shape (no d48 model is built)."""
    cfg = model_config("d48")
    L, NH = cfg.num_layers, cfg.num_heads
    assert (L, NH) == (48, 25)
    table = gpt2_cuda.activation_shapes(cfg, B, T, 1, llmc.attention.attention_path(path))
    (shape,) = [shape for name, shape, _ in table if name == "lse"]
    assert shape == (L, B, NH, T)
    itemsize = np.dtype(np.float32).itemsize
    buf = emulated_gpu.zeros(gpt2_cuda.buffer_elements("lse", shape, itemsize), dtype=np.float32)
    lse = gpt2_cuda.carve(buf, "lse", shape)
    assert lse.shape == shape
    starts = [lse[l].data.ptr - buf.data.ptr for l in range(L)]
    assert all((buf.data.ptr + start) % 16 == 0 for start in starts), starts[:3]
    assert all(lse[l].flags.c_contiguous and lse[l].shape == (B, NH, T) for l in range(L))
    per_layer = B * NH * T * itemsize
    assert all(b - a >= per_layer for a, b in zip(starts, starts[1:]))      # the layers do not overlap
    assert starts[-1] + per_layer <= buf.nbytes
    for l in range(L):                                                      # each layer writes its own slice
        lse[l][...] = float(l + 1)
    assert sorted(set(buf.get().tolist())) == [0.0] + [float(l + 1) for l in range(L)]
    assert (lse.get() == np.arange(1, L + 1, dtype=np.float32)[:, None, None, None]).all()


@pytest.mark.parametrize("path", ["flash", "cudnn"])
def test_model_activations_carve_aligned_lse_layers_for_25_heads(emulated_gpu, path):
    """The same through gpt2_allocate and gpt2_activations of a small model with d48's 25 heads
    (HS 16) at B*T = 3: each layer's lse view, as the attention launchers get it, 16-byte aligned."""
    cfg = dataclasses.replace(TINY, num_heads=25, channels=25 * 16)
    model = gpt2_cuda.GPT2(cfg, "bf16", master_weights=False, recompute=True, attention=path)
    A = gpt2_cuda.gpt2_activations(model, 1, 3)
    assert A["lse"].shape == (cfg.num_layers, 1, 25, 3)
    assert [A["lse"][l].data.ptr % 16 for l in range(cfg.num_layers)] == [0] * cfg.num_layers
