"""llama3_cpu.py against independent references: each new layer's forward against its definition
computed a second way and its backward against float64 central finite differences (the method of
tests/test_layers.py: contract the output with a fixed random R, so dout = R); RoPE's scaled
frequencies against Llama 3.1's rule written as a loop; then the whole model's backward against
finite differences on a sample of every tensor, and against PyTorch autograd on the twin
dev/torch_reference_llama3.py (a Llama 3 written from the equations, not calling llama3_cpu)."""

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import llama3_cpu as m
from llmc import check
from llmc.utils import InputError
from test_layers import numerical_grad  # central differences, float64

H = 1e-6            # finite-difference step (tests/test_layers.py says why these three)
RTOL = 1e-6
ATOL = 1e-9


def assert_close(a, ref, label, atol=ATOL, rtol=RTOL):
    assert check.check_tensor(a, ref, label, atol, rtol), label


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("shape", [(2, 3, 8), (1, 7, 5)])
def test_rmsnorm(rng, shape):
    C, eps = shape[-1], 1e-5
    x = rng.standard_normal(shape) * 2 + 0.5
    w = rng.standard_normal(C)
    R = rng.standard_normal(shape)
    out, rstd = m.rmsnorm_forward(x, w, eps)
    ref = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * w      # Zhang & Sennrich 2019, eq. 4
    assert_close(out, ref, "rmsnorm out")
    loss = lambda: float((m.rmsnorm_forward(x, w, eps)[0] * R).sum())  # noqa: E731
    dw = np.ones(C)                                                     # the backward accumulates
    dx = m.rmsnorm_backward(dw, R, x, w, rstd)
    assert_close(dx, numerical_grad(loss, x), "rmsnorm dinp")
    assert_close(dw - 1, numerical_grad(loss, w), "rmsnorm dweight")


# ---------------------------------------------------------------------------- RoPE

