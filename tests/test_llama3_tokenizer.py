"""
tests/test_llama3_tokenizer.py: Meta's Llama 3 tokenizer (llmc/tokenizer.py), the Llama 3 shards
of dev/data/tinyshakespeare.py --tokenizer-model, and llama3_cpu.py training and sampling on them.

No real tokenizer.model can be fetched here, so the tests write a small one in its format (one
"base64(token) rank" line per rank): the 256 single bytes, then the prefixes of a few words and
numbers, a few hundred ranks in all. The checks, each against an independent reference:
- the reader agrees with tiktoken's own loader (tiktoken.load.load_tiktoken_bpe);
- the special tokens sit where Meta's tokenizer.py puts them: <|begin_of_text|> right after the
  N ranks (128000 with Meta's 128,000), <|end_of_text|> next, 256 of them;
- the split is Llama 3's (digits in groups of at most 3: "12345" is never one token even where
  the BPE holds it, as GPT-2's pattern would make it), and encode -> decode is the identity;
- malformed or missing files: one-line InputError / "error:" line and exit status 1;
- the shards: version 7 header (magic 20240801, uint32), one <|begin_of_text|> per section, the
  sections decoding back through llama3_tokenizer.bin; a second run writes nothing;
- llama3_cpu.py: a descriptor model takes the tokenizer's V, trains, samples and encodes --prompt.

Run: python -m pytest tests/test_llama3_tokenizer.py -q   (about 30 s)
"""

import base64
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from llmc import formats  # noqa: E402
from llmc.tokenizer import (LLAMA3_BOS, LLAMA3_EOS, LLAMA3_NUM_SPECIAL_TOKENS, LLAMA3_SPECIAL_TOKENS,  # noqa: E402
                            LLAMA3_VOCAB_SIZE, Tokenizer, prompt_encoding, read_llama3_encoding,
                            read_tiktoken_ranks)
from llmc.utils import InputError  # noqa: E402

SCRIPT = os.path.join(ROOT, "dev", "data", "tinyshakespeare.py")
TRAINER = os.path.join(ROOT, "llama3_cpu.py")
TIMEOUT_S = 300
WORDS = ["hello", " the", " and", " to", " of", " that", " is", "ROMEO", "JULIET", ":\n", " thou", " thee",
         " love", " night", " day", " brave", " world", " o'er", "12345", " speak", " me", " we", " any"]
TEXTS = ["hello world, ROMEO:\nO brave new world!\n\n",
         "JULIET: thou art 12345 times 3.14159 o'er the night's day; can't, we'll, I'VE.",
         "Ophélie, naïve café, 日本語, Русский, emoji 😀 and tabs\tand\r\nCRLF  ",
         "<|begin_of_text|> as plain text, and <|end_of_text|> too"]


def synthetic_ranks():
    """A small BPE in rank order: the 256 single bytes, then every prefix (2 bytes and longer) of
    WORDS, in order of first appearance (each merge builds on a token already there)."""
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    for word in WORDS:
        raw = word.encode("utf-8")
        for end in range(2, len(raw) + 1):
            if raw[:end] not in seen:
                seen.add(raw[:end])
                tokens.append(raw[:end])
    return tokens


def write_tokenizer_model(path, tokens):
    """Write tokens (index = rank) in Meta's tokenizer.model format."""
    with open(path, "wb") as f:
        for rank, token in enumerate(tokens):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3tok") / "tokenizer.model"
    write_tokenizer_model(path, synthetic_ranks())
    return str(path)


# ----------------------------------------------------------------------------
# the tokenizer

def test_reader_agrees_with_tiktoken(model_path):
    from tiktoken.load import load_tiktoken_bpe
    ranks = read_tiktoken_ranks(model_path)
    assert {token: rank for rank, token in enumerate(ranks)} == load_tiktoken_bpe(model_path)
    assert len(ranks) == len(synthetic_ranks()) > 256


def test_special_tokens_follow_the_ranks(model_path):
    enc, token_bytes = read_llama3_encoding(model_path)
    N = len(synthetic_ranks())
    assert LLAMA3_VOCAB_SIZE == 128256 and LLAMA3_NUM_SPECIAL_TOKENS == 256   # Meta's: 128,000 + 256
    assert enc.n_vocab == len(token_bytes) == N + 256
    assert enc.encode(LLAMA3_BOS, allowed_special="all") == [N]
    assert enc.encode(LLAMA3_EOS, allowed_special="all") == [N + 1]
    assert enc.encode("<|eot_id|>", allowed_special="all") == [N + 9]           # Meta's 128009
    assert enc.encode("<|reserved_special_token_246|>", allowed_special="all") == [N + 255]
    assert len(set(LLAMA3_SPECIAL_TOKENS)) == 256
    assert token_bytes[N] == b"<|begin_of_text|>" and token_bytes[:N] == synthetic_ranks()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(model_path, text):
    enc, token_bytes = read_llama3_encoding(model_path)
    ids = enc.encode_ordinary(text)
    assert b"".join(token_bytes[i] for i in ids) == text.encode("utf-8")
    assert enc.decode(ids) == text


def test_split_is_llama3s(model_path):
    enc, token_bytes = read_llama3_encoding(model_path)
    ranks = synthetic_ranks()
    assert enc.encode_ordinary("hello") == [ranks.index(b"hello")]              # the BPE merges a whole word
    assert b"12345" in ranks
    assert [token_bytes[i] for i in enc.encode_ordinary("12345")] == [b"123", b"4", b"5"]   # \p{N}{1,3}; "45" is no token
    assert [token_bytes[i] for i in enc.encode_ordinary(" the")] == [b" the"]


