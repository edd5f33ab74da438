"""
doc/from_numpy_to_cuda.py: every number and figure of doc/from_numpy_to_cuda.md (one layer,
LayerNorm, followed from gpt2_cpu.layernorm_forward to kernels/layernorm.cu to its launcher
gpt2_cuda.layernorm_forward, and the check that compares the two).

What it is: the tutorial's experiments, all on the CPU:
  1. the launcher gpt2_cuda.layernorm_forward called on device arrays with llmc.cuda.launch replaced
     by a recorder: the grid, the block, the scalar types it passes, and the checks it makes;
  2. the memory traffic of one warp-wide load for three ways of mapping threads to a row
     (coalescing; figure from_numpy_to_cuda_lanes.png), and the parallelism each offers on an H100;
  3. a NumPy emulation of the kernel's arithmetic order (each lane's strided partial sums in
     float32, then warpReduceSum's five xor-shuffles), checked against gpt2_cpu.layernorm_forward
     with llmc.check's tolerances, in fp32 and with bf16 storage;
  4. one-pass (E[x^2] - mean^2) against two-pass variance in float32 as |mean|/std grows
     (figure from_numpy_to_cuda_variance.png), and what the check says about a one-pass kernel;
  5. bytes moved, FLOPs and arithmetic intensity of one LayerNorm of GPT-2 124M against the H100's
     roofline (figure from_numpy_to_cuda_roofline.png), and the three layernorm_forward versions'
     times measured on an H100 (read from dev/results/'s dev/cuda table) against those bytes.
What it is not: a GPU run. Nothing here runs on a GPU; section 4's measured times are read from
the table `make dev-cuda` wrote on an H100 (dev/results/). The emulation reproduces the order of the kernel's float32 operations, not its speed; rsqrtf
(an approximation on the GPU) is emulated by an exactly rounded 1/sqrt.

Run:
    python doc/from_numpy_to_cuda.py
prints one `key = value` line per number the tutorial quotes (e.g. `grid = 1024`) and redraws
doc/from_numpy_to_cuda_lanes.png, _variance.png and _roofline.png. A few seconds on
2 CPU cores. tests/test_docs.py checks that doc/from_numpy_to_cuda.md quotes every number exactly
as computed here.
"""

import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import print_numbers, pyplot, save_figure  # noqa: E402

import gpt2_cuda  # noqa: E402
from gpt2_cpu import LN_EPS, GPT2Config, layernorm_forward  # noqa: E402
from llmc import cuda  # noqa: E402
from llmc.check import TOLERANCES, check_against  # noqa: E402
from llmc.cuda import (FLOATX_DTYPES, VECTOR_BYTES, WARP_ROW_BLOCK_SIZE, WARP_SIZE, vector_size,  # noqa: E402
                       warp_row_grid)
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits  # noqa: E402
from llmc.mfu import peak_flops  # noqa: E402

SEED = 1234
GPT2 = GPT2Config()                    # GPT-2 124M: C = 768 (the defaults)
B, T = 8, 1024                         # one micro-batch of GPT-2 124M at full context
SECTOR_BYTES = 32                      # the unit in which a load instruction moves DRAM/L2 data
BF16_BYTES, FP32_BYTES = 2, 4
# H100 SXM5, from NVIDIA's datasheet: HBM3 bandwidth, and the GPU's shape (compute capability 9.0)
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_BANDWIDTH = 3.35e12               # bytes/s
H100_SMS = 132
MAX_THREADS_PER_SM = 2048
FLOAT32_EPS = float(np.finfo(np.float32).eps)
# FLOPs per element of the kernel's three passes: pass 1 one add; pass 2 a subtract and a fused
# multiply-add (2 FLOPs); pass 3 a subtract, a multiply and a multiply-add
FLOPS_PER_ELEMENT = 1 + 3 + 4
# the variance experiment: rows of C values x = m + std * z, z ~ N(0,1), for a range of m / std
VARIANCE_ROWS = 256
RATIOS = np.logspace(0, 4.5, 19)
RATIOS_QUOTED = (1, 100, 1000, 10000)
BROKEN_MEAN = 10.0                     # the one-pass kernel under the check: rows of mean 10, std 1


