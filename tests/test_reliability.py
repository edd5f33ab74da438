"""Reliability of every command under hostile use, the suite of record for the README's promise
("What a run promises"): no hang, no traceback, no silent wrong result, no lost file, resume exact
or refused. The first sections are the earlier cases (one error on one MPI rank, resume checks,
one-line errors, litter, nonsense flags, outlier skipping); then one section per class of
issue 19, each a parametrized test, so a new hostile case is one more line in its list:
    class 1  a job never hangs (a fault injected on rank 1 only under mpiexec -n 2)
    class 2  every value read is validated (token ids, shards changed while read, the gradient
             norm in float64, state sections, non-finite weights, loss and norm, every flag)
    class 3  a run never touches what is not its own (cleanup, the -o lock, an old run moved aside)
    class 4  resume is exact or refused (changed flags, equality with the straight run, main.log,
             --eval-only -y 1, rotation across a resume)
    class 5  the other commands (export_hf, check_gpt2, vislog, HellaSwag, generation, -m -1)
The same loop (llmc/cli.py) serves gpt2_cuda.py; tests/test_cuda.py runs it through its NumPy
stand-ins. Most cases call gpt2_cpu.main(argv) in process; a subprocess only where the process
itself is what is tested (mpiexec, a signal, the terminal's encoding, a held lock).

A small model keeps these fast: 2 layers, 2 heads, 32 channels, the real GPT-2 vocabulary, tiny
shards written with llmc.formats into tmp_path.
Run: pytest tests/test_reliability.py   (about six minutes on 2 shared cores, two of them the
outlier test's 136-step runs)
"""

import errno
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import gpt2_cpu as g
from mpi_marks import needs_mpi
from llmc import checkpoint, formats
from llmc.outlier import OUTLIER_WINDOW, OutlierDetector, skip_reason
from llmc.utils import atomic_write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = g.GPT2Config(max_seq_len=64, num_layers=2, num_heads=2, channels=32)
TRAIN = os.path.join(ROOT, "data", "tinyshakespeare", "tiny_shakespeare_train.bin")




def run(args, mpi=0, timeout=300):
    cmd = [sys.executable, os.path.join(ROOT, "gpt2_cpu.py")] + args
    if mpi:
        cmd = ["mpiexec", "-n", str(mpi)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def losses(stdout):
    return [float(x) for x in re.findall(r"\| loss ([0-9.]+)", stdout)]


def one_error_line(out):
    """Exit 1 with exactly one `error:` line on stderr and no traceback."""
    lines = out.stderr.strip().splitlines()
    return out.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr


@pytest.fixture(scope="module")
def data():
    if not os.path.exists(TRAIN):
        subprocess.run([sys.executable, os.path.join(ROOT, "dev", "data", "tinyshakespeare.py")], check=True)
    return TRAIN


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "small.bin"
    g.write_model(str(path), g.gpt2_init(SMALL, seed=0))
    return str(path)


def common(model, data, **extra):
    args = {"-e": model, "-i": data, "-j": "", "-b": "2", "-t": "16", "-s": "0", "-k": "constant", "-l": "1e-3"}
    args.update(extra)
    return [x for kv in args.items() for x in kv]


# ----------------------------------------------------------------------------
# 1. an error on one rank ends every rank

@needs_mpi
def test_error_on_one_rank_ends_the_job(data, small_model, tmp_path):
    out = run(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(tmp_path)}), mpi=2)
    assert out.returncode == 0, out.stderr
    os.remove(tmp_path / "state_00000002_00001.bin")           # rank 1 will fail, rank 0 will not
    start = time.monotonic()
    out = run(common(small_model, data, **{"-x": "4", "-o": str(tmp_path), "-y": "1"}), mpi=2, timeout=120)
    assert time.monotonic() - start < 60, "the job must end within seconds, not hang"
    assert out.returncode != 0
    assert "state_00000002_00001.bin: no such state file" in out.stderr


# ----------------------------------------------------------------------------
# 2. resume never silently continues another run

def test_resume_checks_the_model_and_the_step(data, small_model, tmp_path):
    out = run(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(tmp_path)}))
    assert out.returncode == 0, out.stderr
    other = run(common("d2", data, **{"-x": "4", "-o": str(tmp_path), "-y": "1"}))
    assert one_error_line(other)
    assert "-e d2" in other.stderr and "L=2 NH=2 C=32" in other.stderr and "L=2 NH=4 C=128" in other.stderr
    done = run(common(small_model, data, **{"-x": "2", "-o": str(tmp_path), "-y": "1"}))
    assert done.returncode == 0 and "at or past -x 2: nothing to train" in done.stdout and not losses(done.stdout)
    more = run(common(small_model, data, **{"-x": "3", "-o": str(tmp_path), "-y": "1"}))
    assert more.returncode == 0 and "at step 2" in more.stdout and len(losses(more.stdout)) == 1
    assert "L=2 NH=2 C=32" in more.stdout, "the banner describes the model loaded"


# ----------------------------------------------------------------------------
# 3. --shuffle must match the checkpoint

@pytest.mark.parametrize("before,after", [("0", "1"), ("1", "0")])
def test_resume_with_other_shuffle_is_refused(data, small_model, tmp_path, before, after):
    out = run(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(tmp_path), "--shuffle": before}))
    assert out.returncode == 0, out.stderr
    out = run(common(small_model, data, **{"-x": "3", "-o": str(tmp_path), "-y": "1", "--shuffle": after}))
    assert one_error_line(out)
    assert f"written with --shuffle {before}" in out.stderr


# ----------------------------------------------------------------------------
# 4. one line, never a traceback

def test_output_dir_that_cannot_be_written(data, small_model, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out_dir in (a_file, a_file / "sub"):
        out = run(common(small_model, data, **{"-x": "1", "-o": str(out_dir)}))
        assert one_error_line(out)
        assert f"-o {out_dir}: cannot write there" in out.stderr


def test_disk_full_while_checkpointing(data, small_model, tmp_path, monkeypatch, capsys):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    code = g.main(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and err[0].startswith("error: ") and "No space left" in err[0]
    assert sorted(os.listdir(tmp_path)) == [".llmc.lock", "main.log"], "no temporary file and no checkpoint left behind"


def test_model_header_with_impossible_dimensions(data, tmp_path):
    path = tmp_path / "huge.bin"
    header = formats.make_header(formats.MODEL_MAGIC, formats.MODEL_VERSION_FP32,
                                 {2: 1024, 3: 50257, 4: 100000, 5: 12, 6: 76800, 7: 50304})
    path.write_bytes(header.tobytes() + b"\0" * 400)
    out = run(["-e", str(path), "-i", data, "-x", "1"])
    assert one_error_line(out)
    assert "truncated" in out.stderr and "parameters" in out.stderr


def test_state_file_with_a_negative_step(data, small_model, tmp_path):
    out = run(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)}))
    assert out.returncode == 0, out.stderr
    path = tmp_path / "state_00000001_00000.bin"
    raw = bytearray(path.read_bytes())
    raw[4 * checkpoint.STATE_SLOT_STEP:4 * checkpoint.STATE_SLOT_STEP + 4] = np.int32(-3).tobytes()
    path.write_bytes(bytes(raw))
    out = run(common(small_model, data, **{"-x": "2", "-o": str(tmp_path), "-y": "1"}))
    assert one_error_line(out) and "step -3" in out.stderr


