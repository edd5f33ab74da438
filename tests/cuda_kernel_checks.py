"""Checks of gpt2_cuda.py's kernels against gpt2_cpu.py's NumPy layers, shared by the GPU tests
(tests/test_cuda.py part 2 at small shapes, tests/test_gpu_training_shapes.py at the shapes
training uses). Not a test module: test modules must not import each other, so what both need
lives here.

Each check_* function draws its inputs from the generator it is given (~N(0,1), so that the
absolute tolerances of llmc.check.TOLERANCES['kernel_fp32' / 'kernel_bf16'] mean the same at
every shape), runs the launchers on outputs poisoned with NaN (any element a kernel fails to
write stays NaN and fails), and asserts every output against the reference computed in float64
from the inputs as the kernel sees them (rounded to floatX). Device arrays come from
llmc.cuda.cupy(): CuPy on a GPU, or the emulated device where a test chooses it.
Run: through the tests that import it (pytest -m gpu tests/test_cuda.py tests/test_gpu_training_shapes.py).
"""

import math
import types

import numpy as np

import gpt2_cpu
import gpt2_cuda
import llmc.matmul
import llmc.attention
import llmc.cuda
from llmc import cuda_check
from gpt2_cpu import GPT2Config
from llmc.check import TOLERANCES, check_tensor
from llmc.formats import BF16_QUIET_NAN, bfloat16_bits_to_float32, float32_to_bfloat16_bits


# ----------------------------------------------------------------------------
# moving arrays, poisoning outputs, comparing

