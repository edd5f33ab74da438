/*
dev/cuda/tensor_core.cu: one kernel per tensor-core instruction of kernels/tensor_core.cuh, each
run by one warp on values the host chose, each writing out the registers every lane ends up with,
so that the host can see which lane holds which element (dev/cuda/tensor_core.py prints it; the
tests compare it with the PTX ISA's tables, on the emulated device and on a GPU).

- mma_fragments(d, a, b, c): lane l loads its fragment registers a[l][0..3], b[l][0..1] and
  c[l][0..3] from global memory, runs one mma.sync.m16n8k16 (bf16 in, fp32 out) and stores its
  d[l][0..3].
- ldmatrix_fragments(r, tiles, num, trans, ld): the block copies four 8x8 matrices of 16-bit
  elements into shared memory, matrix m's row i at smem[m*8*ld + i*ld] (ld >= 8 elements: rows may
  be padded, as kernels pad them against bank conflicts); lane 8m + i passes the address of that
  row to ldmatrix x`num` (.trans if `trans`), and stores its `num` registers at r[l][0..num-1].
- cp_async_groups(seen, src, n_groups): each of the 32 lanes issues one 16-byte cp.async per
  group (group g copies src[g][lane]) into shared memory, committing a group after each; then it
  reads shared memory three times: before any wait (seen[0]), after cp.async.wait_group 1 (seen[1],
  every group but the last has landed) and after wait_all (seen[2]). Each lane reads only its own
  copies, so no barrier is needed. A copy that has not landed reads what shared memory held: NaN
  bytes (0xff) on the emulated device, where shared memory starts so; on a GPU whatever was there.

Run (through dev/cuda/tensor_core.py; it also runs on the emulated device with --device cpu):
    python dev/cuda/tensor_core.py --device cpu
*/
#include "tensor_core.cuh"

#define LANES 32
#define MATRICES 4
#define MATRIX_ROWS 8

extern "C" __global__ void mma_fragments(float* d, const unsigned* a, const unsigned* b, const float* c) {
    const int lane = threadIdx.x;
    unsigned a_reg[4], b_reg[2];
    float c_reg[4], d_reg[4];
    for (int i = 0; i < 4; i++) a_reg[i] = a[lane * 4 + i];
    for (int i = 0; i < 2; i++) b_reg[i] = b[lane * 2 + i];
    for (int i = 0; i < 4; i++) c_reg[i] = c[lane * 4 + i];
    mma_m16n8k16_bf16(d_reg, a_reg, b_reg, c_reg);
    for (int i = 0; i < 4; i++) d[lane * 4 + i] = d_reg[i];
}

#define MAX_LD 16
extern "C" __global__ void ldmatrix_fragments(unsigned* r, const unsigned short* tiles, int num, int trans, int ld) {
    __shared__ __align__(16) unsigned short smem[MATRICES * MATRIX_ROWS * MAX_LD];
    const int lane = threadIdx.x;
    for (int e = lane; e < MATRICES * MATRIX_ROWS * 8; e += LANES) {    // element (m, i, j) of the tiles
        const int m = e / 64, i = e / 8 % 8, j = e % 8;
        smem[(m * MATRIX_ROWS + i) * ld + j] = tiles[e];
    }
    __syncwarp();
    const unsigned short* row = smem + (lane / 8 * MATRIX_ROWS + lane % 8) * ld;   // lane 8m + i: row i of matrix m
    unsigned reg[4] = {0, 0, 0, 0};
    if (num == 1) {
        trans ? ldmatrix_x1_trans(reg, row) : ldmatrix_x1(reg, row);
    } else if (num == 2) {
        trans ? ldmatrix_x2_trans(reg, row) : ldmatrix_x2(reg, row);
    } else {
        trans ? ldmatrix_x4_trans(reg, row) : ldmatrix_x4(reg, row);
    }
    for (int m = 0; m < num; m++) r[lane * num + m] = reg[m];
}

#define MAX_GROUPS 4
extern "C" __global__ void cp_async_groups(float* seen, const float* src, int n_groups) {
    __shared__ __align__(16) float smem[MAX_GROUPS * LANES * 4];
    const int lane = threadIdx.x;
    for (int g = 0; g < n_groups; g++) {
        cp_async_cg(smem + (g * LANES + lane) * 4, src + (g * LANES + lane) * 4);
        cp_async_commit_group();
    }
    const int n = n_groups * 4;                       // this lane's floats: 4 per group
    for (int g = 0; g < n_groups; g++) {
        for (int k = 0; k < 4; k++) seen[(0 * LANES + lane) * n + g * 4 + k] = smem[(g * LANES + lane) * 4 + k];
    }
    cp_async_wait_group<1>();
    for (int g = 0; g < n_groups; g++) {
        for (int k = 0; k < 4; k++) seen[(1 * LANES + lane) * n + g * 4 + k] = smem[(g * LANES + lane) * 4 + k];
    }
    cp_async_wait_all();
    for (int g = 0; g < n_groups; g++) {
        for (int k = 0; k < 4; k++) seen[(2 * LANES + lane) * n + g * 4 + k] = smem[(g * LANES + lane) * 4 + k];
    }
}
