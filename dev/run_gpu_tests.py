"""
dev/run_gpu_tests.py: the first contact with a GPU machine, in one command: everything that needs
a GPU to check gpt2_cuda.py, with its output kept as a dated log (`make test-gpu` runs this).

It runs, in order, each command with its own time limit, and keeps going after a failure so that
one log shows everything:
    pip install --no-index --no-deps --target <site> .whl/*.whl   # the carried wheels, if .whl/ is there
    python dev/data/tinyshakespeare.py                            # only if data/ lacks the shards
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0 --attention naive --cublaslt 0
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --attention naive --cublaslt 0
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0 --attention flash
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --attention flash
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision bf16 --attention cudnn
    python dev/bench.py --only cupy -b 16 --steps 10 --warmup 3   # ours (its defaults) at B=16: the first number
    python gpt2_cuda.py -x 50 -v 25 -s 50                         # 50 steps on Shakespeare
    python -m pytest -m gpu -v -rs --continue-on-collection-errors tests   # every test marked gpu
    python dev/bench.py --only torch -b 16                        # the PyTorch twin at B=16
    python gpt2_cuda.py --check -e d12 -b 1 -t 1024 --precision bf16 --attention <naive, flash, cudnn>
    python dev/bench.py -e llama3:d4 -b 16 --steps 10 --warmup 3  # llama3_cuda.py against its twin, last
The bench of ours comes right after the checks, before the long test run, so that a run cut short
still brings back a number; a test module that fails to import is one error among the results,
not the end of the test run (--continue-on-collection-errors).
--quick gives the twin fewer steps and every command a shorter limit, so that the whole run ends
inside --deadline seconds (default 540 with --quick: one device command of at most 10 minutes);
a command that would start after the deadline is recorded as NOT RUN. The wheels are installed
into /tmp/llmc-site, which is put first on the commands' PYTHONPATH.
(--check reads its batch from the Shakespeare shards: carry data/ to a machine without network.)

Each command's output (stdout and stderr, interleaved as printed) goes to the terminal and to
    <results>/<UTC date>_<device>_test-gpu.log      e.g. 2026-11-22_nvidia-h100-80gb-hbm3_test-gpu.log
(`_test-gpu-quick.log` with --quick), where <results> is --results-dir, else $OUT when set (the
device tool's folder that comes back), else dev/results/. The log starts with a header (the UTC
time, the device as nvidia-smi or CuPy names it, the driver, CuPy and CUDA runtime versions, the
versions of the packages that matter, the git commit, the commands) and ends with one line per
command: PASS, FAIL (exit status), TIMEOUT, SKIP (why) or NOT RUN, and its seconds. A `--attention
cudnn` run that fell back to flash (no cuDNN frontend) is a SKIP with the trainer's reason, not a
PASS. A second run on the same day and device replaces that log.

What it deliberately is not: a test runner of its own. The checks live in the pytest files and
in gpt2_cuda.py --check; this only runs them and keeps the record.

--emulated rehearses the same run without a GPU, on the emulated CUDA device (llmc/emulator/: the
kernels compiled by g++ and run on the CPU, `gpt2_cuda.py --device cpu`): every gpt2_cuda.py
command gets `--device cpu` and the d2 model at small shapes in place of d12 (the emulated device
runs a 124M --check in hours, not seconds), `pytest -m gpu` becomes the emulated kernel tests,
the bench of ours (timings mean nothing there) becomes dev/bench_emulator.py, and the twin's bench
a few CPU steps of the twin (dev/torch_reference.py). Its log is named
`_test-gpu-emulated.log`. It checks the runner, the commands and the kernels' results; it says
nothing of a GPU's numerics, speed or memory.

Run it:
    python dev/run_gpu_tests.py [--quick] [--emulated]
exits 0 if no command failed, 1 if any failed or timed out. Without a CUDA GPU (or CuPy), and
without --emulated, it prints one line saying so and exits 2, writing no log. dev/results/README.md gives the plan of the first
run on the device machine.
"""

import datetime
import glob
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from llmc import cuda  # noqa: E402  (imports CuPy only when asked: this file runs without it too)
from llmc.cli import ArgumentParser  # noqa: E402

