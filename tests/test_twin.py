"""
tests/test_twin.py: gpt2_cpu.py against its independent PyTorch twin (dev/torch_reference.py).

The twin computes every gradient with torch.autograd from its own nn.Modules, its own file code
and its own schedules; nothing is shared with gpt2_cpu.py but the algorithm. Checked here:
the random init (bit for bit), logits / loss / all 16 gradients in fp32 (small config, d2, and
the GPT-2 124M shape d12) and in fp64 (much tighter), ten AdamW steps with clipping, a cosine
schedule with warmup and weight decay, the checkpoint files (fp32 and bf16) both ways, and
tests/check_gpt2.py end to end (a pass, a corrupted gradient, bad files, a valid model whose
training losses bounce, expected losses from --losses FILE and --gpt2-124M-losses), and the twin's
command line: bad flags and bad checkpoints are the trainers' one `error:` line, exit 1.

Run it (about a minute on 2 cores; -s prints the error reached on every tensor):
    python -m pytest -q tests/test_twin.py
"""

import importlib.util
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import gpt2_cpu as cpu  # noqa: E402
from llmc import dataloader, formats  # noqa: E402


def _load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TWIN_PATH = os.path.join(REPO_ROOT, "dev", "torch_reference.py")
CHECK_PATH = os.path.join(REPO_ROOT, "tests", "check_gpt2.py")
twin = _load_module("torch_reference", TWIN_PATH)
check_gpt2 = _load_module("check_gpt2", CHECK_PATH)

# a small config that is none of the descriptors: V not a multiple of 128, short maxT
SMALL = cpu.GPT2Config(max_seq_len=96, vocab_size=1000, padded_vocab_size=cpu.padded_vocab(1000),
                       num_layers=2, num_heads=4, channels=64)
CONFIGS = {"small": (SMALL, 4, 32), "d2": (cpu.config_from_descriptor("d2"), 4, 64),
           "d12": (cpu.config_from_descriptor("d12"), 4, 64)}
SEED = 42

# fp32 tolerances: the one table of tests/check_gpt2.py (its comment says how they were chosen).
FP32_TOLERANCES = check_gpt2.TOLERANCES
# fp64: both sides compute in float64 from the same float32 draws; measured max|diff|/max|ref|
# was ~1e-15 on every tensor (small config), so 1e-13 leaves 100x for summation order.
FP64_TOL = (1e-13, 0.0)
FP64_TOLERANCES = {"logits": FP64_TOL, "loss": (0.0, 1e-13),
                   **{"d" + name: FP64_TOL for name in cpu.PARAMETER_NAMES}}
# ten training steps in fp32: Adam divides by sqrt(v), which amplifies rounding differences in
# near-zero gradients; the per-step losses were measured to agree to 7e-7 relative in the test
# below and to 2e-6 when overfitting one batch at lr 1e-2; grad norms to ~1e-6.
TRAIN_LOSS_RTOL = 2e-5
TRAIN_NORM_RTOL = 1e-5


def random_batch(V, B, T, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, B * T + 1).astype(np.int32)
    return tokens[:-1].reshape(B, T), tokens[1:].reshape(B, T)


def make_pair(config, dtype=np.float32):
    """gpt2_cpu model and twin from the same seed; asserts their parameters are identical."""
    model = cpu.gpt2_init(config, SEED, dtype)
    t = twin.Twin.init(config, SEED, dtype=torch.float64 if dtype == np.float64 else torch.float32)
    for (name, _), p in zip(model.param_shapes, t.parameters()):
        assert p.dtype == dtype and np.array_equal(model.P[name], p), f"init differs in {name}"
    return model, t


def run_twin(args, env=None):
    return subprocess.run([sys.executable, TWIN_PATH] + args, capture_output=True, text=True, env=env, timeout=300)


def run_check(model_path, state_path, *extra):
    return subprocess.run([sys.executable, CHECK_PATH, "-e", model_path, "-s", state_path, *extra],
                          capture_output=True, text=True, timeout=300)


def printed_losses(stdout):
    """The ten training losses check_gpt2.py printed ("step k: loss X ...")."""
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


