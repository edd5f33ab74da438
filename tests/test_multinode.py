"""
tests/test_multinode.py: llmc/multinode.py, the -pm mpi|tcp|fs start of data parallelism, and
scripts/. Run: python3 -m pytest -q tests/test_multinode.py (about a minute; no GPU).

- The launcher-environment parsing and device selection, with fake environments.
- The tcp and fs rendezvous with 2, 3 and 8 real processes on loopback (`python -m llmc.multinode`,
  rank 0 sends 128 random bytes): every process prints the SHA-256 of rank 0's bytes.
- Each way the rendezvous can fail (a missing peer, a late peer, a stale file, a duplicate rank, a
  port in use, a short id, two ranks on one GPU) gives one `error:` line and exit 1 within the
  timeout, and leaves nothing behind in -pp.
- The stop line: a rank that fails (or is killed) after the rendezvous stops the others at once;
  ranks that end at different times all exit 0.
- scripts/: `bash -n`, shellcheck where installed, and every flag they pass parses.
- On the emulated CUDA device (llmc.emulator, skipped without it): 2-process -pm tcp and -pm fs
  runs give -pm mpi's losses.
"""

import glob
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from llmc import cuda, launcher, multinode
from llmc.utils import InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 3.0                          # --rendezvous-timeout in these tests, seconds
SLACK = 15.0                           # process start-up on a loaded 2-core machine, seconds
LAUNCHER_VARIABLES = [v for variables in launcher.LAUNCHERS for v in variables[1:]] + [
    "SLURM_JOB_ID", "SLURM_RESTART_COUNT", "CUDA_VISIBLE_DEVICES"]


# ----------------------------------------------------------------------------
# the launcher's environment, the flags, the device

def flags(**overrides):
    """add_flags's defaults with overrides, as an argparse namespace."""
    import argparse
    args = multinode.add_flags(argparse.ArgumentParser()).parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, ("Slurm", 5, 16, 1)),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3"}, ("MPICH", 3, 4, 3)),
    ({"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "12", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     ("Open MPI", 9, 12, 1)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4"}, ("MPICH", 2, 4, None)),          # no local rank given
    # mpirun inside an sbatch job: MPI's variables win over the batch step's SLURM_PROCID 0
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
      "OMPI_COMM_WORLD_RANK": "7", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "7"}, ("Open MPI", 7, 8, 7)),
    ({"SLURM_PROCID": "3"}, None),                                         # a rank without a size is no launcher
])
def test_launcher_environment(env, expected):
    assert launcher.launcher_environment(env) == expected


def test_launcher_environment_refuses_a_non_integer():
    with pytest.raises(InputError, match="SLURM_NTASKS='x'"):
        launcher.launcher_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"})