RESULTS_DIR = os.path.join(REPO_ROOT, "dev", "results")
WHEEL_DIR = os.path.join(REPO_ROOT, ".whl")
SITE = "/tmp/llmc-site"                # the carried wheels go here, first on the commands' PYTHONPATH
SHARDS = [os.path.join(REPO_ROOT, "data", "tinyshakespeare", f"tiny_shakespeare_{split}.bin") for split in ("train", "val")]
# The model and batch of each kind of command: on the GPU the 124M model; on the emulated device
# (--emulated) the d2 model at shapes it runs in seconds to a minute on two cores.
GPU_SHAPES = {"check": ["-e", "d12", "-b", "4", "-t", "64"], "check-long": ["-e", "d12", "-b", "1", "-t", "1024"],
              "train": ["-x", "50", "-v", "25", "-s", "50"]}
EMULATED_SHAPES = {"check": ["-e", "d2", "-b", "2", "-t", "32"], "check-long": ["-e", "d2", "-b", "1", "-t", "128"],
                   "train": ["-e", "d2", "-b", "2", "-t", "32", "-x", "4", "-v", "2", "-s", "4", "-g", "8"]}
NO_GPU_EXIT = 2
EMULATED_DEVICE = "emulated CUDA device (CPU)"
TIMEOUT_EXIT = 124                      # as timeout(1) reports it
QUICK_DEADLINE_S = 540                  # one device command may run 600 s; 60 s to spare
# Time limits per command, in seconds, (full run, --quick). The first GPU run (H100, 2026-11-26,
# dev/results/README.md) took 11-13 s per --check, 17-25 s per long one, 10 s for our bench, 55 s
# for the twin's (torch.compile first), 192 s for `pytest -m gpu` (then 257 tests); the second
# (the same day, 259 tests) 224 s for it, 92 s for the Llama 3 bench, 511 s in all (the quick limit
# leaves room for the five CUDA-graph GPU tests added since); the first --check compiles every
# kernel (NVRTC) and each builds the 124M reference with gpt2_cpu.py on the host.
LIMITS_S = {"wheels": (120, 60), "data": (300, 120), "check": (300, 40), "check-long": (300, 50),
            "train": (300, 60), "pytest": (1800, 260), "bench": (600, 90), "twin": (1800, 180),
            "bench-llama3": (900, 150)}
