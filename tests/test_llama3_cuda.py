"""llama3_cuda.py, the Llama 3 model on the device, against llama3_cpu.py, on the emulated CUDA
device (llmc/emulator/): --check (llmc.cuda_check.check_llama3_against_cpu: every activation, the
logits, the loss and every gradient) from the command line on llama3:d2 in fp32 (naive attention)
and bf16 (flash attention); in-process on a tiny model with three query heads per kv head, in
both precisions; and the same comparison seen failing when one of Llama 3's backward launches is
broken (RoPE's backward skipped, SwiGLU's two gradients swapped, the K/V repeat's backward
keeping one query head); three training steps from the command line with llama3_cpu.py's losses,
gradient norms, validation losses and sample; the KV-cached sampler against llama3_cpu's (each
step's logits, the cache, the ids drawn within and past maxT) and the full forward's ids;
checkpoints (-n, -y 1) on a tiny model: a resumed run equals the straight one byte for byte in
fp32 and bf16, and either trainer resumes the other's; a run killed (SIGKILL) after a checkpoint
resumes to the straight run's losses and model file (slow).

Run: python -m pytest -q tests/test_llama3_cuda.py   (~1 minute on 2 cores once the emulated
device's kernels are built; the first run compiles them, a few minutes)
"""

import dataclasses
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
from gpt2_cpu import generate
from llmc import checkpoint, cuda
from llmc.cuda_check import check_llama3_against_cpu
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from llmc.sampler import SamplerRNG

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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_flash_reads_the_kv_heads_in_place(emulated, monkeypatch, precision, capsys):
    """Flash attention takes the NKV key/value heads where RoPE leaves them: no repeat_kv launch,
    its kept qkv is (L,B,T,(NH+2NKV)*HS), and every tensor still matches llama3_cpu's."""
    def never(*args):
        raise AssertionError("the flash path repeated the kv heads")
    monkeypatch.setattr(llama3_cuda, "repeat_kv_forward", never)
    monkeypatch.setattr(llama3_cuda, "repeat_kv_backward", never)
    assert tiny_check(precision, "flash")
    assert "NOT OK" not in capsys.readouterr().out
    model = llama3_cuda.Llama3(TINY, precision, "flash")
    HS = TINY.channels // TINY.num_heads
    assert llama3_cuda.llama3_activations(model, 2, 13)["qkv"].shape == (2, 2, 13, (6 + 2 * 2) * HS)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("HS", [32, 64, 128])
def test_flash_check_at_every_head_size(emulated, precision, HS, capsys):
    """--check through flash attention at the head sizes Llama 3 and GPT-2 use (TINY's is 16), with
    grouped-query heads (NH = 4 on NKV = 2) and a ragged T = 13: every tensor llama3_cpu's."""
    config = llama3_cpu.LlamaConfig(max_seq_len=16, vocab_size=75, num_layers=1, num_heads=4, num_kv_heads=2,
                                    channels=4 * HS, multiple_of=32)
    host = llama3_cpu.llama3_init(config, seed=5)
    model = llama3_cuda.Llama3(config, precision, "flash")
    llama3_cuda.upload_parameters(model, host.params)
    rng = np.random.default_rng(1)
    inputs, targets = rng.integers(0, 75, (1, 13)), rng.integers(0, 75, (1, 13))
    assert check_llama3_against_cpu(llama3_cuda, model, inputs, targets, verbose=False)


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


@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "flash"), ("bf16", "cudnn")])
def test_cli_check_on_the_emulated_device(precision, attention):
    """cudnn: what --attention auto takes on a GPU with the cuDNN frontend (the emulated cuDNN here)."""
    rc, out = run_cli("--device", "cpu", "--check", "-e", "llama3:d2", "-b", "1", "-t", "16", "--precision", precision,
                      "--attention", attention)
    assert "kernels run on the emulated device" in out and f"{attention} attention" in out
    assert rc == 0 and "check: all tensors OK" in out, out[-3000:]
    assert out.count("TENSOR OK") == 29 and "NOT OK" not in out


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cli_check_on_the_gpu_with_the_defaults(precision):
    """On a GPU, llama3_cuda.py --check with its defaults (--attention auto: cuDNN in bf16 where the
    frontend loads, else naive, which the output names) against llama3_cpu.py, every tensor."""
    rc, out = run_cli("--check", "-e", "llama3:d2", "-b", "4", "-t", "64", "--precision", precision)
    assert rc == 0 and "check: all tensors OK" in out, out[-3000:]
    assert out.count("TENSOR OK") == 29 and "NOT OK" not in out


LOSS_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([0-9.]+) \| norm ([0-9.]+)")


