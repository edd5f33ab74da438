"""
dev/setup_env.py: install what one `make` target needs, and nothing that already works. The
Makefile runs it before each target's command; it uses only the standard library, so it runs
before anything is installed.

    python3 dev/setup_env.py TARGET [--dry-run]   install TARGET's packages (dry run: say what it would do)
    python3 dev/setup_env.py --python             print the interpreter the Makefile runs commands with
    python3 dev/setup_env.py --trainer            print gpt2_cuda.py where CuPy sees a GPU, else gpt2_cpu.py
                                                  (and, on stderr, why the GPU trainer cannot run)
    python3 dev/setup_env.py gpu-wheels           download the wheels a GPU machine without network
                                                  lacks into .whl/ (see dev/results/README.md)
TARGET is one of data, train, twin, debug, bench, bench-cpu, test, test-gpu, dev-cuda, compile-kernels.

The rules, in order:
  1. Where: the active virtual environment when there is one (sys.prefix != sys.base_prefix, or
     $VIRTUAL_ENV set); else .venv in the repository, created once with --system-site-packages (so
     what the system Python already has still counts), said in one line. A stock Debian/Ubuntu
     Python refuses `pip install` outside a virtual environment (PEP 668); this never asks it to.
  2. What: each target needs a few packages (NEEDS). A package that imports is never installed
     again, never upgraded: the GPU machine's cupy-cuda13x and CUDA torch stay as they are. A
     package that is installed but does not import is not replaced either (pip would put a second
     CuPy over the first, both owning cupy/): the reason is printed, nothing is installed for it.
  3. CuPy: only where an NVIDIA driver is present (`nvidia-smi` prints "CUDA Version: 13.0") and no
     CuPy distribution is installed: the wheel for the driver's CUDA major, cupy-cuda12x or
     cupy-cuda13x, with its [ctk] extra (CUDA's NVRTC, runtime and cuBLAS as wheels: a machine
     with only the driver has none of them, and CuPy compiles every kernel with NVRTC). The CPU
     test suite's NVRTC compile check needs CuPy's NVRTC binding: there, and only where no CuPy
     exists, requirements-dev.txt's cupy-cuda12x and the NVRTC wheels.
  4. The GPU extras (GPU_EXTRAS): where a driver is present, the GPU targets also ask for the
     libraries behind a GPU run's default fast paths, the cuDNN frontend and library (--attention
     auto picks cuDNN) and nvmath-python (--cublaslt auto picks cuBLASLt), at the versions the
     first GPU run used. They are optional, installed after the rest in a pip call with a short
     network timeout: offline that costs seconds and one line, and the trainer takes its own
     attention and cuBLAS instead, saying so.
  5. The tools' packages (TOOL_PACKAGES): `make train` also installs matplotlib, safetensors and
     tqdm, which the README's commands after it use, with the GPU extras' short timeout; torch
     (the PyTorch twins, about 2 GB) is `make twin`'s, and `make test` installs every test package.
  6. Versions come from requirements.txt and requirements-dev.txt (one place for the pins); the
     CUDA-13 forms are in CUDA13_PACKAGES below, the GPU extras' in GPU_EXTRAS.
  6. Chromium (the browser tests drive it with Playwright): Debian's package, with apt-get, where
     /usr/bin/chromium is missing and this runs as root with apt-get; otherwise one line saying so,
     and the browser tests skip (Playwright's own browser download cannot be fetched here).
A package that cannot be installed (no network, PIP_NO_INDEX=1) ends the target with one
`error:` line naming it when the target cannot run without it, and is reported in one line and
skipped when it is optional (the tests that need it skip).

What it deliberately is not: a lock file or a resolver. It asks pip for the few names it lacks.

Example, on a fresh CPU machine with a stock Python:
    $ make train
    setup: no active virtual environment: created .venv (python3 -m venv --system-site-packages); make runs .venv/bin/python
    setup (train): installing numpy>=1.26 tiktoken>=0.7
    setup (train): installing what the README's later commands use: matplotlib>=3.8 safetensors>=0.8 tqdm
"""

