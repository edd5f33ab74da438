"""
tests/test_tensor_cores_doc.py: doc/tensor_cores.md's commands and gdb walkthrough work as written
(its numbers are tests/test_docs.py's business).

- Section 2 shows lanes of `python dev/cuda/tensor_core.py --device cpu`: every shown line is in the
  command's real output, in the shown order.
- The introduction's `python dev/cuda/matmul.py --device cpu` validates versions 6-8 (run with
  --versions 6-8, the part the tutorial is about).
- Section 7 shows `cat doc/tensor_cores_demo.gdb` and gdb's output on doc/tensor_cores_demo.py: the
  shown command file is the shipped one, its breakpoint line is version 6's mma call, and, where gdb
  is installed, every shown output line is in gdb's real output in the shown order (addresses, the
  absolute path and the thread's name, which vary, normalized).

Run: pytest tests/test_tensor_cores_doc.py   (~1 minute; the -O0 build for gdb the first time, ~1 minute more)
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "doc", "tensor_cores.md")
GDB_FILE = os.path.join(ROOT, "doc", "tensor_cores_demo.gdb")
MATMUL_CU = os.path.join(ROOT, "dev", "cuda", "matmul.cu")
TENSOR_CORE_PROMPT = "$ python dev/cuda/tensor_core.py --device cpu\n"
CAT_PROMPT = "$ cat doc/tensor_cores_demo.gdb\n"
GDB_PROMPT = "$ LLMC_EMULATOR_DEBUG=1 gdb "
TIMEOUT_S = 900              # the -O0 kernel library is compiled on the first gdb run


def doc_text():
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def shown_block(after):
    """The lines of the fenced block that follow `after` in the tutorial, up to the block's end."""
    text = doc_text()
    start = text.index(after) + len(after)
    return text[start:text.index("```", start)].splitlines()


def in_order(shown, actual):
    """Assert that every shown line is in actual, in the shown order."""
    position = 0
    for line in shown:
        assert line in actual[position:], f"not in the output (after line {position}): {line!r}\n" + "\n".join(actual)
        position = actual.index(line, position) + 1


def run(args, env=None):
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_the_fragment_tables_are_tensor_core_py_output():
    result = run([sys.executable, os.path.join("dev", "cuda", "tensor_core.py"), "--device", "cpu"])
    assert result.returncode == 0, result.stderr
    shown = shown_block(TENSOR_CORE_PROMPT)
    assert len(shown) == 3 * 5                      # three tables: a title and four lanes each
    in_order(shown, result.stdout.splitlines())


def test_matmul_py_validates_the_tensor_core_versions_on_the_emulated_device():
    result = run([sys.executable, os.path.join("dev", "cuda", "matmul.py"), "--device", "cpu", "--versions", "6-8"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "every version validated on the emulated device" in result.stdout
    assert " v6 block  128: OK" in result.stdout and " v8 block  256: OK" in result.stdout


# ----------------------------------------------------------------------------
# section 7: gdb

def gdb_blocks():
    """(the command file as the tutorial shows it, the gdb output lines it shows)."""
    text = doc_text()
    start = text.index(CAT_PROMPT) + len(CAT_PROMPT)
    command_at = text.index(GDB_PROMPT, start)
    output_start = text.index("\n", command_at) + 1
    output = text[output_start:text.index("```", output_start)]
    return text[start:command_at], [line for line in output.splitlines() if line]


def normalize(line):
    line = re.sub(r"0x[0-9a-f]{9,}", "0xADDR", line)               # pointers (the registers: 8 digits at most)
    line = re.sub(r'Thread 1 "[^"]*"', 'Thread 1 "python"', line)
    return re.sub(r" at \S*/dev/cuda/", " at dev/cuda/", line)


def test_the_shown_command_file_is_the_shipped_one():
    shown, _ = gdb_blocks()
    with open(GDB_FILE, encoding="utf-8") as f:
        assert shown == f.read()


def test_the_breakpoint_is_version_6s_mma():
    with open(GDB_FILE, encoding="utf-8") as f:
        line_number = int(re.search(r"break matmul\.cu:(\d+)", f.read()).group(1))
    with open(MATMUL_CU, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert "mma_m16n8k16_bf16(acc[mi][ni], a[mi], b[ni]" in lines[line_number - 1]
    v6_start = next(i for i, line in enumerate(lines) if line.startswith("matmul_forward_v6("))
    v7_start = next(i for i, line in enumerate(lines) if line.startswith("matmul_forward_v7("))
    assert v6_start < line_number - 1 < v7_start
    _, shown = gdb_blocks()
    assert f"{line_number}\t{lines[line_number - 1]}" in shown


def test_gdb_output_is_the_tutorials():
    if shutil.which("gdb") is None:
        pytest.skip("gdb is not installed (apt-get install gdb): the walkthrough cannot run")
    env = dict(os.environ, LLMC_EMULATOR_DEBUG="1")
    result = run(["gdb", "-q", "-batch", "-x", GDB_FILE, "--args", sys.executable,
                  os.path.join(ROOT, "doc", "tensor_cores_demo.py")], env=env)
    actual = [normalize(line) for line in (result.stdout + result.stderr).splitlines()]
    _, shown = gdb_blocks()
    in_order([normalize(line) for line in shown], actual)
