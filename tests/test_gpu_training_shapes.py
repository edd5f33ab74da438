"""GPU tests of gpt2_cuda.py at the shapes training uses (all marked gpu: skipped without a CUDA
GPU and CuPy). tests/test_cuda.py part 2 checks every kernel at small, odd shapes; this file checks
what only large shapes exercise:
- every kernel at (B,T) = (2,1024) with GPT-2 124M's C = 768, NH = 12 (HS = 64) and Vp = 50304:
  the encoder (with a token that is 4% of the batch, so the dwte scatter-add has chunks), LayerNorm
  and the fused residual, GELU, the four matmuls with their bias (forward and backward), naive and
  flash attention, the fused classifier, AdamW over wte's 38.6M values, the gradient norm, casts;
- LayerNorm backward and the bias gradient at N = 4096 rows (8 rows per LayerNorm slot, 16 per
  bias chunk);
- grid-stride loops running several passes: the same checks with every grid-stride kernel
  launched with 3 blocks (tests/cuda_kernel_checks.few_blocks), hundreds of passes per thread;
- the logits GEMM, the classifier GEMM's backward and the fused classifier with N*Vp above 2^31
  (N = 43008 rows: 64-bit offsets), checked on rows on both sides of element 2^31;
- determinism: the same 124M training step (B=2, T=1024) twice, on the naive and flash paths:
  losses, gradients, parameters and AdamW moments bitwise equal;
- one 124M step at B=8, T=1024 in bf16 against the same step in fp32 (TF32 off): the loss, the
  gradient norm and every gradient tensor.
Tolerances: llmc.check.TOLERANCES (kernel_* for the kernels, cuda_bf16 for bf16 against fp32).
Every array comes from llmc.cuda.cupy(), so the small checks could run on the emulated device.
Run: pytest -m gpu tests/test_gpu_training_shapes.py   (needs a GPU with ~40 GB; the float64
references on the host take most of the time)
"""

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc.matmul
import llmc.comm
import llmc.cuda
from cuda_kernel_checks import (as_input, assert_kernel, check_adamw_norm_cast, check_attention, check_classifier,
                                check_encoder, check_flash_attention, check_gelu, check_layernorm,
                                check_matmul_and_bias, few_blocks, poisoned, poisoned_f32, to_device, to_host)
from llmc.check import TOLERANCES, check_against, check_tensor

pytestmark = pytest.mark.gpu

CONFIG_124M = gpt2_cpu.config_from_descriptor("d12")
B, T = 2, 1024                                          # the (B,T) of the kernel checks
C, NH = CONFIG_124M.channels, CONFIG_124M.num_heads     # 768, 12
HS = C // NH                                            # 64
V, Vp = CONFIG_124M.vocab_size, CONFIG_124M.padded_vocab_size
FREQUENT_TOKEN_SHARE = 0.04                             # "," or "the": a few % of real text
LINEAR_SHAPES = {"qkv": (C, 3 * C), "attproj": (C, C), "fc": (C, 4 * C), "fcproj": (4 * C, C)}
LARGE_ROWS = 4096                                       # N for LayerNorm backward and the bias gradient
FEW_BLOCKS = 3                                          # grid of the grid-stride checks
INT32_LIMIT = 2 ** 31
PRECISIONS = pytest.mark.parametrize("precision", ["fp32", "bf16"])


@pytest.fixture
def rng():
    return np.random.default_rng(1024)


# ----------------------------------------------------------------------------
# every kernel at (B,T) = (2,1024), C = 768, NH = 12; and with few blocks (grid-stride passes)

def run_every_kernel_check(rng, precision):
    """Every check of tests/cuda_kernel_checks.py at the 124M training shapes."""
    seg = check_encoder(rng, precision, B, T, C, Vp, frequent=FREQUENT_TOKEN_SHARE)
    assert seg.reduce_token.size >= 1                   # the frequent token took several chunks
    check_layernorm(rng, precision, B, T, C)
    check_gelu(rng, precision, B * T * 4 * C, 4 * C)
    for C_in, OC in LINEAR_SHAPES.values():
        check_matmul_and_bias(rng, precision, B, T, C_in, OC)
    check_attention(rng, precision, B, T, NH, HS)
    check_flash_attention(rng, precision, B, T, NH, HS)
    check_classifier(rng, precision, B, T, V, Vp)
    check_adamw_norm_cast(rng, precision, Vp * C)       # wte, the largest tensor AdamW updates


