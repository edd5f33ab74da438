/*
llmc/emulator/shim/tensor_cores.h: the warp-level matrix instructions and the asynchronous copies
of sm_80 on the emulated device, with the lane layouts and rules of NVIDIA's PTX ISA:
- mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: D = A B + C for one warp, A 16x16 and B
  16x8 bf16, C and D 16x8 fp32 (PTX ISA, "Warp-level matrix multiply-accumulate instructions: mma"
  and "Matrix Fragments for mma.m16n8k16 with floating point type");
- ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16: one, two or four 8x8 matrices of
  16-bit elements from shared memory into the fragments the mma takes (PTX ISA, "Warp-level matrix
  load instruction: ldmatrix");
- cp.async.{ca,cg}.shared.global, cp.async.commit_group, cp.async.wait_group N, cp.async.wait_all
  (PTX ISA, "Data Movement and Conversion Instructions: cp.async" and its commit/wait
  instructions). The implementations of these three are in emulator.cpp (they keep state per CUDA
  thread); the rules they check are listed here.

Kernels never call these directly: kernels/tensor_core.cuh gives each instruction one inline
function whose body is its inline PTX, and llmc/emulator/ptx.py turns each asm statement into a
call of these before g++ compiles the kernel, so that the kernel source a GPU runs is the source
the emulated device runs.

How a warp-collective instruction is emulated: each lane brings its operand registers (or the row
of a matrix it was given the address of) to llmc_emu::warp_gather, which waits until all 32 lanes
of the warp have arrived in the same instruction; each lane then has every lane's registers and
rebuilds the whole matrices by the ISA's layout formulas below, then computes the part of the
result that it holds. A lane in another instruction, a warp of fewer than 32 threads, a lane that
has exited: the launch stops with a message naming the kernel, the block and the thread (a GPU
would give undefined results or hang).

Rules checked (the ISA's; a GPU reports a misaligned address as an error or gives garbage):
- ldmatrix: each row address given (lanes 0..8*num-1; the others' are ignored) is 16-byte aligned
  and lies inside a __shared__ array of the block;
- cp.async: cp-size is 4, 8 or 16 bytes (.cg: 16 only); src-size is 0..cp-size (the rest of the
  destination is zero-filled); the destination is 16-, 8- or 4-byte aligned as cp-size, inside a
  __shared__ array; the source is aligned likewise and outside shared memory (global).

What cp.async's emulation makes visible: the copy lands in shared memory at the cp.async.wait_group
that completes its group, not when it is issued. A kernel that reads its tile before waiting
reads what was there before (NaN bytes, or the previous tile), as it may on a GPU, where the copy
runs in the background. The source is read when the copy is issued.

Numerics of the emulated mma: the bf16 products are exact, the 16 products and C are summed in
double and rounded once to fp32. A GPU's tensor core sums with its own order and rounding (Fasi et
al. 2021, "Numerical behavior of NVIDIA tensor cores", measured truncation in its additions), so
results may differ in the last bits of fp32; tests compare within a tolerance.
*/
#pragma once

namespace llmc_emu {

// the 16-bit element `half` (0: the low 16 bits, 1: the high) of a .b32 register holding a bf16
// pair, as a float (a bf16 is the upper half of a float's bits)
inline float bf16_half(unsigned reg, int half) { return __uint_as_float((reg >> (16 * half) & 0xffffu) << 16); }

// ----------------------------------------------------------------------------
// mma.m16n8k16, .bf16 A and B, .f32 C and D: which lane holds which element (PTX ISA, "Matrix
// Fragments for mma.m16n8k16 with floating point type"). With groupID = lane >> 2 and
// threadID_in_group = lane % 4:
//   A (16x16), a0..a7, two per register, low half first (a0, a1 in register 0, ...):
//     row = groupID for a0, a1, a4, a5;  groupID + 8 for a2, a3, a6, a7
//     col = threadID_in_group * 2 + (i & 1) for a0..a3;  the same + 8 for a4..a7
//   B (16x8), b0..b3, two per register:
//     row = threadID_in_group * 2 + (i & 1) for b0, b1;  the same + 8 for b2, b3
//     col = groupID
//   C and D (16x8), c0..c3, one float each:
//     row = groupID for c0, c1;  groupID + 8 for c2, c3
//     col = threadID_in_group * 2 + (i & 1)

inline int mma_a_row(int lane, int i) { return (lane >> 2) + ((i >> 1) & 1) * 8; }
inline int mma_a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 4) * 8; }
inline int mma_b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i >= 2) * 8; }
inline int mma_b_col(int lane, int /*i*/) { return lane >> 2; }
inline int mma_c_row(int lane, int i) { return (lane >> 2) + (i >= 2) * 8; }
inline int mma_c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