def to_device(x, precision):
    """fp32 host array -> floatX device array (bf16: rounded to nearest even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return llmc.cuda.cupy().asarray(float32_to_bfloat16_bits(x) if precision == "bf16" else x)


def as_input(x, precision):
    """What the kernel will actually see: x rounded to floatX, back in float64 for the reference."""
    x = np.asarray(x, dtype=np.float32)
    return (bfloat16_bits_to_float32(float32_to_bfloat16_bits(x)) if precision == "bf16" else x).astype(np.float64)


def poisoned(shape, precision):
    """A floatX device array full of NaN: any element a kernel fails to write stays NaN."""
    cp = llmc.cuda.cupy()
    if precision == "bf16":
        return cp.full(shape, BF16_QUIET_NAN, dtype=np.uint16)
    return cp.full(shape, np.nan, dtype=np.float32)


def poisoned_f32(shape):
    """A float32 device array full of NaN."""
    return llmc.cuda.cupy().full(shape, np.nan, dtype=np.float32)


def to_host(x):
    """A floatX device array as float32 on the host."""
    return gpt2_cuda.as_float32(x.get())


def assert_kernel(name, precision, got, ref, label):
    """got (a device array, or already on the host) against ref with TOLERANCES['kernel_<precision>'][name]."""
    atol, rtol = TOLERANCES[f"kernel_{precision}"][name]
    got = to_host(got) if hasattr(got, "get") else got
    assert check_tensor(got, ref, f"{label} [{precision}]", atol, rtol), label


# ----------------------------------------------------------------------------
# grid-stride loops: the same kernels launched with fewer blocks than items, so every thread
# makes several passes (the launchers size grids for one pass)

GRID_STRIDE_KERNELS = {   # kernels whose headers say any grid (x) is correct
    "encoder_forward", "encoder_backward_wpe", "encoder_backward_wte", "encoder_backward_wte_reduce",
    "layernorm_forward", "fused_residual_forward", "layernorm_param_reduce", "residual_forward",
    "gelu_forward", "gelu_backward_inplace", "add_bias", "bias_backward", "bias_reduce",
    "permute_qkv", "permute_qkv_backward", "unpermute", "unpermute_backward", "softmax_forward",
    "softmax_backward", "fused_classifier", "adamw_update", "cast_float_to_floatX", "cast_floatX_to_float",
    "flash_attention_backward_preprocess",
    "rmsnorm_forward", "rmsnorm_param_reduce", "rope_forward", "rope_backward", "swiglu_forward", "swiglu_backward",
    "repeat_kv_forward", "repeat_kv_backward",
}


def few_blocks(monkeypatch, blocks):
    """Make every grid-stride kernel launch with at most `blocks` blocks along x (the others, whose
    grid is their partition of the work, unchanged). Returns the list of (name, launched grid, grid
    the launcher asked for) it fills."""
    launched = []
    launch = llmc.cuda.launch

    def capped(file, precision, name, grid, block, args, shared_mem=0):
        asked = grid = grid if isinstance(grid, tuple) else (grid,)     # a launcher may pass an int
        if name in GRID_STRIDE_KERNELS:
            grid = (min(asked[0], blocks),) + asked[1:]
        launched.append((name, grid, asked))
        launch(file, precision, name, grid, block, args, shared_mem=shared_mem)
    monkeypatch.setattr(llmc.cuda, "launch", capped)
    return launched


# ----------------------------------------------------------------------------
# one check per kernel file, at any shape

def check_encoder(rng, precision, B, T, C, Vp, frequent=0.0):
    """encoder_forward and encoder_backward (dwte, dwpe accumulate). frequent: the share of the
    positions given token 1 (a common token: several chunks of the dwte scatter-add)."""
    cp = llmc.cuda.cupy()
    maxT = T + 5
    inp = rng.integers(0, Vp, (B, T)).astype(np.int32)
    inp[rng.random((B, T)) < frequent] = 1
    inp[0, :3] = inp[-1, -1] = 1                                         # repeated ids accumulate
    wte, wpe = rng.standard_normal((Vp, C)), rng.standard_normal((maxT, C))
    out = poisoned((B, T, C), precision)
    gpt2_cuda.encoder_forward(out, cp.asarray(inp), to_device(wte, precision), to_device(wpe, precision), B, T, C)
    ref = gpt2_cpu.encoder_forward(inp, as_input(wte, precision), as_input(wpe, precision))
    assert_kernel("encoder_forward", precision, out, ref, "encoded")
    dout = rng.standard_normal((B, T, C))
    dwte0, dwpe0 = rng.standard_normal((Vp, C)), rng.standard_normal((maxT, C))
    dwte, dwpe = to_device(dwte0, precision), to_device(dwpe0, precision)
    seg = gpt2_cuda.encoder_backward_segments(inp)
    partial = poisoned_f32(gpt2_cuda.wte_partial_rows(B * T) * C)
    gpt2_cuda.encoder_backward(dwte, dwpe, partial, to_device(dout, precision), *(cp.asarray(a) for a in seg),
                               seg.chunk_token.size, seg.reduce_token.size, B, T, C)
    ref_wte, ref_wpe = as_input(dwte0, precision), as_input(dwpe0, precision)
    gpt2_cpu.encoder_backward(ref_wte, ref_wpe, as_input(dout, precision), inp)
    assert_kernel("encoder_backward", precision, dwte, ref_wte, "dwte (accumulated)")
    assert_kernel("encoder_backward", precision, dwpe, ref_wpe, "dwpe (accumulated)")
    return seg


def residual_forward(out, inp1, inp2, n):
    """kernels/layernorm.cu's residual_forward, out = inp1 + inp2 over n values, launched as
    llmc/cublaslt.py launches it (dbias += bgrad); the model uses fused_residual_forward."""
    precision = llmc.cuda.check_launch("residual_forward", [("out", out, n), ("inp1", inp1, n), ("inp2", inp2, n)],
                                       aligned=True)
    grid = llmc.cuda.elementwise_grid(llmc.cuda.ceil_div(n, llmc.cuda.vector_size(precision)))
    llmc.cuda.launch("layernorm", precision, "residual_forward", grid, llmc.cuda.BLOCK_SIZE, (out, inp1, inp2, np.uint64(n)))


def check_layernorm(rng, precision, B, T, C):
    """layernorm_forward, fused_residual_forward, residual_forward, layernorm_backward (dinp,
    dweight, dbias accumulate)."""
    N = B * T
    inp = rng.standard_normal((B, T, C)) * 2 + 0.5
    w, b = rng.standard_normal(C), rng.standard_normal(C)
    x, wx, bx = as_input(inp, precision), as_input(w, precision), as_input(b, precision)
    out, mean, rstd = poisoned((B, T, C), precision), poisoned_f32((B, T)), poisoned_f32((B, T))
    gpt2_cuda.layernorm_forward(out, mean, rstd, to_device(inp, precision), to_device(w, precision),
                                to_device(b, precision), B, T, C)
    ref, ref_mean, ref_rstd = gpt2_cpu.layernorm_forward(x, wx, bx)
    assert_kernel("layernorm_forward", precision, out, ref, "ln out")
    assert_kernel("layernorm_forward", "fp32", mean.get(), ref_mean, "ln mean")   # fp32 statistics of floatX inputs
    assert_kernel("layernorm_forward", "fp32", rstd.get(), ref_rstd, "ln rstd")
    # fused residual + layernorm, without and with the projection bias of inp2
    inp2, proj_bias = rng.standard_normal((B, T, C)), rng.standard_normal(C)
    for bias_of_inp2 in (None, proj_bias):
        residual, normed = poisoned((B, T, C), precision), poisoned((B, T, C), precision)
        gpt2_cuda.fused_residual_forward(residual, normed, mean, rstd, to_device(inp, precision), to_device(inp2, precision),
                                         None if bias_of_inp2 is None else to_device(bias_of_inp2, precision),
                                         to_device(w, precision), to_device(b, precision), N, C)
        shift = 0.0 if bias_of_inp2 is None else as_input(bias_of_inp2, precision)
        ref_res = as_input(x + (as_input(inp2, precision) + shift), precision)        # rounded to floatX first
        label = "fused residual" + ("" if bias_of_inp2 is None else " + projection bias")
        assert_kernel("residual_forward", precision, residual, ref_res, label)
        assert_kernel("layernorm_forward", precision, normed, gpt2_cpu.layernorm_forward(ref_res, wx, bx)[0], f"{label}: normed")
    plain = poisoned((B, T, C), precision)
    residual_forward(plain, to_device(inp, precision), to_device(inp2, precision), N * C)
    assert_kernel("residual_forward", precision, plain, x + as_input(inp2, precision), "residual")
    # backward: dinp, dweight, dbias all accumulate
    gpt2_cuda.layernorm_forward(out, mean, rstd, to_device(inp, precision), to_device(w, precision),
                                to_device(b, precision), B, T, C)
    dout = rng.standard_normal((B, T, C))
    dinp0, dw0, db0 = rng.standard_normal((B, T, C)), rng.standard_normal(C), rng.standard_normal(C)
    dinp, dw, db = to_device(dinp0, precision), to_device(dw0, precision), to_device(db0, precision)
    scratch = poisoned_f32(gpt2_cuda.partial_floats(GPT2Config(channels=C)))
    gpt2_cuda.layernorm_backward(dinp, dw, db, scratch, to_device(dout, precision), to_device(inp, precision),
                                 to_device(w, precision), mean, rstd, B, T, C)
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = as_input(dinp0, precision) + gpt2_cpu.layernorm_backward(ref_dw, ref_db, as_input(dout, precision), x, wx,
                                                                        ref_mean, ref_rstd)
    assert_kernel("layernorm_backward", precision, dinp, ref_dinp, "ln dinp (accumulated)")
    assert_kernel("layernorm_backward", precision, dw, ref_dw, "ln dweight (accumulated)")
    assert_kernel("layernorm_backward", precision, db, ref_db, "ln dbias (accumulated)")
    # with dprojb (--ln-bias-grad): the same three, and dprojb += the column sums of dinp as it leaves
    dprojb0 = rng.standard_normal(C)
    dinp, dw, db = to_device(dinp0, precision), to_device(dw0, precision), to_device(db0, precision)
    dprojb = to_device(dprojb0, precision)
    gpt2_cuda.layernorm_backward(dinp, dw, db, poisoned_f32(gpt2_cuda.partial_floats(GPT2Config(channels=C))),
                                 to_device(dout, precision), to_device(inp, precision), to_device(w, precision), mean,
                                 rstd, B, T, C, dprojb=dprojb)
    assert_kernel("layernorm_backward", precision, dinp, ref_dinp, "ln dinp with dprojb")
    assert_kernel("layernorm_backward", precision, dw, ref_dw, "ln dweight with dprojb")
    assert_kernel("layernorm_backward", precision, db, ref_db, "ln dbias with dprojb")
    ref_dprojb = as_input(dprojb0, precision) + as_input(ref_dinp, precision).reshape(-1, C).sum(axis=0)   # as stored
    assert_kernel("layernorm_backward", precision, dprojb, ref_dprojb, "ln dprojb: dinp's column sums (accumulated)")


def check_gelu(rng, precision, n, OC=None):
    """gelu_forward and gelu_backward_inplace over n values; with OC (dividing n), gelu_forward
    also adds a bias of OC values into its input first, as the MLP's first layer does."""
    x = rng.standard_normal(n) * 3
    out = poisoned(n, precision)
    llmc.matmul.gelu_forward(out, to_device(x, precision), n)
    assert_kernel("gelu", precision, out, gpt2_cpu.gelu_forward(as_input(x, precision)), "gelu")
    if OC is not None:
        bias = rng.standard_normal(OC)
        pre, out = to_device(x, precision), poisoned(n, precision)
        llmc.matmul.gelu_forward(out, pre, n, to_device(bias, precision), OC)
        ref_pre = as_input((as_input(x, precision).reshape(-1, OC) + as_input(bias, precision)).ravel(), precision)
        assert_kernel("gelu", precision, pre, ref_pre, "inp + bias, stored")
        assert_kernel("gelu", precision, out, gpt2_cpu.gelu_forward(ref_pre), "gelu(inp + bias)")
    d = rng.standard_normal(n)
    dd = to_device(d, precision)
    llmc.matmul.gelu_backward_inplace(dd, to_device(x, precision), n)
    assert_kernel("gelu", precision, dd, gpt2_cpu.gelu_backward(as_input(d, precision), as_input(x, precision)), "dgelu")


