"""
tests/test_reliability_ranks.py: the ranks of one mpiexec job start alike, or stop at once.

Ranks started with different flags used to train together silently (-l, -t), hang (-x: rank 0
ends, rank 1 waits in an all-reduce) or die in an MPI stack trace (-e, -v). Every rank now
compares its flags and the content of its data and model files with rank 0's before anything
else, and the job ends within seconds with one line from rank 0 naming what differs. An error
every rank finds alike (a bad -d, a missing -i) is said once, by rank 0; a rank given a file that
is not there is named with that file, on every rank of a -pm tcp|fs job too. Both ranks run gpt2_cpu.py, started
with mpiexec's MPMD form (`-n 1 cmd A : -n 1 cmd B`).
"""

import os
import subprocess
import sys
import time

import pytest

from mpi_marks import needs_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ["-e", "d2", "-t", "16", "-b", "2", "-x", "2", "-v", "0", "-s", "0"]
JOB_TIMEOUT_S = 120


def job(rank0_extra, rank1_extra):
    script = os.path.join(ROOT, "gpt2_cpu.py")
    cmd = ["mpiexec", "-n", "1", sys.executable, script] + BASE + rank0_extra + \
          [":", "-n", "1", sys.executable, script] + BASE + rank1_extra
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=ROOT)
    return r, time.monotonic() - start


def error_lines(r):
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


@needs_mpi
@pytest.mark.parametrize("rank0, rank1, named", [
    (["-l", "1e-3"], ["-l", "2e-3"], "--learning-rate"),         # trained together silently
    (["-t", "16"], ["-t", "8"], "--seq-len"),
    (["-x", "2"], ["-x", "3"], "--max-steps"),                   # hung: rank 1 waited in an all-reduce
    (["-e", "d2"], ["-e", "d4"], "--model"),                     # died in an MPI stack trace
    (["-v", "0"], ["-v", "1"], "--val-every"),
])
def test_ranks_started_with_different_flags_stop_at_once_naming_the_flag(rank0, rank1, named):
    r, seconds = job(rank0, rank1)
    assert r.returncode != 0 and seconds < 60
    lines = error_lines(r)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: the ranks of this job were started with different")
    assert named in lines[0] and "Traceback" not in r.stderr


@needs_mpi
def test_ranks_on_different_train_data_of_one_name_stop(tmp_path):
    """The same -i path, other content (as on two nodes without a shared file system)."""
    import numpy as np
    from llmc import formats
    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        formats.write_shard(str(tmp_path / name / "train.bin"), np.random.default_rng(seed).integers(0, 50257, 4000))
    r, _ = job(["-i", str(tmp_path / "a" / "train.bin"), "-j", ""], ["-i", str(tmp_path / "a" / "train.bin"), "-j", ""])
    assert r.returncode == 0, r.stderr                                 # the same file: they agree
    r, _ = job(["-i", str(tmp_path / "a" / "train.bin"), "-j", ""], ["-i", str(tmp_path / "b" / "train.bin"), "-j", ""])
    lines = error_lines(r)
    assert r.returncode != 0 and len(lines) == 1 and "--input-bin, -i content" in lines[0], r.stderr


@needs_mpi
def test_an_error_every_rank_finds_is_said_once_by_rank_0():
    r, seconds = job(["-d", "100"], ["-d", "100"])
    assert r.returncode != 0 and seconds < 60
    assert error_lines(r) == ["error: rank 0: -d 100 is not a multiple of B*T*processes = 64"]


MISSING = "/nonexistent/train.bin"
MISSING_LINE = f"{MISSING}: no data file matches (run `make data` for the default dataset)"


@needs_mpi
def test_one_rank_given_a_missing_file_is_named_with_it_once():
    """Rank 1's -i names no file: the line names rank 1 and the file (not only that the ranks
    differ), said once, by rank 0."""
    r, seconds = job([], ["-i", MISSING])
    assert r.returncode != 0 and seconds < 60 and "Traceback" not in r.stderr
    assert error_lines(r) == [f"error: rank 0: rank 1 cannot start: {MISSING_LINE}"], r.stderr


@needs_mpi
def test_a_missing_file_every_rank_is_given_is_said_once():
    r, seconds = job(["-i", MISSING], ["-i", MISSING])
    assert r.returncode != 0 and seconds < 60
    assert error_lines(r) == [f"error: rank 0: {MISSING_LINE}"], r.stderr


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("method", ["tcp", "fs"])
@pytest.mark.parametrize("rank0, rank1, named", [
    (["-l", "1e-3"], ["-l", "2e-3"], "--learning-rate"),
    (["-x", "2"], ["-x", "3"], "--max-steps"),
])
def test_tcp_and_fs_ranks_started_with_different_flags_stop_at_once_naming_the_flag(tmp_path, method, rank0, rank1,
                                                                                     named):
    """-pm tcp|fs (no MPI: Slurm's srun, or processes started by hand) on the emulated device: the
    rendezvous carries each rank's flags and file fingerprints to rank 0, which compares them before
    handing out the NCCL id; every rank stops within seconds, each with one line naming the flag."""
    extra = (["-ps", "127.0.0.1", "--rendezvous-port", str(free_port())] if method == "tcp"
             else ["-pp", str(tmp_path), "-pj", "differ"])
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                                            "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gpt2_cuda.py"), "--device", "cpu"] + BASE + mine
                              + ["-pm", method, "-pn", "2", "-pr", str(r), "--rendezvous-timeout", "60"] + extra,
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, mine in enumerate((rank0, rank1))]
    results = [p.communicate(timeout=JOB_TIMEOUT_S) + (p.returncode,) for p in procs]
    assert time.monotonic() - start < 60
    for rank, (out, err, code) in enumerate(results):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, (rank, err)
        assert "the ranks of this job were started with different" in lines[0] and named in lines[0], (rank, err)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("method", ["tcp", "fs"])
def test_tcp_and_fs_one_rank_given_a_missing_file_every_rank_names_it(tmp_path, method):
    """Without MPI each rank is a process of its own (srun's, or started by hand): each says, in
    its one line, which rank cannot start and why."""
    extra = (["-ps", "127.0.0.1", "--rendezvous-port", str(free_port())] if method == "tcp"
             else ["-pp", str(tmp_path), "-pj", "missing"])
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                                            "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gpt2_cuda.py"), "--device", "cpu"] + BASE + mine
                              + ["-pm", method, "-pn", "2", "-pr", str(r), "--rendezvous-timeout", "60"] + extra,
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, mine in enumerate(([], ["-i", MISSING]))]
    results = [p.communicate(timeout=JOB_TIMEOUT_S) + (p.returncode,) for p in procs]
    for rank, (out, err, code) in enumerate(results):
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1 and "Traceback" not in err, (rank, err)
        assert lines[0].endswith(f"rank 1 cannot start: {MISSING_LINE}"), (rank, lines[0])
