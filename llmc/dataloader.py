"""
llmc/dataloader.py: batches of training tokens from llm.c's token shards (llm.c's
llmc/dataloader.h DataLoader): strided by rank for data parallelism, optionally shuffled.
"""

import glob

import numpy as np

from llmc.formats import read_shard
from llmc.utils import InputError


class DataLoader:
    """Batches of B sequences of T tokens from a glob of shards, llm.c's scheme:
    a shard holds shard_num_samples global batches of B*T*num_processes tokens; process `rank`
    reads its B*T (+1 for the targets) tokens at offset rank*B*T inside each global batch. After
    the last batch of a shard comes the next shard; after the last shard, the first (an epoch).
    With shuffle, the shard order and the order of batches inside each shard are permuted by a
    seeded RNG (numpy PCG64), reshuffled every epoch / shard.
    Raises InputError if nothing matches, a shard is bad, or a shard is shorter than one batch."""

    def __init__(self, pattern, B, T, process_rank=0, num_processes=1, shuffle=False, seed=42):
        self.pattern, self.B, self.T = pattern, B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise InputError(f"{pattern}: no data file matches (run `make data` for the default dataset)")
        need = B * T * num_processes + 1
        self.num_tokens = 0
        for path in self.files:               # validate every shard up front
            n = read_shard(path).size
            if n < need:
                raise InputError(f"{path}: {n} tokens is shorter than one batch of B*T*processes+1 = {need}")
            self.num_tokens += n
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self):
        """Back to the first batch of the first shard (a new permutation if shuffling)."""
        self.shard_order = self.rng.permutation(len(self.files)) if self.shuffle else np.arange(len(self.files))
        self.current_shard_idx = 0
        self.load_shard(0)

    def load_shard(self, idx):
        """Map shard `idx` of the (possibly shuffled) order and start at its first batch."""
        self.current_shard_idx = idx
        self.tokens = read_shard(self.files[self.shard_order[idx]])
        self.shard_num_samples = (self.tokens.size - 1) // (self.B * self.T * self.num_processes)
        self.sample_order = (self.rng.permutation(self.shard_num_samples) if self.shuffle
                             else np.arange(self.shard_num_samples))
        self.current_sample_idx = 0

    def next_batch(self):
        """Return (inputs, targets), each (B,T) int32; targets are inputs shifted by one token."""
        if self.current_sample_idx >= self.shard_num_samples:
            if self.current_shard_idx == len(self.files) - 1:
                self.reset()
            else:
                self.load_shard(self.current_shard_idx + 1)
        B, T = self.B, self.T
        sample = int(self.sample_order[self.current_sample_idx])
        start = (sample * self.num_processes + self.process_rank) * B * T
        buf = np.asarray(self.tokens[start:start + B * T + 1], dtype=np.int32)
        self.current_sample_idx += 1
        return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)

    def state(self):
        """Position to save: current shard index, current sample index, and the shuffle state."""
        return {"shard": self.current_shard_idx, "sample": self.current_sample_idx,
                "shard_order": self.shard_order.copy(), "sample_order": self.sample_order.copy(),
                "rng": self.rng.bit_generator.state}

    def restore(self, state):
        """Resume at a saved position. Raises InputError if it does not fit these files, or if the
        saved run shuffled and this one does not, or the other way round (a shuffled position
        means nothing in the unshuffled order)."""
        saved_shuffle = "shard_order" in state
        if saved_shuffle != self.shuffle:
            raise InputError(f"the checkpoint was written with --shuffle {int(saved_shuffle)}: resume with the same "
                             f"--shuffle (this run has --shuffle {int(self.shuffle)})")
        if self.shuffle:
            self.shard_order = np.asarray(state["shard_order"])
        if not 0 <= state["shard"] < len(self.files):
            raise InputError(f"saved loader position (shard {state['shard']}) does not fit {len(self.files)} shard(s) of {self.pattern}")
        self.load_shard(state["shard"])
        if self.shuffle:
            self.sample_order = np.asarray(state["sample_order"])
            self.rng.bit_generator.state = state["rng"]
        if not 0 <= state["sample"] <= self.shard_num_samples:
            raise InputError(f"saved loader position (sample {state['sample']}) does not fit shard {self.files[self.shard_order[state['shard']]]}")
        self.current_sample_idx = state["sample"]


