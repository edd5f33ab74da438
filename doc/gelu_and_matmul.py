"""
doc/gelu_and_matmul.py: every number and figure of doc/gelu_and_matmul.md (the matmul backward,
the GELU derivative, and how gpt2_backward accumulates the residual stream's gradient).

What it is: the tutorial's experiments, on gpt2_cpu's layers and a tiny GPT-2 from gpt2_init:
  1. matmul_backward's dinp, dweight, dbias against central finite differences in float64, and
     the FLOPs of the three products for one GPT-2 124M layer;
  2. gelu_backward against finite differences; the tanh approximation against the exact
     x * Phi(x); the extremes of gelu and gelu' (figure gelu_and_matmul_gelu.png);
  3. the residual stream's gradient, added up block by block as gpt2_backward does it, checked
     against gpt2_backward itself and against finite differences of the whole model
     (figure gelu_and_matmul_residual.png).
What it is not: a benchmark. The FLOP counts are arithmetic, not timings.

Run:
    python doc/gelu_and_matmul.py
prints one `key = value` line per number the tutorial quotes (e.g. `matmul_dinp_err = 3.1e-10`)
and redraws doc/gelu_and_matmul_gelu.png and doc/gelu_and_matmul_residual.png. A few seconds on
2 CPU cores. tests/test_docs.py checks that doc/gelu_and_matmul.md quotes every number exactly as
computed here.
"""

import math
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import FD_STEP, numerical_grad, print_numbers, pyplot, rel_err, save_figure  # noqa: E402

from gpt2_cpu import (GELU_CUBIC_COEFF, GELU_SCALING_FACTOR, GPT2Config,  # noqa: E402
                      attention_backward, crossentropy_softmax_backward, gelu_backward, gelu_forward,
                      gpt2_backward, gpt2_forward, gpt2_init, gpt2_zero_grad, layernorm_backward,
                      matmul_backward, matmul_forward, padded_vocab, residual_backward)

SEED = 1234
GELU_RANGE = 6.0               # the figure and the approximation error cover [-6, 6]
BF16_BYTES = 2
GELU_GRID = 600_001            # grid points on that range: spacing 2e-5, enough for 2 decimals of x


# ----------------------------------------------------------------------------
# experiments

def matmul_experiment(rng):
    """matmul_backward against finite differences of L = sum(out * R), float64; FLOPs of GPT-2's fc."""
    B, T, C, OC = 2, 3, 5, 4
    inp = rng.standard_normal((B, T, C))
    weight = rng.standard_normal((OC, C))
    bias = rng.standard_normal(OC)
    R = rng.standard_normal((B, T, OC))                       # dL/dout = R exactly

    def loss():
        return float((matmul_forward(inp, weight, bias) * R).sum())

    dweight, dbias = np.zeros_like(weight), np.zeros_like(bias)
    dinp = matmul_backward(dweight, dbias, R, inp, weight)
    numbers = {
        "mm_B": f"{B}", "mm_T": f"{T}", "mm_C": f"{C}", "mm_OC": f"{OC}",
        "matmul_dinp_err": f"{rel_err(dinp, numerical_grad(loss, inp)):.1e}",
        "matmul_dweight_err": f"{rel_err(dweight, numerical_grad(loss, weight)):.1e}",
        "matmul_dbias_err": f"{rel_err(dbias, numerical_grad(loss, bias)):.1e}",
    }
    # FLOPs: each of out, dinp, dweight is an (N x K) @ (K x M) product, 2*N*K*M FLOPs
    cfg = GPT2Config()
    N, C, OC = 8 * cfg.max_seq_len, cfg.channels, 4 * cfg.channels  # GPT-2 124M's fc at B=8, T=1024
    forward = 2 * N * C * OC
    numbers.update({
        "fc_N": f"{N:,}", "fc_C": f"{C}", "fc_OC": f"{OC:,}",
        "fc_forward_gflop": f"{forward / 1e9:.1f}",
        "fc_backward_gflop": f"{2 * forward / 1e9:.1f}",
        "fc_dbias_mflop": f"{N * OC / 1e6:.1f}",
    })
    return numbers


