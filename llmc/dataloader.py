"""
llmc/dataloader.py: batches of training tokens from llm.c's token shards (llm.c's
llmc/dataloader.h DataLoader): strided by rank for data parallelism, optionally shuffled. A shard
holds uint16 ids (GPT-2's, version 1) or uint32 ids (Llama 3's, version 7): llmc/formats.py.

Every token id is checked against the model's vocabulary once per shard, when the shard is
opened (vectorized, in chunks), and every read is a copy (pread), checked for length: a shard
that changes while a run reads it is reported in one line, never a crash (a memory map would
die of SIGBUS) and never a silent wrong batch.
"""

import glob
import hashlib
import os

import numpy as np

from llmc.formats import HEADER_BYTES, read_shard_tokens, shard_format, shard_num_tokens
from llmc.utils import InputError, check_input_file

VALIDATE_CHUNK = 1 << 22               # tokens read per piece when checking a shard's ids (8 MiB)
# data_fingerprint reads this many evenly spaced blocks of this many bytes from each shard
FINGERPRINT_BLOCKS, FINGERPRINT_BLOCK_BYTES = 64, 4096


def data_fingerprint(paths):
    """A short hex digest of the shards' content, for a resume's check that the train data is
    the same (llmc/cli.py): sha256 over each shard's size and FINGERPRINT_BLOCKS evenly spaced
    blocks of it (the whole shard when it is smaller), so it costs a few hundred KiB of reads
    per shard however large the data. Other data of the same size differs in the sampled
    blocks; an edit between two of them goes unseen (a fingerprint, not a proof). Raises InputError
    for a path that is not a regular file."""
    digest = hashlib.sha256()
    for path in paths:
        check_input_file(path, "data shard")         # a FIFO would be waited on, not read
        size = os.path.getsize(path)
        digest.update(f"{os.path.basename(path)} {size}\n".encode())
        with open(path, "rb") as f:
            if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK_BYTES:
                digest.update(f.read())
                continue
            for k in range(FINGERPRINT_BLOCKS):
                f.seek(k * (size - FINGERPRINT_BLOCK_BYTES) // (FINGERPRINT_BLOCKS - 1))
                digest.update(f.read(FINGERPRINT_BLOCK_BYTES))
    return digest.hexdigest()[:16]


def shard_paths(pattern):
    """The shards of -i / -j: the file `pattern` names (a name with glob characters, [1] or *,
    that exists is that file), else the files its glob matches, sorted. Raises InputError when
    nothing matches."""
    files = [pattern] if os.path.isfile(pattern) else sorted(glob.glob(pattern))
    if not files:
        raise InputError(f"{pattern}: no data file matches (run `make data` for the default dataset)")
    return files


class DataLoader:
    """Batches of B sequences of T tokens from a glob of shards, llm.c's scheme:
    a shard holds shard_num_samples global batches of B*T*num_processes tokens; process `rank`
    reads its B*T (+1 for the targets) tokens at offset rank*B*T inside each global batch. After
    the last batch of a shard comes the next shard; after the last shard, the first (an epoch).
    With shuffle, the shard order and the order of batches inside each shard are permuted by a
    seeded RNG (numpy PCG64), reshuffled every epoch / shard. vocab_size V: every id of a shard
    must be in [0, V) (None: not checked). num_batches: the batches of all shards together.
    Raises InputError if nothing matches, a shard is bad, a shard is shorter than one batch, a
    token id is outside [0, V), or a shard changes while it is read."""

    def __init__(self, pattern, B, T, process_rank=0, num_processes=1, shuffle=False, seed=42, vocab_size=None):
        self.pattern, self.B, self.T = pattern, B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.vocab_size = vocab_size
        self.files = shard_paths(pattern)
        need = B * T * num_processes + 1
        self.num_tokens, self.num_batches = 0, 0
        for path in self.files:               # every shard's header and size up front
            n = shard_num_tokens(path)
            if n < need:
                raise InputError(f"{path}: {n} tokens is shorter than one batch of B*T*processes+1 = {need}")
            self.num_tokens += n
            self.num_batches += (n - 1) // (B * T * num_processes)
        self.file, self.validated = None, {}
        self.token_dtypes = {}                 # path -> uint16 or uint32 (llmc.formats.shard_format)
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self):
        """Back to the first batch of the first shard (a new permutation if shuffling)."""
        self.shard_order = self.rng.permutation(len(self.files)) if self.shuffle else np.arange(len(self.files))
        self.current_shard_idx = 0
        self.load_shard(0)

    def load_shard(self, idx):
        """Open shard `idx` of the (possibly shuffled) order, check it (check_shard), and start at
        its first batch."""
        self.current_shard_idx = idx
        path = self.files[self.shard_order[idx]]
        if self.file is not None:
            self.file.close()
        self.path, self.file = path, open(path, "rb")
        self.num_shard_tokens = self.check_shard()
        self.shard_num_samples = (self.num_shard_tokens - 1) // (self.B * self.T * self.num_processes)
        self.sample_order = (self.rng.permutation(self.shard_num_samples) if self.shuffle
                             else np.arange(self.shard_num_samples))
        self.current_sample_idx = 0

    def file_identity(self):
        """(inode, size, modification time) of the open shard: any change means it was rewritten."""
        st = os.fstat(self.file.fileno())
        return st.st_ino, st.st_size, st.st_mtime_ns

    def check_shard(self):
        """Check the open shard (header, size, and every id in [0, vocab_size)) unless this very
        file, unchanged, was checked before. Returns its number of tokens. Raises InputError."""
        identity = self.file_identity()
        if self.validated.get(self.path) == identity:
            self.token_dtype = self.token_dtypes[self.path]
            return (identity[1] - HEADER_BYTES) // self.token_dtype.itemsize
        n, self.token_dtype = shard_format(self.path)
        self.token_dtypes[self.path] = self.token_dtype
        if self.vocab_size is not None:
            for start in range(0, n, VALIDATE_CHUNK):
                ids = read_shard_tokens(self.file.fileno(), self.path, start, min(VALIDATE_CHUNK, n - start),
                                        self.token_dtype)
                bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))   # < 0: a uint32 id past int32
                if bad.size:
                    raise InputError(f"{self.path}: token id {ids[bad[0]]} at position {start + bad[0]} is outside "
                                     f"the model's vocabulary [0, {self.vocab_size})")
        if self.file_identity() != identity or os.stat(self.path).st_ino != identity[0]:
            raise InputError(f"{self.path}: the shard changed while this run read it")
        self.validated[self.path] = identity
        return n

    def next_batch(self):
        """Return (inputs, targets), each (B,T) int32; targets are inputs shifted by one token.
        Raises InputError if the shard changed on disk since it was checked."""
        if self.current_sample_idx >= self.shard_num_samples:
            if self.current_shard_idx == len(self.files) - 1:
                self.reset()
            else:
                self.load_shard(self.current_shard_idx + 1)
        if self.file_identity() != self.validated[self.path]:
            raise InputError(f"{self.path}: the shard changed while this run read it (rewritten or truncated): "
                             f"restart the run once the data is final")
        B, T = self.B, self.T
        sample = int(self.sample_order[self.current_sample_idx])
        start = (sample * self.num_processes + self.process_rank) * B * T
        buf = read_shard_tokens(self.file.fileno(), self.path, start, B * T + 1, self.token_dtype)
        self.current_sample_idx += 1
        return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)

    def state(self):
        """Position to save: current shard index, current sample index, and the shuffle state."""
        return {"shard": self.current_shard_idx, "sample": self.current_sample_idx,
                "shard_order": self.shard_order.copy(), "sample_order": self.sample_order.copy(),
                "rng": self.rng.bit_generator.state}

    def restore(self, state):
        """Resume at a saved position (state() of the saved run; state["source"], if there, names
        the file it came from in errors). Every section is checked: the shard order must be a
        permutation of these files' indices, the sample order one of the shard's batches, the
        position inside both. Raises InputError if any does not fit, or if the saved run shuffled
        and this one does not, or the other way round (a shuffled position means nothing in the
        unshuffled order)."""
        source = state.get("source", "the checkpoint")
        saved_shuffle = "shard_order" in state
        if saved_shuffle != self.shuffle:
            raise InputError(f"{source} was written with --shuffle {int(saved_shuffle)}: resume with the same "
                             f"--shuffle (this run has --shuffle {int(self.shuffle)})")

        def check_permutation(order, n, what):
            order = np.asarray(order)
            if order.shape != (n,) or not np.array_equal(np.sort(order), np.arange(n)):
                raise InputError(f"{source}: corrupt {what}: not a permutation of 0..{n - 1}")
            return order
        if self.shuffle:
            self.shard_order = check_permutation(state["shard_order"], len(self.files), "shard order")
        if not 0 <= state["shard"] < len(self.files):
            raise InputError(f"{source}: loader position (shard {state['shard']}) does not fit "
                             f"{len(self.files)} shard(s) of {self.pattern}")
        self.load_shard(state["shard"])
        if self.shuffle:
            self.sample_order = check_permutation(state["sample_order"], self.shard_num_samples, "sample order")
            self.rng.bit_generator.state = state["rng"]
        if not 0 <= state["sample"] <= self.shard_num_samples:
            raise InputError(f"{source}: loader position (sample {state['sample']}) does not fit shard {self.path}")
        self.current_sample_idx = state["sample"]