def check_matmul_and_bias(rng, precision, B, T, C, OC):
    """matmul_forward (GEMM + add_bias) and matmul_backward (dinp written; dweight and bias_backward's
    dbias accumulated). Without TF32 (the launchers' default)."""
    inp, w, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)) / math.sqrt(C), rng.standard_normal(OC)
    x, wx, bx = as_input(inp, precision), as_input(w, precision), as_input(bias, precision)
    out = poisoned((B, T, OC), precision)
    llmc.matmul.matmul_forward(out, to_device(inp, precision), to_device(w, precision), to_device(bias, precision), B, T, C, OC)
    assert_kernel("matmul", precision, out, gpt2_cpu.matmul_forward(x, wx, bx), "matmul out")
    dout = rng.standard_normal((B, T, OC))
    dw0, db0 = rng.standard_normal((OC, C)), rng.standard_normal(OC)
    dinp, dw, db = poisoned((B, T, C), precision), to_device(dw0, precision), to_device(db0, precision)
    scratch = poisoned_f32(gpt2_cuda.partial_floats(GPT2Config(channels=max(C, OC))))
    llmc.matmul.matmul_backward(dinp, dw, db, to_device(dout, precision), to_device(inp, precision), to_device(w, precision),
                              scratch, B, T, C, OC)
    ref_dw, ref_db = as_input(dw0, precision), as_input(db0, precision)
    ref_dinp = gpt2_cpu.matmul_backward(ref_dw, ref_db, as_input(dout, precision), x, wx)
    assert_kernel("matmul", precision, dinp, ref_dinp, "matmul dinp")
    assert_kernel("matmul", precision, dw, ref_dw, "matmul dweight (accumulated)")
    assert_kernel("matmul", precision, db, ref_db, "bias_backward dbias (accumulated)")