# ----------------------------------------------------------------------------
# init

@pytest.mark.parametrize("name", ["small", "d2"])
def test_init_matches_gpt2_init(name):
    config = CONFIGS[name][0]
    model, t = make_pair(config)                                # asserts equality per tensor
    params = dict(zip(cpu.PARAMETER_NAMES, t.parameters()))
    assert np.all(params["wte"][config.vocab_size:] == 0)      # padding rows
    resid_std = 0.02 / math.sqrt(2 * config.num_layers)
    for name, std in (("wte", 0.02), ("qkvw", 0.02), ("fcprojw", resid_std)):
        w = params[name][:config.vocab_size] if name == "wte" else params[name]
        assert abs(w.std() / std - 1) < 0.05 and abs(w.mean()) < 0.1 * std, name
    assert np.all(params["ln1w"] == 1) and np.all(params["qkvb"] == 0)
    wte = params["wte"]
    other = twin.Twin.init(config, SEED + 1).parameters()
    assert not np.array_equal(other[0], wte), "the seed must change the draws"


# ----------------------------------------------------------------------------
# forward and backward: logits, loss, 16 gradients

@pytest.mark.parametrize("name", ["small", "d2", "d12"])
def test_forward_backward_fp32(name):
    config, B, T = CONFIGS[name]
    model, t = make_pair(config)
    x, y = random_batch(config.vocab_size, B, T)
    logits, loss, grads = check_gpt2.cpu_forward_backward(model, x, y)
    tl, tloss, tgrads = t.forward_backward(x, y)
    ref = {"logits": tl, "loss": tloss, "grads": dict(zip(cpu.PARAMETER_NAMES, tgrads))}
    print(f"\nfp32 {name} B={B} T={T}: gpt2_cpu vs twin")
    ok, results = check_gpt2.compare_outputs(logits, loss, grads, ref, FP32_TOLERANCES)
    assert ok, {k: v for k, v in results.items() if not v[0]}
    assert math.isclose(loss, math.log(config.vocab_size), rel_tol=0.05)   # random init: ~uniform


def test_forward_backward_fp64_small():
    config, B, T = CONFIGS["small"]
    model, t = make_pair(config, np.float64)
    x, y = random_batch(config.vocab_size, B, T, seed=1)
    logits, loss, grads = check_gpt2.cpu_forward_backward(model, x, y)
    tl, tloss, tgrads = t.forward_backward(x, y)
    assert tl.dtype == np.float64 and all(g.dtype == np.float64 for g in tgrads)
    ref = {"logits": tl, "loss": tloss, "grads": dict(zip(cpu.PARAMETER_NAMES, tgrads))}
    print("\nfp64 small: gpt2_cpu vs twin")
    ok, results = check_gpt2.compare_outputs(logits, loss, grads, ref, FP64_TOLERANCES)
    assert ok, {k: v for k, v in results.items() if not v[0]}


def test_flash_attention_matches_explicit():
    """F.scaled_dot_product_attention (the fast path) vs the explicit masked softmax, fp64."""
    config, B, T = CONFIGS["small"]
    x, y = random_batch(config.vocab_size, B, T, seed=2)
    slow = twin.Twin.init(config, SEED, dtype=torch.float64).forward_backward(x, y)
    fast = twin.Twin.init(config, SEED, dtype=torch.float64, flash=True).forward_backward(x, y)
    np.testing.assert_allclose(fast[0], slow[0], rtol=0, atol=1e-12)
    assert math.isclose(fast[1], slow[1], rel_tol=1e-13)
    for a, b in zip(fast[2], slow[2]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13 * np.abs(b).max())


# ----------------------------------------------------------------------------
# optimizer and schedules

