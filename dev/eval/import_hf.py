"""
dev/eval/import_hf.py: a Hugging Face GPT-2 (local directory or hub id) -> our checkpoint .bin files.
A Llama (config.json's model_type "llama") is handed to dev/eval/import_hf_llama3.py, which writes
our Llama 3 model files.

Reads config.json and model.safetensors (or, failing that, pytorch_model.bin through torch; both
through dev/eval/hf_files.py, which the Llama importer shares) and
writes PREFIX.bin (version 3, fp32) and PREFIX_bf16.bin (version 5, bf16) with
gpt2_cpu.write_model: the same files llm.c's train_gpt2.py writes from the OpenAI weights, so
that `-e data/gpt2_124M.bin` starts from GPT-2. The mapping is export_hf.py's, inverted: Conv1D
weights are transposed back to (OC, C), and wte is padded from V to Vp rows with zeros.
A model that is not plain GPT-2 (another activation, an untied lm_head, scaled attention
variants, a different LayerNorm epsilon) is refused with one line, since our forward pass would
compute something else with its weights.

What it is not: a converter for other architectures, or for the tokenizer
(dev/data/tinyshakespeare.py writes gpt2_tokenizer.bin).

Run it:
    python dev/eval/import_hf.py -i gpt2                 # the hub's GPT-2 124M (needs the network)
    python dev/eval/import_hf.py -i path/to/hf_dir -o data/mymodel
prints
    GPT-2 from gpt2: L=12 NH=12 C=768 V=50257 Vp=50304 maxT=1024
    wrote data/gpt2_124M.bin (fp32)
    wrote data/gpt2_124M_bf16.bin (bf16)
Offline, a hub id fails with one line ("error: cannot reach huggingface.co ...") and exit 1.
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

from export_hf import HF_GELU_TANH, HF_GLOBAL_TENSORS, HF_LAYER_TENSORS, HF_PREFIX  # noqa: E402
import import_hf_llama3  # noqa: E402
from hf_files import is_llama, load_tensors, read_hf_config  # noqa: E402
from gpt2_cpu import (GPT2, LN_EPS, MODEL_DESCRIPTORS, MODEL_SIZES, GPT2Config, padded_vocab,  # noqa: E402
                      parameter_shapes, write_model)
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.paths import DEFAULT_DATA_DIR  # noqa: E402
from llmc.utils import InputError, physical_memory_bytes, require  # noqa: E402

HEADER_INT_MAX = 2 ** 31 - 1          # a checkpoint header slot is an int32
OUTPUT_DTYPES = {"float32": "", "bfloat16": "_bf16"}   # write_model dtype -> file-name suffix


# ----------------------------------------------------------------------------
# a Hugging Face GPT-2 (its files read by hf_files.py) as our GPT2

def header_size(hf, key, where):
    """hf[key] as a model dimension: a positive integer that fits a checkpoint header's int32.
    Raises InputError naming the key (KeyError if it is missing)."""
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{where}: {key} {value!r}: must be a positive integer")
    if value > HEADER_INT_MAX:
        raise InputError(f"{where}: {key} {value}: larger than a checkpoint header holds (int32)")
    return value


def config_from_hf(hf, where):
    """config.json dict -> our GPT2Config (Vp = V rounded up to 128). Raises InputError for
    anything our GPT-2 does not compute the same way, and for dimensions no checkpoint can hold
    or this machine cannot allocate, before anything is allocated or written."""
    if not isinstance(hf, dict):
        raise InputError(f"{where}: not a JSON object but a {type(hf).__name__}: not a Hugging Face config")
    try:
        if hf.get("model_type", "gpt2") != "gpt2":
            raise InputError(f"{where}: model_type '{hf['model_type']}' is not gpt2")
        C, L, NH, V = (header_size(hf, key, where) for key in ("n_embd", "n_layer", "n_head", "vocab_size"))
        maxT = header_size(hf, "n_positions" if "n_positions" in hf else "n_ctx", where)
        if C % NH:
            raise InputError(f"{where}: n_head {NH} does not divide n_embd {C}: heads split the channels evenly")
        unsupported = []
        if hf.get("activation_function", HF_GELU_TANH[0]) not in HF_GELU_TANH:
            unsupported.append(f"activation {hf['activation_function']}")
        if hf.get("n_inner") not in (None, 4 * C):
            unsupported.append(f"n_inner {hf['n_inner']} (we use 4*n_embd)")
        if not math.isclose(hf.get("layer_norm_epsilon", LN_EPS), LN_EPS):
            unsupported.append(f"layer_norm_epsilon {hf['layer_norm_epsilon']}")
        if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
            unsupported.append("attention scaling other than 1/sqrt(head size)")
        if not hf.get("tie_word_embeddings", True):
            unsupported.append("untied lm_head")
        if unsupported:
            raise InputError(f"{where}: not plain GPT-2: {', '.join(unsupported)}")
        config = GPT2Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=padded_vocab(V),
                            num_layers=L, num_heads=NH, channels=C)
    except (KeyError, TypeError) as e:
        raise InputError(f"{where}: incomplete GPT-2 config ({type(e).__name__}: {e})")
    num_parameters = sum(math.prod(shape) for _, shape in parameter_shapes(config))
    needed, present = 4 * num_parameters, physical_memory_bytes()          # fp32
    if needed > present:
        raise InputError(f"{where}: the model has {num_parameters:,} parameters, {needed / 2**30:,.1f} GiB of memory "
                         f"in fp32; this machine has {present / 2**30:,.1f} GiB")
    return config


def model_from_hf(config, tensors, where):
    """Fill a GPT2 of `config` from HF tensors (names with or without the 'transformer.' prefix).
    Raises InputError on a missing tensor, a wrong shape, or an lm_head that is not wte."""
    tensors = {(n[len(HF_PREFIX):] if n.startswith(HF_PREFIX) else n): t for n, t in tensors.items()}
    model = GPT2(config)
    P, V = model.P, config.vocab_size

    def take(name, shape, transposed):
        if name not in tensors:
            raise InputError(f"{where}: tensor {name} missing")
        t = tensors[name].T if transposed else tensors[name]              # (C,OC) -> (OC,C)
        if t.shape != shape:
            raise InputError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected "
                             f"{shape[::-1] if transposed else shape}")
        return t

    for ours, hf in HF_GLOBAL_TENSORS.items():
        if ours == "wte":                                                 # (V,C) -> rows 0..V-1 of (Vp,C)
            P["wte"][:V] = take(hf, (V, config.channels), False)
            P["wte"][V:] = 0.0
        else:
            P[ours][...] = take(hf, P[ours].shape, False)
    for l in range(config.num_layers):
        for ours, (hf, transposed) in HF_LAYER_TENSORS.items():
            P[ours][l] = take(f"h.{l}.{hf}", P[ours][l].shape, transposed)
    lm_head = tensors.get("lm_head.weight")
    if lm_head is not None and not np.array_equal(lm_head, P["wte"][:V]):
        raise InputError(f"{where}: lm_head.weight differs from wte: untied classifiers are not supported")
    return model


def import_hf(source):
    """A local HF GPT-2 directory or a hub id -> our GPT2 (fp32)."""
    hf_dir, hf, config_path = read_hf_config(source)
    config = config_from_hf(hf, config_path)
    return model_from_hf(config, load_tensors(hf_dir), hf_dir)


def default_prefix(config):
    """data/gpt2_124M for the GPT-2 sizes, data/gpt2_d<L> otherwise."""
    shape = (config.num_layers, config.num_heads, config.channels)
    size = {MODEL_DESCRIPTORS[d]: s for s, d in MODEL_SIZES.items()}.get(shape, f"d{config.num_layers}")
    return os.path.join(DEFAULT_DATA_DIR, f"gpt2_{size}")


def parse_args(argv=None):
    p = ArgumentParser(description="Import a Hugging Face GPT-2 (or Llama: import_hf_llama3.py) as our fp32 and "
                                   "bf16 model .bin files.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-i", "--input", default="gpt2", help="local Hugging Face directory, or a hub id")
    p.add_argument("-o", "--output", default=None,
                   help="output prefix: writes PREFIX.bin and PREFIX_bf16.bin; None: data/gpt2_<size>, e.g. data/gpt2_124M")
    p.add_argument("--dtype", choices=("both",) + tuple(OUTPUT_DTYPES), default="both", help="which files to write")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/eval/import_hf.py", "safetensors")
    return run_main(import_command, args)


def import_command(args):
    """Import args.input and write the files; a bad input or a failed write raises (run_main
    makes it one line and exit 1). A Llama's config.json goes to import_hf_llama3.py."""
    hf_dir, hf, config_path = read_hf_config(args.input)
    if is_llama(hf):
        return import_hf_llama3.import_command(args, hf_dir, hf, config_path)
    model = model_from_hf(config_from_hf(hf, config_path), load_tensors(hf_dir), hf_dir)
    cfg = model.config
    print(f"GPT-2 from {args.input}: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} "
          f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} maxT={cfg.max_seq_len}")
    prefix = args.output or default_prefix(cfg)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    for dtype, suffix in OUTPUT_DTYPES.items():
        if args.dtype in ("both", dtype):
            write_model(prefix + suffix + ".bin", model, dtype)
            print(f"wrote {prefix + suffix}.bin ({'fp32' if dtype == 'float32' else 'bf16'})")


if __name__ == "__main__":
    sys.exit(main())
