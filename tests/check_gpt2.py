"""
tests/check_gpt2.py: check gpt2_cpu.py against a debug state, as llm.c's test_gpt2.c does.

Loads an llm.c model checkpoint (fp32 or bf16) and a debug state (the inputs x, targets y, and
the logits, loss and 16 parameter gradients a reference computed for them), runs gpt2_cpu's
forward and backward on (x, y), compares every tensor against the reference with the tolerances
of the TOLERANCES table, then takes ten AdamW steps on that one batch and checks the ten losses:
- against expected losses, each within LOSS_ATOL as llm.c's test_gpt2.c, when given: `--losses FILE`
  (ten numbers), or `--gpt2-124M-losses` for the ones test_gpt2.c hard-codes for the pretrained
  GPT-2 124M (gpt2_124M.bin); never applied on its own, since a random-init 124M has the same shape;
- otherwise, only that the last loss is below the first. Not that every loss is below the one
  before: these steps are AdamW without gradient clipping, and a valid model can bounce (a
  random-init GPT-2 124M on one B=1 T=8 batch went 10.69, 5.91, 2.42, 2.93, 1.32, ...).
The reference is usually the PyTorch twin (dev/torch_reference.py) or llm.c's own
train_gpt2.py (gpt2_124M.bin + gpt2_124M_debug_state.bin).

What it deliberately is not: a pytest file (tests/test_twin.py runs it end to end).

Run it:
    python dev/torch_reference.py -e d2 -x 0 --write-model d2.bin --write-debug-state d2_debug.bin
    python tests/check_gpt2.py -e d2.bin -s d2_debug.bin
prints one line per tensor, ten losses and a verdict, e.g. (data/ from the offline Shakespeare)
    dwpe: TENSOR OK, maxdiff=1.537e-08 (rel to max|ref| 5.853e-07) | first: 0.000511229/0.000511228 ...
    step 0: loss 10.820799
    ...
    step 9: loss 10.187573
    loss goes down (last 10.187573 < first 10.820799; single steps may bounce): True
    overall okay: True
With llm.c's own files and its expected losses
    python tests/check_gpt2.py -e gpt2_124M.bin -s gpt2_124M_debug_state.bin --gpt2-124M-losses
each step's line adds "(expected 5.270007, OK)" or "NOT OK", and the verdict reads
    losses match the expected ones (llm.c's GPT-2 124M, |diff| < 0.01): True or False
Exit status: 0 all checks pass, 2 a check failed, 1 bad input (one line on stderr).
`--cuda` is the hook for checking gpt2_cuda.py the same way; it is not available yet.
"""

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from llmc.interrupt import quiet_ctrl_c_while_importing  # noqa: E402
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback

import numpy as np  # noqa: E402

import gpt2_cpu  # noqa: E402  (needs the repository root on sys.path)
from llmc import formats  # noqa: E402
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.check import check_tensor  # noqa: E402
from llmc.formats import HEADER_BYTES  # noqa: E402
from llmc.utils import InputError, check_regular_file  # noqa: E402

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

# the expected losses: test_gpt2.c fails a step when fabsf(loss - expected) >= 1e-2
LOSS_ATOL = 1e-2
# test_gpt2.c's expected_losses: the pretrained GPT-2 124M (gpt2_124M.bin) on the batch of
# gpt2_124M_debug_state.bin, with the AdamW settings above
GPT2_124M_EXPECTED_LOSSES = (
    5.270007133483887, 4.059706687927246, 3.3751230239868164, 2.8007826805114746, 2.315382242202759,
    1.8490285873413086, 1.3946564197540283, 0.9991465210914612, 0.6240804195404053, 0.37651097774505615,
)


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


def cpu_train_steps(model, x, y, steps, expected=None):
    """`steps` AdamW steps of gpt2_cpu on the one batch (x, y); returns the loss before each.
    Prints each loss, and next to it the expected one, when given, and whether it is within LOSS_ATOL."""
    losses = []
    for step in range(steps):
        gpt2_cpu.gpt2_forward(model, x, y)
        gpt2_cpu.gpt2_zero_grad(model)
        gpt2_cpu.gpt2_backward(model)
        gpt2_cpu.gpt2_update(model, TRAIN_LR, TRAIN_BETA1, TRAIN_BETA2, TRAIN_EPS, TRAIN_WEIGHT_DECAY, step + 1)
        losses.append(model.mean_loss)
        line = f"step {step}: loss {model.mean_loss:.6f}"
        if expected is not None:
            ok = abs(model.mean_loss - expected[step]) < LOSS_ATOL
            line += f" (expected {expected[step]:.6f}, {'OK' if ok else 'NOT OK'})"
        print(line)
    return losses


