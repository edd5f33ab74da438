"""
doc/adamw.py: the experiments behind doc/adamw.md (AdamW, weight decay, clipping, schedules,
gradient accumulation), computed with gpt2_cpu.py's own functions.

What it is: compute(fig_dir) runs each experiment the tutorial quotes, draws its figures into
fig_dir and returns every quoted number as text, formatted exactly as doc/adamw.md writes it
(tests/test_docs.py checks that the two agree). What it is not: a benchmark or a training run;
the model is a tiny float64 GPT-2, so every comparison is limited by float64 rounding only.

Run it from the repository root (about a second on 2 CPU cores):
    python doc/adamw.py
prints one `key = value` line per quoted number, e.g.
    accum_maxdiff = 6.9e-17
and redraws doc/adamw_schedules.png and doc/adamw_bias_correction.png.

Dimension legend: B batch size, T sequence length, C channels, V vocabulary, Vp padded
vocabulary, L layers, NH heads, maxT longest sequence.
"""

import math
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import print_numbers, pyplot, save_figure  # noqa: E402

from gpt2_cpu import (ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, DECAYED_PARAMETERS, LR_SCHEDULES,  # noqa: E402
                      GPT2Config, gpt2_backward, gpt2_forward, gpt2_grad_norm, gpt2_init,
                      gpt2_update, gpt2_zero_grad, learning_rate_at)

# ----------------------------------------------------------------------------
# the tiny model and its data

# small enough that a forward+backward takes milliseconds, big enough to have every parameter
# kind: V=60 padded to Vp=64, L=2, NH=2, C=16 (HS=8), maxT=16
TINY = GPT2Config(max_seq_len=16, vocab_size=60, padded_vocab_size=64, num_layers=2, num_heads=2, channels=16)
MODEL_SEED = 42
DATA_SEED = 1234
B, T = 4, 8                     # one micro-batch; the "big" batch is 2B
GRAD_CLIP = 1.0                 # gpt2_cpu.py's --grad-clip default
LEARNING_RATE = 1e-3            # for the update check: large enough to move every parameter visibly
WEIGHT_DECAY = 0.1              # GPT-3's value (Brown et al. 2020, appendix B)

# the schedule figure: llm.c-like settings, shortened to 1000 steps
SCHEDULE_LR = 6e-4
SCHEDULE_STEPS = 1000
SCHEDULE_WARMUP = 100
SCHEDULE_FINAL_FRAC = 0.1

# GPT-2 small (d12) for the weight-decay census; GPT2Config's defaults are maxT=1024, Vp=50304
D12 = GPT2Config(num_layers=12, num_heads=12, channels=768)


def batches(rng, num_sequences):
    """num_sequences random token sequences: inputs (N,T) and targets (N,T), the same shifted by one."""
    tokens = rng.integers(0, TINY.vocab_size, size=(num_sequences, T + 1))   # (N, T+1)
    return tokens[:, :-1], tokens[:, 1:]


def gradient(model, inputs, targets, loss_scale=1.0):
    """Accumulate loss_scale * d(mean loss)/d(params) of one micro-batch into model.grads."""
    gpt2_forward(model, inputs, targets)
    gpt2_backward(model, loss_scale)


# ----------------------------------------------------------------------------
# experiment 1: gradient accumulation is exact with loss_scale = 1/n

def accumulation_experiment():
    model = gpt2_init(TINY, seed=MODEL_SEED, dtype=np.float64)
    x, y = batches(np.random.default_rng(DATA_SEED), 2 * B)                  # (2B,T) each

    gpt2_zero_grad(model)
    gradient(model, x, y)                                                      # one batch of 2B
    full = model.grads.copy()                                                  # (num_parameters,)

    gpt2_zero_grad(model)
    gradient(model, x[:B], y[:B], loss_scale=0.5)                              # two micro-batches of B
    gradient(model, x[B:], y[B:], loss_scale=0.5)
    accumulated = model.grads.copy()

    gpt2_zero_grad(model)
    gradient(model, x[:B], y[:B])                                              # the mistake: loss_scale 1
    gradient(model, x[B:], y[B:])
    unscaled = model.grads.copy()

    return {
        "accum_maxdiff": f"{np.abs(full - accumulated).max():.1e}",
        "accum_maxgrad": f"{np.abs(full).max():.3f}",
        "accum_unscaled_ratio": f"{np.linalg.norm(unscaled) / np.linalg.norm(full):.6f}",
    }


# ----------------------------------------------------------------------------
# experiment 2: clipping and one AdamW step, by hand