def test_cli_training_equals_llama3_cpu():
    # three steps of llama3:d2 in fp32 on the emulated device: the losses and gradient norms of
    # llama3_cpu.py, then its validation loss and its sample (the same SamplerRNG draws)
    args = ("-e", "llama3:d2", "-b", "2", "-t", "16", "-x", "3", "-v", "3", "-m", "1", "-s", "3", "-g", "6")
    rc_gpu, out_gpu = run_cli("--device", "cpu", "-lg", "2", *args)
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
    # -lg 2: the device's memory line after step 2 (of 3), once
    assert len(re.findall(r"^gpu 0: memory [0-9.]+ of [0-9.]+ GiB in use", out_gpu, re.M)) == 1, out_gpu[-2000:]


@pytest.mark.parametrize("flags", [["--cublaslt", "1"], ["-r", "2"], ["-w", "0"]])
def test_gpt2_cuda_only_flags_are_refused_in_one_line(flags):
    """llama3_cuda.py has no cuBLASLt backend, no recomputation and always keeps fp32 master weights
    in bf16: gpt2_cuda.py's flags for them are unknown here (before, accepted and ignored)."""
    rc, out = run_cli("--device", "cpu", *flags)
    lines = out.strip().splitlines()
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(f"error: unrecognized arguments: {' '.join(flags)}"), out


# ----------------------------------------------------------------------------
# sampler: the KV-cached forward on the device (llama3_cuda.llama3_forward_cached) against
# llama3_cpu's, and the tokens gpt2_cpu.generate draws with it

# fp32 logits of TINY: the same arithmetic as llama3_cpu up to summation order and RoPE's fp32
# tables (llama3_cpu rotates with float64 ones); the differences seen are below 4e-7 of the largest
# logit. Relative to the largest value, not each one: a logit near 0 has no relative precision
CACHED_RTOL = 1e-5


def assert_close(got, ref, label):
    """|got - ref| <= CACHED_RTOL * max |ref|, elementwise."""
    np.testing.assert_allclose(got, ref, rtol=0, atol=CACHED_RTOL * np.abs(ref).max(), err_msg=label)


# random init scaled up so that attention is peaked (it is near uniform at init, where a key's
# position hardly matters) and the logits spread over a few units (the draws then depend on them)
SAMPLING_QKV_SCALE = 4.0
SAMPLING_LMHEAD_SCALE = 10.0


def sampling_models():
    """TINY random-init on the host (llama3_cpu), qkvw and wlmhead scaled up, and the same
    parameters on the device, fp32."""
    host = llama3_cpu.llama3_init(TINY, seed=3)
    host.P["qkvw"] *= SAMPLING_QKV_SCALE
    host.P["wlmhead"] *= SAMPLING_LMHEAD_SCALE
    model = llama3_cuda.Llama3(TINY, "fp32")
    llama3_cuda.upload_parameters(model, host.params)
    return host, model


def test_forward_cached_matches_llama3_cpu(emulated):
    # a prompt of 4 tokens (the prefill), then 3 tokens one at a time: each step's logits against
    # llama3_cpu.llama3_forward_cached's, and the cache against its NKV heads repeated to NH
    host, model = sampling_models()
    x = np.random.default_rng(2).integers(0, TINY.vocab_size, (1, TINY.max_seq_len)).astype(np.int32)
    cache, cpu_cache = llama3_cuda.kv_cache_new(TINY, 1), llama3_cpu.kv_cache_new(TINY, 1)
    for start, stop in [(0, 4), (4, 5), (5, 6), (6, 7)]:
        logits = llama3_cuda.llama3_forward_cached(model, x[:, start:stop], cache)
        ref = llama3_cpu.llama3_forward_cached(host, x[:, start:stop], cpu_cache)
        assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (1, TINY.vocab_size)
        assert_close(logits, ref, f"positions {start}..{stop - 1}")
    assert cache.length == cpu_cache.length == 7
    full = llama3_cuda.llama3_forward(model, x[:, :7])[0, 6].get()             # the last row of the full forward
    assert_close(logits[0], full, "the cached forward's last logits against the full forward's")
    n_rep = TINY.num_heads // TINY.num_kv_heads
    assert cache.k.shape == (TINY.num_layers, 1, TINY.num_heads, TINY.max_seq_len, TINY.head_size)
    for got, ref in [(cache.k, cpu_cache.k), (cache.v, cpu_cache.v)]:   # keys rotated at their own positions
        repeated = np.repeat(ref[:, :, :7], n_rep, axis=3).transpose(0, 1, 3, 2, 4)   # (L,1,7,NKV,HS) -> (L,1,NH,7,HS)
        assert_close(got.get()[:, :, :, :7], repeated, "cache")
    llama3_cuda.llama3_forward_cached(model, x[:, 7:], cache)         # fills it to maxT
    with pytest.raises(llama3_cuda.InputError, match="max_seq_len"):
        llama3_cuda.llama3_forward_cached(model, x[:, :1], cache)        # a full cache takes no more


