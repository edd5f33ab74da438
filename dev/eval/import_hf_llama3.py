"""
dev/eval/import_hf_llama3.py: a Hugging Face LlamaForCausalLM (local directory or hub id) -> our
Llama 3 model files, PREFIX.bin (fp32, version 3) and PREFIX_bf16.bin (bf16, version 5), written
by llama3_cpu.write_model. dev/eval/import_hf.py hands a config.json of model_type "llama" here,
so `import_hf.py -i DIR` works too.

The mapping is export_hf_llama3.py's, inverted: q_proj | k_proj | v_proj stacked into qkvw, q's
and k's rows put back from HF's half layout into RoPE's adjacent pairs (rope_rows_from_hf),
up_proj -> fcw, gate_proj -> fcw2. A tied lm_head (tie_word_embeddings, as Llama 3.2 1B) is
copied into wlmhead: the same forward pass.

HF's config stores the SwiGLU width H (intermediate_size); ours stores how Meta computes it,
ffn_dim_multiplier and multiple_of (llama3_cpu.LlamaConfig.hidden_dim). swiglu_sizing picks a
pair that gives H: the llmc_ keys export_hf_llama3.py writes when present, else Llama 3's own
(1.3, 1024) when it fits (8B, 70B, 405B), else 1.3 with the largest power of two that fits,
else multiple_of = H itself.

A config ours cannot compute the same way is refused with one line, before anything is
allocated: another activation, biases, head_dim other than C/NH, RoPE scaling other than none or
Llama 3.1's with its constants (llama3_cpu.py's ROPE_*), pretraining_tp > 1.

Run it:
    python dev/eval/import_hf_llama3.py -i path/to/hf_llama -o data/llama3_small
prints
    Llama 3 from path/to/hf_llama: L=2 NH=4 NKV=2 C=64 H=224 V=100 maxT=64
    wrote data/llama3_small.bin (fp32)
    wrote data/llama3_small_bf16.bin (bf16)
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from llmc.interrupt import quiet_ctrl_c_while_importing  # noqa: E402
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback

import numpy as np  # noqa: E402

from export_hf_llama3 import (HF_ACT, HF_GLOBAL_TENSORS, HF_LAYER_TENSORS, HF_PREFIX, HF_QKV,  # noqa: E402
                              HF_ROPE_TYPE, LLMC_KEYS, rope_rows_from_hf)
from hf_files import load_tensors, read_hf_config  # noqa: E402
import llama3_cpu  # noqa: E402
from llama3_cpu import (FFN_DIM_MULTIPLIER, FFN_MULTIPLE_OF, MLP_EXPANSION, ROPE_HIGH_FREQ_FACTOR,  # noqa: E402
                        ROPE_LOW_FREQ_FACTOR, ROPE_ORIGINAL_CONTEXT, ROPE_SCALE_FACTOR, Llama3, LlamaConfig,
                        parameter_shapes, write_model)
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.paths import DEFAULT_DATA_DIR  # noqa: E402
from llmc.utils import InputError, physical_memory_bytes, require  # noqa: E402

OUTPUT_DTYPES = {"float32": "", "bfloat16": "_bf16"}   # write_model dtype -> file-name suffix
HEADER_INT_MAX = 2 ** 31 - 1                           # a model-file header slot is an int32
# Llama 3.1's RoPE scaling in HF's words: rope_scaling / rope_parameters keys -> our constants
HF_LLAMA3_ROPE = {"factor": ROPE_SCALE_FACTOR, "low_freq_factor": ROPE_LOW_FREQ_FACTOR,
                  "high_freq_factor": ROPE_HIGH_FREQ_FACTOR, "original_max_position_embeddings": ROPE_ORIGINAL_CONTEXT}
HF_ROPE_NONE = (None, "default")                       # plain RoPE, no frequency scaling


def dimension(hf, key, where):
    """hf[key] as a positive integer that fits an int32 header slot. Raises InputError (KeyError if missing)."""
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= HEADER_INT_MAX:
        raise InputError(f"{where}: {key} {value!r}: must be a positive integer that fits an int32")
    return value


def swiglu_sizing(C, H, hf):
    """(ffn_dim_multiplier, multiple_of) with LlamaConfig.hidden_dim == H for C channels, in the
    order the top says; each candidate checked through the float32 the model file stores."""
    candidates = []
    multiplier, multiple_of = (hf.get(key) for key in reversed(LLMC_KEYS))
    if isinstance(multiplier, (int, float)) and isinstance(multiple_of, int):
        candidates.append((multiplier, multiple_of))
    candidates.append((FFN_DIM_MULTIPLIER, FFN_MULTIPLE_OF))
    candidates += [(FFN_DIM_MULTIPLIER, 1 << k) for k in reversed(range(H.bit_length())) if H % (1 << k) == 0]
    base = 2 * (MLP_EXPANSION * C) // 3                    # hidden_dim's 2/3 of 4C before the multiplier
    # multiple_of = H: any multiplier that puts int(multiplier * base) in [1, H] rounds up to H;
    # (H + 1/4) / base gives int(H + 1/4) = H, with room for the float32 rounding of the multiplier
    candidates.append((1.0 if base <= H else (H + 0.25) / base, H))
    for multiplier, multiple_of in candidates:
        multiplier = float(str(np.float32(multiplier)))    # what the model file's float32 slot gives back
        if multiple_of > 0 and multiplier > 0 and \
                LlamaConfig(channels=C, ffn_dim_multiplier=multiplier, multiple_of=multiple_of).hidden_dim == H:
            return multiplier, multiple_of
    raise InputError(f"intermediate_size {H}: no ffn_dim_multiplier and multiple_of give it for hidden_size {C}")


def rope_settings(hf, where):
    """(rope_theta, use_scaled_rope) from transformers 5's rope_parameters or 4's rope_theta +
    rope_scaling. Raises InputError for a scaling ours does not compute."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type") not in HF_ROPE_NONE else None)
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not theta > 0:
        raise InputError(f"{where}: rope_theta {theta!r}: must be a positive number")
    if scaling is None or scaling.get("rope_type", scaling.get("type")) in HF_ROPE_NONE:
        return float(theta), False
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != HF_ROPE_TYPE:
        raise InputError(f"{where}: RoPE scaling '{kind}': ours computes none or Llama 3.1's ('{HF_ROPE_TYPE}')")
    for key, ours in HF_LLAMA3_ROPE.items():
        if not math.isclose(scaling.get(key, float("nan")), ours):
            raise InputError(f"{where}: Llama 3.1 RoPE scaling with {key} {scaling.get(key)!r}: ours uses {ours}")
    return float(theta), True