# ----------------------------------------------------------------------------
# 5. litter: stale temporaries, checkpoint rotation

def test_stale_temporaries_are_removed_at_start(data, small_model, tmp_path):
    stale = [tmp_path / "model_00000004.bin.tmp12345", tmp_path / "state_00000004_00000.bin.tmp999"]
    for path in stale:
        path.write_bytes(b"\0" * 1000)
    keep = tmp_path / "notes.tmp"                               # not ours: no pid suffix
    keep.write_text("mine")
    out = run(common(small_model, data, **{"-x": "1", "-o": str(tmp_path)}))
    assert out.returncode == 0, out.stderr
    assert not any(p.exists() for p in stale) and keep.exists()


def test_checkpoint_rotation_keeps_newest_and_major(data, small_model, tmp_path):
    out = run(common(small_model, data, **{"-x": "10", "-n": "2", "-nk": "2", "-nm": "4", "-o": str(tmp_path)}))
    assert out.returncode == 0, out.stderr
    steps = sorted(int(name[5:]) for name in os.listdir(tmp_path) if name.startswith("DONE_"))
    assert steps == [4, 8, 10], "the newest two (8, 10) and the major ones (4, 8); 2 and 6 deleted"
    for step in (2, 6):
        assert not any(name.startswith((f"model_{step:08d}", f"state_{step:08d}")) for name in os.listdir(tmp_path))
    out = run(common(small_model, data, **{"-x": "12", "-o": str(tmp_path), "-y": "1", "-n": "2", "-nk": "2"}))
    assert out.returncode == 0 and "at step 10" in out.stdout, out.stderr


# ----------------------------------------------------------------------------
# 6. nonsense flags: one line each, nothing created

@pytest.mark.parametrize("flags,message", [
    (["-x", "0"], "-x 0"), (["-x", "-5"], "-x -5"), (["-d", "-8"], "-d -8"), (["-d", "0"], "-d 0"),
    (["-n", "5"], "needs -o"), (["-l", "nan"], "-l nan"), (["-l", "-0.001"], "-l -0.001"),
    (["--temperature", "-1"], "--temperature -1"), (["--seed", "-1"], "--seed -1"),
    (["--sample-seed", "0"], "--sample-seed 0"), (["-q", "2"], "-q 2"), (["-m", "0"], "-m 0"),
])
def test_nonsense_flags(data, small_model, flags, message):
    out = run(["-e", small_model, "-i", data] + flags)
    assert one_error_line(out)
    assert message in out.stderr


def test_resume_into_a_new_directory_creates_nothing(data, small_model, tmp_path):
    new = tmp_path / "new"
    out = run(common(small_model, data, **{"-x": "1", "-o": str(new), "-y": "1"}))
    assert one_error_line(out) and "no complete checkpoint" in out.stderr
    assert not new.exists()


def test_sampler_rng_refuses_a_zero_state():
    with pytest.raises(ValueError):
        g.SamplerRNG(0)


def test_llmc_defaults_with_newcomer_overrides():
    args = g.parse_args([])
    assert (args.final_lr_frac, args.seq_len, args.max_steps, args.model) == (0.0, 64, 400, "d4")   # newcomer run
    parser = g.build_parser("gpt2_cpu.py", "", g.LR_SCHEDULES)
    llmc_defaults = {a.dest: a.default for a in parser._actions}
    assert llmc_defaults["batch_size"] == 4 and llmc_defaults["learning_rate"] == 3e-4     # llm.c's, untouched
    help_text = " ".join(parser.format_help().split())                     # unwrapped
    assert "[llm.c's default: 1.0; this trainer's newcomer run sets it]" in help_text       # -q
    assert "[llm.c's default: 1024; this trainer's newcomer run sets it]" in help_text      # -t


# ----------------------------------------------------------------------------
# outlier skipping (-sl, -sg)

def test_outlier_detector_matches_numpy():
    rng = np.random.default_rng(0)
    values = rng.standard_normal(300) + 5.0
    d = OutlierDetector()
    z = [d.update(float(v)) for v in values]
    assert all(math.isnan(x) for x in z[:OUTLIER_WINDOW])
    for i in (OUTLIER_WINDOW, 200, 299):
        window = values[i - OUTLIER_WINDOW + 1:i + 1]         # the last 128 values, the new one included
        assert z[i] == pytest.approx((values[i] - window.mean()) / window.std(), rel=1e-9)
    assert skip_reason(3.5, 0.0, 3.0, 0.0).startswith("skipping update due to loss z-score of 3.5")
    assert skip_reason(1.0, 9.0, 3.0, 5.0).startswith("skipping update due to grad z-score of 9.0")
    assert skip_reason(math.nan, math.nan, 1.0, 1.0) is None and skip_reason(9.0, 9.0, 0.0, 0.0) is None


