"""The tensor-core and asynchronous-copy instructions (kernels/tensor_core.cuh) on the emulated device
(llmc/emulator/shim/tensor_cores.h), checked against the PTX ISA's tables.

The layouts below are written from NVIDIA's "Parallel Thread Execution ISA" text, not from the
emulator's code: for mma.m16n8k16 with .bf16 A and B and .f32 C/D, section "Matrix Fragments for
mma.m16n8k16 with floating point type" (groupID = %laneid >> 2, threadID_in_group = %laneid % 4,
and the row/col formulas of A, B and C/D quoted in isa_a, isa_b, isa_c); for ldmatrix, section
"Warp-level matrix load instruction: ldmatrix" (threads 8m..8m+7 give the row addresses of matrix
m; each thread receives two consecutive elements of row laneid / 4, or with .trans of column
laneid / 4). Each test runs dev/cuda/tensor_core.cu's one-warp kernels (the same kernels the GPU
test runs on a GPU) and compares every lane's registers with those formulas:
- mma: random bf16 A (16x16) and B (16x8) and fp32 C packed into fragments by the ISA's layout;
  D unpacked by it equals A @ B + C in float64 within fp32 rounding;
- ldmatrix x1, x2, x4, with and without .trans, with rows packed (8 elements apart) and padded
  (16 apart): every register holds the elements the ISA names; x4 of a tile's quadrants is the
  mma's A fragment;
- cp.async: copies land at the wait that completes their group, not when issued (a read before
  the wait sees the NaN bytes shared memory starts with); wait_group 1 leaves the newest group in
  flight; src-size below 16 zero-fills; a kernel that forgets the wait reads NaN.
The emulator keeps the ISA's rules and names the kernel, block and thread of the one that breaks
one: a misaligned or non-shared ldmatrix row, a misaligned or wrong-space cp.async, a warp of 16
threads, lanes in different instructions, a lane that has exited.
Marked gpu: the same kernels on a GPU, compared with the emulated device's results.

Run: pytest tests/test_tensor_cores.py   (a few seconds once g++ has built the kernels, ~30 s)
"""

import os
import sys

import numpy as np
import pytest

from llmc import cuda
from llmc.emulator import build
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev", "cuda"))

import tensor_core  # noqa: E402  (dev/cuda/tensor_core.py: runs the instruction kernels)

LANES = 32


# ----------------------------------------------------------------------------
# the PTX ISA's layouts, as its text states them

def isa_a(lane, i):
    """(row, col) of element a_i (i = 0..7) of mma.m16n8k16's .bf16 A fragment held by `lane`:
    row = groupID for ai where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
    col = (threadID_in_group * 2) + (i & 0x1) for ai where i < 4, the same + 8 for i >= 4."""
    group_id, thread_id_in_group = lane >> 2, lane % 4
    row = group_id if (0 <= i < 2 or 4 <= i < 6) else group_id + 8
    col = thread_id_in_group * 2 + (i & 0x1) + (8 if i >= 4 else 0)
    return row, col


def isa_b(lane, i):
    """(row, col) of element b_i (i = 0..3) of the .bf16 B fragment:
    row = (threadID_in_group * 2) + (i & 0x1) for bi where i < 2, the same + 8 for i >= 2;
    col = groupID."""
    group_id, thread_id_in_group = lane >> 2, lane % 4
    return thread_id_in_group * 2 + (i & 0x1) + (8 if i >= 2 else 0), group_id


def isa_c(lane, i):
    """(row, col) of element c_i (i = 0..3) of the .f32 C or D fragment:
    row = groupID for c0 and c1, groupID + 8 for c2 and c3; col = (threadID_in_group * 2) + (i & 0x1)."""
    group_id, thread_id_in_group = lane >> 2, lane % 4
    return (group_id if i < 2 else group_id + 8), thread_id_in_group * 2 + (i & 0x1)


def isa_ldmatrix(lane, j, trans):
    """(row, col) within its 8x8 matrix of element j (0: low 16 bits, 1: high) of each register
    `lane` receives from ldmatrix.m8n8.b16: row laneid / 4, columns 2 (laneid % 4) + j; with
    .trans the element of the transposed matrix, so row 2 (laneid % 4) + j, column laneid / 4."""
    row, col = lane // 4, 2 * (lane % 4) + j
    return (col, row) if trans else (row, col)


def pack(pairs):
    """Two 16-bit values into one .b32 register, the first in the low half (the ISA's low-to-high order)."""
    return int(pairs[0]) | int(pairs[1]) << 16


