"""
tests/test_hellaswag.py: the multiple-choice eval file (gpt2_cpu.py), the HellaSwag
script's record -> example step (dev/data/hellaswag.py), and scoring.

Checks, each against an independent reference:
- the byte layout: an example's uint16 stream and the header written out by hand here from
  doc/file_formats.md (and llm.c's dev/data/hellaswag.py), compared to the file's bytes;
- round trip write -> read; a bad magic, bad version, a truncated file, a bad start marker and
  inconsistent length fields are each rejected with InputError;
- completion_rows: rows, targets and mask of a small example, written out by hand;
- score_example: hand-made losses where the lowest *mean* differs from the lowest sum, and
  losses outside the mask that would win if the mask were ignored;
- end to end: a tiny GPT-2 trained (gpt2_cpu, AdamW) on the right completions of a few examples,
  with labels 3, 0, 2, 1 so that no constant guess passes, is then scored right on all of them
  by a clear margin, where before training it was not.

Run: python -m pytest tests/test_hellaswag.py -q   (about 10 s)
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "dev", "data"))
sys.path.insert(0, REPO_ROOT)
import hellaswag  # noqa: E402
from llmc import evalloader  # noqa: E402
from gpt2_cpu import GPT2Config, gpt2_backward, gpt2_forward, gpt2_init, gpt2_update, gpt2_zero_grad, padded_vocab  # noqa: E402
from llmc.evalloader import EVAL_MAGIC, EVAL_VERSION  # noqa: E402
from llmc.formats import HEADER_BYTES  # noqa: E402
from llmc.utils import InputError  # noqa: E402

EXAMPLES = [
    {"index": 0, "label": 2, "context": [5, 6, 7], "completions": [[1], [2, 3], [4], [8, 9, 10]]},
    {"index": 1, "label": 0, "context": [50256, 0, 65534], "completions": [[11, 12], [13], [14, 15, 16, 17], [18]]},
    {"index": 7, "label": 3, "context": list(range(100, 140)), "completions": [[1], [2], [3], [4]]},
]
# EXAMPLES[0] as file_formats.md lays it out: start, nbytes, index, label, 4, then length + tokens
EXAMPLE0_STREAM = [65535, 40, 0, 2, 4, 3, 5, 6, 7, 1, 1, 2, 2, 3, 1, 4, 3, 8, 9, 10]
EXAMPLE2_BYTES = 2 * (5 + 1 + 40 + 4 * 2)           # the longest: 40 context tokens, four 1-token endings


@pytest.fixture
def eval_path(tmp_path):
    path = str(tmp_path / "eval.bin")
    assert evalloader.write_eval_file(path, EXAMPLES) == EXAMPLE2_BYTES
    return path


def test_byte_layout(eval_path):
    raw = open(eval_path, "rb").read()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype="<i4")
    assert list(header[:4]) == [EVAL_MAGIC, EVAL_VERSION, len(EXAMPLES), EXAMPLE2_BYTES]
    assert not header[4:].any()
    body = np.frombuffer(raw[HEADER_BYTES:], dtype="<u2")
    assert list(body[:len(EXAMPLE0_STREAM)]) == EXAMPLE0_STREAM
    ex1 = body[len(EXAMPLE0_STREAM):]
    assert list(ex1[:5]) == [65535, 2 * (5 + 4 + 3 + 5 + 2 + 2), 1, 0, 4]
    assert list(ex1[5:9]) == [3, 50256, 0, 65534]
    assert len(raw) == HEADER_BYTES + 40 + 2 * (5 + 4 + 3 + 5 + 2 + 2) + EXAMPLE2_BYTES


def test_round_trip(eval_path):
    assert evalloader.read_eval_file(eval_path) == EXAMPLES


def corrupt(path, offset, value, fmt="<u2"):
    data = bytearray(open(path, "rb").read())
    data[offset:offset + np.dtype(fmt).itemsize] = np.array([value], dtype=fmt).tobytes()
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("offset,value,fmt,message", [
    (0, 20240520, "<i4", "bad magic"),                           # a token shard's magic
    (4, 2, "<i4", "unsupported"),                                # version
    (12, 38, "<i4", "longest example"),                          # header slot 3 off by one uint16
    (8, 4, "<i4", "truncated"),                                  # claims one example more
    (HEADER_BYTES, 65534, "<u2", "start marker"),
    (HEADER_BYTES + 2, 42, "<u2", "inconsistent lengths"),       # nbytes 40 -> 42
    (HEADER_BYTES + 10, 4, "<u2", "inconsistent lengths"),       # context length 3 -> 4
    (HEADER_BYTES + 32, 4, "<u2", "inconsistent lengths"),       # last completion 3 -> 4 tokens
    (HEADER_BYTES + 8, 3, "<u2", "completions"),                 # 4 completions -> 3
])
def test_corrupt_files_rejected(eval_path, offset, value, fmt, message):
    corrupt(eval_path, offset, value, fmt)
    with pytest.raises(InputError, match=message):
        evalloader.read_eval_file(eval_path)


def test_truncated_and_trailing(eval_path):
    data = open(eval_path, "rb").read()
    for cut in (2, 1, EXAMPLE2_BYTES - 2, len(data) - HEADER_BYTES):
        open(eval_path, "wb").write(data[:-cut])
        with pytest.raises(InputError, match="truncated"):
            evalloader.read_eval_file(eval_path)
    open(eval_path, "wb").write(data + b"\x00\x00")
    with pytest.raises(InputError, match="after the last"):
        evalloader.read_eval_file(eval_path)
    open(eval_path, "wb").write(data[:100])
    with pytest.raises(InputError, match="header"):
        evalloader.read_eval_file(eval_path)


def test_write_rejects_unrepresentable(tmp_path):
    path = str(tmp_path / "x.bin")
    good = EXAMPLES[0]
    for bad, message in [({**good, "context": [1, 65535]}, "token ids"),
                         ({**good, "completions": good["completions"][:3]}, "completions"),
                         ({**good, "label": 4}, "label"),
                         ({**good, "completions": [[1], [], [2], [3]]}, "empty"),
                         ({**good, "context": [1] * 40000}, "bytes")]:
        with pytest.raises(ValueError, match=message):
            evalloader.write_eval_file(path, [bad])
    assert not os.path.exists(path)


# ----------------------------------------------------------------------------
# rows, mask, scoring

def test_completion_rows_by_hand():
    ex = {"index": 0, "label": 1, "context": [5, 6, 7], "completions": [[1], [2, 3], [4], [8, 9]]}
    inputs, targets, mask = evalloader.completion_rows(ex, T=6)
    P = evalloader.PAD_TOKEN
    np.testing.assert_array_equal(inputs, [[5, 6, 7, 1, P, P], [5, 6, 7, 2, 3, P],
                                           [5, 6, 7, 4, P, P], [5, 6, 7, 8, 9, P]])
    np.testing.assert_array_equal(targets, [[6, 7, 1, P, P, P], [6, 7, 2, 3, P, P],
                                            [6, 7, 4, P, P, P], [6, 7, 8, 9, P, P]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                                         [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0]])
    assert inputs.dtype == np.int32 and targets.dtype == np.int32 and mask.dtype == bool
    # the masked targets are exactly each completion
    for i, c in enumerate(ex["completions"]):
        assert list(targets[i][mask[i]]) == c


def test_completion_rows_truncate_context_from_the_left():
    ex = {"index": 0, "label": 0, "context": [1, 2, 3, 4, 5], "completions": [[6], [7, 8, 9], [10], [11]]}
    inputs, targets, mask = evalloader.completion_rows(ex, T=5)   # room for 2 context tokens
    np.testing.assert_array_equal(inputs[1], [4, 5, 7, 8, 9])
    np.testing.assert_array_equal(targets[1][mask[1]], [7, 8, 9])
    np.testing.assert_array_equal(inputs[0], [4, 5, 6, evalloader.PAD_TOKEN, evalloader.PAD_TOKEN])
    with pytest.raises(InputError, match="does not fit"):
        evalloader.completion_rows(ex, T=3)


def test_completion_batches_yields_every_example():
    out = list(evalloader.completion_batches(EXAMPLES, T=64))
    assert [label for *_, label in out] == [ex["label"] for ex in EXAMPLES]
    assert all(x.shape == y.shape == m.shape == (4, 64) for x, y, m, _ in out)


def test_score_example_uses_the_masked_mean():
    mask = np.zeros((4, 8), dtype=bool)
    mask[0, 2:3] = True                  # 1 token
    mask[1, 2:6] = True                  # 4 tokens
    mask[2, 2:4] = True
    mask[3, 2:4] = True
    losses = np.full((4, 8), 0.01)       # outside the mask: would make every row look good
    losses[3, :2] = 50.0                 # ... and row 3 bad, if the mask were ignored
    losses[0, 2] = 2.0                   # mean 2.0, sum 2.0 (lowest sum)
    losses[1, 2:6] = 1.5                 # mean 1.5, sum 6.0: lowest mean
    losses[2, 2:4] = [1.0, 3.0]          # mean 2.0
    losses[3, 2:4] = [1.6, 1.6]          # mean 1.6
    assert evalloader.score_example(losses, mask) == 1
    np.testing.assert_allclose(evalloader.completion_losses(losses, mask), [2.0, 1.5, 2.0, 1.6])
    losses[3, 2:4] = 1.4
    assert evalloader.score_example(losses, mask) == 3
    with pytest.raises(ValueError):
        evalloader.score_example(losses, np.zeros((4, 8), dtype=bool))


# ----------------------------------------------------------------------------
# hellaswag.py: jsonl records -> examples (byte-level stand-in encoder: the BPE is not needed here)

def byte_encode(text):
    return list(text.encode("utf-8"))


RECORDS = [
    {"ind": 24, "ctx": "A man is sitting on a roof. he", "label": 3,
     "endings": ["is using wrap.", "is ripping tiles off.", "is holding a cube.", "starts pulling up roofing."]},
    {"ind": 92, "ctx": "A lady walks to a barbell. She", "label": 0,
     "endings": ["bends down.", "swings.", "pulls a rope.", "stands."]},
]


def test_render_and_build(tmp_path):
    jsonl = tmp_path / "val.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    out = str(tmp_path / "hs.bin")
    n, longest = hellaswag.build_eval_file(str(jsonl), out, byte_encode)
    assert n == 2
    got = evalloader.read_eval_file(out)
    assert [ex["index"] for ex in got] == [0, 1] and [ex["label"] for ex in got] == [3, 0]
    assert bytes(got[0]["context"]) == b"A man is sitting on a roof. he"
    assert bytes(got[0]["completions"][3]) == b" starts pulling up roofing."    # leading space
    assert longest == 2 * (5 + 1 + len(RECORDS[0]["ctx"]) + sum(1 + 1 + len(e) for e in RECORDS[0]["endings"]))
    with pytest.raises(InputError, match="endings"):
        hellaswag.render_example({**RECORDS[0], "endings": ["a", "b"]}, byte_encode, 0)
    with pytest.raises(InputError, match="ctx"):
        hellaswag.render_example({"label": 1}, byte_encode, 0)


@pytest.mark.parametrize("args,message", [
    (["--url", "http://127.0.0.1:9/hellaswag_val.jsonl"], "cannot download"),    # nothing listens there
    (["-i", "/nonexistent/hellaswag_val.jsonl"], "no such HellaSwag jsonl file"),
])
def test_cli_fails_in_one_line(tmp_path, args, message):
    out = tmp_path / "out.bin"             # the jsonl would be cached beside it: none there yet
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "data", "hellaswag.py"), "-o", str(out)] + args,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------
# end to end: a model that has learned the right completions is scored right

TINY = GPT2Config(max_seq_len=16, vocab_size=40, padded_vocab_size=padded_vocab(40), num_layers=2, num_heads=2, channels=32)
TRAIN_STEPS = 300
LEARNING_RATE = 3e-3
TRAINED_MARGIN = 1.0                     # nats between the right completion and the best wrong one


def tiny_examples():
    """Four examples, labels 3, 0, 2, 1; completions differ from their first token on."""
    rng = np.random.default_rng(0)
    examples = []
    for i, label in enumerate([3, 0, 2, 1]):
        context = rng.integers(1, TINY.vocab_size, size=4 + i).tolist()
        completions = [rng.integers(1, TINY.vocab_size, size=2 + (j + i) % 3).tolist() for j in range(4)]
        for j in range(4):                                   # distinct first tokens: no free ties
            completions[j][0] = 1 + 9 * j + i
        examples.append({"index": i, "label": label, "context": context, "completions": completions})
    return examples


def score_all(model, examples, T):
    """(predictions, margin per example: best wrong mean loss - right mean loss)."""
    preds, margins = [], []
    for inputs, targets, mask, label in evalloader.completion_batches(examples, T):
        gpt2_forward(model, inputs, targets)
        per_row = evalloader.completion_losses(model.acts["losses"], mask)
        preds.append(evalloader.score_example(model.acts["losses"], mask))
        margins.append(np.min(np.delete(per_row, label)) - per_row[label])
    return preds, np.array(margins)


def test_trained_model_picks_the_right_completion():
    T = TINY.max_seq_len
    examples = tiny_examples()
    labels = [ex["label"] for ex in examples]
    model = gpt2_init(TINY, seed=3)
    _, margins_before = score_all(model, examples, T)
    assert not np.all(margins_before > TRAINED_MARGIN)           # untrained: not already right by the margin
    # train on the right rows only: context followed by the labelled completion
    rows = [evalloader.completion_rows(ex, T) for ex in examples]
    inputs = np.stack([x[ex["label"]] for (x, _, _), ex in zip(rows, examples)])    # (4, T)
    targets = np.stack([y[ex["label"]] for (_, y, _), ex in zip(rows, examples)])
    for step in range(1, TRAIN_STEPS + 1):
        gpt2_forward(model, inputs, targets)
        gpt2_zero_grad(model)
        gpt2_backward(model)
        gpt2_update(model, LEARNING_RATE, 0.9, 0.95, 1e-8, 0.0, step)
    assert model.mean_loss < 0.1
    preds, margins = score_all(model, examples, T)
    assert preds == labels
    assert np.all(margins > TRAINED_MARGIN), margins