def scaled_frequencies_reference(HS, theta):
    """Llama 3.1's frequency rule, one frequency at a time (the facts of llm.c's apply_scaling)."""
    out = []
    for i in range(HS // 2):
        freq = 1.0 / theta ** (2 * i / HS)
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            out.append(freq)
        elif wavelen > 8192 / 1:
            out.append(freq / 8)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append((1 - smooth) * freq / 8 + smooth * freq)
    return np.array(out)


def test_rope_frequencies_llama31():
    HS, theta = 128, 500000.0
    plain = m.rope_frequencies(HS, theta, use_scaled_rope=False)
    np.testing.assert_allclose(plain, theta ** -(np.arange(0, HS, 2) / HS), rtol=1e-15)
    scaled = m.rope_frequencies(HS, theta, use_scaled_rope=True)
    np.testing.assert_allclose(scaled, scaled_frequencies_reference(HS, theta), rtol=1e-15)
    wavelen = 2 * math.pi / plain
    assert scaled[0] == plain[0] == 1.0                       # the fastest rotation is kept
    np.testing.assert_array_equal(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    middle = (wavelen >= 2048) & (wavelen <= 8192)
    assert middle.sum() > 0 and np.all(scaled[middle] < plain[middle]) and np.all(scaled[middle] > plain[middle] / 8)


def test_rope_tables():
    cos, sin = m.precompute_freqs_cis(8, 5, 10000.0, False)
    freqs = 10000.0 ** -(np.arange(0, 8, 2) / 8)
    angle = np.arange(5)[:, None] * freqs[None, :]
    assert cos.shape == sin.shape == (5, 4)
    np.testing.assert_allclose(cos, np.cos(angle), rtol=1e-15)
    np.testing.assert_allclose(sin, np.sin(angle), rtol=1e-15)


@pytest.mark.parametrize("B,T,NH,HS", [(2, 5, 3, 4), (1, 3, 1, 6)])
def test_rope(rng, B, T, NH, HS):
    x = rng.standard_normal((B, T, NH, HS))
    cos, sin = m.precompute_freqs_cis(HS, T, 10.0, False)
    out = m.rope_forward(x, cos, sin)
    # a second way: channel pairs (2i, 2i+1) as complex numbers, multiplied by e^{i t freq_i}
    z = x[..., 0::2] + 1j * x[..., 1::2]
    zr = z * np.exp(1j * np.arange(T)[None, :, None, None] * m.rope_frequencies(HS, 10.0, False))
    ref = np.stack([zr.real, zr.imag], axis=-1).reshape(x.shape)
    assert_close(out, ref, "rope out")
    assert_close(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), "rope keeps lengths")
    R = rng.standard_normal(x.shape)
    loss = lambda: float((m.rope_forward(x, cos, sin) * R).sum())  # noqa: E731
    assert_close(m.rope_backward(R, cos, sin), numerical_grad(loss, x), "rope dinp")


def test_rope_scores_depend_on_relative_position_only(rng):
    HS, T = 8, 12
    q, k = rng.standard_normal(HS), rng.standard_normal(HS)
    cos, sin = m.precompute_freqs_cis(HS, T, 10000.0, True)
    rot = lambda x, t: m.rope_forward(x[None, None, None], cos[t:t + 1], sin[t:t + 1])[0, 0, 0]  # noqa: E731
    s = [rot(q, t + 3) @ rot(k, t) for t in range(T - 3)]     # query 3 positions after the key
    np.testing.assert_allclose(s, s[0], rtol=1e-12)
    assert abs(rot(q, 5) @ rot(k, 1) - s[0]) > 1e-3            # another distance, another score


# ---------------------------------------------------------------------------- SwiGLU

def test_swiglu(rng):
    fch, fch2 = rng.standard_normal((2, 3, 6)) * 3, rng.standard_normal((2, 3, 6)) * 3
    out = m.swiglu_forward(fch, fch2)
    assert_close(out, fch * fch2 / (1 + np.exp(-fch2)), "swiglu out")   # Shazeer 2020, FFN_SwiGLU
    R = rng.standard_normal(fch.shape)
    loss = lambda: float((m.swiglu_forward(fch, fch2) * R).sum())  # noqa: E731
    dfch, dfch2 = m.swiglu_backward(R, fch, fch2)
    assert_close(dfch, numerical_grad(loss, fch), "swiglu dfch")
    assert_close(dfch2, numerical_grad(loss, fch2), "swiglu dfch2")


# ---------------------------------------------------------------------------- GQA's K/V repeat

@pytest.mark.parametrize("NKV,n_rep", [(2, 3), (1, 4), (3, 1)])
def test_repeat_kv(rng, NKV, n_rep):
    B, T, HS = 2, 3, 4
    x = rng.standard_normal((B, T, NKV, HS))
    out = m.repeat_kv_forward(x, n_rep)
    assert out.shape == (B, T, NKV * n_rep, HS)
    for h in range(NKV * n_rep):                              # query head h reads kv head h // n_rep
        np.testing.assert_array_equal(out[:, :, h], x[:, :, h // n_rep])
    R = rng.standard_normal(out.shape)
    loss = lambda: float((m.repeat_kv_forward(x, n_rep) * R).sum())  # noqa: E731
    assert_close(m.repeat_kv_backward(R, n_rep), numerical_grad(loss, x), "repeat_kv dinp")


# ---------------------------------------------------------------------------- the model

TINY = m.LlamaConfig(max_seq_len=16, vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, channels=32,
                     multiple_of=16)        # H = 112, HS = 8: every RoPE regime of Llama 3.1 (theta 500000)


def tiny_batch(B=2, T=8, seed=3):
    r = np.random.default_rng(seed)
    return r.integers(0, TINY.vocab_size, (B, T)), r.integers(0, TINY.vocab_size, (B, T))


def test_parameter_table():
    assert TINY.hidden_dim == 112 and m.qkv_channels(TINY) == (4 + 2 * 2) * 8
    shapes = dict(m.parameter_shapes(TINY))
    assert list(shapes) == list(m.PARAMETER_NAMES)
    assert shapes["qkvw"] == (2, 64, 32) and shapes["fcw2"] == (2, 112, 32) and shapes["wlmhead"] == (64, 32)
    # Llama 3.1 8B: 8,030,261,248 parameters (Meta's model card), H = 14336
    big = m.LLAMA3_8B
    assert big.hidden_dim == 14336
    assert m.num_elements(m.parameter_shapes(big)) == 8_030_261_248
    with pytest.raises(InputError, match="unknown model"):
        m.config_from_descriptor("llama3:d5")
    with pytest.raises(InputError, match="impossible Llama 3 shape"):
        m.Llama3(m.LlamaConfig(num_layers=1, num_heads=4, num_kv_heads=3, channels=32, vocab_size=8, max_seq_len=4))


def test_init_is_seeded():
    a, b = m.llama3_init(TINY, seed=7), m.llama3_init(TINY, seed=7)
    np.testing.assert_array_equal(a.params, b.params)
    assert np.all(a.P["ln1w"] == 1) and np.all(a.P["lnfw"] == 1)
    assert abs(a.P["wlmhead"].std() - 0.02) < 0.002
    assert not np.array_equal(a.P["wte"], a.P["wlmhead"]), "the classifier is untied"


def test_model_backward_against_finite_differences():
    """The whole backward, float64, against central differences of the mean loss on 6 sampled
    elements of every tensor. The loss is ~4.2 and the gradients ~1e-4..1e-1: the difference
    quotient's rounding error ~ 1e-16 * 4 / 1e-6 = 4e-10, so atol 1e-8 with rtol 1e-5."""
    model = m.llama3_init(TINY, seed=0, dtype=np.float64)
    model.params[...] += np.random.default_rng(1).standard_normal(model.num_parameters) * 0.05   # off the init
    x, y = tiny_batch()
    m.gpt2_zero_grad(model)
    m.llama3_forward(model, x, y)
    m.llama3_backward(model)

    def loss():
        m.llama3_forward(model, x, y)
        return model.mean_loss
    r = np.random.default_rng(2)
    for name, shape in model.param_shapes:
        idx = r.choice(math.prod(shape), 6, replace=False)
        numeric = numerical_grad(loss, model.P[name], idx=idx)
        assert_close(model.G[name].reshape(-1)[idx], numeric, f"d{name}", atol=1e-8, rtol=1e-5)
        assert np.abs(numeric).max() > 1e-7, f"{name}: a sample of zero gradients tests nothing"


def test_model_against_pytorch_autograd():
    """Against dev/torch_reference_llama3.py, the PyTorch twin written from the equations (Meta's
    reference model's structure; it imports nothing of ours), in float64 off the init."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(ROOT, "dev"))
    import torch
    import torch_reference_llama3 as twin
    model = m.llama3_init(TINY, seed=0, dtype=np.float64)
    model.params[...] += np.random.default_rng(1).standard_normal(model.num_parameters) * 0.05
    x, y = tiny_batch()
    m.gpt2_zero_grad(model)
    m.llama3_forward(model, x, y)
    m.llama3_backward(model)
    t = twin.Twin(TINY, [model.P[name] for name in m.PARAMETER_NAMES], dtype=torch.float64)
    _, loss, grads = t.forward_backward(x, y)
    assert abs(loss - model.mean_loss) < 1e-12 * abs(loss)
    for name, g in zip(m.PARAMETER_NAMES, grads):   # float64 on both sides: agreement to summation order
        assert_close(model.G[name], g, f"d{name} vs torch", atol=1e-13, rtol=1e-9)


def test_gradient_accumulates_over_micro_batches():
    model = m.llama3_init(TINY, seed=0, dtype=np.float64)
    x, y = tiny_batch(B=4)
    m.gpt2_zero_grad(model)
    m.llama3_forward(model, x, y)
    m.llama3_backward(model)
    whole = model.grads.copy()
    m.gpt2_zero_grad(model)
    for half in (slice(0, 2), slice(2, 4)):
        m.llama3_forward(model, x[half], y[half])
        m.llama3_backward(model, loss_scale=0.5)
    np.testing.assert_allclose(model.grads, whole, rtol=1e-10, atol=1e-15)


def test_adamw_decays_only_matrices():
    model = m.llama3_init(TINY, seed=0, dtype=np.float64)
    before = model.params.copy()
    m.gpt2_zero_grad(model)                          # no gradient: only the decay moves a parameter
    m.gpt2_update(model, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, decayed=m.DECAYED_PARAMETERS)
    after = m.tensor_views(model.params, model.param_shapes)
    old = m.tensor_views(before, model.param_shapes)
    for name in m.PARAMETER_NAMES:
        expected = old[name] * (1 - 1e-2 * 0.1) if name in m.DECAYED_PARAMETERS else old[name]
        np.testing.assert_allclose(after[name], expected, rtol=1e-15, err_msg=name)


# ---------------------------------------------------------------------------- sampler

def test_generate_with_kv_cache_equals_full_forward():
    """The cached sampler (NKV heads cached, RoPE at each position) against the full forward over
    the window, past maxT = 16 where the context slides and the cache is refilled."""
    model = m.llama3_init(TINY, seed=1)
    a = m.llama3_generate(model, [1, 2, 3], 20, m.SamplerRNG(3))
    b = m.llama3_generate(model, [1, 2, 3], 20, m.SamplerRNG(3), kv_cache=False)
    assert a == b and len(a) == 20 and all(0 <= t < TINY.vocab_size for t in a)
    assert a != m.llama3_generate(model, [1, 2, 3], 20, m.SamplerRNG(4))
    cache = m.kv_cache_new(TINY, 1)
    assert cache.k.shape == (2, 1, 16, 2, 8), "the cache keeps NKV heads, not NH"


# ---------------------------------------------------------------------------- files

def llmc_llama3_file_bytes(model, dtype):
    """llm.c's Llama 3 model file (train_llama3.py's write_model, llama3 branch), assembled here from
    its facts: 256 int32 (magic 20240803, version 3 or 5, block_size, vocab_size, n_layer, n_head,
    n_kv_head, n_embd, multiple_of, use_scaled_rope, 3, 1), 256 float32 (ffn_dim_multiplier,
    norm_eps, rope_theta), then wte, lm_head, and per layer-stacked tensor: ln_1, its zero bias,
    c_attn, zero, attn c_proj, zero, ln_2, zero, [c_fc; c_fc2] per layer, zero, mlp c_proj, zero,
    ln_f, zero."""
    c, P = model.config, model.P
    ints = np.zeros(256, "<i4")
    ints[:12] = [20240803, 3 if dtype == "float32" else 5, c.max_seq_len, c.vocab_size, c.num_layers, c.num_heads,
                 c.num_kv_heads, c.channels, c.multiple_of, int(c.use_scaled_rope), 3, 1]
    floats = np.zeros(256, "<f4")
    floats[:3] = [c.ffn_dim_multiplier, c.norm_eps, c.rope_theta]
    fc = np.stack([np.concatenate([P["fcw"][l], P["fcw2"][l]]) for l in range(c.num_layers)])
    zero = np.zeros_like                                     # +0.0 (0 * a negative weight would be -0.0)
    tensors = [P["wte"], P["wlmhead"], P["ln1w"], zero(P["ln1w"]), P["qkvw"], zero(P["qkvw"][..., 0]),
               P["attprojw"], zero(P["attprojw"][..., 0]), P["ln2w"], zero(P["ln2w"]), fc, zero(fc[..., 0]),
               P["fcprojw"], zero(P["fcprojw"][..., 0]), P["lnfw"], zero(P["lnfw"])]
    flat = np.concatenate([np.asarray(t, np.float32).ravel() for t in tensors])
    if dtype == "bfloat16":          # round to nearest even by hand: add 0x7FFF plus the kept lowest bit
        bits = flat.view("<u4").astype(np.uint64)
        flat = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return ints.tobytes() + floats.tobytes() + flat.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_file_is_llmc_layout_and_round_trips(tmp_path, dtype):
    model = m.llama3_init(TINY, seed=2)
    path = str(tmp_path / "llama.bin")
    m.write_model(path, model, dtype)
    assert open(path, "rb").read() == llmc_llama3_file_bytes(model, dtype)
    back = m.read_model(path)
    assert back.config == TINY, "ffn_dim_multiplier 1.3 and norm_eps 1e-5 survive their float32 slots"
    if dtype == "float32":
        np.testing.assert_array_equal(back.params, model.params)
    else:                            # bf16: 8 significant bits, rounded to nearest: relative error <= 2^-8
        np.testing.assert_allclose(back.params, model.params, rtol=2 ** -8, atol=0)
        assert not np.array_equal(back.params, model.params)
    assert m.model_config(path) == TINY


def test_model_file_refusals(tmp_path):
    model = m.llama3_init(TINY, seed=2)
    good = str(tmp_path / "good.bin")
    m.write_model(good, model)
    raw = open(good, "rb").read()
    cases = {"truncated": raw[:-4], "bad magic": b"\0\0\0\0" + raw[4:],
             "bias": raw[:2048 + 4 * (2 * 64 * 32 + 2 * 32)] + np.float32(0.5).tobytes()
             + raw[2048 + 4 * (2 * 64 * 32 + 2 * 32) + 4:]}            # the first element of ln1b
    messages = {"truncated": "holds", "bad magic": "bad magic", "bias": "not zero"}
    # the header's values a model cannot have (an infinite multiplier used to reach int() and end in
    # an internal error; an infinite norm_eps or rope_theta, or use_scaled_rope 7, trained)
    int_slot = lambda slot, value: raw[:4 * slot] + np.int32(value).tobytes() + raw[4 * slot + 4:]   # noqa: E731
    float_slot = lambda slot, value: (raw[:1024 + 4 * slot] + np.float32(value).tobytes()          # noqa: E731
                                      + raw[1024 + 4 * slot + 4:])
    for name, content in {"use_scaled_rope 7": int_slot(9, 7), "ffn multiplier inf": float_slot(0, np.inf),
                          "ffn multiplier 0": float_slot(0, 0), "ffn multiplier nan": float_slot(0, np.nan),
                          "norm_eps inf": float_slot(1, np.inf), "norm_eps -1": float_slot(1, -1),
                          "rope_theta inf": float_slot(2, np.inf), "rope_theta nan": float_slot(2, np.nan)}.items():
        cases[name], messages[name] = content, "impossible Llama 3 model header"
    for name, content in cases.items():
        path = tmp_path / f"{name.replace(' ', '_').replace('-', 'minus')}.bin"
        path.write_bytes(content)
        with pytest.raises(InputError, match=messages[name]):
            m.read_model(str(path))


def llmc_master_file_bytes(model, dtype):
    """llm.c master's train_llama3.py write_model, assembled here from its facts: ONE header of 256
    int32 (magic 20240803, version 3 or 5, block_size, vocab_size, n_layer, n_head, n_kv_head,
    n_embd, ffn_dim_multiplier, multiple_of, norm_eps, rope_theta, use_scaled_rope,
    max_gen_batch_size 4, major 3, minor 1; torch's int32 header truncates the floats), then wte,
    ln_1, c_attn, attn c_proj, ln_2, c_fc, c_fc2, mlp c_proj (each stacked over the layers), ln_f,
    lm_head: no second header, no biases."""
    c, P = model.config, model.P
    ints = np.zeros(256, "<i4")
    ints[:16] = [20240803, 3 if dtype == "float32" else 5, c.max_seq_len, c.vocab_size, c.num_layers, c.num_heads,
                 c.num_kv_heads, c.channels, math.trunc(c.ffn_dim_multiplier), c.multiple_of, math.trunc(c.norm_eps),
                 math.trunc(c.rope_theta), int(c.use_scaled_rope), 4, 3, 1]
    tensors = [P[name] for name in ("wte", "ln1w", "qkvw", "attprojw", "ln2w", "fcw", "fcw2", "fcprojw", "lnfw",
                                    "wlmhead")]
    flat = np.concatenate([np.asarray(t, np.float32).ravel() for t in tensors])
    if dtype == "bfloat16":
        flat = torch_bf16_bits(flat)
    return ints.tobytes() + flat.tobytes()


def torch_bf16_bits(flat):
    """float32 -> bf16 bit patterns as master's write_bf16 makes them (torch's conversion)."""
    torch = pytest.importorskip("torch")
    return torch.from_numpy(flat).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llmc_master_layout_reads_and_writes(tmp_path, dtype):
    """llm.c master's single-header layout: read (auto-detected: its Llama version sits in header
    slots 14-15), what its int header lost recovered (ffn_dim_multiplier 1.3 from H, H from the
    size, norm_eps 1e-5), and written byte for byte with layout=master."""
    model = m.llama3_init(TINY, seed=2)
    path = tmp_path / "master.bin"
    path.write_bytes(llmc_master_file_bytes(model, dtype))
    back = m.read_model(str(path))
    assert back.config == TINY and m.model_config(str(path)) == TINY
    if dtype == "float32":
        np.testing.assert_array_equal(back.params, model.params)
    else:
        np.testing.assert_allclose(back.params, model.params, rtol=2 ** -8, atol=0)
    written = str(tmp_path / "written.bin")
    m.write_model(written, model, dtype, layout=m.LLAMA3_LAYOUT_MASTER)
    assert open(written, "rb").read() == path.read_bytes()
    # and the other layout is still the default, and both read to the same model
    m.write_model(str(tmp_path / "branch.bin"), model, dtype)
    np.testing.assert_array_equal(m.read_model(str(tmp_path / "branch.bin")).params, back.params)


def test_llmc_master_layout_recovers_another_swiglu_width(tmp_path):
    """ffn_dim_multiplier 1.0 is stored as 1, like 1.3: H (96, not 1.3's 112) comes from the size."""
    config = m.LlamaConfig(**{**TINY.__dict__, "ffn_dim_multiplier": 1.0})
    assert config.hidden_dim == 96
    model = m.llama3_init(config, seed=3)
    path = tmp_path / "master.bin"
    path.write_bytes(llmc_master_file_bytes(model, "float32"))
    back = m.read_model(str(path))
    assert back.config.hidden_dim == 96
    np.testing.assert_array_equal(back.params, model.params)
    raw = path.read_bytes()
    for content, message in ((raw[:-4], "do not fit"), (raw[:56] + b"\0" * 8 + raw[64:], "Llama version")):
        path.write_bytes(content)                   # truncated; the version slots 14-15 zeroed
        with pytest.raises(InputError, match=message):
            m.read_model(str(path))


def test_llama3_shards_hold_uint32_tokens(tmp_path):
    from llmc import formats
    from llmc.dataloader import DataLoader
    tokens = np.arange(1000, dtype=np.int64) * 131 % 128256          # ids past uint16's 65535
    path = str(tmp_path / "llama_shard.bin")
    formats.write_shard(path, tokens, version=formats.LLAMA3_SHARD_VERSION)
    raw = open(path, "rb").read()
    assert np.frombuffer(raw[:12], "<i4").tolist() == [20240801, 7, 1000]
    assert len(raw) == 1024 + 4 * 1000 and np.array_equal(np.frombuffer(raw[1024:], "<u4"), tokens)
    np.testing.assert_array_equal(formats.read_shard(path), tokens)
    loader = DataLoader(path, 2, 8, vocab_size=128256)
    x, y = loader.next_batch()
    np.testing.assert_array_equal(x.ravel(), tokens[:16])
    np.testing.assert_array_equal(y.ravel(), tokens[1:17])
    with pytest.raises(InputError, match="outside the model's vocabulary"):
        DataLoader(path, 2, 8, vocab_size=50257)
    open(path, "ab").write(b"\0\0")
    with pytest.raises(InputError, match="truncated or corrupt"):
        formats.shard_num_tokens(path)


# ---------------------------------------------------------------------------- the trainer, as a user runs it

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# GPT-2's vocabulary (the real Shakespeare shards), otherwise tiny: 3.3M parameters, 3.2M of them
# the two (V,C) embeddings
SMALL = m.LlamaConfig(max_seq_len=64, vocab_size=50257, num_layers=2, num_heads=4, num_kv_heads=2, channels=32,
                      multiple_of=16)


def run(args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, "llama3_cpu.py")] + args, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def losses(stdout):
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]