# ----------------------------------------------------------------------------
# the training verdict

def read_expected_losses(path, count=TRAIN_STEPS):
    """A text file of `count` finite numbers, one per line or separated by any whitespace ->
    tuple of floats. Raises InputError with a one-line message."""
    check_regular_file(path, "the expected losses")               # a FIFO would wait forever
    try:
        with open(path, encoding="utf-8") as f:
            words = f.read().split()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the expected losses ({getattr(e, 'strerror', None) or e})") from None
    try:
        losses = tuple(float(w) for w in words)
    except ValueError as e:
        raise InputError(f"{path}: not a number: {str(e).split(': ', 1)[-1][:40]}") from None
    if len(losses) != count:
        raise InputError(f"{path}: {len(losses)} numbers, expected {count} (one loss per training step)")
    if not all(np.isfinite(losses)):
        raise InputError(f"{path}: the expected losses must be finite numbers")
    return losses


def losses_ok(losses, expected=None, expected_source="expected"):
    """The verdict on the ten training losses -> (ok, one line saying what was checked).
    With expected losses: every one within LOSS_ATOL of its expected value (test_gpt2.c's rule).
    Without: the last below the first; single steps may go up (un-clipped AdamW bounces)."""
    if expected is not None:
        ok = len(losses) == len(expected) and all(abs(a - b) < LOSS_ATOL for a, b in zip(losses, expected))
        return ok, f"losses match the expected ones ({expected_source}, |diff| < {LOSS_ATOL:g}): {ok}"
    ok = bool(losses[-1] < losses[0])          # False for NaN, as it should
    return ok, f"loss goes down (last {losses[-1]:.6f} < first {losses[0]:.6f}; single steps may bounce): {ok}"


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


def check(model_path, state_path, backend="cpu", verbose=False, expected_losses=None, expected_source="expected"):
    """The whole check. Returns True if every tensor is within tolerance and the ten training
    losses pass losses_ok (they match expected_losses when given, else the last is below the
    first). Raises InputError on bad files or an unavailable backend."""
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
    losses = cpu_train_steps(model, x, y, TRAIN_STEPS, expected_losses)
    training_ok, verdict = losses_ok(losses, expected_losses, expected_source)
    print(verdict)
    return tensors_ok and training_ok


def main(argv=None):
    p = ArgumentParser(prog="check_gpt2.py", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-e", "--model", required=True, help="model checkpoint .bin (fp32 or bf16)")
    p.add_argument("-s", "--debug-state", required=True, help="debug-state .bin written for that model")
    p.add_argument("--cuda", action="store_true", help="check gpt2_cuda.py instead (not available yet)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the worst pairs of every tensor")
    expected = p.add_mutually_exclusive_group()
    expected.add_argument("--losses", metavar="FILE", default=None,
                          help=f"expected losses of the {TRAIN_STEPS} training steps (numbers separated by "
                               f"whitespace or newlines), each to be matched within {LOSS_ATOL:g}; without it "
                               "(or --gpt2-124M-losses) only the last loss must be below the first")
    expected.add_argument("--gpt2-124M-losses", action="store_true",
                          help="expect llm.c's test_gpt2.c losses: only for llm.c's pretrained gpt2_124M.bin "
                               "and gpt2_124M_debug_state.bin")
    return run_main(check_command, p.parse_args(argv))


def check_command(args):
    """The command line's check: 0 when every check passes, 2 when one fails. Bad input and
    unreadable files raise (run_main makes them one line and exit 1)."""
    expected_losses, expected_source = None, "expected"
    if args.losses is not None:
        expected_losses, expected_source = read_expected_losses(args.losses), args.losses
    elif args.gpt2_124M_losses:
        expected_losses, expected_source = GPT2_124M_EXPECTED_LOSSES, "llm.c's GPT-2 124M"
    ok = check(args.model, args.debug_state, "cuda" if args.cuda else "cpu", args.verbose,
               expected_losses, expected_source)
    print(f"overall okay: {ok}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
