"""LoRA in the two NumPy trainers (gpt2_cpu.py's LoRA section, llama3_cpu.py's targets; the flags
and files of llmc/lora.py), each check against an independent reference:
  - lora_backward's dinp, dlora_a and dlora_b against central finite differences in float64;
  - a whole tiny GPT-2 and Llama 3 (float64, adapters on every linear layer, lora_B nonzero): the
    adapters' gradients of the mean loss against finite differences, and the frozen model has no
    gradient at all;
  - fresh adapters (lora_B = 0) leave the logits bit for bit the base model's (step 0 is the base);
  - merging (W + scale B A) gives the adapted model's logits, to fp32 rounding;
  - PEFT's target matching (a name equal to a layer's or ending it after a dot);
  - the command line: a LoRA run lowers its loss, trains only the adapters (the base parameters
    bit for bit unchanged, no AdamW state for them), --lora-save / --lora-load round-trip the
    adapters exactly, --lora-merge writes a model file that evaluates as the adapted model, and
    the flags that make no sense are one error line.
PEFT itself (loading ours, ours loading its files, loss and gradients against PyTorch) is
tests/test_lora_peft.py; the CUDA trainers tests/test_lora_cuda.py.

Run: python -m pytest -q tests/test_lora.py   (about a minute on 2 cores)
"""

import dataclasses
import os

import numpy as np
import pytest

import gpt2_cpu as g
import llama3_cpu as m
from llmc import lora as lora_files
from llmc.formats import write_shard

H = 1e-6                               # finite-difference step: float64, as tests/test_layers.py
RTOL = 1e-6
FD_COORDS = 4                          # coordinates per adapter tensor in the whole-model checks
# the tiny Llama's frozen classifier at init's std 0.02 gives logits of ~0.1 whatever the adapters
# do (its input is RMS-normalized): scaled up, as a trained model's, the adapters can lower the loss
LLAMA_CLASSIFIER_GAIN = 20
LOGITS_RTOL_FP32 = 1e-5                # merged vs adapted in fp32: sums of C products in two orders
GPT2_TINY = g.GPT2Config(max_seq_len=8, vocab_size=11, padded_vocab_size=128, num_layers=2, num_heads=2, channels=8)
LLAMA_TINY = m.LlamaConfig(max_seq_len=8, vocab_size=11, num_layers=2, num_heads=4, num_kv_heads=2, channels=8,
                           multiple_of=4)


def numerical_grad(f, x, idx):
    """Central differences of the scalar f() with respect to the elements idx (flat) of x, in place."""
    flat = x.reshape(-1)
    grad = np.zeros(len(idx))
    for j, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + H
        up = f()
        flat[i] = old - H
        down = f()
        flat[i] = old
        grad[j] = (up - down) / (2 * H)
    return grad


def test_lora_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    B, T, C, r, OC, scale = 2, 3, 5, 2, 4, 1.7
    inp, a, b = rng.standard_normal((B, T, C)), rng.standard_normal((r, C)), rng.standard_normal((OC, r))
    R = rng.standard_normal((B, T, OC))

    def loss():
        return float((g.lora_forward(inp, a, b, scale)[0] * R).sum())
    out, h = g.lora_forward(inp, a, b, scale)
    np.testing.assert_allclose(out, scale * inp @ (b @ a).T, rtol=1e-12)     # the merged matrix's product
    da, db = np.zeros_like(a), np.zeros_like(b)
    dinp = g.lora_backward(da, db, R, inp, h, a, b, scale)
    for analytic, x in ((dinp, inp), (da, a), (db, b)):
        np.testing.assert_allclose(analytic.reshape(-1), numerical_grad(loss, x, range(x.size)), rtol=RTOL, atol=1e-9)


def adapted(family, rng):
    """A tiny float64 model of `family` (gpt2_cpu or llama3_cpu) with random adapters (lora_B
    nonzero, so dlora_A is too) of rank 2 on every linear layer, the model frozen."""
    if family is g:
        model = g.gpt2_init(GPT2_TINY, seed=1, dtype=np.float64)
    else:
        model = m.llama3_init(LLAMA_TINY, seed=1, dtype=np.float64)
    model.params += rng.standard_normal(model.num_parameters) * 0.1    # off the init's zeros and ones
    model.lora = g.LoRA(family.lora_targets(model.config), model.config.num_layers, 2, 3.0, dtype=np.float64)
    model.lora.params[...] = rng.standard_normal(model.lora.num_parameters) * 0.3
    g.freeze(model)
    return model


