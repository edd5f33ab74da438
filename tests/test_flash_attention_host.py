"""kernels/flash_attention.cu run on the CPU (the emulated CUDA device, llmc/emulator/) through
llmc/attention.py's launchers, checked against gpt2_cpu.py (and llama3_cpu.py's key/value repeat
for grouped-query attention) in fp32 and bf16. The bf16 build is the code a GPU runs: its products
are mma.sync.m16n8k16 with ldmatrix and cp.async, executed by the emulated device's instructions.

What it checks:
- out, lse, D and dqkv against float64 references at shapes that reach every tail: T not a
  multiple of any tile, a single query, several query and key blocks, a warp whose rows all lie
  past T, every head size (16, 32, 64, 128), and key/value heads shared by 2 and 4 query heads;
- that the dk/dv kernel writes only the k and v columns of dqkv and the dq kernel only the q
  columns (run one at a time on a NaN-filled dqkv), and two runs are bitwise equal;
- the launchers' tile table (llmc.attention.FLASH_TILES) against the typedefs of
  kernels/flash_attention.cu (and dev/cuda/attention.py's DEV_TILES against dev/cuda/attention.cu),
  the grids and dynamic shared memory worked out by hand, and that a kernel above 48 KiB runs only
  after the opt-in the launcher makes;
- ptxas (through NVRTC, no GPU) reports no register spills in the bf16 kernels for sm_80 and sm_90
  and in the fp32 ones for sm_90.
Data races: `make sanitize` runs these kernels under ThreadSanitizer.

Run: python -m pytest -q tests/test_flash_attention_host.py   (about a minute on 2 cores, most of
it g++ building the two precisions once)
"""

import math
import os
import re

import numpy as np
import pytest

import gpt2_cpu
import llama3_cpu
from llmc import attention, cuda
from llmc.check import TOLERANCES, check_tensor
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from nvrtc_marks import nc, needs_nvrtc  # noqa: E402  (dev/cuda/nvrtc_compile.py; skips without NVRTC)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = {"fp32": TOLERANCES["kernel_fp32"]["attention"], "bf16": (3e-2, 5e-2)}   # bf16: cuda_bf16's row

# (B, T, NH, NKV, HS). bf16 tiles (forward rows, keys; dk/dv keys, queries; dq rows, keys):
# HS 16: (64, 32; 64, 32; 64, 32), 32: (64, 64; 64, 64; 64, 64), 64: (128, 64; 64, 32; 64, 64),
# 128: (64, 64; 64, 32; 64, 64); fp32 all (64, 32; 64, 32; 64, 32)
SHAPES = [
    (2, 64, 2, 2, 16),     # two key tiles of 32, two heads and batches
    (1, 70, 2, 2, 64),     # T not a multiple of any tile; bf16: warp 3's rows (96..127) all past T
    (1, 1, 1, 1, 64),      # a single query: every tile is all tail
    (1, 130, 1, 1, 32),    # three query blocks, three key tiles, a tail of 2 rows
    (1, 37, 2, 2, 128),    # Llama 3 8B's head size
    (1, 45, 4, 2, 32),     # grouped-query attention: each kv head shared by 2 query heads
    (1, 33, 4, 1, 16),     # ... by 4
]
SHAPE_ID = "B{}_T{}_NH{}_NKV{}_HS{}".format


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


