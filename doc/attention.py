"""
doc/attention.py: every number and figure of doc/attention.md (causal self-attention).

What it is: the tutorial's experiments, run on gpt2_cpu.attention_forward / attention_backward:
  1. the forward's attention matrix and the backward's datt / dpreatt for one small head
     (figure attention_pattern.png), showing that dpreatt is exactly 0 above the diagonal;
  2. attention_backward against central finite differences in float64;
  3. the memory the (B,NH,T,T) attention matrix costs for GPT-2 124M (figure attention_memory.png);
  4. an online-softmax ("flash") attention in NumPy, forward and backward, block by block, checked
     against the plain layer (figure attention_blocks.png shows which blocks it computes).
What it is not: a fast attention. The block loops are Python loops; they show the algorithm.

Run:
    python doc/attention.py
prints one `key = value` line per number the tutorial quotes (e.g. `fd_rel_err = 5.6e-10`) and
redraws doc/attention_pattern.png, doc/attention_blocks.png and doc/attention_memory.png.
Takes a few seconds on 2 CPU cores. tests/test_docs.py checks that doc/attention.md quotes
every number exactly as computed here.
"""

import math
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import numerical_grad, print_numbers, pyplot, rel_err, save_figure  # noqa: E402

from gpt2_cpu import GPT2Config, attention_backward, attention_forward  # noqa: E402

SEED = 1234
BYTES = {"fp32": 4, "bf16": 2}
GIB = 2 ** 30
MIB = 2 ** 20
GPU_MEMORY_GB = 80             # an 80 GB GPU (H100 / A100 80GB), for scale in the memory figure


# ----------------------------------------------------------------------------
# helpers: heads (finite differences, errors and plotting come from doc/tutorial.py)