@pytest.fixture(scope="module")
def shakespeare():
    train = os.path.join(ROOT, "data", "tinyshakespeare", "tiny_shakespeare_train.bin")
    if not os.path.exists(train):
        subprocess.run([sys.executable, os.path.join(ROOT, "dev", "data", "tinyshakespeare.py")], check=True)
    return train, train.replace("_train.bin", "_val.bin")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "small_llama3.bin"
    m.write_model(str(path), m.llama3_init(SMALL, seed=0))
    return str(path)


def test_training_on_shakespeare_lowers_val_loss(shakespeare, small_model, tmp_path):
    train, val = shakespeare
    out = run(["-e", small_model, "-i", train, "-j", val, "-b", "8", "-t", "32", "-x", "60", "-l", "3e-3",
               "-u", "5", "-v", "30", "-m", "8", "-s", "60", "-g", "16", "-o", str(tmp_path)])
    assert out.returncode == 0, out.stderr
    vals = [float(v) for v in re.findall(r"val loss ([0-9.]+)", out.stdout)]
    assert len(vals) == 3
    assert vals[0] > 10.5, "a fresh model is near ln(50257) = 10.8"
    assert vals[-1] < vals[0] - 3.0, f"validation loss should fall clearly, got {vals}"
    assert "generating:" in out.stdout and "NKV" not in out.stderr