def bf16_round(x):
    return bfloat16_bits_to_float32(float32_to_bfloat16_bits(np.asarray(x, np.float32)))


@pytest.fixture(autouse=True)
def emulated_device():
    cuda.use_device("cpu")
    yield
    cuda.use_device("cuda")


# ----------------------------------------------------------------------------
# mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32

def mma_operands(rng):
    """Random A (16x16), B (16x8) exactly representable in bf16, C (16x8) fp32; and every lane's
    fragment registers for them by the ISA's layout."""
    A = bf16_round(rng.standard_normal((16, 16)))
    B = bf16_round(rng.standard_normal((16, 8)))
    C = rng.standard_normal((16, 8)).astype(np.float32)
    A_bits, B_bits = float32_to_bfloat16_bits(A), float32_to_bfloat16_bits(B)
    a = np.array([[pack([A_bits[isa_a(l, 2 * r)], A_bits[isa_a(l, 2 * r + 1)]]) for r in range(4)]
                  for l in range(LANES)], np.uint32)
    b = np.array([[pack([B_bits[isa_b(l, 2 * r)], B_bits[isa_b(l, 2 * r + 1)]]) for r in range(2)]
                  for l in range(LANES)], np.uint32)
    c = np.array([[C[isa_c(l, i)] for i in range(4)] for l in range(LANES)], np.float32)
    return A, B, C, a, b, c


def unpack_d(d):
    """The 16x8 D from every lane's four registers, by the ISA's C/D layout."""
    D = np.full((16, 8), np.nan, np.float32)
    for lane in range(LANES):
        for i in range(4):
            D[isa_c(lane, i)] = d[lane, i]
    return D


def mma_tolerance(A, B, C, ulps):
    """|D - A @ B - C| bound: `ulps` fp32 units of the magnitude sum |A| @ |B| + |C| (the products
    are exact; only the sums round)."""
    return ulps * np.finfo(np.float32).eps * (np.abs(A.astype(np.float64)) @ np.abs(B) + np.abs(C))


@pytest.mark.parametrize("seed", [0, 1])
def test_mma_m16n8k16_gives_a_at_b_plus_c_in_the_isa_layout(seed):
    A, B, C, a, b, c = mma_operands(np.random.default_rng(seed))
    D = unpack_d(tensor_core.run_mma(a, b, c))
    reference = A.astype(np.float64) @ B + C
    assert not np.isnan(D).any()                                # every element of D is some lane's
    assert (np.abs(D - reference) <= mma_tolerance(A, B, C, 1)).all(), np.abs(D - reference).max()


# ----------------------------------------------------------------------------
# ldmatrix

def numbered_tiles():
    """Four 8x8 matrices whose element (m, r, c) holds its own number 64m + 8r + c."""
    return np.arange(4 * 64, dtype=np.uint16).reshape(4, 8, 8)


@pytest.mark.parametrize("ld", [8, 16])                          # rows packed, or padded by 8 elements
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("num", [1, 2, 4])
def test_ldmatrix_gives_each_lane_the_isa_elements(num, trans, ld):
    tiles = numbered_tiles()
    regs = tensor_core.run_ldmatrix(tiles, num, trans, ld)
    for lane in range(LANES):
        for m in range(num):
            expected = [tiles[m][isa_ldmatrix(lane, j, trans)] for j in range(2)]
            assert regs[lane, m] == pack(expected), (lane, m)


def test_ldmatrix_x4_of_the_quadrants_is_the_mma_a_fragment():
    tile = np.arange(256, dtype=np.uint16).reshape(16, 16)
    quadrants = np.stack([tile[:8, :8], tile[8:, :8], tile[:8, 8:], tile[8:, 8:]])
    regs = tensor_core.run_ldmatrix(quadrants, 4, False)
    for lane in range(LANES):
        for r in range(4):
            assert regs[lane, r] == pack([tile[isa_a(lane, 2 * r)], tile[isa_a(lane, 2 * r + 1)]]), (lane, r)


def test_ldmatrix_x2_trans_of_a_row_major_k_by_n_tile_is_the_mma_b_fragment():
    tile = np.arange(128, dtype=np.uint16).reshape(16, 8)           # (k, n), row-major
    regs = tensor_core.run_ldmatrix(np.stack([tile[:8], tile[8:], tile[:8], tile[8:]]), 2, True)
    for lane in range(LANES):
        for r in range(2):
            assert regs[lane, r] == pack([tile[isa_b(lane, 2 * r)], tile[isa_b(lane, 2 * r + 1)]]), (lane, r)


