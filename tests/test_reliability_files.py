"""
tests/test_reliability_files.py: every file format a trainer or tool reads, damaged every way a
disk, a crash or a hostile hand can damage it, gives one clear error naming the file, never an
"internal error".

For each format a valid small file is written by the project's own writer, then damaged one way
at a time: each of the first header slots set to values a reader may trip on (0, -1, 1, 3, the
int32 extremes, a float NaN's bits); 4- and 8-byte words across the body overwritten with NaN,
infinity, zero, all ones and 2^63; the file cut at a series of lengths; bytes appended. Each
damaged file goes through what the program does with it (the reader, then the consumer: the
loader's restore, the scoring of an eval example, the tokenizer's decode), and the only exception
allowed is InputError: a run prints it as one `error:` line and exits 1 (llmc.cli.run_main),
where any other exception is an "internal error". A reader may also accept the damage where the
file stays valid (a changed parameter value).

The two end-to-end examples of the class run the trainer itself: a state file whose outlier
section holds NaN (a resume), a HellaSwag file with an empty completion (--eval-only -h 1).
Run: pytest tests/test_reliability_files.py (about 20 seconds).
"""

import os
import subprocess
import sys
import types

import numpy as np
import pytest

from llmc import checkpoint, evalloader, formats, tokenizer
from llmc.dataloader import DataLoader
from llmc.outlier import OUTLIER_STATE_FLOATS, OutlierDetector
from llmc.utils import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_SLOTS_DAMAGED = 12              # the slots every format uses lie in the first dozen
SLOT_VALUES = (0, -1, 1, 3, 2**31 - 1, -2**31, 0x7FC00000)
WORDS_DAMAGED = 24                     # body positions overwritten, spread over the file
WORD_VALUES = {4: (0x7FC00000, 0x7F800000, 0, 0xFFFFFFFF), 8: (0x7FF8000000000000, 0, 2**63, 2**64 - 1)}
V = 64                                 # the small vocabulary of these files


