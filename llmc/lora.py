"""
llmc/lora.py: LoRA's host side (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models"; the algorithm itself is gpt2_cpu.py's LoRA section): the flags, which linear layers a
--lora-targets list names, and the adapter files, written and read as Hugging Face PEFT writes
them (adapter_config.json plus adapter_model.safetensors with PEFT's tensor names), so that `peft`
loads our adapters onto the Hugging Face model and we load PEFT's.

The flags, with the defaults a PEFT user expects (PEFT's LoraConfig: r=8, lora_alpha=8; its
per-architecture default targets, peft/utils/constants.py's
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: "gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]):
    --lora-rank r        the rank of every adapter (0: no LoRA, full training)
    --lora-alpha a       the update is scaled by a / r (default LORA_DEFAULT_ALPHA)
    --lora-targets ...   comma-separated layer names, matched as PEFT matches target_modules: a
                         name is a target if it equals the layer's name or ends it after a dot
                         ("c_proj" is GPT-2's attn.c_proj and mlp.c_proj); "all-linear" is every one
    --lora-save DIR      after training, write the adapters into DIR (PEFT's two files)
    --lora-load DIR      start from the adapters in DIR (ours or PEFT's): train them further, or
                         evaluate / sample / merge with them
    --lora-merge OUT     with --lora-load: write -e with the adapters merged in (W + a/r B A) as a
                         model file OUT, llm.c's format, and exit

The file format (PEFT 0.21's save_pretrained, checked against peft itself by tests/test_lora_peft.py):
adapter_model.safetensors holds, for every layer l and adapted module, two fp32 tensors named
    base_model.model.<the module's name in the Hugging Face model>.lora_A.weight   (r, in_features)
    base_model.model.<...>.lora_B.weight                                           (out_features, r)
e.g. base_model.model.transformer.h.0.attn.c_attn.lora_A.weight for GPT-2 and
base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight for Llama; adapter_config.json holds r,
lora_alpha, the target module names and the options below (fan_in_fan_out for GPT-2's Conv1D layers).
Hugging Face's Llama keeps q_proj's and k_proj's rows in another order within each head (its RoPE
rotates halves, ours adjacent pairs: llmc/hf_layout.py), so lora_B of those two is permuted on the
way out and back; lora_A (the input side) never is.

What it is not: PEFT. Plain LoRA on linear layers only: a file asking for DoRA, rsLoRA, trained
biases, per-layer ranks or alphas, extra trained modules, or adapters on some layers only is
refused in one line. No dropout (the trainers train without any).
"""

import json
import math
import os
import re
from typing import NamedTuple

import numpy as np

from llmc.hf_layout import rope_rows_from_hf, rope_rows_to_hf
from llmc.utils import InputError, atomic_write

