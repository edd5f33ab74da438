"""
doc/llama3.py: every number of doc/llama3.md (the four layers that change from GPT-2 to Llama 3).

What it is: the tutorial's checks, run on llama3_cpu.py's own functions, never on copies:
  1. RMSNorm: rmsnorm_backward's dinp and dweight against central finite differences in float64,
     and RMSNorm equal to LayerNorm (gpt2_cpu.layernorm_forward) on a row of mean zero;
  2. RoPE: rope_backward against finite differences, the rotation keeping every pair's length, a
     query-key score depending on the two positions' difference only, and how many of the 64
     frequency pairs of Llama 3.1 8B (HS = 128) the 3.1 scaling keeps, slows or blends;
  3. SwiGLU: swiglu_backward's two gradients and SiLU's derivative against finite differences,
     and the width H of Llama 3 8B's MLP (LlamaConfig.hidden_dim);
  4. grouped-query attention: repeat_kv_backward against finite differences, and the KV cache of
     Llama 3 8B per token, with its NKV = 8 key/value heads and as if it had NH = 32;
  5. the whole model: llama3_backward against finite differences on a few coordinates of every
     parameter tensor of a tiny float64 Llama 3.
What it is not: a test suite (tests/test_llama3_cpu.py is, with tolerances); here the errors are
printed for the text to quote.

Run:
    python doc/llama3.py
prints one `key = value` line per number doc/llama3.md quotes (e.g. `rmsnorm_dinp_err = 3.1e-10`).
Takes a few seconds on 2 CPU cores; it draws no figures. tests/test_docs.py checks that
doc/llama3.md quotes every number exactly as computed here.
"""

import math
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import numerical_grad, print_numbers, rel_err  # noqa: E402

import llama3_cpu as m  # noqa: E402
from gpt2_cpu import layernorm_forward  # noqa: E402

SEED = 1234
B, T, C = 2, 5, 8               # the layer checks' shapes: small enough for finite differences on every element
NH, NKV, HS = 4, 2, 6           # heads for RoPE and the K/V repeat
H = 7                           # SwiGLU width in the check
SHIFT = 37                      # positions added to both a query and a key in the relative-position check
BF16_BYTES = 2                  # a KV cache in bf16
KIB = 2 ** 10
# identities that hold up to rounding are quoted as "below EXACT_BOUND": rounding's own digits (or
# an exact 0) differ from CPU to CPU, the bound does not
EXACT_BOUND = 1e-12
FD_COORDS = 3                   # coordinates per parameter tensor in the whole-model check
TINY = m.LlamaConfig(max_seq_len=8, vocab_size=11, num_layers=2, num_heads=4, num_kv_heads=2, channels=8,
                     multiple_of=4)


def below(diff):
    """EXACT_BOUND as text if diff is below it (the identity holds), else diff itself (the text then fails)."""
    return f"{EXACT_BOUND:.0e}" if diff < EXACT_BOUND else f"{diff:.1e}"


def contracted(fn, R):
    """L = sum(fn() * R): a scalar whose gradient with respect to fn's output is exactly R."""
    return lambda: float((fn() * R).sum())


# ----------------------------------------------------------------------------
# 1. RMSNorm

def rmsnorm_numbers(rng):
    x, w, R = rng.standard_normal((B, T, C)), rng.standard_normal(C), rng.standard_normal((B, T, C))
    _, rstd = m.rmsnorm_forward(x, w, m.NORM_EPS)
    dw = np.zeros(C)
    dx = m.rmsnorm_backward(dw, R, x, w, rstd)
    loss = contracted(lambda: m.rmsnorm_forward(x, w, m.NORM_EPS)[0], R)
    # on a row of mean zero, RMSNorm is LayerNorm without its bias
    z = x - x.mean(axis=-1, keepdims=True)
    ln = layernorm_forward(z, w, np.zeros(C))[0]
    return {"rmsnorm_dinp_err": f"{rel_err(dx, numerical_grad(loss, x)):.1e}",
            "rmsnorm_dweight_err": f"{rel_err(dw, numerical_grad(loss, w)):.1e}",
            "rmsnorm_layernorm_below": below(np.abs(m.rmsnorm_forward(z, w, m.NORM_EPS)[0] - ln).max())}


# ----------------------------------------------------------------------------
# 2. RoPE

