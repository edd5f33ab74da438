"""dev/setup_env.py, the set-up every `make` target runs first: the decision (a pure function)
on faked machines, then a few runs of the script itself in throw-away virtual environments with a
fake `nvidia-smi` on PATH, fake packages, and PIP_NO_INDEX=1 (so any attempt to install fails).

The machines faked: a CPU machine; a GPU machine whose driver reports CUDA 12 or 13; the project's
GPU machine (cupy-cuda13x and a CUDA torch already there, no network, mpi4py without an MPI
library); a broken CuPy (installed, does not import); a stock Python outside any virtual
environment (PEP 668: pip must not be asked to install there).
Run: pytest tests/test_setup.py
"""

import itertools
import time
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import setup_env  # noqa: E402

SCRIPT = os.path.join(ROOT, "dev", "setup_env.py")
SPECS = setup_env.read_requirements()
BROKEN = "ImportError: no module"
TIMEOUT_S = 120


def all_work(target, **broken):
    """works{} for the target with every key working except those given (key=reason)."""
    need = setup_env.NEEDS[target]
    return {key: broken.get(key) for key in need["required"] + need["optional"]}


def cupys(requirements):
    return [r for r in requirements if r.startswith("cupy")]


# ----------------------------------------------------------------------------
# the decision

@pytest.mark.parametrize("major, wheel", [(12, "cupy-cuda12x"), (13, "cupy-cuda13x")])
def test_train_installs_the_cupy_of_the_drivers_cuda_major(major, wheel):
    """With CUDA's libraries as wheels ([ctk]): a machine with only the driver has no NVRTC."""
    install, notes, missing = setup_env.plan("train", all_work("train", cupy=BROKEN), set(), major, SPECS)
    assert install == [f"{wheel}[ctk]==14.2.0"] and not notes and not missing


@pytest.mark.parametrize("target", ["train", "bench", "test-gpu", "dev-cuda"])
@pytest.mark.parametrize("major, library, bindings", [(12, "nvidia-cudnn-cu12", "cuda-bindings>=12.9.2,<13"),
                                                      (13, "nvidia-cudnn-cu13", "cuda-bindings>=13.0.1,<14")])
def test_gpu_targets_add_the_fast_paths_libraries_of_the_drivers_major_last(target, major, library, bindings):
    """cuDNN's frontend and library, nvmath-python with the cuda-bindings of the driver's CUDA
    major, at the first GPU run's pins (GPU_WHEELS), after everything else; none without a driver
    and no line about them (the CuPy line says there is no driver)."""
    works = all_work(target, numpy=BROKEN, cupy=BROKEN, cudnn=BROKEN, nvmath=BROKEN)
    install, notes, missing = setup_env.plan(target, works, set(), major, SPECS)
    extras = ["nvidia-cudnn-frontend==1.32.0", library, "nvmath-python==1.0.0", bindings]
    assert install == [SPECS["numpy"], f"cupy-cuda{major}x[ctk]==14.2.0"] + extras and not notes and not missing
    assert [setup_env.is_gpu_extra(r) for r in install] == [False, False, True, True, True, True]
    assert {r for r in extras if "==" in r} <= set(setup_env.GPU_WHEELS)
    install, notes, _ = setup_env.plan(target, works, set(), None, SPECS)
    assert install == [SPECS["numpy"]] and len(notes) == 1 and "no NVIDIA driver" in notes[0]


def test_a_broken_gpu_extra_is_reported_and_not_replaced():
    works = all_work("train", nvmath="ImportError: cuda.core", cudnn="ImportError: libcudnn")
    install, notes, _ = setup_env.plan("train", works, {"cupy-cuda13x", "nvmath-python", "nvidia-cudnn-cu13"}, 13, SPECS)
    assert install == ["nvidia-cudnn-frontend==1.32.0", "nvidia-cudnn-cu13"]   # the frontend is not there
    assert notes == ["nvmath-python is installed but does not import (ImportError: cuda.core); not replacing it"]


def test_train_installs_only_numpy_and_tiktoken_without_a_driver():
    works = all_work("train", numpy=BROKEN, tiktoken=BROKEN, cupy=BROKEN)
    install, notes, missing = setup_env.plan("train", works, set(), None, SPECS)
    assert install == [SPECS["numpy"], SPECS["tiktoken"]]
    assert len(notes) == 1 and "no NVIDIA driver" in notes[0] and not missing


def test_nothing_is_installed_when_everything_imports():
    for target in setup_env.NEEDS:
        install, notes, missing = setup_env.plan(target, all_work(target), {"cupy-cuda13x", "torch"}, 13, SPECS)
        assert (install, notes, missing) == ([], [], []), target