def test_outlier_skipping_prints_and_resumes_exactly(data, small_model, tmp_path):
    steps, half = OUTLIER_WINDOW + 8, OUTLIER_WINDOW + 4
    flags = {"-t": "8", "-b": "1", "-sg": "0.001"}
    straight = run(common(small_model, data, **flags, **{"-x": str(steps)}))
    assert straight.returncode == 0, straight.stderr
    z_lines = re.findall(r"\| loss [0-9.]+ \(([+-][0-9.]+)z\) \| norm [0-9.]+ \(([+-][0-9.]+)z\)", straight.stdout)
    assert len(z_lines) == steps - OUTLIER_WINDOW, "z-scores once the window is full (from step 129)"
    assert "skipping update due to grad z-score" in straight.stdout
    first = run(common(small_model, data, **flags, **{"-x": str(half), "-n": str(half), "-o": str(tmp_path)}))
    second = run(common(small_model, data, **flags, **{"-x": str(steps), "-o": str(tmp_path), "-y": "1"}))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    skips = [out.stdout.count("skipping update") for out in (first, second, straight)]
    assert skips[0] + skips[1] == skips[2] >= 1
    assert losses(first.stdout) + losses(second.stdout) == losses(straight.stdout)
    tail = lambda out: re.findall(r"step +\d+/\d+ \| .*?\| lr", out)   # noqa: E731
    assert tail(second.stdout) == tail(straight.stdout)[half:], "the same z-scores after the resume"


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    def boom(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        atomic_write(str(tmp_path / "x.bin"), boom)
    assert os.listdir(tmp_path) == []


# ============================================================================
# The suite of record for issue 19: hostile use of every command, one class per section, one
# line per case. Each class states the promise it checks.

def in_process(argv, capsys):
    """gpt2_cpu.main(argv) in this process (much faster than a subprocess): (exit code, stdout,
    stderr lines)."""
    code = g.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err.strip().splitlines()


def one_line(code, err):
    """The promise for bad input: exit 1 and exactly one `error:` line."""
    return code == 1 and len(err) == 1 and err[0].startswith("error: ")


# ----------------------------------------------------------------------------
# class 1: a job never hangs: any exception on any MPI rank ends every rank within seconds

FAULT_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import gpt2_cpu
if os.environ.get("PMI_RANK", "0") == "1":                  # rank 1 only: rank 0 waits in a collective
    def broken(*args, **kwargs):
        raise {exc}("injected fault")
    gpt2_cpu.gpt2_backward = broken
sys.exit(gpt2_cpu.main(sys.argv[1:]))
"""


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="no mpiexec (pip install mpich mpi4py)")
@pytest.mark.parametrize("exc,said", [("RuntimeError", "RuntimeError: injected fault"),
                                      ("ZeroDivisionError", "ZeroDivisionError: injected fault"),
                                      ("KeyError", "KeyError: 'injected fault'"), ("MemoryError", "out of memory")])
def test_any_exception_on_one_rank_ends_the_job(data, small_model, tmp_path, exc, said):
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT.format(root=ROOT, exc=exc))
    cmd = ["mpiexec", "-n", "2", sys.executable, str(script)] + common(small_model, data, **{"-x": "3", "-v": "0"})
    start = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung: rank 0 still waits in the all-reduce rank 1 never reached")
    assert time.monotonic() - start < 60
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    ours = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and ours[0].startswith("error: rank 1: ") and said in ours[0], out.stderr


# ----------------------------------------------------------------------------
# class 2: every value read is validated before it is used

V, VP = SMALL.vocab_size, SMALL.padded_vocab_size


def shard(tmp_path, name, n=400, bad_at=None, bad=None, seed=0):
    """A shard of n random token ids in [0, 1000) in tmp_path, with `bad` at position bad_at."""
    tokens = np.random.default_rng(seed).integers(0, 1000, n)
    if bad_at is not None:
        tokens[bad_at] = bad
    path = tmp_path / name
    formats.write_shard(str(path), tokens)
    return str(path)


# B=2, T=16: the first window is tokens 0..32; token 32 is only ever a target
@pytest.mark.parametrize("bad_at,bad", [(32, VP), (32, V), (32, VP - 1), (5, V), (399, 65535), (200, VP + 7)])
@pytest.mark.parametrize("split", ["-i", "-j"])
def test_token_ids_outside_the_vocabulary(small_model, tmp_path, capsys, bad_at, bad, split):
    good, bad_path = shard(tmp_path, "good.bin"), shard(tmp_path, "bad.bin", bad_at=bad_at, bad=bad)
    files = {"-i": good, "-j": good, split: bad_path}
    code, out, err = in_process(common(small_model, files["-i"], **{"-j": files["-j"], "-x": "3", "-v": "2"}), capsys)
    assert one_line(code, err), err
    assert "bad.bin" in err[0] and f"token id {bad}" in err[0] and f"position {bad_at}" in err[0], err
    assert "loss inf" not in out and "loss nan" not in out


def test_forward_checks_the_targets_too():
    model = g.gpt2_init(SMALL, seed=0)
    inputs = np.zeros((1, 4), np.int32)
    for target in (V, VP, -1):
        with pytest.raises(g.InputError, match="target"):
            g.gpt2_forward(model, inputs, np.full((1, 4), target, np.int32))


TRUNCATE_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from llmc.dataloader import DataLoader
from llmc.utils import InputError
loader = DataLoader({path!r}, 2, 16, vocab_size=50257)
loader.next_batch()
{change}
try:
    for _ in range(40):
        loader.next_batch()
except InputError as e:
    print("error:", e)
"""


@pytest.mark.parametrize("change", [
    "os.truncate(loader_path, 1024 + 50)",                                      # truncated while read
    "os.truncate(loader_path, 0)",
    "open(loader_path, 'r+b').write(b'garbage' * 10)",                          # header rewritten in place
])
def test_shard_changed_while_read(tmp_path, change):
    path = shard(tmp_path, "s.bin", n=2000)
    code = TRUNCATE_SCRIPT.format(root=ROOT, path=path, change=change.replace("loader_path", repr(path)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"killed by signal {-out.returncode}" if out.returncode < 0 else out.stderr
    assert out.stdout.startswith("error: ") and "s.bin" in out.stdout, out.stdout + out.stderr


def test_grad_norm_sums_its_chunks_in_float64():
    """The norm is float32 dot products of GRAD_NORM_CHUNK values added in float64: against the exact
    sum of squares (math.fsum) it is off by a chunk's float32 rounding, about sqrt(16K) * 2^-24 ~ 1e-5
    at worst for a sequential sum (BLAS's blocked sums do better), where one float32 sum over a d12's
    124M values drifts by ~1e-4."""
    model = g.gpt2_init(SMALL, seed=0)
    rng = np.random.default_rng(1)
    model.grads[...] = rng.standard_normal(model.grads.size).astype(np.float32) * 1e-2 + 3e-3
    assert model.grads.size > 8 * g.GRAD_NORM_CHUNK                     # several chunks
    reference = math.sqrt(math.fsum(float(x) * float(x) for x in model.grads[::1]))
    assert g.gpt2_grad_norm(model) == pytest.approx(reference, rel=1e-5)


def checkpointed(small_model, data, tmp_path, capsys, **extra):
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(tmp_path), **extra}), capsys)
    assert code == 0, err
    return tmp_path / "state_00000002_00000.bin"


def rewrite_state(path, edit):
    """Read a state file's bytes, let edit(raw) change them in place, write them back."""
    raw = bytearray(path.read_bytes())
    edit(raw)
    path.write_bytes(bytes(raw))


def shuffle_sections(raw):
    """Byte offsets of a shuffled state file's sections after m and v: shard_order, sample_order
    (int32 each) and the PCG64 increment's low word (uint64)."""
    at = formats.HEADER_BYTES + 2 * 4 * NUM_PARAMETERS
    ns = int(np.frombuffer(raw, "<u8", 1, at)[0])
    nb_at = at + 8 + 4 * ns
    nb = int(np.frombuffer(raw, "<u8", 1, nb_at)[0])
    rng_at = nb_at + 8 + 4 * nb                                  # state hi, state lo, inc hi, inc lo
    return {"shard_order": at + 8, "sample_order": nb_at + 8, "inc_lo": rng_at + 24}


