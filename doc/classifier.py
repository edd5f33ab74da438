"""
doc/classifier.py: every number and figure of doc/classifier.md (softmax + cross-entropy, the
padded vocabulary, weight tying, the fused classifier kernel).

What it is: the tutorial's experiments, on gpt2_cpu's softmax_forward, crossentropy_forward,
crossentropy_softmax_backward and a tiny GPT-2 from gpt2_init:
  1. the `probs - onehot` gradient against central finite differences in float64, and the loss of
     a very unlikely target computed two ways in float32 (-log p underflows, lse - z does not);
  2. the padded vocabulary: sizes, byte alignment, and the padded rows' gradient (always 0);
  3. weight tying: wte's gradient split into its classifier part and its encoder part, each
     recomputed on its own, and the sum checked against finite differences of the whole model;
  4. a NumPy emulation of kernels/classifier.cu's row-wise online logsumexp (1024 threads, strided
     columns, the block reduction in warp 0), checked against the NumPy layers
     (figures classifier_gradient.png and classifier_online.png).
What it is not: a model of the kernel's speed or of its bf16 rounding (the emulation is fp32).

Run:
    python doc/classifier.py
prints one `key = value` line per number the tutorial quotes (e.g. `Vp = 50304`) and redraws
doc/classifier_gradient.png and doc/classifier_online.png. A few seconds on 2 CPU cores.
tests/test_docs.py checks that doc/classifier.md quotes every number exactly as computed here.
"""

import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import numerical_grad, print_numbers, pyplot, rel_err, save_figure  # noqa: E402

from gpt2_cpu import (VOCAB_PAD_MULTIPLE, GPT2Config, crossentropy_forward,  # noqa: E402
                      crossentropy_softmax_backward, encoder_backward, gpt2_backward, gpt2_forward,
                      gpt2_init, gpt2_zero_grad, matmul_backward, padded_vocab, softmax_forward)

SEED = 1234
GIB = 2 ** 30
BF16_BYTES = 2
VECTOR_BYTES = 16              # one 128-bit load (x128 in kernels/common.cuh)
# the fused kernel's launch shape (gpt2_cuda.CLASSIFIER_BLOCK_SIZE, fp32 mode: 4 floats per x128)
BLOCK_THREADS = 1024
WARP_SIZE = 32
FP32_WIDTH = VECTOR_BYTES // 4


# ----------------------------------------------------------------------------
# helpers: integer factors (finite differences, errors and plotting: doc/tutorial.py)

def factorize(n):
    """Prime factors of n, smallest first, as a string like '2^7 x 3 x 131'."""
    factors, p = {}, 2
    while p * p <= n:
        while n % p == 0:
            factors[p] = factors.get(p, 0) + 1
            n //= p
        p += 1
    if n > 1:
        factors[n] = factors.get(n, 0) + 1
    return " x ".join(f"{p}^{e}" if e > 1 else f"{p}" for p, e in factors.items())


# ----------------------------------------------------------------------------
# the fused classifier kernel, emulated in NumPy (kernels/classifier.cu, kernels/common.cuh)

def softmax_state_add(m, l, x, valid):
    """The kernel's softmax_state_add on arrays: fold x into (m, l) where valid, keep it elsewhere.
        x > m:  l = l * exp(m - x) + 1, m = x      (a new max: rescale the old sum)
        else:   l = l + exp(x - m)"""
    with np.errstate(over="ignore"):                          # the branch np.where discards may overflow
        bigger = x > m
        l_new = np.where(bigger, l * np.exp(m - x) + np.float32(1), l + np.exp(x - m))
    return np.where(valid, np.where(bigger, x, m), m), np.where(valid, l_new, l)


def butterfly_sum(values):
    """warpReduceSum: butterfly over the last axis (32 lanes), lane i adding lane i^offset's value,
    in float32; afterwards every lane holds the sum."""
    lanes = np.arange(WARP_SIZE)
    offset = WARP_SIZE // 2
    while offset > 0:
        values = values + values[..., lanes ^ offset]
        offset //= 2
    return values