LORA_DEFAULT_ALPHA = 8                 # PEFT's LoraConfig(lora_alpha=8) (its r is 8 too)
ALL_LINEAR = "all-linear"              # PEFT's target_modules value for every linear layer
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."      # PeftModel's name for the wrapped Hugging Face model
PEFT_INIT = True                       # lora_A kaiming-uniform, lora_B = 0: PEFT's default init_lora_weights
# a PEFT tensor name: PEFT_PREFIX, the layer prefix with its index, the module name, A or B
PEFT_KEY = re.compile(r"^base_model\.model\.(?P<layer>.*?\.)(?P<l>\d+)\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# adapter_config.json values other than these ask for something plain LoRA is not
PEFT_PLAIN = {"peft_type": "LORA", "use_dora": False, "use_rslora": False, "bias": "none", "lora_bias": False,
              "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


class LoraTarget(NamedTuple):
    """A linear layer LoRA can adapt, per layer of the model: PEFT's name for it inside a layer,
    our parameter whose rows `rows` (of each layer's (OC,C) matrix) it is, its input width C, and
    for a projection into RoPE-rotated heads (Llama's q and k) their head size, whose row order
    Hugging Face permutes (0 for every other layer)."""
    name: str                          # e.g. "attn.c_attn" (GPT-2), "self_attn.q_proj" (Llama 3)
    weight: str                        # e.g. "qkvw"
    rows: slice                        # the layer's output channels within weight's OC rows
    in_features: int
    rope_head_size: int = 0

    @property
    def out_features(self):
        return self.rows.stop - self.rows.start


class LoraFamily(NamedTuple):
    """What a model family (gpt2_cpu.py, llama3_cpu.py) tells this module about its LoRA: its
    targets for a config (targets_of(config) -> list of LoraTarget), the Hugging Face model's name
    of layer l ("transformer.h.{l}."), PEFT's default --lora-targets for it, and whether its Hugging
    Face layers store W transposed (GPT-2's Conv1D: PEFT's fan_in_fan_out)."""
    targets_of: object
    layer_prefix: str
    default_targets: tuple
    fan_in_fan_out: bool


# ----------------------------------------------------------------------------
# the flags

def add_flags(parser, default_targets):
    """The LoRA flags, in a group of their own; default_targets: the family's PEFT default, shown
    in --help (--lora-targets itself defaults to None: 'the family's default')."""
    a = parser.add_argument_group("LoRA fine-tuning (Hu et al. 2021; adapters in Hugging Face PEFT's files)").add_argument
    a("--lora-rank", type=int, default=0, metavar="R",
      help="train rank-R LoRA adapters on the --lora-targets, every other parameter frozen (0: full training)")
    a("--lora-alpha", type=float, default=None, metavar="A",
      help=f"LoRA's scale is A / R (default {LORA_DEFAULT_ALPHA}, PEFT's)")
    a("--lora-targets", default=None, metavar="NAMES",
      help=f"comma-separated layers to adapt, PEFT's names and matching (default {','.join(default_targets)}, "
           f"PEFT's for this model family; {ALL_LINEAR}: every linear layer but the classifier)")
    a("--lora-save", default=None, metavar="DIR", help="after training, write the adapters into DIR as PEFT does")
    a("--lora-load", default=None, metavar="DIR", help="start from the adapters in DIR (ours or PEFT's save_pretrained)")
    a("--lora-merge", default=None, metavar="OUT", help="with --lora-load: write -e with the adapters merged in as a "
                                                        "model file OUT and exit")


def describe(lora, num_model_parameters):
    """The banner's LoRA line: rank, alpha, targets and how many parameters train."""
    return (f"lora: r={lora.rank} alpha={lora.alpha:g} (scale {lora.scale:g}) on {', '.join(t.name for t in lora.targets)} "
            f"| {lora.num_parameters:,} trainable parameters ({100 * lora.num_parameters / num_model_parameters:.2f}% "
            f"of the frozen model's {num_model_parameters:,})")


def uses_lora(args):
    """Whether the flags ask for LoRA (training adapters, or loading them)."""
    return getattr(args, "lora_rank", 0) > 0 or getattr(args, "lora_load", None) is not None


def check_flags(args):
    """One InputError for LoRA flags that make no sense together. A LoRA run keeps no checkpoint
    (-n, -y 1): its product is the adapters, --lora-save."""
    shaping = [flag for flag, dest in (("--lora-alpha", "lora_alpha"), ("--lora-targets", "lora_targets"))
               if getattr(args, dest) is not None]
    given = (["--lora-rank"] if args.lora_rank else []) + shaping
    checks = [
        (args.lora_rank >= 0, f"--lora-rank {args.lora_rank}: must be >= 0 (0: no LoRA)"),
        (args.lora_alpha is None or (math.isfinite(args.lora_alpha) and args.lora_alpha > 0),
         f"--lora-alpha {args.lora_alpha}: must be a number > 0"),
        (args.lora_load is None or not given,
         f"--lora-load takes the rank, alpha and targets from {PEFT_CONFIG}: drop {' '.join(given)}"),
        (args.lora_rank > 0 or args.lora_load is not None or not shaping,
         f"{' '.join(shaping)} without --lora-rank R: give the adapters' rank"),
        (args.lora_merge is None or args.lora_load is not None,
         "--lora-merge OUT merges the adapters of --lora-load DIR: give it"),
        (args.lora_save is None or args.lora_rank > 0 or args.lora_load is not None,
         "--lora-save DIR writes LoRA adapters: give --lora-rank R (or --lora-load DIR)"),
        (args.lora_save is None or not (args.eval_only or args.generate),
         "--lora-save DIR writes the adapters a training run trained: not with --eval-only or --generate"),
        (args.lora_merge is None or not (args.eval_only or args.generate or args.lora_save),
         "--lora-merge OUT merges and exits: drop --eval-only, --generate and --lora-save"),
        (not uses_lora(args) or (args.checkpoint_every == 0 and not args.resume),
         "a LoRA run keeps no checkpoints (-n, -y 1): write its adapters with --lora-save DIR"),
    ]
    for ok, message in checks:
        if not ok:
            raise InputError(message)
    if args.lora_save or args.lora_load:                   # refused now, not after the training
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise InputError("--lora-save and --lora-load write and read adapter_model.safetensors with the pip "
                             "package safetensors: pip install safetensors (or activate .venv)") from None


def select_targets(spec, targets, default):
    """The targets (LoraTarget list, the family's table) that --lora-targets `spec` names: PEFT's
    rule, a name matches a target it equals or ends after a dot; None: `default` (names);
    ALL_LINEAR: every target. Raises InputError for a name that matches none, listing the names."""
    names = [n.strip() for n in spec.split(",")] if spec is not None else list(default)
    if names == [ALL_LINEAR]:
        return list(targets)
    chosen = []
    for key in names:
        matched = [t for t in targets if t.name == key or t.name.endswith("." + key)]
        if not key or not matched:
            raise InputError(f"--lora-targets: '{key}' names no layer of this model; its linear layers are "
                             f"{', '.join(t.name for t in targets)} (or {ALL_LINEAR})")
        chosen += [t for t in matched if t not in chosen]
    return [t for t in targets if t in chosen]                 # in the table's (the model's) order


# ----------------------------------------------------------------------------
# PEFT's files: adapter_config.json and adapter_model.safetensors

def lora_tensor_names(target):
    """Our names of a target's two parameter tensors: lora_A (L,r,C) and lora_B (L,OC,r)."""
    return f"{target.name}.lora_A", f"{target.name}.lora_B"


def peft_tensors(P, targets, num_layers, layer_prefix):
    """Our adapters P ({our name: (L,...) array}, lora_tensor_names) -> {PEFT name: contiguous fp32
    array}, lora_B of a RoPE projection in Hugging Face's row order. layer_prefix: the Hugging
    Face model's name of layer l, with {l} (e.g. "transformer.h.{l}.")."""
    tensors = {}
    for t in targets:
        a_name, b_name = lora_tensor_names(t)
        for l in range(num_layers):
            b = P[b_name][l]
            if t.rope_head_size:
                b = rope_rows_to_hf(b, t.rope_head_size)
            key = PEFT_PREFIX + layer_prefix.format(l=l) + t.name
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(P[a_name][l], dtype=np.float32)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(b, dtype=np.float32)
    return tensors


def peft_config(rank, alpha, targets, fan_in_fan_out, base_model):
    """adapter_config.json's dict: plain LoRA (PEFT_PLAIN) of rank r, lora_alpha, the target
    modules' names; fan_in_fan_out for a model whose layers store W transposed (GPT-2's Conv1D)."""
    return {**PEFT_PLAIN, "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": [t.name for t in targets], "fan_in_fan_out": fan_in_fan_out, "lora_dropout": 0.0,
            "init_lora_weights": PEFT_INIT, "base_model_name_or_path": base_model, "inference_mode": True}


def write_adapters(out_dir, config, tensors):
    """Write adapter_config.json (config) and adapter_model.safetensors (tensors, {PEFT name:
    fp32 array}) into out_dir (created if needed), each atomically. Raises OSError if they cannot
    be written."""
    from safetensors.numpy import save
    os.makedirs(out_dir, exist_ok=True)
    weights = save(tensors, metadata={"format": "pt"})       # PEFT reads it with torch: {"format": "pt"}
    text = (json.dumps(config, indent=2) + "\n").encode()
    for name, payload in ((PEFT_WEIGHTS, weights), (PEFT_CONFIG, text)):
        atomic_write(os.path.join(out_dir, name), lambda f: f.write(payload))


def read_adapters(in_dir):
    """(config dict, {PEFT name: fp32 array}) from a PEFT adapter directory. Raises InputError for
    a missing or unreadable file or a configuration other than plain LoRA (PEFT_PLAIN)."""
    config_path, weights_path = os.path.join(in_dir, PEFT_CONFIG), os.path.join(in_dir, PEFT_WEIGHTS)
    for path in (config_path, weights_path):
        if not os.path.isfile(path):
            raise InputError(f"--lora-load {in_dir}: no {os.path.basename(path)} there (a PEFT adapter directory "
                             f"holds {PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{config_path}: not a readable JSON file ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{config_path}: not a PEFT adapter configuration")
    unplain = [f"{key}={config[key]!r}" for key, plain in PEFT_PLAIN.items() if key in config and config[key] != plain]
    if unplain:
        raise InputError(f"{config_path}: {', '.join(unplain)}: only plain LoRA adapters are supported")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(rank, int) and rank > 0 and isinstance(alpha, (int, float)) and alpha > 0):
        raise InputError(f"{config_path}: r={rank!r}, lora_alpha={alpha!r}: need a positive rank and alpha")
    return config, load_safetensors(weights_path)


def load_safetensors(path):
    """{name: fp32 array} of a safetensors file; bf16 (which NumPy lacks) through torch. Raises InputError."""
    from safetensors import safe_open
    try:
        with safe_open(path, framework="numpy") as f:
            return {name: f.get_tensor(name).astype(np.float32) for name in f.keys()}
    except (TypeError, ValueError):                        # bf16: no NumPy dtype, so through torch
        pass
    except Exception as e:                                 # safetensors' own error for a damaged file
        raise InputError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise InputError(f"{path}: holds bfloat16 tensors, which need torch to read (pip install torch)") from None
    return {name: t.float().numpy() for name, t in load_file(path).items()}


def adapters_from_peft(config, tensors, targets, num_layers, layer_prefix, where):
    """PEFT's tensors -> (rank, alpha, the targets they adapt (in the table's order), {our name:
    (L,...) fp32 array}): every name must be one of ours (layer_prefix, a module of `targets`),
    every adapted module present in all num_layers layers with the shapes of `rank`. lora_B of a
    RoPE projection back to our row order. Raises InputError naming what does not fit."""
    rank, alpha = config["r"], config["lora_alpha"]
    by_name = {t.name: t for t in targets}
    found = {}                                             # (module, l, "A"|"B") -> array
    for key, value in tensors.items():
        match = PEFT_KEY.match(key)
        if not match or match["layer"] + "{l}." != layer_prefix or match["module"] not in by_name:
            raise InputError(f"{where}: tensor {key} is not a LoRA adapter of a linear layer of this model "
                             f"(expected {PEFT_PREFIX}{layer_prefix.format(l='<l>')}<one of "
                             f"{', '.join(by_name)}>.lora_A/B.weight)")
        found[match["module"], int(match["l"]), match["ab"]] = value
    chosen = [t for t in targets if any(key[0] == t.name for key in found)]
    if not chosen:
        raise InputError(f"{where}: no LoRA adapter tensors in it")
    P = {}
    for t in chosen:
        a_name, b_name = lora_tensor_names(t)
        P[a_name] = np.zeros((num_layers, rank, t.in_features), np.float32)
        P[b_name] = np.zeros((num_layers, t.out_features, rank), np.float32)
        for l in range(num_layers):
            for ab, name, shape in (("A", a_name, (rank, t.in_features)), ("B", b_name, (t.out_features, rank))):
                value = found.get((t.name, l, ab))
                if value is None or value.shape != shape:
                    got = "missing" if value is None else f"of shape {value.shape}"
                    raise InputError(f"{where}: {t.name}.lora_{ab} of layer {l} is {got}; this model with r={rank} "
                                     f"needs {shape} in every one of its {num_layers} layers")
                if ab == "B" and t.rope_head_size:
                    value = rope_rows_from_hf(value, t.rope_head_size)
                P[name][l] = value
    return rank, alpha, chosen, P


def save(out_dir, lora, num_layers, family, base_model):
    """--lora-save: the adapters `lora` (rank, alpha, targets, P: gpt2_cpu.LoRA's fields, fp32 on
    the host) of a model of num_layers layers of `family`, as PEFT's two files in out_dir; base_model
    (the -e it adapts) goes into adapter_config.json. Raises OSError if they cannot be written."""
    write_adapters(out_dir, peft_config(lora.rank, lora.alpha, lora.targets, family.fan_in_fan_out, base_model),
                   peft_tensors(lora.P, lora.targets, num_layers, family.layer_prefix))


def load(in_dir, config, family):
    """--lora-load: (rank, alpha, targets, {our name: (L,...) fp32 array}) of the PEFT adapter
    directory in_dir, for a model of `config` of `family`. Raises InputError (safetensors missing
    included)."""
    adapter_config, tensors = read_adapters(in_dir)
    return adapters_from_peft(adapter_config, tensors, family.targets_of(config), config.num_layers,
                              family.layer_prefix, os.path.join(in_dir, PEFT_WEIGHTS))