NUM_PARAMETERS = g.num_elements(g.parameter_shapes(SMALL))


def put(raw, offset, value):
    """Overwrite the bytes of numpy scalar `value` at offset."""
    raw[offset:offset + value.nbytes] = value.tobytes()


def shard_out_of_range(raw):
    put(raw, shuffle_sections(raw)["shard_order"], np.int32(5))


def negative_sample(raw):
    put(raw, shuffle_sections(raw)["sample_order"], np.int32(-4))


def repeated_sample(raw):
    at = shuffle_sections(raw)["sample_order"]
    put(raw, at + 4, np.frombuffer(raw, "<i4", 1, at)[0])


def even_rng_increment(raw):
    put(raw, shuffle_sections(raw)["inc_lo"], np.uint64(2))


def step_not_the_name(raw):
    put(raw, 4 * checkpoint.STATE_SLOT_STEP, np.int32(7))


@pytest.mark.parametrize("corrupt,said", [
    (shard_out_of_range, "shard order"), (negative_sample, "sample order"), (repeated_sample, "sample order"),
    (even_rng_increment, "shuffle RNG state"), (step_not_the_name, "step 7"),
])
def test_corrupt_state_sections(data, small_model, tmp_path, capsys, corrupt, said):
    path = checkpointed(small_model, data, tmp_path, capsys, **{"--shuffle": "1"})
    rewrite_state(path, corrupt)
    code, out, err = in_process(common(small_model, data, **{"-x": "3", "-o": str(tmp_path), "-y": "1",
                                                            "--shuffle": "1"}), capsys)
    assert one_line(code, err) and said in err[0] and "state_00000002_00000.bin" in err[0], err


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_model_file_with_non_finite_weights(data, tmp_path, capsys, value):
    model = g.gpt2_init(SMALL, seed=0)
    model.params[1234] = value
    path = tmp_path / "bad.bin"
    g.write_model(str(path), model)
    code, out, err = in_process(common(str(path), data, **{"-x": "1"}), capsys)
    assert one_line(code, err) and "bad.bin" in err[0] and "not finite" in err[0], err


def test_diverging_run_stops_naming_the_step(data, small_model, capsys):
    code, out, err = in_process(common(small_model, data, **{"-x": "4", "-l": "1e30"}), capsys)
    assert one_line(code, err) and re.search(r"step \d+: ", err[0]) and "not finite" in err[0], err
    assert not re.search(r"loss (nan|inf)", out)


@pytest.mark.parametrize("skip", [{"-sl": "3"}, {"-sg": "3"}])
def test_diverging_steps_are_skipped_with_sl_sg(data, small_model, capsys, skip):
    code, out, err = in_process(common(small_model, data, **{"-x": "4", "-l": "1e30", **skip}), capsys)
    assert code == 0, err
    assert re.search(r"skipping update due to a non-finite (loss|grad norm) at step \d+", out), out


@pytest.mark.parametrize("flags,said", [
    (["-b", "abc"], "-b/--batch-size: invalid int value: 'abc'"), (["-x", "1.5"], "invalid int value: '1.5'"),
    (["-k", "nope"], "invalid choice: 'nope'"), (["--shuffle", "2"], "invalid choice: 2"),
    (["-y", "7"], "invalid choice: 7"), (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["-l", "fast"], "invalid float value: 'fast'"), (["-b"], "expected one argument"),
    (["--seed", str(2 ** 64)], f"--seed {2 ** 64}"), (["--sample-seed", str(2 ** 64)], f"--sample-seed {2 ** 64}"),
    (["-d", "1000000000", "-x", "-1"], "-d 1000000000"), (["-b", str(2 ** 40)], f"-b {2 ** 40}"),
    (["-d", str(2 ** 62)], f"-d {2 ** 62}"), (["-t", str(2 ** 40)], f"-t {2 ** 40}"),
])
def test_every_flag_error_is_one_line(data, small_model, flags, said, capsys):
    code, out, err = in_process(["-e", small_model, "-i", data, "-j", "", "-t", "16", "-v", "0"] + flags, capsys)
    assert one_line(code, err) and said in err[0], err
    assert "usage:" not in out


# ----------------------------------------------------------------------------
# class 3: a run never touches what is not its own

