"""
llmc/evalloader.py: multiple-choice evaluation (HellaSwag; llm.c's llmc/dataloader.h EvalLoader
and its scoring): the eval file, the rows one example becomes, and the rule that picks an answer.

An example is a dict {"index", "label" (the right completion), "context": token ids,
"completions": NUM_COMPLETIONS lists of token ids}. In the file (llm.c's dev/data/hellaswag.py
layout) each example is a uint16 stream
    65535 | nbytes | index | label | 4 | n_ctx ctx... | n_0 end_0... | ... | n_3 end_3...
with nbytes counting the whole example in bytes; header slot 3 holds the longest example in
bytes (llm.c's C loader allocates exactly that many bytes for one example).
"""

import os

import numpy as np

from llmc.formats import HEADER_BYTES, make_header, read_header
from llmc.utils import InputError, atomic_write, check_input_file

EVAL_MAGIC = 20240522
EVAL_VERSION = 1
EXAMPLE_START = 2**16 - 1          # uint16 marker that opens every example; no token may equal it
NUM_COMPLETIONS = 4                # llm.c's EvalLoader assumes 4 (ASSUMED_NUM_COMPLETIONS)
EXAMPLE_FIELDS = 5                 # start, nbytes, index, label, num_completions
UINT16_BYTES = 2
MAX_EXAMPLE_BYTES = 2**16 - 1      # nbytes is itself a uint16
MAX_EXAMPLES = 2**16 - 1           # the index is a uint16
HEADER_SLOT_NUM_EXAMPLES = 2
HEADER_SLOT_LONGEST = 3            # longest example, in bytes
PAD_TOKEN = 0                      # fills a row after its completion; causal attention never sees it


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
    """Write `examples` (list of example dicts, see above) as a multiple-choice eval file,
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
    header = make_header(EVAL_MAGIC, EVAL_VERSION, {HEADER_SLOT_NUM_EXAMPLES: len(examples), HEADER_SLOT_LONGEST: longest})
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
    field that disagrees with the fields inside it, an empty context or completion, trailing
    bytes, or a header whose example count or longest-example size disagrees with the body."""
    check_input_file(path, "eval file")
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
        for k, part in enumerate(parts):                      # as example_stream refuses to write one
            if not part:
                raise InputError(f"{where}: {'the context' if k == 0 else f'completion {k - 1}'} is empty: an "
                                 f"example is scored on each completion's tokens after its context")
        examples.append({"index": index, "label": label, "context": parts[0], "completions": parts[1:]})
        seen_longest = max(seen_longest, nbytes)
        pos += n
    if pos != stream.size:
        raise InputError(f"{path}: {(stream.size - pos) * UINT16_BYTES} bytes after the last of {num_examples} examples")
    if longest != seen_longest:
        raise InputError(f"{path}: header says the longest example is {longest} bytes, the body's is {seen_longest}")
    return examples


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


def evaluate_multiple_choice(forward_losses, examples, B, T, comm):
    """Accuracy on multiple-choice examples (HellaSwag). Each example becomes NUM_COMPLETIONS rows
    (completion_rows); B // NUM_COMPLETIONS examples (at least one) go through one call of
    forward_losses(inputs (R,T) int32, targets (R,T) int32) -> per-position losses (R,T); the
    completion with the lowest mean loss over its own tokens is the prediction (score_example).
    Ranks take every comm.size-th example. Returns (accuracy in [0,1], number of examples)."""
    per_batch = max(1, B // NUM_COMPLETIONS)
    mine = examples[comm.rank::comm.size]
    correct = 0
    for start in range(0, len(mine), per_batch):
        batch = mine[start:start + per_batch]
        rows = [completion_rows(ex, T) for ex in batch]
        inputs = np.concatenate([r[0] for r in rows])            # (4 * len(batch), T)
        targets = np.concatenate([r[1] for r in rows])
        losses = forward_losses(inputs, targets)
        for j, (ex, (_, _, mask)) in enumerate(zip(batch, rows)):
            rows_j = slice(j * NUM_COMPLETIONS, (j + 1) * NUM_COMPLETIONS)
            correct += score_example(losses[rows_j], mask) == ex["label"]
    total = comm.sum(float(correct))
    return total / len(examples), len(examples)


def check_hellaswag_path(path):
    """Raise InputError unless -h 1's eval file is there as a regular file (with how to build a
    missing one)."""
    if not os.path.lexists(path):
        raise InputError(f"{path}: no such eval file (build it with `python dev/data/hellaswag.py`, needs internet)")
    check_input_file(path, "eval file")


def read_hellaswag(path, vocab_size=None):
    """The HellaSwag examples for -h 1, with a hint when the file was never built. Every token id
    must be in [0, vocab_size) (None: not checked). Raises InputError, also for a file with no
    examples."""
    check_hellaswag_path(path)
    examples = read_eval_file(path)
    if not examples:
        raise InputError(f"{path}: the eval file holds no examples: nothing to measure an accuracy on")
    for ex in examples if vocab_size is not None else ():
        ids = [t for part in [ex["context"]] + list(ex["completions"]) for t in part]
        if ids and max(ids) >= vocab_size:
            raise InputError(f"{path}: example {ex['index']}: token id {max(ids)} is outside the model's "
                             f"vocabulary [0, {vocab_size})")
    return examples
