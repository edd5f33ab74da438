"""kernels/flash_attention.cu run on the CPU (the emulated CUDA device, llmc/emulator/) through
attention.flash_attention_forward / _backward, checked against gpt2_cpu.py in fp32 and bf16.

What it checks: out, lse, D and dqkv against float64 references at five shapes (tails of both
tiles, a single query, one warp per block); that the dk/dv kernel writes only dk's and dv's
columns of dqkv and the dq kernel only dq's (run one at a time on a NaN-filled dqkv); and that two
runs are bitwise equal. Data races: `make sanitize` runs these kernels under ThreadSanitizer, and
tests/test_emulator.py shows that a missing barrier is caught there. The bf16 build runs the
kernel's scalar tile operations (the emulated device has no tensor cores) under the same tile
algorithm and tile sizes.

Run: python -m pytest -q tests/test_flash_attention_host.py   (seconds once the kernels are built)
"""

import math

import numpy as np
import pytest

import gpt2_cpu
from llmc import attention, cuda
from llmc.check import TOLERANCES, check_tensor
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

TOLERANCE = {"fp32": TOLERANCES["kernel_fp32"]["attention"], "bf16": (3e-2, 5e-2)}   # bf16: cuda_bf16's row

# (B, T, NH, HS). fp32 tiles (owned, streamed): HS 16, 32 -> (64, 32); 64 -> (32, 32); 128 -> (16, 16)
SHAPES = [
    (2, 64, 2, 16),     # one owned block per head, two streamed key blocks, two heads and batches
    (1, 70, 2, 64),     # T not a multiple of either tile: a warp whose 16 rows all lie past T
    (1, 1, 1, 64),      # a single query: every tile is all tail
    (1, 130, 1, 32),    # three owned blocks, five streamed, tail of 2 rows
    (1, 37, 2, 128),    # one warp per block (fp32), 16 x 16 tiles
]
SHAPE_ID = "B{}_T{}_NH{}_HS{}".format


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setattr(cuda, "_device", "cpu")


def rounded(x, precision):
    """x rounded to floatX (as float32) and its floatX storage."""
    if precision == "bf16":
        bits = float32_to_bfloat16_bits(x)
        return bfloat16_bits_to_float32(bits), bits
    return x.astype(np.float32), x.astype(np.float32)


def from_floatX(x, precision):
    return bfloat16_bits_to_float32(x) if precision == "bf16" else x


