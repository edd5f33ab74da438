"""
tests/test_gdb_walkthrough.py: doc/from_numpy_to_cuda.md section 6 works as written.

The tutorial shows `cat doc/layernorm_demo.gdb` and the output of gdb running doc/layernorm_demo.py
with a breakpoint inside kernels/layernorm.cu on the emulated device. These tests check that the
shown command file is the shipped one, that its breakpoint line is the line the tutorial says it is,
and, where gdb is installed, run the walkthrough and compare every line the tutorial shows with
gdb's real output (addresses, the absolute path and the thread's name, which vary, normalized).
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "doc", "from_numpy_to_cuda.md")
GDB_FILE = os.path.join(ROOT, "doc", "layernorm_demo.gdb")
CAT_PROMPT = "$ cat doc/layernorm_demo.gdb\n"
GDB_PROMPT = "$ LLMC_EMULATOR_DEBUG=1 gdb "
GDB_TIMEOUT_S = 600          # the -O0 kernel library is compiled on the first run


def doc_blocks():
    """(the command file as the tutorial shows it, the gdb output lines it shows)."""
    text = open(DOC).read()
    start = text.index(CAT_PROMPT) + len(CAT_PROMPT)
    command_at = text.index(GDB_PROMPT, start)
    shown_file = text[start:command_at]
    output_start = text.index("\n", command_at) + 1
    output = text[output_start:text.index("```", output_start)]
    return shown_file, [line for line in output.splitlines() if line]


def normalize(line):
    line = re.sub(r"0x[0-9a-f]+", "0xADDR", line)
    line = re.sub(r'Thread 1 "[^"]*"', 'Thread 1 "python"', line)
    return re.sub(r" at \S*/kernels/", " at kernels/", line)


def test_the_shown_command_file_is_the_shipped_one():
    shown, _ = doc_blocks()
    assert shown == open(GDB_FILE).read()


def test_the_breakpoint_line_computes_rstd():
    line_number = int(re.search(r"break layernorm\.cu:(\d+)", open(GDB_FILE).read()).group(1))
    kernel_lines = open(os.path.join(ROOT, "kernels", "layernorm.cu")).read().splitlines()
    assert "row_rstd = rsqrtf(" in kernel_lines[line_number - 1]
    _, shown = doc_blocks()
    assert f"{line_number}\t{kernel_lines[line_number - 1]}" in shown


def test_gdb_output_is_the_tutorials():
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed (apt-get install gdb): the walkthrough cannot run")
    env = dict(os.environ, LLMC_EMULATOR_DEBUG="1")
    result = subprocess.run(["gdb", "-q", "-batch", "-x", GDB_FILE, "--args", sys.executable,
                             os.path.join(ROOT, "doc", "layernorm_demo.py")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=GDB_TIMEOUT_S)
    actual = [normalize(line) for line in (result.stdout + result.stderr).splitlines()]
    _, shown = doc_blocks()
    position = 0
    for line in shown:                      # every shown line, in the shown order
        expected = normalize(line)
        assert expected in actual[position:], f"not in gdb's output (after line {position}): {line!r}\n" + \
            "\n".join(actual)
        position = actual.index(expected, position) + 1