@pytest.mark.parametrize("family", [g, m], ids=["gpt2", "llama3"])
def test_adapter_gradients_of_the_model_match_finite_differences(family):
    rng = np.random.default_rng(1)
    model = adapted(family, rng)
    forward = g.gpt2_forward if family is g else m.llama3_forward
    backward = g.gpt2_backward if family is g else m.llama3_backward
    inputs, targets = rng.integers(0, 11, (2, 5)), rng.integers(0, 11, (2, 5))
    forward(model, inputs, targets)
    g.gpt2_zero_grad(model.lora)
    backward(model)
    assert model.grads is None and all(v is None for v in model.G.values())

    def loss():
        forward(model, inputs, targets)
        return model.mean_loss
    for name, _ in model.lora.param_shapes:
        idx = rng.choice(model.lora.P[name].size, FD_COORDS, replace=False)
        numeric = numerical_grad(loss, model.lora.P[name], idx)
        np.testing.assert_allclose(model.lora.G[name].reshape(-1)[idx], numeric, rtol=RTOL, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("family", [g, m], ids=["gpt2", "llama3"])
def test_fresh_adapters_leave_the_base_model_bit_for_bit(family):
    model = g.gpt2_init(GPT2_TINY, seed=1) if family is g else m.llama3_init(LLAMA_TINY, seed=1)
    forward = g.gpt2_forward if family is g else m.llama3_forward
    x = np.random.default_rng(2).integers(0, 11, (2, 6))
    base = forward(model, x).copy()
    model.lora = g.lora_init(family.lora_targets(model.config), model.config.num_layers, 4, 8, seed=0)
    assert np.any(model.lora.params)                                  # lora_A is random, lora_B zero
    np.testing.assert_array_equal(forward(model, x), base)


@pytest.mark.parametrize("family", [g, m], ids=["gpt2", "llama3"])
def test_merged_weights_compute_what_the_adapters_did(family):
    rng = np.random.default_rng(3)
    model = g.gpt2_init(GPT2_TINY, seed=1) if family is g else m.llama3_init(LLAMA_TINY, seed=1)
    forward = g.gpt2_forward if family is g else m.llama3_forward
    model.lora = g.LoRA(family.lora_targets(model.config), model.config.num_layers, 2, 4.0)
    model.lora.params[...] = rng.standard_normal(model.lora.num_parameters, dtype=np.float32) * 0.3
    x = rng.integers(0, 11, (2, 6))
    adapted_logits = forward(model, x).copy()
    lora, model.lora = model.lora, None
    plain = forward(model, x).copy()
    g.lora_merge(model.P, lora)
    merged = forward(model, x)
    scale = np.abs(adapted_logits).max()
    assert np.abs(plain - adapted_logits).max() > 100 * LOGITS_RTOL_FP32 * scale   # the adapters do change it
    assert np.abs(merged - adapted_logits).max() < LOGITS_RTOL_FP32 * scale


def test_targets_match_as_peft_matches_them():
    targets = g.lora_targets(GPT2_TINY)
    names = [t.name for t in lora_files.select_targets("c_proj", targets, ())]
    assert names == ["attn.c_proj", "mlp.c_proj"]                     # both c_proj, as PEFT's suffix rule
    assert [t.name for t in lora_files.select_targets(None, targets, ("c_attn",))] == ["attn.c_attn"]
    assert len(lora_files.select_targets("all-linear", targets, ())) == 4
    llama = [t.name for t in lora_files.select_targets(None, m.lora_targets(LLAMA_TINY), m.LORA_FAMILY.default_targets)]
    assert llama == ["self_attn.q_proj", "self_attn.v_proj"]
    with pytest.raises(lora_files.InputError, match="'proj' names no layer"):
        lora_files.select_targets("proj", targets, ())               # a suffix, but not after a dot


# ----------------------------------------------------------------------------
# the command line

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny GPT-2 and Llama 3 model file, and shards of their V (11) to learn: a fixed cycle
    through the 11 tokens (each token's successor is always the same), a few tokens randomized."""
    d = tmp_path_factory.mktemp("lora")
    rng = np.random.default_rng(4)
    train, val = str(d / "train.bin"), str(d / "val.bin")
    cycle = rng.permutation(11)
    for path, n in ((train, 4000), (val, 600)):
        tokens = np.tile(cycle, n // 11 + 1)[:n]
        noise = rng.random(n) < 0.1
        tokens[noise] = rng.integers(0, 11, noise.sum())
        write_shard(path, tokens.astype(np.uint16))
    g.write_model(str(d / "gpt2.bin"), g.gpt2_init(dataclasses.replace(GPT2_TINY, channels=16), seed=5))
    llama = m.llama3_init(dataclasses.replace(LLAMA_TINY, channels=16), seed=5)
    llama.P["wlmhead"] *= LLAMA_CLASSIFIER_GAIN
    m.write_model(str(d / "llama3.bin"), llama)
    return d, ["-i", train, "-j", val, "-b", "2", "-t", "8", "-s", "0", "-v", "0", "-m", "10", "-l", "3e-2",
               "-k", "constant"]


@pytest.mark.parametrize("family,targets", [(g, "c_attn,c_fc"), (m, "all-linear")], ids=["gpt2", "llama3"])
def test_a_lora_run_trains_the_adapters_only_and_round_trips_them(family, targets, tiny_run, capsys):
    d, common = tiny_run
    name = "gpt2" if family is g else "llama3"
    model_file, saved, merged = str(d / f"{name}.bin"), str(d / f"{name}_adapters"), str(d / f"{name}_merged.bin")
    base = family.read_model(model_file).params.copy()
    model = family.train(family.parse_args(common + ["-e", model_file, "-x", "30", "--lora-rank", "4",
                                                     "--lora-targets", targets, "--lora-save", saved]))
    out = capsys.readouterr().out
    losses = [float(x.split("|")[1].split()[1]) for x in out.splitlines() if x.startswith("step")]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses     # it learns
    np.testing.assert_array_equal(model.params, base)                   # the base is frozen, bit for bit
    assert model.grads is None and model.m is None and model.lora.m is not None
    # --lora-load reads back exactly what was trained; an eval with it is the trained model's
    loaded = family.train(family.parse_args(common + ["-e", model_file, "--lora-load", saved, "--eval-only"]))
    np.testing.assert_array_equal(loaded.lora.params, model.lora.params)
    val_adapted = float(capsys.readouterr().out.split("val loss")[1].split()[0])
    # --lora-merge writes a plain model file that evaluates as the adapted model
    assert family.main(common + ["-e", model_file, "--lora-load", saved, "--lora-merge", merged]) == 0
    assert family.main(common + ["-e", merged, "--eval-only"]) == 0
    val_merged = float(capsys.readouterr().out.split("val loss")[1].split()[0])
    assert val_merged == pytest.approx(val_adapted, rel=1e-5)
    assert family.main(common + ["-e", model_file, "--eval-only"]) == 0
    assert float(capsys.readouterr().out.split("val loss")[1].split()[0]) > val_adapted + 0.05


@pytest.mark.parametrize("flags,said", [
    (["--lora-rank", "4", "-n", "2", "-o", "OUT"], "keeps no checkpoints"),
    (["--lora-rank", "-1"], "--lora-rank -1"),
    (["--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha 0"),
    (["--lora-rank", "4", "--lora-targets", "c_attn,wte"], "'wte' names no layer"),
    (["--lora-alpha", "16"], "without --lora-rank"),
    (["--lora-merge", "x.bin"], "--lora-merge OUT merges the adapters of --lora-load"),
    (["--lora-save", "DIR"], "--lora-save DIR writes LoRA adapters"),
    (["--lora-load", "NOWHERE"], "no adapter_config.json there"),
    (["--lora-load", "NOWHERE", "--lora-rank", "4"], "drop --lora-rank"),
    (["--lora-rank", "4", "--lora-save", "DIR", "--eval-only"], "not with --eval-only or --generate"),
    (["--lora-load", "NOWHERE", "--lora-merge", "x.bin", "--generate", "4"], "merges and exits"),
])
def test_nonsense_lora_flags_are_one_line(tiny_run, tmp_path, capsys, flags, said):
    d, common = tiny_run
    flags = [str(tmp_path / f) if f in ("OUT", "DIR", "NOWHERE") else f for f in flags]
    assert g.main(common + ["-e", str(d / "gpt2.bin"), "-x", "2"] + flags) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err
    assert not os.path.exists(str(tmp_path / "DIR"))


@pytest.mark.parametrize("edit,said", [
    (lambda c: c.update(use_dora=True), "use_dora=True: only plain LoRA"),
    (lambda c: c.update(use_rslora=True), "use_rslora=True: only plain LoRA"),
    (lambda c: c.update(r=0), "need a positive rank"),
    ("llama3", "is not a LoRA adapter of a linear layer of this model"),
    ("rank", "needs (4, 16) in every one of its 2 layers"),
])
def test_adapter_files_that_do_not_fit_are_one_line(tiny_run, tmp_path, capsys, edit, said):
    """--lora-load of PEFT files asking for more than plain LoRA, or made for another model."""
    import json
    d, common = tiny_run
    model_file = str(d / "gpt2.bin")
    config = dataclasses.replace(GPT2_TINY, channels=16)
    saved = str(tmp_path / "adapters")
    if edit == "llama3":
        other = dataclasses.replace(LLAMA_TINY, channels=16)
        lora = g.lora_init(m.lora_targets(other), 2, 4, 8, seed=0)
        lora_files.save(saved, lora, 2, m.LORA_FAMILY, "llama3.bin")
    else:
        lora = g.lora_init(g.lora_targets(config), 2, 8 if edit == "rank" else 4, 8, seed=0)
        lora_files.save(saved, lora, 2, g.LORA_FAMILY, "gpt2.bin")
        if edit == "rank":                                          # r=8 tensors, the config saying r=4
            path = os.path.join(saved, lora_files.PEFT_CONFIG)
            cfg = json.load(open(path))
            cfg["r"] = 4
            json.dump(cfg, open(path, "w"))
        elif callable(edit):
            path = os.path.join(saved, lora_files.PEFT_CONFIG)
            cfg = json.load(open(path))
            edit(cfg)
            json.dump(cfg, open(path, "w"))
    assert g.main(common + ["-e", model_file, "--lora-load", saved, "--eval-only"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
