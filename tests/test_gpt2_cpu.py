"""gpt2_cpu.py's algorithm outside the layers (tests/test_layers.py has those): model init, the
parameter count, AdamW against its textbook formula, the global norm, the schedules, the sampler
and generation, and the forward's input checks. The host infrastructure is tests/test_llmc.py."""

import math
import struct

import numpy as np
import pytest

import gpt2_cpu as g
from llmc import utils

TINY = g.GPT2Config(max_seq_len=16, vocab_size=50, padded_vocab_size=64, num_layers=2, num_heads=2, channels=8)


def header_ints(path, n=8):
    with open(path, "rb") as f:
        return struct.unpack("<256i", f.read(1024))[:n]


# ---------------------------------------------------------------------------- init and AdamW

def test_init_is_seeded_and_gpt2_shaped():
    cfg = g.GPT2Config(num_layers=4, num_heads=4, channels=64)
    a, b, c = g.gpt2_init(cfg, seed=7), g.gpt2_init(cfg, seed=7), g.gpt2_init(cfg, seed=8)
    np.testing.assert_array_equal(a.params, b.params)
    assert not np.array_equal(a.params, c.params)
    P = a.P
    assert abs(P["wte"][:cfg.vocab_size].std() - 0.02) < 0.001
    assert np.all(P["wte"][cfg.vocab_size:] == 0)
    assert abs(P["fcprojw"].std() - 0.02 / math.sqrt(2 * 4)) < 0.0005
    assert abs(P["qkvw"].std() - 0.02) < 0.0005
    assert np.all(P["ln1w"] == 1) and np.all(P["lnfw"] == 1)
    assert np.all(P["qkvb"] == 0) and np.all(P["ln2b"] == 0) and np.all(P["fcprojb"] == 0)


def test_parameter_count_gpt2_124M():
    cfg = g.config_from_descriptor("d12")
    assert g.num_elements(g.parameter_shapes(cfg)) == 124_475_904
    assert g.config_from_descriptor("124M") == cfg
    with pytest.raises(utils.InputError, match="unknown model"):
        g.config_from_descriptor("d13")


def adamw_reference(p, grad, m, v, lr, b1, b2, eps, wd, t, scale):
    """AdamW written straight from Loshchilov & Hutter, Alg. 2, in float64."""
    grad = grad * scale
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad ** 2
    mhat, vhat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return p - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p), m, v


def test_adamw_matches_formula_and_decays_only_weights():
    model = g.gpt2_init(TINY, seed=0, dtype=np.float64)
    rng = np.random.default_rng(1)
    p = model.params.copy()
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    decayed = np.zeros_like(p, dtype=bool)
    off = 0
    for name, shape in model.param_shapes:
        n = int(np.prod(shape))
        decayed[off:off + n] = name in g.DECAYED_PARAMETERS
        off += n
    for t in range(1, 4):
        model.grads[...] = rng.standard_normal(model.num_parameters)
        grad = model.grads.copy()
        g.gpt2_update(model, 1e-2, 0.9, 0.95, 1e-8, 0.1, t, grad_scale=0.5)
        p_dec, m_new, v_new = adamw_reference(p, grad, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, t, 0.5)
        p_nodec, _, _ = adamw_reference(p, grad, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.0, t, 0.5)
        p, m, v = np.where(decayed, p_dec, p_nodec), m_new, v_new
        np.testing.assert_allclose(model.params, p, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(model.m, m, rtol=1e-12)
        np.testing.assert_allclose(model.v, v, rtol=1e-12)


def test_grad_norm():
    model = g.gpt2_init(TINY, seed=0)
    model.grads[...] = np.random.default_rng(0).standard_normal(model.num_parameters).astype(np.float32)
    ref = np.sqrt((model.grads.astype(np.float64) ** 2).sum())
    assert abs(g.gpt2_grad_norm(model) - ref) / ref < 1e-6


# ---------------------------------------------------------------------------- schedules

def test_schedules():
    lr = 1e-3
    f = lambda s, k, w=10, n=100, q=0.1: g.learning_rate_at(s, k, lr, w, n, q)  # noqa: E731
    assert f(0, "cosine") == pytest.approx(lr / 10)           # warmup: (step+1)/warmup
    assert f(9, "cosine") == pytest.approx(lr)
    assert f(10, "cosine") == pytest.approx(lr)               # decay starts at the peak
    assert f(55, "cosine") == pytest.approx(0.1 * lr + 0.5 * (0.9 * lr))  # halfway: the mean of max and min
    assert f(100, "cosine") == pytest.approx(0.1 * lr)
    assert f(55, "linear") == pytest.approx(lr - 0.5 * 0.9 * lr)
    assert f(0, "constant") == lr and f(99, "constant") == lr
    assert f(50, "wsd") == lr and f(79, "wsd") == lr          # stable until the last 20%
    assert f(80, "wsd") == pytest.approx(lr)
    assert f(90, "wsd") == pytest.approx(0.1 * lr + (1 - math.sqrt(0.5)) * 0.9 * lr)
    assert f(100, "wsd") == pytest.approx(0.1 * lr)
    with pytest.raises(utils.InputError):
        f(0, "exponential")


# ---------------------------------------------------------------------------- sampler

def test_sampler_rng_is_xorshift_star():
    rng = g.SamplerRNG(1337)
    # xorshift64* by hand for the first draw
    s = 1337
    s ^= s >> 12
    s ^= (s << 25) & (2 ** 64 - 1)
    s ^= s >> 27
    assert rng.random_u32() == ((s * 0x2545F4914F6CDD1D) % 2 ** 64) >> 32
    f = [g.SamplerRNG(5).random_f32() for _ in range(3)]
    assert f[0] == f[1] == f[2] and 0 <= f[0] < 1


def test_sample_token_distribution_and_topk():
    V = 6
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125, 0.0, 0.0, 9.0]) + 1e-12)   # Vp=7, last padded
    rng = g.SamplerRNG(42)
    draws = np.array([g.sample_token(logits, V, rng) for _ in range(4000)])
    assert draws.max() < 4, "padded and zero-probability tokens are never drawn"
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, [0.5, 0.25, 0.125, 0.125], atol=0.03)
    draws_k = {g.sample_token(logits, V, rng, top_k=2) for _ in range(300)}
    assert draws_k == {0, 1}
    draws_cold = {g.sample_token(logits, V, rng, temperature=0.01) for _ in range(100)}
    assert draws_cold == {0}


def test_generate_is_deterministic():
    model = g.gpt2_init(TINY, seed=0)
    a = g.generate(model, [1, 2], 6, g.SamplerRNG(7))
    b = g.generate(model, [1, 2], 6, g.SamplerRNG(7))
    c = g.generate(model, [1, 2], 6, g.SamplerRNG(8))
    assert a == b and len(a) == 6 and all(0 <= t < TINY.vocab_size for t in a)
    assert a != c
    with pytest.raises(utils.InputError, match="longer than max_seq_len"):
        g.generate(model, [1] * 17, 1, g.SamplerRNG(7))


def test_forward_rejects_bad_tokens_and_length():
    model = g.gpt2_init(TINY, seed=0)
    with pytest.raises(utils.InputError, match="exceeds"):
        g.gpt2_forward(model, np.zeros((1, 17), np.int32))
    with pytest.raises(utils.InputError, match="out of range"):
        g.gpt2_forward(model, np.full((1, 3), 50, np.int32))
