"""
tests/check_gpt2.py: check gpt2_cpu.py against a debug state, as llm.c's test_gpt2.c does.

Loads an llm.c model checkpoint (fp32 or bf16) and a debug state (the inputs x, targets y, and
the logits, loss and 16 parameter gradients a reference computed for them), runs gpt2_cpu's
forward and backward on (x, y), compares every tensor against the reference with the tolerances
of the TOLERANCES table, then takes ten AdamW steps on that one batch and checks that the loss
goes down. The reference is usually the PyTorch twin (dev/torch_reference.py) or llm.c's own
train_gpt2.py (gpt2_124M.bin + gpt2_124M_debug_state.bin).

What it deliberately is not: a pytest file (tests/test_twin.py runs it end to end) or a check of
the training losses against stored numbers (llm.c hard-codes those for GPT-2 124M only).

Run it:
    python dev/torch_reference.py -e d2 -x 0 --write-model d2.bin --write-debug-state d2_debug.bin
    python tests/check_gpt2.py -e d2.bin -s d2_debug.bin
prints one line per tensor, ten losses and a verdict, e.g.
    dwpe: TENSOR OK, maxdiff=1.455e-08 (rel to max|ref| 6.580e-07) | first: -0.00157849/-0.00157849 ...
    step 0: loss 10.846334
    overall okay: True
Exit status: 0 all checks pass, 2 a check failed, 1 bad input (one line on stderr).
`--cuda` is the hook for checking gpt2_cuda.py the same way; it is not available yet.
"""

import argparse
import os
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import gpt2_cpu  # noqa: E402  (needs the repository root on sys.path)
from llmc import formats  # noqa: E402
from llmc.check import check_tensor  # noqa: E402
from llmc.formats import HEADER_BYTES  # noqa: E402
from llmc.utils import InputError  # noqa: E402

# ----------------------------------------------------------------------------
# tolerances: the one table
#
# name -> (atol, rtol). A tensor passes when every element satisfies
#     |got - ref| <= atol * max|ref| + rtol * |ref|
# i.e. atol is a fraction of the tensor's largest magnitude: one table then serves random-init
# and pretrained models, whose gradients differ by orders of magnitude, and a tensor of tiny
# values cannot pass just by being tiny. (Elementwise relative error alone is useless here: some
# gradients are exactly 0 in exact math, e.g. the key bias, and are rounding noise in fp32.)
#
# How chosen: fp32 PyTorch twin (MKL) vs fp32 gpt2_cpu (NumPy/OpenBLAS) at the GPT-2 124M shape
# (d12), random init, B=4, T=64: max|diff| / max|ref| reached 1.1e-6 for the logits and up to
# 2.2e-6 for the gradients (wpe; most are ~1e-6); the loss agreed to 1.2e-7 relative. The
# tolerances are about 10x that, room for longer sequences and other BLAS builds, and 50x tighter
# than a single gradient element off by 1e-3 of max|ref| (tests/test_twin.py checks that fails).
FRACTION_OF_MAX = 2e-5        # gradients: atol as a fraction of max|ref|
TOLERANCES = {
    "logits": (1e-5, 0.0),
    "loss": (0.0, 1e-5),      # a scalar: relative
    "dwte": (FRACTION_OF_MAX, 0.0), "dwpe": (FRACTION_OF_MAX, 0.0),
    "dln1w": (FRACTION_OF_MAX, 0.0), "dln1b": (FRACTION_OF_MAX, 0.0),
    "dqkvw": (FRACTION_OF_MAX, 0.0), "dqkvb": (FRACTION_OF_MAX, 0.0),
    "dattprojw": (FRACTION_OF_MAX, 0.0), "dattprojb": (FRACTION_OF_MAX, 0.0),
    "dln2w": (FRACTION_OF_MAX, 0.0), "dln2b": (FRACTION_OF_MAX, 0.0),
    "dfcw": (FRACTION_OF_MAX, 0.0), "dfcb": (FRACTION_OF_MAX, 0.0),
    "dfcprojw": (FRACTION_OF_MAX, 0.0), "dfcprojb": (FRACTION_OF_MAX, 0.0),
    "dlnfw": (FRACTION_OF_MAX, 0.0), "dlnfb": (FRACTION_OF_MAX, 0.0),
}

# the ten training steps: test_gpt2.c's gpt2_update(&model, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, step+1)
TRAIN_STEPS = 10
TRAIN_LR = 1e-4
TRAIN_BETA1, TRAIN_BETA2 = 0.9, 0.999
TRAIN_EPS = 1e-8
TRAIN_WEIGHT_DECAY = 0.01
PRINT_WORST = 3               # how many worst elements a failing tensor prints


# ----------------------------------------------------------------------------
# comparison

def check_one(got, ref, label, tolerance, verbose=False):
    """Check one tensor with check_tensor (numpy.isclose's rule) after turning the
    table's atol, a fraction of max|ref|, into an absolute one. Prints check_tensor's verdict line
    (label, TENSOR OK / NOT OK, max abs diff, max diff relative to max|ref|, first pairs) and,
    for a failing tensor, its worst elements. Returns (ok, max_abs_diff, max_rel_diff)."""
    atol_fraction, rtol = tolerance
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    ok = check_tensor(got, ref, label, atol_fraction * scale, rtol)
    if got.shape != ref.shape:
        return False, float("inf"), float("inf")
    diff = np.abs(got - ref)
    max_abs = float(diff.max()) if diff.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    if verbose or not ok:
        flat = np.nan_to_num(diff, nan=np.inf).ravel()
        worst = np.argpartition(flat, -PRINT_WORST)[-PRINT_WORST:] if flat.size > PRINT_WORST else range(flat.size)
        for i in sorted(worst, key=lambda j: -flat[j]):
            idx = np.unravel_index(i, ref.shape)
            print(f"    worst at {tuple(int(j) for j in idx)}: got {got[idx]:.9g} ref {ref[idx]:.9g}")
    return ok, max_abs, max_rel


