"""
doc/tensor_cores.py: every number and figure of doc/tensor_cores.md (the matmul from
dev/cuda/matmul.py's version 3, an outer product on the CUDA cores, to versions 6-8 on the tensor
cores: mma.sync, ldmatrix, cp.async and the swizzle).

What it is: the tutorial's numbers, all on the CPU:
  1. the H100's measured table of dev/cuda/matmul.py (dev/results/, read here): versions 3, 4
     (cuBLAS) and 5 (cuBLASLt) in TFLOP/s at each shape, version 3's share of cuBLASLt, and the
     datasheet peaks of the CUDA cores and the tensor cores (llmc/mfu.py);
  2. the arithmetic of one mma and of one warp's k16 step in versions 3 and 6: FMAs per
     instruction, FMAs per byte read from shared memory;
  3. which lane holds which element of the mma's fragments, as the emulated device computes it
     (dev/cuda/tensor_core.py's functions on dev/cuda/tensor_core.cu, compiled by g++);
  4. shared-memory bank conflicts of ldmatrix: the passes (wavefronts) one 8x8 matrix needs with
     version 6's plain tile rows and version 7's XOR-swizzled ones, from the offset formulas of
     dev/cuda/matmul.cu (PlainOffset, SwizzledOffset) written out below; figure
     tensor_cores_swizzle.png;
  5. the pipeline's shared memory and the split of dweight's K sum at the model's shapes
     (dev/cuda/matmul.py's own tables and dweight_splits).
What it is not: a GPU run. The measured numbers are read from the tables `dev/cuda/matmul.py`
wrote on an H100, kept in dev/results/: MEASURED_TABLE versions 1-5 (the second session),
TENSOR_CORE_TABLE versions 5-8 (the fifth session's second call).

Run:
    python doc/tensor_cores.py
prints one `key = value` line per number the tutorial quotes and redraws
doc/tensor_cores_swizzle.png (a few seconds; the first run builds dev/cuda/tensor_core.cu for the
emulated device, ~30 s). tests/test_docs.py checks that doc/tensor_cores.md quotes every number
exactly as computed here.
"""

import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import ROOT, print_numbers, pyplot, save_figure  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "dev", "cuda"))
import matmul  # noqa: E402  (dev/cuda/matmul.py)
import tensor_core  # noqa: E402  (dev/cuda/tensor_core.py)

from llmc import cuda  # noqa: E402
from llmc.mfu import peak_flops  # noqa: E402

H100_NAME = "NVIDIA H100 80GB HBM3"
RESULTS = os.path.join(ROOT, "dev", "results")
# dev/cuda/matmul.py's table from the H100 (`make dev-cuda`, B = 8, T = 1024): versions 1-5
MEASURED_TABLE = os.path.join(RESULTS, "2026-11-26_nvidia-h100-80gb-hbm3_session2_matmul.md")
# the table of the GPU run with versions 5-8 (dev/results/2026-11-27_..._session5_call_b.sh)
TENSOR_CORE_TABLE = "2026-11-27_nvidia-h100-80gb-hbm3_issue36_layers_dev_cuda_matmul.md"
MEASURED_SHAPES = ("qkv", "fc", "fcproj")
CUBLAS, CUBLASLT = 4, 5                          # dev/cuda/matmul.py's library versions
LANES_SHOWN = (0, 1, 9, 31)                      # the lanes the tutorial's excerpt shows

MMA_M, MMA_N, MMA_K = 16, 8, 16                  # mma.m16n8k16
LDMATRIX_X4_BYTES = 4 * 8 * 16                   # four 8x8 matrices of 16-bit elements
BANKS, BANK_BYTES = 32, 4                        # shared memory: 32 banks of 4 bytes
CHUNK_BYTES, CHUNK_ELEMENTS = 16, 8              # one ldmatrix row: 16 bytes, 8 bf16
BANK_LINE_CHUNKS = BANKS * BANK_BYTES // CHUNK_BYTES   # 8 chunks of 16 bytes fill the 32 banks
BF16_BYTES, FP32_BYTES = 2, 4
D12 = dict(B=16, T=1024)                         # the shapes of dev/cuda/matmul.py
H100_SMS = 132
V3_THREAD_TILE = 8                               # matmul.cu V3_THREAD_ROWS = V3_THREAD_COLS


# ----------------------------------------------------------------------------
# 1. the measured table

