"""
doc/lora.py: every number of doc/lora.md (LoRA: fine-tuning a frozen model through low-rank adapters).

What it is: the tutorial's checks, run on gpt2_cpu.py's own functions (lora_forward,
lora_backward, the LoRA parameter table, lora_init, lora_merge, adamw_update), never on copies:
  1. the forward: the adapter's two thin products equal the product with the merged matrix
     W + scale B A, and a fresh adapter (B = 0) changes nothing;
  2. the backward: lora_backward's dinp, dlora_a, dlora_b against central finite differences in
     float64, and the frozen W's gradient, which the backward never computes;
  3. what freezing saves: the multiply-adds of a training step and the bytes per parameter, for
     GPT-2 124M (d12) with rank-8 adapters on c_attn, PEFT's default;
  4. the scale alpha / r: the change one Adam step of fresh adapters makes to a layer's output,
     for several ranks, with the scale alpha / r and with alpha alone;
  5. the whole model: a tiny float64 GPT-2's adapter gradients (the model frozen) against finite
     differences, and the merged model's logits against the adapted one's.
What it is not: a test suite (tests/test_lora.py is, with tolerances); here the values are
printed for the text to quote.

Run:
    python doc/lora.py
prints one `key = value` line per number doc/lora.md quotes. Takes a few seconds on 2 CPU cores;
it draws no figures. tests/test_docs.py checks that doc/lora.md quotes every number exactly as
computed here.
"""

import math
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import numerical_grad, print_numbers, rel_err  # noqa: E402

import gpt2_cpu as g  # noqa: E402
from llmc import lora as lora_files  # noqa: E402

SEED = 1234
B, T, C, OC, R = 2, 5, 6, 4, 2         # the layer checks' shapes: finite differences on every element
SCALE = 1.5                            # alpha / r of the layer checks
EXACT_BOUND = 1e-12                    # identities that hold up to rounding are quoted as "below" this
# 3: GPT-2 124M with PEFT's default adapters
D12 = g.config_from_descriptor("d12")
RANK_DEFAULT = 8                       # PEFT's LoraConfig r
TOKENS = 1024                          # tokens of one sequence, for the multiply-adds per step
BYTES_FULL = {"parameters (bf16)": 2, "gradients (bf16)": 2, "AdamW m (fp32)": 4, "AdamW v (fp32)": 4,
              "master weights (fp32)": 4}  # gpt2_cuda.py's bf16 training, per parameter
# 4: the scale experiment: one linear layer, one Adam step from fresh adapters
SCALE_C, SCALE_ALPHA, SCALE_LR = 256, 8.0, 1e-3
SCALE_RANKS = (4, 16, 64)
SCALE_TOKENS = (1, 64)                 # one token (the r terms of the update add coherently), a batch of 64
SCALE_TRIALS = 16                      # each change averaged over this many draws (seeds SEED, SEED+1, ...)
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = g.ADAMW_BETA1, g.ADAMW_BETA2, g.ADAMW_EPS
# 5: the whole tiny model
TINY = g.GPT2Config(max_seq_len=8, vocab_size=11, padded_vocab_size=128, num_layers=2, num_heads=2, channels=8)
FD_COORDS = 4                          # coordinates per adapter tensor in the whole-model check


def below(diff):
    """EXACT_BOUND as text if diff is below it (the identity holds), else diff itself (the text then fails)."""
    return f"{EXACT_BOUND:.0e}" if diff < EXACT_BOUND else f"{diff:.1e}"


# ----------------------------------------------------------------------------
# 1. the forward

