"""
tests/test_reliability_flags.py: flags that were accepted and then ignored, or that failed late,
are refused before anything runs, in one `error:` line (issue "Reliability III", sections 3 and 5).

-i names a file whose name has glob characters; --generate -y 1 without -o; --temperature and
--top-k on a training run; --eval-only with nothing to evaluate; a model whose vocabulary is not
the tokenizer's, or does not hold <|endoftext|>, with samples on; dev/bench_cpu.py's bad flags.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import gpt2_cpu as g
from llmc import formats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_V = g.GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=1, num_heads=2, channels=16)


def run(args, script="gpt2_cpu.py", timeout=300):
    return subprocess.run([sys.executable, os.path.join(ROOT, script)] + args, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def one_error_line(r):
    lines = r.stderr.strip().splitlines()
    return r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(a V=100 model, a shard of its ids, a second shard) in one directory."""
    d = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(0)
    formats.write_shard(str(d / "x[1].bin"), rng.integers(0, 100, 3000))
    formats.write_shard(str(d / "x1.bin"), rng.integers(0, 100, 1600))
    g.write_model(str(d / "m.bin"), g.gpt2_init(TINY_V, 0))
    return d


def test_a_data_file_whose_name_has_glob_characters_is_that_file(tiny):
    r = run(["-e", str(tiny / "m.bin"), "-i", str(tiny / "x[1].bin"), "-j", "", "-b", "2", "-t", "16", "-x", "1",
             "-s", "0"])
    assert r.returncode == 0, r.stderr
    assert "train 3,000 tokens in 1 shard(s)" in r.stdout            # not x1.bin's 1,600, which the glob matches


@pytest.mark.parametrize("argv, said", [
    (["--generate", "3", "-y", "1"], "-y 1 needs -o DIR"),
    (["-x", "1", "--temperature", "0.5"], "--temperature 0.5 --top-k 0: they shape --generate's sampling only"),
    (["-x", "1", "--top-k", "5"], "--temperature 1.0 --top-k 5: they shape --generate's sampling only"),
    (["--eval-only", "-j", ""], "--eval-only with -j '' and -h 0: nothing to evaluate"),
])
def test_flags_that_would_be_ignored_are_refused(argv, said):
    r = run(["-e", "d2"] + argv)
    assert one_error_line(r) and said in r.stderr, r.stderr


@pytest.mark.parametrize("tokenizer, said", [
    ("none", "samples start from <|endoftext|> (token 50256), outside the model's vocabulary V=100"),
    (os.path.join(ROOT, "data", "gpt2_tokenizer.bin"), "the tokenizer has 50,257 tokens, but the model's vocabulary is V=100"),
])
def test_a_vocabulary_the_samples_cannot_use_is_refused_before_the_first_step(tiny, tokenizer, said):
    r = run(["-e", str(tiny / "m.bin"), "-i", str(tiny / "x1.bin"), "-j", "", "-b", "2", "-t", "16", "-x", "3",
             "-s", "1", "--tokenizer", tokenizer])
    assert one_error_line(r) and said in r.stderr, r.stderr
    assert "step" not in r.stdout                                    # refused before training, not at the sample
    r = run(["-e", str(tiny / "m.bin"), "-i", str(tiny / "x1.bin"), "-j", "", "-b", "2", "-t", "16", "-x", "1",
             "-s", "0", "--tokenizer", tokenizer])
    assert r.returncode == 0, r.stderr                               # no samples: nothing to refuse


@pytest.mark.parametrize("argv, said", [(["-n", "0"], "-n 0: the number of repeats must be at least 1"),
                                        (["-e", "d99"], "unknown model 'd99'"),
                                        (["-t", "2000"], "T in [1, 1024]"),
                                        (["--zzz"], "unrecognized arguments: --zzz")])
def test_bench_cpu_bad_flags_are_one_line(argv, said):
    r = run(argv, script="dev/bench_cpu.py", timeout=120)
    assert one_error_line(r) and said in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["main.log", ".llmc.lock"])
@pytest.mark.parametrize("resume", [False, True])
def test_a_fifo_where_a_run_opens_a_file_is_refused_not_waited_on(tiny, tmp_path, name, resume):
    out = tmp_path / "run"
    flags = ["-e", str(tiny / "m.bin"), "-i", str(tiny / "x1.bin"), "-j", "", "-b", "2", "-t", "16", "-s", "0",
             "-o", str(out)]
    if resume:
        assert run(flags + ["-x", "1", "-n", "1"]).returncode == 0
        os.remove(out / name)
    else:
        out.mkdir()
    os.mkfifo(out / name)
    r = run(flags + ["-x", "2", "-n", "1"] + (["-y", "1"] if resume else []), timeout=60)
    assert one_error_line(r) and f"{name}: the " in r.stderr and "is not a regular file" in r.stderr, r.stderr


def test_a_main_log_that_is_not_text_is_one_line_on_resume(tiny, tmp_path):
    out = tmp_path / "run"
    flags = ["-e", str(tiny / "m.bin"), "-i", str(tiny / "x1.bin"), "-j", "", "-b", "2", "-t", "16", "-s", "0",
             "-o", str(out), "-n", "1"]
    assert run(flags + ["-x", "1"]).returncode == 0
    (out / "main.log").write_bytes(b"s:0 trl:1.0\n\xff\xfe garbage\n")
    r = run(flags + ["-x", "2", "-y", "1"])
    assert one_error_line(r) and "main.log: not a main.log (byte 12 is not UTF-8)" in r.stderr, r.stderr


def test_check_gpt2_losses_from_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "losses")
    code = ("import sys; sys.path[:0] = [%r, %r]; import check_gpt2\n"
            "try:\n    check_gpt2.read_expected_losses(%r)\n"
            "except check_gpt2.InputError as e:\n    print(e)\n") % (ROOT, os.path.join(ROOT, "tests"),
                                                                   str(tmp_path / "losses"))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and "is not a regular file" in r.stdout, r.stdout + r.stderr


def test_a_run_refused_at_start_moves_nothing_of_the_previous_run(tiny, tmp_path):
    out = tmp_path / "run"
    flags = ["-e", str(tiny / "m.bin"), "-i", str(tiny / "x1.bin"), "-j", "", "-b", "2", "-t", "16", "-o", str(out)]
    assert run(flags + ["-x", "1", "-n", "1", "-s", "0"]).returncode == 0
    before = sorted(os.listdir(out))
    r = run(flags + ["-x", "1", "-s", "1", "--tokenizer", "none"])          # refused: <|endoftext|> outside V
    assert one_error_line(r), r.stderr
    assert sorted(os.listdir(out)) == before                                 # no previous_run_1/: nothing moved


def test_a_move_aside_that_fails_half_way_leaves_the_old_run_whole(tmp_path, monkeypatch):
    """The third of five moves fails (as a full or read-only disk would make it): the two files
    already moved go back, the half-made previous_run_1/ goes, and the refusal is one line."""
    from llmc import checkpoint
    from llmc.utils import InputError
    names = ["DONE_00000001", "config_00000001.json", "main.log", "model_00000001.bin", "state_00000001_00000.bin"]
    for name in names:
        (tmp_path / name).write_text(f"the old run's {name}")
    real_replace, calls = os.replace, []

    def failing_replace(src, dst):
        calls.append(src)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", failing_replace)
    with pytest.raises(InputError, match="could not move the previous run's files aside .* left in place"):
        checkpoint.move_previous_run_aside(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == names
    assert all((tmp_path / n).read_text() == f"the old run's {n}" for n in names)
