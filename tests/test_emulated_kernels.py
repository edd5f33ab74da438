"""Every kernel of kernels/*.cu executed on the emulated CUDA device (llmc/emulator/), through
gpt2_cuda.py's own launchers, against gpt2_cpu.py.

What it checks: the whole model's activations and gradients (llmc.check's --check tolerances,
against gpt2_cpu in float64) in fp32 and bf16, with naive and flash attention, with and without
GELU recompute (-r 1) and with the LayerNorms' too (-r 2, also bitwise -r 1's training step), at small odd shapes (T = 13, V = 75 padded to 77 or 80, so the classifier's scalar
and vector paths both run); flash attention alone at every head size (16, 32, 64, 128) and odd T;
two training steps (gradient accumulation, the global norm, AdamW) against gpt2_cpu's; the KV-cached
sampling forward (the cast and residual kernels); Llama 3's kernels once (tests/test_llama3_kernels.py
checks them in full); that no `extern "C" __global__` kernel in
kernels/ is left that no test here executes; and, marked slow, `gpt2_cuda.py --device cpu` on
the d2 model: --check in fp32 and bf16 and the training losses of gpt2_cpu.py.

What it is not: a GPU run (see llmc/emulator/__init__.py for what the emulated device cannot
show). cuBLAS is llmc/emulator/cublas.py, NumPy in fp32.

Run: python -m pytest -q tests/test_emulated_kernels.py   (the first run compiles every kernel
file twice, fp32 and bf16, a few minutes on 2 cores, cached in .emulator-cache/; then ~1 minute,
plus ~3 minutes for the slow CLI tests)
"""

import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
from gpt2_cpu import GPT2Config
from llmc import attention, cuda, cuda_check
from llmc.check import check_tensor
from llmc.emulator import build
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from llmc.matmul import CublasLt
from cuda_kernel_checks import check_repeat_kv, check_rmsnorm, check_rope, check_swiglu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# C = 32 with NH = 2: HS = 16, flash attention's smallest tile; V = 75 and Vp = 77 (not a multiple of
# the 16-byte vector: the classifier's scalar path) or 80 (its x128 path)
CONFIGS = {77: GPT2Config(max_seq_len=32, vocab_size=75, padded_vocab_size=77, num_layers=2, num_heads=2, channels=32),
           80: GPT2Config(max_seq_len=32, vocab_size=75, padded_vocab_size=80, num_layers=2, num_heads=2, channels=32)}
FLASH_TOLERANCES = {"fp32": (1e-4, 1e-4), "bf16": (3e-2, 5e-2)}   # llmc.check's kernel_fp32 / cuda_bf16 rows

EXECUTED = set()                       # names of the kernels launched on the emulated device


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    """The emulated device for gpt2_cuda (its models default to full fp32 matmuls), every launch recorded in EXECUTED."""
    monkeypatch.setattr(cuda, "_device", "cpu")
    launch = build.Kernel.launch

    def recording_launch(self, *args):
        EXECUTED.add(self.name)
        return launch(self, *args)
    monkeypatch.setattr(build.Kernel, "launch", recording_launch)


def tiny_model(precision, Vp=77, recompute=True, attention="naive", seed=42, matmul=None):
    cfg = CONFIGS[Vp]
    model = gpt2_cuda.GPT2(cfg, precision, master_weights=True, recompute=recompute, attention=attention,
                           matmul=matmul)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, seed).params)
    return model


