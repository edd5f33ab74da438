"""
llmc/tokenizer.py: the GPT-2 and Llama 3 tokenizers on the host (llm.c's llmc/tokenizer.h).

Decoding reads llm.c's tokenizer file (gpt2_tokenizer.bin, llama3_tokenizer.bin: a header, then
one length-prefixed byte string per token id). Encoding (prompts, datasets) goes through tiktoken:
GPT-2's BPE, built from a local copy of the BPE ranks when there is one, so it also works offline;
or Llama 3's, built from Meta's tokenizer.model (a tiktoken BPE file: one "base64(token) rank" line
per rank, 128,000 of them) plus Llama 3's 256 special tokens, numbered after the last rank
(Meta's llama3 tokenizer.py; llm.c's train_llama3.py).
"""

import base64
import binascii
import os
import struct

from llmc.formats import make_header, read_header
from llmc.paths import DEFAULT_BPE, DEFAULT_TOKENIZER
from llmc.utils import InputError, atomic_write, check_input_file

TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2                  # version 1 had no EOT slot
TOKENIZER_SLOT_VOCAB_SIZE = 2
TOKENIZER_SLOT_EOT = 3
MAX_TOKEN_BYTES = 255                  # the length prefix is one byte

GPT2_EOT = 50256                       # <|endoftext|>, precedes every document
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"

# Llama 3 (Meta's tokenizer.py, as llm.c's train_llama3.py quotes it). The special tokens follow
# the N BPE ranks: id N + i is LLAMA3_SPECIAL_TOKENS[i]; with Meta's N = 128,000 that puts
# <|begin_of_text|> at 128000, <|end_of_text|> at 128001 and V at 128,256.
LLAMA3_NUM_BASE_TOKENS = 128000        # the ranks in Meta's tokenizer.model
LLAMA3_NUM_SPECIAL_TOKENS = 256        # Meta's num_reserved_special_tokens
LLAMA3_VOCAB_SIZE = LLAMA3_NUM_BASE_TOKENS + LLAMA3_NUM_SPECIAL_TOKENS
LLAMA3_BOS = "<|begin_of_text|>"       # precedes every document (llm.c's Llama 3 data scripts)
LLAMA3_EOS = "<|end_of_text|>"
LLAMA3_NAMED_SPECIAL_TOKENS = (LLAMA3_BOS, LLAMA3_EOS, "<|reserved_special_token_0|>",
                               "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                               "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                               "<|python_tag|>")
# the rest are reserved, numbered on from 2: <|reserved_special_token_2|> .. _246|>
LLAMA3_SPECIAL_TOKENS = LLAMA3_NAMED_SPECIAL_TOKENS + tuple(
    f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL_TOKENS - len(LLAMA3_NAMED_SPECIAL_TOKENS)))
# Llama 3's pre-tokenizer split (Meta's pat_str): contractions, letters, up to 3 digits, punctuation, spaces
LLAMA3_PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_VALUES = 256                      # a BPE must hold every single byte, or some text has no encoding


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
    check_input_file(path, "tokenizer file")
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


# ----------------------------------------------------------------------------
# Llama 3: Meta's tokenizer.model -> tiktoken encoding, and the token bytes of llama3_tokenizer.bin

def read_tiktoken_ranks(path):
    """Read a tiktoken BPE file (Meta's tokenizer.model: one line "base64(token) rank" per rank,
    ranks 0..N-1) -> the N token byte strings, index = rank. Raises InputError, one line, for a
    missing file, a malformed line, ranks that are not 0..N-1 once each, a repeated token, or a
    BPE that lacks one of the 256 single bytes."""
    check_input_file(path, "tokenizer.model (Meta's Llama 3 BPE file)")
    with open(path, "rb") as f:
        lines = f.read().splitlines()
    ranks = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise InputError(f"{path}: line {number} is not \"base64-token rank\": not a tiktoken BPE "
                             f"file (Meta's tokenizer.model)") from None
        if rank in ranks or not token:
            raise InputError(f"{path}: line {number}: rank {rank} repeated or its token empty")
        ranks[rank] = token
    if not ranks or sorted(ranks) != list(range(len(ranks))):
        raise InputError(f"{path}: the ranks are not 0..N-1 once each ({len(ranks)} lines)")
    token_bytes = [ranks[i] for i in range(len(ranks))]
    if len(set(token_bytes)) != len(token_bytes):
        raise InputError(f"{path}: a token appears under two ranks")
    missing = set(bytes([b]) for b in range(BYTE_VALUES)) - set(token_bytes)
    if missing:
        raise InputError(f"{path}: {len(missing)} of the {BYTE_VALUES} single bytes have no rank (e.g. "
                         f"{min(missing)!r}): some text could not be encoded")
    return token_bytes


def llama3_token_bytes(base_tokens):
    """The tokenizer file's table: the N BPE tokens (index = rank), then the 256 special tokens'
    names as bytes, ids N..N+255."""
    return list(base_tokens) + [name.encode("ascii") for name in LLAMA3_SPECIAL_TOKENS]


def llama3_encoding(base_tokens, name="llama3"):
    """tiktoken's Encoding of Llama 3 from the N BPE tokens (index = rank): LLAMA3_PAT_STR, the
    special tokens at N..N+255. encode(text) treats "<|begin_of_text|>" in text as plain text
    unless allowed_special says otherwise (tiktoken's default raises: pass disallowed_special=())."""
    import tiktoken
    N = len(base_tokens)
    return tiktoken.Encoding(name=name, pat_str=LLAMA3_PAT_STR,
                             mergeable_ranks={token: rank for rank, token in enumerate(base_tokens)},
                             special_tokens={s: N + i for i, s in enumerate(LLAMA3_SPECIAL_TOKENS)})


def read_llama3_encoding(path):
    """Meta's tokenizer.model (or one in its format) -> (tiktoken Encoding, token bytes of every id
    for the tokenizer file). Raises InputError."""
    base_tokens = read_tiktoken_ranks(path)
    return llama3_encoding(base_tokens, os.path.basename(path)), llama3_token_bytes(base_tokens)


def is_llama3_tokenizer(token_bytes, eot_token):
    """True if a tokenizer file's table is Llama 3's: its first-token slot (eot_token) is
    <|begin_of_text|>, right after the BPE tokens, with the 256 special tokens after it."""
    return (eot_token + LLAMA3_NUM_SPECIAL_TOKENS == len(token_bytes)
            and token_bytes[eot_token] == LLAMA3_BOS.encode("ascii"))


def prompt_encoding(tokenizer):
    """The encoding that matches a Tokenizer (what --prompt is encoded with): Llama 3's, rebuilt
    from the tokenizer file's own table (the BPE tokens are ids 0..N-1, i.e. their ranks), or
    GPT-2's (gpt2_encoding). Raises InputError."""
    if is_llama3_tokenizer(tokenizer.token_bytes, tokenizer.eot_token):
        return llama3_encoding(tokenizer.token_bytes[:tokenizer.eot_token])
    return gpt2_encoding()