def fused_classifier_emulated(logits, targets, dloss, V):
    """kernels/classifier.cu's fused_classifier, one block of BLOCK_THREADS threads per row, fp32.
    logits (N,Vp) float32; targets (N,) ints -> losses (N,), dlogits (N,Vp).
    Pass 1: thread t folds columns t*W + k + j*BLOCK_THREADS*W (k < W, W = FP32_WIDTH) into its own
    online state, in the order the kernel reads them; blockReduceSoftmax merges the states.
    Pass 2: dlogits = (exp(z - m) / l - onehot) * dloss, 0 in the padded columns."""
    N, Vp = logits.shape
    threads = np.arange(BLOCK_THREADS)
    m = np.full((N, BLOCK_THREADS), -np.inf, dtype=np.float32)
    l = np.zeros((N, BLOCK_THREADS), dtype=np.float32)
    stride = BLOCK_THREADS * FP32_WIDTH
    for start in range(0, Vp, stride):                        # the grid-stride loop over the row
        for k in range(FP32_WIDTH):                           # the W values of one x128 load
            cols = start + threads * FP32_WIDTH + k           # (BLOCK_THREADS,)
            valid = cols < V                                  # padded columns are skipped
            x = logits[:, np.minimum(cols, Vp - 1)]           # (N,BLOCK_THREADS)
            m, l = softmax_state_add(m, l, x, valid[None, :])
    # blockReduceSoftmax: the 1024 states go to shared memory; lane j of warp 0 takes the states
    # j, j + 32, j + 64, ... in order: the block's max M first, then each lane's sum of the states'
    # sums rescaled to M (an empty state, m = -inf, adds nothing), then a butterfly sum over the lanes
    M = m.max(axis=1)                                         # (N,): every thread gets M (a max is exact)
    table_m = m.reshape(N, -1, WARP_SIZE)                     # [row, j, lane]: thread j*32 + lane
    table_l = l.reshape(N, -1, WARP_SIZE)
    lane_sums = np.zeros((N, WARP_SIZE), np.float32)
    with np.errstate(invalid="ignore"):                       # exp(-inf - -inf) of a row of -inf, discarded
        for j in range(table_m.shape[1]):
            rescaled = table_l[:, j] * np.exp(table_m[:, j] - M[:, None])
            lane_sums = lane_sums + np.where(table_m[:, j] == -np.inf, np.float32(0), rescaled)
    m, l = M, butterfly_sum(lane_sums)[:, 0]                  # (N,): every thread now has these
    rows = np.arange(N)
    losses = m + np.log(l) - logits[rows, targets]            # lse - logit[target]
    cols = np.arange(Vp)
    shifted = np.where(cols < V, logits - m[:, None], -np.inf)   # exp only of the real columns
    probs = np.exp(shifted) * (np.float32(1) / l)[:, None]       # exp(-inf) = 0 in the padding
    dlogits = (probs - (cols[None, :] == targets[:, None])) * np.float32(dloss)
    return losses.astype(np.float32), dlogits.astype(np.float32)


# ----------------------------------------------------------------------------
# experiments

def gradient_experiment(rng, fig_dir):
    """dlogits = (probs - onehot) * dlosses against finite differences; the unlikely-target loss."""
    B, T, V, Vp = 2, 3, 10, 16                                # a small Vp, padded for illustration
    logits = rng.standard_normal((B, T, Vp)) * 2
    targets = rng.integers(0, V, (B, T))
    dlosses = np.full((B, T), 1.0 / (B * T))                  # d(mean loss)/d(losses)

    def mean_loss():
        return float(crossentropy_forward(softmax_forward(logits, V), targets).mean())

    probs = softmax_forward(logits, V)
    dlogits = crossentropy_softmax_backward(dlosses, probs, targets)
    dlogits_fd = numerical_grad(mean_loss, logits)
    numbers = {
        "fd_shape": f"({B}, {T}, {Vp})",
        "fd_V": f"{V}",
        "fd_rel_err": f"{rel_err(dlogits, dlogits_fd):.1e}",
        "fd_pad_max": f"{np.abs(dlogits[..., V:]).max():.1f}",
        "row_sum_max": f"{np.abs(dlogits.sum(axis=-1)).max():.1e}",
    }
    # a target 110 below the max logit, float32: p = e^-110 ~ 1.7e-48 is below float32's range
    gap = 110.0
    z = np.zeros((1, 1, Vp), dtype=np.float32)
    z[0, 0, 0] = gap                                          # token 0 dominates
    target = np.array([[1]])                                  # the target has logit 0
    with np.errstate(divide="ignore"):
        two_step = crossentropy_forward(softmax_forward(z, V), target)[0, 0]
    zr = z[0, 0, :V]
    lse = zr.max() + np.log(np.exp(zr - zr.max()).sum())      # the kernel's form: lse - z[target]
    numbers.update({
        "gap": f"{gap:.0f}",
        "two_step_loss": f"{two_step}",
        "fused_loss": f"{lse - zr[1]:.4f}",
    })

    # figure: one row, V real columns and Vp - V padded ones
    Vf, Vpf, tf = 40, 48, 13
    row = rng.standard_normal((1, 1, Vpf)) * 1.5
    row[0, 0, tf] += 1.0
    p = softmax_forward(row, Vf)[0, 0]
    d = crossentropy_softmax_backward(np.ones((1, 1)), softmax_forward(row, Vf), np.array([[tf]]))[0, 0]
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 5.0), sharex=True)
    cols = np.arange(Vpf)
    colors = ["#dd8452" if i == tf else "#4c72b0" for i in cols]
    axes[0].bar(cols, p, color=colors)
    axes[0].set_ylabel("probs_i")
    axes[0].set_title(f"one row: V={Vf} real columns, {Vpf - Vf} padded (shaded); target = {tf} (orange)",
                      fontsize=10)
    axes[1].bar(cols, d, color=colors)
    axes[1].axhline(0, color="black", lw=0.6)
    axes[1].set_ylabel("dlogits_i = probs_i - [i == target]")
    axes[1].set_xlabel("vocabulary column i")
    for ax in axes:
        ax.axvspan(Vf - 0.5, Vpf - 0.5, color="gray", alpha=0.2)
    save_figure(fig, fig_dir, "classifier_gradient.png", dpi=100)
    return numbers