def batch(cfg, B, T, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    x[0, :4] = 5                                         # a repeated token: dwte accumulates
    return x, y


# ----------------------------------------------------------------------------
# the whole model, every activation and gradient

def run_model_check(precision, attention, recompute, Vp, B, T, matmul=None):
    model = tiny_model(precision, Vp, recompute, attention, matmul=matmul)
    x, y = batch(model.config, B, T)
    return cuda_check.check_against_cpu(gpt2_cuda, model, x, y, np.float64, verbose=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("attention,recompute,Vp,B,T", [("naive", True, 77, 3, 13), ("naive", False, 80, 2, 16),
                                                        ("flash", True, 80, 3, 13), ("flash", False, 77, 1, 32),
                                                        ("naive", 2, 77, 3, 13), ("flash", 2, 80, 2, 16)])
def test_model_matches_gpt2_cpu(precision, attention, recompute, Vp, B, T):
    assert run_model_check(precision, attention, recompute, Vp, B, T)


# -r 2 recomputes ln1 and ln2 in the backward with layernorm_forward on the kept residual: the
# same layernorm_row the forward ran on the same input, so a training step is bitwise -r 1's
@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "flash")])
def test_recompute_2_step_is_bitwise_recompute_1(precision, attention):
    cfg = CONFIGS[80]
    models = {r: tiny_model(precision, 80, r, attention) for r in (1, 2)}
    for step in (1, 2):                                  # two steps: the second starts from updated parameters
        x, y = batch(cfg, 2, 13, seed=step)
        for model in models.values():
            gpt2_cuda.gpt2_zero_grad(model)
            gpt2_cuda.gpt2_forward(model, x, y)
            gpt2_cuda.gpt2_backward(model)
        one, two = models[1], models[2]
        assert np.array_equal(two.grads.get(), one.grads.get())
        assert gpt2_cuda.gpt2_mean_loss(two) == gpt2_cuda.gpt2_mean_loss(one)
        for model in models.values():
            gpt2_cuda.gpt2_update(model, 1e-3, 0.9, 0.95, 1e-8, 0.1, step)
        assert np.array_equal(two.params.get(), one.params.get())
        assert np.array_equal(two.m.get(), one.m.get()) and np.array_equal(two.v.get(), one.v.get())
    A = gpt2_cuda.gpt2_activations(models[2], 2, 13)
    assert A["ln1"].shape[0] == A["ln2"].shape[0] == 1 and A["ln1_mean"].shape[0] == cfg.num_layers


# the vendor-library paths on their emulations (llmc/emulator/cublaslt.py, cudnn.py): cuBLASLt's
# fused epilogues with our kernels around them, cuDNN's attention (bf16 only, as on a GPU)
@pytest.mark.parametrize("precision,attention,lt", [("fp32", "naive", True), ("bf16", "flash", True),
                                                    ("bf16", "cudnn", False), ("bf16", "cudnn", True)])
def test_vendor_paths_match_gpt2_cpu(precision, attention, lt):
    assert run_model_check(precision, attention, True, 80, 2, 13, matmul=CublasLt() if lt else None)


# ----------------------------------------------------------------------------
# flash attention at every head size

def to_floatX(x, precision):
    return float32_to_bfloat16_bits(x) if precision == "bf16" else x.astype(np.float32)


def from_floatX(x, precision):
    return bfloat16_bits_to_float32(x) if precision == "bf16" else x


def run_flash(precision, HS, B, T, NH, seed=0):
    """flash_attention_forward / _backward on the emulated device and gpt2_cpu's attention on the
    same (floatX-rounded) inputs: returns ((out, ref_out), (dqkv, ref_dqkv))."""
    cp, X = cuda.cupy(), cuda.FLOATX_DTYPES[precision]
    C = NH * HS
    rng = np.random.default_rng(seed)
    qkv_host = from_floatX(to_floatX(rng.standard_normal((B, T, 3 * C)).astype(np.float32), precision), precision)
    dout_host = from_floatX(to_floatX(rng.standard_normal((B, T, C)).astype(np.float32), precision), precision)
    qkv, dout = cp.asarray(to_floatX(qkv_host, precision)), cp.asarray(to_floatX(dout_host, precision))
    out, lse = cp.empty((B, T, C), X), cp.empty((B, NH, T), np.float32)
    dqkv, D = cp.empty((B, T, 3 * C), X), cp.empty((B, NH, T), np.float32)
    attention.flash_attention_forward(out, lse, qkv, B, T, C, NH)
    attention.flash_attention_backward(dqkv, D, dout, out, qkv, lse, B, T, C, NH)
    ref_out, att = gpt2_cpu.attention_forward(qkv_host.astype(np.float64), NH)
    ref_dqkv = gpt2_cpu.attention_backward(dout_host.astype(np.float64), qkv_host.astype(np.float64), att, NH)
    return (from_floatX(out.get(), precision), ref_out), (from_floatX(dqkv.get(), precision), ref_dqkv)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("HS,B,T,NH", [(16, 2, 37, 2), (32, 1, 70, 2), (64, 1, 33, 1), (128, 1, 19, 1)])
