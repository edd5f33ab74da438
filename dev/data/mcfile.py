"""
dev/data/mcfile.py: the multiple-choice eval file (HellaSwag, MMLU) and how a model is scored on it.

The public pieces, self-contained (numpy + gpt2_cpu only) so that they can move into gpt2_cpu.py:
    write_eval_file(path, examples)      examples -> the byte layout of shared/docs/file-formats.md
    read_eval_file(path) -> examples     the same layout back, every length field checked
    completion_batches(examples, T)      each example -> 4 rows "context + completion i" with the
                                         targets and a mask on the positions that predict a
                                         completion token
    score_example(losses, mask) -> i     the completion with the lowest mean cross-entropy wins

An example is a dict: {"index": int, "label": int (index of the right completion),
"context": list of token ids, "completions": list of NUM_COMPLETIONS lists of token ids}.

The file is byte-compatible with the one llm.c's dev/data/hellaswag.py writes and its C
EvalLoader reads: after the 256-int32 header, each example is a stream of uint16

    65535 | nbytes | index | label | 4 | n_ctx ctx... | n_0 end_0... | n_1 end_1... | ... | n_3 end_3...

where nbytes counts the whole example in bytes, these five fields included. Header slot 3 holds
the longest example *in bytes* (llm.c's `longest_example_bytes`: its C loader mallocs a buffer of
exactly that many bytes, so a value in uint16 units would overflow it).

What it is not: a downloader (dev/data/hellaswag.py writes the HellaSwag file) or a training-loop
hook (the trainers run the forward pass and call score_example).

Check it:
    python -m pytest tests/test_hellaswag.py -q
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from gpt2_cpu import (EVAL_MAGIC, EVAL_VERSION, HEADER_BYTES, InputError,  # noqa: E402
                      atomic_write, make_header, read_header)

# ----------------------------------------------------------------------------
# constants of the layout

EXAMPLE_START = 2**16 - 1          # uint16 marker that opens every example; no token may equal it
NUM_COMPLETIONS = 4                # llm.c's EvalLoader assumes 4 (ASSUMED_NUM_COMPLETIONS)
EXAMPLE_FIELDS = 5                 # start, nbytes, index, label, num_completions
UINT16_BYTES = 2
MAX_EXAMPLE_BYTES = 2**16 - 1      # nbytes is itself a uint16
MAX_EXAMPLES = 2**16 - 1           # the index is a uint16
HEADER_SLOT_NUM_EXAMPLES = 2
HEADER_SLOT_LONGEST = 3            # longest example, in bytes
PAD_TOKEN = 0                      # fills a row after its completion; causal attention never sees it


# ----------------------------------------------------------------------------
# writing and reading

def example_stream(example):
    """One example -> its uint16 stream (list of ints), nbytes filled in.
    Raises ValueError if a field does not fit the format."""
    context, completions, label = example["context"], example["completions"], example["label"]
    if len(completions) != NUM_COMPLETIONS:
        raise ValueError(f"example {example['index']}: {len(completions)} completions, the format needs {NUM_COMPLETIONS}")
    if not 0 <= label < NUM_COMPLETIONS:
        raise ValueError(f"example {example['index']}: label {label} is not a completion index")
    if not 0 <= example["index"] < MAX_EXAMPLES:
        raise ValueError(f"example index {example['index']} does not fit in uint16")
    stream = [EXAMPLE_START, 0, example["index"], label, NUM_COMPLETIONS]
    for tokens in [context] + list(completions):
        if len(tokens) == 0:
            raise ValueError(f"example {example['index']}: empty context or completion")
        if min(tokens) < 0 or max(tokens) >= EXAMPLE_START:
            raise ValueError(f"example {example['index']}: token ids must be in [0, {EXAMPLE_START})")
        stream.append(len(tokens))
        stream.extend(int(t) for t in tokens)
    nbytes = len(stream) * UINT16_BYTES
    if nbytes > MAX_EXAMPLE_BYTES:
        raise ValueError(f"example {example['index']}: {nbytes} bytes, more than a uint16 length can say")
    stream[1] = nbytes
    return stream


def write_eval_file(path, examples):
    """Write `examples` (list of dicts, see the module docstring) as a multiple-choice eval file,
    atomically. Header: magic, version, number of examples, longest example in bytes.
    Returns the longest example's size in bytes. Raises ValueError on an example that does not
    fit the format (not 4 completions, a token id >= 65535, an example over 65535 bytes, more
    than 65535 examples)."""
    if not examples:
        raise ValueError("no examples to write")
    if len(examples) > MAX_EXAMPLES:
        raise ValueError(f"{len(examples)} examples: the format holds at most {MAX_EXAMPLES}")
    streams = [example_stream(ex) for ex in examples]
    longest = max(s[1] for s in streams)
    header = make_header({0: EVAL_MAGIC, 1: EVAL_VERSION, HEADER_SLOT_NUM_EXAMPLES: len(examples),
                          HEADER_SLOT_LONGEST: longest})
    body = np.array([t for s in streams for t in s], dtype="<u2")

    def write(f):
        f.write(header.tobytes())
        f.write(body.tobytes())
    atomic_write(path, write)
    return longest


def read_eval_file(path):
    """Read a multiple-choice eval file -> list of example dicts (tokens as lists of int).
    Every length is checked against the others: raises InputError naming the file and the
    example on a bad magic or version, a missing start marker, a truncated example, an nbytes
    field that disagrees with the fields inside it, trailing bytes, or a header whose example
    count or longest-example size disagrees with the body."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such eval file")
    with open(path, "rb") as f:
        h = read_header(f, path, EVAL_MAGIC, (EVAL_VERSION,), "multiple-choice eval")
        body = f.read()
    if len(body) % UINT16_BYTES:
        raise InputError(f"{path}: truncated eval file: odd number of bytes after the header")
    stream = np.frombuffer(body, dtype="<u2")
    num_examples, longest = int(h[HEADER_SLOT_NUM_EXAMPLES]), int(h[HEADER_SLOT_LONGEST])
    examples, pos, seen_longest = [], 0, 0
    for i in range(num_examples):
        where = f"{path}: example {i} (byte {HEADER_BYTES + pos * UINT16_BYTES})"
        if pos + EXAMPLE_FIELDS > stream.size:
            raise InputError(f"{where}: truncated eval file, {num_examples} examples promised")
        if stream[pos] != EXAMPLE_START:
            raise InputError(f"{where}: no start marker {EXAMPLE_START} (found {stream[pos]}): corrupt eval file")
        nbytes = int(stream[pos + 1])
        n = nbytes // UINT16_BYTES                            # the example's length in uint16
        if nbytes % UINT16_BYTES or n < EXAMPLE_FIELDS:
            raise InputError(f"{where}: impossible example length {nbytes} bytes")
        if pos + n > stream.size:
            raise InputError(f"{where}: truncated: its {nbytes} bytes run past the end of the file")
        ex = stream[pos:pos + n]
        index, label, num_completions = int(ex[2]), int(ex[3]), int(ex[4])
        if num_completions != NUM_COMPLETIONS or not 0 <= label < num_completions:
            raise InputError(f"{where}: {num_completions} completions with label {label}; expected {NUM_COMPLETIONS} and a label below it")
        parts, q = [], EXAMPLE_FIELDS                         # q walks the example's uint16s
        for _ in range(1 + num_completions):                  # the context, then each completion
            if q >= n or q + 1 + int(ex[q]) > n:
                raise InputError(f"{where}: a token-list length runs past the example's {nbytes} bytes: inconsistent lengths")
            length = int(ex[q])
            parts.append(ex[q + 1:q + 1 + length].astype(np.int64).tolist())
            q += 1 + length
        if q != n:
            raise InputError(f"{where}: fields fill {q * UINT16_BYTES} of the example's {nbytes} bytes: inconsistent lengths")
        examples.append({"index": index, "label": label, "context": parts[0], "completions": parts[1:]})
        seen_longest = max(seen_longest, nbytes)
        pos += n
    if pos != stream.size:
        raise InputError(f"{path}: {(stream.size - pos) * UINT16_BYTES} bytes after the last of {num_examples} examples")
    if longest != seen_longest:
        raise InputError(f"{path}: header says the longest example is {longest} bytes, the body's is {seen_longest}")
    return examples