def damaged_versions(data, positions=()):
    """(name, bytes) of every damage of the file `data` (see the module's docstring); `positions`:
    byte offsets of fields the format holds there, damaged too."""
    header = formats.HEADER_BYTES
    for slot in range(HEADER_SLOTS_DAMAGED):
        for value in SLOT_VALUES:
            out = bytearray(data)
            out[4 * slot:4 * slot + 4] = np.array([value], "<u4" if value >= 0 else "<i4").tobytes()
            yield f"header slot {slot} = {value}", bytes(out)
    body = len(data) - header
    for size, values in WORD_VALUES.items():
        spread = {header + (body - size) * k // (WORDS_DAMAGED - 1) for k in range(WORDS_DAMAGED)}
        for pos in sorted(spread | set(positions)):
            for value in values:
                out = bytearray(data)
                out[pos:pos + size] = np.array([value], f"<u{size}").tobytes()
                yield f"{size}-byte word at byte {pos} = {value:#x}", bytes(out)
    for cut in sorted({0, 3, header - 1, header, header + 1, header + body // 2, len(data) - 1}):
        yield f"cut at {cut} bytes", data[:cut]
    yield "1 byte appended", data + b"\x00"
    yield "8 bytes appended", data + b"\xff" * 8


def check_every_damage(tmp_path, name, data, consume, positions=()):
    """Write each damaged version of `data` (damaged_versions) to tmp_path/name and run
    consume(path): only InputError may come out, and its message must name the file. Returns how
    many were refused."""
    path = str(tmp_path / name)
    refused, internal = 0, []
    for damage, content in damaged_versions(data, positions):
        with open(path, "wb") as f:
            f.write(content)
        try:
            consume(path)
        except InputError as e:
            refused += 1
            if path not in str(e):
                internal.append(f"{damage}: the message does not name the file: {e}")
        except Exception as e:                                    # noqa: BLE001: the defect this test finds
            internal.append(f"{damage}: {type(e).__name__}: {e}")
    assert not internal, f"{name}: an internal error instead of one line for {len(internal)} damages:\n" + \
        "\n".join(internal[:20])
    return refused


# ----------------------------------------------------------------------------
# the formats: a valid file, and what a program does with it

def tiny_gpt2():
    import gpt2_cpu
    config = gpt2_cpu.GPT2Config(max_seq_len=8, vocab_size=V, padded_vocab_size=V, num_layers=1, num_heads=2,
                                 channels=8)
    model = gpt2_cpu.GPT2(config)
    model.params[...] = np.random.default_rng(0).standard_normal(model.params.size).astype(np.float32)
    return model


def test_gpt2_model_files(tmp_path):
    import gpt2_cpu
    for dtype in ("float32", "bfloat16"):
        gpt2_cpu.write_model(str(tmp_path / "valid.bin"), tiny_gpt2(), dtype)
        data = open(tmp_path / "valid.bin", "rb").read()
        assert check_every_damage(tmp_path, "model.bin", data, gpt2_cpu.read_model) > 0


def test_llama3_model_files(tmp_path):
    import llama3_cpu
    config = llama3_cpu.LlamaConfig(max_seq_len=8, vocab_size=V, num_layers=1, num_heads=2, num_kv_heads=1,
                                    channels=8, multiple_of=4)
    model = llama3_cpu.Llama3(config)
    for layout in (formats.LLAMA3_LAYOUT_BRANCH, formats.LLAMA3_LAYOUT_MASTER):
        llama3_cpu.write_model(str(tmp_path / "valid.bin"), model, "float32", layout)
        data = open(tmp_path / "valid.bin", "rb").read()
        assert check_every_damage(tmp_path, "model.bin", data, llama3_cpu.read_model) > 0


def shards(tmp_path, n=2, tokens=400):
    paths = []
    for i in range(n):
        paths.append(str(tmp_path / f"train_{i:06d}.bin"))
        formats.write_shard(paths[-1], np.random.default_rng(i).integers(0, V, tokens))
    return paths


def test_token_shards(tmp_path):
    formats.write_shard(str(tmp_path / "valid.bin"), np.random.default_rng(0).integers(0, V, 300))

    def consume(path):
        loader = DataLoader(path, 2, 8, vocab_size=V)
        for _ in range(3):
            loader.next_batch()
    assert check_every_damage(tmp_path, "shard.bin", open(tmp_path / "valid.bin", "rb").read(), consume) > 0


def test_training_state_files(tmp_path):
    """A resume reads the state, restores the loader and the outlier detectors from it."""
    pattern = os.path.join(str(tmp_path), "train_*.bin")
    shards(tmp_path)
    B, T, N = 2, 8, 50
    loader = DataLoader(pattern, B, T, shuffle=True, vocab_size=V)
    for _ in range(5):
        loader.next_batch()
    detectors = OutlierDetector(), OutlierDetector()
    for step in range(OUTLIER_STATE_FLOATS):                      # full windows: every slot in use
        detectors[0].update(10.0 - step * 0.01)
        detectors[1].update(1.0 + step % 3)
    outliers = np.concatenate([d.state() for d in detectors])
    rng = np.random.default_rng(1)
    checkpoint.write_state(str(tmp_path / "valid.bin"), 5, 0, 1, rng.standard_normal(N), rng.random(N), loader,
                           sample_rng_state=1337, master_weights=rng.standard_normal(N), outliers=outliers)

    def consume(path):
        state = checkpoint.read_state(path, N, 0, 1)
        DataLoader(pattern, B, T, shuffle=True, vocab_size=V).restore(state["loader"])
        if state["outliers"] is not None:
            for detector, saved in zip((OutlierDetector(), OutlierDetector()), np.split(state["outliers"], 2)):
                detector.restore(saved)
                detector.update(1.0)
    data = open(tmp_path / "valid.bin", "rb").read()
    outlier_fields = [len(data) - 8 * OUTLIER_STATE_FLOATS * 2 // 2 * (2 - d) + 8 * k for d in (0, 1) for k in range(4)]
    assert check_every_damage(tmp_path, "state.bin", data, consume, outlier_fields) > 0


def test_multiple_choice_eval_files(tmp_path):
    """What -h 1 does with the file: read it, check the ids against V, score every example."""
    rng = np.random.default_rng(0)
    examples = [{"index": i, "label": i % 4, "context": rng.integers(0, V, 5).tolist(),
                 "completions": [rng.integers(0, V, 1 + j).tolist() for j in range(4)]} for i in range(3)]
    evalloader.write_eval_file(str(tmp_path / "valid.bin"), examples)
    one_process = types.SimpleNamespace(rank=0, size=1, sum=float)

    def consume(path):
        found = evalloader.read_hellaswag(path, V)
        evalloader.evaluate_multiple_choice(lambda inputs, targets: np.zeros(inputs.shape), found, 8, 16, one_process)
    assert check_every_damage(tmp_path, "eval.bin", open(tmp_path / "valid.bin", "rb").read(), consume) > 0


def test_tokenizer_files(tmp_path):
    token_bytes = [bytes([i]) for i in range(V - 1)] + [b"<|endoftext|>"]
    tokenizer.write_tokenizer(str(tmp_path / "valid.bin"), token_bytes, eot_token=V - 1)

    def consume(path):
        t = tokenizer.Tokenizer(path)
        for token in range(len(t.token_bytes)):
            t.decode([token])
    assert check_every_damage(tmp_path, "tokenizer.bin", open(tmp_path / "valid.bin", "rb").read(), consume) > 0


def test_debug_state_files(tmp_path):
    import gpt2_cpu
    model = tiny_gpt2()
    shapes = gpt2_cpu.parameter_shapes(model.config)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, V, (2, 4)), rng.integers(0, V, (2, 4))
    formats.write_debug_state(str(tmp_path / "valid.bin"), x, y, rng.standard_normal((2, 4, V)), 1.5,
                              [rng.standard_normal(s) for _, s in shapes])
    consume = lambda path: formats.read_debug_state(path, V, shapes)  # noqa: E731
    assert check_every_damage(tmp_path, "debug.bin", open(tmp_path / "valid.bin", "rb").read(), consume) > 0


def test_main_logs(tmp_path):
    """dev/vislog.py's reading of main.log (a text file: the byte damages make it binary or not
    UTF-8, and a few text ones keep it text)."""
    sys.path.insert(0, os.path.join(ROOT, "dev"))
    import vislog
    lines = "".join(f"s:{step} trl:{10 - step / 10:.6f} lr:3.0e-04 norm:1.5\n" for step in range(20)) + "s:20 tel:8.1\n"
    (tmp_path / "valid.log").write_text(lines)
    data = (tmp_path / "valid.log").read_bytes()
    assert check_every_damage(tmp_path, "main.log", data, vislog.parse_log) > 0
    for text_damage in ("s:1 trl:nan\n", "s:-1 trl:1\n", "s:99999999999999999999 trl:1\n", "s:1 trl:1e999\n",
                        "s:1 :\n", "s: trl:1\n", "s:1 trl:1:2\n", "\t\n", "s:1\n", "s:0x10 trl:1\n"):
        (tmp_path / "main.log").write_bytes(data + text_damage.encode())
        try:
            vislog.parse_log(str(tmp_path / "main.log"))
        except InputError as e:
            assert str(tmp_path / "main.log") in str(e)


# ----------------------------------------------------------------------------
# the class's two examples, end to end: one line naming the file and the fault

def run_trainer(args, cwd):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "gpt2_cpu.py")] + args, cwd=cwd, capture_output=True,
                       text=True, timeout=300)
    return r, [line for line in r.stderr.splitlines() if line.strip()]