def adamw_by_hand(p, grad, m, v, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale):
    """Loshchilov & Hutter 2019 Alg. 2 with Kingma & Ba's bias correction, one tensor, returning
    new (p, m, v). Written independently of gpt2_cpu.gpt2_update, to check it."""
    g = grad_scale * grad
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1 ** t)
    v_hat = v / (1 - beta2 ** t)
    p = p - learning_rate * (m_hat / (np.sqrt(v_hat) + eps) + weight_decay * p)
    return p, m, v


def update_experiment():
    model = gpt2_init(TINY, seed=MODEL_SEED, dtype=np.float64)
    rng = np.random.default_rng(DATA_SEED)
    names = list(model.P)
    hand_p = {name: model.P[name].copy() for name in names}
    hand_m = {name: np.zeros_like(hand_p[name]) for name in names}
    hand_v = {name: np.zeros_like(hand_p[name]) for name in names}
    record = {}
    for t in (1, 2):                                   # two steps: the second uses m, v of the first
        x, y = batches(rng, B)
        gpt2_zero_grad(model)
        gradient(model, x, y)
        norm = gpt2_grad_norm(model)
        grad_scale = GRAD_CLIP / norm if norm > GRAD_CLIP else 1.0
        record[t] = (norm, grad_scale)
        for name in names:
            wd = WEIGHT_DECAY if name in DECAYED_PARAMETERS else 0.0
            hand_p[name], hand_m[name], hand_v[name] = adamw_by_hand(
                hand_p[name], model.G[name], hand_m[name], hand_v[name],
                LEARNING_RATE, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, wd, t, grad_scale)
        gpt2_update(model, LEARNING_RATE, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, WEIGHT_DECAY, t, grad_scale)

    maxdiff = max(float(np.abs(model.P[name] - hand_p[name]).max()) for name in names)
    moved = np.abs(model.params - gpt2_init(TINY, seed=MODEL_SEED, dtype=np.float64).params)
    norm1, scale1 = record[1]
    return {
        "update_lr": f"{LEARNING_RATE:g}",
        "update_wd": f"{WEIGHT_DECAY:g}",
        "clip_max_norm": f"{GRAD_CLIP:g}",
        "clip_norm": f"{norm1:.4f}",
        "clip_scale": f"{scale1:.4f}",
        "update_maxdiff": f"{maxdiff:.1e}",
        "update_maxmove": f"{moved.max():.2e}",
        "update_medianmove": f"{np.median(moved):.2e}",
    }


# ----------------------------------------------------------------------------
# which parameters decay: a census of GPT-2 small

def parameter_counts(config):
    """(decayed, not decayed) parameter counts of a GPT-2, from its shape: the matmul weights and
    the two embeddings decay; biases and LayerNorm weights/biases do not."""
    Vp, C, L, maxT = config.padded_vocab_size, config.channels, config.num_layers, config.max_seq_len
    decayed = Vp * C + maxT * C + L * (3 * C * C + C * C + 4 * C * C + 4 * C * C)   # wte wpe qkvw attprojw fcw fcprojw
    kept = L * (2 * C + 3 * C + C + 2 * C + 4 * C + C) + 2 * C                     # ln1 qkvb attprojb ln2 fcb fcprojb, lnf
    return decayed, kept


def census():
    # the formula must agree with gpt2_cpu's own parameter table (here: on the tiny model)
    tiny = gpt2_init(TINY, seed=MODEL_SEED)
    table = (sum(tiny.P[n].size for n in tiny.P if n in DECAYED_PARAMETERS),
             sum(tiny.P[n].size for n in tiny.P if n not in DECAYED_PARAMETERS))
    assert parameter_counts(TINY) == table, (parameter_counts(TINY), table)
    decayed, kept = parameter_counts(D12)
    return {
        "d12_decayed": f"{decayed:,}",
        "d12_kept": f"{kept:,}",
        "d12_total": f"{decayed + kept:,}",
        "d12_kept_percent": f"{100 * kept / (decayed + kept):.2f}%",
        "d12_moment_gb": f"{(decayed + kept) * 2 * 4 / 1e9:.2f}",                 # m and v, fp32
    }


# ----------------------------------------------------------------------------
# bias correction: the first steps of Adam on a constant gradient