def forward_numbers(rng):
    x, W = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C))
    a, b = rng.standard_normal((R, C)), rng.standard_normal((OC, R))
    out = g.matmul_forward(x, W, None) + g.lora_forward(x, a, b, SCALE)[0]
    merged = g.matmul_forward(x, W + SCALE * b @ a, None)
    fresh = g.lora_forward(x, a, np.zeros_like(b), SCALE)[0]
    c_attn = g.lora_targets(D12)[0]                          # d12's qkv projection, 768 -> 2304
    return {"merged_forward_below": below(rel_err(out, merged)), "fresh_delta_max": f"{np.abs(fresh).max():.1f}",
            "c_attn_macs": f"{c_attn.out_features * c_attn.in_features:,}",
            "c_attn_lora_macs": f"{RANK_DEFAULT * (c_attn.in_features + c_attn.out_features):,}"}


# ----------------------------------------------------------------------------
# 2. the backward

def backward_numbers(rng):
    x, a, b = rng.standard_normal((B, T, C)), rng.standard_normal((R, C)), rng.standard_normal((OC, R))
    dout = rng.standard_normal((B, T, OC))                    # L = sum(out * dout): dL/dout = dout

    def loss():
        return float((g.lora_forward(x, a, b, SCALE)[0] * dout).sum())
    _, h = g.lora_forward(x, a, b, SCALE)
    da, db = np.zeros_like(a), np.zeros_like(b)
    dinp = g.lora_backward(da, db, dout, x, h, a, b, SCALE)
    return {"lora_dinp_err": f"{rel_err(dinp, numerical_grad(loss, x)):.1e}",
            "lora_da_err": f"{rel_err(da, numerical_grad(loss, a)):.1e}",
            "lora_db_err": f"{rel_err(db, numerical_grad(loss, b)):.1e}"}


# ----------------------------------------------------------------------------
# 3. what freezing saves

def savings_numbers():
    """Multiply-adds of the linear layers per token (forward: each W once; a full backward: each W
    twice, dinp and dW; a frozen one: dinp only) and bytes per parameter, for d12."""
    C, L, Vp = D12.channels, D12.num_layers, D12.padded_vocab_size
    per_layer = 3 * C * C + C * C + 4 * C * C + 4 * C * C      # qkv, attproj, fc, fcproj
    forward = L * per_layer + Vp * C                           # and the classifier
    targets = lora_files.select_targets(None, g.lora_targets(D12), g.LORA_FAMILY.default_targets)
    lora = g.LoRA(targets, L, RANK_DEFAULT, RANK_DEFAULT)
    adapter_forward = sum(RANK_DEFAULT * (t.in_features + t.out_features) for t in targets) * L
    # per adapter, the forward's two products and the backward's four (dh, dinp, dA, dB)
    full, frozen = 3 * forward, 2 * forward + 3 * adapter_forward
    model = g.num_elements(g.parameter_shapes(D12))
    full_bytes = sum(BYTES_FULL.values()) * model
    lora_bytes = BYTES_FULL["parameters (bf16)"] * model + sum(BYTES_FULL.values()) * lora.num_parameters
    return {"d12_params": f"{model:,}", "d12_lora_params": f"{lora.num_parameters:,}",
            "d12_lora_share": f"{100 * lora.num_parameters / model:.2f}", "d12_macs_ratio": f"{frozen / full:.3f}",
            "bytes_full": f"{sum(BYTES_FULL.values())}", "d12_state_full_gib": f"{full_bytes / 2**30:.2f}",
            "d12_state_lora_gib": f"{lora_bytes / 2**30:.2f}"}


# ----------------------------------------------------------------------------
# 4. the scale alpha / r