def compare_outputs(logits, loss, grads, ref, tolerances=TOLERANCES, verbose=False):
    """Compare a forward/backward (logits (B,T,V), loss float, grads {name: array}) against a
    reference dict of the same (formats.read_debug_state's layout). Prints one line per tensor.
    Returns (all_ok, {label: (ok, max_abs_diff, max_rel_diff)})."""
    results = {"logits": check_one(logits, ref["logits"], "logits", tolerances["logits"], verbose)}
    results["loss"] = check_one(np.array([loss]), np.array([ref["loss"]]), "loss", tolerances["loss"], verbose)
    for name, g in grads.items():
        results["d" + name] = check_one(g, ref["grads"][name], "d" + name, tolerances["d" + name], verbose)
    return all(r[0] for r in results.values()), results


# ----------------------------------------------------------------------------
# backends: what is being checked. --cuda will add gpt2_cuda.py here.

def cpu_forward_backward(model, x, y):
    """gpt2_cpu forward + backward on (B,T) x, y. Returns logits (B,T,V), loss, {name: grad}."""
    V = model.config.vocab_size
    logits = gpt2_cpu.gpt2_forward(model, x, y)
    gpt2_cpu.gpt2_zero_grad(model)
    gpt2_cpu.gpt2_backward(model)
    return logits[..., :V], model.mean_loss, dict(model.G)


def cpu_train_steps(model, x, y, steps):
    """`steps` AdamW steps of gpt2_cpu on the one batch (x, y); returns the loss before each."""
    losses = []
    for step in range(steps):
        gpt2_cpu.gpt2_forward(model, x, y)
        gpt2_cpu.gpt2_zero_grad(model)
        gpt2_cpu.gpt2_backward(model)
        gpt2_cpu.gpt2_update(model, TRAIN_LR, TRAIN_BETA1, TRAIN_BETA2, TRAIN_EPS, TRAIN_WEIGHT_DECAY, step + 1)
        losses.append(model.mean_loss)
        print(f"step {step}: loss {model.mean_loss:.6f}")
    return losses


def load(model_path, state_path):
    """Read the checkpoint and its debug state; check the state's size fits the model.
    Raises InputError with a one-line message."""
    model = gpt2_cpu.read_model(model_path)
    cfg = model.config
    state = formats.read_debug_state(state_path, cfg.vocab_size, gpt2_cpu.parameter_shapes(cfg))
    B, T = state["x"].shape
    expected = HEADER_BYTES + 4 * (2 * B * T + B * T * cfg.vocab_size + 1 + model.num_parameters)
    size = os.path.getsize(state_path)
    if size != expected:
        raise InputError(f"{state_path}: {size} bytes, but a debug state of B={B} T={T} for this model "
                         f"(V={cfg.vocab_size}, {model.num_parameters} parameters) has {expected}: "
                         f"it belongs to another model")
    if T > cfg.max_seq_len:
        raise InputError(f"{state_path}: T={T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    return model, state


def check(model_path, state_path, backend="cpu", verbose=False):
    """The whole check. Returns True if every tensor is within tolerance and the ten training
    losses decrease. Raises InputError on bad files or an unavailable backend."""
    if backend != "cpu":
        raise InputError(f"--{backend}: not available yet (gpt2_cuda.py has no check backend)")
    model, state = load(model_path, state_path)
    cfg = model.config
    x, y = state["x"], state["y"]
    print(f"model {model_path}: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} V={cfg.vocab_size} "
          f"Vp={cfg.padded_vocab_size} | debug state {state_path}: B={x.shape[0]} T={x.shape[1]}")

    logits, loss, grads = cpu_forward_backward(model, x, y)
    print(f"loss: {loss:.6f} (reference {state['loss']:.6f})")
    tensors_ok, _ = compare_outputs(logits, loss, grads, state, verbose=verbose)

    print(f"training {TRAIN_STEPS} AdamW steps on this batch (lr {TRAIN_LR:g}):")
    losses = cpu_train_steps(model, x, y, TRAIN_STEPS)
    decreasing = all(b < a for a, b in zip(losses, losses[1:]))
    print(f"losses decrease: {decreasing}")
    return tensors_ok and decreasing


def main(argv=None):
    p = argparse.ArgumentParser(prog="check_gpt2.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-e", "--model", required=True, help="model checkpoint .bin (fp32 or bf16)")
    p.add_argument("-s", "--debug-state", required=True, help="debug-state .bin written for that model")
    p.add_argument("--cuda", action="store_true", help="check gpt2_cuda.py instead (not available yet)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the worst pairs of every tensor")
    args = p.parse_args(argv)
    try:
        ok = check(args.model, args.debug_state, "cuda" if args.cuda else "cpu", args.verbose)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"overall okay: {ok}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
