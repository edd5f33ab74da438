"""
doc/flash_attention.py: every number doc/flash_attention.md quotes, computed here: the H100 timings
read from the recorded tables in dev/results/, the mma fragment layouts observed on the emulated
device (dev/cuda/tensor_core.py's one-warp kernels), the shared-memory and FLOP arithmetic of the
kernels' tile shapes (llmc.attention.FLASH_TILES), and the bank groups of the swizzle.

What it is not: a benchmark (dev/cuda/attention.py times the kernels) or a test of the kernels
(tests/test_flash_attention_host.py runs them against gpt2_cpu.py).

Run (a few seconds; the first run builds dev/cuda/tensor_core.cu with g++):
    python doc/flash_attention.py
prints each number of the tutorial with its key.
"""

import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "dev", "cuda"))

from llmc import attention, cuda  # noqa: E402

RESULTS = os.path.join(ROOT, "dev", "results")
# the H100 table of the previous kernel (dev/cuda/attention.py's version 3 then, wmma tiles)
RECORDED_LOG = os.path.join(RESULTS, "2026-11-26_nvidia-h100-80gb-hbm3_session2_dev-cuda.log")
# the tables of the tensor-core kernels from the H100 (the fifth session's second call: its 124M
# and gqa tables)
NEW_TABLES = os.path.join(RESULTS, "*_issue37_*dev_cuda_attention.md")
SHAPE_124M = dict(B=16, T=1024, NH=12, HS=64)
CUDNN_VERSION = 4
LANES = 32
BANK_GROUP_BYTES = 16          # 32 banks x 4 bytes = 8 groups of one 16-byte chunk
BANK_GROUPS = 8


# ----------------------------------------------------------------------------
# recorded tables

def timing_table(path, progression):
    """{version: (ms, TFLOP/s)} of the bf16 table `### <progression> [bf16], ...` in a results file
    written by dev/cuda/common.py (the first row of each version: the flash versions have one)."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"### {progression} [bf16]"))
    table = {}
    for line in lines[start + 1:]:
        if line.startswith("### "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            table.setdefault(int(cells[0]), (float(cells[3]), float(cells[6])))
    return table


def recorded_numbers():
    """The previous kernel against cuDNN and PyTorch at GPT-2 124M's shape."""
    table = timing_table(RECORDED_LOG, "attention_forward")
    old, cudnn, sdpa = table[3][0], table[CUDNN_VERSION][0], table[5][0]
    return {"old_fwd_ms": f"{old:.2f}", "cudnn_fwd_ms": f"{cudnn:.3f}", "sdpa_fwd_ms": f"{sdpa:.3f}",
            "old_vs_cudnn": f"{old / cudnn:.1f}", "cudnn_fwd_tflops": f"{table[CUDNN_VERSION][1]:.0f}",
            "old_fwd_tflops": f"{table[3][1]:.0f}", "target_fwd_ms": f"{1.3 * cudnn:.3f}"}


def new_numbers():
    """From the recorded runs of the tensor-core kernels, if there are any: each version's time and
    its ratio to cuDNN's in the same run, for every progression timed (a later file, by name,
    replaces an earlier one's table of the same progression)."""
    numbers = {}
    for progression, short in (("attention_forward", "fwd"), ("attention_backward", "bwd"),
                               ("attention_forward_gqa", "fwd_gqa"), ("attention_backward_gqa", "bwd_gqa")):
        table = None
        for path in sorted(glob.glob(NEW_TABLES)):
            try:
                table = timing_table(path, progression)
            except StopIteration:           # not in this file
                pass
        if table is None:
            continue
        for version, (ms, _) in table.items():
            numbers[f"{short}_v{version}_ms"] = f"{ms:.3f}"
            if CUDNN_VERSION in table:
                numbers[f"{short}_v{version}_vs_cudnn"] = f"{ms / table[CUDNN_VERSION][0]:.2f}"
    return numbers


# ----------------------------------------------------------------------------
# the fragments, observed on the emulated device