def padding_numbers():
    """V = 50257 -> Vp: factors, bytes per bf16 row, extra parameters, share of the model."""
    cfg = GPT2Config()
    V, C, L, maxT = cfg.vocab_size, cfg.channels, cfg.num_layers, cfg.max_seq_len
    Vp = padded_vocab(V)
    # GPT-2's parameter count, from the shapes of gpt2_cpu.parameter_shapes:
    # wte (Vp,C) + wpe (maxT,C) + per layer 12 C^2 + 13 C (qkv, attproj, fc, fcproj weights and
    # biases, two LayerNorms) + the final LayerNorm's 2 C
    num_params = Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C
    return {
        "V": f"{V}", "Vp": f"{Vp}", "pad_multiple": f"{VOCAB_PAD_MULTIPLE}",
        "V_factors": factorize(V), "Vp_factors": factorize(Vp), "pad_rows": f"{Vp - V}",
        "V_row_bytes": f"{V * BF16_BYTES:,}", "V_row_mod16": f"{V * BF16_BYTES % VECTOR_BYTES}",
        "Vp_row_bytes": f"{Vp * BF16_BYTES:,}",
        "pad_params": f"{(Vp - V) * C:,}",
        "pad_flops_pct": f"{100 * (Vp - V) / V:.2f}",
        "wte_params": f"{Vp * C:,}", "num_params": f"{num_params:,}",
        "wte_share_pct": f"{100 * Vp * C / num_params:.1f}",
    }


def tying_experiment(rng):
    """A tiny GPT-2 in float64: wte's gradient = classifier part + encoder part."""
    V = 100
    cfg = GPT2Config(max_seq_len=16, vocab_size=V, padded_vocab_size=padded_vocab(V),
                     num_layers=2, num_heads=2, channels=16)
    B, T, Vp, C = 1, cfg.max_seq_len, cfg.padded_vocab_size, cfg.channels
    model = gpt2_init(cfg, seed=SEED, dtype=np.float64)
    inputs = rng.integers(0, V, (B, T))
    targets = rng.integers(0, V, (B, T))
    gpt2_forward(model, inputs, targets)
    gpt2_zero_grad(model)
    gpt2_backward(model)
    P, G, A = model.P, model.G, model.acts
    dwte = G["wte"].copy()                                    # (Vp,C): what gpt2_backward accumulated
    # classifier part: logits = lnf @ wte^T, so dwte_cls = dlogits^T @ lnf
    dlosses = np.full((B, T), 1.0 / (B * T))
    dlogits = crossentropy_softmax_backward(dlosses, A["probs"], targets)     # (B,T,Vp)
    dwte_cls = np.zeros((Vp, C))
    matmul_backward(dwte_cls, None, dlogits, A["lnf"], P["wte"])
    # encoder part: encoded = wte[inputs] + wpe. With B=1, wpe's gradient *is* the gradient of the
    # residual stream at the bottom (dwpe[t] = sum over the batch of dresidual[b,t]), so scatter
    # it into the input tokens' rows of wte the way encoder_backward does.
    dresidual_bottom = G["wpe"][:T][None].copy()                           # (1,T,C)
    dwte_enc = np.zeros((Vp, C))
    encoder_backward(dwte_enc, np.zeros_like(G["wpe"]), dresidual_bottom, inputs)

    def mean_loss():
        gpt2_forward(model, inputs, targets)
        return model.mean_loss

    dwte_fd = numerical_grad(mean_loss, P["wte"][:V])        # the padded rows are checked apart
    enc_rows = np.flatnonzero(np.abs(dwte_enc).sum(axis=1))
    cls_rows = np.flatnonzero(np.abs(dwte_cls).sum(axis=1))
    return {
        "tiny_V": f"{V}", "tiny_Vp": f"{Vp}", "tiny_L": f"{cfg.num_layers}", "tiny_C": f"{C}",
        "tiny_T": f"{T}",
        "tying_sum_diff": f"{np.abs(dwte - (dwte_cls + dwte_enc)).max():.1e}",
        "tying_fd_rel_err": f"{rel_err(dwte[:V], dwte_fd):.1e}",
        "tying_cls_only_err": f"{rel_err(dwte_cls[:V], dwte_fd):.2f}",
        "tying_enc_only_err": f"{rel_err(dwte_enc[:V], dwte_fd):.2f}",
        "enc_rows": f"{enc_rows.size}", "cls_rows": f"{cls_rows.size}",
        "distinct_inputs": f"{np.unique(inputs).size}",
        "cls_norm": f"{np.linalg.norm(dwte_cls):.3f}", "enc_norm": f"{np.linalg.norm(dwte_enc):.3f}",
        "pad_grad_max": f"{np.abs(dwte[V:]).max():.1f}",
    }