@PRECISIONS
def test_every_kernel_at_the_124M_training_shape(rng, precision):
    run_every_kernel_check(rng, precision)


@PRECISIONS
def test_grid_stride_loops_running_several_passes(rng, monkeypatch, precision):
    launched = few_blocks(monkeypatch, FEW_BLOCKS)
    run_every_kernel_check(rng, precision)
    passes = {name: asked[0] / grid[0] for name, grid, asked in launched if grid != asked}
    # the kernels whose loops cover every item only in several passes were really so launched
    for name in ("encoder_forward", "encoder_backward_wte", "layernorm_forward", "fused_residual_forward",
                 "gelu_forward", "add_bias", "permute_qkv", "softmax_forward", "softmax_backward",
                 "fused_classifier", "adamw_update", "cast_floatX_to_float"):
        assert passes.get(name, 0) > 10, (name, passes.get(name))


@PRECISIONS
def test_layernorm_backward_and_bias_gradient_at_4096_rows(rng, precision):
    rows_B = LARGE_ROWS // T                            # (4, 1024)
    assert gpt2_cuda.layernorm_backward_grid(LARGE_ROWS) * 8 == LARGE_ROWS       # 8 rows per scratch slot
    assert llmc.matmul.bias_backward_chunks(LARGE_ROWS) * 16 == LARGE_ROWS         # 16 rows per bias chunk
    check_layernorm(rng, precision, rows_B, T, C)
    check_matmul_and_bias(rng, precision, rows_B, T, C, 4 * C)
    check_matmul_and_bias(rng, precision, rows_B, T, 4 * C, C)


# ----------------------------------------------------------------------------
# the classifier past 2^31 elements

def test_logits_gemm_and_classifier_past_int32_offsets(rng):
    precision, B_big = "bf16", 42
    N = B_big * T                                       # 43008 rows
    assert N * Vp > INT32_LIMIT
    cp = llmc.cuda.cupy()
    lnf = rng.standard_normal((B_big, T, C)).astype(np.float32)
    wte = (rng.standard_normal((Vp, C)) / np.sqrt(C)).astype(np.float32)     # logits ~ N(0,1)
    targets = rng.integers(0, V, (B_big, T)).astype(np.int32)
    lnf_d, wte_d = to_device(lnf, precision), to_device(wte, precision)
    logits = poisoned((B_big, T, Vp), precision)                             # 4.3 GB
    llmc.matmul.matmul_forward(logits, lnf_d, wte_d, None, B_big, T, C, Vp)
    # rows on both sides of element 2^31 (row r0 holds it), and the first and last rows
    r0 = INT32_LIMIT // Vp
    rows = np.array([0, 1, r0 - 1, r0, r0 + 1, N - 1])
    flat_logits = logits.reshape(N, Vp)
    x, w = as_input(lnf.reshape(N, C)[rows], precision), as_input(wte, precision)
    ref_logits = x @ w.T                                                     # (6, Vp)
    assert_kernel("matmul", precision, flat_logits[rows], ref_logits, "logits rows around element 2^31")
    z = to_host(flat_logits[rows]).astype(np.float64)[None]                  # (1, 6, Vp): what the classifier reads
    losses = poisoned_f32((B_big, T))
    dloss = 1.0 / N
    gpt2_cuda.fused_classifier(logits, losses, cp.asarray(targets), dloss, B_big, T, V, Vp, write_dlogits=True)
    probs = gpt2_cpu.softmax_forward(z, V)
    t_rows = targets.reshape(N)[rows][None]                                  # (1, 6)
    assert_kernel("classifier", "fp32", losses.reshape(N)[rows].get(), gpt2_cpu.crossentropy_forward(probs, t_rows)[0],
                  "losses around element 2^31")
    assert bool(cp.isfinite(losses).all())                                   # every row was written
    ref_dlogits = gpt2_cpu.crossentropy_softmax_backward(np.full((1, rows.size), dloss), probs, t_rows)[0]
    atol, rtol = TOLERANCES[f"kernel_{precision}"]["classifier"]
    dlogits_rows = to_host(flat_logits[rows])
    assert check_tensor(dlogits_rows, ref_dlogits, "dlogits around element 2^31", atol * dloss, rtol)
    # the classifier's backward GEMM: dlnf = dlogits @ wte, row by row (its rows past 2^31 too)
    dlnf = poisoned((B_big, T, C), precision)
    dwte = to_device(np.zeros((Vp, C), np.float32), precision)
    scratch = poisoned_f32(gpt2_cuda.partial_floats(CONFIG_124M))
    llmc.matmul.matmul_backward(dlnf, dwte, None, logits, lnf_d, wte_d, scratch, B_big, T, C, Vp)
    ref_dlnf = dlogits_rows.astype(np.float64) @ w
    atol, rtol = TOLERANCES[f"kernel_{precision}"]["matmul"]
    assert check_tensor(to_host(dlnf.reshape(N, C)[rows]), ref_dlnf, "dlnf rows around element 2^31",
                        atol * dloss, rtol)
    assert bool(cp.isfinite(cp.asarray(to_host(dwte))).all())


