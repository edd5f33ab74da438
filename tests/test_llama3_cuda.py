"""llama3_cuda.py, the Llama 3 model on the device, against llama3_cpu.py, on the emulated CUDA
device (llmc/emulator/): --check (llmc.cuda_check.check_llama3_against_cpu: every activation, the
logits, the loss and every gradient) from the command line on llama3:d2 in fp32 (naive attention)
and bf16 (flash attention); in-process on a tiny model with three query heads per kv head, in
both precisions; and the same comparison seen failing when one of Llama 3's backward launches is
broken (RoPE's backward skipped, SwiGLU's two gradients swapped, the K/V repeat's backward
keeping one query head); three training steps from the command line with llama3_cpu.py's losses,
gradient norms, validation losses and sample; checkpoints (-n, -y 1) on a tiny model: a resumed
run equals the straight one byte for byte in fp32 and bf16, and either trainer resumes the other's.

Run: python -m pytest -q tests/test_llama3_cuda.py   (~1 minute on 2 cores once the emulated
device's kernels are built; the first run compiles them, a few minutes)
"""

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpt2_cuda
import llama3_cpu
import llama3_cuda
from emulated_gpu import _train_losses, _write_shards
from llmc import checkpoint, cuda
from llmc.cuda_check import check_llama3_against_cpu
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NH = 6, NKV = 2: n_rep = 3; C = 96: HS = 16 (flash attention's smallest tile); H = 256 (a
# multiple of 8, bf16's x128); V = 75, no padding (a scalar path of the classifier)
TINY = llama3_cpu.LlamaConfig(max_seq_len=16, vocab_size=75, num_layers=2, num_heads=6, num_kv_heads=2, channels=96,
                              multiple_of=32)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda, "_device", "cpu")


def tiny_check(precision, attention="naive", verbose=True):
    """check_llama3_against_cpu on TINY, random init, one batch of 2x13 random tokens."""
    host = llama3_cpu.llama3_init(TINY, seed=3)
    model = llama3_cuda.Llama3(TINY, precision, attention)
    llama3_cuda.upload_parameters(model, host.params)
    rng = np.random.default_rng(0)
    inputs, targets = rng.integers(0, TINY.vocab_size, (2, 13)), rng.integers(0, TINY.vocab_size, (2, 13))
    return check_llama3_against_cpu(llama3_cuda, model, inputs, targets, verbose=verbose)


@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "naive"), ("fp32", "flash")])
def test_tiny_model_matches_llama3_cpu(emulated, precision, attention, capsys):
    assert tiny_check(precision, attention)
    out = capsys.readouterr().out
    assert out.count("TENSOR OK") == 29 and "NOT OK" not in out    # 16 activations, 3 of the loss, 10 gradients
    assert "dwte: TENSOR OK" in out and "dqkvw: TENSOR OK" in out


def broken_launcher(name, real):
    """A wrong version of llama3_cuda's launcher `name` (real: the right one), for the check to catch."""
    def rope_backward_skipped(dinp, dout, cos, sin, B, T, nh, n_rot, HS):       # dq, dk not rotated back
        real(dinp, dout, cos, sin, B, T, nh, 0, HS)

    def swiglu_gradients_swapped(dfch, dfch2, dout, fch, fch2, n):              # dfch and dfch2 exchanged
        real(dfch2, dfch, dout, fch, fch2, n)

    def repeat_kv_first_head_only(dinp, dout, B, T, NH, NKV, HS):             # each kv head: one query head's
        kept = dout.reshape(B, T, 3, NKV, NH // NKV, HS).copy()
        kept[:, :, 1:, :, 1:] = 0
        real(dinp, kept.reshape(dout.shape), B, T, NH, NKV, HS)
    return {"rope_backward": rope_backward_skipped, "swiglu_backward": swiglu_gradients_swapped,
            "repeat_kv_backward": repeat_kv_first_head_only}[name]


@pytest.mark.parametrize("name", ["rope_backward", "swiglu_backward", "repeat_kv_backward"])
def test_check_fails_on_a_broken_backward(emulated, monkeypatch, name, capsys):
    monkeypatch.setattr(llama3_cuda, name, broken_launcher(name, getattr(llama3_cuda, name)))
    assert not tiny_check("fp32")
    out = capsys.readouterr().out
    assert "dqkvw: TENSOR NOT OK" in out                    # upstream of every broken launch
    assert "dwlmhead: TENSOR OK" in out                     # downstream of them all


def run_cli(*args):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "llama3_cuda.py"), *args], capture_output=True,
                            text=True, timeout=900, cwd=ROOT)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "flash")])