import argparse
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.path.join(REPO_ROOT, ".venv")
REQUIREMENTS = [os.path.join(REPO_ROOT, "requirements.txt"), os.path.join(REPO_ROOT, "requirements-dev.txt")]
WHEEL_DIR = os.path.join(REPO_ROOT, ".whl")
NVIDIA_SMI_TIMEOUT_S = 30

# ----------------------------------------------------------------------------
# what each target needs

# Keys are the names used below; "cupy" is the GPU array library (any cupy-* distribution) and
# "nvrtc" CuPy's NVRTC binding plus the CUDA headers (what dev/cuda/nvrtc_compile.py needs).
# The README's commands after `make train` need a few small packages (TOOL_PACKAGES: the plots of
# dev/vislog.py and the tutorials, the Hugging Face export, progress bars), so make train installs
# them too, after the rest, in a pip call of their own with a short timeout: offline that costs
# seconds and one line, and each tool names its missing package when run. torch (about 2 GB, the
# PyTorch twins) stays behind `make twin` (and `make test`, which installs every test package).
TOOL_PACKAGES = ("matplotlib", "safetensors", "tqdm")
NEEDS = {
    "data":            {"required": ["numpy", "tiktoken"], "optional": []},
    "train":           {"required": ["numpy", "tiktoken"], "optional": ["cupy", "cudnn", "nvmath", *TOOL_PACKAGES]},
    "debug":           {"required": ["numpy", "tiktoken", "plotly"], "optional": []},
    "twin":            {"required": ["numpy", "torch"], "optional": []},
    "bench":           {"required": ["numpy", "tiktoken", "cupy", "torch"], "optional": ["cudnn", "nvmath"]},
    "bench-cpu":       {"required": ["numpy"], "optional": ["torch"]},     # torch: PyTorch's step, the reference
    "test-gpu":        {"required": ["numpy", "tiktoken", "pytest", "cupy"], "optional": ["torch", "cudnn", "nvmath"]},
    "dev-cuda":        {"required": ["numpy", "cupy"], "optional": ["cudnn", "nvmath"]},
    "compile-kernels": {"required": ["numpy", "nvrtc"], "optional": []},
    "test":            {"required": ["numpy", "tiktoken", "pytest"],
                        "optional": ["torch", "mpi4py", "mpich", "transformers", "peft", "safetensors", "matplotlib",
                                     "tqdm", "nvrtc", "plotly", "playwright", "chromium"]},
}
GPU_TARGETS = ("bench", "test-gpu", "dev-cuda")   # need a GPU: without a driver they install no CuPy