# ----------------------------------------------------------------------------
# cp.async

def test_cp_async_copies_land_at_the_wait_not_at_the_issue():
    groups = 3
    src = np.arange(groups * LANES * 4, dtype=np.float32).reshape(groups, LANES, 4) + 1.0
    before, after_wait_1, after_all = tensor_core.run_cp_async(src)
    assert np.isnan(before).all()                                  # shared memory as it started: NaN bytes
    np.testing.assert_array_equal(after_wait_1[:, :2], src[:2].transpose(1, 0, 2))   # wait_group 1: the
    assert np.isnan(after_wait_1[:, 2]).all()                       # newest group may still be in flight
    np.testing.assert_array_equal(after_all, src.transpose(1, 0, 2))


# kernels that break a rule, or forget one, compiled by the emulated device against the header
RULE_KERNELS = r"""
#include "tensor_core.cuh"
extern "C" __global__ void zero_fill(float* out, const float* src, int src_bytes) {
    __shared__ __align__(16) float tile[32 * 4];
    cp_async_cg(tile + threadIdx.x * 4, src + threadIdx.x * 4, src_bytes);
    cp_async_wait_all();
    for (int k = 0; k < 4; k++) out[threadIdx.x * 4 + k] = tile[threadIdx.x * 4 + k];
}
// the planted bug: the tile is summed before cp.async.wait_all (the wait comes too late)
extern "C" __global__ void sum_before_wait(float* out, const float* src) {
    __shared__ __align__(16) float tile[32 * 4];
    cp_async_cg(tile + threadIdx.x * 4, src + threadIdx.x * 4);
    cp_async_commit_group();
    __syncthreads();
    float sum = 0.0f;
    for (int k = 0; k < 32 * 4; k++) sum += tile[k];
    cp_async_wait_all();
    out[threadIdx.x] = sum;
}
extern "C" __global__ void ldmatrix_misaligned(unsigned* out, int byte_offset) {
    __shared__ __align__(16) unsigned short tile[8 * 16 + 8];
    for (int i = threadIdx.x; i < 8 * 16 + 8; i += 32) tile[i] = (unsigned short)i;
    __syncwarp();
    unsigned r[1];
    ldmatrix_x1(r, (const char*)(tile + (threadIdx.x % 8) * 16) + byte_offset);
    out[threadIdx.x] = r[0];
}
extern "C" __global__ void ldmatrix_from_global(unsigned* out, const unsigned short* rows) {
    unsigned r[1];
    ldmatrix_x1(r, rows + (threadIdx.x % 8) * 8);
    out[threadIdx.x] = r[0];
}
extern "C" __global__ void cp_async_to_global(float* dst, const float* src) {
    cp_async_cg(dst + threadIdx.x * 4, src + threadIdx.x * 4);
    cp_async_wait_all();
}
extern "C" __global__ void cp_async_misaligned(float* out, const float* src) {
    __shared__ __align__(16) float tile[32 * 4 + 4];
    cp_async_cg(tile + threadIdx.x * 4 + 1, src + threadIdx.x * 4);
    cp_async_wait_all();
    out[threadIdx.x] = tile[threadIdx.x * 4 + 1];
}
// lanes 0-15 in an mma, lanes 16-31 in an ldmatrix (mode 0); lane 31 gone before the mma (mode 1);
// or every lane in the mma (mode 2: run with a block of 16 threads)
extern "C" __global__ void mma_misused(float* out, int mode) {
    __shared__ __align__(16) unsigned short tile[64];
    for (int i = threadIdx.x; i < 64; i += blockDim.x) tile[i] = 0;
    __syncthreads();
    unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0, 0, 0, 0}, d[4];
    if (mode == 1 && threadIdx.x == 31) return;
    if (mode == 0 && threadIdx.x >= 16) {
        ldmatrix_x1(b, tile + (threadIdx.x % 8) * 8);
    } else {
        mma_m16n8k16_bf16(d, a, b, c);
    }
    out[threadIdx.x] = d[0];
}
// a tile in dynamic shared memory (kernels with large tiles, e.g. a multi-stage cp.async pipeline)
extern "C" __global__ void dynamic_tile(float* out, int n) {
    extern __shared__ __align__(16) float tile[];
    for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = (float)i;
    __syncthreads();
    out[threadIdx.x] = tile[n - 1 - threadIdx.x];
}
"""