def measured_tflops(path):
    """{(progression, version): best TFLOP/s over its block sizes} of a dev/cuda/matmul.py table
    (rows `| version | kernel | block | time (ms) | GB/s | % of copy BW | TFLOP/s | % of GEMM |`),
    and the measured cuBLAS GEMM (TFLOP/s) of its header."""
    best, section, gemm = {}, None, None
    for line in open(path, encoding="utf-8"):
        if line.startswith("- measured GEMM:"):
            gemm = float(line.split(":")[1].split()[0])
        elif line.startswith("### "):
            section = line.split()[1]
        elif section and line.startswith("| ") and line.split("|")[1].strip().isdigit():
            cells = [c.strip() for c in line.split("|")[1:-1]]
            key = (section, int(cells[0]))
            best[key] = max(best.get(key, 0.0), float(cells[6]))
    return best, gemm


def measured_experiment():
    """Versions 3, 4 and 5 on the H100 at GPT-2 124M's qkv, fc and fcproj (B = 8, T = 1024)."""
    best, gemm = measured_tflops(MEASURED_TABLE)

    def at(version):
        return [best[(f"matmul_forward_{shape}", version)] for shape in MEASURED_SHAPES]
    v3, v4, v5 = at(3), at(CUBLAS), at(CUBLASLT)
    share = [100 * a / b for a, b in zip(v3, v5)]
    bf16, fp32 = peak_flops(H100_NAME, "bf16", False) / 1e12, peak_flops(H100_NAME, "fp32", False) / 1e12
    numbers = {"v3_min_tflops": f"{min(v3):.1f}", "v3_max_tflops": f"{max(v3):.1f}",
               "cublas_min_tflops": f"{min(v4):.0f}", "cublas_max_tflops": f"{max(v4):.0f}",
               "cublaslt_min_tflops": f"{min(v5):.0f}", "cublaslt_max_tflops": f"{max(v5):.0f}",
               "v3_of_cublaslt_min": f"{min(share):.1f}", "v3_of_cublaslt_max": f"{max(share):.1f}",
               "gemm_tflops": f"{gemm:.0f}", "peak_bf16_tflops": f"{bf16:.0f}", "peak_fp32_tflops": f"{fp32:.1f}",
               "tensor_over_fp32": f"{bf16 / fp32:.1f}", "fp32_peak_of_cublaslt": f"{100 * fp32 / max(v5):.0f}"}
    for shape, a, b, c in zip(MEASURED_SHAPES, v3, v4, v5):
        numbers |= {f"{shape}_v3": f"{a:.1f}", f"{shape}_cublas": f"{b:.0f}", f"{shape}_cublaslt": f"{c:.0f}"}
    return numbers


def tensor_core_experiment():
    """Versions 6-8 and the libraries, best block size, TFLOP/s and % of cuBLASLt at every shape of
    TENSOR_CORE_TABLE (nothing while there is no such table)."""
    if TENSOR_CORE_TABLE is None:
        return {}
    best, _ = measured_tflops(os.path.join(RESULTS, TENSOR_CORE_TABLE))
    numbers = {}
    for (progression, version), tflops in best.items():
        if version in (3, CUBLAS, CUBLASLT, 6, 7, 8):
            name = progression.removeprefix("matmul_")
            numbers[f"{name}_v{version}_tflops"] = f"{tflops:.0f}"
            if (progression, CUBLASLT) in best:
                numbers[f"{name}_v{version}_of_lt"] = f"{100 * tflops / best[(progression, CUBLASLT)]:.0f}"
    return numbers


# ----------------------------------------------------------------------------
# 2. the arithmetic of an mma and of a warp's k16 step