def repeated(qkv, NH, NKV):
    """(B,T,(NH+2NKV)*HS) -> GPT-2's (B,T,3C) with every kv head repeated for its query heads
    (llama3_cpu.repeat_kv_forward): the input of gpt2_cpu's attention."""
    q, k, v = llama3_cpu.split_qkv(qkv, NH, NKV)
    return llama3_cpu.merge_heads(q, llama3_cpu.repeat_kv_forward(k, NH // NKV), llama3_cpu.repeat_kv_forward(v, NH // NKV))


def grouped(dqkv, NH, NKV):
    """The gradient of `repeated`'s input from that of its output (llama3_cpu.repeat_kv_backward)."""
    dq, dk, dv = llama3_cpu.split_qkv(dqkv, NH, NH)
    return llama3_cpu.merge_heads(dq, llama3_cpu.repeat_kv_backward(dk, NH // NKV), llama3_cpu.repeat_kv_backward(dv, NH // NKV))


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


def run_flash(precision, B, T, NH, NKV, HS, seed=0):
    """The forward, then the backward's three kernels one at a time (so that what each writes
    shows), with llmc.attention's own grids and shared memory; returns the rounded inputs and every
    output as float32 host arrays."""
    cp, X = cuda.cupy(), cuda.FLOATX_DTYPES[precision]
    C, QKV = NH * HS, (NH + 2 * NKV) * HS
    rng = np.random.default_rng(seed)
    qkv, qkv_stored = rounded(rng.standard_normal((B, T, QKV)).astype(np.float32), precision)
    dout, dout_stored = rounded(rng.standard_normal((B, T, C)).astype(np.float32), precision)
    d_qkv, d_dout = cp.asarray(qkv_stored), cp.asarray(dout_stored)
    out, lse = cp.empty((B, T, C), X), cp.empty((B, NH, T), np.float32)
    dqkv, D = cp.empty((B, T, QKV), X), cp.empty((B, NH, T), np.float32)         # NaN until written
    attention.flash_attention_forward(out, lse, d_qkv, B, T, C, NH, NKV)
    _, dkdv_tiles, dq_tiles = attention.FLASH_TILES[precision, HS]
    _, dkdv_name, dq_name = attention.FLASH_ATTENTION_KERNELS[HS]
    itemsize = np.dtype(X).itemsize
    args = (dqkv, d_dout, d_qkv, lse, D, np.int32(B), np.int32(T), np.int32(NH), np.int32(NKV))
    cuda.launch("flash_attention", precision, "flash_attention_backward_preprocess", cuda.elementwise_grid(B * T * NH),
                cuda.BLOCK_SIZE, (D, d_dout, out, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))
    grid, block, shared = attention.flash_dkdv_launch(dkdv_tiles, HS, itemsize, B, T, NKV)
    attention.launch_with_shared_memory(attention.flash_kernel(precision, dkdv_name), grid, block, args, shared)
    after_dkdv = from_floatX(dqkv.get(), precision)
    grid, block, shared = attention.flash_dq_launch(dq_tiles, HS, itemsize, B, T, NH)
    attention.launch_with_shared_memory(attention.flash_kernel(precision, dq_name), grid, block, args, shared)
    return qkv, dout, {"out": from_floatX(out.get(), precision), "lse": lse.get(), "D": D.get(),
                       "dqkv_dkdv": after_dkdv, "dqkv": from_floatX(dqkv.get(), precision)}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: SHAPE_ID(*s))
def test_forward_and_backward_on_the_cpu(precision, shape):
    B, T, NH, NKV, HS = shape
    C = NH * HS
    atol, rtol = TOLERANCE[precision]
    qkv, dout, run = run_flash(precision, *shape)
    full = repeated(qkv.astype(np.float64), NH, NKV)                               # (B,T,3C)
    dout64 = dout.astype(np.float64)
    out_ref, att = gpt2_cpu.attention_forward(full, NH)
    assert check_tensor(run["out"], out_ref, f"out {shape}", atol, rtol)
    assert check_tensor(run["lse"], causal_logsumexp(full, NH), f"lse {shape}", *TOLERANCE["fp32"])  # fp32 arithmetic
    dqkv_ref = grouped(gpt2_cpu.attention_backward(dout64, full, att, NH), NH, NKV)
    D_ref = (dout64 * run["out"]).reshape(B, T, NH, HS).sum(axis=-1).transpose(0, 2, 1)   # (B,NH,T), of the stored out
    assert check_tensor(run["D"], D_ref, f"D {shape}", *TOLERANCE["fp32"])
    assert check_tensor(run["dqkv"], dqkv_ref, f"dqkv {shape}", 10 * atol, 10 * rtol)
    # the dk/dv kernel writes dk and dv (= what dqkv ends with) and leaves dq's columns alone
    after_dkdv, final = run["dqkv_dkdv"], run["dqkv"]
    assert np.isnan(after_dkdv[..., :C]).all(), "the dk/dv kernel wrote into dq's columns"
    assert np.array_equal(after_dkdv[..., C:], final[..., C:]), "the dq kernel changed dk or dv"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[5]], ids=lambda s: SHAPE_ID(*s))
def test_two_runs_bitwise_equal(precision, shape):
    _, _, first = run_flash(precision, *shape)
    _, _, second = run_flash(precision, *shape)
    assert not np.isnan(first["dqkv"]).any()
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name


def test_launchers_run_the_kernels_they_check():
    # the backward launcher: the preprocess, then dk/dv and dq with their own grids and shared memory
    launched = []
    original = attention.launch_with_shared_memory
    attention.launch_with_shared_memory = lambda kernel, grid, block, args, shared: launched.append(
        (kernel.name, grid, block, len(args), shared))
    try:
        cp = cuda.cupy()
        B, T, NH, NKV, HS = 2, 100, 4, 2, 64
        C, QKV, X = NH * HS, (NH + 2 * NKV) * HS, np.float32
        attention.flash_attention_forward(cp.empty((B, T, C), X), cp.empty((B, NH, T), X), cp.empty((B, T, QKV), X),
                                          B, T, C, NH, NKV)
        attention.flash_attention_backward(cp.empty((B, T, QKV), X), cp.empty((B, NH, T), X), cp.empty((B, T, C), X),
                                           cp.empty((B, T, C), X), cp.empty((B, T, QKV), X),
                                           cp.empty((B, NH, T), X), B, T, C, NH, NKV)
    finally:
        attention.launch_with_shared_memory = original
    # fp32 HS 64: forward rows 64, keys 32: (64 + 2*2*32) rows * 64 * 4 bytes; dk/dv keys 64,
    # queries 32: (2*64 + 2*2*32) * 256 + 2*2*32*4; dq rows 64, keys 32: (2*64 + 2*2*32) * 256
    assert launched == [("flash_attention_forward_hs64", (B * NH, 2), 128, 7, 192 * 256),
                        ("flash_attention_backward_dkdv_hs64", (B * NKV, 2), 128, 9, 256 * 256 + 512),
                        ("flash_attention_backward_dq_hs64", (B * NH, 2), 128, 9, 256 * 256)]


def test_tile_table_matches_the_kernels():
    with open(os.path.join(ROOT, "kernels", "flash_attention.cu"), encoding="utf-8") as f:
        source = f.read()
    bf16, fp32 = source.split("#if defined(ENABLE_BF16)\n", 1)[1].split("#endif", 1)[0].split("#else\n")
    kinds = {"Forward": 0, "Dkdv": 1, "Dq": 2}
    for precision, text in (("bf16", bf16), ("fp32", fp32)):
        typedefs = re.findall(r"typedef (Forward|Dkdv|Dq)Tiles<([\d, ]+)> \1TilesHS(\d+);", text)
        assert len(typedefs) == 3 * len(attention.FLASH_HEAD_SIZES)
        for kind, values, HS in typedefs:
            HS_in, *shape = (int(v) for v in values.split(","))
            assert HS_in == int(HS)
            tiles = attention.FLASH_TILES[precision, int(HS)][kinds[kind]]
            assert list(shape) == list(tiles.__dict__.values()), (precision, kind, HS)


def test_dev_tile_table_matches_the_dev_kernels():
    # dev/cuda/attention.py's DEV_TILES against dev/cuda/attention.cu's typedefs (versions 6-11)
    import attention as progression                               # dev/cuda/attention.py (nvrtc_marks' path)
    with open(os.path.join(ROOT, "dev", "cuda", "attention.cu"), encoding="utf-8") as f:
        source = f.read()
    block = source[source.index("typedef ForwardTiles<64, 4, 1, 64, 1, false> ForwardV6HS64;"):]
    bf16, fp32 = block.split("#endif", 1)[0].split("#else\n")
    kinds = {"Forward": 0, "Dkdv": 1, "Dq": 2}
    for precision, text in (("bf16", bf16), ("fp32", fp32)):
        typedefs = re.findall(r"typedef (Forward|Dkdv|Dq)Tiles<([\w, ]+)> \1V(\d+)HS64;", text)
        assert len(typedefs) == sum(tiles is not None for (p, _), value in progression.DEV_TILES.items()
                                    if p == precision for tiles in value)
        for kind, values, number in typedefs:
            HS, *shape = (v.strip() for v in values.split(","))
            assert int(HS) == progression.DEV_HEAD_SIZE
            numbers = [int(v) for v in shape if v.isdigit()]      # a trailing `false`: plain (unswizzled) tiles
            tiles = progression.DEV_TILES[precision, int(number)][kinds[kind]]
            assert numbers == list(tiles.__dict__.values()), (precision, kind, number)


@needs_nvrtc
@pytest.mark.parametrize("precision,arch", [("bf16", "sm_80"), ("bf16", "sm_90"), ("fp32", "sm_90")])
def test_no_register_spills(monkeypatch, precision, arch):
    # ptxas: every kernel of kernels/flash_attention.cu keeps its fragments and accumulators in
    # registers (at most 255: O, S and Q's fragments are 160 of them at HS = 64 in bf16)
    monkeypatch.setattr(cuda, "_device", "cuda")                  # NVRTC's options, with the CUDA headers
    usage = nc.resource_usage(os.path.join(ROOT, "kernels", "flash_attention.cu"), precision, arch)
    assert len(usage) == 1 + 3 * len(attention.FLASH_HEAD_SIZES)
    for name, (registers, _, spill_stores, spill_loads) in usage.items():
        assert registers <= 255 and spill_stores == 0 and spill_loads == 0, (name, usage[name])


def test_grids_and_shared_memory_by_hand():
    fwd, dkdv, dq = attention.FLASH_TILES["bf16", 64]
    # GPT-2 124M, B = 16, T = 1024, NH = 12: 128 query rows a block -> 8 blocks a head; Q (128 rows)
    # and two buffers of K and V (64 rows), 64 bf16 each: 384 * 128 bytes = 48 KiB, no opt-in
    assert attention.flash_forward_launch(fwd, 64, 2, 16, 1024, 12) == ((192, 8), 128, 49152)
    assert attention.flash_dkdv_launch(dkdv, 64, 2, 16, 1024, 12) == ((192, 16), 128, (128 + 128) * 128 + 512)
    assert attention.flash_dq_launch(dq, 64, 2, 16, 1024, 12) == ((192, 16), 128, (128 + 256) * 128)
    # Llama 3 8B, HS = 128, NH = 32, NKV = 8: the dk/dv grid runs over kv heads
    fwd, dkdv, dq = attention.FLASH_TILES["bf16", 128]
    assert attention.flash_forward_launch(fwd, 128, 2, 1, 1000, 32) == ((32, 16), 128, (64 + 256) * 256)
    assert attention.flash_dkdv_launch(dkdv, 128, 2, 1, 1000, 8) == ((8, 16), 128, (128 + 128) * 256 + 512)
    assert [HS for HS in range(1, 257) if attention.flash_attention_supported(HS)] == [16, 32, 64, 128]


def test_above_48_kib_needs_the_opt_in():
    # bf16 HS = 128's forward takes 80 KiB: a launch without the kernel's opt-in is refused, as
    # CUDA refuses it; the launcher opts in and the kernel then runs
    cp = cuda.cupy()
    B, T, NH, HS = 1, 5, 1, 128
    fwd = attention.FLASH_TILES["bf16", 128][0]
    grid, block, shared = attention.flash_forward_launch(fwd, HS, 2, B, T, NH)
    assert shared == 80 * 1024
    X = cuda.FLOATX_DTYPES["bf16"]
    out, lse, qkv = cp.empty((B, T, HS), X), cp.empty((B, NH, T), np.float32), cp.zeros((B, T, 3 * HS), X)
    args = (out, lse, qkv, np.int32(B), np.int32(T), np.int32(NH), np.int32(NH))
    kernel = cuda.load_module("flash_attention", "bf16").get_function("flash_attention_forward_hs128")
    kernel.max_dynamic_shared_size_bytes = attention.FLASH_DEFAULT_SHARED_BYTES     # as a fresh process has it
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        kernel(grid, (block,), args, shared_mem=shared)
    attention.launch_with_shared_memory(kernel, grid, block, args, shared)
    assert kernel.max_dynamic_shared_size_bytes == shared
    assert np.array_equal(from_floatX(out.get(), "bf16"), np.zeros((B, T, HS), np.float32))   # v = 0: out = 0


def test_launchers_refuse_bad_layouts():
    cp = cuda.cupy()
    X = np.float32
    with pytest.raises(ValueError, match="no kernel for head size 48"):
        attention.flash_attention_forward(cp.empty((1, 4, 48), X), cp.empty((1, 1, 4), X), cp.empty((1, 4, 144), X),
                                          1, 4, 48, 1)
    with pytest.raises(ValueError, match="NH=3 is not a multiple of NKV=2"):
        attention.flash_attention_forward(cp.empty((1, 4, 48), X), cp.empty((1, 3, 4), X), cp.empty((1, 4, 112), X),
                                          1, 4, 48, 3, 2)