@pytest.mark.parametrize("content, message", [
    (b"aGVsbG8= 0 extra\n", "line 1 is not"),
    (b"not*base64 0\n", "line 1 is not"),
    (b"aGVsbG8= zero\n", "line 1 is not"),
    (b"aGk= 0\naGk= 1\n", "a token appears under two ranks"),
    (b"aGk= 0\naGVsbG8= 2\n", "not 0..N-1"),
    (b"aGk= 0\n", "single bytes have no rank"),
    (b"", "not 0..N-1"),
])
def test_malformed_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as e:
        read_tiktoken_ranks(str(path))
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="no such tokenizer.model"):
        read_tiktoken_ranks(str(tmp_path / "missing.model"))


# ----------------------------------------------------------------------------
# the shards

SECTIONS = [f"ROMEO {i}:\nhello the world, o'er {i} night and day,\nthou speak to me! Ophélie, 日本."
            for i in range(1500)]


@pytest.fixture(scope="module")
def llama3_data(model_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama3data")
    source = tmp / "input.txt"
    source.write_text("\n\n".join(SECTIONS), encoding="utf-8")
    data_dir = tmp / "data"
    args = ["--data-dir", str(data_dir), "--url", source.as_uri(), "--tokenizer-model", model_path]
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    return data_dir, args, result.stdout


def test_shards_are_version_7_with_bos_per_section(llama3_data):
    data_dir, _, stdout = llama3_data
    N = len(synthetic_ranks())
    shards = [str(data_dir / "tinyshakespeare_llama3" / f"tiny_shakespeare_{s}.bin") for s in ("val", "train")]
    for path in shards:
        header = np.fromfile(path, dtype="<i4", count=256)
        assert (header[0], header[1]) == (20240801, 7)
        assert os.path.getsize(path) == 1024 + 4 * header[2]          # uint32 tokens
    tokens = np.concatenate([formats.read_shard(p) for p in shards])
    assert tokens.dtype == np.uint32 and tokens[0] == N and tokens.max() < N + 256
    assert formats.read_shard(shards[0]).size == 32768
    starts = np.flatnonzero(tokens == N)
    assert len(starts) == len(SECTIONS)
    tokenizer = Tokenizer(str(data_dir / "llama3_tokenizer.bin"))
    assert tokenizer.eot_token == N and len(tokenizer.token_bytes) == N + 256
    chunks = np.split(tokens, starts[1:])
    decoded = [tokenizer.decode(chunk[1:].tolist()) for chunk in chunks]
    assert decoded == [s + "\n\n" for s in SECTIONS[:-1]] + [SECTIONS[-1]]
    assert "llama3_tokenizer.bin" in stdout and "(132,096 bytes)" in stdout   # llm.c's val size: 1024 + 4 x 32,768


def test_rerun_is_up_to_date_and_another_model_rebuilds(llama3_data, tmp_path):
    data_dir, args, _ = llama3_data
    again = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0 and "is up to date" in again.stdout and "writing" not in again.stdout
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    other = tmp_path / "other.model"
    write_tokenizer_model(other, synthetic_ranks()[:300])
    args = ["--data-dir", str(copy)] + args[2:-1] + [str(other)]
    result = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert "is not the tokenizer --tokenizer-model gives" in result.stdout
    assert Tokenizer(str(copy / "llama3_tokenizer.bin")).eot_token == 300


@pytest.mark.parametrize("content", [None, b"garbage\n"])
def test_script_refuses_a_bad_tokenizer_model_in_one_line(tmp_path, content):
    path = tmp_path / "tokenizer.model"
    if content is not None:
        path.write_bytes(content)
    result = subprocess.run([sys.executable, SCRIPT, "--data-dir", str(tmp_path / "data"),
                             "--tokenizer-model", str(path)], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(path) in lines[0]
    assert not (tmp_path / "data").exists()


# ----------------------------------------------------------------------------
# llama3_cpu.py on the Llama 3 shards

def run_trainer(args):
    return subprocess.run([sys.executable, TRAINER, *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                          cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_llama3_cpu_trains_and_samples_with_the_llama3_tokenizer(llama3_data, tmp_path):
    data_dir, _, _ = llama3_data
    N = len(synthetic_ranks())
    d = data_dir / "tinyshakespeare_llama3"
    tok = str(data_dir / "llama3_tokenizer.bin")
    out = run_trainer(["-e", "llama3:d2", "-i", str(d / "tiny_shakespeare_train.bin"),
                       "-j", str(d / "tiny_shakespeare_val.bin"), "-b", "4", "-t", "32", "-x", "20",
                       "-l", "3e-3", "-v", "20", "-m", "2", "-s", "20", "-g", "12", "-n", "20", "--tokenizer", tok,
                       "-o", str(tmp_path)])
    assert out.returncode == 0, out.stderr
    vals = [float(v) for v in re.findall(r"val loss ([0-9.]+)", out.stdout)]
    assert abs(vals[0] - np.log(N + 256)) < 0.5, "a fresh model is near ln(V), V the tokenizer's"
    assert vals[-1] < vals[0] - 1.0, vals
    assert "generating:" in out.stdout
    model = str(tmp_path / "model_00000020.bin")
    gen = run_trainer(["-e", model, "--tokenizer", tok, "--generate", "8", "--prompt", "hello the"])
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("hello the")


def test_prompt_encoding_follows_the_tokenizer_file(llama3_data):
    data_dir, _, _ = llama3_data
    tokenizer = Tokenizer(str(data_dir / "llama3_tokenizer.bin"))
    enc = prompt_encoding(tokenizer)
    ranks = synthetic_ranks()
    assert enc.encode("hello <|begin_of_text|>", allowed_special="all") == [ranks.index(b"hello"), ranks.index(b" "),
                                                                          len(ranks)]
