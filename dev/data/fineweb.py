"""
dev/data/fineweb.py: FineWeb (or FineWeb-Edu) 10B-token sample -> GPT-2 token shards.

FineWeb (Penedo et al. 2024, https://arxiv.org/abs/2406.17557) is filtered, deduplicated
CommonCrawl text; its "sample-10BT" subset holds about 10B GPT-2 tokens, the budget llm.c
trains GPT-2 124M on. FineWeb-Edu is the same crawl kept only where a classifier judged the
page educational. This script downloads the subset with Hugging Face `datasets` (about 28 GB
of parquet in the Hugging Face cache), then dev/data/sharding.py tokenizes it with the GPT-2 BPE
in worker processes and writes shards of --shard-size tokens, the first one the val split:

    data/fineweb10B/fineweb_val_000000.bin, fineweb_train_000001.bin, ...   (about 100 shards)
    data/edu_fineweb10B/edu_fineweb_val_000000.bin, ...                      (with --edu)

What it is not: a streaming or resumable downloader; the `datasets` cache is what makes a
second run cheap. It needs `pip install datasets` and the network; offline it prints one line
("error: cannot load dataset ...") and exits 1.

Run it (hours on many cores):
    python dev/data/fineweb.py            # or: python dev/data/fineweb.py --edu
then train with -i "data/fineweb10B/fineweb_train_*.bin" -j "data/fineweb10B/fineweb_val_*.bin".
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

FINEWEB_SHARD_SIZE = 10**8          # tokens per shard, as in llm.c (200 MB of uint16)
DATASETS = {   # flag -> (Hugging Face dataset, subset, output directory, shard name)
    False: ("HuggingFaceFW/fineweb", "sample-10BT", "fineweb10B", "fineweb"),
    True: ("HuggingFaceFW/fineweb-edu", "sample-10BT", "edu_fineweb10B", "edu_fineweb"),
}


def parse_args(argv=None):
    p = ArgumentParser(description="Download FineWeb 10B (or FineWeb-Edu) and write GPT-2 token shards.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--edu", action="store_true", help="FineWeb-Edu instead of FineWeb")
    shard_flags(p, FINEWEB_SHARD_SIZE, "where the shards go; None: data/fineweb10B, or data/edu_fineweb10B with --edu")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require("dev/data/fineweb.py", "tiktoken")
    dataset, subset, dirname, name = DATASETS[args.edu]
    return shard_hf_dataset(dataset, subset, args.output_dir or os.path.join(DEFAULT_DATA_DIR, dirname), name, args)


if __name__ == "__main__":
    sys.exit(main())
