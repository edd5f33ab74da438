"""
tests/test_bench_llama3.py: dev/bench_cpu.py and dev/bench_emulator.py take -e llama3:dX.

A benchmark's numbers depend on the machine, so nothing here asserts a time: a tiny run must
print its lines (the table, the ratio) for llama3_cpu.py's step, and the matmul workload must
hold the products of Llama 3's block (five linear layers, the SwiGLU pair among them), counted
against the shapes written out here from llama3_cpu.parameter_shapes.

Run: python -m pytest tests/test_bench_llama3.py -q   (about 30 s)
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev"))
import bench_cpu  # noqa: E402
import llama3_cpu  # noqa: E402

TIMEOUT_S = 300


def run(script, args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "dev", script), *args], capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=ROOT)


def test_bench_cpu_times_the_llama3_step():
    r = run("bench_cpu.py", ["-e", "llama3:d2", "-b", "1", "-t", "8", "-n", "1"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llama3_cpu.py step, llama3:d2 (13,308,800 params), B=1 T=8, 1 repeats")
    for phase in ("training step", "forward", "backward", "update", "matmuls alone"):
        assert re.search(rf"^\s*{phase}\s+[0-9.]+$", r.stdout, re.MULTILINE), (phase, r.stdout)
    assert re.search(r"^ratio step / matmuls: [0-9.]+", r.stdout, re.MULTILINE)


def test_bench_cpu_refuses_an_unknown_llama3_model_in_one_line():
    r = run("bench_cpu.py", ["-e", "llama3:d9"])
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "unknown model 'llama3:d9'" in r.stderr


def test_llama3_matmul_workload_has_the_blocks_products():
    """Every (M,K) @ (K,N) the workload runs, counted by shape through a wrapped np.ndarray
    matmul: each linear layer of each block three times (forward, dinp, dweight), with Llama 3's
    widths: qkv (NH+2NKV)*HS = 256 for llama3:d2, the SwiGLU width H = 448 twice (c_fc, c_fc2),
    and once more in c_proj (C,H)."""
    family = bench_cpu.model_family("llama3:d2")
    cfg = family.config("llama3:d2")
    assert (cfg.channels, cfg.hidden_dim, llama3_cpu.qkv_channels(cfg)) == (128, 448, 256)
    assert family.linear_shapes(cfg) == [(256, 128), (128, 128), (448, 128), (448, 128), (128, 448)]
    shapes = {name: shape[-2:] for name, shape in llama3_cpu.parameter_shapes(cfg) if len(shape) == 3}
    assert sorted(family.linear_shapes(cfg)) == sorted(shapes.values())   # every block matrix, once
    assert isinstance(bench_cpu.model_family("d12"), bench_cpu.GPT2Family)
    products = []

    class Counting(np.ndarray):
        def __matmul__(self, other):
            products.append((self.shape[-2:], other.shape[-2:]))
            return np.matmul(np.asarray(self), np.asarray(other))

    class CountingRNG:
        """The workload's random arrays, as Counting arrays."""
        def __init__(self):
            self.rng = np.random.default_rng(0)

        def standard_normal(self, shape, dtype):
            return self.rng.standard_normal(shape, dtype=dtype).view(Counting)

    bench_cpu.matmul_workload(family, cfg, 2, 8, CountingRNG())()
    BT, C, H, L = 16, 128, 448, cfg.num_layers
    assert products.count(((BT, C), (C, H))) == 3 * L          # c_fc and c_fc2 forward (x @ w.T), c_proj's dinp (d @ w)
    assert products.count(((BT, H), (H, C))) == 3 * L          # c_fc and c_fc2 dinp, c_proj forward
    assert products.count(((H, BT), (BT, C))) == 2 * L          # c_fc and c_fc2 dweight (d.T @ x)
    assert products.count(((C, BT), (BT, H))) == L              # c_proj dweight
    assert products.count(((BT, C), (C, cfg.vocab_size))) == 1  # the classifier


@pytest.mark.parametrize("flags", [["-e", "llama3:d2", "-b", "1", "-t", "8", "--repeats", "1"]])
def test_bench_emulator_takes_llama3(flags):
    """With llama3_cuda.py in the checkout, the emulated Llama 3 step against llama3_cpu.py's;
    without it, one line saying what is missing."""
    r = run("bench_emulator.py", flags)
    if not os.path.isfile(os.path.join(ROOT, "llama3_cuda.py")):
        assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
        assert "llama3_cuda.py" in r.stderr
        return
    assert r.returncode == 0, r.stderr
    assert "llama3:d2, B=1, T=8, fp32" in r.stdout
    assert re.search(r"emulated device [0-9]+ ms, llama3_cpu.py [0-9]+ ms, ratio [0-9.]+", r.stdout), r.stdout
