"""
llmc/tokenizer.py: the GPT-2 tokenizer on the host (llm.c's llmc/tokenizer.h).

Decoding reads llm.c's tokenizer file (gpt2_tokenizer.bin: a header, then one length-prefixed
byte string per token id). Encoding (prompts, datasets) goes through tiktoken's GPT-2 BPE, built
from a local copy of the BPE ranks when there is one, so it also works offline.
"""

import os
import struct

from llmc.formats import make_header, read_header
from llmc.paths import DEFAULT_BPE, DEFAULT_TOKENIZER
from llmc.utils import InputError, atomic_write

TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2                  # version 1 had no EOT slot
TOKENIZER_SLOT_VOCAB_SIZE = 2
TOKENIZER_SLOT_EOT = 3
MAX_TOKEN_BYTES = 255                  # the length prefix is one byte

GPT2_EOT = 50256                       # <|endoftext|>, precedes every document
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


def write_tokenizer(path, token_bytes, eot_token=GPT2_EOT):
    """Write the tokenizer file (version 2): token_bytes is a list of bytes, one per token id.
    Raises ValueError for a token of 0 or more than MAX_TOKEN_BYTES bytes."""
    header = make_header(TOKENIZER_MAGIC, TOKENIZER_VERSION,
                         {TOKENIZER_SLOT_VOCAB_SIZE: len(token_bytes), TOKENIZER_SLOT_EOT: eot_token})

    def write(f):
        f.write(header.tobytes())
        for i, b in enumerate(token_bytes):
            if not 1 <= len(b) <= MAX_TOKEN_BYTES:
                raise ValueError(f"token {i} has {len(b)} bytes; the format allows 1..{MAX_TOKEN_BYTES}")
            f.write(struct.pack("<B", len(b)) + b)
    atomic_write(path, write)


def read_tokenizer(path):
    """Read a tokenizer file -> (token_bytes: list of bytes, eot_token: int). Raises InputError."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such tokenizer file")
    with open(path, "rb") as f:
        h = read_header(f, path, TOKENIZER_MAGIC, (1, TOKENIZER_VERSION), "tokenizer")
        n = int(h[TOKENIZER_SLOT_VOCAB_SIZE])
        eot = int(h[TOKENIZER_SLOT_EOT]) if h[1] == TOKENIZER_VERSION else GPT2_EOT
        data = f.read()
    tokens, pos = [], 0
    for i in range(n):
        if pos >= len(data):
            raise InputError(f"{path}: truncated tokenizer: {i} of {n} tokens present")
        length = data[pos]
        if length == 0 or pos + 1 + length > len(data):
            raise InputError(f"{path}: truncated or corrupt tokenizer at token {i}")
        tokens.append(data[pos + 1:pos + 1 + length])
        pos += 1 + length
    return tokens, eot


class Tokenizer:
    """Decodes token ids with a tokenizer .bin (a byte string per id). Raises InputError."""

    def __init__(self, path=DEFAULT_TOKENIZER):
        self.token_bytes, self.eot_token = read_tokenizer(path)

    def decode_bytes(self, ids):
        """Token ids -> their bytes, concatenated (a character may span tokens)."""
        return b"".join(self.token_bytes[i] for i in ids)

    def decode(self, ids):
        """Token ids -> text (bytes that are not valid UTF-8 become U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def gpt2_encoding(bpe_path=DEFAULT_BPE):
    """tiktoken's GPT-2 encoding. Built from a local copy of the BPE ranks (`data/gpt2.tiktoken`,
    checked against its sha256, which `make data` fetches offline) when there is one, else
    tiktoken's own download/cache. Raises InputError if neither works."""
    import tiktoken
    if os.path.isfile(bpe_path):
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str
        ranks = load_tiktoken_bpe(bpe_path, expected_hash=GPT2_BPE_SHA256)
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": GPT2_EOT})
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:     # offline and no local copy
        raise InputError(f"cannot load the GPT-2 BPE: tiktoken failed ({type(e).__name__}) and {bpe_path} is missing; "
                         "run `make data`")