def test_a_broken_cupy_is_reported_and_never_joined_by_a_second():
    install, notes, _ = setup_env.plan("train", all_work("train", cupy=BROKEN), {"cupy-cuda12x"}, 13, SPECS)
    assert install == [] and "not installing a second CuPy" in notes[0] and BROKEN in notes[0]


def test_no_second_cupy_on_any_machine():
    """Every target, driver, set of installed CuPys and broken keys: at most one CuPy is ever
    asked for, and none where one is installed."""
    keys = ["numpy", "cupy", "nvrtc", "torch"]
    for target, major, present, broken in itertools.product(
            setup_env.NEEDS, [None, 12, 13], [set(), {"cupy-cuda12x"}, {"cupy-cuda13x"}, {"cupy"}],
            itertools.product([False, True], repeat=len(keys))):
        works = all_work(target, **{k: BROKEN for k, b in zip(keys, broken) if b})
        install, _, _ = setup_env.plan(target, works, present, major, SPECS)
        assert len(cupys(install)) <= (0 if present else 1), (target, major, present, broken, install)


def test_the_gpu_machine_keeps_its_cupy_and_torch():
    """make test there: cupy-cuda13x, CUDA torch and NVRTC work, mpi4py is there but finds no MPI
    library, mpiexec is missing: only mpich is asked for (and it is optional: offline, it skips)."""
    works = all_work("test", mpi4py="RuntimeError: cannot load MPI library", mpich="no mpiexec on PATH")
    install, notes, missing = setup_env.plan("test", works, {"cupy-cuda13x", "torch", "mpi4py"}, 13, SPECS)
    assert install == [SPECS["mpich"]] and not missing
    assert len(notes) == 1 and "mpi4py is installed but does not import" in notes[0]


def test_cpu_machine_gets_the_cuda12_nvrtc_packages_only_without_a_cupy():
    works = all_work("test", nvrtc="NvrtcUnavailable")
    install, _, _ = setup_env.plan("test", works, set(), None, SPECS)
    assert install == [SPECS["cupy-cuda12x"], SPECS["nvidia-cuda-nvrtc-cu12"], SPECS["nvidia-cuda-runtime-cu12"]]
    install, _, _ = setup_env.plan("compile-kernels", all_work("compile-kernels", nvrtc="x"), {"cupy-cuda13x"}, 13, SPECS)
    assert install == setup_env.CUDA13_PACKAGES["nvrtc"]                 # its CuPy's CUDA major, no CuPy


def test_a_gpu_machine_without_cupy_gets_from_make_test_the_cupy_make_train_would_install():
    """make test before make train on a driver-only GPU machine: the CuPy with CUDA's libraries
    ([ctk]), not the CPU check's bare one, which would leave make train a CuPy without cuBLAS."""
    install, _, _ = setup_env.plan("test", all_work("test", nvrtc="NvrtcUnavailable"), set(), 13, SPECS)
    assert install == ["cupy-cuda13x[ctk]==14.2.0"] + setup_env.CUDA13_PACKAGES["nvrtc"]


def test_a_present_torch_is_never_replaced():
    install, notes, missing = setup_env.plan("bench", all_work("bench", torch=BROKEN), {"torch"}, 13, SPECS)
    assert install == [] and missing == ["torch"] and "not replacing it" in notes[0]


def test_bench_needs_no_data():
    with open(os.path.join(ROOT, "Makefile")) as f:
        rules = [line for line in f if line.startswith("bench:")]
    assert len(rules) == 1 and rules[0].split("##")[0].split(":", 1)[1].strip() == ""


def test_environment_choice():
    assert setup_env.choose_environment("/v", "/usr", None, "/r/.venv", "/v/bin/python") == ("active", "/v/bin/python")
    assert setup_env.choose_environment("/usr", "/usr", "/v", "/r/.venv", "/usr/bin/python3") == ("active", "/v/bin/python")
    assert setup_env.choose_environment("/usr", "/usr", None, "/nonexistent/.venv", "/usr/bin/python3") == \
        ("create", "/nonexistent/.venv/bin/python")


# ----------------------------------------------------------------------------
# the script, on faked machines