def check_attention(rng, precision, B, T, NH, HS):
    """The naive attention path (permutes, cuBLAS, softmax kernels), forward and backward."""
    C = NH * HS
    qkv = rng.standard_normal((B, T, 3 * C))
    out, qkvr, att = poisoned((B, T, C), precision), poisoned((3, B, NH, T, HS), precision), poisoned((B, NH, T, T), precision)
    scratch = poisoned(B * T * max(3 * C, NH * T), precision)
    scratch[:B * T * 3 * C] = to_device(qkv, precision).ravel()
    llmc.attention.attention_forward(out, qkvr, att, scratch, B, T, C, NH)
    ref_out, ref_att = gpt2_cpu.attention_forward(as_input(qkv, precision), NH)
    ref_qkvr = as_input(qkv, precision).reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)
    assert_kernel("attention", precision, qkvr, ref_qkvr, "permute_qkv")
    assert_kernel("attention", precision, att, ref_att, "att (softmax, 0 above the diagonal)")
    assert_kernel("attention", precision, out, ref_out, "attention out")
    dout = rng.standard_normal((B, T, C))
    dinp = poisoned((B, T, 3 * C), precision)
    dqkvr, dy, datt = poisoned((3, B, NH, T, HS), precision), poisoned((B, NH, T, HS), precision), poisoned(B * NH * T * T, precision)
    llmc.attention.attention_backward(dinp, dqkvr, datt, dy, to_device(dout, precision), qkvr, att, B, T, C, NH)
    ref_dinp = gpt2_cpu.attention_backward(as_input(dout, precision), as_input(qkv, precision), to_host(att).astype(np.float64), NH)
    assert_kernel("attention", precision, dinp, ref_dinp, "attention dqkv")
    assert np.isfinite(to_host(dinp)).all()


