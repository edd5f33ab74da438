"""
dev/data/tinystories.py: TinyStories -> GPT-2 token shards.

TinyStories (Eldan & Li 2023, https://arxiv.org/abs/2305.07759) is about 2.1M short stories
written by GPT-3.5/GPT-4 in the vocabulary of a small child: a dataset on which even a few-million
parameter model learns to write fluent English, so it is a good second dataset after Shakespeare.
This script downloads the train split of roneneldan/TinyStories with Hugging Face `datasets`,
then dev/data/sharding.py tokenizes it with the GPT-2 BPE in worker processes and writes shards of
--shard-size tokens (about 470M tokens in all), the first one the val split:

    data/tinystories/tinystories_val_000000.bin, tinystories_train_000001.bin, ...

What it is not: llm.c's tinystories.py, which reads the original tarball and takes val from its
first JSON file; here val is simply the first shard, as for FineWeb. It needs
`pip install datasets` and the network; offline it prints one line
("error: cannot load dataset ...") and exits 1.

Run it (tens of minutes on a few cores):
    python dev/data/tinystories.py
then train with -i "data/tinystories/tinystories_train_*.bin" -j "data/tinystories/tinystories_val_*.bin".
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.paths import DEFAULT_DATA_DIR  # noqa: E402
from llmc.utils import require  # noqa: E402
from sharding import shard_flags, shard_hf_dataset  # noqa: E402

TINYSTORIES_DATASET = "roneneldan/TinyStories"
TINYSTORIES_SHARD_SIZE = 10**7      # tokens per shard: ~47 shards for the ~470M-token train split
TINYSTORIES_DIR = os.path.join(DEFAULT_DATA_DIR, "tinystories")


def parse_args(argv=None):
    p = ArgumentParser(description="Download TinyStories and write GPT-2 token shards.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return shard_flags(p, TINYSTORIES_SHARD_SIZE, "where the shards go", TINYSTORIES_DIR).parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/data/tinystories.py", "tiktoken")
    return shard_hf_dataset(TINYSTORIES_DATASET, None, args.output_dir, "tinystories", args)


if __name__ == "__main__":
    sys.exit(main())
