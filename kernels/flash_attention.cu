/*
kernels/flash_attention.cu: causal multi-head attention without the (B,NH,T,T) matrix: the
forward and a deterministic backward, tiled through shared memory, bf16 tensor cores (wmma)
in the bf16 build and plain FMAs in the fp32 build.

Progression: `python dev/cuda/attention.py` shows the way here; this file is its version 3 of the
attention forward and backward, each version validated against gpt2_cpu.py, then timed against the
GPU's measured limits.

What it computes (gpt2_cpu.attention_forward / attention_backward, the math of kernels/attention.cu),
for each (b, h) with q, k, v (T,HS) read straight from the qkv projection:
    s[t,j] = scale * q_t . k_j,  scale = 1/sqrt(HS),  only for keys j <= t (causal mask)
    lse[t] = log sum_{j<=t} exp(s[t,j])                    (the log-sum-exp of row t)
    p[t,j] = exp(s[t,j] - lse[t])                          (the softmax, never stored)
    out[t] = sum_{j<=t} p[t,j] v_j
and its backward from dout (= dO):
    D[t]     = dO_t . out_t  = sum_j p[t,j] dP[t,j]        (the softmax Jacobian's shared term)
    dP[t,j]  = dO_t . v_j,   dS[t,j] = p[t,j] (dP[t,j] - D[t])
    dv_j = sum_{t>=j} p[t,j] dO_t,  dq_t = scale sum_{j<=t} dS[t,j] k_j,  dk_j = scale sum_{t>=j} dS[t,j] q_t
Memory layout: qkv (B,T,3C) holds q of head h at column h*HS, k at C + h*HS, v at 2C + h*HS of row
b*T+t; out and dout (B,T,C) hold head h at columns h*HS..; dqkv (B,T,3C) is written in qkv's
layout (dq | dk | dv), ready for the qkv matmul's backward; lse and D are (B,NH,T) fp32. No permute
kernels and no per-head copies: each block reads its head's columns with a row stride of 3C (or C).

Sources: Dao et al. 2022, "FlashAttention", Alg. 1 (tiling + online softmax, Milakov & Gimelshein
2018) with the loop order of Dao 2023, "FlashAttention-2", Alg. 1 (the outer loop over query blocks
lives in the grid, each block keeps its running max m, sum l and output accumulator O and streams
the key/value blocks) and the backward of FlashAttention-2 Alg. 2, made deterministic: instead of
one pass that adds dq with float atomics, dk/dv and dq are two kernels, each owning its outputs.

Tiling. A block OWNS R rows (query rows in the forward and dq kernels, key rows in the dk/dv kernel),
16 rows per warp, and STREAMS blocks of S rows of the other side through shared memory:

    forward / dq, one block per (b, h, query block)        dk/dv, one block per (b, h, key block)
                 keys ->                                                queries ->
             kb=0   kb=1   kb=2                                      qb=0   qb=1   qb=2   qb=3
            +------+------+------+                                +------+------+------+------+
    warp 0  |######|\     |      |  query rows q0..q0+R-1  warp 0 |      |\#####|######|######|
    warp 1  |######|##\   |      |  (R = 4 warps x 16)     warp 1 |      |  \###|######|######|
            +------+------+------+                                +------+------+------+------+
     ###: all keys j <= t: no mask;  \ : the diagonal,             the key rows j own the block; query blocks
     masked elementwise; right of it: never computed (the          left of the diagonal are never loaded,
     loop stops at the diagonal; a warp whose 16 rows all lie      those past T neither; rows >= T are masked.
     before a key block skips it).

Per streamed block, a warp computes with its own 16 rows only (no block-wide sync except around the
shared loads of the streamed tiles):
    1. S = (its 16 rows of Q) K^T          16 x S scores, fp32, into its rows of s_tile     [tensor cores]
    2. lanes 2r and 2r+1 own row r: each takes half the S columns of the row, and the pair
       reduces with one __shfl_xor(1): the online softmax (m, l, alpha = exp(m_old - m_new)),
       the probabilities P rounded to floatX into p_tile
    3. O = diag(alpha) O + P V             accumulated in registers                          [tensor cores]
The backward kernels repeat 1-2 with lse in place of the running max (P is exact at once), then
dV += P^T dO, dP = V dO^T (or dO V^T), dS = P (dP - D) into p_tile, dK += dS^T Q (or dQ += dS K).

Tile sizes: R = min(64, 8 KiB / (HS * sizeof(floatX))) owned rows (one tile of owned rows is at
most 8 KiB) and S = min(32, R) streamed rows, so that the six tiles of a kernel fit in the 48 KiB
of static shared memory (static_asserted below; CuPy launches without dynamic shared memory):
    bf16: HS 16, 32, 64 -> R=64, S=32 (4 warps);  HS 128 -> R=32, S=32 (2 warps)
    fp32: HS 16, 32 -> R=64, S=32;  HS 64 -> R=32, S=32;  HS 128 -> R=16, S=16 (1 warp)
Every shared row is padded by 16 bytes, so consecutive rows start 4 banks apart (no 8-way bank
conflicts on the column reads of the matrix loads) and every 16x16 tile still starts 32-byte
aligned, as wmma needs. gpt2_cuda.flash_attention_tiles restates the rule for the launchers.

Tensor cores (bf16 build): the matrix products are 16x16x16 wmma operations with bf16 inputs and
fp32 accumulation (sm_80+), written as inline PTX (wmma.load / wmma.mma / wmma.store) because
NVRTC with the pip CUDA headers has no <mma.h>. The register layout of an accumulator fragment is
unspecified, so the per-row rescale of O uses a "row index" fragment: a 16x16 tile whose (r, c)
element is r, loaded once with the same instruction as every accumulator; element i of any
accumulator then belongs to row rows.x[i]. The fp32 build implements the same five tile operations
with scalar FMAs in a known layout (lane l: row l/2, columns (l%2)*8..+7), so the algorithm code
above them is written once.

Why it is meant to be fast: the T x T scores never leave the SM (HBM
traffic is O(T*HS) per head instead of O(T*T)); both products per streamed block run on tensor
cores; the causal structure halves the work (blocks right of the diagonal are never loaded). What
it leaves on the table against cuDNN / FlashAttention-2: S and P make a round trip through shared
memory (FA2 keeps them in registers via the documented mma.m16n8k16 layout), tile loads are not
pipelined (no cp.async double buffering), and the softmax is scalar. Expect it slower than cuDNN's
fused attention.

Determinism: every output element is written (=) exactly once, by one thread, after a fixed-order
sum (no atomics), so two runs give bitwise equal results.

Kernels (floatX per common.cuh; launcher: gpt2_cuda.flash_attention_forward / _backward):
- flash_attention_forward_hs{16,32,64,128}(out, lse, qkv, B, T, NH): grid (B*NH, ceil(T/R)),
  blockDim R/16*32. Block (bh, y) owns query block ceil(T/R)-1-y (the longest rows start first).
- flash_attention_backward_preprocess(D, dout, out, B, T, NH, HS): D = rowsum(dout * out); one thread
  per (b, t, h) row, grid-stride, any grid and block size.
- flash_attention_backward_dkdv_hs{...}(dqkv, dout, qkv, lse, D, B, T, NH): writes the dk and dv
  columns of dqkv; grid (B*NH, ceil(T/R)), block (bh, y) owns key block y (block 0 has the most
  queries and starts first).
- flash_attention_backward_dq_hs{...}(dqkv, dout, qkv, lse, D, B, T, NH): writes the dq columns;
  grid and block as the forward.
The launcher must check: HS % x128::size == 0 (true for the supported HS), 16-byte aligned
pointers, and pass exactly this grid and blockDim (the tile sizes are compile-time constants here).
Offsets into qkv, out, dqkv are size_t: B*T*3C can exceed 2^31.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// tile sizes

#define TILE 16                     // edge of one tensor-core tile (m16n16k16); one warp's rows
#define MAX_OWNED_ROWS 64           // 4 warps
#define MAX_STREAMED_ROWS 32
#define OWNED_TILE_BYTES 8192       // one tile of owned rows is at most 8 KiB
#define ROW_PAD_BYTES 16            // shared rows padded by 16 bytes: 4 banks of skew per row
#define MAX_STATIC_SHARED_BYTES 49152

__host__ __device__ constexpr int const_min(int a, int b) { return a < b ? a : b; }

template <int HS>
struct FlashTiles {
    static_assert(HS % TILE == 0, "the head size must be a multiple of 16");
    static constexpr int OWNED = const_min(MAX_OWNED_ROWS, OWNED_TILE_BYTES / (HS * (int)sizeof(floatX)));
    static constexpr int STREAMED = const_min(MAX_STREAMED_ROWS, OWNED);
    static constexpr int WARPS = OWNED / TILE;
    static constexpr int HS_TILES = HS / TILE;                               // accumulator tiles per warp
    static constexpr int LD = HS + ROW_PAD_BYTES / (int)sizeof(floatX);      // q, k, v, dout tiles (floatX)
    static constexpr int SLD = STREAMED + ROW_PAD_BYTES / (int)sizeof(float);    // score tiles (float)
    static constexpr int PLD = STREAMED + ROW_PAD_BYTES / (int)sizeof(floatX);   // probability tiles (floatX)
    static constexpr int COLS_PER_LANE = STREAMED / 2;                       // lanes 2r, 2r+1 split row r
    static_assert(OWNED % STREAMED == 0 && STREAMED % TILE == 0, "tiles are whole 16x16 tiles");
};

// ----------------------------------------------------------------------------
// 16x16 tile operations of one warp: the only code that differs between the two builds
//
// AccTile: a 16x16 fp32 accumulator spread over the 32 lanes of a warp, 8 values per lane.
// tile_mma<LAYOUT_B>(d, A, lda, B, ldb): d += A @ B for a 16x16 A (row-major in shared memory,
//     element (r, k) at A[r*lda + k]) and a 16x16 B stored as LAYOUT_B says:
//         ROW_MAJOR: element (k, n) at B[k*ldb + n]        (V, dout, Q, K as the right factor)
//         COL_MAJOR: element (k, n) at B[n*ldb + k]        (K^T, Q^T, V^T, dout^T: a row-major tile read transposed)
// tile_store(p, ld, acc) / tile_load_acc(acc, p, ld): element (r, c) at p[r*ld + c], fp32.
// All lanes of the warp must call them together (warp-synchronous); they read or write shared
// memory written or read by other lanes, so callers put __syncwarp() between producer and consumer.

enum OperandLayout { ROW_MAJOR, COL_MAJOR };

struct AccTile {
    float x[8];
};

// The emulated device (llmc/emulator/, LLMC_EMULATED_DEVICE) has no tensor cores: its bf16 build
// takes the scalar tile operations below, under the same tile algorithm (bf16 operands, fp32 sums).
#if defined(ENABLE_BF16) && !defined(LLMC_EMULATED_DEVICE)

// A or B operand of m16n16k16 bf16: 4 registers, each holding two bf16 values
struct OperandTile {
    unsigned int r[4];
};

__device__ inline void tile_load_a(OperandTile& a, const floatX* p, int ld) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(a.r[0]), "=r"(a.r[1]), "=r"(a.r[2]), "=r"(a.r[3]) : "l"(p), "r"(ld) : "memory");
}

template <OperandLayout LAYOUT_B>
__device__ inline void tile_mma(AccTile& d, const floatX* A, int lda, const floatX* B, int ldb) {
    OperandTile a, b;
    tile_load_a(a, A, lda);
    // the mma must name the same layouts its operands were loaded with
    if constexpr (LAYOUT_B == ROW_MAJOR) {
        asm volatile("wmma.load.b.sync.aligned.row.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(b.r[0]), "=r"(b.r[1]), "=r"(b.r[2]), "=r"(b.r[3]) : "l"(B), "r"(ldb) : "memory");
        asm volatile("wmma.mma.sync.aligned.row.row.m16n16k16.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, {%12, %13, %14, %15}, "
                     "{%0, %1, %2, %3, %4, %5, %6, %7};"
                     : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3]),
                       "+f"(d.x[4]), "+f"(d.x[5]), "+f"(d.x[6]), "+f"(d.x[7])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]),
                       "r"(b.r[0]), "r"(b.r[1]), "r"(b.r[2]), "r"(b.r[3]));
    } else {
        asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.bf16 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(b.r[0]), "=r"(b.r[1]), "=r"(b.r[2]), "=r"(b.r[3]) : "l"(B), "r"(ldb) : "memory");
        asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32 "
                     "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, {%12, %13, %14, %15}, "
                     "{%0, %1, %2, %3, %4, %5, %6, %7};"
                     : "+f"(d.x[0]), "+f"(d.x[1]), "+f"(d.x[2]), "+f"(d.x[3]),
                       "+f"(d.x[4]), "+f"(d.x[5]), "+f"(d.x[6]), "+f"(d.x[7])
                     : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]),
                       "r"(b.r[0]), "r"(b.r[1]), "r"(b.r[2]), "r"(b.r[3]));
    }
}

__device__ inline void tile_store(float* p, int ld, const AccTile& c) {
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8}, %9;"
                 :: "l"(p), "f"(c.x[0]), "f"(c.x[1]), "f"(c.x[2]), "f"(c.x[3]),
                    "f"(c.x[4]), "f"(c.x[5]), "f"(c.x[6]), "f"(c.x[7]), "r"(ld) : "memory");
}

__device__ inline void tile_load_acc(AccTile& c, const float* p, int ld) {
    asm volatile("wmma.load.c.sync.aligned.row.m16n16k16.f32 {%0, %1, %2, %3, %4, %5, %6, %7}, [%8], %9;"
                 : "=f"(c.x[0]), "=f"(c.x[1]), "=f"(c.x[2]), "=f"(c.x[3]),
                   "=f"(c.x[4]), "=f"(c.x[5]), "=f"(c.x[6]), "=f"(c.x[7]) : "l"(p), "r"(ld) : "memory");
}

#else   // ENABLE_FP32 or the emulated device: the same operations with scalar FMAs; lane l holds row l/2, columns (l%2)*8..+7

__device__ inline int acc_row() { return (threadIdx.x % WARP_SIZE) / 2; }
__device__ inline int acc_col0() { return (threadIdx.x % 2) * 8; }

template <OperandLayout LAYOUT_B>
__device__ inline void tile_mma(AccTile& d, const floatX* A, int lda, const floatX* B, int ldb) {
    const int r = acc_row(), c0 = acc_col0();
#pragma unroll 1                            // a rolled loop: 16x less code to compile, same FMAs
    for (int k = 0; k < TILE; k++) {
        const float a = A[r * lda + k];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float b = (LAYOUT_B == ROW_MAJOR) ? B[k * ldb + c0 + i] : B[(c0 + i) * ldb + k];
            d.x[i] += a * b;
        }
    }
}

__device__ inline void tile_store(float* p, int ld, const AccTile& c) {
    const int r = acc_row(), c0 = acc_col0();
#pragma unroll
    for (int i = 0; i < 8; i++) {
        p[r * ld + c0 + i] = c.x[i];
    }
}

__device__ inline void tile_load_acc(AccTile& c, const float* p, int ld) {
    const int r = acc_row(), c0 = acc_col0();
#pragma unroll
    for (int i = 0; i < 8; i++) {
        c.x[i] = p[r * ld + c0 + i];
    }
}

#endif

// ----------------------------------------------------------------------------
// helpers written once on top of the tile operations

__device__ inline AccTile tile_zero() {
    AccTile c;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        c.x[i] = 0.0f;
    }
    return c;
}

// The row index tile: element i of any AccTile of this warp lies in row (int)rows.x[i]. Built by
// writing r into (r, c) of a warp-private 16x16 scratch and loading it as an accumulator, so it
// holds for whatever register layout tile_load_acc uses. Each lane writes 8 of the 256 entries.
__device__ inline AccTile tile_row_indices(float* scratch, int ld) {
    const int lane = threadIdx.x % WARP_SIZE;
    for (int i = 0; i < 8; i++) {
        const int e = lane * 8 + i;                         // entries 0..255, row-major
        scratch[(e / TILE) * ld + e % TILE] = (float)(e / TILE);
    }
    __syncwarp();
    AccTile rows;
    tile_load_acc(rows, scratch, ld);
    __syncwarp();                                           // the caller may overwrite scratch next
    return rows;
}

// acc *= row_factor[row] elementwise: row_factor holds one factor per row of the warp's 16 rows
__device__ inline void tile_scale_rows(AccTile& acc, const AccTile& rows, const float* row_factor) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        acc.x[i] *= row_factor[(int)rows.x[i]];
    }
}

// S (16 x N fp32, lds) = A (16 x K) @ B^T for B (N x K): both operands row-major floatX tiles
template <int K, int N>
__device__ inline void warp_matmul_abt(float* S, int lds, const floatX* A, int lda, const floatX* B, int ldb) {
#pragma unroll
    for (int n0 = 0; n0 < N; n0 += TILE) {
        AccTile acc = tile_zero();
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += TILE) {
            tile_mma<COL_MAJOR>(acc, A + k0, lda, B + n0 * ldb + k0, ldb);   // B^T's (k0, n0) tile
        }
        tile_store(S + n0, lds, acc);
    }
}

// acc (16 x N, as N/16 tiles in registers) += A (16 x K) @ B (K x N): both row-major floatX tiles
template <int K, int N>
__device__ inline void warp_matmul_ab(AccTile* acc, const floatX* A, int lda, const floatX* B, int ldb) {
#pragma unroll
    for (int j = 0; j < N / TILE; j++) {
#pragma unroll
        for (int k0 = 0; k0 < K; k0 += TILE) {
            tile_mma<ROW_MAJOR>(acc[j], A + k0, lda, B + k0 * ldb + j * TILE, ldb);
        }
    }
}

// Every thread of the block copies x128 groups: tile row r (row stride LD) = src row first + r
// (row stride src_stride elements, HS values), zeros for rows at or past T, so that masked and
// out-of-range rows can never inject NaN or garbage into a product.
template <int HS, int LD>
__device__ inline void load_tile_rows(floatX* tile, int rows, const floatX* src, size_t src_stride,
                                      int first, int T) {
    constexpr int GROUPS = HS / x128::size;
    for (int g = threadIdx.x; g < rows * GROUPS; g += blockDim.x) {
        const int r = g / GROUPS, c = (g % GROUPS) * x128::size;
        const int t = first + r;
        const x128 value = t < T ? load128(src + (size_t)t * src_stride + c) : x128::zeros();
        store128(tile + r * LD + c, value);
    }
}

// dst[i] = src[first + i] for first + i < T, else 0 (per-query lse and D of a streamed block)
__device__ inline void load_row_values(float* dst, int n, const float* src, int first, int T) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        dst[i] = first + i < T ? src[first + i] : 0.0f;
    }
}

// Write the warp's 16 x HS accumulator (HS/16 tiles) as floatX into rows first_row.. of dst (row
// stride dst_stride), skipping rows at or past T. Each tile goes through the warp's 16x16 fp32
// scratch; lane pair (2r, 2r+1) then writes 8 contiguous values each of row r: one 16-byte store
// in bf16, two in fp32.
template <int HS>
__device__ inline void warp_store_rows(floatX* dst, size_t dst_stride, int first_row, int T,
                                       const AccTile* acc, float* scratch, int ld) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int r = lane / 2, c0 = (lane % 2) * 8;
    const int t = first_row + r;
#pragma unroll
    for (int j = 0; j < HS / TILE; j++) {
        tile_store(scratch, ld, acc[j]);
        __syncwarp();
        if (t < T) {
            for (int g = 0; g < 8; g += x128::size) {
                x128 group;
                for (int e = 0; e < x128::size; e++) {
                    group[e] = (floatX)scratch[r * ld + c0 + g + e];
                }
                store128(dst + (size_t)t * dst_stride + j * TILE + c0 + g, group);
            }
        }
        __syncwarp();                                       // before the next tile overwrites scratch
    }
}

// ----------------------------------------------------------------------------
// forward: FlashAttention-2 Alg. 1, one block per (b, h, query block)

template <int HS>
__device__ void flash_attention_forward_block(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH) {
    typedef FlashTiles<HS> Tiles;
    constexpr int OWNED = Tiles::OWNED, STREAMED = Tiles::STREAMED, LD = Tiles::LD, SLD = Tiles::SLD,
                  PLD = Tiles::PLD, COLS = Tiles::COLS_PER_LANE;
    __shared__ __align__(32) floatX q_tile[OWNED * LD];
    __shared__ __align__(32) floatX k_tile[STREAMED * LD];
    __shared__ __align__(32) floatX v_tile[STREAMED * LD];
    __shared__ __align__(32) float s_tile[OWNED * SLD];
    __shared__ __align__(32) floatX p_tile[OWNED * PLD];
    __shared__ float row_factor[OWNED];                    // alpha per row, then 1/l at the end
    static_assert(sizeof(q_tile) + sizeof(k_tile) + sizeof(v_tile) + sizeof(s_tile) + sizeof(p_tile)
                  + sizeof(row_factor) <= MAX_STATIC_SHARED_BYTES, "forward tiles exceed 48 KiB");

    const int C = NH * HS;
    const size_t qkv_stride = 3 * (size_t)C;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * OWNED;             // the longest rows start first
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int r = lane / 2, half = lane % 2;                          // lane pair (2r, 2r+1) owns row r
    const int warp_row0 = warp * TILE;                                // the warp's rows in the block
    const int t = q0 + warp_row0 + r;                                 // this lane pair's query
    const float scale = 1.0f / sqrtf((float)HS);
    const floatX* q_src = qkv + (size_t)b * T * qkv_stride + h * HS;
    float* s_warp = s_tile + warp_row0 * SLD;
    floatX* p_warp = p_tile + warp_row0 * PLD;
    float* factor_warp = row_factor + warp_row0;

    load_tile_rows<HS, LD>(q_tile, OWNED, q_src, qkv_stride, q0, T);
    const AccTile rows = tile_row_indices(s_warp, SLD);
    AccTile o[Tiles::HS_TILES];                                       // O, unnormalized, in registers
#pragma unroll
    for (int j = 0; j < Tiles::HS_TILES; j++) {
        o[j] = tile_zero();
    }
    float m = NEGATIVE_INFINITY, l = 0.0f;                            // running max and sum of row t
    const int num_key_blocks = (min(q0 + OWNED, T) + STREAMED - 1) / STREAMED;   // up to the diagonal
    for (int kb = 0; kb < num_key_blocks; kb++) {
        const int k0 = kb * STREAMED;
        __syncthreads();                   // q_tile is loaded; every warp is done with the last k, v
        load_tile_rows<HS, LD>(k_tile, STREAMED, q_src + C, qkv_stride, k0, T);
        load_tile_rows<HS, LD>(v_tile, STREAMED, q_src + 2 * C, qkv_stride, k0, T);
        __syncthreads();
        if (k0 > q0 + warp_row0 + TILE - 1) {
            continue;                      // every key after every row of this warp: all masked
        }
        // 1. S = Q K^T for the warp's 16 rows: (16,HS) @ (HS,STREAMED) -> (16,STREAMED)
        warp_matmul_abt<HS, STREAMED>(s_warp, SLD, q_tile + warp_row0 * LD, LD, k_tile, LD);
        __syncwarp();
        // 2. online softmax of row t over this block's columns (keys k0 + c), masked at j > t
        float p[COLS];
        float block_max = NEGATIVE_INFINITY;
        for (int i = 0; i < COLS; i++) {
            const int c = half * COLS + i;
            p[i] = (k0 + c <= t) ? scale * s_warp[r * SLD + c] : NEGATIVE_INFINITY;
            block_max = fmaxf(block_max, p[i]);
        }
        block_max = fmaxf(block_max, __shfl_xor_sync(FULL_WARP_MASK, block_max, 1));
        const float m_new = fmaxf(m, block_max);       // finite: key 0 <= t lies in block 0
        const float alpha = expf(m - m_new);           // rescales the old l and O; 0 on block 0
        float sum = 0.0f;
        for (int i = 0; i < COLS; i++) {
            p[i] = expf(p[i] - m_new);                 // exp(-inf) = 0 for masked keys
            sum += p[i];
            p_warp[r * PLD + half * COLS + i] = (floatX)p[i];
        }
        sum += __shfl_xor_sync(FULL_WARP_MASK, sum, 1);   // a + b == b + a: both lanes agree
        l = alpha * l + sum;
        m = m_new;
        if (half == 0) {
            factor_warp[r] = alpha;
        }
        __syncwarp();
        // 3. O = diag(alpha) O + P V: (16,STREAMED) @ (STREAMED,HS) -> (16,HS)
#pragma unroll
        for (int j = 0; j < Tiles::HS_TILES; j++) {
            tile_scale_rows(o[j], rows, factor_warp);
        }
        warp_matmul_ab<STREAMED, HS>(o, p_warp, PLD, v_tile, LD);
    }
    // out = O / l (l >= 1: the row's max contributes exp(0)), lse = m + log(l)
    __syncwarp();                          // every lane has read factor_warp's alphas
    if (half == 0) {
        factor_warp[r] = 1.0f / l;
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < Tiles::HS_TILES; j++) {
        tile_scale_rows(o[j], rows, factor_warp);
    }
    warp_store_rows<HS>(out + (size_t)b * T * C + h * HS, C, q0 + warp_row0, T, o, s_warp, SLD);
    if (half == 0 && t < T) {
        lse[(size_t)bh * T + t] = m + logf(l);
    }
}

// ----------------------------------------------------------------------------
// backward: FlashAttention-2 Alg. 2 as three kernels, no atomics

// D (B,NH,T) = rowsum(dout * out) per head: one thread per (b, t, h) row of HS values. Row
// (b*T + t)*NH + h starts at element row*HS of out and dout, since C = NH*HS.
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

// dk, dv of one key block: the block owns key rows k0.., streams the query blocks at or after the
// diagonal; lanes (2r, 2r+1) own key j. P^T and dS^T are computed directly (the transposed roles).
template <int HS>
__device__ void flash_attention_backward_dkdv_block(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                    const float* lse, const float* D, int B, int T, int NH) {
    typedef FlashTiles<HS> Tiles;
    constexpr int OWNED = Tiles::OWNED, STREAMED = Tiles::STREAMED, LD = Tiles::LD, SLD = Tiles::SLD,
                  PLD = Tiles::PLD, COLS = Tiles::COLS_PER_LANE;
    __shared__ __align__(32) floatX k_tile[OWNED * LD];
    __shared__ __align__(32) floatX v_tile[OWNED * LD];
    __shared__ __align__(32) floatX q_tile[STREAMED * LD];
    __shared__ __align__(32) floatX dout_tile[STREAMED * LD];
    __shared__ __align__(32) float s_tile[OWNED * SLD];     // S^T, then dP^T
    __shared__ __align__(32) floatX p_tile[OWNED * PLD];    // P^T, then dS^T
    __shared__ float lse_tile[STREAMED];
    __shared__ float d_tile[STREAMED];
    static_assert(sizeof(k_tile) + sizeof(v_tile) + sizeof(q_tile) + sizeof(dout_tile) + sizeof(s_tile)
                  + sizeof(p_tile) + sizeof(lse_tile) + sizeof(d_tile) <= MAX_STATIC_SHARED_BYTES,
                  "dk/dv tiles exceed 48 KiB");

    const int C = NH * HS;
    const size_t qkv_stride = 3 * (size_t)C;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int k0 = blockIdx.y * OWNED;                      // key block 0 sees the most queries: first
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int r = lane / 2, half = lane % 2;
    const int warp_row0 = warp * TILE;
    const int j = k0 + warp_row0 + r;                       // this lane pair's key
    const float scale = 1.0f / sqrtf((float)HS);
    const floatX* q_src = qkv + (size_t)b * T * qkv_stride + h * HS;
    const floatX* dout_src = dout + (size_t)b * T * C + h * HS;
    float* s_warp = s_tile + warp_row0 * SLD;
    floatX* p_warp = p_tile + warp_row0 * PLD;

    load_tile_rows<HS, LD>(k_tile, OWNED, q_src + C, qkv_stride, k0, T);
    load_tile_rows<HS, LD>(v_tile, OWNED, q_src + 2 * C, qkv_stride, k0, T);
    AccTile dk[Tiles::HS_TILES], dv[Tiles::HS_TILES];
#pragma unroll
    for (int i = 0; i < Tiles::HS_TILES; i++) {
        dk[i] = tile_zero();
        dv[i] = tile_zero();
    }
    for (int t0 = (k0 / STREAMED) * STREAMED; t0 < T; t0 += STREAMED) {   // from the diagonal on
        __syncthreads();                   // k, v are loaded; every warp is done with the last q, dout
        load_tile_rows<HS, LD>(q_tile, STREAMED, q_src, qkv_stride, t0, T);
        load_tile_rows<HS, LD>(dout_tile, STREAMED, dout_src, C, t0, T);
        load_row_values(lse_tile, STREAMED, lse + (size_t)bh * T, t0, T);
        load_row_values(d_tile, STREAMED, D + (size_t)bh * T, t0, T);
        __syncthreads();
        if (k0 + warp_row0 > t0 + STREAMED - 1) {
            continue;                      // every query before every key of this warp: all masked
        }
        // S^T = K Q^T: (16,HS) @ (HS,STREAMED) -> (16,STREAMED); P^T = exp(scale S^T - lse)
        warp_matmul_abt<HS, STREAMED>(s_warp, SLD, k_tile + warp_row0 * LD, LD, q_tile, LD);
        __syncwarp();
        float p[COLS];
        for (int i = 0; i < COLS; i++) {
            const int c = half * COLS + i, tq = t0 + c;
            p[i] = (j <= tq && tq < T) ? expf(scale * s_warp[r * SLD + c] - lse_tile[c]) : 0.0f;
            p_warp[r * PLD + c] = (floatX)p[i];
        }
        __syncwarp();
        // dV += P^T dO: (16,STREAMED) @ (STREAMED,HS)
        warp_matmul_ab<STREAMED, HS>(dv, p_warp, PLD, dout_tile, LD);
        // dP^T = V dO^T: (16,HS) @ (HS,STREAMED), over S^T (read above, before the __syncwarp)
        warp_matmul_abt<HS, STREAMED>(s_warp, SLD, v_tile + warp_row0 * LD, LD, dout_tile, LD);
        __syncwarp();
        // dS^T = P^T (dP^T - D), over P^T (its reads by dV's product came before the __syncwarp)
        for (int i = 0; i < COLS; i++) {
            const int c = half * COLS + i;
            p_warp[r * PLD + c] = (floatX)(p[i] * (s_warp[r * SLD + c] - d_tile[c]));
        }
        __syncwarp();
        // dK += dS^T Q: (16,STREAMED) @ (STREAMED,HS); the scale is applied once, at the end
        warp_matmul_ab<STREAMED, HS>(dk, p_warp, PLD, q_tile, LD);
    }
    __syncwarp();                          // the last dS^T reads of s_warp are done: it is scratch now
#pragma unroll
    for (int i = 0; i < Tiles::HS_TILES; i++) {
        for (int e = 0; e < 8; e++) {
            dk[i].x[e] *= scale;
        }
    }
    floatX* dqkv_b = dqkv + (size_t)b * T * qkv_stride + h * HS;
    warp_store_rows<HS>(dqkv_b + C, qkv_stride, k0 + warp_row0, T, dk, s_warp, SLD);
    warp_store_rows<HS>(dqkv_b + 2 * C, qkv_stride, k0 + warp_row0, T, dv, s_warp, SLD);
}

// dq of one query block: the block owns query rows q0.., streams the key blocks up to the diagonal
template <int HS>
__device__ void flash_attention_backward_dq_block(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                  const float* lse, const float* D, int B, int T, int NH) {
    typedef FlashTiles<HS> Tiles;
    constexpr int OWNED = Tiles::OWNED, STREAMED = Tiles::STREAMED, LD = Tiles::LD, SLD = Tiles::SLD,
                  PLD = Tiles::PLD, COLS = Tiles::COLS_PER_LANE;
    __shared__ __align__(32) floatX q_tile[OWNED * LD];
    __shared__ __align__(32) floatX dout_tile[OWNED * LD];
    __shared__ __align__(32) floatX k_tile[STREAMED * LD];
    __shared__ __align__(32) floatX v_tile[STREAMED * LD];
    __shared__ __align__(32) float s_tile[OWNED * SLD];     // S, then dP
    __shared__ __align__(32) floatX p_tile[OWNED * PLD];    // dS
    static_assert(sizeof(q_tile) + sizeof(dout_tile) + sizeof(k_tile) + sizeof(v_tile) + sizeof(s_tile)
                  + sizeof(p_tile) <= MAX_STATIC_SHARED_BYTES, "dq tiles exceed 48 KiB");

    const int C = NH * HS;
    const size_t qkv_stride = 3 * (size_t)C;
    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * OWNED;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int r = lane / 2, half = lane % 2;
    const int warp_row0 = warp * TILE;
    const int t = q0 + warp_row0 + r;                       // this lane pair's query
    const float scale = 1.0f / sqrtf((float)HS);
    const floatX* q_src = qkv + (size_t)b * T * qkv_stride + h * HS;
    float* s_warp = s_tile + warp_row0 * SLD;
    floatX* p_warp = p_tile + warp_row0 * PLD;
    const float lse_t = t < T ? lse[(size_t)bh * T + t] : 0.0f;
    const float d_t = t < T ? D[(size_t)bh * T + t] : 0.0f;

    load_tile_rows<HS, LD>(q_tile, OWNED, q_src, qkv_stride, q0, T);
    load_tile_rows<HS, LD>(dout_tile, OWNED, dout + (size_t)b * T * C + h * HS, C, q0, T);
    AccTile dq[Tiles::HS_TILES];
#pragma unroll
    for (int i = 0; i < Tiles::HS_TILES; i++) {
        dq[i] = tile_zero();
    }
    const int num_key_blocks = (min(q0 + OWNED, T) + STREAMED - 1) / STREAMED;
    for (int kb = 0; kb < num_key_blocks; kb++) {
        const int k0 = kb * STREAMED;
        __syncthreads();
        load_tile_rows<HS, LD>(k_tile, STREAMED, q_src + C, qkv_stride, k0, T);
        load_tile_rows<HS, LD>(v_tile, STREAMED, q_src + 2 * C, qkv_stride, k0, T);
        __syncthreads();
        if (k0 > q0 + warp_row0 + TILE - 1) {
            continue;
        }
        // S = Q K^T, P = exp(scale S - lse): (16,HS) @ (HS,STREAMED)
        warp_matmul_abt<HS, STREAMED>(s_warp, SLD, q_tile + warp_row0 * LD, LD, k_tile, LD);
        __syncwarp();
        float p[COLS];
        for (int i = 0; i < COLS; i++) {
            const int c = half * COLS + i;
            p[i] = (k0 + c <= t) ? expf(scale * s_warp[r * SLD + c] - lse_t) : 0.0f;
        }
        __syncwarp();
        // dP = dO V^T: (16,HS) @ (HS,STREAMED), over S
        warp_matmul_abt<HS, STREAMED>(s_warp, SLD, dout_tile + warp_row0 * LD, LD, v_tile, LD);
        __syncwarp();
        for (int i = 0; i < COLS; i++) {
            const int c = half * COLS + i;
            p_warp[r * PLD + c] = (floatX)(p[i] * (s_warp[r * SLD + c] - d_t));   // dS
        }
        __syncwarp();
        // dQ += dS K: (16,STREAMED) @ (STREAMED,HS); the scale is applied once, at the end
        warp_matmul_ab<STREAMED, HS>(dq, p_warp, PLD, k_tile, LD);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < Tiles::HS_TILES; i++) {
        for (int e = 0; e < 8; e++) {
            dq[i].x[e] *= scale;
        }
    }
    warp_store_rows<HS>(dqkv + (size_t)b * T * qkv_stride + h * HS, qkv_stride, q0 + warp_row0, T, dq, s_warp, SLD);
}

// ----------------------------------------------------------------------------
// entry points, one per supported head size (GPT-2: 64; the tiny test models: 16)

extern "C" __global__ void flash_attention_forward_hs16(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH) {
    flash_attention_forward_block<16>(out, lse, qkv, B, T, NH);
}
extern "C" __global__ void flash_attention_forward_hs32(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH) {
    flash_attention_forward_block<32>(out, lse, qkv, B, T, NH);
}
extern "C" __global__ void flash_attention_forward_hs64(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH) {
    flash_attention_forward_block<64>(out, lse, qkv, B, T, NH);
}
extern "C" __global__ void flash_attention_forward_hs128(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH) {
    flash_attention_forward_block<128>(out, lse, qkv, B, T, NH);
}

extern "C" __global__ void flash_attention_backward_dkdv_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                              const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dkdv_block<16>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void flash_attention_backward_dkdv_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                              const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dkdv_block<32>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void flash_attention_backward_dkdv_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                              const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dkdv_block<64>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void flash_attention_backward_dkdv_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                               const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dkdv_block<128>(dqkv, dout, qkv, lse, D, B, T, NH);
}

extern "C" __global__ void flash_attention_backward_dq_hs16(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                            const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dq_block<16>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void flash_attention_backward_dq_hs32(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                            const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dq_block<32>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void flash_attention_backward_dq_hs64(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                            const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dq_block<64>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void flash_attention_backward_dq_hs128(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                             const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dq_block<128>(dqkv, dout, qkv, lse, D, B, T, NH);
}