# key -> (distribution names as in the requirements files, module to import to see it works)
PACKAGES = {
    "numpy": (["numpy"], "numpy"),
    "tiktoken": (["tiktoken"], "tiktoken"),
    "pytest": (["pytest"], "pytest"),
    "torch": (["torch"], "torch"),
    "mpi4py": (["mpi4py"], "mpi4py.MPI"),          # .MPI: loads the MPI library, not only the package
    "transformers": (["transformers"], "transformers"),
    "peft": (["peft"], "peft"),
    "safetensors": (["safetensors"], "safetensors"),
    "matplotlib": (["matplotlib"], "matplotlib"),
    "tqdm": (["tqdm"], "tqdm"),
    "plotly": (["plotly"], "plotly"),
    "playwright": (["playwright"], "playwright.sync_api"),
}
# key -> (Debian package, the file that shows it is installed): installed with apt-get (rule 6)
APT_PACKAGES = {"chromium": ("chromium", "/usr/bin/chromium")}
APT_TIMEOUT_S = 900
CUPY_FOR_CUDA = {12: "cupy-cuda12x", 13: "cupy-cuda13x"}
CUPY_EXTRA = "ctk"          # cupy-cudaXXx[ctk]: CUDA's libraries from PyPI (cuda-toolkit[nvrtc,cublas,...])
# The GPU extras (rule 4), per driver CUDA major: key -> (the module whose import says it works,
# the requirements). The pins are the ones the first GPU run used (GPU_WHEELS below); nvmath's
# cuda-bindings must match the driver's major (nvmath-python's sysctk12/sysctk13 extras say so,
# without their cuTENSOR, which llmc does not use); cuBLAS comes with CuPy's [ctk] or with torch.
FRONTEND_PIN, NVMATH_PIN = "nvidia-cudnn-frontend==1.32.0", "nvmath-python==1.0.0"
GPU_EXTRAS = {
    "cudnn": ("cudnn", {12: [FRONTEND_PIN, "nvidia-cudnn-cu12"], 13: [FRONTEND_PIN, "nvidia-cudnn-cu13"]}),
    "nvmath": ("nvmath", {12: [NVMATH_PIN, "cuda-bindings>=12.9.2,<13"], 13: [NVMATH_PIN, "cuda-bindings>=13.0.1,<14"]}),
}
EXTRAS_PIP_OPTIONS = ["--retries", "0", "--timeout", "5"]    # offline: seconds, not pip's minutes
# The CUDA-13 wheels carry no -cu13 suffix: nvidia-cuda-nvrtc 13.x is CUDA 13's NVRTC.
CUDA13_PACKAGES = {"cupy-cuda13x": "cupy-cuda13x==14.2.0",
                   "nvrtc": ["nvidia-cuda-nvrtc==13.*", "nvidia-cuda-runtime==13.*"]}
CUDA12_NVRTC = ["nvidia-cuda-nvrtc-cu12", "nvidia-cuda-runtime-cu12"]


def read_requirements(paths=REQUIREMENTS):
    """{distribution name (lower case): the requirement as written, e.g. 'torch==2.13.0'} from the
    requirements files, comments, blank and `-r` lines skipped."""
    specs = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if not line or line.startswith("-"):
                    continue
                name = re.match(r"[A-Za-z0-9._-]+", line).group(0).lower()
                specs[name] = line
    return specs


# ----------------------------------------------------------------------------
# the decision: a pure function of what was probed

def plan(target, works, installed, cuda_major, specs):
    """What to install for `target`, as (install, notes, missing_required).

    works:      {key: None if it imports and works, else the one-line reason}, for every key NEEDS
                names for the target ("cupy", "nvrtc", "mpich", the GPU_EXTRAS and PACKAGES keys)
    installed:  set of installed distribution names, lower case (e.g. {"cupy-cuda13x", "torch"})
    cuda_major: the driver's CUDA major version from nvidia-smi (12, 13, ...), None without a driver
    specs:      read_requirements()'s {name: requirement}
    Returns install (requirements for pip, in order; the GPU extras' last, is_gpu_extra tells them
    apart), notes (one line each: what is not installed and why) and missing_required (the
    required keys that will still not work afterwards)."""
    need = NEEDS[target]
    install, notes, missing = [], [], []
    cupy_installed = sorted(d for d in installed if d == "cupy" or d.startswith("cupy-"))
    for key in need["required"] + need["optional"]:
        required = key in need["required"]
        reason = works.get(key, "not probed")
        if reason is None or key in APT_PACKAGES:            # apt's are apt_install's
            continue
        wanted, why_not = _packages_for(key, target, installed, cupy_installed, cuda_major, specs, reason)
        if wanted:
            install += [w for w in wanted if w not in install]
        elif why_not:
            notes.append(why_not)
            if required:
                missing.append(key)
    install.sort(key=is_gpu_extra)             # stable: the others first, in their order
    return install, notes, missing


def is_tool_package(requirement):
    """True for a requirement of TOOL_PACKAGES (make train installs them last, with a short timeout)."""
    return _name(requirement) in {name for key in TOOL_PACKAGES for name in PACKAGES[key][0]}


