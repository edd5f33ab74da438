"""
tests/test_readme.py: the README's commands exist and work as written, in the README's order.

Every command line of the README (the indented blocks) is checked statically: each script it runs
exists, each `make` target is in the Makefile, and each flag it passes is one the script's --help
lists. Then the "Evaluate, sample, export, plot" chain runs for real in a scratch directory, in
order, each command on the files the ones before it wrote; only the first run is shortened (a d2
model for 2 steps instead of d4 for 400, so the chain takes seconds), and the two commands that
need internet are left out. The set-up commands themselves (`make train`, `make test`) are what CI
and a fresh clone run.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
NEEDS_INTERNET = ("dev/data/hellaswag.py", "dev/eval/import_hf.py -i gpt2")
SHORT_FIRST_RUN = {"-o log_d4 -n 400": "-e d2 -x 2 -t 32 -v 0 -s 0 -o log_d4 -n 2"}
STEP = {"model_00000400.bin": "model_00000002.bin"}


def readme_commands(text=None):
    """The command lines of the README (or of `text`, a part of it), in order: indented lines,
    '$ ' prompts and shown output removed, comments dropped."""
    commands = []
    for line in (text or open(README).read()).splitlines():
        if not line.startswith("    ") or line.lstrip().startswith(("(", "model:", "batch:", "step", "val loss",
                                                                     "generating", "...")):
            continue
        text = line.strip().removeprefix("$ ")
        text = re.split(r"\s+#", text)[0].strip()
        if text.split()[0] in ("make", "python", "source", "LLMC_EMULATOR_DEBUG=1"):
            commands.append(text)
    return commands


def flags_of(words):
    return [w.split("=")[0] for w in words if w.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", w)]


def test_the_readme_has_the_commands_a_newcomer_needs():
    commands = readme_commands()
    assert commands[:3] == ["make train", "make test", "source .venv/bin/activate"]
    assert len(open(README).read().splitlines()) < 200


def test_every_script_target_and_flag_exists():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    help_texts = {}
    for command in readme_commands():
        words = shlex.split(command)
        if words[0] == "make":
            for target in words[1:]:
                assert re.search(rf"(?m)^{re.escape(target)}:", makefile), f"{command}: no make target {target}"
            continue
        if words[0] == "source":
            continue
        if words[0] == "LLMC_EMULATOR_DEBUG=1":                  # gdb -x FILE --args python SCRIPT
            assert os.path.isfile(os.path.join(ROOT, words[words.index("-x") + 1]))
            words = words[words.index("--args") + 1:]
        if words[1:3] == ["-m", "pdb"]:                           # python -m pdb SCRIPT ...
            words = words[:1] + words[3:]
        script = words[1]
        assert os.path.isfile(os.path.join(ROOT, script)), f"{command}: no {script}"
        if script not in help_texts:
            r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"{script} --help: {r.stderr}"
            help_texts[script] = r.stdout
        for flag in flags_of(words[2:]):
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_texts[script]), \
                f"{command}: {script} --help lists no {flag}"


def test_the_evaluate_sample_export_plot_chain_runs_in_order(tmp_path):
    section = open(README).read().split("## Evaluate, sample, export, plot", 1)[1].split("\n## ", 1)[0]
    chain = readme_commands(section)
    assert len(chain) == 7
    ran = []
    for command in chain:
        if any(command.startswith(f"python {skip}") for skip in NEEDS_INTERNET):
            continue
        if "--eval-only -h 1" in command:                         # needs the HellaSwag file from the line before
            continue
        for long, short in list(SHORT_FIRST_RUN.items()) + list(STEP.items()):
            command = command.replace(long, short)
        words = shlex.split(command)
        words[1] = os.path.join(ROOT, words[1])
        r = subprocess.run([sys.executable] + words[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{command}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        ran.append(command)
    assert (tmp_path / "log_d4" / "main.log").is_file() and (tmp_path / "hf_dir").is_dir()
    assert (tmp_path / "loss.png").is_file()
    assert len(ran) == 4
