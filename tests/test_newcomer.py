"""
tests/test_newcomer.py: what a newcomer meets first says what to do, in one line.

A mistyped long flag names the closest real one, and one typed from PyTorch's, nanoGPT's or llm.c's
habits (--lr, --epochs, --batch_size, --device cuda:0) is taken or named; --help keeps paths whole; -e naming a run
directory names the newest model in it; --eval-only needs no train data; a tool whose package is
missing names the pip package and the one command that installs it (`make train` the small ones,
`make twin` torch), and to activate the project's .venv only where no environment is active,
instead of a traceback.
"""

import io
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_AND_PACKAGES = [  # (command line, the package it must name, the command that installs it)
    (["dev/vislog.py", "main.log"], "matplotlib", "make train"),
    (["dev/eval/export_hf.py", "-i", "model.bin", "-o", "hf"], "safetensors", "make train"),
    (["dev/eval/import_hf.py", "-i", "hf"], "safetensors", "make train"),
    (["dev/data/tinyshakespeare.py"], "tiktoken", "make train"),
    (["dev/data/hellaswag.py"], "tiktoken", "make train"),
    (["dev/torch_reference.py", "-x", "1"], "torch", "make twin"),
    (["dev/torch_reference_llama3.py", "-e", "llama3:d2", "-x", "10"], "torch", "make twin"),   # the README's line
]


def run(args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run([sys.executable] + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flag, meant", [("--learnign-rate", "--learning-rate"), ("--shufle", "--shuffle"),
                                         ("--val-evry=3", "--val-every")])
def test_a_mistyped_flag_names_the_closest_one(flag, meant):
    r = run(["gpt2_cpu.py", flag] + ([] if "=" in flag else ["1"]))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert f"did you mean {meant}?" in r.stderr


def test_lr_is_the_learning_rate_and_no_flag_is_a_prefix(capsys):
    """PyTorch's and nanoGPT's --lr is -l; argparse's prefix matching once took it for
    --lr-schedule. A prefix of a real flag is now an unknown flag with its did-you-mean."""
    import gpt2_cpu
    for argv in (["--lr", "1e-3"], ["--lr=1e-3"], ["-l", "1e-3"], ["--learning-rate", "1e-3"]):
        assert gpt2_cpu.parse_args(argv).learning_rate == 1e-3
    assert gpt2_cpu.parse_args([]).lr_schedule == "cosine"
    with pytest.raises(SystemExit) as e:
        gpt2_cpu.parse_args(["--lr-sched", "linear"])
    assert e.value.code == 1
    assert capsys.readouterr().err == ("error: unrecognized arguments: --lr-sched linear; did you mean --lr-schedule? "
                                       "(see --help)\n")


@pytest.mark.parametrize("argv, hint", [
    (["--epochs", "3"], "this trainer counts optimizer steps, not epochs: -x N trains N steps, -x -1 one epoch"),
    (["--num_epochs", "3"], "this trainer counts optimizer steps, not epochs"),
    (["--max_iters", "5"], "did you mean -x/--max-steps (optimizer steps)?"),
    (["--batch_size", "8"], "did you mean --batch-size?"),
    (["--learning_rate=1e-3"], "did you mean --learning-rate?"),
    (["--warmup_steps", "10"], "did you mean -u/--warmup-iters (linear warmup steps)?"),
    (["--block_size", "64"], "did you mean -t/--seq-len (sequence length T)?"),
    (["--device", "cpu"], "this program runs on the CPU only; gpt2_cuda.py and llama3_cuda.py take --device cuda|cpu"),
])
def test_habits_from_other_trainers_name_the_flag_meant(capsys, argv, hint):
    import gpt2_cpu
    with pytest.raises(SystemExit) as e:
        gpt2_cpu.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith("error: unrecognized arguments: ")
    assert f"; {hint}" in err


@pytest.mark.parametrize("value, said", [
    ("cuda:0", "'cuda:0': pass --device cuda; each process takes the GPU of its local rank (GPU 0 for one process), "
               "and CUDA_VISIBLE_DEVICES=0 runs on GPU 0 alone"),
    ("cuda:3", "CUDA_VISIBLE_DEVICES=3 runs on GPU 3 alone"),
    ("gpu", "invalid choice: 'gpu' (choose from cuda, cpu)"),
])
def test_the_cuda_trainers_device_flag_answers_pytorchs_cuda_n(capsys, value, said):
    import gpt2_cuda
    assert gpt2_cuda.parse_args(["--device", "cpu"]).device == "cpu"
    with pytest.raises(SystemExit) as e:
        gpt2_cuda.parse_args(["--device", value])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith("error: argument --device: ") and said in err


def test_a_flag_close_to_nothing_gets_no_guess():
    r = run(["gpt2_cpu.py", "--zzz", "1"])
    assert r.returncode == 1 and "did you mean" not in r.stderr and "unrecognized arguments: --zzz" in r.stderr


def test_help_keeps_paths_whole_on_a_narrow_terminal():
    r = run(["gpt2_cpu.py", "--help"], env=dict(os.environ, COLUMNS="50"))
    assert r.returncode == 0
    words = r.stdout.split()
    # the default data files print whole, though they are longer than the line
    assert any(word.endswith("data/tinyshakespeare/tiny_shakespeare_train.bin)") for word in words), r.stdout
    assert not any(word.endswith("-") and len(word) > 1 and word[-2].isalpha() for word in words)