def test_placement_from_flags_and_launcher():
    slurm = {"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_JOB_ID": "777"}
    p = multinode.resolve_placement(flags(init_method="tcp"), slurm, host="n1")
    assert (p.rank, p.size, p.local_rank, p.job) == (11, 16, 3, "777")             # the launcher's local rank
    p = multinode.resolve_placement(flags(init_method="tcp", num_processes=16, process_rank=11), {}, host="n1")
    assert (p.rank, p.size, p.local_rank) == (11, 16, 3)                          # -pr % -pg = 11 % 8
    p = multinode.resolve_placement(flags(init_method="tcp", num_processes=16, process_rank=11, gpus_per_node=4),
                                    {}, host="n1")
    assert p.local_rank == 3 and p.local_source == "-pr % -pg"                  # 11 % 4
    p = multinode.resolve_placement(flags(init_method="fs"), {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"})
    assert (p.rank, p.size, p.job) == (0, 1, "42.2")                              # no launcher: 0 of 1
    assert multinode.resolve_placement(flags(init_method="fs", job_id="mine"), {"SLURM_JOB_ID": "42"}).job == "mine"


@pytest.mark.parametrize("overrides, env, message", [
    ({"num_processes": 4, "process_rank": 4}, {}, "-pr 4 is out of range for -pn 4"),
    ({"num_processes": 4, "process_rank": -1}, {}, "-pr -1 is out of range"),
    ({"num_processes": 0}, {}, "-pn 0"),
    ({"gpus_per_node": 0}, {}, "-pg 0"),
    ({}, {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "8"}, "more processes on this node than GPUs"),
    ({"init_method": "fs", "num_processes": 2}, {}, "-pm fs needs a job id"),
    ({"init_method": "fs", "num_processes": 2, "job_id": "j", "fs_path": "/nonexistent/dir"}, {}, "not a directory"),
    ({"rendezvous_port": 70000}, {}, "not a port number"),
    ({"rendezvous_timeout": 0.0}, {}, "must be a finite number of seconds > 0"),
])
def test_placement_refuses_bad_flags(overrides, env, message):
    with pytest.raises(InputError, match=re.escape(message)):
        multinode.resolve_placement(flags(**dict({"init_method": "tcp"}, **overrides)), env)


def test_choose_device():
    assert [cuda.choose_device(r, 8) for r in range(8)] == list(range(8))
    with pytest.raises(InputError, match="two processes would share one"):
        cuda.choose_device(4, 4)                                  # 5 processes, 4 GPUs
    assert cuda.choose_device(5, 1, "5") == 0                     # srun --gpus-per-task=1: its own GPU
    with pytest.raises(InputError, match="two processes would share one"):
        cuda.choose_device(1, 1, None)                            # everyone sees the same single GPU


def test_check_distinct_gpus():
    multinode.check_distinct_gpus([(0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "b", 1)])
    with pytest.raises(InputError, match="ranks 1 and 3 would share GPU 1 of a"):
        multinode.check_distinct_gpus([(0, "a", 0), (1, "a", 1), (2, "b", 0), (3, "a", 1)])


def test_nccl_id_round_trip():
    """CuPy 13's get_unique_id gives signed chars, CuPy 14's bytes; both come back as the same bytes."""
    data = os.urandom(multinode.NCCL_UNIQUE_ID_BYTES)
    signed = multinode.nccl_id_from_bytes(data)
    assert all(-128 <= b <= 127 for b in signed) and multinode.nccl_id_to_bytes(signed) == data
    assert multinode.nccl_id_to_bytes(data) == data


@pytest.fixture
def emulated_nccl(monkeypatch):
    """The emulated NCCL (llmc.cuda.library("nccl") on the emulated device)."""
    from llmc import cuda
    monkeypatch.setattr(cuda, "_device", "cpu")
    return cuda.library("nccl")


@pytest.mark.parametrize("id_type", [bytes, tuple])
def test_emulated_nccl_takes_only_the_installed_cupys_id_form(emulated_nccl, monkeypatch, id_type):
    """CuPy 14's nccl.pyx: get_unique_id() -> bytes, NcclCommunicator(int, bytes commId, int); CuPy 13's
    a tuple of 128 signed chars. Cython refuses the other type with a TypeError naming both."""
    monkeypatch.setattr(emulated_nccl, "ID_TYPE", id_type)
    uid = emulated_nccl.get_unique_id()
    assert type(uid) is id_type and len(uid) == multinode.NCCL_UNIQUE_ID_BYTES
    other = tuple(multinode.nccl_id_from_bytes(uid)) if id_type is bytes else multinode.nccl_id_to_bytes(uid)
    expected = f"Argument 'commId' has incorrect type (expected {id_type.__name__}, got {type(other).__name__})"
    with pytest.raises(TypeError, match=re.escape(expected)):
        emulated_nccl.NcclCommunicator(1, other, 0)
    emulated_nccl.NcclCommunicator(1, uid, 0).destroy()


def test_emulated_nccl_follows_the_installed_cupy(emulated_nccl):
    """Installed CuPy 14 (or none: the version the project installs) -> bytes; CuPy 13 -> tuple."""
    assert emulated_nccl._id_type_of_cupy("14.2.0") is bytes and emulated_nccl._id_type_of_cupy(None) is bytes
    assert emulated_nccl._id_type_of_cupy("13.6.0") is tuple


@pytest.mark.parametrize("id_type", [bytes, tuple])
def test_tcp_fs_group_joins_nccl_with_either_cupys_id(emulated_nccl, monkeypatch, id_type):
    """-pm tcp | fs carry the id as bytes; NcclGroupComm hands it to CuPy 13 or 14 in its own form."""
    monkeypatch.setattr(emulated_nccl, "ID_TYPE", id_type)
    uid = multinode.nccl_id_to_bytes(emulated_nccl.get_unique_id())
    import numpy as np
    group = multinode.NcclGroupComm(0, 1, uid)
    try:
        assert group.host_sum(np.array([1.5, -2.0])).tolist() == [1.5, -2.0]
    finally:
        group.communicator.destroy()


# ----------------------------------------------------------------------------
# the rendezvous between real processes (python -m llmc.multinode)

def free_port():
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    """This environment without any launcher's variables (pytest may itself run under one)."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


def start(method, size, rank, where, *extra, timeout=TIMEOUT):
    """One `python -m llmc.multinode` process; where: the port (tcp) or (directory, job) (fs)."""
    argv = [sys.executable, "-m", "llmc.multinode", "-pm", method, "-pn", str(size), "-pr", str(rank),
            "--rendezvous-timeout", str(timeout)]
    argv += ["-ps", "127.0.0.1", "--rendezvous-port", str(where)] if method == "tcp" else \
        ["-pp", str(where[0]), "-pj", where[1]]
    return subprocess.Popen(argv + [str(x) for x in extra], cwd=ROOT, env=clean_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(procs, limit=TIMEOUT + SLACK):
    """(exit code, stdout, stderr) of each process, in order; fails if any runs past `limit` s."""
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a process ran past {limit} s")
        results.append((proc.returncode, out, err))
    return results


def digest(stdout):
    match = re.search(r"id sha256 ([0-9a-f]{64})", stdout)
    return match and match.group(1)


def where_for(method, tmp_path, job="job1"):
    return free_port() if method == "tcp" else (tmp_path, job)


def assert_one_error_line(result, *fragments):
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 1, result
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("method", ["tcp", "fs"])
@pytest.mark.parametrize("size", [2, 3, 8])
def test_every_rank_gets_rank_0s_id(method, size, tmp_path):
    where = where_for(method, tmp_path)
    results = finish([start(method, size, r, where) for r in reversed(range(size))])[::-1]
    assert all(code == 0 for code, _, _ in results), results
    digests = [digest(out) for _, out, _ in results]
    assert digests[0] is not None and digests == [digests[0]] * size
    assert [f"rank {r}/{size} ({method})" in out for r, (_, out, _) in enumerate(results)] == [True] * size
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("method", ["tcp", "fs"])
def test_a_missing_peer(method, tmp_path):
    where = where_for(method, tmp_path)
    t0 = time.monotonic()
    results = finish([start(method, 3, r, where) for r in (0, 1)])          # rank 2 never starts
    assert time.monotonic() - t0 < TIMEOUT + SLACK
    assert_one_error_line(results[0], "rank(s) 2 never")
    assert_one_error_line(results[1])
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("method", ["tcp", "fs"])
def test_a_late_peer(method, tmp_path):
    """Late but within the timeout: it joins. After rank 0 gave up: one line, exit 1."""
    where = where_for(method, tmp_path)
    first = [start(method, 2, 0, where, timeout=10 * TIMEOUT)]
    time.sleep(TIMEOUT)
    results = finish(first + [start(method, 2, 1, where)], limit=10 * TIMEOUT + SLACK)
    assert [code for code, _, _ in results] == [0, 0] and digest(results[0][1]) == digest(results[1][1])
    where = where_for(method, tmp_path, "job2")
    assert_one_error_line(finish([start(method, 2, 0, where)])[0], "rank(s) 1 never")
    assert_one_error_line(finish([start(method, 2, 1, where)])[0], "rank 1")
    assert os.listdir(tmp_path) == []


def test_fs_stale_id_file(tmp_path):
    stale = tmp_path / "llmc_job1.id"
    stale.write_text('{"nonces": {"1": "0"}, "id": "' + "00" * 128 + '"}')
    results = finish([start("fs", 2, r, (tmp_path, "job1")) for r in (0, 1)])
    assert_one_error_line(results[0], "llmc_job1.id exists: left by an earlier job")
    assert_one_error_line(results[1], "is stale")
    assert os.listdir(tmp_path) == ["llmc_job1.id"]          # the stale file is the user's to remove
    stale.unlink()
    results = finish([start("fs", 2, r, (tmp_path, "job2")) for r in (0, 1)])    # another job: unaffected
    assert [code for code, _, _ in results] == [0, 0]


def test_fs_stale_claim_file(tmp_path):
    (tmp_path / "llmc_job1.rank1").write_text("{}")
    results = finish([start("fs", 2, 1, (tmp_path, "job1"))])
    assert_one_error_line(results[0], "rank 1 is claimed twice")


@pytest.mark.parametrize("method", ["tcp", "fs"])
def test_a_duplicate_rank(method, tmp_path):
    where = where_for(method, tmp_path)
    procs = [start(method, 3, 1, where), start(method, 3, 1, where)]
    time.sleep(1.0)                                           # both claim rank 1 before rank 0 starts
    results = finish(procs + [start(method, 3, 0, where)])
    assert all(code == 1 for code, _, _ in results), results
    assert any("claim" in err and "rank 1" in err for _, _, err in results)
    for result in results:
        assert_one_error_line(result)
    assert os.listdir(tmp_path) == []


def test_tcp_rank_out_of_range_and_wrong_size(tmp_path):
    port = free_port()
    assert_one_error_line(finish([start("tcp", 2, 2, port)])[0], "-pr 2 is out of range for -pn 2")
    # a process started with another -pn: rank 0 refuses it and tells it why
    results = finish([start("tcp", 2, 0, port), start("tcp", 3, 1, port)])
    assert_one_error_line(results[0], "says -pn 3, rank 0 says -pn 2")
    assert_one_error_line(results[1], "refused", "-pn 3")


@pytest.mark.parametrize("method", ["tcp", "fs"])
def test_two_ranks_on_one_gpu(method, tmp_path):
    where = where_for(method, tmp_path)
    results = finish([start(method, 2, r, where, "-pg", "1") for r in (0, 1)])   # both local rank 0 of this host
    assert_one_error_line(results[0], "would share GPU 0")
    assert_one_error_line(results[1], "would share GPU 0")
    assert os.listdir(tmp_path) == []


def test_tcp_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        t0 = time.monotonic()
        result = finish([start("tcp", 2, 0, busy.getsockname()[1])])[0]
        assert time.monotonic() - t0 < SLACK                     # at once, not after the timeout
    assert_one_error_line(result, "cannot listen on port", "Address already in use", "--rendezvous-port")


def test_tcp_short_id():
    """A rank 0 that sends 100 bytes instead of 128 (a fake one, in a thread here)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)

        def serve():
            conn, _ = server.accept()
            multinode.receive_message(conn)
            multinode.send_message(conn, multinode.MSG_ID, os.urandom(100))
            conn.close()
        thread = threading.Thread(target=serve)
        thread.start()
        result = finish([start("tcp", 2, 1, server.getsockname()[1])])[0]
        thread.join()
    assert_one_error_line(result, "received 100 of the 128 bytes of the NCCL id")


def test_tcp_ignores_a_stranger():
    """A connection that is not one of our ranks (a port scanner) is dropped; the run goes on."""
    port = free_port()
    procs = [start("tcp", 2, 0, port)]
    deadline = time.monotonic() + SLACK
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port)) as stranger:
                stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
            break
        except OSError:
            time.sleep(0.1)
    results = finish(procs + [start("tcp", 2, 1, port)])
    assert [code for code, _, _ in results] == [0, 0]