def test_resume_equals_straight_run(shakespeare, small_model, tmp_path):
    """6 steps straight == 3 steps, checkpoint (a Llama 3 model file), resume, 3 more: the same losses."""
    train, _ = shakespeare
    common = ["-e", small_model, "-i", train, "-j", "", "-b", "2", "-t", "16", "-k", "constant", "-l", "1e-3",
              "-s", "0", "--shuffle", "1"]
    straight = run(common + ["-x", "6"])
    assert straight.returncode == 0, straight.stderr
    first = run(common + ["-x", "3", "-n", "3", "-o", str(tmp_path)])
    assert first.returncode == 0, first.stderr
    assert m.read_model(str(tmp_path / "model_00000003.bin")).config == SMALL
    second = run(common + ["-x", "6", "-o", str(tmp_path), "-y", "1"])
    assert second.returncode == 0, second.stderr
    assert losses(first.stdout) + losses(second.stdout) == losses(straight.stdout)
    assert len(losses(straight.stdout)) == 6


def test_command_line_errors_are_one_line(small_model):
    out = run(["-e", "llama3:d5", "-x", "1"])
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and "unknown model 'llama3:d5'" in out.stderr
    out = run(["-e", small_model, "-t", "65", "-x", "1"])
    assert out.returncode == 1 and "exceeds the model's max_seq_len 64" in out.stderr