BENCH_STEPS = ["--steps", "10", "--warmup", "3"]      # ours' bench: a few steps, so that it comes back early
PACKAGES = ["numpy", "cupy-cuda13x", "cupy-cuda12x", "torch", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12",
            "nvidia-cudnn-frontend", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvmath-python", "tiktoken", "pytest"]
CUDNN_FALLBACK = re.compile(r"cuDNN attention unavailable \((.*)\): using (\w+) attention")


def commands():
    """The commands of a full run, as argument lists (run from the repository root)."""
    return preparation() + _commands(quick=False)


def quick_commands():
    """The commands of a --quick run: the same list, the twin's bench at fewer steps."""
    return preparation() + _commands(quick=True)


def emulated_commands(quick):
    """The commands of an --emulated rehearsal: the same list on the emulated device."""
    return preparation() + _commands(quick, emulated=True)


def _commands(quick, emulated=False):
    """The checks, the bench of ours, the training run, the tests, the twin's bench, the long
    checks and Llama 3's bench (llama3_cuda.py against its twin). emulated: the same list for the emulated device (EMULATED_SHAPES in place of the GPU
    shapes, `--device cpu`, the emulated kernel tests in place of `pytest -m gpu`,
    dev/bench_emulator.py in place of our bench and of Llama 3's, and a few CPU steps of the twin in
    place of its)."""
    python = sys.executable
    shapes = EMULATED_SHAPES if emulated else GPU_SHAPES
    trainer = [python, "gpt2_cuda.py"] + (["--device", "cpu"] if emulated else [])
    fp32, bf16 = ["--precision", "fp32", "-f", "0"], ["--precision", "bf16"]
    readable = ["--attention", "naive", "--cublaslt", "0"]   # the others run the default --cublaslt auto
    check, long = ["--check"] + shapes["check"], ["--check"] + shapes["check-long"]
    if emulated:
        llama3_bench = [python, "dev/bench_emulator.py", "-e", "llama3:d2", "-b", "1", "-t", "16", "--repeats", "1"]
        tests = [python, "-m", "pytest", "-q", "-rs", "--continue-on-collection-errors", "-m", "not slow",
                 "tests/test_emulated_kernels.py"]
        bench = [python, "dev/bench_emulator.py"] + (["-e", "d2", "-b", "2", "--repeats", "1"] if quick else [])
        twin = [python, "dev/torch_reference.py", "-e", "d2", "-b", "2", "-t", "32", "-x", "4"]
    else:
        llama3_bench = [python, "dev/bench.py", "-e", "llama3:d4", "-b", "16"] + BENCH_STEPS   # ours and its twin
        tests = [python, "-m", "pytest", "-m", "gpu", "-v", "-rs", "--continue-on-collection-errors", "tests"]
        bench = [python, "dev/bench.py", "--only", "cupy", "-b", "16"] + BENCH_STEPS
        twin = [python, "dev/bench.py", "--only", "torch", "-b", "16"] + (BENCH_STEPS if quick else [])
    return [
        trainer + check + fp32 + readable,
        trainer + check + bf16 + readable,
        trainer + check + fp32 + ["--attention", "flash"],
        trainer + check + bf16 + ["--attention", "flash"],
        trainer + check + bf16 + ["--attention", "cudnn"],
        bench,
        trainer + shapes["train"],
        tests,
        twin,
    ] + [trainer + long + bf16 + ["--attention", path] for path in ("naive", "flash", "cudnn")] + [llama3_bench]


def kind_of(cmd):
    """The LIMITS_S key of a command."""
    text = " ".join(cmd)
    if "pip install" in text or (len(cmd) > 2 and cmd[1:3] == ["-m", "pip"]):
        return "wheels"
    for key, marker in (("data", "tinyshakespeare.py"), ("bench-llama3", "llama3:"), ("pytest", "pytest"),
                        ("twin", "--only torch"),
                        ("twin", "torch_reference.py"), ("bench", "bench.py"), ("bench", "bench_emulator.py"),
                        ("check-long", "-b 1 -t"), ("check", "--check")):
        if marker in text:
            return key
    return "train"


def limit_s(cmd, quick):
    return LIMITS_S[kind_of(cmd)][1 if quick else 0]


def preparation(site=SITE, wheel_dir=WHEEL_DIR, shards=SHARDS):
    """The commands before the checks: install the carried wheels (if wheel_dir holds any) into
    `site`, and build data/ (if a shard is missing)."""
    python = sys.executable
    cmds = []
    wheels = sorted(os.path.relpath(w, REPO_ROOT) for w in glob.glob(os.path.join(wheel_dir, "*.whl")))
    if wheels:
        cmds.append([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                     "--upgrade", "--target", site] + wheels)
    if not all(os.path.isfile(p) for p in shards):
        cmds.append([python, "dev/data/tinyshakespeare.py"])
    return cmds


def verdict(cmd, status, output):
    """One summary word for a finished command: PASS, FAIL (status), TIMEOUT, or SKIP (why) for a
    `--attention cudnn` run that passed on another path because cuDNN attention is unavailable."""
    if status == TIMEOUT_EXIT:
        return "TIMEOUT"
    if status != 0:
        return f"FAIL ({status})"
    fallback = CUDNN_FALLBACK.search(output) if "cudnn" in cmd else None
    if fallback:
        return f"SKIP (cuDNN attention unavailable, ran {fallback.group(2)}: {fallback.group(1)})"
    return "PASS"


def shown(cmd):
    """A command as the summary shows it: this interpreter's path as `python`."""
    return " ".join(["python" if arg == sys.executable else arg for arg in cmd])


def package_versions():
    """'name version, ...' of the PACKAGES installed here (no import: read from their metadata)."""
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"Python {sys.version.split()[0]}; " + ", ".join(found)


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


def emulator_versions():
    """The compiler that builds the emulated device's kernels, as one line for the header."""
    from llmc.emulator import build
    return f"emulated: kernels compiled by {build.compiler_version()}; no GPU"


def device_slug(name):
    """A device name as a file-name part: lower case, runs of anything else than a-z0-9 -> '-'."""
    return re.sub(r"[^a-z0-9]+", "-", name.strip().lower()).strip("-")


def log_path(results_dir, date, device, name="test-gpu"):
    """<results_dir>/<date>_<device slug>_<name>.log"""
    return os.path.join(results_dir, f"{date}_{device_slug(device)}_{name}.log")


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


def run_and_tee(cmd, log, timeout_s=None, env=None, output=None):
    """Run cmd from the repository root, copying its output line by line to the terminal and to
    the open file `log`, between a `$ command` line and an `exit status N` line. After timeout_s
    seconds the command and every process it started are killed, and N is TIMEOUT_EXIT. The lines
    are also appended to the list `output` when one is given. Returns N."""
    tee(f"\n$ {' '.join(cmd)}\n", log)
    env = {**(env or os.environ), "PYTHONUNBUFFERED": "1"}            # children's lines arrive as printed
    timed_out = threading.Event()
    with subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace", bufsize=1, start_new_session=True) as proc:
        def kill():
            timed_out.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)                     # its own session: pytest's and bench's children too
            except ProcessLookupError:
                pass
        timer = threading.Timer(timeout_s, kill) if timeout_s else None
        if timer:
            timer.start()
        for line in proc.stdout:
            tee(line, log)
            if output is not None:
                output.append(line)
        proc.wait()
        if timer:
            timer.cancel()
    status = TIMEOUT_EXIT if timed_out.is_set() else proc.returncode
    tee(f"exit status {status}" + (f" (killed after {timeout_s:.0f} s)" if timed_out.is_set() else "") + "\n", log)
    return status


