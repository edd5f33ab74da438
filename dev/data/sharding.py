"""
dev/data/sharding.py: documents -> GPT-2 tokens -> fixed-size token shards (llm.c's layout).

The shared back half of dev/data/fineweb.py and dev/data/tinystories.py. write_shards takes any
iterable of document strings, tokenizes them in a pool of worker processes (Pool.imap, which
keeps the documents' order), puts the end-of-text token 50256 in front of each document, and
cuts the token stream into shards of exactly `shard_size` tokens (the last one shorter):

    <name>_val_000000.bin     the first shard_size tokens: the validation split
    <name>_train_000001.bin   the next shard_size tokens, and so on
    <name>_train_00000N.bin   whatever is left

A document that does not fit in the current shard is split: its tail opens the next shard, as
in llm.c's fineweb.py. Shards are written with gpt2_cpu.write_shard (format in
doc/file_formats.md).

What it is not: a downloader. The two scripts fetch their dataset with Hugging Face `datasets`
(load_hf_texts below, imported only when called) and hand the texts here; tests hand it small
local documents and a byte-level encoder instead, through the same code path.

Check it:
    python -m pytest tests/test_sharding.py -q
"""

import os
import socket
import sys
import time
import urllib.parse
from multiprocessing import Pool

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from llmc.formats import read_shard, write_shard  # noqa: E402
from llmc.tokenizer import GPT2_EOT, gpt2_encoding  # noqa: E402
from llmc.utils import InputError, check_reachable  # noqa: E402

TOKEN_LIMIT = 2**16                 # shards store uint16 tokens
DEFAULT_CHUNKSIZE = 16              # documents per imap task: amortizes the inter-process pickling
COUNTER_EVERY_S = 2.0               # the fallback progress counter prints at most this often


# ----------------------------------------------------------------------------
# tokenizing, inside the worker processes

_gpt2 = None                        # per-process cache of the tiktoken encoding
_worker_encode = None               # set in each worker by init_worker
_worker_eot = None


def gpt2_encode(text):
    """Default encoder: GPT-2 BPE of `text` (no special tokens), loaded once per process."""
    global _gpt2
    if _gpt2 is None:
        _gpt2 = gpt2_encoding()
    return _gpt2.encode_ordinary(text)


def init_worker(encode, eot):
    global _worker_encode, _worker_eot
    _worker_encode, _worker_eot = encode, eot


def tokenize_document(text):
    """One document -> uint16 array [eot, tokens...]. Runs in a worker. Raises ValueError if a
    token id does not fit in uint16."""
    encoded = np.asarray(_worker_encode(text), dtype=np.int64)
    tokens = np.concatenate([np.array([_worker_eot], dtype=np.int64), encoded])
    if tokens.min() < 0 or tokens.max() >= TOKEN_LIMIT:
        raise ValueError(f"token id {tokens.max()} does not fit in a uint16 shard")
    return tokens.astype(np.uint16)


# ----------------------------------------------------------------------------
# progress: tqdm when installed, a printed counter otherwise

