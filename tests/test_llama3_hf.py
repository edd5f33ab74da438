"""
tests/test_llama3_hf.py: dev/eval/export_hf_llama3.py and import_hf_llama3.py (reached through
export_hf.py / import_hf.py, which dispatch on the model file's magic / config.json's model_type)
against Hugging Face transformers' own LlamaForCausalLM (CPU, fp32).

Checks, each against an independent reference:
- import: a Llama that transformers initialized (seeded) and saved with save_pretrained imports to
  ours with logits equal to transformers' own: Llama 3.1 RoPE scaling and plain RoPE, grouped and
  plain multi-head attention, an intermediate_size Llama 3's rule gives and one it does not;
- export: a random model of ours exported and loaded by LlamaForCausalLM gives our logits; the
  same export without the RoPE row permutation does not (the test can fail);
- round trips ours -> HF -> ours are byte-identical (fp32, and bf16 through import's bf16 writer);
- a tied lm_head (Llama 3.2 1B's) imports as a copy; refusals in one line for what ours cannot
  compute (activation, biases, another RoPE scaling or other Llama 3.1 constants, a missing tensor).

Run: python -m pytest tests/test_llama3_hf.py -q   (needs transformers, safetensors, torch)
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "dev", "eval"))
sys.path.insert(0, REPO_ROOT)
import export_hf  # noqa: E402
import export_hf_llama3  # noqa: E402
import import_hf  # noqa: E402
import import_hf_llama3  # noqa: E402
import llama3_cpu as m  # noqa: E402
from llmc import hf_layout  # noqa: E402
from llmc.utils import InputError  # noqa: E402

# logits compared relative to their largest magnitude, as tests/test_hf.py: fp32 sums over C <= 64
# terms ordered differently (HF's matmuls, its RoPE in float32 where ours tables are float64-made);
# observed ~5e-7; 1e-4 still fails on any layout mistake (the missing permutation gives O(1) errors)
LOGITS_RTOL = 1e-4
PERTURB_STD = 0.05
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
TINY = m.LlamaConfig(max_seq_len=32, vocab_size=100, num_layers=2, num_heads=4, num_kv_heads=2, channels=64,
                     multiple_of=32)        # H = 224, HS = 16


def assert_logits_close(ours, ref):
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < LOGITS_RTOL, f"max |ours - HF| / max |HF| = {err:.2e}"


def hf_logits(hf_dir, tokens):
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        return hf(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def random_model(config, seed):
    model = m.llama3_init(config, seed)
    model.params += np.random.default_rng(seed + 1).standard_normal(model.num_parameters, dtype=np.float32) \
        * np.float32(PERTURB_STD)               # RMSNorm weights off 1, so a swapped norm shows
    return model


def hf_saved_model(tmp_path, NKV=2, intermediate_size=224, rope_scaling=LLAMA31_ROPE, rope_theta=500000.0,
                   tie=False, dtype=torch.float32):
    """A tiny Llama that transformers initializes (seeded) and saves itself, every tensor perturbed."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=TINY.vocab_size, hidden_size=TINY.channels,
                                   intermediate_size=intermediate_size, num_hidden_layers=TINY.num_layers,
                                   num_attention_heads=TINY.num_heads, num_key_value_heads=NKV,
                                   max_position_embeddings=TINY.max_seq_len, rms_norm_eps=1e-5, rope_theta=rope_theta,
                                   rope_scaling=rope_scaling, tie_word_embeddings=tie, bos_token_id=None,
                                   eos_token_id=None)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * PERTURB_STD)
    hf_dir = str(tmp_path / "hf_saved")
    hf.to(dtype).save_pretrained(hf_dir)
    return hf_dir


@pytest.mark.parametrize("NKV,H,rope", [(2, 224, "llama3"), (4, 160, "default")],
                         ids=["gqa-llama31rope-H224", "mha-plainrope-H160"])
def test_import_transformers_saved_model(tmp_path, NKV, H, rope):
    scaled = rope == "llama3"
    hf_dir = hf_saved_model(tmp_path, NKV, H, LLAMA31_ROPE if scaled else None, 500000.0 if scaled else 10000.0)
    prefix = str(tmp_path / "imported")
    assert import_hf.main(["-i", hf_dir, "-o", prefix]) == 0               # dispatched on model_type llama
    model = m.read_model(prefix + ".bin")
    c = model.config
    assert (c.num_kv_heads, c.hidden_dim, c.use_scaled_rope, c.rope_theta) == (NKV, H, scaled, 500000.0 if scaled else 10000.0)
    tokens = np.random.default_rng(1).integers(0, TINY.vocab_size, size=(3, TINY.max_seq_len))
    assert_logits_close(m.llama3_forward(model, tokens), hf_logits(hf_dir, tokens))
    np.testing.assert_allclose(m.read_model(prefix + "_bf16.bin").params, model.params, rtol=2 ** -8, atol=0)


PLAIN = m.LlamaConfig(**{**TINY.__dict__, "num_kv_heads": 4, "use_scaled_rope": False, "rope_theta": 10000.0,
                         "norm_eps": 1e-6})