def arithmetic_experiment():
    """FMAs per mma; per warp tile step: version 3's FMAs per byte of shared memory read against
    version 6's (4 + 4 ldmatrix.x4 feeding 4 x 8 mma)."""
    fmas_per_mma = MMA_M * MMA_N * MMA_K
    v3_fmas, v3_bytes = V3_THREAD_TILE * V3_THREAD_TILE, 2 * V3_THREAD_TILE * FP32_BYTES   # a thread's outer product
    tile = matmul.V6_TILE
    warp_m, warp_n = 64, 64                                                    # matmul.cu V6_WARP_ROWS, _COLS
    mmas = (warp_m // MMA_M) * (warp_n // MMA_N)
    loads = warp_m // MMA_M + warp_n // (2 * MMA_N)                            # A: one x4 per m16; B: one per two n8
    v6_fmas, v6_bytes = mmas * fmas_per_mma, loads * LDMATRIX_X4_BYTES
    return {"fmas_per_mma": f"{fmas_per_mma}", "mmas_per_step": f"{mmas}", "ldmatrix_per_step": f"{loads}",
            "v6_step_fmas": f"{v6_fmas:,}", "v6_step_bytes": f"{v6_bytes:,}",
            "v3_fmas_per_byte": f"{v3_fmas / v3_bytes:.0f}", "v6_fmas_per_byte": f"{v6_fmas / v6_bytes:.0f}",
            "v6_block_threads": f"{tile.threads}", "v6_block_rows": f"{tile.bm}", "v6_block_cols": f"{tile.bn}",
            "v6_slice": f"{tile.bk}"}


# ----------------------------------------------------------------------------
# 3. the fragments, as the emulated device computes them

def fragment_experiment():
    """The excerpt of `python dev/cuda/tensor_core.py --device cpu` the tutorial shows (lanes
    LANES_SHOWN of the A, B and C/D tables), as lines of text, and lane 9's elements."""
    previous = cuda.device()
    cuda.use_device("cpu")
    try:
        a_layout = tensor_core.a_fragment_layout()
        b_layout = tensor_core.b_fragment_layout()
        c_layout = tensor_core.d_fragment_layout(a_layout)
    finally:
        cuda.use_device(previous)
    numbers = {}
    for letter, layout, count in (("a", a_layout, 8), ("b", b_layout, 4), ("c", c_layout, 4)):
        for i in range(count):
            numbers[f"lane9_{letter}{i}"] = "({}, {})".format(*layout[9, i])
    return numbers, {"a": a_layout, "b": b_layout, "c": c_layout}


# ----------------------------------------------------------------------------
# 4. bank conflicts of ldmatrix, plain and swizzled

def plain_offset(row, chunk, chunks):
    """Element offset of chunk `chunk` of row `row` stored plainly (matmul.cu PlainOffset)."""
    return (row * chunks + chunk) * CHUNK_ELEMENTS


def swizzled_offset(row, chunk, chunks):
    """matmul.cu SwizzledOffset<CHUNKS>: the chunk position XORed with f(row), f(row) = (row /
    rows per 128-byte line) % period."""
    rows_per_line = 1 if chunks >= BANK_LINE_CHUNKS else BANK_LINE_CHUNKS // chunks
    period = BANK_LINE_CHUNKS if chunks >= BANK_LINE_CHUNKS else chunks
    return (row * chunks + (chunk ^ (row // rows_per_line) % period)) * CHUNK_ELEMENTS


def wavefronts(offsets):
    """Shared-memory passes one 8x8 ldmatrix matrix needs: its 8 rows of 16 bytes (element offsets
    given) are served together unless two distinct rows fall on the same 4 banks; then the most
    rows sharing one group of banks is the count of passes."""
    groups = [offset * BF16_BYTES // CHUNK_BYTES % BANK_LINE_CHUNKS for offset in offsets]
    return max(groups.count(g) for g in set(groups))


def worst_wavefronts(offset, rows, chunks):
    """The most passes any ldmatrix matrix of the tile needs: 8 consecutive rows from a multiple of
    8, one chunk."""
    return max(wavefronts([offset(r0 + i, c, chunks) for i in range(8)])
               for r0 in range(0, rows, 8) for c in range(chunks))


def bank_experiment(fig_dir):
    """Passes per ldmatrix matrix for the forward's tiles (rows of BK = 32: 4 chunks) and the
    backward's transposed ones (rows of 128 elements: 16 chunks), plain and swizzled; the figure."""
    k_major, mn_major = matmul.V7_TILE.bk // CHUNK_ELEMENTS, matmul.V7_TILE.bn // CHUNK_ELEMENTS
    numbers = {"chunks_per_row": f"{k_major}",
               "plain_passes": f"{worst_wavefronts(plain_offset, 128, k_major)}",
               "swizzled_passes": f"{worst_wavefronts(swizzled_offset, 128, k_major)}",
               "plain_passes_trans": f"{worst_wavefronts(plain_offset, matmul.V7_TILE.bk, mn_major)}",
               "swizzled_passes_trans": f"{worst_wavefronts(swizzled_offset, matmul.V7_TILE.bk, mn_major)}"}
    draw_swizzle(fig_dir, k_major)
    return numbers


def draw_swizzle(fig_dir, chunks):
    """8 rows of a (rows, 32) bf16 tile, 4 chunks each: the bank group of every chunk, plain and
    swizzled; the cells of logical chunk 0, which one ldmatrix matrix reads, outlined."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = plt.get_cmap("tab10")
    for ax, offset, title in ((axes[0], plain_offset, "version 6: plain rows"),
                              (axes[1], swizzled_offset, "version 7: XOR-swizzled rows")):
        for row in range(8):
            for chunk in range(chunks):
                address = offset(row, chunk, chunks) * BF16_BYTES
                group = address // CHUNK_BYTES % BANK_LINE_CHUNKS
                position = address // CHUNK_BYTES % chunks                  # where the chunk sits in its row
                read = chunk == 0
                ax.add_patch(plt.Rectangle((position, 7 - row), 1, 1, facecolor=colors(group),
                                           alpha=1.0 if read else 0.25, edgecolor="black", lw=2.5 if read else 0.5))
                ax.text(position + 0.5, 7.5 - row, f"k{chunk * CHUNK_ELEMENTS}\nbanks {4 * group}-{4 * group + 3}",
                        ha="center", va="center", fontsize=6.5)
        ax.set_xlim(0, chunks)
        ax.set_ylim(0, 8)
        ax.set_xticks([c + 0.5 for c in range(chunks)], [f"bytes {16 * c}-{16 * c + 15}" for c in range(chunks)],
                      fontsize=7)
        ax.set_yticks([7.5 - r for r in range(8)], [f"row {r}" for r in range(8)], fontsize=7)
        offsets = [offset(r, 0, chunks) for r in range(8)]
        groups = len({o * BF16_BYTES // CHUNK_BYTES % BANK_LINE_CHUNKS for o in offsets})
        passes = wavefronts(offsets)
        ax.set_title(f"{title}: chunk k0-7 of rows 0-7 lands in\n{groups} of the 8 groups of 4 banks: "
                     f"{passes} pass{'es' if passes > 1 else ''}", fontsize=9)
    fig.suptitle("ldmatrix reads one 16-byte chunk of 8 rows (64-byte rows of a (128, 32) bf16 tile)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, fig_dir, "tensor_cores_swizzle.png")


# ----------------------------------------------------------------------------
# 5. the pipeline's memory, dweight's split

def pipeline_experiment():
    """Shared memory per stage and in all, version 7 and version 8's two tiles; dweight's splits at
    the four layer shapes (B = 16, T = 1024) with version 8's 128 x 128 tiles on an H100."""
    v7 = matmul.V7_TILE
    numbers = {"v7_stages": f"{v7.stages}", "v7_stage_kib": f"{v7.shared_bytes // v7.stages // 1024}",
               "v7_kib": f"{v7.shared_bytes // 1024}", "v6_kib": f"{(v7.bm + v7.bn) * v7.bk * BF16_BYTES // 1024}"}
    for threads, tile in matmul.V8_TILES.items():
        numbers[f"v8_{threads}_kib"] = f"{tile.shared_bytes // 1024}"
        numbers[f"v8_{threads}_stages"] = f"{tile.stages}"
    tile = matmul.V8_TILES[128]
    N = D12["B"] * D12["T"]
    slots = H100_SMS * matmul.V8_BLOCKS_PER_SM[128]
    for shape, (C, OC) in matmul.SHAPES.items():
        tiles = matmul.tile_count(tile, OC, C)
        splits, per_split = matmul.dweight_splits(tiles, N // tile.bk, slots, OC * C * FP32_BYTES)
        numbers |= {f"dweight_{shape}_tiles": f"{tiles}", f"dweight_{shape}_splits": f"{splits}"}
    numbers["k_tiles"] = f"{N // tile.bk}"
    numbers["h100_slots"] = f"{slots}"
    return numbers


# ----------------------------------------------------------------------------
# the tutorial's numbers

def compute(fig_dir):
    """Run every experiment; save the figure into fig_dir; return {key: formatted number}."""
    numbers = {}
    numbers |= measured_experiment()
    numbers |= tensor_core_experiment()
    numbers |= arithmetic_experiment()
    numbers |= fragment_experiment()[0]
    numbers |= bank_experiment(fig_dir)
    numbers |= pipeline_experiment()
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