# ----------------------------------------------------------------------------
# scoring: one example -> 4 rows -> losses -> the predicted completion

def completion_rows(example, T):
    """One example -> (inputs, targets, mask), each (NUM_COMPLETIONS, T): row i is the context
    followed by completion i, padded with PAD_TOKEN; targets are the inputs shifted left by one;
    mask (bool) is True at the positions whose target is a completion token, i.e. positions
    n_ctx-1 .. n_ctx+n_i-2 of row i (the last context token predicts the first completion token).
    If context + longest completion exceed T, the context loses tokens from its *start* so that
    every row still fits (llm.c asserts instead). Raises InputError if a completion alone
    needs T or more positions."""
    context, completions = example["context"], example["completions"]
    if not context:
        raise InputError(f"example {example['index']}: empty context: nothing predicts the first completion token")
    longest = max(len(c) for c in completions)
    if longest >= T:
        raise InputError(f"example {example['index']}: a completion of {longest} tokens does not fit T={T} after a context token")
    context = context[-(T - longest):]                            # keep the context's end
    n_ctx = len(context)
    rows = len(completions)
    inputs = np.full((rows, T + 1), PAD_TOKEN, dtype=np.int32)    # one extra column so targets can shift
    mask = np.zeros((rows, T), dtype=bool)
    for i, completion in enumerate(completions):
        n = len(completion)
        inputs[i, :n_ctx] = context
        inputs[i, n_ctx:n_ctx + n] = completion
        mask[i, n_ctx - 1:n_ctx - 1 + n] = True                   # targets[i, t] = inputs[i, t+1]
    return inputs[:, :T], inputs[:, 1:], mask


def completion_batches(examples, T):
    """Yield (inputs, targets, mask, label) per example: inputs and targets (NUM_COMPLETIONS, T)
    int32, mask (NUM_COMPLETIONS, T) bool (see completion_rows), label the right completion's
    index. A trainer runs the forward pass with targets on each (stacking B // 4 examples per
    batch if it likes) and hands the per-position losses to score_example."""
    for example in examples:
        inputs, targets, mask = completion_rows(example, T)
        yield inputs, targets, mask, example["label"]


def completion_losses(losses, mask):
    """Mean cross-entropy of each row over its masked positions. losses (R,T), mask (R,T) -> (R,)
    float64. Raises ValueError if a row has no masked position."""
    mask = np.asarray(mask, dtype=bool)
    counts = mask.sum(axis=1)
    if np.any(counts == 0):
        raise ValueError("every row needs at least one masked (completion) position")
    total = np.where(mask, np.asarray(losses, dtype=np.float64), 0.0).sum(axis=1)  # (R,)
    return total / counts


def score_example(losses, mask):
    """The predicted completion of one example: the row with the lowest mean cross-entropy over
    its own completion tokens (llm.c's rule; dividing by the length keeps long completions from
    losing just for being long). losses (4,T) per-position cross-entropy; mask (4,T) bool.
    Ties go to the lower index. Returns an int."""
    return int(np.argmin(completion_losses(losses, mask)))
