"""
tests/test_lora_peft.py: our LoRA (gpt2_cpu.py / llama3_cpu.py, llmc/lora.py's files) against
Hugging Face PEFT itself, on small random-init Hugging Face GPT-2 and Llama models (CPU, fp32).

For each family a tiny model that transformers initializes (seeded, every tensor perturbed) is
saved and imported into ours (dev/eval/import_hf.py), and:
  - PEFT -> ours: PEFT's LoRA on every linear layer (lora_B made nonzero, so that every gradient
    is), saved with save_pretrained, loads into ours (--lora-load's reader); one batch's loss and
    every adapter gradient (lora_A and lora_B of each module of each layer) match PyTorch's
    autograd through PEFT's model, in fp32;
  - ours -> PEFT: random adapters of ours written as PEFT's files (--lora-save's writer) load with
    PeftModel.from_pretrained onto the Hugging Face model and give our logits; PEFT's own config
    reader sees our rank, alpha and targets;
  - the defaults: ours train the modules PEFT would (TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING),
    and LoraConfig's default alpha is ours;
  - Llama's q_proj/k_proj lora_B rows are permuted (llmc/hf_layout.py): without the permutation
    the loaded adapters give other logits (the test can fail).

Run: python -m pytest -q tests/test_lora_peft.py   (about 20 s; needs torch, transformers, peft, safetensors)
"""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "dev", "eval"))
sys.path.insert(0, REPO_ROOT)
import gpt2_cpu as g  # noqa: E402
import import_hf  # noqa: E402
import llama3_cpu as m  # noqa: E402
from llmc import hf_layout  # noqa: E402
from llmc import lora as lora_files  # noqa: E402

PERTURB_STD = 0.05
LORA_B_STD = 0.1                       # PEFT starts lora_B at 0; nonzero here, so that dlora_A is not 0
RANK, ALPHA = 4, 16
B, T, V = 2, 12, 100
# fp32 in both, summed in other orders (PyTorch's and NumPy's matmuls, HF's RoPE in float32 where ours
# are float64-made tables): observed ~1e-6 relative to the largest value; any layout mistake is O(1)
RTOL = 1e-4


def hf_gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=None, eos_token_id=None,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu_new"))


def hf_llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None))


FAMILIES = {"gpt2": (g, hf_gpt2, ["c_attn", "c_proj", "c_fc"]),
            "llama3": (m, hf_llama, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


@pytest.fixture(params=list(FAMILIES))
def family(request, tmp_path):
    """(ours: the trainer module, the HF model (perturbed, eval mode), our imported model, tokens)."""
    ours, make, targets = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = make()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * PERTURB_STD)
    hf_dir = str(tmp_path / "hf")
    hf.save_pretrained(hf_dir)
    assert import_hf.main(["-i", hf_dir, "-o", str(tmp_path / "ours"), "--dtype", "float32"]) == 0
    model = ours.read_model(str(tmp_path / "ours.bin"))
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, V, (B, T)), rng.integers(0, V, (B, T))
    return ours, hf.eval(), model, targets, x, y, tmp_path


def torch_loss(peft_model, x, y):
    logits = peft_model(input_ids=torch.from_numpy(x)).logits
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V), torch.from_numpy(y).reshape(-1))


def forward_backward(ours, model, x, y):
    forward, backward = (g.gpt2_forward, g.gpt2_backward) if ours is g else (m.llama3_forward, m.llama3_backward)
    logits = forward(model, x, y)[..., :V].copy()
    g.gpt2_zero_grad(model.lora)
    backward(model)
    return logits, model.mean_loss


def close(a, ref):
    return np.abs(a - ref).max() <= RTOL * np.abs(ref).max()


def test_peft_adapters_load_into_ours_with_pytorchs_loss_and_gradients(family):
    ours, hf, model, targets, x, y, tmp_path = family
    torch.manual_seed(2)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, LORA_B_STD)
    pm.save_pretrained(str(tmp_path / "peft"))
    _, loss = torch_loss(pm, x, y)
    loss.backward()
    torch_grads = {name: p.grad.numpy() for name, p in pm.named_parameters() if p.grad is not None}
    assert all("lora_" in name for name in torch_grads)              # PEFT froze the base as we do

    rank, alpha, chosen, tensors = lora_files.load(str(tmp_path / "peft"), model.config, ours.LORA_FAMILY)
    assert (rank, alpha, len(chosen)) == (RANK, ALPHA, len(ours.lora_targets(model.config)))
    model.lora = g.LoRA(chosen, model.config.num_layers, rank, alpha)
    for name, value in tensors.items():
        model.lora.P[name][...] = value
    g.freeze(model)
    _, our_loss = forward_backward(ours, model, x, y)
    assert our_loss == pytest.approx(loss.item(), rel=RTOL)
    ours_in_peft_names = lora_files.peft_tensors(model.lora.G, chosen, model.config.num_layers,
                                                 ours.LORA_FAMILY.layer_prefix)
    assert len(ours_in_peft_names) == len(torch_grads)
    for key, grad in ours_in_peft_names.items():
        ref = torch_grads[key.replace(".weight", ".default.weight")]     # PEFT's live name holds the adapter's
        assert close(grad, ref), key


def test_our_adapters_load_into_peft_with_our_logits(family, monkeypatch):
    ours, hf, model, _, x, _, tmp_path = family
    targets = lora_files.select_targets("all-linear", ours.lora_targets(model.config), ())
    model.lora = g.LoRA(targets, model.config.num_layers, RANK, ALPHA)
    model.lora.params[...] = np.random.default_rng(3).standard_normal(model.lora.num_parameters) * LORA_B_STD
    g.freeze(model)
    logits, _ = forward_backward(ours, model, x, x)
    saved = str(tmp_path / "ours_adapters")
    lora_files.save(saved, model.lora, model.config.num_layers, ours.LORA_FAMILY, "ours.bin")
    config = peft.PeftConfig.from_pretrained(saved)
    assert (config.r, config.lora_alpha, config.peft_type) == (RANK, ALPHA, peft.PeftType.LORA)
    pm = peft.PeftModel.from_pretrained(hf, saved)
    with torch.no_grad():
        assert close(pm(input_ids=torch.from_numpy(x)).logits.numpy(), logits)
    if ours is m:                                          # without the RoPE row order, PEFT's q and k differ
        monkeypatch.setattr(lora_files, "rope_rows_to_hf", lambda w, HS: w)
        lora_files.save(saved, model.lora, model.config.num_layers, ours.LORA_FAMILY, "ours.bin")
        with torch.no_grad():
            wrong = peft.PeftModel.from_pretrained(hf_llama_like(hf), saved)(input_ids=torch.from_numpy(x)).logits
        assert not close(wrong.numpy(), logits)
    assert hf_layout.hf_rope_rows(4).tolist() == [0, 2, 1, 3]


def hf_llama_like(hf):
    """A fresh copy of the (unwrapped) Hugging Face model: from_pretrained wraps its argument in place."""
    copy = type(hf)(hf.config)
    copy.load_state_dict({k.replace("base_layer.", ""): v for k, v in hf.state_dict().items() if "lora_" not in k})
    return copy.eval()


def test_our_defaults_are_pefts():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    assert list(g.LORA_FAMILY.default_targets) == defaults["gpt2"]
    assert list(m.LORA_FAMILY.default_targets) == defaults["llama"]
    config = peft.LoraConfig()
    assert (config.lora_alpha, config.r) == (lora_files.LORA_DEFAULT_ALPHA, 8)
    assert config.lora_dropout == 0.0 and config.bias == "none"      # what ours train without
