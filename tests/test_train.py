"""The training loop through the command line, as a user runs it: real Shakespeare shards, resume,
data parallelism under mpiexec, and the one-line errors for bad input.

A small model file keeps these fast: 2 layers, 2 heads, 32 channels, but the real GPT-2 vocabulary
(so the real token shards work), written by gpt2_cpu itself."""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpt2_cpu as g
from mpi_marks import needs_mpi
from llmc import cli, evalloader, formats, tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = g.GPT2Config(max_seq_len=64, num_layers=2, num_heads=2, channels=32)




def run(args, env=None, mpi=0, timeout=300):
    cmd = [sys.executable, os.path.join(ROOT, "gpt2_cpu.py")] + args
    if mpi:
        cmd = ["mpiexec", "-n", str(mpi)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def losses(stdout):
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", stdout)]


@pytest.fixture(scope="module")
def shakespeare():
    """The real Shakespeare shards (built by dev/data/tinyshakespeare.py if missing)."""
    train = os.path.join(ROOT, "data", "tinyshakespeare", "tiny_shakespeare_train.bin")
    if not os.path.exists(train):
        subprocess.run([sys.executable, os.path.join(ROOT, "dev", "data", "tinyshakespeare.py")], check=True)
    return train, train.replace("_train.bin", "_val.bin")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "small.bin"
    g.write_model(str(path), g.gpt2_init(SMALL, seed=0))
    return str(path)


def test_training_on_shakespeare_lowers_val_loss(shakespeare, small_model, tmp_path):
    train, val = shakespeare
    out = run(["-e", small_model, "-i", train, "-j", val, "-b", "8", "-t", "32", "-x", "60", "-l", "3e-3",
               "-u", "5", "-v", "30", "-m", "8", "-s", "60", "-g", "16", "-o", str(tmp_path)])
    assert out.returncode == 0, out.stderr
    vals = [float(v) for v in re.findall(r"val loss ([0-9.]+)", out.stdout)]
    assert len(vals) == 3
    assert vals[0] > 10.5, "a fresh model is near ln(50257) = 10.8"
    assert vals[-1] < vals[0] - 3.0, f"validation loss should fall clearly, got {vals}"
    assert "generating:" in out.stdout
    log = (tmp_path / "main.log").read_text().splitlines()
    assert log[0].startswith("s:0 tel:") and any(line.startswith("s:59 trl:") for line in log)


def test_resume_equals_straight_run(shakespeare, small_model, tmp_path):
    """6 steps straight == 3 steps, checkpoint, resume, 3 more steps: identical losses."""
    train, _ = shakespeare
    common = ["-e", small_model, "-i", train, "-j", "", "-b", "2", "-t", "32", "-k", "constant",
              "-l", "1e-3", "-s", "0", "--shuffle", "1"]
    straight = run(common + ["-x", "6"])
    assert straight.returncode == 0, straight.stderr
    first = run(common + ["-x", "3", "-n", "3", "-o", str(tmp_path)])
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(tmp_path)) == [".llmc.lock", "DONE_00000003", "config_00000003.json", "main.log",
                                            "model_00000003.bin", "state_00000003_00000.bin"]
    second = run(common + ["-x", "6", "-o", str(tmp_path), "-y", "1"])
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    assert len(losses(straight.stdout)) == 6
    assert losses(first.stdout) + losses(second.stdout) == losses(straight.stdout)


def test_resume_ignores_incomplete_checkpoint(shakespeare, small_model, tmp_path):
    """A checkpoint without its DONE marker (a crash mid-write) is never resumed from."""
    train, _ = shakespeare
    common = ["-e", small_model, "-i", train, "-j", "", "-b", "2", "-t", "16", "-s", "0"]
    assert run(common + ["-x", "2", "-n", "2", "-o", str(tmp_path)]).returncode == 0
    shutil.copy(tmp_path / "model_00000002.bin", tmp_path / "model_00000004.bin")   # step 4 half-written
    out = run(common + ["-x", "3", "-o", str(tmp_path), "-y", "1"])
    assert out.returncode == 0 and "at step 2" in out.stdout


