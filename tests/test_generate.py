"""Tests of generation with a KV cache (issue 12, "Fast generation"): gpt2_cpu's
attention_forward_cached, gpt2_forward_cached (the forward with a KV cache) and generate, and gpt2_cuda's counterparts run
on the emulated CUDA device (tests/emulated_gpu.py's fixture: the real kernels on the CPU).
Each test computes the same thing two ways and compares:
- the cached attention and forward against the full ones (attention_forward, gpt2_forward), the
  logits at every step, tolerances from llmc.check.TOLERANCES (reference_fp32 / reference_fp64:
  two computations of the same logits in another summation order);
- generate with the cache against generate without it (kv_cache=False, the full forward over the
  window at every step): the same tokens under the same seed, and the logits each token was drawn
  from, at every step; with a tiny maxT the context slides, and the cache is recomputed;
- gpt2_cuda's cached forward and generate, on the emulated device, against gpt2_cpu's.
Run: pytest tests/test_generate.py   (a few seconds on 2 cores once the emulated kernels are built)
"""

import numpy as np
import pytest

import gpt2_cpu as g
import gpt2_cuda
from llmc.check import check_against
from llmc.utils import InputError
from emulated_gpu import emulated_gpu  # noqa: F401  (a fixture: the emulated CUDA device)

# small models; SLIDE's maxT = 8 makes the context slide within a dozen tokens. HS = 16 fits the
# CUDA kernels' 16-byte vectors in bf16 too (8 values).
TINY = g.GPT2Config(max_seq_len=16, vocab_size=50, padded_vocab_size=64, num_layers=2, num_heads=2, channels=8)
SLIDE = g.GPT2Config(max_seq_len=8, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2, channels=32)
LOGITS_TOLERANCE = {np.float32: "reference_fp32", np.float64: "reference_fp64"}   # llmc.check.TOLERANCES groups


def sampling_model(config, seed=0, dtype=np.float32):
    """A random-init model whose logits spread over a few units (wte scaled up), so that the draws
    are neither uniform nor always the same token (as tests/test_cuda.py's _gen_model; scaled by
    10 or more, these models repeat one token)."""
    model = g.gpt2_init(config, seed, dtype)
    model.P["wte"] *= 3.0
    return model


def recorded_generate(monkeypatch, model, prompt, n, seed, **kwargs):
    """generate(...) -> (ids, the logits row each token was drawn from), via sample_token."""
    rows = []
    sample_token = g.sample_token

    def recording(logits, *args):
        rows.append(np.array(logits, dtype=np.float64))
        return sample_token(logits, *args)
    monkeypatch.setattr(g, "sample_token", recording)
    ids = g.generate(model, prompt, n, g.SamplerRNG(seed), **kwargs)
    monkeypatch.setattr(g, "sample_token", sample_token)
    return ids, rows


# ---------------------------------------------------------------------------- gpt2_cpu

def test_attention_forward_cached_matches_attention_forward():
    # a prefill of 3 positions, one of 2 at pos 3 (the mask with an offset), then one row at a time
    B, T, NH, HS = 2, 9, 2, 4
    qkv = np.random.default_rng(0).standard_normal((B, T, 3 * NH * HS))
    ref, _ = g.attention_forward(qkv, NH)                                    # (B,T,C)
    k_cache, v_cache = np.zeros((2, B, NH, 16, HS)), np.zeros((2, B, NH, 16, HS))
    out = []
    for start, stop in [(0, 3), (3, 5)] + [(t, t + 1) for t in range(5, T)]:
        out.append(g.attention_forward_cached(qkv[:, start:stop], k_cache[0], v_cache[0], start, NH))
    assert check_against(np.concatenate(out, axis=1), ref, "attention, cached", "reference_fp64", "logits")
    q, k, v = g.split_heads(qkv, NH)
    np.testing.assert_array_equal(k_cache[0][:, :, :T], k)                   # the cache holds every key
    np.testing.assert_array_equal(v_cache[0][:, :, :T], v)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("prompt_length", [1, 5])