def is_gpu_extra(requirement):
    """True for a requirement of GPU_EXTRAS (installed last, optional, with a short timeout)."""
    return any(_name(requirement) == _name(r) for _, by_major in GPU_EXTRAS.values()
               for requirements in by_major.values() for r in requirements)


def _packages_for(key, target, installed, cupy_installed, cuda_major, specs, reason):
    """(requirements to install for one key that does not work, or [] and the reason why not;
    None as the reason for a GPU extra on a machine without a driver: the CuPy line says it)."""
    if key in GPU_EXTRAS:
        by_major = GPU_EXTRAS[key][1]
        if cuda_major not in by_major:
            return [], None
        wanted = by_major[cuda_major]            # pip leaves alone what already meets them
        if _name(wanted[0]) in installed:
            return [], f"{_name(wanted[0])} is installed but does not import ({reason}); not replacing it"
        return list(wanted), None
    if key == "cupy":
        if cupy_installed:
            return [], (f"CuPy ({', '.join(cupy_installed)}) is installed but does not work ({reason}); "
                        "not installing a second CuPy: fix or remove that one")
        if cuda_major is None:
            where = "the GPU commands need one" if target in GPU_TARGETS else "the NumPy trainer runs instead"
            return [], f"no NVIDIA driver (nvidia-smi reports no CUDA version): no CuPy installed; {where}"
        if cuda_major not in CUPY_FOR_CUDA:
            return [], f"the driver supports CUDA {cuda_major}: no CuPy wheel chosen for it (12 and 13 are known)"
        return [_cupy_spec(cuda_major, specs, extra=CUPY_EXTRA)], None
    if key == "nvrtc":
        if cupy_installed:                    # keep that CuPy; add the NVRTC wheels of its CUDA major
            major = 13 if "cupy-cuda13x" in cupy_installed else 12
        else:                                 # no CuPy: the driver's, else CUDA 12 (the CPU check)
            major = 13 if cuda_major == 13 else 12
        with_libraries = CUPY_EXTRA if cuda_major in CUPY_FOR_CUDA else None   # a GPU: the CuPy train would install
        wanted = [] if cupy_installed else [_cupy_spec(major, specs, extra=with_libraries)]
        wanted += CUDA13_PACKAGES["nvrtc"] if major == 13 else [specs.get(n, n) for n in CUDA12_NVRTC]
        if all(_name(w) in installed for w in wanted):
            return [], f"NVRTC does not work ({reason}), though {' '.join(_name(w) for w in wanted)} are installed"
        return wanted, None
    if key == "mpich":
        return [specs.get("mpich", "mpich")], None
    names, _ = PACKAGES[key]
    present = [n for n in names if n in installed]
    if present:
        return [], f"{present[0]} is installed but does not import ({reason}); not replacing it"
    return [specs.get(n, n) for n in names], None


def _cupy_spec(major, specs, extra=None):
    """The pinned requirement of the CuPy for CUDA `major`, e.g. cupy-cuda13x==14.2.0, or with
    extra="ctk" cupy-cuda13x[ctk]==14.2.0."""
    name = CUPY_FOR_CUDA[major]
    spec = specs.get(name) or CUDA13_PACKAGES.get(name, name)
    return spec.replace(name, f"{name}[{extra}]", 1) if extra else spec


def _name(requirement):
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower()


# ----------------------------------------------------------------------------
# the environment: which Python, which virtual environment

def choose_environment(prefix, base_prefix, virtual_env, venv_dir, executable):
    """(kind, python): ("active", executable) inside a virtual environment (prefix != base_prefix,
    or $VIRTUAL_ENV set, then its bin/python); else ("create", venv python) when venv_dir does not
    exist yet, or ("existing", venv python)."""
    if prefix != base_prefix:
        return "active", executable
    if virtual_env:
        return "active", os.path.join(virtual_env, "bin", "python")
    python = os.path.join(venv_dir, "bin", "python")
    return ("existing" if os.path.exists(python) else "create"), python