def check_flash_attention(rng, precision, B, T, NH, HS):
    """kernels/flash_attention.cu forward (out, lse) and backward (dqkv) against gpt2_cpu's
    attention and llmc.cuda_check.attention_lse, in float64."""
    C = NH * HS
    qkv, dout = rng.standard_normal((B, T, 3 * C)), rng.standard_normal((B, T, C))
    qkv_d, dout_d = to_device(qkv, precision), to_device(dout, precision)
    out, lse = poisoned((B, T, C), precision), poisoned_f32((B, NH, T))
    llmc.attention.flash_attention_forward(out, lse, qkv_d, B, T, C, NH)
    dqkv, D = poisoned((B, T, 3 * C), precision), poisoned_f32((B, NH, T))
    llmc.attention.flash_attention_backward(dqkv, D, dout_d, out, qkv_d, lse, B, T, C, NH)
    x, dx = as_input(qkv, precision), as_input(dout, precision)
    ref_out, ref_att = gpt2_cpu.attention_forward(x, NH)
    assert_kernel("attention", precision, out, ref_out, "flash out")
    assert_kernel("attention", "fp32", lse.get(), cuda_check.attention_lse(x, NH), "flash lse")   # fp32 arithmetic
    assert_kernel("attention", precision, dqkv, gpt2_cpu.attention_backward(dx, x, ref_att, NH), "flash dqkv")


def check_classifier(rng, precision, B, T, V, Vp):
    """fused_classifier: losses with the logits left intact, then losses and dlogits in one pass."""
    cp = llmc.cuda.cupy()
    logits = rng.standard_normal((B, T, Vp)) * 3
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    z = as_input(logits, precision)
    dev = to_device(logits, precision)
    losses = poisoned_f32((B, T))
    gpt2_cuda.fused_classifier(dev, losses, cp.asarray(targets), 0.0, B, T, V, Vp, write_dlogits=False)
    probs = gpt2_cpu.softmax_forward(z, V)
    ref_losses = gpt2_cpu.crossentropy_forward(probs, targets)
    assert_kernel("classifier", "fp32", losses.get(), ref_losses, "losses")
    assert_kernel("classifier", precision, dev, z, "logits untouched without write_dlogits")
    dloss = 1.0 / (B * T)
    losses.fill(np.nan)
    gpt2_cuda.fused_classifier(dev, losses, cp.asarray(targets), dloss, B, T, V, Vp, write_dlogits=True)
    assert_kernel("classifier", "fp32", losses.get(), ref_losses, "losses (the one pass with dlogits)")
    ref = gpt2_cpu.crossentropy_softmax_backward(np.full((B, T), dloss), probs, targets)
    atol, rtol = TOLERANCES[f"kernel_{precision}"]["classifier"]
    assert check_tensor(to_host(dev), ref, f"dlogits [{precision}]", atol * dloss, rtol)
    assert np.all(to_host(dev)[..., V:] == 0.0)