def gelu_exact(x):
    """x * Phi(x), Phi the standard normal CDF (Hendrycks & Gimpel 2016): what tanh approximates."""
    erf = np.vectorize(math.erf, otypes=[float])
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_exact_derivative(x):
    """Phi(x) + x phi(x)."""
    erf = np.vectorize(math.erf, otypes=[float])
    return 0.5 * (1.0 + erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def gelu_experiment(rng, fig_dir):
    """gelu_backward against finite differences; the approximation's error; extremes; the figure."""
    x = rng.uniform(-GELU_RANGE, GELU_RANGE, 1000)
    R = rng.standard_normal(x.shape)
    dinp = gelu_backward(R, x)
    # gelu is elementwise: out_i depends on x_i only, so all elements can be perturbed at once
    fd = R * (gelu_forward(x + FD_STEP) - gelu_forward(x - FD_STEP)) / (2 * FD_STEP)
    grid = np.linspace(-GELU_RANGE, GELU_RANGE, GELU_GRID)
    g, dg = gelu_forward(grid), gelu_backward(np.ones_like(grid), grid)
    g_exact, dg_exact = gelu_exact(grid), gelu_exact_derivative(grid)
    i_min, i_dmin, i_dmax = int(np.argmin(g)), int(np.argmin(dg)), int(np.argmax(dg))
    numbers = {
        "gelu_fd_count": f"{x.size}",
        "gelu_fd_err": f"{rel_err(dinp, fd):.1e}",
        "gelu_approx_err": f"{np.abs(g - g_exact).max():.1e}",
        "gelu_approx_derr": f"{np.abs(dg - dg_exact).max():.1e}",
        "gelu_min_x": f"{grid[i_min]:.2f}", "gelu_min": f"{g[i_min]:.3f}",
        "dgelu_min_x": f"{grid[i_dmin]:.2f}", "dgelu_min": f"{dg[i_dmin]:.3f}",
        "dgelu_max_x": f"{grid[i_dmax]:.2f}", "dgelu_max": f"{dg[i_dmax]:.3f}",
        "scaling": f"{GELU_SCALING_FACTOR:.6f}", "cubic": f"{GELU_CUBIC_COEFF}",
    }
    # the CUDA trainer's recompute: fch_gelu (B,T,4C) kept for one layer instead of L
    cfg = GPT2Config()
    saved = (cfg.num_layers - 1) * 8 * cfg.max_seq_len * 4 * cfg.channels   # GPT-2 124M, B=8, T=1024
    numbers["recompute_saved"] = f"{saved:,}"
    numbers["recompute_saved_mib"] = f"{saved * BF16_BYTES / 2 ** 20:.0f}"
    plt = pyplot()
    view = np.abs(grid) <= 4.0
    gx = grid[view]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.0))
    axes[0].plot(gx, np.maximum(gx, 0), color="lightgray", lw=3, label="ReLU, for reference")
    axes[0].plot(gx, g_exact[view], color="black", lw=1, ls="--", label="exact: x Phi(x)")
    axes[0].plot(gx, g[view], color="#4c72b0", lw=1.5, label="tanh approximation (GPT-2)")
    axes[0].plot(grid[i_min], g[i_min], "o", color="#dd8452", label=f"minimum at x = {grid[i_min]:.2f}")
    axes[0].set_xlabel("x")
    axes[0].set_ylabel("gelu(x)")
    axes[0].set_title("GELU", fontsize=10)
    axes[1].plot(gx, (gx > 0).astype(float), color="lightgray", lw=3, label="ReLU'")
    axes[1].plot(gx, dg_exact[view], color="black", lw=1, ls="--", label="exact: Phi(x) + x phi(x)")
    axes[1].plot(gx, dg[view], color="#4c72b0", lw=1.5, label="gelu_backward's local_grad")
    axes[1].plot([grid[i_dmin], grid[i_dmax]], [dg[i_dmin], dg[i_dmax]], "o", color="#dd8452",
                 label="extremes of gelu'")
    axes[1].axhline(0, color="gray", lw=0.5)
    axes[1].axhline(1, color="gray", lw=0.5, ls=":")
    axes[1].set_xlabel("x")
    axes[1].set_ylabel("gelu'(x)")
    axes[1].set_title("its derivative", fontsize=10)
    for ax in axes:
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(True, alpha=0.3)
    save_figure(fig, fig_dir, "gelu_and_matmul_gelu.png", dpi=100)
    return numbers