def first_step_change(rng_seed, rank, scale, N):
    """The RMS change of a linear layer's output over a batch of N random tokens after one Adam step
    of fresh adapters (lora_init: A kaiming-uniform, B = 0) of `rank`, `scale`, on the loss
    0.5 |out - y|^2 with random targets y."""
    rng = np.random.default_rng(rng_seed)
    x, y = rng.standard_normal((1, N, SCALE_C)), rng.standard_normal((1, N, SCALE_C))
    W = rng.standard_normal((SCALE_C, SCALE_C)) / math.sqrt(SCALE_C)
    target = lora_files.LoraTarget("layer", "w", slice(0, SCALE_C), SCALE_C)
    lora = g.lora_init([target], 1, rank, scale * rank, seed=rng_seed)
    a, b = (lora.P[name][0].astype(np.float64) for name in lora_files.lora_tensor_names(target))
    delta, h = g.lora_forward(x, a, b, scale)
    dout = g.matmul_forward(x, W, None) + delta - y              # d(0.5 |out - y|^2) / d out
    da, db = np.zeros_like(a), np.zeros_like(b)
    g.lora_backward(da, db, dout, x, h, a, b, scale)
    m, v = np.zeros_like(b), np.zeros_like(b)
    g.adamw_update(b.reshape(-1), db.reshape(-1), m.reshape(-1), v.reshape(-1), SCALE_LR, ADAM_BETA1, ADAM_BETA2,
                   ADAM_EPS, 0.0, 1)                             # B's first step (A's gradient is 0: B was 0)
    return float(np.sqrt((g.lora_forward(x, a, b, scale)[0] ** 2).mean()))


def scale_numbers():
    """For N = 1 and 64 tokens, the first step's change at each rank (the mean of SCALE_TRIALS draws)
    with scale alpha / r and with alpha, and the ratio of the largest rank's to the smallest's."""
    numbers = {}
    for N in SCALE_TOKENS:
        for label, scale_of in (("alpha_over_r", lambda r: SCALE_ALPHA / r), ("alpha", lambda r: SCALE_ALPHA)):
            changes = [np.mean([first_step_change(SEED + k, r, scale_of(r), N) for k in range(SCALE_TRIALS)])
                       for r in SCALE_RANKS]
            for r, change in zip(SCALE_RANKS, changes):
                numbers[f"step_n{N}_{label}_r{r}"] = f"{change:.2e}"
            numbers[f"step_n{N}_{label}_ratio"] = f"{changes[-1] / changes[0]:.2f}"
    return numbers


# ----------------------------------------------------------------------------
# 5. the whole model

def model_numbers(rng):
    model = g.gpt2_init(TINY, seed=SEED, dtype=np.float64)
    model.params += rng.standard_normal(model.num_parameters) * 0.1
    model.lora = g.LoRA(g.lora_targets(TINY), TINY.num_layers, 2, 3.0, dtype=np.float64)
    model.lora.params[...] = rng.standard_normal(model.lora.num_parameters) * 0.3
    g.freeze(model)
    inputs, targets = rng.integers(0, TINY.vocab_size, (B, T)), rng.integers(0, TINY.vocab_size, (B, T))
    adapted = g.gpt2_forward(model, inputs, targets).copy()
    g.gpt2_zero_grad(model.lora)
    g.gpt2_backward(model)
    analytic, numeric = [], []
    for name, _ in model.lora.param_shapes:
        view = model.lora.P[name].reshape(-1)
        for i in rng.choice(view.size, FD_COORDS, replace=False):
            cell = view[i:i + 1]

            def loss():
                g.gpt2_forward(model, inputs, targets)
                return model.mean_loss
            numeric.append(numerical_grad(loss, cell)[0])
            analytic.append(model.lora.G[name].reshape(-1)[i])
    lora, model.lora = model.lora, None
    g.lora_merge(model.P, lora)
    merged = g.gpt2_forward(model, inputs, targets)
    return {"model_grad_err": f"{rel_err(np.array(analytic), np.array(numeric)):.1e}",
            "model_coords": f"{len(analytic)}", "merged_logits_below": below(rel_err(merged, adapted))}


def compute(fig_dir):
    """Every number doc/lora.md quotes, {key: text}. fig_dir is unused: the tutorial has no figures."""
    rng = np.random.default_rng(SEED)
    numbers = {}
    numbers.update(forward_numbers(rng))
    numbers.update(backward_numbers(rng))
    numbers.update(savings_numbers())
    numbers.update(scale_numbers())
    numbers.update(model_numbers(rng))
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