def main(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--results-dir", default=os.environ.get("OUT") or RESULTS_DIR,
                   help="where the log goes (default: $OUT when set, else dev/results/)")
    p.add_argument("--quick", action="store_true", help="shorter limits and bench, to end inside --deadline")
    p.add_argument("--emulated", action="store_true",
                   help="rehearse on the emulated CUDA device (no GPU): small shapes, --device cpu, no timings")
    p.add_argument("--deadline", type=float, default=None,
                   help=f"seconds after which no command starts (default: {QUICK_DEADLINE_S} with --quick, none without)")
    args = p.parse_args(argv)
    started = time.monotonic()
    deadline = args.deadline if args.deadline is not None else (QUICK_DEADLINE_S if args.quick else None)
    reason = None if args.emulated else cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/run_gpu_tests.py: no CUDA GPU found ({reason}); nothing to run here "
              "(`make test` runs the CPU tests)", file=sys.stderr)
        return NO_GPU_EXIT
    now = datetime.datetime.now(datetime.timezone.utc)
    device = EMULATED_DEVICE if args.emulated else device_name()
    if args.emulated:
        cmds = emulated_commands(args.quick)
    else:
        cmds = quick_commands() if args.quick else commands()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SITE, os.environ.get("PYTHONPATH")]))}
    os.makedirs(args.results_dir, exist_ok=True)
    name = "test-gpu" + ("-quick" if args.quick else "") + ("-emulated" if args.emulated else "")
    path = log_path(args.results_dir, now.strftime("%Y-%m-%d"), device, name)
    results = []                                                       # (command, verdict, seconds)
    with open(path, "w") as log:
        flags = (" --quick" if args.quick else "") + (" --emulated" if args.emulated else "")
        tee(f"# dev/run_gpu_tests.py{flags}, {now.strftime('%Y-%m-%d %H:%M:%S')} UTC\n"
            f"# device: {device} ({emulator_versions() if args.emulated else software_versions()})\n"
            f"# commit: {git_commit()}\n"
            "# commands:\n" + "".join(f"#   {' '.join(c)}\n" for c in cmds), log)
        for cmd in cmds:
            # the emulated device is slower than a GPU: the full run's limits, also with --quick
            limit = limit_s(cmd, args.quick and not args.emulated) if (args.quick or deadline) else None
            if deadline is not None:
                left = deadline - (time.monotonic() - started)
                if left < 10:
                    results.append((cmd, f"NOT RUN (past the {deadline:.0f} s deadline)", 0.0))
                    continue
                limit = min(limit, left)
            t0, output = time.monotonic(), []
            status = run_and_tee(cmd, log, timeout_s=limit, env=env, output=output)
            results.append((cmd, verdict(cmd, status, "".join(output)), time.monotonic() - t0))
            if kind_of(cmd) == "wheels":                               # the header's versions see them too
                sys.path.insert(0, SITE)
        failed = sum(v.startswith(("FAIL", "TIMEOUT")) for _, v, _ in results)
        tee(f"\n# versions: {package_versions()}\n# summary ({time.monotonic() - started:.0f} s)\n"
            + "".join(f"#   {v:9s} {t:6.1f} s  {shown(c)}\n" for c, v, t in results), log)
        tee(f"# {'all passed' if not failed else f'{failed} of {len(cmds)} FAILED'}; log: {path}\n", log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