def residual_experiment(rng, fig_dir):
    """The residual stream's gradient in a tiny float64 GPT-2, block by block."""
    V = 100
    cfg = GPT2Config(max_seq_len=16, vocab_size=V, padded_vocab_size=padded_vocab(V),
                     num_layers=4, num_heads=2, channels=16)
    B, T, L, NH, C = 1, cfg.max_seq_len, cfg.num_layers, cfg.num_heads, cfg.channels
    model = gpt2_init(cfg, seed=SEED, dtype=np.float64)
    inputs, targets = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    gpt2_forward(model, inputs, targets)
    gpt2_zero_grad(model)
    gpt2_backward(model)
    P, A = model.P, model.acts
    # With B=1 the encoder adds dresidual[0, t] into dwpe[t], and wpe is used nowhere else:
    # G["wpe"][:T] is exactly the residual stream's gradient at the bottom.
    dresidual_model = model.G["wpe"][:T].copy()                               # (T,C)

    def grads_like(*arrays):                                  # parameter gradients we do not look at
        return [np.zeros_like(a) for a in arrays]

    def backward(skip=True):
        """gpt2_backward's residual stream, written out again; with skip=False the identity path
        is dropped (dresidual = branch, a deliberate bug). Returns the bottom gradient and, per
        branch, (label, norm of the branch's term, norm of dresidual after adding it)."""
        dlosses = np.full((B, T), 1.0 / (B * T))
        dlogits = crossentropy_softmax_backward(dlosses, A["probs"], targets)
        dlnf = matmul_backward(*grads_like(P["wte"]), None, dlogits, A["lnf"], P["wte"])
        dresidual = layernorm_backward(*grads_like(P["lnfw"], P["lnfb"]), dlnf, A["residual3"][L - 1],
                                       P["lnfw"], A["lnf_mean"], A["lnf_rstd"])
        steps = [("lnf", np.linalg.norm(dresidual), np.linalg.norm(dresidual))]
        for l in reversed(range(L)):
            residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
            # MLP block: residual3 = residual2 + fcproj
            dresidual, dfcproj = residual_backward(dresidual)
            dfch_gelu = matmul_backward(*grads_like(P["fcprojw"][l], P["fcprojb"][l]), dfcproj,
                                        A["fch_gelu"][l], P["fcprojw"][l])
            dfch = gelu_backward(dfch_gelu, A["fch"][l])
            dln2 = matmul_backward(*grads_like(P["fcw"][l], P["fcb"][l]), dfch, A["ln2"][l], P["fcw"][l])
            branch = layernorm_backward(*grads_like(P["ln2w"][l], P["ln2b"][l]), dln2, A["residual2"][l],
                                        P["ln2w"][l], A["ln2_mean"][l], A["ln2_rstd"][l])
            dresidual = dresidual + branch if skip else branch
            steps.append((f"MLP {l}", np.linalg.norm(branch), np.linalg.norm(dresidual)))
            # attention block: residual2 = residual + attproj
            dresidual, dattproj = residual_backward(dresidual)
            datty = matmul_backward(*grads_like(P["attprojw"][l], P["attprojb"][l]), dattproj,
                                    A["atty"][l], P["attprojw"][l])
            dqkv = attention_backward(datty, A["qkv"][l], A["att"][l], NH)
            dln1 = matmul_backward(*grads_like(P["qkvw"][l], P["qkvb"][l]), dqkv, A["ln1"][l], P["qkvw"][l])
            branch = layernorm_backward(*grads_like(P["ln1w"][l], P["ln1b"][l]), dln1, residual,
                                        P["ln1w"][l], A["ln1_mean"][l], A["ln1_rstd"][l])
            dresidual = dresidual + branch if skip else branch
            steps.append((f"attn {l}", np.linalg.norm(branch), np.linalg.norm(dresidual)))
        return dresidual[0], steps

    dresidual, steps = backward()
    dresidual_noskip, _ = backward(skip=False)

    def mean_loss():
        gpt2_forward(model, inputs, targets)
        return model.mean_loss

    fd = numerical_grad(mean_loss, P["wpe"][:T])              # dL/d(encoded) = dL/dwpe[:T] for B=1
    top = steps[0][1]
    branches = sum(s[1] for s in steps[1:])
    numbers = {
        "res_L": f"{L}", "res_C": f"{C}", "res_T": f"{T}", "res_terms": f"{len(steps)}",
        "res_vs_model": f"{np.abs(dresidual - dresidual_model).max():.1e}",
        "res_fd_err": f"{rel_err(dresidual, fd):.1e}",
        "res_noskip_err": f"{rel_err(dresidual_noskip, fd):.2f}",
        "res_top_norm": f"{top:.4f}", "res_bottom_norm": f"{np.linalg.norm(dresidual):.4f}",
        "res_branch_norm_sum": f"{branches:.4f}",
    }
    plt = pyplot()
    labels = [s[0] for s in steps]
    pos = np.arange(len(steps))
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    ax.bar(pos, [s[1] for s in steps], color=["#dd8452"] + ["#4c72b0"] * (len(steps) - 1),
           label="norm of the term this step adds (lnf: the starting value)")
    ax.plot(pos, [s[2] for s in steps], "o-", color="black", label="norm of dresidual after the step")
    ax.set_xticks(pos)
    ax.set_xticklabels(labels, rotation=0, fontsize=8)
    ax.set_xlabel("backward order: top of the network (left) to the embedding (right)")
    ax.set_ylabel("Frobenius norm over (T,C)")
    ax.set_title(f"residual stream gradient, tiny GPT-2 at init (L={L}, C={C}, T={T})", fontsize=10)
    ax.set_ylim(0, 1.25 * max(max(s[1], s[2]) for s in steps))
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    save_figure(fig, fig_dir, "gelu_and_matmul_residual.png", dpi=100)
    return numbers


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment; save the figures into fig_dir; return {key: formatted number}."""
    rng = np.random.default_rng(SEED)
    numbers = {}
    numbers.update(matmul_experiment(rng))
    numbers.update(gelu_experiment(rng, fig_dir))
    numbers.update(residual_experiment(rng, fig_dir))
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