def check_adamw_norm_cast(rng, precision, n):
    """adamw_update (against gpt2_cpu.gpt2_update), global_norm, both casts, over n values."""
    cp = llmc.cuda.cupy()
    p0, g0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    m0, v0 = rng.standard_normal(n).astype(np.float32) * 0.1, np.abs(rng.standard_normal(n)).astype(np.float32)
    params, grads, m, v = to_device(p0, precision), to_device(g0, precision), cp.asarray(m0), cp.asarray(v0)
    master = cp.asarray(as_input(p0, precision).astype(np.float32))
    lr, b1, b2, eps, wd, t, scale = 1e-3, 0.9, 0.95, 1e-8, 0.1, 3, 0.7
    gpt2_cuda.adamw_update_tensor(params, master, grads, m, v, n, lr, b1, b2, 1 - b1 ** t, 1 - b2 ** t, eps, wd, scale, 1234)
    ref = types.SimpleNamespace(params=as_input(p0, precision).astype(np.float32), grads=as_input(g0, precision).astype(np.float32),
                                m=m0.copy(), v=v0.copy(), param_shapes=[("wte", (n,))])
    gpt2_cpu.gpt2_update(ref, lr, b1, b2, eps, wd, t, scale)
    atol, rtol = TOLERANCES["kernel_fp32"]["adamw"]
    assert check_tensor(master.get(), ref.params, "master", atol, rtol)
    assert check_tensor(m.get(), ref.m, "m", atol, rtol)
    assert check_tensor(v.get(), ref.v, "v", atol, rtol)
    assert_kernel("adamw", precision, params, ref.params, "params (stochastically rounded in bf16)")
    # global norm, fixed-order reduction
    out, partial = poisoned_f32(gpt2_cuda.NORM_VALUES), poisoned_f32(gpt2_cuda.GLOBAL_NORM_GRID)
    ref_norm = np.sqrt((as_input(g0, precision) ** 2).sum())
    for grad_clip in (0.0, 2 * ref_norm, 0.5 * ref_norm):          # no clipping; the norm under it; over it
        gpt2_cuda.global_norm(out, partial, grads, n, grad_clip)
        norm, scale = out.get()
        assert_kernel("global_norm", precision, np.array([norm]), np.array([ref_norm]), "global norm")
        clip = np.float32(grad_clip)
        assert scale == (clip / norm if 0 < clip < norm else np.float32(1.0)), "the clipping factor, fp32"
    # casts: exact round-trips
    f = poisoned_f32(n)
    gpt2_cuda.cast_floatX_to_float(f, grads, n)
    assert_kernel("cast", precision, f.get(), as_input(g0, precision), "cast floatX -> float")
    back = poisoned(n, precision)
    gpt2_cuda.cast_float_to_floatX(back, cp.asarray(g0), n)
    assert_kernel("cast", precision, back, as_input(g0, precision), "cast float -> floatX (nearest even)")


# ----------------------------------------------------------------------------
# Llama 3's kernels (llama3_cuda.py's launchers) against llama3_cpu.py's layers

def check_rmsnorm(rng, precision, B, T, C):
    """rmsnorm_forward, and rmsnorm_backward (dinp and dweight accumulate)."""
    import llama3_cpu
    import llama3_cuda
    inp = rng.standard_normal((B, T, C)) * 2 + 0.5
    w = rng.standard_normal(C)
    x, wx = as_input(inp, precision), as_input(w, precision)
    out, rstd = poisoned((B, T, C), precision), poisoned_f32((B, T))
    llama3_cuda.rmsnorm_forward(out, rstd, to_device(inp, precision), to_device(w, precision), B, T, C)
    ref, ref_rstd = llama3_cpu.rmsnorm_forward(x, wx, llama3_cpu.NORM_EPS)
    assert_kernel("rmsnorm_forward", precision, out, ref, "rmsnorm out")
    assert_kernel("rmsnorm_forward", "fp32", rstd.get(), ref_rstd, "rmsnorm rstd")   # fp32 statistic of floatX inputs
    dout = rng.standard_normal((B, T, C))
    dinp0, dw0 = rng.standard_normal((B, T, C)), rng.standard_normal(C)
    dinp, dw = to_device(dinp0, precision), to_device(dw0, precision)
    partial = poisoned_f32(llama3_cuda.rmsnorm_backward_grid(B * T) * C)
    llama3_cuda.rmsnorm_backward(dinp, dw, partial, to_device(dout, precision), to_device(inp, precision),
                                 to_device(w, precision), rstd, B, T, C)
    ref_dw = as_input(dw0, precision)
    ref_dinp = as_input(dinp0, precision) + llama3_cpu.rmsnorm_backward(ref_dw, as_input(dout, precision), x, wx, ref_rstd)
    assert_kernel("rmsnorm_backward", precision, dinp, ref_dinp, "rmsnorm dinp (accumulated)")
    assert_kernel("rmsnorm_backward", precision, dw, ref_dw, "rmsnorm dweight (accumulated)")