def causal_logsumexp(qkv, NH):
    """lse (B,NH,T) = log sum_{j<=t} exp(q_t . k_j / sqrt(HS)), float64, written out independently
    of gpt2_cpu: the max-shifted log-sum-exp of the masked scaled scores."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    q, k, _ = (qkv.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4))             # each (B,NH,T,HS)
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(HS)                         # (B,NH,T,T)
    scores[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    top = scores.max(axis=-1)                                                      # (B,NH,T)
    return top + np.log(np.exp(scores - top[..., None]).sum(axis=-1))


def run_flash(precision, B, T, NH, HS, seed=0):
    """Forward, then the backward's three kernels one at a time (so that what each writes shows);
    returns the rounded inputs and every output as float32 host arrays."""
    cp, X = cuda.cupy(), cuda.FLOATX_DTYPES[precision]
    C = NH * HS
    rng = np.random.default_rng(seed)
    qkv, qkv_stored = rounded(rng.standard_normal((B, T, 3 * C)).astype(np.float32), precision)
    dout, dout_stored = rounded(rng.standard_normal((B, T, C)).astype(np.float32), precision)
    d_qkv, d_dout = cp.asarray(qkv_stored), cp.asarray(dout_stored)
    out, lse = cp.empty((B, T, C), X), cp.empty((B, NH, T), np.float32)
    dqkv, D = cp.empty((B, T, 3 * C), X), cp.empty((B, NH, T), np.float32)       # NaN until written
    attention.flash_attention_forward(out, lse, d_qkv, B, T, C, NH)
    grid, block = attention.flash_attention_launch(precision, HS, B, T, NH)
    _, dkdv_kernel, dq_kernel = attention.FLASH_ATTENTION_KERNELS[HS]
    scalars = (np.int32(B), np.int32(T), np.int32(NH))
    cuda.launch("flash_attention", precision, "flash_attention_backward_preprocess", cuda.elementwise_grid(B * T * NH),
                cuda.BLOCK_SIZE, (D, d_dout, out, *scalars, np.int32(HS)))
    cuda.launch("flash_attention", precision, dkdv_kernel, grid, block, (dqkv, d_dout, d_qkv, lse, D) + scalars)
    after_dkdv = from_floatX(dqkv.get(), precision)
    cuda.launch("flash_attention", precision, dq_kernel, grid, block, (dqkv, d_dout, d_qkv, lse, D) + scalars)
    return qkv, dout, {"out": from_floatX(out.get(), precision), "lse": lse.get(), "D": D.get(),
                       "dqkv_dkdv": after_dkdv, "dqkv": from_floatX(dqkv.get(), precision)}


def test_backward_launch_order_is_the_launchers():
    # run_flash launches the backward's kernels itself: they must be the ones, with the same
    # arguments, that attention.flash_attention_backward launches
    launched = []
    original = cuda.launch
    cuda.launch = lambda file, precision, name, grid, block, args: launched.append((name, grid, block, len(args)))
    try:
        cp = cuda.cupy()
        B, T, NH, HS = 1, 5, 1, 16
        X = np.float32
        attention.flash_attention_backward(cp.empty((B, T, 3 * HS), X), cp.empty((B, NH, T), X), cp.empty((B, T, HS), X),
                                           cp.empty((B, T, HS), X), cp.empty((B, T, 3 * HS), X),
                                           cp.empty((B, NH, T), X), B, T, HS, NH)
    finally:
        cuda.launch = original
    grid, block = attention.flash_attention_launch("fp32", HS, B, T, NH)
    _, dkdv, dq = attention.FLASH_ATTENTION_KERNELS[HS]
    assert launched == [("flash_attention_backward_preprocess", cuda.elementwise_grid(B * T * NH), cuda.BLOCK_SIZE, 7),
                        (dkdv, grid, block, 8), (dq, grid, block, 8)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: SHAPE_ID(*s))
def test_forward_and_backward_on_the_cpu(precision, shape):
    B, T, NH, HS = shape
    C = NH * HS
    atol, rtol = TOLERANCE[precision]
    qkv, dout, run = run_flash(precision, *shape)
    qkv64, dout64 = qkv.astype(np.float64), dout.astype(np.float64)
    out_ref, att = gpt2_cpu.attention_forward(qkv64, NH)
    assert check_tensor(run["out"], out_ref, f"out {shape}", atol, rtol)
    assert check_tensor(run["lse"], causal_logsumexp(qkv64, NH), f"lse {shape}", atol, rtol)
    dqkv_ref = gpt2_cpu.attention_backward(dout64, qkv64, att, NH)
    D_ref = (dout64 * run["out"]).reshape(B, T, NH, HS).sum(axis=-1).transpose(0, 2, 1)   # (B,NH,T), of the stored out
    assert check_tensor(run["D"], D_ref, f"D {shape}", atol, rtol)
    assert check_tensor(run["dqkv"], dqkv_ref, f"dqkv {shape}", 10 * atol, 10 * rtol)
    # the dk/dv kernel writes dk and dv (= what dqkv ends with) and leaves dq's columns alone
    after_dkdv, final = run["dqkv_dkdv"], run["dqkv"]
    assert np.isnan(after_dkdv[..., :C]).all(), "the dk/dv kernel wrote into dq's columns"
    assert np.array_equal(after_dkdv[..., C:], final[..., C:]), "the dq kernel changed dk or dv"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: SHAPE_ID(*s))
def test_two_runs_bitwise_equal(precision, shape):
    _, _, first = run_flash(precision, *shape)
    _, _, second = run_flash(precision, *shape)
    assert not np.isnan(first["dqkv"]).any()
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name
