"""
tests/test_sharding.py: dev/data/sharding.py, the tokenize-and-shard half of fineweb.py and
tinystories.py, on small local documents.

The documents go through write_shards exactly as the downloaded ones do (worker pool, imap,
shard cutting, gpt2_cpu.write_shard); only the download is left out and the GPT-2 BPE is
replaced by a byte-level encoder (token id = UTF-8 byte, 0..255), so that the expected token
stream can be computed independently here: EOT, bytes of document 0, EOT, bytes of document 1...
The shards are read back byte by byte (header + uint16), not with gpt2_cpu.read_shard.

Run: python -m pytest tests/test_sharding.py -q   (a few seconds)
"""

import os
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "dev", "data"))
sys.path.insert(0, REPO_ROOT)
import sharding  # noqa: E402
from llmc.formats import HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION  # noqa: E402
from llmc.tokenizer import GPT2_EOT  # noqa: E402
from llmc.utils import InputError  # noqa: E402

SHARD_SIZE = 64
DOCUMENTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.",
    "All:\nSpeak, speak.",
    "Ünïcödé döcument — with multi-byte characters: 日本語, emoji 🙂.",
    "x" * 150,                      # longer than two shards: must span three
    "",                             # an empty document is just its EOT
    "Last one.\n",
] + [f"document number {i}: " + "abc " * (i % 7) for i in range(40)]


def byte_encode(text):
    """Stand-in tokenizer: one token per UTF-8 byte. Top level so that it pickles for the pool."""
    return list(text.encode("utf-8"))


def expected_stream(documents):
    """The token stream write_shards should produce, built without it: EOT + bytes per document."""
    out = []
    for doc in documents:
        out.append(GPT2_EOT)
        out.extend(doc.encode("utf-8"))
    return np.array(out, dtype=np.int64)


def read_shard_bytes(path):
    """Parse a shard by hand: check the header fields and the exact file size, return tokens."""
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert header[0] == SHARD_MAGIC and header[1] == SHARD_VERSION
    assert not header[3:].any(), "unused header slots must be 0"
    n = int(header[2])
    assert len(raw) == HEADER_BYTES + 2 * n
    return np.frombuffer(raw[HEADER_BYTES:], dtype="<u2").astype(np.int64)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    paths = sharding.write_shards(iter(DOCUMENTS), str(out), "fixture", SHARD_SIZE, encode=byte_encode,
                                  num_workers=2, chunksize=3, total_docs=len(DOCUMENTS))
    return out, paths


def test_val_first_naming(shards):
    out, paths = shards
    total = expected_stream(DOCUMENTS).size
    num_shards = -(-total // SHARD_SIZE)
    names = [f"fixture_val_{0:06d}.bin"] + [f"fixture_train_{i:06d}.bin" for i in range(1, num_shards)]
    assert [os.path.basename(p) for p in paths] == names
    assert sorted(os.listdir(out)) == sorted(names)            # nothing else left behind (no .tmp)


def test_shard_boundaries_and_counts(shards):
    _, paths = shards
    stream = expected_stream(DOCUMENTS)
    sizes = [read_shard_bytes(p).size for p in paths]
    assert all(s == SHARD_SIZE for s in sizes[:-1])
    assert sizes[-1] == stream.size - SHARD_SIZE * (len(paths) - 1)
    assert 0 < sizes[-1] <= SHARD_SIZE
    assert sum(sizes) == sum(len(d.encode("utf-8")) + 1 for d in DOCUMENTS)
    # each shard holds exactly its slice of the stream: documents are cut, not moved
    for i, p in enumerate(paths):
        np.testing.assert_array_equal(read_shard_bytes(p), stream[i * SHARD_SIZE:(i + 1) * SHARD_SIZE])


def test_eot_placement(shards):
    _, paths = shards
    tokens = np.concatenate([read_shard_bytes(p) for p in paths])
    starts = np.cumsum([0] + [len(d.encode("utf-8")) + 1 for d in DOCUMENTS[:-1]])
    np.testing.assert_array_equal(np.flatnonzero(tokens == GPT2_EOT), starts)
    assert read_shard_bytes(paths[0])[0] == GPT2_EOT


def test_decode_gives_back_documents(shards):
    _, paths = shards
    tokens = np.concatenate([read_shard_bytes(p) for p in paths])
    eots = list(np.flatnonzero(tokens == GPT2_EOT)) + [tokens.size]
    decoded = [bytes(tokens[a + 1:b].astype(np.uint8)).decode("utf-8") for a, b in zip(eots[:-1], eots[1:])]
    assert decoded == DOCUMENTS


def test_single_worker_same_bytes(shards, tmp_path):
    """1 worker and chunksize 1 give byte-identical shards (imap keeps the order)."""
    _, paths = shards
    again = sharding.write_shards(DOCUMENTS, str(tmp_path), "fixture", SHARD_SIZE, encode=byte_encode,
                                  num_workers=1, chunksize=1, progress=False)
    for a, b in zip(paths, again):
        assert open(a, "rb").read() == open(b, "rb").read()
    assert len(again) == len(paths)


def test_exact_multiple_has_no_empty_tail(tmp_path):
    docs = ["a" * 15, "b" * 15]                               # 2 x (15 + EOT) = 32 tokens
    paths = sharding.write_shards(docs, str(tmp_path), "even", 16, encode=byte_encode, num_workers=1, progress=False)
    assert [os.path.basename(p) for p in paths] == ["even_val_000000.bin", "even_train_000001.bin"]
    assert [read_shard_bytes(p).size for p in paths] == [16, 16]


def wide_encode(text):
    return [70000]                                            # does not fit uint16


def test_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        sharding.write_shards(["x"], str(tmp_path), "bad", 16, encode=wide_encode, num_workers=1, progress=False)
    with pytest.raises(ValueError, match="shard_size"):
        sharding.write_shards(["x"], str(tmp_path), "bad", 0, encode=byte_encode, num_workers=1, progress=False)
    with pytest.raises(InputError, match="no documents"):
        sharding.write_shards([], str(tmp_path), "bad", 16, encode=byte_encode, num_workers=1, progress=False)


@pytest.mark.parametrize("script,args", [("fineweb.py", []), ("fineweb.py", ["--edu"]), ("tinystories.py", [])])
def test_download_scripts_fail_in_one_line_offline(script, args, tmp_path):
    """Without `datasets`, or with it but offline (forced here so that a machine with a network
    never starts a 28 GB download), the scripts print one error line and exit 1."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "data", script), "-o", str(tmp_path)] + args,
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert os.listdir(tmp_path) == []
