"""
doc/data.py: every number and figure of doc/data.md (from text to training batches: the GPT-2
tokenizer, the token shard file, and how llmc.dataloader.DataLoader cuts batches out of it).

What it is: the tutorial's experiments, on llmc's own tokenizer, file and loader code:
  1. a Shakespeare line encoded with llmc.tokenizer.gpt2_encoding() (tiktoken's GPT-2 BPE) and
     decoded token by token with llmc.tokenizer.Tokenizer on data/gpt2_tokenizer.bin; then the same
     encoding recomputed by a 20-line byte-level BPE written here from the tokenizer file's ranks,
     with the merge-by-merge trace of one word;
  2. a tiny shard written with llmc.formats.write_shard and dumped byte by byte; the header of
     the real validation shard;
  3. DataLoader on two tiny shards whose token values are their own offsets: the B*T+1 windows,
     the move to the next shard, the wrap at the end of the epoch, the seeded shuffle, and which
     offsets rank 0 and rank 1 read (figure data_windows.png).
What it is not: a dataset builder (that is dev/data/tinyshakespeare.py). It quotes nothing that
depends on which Shakespeare text `make data` found (the canonical one online, 37 plays offline):
only the tokenizer, its own tiny shards, and the validation shard's header, which are the same
either way.

Needs `make data` (data/gpt2_tokenizer.bin, the validation shard, and the GPT-2 BPE: data/gpt2.tiktoken
or tiktoken's cache). Run:
    python doc/data.py
prints one `key = value` line per number the tutorial quotes (e.g. `line_tokens = 14`) and
redraws doc/data_windows.png. About a second on 2 CPU cores.
tests/test_docs.py checks that doc/data.md quotes every number exactly as computed here.
"""

import os
import sys
import tempfile

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import print_numbers, pyplot, save_figure  # noqa: E402

from llmc.dataloader import DataLoader  # noqa: E402
from llmc.formats import HEADER_BYTES, SHARD_MAGIC, SHARD_VERSION, read_shard, write_shard  # noqa: E402
from llmc.paths import DEFAULT_TOKENIZER, DEFAULT_VAL  # noqa: E402
from llmc.tokenizer import GPT2_EOT, Tokenizer, gpt2_encoding  # noqa: E402

LINE = "First Citizen:\nBefore we proceed any further, hear me speak."   # Coriolanus, the opening line
WORD = " Coriolanus"                   # a name the vocabulary does not hold whole: the merge trace
STRAIGHT = " is't"                     # the contraction rule splits off 't
CURLY = " is\u2019t"                   # the same with a typographic apostrophe (U+2019, 3 UTF-8 bytes)
EXAMPLES = (LINE, WORD, STRAIGHT, CURLY, "  O, beware, my lord, of jealousy!\n\n")
NUM_BYTE_TOKENS = 256                  # byte-level BPE starts from every possible byte
BYTES_SHOWN = 8                        # hex dump: the first 4 tokens after the header

# the loader experiment: two tiny shards in which every token's value tells where it is:
# shard s holds the values SHARD_BASE*s + offset, so a batch shows which file and offset it came from
B, T = 2, 4
SHARD_SIZES = (50, 40)
SHARD_BASE = 100
NUM_PROCESSES = 2
LOADER_SEED = 42                       # the trainers' --seed default
CALLS = 7                              # next_batch calls shown: one epoch (5) and the start of the next


# ----------------------------------------------------------------------------
# byte-level BPE, recomputed from the tokenizer file (Radford et al. 2019, sec. 2.2; Sennrich et al. 2016)

def pretokenize(text):
    """Split text into the chunks BPE merges inside, never across, with GPT-2's regular expression
    (contractions, letters, digits, other symbols, each with one optional leading space; whitespace).
    The pattern is tiktoken's copy of OpenAI's, the same one llmc.tokenizer.gpt2_encoding uses."""
    import regex                                        # \p{L}: the `regex` module (tiktoken depends on it)
    from tiktoken_ext.openai_public import r50k_pat_str
    return regex.findall(r50k_pat_str, text)