def fake_nvidia_smi(bin_dir, cuda_version):
    """An nvidia-smi that prints the header of a driver supporting cuda_version (None: it fails)."""
    os.makedirs(bin_dir, exist_ok=True)
    path = os.path.join(bin_dir, "nvidia-smi")
    with open(path, "w") as f:
        if cuda_version:
            f.write(f"#!/bin/sh\necho '| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: "
                    f"{cuda_version}     |'\n")
        else:
            f.write("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                    "exit 9\n")
    os.chmod(path, 0o755)
    return bin_dir


def fake_package(site, module, distribution=None, body=""):
    """A package `module` in the folder `site` (importable, or raising in `body`), with a
    dist-info naming `distribution` so that importlib.metadata lists it."""
    os.makedirs(os.path.join(site, module), exist_ok=True)
    with open(os.path.join(site, module, "__init__.py"), "w") as f:
        f.write(body)
    if distribution:
        info = os.path.join(site, f"{distribution.replace('-', '_')}-14.2.0.dist-info")
        os.makedirs(info, exist_ok=True)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 14.2.0\n")


@pytest.mark.parametrize("major, version", [(12, "12.4"), (13, "13.0"), (None, None)])
def test_driver_cuda_major_from_a_fake_nvidia_smi(tmp_path, major, version):
    fake_nvidia_smi(str(tmp_path), version)
    assert setup_env.driver_cuda_major(str(tmp_path / "nvidia-smi")) == major
    assert setup_env.driver_cuda_major(str(tmp_path / "absent")) is None


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory):
    """A virtual environment with nothing in it (no pip, no system packages): 0.2 s to make."""
    venv = tmp_path_factory.mktemp("venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=TIMEOUT_S)
    return venv


def run_script(python, args, tmp_path, cuda_version, site=None):
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_FIND_LINKS")}
    env["PATH"] = fake_nvidia_smi(str(tmp_path / "bin"), cuda_version) + os.pathsep + env["PATH"]
    env["PIP_NO_INDEX"] = "1"
    if site:
        env["PYTHONPATH"] = str(site)
    return subprocess.run([str(python), SCRIPT] + args, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)


@pytest.mark.parametrize("version, wheel", [("12.8", "cupy-cuda12x[ctk]==14.2.0"), ("13.0", "cupy-cuda13x[ctk]==14.2.0")])
def test_script_chooses_the_cupy_of_the_fake_driver(bare_venv, tmp_path, version, wheel):
    r = run_script(bare_venv / "bin" / "python", ["train", "--dry-run"], tmp_path, version)
    assert r.returncode == 0, r.stderr
    major = version.split(".")[0]
    extras = setup_env.GPU_EXTRAS["cudnn"][1][int(major)] + setup_env.GPU_EXTRAS["nvmath"][1][int(major)]
    tools = [SPECS[name] for name in setup_env.TOOL_PACKAGES]
    assert r.stdout.strip().splitlines()[-1] == \
        f"setup (train): would install: {SPECS['numpy']} {SPECS['tiktoken']} {wheel} {' '.join(tools + extras)}"


def test_script_installs_nothing_when_cupy_and_the_gpu_extras_import(bare_venv, tmp_path):
    """Not a dry run, and pip has no index: any install would fail the run."""
    site = tmp_path / "site"
    for module in ("numpy", "tiktoken") + setup_env.TOOL_PACKAGES:
        fake_package(str(site), module)
    fake_package(str(site), "cupy", "cupy-cuda13x")
    fake_package(str(site), "cudnn", "nvidia-cudnn-frontend")
    fake_package(str(site), "nvmath", "nvmath-python")
    r = run_script(bare_venv / "bin" / "python", ["train"], tmp_path, "13.0", site)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stdout + r.stderr


def test_script_offline_without_the_gpu_extras_is_one_line_and_trains(bare_venv, tmp_path):
    """The project's GPU machine (CuPy there, no cuDNN frontend, no nvmath, no network): make train
    tries the optional libraries once, says in one line that it could not, and exits 0."""
    site = tmp_path / "site"
    for module in ("numpy", "tiktoken") + setup_env.TOOL_PACKAGES:
        fake_package(str(site), module)
    fake_package(str(site), "cupy", "cupy-cuda13x")
    r = run_script(bare_venv / "bin" / "python", ["train"], tmp_path, "13.0", site)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("setup (train): installing the GPU fast paths' libraries (optional): ")
    assert lines[1].startswith("setup (train): could not install them (") and "takes its own attention" in lines[1]


def test_script_offline_without_the_tools_packages_is_one_line_and_trains(bare_venv, tmp_path):
    """A CPU machine offline: make train tries matplotlib, safetensors and tqdm once (the README's
    later commands use them), says in one line that it could not, and exits 0 (training needs none)."""
    site = tmp_path / "site"
    for module in ("numpy", "tiktoken"):
        fake_package(str(site), module)
    start = time.monotonic()
    r = run_script(bare_venv / "bin" / "python", ["train"], tmp_path, None, site)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = r.stdout.strip().splitlines()
    tools = " ".join(SPECS[name] for name in setup_env.TOOL_PACKAGES)
    assert lines[-2:] == [f"setup (train): installing what the README's later commands use: {tools}",
                          lines[-1]] and lines[-1].startswith("setup (train): could not install them (")
    assert lines[-1].endswith("training needs none of them, and a tool that does names its package when run")
    assert time.monotonic() - start < TIMEOUT_S


def test_twin_installs_torch_only():
    install, notes, missing = setup_env.plan("twin", all_work("twin", torch=BROKEN), set(), None, SPECS)
    assert install == [SPECS["torch"]] and not notes and not missing


def test_script_reports_a_broken_cupy_and_does_not_install_another(bare_venv, tmp_path):
    site = tmp_path / "site"
    fake_package(str(site), "cupy", "cupy-cuda12x", body="raise ImportError('libcudart.so.12: cannot open')\n")
    r = run_script(bare_venv / "bin" / "python", ["train", "--dry-run"], tmp_path, "13.0", site)
    assert "CuPy (cupy-cuda12x) is installed but does not work (ImportError: libcudart.so.12" in r.stdout
    assert "cupy" not in r.stdout.strip().splitlines()[-1], r.stdout
    r = run_script(bare_venv / "bin" / "python", ["--trainer"], tmp_path, "13.0", site)
    assert r.stdout.strip() == "gpt2_cpu.py"
    assert "make train: no CUDA GPU to use (ImportError: libcudart.so.12: cannot open)" in r.stderr


def test_script_reports_what_data_lacks_in_one_line_offline(bare_venv, tmp_path):
    r = run_script(bare_venv / "bin" / "python", ["data"], tmp_path, None)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: make data needs numpy, tiktoken"), r.stderr


def test_outside_a_virtual_environment_it_creates_one_and_installs_there(tmp_path):
    """PEP 668: a stock Python refuses pip outside a virtual environment. The script never asks
    it: it creates the venv (with the system's packages visible), says so, and goes on in it."""
    base_python = getattr(sys, "_base_executable", sys.executable)
    site = tmp_path / "site"
    for module in ("numpy", "tiktoken"):
        fake_package(str(site), module)
    venv = tmp_path / "venv"
    r = run_script(base_python, ["data", "--venv", str(venv)], tmp_path, None, site)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("setup: no active virtual environment: created"), r.stdout
    assert (venv / "bin" / "python").exists() and "installing" not in r.stdout
    r = run_script(venv / "bin" / "python", ["--python"], tmp_path, None)
    assert r.stdout.strip() == str(venv / "bin" / "python")


# ----------------------------------------------------------------------------
# dev/run_gpu_tests.py, the first GPU run: its plan, limits and verdicts (no GPU needed)

def _load_run_gpu_tests():
    import importlib.util
    spec = importlib.util.spec_from_file_location("run_gpu_tests", os.path.join(ROOT, "dev", "run_gpu_tests.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_gpu_run_plan_has_every_part():
    rgt = _load_run_gpu_tests()
    for cmds in (rgt.commands(), rgt.quick_commands()):
        texts = [" ".join(c[1:]) for c in cmds]
        assert sum("--check" in t for t in texts) == 8
        assert sum("--attention cudnn" in t for t in texts) == 2
        assert "-m pytest -m gpu -v -rs --continue-on-collection-errors tests" in texts
        assert "gpt2_cuda.py -x 50 -v 25 -s 50" in texts
        ours = texts.index("dev/bench.py --only cupy -b 16 --steps 10 --warmup 3")
        twin = next(i for i, t in enumerate(texts) if t.startswith("dev/bench.py --only torch -b 16"))
        assert max(i for i, t in enumerate(texts[:ours]) if "--check" in t) == ours - 1   # right after the checks
        assert ours < texts.index("-m pytest -m gpu -v -rs --continue-on-collection-errors tests") < twin
    assert rgt.QUICK_DEADLINE_S <= 600 - 30                 # a running command is cut at the deadline too


def test_preparation_installs_carried_wheels_and_builds_missing_data(tmp_path):
    rgt = _load_run_gpu_tests()
    (tmp_path / "w").mkdir()
    assert rgt.preparation("/tmp/site", str(tmp_path / "w"), [__file__]) == []
    (tmp_path / "w" / "a-1.0-py3-none-any.whl").write_bytes(b"")
    pip, data = rgt.preparation("/tmp/site", str(tmp_path / "w"), [str(tmp_path / "missing.bin")])
    assert pip[1:4] == ["-m", "pip", "install"] and pip[pip.index("--target") + 1] == "/tmp/site"
    assert "--no-index" in pip and "--no-deps" in pip and pip[-1].endswith("a-1.0-py3-none-any.whl")
    assert data[1:] == ["dev/data/tinyshakespeare.py"]
    assert rgt.kind_of(pip) == "wheels" and rgt.kind_of(data) == "data"


def test_cudnn_fallback_is_a_skip_not_a_pass():
    rgt = _load_run_gpu_tests()
    cudnn = ["python", "gpt2_cuda.py", "--check", "--attention", "cudnn"]
    said = ("gpt2_cuda.py: cuDNN attention unavailable (the cuDNN frontend is not importable (No module named "
            "'cudnn'): pip install nvidia-cudnn-frontend): using flash attention\nTENSOR OK\n")
    assert rgt.verdict(cudnn, 0, said).startswith("SKIP (cuDNN attention unavailable, ran flash: the cuDNN frontend")
    assert rgt.verdict(cudnn, 0, "TENSOR OK\n") == "PASS"
    assert rgt.verdict(cudnn, 1, said) == "FAIL (1)" and rgt.verdict(cudnn, 124, "") == "TIMEOUT"


def test_a_command_past_its_limit_is_killed_with_its_children(tmp_path):
    rgt = _load_run_gpu_tests()
    sleeper = [sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '60']); "
               "print('started', flush=True); time.sleep(60)"]
    with open(tmp_path / "x.log", "w") as log:
        t0 = time.monotonic()
        status = rgt.run_and_tee(sleeper, log, timeout_s=2)
    assert status == rgt.TIMEOUT_EXIT and time.monotonic() - t0 < 30
    assert "started" in (tmp_path / "x.log").read_text()


def test_quick_run_keeps_going_and_stops_at_its_deadline(tmp_path, monkeypatch):
    """Past the GPU gate: a failure, a timeout at the deadline, a command never started; the log
    goes to $OUT."""
    rgt = _load_run_gpu_tests()
    ok = [sys.executable, "-c", "print('fine')"]
    bad = [sys.executable, "-c", "import sys; sys.exit(3)"]
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(rgt.cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(rgt, "device_name", lambda: "NVIDIA Test GPU")
    monkeypatch.setattr(rgt, "software_versions", lambda: "driver 0.0")
    monkeypatch.setattr(rgt, "quick_commands", lambda: [ok, bad, slow, ok])
    monkeypatch.setenv("OUT", str(tmp_path))
    assert rgt.main(["--quick", "--deadline", "15"]) == 1
    (name,) = os.listdir(tmp_path)
    assert name.endswith("_nvidia-test-gpu_test-gpu-quick.log")
    summary = (tmp_path / name).read_text().split("# summary")[1].splitlines()
    verdicts = [line.split()[1] for line in summary[1:5]]
    assert verdicts == ["PASS", "FAIL", "TIMEOUT", "NOT"], summary


def test_gpu_wheels_carry_what_nvmath_requires():
    """nvmath-python 1.0.0's Requires-Dist (its wheel's METADATA, Linux, no extras) is met by the
    carried wheels, with numpy from the machine; the cuda-pathfinder also meets cupy-cuda13x 14.2's
    own requirement, since the carried one shadows the machine's (first on PYTHONPATH)."""
    from packaging.requirements import Requirement
    pins = {Requirement(w).name: Requirement(w).specifier for w in setup_env.GPU_WHEELS}
    assert all(len(spec) == 1 and next(iter(spec)).operator == "==" for spec in pins.values())
    carried = {name: next(iter(spec)).version for name, spec in pins.items()}
    assert carried["nvmath-python"] == "1.0.0"
    nvmath_requires = ["cuda-bindings", "cuda-core<2,>=0.5.0", "cuda-pathfinder<2.0,>=1.5.1", "numpy<3,>=1.25"]
    on_the_machine = {"numpy"}
    for text in nvmath_requires + ["cuda-pathfinder==1.*,>=1.3.4"]:          # the last: cupy-cuda13x 14.2.0's
        req = Requirement(text)
        assert req.name in on_the_machine or req.specifier.contains(carried[req.name]), text
    assert carried["cuda-bindings"].split(".")[0] == "13"                   # the GPU machine's CUDA major