def test_flash_attention_every_head_size(precision, HS, B, T, NH):
    (out, ref_out), (dqkv, ref_dqkv) = run_flash(precision, HS, B, T, NH)
    atol, rtol = FLASH_TOLERANCES[precision]
    assert check_tensor(out, ref_out, f"flash out HS={HS}", atol, rtol)
    assert check_tensor(dqkv, ref_dqkv, f"flash dqkv HS={HS}", atol * 10, rtol * 10)


# ----------------------------------------------------------------------------
# training: gradient accumulation, global norm, AdamW

def run_training(precision="fp32"):
    """Two steps of two accumulated micro-batches on both models; asserts as it goes."""
    cfg = CONFIGS[80]
    rng = np.random.default_rng(3)
    B, T = 2, 9
    batches = [tuple(rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(2)]
    model = tiny_model(precision, 80)
    cpu = gpt2_cpu.gpt2_init(cfg, 42)
    for step in range(1, 3):
        gpt2_cuda.gpt2_zero_grad(model)
        gpt2_cpu.gpt2_zero_grad(cpu)
        for x, y in batches:
            gpt2_cuda.gpt2_forward(model, x, y)
            gpt2_cuda.gpt2_backward(model, loss_scale=0.5)
            gpt2_cpu.gpt2_forward(cpu, x, y)
            gpt2_cpu.gpt2_backward(cpu, loss_scale=0.5)
        assert check_tensor(model.grads.get(), cpu.grads, "grads", 1e-6, 1e-4)
        # AdamW from the same gradients: where |g| is near eps (1e-8) the update g / (|g| + eps)
        # turns the gradients' fp32 differences into differences of ~lr, which is not the kernel's
        cpu.grads[...] = model.grads.get()
        assert gpt2_cuda.gpt2_grad_norm(model) == pytest.approx(gpt2_cpu.gpt2_grad_norm(cpu), rel=1e-5)
        gpt2_cuda.gpt2_update(model, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, grad_scale=0.5)
        gpt2_cpu.gpt2_update(cpu, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, grad_scale=0.5)
        assert check_tensor(model.params.get(), cpu.params, "params", 1e-6, 1e-5)
        assert check_tensor(model.m.get(), cpu.m, "m", 1e-7, 1e-4)


def test_training_steps_match_gpt2_cpu():
    run_training()


# ----------------------------------------------------------------------------
# CUDA graphs: captured once, replayed with new inputs, bitwise the eager results

def test_cuda_graph_replay_equals_eager():
    cfg, cp = CONFIGS[80], cuda.cupy()
    eager, graphed = tiny_model("fp32", 80), tiny_model("fp32", 80)
    stream = cp.cuda.Stream().use()                      # a created stream: the legacy one cannot capture
    try:
        for seed in (1, 2, 3):                           # capture on the first, replay on the next two
            x, y = batch(cfg, 2, 9, seed)
            for model, graph in ((eager, False), (graphed, True)):
                gpt2_cuda.gpt2_zero_grad(model)
                gpt2_cuda.gpt2_activations(model, 2, 9)["loss_accum"].fill(0)
                gpt2_cuda.gpt2_micro_batch(model, x, y, 0.5, cuda_graph=graph)
            assert len(graphed.graphs) == 1
            assert np.array_equal(graphed.grads.get(), eager.grads.get())
            assert np.array_equal(gpt2_cuda.gpt2_activations(graphed, 2, 9)["loss_accum"].get(),
                                  gpt2_cuda.gpt2_activations(eager, 2, 9)["loss_accum"].get())
            assert not np.isnan(eager.grads.get()).any()
    finally:
        cp.cuda.Stream.null.use()


# ----------------------------------------------------------------------------
# the sampling forward (KV cache: the cast kernels, residual_forward)

def run_sampling(precision="fp32"):
    model, cfg = tiny_model(precision, 80), CONFIGS[80]
    x, _ = batch(cfg, 1, 11)
    cpu = gpt2_cpu.gpt2_init(cfg, 42)
    ref = gpt2_cpu.gpt2_forward(cpu, x)[:, -1]                               # (1,Vp)
    cache = gpt2_cuda.kv_cache_new(cfg, 1)
    gpt2_cuda.gpt2_forward_cached(model, x[:, :6], cache)
    logits = gpt2_cuda.gpt2_forward_cached(model, x[:, 6:], cache)          # positions 6..10 against the cache
    return check_tensor(logits[:, :cfg.vocab_size], ref[:, :cfg.vocab_size], "cached logits", 1e-4, 1e-3)


def test_cached_sampling_forward_matches_gpt2_cpu():
    assert run_sampling()


# ----------------------------------------------------------------------------
# no kernel left that no test executes

def all_kernels():
    names = set()
    for path in glob.glob(os.path.join(cuda.KERNELS_DIR, "*.cu")):
        with open(path) as f:
            names.update(build.kernel_names(f.read()))
    return names


def test_every_kernel_in_kernels_is_executed():
    # the cheapest run of each workload above, so that this test stands alone
    assert run_model_check("fp32", "naive", True, 77, 1, 5)
    assert run_model_check("bf16", "flash", True, 80, 1, 5)
    assert run_model_check("fp32", "naive", True, 80, 1, 5, matmul=CublasLt())    # its dbias accumulation
    for HS in (16, 32, 64, 128):
        run_flash("fp32", HS, 1, 3, 1)
    run_training()
    assert run_sampling()
    rng = np.random.default_rng(0)                    # Llama 3's kernels (tests/test_llama3_kernels.py)
    check_rmsnorm(rng, "fp32", 1, 3, 32)
    check_rope(rng, "fp32", 1, 3, 2, 1, 16)
    check_repeat_kv(rng, "fp32", 1, 3, 2, 1, 16)
    check_swiglu(rng, "fp32", 37)
    missing = all_kernels() - EXECUTED
    assert not missing, f"kernels that no test executes: {sorted(missing)}"
    assert len(all_kernels()) >= 47


# ----------------------------------------------------------------------------
# the command line on the d2 model (slow: ~1 minute each on 2 cores)

def run_cli(script, *args, timeout=900):
    result = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "flash")])
