"""
dev/eval/export_hf_llama3.py: our Llama 3 model file (.bin, fp32 or bf16) -> a Hugging Face
LlamaForCausalLM directory (config.json + model.safetensors, fp32). dev/eval/export_hf.py hands a
Llama 3 file here (it reads the file's magic), so `export_hf.py -i llama.bin -o DIR` works too.

The mapping, parameter by parameter (HF_LAYER_TENSORS below): HF's nn.Linear weights are
(out, in) like ours, so nothing is transposed; c_attn (qkvw) is split into q_proj | k_proj |
v_proj; c_fc (fcw, the linear branch) is up_proj and c_fc2 (fcw2, through SiLU) is gate_proj;
wlmhead is lm_head (untied).

RoPE's channel order is the one real difference. llama3_cpu.rope_forward rotates adjacent pairs
(x_2i, x_2i+1) of a head by the angle t freq_i (Meta's and llm.c's layout); HF's LlamaAttention
rotates the halves, pairs (x_i, x_i+HS/2) by the same t freq_i (rotate_half). Writing both rules
out, HF's channel i of a head is our channel 2i and HF's channel i+HS/2 is our 2i+1. So q_proj's and
k_proj's rows are permuted within each head (hf_rope_rows): HF row j of head h = our row
ROPE_TO_HF[j] of head h, ROPE_TO_HF = [0, 2, 4, .., HS-2, 1, 3, .., HS-1]. A query-key score is
a sum over a head's channels, which the same permutation of q and k leaves unchanged; v and o_proj
are not permuted. (HF's own convert_llama_weights_to_hf.py applies this permutation to Meta's weights;
llmc/hf_layout.py holds it, as llmc/lora.py permutes LoRA adapters the same way.)

What it is not: a tokenizer exporter (our Llama 3 models use GPT-2's tokenizer). The inverse is
dev/eval/import_hf_llama3.py.

Run it:
    python dev/eval/export_hf_llama3.py -i llama3_d4.bin -o hf_llama      # a model file of llama3:d4
prints
    exported Llama 3 (L=4 NH=4 NKV=2 C=256 H=896 V=50257 maxT=1024, 29,272,832 parameters) to hf_llama
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from hf_files import HF_CONFIG, HF_WEIGHTS  # noqa: E402
from llama3_cpu import (ROPE_HIGH_FREQ_FACTOR, ROPE_LOW_FREQ_FACTOR, ROPE_ORIGINAL_CONTEXT,  # noqa: E402
                        ROPE_SCALE_FACTOR, read_model)
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.hf_layout import hf_rope_rows, rope_rows_from_hf, rope_rows_to_hf  # noqa: E402,F401 (import_hf_llama3 takes them from here)
from llmc.utils import atomic_write, require  # noqa: E402

HF_PREFIX = "model."                 # LlamaForCausalLM keeps the decoder under this name (lm_head outside it)
HF_ROPE_TYPE = "llama3"              # HF's name for Llama 3.1's frequency scaling (rope_parameters' rope_type)
HF_ACT = "silu"
# our per-layer tensor -> HF name inside model.layers.<l>. (qkvw is split in three: hf_state_dict)
HF_LAYER_TENSORS = {"ln1w": "input_layernorm.weight", "attprojw": "self_attn.o_proj.weight",
                    "ln2w": "post_attention_layernorm.weight", "fcw": "mlp.up_proj.weight",
                    "fcw2": "mlp.gate_proj.weight", "fcprojw": "mlp.down_proj.weight"}
HF_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
HF_GLOBAL_TENSORS = {"wte": "model.embed_tokens.weight", "lnfw": "model.norm.weight", "wlmhead": "lm_head.weight"}
# the two SwiGLU sizing fields HF's config has no place for (it stores H itself): kept so that a
# round trip ours -> HF -> ours gives the same model file, byte for byte (import_hf_llama3 reads them)
LLMC_KEYS = ("llmc_multiple_of", "llmc_ffn_dim_multiplier")


def hf_config(config):
    """Our LlamaConfig -> the dict of a Hugging Face Llama config.json. rope_theta and rope_scaling
    are written as transformers 4.x names them; 5.x reads them into its rope_parameters."""
    rope_scaling = {"rope_type": HF_ROPE_TYPE, "factor": float(ROPE_SCALE_FACTOR),
                    "low_freq_factor": float(ROPE_LOW_FREQ_FACTOR), "high_freq_factor": float(ROPE_HIGH_FREQ_FACTOR),
                    "original_max_position_embeddings": ROPE_ORIGINAL_CONTEXT} if config.use_scaled_rope else None
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.channels, "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_size,
        "max_position_embeddings": config.max_seq_len, "hidden_act": HF_ACT,
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta, "rope_scaling": rope_scaling,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        LLMC_KEYS[0]: config.multiple_of, LLMC_KEYS[1]: config.ffn_dim_multiplier,
    }


def hf_state_dict(model):
    """Our Llama3 -> {HF tensor name: contiguous float32 array}, HF's layout (see the top)."""
    cfg = model.config
    NH, NKV, HS = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    P = {name: view.astype(np.float32) for name, view in model.P.items()}
    tensors = {hf: P[ours] for ours, hf in HF_GLOBAL_TENSORS.items()}
    for l in range(cfg.num_layers):
        prefix = f"{HF_PREFIX}layers.{l}."
        for ours, hf in HF_LAYER_TENSORS.items():
            tensors[prefix + hf] = P[ours][l]
        q, k, v = np.split(P["qkvw"][l], [NH * HS, (NH + NKV) * HS])      # (NH*HS,C), (NKV*HS,C), (NKV*HS,C)
        for hf, t in zip(HF_QKV, (rope_rows_to_hf(q, HS), rope_rows_to_hf(k, HS), v)):
            tensors[prefix + hf] = t
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def export_hf(model, out_dir):
    """Write config.json and model.safetensors for `model` into out_dir (created if needed), each
    atomically. Raises OSError if the files cannot be written."""
    from safetensors.numpy import save
    os.makedirs(out_dir, exist_ok=True)
    weights = save(hf_state_dict(model), metadata={"format": "pt"})   # transformers wants {"format": "pt"}
    config = (json.dumps(hf_config(model.config), indent=2) + "\n").encode()
    for name, payload in ((HF_WEIGHTS, weights), (HF_CONFIG, config)):
        atomic_write(os.path.join(out_dir, name), lambda f: f.write(payload))


def parse_args(argv=None):
    p = ArgumentParser(description="Export a Llama 3 model .bin as a Hugging Face LlamaForCausalLM directory.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-i", "--input", required=True, help="our Llama 3 model file .bin (version 3 fp32 or 5 bf16)")
    p.add_argument("-o", "--output-dir", required=True, help="directory for config.json + model.safetensors")
    return p.parse_args(argv)


def export_command(args):
    model = read_model(args.input)
    export_hf(model, args.output_dir)
    c = model.config
    print(f"exported Llama 3 (L={c.num_layers} NH={c.num_heads} NKV={c.num_kv_heads} C={c.channels} "
          f"H={c.hidden_dim} V={c.vocab_size} maxT={c.max_seq_len}, {model.num_parameters:,} parameters) "
          f"to {args.output_dir}")


def main(argv=None):
    args = parse_args(argv)
    require("dev/eval/export_hf_llama3.py", "safetensors")
    return run_main(export_command, args)


if __name__ == "__main__":
    sys.exit(main())
