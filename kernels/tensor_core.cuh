/*
kernels/tensor_core.cuh: the sm_80 tensor-core and asynchronous-copy instructions as small inline
functions, one per instruction, for the kernels that use them (dev/cuda/matmul.cu's versions 6-8,
kernels/flash_attention.cu).

Each function's body is the instruction's inline PTX, for a GPU and the emulated device alike:
before g++ compiles a kernel for the emulated device, llmc/emulator/ptx.py turns each asm
statement into a call of the emulator's implementation of that instruction
(llmc/emulator/shim/tensor_cores.h), its operands bound as the asm binds them. The emulated
instructions follow the PTX ISA's lane layouts and check its rules (alignment, shared-memory
addresses, every lane of the warp in the same instruction), and a cp.async lands at its wait, not
at its issue.

The instructions (NVIDIA, "Parallel Thread Execution ISA", sections named after each):
- mma_m16n8k16_bf16(d, a, b, c): mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, D = A B + C,
  one warp, A 16x16 bf16, B 16x8 bf16, C and D 16x8 fp32. This lane's fragments, with
  g = lane / 4 and t = lane % 4 ("Matrix Fragments for mma.m16n8k16 with floating point type"):
      a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
      b[0] = B[2t, 2t+1][g]     b[1] = B[2t+8, 2t+9][g]
      c[0], c[1] = C[g][2t, 2t+1]                          c[2], c[3] = C[g+8][2t, 2t+1]
  (each a and b register holds two bf16, the lower-indexed in its low 16 bits). "row.col" means A
  row-major and B column-major: B's fragment is two consecutive k of one column n, so a row-major
  (n, k) tile, e.g. K for S = Q K^T, feeds it directly.
- ldmatrix_x{1,2,4}[_trans](r, row): ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16, one,
  two or four 8x8 matrices of 16-bit elements from shared memory. Lane 8m + i passes the address of
  row i of matrix m (16 contiguous bytes, 16-byte aligned); lane l receives r[m] = matrix m's
  elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1), or with _trans those of its transpose. x4 of A's four
  8x8 quadrants (top-left, bottom-left, top-right, bottom-right) is exactly mma's a[0..3];
  x2_trans of a row-major (k, n) tile's two 8x8 halves (k 0-7, k 8-15) is exactly mma's b[0..1].
- cp_async_ca<BYTES>(smem, gmem) (BYTES 4, 8, 16; cached in L1 and L2) and cp_async_cg(smem,
  gmem[, src_bytes]) (16 bytes, L2 only; bytes past src_bytes are zero-filled: a row past the
  matrix's end loads zeros): cp.async.ca/cg.shared.global, a copy from global to shared memory that
  runs in the background. cp_async_commit_group() closes the group of the copies issued since the
  last one; cp_async_wait_group<N>() waits until at most the N most recent groups are still in
  flight; cp_async_wait_all() waits for every copy. A copy is visible to other threads only after
  the issuing thread's wait and a __syncthreads().

Addresses: the PTX takes 32-bit shared-window addresses (cvta.to.shared); the functions take
ordinary pointers and convert them.
*/
#pragma once

#include "common.cuh"

// a pair of floats rounded to bf16 and packed into one .b32 register, the first in the low 16 bits
// (the layout of the mma's A and B registers: an accumulator pair (c[0], c[1]) becomes an A pair)
__device__ inline unsigned pack_bf16x2(float lo, float hi) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
}


__device__ inline unsigned shared_address(const void* p) {
    unsigned address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(p));
    return address;
}

__device__ inline void mma_m16n8k16_bf16(float d[4], const unsigned a[4], const unsigned b[2], const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
__device__ inline void ldmatrix_x1(unsigned r[1], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(shared_address(row)));
}
__device__ inline void ldmatrix_x2(unsigned r[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(row)));
}
__device__ inline void ldmatrix_x4(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}
__device__ inline void ldmatrix_x1_trans(unsigned r[1], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];" : "=r"(r[0]) : "r"(shared_address(row)));
}
__device__ inline void ldmatrix_x2_trans(unsigned r[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(shared_address(row)));
}
__device__ inline void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(shared_address(row)));
}
template <int BYTES>
__device__ inline void cp_async_ca(void* smem, const void* gmem) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async.ca copies 4, 8 or 16 bytes");
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(shared_address(smem)), "l"(gmem), "n"(BYTES) : "memory");
}
__device__ inline void cp_async_cg(void* smem, const void* gmem, int src_bytes = 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(shared_address(smem)), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ inline void cp_async_commit_group() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ inline void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
__device__ inline void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