// d = A B + c for the warp: a (4 registers), b (2), c and d (4 floats) are this lane's fragments.
// d may be c (accumulating in place).
inline void mma_m16n8k16_row_col_f32_bf16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    struct Fragments {
        unsigned a[4], b[2];
    };
    Fragments mine = {{a[0], a[1], a[2], a[3]}, {b[0], b[1]}}, all[32];
    warp_gather(&mine, all, sizeof(Fragments), "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32");
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; l++) {
        for (int i = 0; i < 8; i++) A[mma_a_row(l, i)][mma_a_col(l, i)] = bf16_half(all[l].a[i / 2], i % 2);
        for (int i = 0; i < 4; i++) B[mma_b_row(l, i)][mma_b_col(l, i)] = bf16_half(all[l].b[i / 2], i % 2);
    }
    const int lane = (int)__lane_id();
    for (int i = 0; i < 4; i++) {
        const int row = mma_c_row(lane, i), col = mma_c_col(lane, i);
        double sum = c[i];
        for (int k = 0; k < 16; k++) sum += (double)A[row][k] * (double)B[k][col];
        d[i] = (float)sum;
    }
}

// ----------------------------------------------------------------------------
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{,.trans}.shared.b16 (PTX ISA, "Warp-level matrix load
// instruction: ldmatrix"): `num` 8x8 matrices of 16-bit elements, each row 16 contiguous bytes.
// Lanes 8m .. 8m+7 give the addresses of rows 0..7 of matrix m. Every lane receives one register
// d[m] per matrix, holding two elements (low half first):
//   without .trans: row lane >> 2, columns (lane % 4) * 2 and (lane % 4) * 2 + 1
//   with .trans:    the same of the transposed matrix: rows (lane % 4) * 2 and (lane % 4) * 2 + 1
//                   of column lane >> 2
// which is, for x4 without .trans, exactly an mma.m16n8k16 A fragment when the four matrices are
// A's quadrants in the order (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15).
// a lane's read of its 16-byte row; in a traced build (memory.py) counted as one shared-memory
// access at the kernel's call site, and hidden from the instrumentation that would count it again
#ifdef LLMC_EMU_TRACE
__attribute__((noinline, no_sanitize_thread)) inline void ldmatrix_read_row(void* mine, const void* row) {
    memcpy(mine, row, 16);
    trace_access(row, 16, false, __builtin_return_address(0));
}
#else
inline void ldmatrix_read_row(void* mine, const void* row) { memcpy(mine, row, 16); }
#endif

inline void ldmatrix_m8n8_b16(unsigned* d, int num, bool trans, const void* row, const char* what) {
    struct Row {
        unsigned short x[8];
    };
    Row mine = {}, all[32];
    const int lane = (int)__lane_id();
    if (lane < 8 * num) {
        if ((uintptr_t)row % 16 != 0) {
            fail("%s: lane %d's row address %p is not 16-byte aligned", what, lane, row);
        }
        if (!is_shared(row, 16)) {
            fail("%s: lane %d's row address %p (16 bytes) is not inside the block's shared memory", what, lane, row);
        }
        ldmatrix_read_row(&mine, row);
    }
    warp_gather(&mine, all, sizeof(Row), what);
    const int group = lane >> 2, pair = (lane % 4) * 2;
    for (int m = 0; m < num; m++) {
        const Row* rows = all + 8 * m;
        const unsigned short lo = trans ? rows[pair].x[group] : rows[group].x[pair];
        const unsigned short hi = trans ? rows[pair + 1].x[group] : rows[group].x[pair + 1];
        d[m] = (unsigned)lo | (unsigned)hi << 16;
    }
}

}  // namespace llmc_emu