def config_from_hf(hf, where):
    """config.json dict -> our LlamaConfig. Raises InputError for anything ours does not compute
    the same way, before anything is allocated or written."""
    if not isinstance(hf, dict):
        raise InputError(f"{where}: not a JSON object but a {type(hf).__name__}: not a Hugging Face config")
    try:
        if hf.get("model_type") != "llama":
            raise InputError(f"{where}: model_type {hf.get('model_type')!r} is not llama")
        C, L, NH, V, H, maxT = (dimension(hf, key, where) for key in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size",
            "max_position_embeddings"))
        NKV = dimension(hf, "num_key_value_heads", where) if hf.get("num_key_value_heads") is not None else NH
        unsupported = []
        if hf.get("hidden_act", HF_ACT) != HF_ACT:
            unsupported.append(f"activation {hf['hidden_act']}")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            unsupported.append("biases")
        if C % NH or hf.get("head_dim") not in (None, C // NH):
            unsupported.append(f"head_dim {hf.get('head_dim', C / NH)} (ours is hidden_size / num_attention_heads)")
        if hf.get("pretraining_tp", 1) != 1:
            unsupported.append(f"pretraining_tp {hf['pretraining_tp']}")
        if unsupported:
            raise InputError(f"{where}: not a Llama 3 ours computes: {', '.join(unsupported)}")
        theta, scaled = rope_settings(hf, where)
        eps = hf.get("rms_norm_eps")
        if not isinstance(eps, (int, float)) or not eps >= 0:
            raise InputError(f"{where}: rms_norm_eps {eps!r}: must be a number >= 0")
        multiplier, multiple_of = swiglu_sizing(C, H, hf)
        config = LlamaConfig(max_seq_len=maxT, vocab_size=V, num_layers=L, num_heads=NH, num_kv_heads=NKV,
                             channels=C, multiple_of=multiple_of, use_scaled_rope=scaled,
                             ffn_dim_multiplier=multiplier, norm_eps=float(eps), rope_theta=theta)
        llama3_cpu.check_config(config)
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(f"{where}: incomplete Llama config ({type(e).__name__}: {e})")
    num_parameters = sum(math.prod(shape) for _, shape in parameter_shapes(config))
    needed, present = 4 * num_parameters, physical_memory_bytes()
    if needed > present:
        raise InputError(f"{where}: the model has {num_parameters:,} parameters, {needed / 2**30:,.1f} GiB in fp32; "
                         f"this machine has {present / 2**30:,.1f} GiB")
    return config


def model_from_hf(config, tensors, where):
    """Fill a Llama3 of `config` from HF tensors. Raises InputError on a missing tensor or a wrong shape."""
    model = Llama3(config)
    P, HS = model.P, config.head_size

    def take(name, shape):
        if name not in tensors:
            raise InputError(f"{where}: tensor {name} missing")
        if tensors[name].shape != shape:
            raise InputError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        return tensors[name]

    for ours, hf in HF_GLOBAL_TENSORS.items():
        if ours == "wlmhead" and hf not in tensors:            # tied: lm_head is embed_tokens
            hf = HF_GLOBAL_TENSORS["wte"]
        P[ours][...] = take(hf, P[ours].shape)
    NH, NKV = config.num_heads, config.num_kv_heads
    for l in range(config.num_layers):
        prefix = f"{HF_PREFIX}layers.{l}."
        for ours, hf in HF_LAYER_TENSORS.items():
            P[ours][l] = take(prefix + hf, P[ours][l].shape)
        C = config.channels
        q, k, v = (take(prefix + hf, (nh * HS, C)) for hf, nh in zip(HF_QKV, (NH, NKV, NKV)))
        P["qkvw"][l] = np.concatenate([rope_rows_from_hf(q, HS), rope_rows_from_hf(k, HS), v])
    return model


def import_hf(hf_dir, hf, where):
    """A local HF Llama directory (its config.json already read into hf) -> our Llama3 (fp32)."""
    config = config_from_hf(hf, where)
    return model_from_hf(config, load_tensors(hf_dir), hf_dir)


def import_command(args, hf_dir, hf, where):
    """import_hf.py's command for a Llama: import, print, write the files (run_main reports errors)."""
    model = import_hf(hf_dir, hf, where)
    c = model.config
    print(f"Llama 3 from {args.input}: L={c.num_layers} NH={c.num_heads} NKV={c.num_kv_heads} C={c.channels} "
          f"H={c.hidden_dim} V={c.vocab_size} maxT={c.max_seq_len}")
    prefix = args.output or os.path.join(DEFAULT_DATA_DIR, f"llama3_d{c.num_layers}")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    for dtype, suffix in OUTPUT_DTYPES.items():
        if args.dtype in ("both", dtype):
            write_model(prefix + suffix + ".bin", model, dtype)
            print(f"wrote {prefix + suffix}.bin ({'fp32' if dtype == 'float32' else 'bf16'})")


def parse_args(argv=None):
    p = ArgumentParser(description="Import a Hugging Face Llama as our fp32 and bf16 Llama 3 model files.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-i", "--input", required=True, help="local Hugging Face directory, or a hub id")
    p.add_argument("-o", "--output", default=None,
                   help="output prefix: writes PREFIX.bin and PREFIX_bf16.bin; None: data/llama3_d<L>")
    p.add_argument("--dtype", choices=("both",) + tuple(OUTPUT_DTYPES), default="both", help="which files to write")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/eval/import_hf_llama3.py", "safetensors")

    def command(args):
        hf_dir, hf, where = read_hf_config(args.input)
        return import_command(args, hf_dir, hf, where)
    return run_main(command, args)


if __name__ == "__main__":
    sys.exit(main())