def bpe_chunk(chunk, ranks, trace=None):
    """One chunk's bytes -> token ids. Start from single bytes; repeatedly merge the adjacent pair
    whose concatenation has the lowest rank (the earliest-learned merge) until no pair is a token.
    For GPT-2 a token's rank is its id. trace, if a list, receives (rank, pieces) after each merge."""
    pieces = [bytes([b]) for b in chunk]
    while len(pieces) > 1:
        pairs = [(ranks.get(pieces[i] + pieces[i + 1]), i) for i in range(len(pieces) - 1)]
        pairs = [(r, i) for r, i in pairs if r is not None]
        if not pairs:
            break
        rank, i = min(pairs)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        if trace is not None:
            trace.append((rank, list(pieces)))
    return [ranks[p] for p in pieces]


def bpe_encode(text, ranks):
    """text -> GPT-2 token ids, without tiktoken: pretokenize, then BPE inside each chunk's UTF-8 bytes."""
    return [i for chunk in pretokenize(text) for i in bpe_chunk(chunk.encode("utf-8"), ranks)]


def code(text):
    """text as markdown inline code, as the tutorial shows it."""
    return f"`{text}`"


def show_pieces(pieces):
    """[b' Cor', b'iol'] -> "`b' Cor' b'iol'`": each piece as Python writes a bytes literal, as code."""
    return code(" ".join(repr(p) for p in pieces))


def tokenizer_experiment():
    enc = gpt2_encoding()
    tok = Tokenizer(DEFAULT_TOKENIZER)
    ids = enc.encode(LINE)
    assert tok.decode(ids) == LINE
    V = len(tok.token_bytes)
    # the tokenizer file's byte strings are tiktoken's tokens, id for id
    mismatches = sum(tok.token_bytes[i] != enc.decode_single_token_bytes(i) for i in range(V))
    assert mismatches == 0, mismatches
    ranks = {b: i for i, b in enumerate(tok.token_bytes) if i != tok.eot_token}
    ours = [bpe_encode(text, ranks) for text in EXAMPLES]
    theirs = [enc.encode(text) for text in EXAMPLES]
    assert ours == theirs, (ours, theirs)
    trace = []
    word_ids = bpe_chunk(WORD.encode("utf-8"), ranks, trace)
    longest = max(range(V), key=lambda i: len(tok.token_bytes[i]))
    straight, curly = enc.encode(STRAIGHT), enc.encode(CURLY)
    numbers = {
        "line_chars": f"{len(LINE)}",
        "line_bytes": f"{len(LINE.encode('utf-8'))}",
        "line_tokens": f"{len(ids)}",
        "line_ids": code(ids),
        "line_pieces": show_pieces(tok.token_bytes[i] for i in ids),
        "bytes_per_token": f"{len(LINE.encode('utf-8')) / len(ids):.1f}",
        "vocab_size": f"{V:,}",
        "eot_id": f"{tok.eot_token}",
        "eot_bytes": code(repr(tok.token_bytes[tok.eot_token])),
        "byte_tokens": f"{sum(len(b) == 1 for b in tok.token_bytes)}",
        "merges": f"{V - NUM_BYTE_TOKENS - 1:,}",
        "longest_len": f"{len(tok.token_bytes[longest])}",
        "longest_id": f"{longest}",
        "file_mismatches": f"{mismatches}",
        "ours_tokens": f"{sum(len(x) for x in ours)}",
        "ours_examples": f"{len(EXAMPLES)}",
        "word_bytes": f"{len(WORD.encode('utf-8'))}",
        "word_merges": f"{len(trace)}",
        "word_ids": code(word_ids),
        "line_chunks": f"{len(pretokenize(LINE))}",
        "straight_pieces": show_pieces(tok.token_bytes[i] for i in straight),
        "curly_pieces": show_pieces(tok.token_bytes[i] for i in curly),
        "curly_prefix_decoded": code(repr(tok.decode(curly[:2]))),
    }
    for step, (rank, pieces) in enumerate(trace, start=1):
        numbers[f"trace_rank_{step}"] = f"{rank}"
        numbers[f"trace_pieces_{step}"] = show_pieces(pieces)
    return numbers, [GPT2_EOT] + ids


# ----------------------------------------------------------------------------
# the token shard, byte by byte

def hex_bytes(raw):
    """b'\\x88\\xd8' -> '88 d8'."""
    return " ".join(f"{b:02x}" for b in raw)