def test_forward_cached_matches_full_forward_at_every_step(dtype, prompt_length):
    model = g.gpt2_init(TINY, 0, dtype)
    x = np.random.default_rng(1).integers(0, TINY.vocab_size, (1, TINY.max_seq_len)).astype(np.int32)
    ref = g.gpt2_forward(model, x).copy()                  # (1,maxT,Vp): row t is the logits after x[:, :t+1]
    cache = g.kv_cache_new(TINY, 1, dtype)
    logits = g.gpt2_forward_cached(model, x[:, :prompt_length], cache)
    assert logits.shape == (1, TINY.padded_vocab_size) and cache.length == prompt_length
    assert check_against(logits, ref[:, prompt_length - 1], "prefill", LOGITS_TOLERANCE[dtype], "logits")
    for t in range(prompt_length, TINY.max_seq_len):
        logits = g.gpt2_forward_cached(model, x[:, t:t + 1], cache)
        assert check_against(logits, ref[:, t], f"position {t}", LOGITS_TOLERANCE[dtype], "logits", verbose=False)
    assert cache.length == TINY.max_seq_len


def test_forward_cached_rejects_overflow_and_bad_tokens():
    model = g.gpt2_init(TINY, 0)
    cache = g.kv_cache_new(TINY, 1)
    g.gpt2_forward_cached(model, np.zeros((1, TINY.max_seq_len), np.int32), cache)
    with pytest.raises(InputError, match="max_seq_len"):
        g.gpt2_forward_cached(model, np.zeros((1, 1), np.int32), cache)       # a full cache takes no more
    with pytest.raises(InputError, match="out of range"):
        g.gpt2_forward_cached(model, np.full((1, 1), TINY.vocab_size, np.int32), g.kv_cache_new(TINY, 1))


@pytest.mark.parametrize("config,prompt,n,temperature,top_k", [
    (TINY, [1, 2], 6, 1.0, 0),
    (TINY, [7], 15, 1.0, 0),               # up to maxT exactly, no slide
    (SLIDE, [3, 4, 5], 20, 1.0, 0),        # slides from the 6th token on: the cache is recomputed
    (SLIDE, [9] * 8, 6, 0.8, 20),          # a prompt of maxT tokens: every token recomputes
    (SLIDE, [1], 30, 1.3, 5),
])
def test_generate_with_cache_gives_the_same_tokens_as_without(monkeypatch, config, prompt, n, temperature, top_k):
    model = sampling_model(config)
    ids, rows = recorded_generate(monkeypatch, model, prompt, n, 7, temperature=temperature, top_k=top_k)
    ref_ids, ref_rows = recorded_generate(monkeypatch, model, prompt, n, 7, temperature=temperature, top_k=top_k,
                                          kv_cache=False)
    assert ids == ref_ids and len(ids) == n and len(set(ids)) > 1
    assert len(rows) == len(ref_rows) == n
    for t, (row, ref) in enumerate(zip(rows, ref_rows)):
        assert check_against(row, ref, f"token {t}", "reference_fp32", "logits", verbose=False), f"token {t}"


def test_sliding_recomputes_the_cache_from_the_last_window():
    # prompt of 3, maxT 8: tokens 1..5 run alone (cache lengths 3 -> 8); from token 6 on the
    # context slides, and each token is a prefill of the last 8 tokens into an emptied cache
    model = sampling_model(SLIDE)
    forward = g.sampling_forward(model)
    calls = []

    def cached(x, cache):
        calls.append((cache.length, x.shape[1], x[0].tolist()))
        return forward.cached(x, cache)
    counting = g.SamplingForward(full=forward.full, cached=cached, new_cache=forward.new_cache)
    prompt = [3, 4, 5]
    ids = g.generate(model, prompt, 12, g.SamplerRNG(7), forward=counting)
    tokens = prompt + ids
    assert [(length, T) for length, T, _ in calls] == [(0, 3)] + [(n, 1) for n in range(3, 8)] + [(0, 8)] * 6
    for i, (_, T, x) in enumerate(calls):             # each call's tokens: the last window's
        context = tokens[:len(prompt) + i][-SLIDE.max_seq_len:]
        assert x == (context if T > 1 else context[-1:])
    assert ids == g.generate(model, prompt, 12, g.SamplerRNG(7), kv_cache=False)