def test_learning_rate_schedules_match():
    N = 50
    for schedule in twin.LR_SCHEDULES:
        for warmup in (0, 5):
            for frac in (0.0, 0.1):
                ours = [twin.learning_rate_at(s, schedule, 6e-4, warmup, N, frac) for s in range(N + 1)]
                theirs = [cpu.learning_rate_at(s, schedule, 6e-4, warmup, N, frac) for s in range(N + 1)]
                np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=0, err_msg=f"{schedule} {warmup} {frac}")
    # the shapes themselves: warmup ramps, cosine ends at min_lr, wsd holds then cools down
    assert twin.learning_rate_at(0, "cosine", 1.0, 5, N, 0.1) == pytest.approx(0.2)
    assert twin.learning_rate_at(N, "cosine", 1.0, 5, N, 0.1) == pytest.approx(0.1)
    assert twin.learning_rate_at(int(0.8 * N) - 1, "wsd", 1.0, 5, N, 0.0) == 1.0


def test_ten_adamw_steps_match(tmp_path):
    """Ten steps, consecutive batches from one shard: cosine with warmup, weight decay 0.1 (two
    groups), global-norm clipping that fires on some steps and not on others."""
    config, B, T = CONFIGS["small"]
    steps, lr, warmup, final_frac, wd, clip = 10, 1e-2, 3, 0.1, 0.1, 2.5   # norms run 1.3..17
    shard = str(tmp_path / "train.bin")
    pattern = np.random.default_rng(3).integers(0, config.vocab_size, 3 * T)   # a text to memorize
    formats.write_shard(shard, np.resize(pattern, steps * B * T + 1))
    model, t = make_pair(config)

    loader = dataloader.DataLoader(shard, B, T)
    cpu_losses, cpu_norms = [], []
    for step in range(steps):
        x, y = loader.next_batch()
        cpu.gpt2_zero_grad(model)
        cpu.gpt2_forward(model, x, y)
        cpu.gpt2_backward(model)
        norm = cpu.gpt2_grad_norm(model)
        grad_scale = clip / norm if 0 < clip < norm else 1.0
        step_lr = cpu.learning_rate_at(step, "cosine", lr, warmup, steps, final_frac)
        cpu.gpt2_update(model, step_lr, 0.9, 0.95, 1e-8, wd, step + 1, grad_scale)
        cpu_losses.append(model.mean_loss)
        cpu_norms.append(norm)

    twin_loader = twin.TokenLoader(shard, B, T)
    batches = [twin_loader.next_batch() for _ in range(steps)]
    check_loader = dataloader.DataLoader(shard, B, T)
    for x, y in batches:                                        # the twin reads the same batches
        cx, cy = check_loader.next_batch()
        assert np.array_equal(x.numpy(), cx) and np.array_equal(y.numpy(), cy)
    twin_norms = []
    twin_losses = t.train_steps(batches, lr, steps, "cosine", warmup, final_frac, wd, clip,
                                on_step=lambda s, loss, norm, step_lr, dt: twin_norms.append(norm))

    print("\nstep | gpt2_cpu loss | twin loss | rel diff | norm")
    for s, (a, b, n) in enumerate(zip(cpu_losses, twin_losses, cpu_norms)):
        print(f"{s:4d} | {a:.7f} | {b:.7f} | {abs(a - b) / a:.1e} | {n:.4f}")
    assert any(n > clip for n in cpu_norms) and any(n < clip for n in cpu_norms), "clipping not exercised"
    np.testing.assert_allclose(twin_losses, cpu_losses, rtol=TRAIN_LOSS_RTOL, atol=0)
    np.testing.assert_allclose(twin_norms, cpu_norms, rtol=TRAIN_NORM_RTOL, atol=0)
    assert cpu_losses[-1] < 0.8 * cpu_losses[0]                # it learns: the updates are real


# ----------------------------------------------------------------------------
# files