def dead_pid():
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("name,removed", [
    ("model_00000004.bin.tmp{dead}", True), ("state_00000004_00000.bin.tmp{dead}", True),
    ("DONE_00000004.tmp{dead}", True),
    ("model_00000004.bin.tmp{live}", False),                   # a live process's temporary: still being written
    ("notes.tmp2024", False), ("notes.tmp{dead}", False),      # a user's files: not a name this program writes
    ("model_final.bin.tmp{dead}", False), ("data.bin.tmp{dead}", False),
])
def test_start_up_cleanup_removes_only_its_own_dead_temporaries(data, small_model, tmp_path, capsys, name, removed):
    path = tmp_path / name.format(dead=dead_pid(), live=os.getppid())
    path.write_bytes(b"\0" * 100)
    code, out, err = in_process(common(small_model, data, **{"-x": "1", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    assert path.exists() != removed


HOLD_LOCK = """
import sys, time
sys.path.insert(0, {root!r})
from llmc.utils import lock_directory
lock = lock_directory({out!r})
print("locked", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("resume", ["0", "1"])
def test_second_run_on_one_output_dir_refuses(data, small_model, tmp_path, capsys, resume):
    code, out, err = in_process(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    def files():                                               # the run's files (the lock file is the holder's)
        return {p: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name != ".llmc.lock"}
    before = files()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=ROOT, out=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "1", "-o": str(tmp_path),
                                                                "-y": resume}), capsys)
        assert one_line(code, err) and f"pid {holder.pid}" in err[0] and "another run" in err[0], err
        assert files() == before, "nothing touched"
    finally:
        holder.kill()                                          # kill -9: the kernel drops its lock
        holder.wait()
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "1", "-o": str(tmp_path),
                                                            "-y": resume}), capsys)
    assert code == 0, err


@pytest.mark.parametrize("resume", ["0", "1"])
def test_a_live_run_whose_lock_file_was_deleted_keeps_its_directory(data, small_model, tmp_path, capsys, resume):
    """The user deletes -o/.llmc.lock while a run lives: the lock file is not all that says the run
    lives (its directory is locked too), so a second run is refused and moves nothing aside."""
    code, out, err = in_process(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK.format(root=ROOT, out=str(tmp_path))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        (tmp_path / ".llmc.lock").unlink()
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "1", "-o": str(tmp_path),
                                                                "-y": resume}), capsys)
        assert one_line(code, err), err
        assert err[0] == f"error: -o {tmp_path}: another run is using this directory: wait for it to end, or use " \
                         f"another -o"
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "nothing moved aside, nothing written"
    finally:
        holder.kill()
        holder.wait()
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "1", "-o": str(tmp_path)}), capsys)
    assert code == 0 and "moved them to" in out, err                # the run is dead now: its files go aside


def test_fresh_run_into_an_old_runs_directory_moves_it_aside(data, small_model, tmp_path, capsys):
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    old = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if not name.startswith(".")}
    code, out, err = in_process(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    aside = tmp_path / "previous_run_1"
    assert f"moved them to {aside}" in out
    assert {name: (aside / name).read_bytes() for name in os.listdir(aside)} == old, "the old run, intact"
    assert not (tmp_path / "DONE_00000002").exists()
    code, out, err = in_process(common(small_model, data, **{"-x": "3", "-o": str(tmp_path), "-y": "1"}), capsys)
    assert code == 0 and "at step 1" in out, "the resume continues the newer run, not the old one"


# ----------------------------------------------------------------------------
# class 4: resume is exact or refused

@pytest.mark.parametrize("change,said", [
    ({"-b": "1"}, "-b 2"), ({"-t": "8"}, "-t 16"), ({"-d": "64"}, "-d 32"), ({"-l": "2e-3"}, "-l 0.001"),
    ({"-k": "cosine"}, "-k constant"), ({"-u": "3"}, "-u 0"), ({"-q": "0.5"}, "-q 0.0"), ({"-c": "0.1"}, "-c 0.0"),
    ({"--grad-clip": "0.5"}, "--grad-clip 1.0"), ({"--seed": "7"}, "--seed 42"), ({"-sl": "2"}, "-sl 0.0"),
    ({"-a": "1"}, "-a 0"), ({"-i": "other"}, "-i"),
])
def test_resume_that_changes_the_result_is_refused(data, small_model, tmp_path, capsys, change, said):
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "1", "-o": str(tmp_path / "run")}), capsys)
    assert code == 0, err
    if change.get("-i") == "other":
        change = {"-i": shard(tmp_path, "other.bin", n=5000)}
    args = common(small_model, data, **{"-x": "3", "-o": str(tmp_path / "run"), "-y": "1", **change})
    code, out, err = in_process(args, capsys)
    assert one_line(code, err) and said in err[0] and "resumed from" not in out, err


@pytest.mark.parametrize("change", [{"-v": "1"}, {"-s": "1"}, {"-n": "3"}, {"-g": "4"}, {"-x": "9"}, {"-nk": "1"}])
def test_resume_with_flags_that_do_not_change_the_result(data, small_model, tmp_path, capsys, change):
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    code, out, err = in_process(common(small_model, data, **{"-x": "3", "-o": str(tmp_path), "-y": "1", **change}), capsys)
    assert code == 0 and "at step 2" in out, err


def comparable(stdout, out_dir):
    """stdout without timings and with the output directory's name taken out."""
    stdout = re.sub(r"\| [0-9.]+ ms \| [0-9]+ tok/s", "", stdout.replace(str(out_dir), "D"))
    return stdout.splitlines()


def test_resumed_run_equals_the_straight_run(data, small_model, tmp_path, capsys):
    """The checkpoint falls on a multiple of -s and -v: the sample, the validation and the state
    after the resume are the straight run's, and so are every file and every line."""
    flags = {"-s": "4", "-v": "4", "-n": "4", "-g": "8", "--shuffle": "1", "--tokenizer": "none"}
    straight, split = tmp_path / "straight", tmp_path / "split"
    code, s_out, err = in_process(common(small_model, data, **flags, **{"-x": "8", "-o": str(straight)}), capsys)
    assert code == 0, err
    code, first, err = in_process(common(small_model, data, **flags, **{"-x": "4", "-o": str(split)}), capsys)
    assert code == 0, err
    code, second, err = in_process(common(small_model, data, **flags, **{"-x": "8", "-o": str(split), "-y": "1"}), capsys)
    assert code == 0, err
    s_lines, r_lines = comparable(s_out, straight), comparable(second, split)
    after = r_lines.index(next(line for line in r_lines if line.startswith("resumed from")))
    from_4 = s_lines.index("checkpoint written: step 4 in D")
    assert r_lines[after + 1:] == s_lines[from_4 + 1:]
    for name in sorted(os.listdir(straight)):
        if not name.startswith(".") and name != "config_00000004.json":    # that one records the first run's -x 4
            assert (straight / name).read_bytes() == (split / name).read_bytes(), name


def test_resume_after_a_crash_rewrites_main_log(data, small_model, tmp_path, capsys):
    """A run killed after its checkpoint at step 2 had logged steps 3 and 4: the resume from step 2
    logs them again, once."""
    code, out, err = in_process(common(small_model, data, **{"-x": "4", "-n": "2", "-v": "2", "-o": str(tmp_path / "a")}), capsys)
    assert code == 0, err
    straight_log = (tmp_path / "a" / "main.log").read_text()
    for step in (4,):
        checkpoint.delete_checkpoint(str(tmp_path / "a"), step, 0)   # as if killed before the step-4 checkpoint
    code, out, err = in_process(common(small_model, data, **{"-x": "4", "-n": "2", "-v": "2", "-o": str(tmp_path / "a"),
                                                            "-y": "1"}), capsys)
    assert code == 0, err
    assert (tmp_path / "a" / "main.log").read_text() == straight_log


def test_eval_only_resume_evaluates_the_checkpoint(data, small_model, tmp_path, capsys):
    code, out, err = in_process(common(small_model, data, **{"-x": "3", "-n": "3", "-v": "3", "-j": data, "-m": "2",
                                                            "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    trained = re.findall(r"val loss ([0-9.]+)", out)[-1]
    code, out, err = in_process(["-e", "d2", "-i", data, "-j", data, "-b", "2", "-t", "16", "-m", "2", "--eval-only",
                                 "-y", "1", "-o", str(tmp_path)], capsys)
    assert code == 0, err
    assert re.findall(r"val loss ([0-9.]+)", out) == [trained]


def test_rotation_across_a_resume(data, small_model, tmp_path, capsys):
    code, out, err = in_process(common(small_model, data, **{"-x": "5", "-n": "2", "-nk": "1", "-o": str(tmp_path)}), capsys)
    assert code == 0, err
    code, out, err = in_process(common(small_model, data, **{"-x": "9", "-n": "2", "-nk": "1", "-o": str(tmp_path),
                                                            "-y": "1"}), capsys)
    assert code == 0, err
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(("DONE", "model", "state"))) == \
        ["DONE_00000009", "model_00000009.bin", "state_00000009_00000.bin"]


def run_read_only(directory, args):
    """gpt2_cpu.py `args` in a subprocess that sees `directory` read-only: by its mode for a user
    (whom a mode stops), by a read-only bind mount in a mount namespace of its own for root (whom
    no mode stops; `unshare -m`, where the kernel lets root make one); the test skips where
    neither can be had."""
    cmd = [sys.executable, os.path.join(ROOT, "gpt2_cpu.py")] + args
    if os.geteuid() != 0:
        os.chmod(directory, 0o555)
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
        finally:
            os.chmod(directory, 0o755)
    if not shutil.which("unshare"):
        pytest.skip("root, and no unshare to make a read-only mount")
    mount = 'mount --bind -o ro "$0" "$0" || exit 97; exec "$@"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", mount, str(directory)] + cmd, capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    if r.returncode == 97 or "unshare:" in r.stderr:
        pytest.skip(f"root, and no read-only mount here: {r.stderr.strip()[:200]}")
    return r


def test_a_read_only_run_directory_serves_eval_only_and_generate_and_refuses_training(data, small_model, tmp_path,
                                                                                     capsys):
    """--eval-only -y 1 and --generate -y 1 only read -o: they run on a read-only -o and write
    nothing; a training run, which writes there, says so in one line."""
    run_dir = tmp_path / "run"
    code, out, err = in_process(common(small_model, data, **{"-x": "2", "-n": "2", "-o": str(run_dir)}), capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    argv = common(small_model, data, **{"-j": data, "-m": "2", "-o": str(run_dir), "-y": "1"})
    code, writable, err = in_process(argv + ["--eval-only"], capsys)
    assert code == 0 and writable.startswith("val loss "), err
    r = run_read_only(run_dir, argv + ["--eval-only"])
    assert r.returncode == 0 and r.stdout == writable and r.stderr == "", r.stderr
    r = run_read_only(run_dir, argv + ["--generate", "4", "--prompt", "ROMEO:"])
    assert r.returncode == 0 and r.stdout.startswith("ROMEO:") and r.stderr == "", r.stderr
    r = run_read_only(run_dir, argv + ["-x", "3", "-n", "1"])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: -o {run_dir}: cannot write there (") and lines[0].endswith(
        "): a training run writes its lock, checkpoints and main.log in -o"), lines[0]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


# ----------------------------------------------------------------------------
# class 5: the other commands keep the same promise

def load_tool(relative):
    """Import a script (dev/eval/export_hf.py, tests/check_gpt2.py, dev/vislog.py) as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(os.path.basename(relative)[:-3], os.path.join(ROOT, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_hf_disk_full_leaves_nothing(small_model, tmp_path, monkeypatch, capsys):
    export_hf = load_tool("dev/eval/export_hf.py")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    code = export_hf.main(["-i", small_model, "-o", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert one_line(code, err) and "No space left" in err[0], err
    assert os.listdir(tmp_path / "hf") == [], "no partial model.safetensors or config.json"


def test_export_hf_unwritable_output(small_model, tmp_path, capsys):
    export_hf = load_tool("dev/eval/export_hf.py")
    (tmp_path / "file").write_text("x")
    code = export_hf.main(["-i", small_model, "-o", str(tmp_path / "file" / "hf")])
    assert one_line(code, capsys.readouterr().err.strip().splitlines())


def debug_state(tmp_path, edit=None):
    """A model and its debug state (B=2, T=4), the state's bytes passed through edit(raw)."""
    model = g.gpt2_init(SMALL, seed=0)
    x = np.arange(8, dtype=np.int32).reshape(2, 4)
    y = x + 1
    logits = g.gpt2_forward(model, x, y)[..., :V]
    g.gpt2_zero_grad(model)
    g.gpt2_backward(model)
    model_path, state_path = tmp_path / "m.bin", tmp_path / "s.bin"
    g.write_model(str(model_path), model)
    formats.write_debug_state(str(state_path), x, y, logits, model.mean_loss,
                              [model.G[name] for name, _ in model.param_shapes])
    if edit:
        raw = bytearray(state_path.read_bytes())
        edit(raw)
        state_path.write_bytes(bytes(raw))
    return str(model_path), str(state_path)


@pytest.mark.parametrize("slot,value", [
    (formats.DEBUG_SLOT_B, -1), (formats.DEBUG_SLOT_B, 0), (formats.DEBUG_SLOT_B, 2 ** 30),
    (formats.DEBUG_SLOT_T, -4), (formats.DEBUG_SLOT_T, 2 ** 31 - 1),
    ("y", V), ("y", 65535), ("x", -1),
])
def test_check_gpt2_impossible_debug_state(tmp_path, capsys, slot, value):
    def edit(raw):
        if slot == "x":
            raw[formats.HEADER_BYTES:formats.HEADER_BYTES + 4] = np.int32(value).tobytes()
        elif slot == "y":
            at = formats.HEADER_BYTES + 4 * 8 + 4 * 3                 # y[0, 3]
            raw[at:at + 4] = np.int32(value).tobytes()
        else:
            raw[4 * slot:4 * slot + 4] = np.int32(value).tobytes()
    model_path, state_path = debug_state(tmp_path, edit)
    code = load_tool("tests/check_gpt2.py").main(["-e", model_path, "-s", state_path])
    out = capsys.readouterr()
    assert one_line(code, out.err.strip().splitlines()) and "s.bin" in out.err, out.err


@pytest.mark.parametrize("log,output,said", [
    ("s:0 trl:5.0\ns:99999999999999999999999 trl:4.0\n", "plot.png", "step"),
    ("s:0 trl:5.0\ns:-3 trl:4.0\n", "plot.png", "step"),
    ("s:0 trl:5.0\ns:1 trl:4.0\n", "plot.xyz", "plot.xyz"),
    ("s:0 trl:5.0\ns:1 trl:4.0\n", "plot", "plot"),
])
def test_vislog_absurd_input(tmp_path, capsys, log, output, said):
    (tmp_path / "main.log").write_text(log)
    code = load_tool("dev/vislog.py").main([str(tmp_path), "-o", str(tmp_path / output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert one_line(code, err) and said in err[0], err
    assert not (tmp_path / output).exists()


def test_hellaswag_file_with_no_examples(data, small_model, tmp_path, capsys):
    from llmc import evalloader
    path = tmp_path / "empty.bin"
    path.write_bytes(formats.make_header(evalloader.EVAL_MAGIC, evalloader.EVAL_VERSION).tobytes())
    code, out, err = in_process(["-e", small_model, "-i", data, "-j", "", "-b", "4", "-t", "16", "-h", "1",
                                 "--hellaswag-file", str(path), "--eval-only"], capsys)
    assert one_line(code, err) and "empty.bin" in err[0] and "no examples" in err[0], err


def test_generation_when_stdout_cannot_encode(small_model):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "gpt2_cpu.py"), "-e", small_model, "--generate", "30",
                          "--prompt", "caf\u00e9 \u2603"], capture_output=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert out.returncode == 0 and out.stderr == b"", out.stderr.decode()
    assert out.stdout.startswith(b"caf? ?")


def test_validation_over_shards_of_unequal_size(small_model, tmp_path, capsys):
    """-m -1 is every batch of every shard: the mean over all of them, whatever their sizes."""
    paths = [shard(tmp_path, "val_a.bin", n=33 * 3, seed=1), shard(tmp_path, "val_b.bin", n=32 * 9 + 1, seed=2)]
    model = g.read_model(small_model)
    losses = []
    for path in paths:
        tokens = formats.read_shard(path).astype(np.int32)
        for start in range(0, tokens.size - 32, 32):                   # B*T = 32 tokens a batch
            window = tokens[start:start + 33]
            g.gpt2_forward(model, window[:-1].reshape(2, 16), window[1:].reshape(2, 16))
            losses.append(model.mean_loss)
    assert len(losses) == 3 + 9
    code, out, err = in_process(["-e", small_model, "-i", paths[0], "-j", str(tmp_path / "val_*.bin"), "-b", "2",
                                 "-t", "16", "-m", "-1", "--eval-only"], capsys)
    assert code == 0, err
    assert float(re.search(r"val loss ([0-9.]+)", out).group(1)) == pytest.approx(np.mean(losses), abs=2e-6)


@pytest.mark.parametrize("tool", ["dev/vislog.py", "dev/eval/export_hf.py", "tests/check_gpt2.py"])
def test_tools_bad_flags_are_one_line(tool):
    out = subprocess.run([sys.executable, os.path.join(ROOT, tool), "--no-such-flag"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert one_error_line(out), out.stderr                    # (argparse names the missing required ones first)


def test_resume_refuses_another_cuda_precision(data, small_model, tmp_path):
    """gpt2_cuda.py's arithmetic flags are part of the checkpoint's configuration (checked without
    a GPU: only the flags and the loop are involved)."""
    gpt2_cuda = pytest.importorskip("gpt2_cuda")
    from llmc.cli import TrainingRun
    from llmc.comm import Comm
    code = g.main(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)}))
    assert code == 0
    saved = checkpoint.read_run_config(checkpoint.config_path(str(tmp_path), 1))
    assert "--precision" not in saved, "a CPU run has no such flag: a CUDA run may resume it"
    saved["--precision"] = "bf16"                                   # as a CUDA run with --precision bf16 wrote it
    checkpoint.write_run_config(checkpoint.config_path(str(tmp_path), 1), saved)
    args = gpt2_cuda.parse_args(common(small_model, data, **{"-x": "2", "-o": str(tmp_path), "-y": "1",
                                                             "--precision": "fp32"}))
    run = TrainingRun(args, Comm())
    with pytest.raises(g.InputError, match="--precision bf16.*--precision fp32"):
        run.prepare(SMALL)


def test_resume_refuses_another_bias_gradient_level_and_the_doc_lists_every_such_flag(data, small_model, tmp_path):
    """--bias-grad-epilogue changes the summation order of the bias gradients, so a CUDA run
    resumed with another level is refused like --precision above; doc/running.md's "Resume is
    exact or refused" names every flag of gpt2_cuda.py that a resume compares."""
    gpt2_cuda = pytest.importorskip("gpt2_cuda")
    from llmc.cli import DEVICE_RESULT_FLAGS, TrainingRun
    from llmc.comm import Comm
    assert g.main(common(small_model, data, **{"-x": "1", "-n": "1", "-o": str(tmp_path)})) == 0
    saved = checkpoint.read_run_config(checkpoint.config_path(str(tmp_path), 1))
    saved["--bias-grad-epilogue"] = 1                               # as a CUDA run with the default wrote it
    checkpoint.write_run_config(checkpoint.config_path(str(tmp_path), 1), saved)
    args = gpt2_cuda.parse_args(common(small_model, data, **{"-x": "2", "-o": str(tmp_path), "-y": "1",
                                                             "--bias-grad-epilogue": "2"}))
    with pytest.raises(g.InputError, match="--bias-grad-epilogue 1.*--bias-grad-epilogue 2"):
        TrainingRun(args, Comm()).prepare(SMALL)
    text = open(os.path.join(ROOT, "doc", "running.md"), encoding="utf-8").read()
    paragraph = re.split(r"\n- |\n\n", text[text.index("**Resume is exact or refused.**"):])[0]
    options = gpt2_cuda.build_parser()._option_string_actions
    for flag, _ in DEVICE_RESULT_FLAGS:
        if flag in options:                                         # (--pad-vocab is llama3_cuda.py's)
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", paragraph), flag


def test_resume_after_a_run_that_ended_off_the_sample_grid(data, small_model, tmp_path, capsys):
    """The first run ends at step 5 with -s 3: its last sample (off the grid) must not advance the
    sampler's state in the step-5 checkpoint, so the resumed run samples at 6 as the straight one."""
    flags = {"-s": "3", "-n": "4", "-g": "6", "-v": "0", "--tokenizer": "none"}
    straight, split = tmp_path / "straight", tmp_path / "split"
    code, s_out, err = in_process(common(small_model, data, **flags, **{"-x": "8", "-o": str(straight)}), capsys)
    assert code == 0, err
    code, first, err = in_process(common(small_model, data, **flags, **{"-x": "5", "-o": str(split)}), capsys)
    assert code == 0 and first.count("generating:") == 2, err                    # at 3 and at the end
    code, second, err = in_process(common(small_model, data, **flags, **{"-x": "8", "-o": str(split), "-y": "1"}), capsys)
    assert code == 0, err
    s_lines, r_lines = comparable(s_out, straight), comparable(second, split)
    after = r_lines.index(next(line for line in r_lines if line.startswith("resumed from")))
    at_5 = s_lines.index(next(line for line in s_lines if line.startswith("step    5/8")))
    assert r_lines[after + 1:] == s_lines[at_5 + 1:]
    for name in ("model_00000008.bin", "state_00000008_00000.bin", "config_00000008.json", "main.log"):
        assert (straight / name).read_bytes() == (split / name).read_bytes(), name


def test_hellaswag_token_id_outside_the_vocabulary(data, small_model, tmp_path, capsys):
    from llmc import evalloader
    path = tmp_path / "hs.bin"
    example = {"index": 0, "label": 1, "context": [1, 2, 3], "completions": [[4], [5, V + 3], [6], [7]]}
    evalloader.write_eval_file(str(path), [example])
    code, out, err = in_process(["-e", small_model, "-i", data, "-j", "", "-b", "4", "-t", "16", "-h", "1",
                                 "--hellaswag-file", str(path), "--eval-only"], capsys)
    assert one_line(code, err) and "hs.bin" in err[0] and f"token id {V + 3}" in err[0], err


def test_shuffled_resume_before_a_reshuffle_keeps_the_batch_order(small_model, tmp_path, capsys):
    """PCG64 draws 32-bit values in halves of a 64-bit one: between a permutation and the next
    the generator may hold a buffered half (has_uint32, uinteger), which the state file must keep
    too, or a run resumed there reshuffles into another order. Two shards of 97 and 65 tokens at
    B=2, T=16: the shards end, and are reshuffled, every few steps."""
    rng = np.random.default_rng(5)
    for name, n in (("a.bin", 97), ("b.bin", 65)):
        formats.write_shard(str(tmp_path / name), rng.integers(0, SMALL.vocab_size, n))
    flags = common(small_model, str(tmp_path / "*.bin"), **{"--shuffle": "1", "-x": "24", "-n": "19", "-v": "0"})
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    code, s_out, err = in_process(flags + ["-o", str(straight)], capsys)
    assert code == 0, err
    shutil.copytree(straight, resumed)
    for name in os.listdir(resumed):
        if "00000024" in name:
            os.remove(resumed / name)                                 # as if it had stopped after step 19
    code, r_out, err = in_process(flags + ["-o", str(resumed), "-y", "1"], capsys)
    assert code == 0, err
    assert losses(r_out) == losses(s_out)[19:]
    for name in ("model_00000024.bin", "state_00000024_00000.bin"):
        assert (straight / name).read_bytes() == (resumed / name).read_bytes(), name


@pytest.mark.parametrize("damage, said", [
    ("{}", "damaged run configuration"),                                  # emptied: not a way around the check
    ('{"-b": "2"}', "damaged run configuration"),                         # a value of the wrong type
    (None, "is missing, so this run's flags cannot be checked"),          # gone (llm.c's checkpoints have none)
])
def test_a_missing_or_damaged_run_configuration_is_refused(data, small_model, tmp_path, capsys, damage, said):
    out = tmp_path / "run"
    flags = common(small_model, data, **{"-x": "4", "-n": "2", "-v": "0", "-o": str(out)})
    code, _, err = in_process(flags[:-2] + ["-x", "2", "-o", str(out)], capsys)
    assert code == 0, err
    config = out / "config_00000002.json"
    if damage is None:
        config.unlink()
    else:
        saved = json.loads(config.read_text())
        config.write_text(damage if damage == "{}" else json.dumps({**saved, **json.loads(damage)}))
    code, _, err = in_process(flags + ["-y", "1", "-b", "4"], capsys)     # another -b: must not slip through
    assert one_line(code, err) and said in err[0] and "--resume-unchecked" in err[0], err
    if damage is None:                                                    # the explicit way on, with a note
        code, stdout, err = in_process(flags + ["-y", "1", "--resume-unchecked"], capsys)
        assert code == 0 and "flags unchecked" in stdout, err


def test_resume_on_other_train_data_of_the_same_size_is_refused(small_model, tmp_path, capsys):
    rng = np.random.default_rng(8)
    first, second = tmp_path / "first.bin", tmp_path / "second.bin"
    formats.write_shard(str(first), rng.integers(0, SMALL.vocab_size, 4000))
    formats.write_shard(str(second), rng.integers(0, SMALL.vocab_size, 4000))  # the same token count
    out = str(tmp_path / "run")
    code, _, err = in_process(common(small_model, str(first), **{"-x": "2", "-n": "2", "-v": "0", "-o": out}), capsys)
    assert code == 0, err
    code, _, err = in_process(common(small_model, str(second), **{"-x": "4", "-n": "2", "-v": "0", "-o": out,
                                                                    "-y": "1"}), capsys)
    assert one_line(code, err) and "-i (4000 tokens in 1 shard(s), content" in err[0], err


@pytest.mark.parametrize("corrupt, said", [
    ("sampler", "the sampler's RNG state is 0"),
    ("nan", "the loss outlier window's a value is not finite"),
    ("count", "the grad-norm outlier window's count 999.0 is not an integer"),
])
def test_a_state_files_values_are_checked_not_only_its_sizes(data, small_model, tmp_path, capsys, corrupt, said):
    out = tmp_path / "run"
    flags = common(small_model, data, **{"-x": "4", "-n": "2", "-v": "0", "-o": str(out)})
    code, _, err = in_process(flags[:-2] + ["-x", "2", "-o", str(out)], capsys)
    assert code == 0, err
    state = out / "state_00000002_00000.bin"
    raw = bytearray(state.read_bytes())
    outliers_at = len(raw) - checkpoint.OUTLIER_DETECTORS_FLOATS * 8          # the two detectors close the file
    if corrupt == "sampler":
        raw[checkpoint.STATE_U64_SAMPLE_RNG * 8:checkpoint.STATE_U64_SAMPLE_RNG * 8 + 8] = bytes(8)
    elif corrupt == "nan":
        raw[outliers_at + 4 * 8:outliers_at + 5 * 8] = np.array([np.nan]).tobytes()  # the loss window's first value
    else:
        grad_at = outliers_at + checkpoint.OUTLIER_DETECTORS_FLOATS // 2 * 8
        raw[grad_at:grad_at + 8] = np.array([999.0]).tobytes()                    # the grad-norm window's count
    state.write_bytes(bytes(raw))
    code, _, err = in_process(flags + ["-y", "1"], capsys)
    assert one_line(code, err) and said in err[0], err


def test_a_run_killed_before_its_last_off_grid_sample_prints_it_on_resume(data, small_model, tmp_path, capsys):
    """-x 5 with -s 3: the last sample follows the step-5 checkpoint. A run killed between the two
    (here: the checkpoint is there, the sample never printed) prints that same sample on resume."""
    flags = common(small_model, data, **{"-s": "3", "-n": "5", "-g": "6", "-v": "0", "--tokenizer": "none",
                                          "-x": "5", "-o": str(tmp_path / "run")})
    code, first, err = in_process(flags, capsys)
    assert code == 0, err
    last_sample = first.rsplit("generating:\n---\n", 1)[1].split("\n---")[0]
    code, resumed, err = in_process(flags + ["-y", "1"], capsys)
    assert code == 0, err
    assert "the run's last sample, which follows its step-5 checkpoint:" in resumed
    assert resumed.rsplit("generating:\n---\n", 1)[1].split("\n---")[0] == last_sample