def fused_kernel_experiment(rng, fig_dir):
    """The emulated fused_classifier against softmax_forward + crossentropy_forward + backward."""
    cfg = GPT2Config()
    V, Vp = cfg.vocab_size, padded_vocab(cfg.vocab_size)
    N = 4
    logits = (rng.standard_normal((1, N, Vp)) * 3).astype(np.float32)   # B=1, T=N rows
    logits[..., V:] = rng.standard_normal((1, N, Vp - V)).astype(np.float32) * 50  # garbage: must be ignored
    targets = rng.integers(0, V, (1, N))
    dloss = 1.0 / N
    probs = softmax_forward(logits, V)                                  # (1,N,Vp)
    losses_ref = crossentropy_forward(probs, targets)[0]                # (N,)
    dlogits_ref = crossentropy_softmax_backward(np.full((1, N), dloss, np.float32), probs, targets)[0]
    losses, dlogits = fused_classifier_emulated(logits[0], targets[0], dloss, V)
    B8, T8 = 8, cfg.max_seq_len                                          # the memory the fusion saves
    numbers = {
        "emu_rows": f"{N}",
        "emu_loss_diff": f"{np.abs(losses - losses_ref).max():.1e}",
        "emu_dlogits_diff": f"{np.abs(dlogits - dlogits_ref).max():.1e}",
        "emu_dlogits_max": f"{np.abs(dlogits_ref).max():.1e}",
        "cols_per_thread": f"{-(-V // BLOCK_THREADS)}",
        "probs_floats": f"{B8 * T8 * Vp:,}",
        "probs_gib_fp32": f"{B8 * T8 * Vp * 4 / GIB:.2f}",
        "probs_gib_bf16": f"{B8 * T8 * Vp * BF16_BYTES / GIB:.2f}",
    }

    # figure: the online recurrence along one short row, one value at a time
    n = 60
    x = (rng.standard_normal(n) * 1.5 + np.linspace(0, 3, n)).astype(np.float32)
    m_hist, l_hist = [], []
    m, l = np.float32(-np.inf), np.float32(0)
    for value in x:
        m_arr, l_arr = softmax_state_add(np.array(m), np.array(l), np.array(value), True)
        m, l = m_arr[()], l_arr[()]
        m_hist.append(m)
        l_hist.append(l)
    k = np.arange(1, n + 1)
    jumps = [i for i in range(1, n) if m_hist[i] > m_hist[i - 1]]
    l_direct = np.exp(x - x.max()).sum()
    numbers["online_lse"] = f"{m + np.log(l):.4f}"
    numbers["direct_lse"] = f"{x.max() + np.log(l_direct):.4f}"
    numbers["online_jumps"] = f"{len(jumps)}"
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(7.5, 5.4), sharex=True)
    axes[0].plot(k, x, "o", ms=3, color="gray", label="x_k, the logits in reading order")
    axes[0].step(k, m_hist, where="post", color="#4c72b0", label="m_k = running max")
    axes[0].set_ylabel("value")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[0].set_title("online softmax state along one row of logits", fontsize=10)
    axes[1].step(k, l_hist, where="post", color="#dd8452", label="l_k = sum_{i<=k} exp(x_i - m_k)")
    for i in jumps:
        axes[1].axvline(k[i], color="#4c72b0", lw=0.6, ls=":")
    axes[1].set_ylabel("running sum l_k")
    axes[1].set_xlabel("k (values read so far)")
    axes[1].legend(fontsize=8, loc="upper left",
                   title="dotted: a new max, the old sum rescaled by exp(m_old - m_new)", title_fontsize=8)
    save_figure(fig, fig_dir, "classifier_online.png", dpi=100)
    return numbers


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment; save the figures into fig_dir; return {key: formatted number}."""
    rng = np.random.default_rng(SEED)
    numbers = {}
    numbers.update(gradient_experiment(rng, fig_dir))
    numbers.update(padding_numbers())
    numbers.update(tying_experiment(rng))
    numbers.update(fused_kernel_experiment(rng, fig_dir))
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
