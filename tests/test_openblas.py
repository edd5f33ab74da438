"""tests/test_openblas.py: the CUDA trainers set how long OpenBLAS's idle threads spin before NumPy
loads it (llmc/openblas.py), and a value the user set wins."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# records whether NumPy was loaded when the trainer set the variable, then the value it left
PROBE = """
import sys
sys.path.insert(0, {root!r})
import llmc.openblas
real = llmc.openblas.spin_briefly_when_idle
seen = []
def spy():
    seen.append("numpy" in sys.modules)
    real()
llmc.openblas.spin_briefly_when_idle = spy
import {module}
import os
print(seen, os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
"""


@pytest.mark.parametrize("module", ["gpt2_cuda", "llama3_cuda"])
@pytest.mark.parametrize("user_value", [None, "20"])
def test_the_cuda_trainers_set_the_spin_before_numpy_loads(module, user_value):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if user_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = user_value
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=ROOT, module=module)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    expected = user_value or "16"                  # llmc.openblas.IDLE_SPIN_LOG2_CYCLES, or the user's
    seen, value = out.stdout.rsplit(maxsplit=1)
    assert seen.startswith("[False") and value == expected   # llama3_cuda's import of gpt2_cuda calls it again
