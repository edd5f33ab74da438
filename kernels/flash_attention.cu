/*
kernels/flash_attention.cu: causal multi-head attention without the (B,NH,T,T) matrix, forward
and deterministic backward, FlashAttention-2 (Dao 2023) on bf16 tensor cores (mma.sync.m16n8k16)
with S and P in registers, cp.async double buffering and swizzled shared-memory tiles; grouped-
query attention (Llama 3) reads its shared key/value heads in place.

The algorithm, the register layout and the pipeline are in kernels/flash_attention.cuh (templates
over the tile shapes, shared with dev/cuda/attention.cu); this file picks one tile shape per head
size and defines the kernels the trainers launch. Progression: `python dev/cuda/attention.py`;
these kernels are its version 8 of the forward and the backward, each version validated against
gpt2_cpu.py, then timed against cuDNN.

Kernels (floatX per common.cuh; launchers: llmc/attention.py flash_attention_forward / _backward,
which also compute the grids and the dynamic shared memory from the same tile shapes):
- flash_attention_forward_hs{16,32,64,128}(out, lse, qkv, B, T, NH, NKV): grid (B*NH,
  ceil(T/ROWS)), ForwardTiles::THREADS threads, SHARED_BYTES of dynamic shared memory. Block
  (bh, y) owns query block ceil(T/ROWS)-1-y: the longest rows start first.
- flash_attention_backward_preprocess(D, dout, out, B, T, NH, HS): D = rowsum(dout * out) per
  (b, h, t); one thread per row, grid-stride, any grid and block size.
- flash_attention_backward_dkdv_hs{...}(dqkv, dout, qkv, lse, D, B, T, NH, NKV): writes the k and
  v columns of dqkv; grid (B*NKV, ceil(T/KEYS)), block (bkv, y) owns key block y.
- flash_attention_backward_dq_hs{...}(same arguments): writes the q columns; grid (B*NH,
  ceil(T/ROWS)), the longest rows first.
qkv and dqkv are (B,T,(NH+2NKV)*HS) (GPT-2: NKV = NH, (B,T,3C)); out, dout (B,T,NH*HS); lse, D
(B,NH,T) fp32. The launcher checks: NH % NKV == 0, HS % x128::size == 0 and 16-byte aligned
pointers (the cp.async copies and 16-byte stores); offsets are size_t (B*T*3C can pass 2^31).
*/
#include "common.cuh"
#include "flash_attention.cuh"

// ----------------------------------------------------------------------------
// the tile shape of each head size (llmc/attention.py's FLASH_TILES restates them;
// tests/test_flash_attention_host.py checks that the two agree)
//
// bf16: HS <= 64 keeps Q's fragments in registers with two row tiles per warp at HS = 64 (each
// K and V fragment loaded from shared memory then feeds two mma); HS = 128 has one row tile per
// warp (O alone is 64 registers). fp32 tiles are twice the bytes: fewer keys per stage.
//                     ForwardTiles<HS, warps, row tiles per warp, keys, stages>
//                     DkdvTiles<HS, warps (16 keys each), queries, stages>
//                     DqTiles<HS, warps (16 rows each), keys, stages>
#if defined(ENABLE_BF16)
typedef ForwardTiles<16, 4, 1, 32, 2> ForwardTilesHS16;
typedef ForwardTiles<32, 4, 1, 64, 2> ForwardTilesHS32;
typedef ForwardTiles<64, 4, 2, 64, 2> ForwardTilesHS64;
typedef ForwardTiles<128, 4, 1, 64, 2> ForwardTilesHS128;
typedef DkdvTiles<16, 4, 32, 2> DkdvTilesHS16;
typedef DkdvTiles<32, 4, 64, 2> DkdvTilesHS32;
typedef DkdvTiles<64, 4, 32, 2> DkdvTilesHS64;
typedef DkdvTiles<128, 4, 32, 2> DkdvTilesHS128;
typedef DqTiles<16, 4, 32, 2> DqTilesHS16;
typedef DqTiles<32, 4, 64, 2> DqTilesHS32;
typedef DqTiles<64, 4, 64, 2> DqTilesHS64;
typedef DqTiles<128, 4, 64, 2> DqTilesHS128;
#else
typedef ForwardTiles<16, 4, 1, 32, 2> ForwardTilesHS16;
typedef ForwardTiles<32, 4, 1, 32, 2> ForwardTilesHS32;
typedef ForwardTiles<64, 4, 1, 32, 2> ForwardTilesHS64;
typedef ForwardTiles<128, 4, 1, 32, 2> ForwardTilesHS128;
typedef DkdvTiles<16, 4, 32, 2> DkdvTilesHS16;
typedef DkdvTiles<32, 4, 32, 2> DkdvTilesHS32;
typedef DkdvTiles<64, 4, 32, 2> DkdvTilesHS64;
typedef DkdvTiles<128, 4, 32, 2> DkdvTilesHS128;
typedef DqTiles<16, 4, 32, 2> DqTilesHS16;
typedef DqTiles<32, 4, 32, 2> DqTilesHS32;
typedef DqTiles<64, 4, 32, 2> DqTilesHS64;
typedef DqTiles<128, 4, 32, 2> DqTilesHS128;
#endif

