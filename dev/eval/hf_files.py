"""
dev/eval/hf_files.py: a Hugging Face model directory as files, whatever the model in it: its
names (config.json, model.safetensors or pytorch_model.bin), fetching one from the hub, reading
its config.json and its tensors. The four converters share it: export_hf.py and
export_hf_llama3.py write these files, import_hf.py and import_hf_llama3.py read them (import_hf.py
hands a config.json of model_type "llama" to import_hf_llama3.py, is_llama).

What it is not: a mapping of tensors to ours (each converter has its own), or a loader of
tokenizers.

    python -c "import sys; sys.path.insert(0, 'dev/eval'); import hf_files; print(hf_files.read_hf_config('hf_dir')[1]['model_type'])"
prints `gpt2` for the directory `python dev/eval/export_hf.py -i model.bin -o hf_dir` wrote.
"""

import json
import os
import socket
import sys
import urllib.parse

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from llmc.utils import InputError, check_input_file, check_reachable  # noqa: E402

HF_CONFIG = "config.json"
HF_WEIGHTS = "model.safetensors"
HF_TORCH_WEIGHTS = "pytorch_model.bin"
LLAMA_MODEL_TYPE = "llama"             # config.json's model_type of a Llama: import_hf_llama3.py imports it
def fetch_from_hub(repo_id):
    """Download config.json + weights of a hub model into the Hugging Face cache; returns the dir."""
    try:
        import huggingface_hub.constants         # optional (comes with transformers): only for a hub id
        import huggingface_hub.utils.logging
    except ImportError:
        raise InputError(f"'{repo_id}' is not a directory, and huggingface_hub (pip install transformers) is not installed to fetch it")
    huggingface_hub.utils.logging.set_verbosity_error()
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        check_reachable(huggingface_hub.constants.ENDPOINT, "pass a local Hugging Face directory instead")
    try:
        return huggingface_hub.snapshot_download(repo_id, allow_patterns=[HF_CONFIG, HF_WEIGHTS])
    except Exception as e:                      # not found, offline mode, HTTP errors, ...
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise InputError(f"cannot fetch '{repo_id}' from the Hugging Face hub ({type(e).__name__}: {first_line})")


def read_hf_config(source):
    """A local HF directory or a hub id -> (its directory, its config.json as read, the config's
    path). Raises InputError for a missing, irregular (a FIFO), non-JSON or non-UTF-8 config.json."""
    hf_dir = source if os.path.isdir(source) else fetch_from_hub(source)
    config_path = os.path.join(hf_dir, HF_CONFIG)
    if not os.path.lexists(config_path):
        raise InputError(f"{hf_dir}: no {HF_CONFIG}")
    check_input_file(config_path, "Hugging Face config")
    try:
        with open(config_path, encoding="utf-8") as f:
            hf = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{config_path}: not JSON ({e.msg})")
    except UnicodeDecodeError:
        raise InputError(f"{config_path}: not UTF-8 text") from None
    return hf_dir, hf, config_path


def is_llama(hf):
    """Whether a config.json is a Llama's (import_hf_llama3.py's to import)."""
    return isinstance(hf, dict) and hf.get("model_type") == LLAMA_MODEL_TYPE


def load_tensors(hf_dir):
    """{name: float32 numpy array} from model.safetensors, else pytorch_model.bin (needs torch).
    bf16 / fp16 tensors are upcast exactly. Raises InputError for a missing, irregular or
    unreadable file."""
    path = os.path.join(hf_dir, HF_WEIGHTS)
    if os.path.lexists(path):
        check_input_file(path, "safetensors file")
        from safetensors import safe_open       # optional (requirements-dev.txt): the tools require() it first
        try:
            with safe_open(path, framework="numpy") as f:
                return {name: f.get_tensor(name).astype(np.float32) for name in f.keys()}
        except (TypeError, ValueError):         # bf16: numpy has no such dtype, so go through torch
            pass
        except Exception as e:                  # safetensors' own error for a corrupt header
            raise InputError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})")
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise InputError(f"{path}: holds bfloat16 tensors, which need torch to read (pip install torch)")
        return {name: t.float().numpy() for name, t in load_file(path).items()}
    path = os.path.join(hf_dir, HF_TORCH_WEIGHTS)
    if os.path.lexists(path):
        check_input_file(path, "PyTorch state dict")
        try:
            import torch                        # optional: only for a pytorch_model.bin
        except ImportError:
            raise InputError(f"{path}: reading {HF_TORCH_WEIGHTS} needs torch (pip install torch)")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise InputError(f"{path}: not a readable PyTorch state dict ({type(e).__name__})")
        return {name: t.float().numpy() for name, t in state.items()}
    raise InputError(f"{hf_dir}: neither {HF_WEIGHTS} nor {HF_TORCH_WEIGHTS} found")