@needs_mpi
def test_mpi_two_ranks_equal_one_process(shakespeare, small_model):
    """mpiexec -n 2 with B=2 equals one process accumulating two micro-batches of B=2. Validation
    runs -m batches per rank (as in llm.c), so 2 ranks x 2 batches cover the windows 1 x 4 does."""
    train, val = shakespeare
    common = ["-e", small_model, "-i", train, "-j", val, "-b", "2", "-t", "32", "-d", "128", "-x", "4",
              "-l", "1e-3", "-s", "0", "-v", "4"]
    one = run(common + ["-m", "4"])
    two = run(common + ["-m", "2"], mpi=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    assert "grad_accum=2" in one.stdout and "processes=2 grad_accum=1" in two.stdout
    a, b = losses(one.stdout), losses(two.stdout)
    assert len(a) == 4 and len(b) == 4, "only rank 0 prints"
    np.testing.assert_allclose(b, a, rtol=1e-6)
    va = [float(v) for v in re.findall(r"val loss ([0-9.]+)", one.stdout)]
    vb = [float(v) for v in re.findall(r"val loss ([0-9.]+)", two.stdout)]
    np.testing.assert_allclose(vb, va, rtol=1e-6)


# ---------------------------------------------------------------------------- bad input

def bad_shard(path, kind):
    formats.write_shard(str(path), np.arange(1000) % 50257)
    raw = path.read_bytes()
    if kind == "magic":
        path.write_bytes(b"\x01\x02\x03\x04" + raw[4:])
    elif kind == "version":
        path.write_bytes(raw[:4] + (7).to_bytes(4, "little") + raw[8:])
    elif kind == "truncated":
        path.write_bytes(raw[:-100])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "short":
        formats.write_shard(str(path), np.arange(10))


@pytest.mark.parametrize("kind,message", [
    ("magic", "bad magic number"), ("version", "unsupported token shard version 7"),
    ("truncated", "truncated or corrupt"), ("empty", "empty data shard"), ("short", "shorter than one batch"),
])
def test_bad_data_gives_one_line(small_model, tmp_path, kind, message):
    path = tmp_path / "bad_train.bin"
    bad_shard(path, kind)
    out = run(["-e", small_model, "-i", str(path), "-j", "", "-b", "2", "-t", "16", "-x", "1"])
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert message in out.stderr and str(path) in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("args,message", [
    (["-i", "/nonexistent/dir/*.bin"], "no data file matches"),
    (["-t", "65"], "exceeds the model's max_seq_len 64"),
    (["-e", "/nonexistent/model.bin"], "no such model checkpoint"),
    (["-e", "d99"], "unknown model 'd99'"),
    (["-d", "100"], "is not a multiple of B*T*processes"),
    (["-y", "1"], "needs -o DIR"),
])
def test_bad_arguments_give_one_line(shakespeare, small_model, args, message):
    train, _ = shakespeare
    base = {"-e": small_model, "-i": train, "-j": "", "-b": "2", "-t": "16", "-x": "1"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    out = run([x for kv in base.items() for x in kv])
    assert out.returncode == 1 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr


def test_bad_model_and_state_files(shakespeare, small_model, tmp_path):
    train, _ = shakespeare
    bad = tmp_path / "bad.bin"
    bad.write_bytes(open(small_model, "rb").read()[:5000])
    out = run(["-e", str(bad), "-i", train, "-j", "", "-x", "1"])
    assert out.returncode == 1 and "truncated" in out.stderr and str(bad) in out.stderr
    # a corrupt state file: resume refuses with one line and leaves every file as it was
    ckpt = tmp_path / "ckpt"
    common = ["-e", small_model, "-i", train, "-j", "", "-b", "2", "-t", "16", "-s", "0"]
    assert run(common + ["-x", "1", "-n", "1", "-o", str(ckpt)]).returncode == 0
    state = ckpt / "state_00000001_00000.bin"
    state.write_bytes(state.read_bytes()[:3000])
    before = {p: (ckpt / p).read_bytes() for p in os.listdir(ckpt) if p != ".llmc.lock"}   # the lock names its holder
    out = run(common + ["-x", "2", "-o", str(ckpt), "-y", "1"])
    assert out.returncode == 1 and "truncated" in out.stderr and str(state) in out.stderr
    assert out.stderr.count("\n") == 1
    assert {p: (ckpt / p).read_bytes() for p in os.listdir(ckpt) if p != ".llmc.lock"} == before, "nothing overwritten"


def test_help_lists_flags():
    out = run(["--help"])
    assert out.returncode == 0
    for flag in ["-i", "-j", "-e", "-o", "-b", "-t", "-d", "-x", "-k", "-l", "-u", "-q", "-c", "-v", "-m",
                 "-s", "-g", "-n", "-y", "-a", "--input-bin", "--learning-rate", "(default: 0.0003)"]:
        assert flag in out.stdout, flag


# ---------------------------------------------------------------------------- sampling and evaluation

def test_generate_from_prompt_is_deterministic(shakespeare, small_model):
    args = ["-e", small_model, "--generate", "12", "--prompt", "ROMEO:", "--top-k", "40", "--temperature", "0.8"]
    a, b = run(args), run(args)
    c = run(args + ["--sample-seed", "7"])
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout != c.stdout
    assert a.stdout.startswith("ROMEO:") and len(a.stdout) > len("ROMEO:\n")
    # the streamed text is the decoded sample of the library call with the same RNG
    model = g.read_model(small_model)
    prompt = tokenizer.gpt2_encoding().encode("ROMEO:")
    ids = g.generate(model, prompt, 12, g.SamplerRNG(cli.SAMPLE_SEED), 0.8, 40)
    assert a.stdout == "ROMEO:" + tokenizer.Tokenizer().decode(ids) + "\n"


@pytest.mark.parametrize("args,message", [
    (["--prompt", "to be " * 40], "longer than max_seq_len 64"),
    (["--tokenizer", "/nonexistent/tok.bin"], "no such tokenizer file"),
    (["-e", "/nonexistent/m.bin"], "no such model checkpoint"),
])
def test_generate_errors(shakespeare, small_model, args, message):
    base = {"-e": small_model, "--generate": "5", "--prompt": "hi"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    out = run([x for kv in base.items() for x in kv])
    assert out.returncode == 1 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert message in out.stderr
    assert out.stdout == "", "nothing (not even the prompt) is printed before the error"


def test_eval_only_hellaswag(shakespeare, small_model, tmp_path):
    """--eval-only -h 1 scores every example once; the accuracy equals scoring by hand."""
    rng = np.random.default_rng(0)
    examples = [{"index": i, "label": int(rng.integers(4)), "context": rng.integers(0, 50257, 5).tolist(),
                 "completions": [rng.integers(0, 50257, int(rng.integers(1, 4))).tolist() for _ in range(4)]}
                for i in range(6)]
    path = tmp_path / "hs.bin"
    evalloader.write_eval_file(str(path), examples)
    train, _ = shakespeare
    out = run(["-e", small_model, "-i", train, "-j", "", "-b", "8", "-t", "16", "-h", "1",
               "--hellaswag-file", str(path), "--eval-only"])
    assert out.returncode == 0, out.stderr
    acc = float(re.search(r"HellaSwag: ([0-9.]+) accuracy over 6 examples", out.stdout).group(1))
    model = g.read_model(small_model)
    correct = 0
    for ex in examples:
        inputs, targets, mask = evalloader.completion_rows(ex, 16)
        g.gpt2_forward(model, inputs, targets)
        correct += evalloader.score_example(model.acts["losses"], mask) == ex["label"]
    assert acc == pytest.approx(correct / 6, abs=1e-4)
    # during training: every -v steps and at the end, logged as s:<step> eval:<acc>
    log_dir = tmp_path / "log"
    out = run(["-e", small_model, "-i", train, "-j", "", "-b", "8", "-t", "16", "-h", "1", "-x", "4", "-v", "2",
               "-s", "0", "--hellaswag-file", str(path), "-o", str(log_dir)])
    assert out.returncode == 0, out.stderr
    evals = [line for line in (log_dir / "main.log").read_text().splitlines() if " eval:" in line]
    assert [e.split()[0] for e in evals] == ["s:2", "s:4"]
    assert all(0.0 <= float(e.split("eval:")[1]) <= 1.0 for e in evals)
    missing = run(["-e", small_model, "-i", train, "-j", "", "-h", "1", "--hellaswag-file", str(tmp_path / "no.bin")])
    assert missing.returncode == 1 and "dev/data/hellaswag.py" in missing.stderr