def bias_correction(fig_dir, steps=5000):
    """With a constant gradient g = 1 the ideal normalized step m_hat/sqrt(v_hat) is 1 at every t;
    without the correction it is (1 - beta1^t) / sqrt(1 - beta2^t). Draw that over `steps` steps
    for llm.c's beta2 and for Adam's default 0.999, return its first value and its peak."""
    plt = pyplot()

    t = np.arange(1, steps + 1)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    numbers = {}
    for beta2, style, name in ((ADAMW_BETA2, "-", "095"), (0.999, "--", "0999")):
        m, v = 0.0, 0.0
        raw = np.empty(steps)                          # (steps,)
        for i in range(steps):                         # g = 1 at every step
            m = ADAMW_BETA1 * m + (1 - ADAMW_BETA1) * 1.0
            v = beta2 * v + (1 - beta2) * 1.0
            raw[i] = m / math.sqrt(v)
        numbers[f"bc_first_{name}"] = f"{raw[0]:.3f}"
        numbers[f"bc_peak_{name}"] = f"{raw.max():.2f}"
        numbers[f"bc_peak_step_{name}"] = f"{int(t[raw.argmax()])}"
        ax.plot(t, raw, style, label=f"m / sqrt(v), uncorrected, beta2 = {beta2}")
    ax.axhline(1.0, color="k", lw=1, label="m_hat / sqrt(v_hat), corrected (either beta2)")
    ax.set_xscale("log")
    ax.set_xlabel(f"step t (log scale; constant gradient g = 1, beta1 = {ADAMW_BETA1})")
    ax.set_ylabel("normalized step size")
    ax.set_title("Adam's bias correction: what the first steps would be without it")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save_figure(fig, fig_dir, "adamw_bias_correction.png", dpi=110)
    return numbers


# ----------------------------------------------------------------------------
# the four learning-rate schedules

def schedules(fig_dir):
    plt = pyplot()

    steps = np.arange(SCHEDULE_STEPS)
    curves = {name: np.array([learning_rate_at(int(s), name, SCHEDULE_LR, SCHEDULE_WARMUP, SCHEDULE_STEPS,
                                               SCHEDULE_FINAL_FRAC) for s in steps])
              for name in LR_SCHEDULES}
    fig, axes = plt.subplots(2, 2, figsize=(8, 5.2), sharex=True, sharey=True)
    for ax, name in zip(axes.ravel(), LR_SCHEDULES):
        ax.plot(steps, curves[name] * 1e4)
        ax.set_title(name)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("learning rate (x 1e-4)")
    fig.suptitle(f"learning_rate_at: lr {SCHEDULE_LR:g}, warmup {SCHEDULE_WARMUP}, "
                 f"{SCHEDULE_STEPS} steps, final_lr_frac {SCHEDULE_FINAL_FRAC:g}")
    save_figure(fig, fig_dir, "adamw_schedules.png", dpi=110)

    mid = (SCHEDULE_WARMUP + SCHEDULE_STEPS) // 2                                 # halfway through the decay
    late = SCHEDULE_WARMUP + 3 * (SCHEDULE_STEPS - SCHEDULE_WARMUP) // 4          # three quarters through it
    last_peak = int(np.nonzero(np.isclose(curves["wsd"], SCHEDULE_LR, rtol=1e-12, atol=0))[0].max())
    wsd_mid = (last_peak + SCHEDULE_STEPS) // 2                                    # halfway through WSD's cool-down
    return {
        "sched_lr": f"{SCHEDULE_LR:g}",
        "sched_warmup": f"{SCHEDULE_WARMUP}",
        "sched_steps": f"{SCHEDULE_STEPS}",
        "sched_final_frac": f"{SCHEDULE_FINAL_FRAC:g}",
        "sched_step0": f"{curves['cosine'][0]:.1e}",
        "sched_warm_end": f"{curves['cosine'][SCHEDULE_WARMUP - 1]:.1e}",
        "sched_mid": f"{mid}",
        "sched_cosine_mid": f"{curves['cosine'][mid]:.3e}",
        "sched_linear_mid": f"{curves['linear'][mid]:.3e}",
        "sched_late": f"{late}",
        "sched_cosine_late": f"{curves['cosine'][late]:.3e}",
        "sched_linear_late": f"{curves['linear'][late]:.3e}",
        "sched_wsd_cool": f"{wsd_mid}",
        "sched_wsd_cool_lr": f"{curves['wsd'][wsd_mid]:.3e}",
        "sched_wsd_last_peak": f"{last_peak}",
        "sched_last_step": f"{SCHEDULE_STEPS - 1}",
        "sched_cosine_last": f"{curves['cosine'][-1]:.3e}",
        "sched_linear_last": f"{curves['linear'][-1]:.3e}",
        "sched_wsd_last": f"{curves['wsd'][-1]:.3e}",
    }


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment of doc/adamw.md, draw its figures into fig_dir, return {key: text}."""
    numbers = {}
    numbers |= accumulation_experiment()
    numbers |= update_experiment()
    numbers |= census()
    numbers |= bias_correction(fig_dir)
    numbers |= schedules(fig_dir)
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