def test_a_state_file_with_nan_in_its_outlier_section_is_one_line(tmp_path):
    base = ["-e", "d2", "-t", "16", "-b", "2", "-v", "0", "-s", "0", "-o", "run", "-n", "2"]
    r, _ = run_trainer(base + ["-x", "2"], tmp_path)
    assert r.returncode == 0, r.stderr
    state = tmp_path / "run" / "state_00000002_00000.bin"
    data = bytearray(state.read_bytes())
    data[-8 * OUTLIER_STATE_FLOATS:-8 * OUTLIER_STATE_FLOATS + 8] = np.array([np.nan], "<f8").tobytes()  # grad count
    state.write_bytes(bytes(data))
    r, lines = run_trainer(base + ["-x", "4", "-y", "1"], tmp_path)
    assert r.returncode == 1 and len(lines) == 1 and "internal error" not in lines[0], r.stderr
    assert lines[0] == (f"error: {os.path.join('run', 'state_00000002_00000.bin')}: corrupt state file: the "
                        f"grad-norm outlier window's count nan is not an integer in [0, 128]")


def test_a_hellaswag_file_with_an_empty_completion_is_one_line(tmp_path):
    """One example whose fourth completion holds no token (its length field 0): every length in the
    file agrees, so only the empty completion is wrong."""
    context, completions = [464, 3290, 373, 257, 1913], [[318, 257], [1110], [612, 11, 290], []]
    stream = [evalloader.EXAMPLE_START, 0, 0, 1, evalloader.NUM_COMPLETIONS, len(context), *context]
    for completion in completions:
        stream += [len(completion), *completion]
    stream[1] = evalloader.UINT16_BYTES * len(stream)
    header = formats.make_header(evalloader.EVAL_MAGIC, evalloader.EVAL_VERSION,
                                 {evalloader.HEADER_SLOT_NUM_EXAMPLES: 1, evalloader.HEADER_SLOT_LONGEST: stream[1]})
    (tmp_path / "h.bin").write_bytes(header.tobytes() + np.array(stream, "<u2").tobytes())
    r, lines = run_trainer(["-e", "d2", "--eval-only", "-h", "1", "-j", "", "-b", "4", "-t", "32",
                            "--hellaswag-file", "h.bin"], tmp_path)
    assert r.returncode == 1 and len(lines) == 1 and "internal error" not in lines[0], r.stderr
    assert lines[0].startswith("error: h.bin: example 0 (byte 1024): completion 3 is empty"), lines[0]
