"""
tests/test_llama3_twin.py: llama3_cpu.py against its independent PyTorch twin
(dev/torch_reference_llama3.py: autograd, its own modules, complex-number RoPE, its own model file code).

Checked: the random init (bit for bit), logits / loss / all 10 gradients in fp32 and in fp64,
ten AdamW steps (llama3_cpu.py's training step: cosine schedule with warmup, weight decay on the
matrices only, global-norm clipping that fires on some steps) on the losses, the grad norms and
the final parameters, and the model file both ways (fp32 and bf16, byte for byte); the twin's command
line: bad flags and bad model files are the trainers' one `error:` line, exit 1.
Tolerances: llmc/check.py's TOLERANCES (each entry says how it was chosen; the Llama 3 numbers
measured here are in its comments). Run: python -m pytest -q tests/test_llama3_twin.py -s (a few seconds).
"""

import os
import sys

import numpy as np
import pytest
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "dev"))

import llama3_cpu as m  # noqa: E402
import torch_reference_llama3 as twin  # noqa: E402
from llmc.check import check_against  # noqa: E402

# every RoPE regime of Llama 3.1 (HS 16, theta 500000), two query heads per kv head, H = 192
CONFIG = m.LlamaConfig(max_seq_len=32, vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, channels=64,
                       multiple_of=32)
B, T, SEED = 4, 32, 42


def batch(seed=0):
    r = np.random.default_rng(seed)
    return r.integers(0, CONFIG.vocab_size, (B, T)), r.integers(0, CONFIG.vocab_size, (B, T))


def cpu_forward_backward(model, x, y):
    m.gpt2_zero_grad(model)
    logits = m.llama3_forward(model, x, y).copy()
    m.llama3_backward(model)
    return logits, model.mean_loss, {name: model.G[name] for name in m.PARAMETER_NAMES}


def test_init_matches_llama3_init():
    model, t = m.llama3_init(CONFIG, SEED), twin.Twin.init(CONFIG, SEED)
    assert [name for name, _ in twin.PARAMETER_LAYOUT] == list(m.PARAMETER_NAMES)
    for name, a in zip(m.PARAMETER_NAMES, t.parameters()):
        np.testing.assert_array_equal(a, model.P[name], err_msg=name)
    assert not np.array_equal(twin.Twin.init(CONFIG, SEED + 1).parameters()[0], model.P["wte"])
    assert twin.config_from_name("llama3:d4").hidden_dim == m.config_from_descriptor("llama3:d4").hidden_dim


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_forward_backward(dtype):
    """fp32: measured max|diff|/max|ref| 2.3e-7 (logits) and <= 8.4e-7 (dattprojw) on every gradient;
    fp64: <= 1.2e-15. The groups reference_fp32 / reference_fp64 of llmc/check.py."""
    model = m.llama3_init(CONFIG, SEED, dtype=getattr(np, dtype))
    t = twin.Twin.init(CONFIG, SEED, dtype=getattr(torch, dtype))
    x, y = batch()
    logits, loss, grads = cpu_forward_backward(model, x, y)
    tl, tloss, tgrads = t.forward_backward(x, y)
    group = "reference_fp32" if dtype == "float32" else "reference_fp64"
    print(f"\n{dtype}: llama3_cpu vs twin")
    results = [check_against(logits, tl, "logits", group, "logits"),
               check_against(np.array(loss), np.array(tloss), "loss", group, "loss")]
    results += [check_against(grads[name], g, f"d{name}", group, "grad") for name, g in zip(m.PARAMETER_NAMES, tgrads)]
    assert all(results)
    assert abs(loss - np.log(CONFIG.vocab_size)) < 0.05 * loss          # random init: near uniform


def test_a_wrong_gradient_fails():
    """The comparison can fail: one gradient element off by 1e-3 of max|ref| is caught."""
    model, t = m.llama3_init(CONFIG, SEED), twin.Twin.init(CONFIG, SEED)
    x, y = batch()
    _, _, grads = cpu_forward_backward(model, x, y)
    _, _, tgrads = t.forward_backward(x, y)
    g = grads["fcw2"].copy()
    g.flat[17] += 1e-3 * np.abs(g).max()
    assert not check_against(g, tgrads[m.PARAMETER_NAMES.index("fcw2")], "dfcw2 corrupted", "reference_fp32", "grad")


STEPS, LR, WARMUP, FINAL_FRAC, WD, CLIP = 10, 1e-2, 3, 0.1, 0.1, 1.5   # the grad norms run 1.2..8.9