def shard_experiment(tokens, tmp):
    path = os.path.join(tmp, "line.bin")
    write_shard(path, tokens)
    with open(path, "rb") as f:
        raw = f.read()
    assert np.array_equal(read_shard(path), tokens)
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert (header[0], header[1], header[2]) == (SHARD_MAGIC, SHARD_VERSION, len(tokens))
    assert not header[3:].any()                         # slots 3..255 unused
    val = read_shard(DEFAULT_VAL)
    val_header = np.fromfile(DEFAULT_VAL, dtype="<i4", count=3)
    return {
        "shard_tokens": f"{len(tokens)}",
        "shard_size": f"{len(raw):,}",
        "shard_magic": f"{SHARD_MAGIC}",
        "shard_magic_hex": f"0x{SHARD_MAGIC:08x}",
        "hex_slot0": hex_bytes(raw[0:4]),
        "hex_slot1": hex_bytes(raw[4:8]),
        "hex_slot2": hex_bytes(raw[8:12]),
        "hex_slot3": hex_bytes(raw[12:16]),
        "header_zero_slots": f"{int((header == 0).sum())}",
        "hex_tokens": hex_bytes(raw[HEADER_BYTES:HEADER_BYTES + BYTES_SHOWN]),
        "first_tokens": ", ".join(str(t) for t in tokens[:BYTES_SHOWN // 2]),
        "eot_hex": f"0x{GPT2_EOT:04x}",
        "val_header": ", ".join(str(v) for v in val_header),
        "val_size": f"{os.path.getsize(DEFAULT_VAL):,}",
        "val_first": f"{int(val[0])}",
        "uint16_max": f"{np.iinfo(np.uint16).max:,}",
    }


# ----------------------------------------------------------------------------
# the data loader: windows, shards, epochs, shuffling, ranks

def write_offset_shards(tmp):
    """Shards tmp/shard_000.bin, ... holding SHARD_BASE*s + offset; returns their glob pattern."""
    for s, n in enumerate(SHARD_SIZES):
        write_shard(os.path.join(tmp, f"shard_{s:03d}.bin"), SHARD_BASE * s + np.arange(n))
    return os.path.join(tmp, "shard_*.bin")


def window_starts(pattern, num_processes, shuffle):
    """For each rank: the first input token of each of CALLS next_batch calls (= shard*SHARD_BASE
    + offset of its window), checking on the way that targets are the inputs shifted by one."""
    starts = []
    for rank in range(num_processes):
        loader = DataLoader(pattern, B, T, rank, num_processes, shuffle, LOADER_SEED)
        row = []
        for _ in range(CALLS):
            x, y = loader.next_batch()                  # (B,T) each
            assert np.array_equal(x.ravel()[1:], y.ravel()[:-1]) and y.ravel()[-1] == x.ravel()[-1] + 1
            row.append(int(x[0, 0]))
        starts.append(row)
    return starts


def draw_windows(fig_dir, panels):
    """One panel per loader setting: each next_batch call as a bar over the token offsets it reads
    (B*T inputs, then the one extra token only the targets use), rank 0 and rank 1 side by side."""
    plt = pyplot()
    from matplotlib.patches import Patch
    gap = 6                                             # offsets drawn between the two shards
    xpos = lambda v: v % SHARD_BASE + (SHARD_SIZES[0] + gap) * (v // SHARD_BASE)  # noqa: E731
    colors = ("#4c72b0", "#dd8452")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.4 * len(panels)), sharex=True)
    for ax, (title, starts) in zip(axes, panels):
        for rank, row in enumerate(starts):
            for call, v in enumerate(row):
                y = call + (rank - 0.5) * 0.42
                ax.barh(y, B * T, left=xpos(v), height=0.4, color=colors[rank], edgecolor="white", lw=0.5)
                ax.barh(y, 1, left=xpos(v) + B * T, height=0.4, color="white", edgecolor=colors[rank],
                        hatch="////", lw=0.8)
        for s, n in enumerate(SHARD_SIZES):
            left = xpos(SHARD_BASE * s)
            ax.axvspan(left, left + n, color="0.93", zorder=0)
            ax.text(left + n / 2, -1.15, f"shard {s}: {n} tokens", ha="center", fontsize=8, color="0.35")
        epoch = sum((n - 1) // (B * T * NUM_PROCESSES) for n in SHARD_SIZES)
        ax.axhline(epoch - 0.5, color="k", ls="--", lw=0.8)
        ax.text(xpos(SHARD_BASE) + SHARD_SIZES[1] + 1, epoch - 0.35, "next epoch", fontsize=8, va="top")
        ax.set_ylim(CALLS - 0.4, -1.5)
        ax.set_yticks(range(CALLS), [f"{c + 1}" for c in range(CALLS)])
        ax.set_ylabel("next_batch call")
        ax.set_title(title, fontsize=10)
    ticks = [0, 10, 20, 30, 40, 49] + [xpos(SHARD_BASE + t) for t in (0, 10, 20, 30, 39)]
    axes[-1].set_xticks(ticks, [0, 10, 20, 30, 40, 49, 0, 10, 20, 30, 39])
    axes[-1].set_xlabel("token offset inside its shard")
    target_only = Patch(facecolor="white", edgecolor="0.3", hatch="////", label="+1: read for the targets only")
    axes[0].legend(handles=[Patch(color=colors[0], label="rank 0: B*T input tokens"),
                            Patch(color=colors[1], label="rank 1: B*T input tokens"), target_only],
                   fontsize=8, loc="lower right", ncol=3, bbox_to_anchor=(1.0, 1.12))
    fig.suptitle(f"DataLoader windows, B={B}, T={T}, {NUM_PROCESSES} processes", fontsize=11, y=1.0)
    save_figure(fig, fig_dir, "data_windows.png", bbox_inches="tight")


def loader_experiment(tmp, fig_dir):
    pattern = write_offset_shards(tmp)
    one = DataLoader(pattern, B, T)
    x, y = one.next_batch()
    single = window_starts(pattern, 1, False)[0]
    plain = window_starts(pattern, NUM_PROCESSES, False)
    shuffled = window_starts(pattern, NUM_PROCESSES, True)
    # both ranks shuffle with the same seed, so together they always read one global batch
    global_batch = B * T * NUM_PROCESSES
    assert all(r1 == r0 + B * T for r0, r1 in zip(*plain)) and all(r1 == r0 + B * T for r0, r1 in zip(*shuffled))
    per_shard = [(n - 1) // global_batch for n in SHARD_SIZES]
    epoch = sum(per_shard)
    # the union of what both ranks read as inputs in one epoch, shuffled or not: each usable token once
    for starts in (plain, shuffled):
        read = sorted(v + i for row in starts for v in row[:epoch] for i in range(B * T))
        assert len(read) == len(set(read)) == epoch * global_batch
    shard0 = DataLoader(pattern, B, T, 0, NUM_PROCESSES, True, LOADER_SEED)
    draw_windows(fig_dir, [
        (f"in order (shuffle off): rank r reads global batch k at offset (k*{NUM_PROCESSES} + r)*B*T", plain),
        (f"--shuffle 1 (seed {LOADER_SEED}): shard order and batch order permuted, same for both ranks", shuffled)])
    return {
        "B": f"{B}", "T": f"{T}", "window": f"{B * T + 1}",
        "shard_sizes": " and ".join(f"{n}" for n in SHARD_SIZES),
        "first_inputs": code(x.tolist()),
        "first_targets": code(y.tolist()),
        "single_starts": ", ".join(f"{v}" for v in single),
        "single_samples": ", ".join(f"{(n - 1) // (B * T)}" for n in SHARD_SIZES),
        "num_processes": f"{NUM_PROCESSES}",
        "global_batch": f"{global_batch}",
        "per_shard": " and ".join(f"{n}" for n in per_shard),
        "epoch_calls": f"{epoch}",
        "rank0_starts": ", ".join(f"{v}" for v in plain[0]),
        "rank1_starts": ", ".join(f"{v}" for v in plain[1]),
        "unread": f"{sum(SHARD_SIZES) - epoch * global_batch}",
        "usable": f"{epoch * global_batch}",
        "total_tokens": f"{sum(SHARD_SIZES)}",
        "shuffle_seed": f"{LOADER_SEED}",
        "shuffle_shard_order": f"{shard0.shard_order.tolist()}",
        "shuffle_rank0": ", ".join(f"{v}" for v in shuffled[0]),
        "shuffle_rank1": ", ".join(f"{v}" for v in shuffled[1]),
        "calls": f"{CALLS}",
    }


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment; save the figure into fig_dir; return {key: formatted number}."""
    numbers, line_tokens = tokenizer_experiment()
    with tempfile.TemporaryDirectory() as tmp:
        numbers.update(shard_experiment(np.array(line_tokens), tmp))
        numbers.update(loader_experiment(tmp, fig_dir))
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