@pytest.mark.parametrize("config", [TINY, PLAIN], ids=["gqa-llama31rope", "mha-plainrope"])
def test_export_matches_transformers(tmp_path, monkeypatch, config):
    model = random_model(config, seed=7)
    ours_bin, hf_dir = str(tmp_path / "model.bin"), str(tmp_path / "hf")
    m.write_model(ours_bin, model)
    assert export_hf.main(["-i", ours_bin, "-o", hf_dir]) == 0             # dispatched on the magic
    assert sorted(os.listdir(hf_dir)) == ["config.json", "model.safetensors"]
    hf_config = json.load(open(os.path.join(hf_dir, "config.json")))
    assert hf_config["intermediate_size"] == config.hidden_dim and hf_config["tie_word_embeddings"] is False
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, size=(2, config.max_seq_len))
    ours = m.llama3_forward(model, tokens)
    assert_logits_close(ours, hf_logits(hf_dir, tokens))
    # without the permutation of q's and k's rows, HF's rotate_half rotates the wrong pairs
    monkeypatch.setattr(hf_layout, "hf_rope_rows", lambda HS: np.arange(HS))
    assert export_hf_llama3.main(["-i", ours_bin, "-o", hf_dir]) == 0
    with pytest.raises(AssertionError, match="max"):
        assert_logits_close(ours, hf_logits(hf_dir, tokens))


def test_rope_row_permutation():
    """HF row j of a head is our row [0,2,..,HS-2,1,3,..,HS-1][j]; the inverse puts them back."""
    np.testing.assert_array_equal(export_hf_llama3.hf_rope_rows(8), [0, 2, 4, 6, 1, 3, 5, 7])
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)             # two heads of HS = 8
    hf = export_hf_llama3.rope_rows_to_hf(w, 8)
    np.testing.assert_array_equal(hf[8 + 4], w[8 + 1])                     # head 1: HF row 4 is our row 1
    np.testing.assert_array_equal(export_hf_llama3.rope_rows_from_hf(hf, 8), w)


@pytest.mark.parametrize("dtype,suffix", [("float32", ""), ("bfloat16", "_bf16")])
def test_round_trip_bytes(tmp_path, dtype, suffix):
    model = random_model(TINY, seed=11)
    original, hf_dir, prefix = str(tmp_path / f"orig{suffix}.bin"), str(tmp_path / "hf"), str(tmp_path / "back")
    m.write_model(original, model, dtype)
    assert export_hf.main(["-i", original, "-o", hf_dir]) == 0
    assert import_hf.main(["-i", hf_dir, "-o", prefix, "--dtype", dtype]) == 0
    assert open(prefix + suffix + ".bin", "rb").read() == open(original, "rb").read()


def test_swiglu_sizing_recovers_h():
    """Llama 3 8B's and 70B's H give Meta's (1.3, 1024); any other H some pair that gives it."""
    assert import_hf_llama3.swiglu_sizing(4096, 14336, {}) == (1.3, 1024)
    assert import_hf_llama3.swiglu_sizing(8192, 28672, {}) == (1.3, 1024)
    for C, H in ((64, 160), (64, 224), (256, 896), (128, 1), (96, 1000)):
        mult, multiple_of = import_hf_llama3.swiglu_sizing(C, H, {})
        assert m.LlamaConfig(channels=C, ffn_dim_multiplier=mult, multiple_of=multiple_of).hidden_dim == H


def test_tied_lm_head_is_copied(tmp_path):
    hf_dir = hf_saved_model(tmp_path, tie=True)
    model = import_hf_llama3.import_hf(hf_dir, json.load(open(os.path.join(hf_dir, "config.json"))), hf_dir)
    np.testing.assert_array_equal(model.P["wlmhead"], model.P["wte"])
    tokens = np.random.default_rng(2).integers(0, TINY.vocab_size, size=(2, 16))
    assert_logits_close(m.llama3_forward(model, tokens), hf_logits(hf_dir, tokens))


def test_refusals(tmp_path):
    hf_dir = hf_saved_model(tmp_path)
    config_path = os.path.join(hf_dir, "config.json")
    good = json.load(open(config_path))
    rope = good.get("rope_parameters") or good["rope_scaling"]
    cases = [({"hidden_act": "gelu"}, "activation gelu"), ({"attention_bias": True}, "biases"),
             ({"head_dim": 32}, "head_dim 32"), ({"model_type": "mistral"}, "model_type 'mistral'"),
             ({"rope_parameters": {**rope, "rope_type": "yarn"}, "rope_scaling": None}, "RoPE scaling 'yarn'"),
             ({"rope_parameters": {**rope, "factor": 16.0}, "rope_scaling": None}, "factor 16.0"),
             ({"intermediate_size": 0}, "intermediate_size 0")]
    for change, message in cases:
        hf = {**good, **change}
        with pytest.raises(InputError, match=message):
            import_hf_llama3.config_from_hf(hf, config_path)
    from safetensors.numpy import load_file, save_file
    weights = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"}, weights,
              metadata={"format": "pt"})
    json.dump({**good, "hidden_act": "relu"}, open(config_path, "w"))
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "eval", "import_hf.py"), "-i", hf_dir,
                        "-o", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "activation relu" in r.stderr, r.stderr
    json.dump(good, open(config_path, "w"))
    with pytest.raises(InputError, match="layers.1.self_attn.k_proj.weight missing"):
        import_hf_llama3.import_hf(hf_dir, good, config_path)