def repack_numbers():
    """The mma accumulator (C) layout against the A layout, both observed (dev/cuda/tensor_core.py):
    for how many lanes C's elements c0..c3 of n-tiles 0 and 1 sit at A's a0..a7 positions (k for
    column), and lane 5's places as an example."""
    import tensor_core                      # dev/cuda/tensor_core.py
    before = cuda.device()
    cuda.use_device("cpu")
    try:
        a = tensor_core.a_fragment_layout()
        c = tensor_core.d_fragment_layout(a)
    finally:
        cuda.use_device(before)
    # a0, a1 = (c0, c1) of n-tile 0; a2, a3 = (c2, c3) of n-tile 0; a4..a7 the same of n-tile 1 (col + 8)
    matches = sum(all(a[lane, i] == (c[lane, i % 4][0], c[lane, i % 4][1] + 8 * (i // 4)) for i in range(8))
                  for lane in range(LANES))
    lane = 5
    return {"repack_lanes": str(matches),
            "lane5_c": "  ".join(f"c{i} {c[lane, i]}" for i in range(4)),
            "lane5_a": "  ".join(f"a{i} {a[lane, i]}" for i in range(8))}


# ----------------------------------------------------------------------------
# shared memory: the swizzle's bank groups, the tiles' bytes

def bank_groups(rows, chunk, chunks_per_row, swizzled):
    """The 16-byte bank group (0..7) of logical chunk `chunk` of each of `rows` (rows of
    chunks_per_row chunks, kernels/flash_attention.cuh's SharedTile: chunk c of row r at c ^ f(r))."""
    per_line = max(1, BANK_GROUPS // chunks_per_row)
    span = min(BANK_GROUPS, chunks_per_row)
    groups = []
    for r in rows:
        physical = chunk ^ ((r // per_line) % span) if swizzled else chunk
        groups.append((r * chunks_per_row + physical) % BANK_GROUPS)
    return groups


def shared_memory_numbers():
    """The bytes of each kernel's tiles, from llmc.attention's tables."""
    fwd64, dkdv64, dq64 = attention.FLASH_TILES["bf16", 64]
    fwd128, dkdv128, dq128 = attention.FLASH_TILES["bf16", 128]
    kib = 1024
    chunks = 64 * 2 // BANK_GROUP_BYTES                                # HS = 64 bf16: 8 chunks a row
    plain = bank_groups(range(8), 0, chunks, False)
    swizzled = bank_groups(range(8), 0, chunks, True)
    return {"fwd64_rows": str(fwd64.rows), "fwd64_keys": str(fwd64.keys),
            "fwd64_kib": f"{fwd64.shared_bytes(64, 2) / kib:.0f}",
            "fwd128_rows": str(fwd128.rows), "fwd128_kib": f"{fwd128.shared_bytes(128, 2) / kib:.0f}",
            "dkdv64_keys": str(dkdv64.keys), "dkdv64_queries": str(dkdv64.queries),
            "dkdv64_kib": f"{dkdv64.shared_bytes(64, 2) / kib:.1f}", "dq64_rows": str(dq64.rows),
            "dq64_keys": str(dq64.keys), "dq64_kib": f"{dq64.shared_bytes(64, 2) / kib:.0f}",
            "dkdv128_kib": f"{dkdv128.shared_bytes(128, 2) / kib:.1f}", "dq128_kib": f"{dq128.shared_bytes(128, 2) / kib:.0f}",
            "plain_groups": " ".join(map(str, plain)), "plain_distinct": str(len(set(plain))),
            "swizzled_groups": " ".join(map(str, swizzled)), "swizzled_distinct": str(len(set(swizzled)))}


# ----------------------------------------------------------------------------
# registers and FLOPs

def register_numbers():
    """What each warp keeps in registers at HS = 64 (bf16 forward, two row tiles of 16 rows):
    32-bit registers per lane of Q's fragments, S's accumulators (64 keys) and O's."""
    fwd = attention.FLASH_TILES["bf16", 64][0]
    HS, rows = 64, fwd.m_tiles * 16
    q = rows * HS // 2 // LANES            # bf16 pairs
    s = rows * fwd.keys // LANES
    o = rows * HS // LANES
    return {"reg_q": str(q), "reg_s": str(s), "reg_o": str(o), "reg_sum": str(q + s + o)}


def flop_numbers():
    """FLOPs at the 124M shape (FlashAttention-2's causal convention: dev/cuda/attention.py)."""
    B, T, NH, HS = (SHAPE_124M[k] for k in ("B", "T", "NH", "HS"))
    forward = 4 * B * NH * T * T * HS // 2
    return {"fwd_gflop": f"{forward / 1e9:.1f}", "bwd_gflop": f"{2.5 * forward / 1e9:.1f}",
            "ours_bwd_gflop": f"{3.5 * forward / 1e9:.1f}", "bwd_extra": f"{7 / 5:.1f}"}


def compute(fig_dir):
    """Every number of doc/flash_attention.md ({key: text}); it draws no figures."""
    numbers = {}
    for part in (recorded_numbers, new_numbers, repack_numbers, shared_memory_numbers, register_numbers, flop_numbers):
        numbers.update(part())
    return numbers


if __name__ == "__main__":
    for key, value in compute(os.path.dirname(os.path.abspath(__file__))).items():
        print(f"{key:20s} {value}")