def create_venv(venv_dir):
    """python -m venv --system-site-packages venv_dir. Raises SystemExit with one error line."""
    r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv_dir],
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        sys.exit(f"error: cannot create {venv_dir} ({last[0]}): install python3-venv "
                 "(apt install python3-venv) or activate a virtual environment first")


# ----------------------------------------------------------------------------
# probing this interpreter and the machine

def probe_import(module):
    """None if `module` imports, else 'ExceptionType: first line'."""
    try:
        importlib.import_module(module)
        return None
    except BaseException as e:              # ImportError, OSError from a library, CuPy's RuntimeError
        if isinstance(e, KeyboardInterrupt):
            raise
        return f"{type(e).__name__}: {e}".splitlines()[0]


def probe_nvrtc():
    """None if CuPy's NVRTC loads and the CUDA headers are found (dev/cuda/nvrtc_compile.py's own
    check, in a child process, as it needs NumPy), else its last error line."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import nvrtc_compile as n; "
            "n.load_nvrtc(); n.cuda_include_dir()")
    r = subprocess.run([sys.executable, "-c", code, os.path.join(REPO_ROOT, "dev", "cuda")],
                       capture_output=True, text=True)
    return None if r.returncode == 0 else ((r.stderr.strip().splitlines() or ["failed"])[-1])


def probe_mpiexec():
    """None if mpiexec is on PATH or beside this interpreter, else the reason."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return None if shutil.which("mpiexec") or os.path.exists(here) else "no mpiexec on PATH"


def installed_distributions():
    """Names (lower case) of the distributions installed for this interpreter."""
    return {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()} - {""}


def driver_cuda_major(nvidia_smi="nvidia-smi"):
    """The CUDA major version the NVIDIA driver supports, from nvidia-smi's header line
    ("| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |"), or None when
    there is no nvidia-smi or it fails (no driver)."""
    try:
        r = subprocess.run([nvidia_smi], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"CUDA Version:\s*(\d+)\.", r.stdout)
    return int(match.group(1)) if r.returncode == 0 and match else None


def probe(target):
    """{key: None or reason} for every key the target needs."""
    need = NEEDS[target]
    works = {}
    for key in need["required"] + need["optional"]:
        if key == "cupy":
            works[key] = probe_import("cupy")
        elif key == "nvrtc":
            works[key] = probe_nvrtc()
        elif key == "mpich":
            works[key] = probe_mpiexec()
        elif key in GPU_EXTRAS:
            works[key] = probe_import(GPU_EXTRAS[key][0])
        elif key in APT_PACKAGES:
            path = APT_PACKAGES[key][1]
            works[key] = None if os.path.isfile(path) else f"no {path}"
        else:
            works[key] = probe_import(PACKAGES[key][1])
    return works


# ----------------------------------------------------------------------------
# doing it

def pip_install(requirements, options=()):
    """pip install the requirements into this interpreter; None on success, else pip's last error line."""
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *options, *requirements],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return None
    lines = [l for l in (r.stderr + r.stdout).strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("ERROR")]
    return (errors or lines or ["pip failed"])[-1].strip()


def apt_install(target, key):
    """Install APT_PACKAGES[key] with apt-get where this runs as root and has apt-get (updating the
    package lists once if the first try fails); otherwise, or if it fails, one line: the tests
    that need it skip."""
    package, path = APT_PACKAGES[key]
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        print(f"setup ({target}): no {path}; `sudo apt-get install {package}` adds it (the tests that need it skip)")
        return
    print(f"setup ({target}): installing Debian's {package} (apt-get install -y {package}) for the browser tests")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", package]
    try:
        r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=APT_TIMEOUT_S)
            r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        r = None
    if r is None or r.returncode != 0 or not os.path.isfile(path):
        last = ((r.stderr or r.stdout).strip().splitlines() or ["no output"])[-1] if r else "timed out"
        print(f"setup ({target}): could not install {package} ({last}); the tests that need it skip")