def test_e_naming_a_run_directory_names_its_newest_model(tmp_path):
    for step in (3, 10):
        (tmp_path / f"model_{step:08d}.bin").write_bytes(b"")
    for spec in (str(tmp_path), tmp_path.name):
        r = run([os.path.join(ROOT, "gpt2_cpu.py"), "-e", spec, "-x", "1"], cwd=tmp_path.parent)
        assert r.returncode == 1
        newest = os.path.join(spec, "model_00000010.bin")
        assert r.stderr.strip() == f"error: {spec}: -e names a directory, not a model checkpoint: its newest " \
                                   f"model is -e {newest}"


def test_eval_only_needs_no_train_data(tmp_path):
    r = run(["gpt2_cpu.py", "--eval-only", "-e", "d2", "-i", str(tmp_path / "missing.bin"), "-b", "2", "-t", "16",
             "-m", "1"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("val loss ")


def hide_package(tmp_path, package):
    """A directory to put first on PYTHONPATH that holds a stand-in `package` raising
    ModuleNotFoundError, as a missing one does."""
    blocked = tmp_path / package
    blocked.mkdir()
    (blocked / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n")
    return str(tmp_path)


@pytest.mark.parametrize("argv, package, command", TOOLS_AND_PACKAGES, ids=[a[0] for a, _, _ in TOOLS_AND_PACKAGES])
def test_a_tool_without_its_package_names_the_command_that_installs_it(tmp_path, argv, package, command):
    """Run by the project's environment (a virtual environment, as `make` made it): the advice is
    the command, never to activate the environment that is active."""
    r = run(argv, env=dict(os.environ, PYTHONPATH=hide_package(tmp_path, package)), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert f"needs the pip package {package}" in lines[0] and lines[0].endswith(f"`{command}` installs it into "
                                                                                 f"this environment")
    assert "activate" not in lines[0]


def test_outside_any_environment_the_advice_is_to_activate_the_projects_first(tmp_path):
    """The README's trainer run by the system's Python (no environment active): activate .venv,
    which `make` created, and the command for the case it lacks the package too."""
    base_python = getattr(sys, "_base_executable", sys.executable)
    if os.path.realpath(base_python) == os.path.realpath(sys.executable) and sys.prefix == sys.base_prefix:
        pytest.skip("the tests run outside a virtual environment")
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = hide_package(tmp_path, "numpy")
    r = subprocess.run([base_python, "gpt2_cpu.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    if os.path.isdir(os.path.join(ROOT, ".venv")):
        assert r.stderr.strip().endswith("activate the project's environment first (source .venv/bin/activate); if it "
                                         "lacks numpy too, `make train` installs it there")
    else:
        assert "`make train` installs it into the project's environment .venv" in r.stderr


def test_the_missing_package_line_in_each_case():
    from llmc.utils import missing_package_line
    start = "error: dev/vislog.py needs the pip package matplotlib, which this Python (/usr/bin/python3) does not have: "
    assert missing_package_line("dev/vislog.py", "matplotlib", "/usr/bin/python3", True, True) == \
        start + "`make train` installs it into this environment"
    assert missing_package_line("dev/vislog.py", "matplotlib", "/usr/bin/python3", False, True) == \
        start + ("activate the project's environment first (source .venv/bin/activate); if it lacks matplotlib too, "
                 "`make train` installs it there")
    assert missing_package_line("dev/vislog.py", "matplotlib", "/usr/bin/python3", False, False) == \
        start + "`make train` installs it into the project's environment .venv (then: source .venv/bin/activate)"
    assert missing_package_line("x.py", "torch", "p", True, True).endswith("`make twin` installs it into this environment")


class Terminal(io.StringIO):
    """stderr as a terminal (isatty), its output kept."""

    def isatty(self):
        return True


@pytest.mark.parametrize("with_tqdm", [True, False])
def test_a_first_kernel_build_shows_progress_on_a_terminal_and_a_cached_one_nothing(tmp_path, monkeypatch, with_tqdm):
    """The emulated device compiles kernels/cast.cu into an empty build cache: the terminal shows
    the build, named and counted (a tqdm bar, or a counted line without tqdm); loading it again
    from the cache in a new process (the in-process table cleared) shows nothing, and neither
    does a first build whose stderr is not a terminal (a log, a test's capture)."""
    from llmc import cuda
    from llmc.emulator import build
    monkeypatch.setattr(build, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda, "_device", cuda.device())                # restored after the test
    monkeypatch.setattr(cuda, "_MODULES", {})
    if not with_tqdm:
        monkeypatch.setitem(sys.modules, "tqdm", None)                  # import tqdm: ImportError
    cuda.use_device("cpu")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    cuda.load_modules(["cast"], "fp32")
    shown = terminal.getvalue()
    if with_tqdm:
        assert "compiling kernels for the emulated device (g++, once)" in shown and "1/1" in shown, shown
        assert "cast.cu" in shown and "100%" in shown
    else:
        assert shown == "compiling kernels for the emulated device (g++, once): 1/1 cast.cu\n"
    assert ("cpu", "cast", "fp32") in cuda._MODULES
    monkeypatch.setattr(cuda, "_MODULES", {})                            # a new process: the disk cache answers
    terminal.seek(0)
    terminal.truncate()
    cuda.load_modules(["cast"], "fp32")
    assert terminal.getvalue() == ""
    monkeypatch.setattr(build, "CACHE_DIR", str(tmp_path / "cache2"))  # a first build again, into a log
    monkeypatch.setattr(cuda, "_MODULES", {})
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    cuda.load_modules(["cast"], "fp32")
    assert log.getvalue() == "" and os.listdir(tmp_path / "cache2")
