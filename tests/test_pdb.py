"""
tests/test_pdb.py: gpt2_cpu.py steps through with the real pdb, as the README promises.

Every top-level function of gpt2_cpu.py that a training step and a sample run (found by running
them under sys.setprofile, so the list cannot go stale) stops at a pdb breakpoint; `q` quits at
once with no "internal error"; an internal error reaches pdb's post-mortem; --traceback and
LLMC_TRACEBACK=1 print an internal error's traceback; the README's walkthrough prints, line for
line, what the README shows. pdb is driven through its stdin.
"""

import inspect
import os
import shlex
import subprocess
import sys

import pytest

import gpt2_cpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "gpt2_cpu.py")
README = os.path.join(ROOT, "README.md")
PDB_PROMPT = "(Pdb) "
# one optimizer step and one short sample of a small model (the README's pdb line, smaller)
ARGV = ["-e", "d2", "-x", "1", "-v", "0", "-s", "1", "-g", "4", "-b", "2", "-t", "16"]
PDB_TIMEOUT_S = 600

DISCOVER = """
import sys
sys.path.insert(0, {root!r})
import gpt2_cpu
seen = set()
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_filename == gpt2_cpu.__file__:
        seen.add(frame.f_code.co_name)
sys.setprofile(profile)
gpt2_cpu.main({argv!r})
sys.setprofile(None)
print(" ".join(sorted(seen)))
"""


def functions_run():
    """The top-level functions of gpt2_cpu.py that one step and one sample call."""
    r = subprocess.run([sys.executable, "-c", DISCOVER.format(root=ROOT, argv=ARGV)], cwd=ROOT, capture_output=True,
                       text=True, timeout=PDB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    called = set(r.stdout.strip().splitlines()[-1].split())
    top_level = {name for name, f in inspect.getmembers(gpt2_cpu, inspect.isfunction) if f.__module__ == "gpt2_cpu"}
    return sorted(called & top_level)


def run_pdb(commands, argv=ARGV, env=None):
    return subprocess.run([sys.executable, "-m", "pdb", SCRIPT] + argv, input="\n".join(commands) + "\n", cwd=ROOT,
                          capture_output=True, text=True, timeout=PDB_TIMEOUT_S, env=env)


def main_line():
    """The line of gpt2_cpu.py that calls main(): stopping there, every function is defined."""
    lines = open(SCRIPT).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == "sys.exit(main())")


def test_every_function_of_a_step_and_a_sample_stops_at_a_breakpoint_and_q_quits():
    functions = functions_run()
    for expected in ("gpt2_forward", "gpt2_backward", "adamw_update", "gpt2_update", "layernorm_backward"):
        assert expected in functions
    commands = [f"b {SCRIPT}:{main_line()}", "c"] + [f"tbreak {name}" for name in functions] + \
        ["c"] * len(functions) + ["q"]
    r = run_pdb(commands)
    assert r.returncode in (0, 1), r.stderr
    assert "internal error" not in r.stdout + r.stderr
    assert "The program finished and will be restarted" not in r.stdout, "a breakpoint was never hit"
    hit = {name for name in functions if f"gpt2_cpu.py(" in r.stdout and f"){name}()" in r.stdout}
    assert hit == set(functions), f"never stopped in: {sorted(set(functions) - hit)}"


def readme_walkthrough():
    """The README's pdb section: (its command line, [(pdb command, the lines the README shows it
    printing)])."""
    section = open(README).read().split("## Step through a training step with pdb", 1)[1].split("\n## ", 1)[0]
    lines = [line[4:] for line in section.splitlines() if line.startswith("    ")]
    steps = []
    for line in lines[1:]:
        if line.startswith(PDB_PROMPT):
            steps.append((line[len(PDB_PROMPT):], []))
        else:
            steps[-1][1].append(line)
    return lines[0], steps


def test_the_readme_walkthrough_prints_what_the_readme_says():
    """The README's commands, typed into pdb as written: each command that the README shows
    printing something prints exactly that, and none is refused (pdb's `***` lines: a NameError, a
    breakpoint that cannot be set). It must reach the two the README names in its text."""
    command, steps = readme_walkthrough()
    words = shlex.split(command)
    assert words[:4] == ["python", "-m", "pdb", "gpt2_cpu.py"]
    r = subprocess.run([sys.executable] + words[1:], input="\n".join([c for c, _ in steps] + ["q"]) + "\n", cwd=ROOT,
                       capture_output=True, text=True, timeout=PDB_TIMEOUT_S)
    outputs = r.stdout.split(PDB_PROMPT)[1:]           # what each command printed, up to the next prompt
    assert r.returncode == 0 and len(outputs) == len(steps) + 1, r.stdout + r.stderr
    for (pdb_command, shown), printed in zip(steps, outputs):
        assert "***" not in printed, f"(Pdb) {pdb_command}: {printed}"
        if shown:
            assert printed.splitlines() == shown, f"(Pdb) {pdb_command}: printed {printed!r}, the README shows {shown}"
    printed_commands = [c for c, shown in steps if shown]
    assert "p dresidual.shape" in printed_commands and any('model.G["qkvw"][0]' in c for c in printed_commands)


def test_q_quits_at_the_first_prompt():
    r = run_pdb(["q"])
    assert r.returncode == 0 and "internal error" not in r.stdout + r.stderr
    assert "restarted" not in r.stdout


def test_an_internal_error_reaches_pdbs_post_mortem(tmp_path):
    """A learner's bug (here: gpt2_forward replaced by one that raises) stops in post-mortem at
    the line that raised, instead of becoming an `error:` line."""
    commands = [f"b {SCRIPT}:{main_line()}", "c",
                "gpt2_forward = lambda *a, **k: 1 / 0", "c", "p 'POST-MORTEM'", "q", "q"]
    r = run_pdb(commands)
    assert "ZeroDivisionError" in r.stdout + r.stderr and "Entering post mortem debugging" in r.stdout, r.stdout
    assert "internal error" not in r.stdout + r.stderr


@pytest.mark.parametrize("how", ["flag", "env"])
def test_traceback_switch_prints_an_internal_errors_traceback(tmp_path, how):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"")                          # bad input: still one line, no traceback
    argv = ["-e", str(bad), "-x", "1"] + (["--traceback"] if how == "flag" else [])
    env = dict(os.environ, **({"LLMC_TRACEBACK": "1"} if how == "env" else {}))
    r = subprocess.run([sys.executable, SCRIPT] + argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # an internal error: a gpt2_forward that raises, through the same run_main
    code = ("import sys; sys.path.insert(0, %r); import gpt2_cpu\n"
            "def broken(*a, **k): raise ZeroDivisionError('planted')\n"
            "gpt2_cpu.gpt2_forward = broken\n"
            "sys.exit(gpt2_cpu.main(%r))\n") % (ROOT, ARGV + (["--traceback"] if how == "flag" else []))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr and ", in broken" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: internal error: ZeroDivisionError: planted")
    # and without the switch, one line
    code_plain = code.replace(", '--traceback'", "")
    r = subprocess.run([sys.executable, "-c", code_plain], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, LLMC_TRACEBACK="0"), timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