// the block's dynamic shared memory (the launch's shared_mem bytes), carved up by each kernel
extern __shared__ __align__(16) char flash_smem[];

// ----------------------------------------------------------------------------
// backward preprocess: D (B,NH,T) = rowsum(dout * out) per head, one thread per (b, t, h) row of
// HS values. Row (b*T + t)*NH + h starts at element row*HS of out and dout, since C = NH*HS.

extern "C" __global__ void flash_attention_backward_preprocess(float* D, const floatX* dout, const floatX* out,
                                                               int B, int T, int NH, int HS) {
    const size_t num_rows = (size_t)B * T * NH;
    for (size_t row = blockIdx.x * (size_t)blockDim.x + threadIdx.x; row < num_rows;
         row += (size_t)gridDim.x * blockDim.x) {
        const size_t offset = row * HS;
        float sum = 0.0f;
        for (int c = 0; c < HS; c += x128::size) {
            const x128 d = load128cs(dout + offset + c);
            const x128 o = load128cs(out + offset + c);
            for (int k = 0; k < x128::size; k++) {
                sum += (float)d[k] * (float)o[k];
            }
        }
        const size_t h = row % NH, bt = row / NH;
        const size_t t = bt % T, b = bt / T;
        D[(b * NH + h) * T + t] = sum;
    }
}

// ----------------------------------------------------------------------------
// entry points, one per head size (GPT-2 124M: 64; Llama 3 8B: 128; the tiny test models: 16, 32)

extern "C" __global__ void __launch_bounds__(ForwardTilesHS16::THREADS)
flash_attention_forward_hs16(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardTilesHS16>(out, lse, qkv, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(ForwardTilesHS32::THREADS)
flash_attention_forward_hs32(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardTilesHS32>(out, lse, qkv, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(ForwardTilesHS64::THREADS)
flash_attention_forward_hs64(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardTilesHS64>(out, lse, qkv, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(ForwardTilesHS128::THREADS)
flash_attention_forward_hs128(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardTilesHS128>(out, lse, qkv, T, NH, NKV, flash_smem);
}

extern "C" __global__ void __launch_bounds__(DkdvTilesHS16::THREADS)
flash_attention_backward_dkdv_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                   const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvTilesHS16>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(DkdvTilesHS32::THREADS)
flash_attention_backward_dkdv_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                   const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvTilesHS32>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(DkdvTilesHS64::THREADS)
flash_attention_backward_dkdv_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                   const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvTilesHS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(DkdvTilesHS128::THREADS)
flash_attention_backward_dkdv_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                    const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvTilesHS128>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}

extern "C" __global__ void __launch_bounds__(DqTilesHS16::THREADS)
flash_attention_backward_dq_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqTilesHS16>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqTilesHS32::THREADS)
flash_attention_backward_dq_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqTilesHS32>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqTilesHS64::THREADS)
flash_attention_backward_dq_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqTilesHS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqTilesHS128::THREADS)
flash_attention_backward_dq_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqTilesHS128>(dqkv, dout, qkv, lse, D, T, NH, NKV, flash_smem);
}