# ----------------------------------------------------------------------------
# 1. the launcher, with the launch recorded instead of run

def record_launch(launcher, *args):
    """Call a gpt2_cuda launcher on device arrays with llmc.cuda.launch replaced by a recorder.
    Returns the one launch it made: (file, precision, kernel name, grid, block, args)."""
    calls = []
    real = cuda.launch
    cuda.launch = lambda *launch_args: calls.append(launch_args)
    try:
        launcher(*args)
    finally:
        cuda.launch = real
    assert len(calls) == 1, calls
    return calls[0]


def zeros(n, dtype):
    """A zeroed device array of the emulated device (the launchers take device arrays: they pass
    their addresses to the kernel). The process's device choice (llmc.cuda.use_device) is left as it is."""
    from llmc.emulator import device
    return device.zeros(n, dtype)


def launcher_arrays(precision, N, C):
    """Zeroed device arrays for layernorm_forward: out, mean, rstd, inp, weight, bias."""
    X = FLOATX_DTYPES[precision]
    return (zeros(N * C, X), zeros(N, np.float32), zeros(N, np.float32), zeros(N * C, X), zeros(C, X), zeros(C, X))


def check_message(precision, N, C, **replace):
    """The error layernorm_forward raises for a bad argument (replace: name -> array)."""
    names = ("out", "mean", "rstd", "inp", "weight", "bias")
    arrays = dict(zip(names, launcher_arrays(precision, N, C)))
    arrays.update(replace)
    try:
        record_launch(gpt2_cuda.layernorm_forward, *[arrays[n] for n in names], 1, N, C)
    except (TypeError, ValueError) as e:
        message = f"{type(e).__name__}: {e}".split(" (address")[0]    # the address differs from run to run
        return f"`{message}`"
    raise AssertionError("the launcher accepted a bad argument")


def launcher_experiment():
    C, N = GPT2.channels, B * T
    numbers = {"B": f"{B}", "T": f"{T}", "C": f"{C}", "N": f"{N:,}"}
    for precision in ("bf16", "fp32"):
        file, prec, name, grid, block, args = record_launch(gpt2_cuda.layernorm_forward,
                                                            *launcher_arrays(precision, N, C), B, T, C)
        assert (file, prec, name, grid) == ("layernorm", precision, "layernorm_forward", warp_row_grid(N))
        vec = vector_size(precision)
        numbers[f"vec_{precision}"] = f"{vec}"
        numbers[f"groups_{precision}"] = f"{C // vec}"
        numbers[f"iters_{precision}"] = f"{C // (WARP_SIZE * vec)}"
        numbers[f"lane_stride_{precision}"] = f"{WARP_SIZE * vec}"
        if precision == "bf16":
            numbers |= {"grid": f"{grid:,}", "block": f"{block}", "rows_per_block": f"{block // WARP_SIZE}",
                        "threads": f"{grid * block:,}", "warps": f"{grid * block // WARP_SIZE:,}",
                        "scalars": "`" + ", ".join(f"np.{type(a).__name__}({a})" for a in args[-2:]) + "`"}
    numbers["warp_bytes"] = f"{WARP_SIZE * VECTOR_BYTES}"
    numbers["grid_d4"] = f"{warp_row_grid(4 * 64)}"
    numbers["error_C"] = check_message("bf16", 8, 100, out=zeros(800, np.uint16), inp=zeros(800, np.uint16),
                                       weight=zeros(100, np.uint16), bias=zeros(100, np.uint16))
    numbers["error_dtype"] = check_message("bf16", 8, 64, inp=zeros(8 * 64, np.float32))
    numbers["error_view"] = check_message("fp32", 8, 64, inp=zeros(8 * 64 + 1, np.float32)[1:])
    return numbers


# ----------------------------------------------------------------------------
# 2. coalescing: which bytes one warp-wide load instruction touches