def check_rope(rng, precision, B, T, NH, NKV, HS, in_place=False):
    """rope_forward and rope_backward on a qkv projection (B,T,NH+2NKV,HS): q and k heads rotated
    (n_rot = NH+NKV), v heads copied; in_place: out is inp."""
    import llama3_cpu
    import llama3_cuda
    cp = llmc.cuda.cupy()
    nh, n_rot = NH + 2 * NKV, NH + NKV
    cos, sin = llama3_cpu.precompute_freqs_cis(HS, T, llama3_cpu.ROPE_THETA, True)      # (T,HS/2) float64
    dev_cos, dev_sin = cp.asarray(cos.astype(np.float32)), cp.asarray(sin.astype(np.float32))
    for launcher, reference, label in ((llama3_cuda.rope_forward, llama3_cpu.rope_forward, "rope forward"),
                                       (llama3_cuda.rope_backward, llama3_cpu.rope_backward, "rope backward")):
        inp = rng.standard_normal((B, T, nh, HS))
        x = as_input(inp, precision)
        source = to_device(inp, precision)
        out = source if in_place else poisoned((B, T, nh, HS), precision)
        launcher(out, source, dev_cos, dev_sin, B, T, nh, n_rot, HS)
        ref = x.copy()
        ref[:, :, :n_rot] = reference(x[:, :, :n_rot], cos, sin)
        assert_kernel("rope", precision, out, ref, label + (" (in place)" if in_place else ""))


def check_repeat_kv(rng, precision, B, T, NH, NKV, HS):
    """repeat_kv_forward (qkv (B,T,NH+2NKV,HS) -> GPT-2's (B,T,3,NH,HS)) and repeat_kv_backward."""
    import llama3_cpu
    import llama3_cuda
    n_rep, QKV = NH // NKV, (NH + 2 * NKV) * HS
    inp = rng.standard_normal((B, T, QKV))
    x = as_input(inp, precision)
    out = poisoned((B, T, 3 * NH * HS), precision)
    llama3_cuda.repeat_kv_forward(out, to_device(inp, precision), B, T, NH, NKV, HS)
    q, k, v = llama3_cpu.split_qkv(x, NH, NKV)
    ref = llama3_cpu.merge_heads(q, llama3_cpu.repeat_kv_forward(k, n_rep), llama3_cpu.repeat_kv_forward(v, n_rep))
    assert_kernel("repeat_kv", precision, out, ref, "repeat_kv forward")
    dout = rng.standard_normal((B, T, 3 * NH * HS))
    dx = as_input(dout, precision)
    dinp = poisoned((B, T, QKV), precision)
    llama3_cuda.repeat_kv_backward(dinp, to_device(dout, precision), B, T, NH, NKV, HS)
    dq, dk, dv = llama3_cpu.split_qkv(dx, NH, NH)
    ref = llama3_cpu.merge_heads(dq, llama3_cpu.repeat_kv_backward(dk, n_rep), llama3_cpu.repeat_kv_backward(dv, n_rep))
    assert_kernel("repeat_kv", precision, dinp, ref, "repeat_kv backward")


def check_swiglu(rng, precision, n, in_place=False):
    """swiglu_forward and swiglu_backward over n values (any n: the x128 groups and the scalar
    tail); in_place: dfch is dout."""
    import llama3_cpu
    import llama3_cuda
    fch, fch2, dout = rng.standard_normal(n) * 3, rng.standard_normal(n) * 3, rng.standard_normal(n)
    fch2[:2] = (-100.0, 100.0)                                          # silu's limits: -0 and the identity
    a, b, d = as_input(fch, precision), as_input(fch2, precision), as_input(dout, precision)
    out = poisoned(n, precision)
    llama3_cuda.swiglu_forward(out, to_device(fch, precision), to_device(fch2, precision), n)
    assert_kernel("swiglu", precision, out, llama3_cpu.swiglu_forward(a, b), "swiglu forward")
    dev_dout = to_device(dout, precision)
    dfch = dev_dout if in_place else poisoned(n, precision)
    dfch2 = poisoned(n, precision)
    llama3_cuda.swiglu_backward(dfch, dfch2, dev_dout, to_device(fch, precision), to_device(fch2, precision), n)
    ref_dfch, ref_dfch2 = llama3_cpu.swiglu_backward(d, a, b)
    assert_kernel("swiglu", precision, dfch, ref_dfch, "swiglu dfch" + (" (in place)" if in_place else ""))
    assert_kernel("swiglu", precision, dfch2, ref_dfch2, "swiglu dfch2")