def split_heads(qkv, NH):
    """qkv (B,T,3C) -> q, k, v each (B,NH,T,HS), the layout attention_forward uses internally."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    qkv = qkv.reshape(B, T, 3, NH, HS)                        # (B,T,3,NH,HS)
    return [qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3)]


def to_heads(x, NH):
    """(B,T,C) -> (B,NH,T,HS): a per-head view of an output-shaped tensor (dout, out)."""
    B, T, C = x.shape
    return x.reshape(B, T, NH, C // NH).transpose(0, 2, 1, 3)


def merge_heads(x):
    """(B,NH,T,HS) -> (B,T,C): the heads side by side again."""
    B, NH, T, HS = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, NH * HS)


# ----------------------------------------------------------------------------
# online-softmax attention, block by block (Milakov & Gimelshein 2018; Dao et al. 2022)

def causal_block_mask(qs, q_block, ks, k_block):
    """(q_block, k_block) bool, True where key ks+j is in the future of query qs+i."""
    return (ks + np.arange(k_block))[None, :] > (qs + np.arange(q_block))[:, None]


def flash_attention_forward(q, k, v, q_block, k_block):
    """Causal attention of q, k, v (B,NH,T,HS) without ever forming a (T,T) matrix.
    Returns out (B,NH,T,HS) and lse (B,NH,T), the logsumexp of each row of scaled scores (all the
    backward needs to rebuild any block of att). Per query block, the running state is:
        m (B,NH,Bq)     running max of the scores seen so far
        l (B,NH,Bq)     running sum of exp(score - m)
        acc (B,NH,Bq,HS) running sum of exp(score - m) * v
    and every new key block rescales the old state by exp(m_old - m_new)."""
    B, NH, T, HS = q.shape
    scale = 1.0 / math.sqrt(HS)
    out = np.empty_like(q)
    lse = np.empty((B, NH, T), dtype=q.dtype)
    for qs in range(0, T, q_block):
        qb = q[:, :, qs:qs + q_block]                         # (B,NH,Bq,HS)
        m = np.full((B, NH, q_block), -np.inf, dtype=q.dtype)
        l = np.zeros((B, NH, q_block), dtype=q.dtype)
        acc = np.zeros((B, NH, q_block, HS), dtype=q.dtype)
        for ks in range(0, qs + q_block, k_block):            # key blocks past the last query: skipped
            kb, vb = k[:, :, ks:ks + k_block], v[:, :, ks:ks + k_block]  # (B,NH,Bk,HS)
            s = (qb @ kb.transpose(0, 1, 3, 2)) * scale       # (B,NH,Bq,HS) @ (B,NH,HS,Bk) -> (B,NH,Bq,Bk)
            s[..., causal_block_mask(qs, q_block, ks, k_block)] = -np.inf
            m_new = np.maximum(m, s.max(axis=-1))             # finite: key 0 is in the first block
            p = np.exp(s - m_new[..., None])                  # (B,NH,Bq,Bk), 0 where masked
            rescale = np.exp(m - m_new)                       # (B,NH,Bq), exp(-inf) = 0 at the start
            l = l * rescale + p.sum(axis=-1)
            acc = acc * rescale[..., None] + p @ vb           # (B,NH,Bq,Bk) @ (B,NH,Bk,HS)
            m = m_new
        out[:, :, qs:qs + q_block] = acc / l[..., None]       # normalize once, at the end
        lse[:, :, qs:qs + q_block] = m + np.log(l)
    return out, lse


def flash_attention_backward(dout, q, k, v, out, lse, q_block, k_block):
    """Gradients dq, dk, dv (B,NH,T,HS) of flash_attention_forward, block by block, from dout
    (B,NH,T,HS), the forward's out and lse. Each block of att is recomputed as exp(s - lse),
    and the softmax Jacobian's shared term sum_j datt_j att_j is taken as sum(dout * out) per row."""
    B, NH, T, HS = q.shape
    scale = 1.0 / math.sqrt(HS)
    D = (dout * out).sum(axis=-1)                             # (B,NH,T) = sum_j datt_tj att_tj
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for qs in range(0, T, q_block):
        rows = slice(qs, qs + q_block)
        for ks in range(0, qs + q_block, k_block):
            cols = slice(ks, ks + k_block)
            s = (q[:, :, rows] @ k[:, :, cols].transpose(0, 1, 3, 2)) * scale  # (B,NH,Bq,Bk)
            s[..., causal_block_mask(qs, q_block, ks, k_block)] = -np.inf
            att = np.exp(s - lse[:, :, rows, None])           # this block of att, exact
            dv[:, :, cols] += att.transpose(0, 1, 3, 2) @ dout[:, :, rows]     # (B,NH,Bk,Bq) @ (B,NH,Bq,HS)
            datt = dout[:, :, rows] @ v[:, :, cols].transpose(0, 1, 3, 2)     # (B,NH,Bq,HS) @ (B,NH,HS,Bk)
            dpreatt = att * (datt - D[:, :, rows, None])      # softmax Jacobian, 0 where masked
            dq[:, :, rows] += (dpreatt @ k[:, :, cols]) * scale
            dk[:, :, cols] += (dpreatt.transpose(0, 1, 3, 2) @ q[:, :, rows]) * scale
    return dq, dk, dv


# ----------------------------------------------------------------------------
# experiments

def pattern_experiment(rng, fig_dir):
    """One head, T=16: att, datt and dpreatt, as attention_backward computes them internally."""
    B, T, NH, HS = 1, 16, 1, 8
    qkv = rng.standard_normal((B, T, 3 * NH * HS)) * 1.5
    dout = rng.standard_normal((B, T, NH * HS))
    out, att = attention_forward(qkv, NH)                     # (B,T,C), (B,NH,T,T)
    q, k, v = split_heads(qkv, NH)
    dout_h = to_heads(dout, NH)                               # (B,NH,T,HS)
    # the datt and dpreatt lines of attention_backward, written out again to look at their (T,T) results
    datt = dout_h @ v.transpose(0, 1, 3, 2)                   # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    dpreatt = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    future = np.triu(np.ones((T, T), dtype=bool), k=1)
    # flash attention's shortcut for the Jacobian's shared term: sum_j datt_j att_j = dout . out
    shared_direct = (datt * att).sum(axis=-1)                 # (B,NH,T)
    shared_flash = (dout_h * to_heads(out, NH)).sum(axis=-1)  # (B,NH,T)
    numbers = {
        "att_future_max": f"{np.abs(att[..., future]).max():.1f}",
        "datt_future_max": f"{np.abs(datt[..., future]).max():.2f}",
        "dpreatt_future_max": f"{np.abs(dpreatt[..., future]).max():.1f}",
        "shared_term_diff": f"{np.abs(shared_direct - shared_flash).max():.1e}",
    }
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.9))
    panels = [(att[0, 0], "att = softmax(q k^T / sqrt(HS) + mask)", "viridis", False),
              (datt[0, 0], "datt = dout @ v^T   (dense)", "RdBu_r", True),
              (dpreatt[0, 0], "dpreatt = att * (datt - rowsum(datt*att))", "RdBu_r", True)]
    for ax, (data, title, cmap, symmetric) in zip(axes, panels):
        lim = np.abs(data).max()
        im = ax.imshow(data, cmap=cmap, vmin=-lim if symmetric else 0, vmax=lim)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position j")
        ax.set_ylabel("query position t")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"one head, T={T}, HS={HS}: the upper triangle of att and dpreatt is exactly 0", fontsize=10)
    save_figure(fig, fig_dir, "attention_pattern.png", dpi=100)
    return numbers