def sectors(byte_addresses):
    """The distinct 32-byte sectors covering a set of byte addresses."""
    return len({a // SECTOR_BYTES for a in byte_addresses})


def coalescing_experiment():
    """One load instruction of a warp reading a bf16 (N, C) tensor, three thread-to-data mappings:
        thread per row (llm.c dev/cuda/layernorm_forward.cu version 1): lane l reads element 0 of row l
        warp per row, scalar loads:  lane l reads element l of the row
        warp per row, x128 loads (kernels/layernorm.cu): lane l reads elements 8l .. 8l+7"""
    C, el = GPT2.channels, BF16_BYTES
    vec = vector_size("bf16")
    lanes = range(WARP_SIZE)
    mappings = {
        "thread_row": [l * C * el + b for l in lanes for b in range(el)],
        "warp_scalar": [l * el + b for l in lanes for b in range(el)],
        "warp_x128": [l * VECTOR_BYTES + b for l in lanes for b in range(VECTOR_BYTES)],
    }
    numbers = {}
    for name, addresses in mappings.items():
        s = sectors(addresses)
        numbers[f"{name}_useful"] = f"{len(addresses)}"
        numbers[f"{name}_sectors"] = f"{s}"
        numbers[f"{name}_efficiency"] = f"{100 * len(addresses) / (s * SECTOR_BYTES):.2f}%"
    numbers["loads_per_row_scalar"] = f"{C // WARP_SIZE}"
    numbers["loads_per_row_x128"] = f"{C // (WARP_SIZE * vec)}"
    # parallelism: how many threads each mapping puts to work, against what an H100 keeps resident
    N = B * T
    resident = H100_SMS * MAX_THREADS_PER_SM
    numbers |= {"h100_sms": f"{H100_SMS}", "threads_per_sm": f"{MAX_THREADS_PER_SM:,}",
                "resident_threads": f"{resident:,}",
                "thread_row_threads": f"{N:,}", "thread_row_share": f"{100 * N / resident:.0f}%",
                "resident_blocks": f"{H100_SMS * MAX_THREADS_PER_SM // WARP_ROW_BLOCK_SIZE:,}"}
    return numbers


def draw_lanes(fig_dir):
    """Which lane of the warp reads each element of one bf16 row of C channels: the row cut into
    lane strides of 32 * 8 elements, one per load instruction of the warp."""
    C, vec = GPT2.channels, vector_size("bf16")
    stride = WARP_SIZE * vec
    lane = (np.arange(C) // vec) % WARP_SIZE                  # element c is read by lane (c // 8) % 32
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 2.9))
    im = ax.imshow(lane.reshape(C // stride, stride), aspect="auto", cmap="viridis", interpolation="nearest",
                   extent=(0, stride, C // stride - 0.5, -0.5))
    for x in range(0, stride + 1, vec):
        ax.axvline(x, color="white", lw=0.3)
    for k in range(C // stride):
        for l in range(WARP_SIZE):
            ax.text(l * vec + vec / 2, k, f"{l}", ha="center", va="center", fontsize=6,
                    color="white" if l < WARP_SIZE * 0.6 else "black")
    iterations = range(C // stride)
    ax.set_yticks(iterations, [f"{k}: channels {k * stride}..{(k + 1) * stride - 1}" for k in iterations])
    ax.set_ylabel("loop iteration k")
    ax.set_xlabel(f"position inside the lane stride (element; each cell = one lane's x128 = {vec} bf16 "
                  f"= {VECTOR_BYTES} bytes)")
    ax.set_title(f"layernorm_row, bf16, C={C}: lane l reads channels k*{stride} + {vec}l ... "
                 f"k*{stride} + {vec}l + {vec - 1}\none row of this picture = one load instruction of the warp "
                 f"= {WARP_SIZE * VECTOR_BYTES} contiguous bytes", fontsize=9)
    fig.colorbar(im, ax=ax, label="lane", fraction=0.03, pad=0.01)
    save_figure(fig, fig_dir, "from_numpy_to_cuda_lanes.png")


# ----------------------------------------------------------------------------
# 3. the kernel's arithmetic, emulated in NumPy float32

def fma(a, b, c):
    """float32 a*b + c rounded once, as the GPU's fused multiply-add: the float64 product of two
    float32 is exact, so only the float64 sum and the final rounding remain (the two roundings can
    differ from one in rare ties; nothing quoted depends on that)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def lane_partials(values, vec, square=False):
    """values (N,C) float32 -> (N,32) float32: what each lane of the warp holds after its loop in
    layernorm_row, `for (c = lane*vec; c < C; c += 32*vec) for (k < vec) sum += x[c+k]` (or
    `sum_sq += x*x`, a fused multiply-add, with square). Lane l's k-th value of group g is column
    g*32*vec + l*vec + k; the additions happen in exactly the kernel's order."""
    N, C = values.shape
    acc = np.zeros((N, WARP_SIZE), np.float32)
    for base in range(0, C, WARP_SIZE * vec):
        for k in range(vec):
            cols = base + np.arange(WARP_SIZE) * vec + k
            live = cols < C                                   # lanes past the row's end add nothing
            v = values[:, cols[live]]
            acc[:, live] = fma(v, v, acc[:, live]) if square else acc[:, live] + v
    return acc


def warp_reduce_sum(partial):
    """kernels/common.cuh warpReduceSum on (N,32) lane values: five rounds of
    `value += __shfl_xor_sync(FULL_WARP_MASK, value, offset)`, offset 16, 8, 4, 2, 1. Returns
    (N,32): every lane's result (they are all equal: float addition is commutative)."""
    lanes = np.arange(WARP_SIZE)
    for offset in (16, 8, 4, 2, 1):
        partial = partial + partial[:, lanes ^ offset]        # lane l adds the value of lane l xor offset
    return partial


def kernel_layernorm(x, weight, bias, vec, one_pass=False):
    """layernorm_row for all rows of x (N,C) float32 (already rounded to floatX); weight, bias (C,)
    float32. Returns out (N,C) float32 (before the floatX store), mean (N,), rstd (N,), and whether
    all lanes agreed on both sums. one_pass: the variance as E[x^2] - mean^2 (not the kernel)."""
    C = np.float32(x.shape[1])
    total = warp_reduce_sum(lane_partials(x, vec))
    mean = total[:, 0] / C                                    # pass 1
    if one_pass:
        total_sq = warp_reduce_sum(lane_partials(x, vec, square=True))
        var = total_sq[:, 0] / C - mean * mean
    else:
        total_sq = warp_reduce_sum(lane_partials(x - mean[:, None], vec, square=True))
        var = total_sq[:, 0] / C                              # pass 2
    agree = bool((total == total[:, :1]).all() and (total_sq == total_sq[:, :1]).all())
    with np.errstate(invalid="ignore"):                       # one-pass: a negative var + eps gives NaN
        rstd = np.float32(1.0) / np.sqrt(var + np.float32(LN_EPS))   # rsqrtf on the GPU
    norm = (x - mean[:, None]) * rstd[:, None]                # pass 3
    return fma(norm, weight, bias), mean, rstd, agree


def bf16(x):
    """float32 -> the nearest bf16 value, as float32 (what a bf16 store keeps)."""
    return bfloat16_bits_to_float32(float32_to_bfloat16_bits(x)).reshape(np.shape(x))


def emulation_experiment(rng):
    N, C = 4096, GPT2.channels
    x = rng.standard_normal((N, C)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(C)).astype(np.float32)
    b = (0.1 * rng.standard_normal(C)).astype(np.float32)
    numbers = {"emu_rows": f"{N:,}"}
    # fp32: the kernel's order against gpt2_cpu in float64 on the same float32 inputs
    out, mean, rstd, agree = kernel_layernorm(x, w, b, vector_size("fp32"))
    ref, ref_mean, ref_rstd = layernorm_forward(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64))
    assert agree
    exact_sum = x.astype(np.float64).sum(axis=1)
    warp_sum = warp_reduce_sum(lane_partials(x, vector_size("fp32")))[:, 0]
    numbers["lanes_agree"] = "all" if agree else "not all"
    numbers["sum_err"] = f"{np.abs(warp_sum - exact_sum).max():.0e}"
    scale = np.abs(x).sum(axis=1).mean()
    numbers["sum_scale"] = f"{scale:.0f}"
    numbers["sum_eps_scale"] = f"{FLOAT32_EPS * scale:.0e}"
    atol, rtol = TOLERANCES["kernel_fp32"]["layernorm_forward"]
    ok_out = check_against(out, ref, "ln out", "kernel_fp32", "layernorm_forward", verbose=False)
    ok_mean = check_against(mean, ref_mean, "ln mean", "kernel_fp32", "layernorm_forward", verbose=False)
    ok_rstd = check_against(rstd, ref_rstd, "ln rstd", "kernel_fp32", "layernorm_forward", verbose=False)
    numbers |= {"tol_fp32": f"({atol:g}, {rtol:g})",
                "fp32_verdict": "TENSOR OK" if ok_out and ok_mean and ok_rstd else "TENSOR NOT OK",
                "fp32_out_diff": f"{np.abs(out - ref).max():.0e}",
                "fp32_rstd_diff": f"{np.abs(rstd - ref_rstd).max():.0e}"}
    # bf16 storage: inputs and parameters are bf16 values, arithmetic float32, the output stored as bf16
    xb, wb, bb = bf16(x), bf16(w), bf16(b)
    out_b, _, _, _ = kernel_layernorm(xb, wb, bb, vector_size("bf16"))
    out_b = bf16(out_b)
    ref_b = layernorm_forward(xb.astype(np.float64), wb.astype(np.float64), bb.astype(np.float64))[0]
    atol_b, rtol_b = TOLERANCES["kernel_bf16"]["layernorm_forward"]
    ok_b = check_against(out_b, ref_b, "ln out", "kernel_bf16", "layernorm_forward", verbose=False)
    numbers |= {"tol_bf16": f"({atol_b:g}, {rtol_b:g})", "bf16_verdict": "TENSOR OK" if ok_b else "TENSOR NOT OK",
                "bf16_out_diff": f"{np.abs(out_b - ref_b).max():.0e}",
                "bf16_out_rel": f"{np.abs(out_b - ref_b).max() / np.abs(ref_b).max():.0e}"}
    # --check: llmc.cuda_check.check_against_cpu compares layer outputs as "activation", mean/rstd as "statistic"
    fp32_atol, fp32_rtol = TOLERANCES["cuda_fp32"]["activation"]
    bf16_atol, bf16_rtol = TOLERANCES["cuda_bf16"]["activation"]
    numbers |= {"tol_cuda_fp32": f"({fp32_atol:g}, {fp32_rtol:g})", "tol_cuda_bf16": f"({bf16_atol:g}, {bf16_rtol:g})"}
    # a one-pass kernel, same check, on rows whose mean is BROKEN_MEAN times their std
    xs = (BROKEN_MEAN + rng.standard_normal((256, C))).astype(np.float32)
    ref_s = layernorm_forward(xs.astype(np.float64), w.astype(np.float64), b.astype(np.float64))[0]
    for name, one_pass in (("two", False), ("one", True)):
        out_s = kernel_layernorm(xs, w, b, vector_size("fp32"), one_pass=one_pass)[0]
        ok = check_against(out_s, ref_s, "ln out", "kernel_fp32", "layernorm_forward", verbose=False)
        numbers[f"shifted_{name}_verdict"] = "TENSOR OK" if ok else "TENSOR NOT OK"
        numbers[f"shifted_{name}_diff"] = f"{np.abs(out_s - ref_s).max():.0e}"
    numbers["shifted_cpu32_diff"] = f"{np.abs(layernorm_forward(xs, w, b)[0] - ref_s).max():.0e}"
    numbers["broken_mean"] = f"{BROKEN_MEAN:g}"
    return numbers


# ----------------------------------------------------------------------------
# 4. one-pass against two-pass variance

def variance_errors(rng, ratio, vec):
    """Rows of GPT2.channels float32 values, mean `ratio`, std 1: the largest relative error of the
    variance over VARIANCE_ROWS rows, one-pass and two-pass (both in the kernel's order), against
    float64 on the same float32 values; and how many one-pass variances came out negative."""
    x = (ratio + rng.standard_normal((VARIANCE_ROWS, GPT2.channels))).astype(np.float32)
    C = np.float32(x.shape[1])
    exact = x.astype(np.float64).var(axis=1)
    mean = warp_reduce_sum(lane_partials(x, vec))[:, 0] / C
    one = warp_reduce_sum(lane_partials(x, vec, square=True))[:, 0] / C - mean * mean
    two = warp_reduce_sum(lane_partials(x - mean[:, None], vec, square=True))[:, 0] / C
    rel = lambda v: float(np.abs(v - exact).max() / exact.min())  # noqa: E731
    return rel(one), rel(two), int((one < 0).sum())


def variance_experiment(rng, fig_dir):
    vec = vector_size("fp32")
    errors = np.array([variance_errors(rng, r, vec) for r in RATIOS])   # (len(RATIOS), 3)
    numbers = {"var_rows": f"{VARIANCE_ROWS}", "eps32": f"{FLOAT32_EPS:.1e}"}
    for r in RATIOS_QUOTED:
        i = int(np.argmin(np.abs(RATIOS - r)))
        assert np.isclose(RATIOS[i], r)
        numbers[f"one_pass_{r}"] = f"{errors[i, 0]:.0e}"
        numbers[f"two_pass_{r}"] = f"{errors[i, 1]:.0e}"
        numbers[f"negative_{r}"] = f"{int(errors[i, 2])}"
    lost = RATIOS[np.argmax(errors[:, 0] >= 1.0)]
    numbers["first_total_loss"] = f"{lost:,.0f}"
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.loglog(RATIOS, errors[:, 0], "o-", label="one pass: E[x^2] - mean^2")
    ax.loglog(RATIOS, errors[:, 1], "s-", label="two passes: E[(x - mean)^2]  (kernels/layernorm.cu)")
    ax.loglog(RATIOS, FLOAT32_EPS * RATIOS ** 2, "k:", lw=1, label="eps32 * (mean/std)^2")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.text(RATIOS[0], 1.5, "100% error: no correct digit left", fontsize=8, color="gray", va="bottom")
    ax.set_xlabel("|mean| / std of the row")
    ax.set_ylabel("max relative error of the variance")
    ax.set_title(f"float32 variance of rows of C={GPT2.channels}, in the kernel's summation order", fontsize=10)
    ax.set_ylim(1e-8, 1e3)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, fig_dir, "from_numpy_to_cuda_variance.png")
    return numbers


# ----------------------------------------------------------------------------
# 5. bytes, FLOPs, roofline

def traffic(N, C, element_bytes):
    """DRAM bytes of one layernorm_forward: read inp, write out (N*C each), write mean and rstd
    (N floats each), read weight and bias once (C each; later blocks find them in L2). Passes 2
    and 3 re-read the row from L1/L2, not DRAM."""
    return 2 * N * C * element_bytes + 2 * N * FP32_BYTES + 2 * C * element_bytes


def roofline_experiment(fig_dir):
    N, C = B * T, GPT2.channels
    fp32_peak = peak_flops(H100_NAME, "fp32", False)
    ridge = fp32_peak / H100_BANDWIDTH
    flops = FLOPS_PER_ELEMENT * N * C
    numbers = {"flops_per_element": f"{FLOPS_PER_ELEMENT}", "ln_flops": f"{flops / 1e6:.1f}",
               "h100_bandwidth": f"{H100_BANDWIDTH / 1e12:.2f}", "h100_fp32": f"{fp32_peak / 1e12:.1f}",
               "ridge": f"{ridge:.0f}", "ln_per_forward": f"{2 * GPT2.num_layers + 1}"}
    points = {}
    for precision, el in (("bf16", BF16_BYTES), ("fp32", FP32_BYTES)):
        moved = traffic(N, C, el)
        intensity = flops / moved
        t_memory, t_compute = moved / H100_BANDWIDTH, flops / fp32_peak
        points[precision] = intensity
        numbers |= {f"bytes_{precision}": f"{moved / 1e6:.1f}", f"intensity_{precision}": f"{intensity:.2f}",
                    f"t_memory_{precision}": f"{t_memory * 1e6:.1f}",
                    f"t_compute_{precision}": f"{t_compute * 1e6:.2f}",
                    f"ratio_{precision}": f"{t_memory / t_compute:.0f}"}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ai = np.logspace(-1, 3, 200)
    ax.loglog(ai, np.minimum(fp32_peak, ai * H100_BANDWIDTH) / 1e12, "k-", lw=1.5,
              label=f"H100 SXM roofline: min({fp32_peak / 1e12:.1f} TFLOP/s, AI x {H100_BANDWIDTH / 1e12:.2f} TB/s)")
    for precision, marker in (("bf16", "o"), ("fp32", "s")):
        ai_p = points[precision]
        ax.loglog([ai_p], [ai_p * H100_BANDWIDTH / 1e12], marker, ms=8,
                  label=f"layernorm_forward, {precision} storage: {ai_p:.2f} FLOP/byte")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.text(ridge * 1.1, 0.5, f"ridge point\n{ridge:.0f} FLOP/byte", fontsize=8, color="gray")
    ax.set_xlabel("arithmetic intensity (FLOP per DRAM byte)")
    ax.set_ylabel("attainable TFLOP/s (fp32, no tensor cores)")
    ax.set_ylim(0.2, 2000)                                    # room for the legend above the roof
    ax.set_title(f"one LayerNorm of GPT-2 124M, B={B}, T={T}, C={C}: memory bound", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    save_figure(fig, fig_dir, "from_numpy_to_cuda_roofline.png")
    return numbers


# the measured times: dev/cuda/layernorm.py's table from the H100 (`make dev-cuda`, kept in dev/results/)
MEASURED_TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dev", "results",
                               "2026-11-26_nvidia-h100-80gb-hbm3_session2_layernorm.md")


def measured_times(path, progression):
    """{version: [(time in seconds, block size), ...] fastest first} of one progression of a
    dev/cuda table (rows `| version | kernel | block | time (ms) | ...`), and the measured copy
    bandwidth (bytes/s) of its header."""
    times, section, copy = {}, None, None
    for line in open(path, encoding="utf-8"):
        if line.startswith("- measured copy bandwidth:"):
            copy = float(line.split(":")[1].split()[0]) * 1e9
        elif line.startswith("### "):
            section = line.split()[1]
        elif section == progression and line.startswith("| ") and line.split("|")[1].strip().isdigit():
            version, block, ms = (line.split("|")[i].strip() for i in (1, 3, 4))
            times.setdefault(int(version), []).append((float(ms) / 1e3, int(block)))
    return {version: sorted(rows) for version, rows in times.items()}, copy


def measured_experiment():
    """Section 4's measurement: the three layernorm_forward versions on the H100, bf16, N = 8192 rows
    of C = 768 (the running example), each at its fastest block size, against traffic()'s bytes."""
    times, copy = measured_times(MEASURED_TABLE, "layernorm_forward")
    moved = traffic(B * T, GPT2.channels, BF16_BYTES)
    t1, t2, (t3, block3), t3_slowest = times[1][0][0], times[2][0][0], times[3][0], times[3][-1][0]
    return {"measured_v1_us": f"{t1 * 1e6:.0f}", "measured_v2_us": f"{t2 * 1e6:.1f}",
            "measured_v3_us": f"{t3 * 1e6:.1f}", "measured_v3_block": f"{block3}",
            "measured_v3_slowest_us": f"{t3_slowest * 1e6:.1f}",
            "measured_v3_tbs": f"{moved / t3 / 1e12:.2f}",
            "measured_v3_of_datasheet": f"{100 * moved / t3 / H100_BANDWIDTH:.0f}",
            "measured_copy_tbs": f"{copy / 1e12:.2f}",
            "measured_v3_of_copy": f"{100 * moved / t3 / copy:.0f}",
            "measured_v3_over_bound": f"{t3 / (moved / H100_BANDWIDTH):.1f}",
            "measured_v1_over_v3": f"{t1 / t3:.0f}"}


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment; save the figures into fig_dir; return {key: formatted number}."""
    rng = np.random.default_rng(SEED)
    numbers = {}
    numbers |= launcher_experiment()
    numbers |= coalescing_experiment()
    draw_lanes(fig_dir)
    numbers |= emulation_experiment(rng)
    numbers |= variance_experiment(rng, fig_dir)
    numbers |= roofline_experiment(fig_dir)
    numbers |= measured_experiment()
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