def test_cli_check_on_the_emulated_device(precision, attention):
    rc, out = run_cli("--device", "cpu", "--check", "-e", "llama3:d2", "-b", "1", "-t", "16", "--precision", precision,
                      "--attention", attention)
    assert "kernels run on the emulated device" in out
    assert rc == 0 and "check: all tensors OK" in out, out[-3000:]
    assert out.count("TENSOR OK") == 29 and "NOT OK" not in out


LOSS_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([0-9.]+) \| norm ([0-9.]+)")


def test_cli_training_equals_llama3_cpu():
    # three steps of llama3:d2 in fp32 on the emulated device: the losses and gradient norms of
    # llama3_cpu.py, then its validation loss and its sample (the same SamplerRNG draws)
    args = ("-e", "llama3:d2", "-b", "2", "-t", "16", "-x", "3", "-v", "3", "-m", "1", "-s", "3", "-g", "6")
    rc_gpu, out_gpu = run_cli("--device", "cpu", *args)
    cpu = subprocess.run([sys.executable, os.path.join(ROOT, "llama3_cpu.py"), *args], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    out_cpu = cpu.stdout + cpu.stderr
    assert rc_gpu == 0 and cpu.returncode == 0, out_gpu[-2000:] + out_cpu[-2000:]
    gpu_steps, cpu_steps = LOSS_LINE.findall(out_gpu), LOSS_LINE.findall(out_cpu)
    assert len(gpu_steps) == len(cpu_steps) == 3
    for (step, loss, norm), (_, cpu_loss, cpu_norm) in zip(gpu_steps, cpu_steps):
        assert float(loss) == pytest.approx(float(cpu_loss), rel=2e-6), f"step {step}"
        assert float(norm) == pytest.approx(float(cpu_norm), rel=1e-4), f"step {step}"
    val_gpu, val_cpu = re.findall(r"val loss ([0-9.]+)", out_gpu), re.findall(r"val loss ([0-9.]+)", out_cpu)
    assert len(val_gpu) == len(val_cpu) == 2
    assert [float(v) for v in val_gpu] == pytest.approx([float(v) for v in val_cpu], rel=2e-6)
    sample = out_cpu.split("generating:")[1].split("---")[1]
    assert sample.strip() and sample in out_gpu.split("generating:")[1]


# ----------------------------------------------------------------------------
# checkpoints: llmc/checkpoint.py's files, written and resumed by either trainer

EMULATED = ["--device", "cpu"]                 # llama3_cuda.py's flag: llama3_cpu.py has no --device


@pytest.fixture
def tiny_training(emulated, monkeypatch, tmp_path):
    """The flags of a short run of TINY (a Llama 3 model file) on a shard of its random tokens, on the
    emulated device with the global norm's grid cut from 1024 blocks to 16 (as tests/test_cuda.py's
    emulated_training: the same kernel, another fixed summation order), no validation, no samples."""
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)
    model = str(tmp_path / "tiny_llama3.bin")
    llama3_cpu.write_model(model, llama3_cpu.llama3_init(TINY, seed=3))
    data = _write_shards(tmp_path, V=TINY.vocab_size)
    return ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "16", "-v", "0", "-s", "0", "-l", "1e-3",
            "-k", "constant"]