def train_batches():
    pattern = np.random.default_rng(3).integers(0, CONFIG.vocab_size, 3 * T)        # a text to memorize
    tokens = np.resize(pattern, STEPS * B * T + 1)
    return [(tokens[i * B * T:(i + 1) * B * T].reshape(B, T), tokens[i * B * T + 1:(i + 1) * B * T + 1].reshape(B, T))
            for i in range(STEPS)]


def cpu_train(decayed=m.DECAYED_PARAMETERS):
    """llama3_cpu.train's step, written out: zero_grad, forward, backward, norm, clip, schedule, AdamW."""
    model, losses, norms = m.llama3_init(CONFIG, SEED), [], []
    for step, (x, y) in enumerate(train_batches()):
        m.gpt2_zero_grad(model)
        m.llama3_forward(model, x, y)
        m.llama3_backward(model)
        norm = m.gpt2_grad_norm(model)
        grad_scale = CLIP / norm if 0 < CLIP < norm else 1.0
        lr = m.learning_rate_at(step, "cosine", LR, WARMUP, STEPS, FINAL_FRAC)
        m.gpt2_update(model, lr, m.ADAMW_BETA1, m.ADAMW_BETA2, m.ADAMW_EPS, WD, step + 1, grad_scale, decayed=decayed)
        losses.append(model.mean_loss)
        norms.append(norm)
    return model, losses, norms


def test_ten_adamw_steps_match():
    """Measured: losses within 2.1e-7 relative, norms 9.1e-7, final parameters within 1.2e-5
    absolute (fcw2; Adam's m/sqrt(v) amplifies rounding in near-zero gradients). A wrong weight-decay
    set (wte not decayed) moves wte by up to 6e-4: the params tolerance (llmc/check.py) catches it."""
    model, losses, norms = cpu_train()
    t = twin.Twin.init(CONFIG, SEED)
    tnorms = []
    tlosses = t.train_steps(train_batches(), LR, STEPS, "cosine", WARMUP, FINAL_FRAC, WD, CLIP,
                            on_step=lambda s, loss, norm, lr, dt: tnorms.append(norm))
    print("\nstep | llama3_cpu loss | twin loss | norm")
    for s, (a, b, n) in enumerate(zip(losses, tlosses, norms)):
        print(f"{s:4d} | {a:.7f} | {b:.7f} | {n:.4f}")
    assert any(n > CLIP for n in norms) and any(n < CLIP for n in norms), "clipping not exercised"
    assert check_against(np.array(losses), np.array(tlosses), "losses", "reference_train", "loss")
    assert check_against(np.array(norms), np.array(tnorms), "norms", "reference_train", "norm")
    final = dict(zip(m.PARAMETER_NAMES, t.parameters()))
    assert all([check_against(model.P[name], final[name], name, "reference_train", "params") for name in final])
    assert losses[-1] < 0.5 * losses[0]                                  # it learns: the updates are real
    wrong, _, _ = cpu_train(decayed=tuple(n for n in m.DECAYED_PARAMETERS if n != "wte"))
    assert not check_against(wrong.P["wte"], final["wte"], "wte, undecayed", "reference_train", "params")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_file_both_ways(tmp_path, dtype):
    model = m.llama3_init(CONFIG, SEED)
    model.params += np.random.default_rng(1).standard_normal(model.num_parameters).astype(np.float32) * 0.05
    ours, theirs = str(tmp_path / "ours.bin"), str(tmp_path / "twin.bin")
    m.write_model(ours, model, dtype)
    t = twin.Twin.from_model_file(ours)
    assert t.config == twin.as_config(CONFIG)
    t.write_model(theirs, dtype)
    assert open(theirs, "rb").read() == open(ours, "rb").read()
    back = m.read_model(theirs)
    for name, a in zip(m.PARAMETER_NAMES, t.parameters()):
        np.testing.assert_array_equal(back.P[name], a, err_msg=name)