def test_checkpoint_files_both_ways(tmp_path):
    config = CONFIGS["small"][0]
    t = twin.Twin.init(config, SEED)
    # a few exact bf16 ties, to check both roundings go to the even mantissa
    ties = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -9 * (1 + 2 ** -8)], np.float32)
    params = t.parameters()
    params[-1][:ties.size] = ties                               # lnfb
    t.set_parameters(params)
    fp32 = t.parameters()

    t.save_checkpoint(str(tmp_path / "m32.bin"), "float32")
    m32 = cpu.read_model(str(tmp_path / "m32.bin"))
    assert m32.config == config
    for (name, _), p in zip(m32.param_shapes, fp32):
        assert np.array_equal(m32.P[name], p), name

    t.save_checkpoint(str(tmp_path / "m16.bin"), "bfloat16")
    header = np.fromfile(str(tmp_path / "m16.bin"), dtype="<i4", count=8)
    assert list(header[:2]) == [formats.MODEL_MAGIC, formats.MODEL_VERSION_BF16]
    m16 = cpu.read_model(str(tmp_path / "m16.bin"))
    for (name, _), p in zip(m16.param_shapes, fp32):
        rounded = formats.bfloat16_bits_to_float32(formats.float32_to_bfloat16_bits(p))
        assert np.array_equal(m16.P[name], rounded), name
    assert list(m16.P["lnfb"][:ties.size]) == [1.0, 1 + 2 ** -6, -1.0, 2 ** -9]
    assert not np.array_equal(m16.P["qkvw"], m32.P["qkvw"])    # bf16 really rounded

    # and back: the twin reads what gpt2_cpu writes, fp32 exactly, bf16 as rounded
    model = cpu.gpt2_init(config, SEED + 7)
    cpu.write_model(str(tmp_path / "c32.bin"), model)
    cpu.write_model(str(tmp_path / "c16.bin"), model, "bfloat16")
    for path, m in ((tmp_path / "c32.bin", model), (tmp_path / "c16.bin", cpu.read_model(str(tmp_path / "c16.bin")))):
        back = twin.Twin.from_checkpoint(str(path))
        assert back.config == twin.as_config(config)
        for (name, _), p in zip(m.param_shapes, back.parameters()):
            assert np.array_equal(m.P[name], p), f"{path.name} {name}"


def test_debug_state_layout(tmp_path):
    """The twin's debug state reads back through gpt2_cpu.read_debug_state unchanged."""
    config, B, T = CONFIGS["small"]
    t = twin.Twin.init(config, SEED)
    x, y = random_batch(config.vocab_size, B, T, seed=4)
    logits, loss, grads = t.write_debug_state(str(tmp_path / "s.bin"), x, y)
    state = formats.read_debug_state(str(tmp_path / "s.bin"), config.vocab_size, cpu.parameter_shapes(config))
    assert np.array_equal(state["x"], x) and np.array_equal(state["y"], y)
    assert state["logits"].shape == (B, T, config.vocab_size) and np.array_equal(state["logits"], logits)
    assert state["loss"] == np.float32(loss)
    for name, g in zip(cpu.PARAMETER_NAMES, grads):
        assert np.array_equal(state["grads"][name], g), name
    assert np.all(state["grads"]["wte"][config.vocab_size:] == 0)  # padded rows: no gradient
    size = os.path.getsize(tmp_path / "s.bin")
    P = cpu.num_elements(cpu.parameter_shapes(config))
    assert size == formats.HEADER_BYTES + 4 * (2 * B * T + B * T * config.vocab_size + 1 + P)


# ----------------------------------------------------------------------------
# command lines end to end: twin CLI -> files -> check_gpt2.py