def finite_difference_experiment(rng):
    """attention_backward against central differences of L = sum(out * R), float64."""
    B, T, NH, HS = 2, 5, 2, 3
    C = NH * HS
    qkv = rng.standard_normal((B, T, 3 * C))
    R = rng.standard_normal((B, T, C))                        # dL/dout = R exactly
    out, att = attention_forward(qkv, NH)
    dqkv = attention_backward(R, qkv, att, NH)                # (B,T,3C)
    dqkv_fd = numerical_grad(lambda: float((attention_forward(qkv, NH)[0] * R).sum()), qkv)
    return {
        "fd_shape": f"({B}, {T}, {3 * C})",
        "fd_count": f"{qkv.size}",
        "fd_rel_err": f"{rel_err(dqkv, dqkv_fd):.1e}",
    }


def memory_experiment(fig_dir):
    """The (B,NH,T,T) attention matrix of GPT-2 124M (GPT2Config() defaults) at B=8, T=1024."""
    cfg = GPT2Config()
    B, T, L, NH, C = 8, cfg.max_seq_len, cfg.num_layers, cfg.num_heads, cfg.channels
    att_layer = B * NH * T * T                                # floats per layer
    btc = B * T * C                                           # one (B,T,C) activation
    lse_layer = B * NH * T                                    # flash attention keeps one float per row
    numbers = {
        "mem_B": f"{B}", "mem_T": f"{T}", "mem_L": f"{L}", "mem_NH": f"{NH}", "mem_C": f"{C}",
        "att_layer_floats": f"{att_layer:,}",
        "att_layer_mib_fp32": f"{att_layer * BYTES['fp32'] / MIB:,.0f}",
        "att_all_gib_fp32": f"{L * att_layer * BYTES['fp32'] / GIB:.2f}",
        "att_all_gib_bf16": f"{L * att_layer * BYTES['bf16'] / GIB:.2f}",
        "att_vs_btc": f"{att_layer // btc}",
        "lse_layer_floats": f"{lse_layer:,}",
        "lse_all_mib_fp32": f"{L * lse_layer * BYTES['fp32'] / MIB:.1f}",
    }
    plt = pyplot()
    Ts = 2 ** np.arange(6, 15)                                # 64 .. 16384
    fig, ax = plt.subplots(figsize=(6.4, 5.0))
    ax.loglog(Ts, L * B * NH * Ts.astype(float) ** 2 * BYTES["bf16"] / GIB, "o-",
              label="att (L,B,NH,T,T) in bf16: what the CUDA trainer keeps for the backward")
    ax.loglog(Ts, L * B * Ts * 3 * C * BYTES["bf16"] / GIB, "s-", label="qkv (L,B,T,3C) in bf16, for comparison")
    ax.loglog(Ts, L * B * NH * Ts * BYTES["fp32"] / GIB, "^-",
              label="logsumexp (L,B,NH,T) in fp32: what flash attention keeps instead")
    gpu_gib = GPU_MEMORY_GB * 1e9 / GIB
    ax.axhline(gpu_gib, color="gray", ls="--", lw=1)
    ax.text(Ts[0], gpu_gib * 1.4, f"all of an {GPU_MEMORY_GB} GB GPU ({gpu_gib:.1f} GiB)", fontsize=8, color="gray")
    ax.axvline(cfg.max_seq_len, color="gray", ls=":", lw=1)
    ax.text(cfg.max_seq_len * 1.1, 2e-3, "GPT-2's maxT", fontsize=8, color="gray")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("memory over all L layers (GiB)")
    ax.set_title(f"GPT-2 124M (L={L}, NH={NH}, C={C}) at B={B}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    ax.grid(True, which="major", alpha=0.3)
    save_figure(fig, fig_dir, "attention_memory.png", dpi=100, bbox_inches="tight")
    return numbers


def flash_experiment(rng, fig_dir):
    """Online-softmax attention against attention_forward / attention_backward, float32 and float64."""
    B, T, NH, HS = 2, 64, 4, 16
    q_block, k_block = 16, 8
    C = NH * HS
    numbers = {"flash_T": f"{T}", "flash_q_block": f"{q_block}", "flash_k_block": f"{k_block}"}
    qkv64 = rng.standard_normal((B, T, 3 * C))
    dout64 = rng.standard_normal((B, T, C))
    for dtype, name in ((np.float32, "f32"), (np.float64, "f64")):
        qkv, dout = qkv64.astype(dtype), dout64.astype(dtype)
        out_ref, att = attention_forward(qkv, NH)             # (B,T,C), (B,NH,T,T)
        dqkv_ref = attention_backward(dout, qkv, att, NH)     # (B,T,3C)
        q, k, v = (np.ascontiguousarray(x) for x in split_heads(qkv, NH))
        dout_h = np.ascontiguousarray(to_heads(dout, NH))
        out_h, lse = flash_attention_forward(q, k, v, q_block, k_block)
        dq, dk, dv = flash_attention_backward(dout_h, q, k, v, out_h, lse, q_block, k_block)
        dqkv = np.concatenate([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)
        numbers[f"flash_fwd_diff_{name}"] = f"{np.abs(merge_heads(out_h) - out_ref).max():.1e}"
        numbers[f"flash_bwd_diff_{name}"] = f"{np.abs(dqkv - dqkv_ref).max():.1e}"
    # which score blocks the forward computes: one image of T x T positions
    n_q, n_k = T // q_block, T // k_block
    computed = sum(1 for qs in range(0, T, q_block) for ks in range(0, qs + q_block, k_block))
    numbers["blocks_computed"] = f"{computed}"
    numbers["blocks_total"] = f"{n_q * n_k}"
    kind = np.zeros((T, T))                                   # 0 skipped, 1 computed and used, 2 computed, masked
    for qs in range(0, T, q_block):
        for ks in range(0, qs + q_block, k_block):
            kind[qs:qs + q_block, ks:ks + k_block] = np.where(causal_block_mask(qs, q_block, ks, k_block), 2, 1)
    plt = pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    colors = ["#f0f0f0", "#4c72b0", "#dd8452"]
    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    ax.imshow(kind, cmap=ListedColormap(colors), vmin=0, vmax=2, extent=(0, T, T, 0))
    for x in range(0, T + 1, k_block):
        ax.axvline(x, color="white", lw=0.6)
    for y in range(0, T + 1, q_block):
        ax.axhline(y, color="white", lw=1.5)
    ax.set_xlabel(f"key position j  (blocks of {k_block})")
    ax.set_ylabel(f"query position t  (blocks of {q_block})")
    ax.set_title(f"online-softmax attention, T={T}: {computed} of {n_q * n_k} score blocks computed", fontsize=10)
    ax.legend(handles=[Patch(color=colors[1], label="computed, used"),
                       Patch(color=colors[2], label="computed, masked to -inf"),
                       Patch(color=colors[0], label="skipped (all in the future)")],
              loc="upper right", fontsize=8)
    save_figure(fig, fig_dir, "attention_blocks.png", dpi=100)
    return numbers


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment; save the figures into fig_dir; return {key: formatted number}."""
    rng = np.random.default_rng(SEED)
    numbers = {}
    numbers.update(pattern_experiment(rng, fig_dir))
    numbers.update(finite_difference_experiment(rng))
    numbers.update(memory_experiment(fig_dir))
    numbers.update(flash_experiment(rng, fig_dir))
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