def test_plain_forward_runs_the_full_window_path():
    # a plain function as forward (how callers passed it before the cache) is the full forward
    model = sampling_model(SLIDE)
    windows = []

    def forward(x):
        windows.append(x.shape)
        return g.gpt2_forward(model, x)
    ids = g.generate(model, [2, 3], 10, g.SamplerRNG(3), forward=forward)
    assert windows == [(1, SLIDE.max_seq_len)] * 10
    assert ids == g.generate(model, [2, 3], 10, g.SamplerRNG(3))
    assert g.sampling_forward(model)(np.zeros((1, 4), np.int32)).shape == (1, 4, SLIDE.padded_vocab_size)


# ---------------------------------------------------------------------------- gpt2_cuda, emulated

def gpu_model(cpu, precision):
    model = gpt2_cuda.GPT2(cpu.config, precision, recompute=True)
    gpt2_cuda.upload_parameters(model, cpu.params)
    return model


@pytest.mark.parametrize("precision,group", [("fp32", "reference_fp32"), ("bf16", "cuda_bf16")])
def test_emulated_forward_cached_matches_gpt2_cpu(emulated_gpu, precision, group):  # noqa: F811
    # fp32: the same arithmetic as gpt2_cpu up to summation order. bf16: every stored activation
    # is rounded to bf16, the cache and the attention stay fp32
    cpu = sampling_model(SLIDE)
    model = gpu_model(cpu, precision)
    x = np.random.default_rng(2).integers(0, SLIDE.vocab_size, (1, SLIDE.max_seq_len)).astype(np.int32)
    cache, cpu_cache = gpt2_cuda.kv_cache_new(SLIDE, 1), g.kv_cache_new(SLIDE, 1)
    for start, stop in [(0, 3)] + [(t, t + 1) for t in range(3, SLIDE.max_seq_len)]:
        logits = gpt2_cuda.gpt2_forward_cached(model, x[:, start:stop], cache)
        ref = g.gpt2_forward_cached(cpu, x[:, start:stop], cpu_cache)
        assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == ref.shape
        assert check_against(logits, ref, f"positions {start}..{stop - 1}", group, "logits")
    assert cache.length == cpu_cache.length == SLIDE.max_seq_len
    assert check_against(cache.k.get(), cpu_cache.k, "k cache", group, "logits")
    assert check_against(cache.v.get(), cpu_cache.v, "v cache", group, "logits")
    with pytest.raises(InputError, match="max_seq_len"):
        gpt2_cuda.gpt2_forward_cached(model, x[:, :1], cache)


@pytest.mark.parametrize("prompt,n", [([3, 4, 5], 14), ([1], 9)])
def test_emulated_generate_with_cache_matches_gpt2_cpu(emulated_gpu, monkeypatch, prompt, n):  # noqa: F811
    # gpt2_cuda.sampling_forward runs the cached path (counted), sliding past maxT in the first
    # case, and draws the tokens gpt2_cpu draws with and without its cache
    cpu = sampling_model(SLIDE)
    model = gpu_model(cpu, "fp32")
    calls = []
    forward = gpt2_cuda.gpt2_forward_cached

    def counting(model, x, cache):
        calls.append(x.shape[1])
        return forward(model, x, cache)
    monkeypatch.setattr(gpt2_cuda, "gpt2_forward_cached", counting)
    ids = g.generate(model, prompt, n, g.SamplerRNG(11), 0.9, 40, forward=gpt2_cuda.sampling_forward(model))
    assert len(calls) == n and calls[0] == len(prompt) and calls[1] == 1
    assert ids == g.generate(cpu, prompt, n, g.SamplerRNG(11), 0.9, 40)
    assert ids == g.generate(cpu, prompt, n, g.SamplerRNG(11), 0.9, 40, kv_cache=False)
    full = g.generate(model, prompt, n, g.SamplerRNG(11), 0.9, 40, forward=gpt2_cuda.sampling_forward(model),
                      kv_cache=False)                                      # gpt2_cuda's full-window path
    assert ids == full and len(set(ids)) > 1 and len(calls) == n