# ----------------------------------------------------------------------------
# whole training steps of the 124M model

def one_step(precision, attention, x, y, master_weights=True):
    """A fresh 124M model (gpt2_init's seed 42) after one training step on (x, y): micro-batch
    (forward, backward), gradient norm, AdamW. Returns (model, mean loss, norm)."""
    model = gpt2_cuda.GPT2(CONFIG_124M, precision, master_weights=master_weights, recompute=True, attention=attention)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(CONFIG_124M, 42).params)
    llmc.cuda.load_modules(gpt2_cuda.kernel_files(model), precision)
    Bx, Tx = x.shape
    gpt2_cuda.gpt2_zero_grad(model)
    gpt2_cuda.gpt2_activations(model, Bx, Tx)["loss_accum"].fill(0)
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0)
    loss = gpt2_cuda.gpt2_mean_loss(model)
    norm = gpt2_cuda.gpt2_global_grad_norm(model, llmc.comm.Comm())
    gpt2_cuda.gpt2_update(model, 3e-4, 0.9, 0.95, 1e-8, 0.1, 1, 1.0 / norm if norm > 1.0 else 1.0)
    return model, loss, norm


def batch(rng, Bx, Tx):
    x, y = (rng.integers(0, V, (Bx, Tx)).astype(np.int32) for _ in range(2))
    x[rng.random((Bx, Tx)) < FREQUENT_TOKEN_SHARE] = 11                    # a frequent token: chunked dwte
    return x, y


@pytest.mark.parametrize("attention", ["naive", "flash"])
def test_the_same_step_twice_is_bitwise_equal(rng, attention):
    x, y = batch(rng, B, T)
    first, loss1, norm1 = one_step("bf16", attention, x, y)
    state1 = {name: getattr(first, name).get() for name in ("grads", "params", "master", "m", "v")}
    losses1 = gpt2_cuda.gpt2_activations(first, B, T)["losses"].get()
    del first
    second, loss2, norm2 = one_step("bf16", attention, x, y)
    assert loss1 == loss2 and norm1 == norm2 and np.isfinite(loss1)
    np.testing.assert_array_equal(gpt2_cuda.gpt2_activations(second, B, T)["losses"].get(), losses1)
    for name, value in state1.items():
        np.testing.assert_array_equal(getattr(second, name).get(), value, err_msg=name)


def test_one_124M_step_bf16_against_fp32(rng):
    x, y = batch(rng, 8, 1024)
    fp32, loss32, norm32 = one_step("fp32", "naive", x, y)
    grads32 = gpt2_cpu.tensor_views(gpt2_cuda.as_float32(fp32.grads.get()), fp32.param_shapes)
    del fp32
    bf16, loss16, norm16 = one_step("bf16", "naive", x, y)
    grads16 = gpt2_cpu.tensor_views(gpt2_cuda.as_float32(bf16.grads.get()), bf16.param_shapes)
    ok = check_against(np.array([loss16]), np.array([loss32]), "mean loss", "cuda_bf16", "loss")
    ok &= check_against(np.array([norm16]), np.array([norm32]), "gradient norm", "cuda_bf16", "loss")
    for name, _ in bf16.param_shapes:
        ok &= check_against(grads16[name], grads32[name], f"d{name}", "cuda_bf16", "grad")
    assert ok