def test_cli_check_d2(precision, attention):
    rc, out = run_cli("gpt2_cuda.py", "--device", "cpu", "-e", "d2", "-b", "2", "-t", "32", "--check",
                      "--precision", precision, "--attention", attention)
    assert "kernels run on the emulated device" in out
    assert rc == 0 and "check: all tensors OK" in out, out[-3000:]


LOSS_LINE = re.compile(r"step\s+(\d+)/\d+ \| loss ([0-9.]+)")


@pytest.mark.slow
def test_cli_training_losses_equal_gpt2_cpu():
    args = ("-e", "d2", "-b", "2", "-t", "32", "-x", "3", "-v", "0", "-s", "0")
    rc_gpu, out_gpu = run_cli("gpt2_cuda.py", "--device", "cpu", *args)
    rc_cpu, out_cpu = run_cli("gpt2_cpu.py", *args)
    assert rc_gpu == 0 and rc_cpu == 0, out_gpu[-2000:] + out_cpu[-2000:]
    gpu, cpu = LOSS_LINE.findall(out_gpu), LOSS_LINE.findall(out_cpu)
    assert len(gpu) == len(cpu) == 3
    for (step, a), (_, b) in zip(gpu, cpu):
        assert float(a) == pytest.approx(float(b), rel=2e-6), f"step {step}: {a} vs gpt2_cpu's {b}"
