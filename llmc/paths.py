"""
llmc/paths.py: where the default data lives (everything under data/, built by `make data`).
"""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.join(REPO_ROOT, "data")
DEFAULT_TRAIN = os.path.join(DEFAULT_DATA_DIR, "tinyshakespeare", "tiny_shakespeare_train.bin")
DEFAULT_VAL = os.path.join(DEFAULT_DATA_DIR, "tinyshakespeare", "tiny_shakespeare_val.bin")
DEFAULT_TOKENIZER = os.path.join(DEFAULT_DATA_DIR, "gpt2_tokenizer.bin")
DEFAULT_BPE = os.path.join(DEFAULT_DATA_DIR, "gpt2.tiktoken")
DEFAULT_HELLASWAG = os.path.join(DEFAULT_DATA_DIR, "hellaswag", "hellaswag_val.bin")