def counted(monkeypatch, module, calls):
    """Record the number of positions of each call of module.llama3_forward_cached in calls."""
    forward = module.llama3_forward_cached

    def counting(model, x, cache):
        calls.append(x.shape[1])
        return forward(model, x, cache)
    monkeypatch.setattr(module, "llama3_forward_cached", counting)


@pytest.mark.parametrize("prompt,n,expected_calls", [
    ([3, 4, 5], 13, [3] + [1] * 12),                 # within maxT = 16: the prefill, then one token a call
    # past maxT: the cache fills at the 14th call; from then on the context slides one position a
    # token, every key's RoPE angle changes, and the cache is refilled with the last maxT tokens
    ([3, 4, 5], 20, [3] + [1] * 13 + [16] * 6),
])
def test_generate_with_kv_cache_matches_the_full_forward_and_llama3_cpu(emulated, monkeypatch, prompt, n,
                                                                        expected_calls):
    host, model = sampling_models()
    calls, cpu_calls = [], []
    counted(monkeypatch, llama3_cuda, calls)
    counted(monkeypatch, llama3_cpu, cpu_calls)
    ids = generate(model, prompt, n, SamplerRNG(11), 0.9, 40, forward=llama3_cuda.sampling_forward(model))
    assert calls == expected_calls
    assert ids == llama3_cpu.llama3_generate(host, prompt, n, SamplerRNG(11), 0.9, 40, kv_cache=True)
    assert cpu_calls == expected_calls
    full = generate(model, prompt, n, SamplerRNG(11), 0.9, 40, forward=llama3_cuda.sampling_forward(model),
                    kv_cache=False)                  # the full forward over the window, on the device
    assert ids == full and len(calls) == n and len(set(ids)) > 1


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


def test_a_norm_eps_the_kernel_does_not_have_is_refused(emulated):
    """kernels/rmsnorm.cu compiles in Llama 3's 1e-5: a model file with another norm_eps (which
    llama3_cpu.py honours) is refused, not trained with the wrong epsilon (before: silently)."""
    config = dataclasses.replace(TINY, norm_eps=0.1)
    with pytest.raises(llama3_cuda.InputError, match="RMSNorm epsilon is 0.1; .* 1e-05 built in"):
        llama3_cuda.Llama3(config, "fp32")


@pytest.mark.parametrize("tool", ["llama3_cuda.py", "llama3_cpu.py"])
def test_help_describes_llama3_not_gpt2(tool):
    """--help's first line and -e's help name Llama 3 and its descriptors (llama3_cuda.py's said
    "Train GPT-2" and listed GPT-2's and GPT-3's descriptors)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, tool), "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "Train Llama 3" in text and "Train GPT-2" not in text
    model_help = text.split("-e MODEL, --model MODEL", 1)[1].split(" -o OUTPUT_DIR")[0]
    assert "llama3:d2 llama3:d4 llama3:d6" in model_help and "(default: llama3:d4)" in model_help
    assert "GPT-2" not in model_help and "gpt3" not in model_help and "llm.c's default" not in model_help


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_straight_runs_result(tmp_path):
    """kill -9 of a running llama3_cuda.py (emulated device) once its step-2 checkpoint is complete,
    wherever it then is (mid-step, mid-checkpoint: its temporaries are left behind); -y 1 resumes from
    its newest complete checkpoint and ends with the straight run's losses and model file, byte for byte."""
    import signal
    import time
    model = str(tmp_path / "tiny_llama3.bin")
    llama3_cpu.write_model(model, llama3_cpu.llama3_init(TINY, seed=3))
    flags = [sys.executable, os.path.join(ROOT, "llama3_cuda.py"), "--device", "cpu", "-e", model, "-i",
             _write_shards(tmp_path, V=TINY.vocab_size), "-j", "", "-b", "2", "-t", "16", "-v", "0", "-s", "0",
             "-l", "1e-3", "-k", "constant", "-x", "12", "-n", "2"]
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    subprocess.run(flags + ["-o", straight], check=True, capture_output=True, timeout=600, cwd=ROOT)
    victim = subprocess.Popen(flags + ["-o", killed], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(killed, "DONE_00000002")) and victim.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not os.path.exists(os.path.join(killed, "DONE_00000012"))      # killed before the end
    r = subprocess.run(flags + ["-o", killed, "-y", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr
    assert _train_losses(os.path.join(killed, "main.log")) == _train_losses(os.path.join(straight, "main.log"))
    with open(os.path.join(straight, "model_00000012.bin"), "rb") as a, \
            open(os.path.join(killed, "model_00000012.bin"), "rb") as b:
        assert a.read() == b.read()