@pytest.fixture(scope="module")
def rule_kernels():
    from llmc.emulator import device as emulated
    module = emulated.RawModule(code=RULE_KERNELS, options=("-DENABLE_BF16", f"-I{os.path.join(ROOT, 'kernels')}"))
    module.compile()
    return module


def launch(module, name, block, *args):
    module.get_function(name)((1,), (block,), args)


@pytest.mark.parametrize("src_bytes", [0, 4, 12, 16])
def test_cp_async_zero_fills_past_src_size(rule_kernels, src_bytes):
    from llmc.emulator import device as emulated
    src = np.arange(1, 32 * 4 + 1, dtype=np.float32)
    out = emulated.zeros(32 * 4, np.float32)
    launch(rule_kernels, "zero_fill", 32, out, emulated.asarray(src), np.int32(src_bytes))
    expected = np.where(np.arange(32 * 4) % 4 < src_bytes // 4, src, 0.0)
    np.testing.assert_array_equal(out.get(), expected)


def test_reading_a_tile_before_its_cp_async_wait_is_caught(rule_kernels):
    """The planted bug: on a GPU the sum might even be right when the copies happen to be fast;
    here the copies have not landed, so every sum is NaN and the kernel's check fails at once."""
    from llmc.emulator import device as emulated
    out = emulated.zeros(32, np.float32)
    launch(rule_kernels, "sum_before_wait", 32, out, emulated.asarray(np.ones(32 * 4, np.float32)))
    assert np.isnan(out.get()).all()


@pytest.mark.parametrize("name,block,args,message", [
    ("ldmatrix_misaligned", 32, lambda e: (e.zeros(32, np.uint32), np.int32(2)), "not 16-byte aligned"),
    ("ldmatrix_from_global", 32, lambda e: (e.zeros(32, np.uint32), e.zeros(64, np.uint16)),
     "not inside the block's shared memory"),
    ("cp_async_to_global", 32, lambda e: (e.zeros(128, np.float32), e.zeros(128, np.float32)),
     "not inside the block's shared memory"),
    ("cp_async_misaligned", 32, lambda e: (e.zeros(32, np.float32), e.zeros(128, np.float32)),
     "not 16-byte aligned"),
    ("mma_misused", 32, lambda e: (e.zeros(32, np.float32), np.int32(0)), "another warp-collective instruction"),
    ("mma_misused", 32, lambda e: (e.zeros(32, np.float32), np.int32(1)), "deadlock"),
    ("mma_misused", 16, lambda e: (e.zeros(32, np.float32), np.int32(2)), "needs all 32 lanes"),
])
def test_broken_rules_stop_the_launch_naming_the_thread(rule_kernels, name, block, args, message):
    from llmc.emulator import device as emulated
    with pytest.raises(build.EmulatorError, match=message) as e:
        launch(rule_kernels, name, block, *args(emulated))
    assert f"kernel {name}, block (0,0,0)" in str(e.value)


def test_kernels_hold_no_emulator_only_branch():
    """One kernel source: the emulated device compiles kernels/ as a GPU does, inline PTX included
    (llmc/emulator/ptx.py translates it), so no file there asks which device it is built for."""
    for name in sorted(os.listdir(os.path.join(ROOT, "kernels"))):
        with open(os.path.join(ROOT, "kernels", name)) as f:
            assert "LLMC_EMULATED_DEVICE" not in f.read(), name


def test_inline_ptx_becomes_the_emulators_instructions_line_for_line():
    from llmc.emulator import ptx
    with open(os.path.join(ROOT, "kernels", "tensor_core.cuh")) as f:
        source = f.read()
    translated = ptx.translate(source)
    assert not ptx.has_inline_asm(translated) and ptx.has_inline_asm(source)
    before, after = source.splitlines(), translated.splitlines()
    assert len(before) == len(after)                    # gdb's and g++'s line numbers stay the file's
    changed = [i for i, (a, b) in enumerate(zip(before, after)) if a != b]
    # the line of each asm now holds its call; the asm's continuation lines are left empty (its ';' on the last)
    assert changed and all("asm" in before[i] or after[i].strip() in ("", ";") for i in changed)
    assert "llmc_emu::mma_m16n8k16_row_col_f32_bf16(llmc_d, llmc_a, llmc_b, llmc_c); d[0] = llmc_d[0];" in translated
    assert ("llmc_emu::cp_async(llmc_emu::shared_window_pointer((unsigned)(shared_address(smem))), "
            "(const void*)(gmem), (int)16, (int)(src_bytes), \"cp.async.cg.shared.global\");") in translated


def test_inline_ptx_the_emulator_lacks_is_named():
    from llmc.emulator import device as emulated
    code = ('extern "C" __global__ void lane_of(unsigned* out) {\n'
            '    unsigned lane;\n'
            '    asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));\n'
            '    out[threadIdx.x] = lane;\n'
            '}\n')
    module = emulated.RawModule(code=code, options=("-DENABLE_BF16",))
    with pytest.raises(emulated.cuda.compiler.CompileException, match=r"no implementation of the inline PTX 'mov\.u32 %0, %%laneid;'"):
        module.compile()


def test_an_aligned_ldmatrix_of_the_same_kernel_runs(rule_kernels):
    from llmc.emulator import device as emulated
    out = emulated.zeros(32, np.uint32)
    launch(rule_kernels, "ldmatrix_misaligned", 32, out, np.int32(0))
    lanes = np.arange(32)
    rows, cols = lanes // 4, 2 * (lanes % 4)                          # isa_ldmatrix, non-transposed
    np.testing.assert_array_equal(out.get(), (rows * 16 + cols) | (rows * 16 + cols + 1) << 16)


def test_dynamic_shared_memory_above_48_kib_needs_the_opt_in(rule_kernels):
    """CUDA's rule, as CuPy exposes it (RawKernel.max_dynamic_shared_size_bytes, cuFuncSetAttribute):
    a launch may ask for 48 KiB of dynamic shared memory; more once the kernel opted in, up to the
    device's limit (163 KiB on compute capability 8.0, as the emulated device reports)."""
    from llmc.emulator import device as emulated
    kernel = rule_kernels.get_function("dynamic_tile")
    n = 100 * 1024 // 4                                              # 100 KiB of floats
    out = emulated.zeros(32, np.float32)
    with pytest.raises(ValueError, match="max_dynamic_shared_size_bytes"):
        kernel((1,), (32,), (out, np.int32(n)), shared_mem=n * 4)
    assert kernel.max_dynamic_shared_size_bytes == 48 * 1024
    with pytest.raises(emulated.cuda.runtime.CUDARuntimeError, match="invalid argument"):
        kernel.max_dynamic_shared_size_bytes = 164 * 1024
    kernel.max_dynamic_shared_size_bytes = n * 4
    assert rule_kernels.get_function("dynamic_tile").max_dynamic_shared_size_bytes == n * 4   # kept with the function
    kernel((1,), (32,), (out, np.int32(n)), shared_mem=n * 4)
    np.testing.assert_array_equal(out.get(), n - 1 - np.arange(32))
    assert emulated.cuda.runtime.getDeviceProperties(0)["sharedMemPerBlockOptin"] == 163 * 1024


# ----------------------------------------------------------------------------
# on a GPU: the same instruction kernels, compared with the emulated device

@pytest.mark.gpu
def test_gpu_instructions_match_the_emulated_device():
    rng = np.random.default_rng(3)
    A, B, C, a, b, c = mma_operands(rng)
    tiles = numbered_tiles()
    src = rng.standard_normal((3, LANES, 4)).astype(np.float32)
    results = {}
    for device in ("cpu", "cuda"):
        cuda.use_device(device)
        results[device] = (tensor_core.run_mma(a, b, c),
                           {(num, trans): tensor_core.run_ldmatrix(tiles, num, trans, 16)
                            for num in (1, 2, 4) for trans in (False, True)},
                           tensor_core.run_cp_async(src))
    (d_emulated, ld_emulated, seen_emulated), (d_gpu, ld_gpu, seen_gpu) = results["cpu"], results["cuda"]
    D_gpu = unpack_d(d_gpu)
    # the GPU's tensor core rounds its sums its own way: a few ulps of the magnitude sum
    assert (np.abs(D_gpu - unpack_d(d_emulated)) <= mma_tolerance(A, B, C, 4)).all()
    for key in ld_emulated:
        np.testing.assert_array_equal(ld_gpu[key], ld_emulated[key], err_msg=str(key))
    np.testing.assert_array_equal(seen_gpu[1][:, :2], seen_emulated[1][:, :2])    # landed by wait_group 1
    np.testing.assert_array_equal(seen_gpu[2], seen_emulated[2])                  # by wait_all
