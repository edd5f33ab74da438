"""
tests/test_newcomer.py: what a newcomer meets first says what to do, in one line.

A mistyped long flag names the closest real one, and one typed from PyTorch's, nanoGPT's or llm.c's
habits (--lr, --epochs, --batch_size, --device cuda:0) is taken or named; --help keeps paths whole; -e naming a run
directory names the newest model in it; --eval-only needs no train data; a tool whose package is
missing (the project's .venv not activated) names the pip package and the venv instead of a
traceback.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS_AND_PACKAGES = [  # (command line, the package it must name)
    (["dev/vislog.py", "main.log"], "matplotlib"),
    (["dev/eval/export_hf.py", "-i", "model.bin", "-o", "hf"], "safetensors"),
    (["dev/eval/import_hf.py", "-i", "hf"], "safetensors"),
    (["dev/data/tinyshakespeare.py"], "tiktoken"),
    (["dev/data/hellaswag.py"], "tiktoken"),
    (["dev/torch_reference.py", "-x", "1"], "torch"),
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


@pytest.mark.parametrize("argv, package", TOOLS_AND_PACKAGES, ids=[a[0] for a, _ in TOOLS_AND_PACKAGES])
def test_a_tool_without_its_package_says_which_and_to_activate_the_venv(tmp_path, argv, package):
    """The package is hidden by a stand-in on PYTHONPATH that raises ModuleNotFoundError as a
    missing one does."""
    blocked = tmp_path / package
    blocked.mkdir()
    (blocked / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{package}'\", name='{package}')\n")
    r = run(argv, env=dict(os.environ, PYTHONPATH=str(tmp_path)), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert f"needs the pip package {package}" in lines[0] and "source .venv/bin/activate" in lines[0]