def setup(target, dry_run):
    """Probe, plan, install, probe again. Returns the exit status (0, or 1 after an error line)."""
    specs = read_requirements()
    works = probe(target)
    installed, cuda_major = installed_distributions(), driver_cuda_major()
    install, notes, missing = plan(target, works, installed, cuda_major, specs)
    for note in notes:
        print(f"setup ({target}): {note}")
    if dry_run:
        apt = [APT_PACKAGES[k][0] for k in NEEDS[target]["required"] + NEEDS[target]["optional"]
               if k in APT_PACKAGES and works.get(k) is not None]
        print(f"setup ({target}): would install: {' '.join(install) or 'nothing'}"
              + (f"; with apt-get: {' '.join(apt)}" if apt else ""))
        return 0
    extras = [r for r in install if is_gpu_extra(r)]
    tools = [r for r in install if is_tool_package(r)] if target == "train" else []
    install = [r for r in install if not is_gpu_extra(r) and r not in tools]
    failure = None
    if install:
        print(f"setup ({target}): installing {' '.join(install)}")
        failure = pip_install(install)
        if failure and len(install) > 1:      # one that cannot be had must not keep out the others
            failures = [pip_install([requirement]) for requirement in install]
            failure = next((f for f in failures if f), None)
    if tools:                                 # optional: a short timeout, one line if they cannot be had
        print(f"setup ({target}): installing what the README's later commands use: {' '.join(tools)}")
        tools_failure = pip_install(tools, EXTRAS_PIP_OPTIONS)
        if tools_failure:
            print(f"setup ({target}): could not install them ({tools_failure}); training needs none of them, "
                  f"and a tool that does names its package when run")
    if extras:                                # optional: a short timeout, one line if they cannot be had
        print(f"setup ({target}): installing the GPU fast paths' libraries (optional): {' '.join(extras)}")
        extras_failure = pip_install(extras, EXTRAS_PIP_OPTIONS)
        if extras_failure:
            print(f"setup ({target}): could not install them ({extras_failure}); the GPU trainer "
                  "takes its own attention and cuBLAS instead, and says so")
    apt = [key for key in NEEDS[target]["required"] + NEEDS[target]["optional"]
           if key in APT_PACKAGES and works.get(key) is not None]
    for key in apt:
        apt_install(target, key)
    if install or extras or tools:
        works = probe(target)
        still = [k for k in NEEDS[target]["required"] if works[k] is not None]
        if failure:
            optional = [k for k in NEEDS[target]["optional"] if works[k] is not None and k not in GPU_EXTRAS
                        and not (target == "train" and k in TOOL_PACKAGES)]      # those said above
            if optional and not still:
                print(f"setup ({target}): could not install ({failure}); the tests that need "
                      f"{', '.join(optional)} will skip")
        missing = sorted(set(missing) | set(still))
        if missing and failure:
            print(f"error: make {target} needs {', '.join(missing)}, which could not be installed "
                  f"({failure})", file=sys.stderr)
            return 1
    if missing:
        print(f"error: make {target} needs {', '.join(missing)}: {works.get(missing[0])}", file=sys.stderr)
        return 1
    return 0


def trainer():
    """Print the trainer for `make train` on stdout; on stderr, one line saying why not the GPU one."""
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        reason = None if count > 0 else "the CUDA runtime reports 0 devices"
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        reason = f"{type(e).__name__}: {e}".splitlines()[0]
    if reason is None:
        print("gpt2_cuda.py")
        return
    if driver_cuda_major() is None:          # CuPy's own words would be "driver insufficient"
        reason = "no NVIDIA driver: nvidia-smi reports no CUDA version"
    print(f"make train: no CUDA GPU to use ({reason}): running the NumPy trainer gpt2_cpu.py instead",
          file=sys.stderr)
    print("gpt2_cpu.py")


