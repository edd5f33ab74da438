"""
tests/test_bench_llama3.py: dev/bench_cpu.py and dev/bench_emulator.py take -e llama3:dX, and a Llama 3
model file; bad input (an unknown -e, B or T out of range, a bad model file) is one `error:` line and exit 1.
dev/bench_cpu.py times PyTorch's step of the same model (both families): its twin holds the NumPy
model's parameters (the same loss on the same batch), and the table has PyTorch's row and ratio, or
says why not (--no-torch).

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


@pytest.mark.parametrize("spec", ["d2", "llama3:d2"])
def test_bench_cpu_twin_is_the_same_model(spec):
    """PyTorch's step is timed on the NumPy model's own parameters: the twin's loss on a batch is
    the NumPy forward's (fp32, to 1e-5), so the two steps do the same work."""
    pytest.importorskip("torch")
    family = bench_cpu.model_family(spec)
    model = family.build(spec)
    x, y = (np.random.default_rng(seed).integers(0, model.config.vocab_size, (2, 8), dtype=np.int32) for seed in (1, 2))
    family.forward(model, x, y)
    _, twin_loss, _ = family.twin(model).forward_backward(x, y)
    assert abs(twin_loss - model.mean_loss) < 1e-5, (twin_loss, model.mean_loss)


def test_bench_cpu_times_pytorch_in_the_same_run():
    pytest.importorskip("torch")
    r = run("bench_cpu.py", ["-e", "d2", "-b", "1", "-t", "8", "-n", "1"])
    assert r.returncode == 0, r.stderr
    assert "PyTorch (dev/torch_reference.py) on" in r.stdout.splitlines()[0], r.stdout
    assert re.search(r"^PyTorch step\s+[0-9.]+$", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^ratio step / PyTorch: [0-9.]+", r.stdout, re.MULTILINE), r.stdout
    r = run("bench_cpu.py", ["-e", "d2", "-b", "1", "-t", "8", "-n", "1", "--no-torch"])
    assert r.returncode == 0 and "PyTorch's step not timed: --no-torch" in r.stdout, r.stdout + r.stderr
    assert "ratio step / PyTorch" not in r.stdout


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


# ----------------------------------------------------------------------------
# bad input: one `error:` line and exit 1; a Llama 3 model file is benchmarked as Llama 3

TINY = llama3_cpu.LlamaConfig(max_seq_len=32, vocab_size=256, num_layers=1, num_heads=4, num_kv_heads=2, channels=32,
                              multiple_of=32)


def tiny_llama3_file(tmp_path):
    """A tiny Llama 3 model file (llama3_cpu's writer)."""
    path = str(tmp_path / "tiny_llama3.bin")
    llama3_cpu.write_model(path, llama3_cpu.llama3_init(TINY, 0))
    return path


def error_line(capsys):
    """The one stderr line of a main that returned 1, else None."""
    err = capsys.readouterr().err.strip().splitlines()
    return err[0] if len(err) == 1 and err[0].startswith("error: ") else None


@pytest.mark.parametrize("flags, said", [
    (["-e", "llama3:d0"], "unknown model 'llama3:d0'"), (["-e", "llama3:dx"], "unknown model 'llama3:dx'"),
    (["-e", "d0"], "unknown model 'd0'"), (["-b", "0"], "-b 0 -t 8"), (["-b", "-1"], "-b -1 -t 8"),
    (["-t", "0"], "-b 1 -t 0"), (["-t", "2000"], "-b 1 -t 2000: B must be positive and T in [1, 1024]"),
    (["--repeats", "0"], "--repeats 0"),
])
def test_bench_emulator_bad_input_is_one_line(capsys, flags, said):
    """Checked before anything is built or run (these were InputError and ValueError tracebacks,
    or a run with B = -1)."""
    import bench_emulator
    assert bench_emulator.main(["-e", "llama3:d2", "-b", "1", "-t", "8", "--repeats", "1"] + flags) == 1
    line = error_line(capsys)
    assert line and said in line and "internal error" not in line, line


def test_bench_emulator_and_bench_cpu_take_a_llama3_model_file(tmp_path, capsys, monkeypatch):
    """-e a Llama 3 model file benchmarks its model as Llama 3 (bench_emulator read it as GPT-2's
    and died on the magic; bench_cpu said it was not a .bin file); a file that is no model, or a
    truncated one, is the trainers' one line (the file is read whole, as the trainers read it)."""
    import bench_emulator
    from llmc import cuda
    monkeypatch.setattr(cuda, "_device", cuda.device())    # the emulated run switches it to "cpu": put back
    path = tiny_llama3_file(tmp_path)
    assert bench_emulator.main(["-e", path, "-b", "1", "-t", "8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{path}, B=1, T=8, fp32" in out and re.search(r"emulated device [0-9]+ ms, llama3_cpu.py", out), out
    assert bench_cpu.main(["-e", path, "-b", "1", "-t", "8", "-n", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"llama3_cpu.py step, {path} (")
    junk, truncated = tmp_path / "junk.bin", tmp_path / "truncated.bin"
    junk.write_bytes(b"\0" * 2048)
    truncated.write_bytes(open(path, "rb").read()[:-4])
    for main, flags in ((bench_emulator.main, ["--repeats", "1"]), (bench_cpu.main, ["-n", "1"])):
        for bad, said in ((junk, "bad magic number 0"), (truncated, "but the file holds")):
            assert main(["-e", str(bad), "-b", "1", "-t", "8"] + flags) == 1
            line = error_line(capsys)
            assert line and str(bad) in line and said in line, line