# ----------------------------------------------------------------------------
# the stop line: one rank fails, all stop; a normal end is not a failure

@pytest.mark.parametrize("method", ["tcp", "fs"])
@pytest.mark.parametrize("failing", [0, 2])
def test_one_rank_fails_all_stop(method, failing, tmp_path):
    where, hold = where_for(method, tmp_path), 60
    t0 = time.monotonic()
    results = finish([start(method, 3, r, where, "--fail-rank", failing, "--hold", hold) for r in range(3)])
    assert time.monotonic() - t0 < SLACK < hold
    for rank, result in enumerate(results):
        assert_one_error_line(result, "fails on purpose" if rank == failing else f"rank {failing} failed (exit code 1)")


def test_tcp_a_killed_rank_stops_the_others():
    port, hold = free_port(), 60
    procs = [start("tcp", 3, r, port, "--hold", hold) for r in range(3)]
    deadline = time.monotonic() + SLACK
    while time.monotonic() < deadline and not all(os.path.exists(f"/proc/{p.pid}") for p in procs):
        time.sleep(0.1)
    line = procs[1].stdout.readline()                            # rank 1 is past the rendezvous
    assert "rank 1/3" in line
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    results = finish(procs)
    assert time.monotonic() - t0 < SLACK < hold
    assert results[1][0] == -signal.SIGKILL
    assert_one_error_line(results[0], "lost the connection to rank 1")
    assert_one_error_line(results[2], "rank 1 failed")          # rank 0 passed it on