GPU_WHEEL_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                       "manylinux2014_x86_64", "manylinux1_x86_64"]
# What the GPU machine (Python 3.12, CUDA 13, see dev/results/README.md) lacks for the optional
# paths: the cuDNN frontend (its nvidia-cutlass-dsl dependency is not needed to import it) and
# nvmath-python with what its metadata requires (cuda-bindings, cuda-core<2,>=0.5.0,
# cuda-pathfinder<2,>=1.5.1, numpy): neither torch 2.11 nor cupy-cuda13x 14.2 brings cuda-core, and
# cupy's cuda-pathfinder (==1.*,>=1.3.4) may be older than nvmath's; numpy and the CUDA 13 cuBLAS are
# there (nvidia-cudss-cu13 and cutensor-cu13 of nvmath's [cu13] serve solvers and tensor contractions
# that llmc does not use).
NVMATH_WHEELS = [NVMATH_PIN, "cuda-core==1.2.2", "cuda-bindings==13.5.0", "cuda-pathfinder==1.9.0"]
GPU_WHEELS = [FRONTEND_PIN] + NVMATH_WHEELS


def gpu_wheels(dest=WHEEL_DIR):
    """Download GPU_WHEELS (cp312, manylinux x86_64, no dependencies) into dest; print each size."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", dest]
    for platform in GPU_WHEEL_PLATFORMS:
        cmd += ["--platform", platform]
    r = subprocess.run(cmd + GPU_WHEELS, capture_output=True, text=True)
    if r.returncode != 0:
        errors = [l for l in (r.stderr + r.stdout).splitlines() if l.startswith("ERROR")] or ["pip download failed"]
        print(f"error: {errors[-1]}", file=sys.stderr)
        return 1
    total = 0
    for name in sorted(os.listdir(dest)):
        size = os.path.getsize(os.path.join(dest, name))
        total += size
        print(f"{size / 2**20:6.1f} MiB  {os.path.relpath(os.path.join(dest, name), REPO_ROOT)}")
    print(f"{total / 2**20:6.1f} MiB  in all (a device call carries at most 64 MiB, data/ included)")
    return 0


class OneLineErrorParser(argparse.ArgumentParser):
    """A bad flag is one `error:` line and exit 1, as for every tool of the project (llmc.cli's
    parser does the same, but this file must run before numpy is installed, so it imports no llmc)."""

    def error(self, message):
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(1)


def main(argv=None):
    p = OneLineErrorParser(description="install what one make target needs (see the docstring)")
    p.add_argument("target", nargs="?", choices=sorted(NEEDS) + ["gpu-wheels"])
    p.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing")
    p.add_argument("--python", action="store_true", help="print the interpreter make runs commands with")
    p.add_argument("--trainer", action="store_true", help="print the trainer make train runs")
    p.add_argument("--venv", default=DEFAULT_VENV, help="the virtual environment to create outside one")
    args = p.parse_args(argv)
    kind, python = choose_environment(sys.prefix, sys.base_prefix, os.environ.get("VIRTUAL_ENV"),
                                      args.venv, sys.executable)
    if args.python:                           # relative to the repository when inside it: .venv/bin/python
        inside = os.path.realpath(python).startswith(REPO_ROOT + os.sep) or python.startswith(REPO_ROOT + os.sep)
        print(os.path.relpath(python, REPO_ROOT) if kind != "active" and inside else python)
        return 0
    if args.trainer:
        trainer()
        return 0
    if args.target is None:
        p.error("name a target, or --python / --trainer")
    if args.target == "gpu-wheels":
        return gpu_wheels()
    if kind != "active":                    # not inside a virtual environment: use (or make) .venv
        if kind == "create":
            if args.dry_run:
                print(f"setup: no active virtual environment: would create {args.venv} "
                      "(python3 -m venv --system-site-packages)")
            else:
                create_venv(args.venv)
                print(f"setup: no active virtual environment: created {os.path.relpath(args.venv)} "
                      f"(python3 -m venv --system-site-packages); make runs {os.path.relpath(python)}")
        if os.path.exists(python) and os.path.abspath(sys.executable) != os.path.abspath(python):  # go on inside it
            os.execv(python, [python, os.path.abspath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    return setup(args.target, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