def test_resume_equals_the_straight_run(tiny_training, tmp_path, capsys):
    """fp32: 3 steps, a checkpoint (a Llama 3 model file and the state), resume, 3 more: the
    straight 6-step run's losses, and its step-6 checkpoint byte for byte (the emulated device is
    deterministic)."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert llama3_cuda.main(tiny_training + EMULATED + ["-x", "6", "-n", "3", "-o", straight]) == 0
    assert llama3_cuda.main(tiny_training + EMULATED + ["-x", "3", "-n", "3", "-o", resumed]) == 0
    assert llama3_cpu.read_model(os.path.join(resumed, "model_00000003.bin")).config == TINY
    assert llama3_cuda.main(tiny_training + EMULATED + ["-x", "6", "-n", "3", "-y", "1", "-o", resumed]) == 0
    assert "resumed from" in capsys.readouterr().out
    ref = _train_losses(os.path.join(straight, "main.log"))
    assert len(ref) == 6 and _train_losses(os.path.join(resumed, "main.log")) == ref
    for name in ("model_00000006.bin", "state_00000006_00000.bin"):
        with open(os.path.join(straight, name), "rb") as a, open(os.path.join(resumed, name), "rb") as b:
            assert a.read() == b.read(), name
    # a resume checks that -e names the checkpoint's model
    other = ["-e", "llama3:d2", "-x", "6", "-y", "1", "-o", resumed]
    assert llama3_cuda.main(tiny_training[2:] + EMULATED + other) == 1
    assert "the checkpoint in -o" in capsys.readouterr().err


def test_bf16_resume_equals_the_straight_run_byte_for_byte(tiny_training, tmp_path):
    """bf16 with its fp32 master weights: the state file holds them, the model file the bf16
    parameters (upcast); a run resumed from its step-2 checkpoint prints the straight run's losses
    and writes the straight run's step-4 files, byte for byte."""
    common = tiny_training + ["-x", "4", "-n", "2", "--precision", "bf16", "-l", "1e-2"]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert llama3_cuda.main(common + EMULATED + ["-o", straight]) == 0
    saved = llama3_cpu.read_model(os.path.join(straight, "model_00000002.bin"))
    st = checkpoint.read_state(os.path.join(straight, "state_00000002_00000.bin"), saved.num_parameters, 0, 1)
    assert st["master_weights"] is not None and not np.array_equal(st["master_weights"], saved.params)
    np.testing.assert_array_equal(saved.params, bfloat16_bits_to_float32(float32_to_bfloat16_bits(saved.params)))
    assert st["rng_state_last_update"] != 0
    shutil.copytree(straight, resumed)
    for name in ("DONE_00000004", "model_00000004.bin", "state_00000004_00000.bin", "config_00000004.json"):
        os.remove(os.path.join(resumed, name))                           # as if it had stopped at step 2
    assert llama3_cuda.main(common + EMULATED + ["-y", "1", "-o", resumed]) == 0
    assert _train_losses(os.path.join(resumed, "main.log")) == _train_losses(os.path.join(straight, "main.log"))
    for name in ("model_00000004.bin", "state_00000004_00000.bin"):
        with open(os.path.join(straight, name), "rb") as a, open(os.path.join(resumed, name), "rb") as b:
            assert a.read() == b.read(), name


def test_cross_resume_with_llama3_cpu(tiny_training, tmp_path):
    """Either trainer resumes the other's checkpoint and continues with llama3_cpu.py's losses (fp32:
    the device's sums in another order, as tests/test_cuda.py's GPT-2 cross-resume, rel 1e-5)."""
    straight, a, b = (str(tmp_path / d) for d in ("straight", "a", "b"))
    assert llama3_cpu.main(tiny_training + ["-x", "6", "-o", straight]) == 0
    ref = _train_losses(os.path.join(straight, "main.log"))
    # CUDA 0..3, then CPU 3..6
    assert llama3_cuda.main(tiny_training + EMULATED + ["-x", "3", "-n", "3", "-o", a]) == 0
    assert llama3_cpu.main(tiny_training + ["-x", "6", "-y", "1", "-o", a]) == 0
    # CPU 0..3, then CUDA 3..6
    assert llama3_cpu.main(tiny_training + ["-x", "3", "-n", "3", "-o", b]) == 0
    assert llama3_cuda.main(tiny_training + EMULATED + ["-x", "6", "-y", "1", "-o", b]) == 0
    assert len(ref) == 6
    for run in (a, b):
        got = _train_losses(os.path.join(run, "main.log"))
        assert sorted(got) == sorted(ref)
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (run, step)


def test_import_does_not_import_cupy():
    r = subprocess.run([sys.executable, "-c", "import sys, llama3_cuda; print('cupy' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_shapes_the_kernels_cannot_run_are_refused(emulated):
    # bf16's x128 groups are 8 values: a head size of 12 (C = 48, NH = 4) cannot be read in them
    config = llama3_cpu.LlamaConfig(max_seq_len=8, vocab_size=11, num_layers=1, num_heads=4, num_kv_heads=2,
                                    channels=48, multiple_of=16)
    with pytest.raises(llama3_cuda.InputError, match="head size 12 .* whole multiples of 8 in bf16"):
        llama3_cuda.Llama3(config, "bf16")
    assert llama3_cuda.Llama3(config, "fp32").num_parameters == llama3_cpu.Llama3(config).num_parameters