def rope_numbers(rng):
    cos, sin = m.precompute_freqs_cis(HS, T + SHIFT, m.ROPE_THETA, True)
    x, R = rng.standard_normal((B, T, NH, HS)), rng.standard_normal((B, T, NH, HS))
    out = m.rope_forward(x, cos[:T], sin[:T])
    dx = m.rope_backward(R, cos[:T], sin[:T])
    loss = contracted(lambda: m.rope_forward(x, cos[:T], sin[:T]), R)
    pair_len = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])             # noqa: E731  (B,T,nh,HS/2)
    # a query at position i and a key at position j, then both moved SHIFT positions on
    q, k = rng.standard_normal((1, 1, 1, HS)), rng.standard_normal((1, 1, 1, HS))
    i, j = 3, 1

    def score(pi, pj):
        qr = m.rope_forward(q, cos[pi:pi + 1], sin[pi:pi + 1])
        kr = m.rope_forward(k, cos[pj:pj + 1], sin[pj:pj + 1])
        return float((qr * kr).sum())
    # Llama 3.1's scaling on Llama 3 8B's 64 pairs: which are kept, slowed, blended
    HS8B = m.LLAMA3_8B.head_size
    base = m.rope_frequencies(HS8B, m.ROPE_THETA, False)
    scaled = m.rope_frequencies(HS8B, m.ROPE_THETA, True)
    kept = int((scaled == base).sum())
    slowed = int(np.isclose(scaled, base / m.ROPE_SCALE_FACTOR, rtol=0, atol=0).sum())
    wavelen_max = 2 * math.pi / base.min()
    return {"rope_dinp_err": f"{rel_err(dx, numerical_grad(loss, x)):.1e}",
            "rope_pair_length_below": below(np.abs(pair_len(out) - pair_len(x)).max()),
            "rope_relative_below": below(abs(score(i, j) - score(i + SHIFT, j + SHIFT))),
            "rope_score_moved": f"{score(i + SHIFT, j):.3f}", "rope_score": f"{score(i, j):.3f}",
            "rope_pairs": f"{HS8B // 2}", "rope_kept": f"{kept}", "rope_slowed": f"{slowed}",
            "rope_blended": f"{HS8B // 2 - kept - slowed}",
            "rope_longest_wavelength": f"{wavelen_max:,.0f}"}


# ----------------------------------------------------------------------------
# 3. SwiGLU

def swiglu_numbers(rng):
    a, b, R = rng.standard_normal((B, T, H)), rng.standard_normal((B, T, H)), rng.standard_normal((B, T, H))
    da, db = m.swiglu_backward(R, a, b)
    loss = contracted(lambda: m.swiglu_forward(a, b), R)
    x = np.linspace(-6, 6, 25)
    sig = 1 / (1 + np.exp(-x))
    silu_grad = sig * (1 + x * (1 - sig))                    # the formula of the text
    silu_fd = numerical_grad(lambda: float(m.silu(x).sum()), x)
    cfg = m.LLAMA3_8B
    return {"swiglu_dfch_err": f"{rel_err(da, numerical_grad(loss, a)):.1e}",
            "swiglu_dfch2_err": f"{rel_err(db, numerical_grad(loss, b)):.1e}",
            "silu_grad_err": f"{rel_err(silu_grad, silu_fd):.1e}",
            "silu_min": f"{m.silu(x).min():.3f}",
            "h_8b": f"{cfg.hidden_dim:,}", "c_8b": f"{cfg.channels:,}",
            "mlp_params_8b": f"{3 * cfg.channels * cfg.hidden_dim / 1e6:.1f}",
            "gelu_mlp_params_8b": f"{2 * cfg.channels * 4 * cfg.channels / 1e6:.1f}"}


# ----------------------------------------------------------------------------
# 4. grouped-query attention

def gqa_numbers(rng):
    n_rep = NH // NKV
    kv, R = rng.standard_normal((B, T, NKV, HS)), rng.standard_normal((B, T, NH, HS))
    dkv = m.repeat_kv_backward(R, n_rep)
    loss = contracted(lambda: m.repeat_kv_forward(kv, n_rep), R)
    cfg = m.LLAMA3_8B
    per_token = lambda nkv: 2 * cfg.num_layers * nkv * cfg.head_size * BF16_BYTES    # noqa: E731  k and v
    return {"repeat_kv_err": f"{rel_err(dkv, numerical_grad(loss, kv)):.1e}",
            "nh_8b": f"{cfg.num_heads}", "nkv_8b": f"{cfg.num_kv_heads}",
            "kv_token_gqa_kib": f"{per_token(cfg.num_kv_heads) // KIB}",
            "kv_token_mha_kib": f"{per_token(cfg.num_heads) // KIB}",
            "kv_8k_gqa_gib": f"{per_token(cfg.num_kv_heads) * cfg.max_seq_len / 2 ** 30:.0f}",
            "kv_8k_mha_gib": f"{per_token(cfg.num_heads) * cfg.max_seq_len / 2 ** 30:.0f}"}


# ----------------------------------------------------------------------------
# 5. the whole model

def model_numbers(rng):
    """llama3_backward against central differences of the mean loss, FD_COORDS random
    coordinates of each of the 10 parameter tensors, float64."""
    model = m.llama3_init(TINY, seed=SEED, dtype=np.float64)
    inputs, targets = rng.integers(0, TINY.vocab_size, (B, T)), rng.integers(0, TINY.vocab_size, (B, T))
    m.llama3_forward(model, inputs, targets)
    model.grads[...] = 0
    m.llama3_backward(model)
    analytic, numeric = [], []
    for name in m.PARAMETER_NAMES:
        view = model.P[name].reshape(-1)
        for i in rng.choice(view.size, FD_COORDS, replace=False):
            cell = view[i:i + 1]

            def loss():
                m.llama3_forward(model, inputs, targets)
                return model.mean_loss
            numeric.append(numerical_grad(loss, cell)[0])
            analytic.append(model.G[name].reshape(-1)[i])
    return {"model_grad_err": f"{rel_err(np.array(analytic), np.array(numeric)):.1e}",
            "model_coords": f"{len(analytic)}"}


def compute(fig_dir):
    """Every number doc/llama3.md quotes, {key: text}. fig_dir is unused: the tutorial has no figures."""
    rng = np.random.default_rng(SEED)
    numbers = {}
    for part in (rmsnorm_numbers, rope_numbers, swiglu_numbers, gqa_numbers, model_numbers):
        numbers.update(part(rng))
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