class Progress:
    """Documents and tokens done so far, shown on stderr."""

    def __init__(self, total_docs=None, enabled=True):
        self.docs = self.tokens = 0
        self.enabled = enabled
        self.bar = None
        self.last_print = 0.0
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total_docs, unit="docs", file=sys.stderr)
            except ImportError:
                pass

    def update(self, num_tokens):
        self.docs += 1
        self.tokens += num_tokens
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        elif time.monotonic() - self.last_print > COUNTER_EVERY_S:
            self.last_print = time.monotonic()
            print(f"\r{self.docs:,} documents, {self.tokens:,} tokens", end="", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(f"\r{self.docs:,} documents, {self.tokens:,} tokens", file=sys.stderr)


# ----------------------------------------------------------------------------
# sharding, in the main process

def shard_path(output_dir, name, index):
    """Shard 0 is the validation split, the rest train: <name>_<split>_<index:06d>.bin."""
    split = "val" if index == 0 else "train"
    return os.path.join(output_dir, f"{name}_{split}_{index:06d}.bin")


def write_shards(documents, output_dir, name, shard_size, encode=gpt2_encode, eot=GPT2_EOT,
                 num_workers=None, chunksize=DEFAULT_CHUNKSIZE, total_docs=None, progress=True):
    """Tokenize `documents` (an iterable of str) and write them as shards of `shard_size` tokens.
    encode: a picklable top-level function text -> sequence of token ids (no EOT: it is added
    here, in front of each document). num_workers: worker processes (default: half the cores).
    Returns the list of shard paths written, val first. Raises ValueError on a bad shard_size
    or a token id >= 65536; InputError if there are no documents."""
    if shard_size <= 0:
        raise ValueError(f"shard_size must be positive, not {shard_size}")
    if num_workers is None:
        num_workers = max(1, (os.cpu_count() or 2) // 2)
    encode("")                  # fail fast here, not in a worker; with fork the workers inherit its caches
    os.makedirs(output_dir, exist_ok=True)
    shard = np.empty(shard_size, dtype=np.uint16)   # the shard being filled
    filled = 0
    paths = []
    bar = Progress(total_docs, progress)
    with Pool(num_workers, initializer=init_worker, initargs=(encode, eot)) as pool:
        for tokens in pool.imap(tokenize_document, documents, chunksize=chunksize):
            bar.update(tokens.size)
            while tokens.size:                        # a long document may span several shards
                take = min(shard_size - filled, tokens.size)
                shard[filled:filled + take] = tokens[:take]
                filled += take
                tokens = tokens[take:]
                if filled == shard_size:
                    paths.append(shard_path(output_dir, name, len(paths)))
                    write_shard(paths[-1], shard)
                    filled = 0
    bar.close()
    if filled:
        paths.append(shard_path(output_dir, name, len(paths)))
        write_shard(paths[-1], shard[:filled])
    if not paths:
        raise InputError("no documents to shard")
    return paths


# ----------------------------------------------------------------------------
# the download half, shared by fineweb.py and tinystories.py

def load_hf_texts(path, name=None, split="train", column="text"):
    """(iterator over the `column` strings of a Hugging Face dataset split, its length).
    Imports `datasets` here, so that nothing else needs it. Raises InputError, one line, when
    the package is missing or the hub cannot be reached."""
    try:
        import datasets
        import huggingface_hub.constants
        import huggingface_hub.utils.logging
    except ImportError:
        raise InputError("the Hugging Face `datasets` package is not installed: pip install datasets")
    # offline, the hub client retries for ~20 s and logs every retry: ask the host once instead
    datasets.logging.set_verbosity_error()
    huggingface_hub.utils.logging.set_verbosity_error()
    if not huggingface_hub.constants.HF_HUB_OFFLINE:
        check_reachable(huggingface_hub.constants.ENDPOINT, "the dataset download needs the network")
    try:
        ds = datasets.load_dataset(path, name=name, split=split)
    except Exception as e:                  # offline, unknown dataset, ...: datasets raises many kinds
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        raise InputError(f"cannot load dataset {path}{'/' + name if name else ''} ({type(e).__name__}: {first_line}): offline?")
    if column not in ds.column_names:
        raise InputError(f"dataset {path} has no column '{column}' (has {', '.join(ds.column_names)})")
    return (row[column] for row in ds), len(ds)


def report(paths):
    """Print one line per shard, and a warning when there is no train shard."""
    for path in paths:
        print(f"{path}: {read_shard(path).size:,} tokens")
    if len(paths) == 1:
        print("warning: everything fit in the val shard; lower --shard-size to get train shards", file=sys.stderr)


def shard_flags(parser, shard_size, output_help, output_default=None):
    """The flags every Hugging Face dataset script takes: -s tokens per shard, -o output
    directory, -w tokenizer processes, --chunksize."""
    p = parser.add_argument
    p("-s", "--shard-size", type=int, default=shard_size, help="tokens per shard")
    p("-o", "--output-dir", default=output_default, help=output_help)
    p("-w", "--workers", type=int, default=None, help="tokenizer processes; None: half the cores")
    p("--chunksize", type=int, default=DEFAULT_CHUNKSIZE, help="documents per worker task")
    return parser


def shard_hf_dataset(dataset, subset, output_dir, name, args):
    """Download a Hugging Face dataset's train split and write it as GPT-2 token shards named
    `name` in output_dir, with shard_flags' settings. Returns the exit code: 0, or 1 with one
    `error:` line on stderr."""
    try:
        texts, num_docs = load_hf_texts(dataset, subset, split="train")
        paths = write_shards(texts, output_dir, name, args.shard_size, num_workers=args.workers,
                             chunksize=args.chunksize, total_docs=num_docs)
    except (InputError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report(paths)
    return 0