def test_cli_writes_a_debug_state_llama3_cpu_agrees_with(tmp_path, capsys):
    """The command line as a user runs it, on a tiny model file: its debug state (llm.c's layout,
    gradients in table order) read by llmc.formats holds what llama3_cpu computes on that batch."""
    from llmc.formats import read_debug_state, write_shard
    shard, model_path, state = (str(tmp_path / name) for name in ("train.bin", "tiny.bin", "state.bin"))
    write_shard(shard, np.arange(2000) % CONFIG.vocab_size)
    model = m.llama3_init(CONFIG, SEED)
    m.write_model(model_path, model)
    assert twin.main(["-e", model_path, "-i", shard, "-b", "2", "-t", "16", "-x", "1",
                      "--write-debug-state", state]) == 0
    assert capsys.readouterr().out.count("step ") == 1
    d = read_debug_state(state, CONFIG.vocab_size, model.param_shapes)
    logits, loss, grads = cpu_forward_backward(model, d["x"], d["y"])
    assert check_against(logits, d["logits"], "logits", "reference_fp32", "logits")
    assert all([check_against(grads[name], d["grads"][name], name, "reference_fp32", "grad") for name in grads])
    assert twin.main(["-e", "llama3:d5", "-i", shard]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model 'llama3:d5'" in err


# ----------------------------------------------------------------------------
# the command line's promise (the trainers'): bad input is one `error:` line and exit 1

def patched(path, offset, value, dtype):
    """Overwrite the one `dtype` item at byte `offset` of the file with value (a bad header or
    parameter, made from a good file)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.asarray([value], dtype).tobytes())
    return path


def tiny_files(tmp_path):
    """A token shard and a tiny Llama 3 model file (llama3_cpu's writers): (shard, model path)."""
    from llmc.formats import write_shard
    shard, model_path = str(tmp_path / "train.bin"), str(tmp_path / "tiny.bin")
    write_shard(shard, np.arange(2000) % CONFIG.vocab_size)
    m.write_model(model_path, m.llama3_init(CONFIG, SEED))
    return shard, model_path


def one_error_line(capsys):
    """The one stderr line of a twin.main that returned 1 (asserted), else None."""
    err = capsys.readouterr().err.strip().splitlines()
    return err[0] if len(err) == 1 and err[0].startswith("error: ") else None


@pytest.mark.parametrize("flags, said", [
    (["-x", "-5"], "-x -5"), (["-q", "2"], "-q 2.0: must be in [0, 1]"), (["-u", "-1"], "-u -1"),
    (["-c", "-1"], "-c -1.0"), (["--grad-clip", "-1"], "--grad-clip -1.0"), (["-l", "-1"], "-l -1.0"),
    (["-l", "nan"], "-l nan"), (["--seed", "-1"], "--seed -1"), (["-b", "0"], "-b 0"),
    (["--device", "foo"], "--device foo"),
    pytest.param(["--device", "cuda"], "--device cuda", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA")),
])
def test_cli_bad_flags_are_one_line(tmp_path, capsys, flags, said):
    """llmc.cli.check_args' rules and messages, before any model is built (the twin would train
    on -q 2, -u -1, -c -1 or --grad-clip -1, and did nothing with exit 0 on -x -5)."""
    shard, model_path = tiny_files(tmp_path)
    assert twin.main(["-e", model_path, "-i", shard, "-b", "1", "-t", "8", "-x", "1"] + flags) == 1
    line = one_error_line(capsys)
    assert line and said in line and "internal error" not in line, line


@pytest.mark.parametrize("flag", ["--write-model", "--write-debug-state"])
def test_cli_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys, flag):
    shard, model_path = tiny_files(tmp_path)
    out = str(tmp_path / "missing" / "out.bin")
    assert twin.main(["-e", model_path, "-i", shard, "-b", "1", "-t", "8", "-x", "0", flag, out]) == 1
    line = one_error_line(capsys)
    assert line and f"{flag} {out}: cannot write there" in line, line


HEADER_BYTES = 1024                     # llm.c's int32 header; the float32 header follows it


@pytest.mark.parametrize("slot, value, dtype, said", [
    (2, -5, "<i4", "impossible Llama 3 model header"),                       # maxT -5
    (4, 100000, "<i4", "but the file holds"),                                # L = 100000: 40 GiB, not allocated
    (HEADER_BYTES // 4, 0.0, "<f4", "impossible Llama 3 model header"),      # ffn_dim_multiplier 0
    (HEADER_BYTES // 4, np.inf, "<f4", "impossible Llama 3 model header"),   # ffn_dim_multiplier inf
    (2 * HEADER_BYTES // 4 + 7, np.nan, "<f4", "parameters are not finite"),  # a NaN in wte
])
def test_cli_a_bad_model_file_is_the_trainers_one_line(tmp_path, capsys, slot, value, dtype, said):
    """The file is checked by llama3_cpu.py's reader (llmc.formats) before the twin's own reads it,
    so a bad file gets the trainers' message (it was an OverflowError, ZeroDivisionError or
    MemoryError traceback, "-t 8 exceeds the model's max_seq_len -5", or training on NaN)."""
    shard, model_path = tiny_files(tmp_path)
    patched(model_path, 4 * slot, value, dtype)
    assert twin.main(["-e", model_path, "-i", shard, "-b", "1", "-t", "8", "-x", "1"]) == 1
    line = one_error_line(capsys)
    assert line and said in line, line