def test_check_gpt2_end_to_end(tmp_path):
    """The twin CLI trains d2 two steps on a shard (same losses as gpt2_cpu), writes the starting
    model and the first batch's debug state; check_gpt2.py passes on them, fails on a corrupted
    gradient, and rejects bad files with one line."""
    config, B, T = cpu.config_from_descriptor("d2"), 2, 32
    shard = str(tmp_path / "train.bin")
    formats.write_shard(shard, np.random.default_rng(5).integers(0, config.vocab_size, 8 * B * T + 1))
    model_path, state_path = str(tmp_path / "d2.bin"), str(tmp_path / "d2_debug.bin")
    r = run_twin(["-e", "d2", "--seed", str(SEED), "-i", shard, "-b", str(B), "-t", str(T), "-x", "2",
                  "-l", "1e-3", "-u", "1", "-c", "0.1", "--write-model", model_path, "--write-debug-state", state_path])
    assert r.returncode == 0, r.stderr
    twin_losses = [float(line.split("| loss ")[1].split()[0]) for line in r.stdout.splitlines()
                   if line.startswith("step")]

    model = cpu.gpt2_init(config, SEED)
    loader = dataloader.DataLoader(shard, B, T)
    cpu_losses = []
    for step in range(2):
        x, y = loader.next_batch()
        cpu.gpt2_zero_grad(model)
        cpu.gpt2_forward(model, x, y)
        cpu.gpt2_backward(model)
        norm = cpu.gpt2_grad_norm(model)
        lr = cpu.learning_rate_at(step, "cosine", 1e-3, 1, 2, 0.0)
        cpu.gpt2_update(model, lr, 0.9, 0.95, 1e-8, 0.1, step + 1, 1.0 / norm if norm > 1.0 else 1.0)
        cpu_losses.append(model.mean_loss)
    np.testing.assert_allclose(twin_losses, cpu_losses, rtol=TRAIN_LOSS_RTOL)   # printed with 6 decimals

    r = run_check(model_path, state_path)
    print("\n" + r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "overall okay: True" in r.stdout and "NOT OK" not in r.stdout
    assert r.stdout.count("TENSOR OK") == 18                 # logits, loss, 16 gradients

    # corrupt one gradient element by 1e-3 of the tensor's largest value (50x the tolerance)
    state = formats.read_debug_state(state_path, config.vocab_size, cpu.parameter_shapes(config))
    grads = dict(state["grads"])
    qkvw = grads["qkvw"].copy()
    qkvw[1, 5, 7] += 1e-3 * np.abs(qkvw).max()
    grads["qkvw"] = qkvw
    bad_path = str(tmp_path / "bad_debug.bin")
    formats.write_debug_state(bad_path, state["x"], state["y"], state["logits"], state["loss"],
                          [grads[n] for n in cpu.PARAMETER_NAMES])
    r = run_check(model_path, bad_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "overall okay: False" in r.stdout
    assert [line.split(":")[0] for line in r.stdout.splitlines() if "TENSOR NOT OK" in line] == ["dqkvw"]
    assert r.stdout.count("TENSOR OK") == 17

    # bad magic: one line on stderr naming the file, exit 1
    junk = str(tmp_path / "junk.bin")
    with open(junk, "wb") as f:
        f.write(np.full(formats.HEADER_INTS, 7, dtype="<i4").tobytes())
    for args in ((junk, state_path), (model_path, junk)):
        r = run_check(*args)
        assert r.returncode == 1 and r.stdout == ""
        assert len(r.stderr.strip().splitlines()) == 1 and junk in r.stderr and "bad magic" in r.stderr

    # a debug state written for another model: one line, exit 1
    small, sB, sT = CONFIGS["small"]
    other = str(tmp_path / "small_debug.bin")
    twin.Twin.init(small, SEED).write_debug_state(other, *random_batch(small.vocab_size, sB, sT))
    r = run_check(model_path, other)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and other in r.stderr


def test_twin_cli_bad_input(tmp_path):
    """--hf without transformers, and a missing checkpoint: one line on stderr, exit 1."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "transformers.py").write_text("raise ImportError('hidden by the test')\n")
    env = dict(os.environ, PYTHONPATH=str(shadow) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = run_twin(["--hf", "gpt2"], env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "transformers" in r.stderr

    missing = str(tmp_path / "nope.bin")
    r = run_twin(["-e", missing])
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and missing in r.stderr


# ----------------------------------------------------------------------------
# check_gpt2.py's verdict on the ten training losses

# A random-init model that is deep and wide enough bounces under check_gpt2's un-clipped AdamW
# (lr 1e-4) on one short batch, like the random-init GPT-2 124M of issue 12 (10.69, 5.91, 2.42,
# 2.93, ...), at a third of its size: on this batch the losses went 5.90, 2.66, 0.83, 3.21, 0.25, ...
BOUNCING = cpu.GPT2Config(max_seq_len=64, vocab_size=256, padded_vocab_size=cpu.padded_vocab(256),
                          num_layers=12, num_heads=8, channels=512)
BOUNCING_BATCH_SEED = 2


def test_losses_verdict():
    """losses_ok: without expected losses only last < first counts; with them, each within LOSS_ATOL."""
    bounce = [5.9, 2.66, 0.83, 3.21, 0.25, 0.21, 0.16, 0.13, 0.10, 0.08]
    assert check_gpt2.losses_ok(bounce)[0]
    assert not check_gpt2.losses_ok([5.9, 5.0, 4.0, 3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 5.9])[0]    # last == first
    assert not check_gpt2.losses_ok([5.9] + [float("nan")] * 9)[0]
    expected = list(check_gpt2.GPT2_124M_EXPECTED_LOSSES)
    near = [e + (0.9 if i % 2 else -0.9) * check_gpt2.LOSS_ATOL for i, e in enumerate(expected)]
    assert check_gpt2.losses_ok(near, expected)[0]
    off = list(expected)
    off[7] += 1.1 * check_gpt2.LOSS_ATOL
    assert not check_gpt2.losses_ok(off, expected)[0]
    assert not check_gpt2.losses_ok(bounce, expected)[0]      # expected losses replace last < first


def test_check_gpt2_passes_when_losses_bounce(tmp_path):
    """A valid model (files written by the twin, every tensor matches) whose ten AdamW losses go
    up at one step: check_gpt2.py passes it, since the last loss is below the first."""
    model_path, state_path = str(tmp_path / "bouncing.bin"), str(tmp_path / "bouncing_debug.bin")
    t = twin.Twin.init(BOUNCING, SEED)
    t.save_checkpoint(model_path)
    t.write_debug_state(state_path, *random_batch(BOUNCING.vocab_size, 1, 8, seed=BOUNCING_BATCH_SEED))
    del t
    r = run_check(model_path, state_path)
    print("\n" + r.stdout)
    losses = printed_losses(r.stdout)
    assert len(losses) == check_gpt2.TRAIN_STEPS, r.stdout + r.stderr
    assert any(b > a for a, b in zip(losses, losses[1:])), f"premise lost: these losses do not bounce: {losses}"
    assert r.stdout.count("TENSOR OK") == 18 and "NOT OK" not in r.stdout
    assert r.returncode == 0, r.stdout + r.stderr
    assert "overall okay: True" in r.stdout


def test_check_gpt2_expected_losses(tmp_path):
    """--losses FILE: ten numbers (lines or any whitespace) matched within LOSS_ATOL: the losses
    themselves pass, one of them off by 5 x LOSS_ATOL fails at that step; --gpt2-124M-losses
    (llm.c's pretrained numbers) fails on a random model; a bad losses file is one line, exit 1."""
    config, B, T = CONFIGS["small"]
    model_path, state_path = str(tmp_path / "small.bin"), str(tmp_path / "small_debug.bin")
    t = twin.Twin.init(config, SEED)
    t.save_checkpoint(model_path)
    x, y = random_batch(config.vocab_size, B, T)
    t.write_debug_state(state_path, x, y)
    losses = check_gpt2.cpu_train_steps(cpu.read_model(model_path), x, y, check_gpt2.TRAIN_STEPS)

    same = tmp_path / "same.txt"             # one per line, then several on a line, tabs and spaces
    same.write_text("\n".join(f"{v:.6f}" for v in losses[:5]) + "\n" +
                    "  ".join(f"{v:.6f}" for v in losses[5:8]) + "\t" + " ".join(f"{v:.6f}" for v in losses[8:]))
    r = run_check(model_path, state_path, "--losses", str(same))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(", OK)") == check_gpt2.TRAIN_STEPS and "overall okay: True" in r.stdout
    assert printed_losses(r.stdout) == [float(f"{v:.6f}") for v in losses]

    off = list(losses)
    off[6] += 5 * check_gpt2.LOSS_ATOL
    wrong = tmp_path / "wrong.txt"
    wrong.write_text("\n".join(f"{v:.6f}" for v in off))
    r = run_check(model_path, state_path, "--losses", str(wrong))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "overall okay: False" in r.stdout
    assert [line.split(":")[0] for line in r.stdout.splitlines() if "NOT OK)" in line] == ["step 6"]
    assert r.stdout.count("TENSOR OK") == 18                  # the tensors still pass

    r = run_check(model_path, state_path, "--gpt2-124M-losses")
    assert r.returncode == 2 and "overall okay: False" in r.stdout, r.stdout + r.stderr
    assert "llm.c's GPT-2 124M" in r.stdout

    nine = tmp_path / "nine.txt"
    nine.write_text("\n".join(f"{v:.6f}" for v in losses[:9]))
    text = tmp_path / "text.txt"
    text.write_text("5.27 4.06 three 2.80\n")
    for path, reason in ((nine, "9 numbers, expected 10"), (text, "not a number"), (tmp_path / "nope.txt", "cannot read")):
        r = run_check(model_path, state_path, "--losses", str(path))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r.stdout + r.stderr
        assert lines[0].startswith("error: ") and str(path) in lines[0] and reason in lines[0]


# ----------------------------------------------------------------------------
# the command line's promise (the trainers'): bad input is one `error:` line and exit 1

def tiny_files(tmp_path):
    """A token shard and a small GPT-2 checkpoint (gpt2_cpu's writers): (shard, model path)."""
    shard, model_path = str(tmp_path / "train.bin"), str(tmp_path / "small.bin")
    formats.write_shard(shard, np.arange(2000) % SMALL.vocab_size)
    cpu.write_model(model_path, cpu.gpt2_init(SMALL, SEED))
    return shard, model_path


def twin_error_line(capsys):
    """The one stderr line of a twin.main that returned 1, else None."""
    err = capsys.readouterr().err.strip().splitlines()
    return err[0] if len(err) == 1 and err[0].startswith("error: ") else None


@pytest.mark.parametrize("flags, said", [
    (["-x", "-5"], "-x -5"), (["-q", "2"], "-q 2.0: must be in [0, 1]"), (["-u", "-1"], "-u -1"),
    (["-c", "-1"], "-c -1.0"), (["--grad-clip", "-1"], "--grad-clip -1.0"), (["-l", "nan"], "-l nan"),
    (["--seed", "-1"], "--seed -1"), (["-d", "-5"], "-d -5"), (["--device", "foo"], "--device foo"),
    (["--write-model", "missing/out.bin"], "--write-model missing/out.bin: cannot write there"),
    (["--write-debug-state", "missing/out.bin"], "--write-debug-state missing/out.bin: cannot write there"),
])
def test_twin_cli_bad_flags_are_one_line(tmp_path, capsys, monkeypatch, flags, said):
    """llmc.cli.check_args' rules and messages (the twin trained on -q 2, -u -1, -c -1 or
    --grad-clip -1, exited 0 on -x -5, and gave tracebacks for -l nan, --seed -1, --device foo and
    an output in a missing directory)."""
    shard, model_path = tiny_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert twin.main(["-e", model_path, "-i", shard, "-b", "1", "-t", "8", "-x", "1"] + flags) == 1
    line = twin_error_line(capsys)
    assert line and said in line and "internal error" not in line, line


@pytest.mark.parametrize("slot, value, dtype, said", [
    (formats.MODEL_SLOTS["max_seq_len"], -5, "<i4", "impossible model header"),
    (formats.MODEL_SLOTS["num_layers"], 100000, "<i4", "truncated: the header's model has"),   # never allocated
    (formats.HEADER_INTS + 7, np.nan, "<f4", "parameters are not finite"),                   # a NaN in wte
])
def test_twin_cli_a_bad_model_file_is_the_trainers_one_line(tmp_path, capsys, slot, value, dtype, said):
    """The checkpoint is checked by gpt2_cpu.py's reader (llmc.formats) before the twin's own reads
    it: a bad file gets the trainers' message (a NaN parameter trained, exit 0)."""
    shard, model_path = tiny_files(tmp_path)
    with open(model_path, "r+b") as f:
        f.seek(4 * slot)
        f.write(np.asarray([value], dtype).tobytes())
    assert twin.main(["-e", model_path, "-i", shard, "-b", "1", "-t", "8", "-x", "1"]) == 1
    line = twin_error_line(capsys)
    assert line and model_path in line and said in line, line