@pytest.mark.parametrize("method", ["tcp", "fs"])
def test_ranks_ending_at_different_times_all_succeed(method, tmp_path):
    where = where_for(method, tmp_path)
    results = finish([start(method, 3, r, where, "--hold", hold) for r, hold in ((0, 0), (1, 2), (2, 4))])
    assert [code for code, _, _ in results] == [0, 0, 0], results
    assert os.listdir(tmp_path) == []


def test_fs_stop_file_of_an_earlier_run_is_cleared(tmp_path):
    (tmp_path / "llmc_job1.abort").write_text('{"rank": 1, "code": 1}')
    results = finish([start("fs", 2, r, (tmp_path, "job1"), "--hold", 2) for r in (0, 1)])
    assert [code for code, _, _ in results] == [0, 0], results
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------
# the process group's host reductions under -pm mpi with one process

def test_one_process_group_reduces_to_itself():
    group = multinode.init_process_group(flags(), env={})
    assert (group.rank, group.size, group.connect()) == (0, 1, None)
    assert group.mean(2.5) == 2.5 and group.sum(2.5) == 2.5
    group.barrier()


def test_tcp_group_before_connect_refuses_host_reductions():
    p = multinode.Placement("tcp", 0, 2, 0, "h")
    import numpy as np
    with pytest.raises(RuntimeError, match="call connect"):
        multinode.ProcessGroup(p).mean_(np.zeros(1))


