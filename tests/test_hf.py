"""
tests/test_hf.py: dev/eval/export_hf.py and dev/eval/import_hf.py against Hugging Face
transformers' own GPT2LMHeadModel (CPU, fp32).

Checks, each against an independent reference:
- export: a random model of ours (every tensor perturbed, so that biases and LayerNorm weights
  are not 0 / 1 and a swapped or untransposed tensor shows) exported, loaded with
  GPT2LMHeadModel.from_pretrained, gives the logits of gpt2_cpu.gpt2_forward on the same tokens;
  for d2 (the real vocabulary, 50257) and a tiny custom config;
- import: a model that transformers itself initialized and saved (save_pretrained; also in
  bf16) imports to ours with logits equal to transformers' own;
- round trips ours -> HF -> ours are byte-identical: the fp32 file, and a bf16 file through
  import's bf16 writer;
- refusals, one line each: not plain GPT-2 (activation), an untied lm_head, a missing tensor,
  an unreachable hub id; and export of a model whose vocabulary padding is not zero;
- the exported files' permissions follow the umask (0644 under 022), model.safetensors included.

Run: python -m pytest tests/test_hf.py -q   (about 20 s; needs transformers, safetensors, torch)
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "dev", "eval"))
sys.path.insert(0, REPO_ROOT)
import export_hf  # noqa: E402
import import_hf  # noqa: E402
from gpt2_cpu import GPT2Config, config_from_descriptor, gpt2_forward, gpt2_init, padded_vocab, read_model, write_model  # noqa: E402
from llmc.utils import InputError  # noqa: E402

# logits are compared relative to their largest magnitude: fp32 sums over C <= 128 terms and the
# two implementations order them differently (HF: addmm / its own GELU and softmax), observed
# ~1e-6 relative; 1e-4 leaves room and still fails on any layout mistake (those give O(1) errors)
LOGITS_RTOL = 1e-4
PERTURB_STD = 0.05
TINY = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=padded_vocab(100), num_layers=3, num_heads=2, channels=16)


def random_model(config, seed):
    """gpt2_init plus N(0, PERTURB_STD^2) on every parameter, the vocabulary padding kept at 0."""
    model = gpt2_init(config, seed)
    rng = np.random.default_rng(seed + 1)
    model.params += rng.standard_normal(model.num_parameters, dtype=np.float32) * np.float32(PERTURB_STD)
    model.P["wte"][config.vocab_size:] = 0.0
    return model


def hf_logits(hf_dir, tokens):
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager")
    hf.eval()
    with torch.no_grad():
        return hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy(), hf


def assert_logits_close(ours, ref):
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max() / scale
    assert err < LOGITS_RTOL, f"max |ours - HF| / max |HF| = {err:.2e}"
    return err


@pytest.mark.parametrize("config,T", [(config_from_descriptor("d2"), 64), (TINY, TINY.max_seq_len)],
                         ids=["d2", "tiny"])
def test_export_matches_transformers(tmp_path, config, T):
    model = random_model(config, seed=7)
    ours_bin = str(tmp_path / "model.bin")
    write_model(ours_bin, model)
    hf_dir = str(tmp_path / "hf")
    assert export_hf.main(["-i", ours_bin, "-o", hf_dir]) == 0
    assert sorted(os.listdir(hf_dir)) == ["config.json", "model.safetensors"]
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, T))
    ref, hf = hf_logits(hf_dir, tokens)
    assert ref.shape == (2, T, config.vocab_size)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()      # tied, as ours
    ours = gpt2_forward(model, tokens.astype(np.int32))[..., :config.vocab_size]
    assert_logits_close(ours, ref)


def test_round_trip_fp32_and_bf16_bytes(tmp_path):
    model = random_model(TINY, seed=11)
    for dtype, suffix in (("float32", ""), ("bfloat16", "_bf16")):
        original = str(tmp_path / f"orig{suffix}.bin")
        write_model(original, model, dtype)
        hf_dir = str(tmp_path / f"hf{suffix}")
        assert export_hf.main(["-i", original, "-o", hf_dir]) == 0
        prefix = str(tmp_path / "back")
        assert import_hf.main(["-i", hf_dir, "-o", prefix, "--dtype", dtype]) == 0
        assert open(prefix + suffix + ".bin", "rb").read() == open(original, "rb").read(), dtype


def hf_saved_model(tmp_path, dtype=torch.float32):
    """A tiny GPT-2 that transformers initializes (seeded) and saves itself; LayerNorms and biases
    perturbed so that they matter."""
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=TINY.vocab_size, n_positions=TINY.max_seq_len,
                                     n_embd=TINY.channels, n_layer=TINY.num_layers, n_head=TINY.num_heads,
                                     bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * PERTURB_STD)
    hf = hf.to(dtype)
    hf_dir = str(tmp_path / f"hf_saved_{str(dtype)[6:]}")
    hf.save_pretrained(hf_dir)
    return hf_dir


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_import_transformers_saved_model(tmp_path, dtype):
    hf_dir = hf_saved_model(tmp_path, dtype)
    model = import_hf.import_hf(hf_dir)
    assert model.config == TINY
    assert not model.P["wte"][TINY.vocab_size:].any()
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, size=(3, TINY.max_seq_len))
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens)).logits.numpy()
    assert_logits_close(gpt2_forward(model, tokens.astype(np.int32))[..., :TINY.vocab_size], ref)
    # and the files: fp32 reads back exactly, bf16 within bf16 rounding (exact when the source was bf16)
    prefix = str(tmp_path / "imported")
    assert import_hf.main(["-i", hf_dir, "-o", prefix]) == 0
    np.testing.assert_array_equal(read_model(prefix + ".bin").params, model.params)
    bf16 = read_model(prefix + "_bf16.bin").params
    if dtype == torch.bfloat16:
        np.testing.assert_array_equal(bf16, model.params)
    else:
        np.testing.assert_allclose(bf16, model.params, rtol=2 ** -8, atol=0)


def test_import_refusals(tmp_path):
    hf_dir = hf_saved_model(tmp_path)
    config_path = os.path.join(hf_dir, "config.json")
    good = json.load(open(config_path))
    json.dump({**good, "activation_function": "relu"}, open(config_path, "w"))
    with pytest.raises(InputError, match="not plain GPT-2: activation relu"):
        import_hf.import_hf(hf_dir)
    json.dump(good, open(config_path, "w"))

    from safetensors.numpy import load_file, save_file
    weights = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(weights)
    untied = dict(tensors, **{"lm_head.weight": tensors["transformer.wte.weight"] + 1.0})
    save_file(untied, weights, metadata={"format": "pt"})
    with pytest.raises(InputError, match="lm_head"):
        import_hf.import_hf(hf_dir)
    missing = {k: v for k, v in tensors.items() if k != "transformer.h.2.mlp.c_fc.bias"}
    save_file(missing, weights, metadata={"format": "pt"})
    with pytest.raises(InputError, match="h.2.mlp.c_fc.bias missing"):
        import_hf.import_hf(hf_dir)
    # the hub's original files name tensors without the "transformer." prefix: also accepted
    save_file({k[len("transformer."):]: v for k, v in tensors.items()}, weights, metadata={"format": "pt"})
    assert import_hf.import_hf(hf_dir).config == TINY


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)],
                         ids=["umask022", "umask077", "umask002"])
def test_export_file_modes_follow_umask(tmp_path, umask, mode):
    """Both exported files get the mode an ordinary open() gives under the umask (0644 under the
    usual 022), not one of their own; the export runs in a child process, where setting the
    umask cannot leak into other tests."""
    write_model(str(tmp_path / "model.bin"), random_model(TINY, seed=5))
    hf_dir = tmp_path / "hf"
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "eval", "export_hf.py"),
                        "-i", str(tmp_path / "model.bin"), "-o", str(hf_dir)],
                       capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(umask))
    assert r.returncode == 0, r.stderr
    modes = {name: oct(os.stat(hf_dir / name).st_mode & 0o777) for name in sorted(os.listdir(hf_dir))}
    assert modes == {"config.json": oct(mode), "model.safetensors": oct(mode)}


def test_export_refuses_nonzero_padding(tmp_path):
    model = random_model(TINY, seed=3)
    model.P["wte"][TINY.vocab_size] = 1.0
    with pytest.raises(InputError, match="padding"):
        export_hf.export_hf(model, str(tmp_path / "hf"))


def test_cli_one_line_errors(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")           # never touch the network from a test
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "eval", "import_hf.py"),
                        "-i", "no-such-user/no-such-model", "-o", str(tmp_path / "x")],
                       capture_output=True, text=True, env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: cannot fetch"), r.stderr
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "eval", "export_hf.py"),
                        "-i", str(tmp_path / "none.bin"), "-o", str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "no such model checkpoint" in lines[0], r.stderr
    assert os.listdir(tmp_path) == []
