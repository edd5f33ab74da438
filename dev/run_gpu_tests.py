"""
dev/run_gpu_tests.py: everything that needs a GPU to check gpt2_cuda.py, in one run, with its
output kept as a dated log (`make test-gpu` runs this).

It runs, in order, and keeps going after a failure so that one log shows everything:
    python -m pytest -m gpu -v tests          # every test marked gpu (tests/test_cuda.py part 2:
                                              # the kernels, the 124M model, training, resume)
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0 --attention flash
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --attention flash
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --attention cudnn
    python gpt2_cuda.py --check -e d12 -b 1 -t 1024 --precision bf16 --attention <each of the three>
(--check reads its batch from the default -i, the Shakespeare shards: `make data` first.)
Each command's output (stdout and stderr, interleaved as printed) goes to the terminal and to
    dev/results/<UTC date>_<device>_test-gpu.log      e.g. 2026-11-22_nvidia-h100-80gb-hbm3_test-gpu.log
which starts with a header (the UTC time, the device as nvidia-smi or CuPy names it, the
driver, CuPy and CUDA runtime versions, the git commit, the commands) and ends with one line
per command and its exit status. A second run on the same day and device replaces that log.

What it deliberately is not: a test runner of its own. The checks live in the pytest files and
in gpt2_cuda.py --check; this only runs them and keeps the record.

Run it:
    python dev/run_gpu_tests.py
exits 0 if every command passed, 1 if any failed. Without a CUDA GPU (or CuPy) it prints one
line saying so and exits 2, writing no log.
"""

import argparse
import datetime
import os
import re
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from llmc import cuda  # noqa: E402  (imports CuPy only when asked: this file runs without it too)

RESULTS_DIR = os.path.join(REPO_ROOT, "dev", "results")
CHECK_ARGS = ["--check", "-e", "d12", "-b", "4", "-t", "64"]
NO_GPU_EXIT = 2


def commands():
    """The commands of a run, as argument lists (run from the repository root)."""
    python = sys.executable
    fp32, bf16 = ["--precision", "fp32", "-f", "0"], ["--precision", "bf16"]
    long = ["--check", "-e", "d12", "-b", "1", "-t", "1024"]
    return [
        [python, "-m", "pytest", "-m", "gpu", "-v", "tests"],
        [python, "gpt2_cuda.py"] + CHECK_ARGS + fp32,
        [python, "gpt2_cuda.py"] + CHECK_ARGS + bf16,
        [python, "gpt2_cuda.py"] + CHECK_ARGS + fp32 + ["--attention", "flash"],
        [python, "gpt2_cuda.py"] + CHECK_ARGS + bf16 + ["--attention", "flash"],
        [python, "gpt2_cuda.py"] + CHECK_ARGS + bf16 + ["--attention", "cudnn"],
    ] + [[python, "gpt2_cuda.py"] + long + bf16 + ["--attention", path] for path in ("naive", "flash", "cudnn")]


def device_name():
    """The first GPU's name: from nvidia-smi where it runs, else from CuPy."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def software_versions():
    """The driver (nvidia-smi), CuPy and CUDA runtime versions, as one line for the header."""
    parts = []
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip():
            parts.append(f"driver {r.stdout.strip().splitlines()[0]}")
    except (OSError, subprocess.TimeoutExpired):
        pass
    import cupy
    runtime = cupy.cuda.runtime.runtimeGetVersion()                   # e.g. 12090 for 12.9
    parts += [f"CuPy {cupy.__version__}", f"CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}"]
    return ", ".join(parts)


def device_slug(name):
    """A device name as a file-name part: lower case, runs of anything else than a-z0-9 -> '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.strip().lower()).strip("-")


def log_path(results_dir, date, device):
    """<results_dir>/<date>_<device slug>_test-gpu.log"""
    return os.path.join(results_dir, f"{date}_{device_slug(device)}_test-gpu.log")


def git_commit():
    """The checked-out commit, with ' (modified)' when the working tree differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT,
                              timeout=60).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=REPO_ROOT, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no git)"
    return (head or "unknown") + (" (modified)" if dirty else "")


def tee(line, log):
    """Write one line (with its newline) to the terminal and the log, at once."""
    sys.stdout.write(line)
    sys.stdout.flush()
    log.write(line)
    log.flush()


def run_and_tee(cmd, log):
    """Run cmd from the repository root, copying its output line by line to the terminal and to
    the open file `log`, between a `$ command` line and an `exit status N` line. Returns N."""
    tee(f"\n$ {' '.join(cmd)}\n", log)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}                    # children's lines arrive as printed
    with subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace", bufsize=1) as proc:
        for line in proc.stdout:
            tee(line, log)
    tee(f"exit status {proc.returncode}\n", log)
    return proc.returncode


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--results-dir", default=RESULTS_DIR, help="where the log goes")
    args = p.parse_args(argv)
    reason = cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/run_gpu_tests.py: no CUDA GPU found ({reason}); nothing to run here "
              "(`make test` runs the CPU tests)", file=sys.stderr)
        return NO_GPU_EXIT
    now = datetime.datetime.now(datetime.timezone.utc)
    device = device_name()
    cmds = commands()
    os.makedirs(args.results_dir, exist_ok=True)
    path = log_path(args.results_dir, now.strftime("%Y-%m-%d"), device)
    with open(path, "w") as log:
        tee(f"# dev/run_gpu_tests.py, {now.strftime('%Y-%m-%d %H:%M:%S')} UTC\n"
            f"# device: {device} ({software_versions()})\n"
            f"# commit: {git_commit()}\n"
            "# commands:\n" + "".join(f"#   {' '.join(c)}\n" for c in cmds), log)
        statuses = [run_and_tee(cmd, log) for cmd in cmds]
        tee("\n# summary\n" + "".join(f"#   {'PASS' if s == 0 else f'FAIL ({s})':9s} {' '.join(c)}\n"
                                      for c, s in zip(cmds, statuses)), log)
        failed = sum(s != 0 for s in statuses)
        tee(f"# {'all passed' if not failed else f'{failed} of {len(cmds)} FAILED'}; log: {path}\n", log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
