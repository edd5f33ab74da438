"""
dev/eval/export_hf.py: our model checkpoint (.bin, fp32 or bf16) -> a Hugging Face GPT-2 directory.
A Llama 3 model file (its magic) is handed to dev/eval/export_hf_llama3.py (LlamaForCausalLM).

Writes DIR/config.json and DIR/model.safetensors (fp32), both with the mode the umask gives (0644
under 022), which transformers.GPT2LMHeadModel.from_pretrained(DIR) loads as is, so that a model
trained here can be evaluated with other tools (lm-evaluation-harness, the HF generate() API, ...).
The mapping, parameter by parameter (HF_LAYER_TENSORS below):
  - Hugging Face's GPT-2 uses Conv1D layers that compute `out = inp @ W + b` with W stored
    (in_features, out_features): our (OC, C) matmul weights are written transposed;
  - our qkvw (3C, C) is HF's c_attn, whose output columns are q | k | v, heads in order, as ours;
  - wte loses its padding rows V..Vp-1 (HF has no padded vocabulary);
  - there is no lm_head tensor: the classifier is tied to wte in both models.
The tanh GELU is HF's "gelu_new"; LayerNorm epsilon 1e-5; no dropout (we train without it).

What it is not: a tokenizer exporter. Copy the GPT-2 tokenizer files (vocab.json, merges.txt)
from the "gpt2" hub repository if a tool needs them. dev/eval/import_hf.py goes the other way.

Run it:
    python dev/eval/export_hf.py -i log124M/model_00005000.bin -o hf_model
prints
    exported GPT-2 (L=12 NH=12 C=768 V=50257 maxT=1024, 124,439,808 parameters) to hf_model
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import export_hf_llama3  # noqa: E402
from gpt2_cpu import LN_EPS, read_model  # noqa: E402
from hf_files import HF_CONFIG, HF_WEIGHTS  # noqa: E402
from llmc.tokenizer import GPT2_EOT  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.formats import is_llama3_model_file  # noqa: E402
from llmc.utils import InputError, atomic_write, require  # noqa: E402

HF_PREFIX = "transformer."          # GPT2LMHeadModel keeps the transformer under this name
HF_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")   # both are the tanh approximation we use
# our per-layer tensor -> (HF name inside transformer.h.<l>., stored transposed?)
HF_LAYER_TENSORS = {
    "ln1w": ("ln_1.weight", False), "ln1b": ("ln_1.bias", False),
    "qkvw": ("attn.c_attn.weight", True), "qkvb": ("attn.c_attn.bias", False),
    "attprojw": ("attn.c_proj.weight", True), "attprojb": ("attn.c_proj.bias", False),
    "ln2w": ("ln_2.weight", False), "ln2b": ("ln_2.bias", False),
    "fcw": ("mlp.c_fc.weight", True), "fcb": ("mlp.c_fc.bias", False),
    "fcprojw": ("mlp.c_proj.weight", True), "fcprojb": ("mlp.c_proj.bias", False),
}
# our whole-model tensor -> HF name inside transformer. (wte is unpadded to V on the way out)
HF_GLOBAL_TENSORS = {"wte": "wte.weight", "wpe": "wpe.weight", "lnfw": "ln_f.weight", "lnfb": "ln_f.bias"}


def hf_config(config):
    """Our GPT2Config -> the dict of a Hugging Face GPT-2 config.json."""
    eot = GPT2_EOT if config.vocab_size > GPT2_EOT else None     # a small test vocabulary has none
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_seq_len, "n_ctx": config.max_seq_len,
        "n_embd": config.channels, "n_layer": config.num_layers, "n_head": config.num_heads,
        "n_inner": None,                                 # None means 4 * n_embd, as ours
        "activation_function": HF_GELU_TANH[0], "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "bos_token_id": eot, "eos_token_id": eot,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
    }


def hf_state_dict(model):
    """Our GPT2 -> {HF tensor name: contiguous float32 array}, in HF's layout (see the top)."""
    cfg = model.config
    P = {name: view.astype(np.float32) for name, view in model.P.items()}
    tensors = {HF_PREFIX + hf: P[ours] for ours, hf in HF_GLOBAL_TENSORS.items()}
    tensors[HF_PREFIX + "wte.weight"] = P["wte"][:cfg.vocab_size]          # (Vp,C) -> (V,C)
    for l in range(cfg.num_layers):
        for ours, (hf, transposed) in HF_LAYER_TENSORS.items():
            t = P[ours][l]
            tensors[f"{HF_PREFIX}h.{l}.{hf}"] = t.T if transposed else t   # (OC,C) -> (C,OC)
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def export_hf(model, out_dir):
    """Write config.json and model.safetensors for `model` into out_dir (created if needed), each
    atomically (llmc.utils.atomic_write: a full disk or a crash leaves no partial file).
    Raises InputError if wte's padding rows are not zero (they would be lost); OSError if the
    files cannot be written."""
    from safetensors.numpy import save
    cfg = model.config
    if np.any(model.P["wte"][cfg.vocab_size:]):
        raise InputError(f"wte rows {cfg.vocab_size}..{cfg.padded_vocab_size - 1} (vocabulary padding) are not zero: "
                         "Hugging Face has no place for them")
    os.makedirs(out_dir, exist_ok=True)
    # transformers refuses a safetensors file without {"format": "pt"} metadata
    weights = save(hf_state_dict(model), metadata={"format": "pt"})
    config = (json.dumps(hf_config(cfg), indent=2) + "\n").encode()
    for name, payload in ((HF_WEIGHTS, weights), (HF_CONFIG, config)):
        atomic_write(os.path.join(out_dir, name), lambda f: f.write(payload))   # open()'s mode: the umask's


def parse_args(argv=None):
    p = ArgumentParser(description="Export a model .bin (fp32 or bf16) as a Hugging Face GPT-2 directory.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-i", "--input", required=True, help="our checkpoint .bin (version 3 fp32 or 5 bf16)")
    p.add_argument("-o", "--output-dir", required=True, help="directory for config.json + model.safetensors")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/eval/export_hf.py", "safetensors")
    if is_llama3_model_file(args.input):
        return export_hf_llama3.main(argv)
    try:
        model = read_model(args.input)
        export_hf(model, args.output_dir)
    except (InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    cfg = model.config
    num_hf = model.num_parameters - (cfg.padded_vocab_size - cfg.vocab_size) * cfg.channels
    print(f"exported GPT-2 (L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} V={cfg.vocab_size} "
          f"maxT={cfg.max_seq_len}, {num_hf:,} parameters) to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
