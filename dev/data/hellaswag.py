"""
dev/data/hellaswag.py: HellaSwag validation split -> data/hellaswag/hellaswag_val.bin.

HellaSwag (Zellers et al. 2019, https://arxiv.org/abs/1905.07830) asks which of four endings
continues a short context. Each line of the canonical hellaswag_val.jsonl (10,042 lines, from
the rowanz/hellaswag GitHub repository) holds "ctx", "endings" (4 strings) and "label". This
script downloads that file once (kept beside the output), encodes the context and each ending
with the GPT-2 BPE (each ending as " " + ending, because in running text it follows a space,
as llm.c and nanoGPT do), and writes the multiple-choice eval file of
doc/file_formats.md through gpt2_cpu.write_eval_file.

What it is not: the scorer (gpt2_cpu.completion_batches / score_example) or the eval loop.

Run it:
    python dev/data/hellaswag.py
prints
    downloading https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl
    wrote 10042 examples to data/hellaswag/hellaswag_val.bin (longest example ... bytes)
Offline, it stops with one line ("error: cannot download ...") and exit status 1; give it a
local copy of the jsonl with -i then.
"""

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from llmc.interrupt import quiet_ctrl_c_while_importing  # noqa: E402
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback

from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.evalloader import NUM_COMPLETIONS, write_eval_file  # noqa: E402
from llmc.paths import DEFAULT_DATA_DIR  # noqa: E402
from llmc.tokenizer import gpt2_encoding  # noqa: E402
from llmc.utils import InputError, atomic_write, check_input_file, require  # noqa: E402

HELLASWAG_VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_DIR = os.path.join(DEFAULT_DATA_DIR, "hellaswag")
JSONL_NAME = "hellaswag_val.jsonl"     # the download is kept beside the output
DEFAULT_OUTPUT = os.path.join(HELLASWAG_DIR, "hellaswag_val.bin")
DOWNLOAD_TIMEOUT_S = 60


def download(url, path):
    """Fetch `url` into `path` (atomically). Raises InputError when it cannot be reached."""
    print(f"downloading {url}")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            data = response.read()
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise InputError(f"cannot download {url} ({reason}): offline? pass a local copy of the jsonl with -i")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    atomic_write(path, lambda f: f.write(data))


def render_example(record, encode, index):
    """One HellaSwag jsonl record -> an eval-file example dict (gpt2_cpu's layout).
    encode: text -> list of token ids. Endings are encoded as " " + ending. Raises InputError
    when the record lacks ctx / endings / label or has the wrong number of endings."""
    try:
        context, endings, label = record["ctx"], record["endings"], int(record["label"])
    except (KeyError, TypeError, ValueError):
        raise InputError(f"hellaswag line {index + 1}: needs 'ctx', 'endings' and an integer 'label'")
    if not isinstance(context, str):
        raise InputError(f"hellaswag line {index + 1}: 'ctx' must be a string, not {type(context).__name__}")
    if not (isinstance(endings, list) and all(isinstance(ending, str) for ending in endings)):
        raise InputError(f"hellaswag line {index + 1}: 'endings' must be a list of {NUM_COMPLETIONS} strings")
    if len(endings) != NUM_COMPLETIONS or not 0 <= label < NUM_COMPLETIONS:
        raise InputError(f"hellaswag line {index + 1}: {len(endings)} endings with label {label}; expected {NUM_COMPLETIONS}")
    return {"index": index, "label": label, "context": list(encode(context)),
            "completions": [list(encode(" " + ending)) for ending in endings]}


def read_jsonl(path):
    """The records of a jsonl file, in order. Raises InputError on a missing file, a line that
    is not UTF-8 or not JSON; OSError when it cannot be read."""
    check_input_file(path, "HellaSwag jsonl file")
    records = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"{path}: line {lineno}: not UTF-8 text: not a HellaSwag jsonl file") from None
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}: line {lineno}: not JSON ({e.msg})")
    if not records:
        raise InputError(f"{path}: no records")
    return records


def build_eval_file(jsonl_path, output_path, encode):
    """jsonl -> eval file. Returns (number of examples, longest example in bytes)."""
    examples = [render_example(r, encode, i) for i, r in enumerate(read_jsonl(jsonl_path))]
    os.makedirs(os.path.dirname(output_path) or ".", exist_ok=True)
    try:
        longest = write_eval_file(output_path, examples)
    except ValueError as e:
        raise InputError(f"{output_path}: {e}")
    return len(examples), longest


def parse_args(argv=None):
    p = ArgumentParser(description="Download HellaSwag (val) and write the multiple-choice eval .bin.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-i", "--input", default=None,
                   help=f"local hellaswag_val.jsonl; None: {JSONL_NAME} beside the output, downloaded if missing")
    p.add_argument("-o", "--output", default=DEFAULT_OUTPUT, help="eval file to write")
    p.add_argument("--url", default=HELLASWAG_VAL_URL, help="where to download the jsonl from")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/data/hellaswag.py", "tiktoken")
    return run_main(build_command, args)


def build_command(args):
    """Download the jsonl where needed and write the eval file; bad input or a failed write
    raises (run_main makes it one line and exit 1)."""
    jsonl = args.input
    if jsonl is None:
        jsonl = os.path.join(os.path.dirname(os.path.abspath(args.output)), JSONL_NAME)
        if not os.path.isfile(jsonl):
            download(args.url, jsonl)
    encoding = gpt2_encoding()
    num_examples, longest = build_eval_file(jsonl, args.output, encoding.encode_ordinary)
    print(f"wrote {num_examples} examples to {args.output} (longest example {longest} bytes)")


if __name__ == "__main__":
    sys.exit(main())