# ----------------------------------------------------------------------------
# scripts/

SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "**", "*.sh"), recursive=True) +
                 glob.glob(os.path.join(ROOT, "scripts", "**", "*.sbatch"), recursive=True))
RECIPE = os.path.join(ROOT, "scripts", "gpt2_recipe.sh")      # sourced by the others: llm.c's shared flags
RUNS = [s for s in SCRIPTS if s != RECIPE]


def test_there_are_scripts():
    names = {os.path.relpath(s, ROOT) for s in SCRIPTS}
    assert {"scripts/run_gpt2_124M.sh", "scripts/run_gpt2_350M.sh", "scripts/multi_node/run_gpt2_124M_mpi.sh",
            "scripts/multi_node/run_gpt2_124M_tcp.sbatch", "scripts/multi_node/run_gpt2_124M_fs.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: os.path.relpath(s, ROOT))
def test_script_is_valid_bash(script):
    subprocess.run(["bash", "-n", script], check=True)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: os.path.relpath(s, ROOT))
def test_script_passes_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    result = subprocess.run(["shellcheck", "-s", "bash", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def trainer_arguments(script):
    """The arguments each script passes to gpt2_cuda.py: the words after `gpt2_cuda.py` to the end
    of the (backslash-continued) command, each "$variable" replaced by its plain assignment in the
    script (`steps=18865`), or by 1 where it has none (a path, an environment variable), and
    "${GPT2_RECIPE[@]}" by the flags scripts/gpt2_recipe.sh gives it."""
    recipe = re.search(r"^GPT2_RECIPE=\((.*)\)$", open(RECIPE).read(), re.MULTILINE).group(1)
    text = open(script).read().replace("\\\n", " ").replace('"${GPT2_RECIPE[@]}"', recipe)
    values = dict(re.findall(r'^(\w+)=([\w.]+)\s', text, re.MULTILINE))
    commands = [line.split("gpt2_cuda.py", 1)[1] for line in text.splitlines()
                if "gpt2_cuda.py" in line and not line.lstrip().startswith("#")]
    return [shlex.split(re.sub(r'"\$\{?(\w+)\}?"', lambda m: values.get(m.group(1), "1"), command))
            for command in commands]


@pytest.mark.parametrize("script", RUNS, ids=lambda s: os.path.relpath(s, ROOT))
def test_script_flags_exist(script):
    import gpt2_cuda
    parser = gpt2_cuda.build_parser()
    commands = trainer_arguments(script)
    assert commands, f"{script} runs no gpt2_cuda.py"
    for argv in commands:
        parser.parse_args(argv)                         # exits (SystemExit) on an unknown flag


def test_124M_script_is_llm_c_recipe():
    argv = trainer_arguments(os.path.join(ROOT, "scripts", "run_gpt2_124M.sh"))[0]
    import gpt2_cuda
    args = gpt2_cuda.build_parser().parse_args(argv)
    assert (args.batch_size, args.seq_len, args.total_batch_size, args.learning_rate, args.warmup_iters,
            args.final_lr_frac, args.max_steps, args.weight_decay, args.hellaswag, args.zero_stage) == \
        (64, 1024, 524288, 0.0006, 700, 0.0, 18865, 0.1, 1, 1)
    assert args.model == "d12" and "fineweb10B" in args.input_bin


# ----------------------------------------------------------------------------
# the emulated CUDA device: -pm mpi with 2 processes gives one process's losses

def losses(stdout):
    return [float(x) for x in re.findall(r"step +\d+/\d+ \| loss ([0-9.]+)", stdout)]


EMULATED = ["gpt2_cuda.py", "--device", "cpu", "-e", "d2", "-t", "32", "-d", "128", "-x", "3", "-v", "0", "-s", "0",
            "--precision", "fp32"]


@pytest.fixture(scope="module")
def emulated_mpi_losses():
    """The losses of a 2-process -pm mpi run on the emulated device (-b 2 each)."""
    pytest.importorskip("llmc.emulator.device", reason="needs llmc.emulator.device (the emulated CUDA device)")
    mpi = subprocess.run(["mpiexec", "-n", "2", sys.executable] + EMULATED + ["-b", "2"], cwd=ROOT, env=clean_env(),
                         capture_output=True, text=True, timeout=1800)
    assert mpi.returncode == 0, mpi.stderr
    reference = losses(mpi.stdout)
    assert len(reference) == 3
    return reference


def test_emulated_two_process_mpi_run_agrees_with_one_process(emulated_mpi_losses):
    """-pm mpi with 2 processes on the emulated device gives the losses of one process on the whole
    batch (the same tokens per step, summed in another order: a relative bound)."""
    one = subprocess.run([sys.executable] + EMULATED + ["-b", "4"], cwd=ROOT, env=clean_env(), capture_output=True,
                         text=True, timeout=1800)
    assert one.returncode == 0, one.stderr
    assert emulated_mpi_losses == pytest.approx(losses(one.stdout), rel=1e-5)


def test_emulated_two_process_tcp_and_fs_runs_print_the_mpi_losses(emulated_mpi_losses, tmp_path):
    """-pm tcp and -pm fs with 2 processes started without MPI on the emulated device print exactly
    the losses of -pm mpi (the same reductions in the same order, only another transport), and leave
    nothing behind: neither in the fs rendezvous folder nor in the emulated NCCL's folder."""
    rendezvous, transport = tmp_path / "rendezvous", tmp_path / "nccl"
    rendezvous.mkdir()
    transport.mkdir()
    env = dict(clean_env(), LLMC_NCCL_EMULATION_DIR=str(transport))
    for method, extra in (("tcp", ["-ps", "127.0.0.1", "--rendezvous-port", str(free_port())]),
                          ("fs", ["-pp", str(rendezvous), "-pj", "emulated"])):
        procs = [subprocess.Popen([sys.executable] + EMULATED + ["-b", "2", "-pm", method, "-pn", "2", "-pr", str(r)]
                                  + extra, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
                 for r in range(2)]
        results = finish(procs, limit=1800)
        assert [code for code, _, _ in results] == [0, 0], results
        assert losses(results[0][1]) == emulated_mpi_losses, method
        assert os.listdir(rendezvous) == [] and os.listdir(transport) == [], method
