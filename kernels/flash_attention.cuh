/*
kernels/flash_attention.cuh: the FlashAttention-2 kernels of kernels/flash_attention.cu as
templates over their tile shapes, and the warp-level pieces they are built from: shared-memory
tiles, the mma.sync products on register fragments, the online softmax. kernels/flash_attention.cu
instantiates them once per head size (the trainer's kernels); dev/cuda/attention.cu builds its
intermediate versions from the same pieces and instantiates other tile shapes to time against them.

What it computes, for each (b, head h) with q, k, v (T, HS) read in place from the projection qkv
(gpt2_cpu.attention_forward / attention_backward):
    s[t,j] = scale q_t . k_j,  scale = 1/sqrt(HS),  only for keys j <= t (causal mask)
    lse[t] = log sum_{j<=t} exp(s[t,j]),  p[t,j] = exp(s[t,j] - lse[t]),  out[t] = sum_{j<=t} p[t,j] v_j
and from dout (= dO):
    D[t]    = dO_t . out_t = sum_j p[t,j] dP[t,j]         (the softmax Jacobian's shared term)
    dP[t,j] = dO_t . v_j,   dS[t,j] = p[t,j] (dP[t,j] - D[t])
    dv_j = sum_{t>=j} p[t,j] dO_t,   dk_j = scale sum_{t>=j} dS[t,j] q_t,   dq_t = scale sum_{j<=t} dS[t,j] k_j
Grouped-query attention (Llama 3; Ainslie et al. 2023): NKV key/value heads, each shared by the
G = NH/NKV consecutive query heads h = kvh*G .. kvh*G + G-1, read in place (no repeated copy):
qkv (B,T,(NH+2NKV)*HS) holds q of head h at column h*HS, k of kv head kvh at (NH + kvh)*HS, v at
(NH + NKV + kvh)*HS; dqkv is written in the same layout, a kv head's dk, dv the sum over its G
query heads. GPT-2 is NKV = NH (G = 1). out, dout (B,T,NH*HS); lse, D (B,NH,T) fp32.

Sources: Dao 2023, "FlashAttention-2", Alg. 1 (forward) and Alg. 2 (backward); the register
layouts of the PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type" and
"Warp-level matrix load instruction: ldmatrix" (kernels/tensor_core.cuh states them).

1. The fragments. A warp computes S = Q K^T for its 16 query rows (one "row tile"; a warp may own
   M_TILES of them) with mma.m16n8k16 (A 16x16, B 16x8, C 16x8), lane = 4g + t (g = lane/4,
   t = lane%4):

       Q (A, 16 x HS: HS/16 k-tiles)     K^T (B, one n-tile = 8 keys)    S (C, one n-tile)
       a0: Q[g  ][16kk+2t, +1]           b0: K[8n+g][16kk+2t, +1]        c0, c1: S[g  ][8n+2t, +1]
       a1: Q[g+8][16kk+2t, +1]           b1: K[8n+g][16kk+2t+8, +9]      c2, c3: S[g+8][8n+2t, +1]
       a2: Q[g  ][16kk+2t+8, +9]
       a3: Q[g+8][16kk+2t+8, +9]
   b is "two consecutive k of one column n": for S = Q K^T that is two consecutive dimensions of
   one key, contiguous in K's row-major (key, dim) tile, so a plain ldmatrix of K gives it. The
   accumulator S sits in registers; lanes 4g..4g+3 hold row g (and g+8), two columns of each
   n-tile each, so a row's max and sum are a reduction over 4 lanes (two __shfl_xor).
   P = softmax(S) is then the A operand of O += P V with no data movement: for the k-tile kk
   (keys 16kk..16kk+15) the A registers are
       a0 = (c0, c1) of n-tile 2kk,  a1 = (c2, c3) of 2kk,  a2 = (c0, c1) of 2kk+1,  a3 = (c2, c3) of 2kk+1
   rounded to bf16 pairs (pack_bf16x2): C's (row g, cols 2t, 2t+1) is exactly A's (row g, k 2t, 2t+1).
   V is the B operand (k = key, n = dim): b0 = V[16kk+2t, +1][8n+g] is two keys of one dimension,
   a column of the row-major V tile: ldmatrix.trans delivers it. The backward reuses the same two
   products with other roles: S^T = K Q^T, dP^T = V dO^T, dP = dO V^T are "A B^T" (mma_abt), and
   dV += P^T dO, dK += dS^T Q, dQ += dS K are "C-fragments times a row-major tile" (mma_ab_regs).
2. Shared memory. Tiles are row-major (rows, HS) in 16-byte chunks, with the chunks of each row
   permuted by an XOR of the row index (swizzled, SharedTile<HS, true>): the 8 rows one ldmatrix
   phase reads at one logical chunk then fall in 8 different 16-byte bank groups. Unswizzled,
   rows of 128 bytes (HS = 64, bf16) put those 8 rows in the same 4 banks: an 8-way conflict.
3. The pipeline. Streamed tiles (K and V in the forward and the dq kernel; Q, dO, lse and D in the
   dk/dv kernel) are loaded with cp.async into STAGES buffers: while the warps compute tile j,
   tile j+STAGES-1 is in flight. One __syncthreads per tile:

       prologue: cp.async owned rows; tiles 0..STAGES-2        (one commit group each)
       for j:  wait_group<STAGES-2>   tile j has landed (this thread's copies)
               __syncthreads          ... everyone's; and everyone is done with tile j-1's buffer
               cp.async tile j+STAGES-1 into that buffer; commit (an empty group past the end)
               compute tile j

4. The online softmax in the log2 domain: x = s * scale * log2(e), m = running max of x,
   p = exp2(x - m) (one FFMA and one MUFU.EX2 per score), alpha = exp2(m_old - m_new) rescales l
   and O; lse = (m + log2 l) ln 2 at the end. Each lane keeps its own partial row sum l and the 4
   lanes of a row add theirs once, at the end (a fixed order: deterministic).
5. The causal mask is applied only on tiles that cross the diagonal of a row tile; a warp skips a
   tile whose keys all lie after its rows (and the dk/dv kernel a query tile before its keys).
   Rows past T load zeros (cp.async's zero fill), so no NaN can enter a product.

The fp32 build (ENABLE_FP32) has no fp32 tensor-core instruction with this layout: its mma_abt and
mma_ab_regs compute the same C fragments with scalar FMAs, reading the operands from the shared
tiles (and the P fragments of other lanes of the row with __shfl_sync). Everything above them, the
tiles, the pipeline, the softmax, is the same code in both builds.

Determinism: every output element is written (=) once, by one thread, after sums in a fixed
order: dq and dk/dv are two kernels, each owning its outputs (no atomics).

Dynamic shared memory: each kernel takes its tiles from `smem`, the block's dynamic shared memory
(an `extern __shared__` array of the .cu file that instantiates it), SHARED_BYTES of its tile
shape; more than 48 KiB needs the launcher's opt-in (llmc/attention.py).
*/
#pragma once

#include "common.cuh"
#include "tensor_core.cuh"

// ----------------------------------------------------------------------------
// constants

#define MMA_M 16                    // mma.m16n8k16: rows of A and C (one row tile)
#define MMA_N 8                     // columns of B and C (one n-tile)
#define MMA_K 16                    // columns of A, rows of B (one k-tile)
#define CHUNK_BYTES 16              // one cp.async.cg copy; one row of an ldmatrix 8x8 matrix
#define BANK_LINE_BYTES 128         // 32 banks x 4 bytes: one conflict-free shared-memory wavefront
#define LOG2E 1.4426950408889634f   // exp(x) = exp2(x * LOG2E)
#define LN2 0.6931471805599453f     // log(x) = log2(x) * LN2
#define MAX_SHARED_BYTES_OPT_IN 166912   // dynamic shared memory a block may opt in to on sm_80 (163 KiB; sm_90: 227)

// ----------------------------------------------------------------------------
// shared-memory tiles

// A (rows, HS) floatX tile, row-major in 16-byte chunks: element (row, col) at offset(row, col).
// SWIZZLE: chunk c of row r is stored at chunk c ^ f(r), f(r) = (r / ROWS_PER_LINE) % XOR_SPAN, so
// that any 8 consecutive rows (from a multiple of 8) at one logical chunk occupy 8 different
// 16-byte bank groups: HS = 64 bf16 (8 chunks a row): f = r % 8; HS = 32 (4 chunks, 2 rows per
// 128-byte line): f = (r/2) % 4; HS = 16: f = (r/4) % 2; HS = 128: f = r % 8 on the low 3 bits.
template <int HS, bool SWIZZLE>
struct SharedTile {
    static constexpr int WIDTH = HS;                                            // elements per row
    static constexpr bool SWIZZLED = SWIZZLE;
    static constexpr int ELEMS = CHUNK_BYTES / (int)sizeof(floatX);            // per chunk: 8 bf16, 4 fp32
    static constexpr int CHUNKS = HS / ELEMS;                                   // per row
    static constexpr int LINE_CHUNKS = BANK_LINE_BYTES / CHUNK_BYTES;           // 8
    static constexpr int ROWS_PER_LINE = CHUNKS >= LINE_CHUNKS ? 1 : LINE_CHUNKS / CHUNKS;
    static constexpr int XOR_SPAN = CHUNKS >= LINE_CHUNKS ? LINE_CHUNKS : CHUNKS;
    static_assert(HS % MMA_K == 0, "the head size must be a multiple of 16");

    // f(row): the same for rows 8 apart (ROWS_PER_LINE * XOR_SPAN = 8 for every HS)
    __device__ static int swizzle(int row) { return SWIZZLE ? (row / ROWS_PER_LINE) % XOR_SPAN : 0; }
    __device__ static int offset(int row, int col) {
        return row * HS + ((col / ELEMS) ^ swizzle(row)) * ELEMS + col % ELEMS;
    }
};

// The lanes of one ldmatrix.x4 over 16 x 16 blocks of a tile (bf16: two chunks a row): lane l
// reads row `lane_row` (0..15) and chunk `lane_chunk` (0 or 1) of the block. For the block at rows
// row0 + 16 i, columns 16 j, that is offset(i, j) = base + 16 i HS + (x ^ 2j) ELEMS, with base and
// x = lane_chunk ^ f(row) computed once (f repeats every 8 rows; 2j has no bit in common with
// lane_chunk): per block, one XOR and an immediate offset instead of a swizzled address each.
template <class Tile>
struct LdmatrixLanes {
    int base, x;
    __device__ LdmatrixLanes(int row0, int lane_row, int lane_chunk) {
        base = (row0 + lane_row) * Tile::WIDTH;
        x = lane_chunk ^ Tile::swizzle(row0 + lane_row);
    }
    __device__ int offset(int i, int j) const {
        return base + MMA_M * i * Tile::WIDTH + (x ^ (2 * j)) * Tile::ELEMS;
    }
};

#if defined(ENABLE_BF16)
#define SWIZZLED_TILES true         // ldmatrix reads 8 rows at one chunk: swizzled against bank conflicts
#else
#define SWIZZLED_TILES false        // the fp32 products read rows with float4 / float2 loads, no ldmatrix
#endif

// cp.async: tile rows 0..ROWS-1 = rows first.. of src (row stride `stride` elements), zero-filled
// at and past T (src-size 0). Called by all THREADS threads of the block; one group per call site.
template <class Tile, int ROWS, int THREADS>
__device__ inline void load_rows_async(floatX* tile, const floatX* src, size_t stride, int first, int T) {
#pragma unroll
    for (int i = threadIdx.x; i < ROWS * Tile::CHUNKS; i += THREADS) {
        const int r = i / Tile::CHUNKS, c = i % Tile::CHUNKS;
        const bool inside = first + r < T;
        const floatX* from = inside ? src + (size_t)(first + r) * stride + c * Tile::ELEMS : src;
        cp_async_cg(tile + Tile::offset(r, c * Tile::ELEMS), from, inside ? CHUNK_BYTES : 0);
    }
}

// cp.async of ROWS per-row floats (lse or D of a query tile): dst[i] = src[first + i], 0 at and
// past T (a plain store: the buffer is free, and the barrier before its use publishes both).
template <int ROWS, int THREADS>
__device__ inline void load_values_async(float* dst, const float* src, int first, int T) {
    for (int i = threadIdx.x; i < ROWS; i += THREADS) {
        if (first + i < T) {
            cp_async_ca<sizeof(float)>(dst + i, src + first + i);
        } else {
            dst[i] = 0.0f;
        }
    }
}

// ----------------------------------------------------------------------------
// C fragments: a 16 x N fp32 tile as N/8 n-tiles of 4 registers per lane. Element e of n-tile n
// held by lane 4g + t is (row g + 8 (e / 2), column 8n + 2t + e % 2).

__device__ inline int lane_group() { return (threadIdx.x % WARP_SIZE) / 4; }      // g: rows g, g + 8
__device__ inline int lane_in_group() { return threadIdx.x % 4; }                 // t: columns 2t, 2t + 1
__device__ inline int fragment_row(int e) { return lane_group() + MMA_M / 2 * (e / 2); }
__device__ inline int fragment_col(int n, int e) { return MMA_N * n + 2 * lane_in_group() + e % 2; }

template <int M_TILES, int N>
__device__ inline void zero_fragments(float (&acc)[M_TILES][N / MMA_N][4]) {
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
#pragma unroll
        for (int n = 0; n < N / MMA_N; n++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[mi][n][e] = 0.0f;
            }
        }
    }
}

// two adjacent elements (a at p[0], b at p[1]) as floatX: one 4-byte store in bf16, 8 in fp32
__device__ inline void store_pair(floatX* p, float a, float b) {
#if defined(ENABLE_BF16)
    *reinterpret_cast<unsigned*>(p) = pack_bf16x2(a, b);
#else
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
#endif
}

// ----------------------------------------------------------------------------
// the A operand of mma_abt: 16 rows x K of a shared tile (Q, dO or K, V of the warp's rows).
// IN_REGISTERS: its K/16 fragments are loaded once (ldmatrix.x4 of the four 8x8 quadrants, which
// is exactly a0..a3) and kept for the whole loop; else each product loads them again from shared
// memory (fewer registers, more shared-memory traffic). The fp32 build reads the tile itself.

template <int K, class Tile, bool IN_REGISTERS>
struct RowsOperand {
    const floatX* tile;
    int row0;                                       // the first of its 16 rows in the tile
#if defined(ENABLE_BF16)
    unsigned frag[IN_REGISTERS ? K / MMA_K : 1][4];

    // ldmatrix.x4: lane l gives row l % 16, columns 16 kk + 8 (l / 16): the quadrants
    // (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) = a0..a3
    __device__ void load_fragment(int kk, unsigned a[4]) const {
        const int lane = threadIdx.x % WARP_SIZE;
        ldmatrix_x4(a, tile + LdmatrixLanes<Tile>(row0, lane % MMA_M, lane / MMA_M).offset(0, kk));
    }
    __device__ void fragment(int kk, unsigned a[4]) const {
        if constexpr (IN_REGISTERS) {
            for (int i = 0; i < 4; i++) {
                a[i] = frag[kk][i];
            }
        } else {
            load_fragment(kk, a);
        }
    }
#endif
    __device__ void load(const floatX* tile_, int row0_) {
        tile = tile_;
        row0 = row0_;
#if defined(ENABLE_BF16)
        if constexpr (IN_REGISTERS) {
#pragma unroll
            for (int kk = 0; kk < K / MMA_K; kk++) {
                load_fragment(kk, frag[kk]);
            }
        }
#endif
    }
};

// acc[mi] (16 x N) += A[mi] (16 x K) @ Bt^T, with Bt the N rows bt_row0.. of a shared tile (N x K,
// row-major): S = Q K^T, dP = dO V^T, S^T = K Q^T, dP^T = V dO^T. Each B fragment loaded serves
// the M_TILES row tiles of the warp.
template <int M_TILES, int K, int N, class Tile, class Operand>
__device__ inline void mma_abt(float (&acc)[M_TILES][N / MMA_N][4], const Operand (&a)[M_TILES], const floatX* bt,
                               int bt_row0) {
    static_assert(N % (2 * MMA_N) == 0 && K % MMA_K == 0, "whole 16 x 16 tiles");
#if defined(ENABLE_BF16)
    // ldmatrix.x4 of Bt rows 16np.. (the keys of n-tiles 2np, 2np+1), columns 16kk..: lane l gives
    // row 16np + 8(l/16) + l%8, column 16kk + 8((l/8)%2), so that r0, r1 are b0, b1 of n-tile 2np
    // and r2, r3 those of n-tile 2np+1
    const int lane = threadIdx.x % WARP_SIZE;
    const LdmatrixLanes<Tile> lanes(bt_row0, lane / 16 * 8 + lane % 8, (lane / 8) % 2);
#pragma unroll
    for (int kk = 0; kk < K / MMA_K; kk++) {
        unsigned af[M_TILES][4];
#pragma unroll
        for (int mi = 0; mi < M_TILES; mi++) {
            a[mi].fragment(kk, af[mi]);
        }
#pragma unroll
        for (int np = 0; np < N / (2 * MMA_N); np++) {
            unsigned b[4];
            ldmatrix_x4(b, bt + lanes.offset(np, kk));
#pragma unroll
            for (int mi = 0; mi < M_TILES; mi++) {
                mma_m16n8k16_bf16(acc[mi][2 * np], af[mi], b, acc[mi][2 * np]);
                mma_m16n8k16_bf16(acc[mi][2 * np + 1], af[mi], b + 2, acc[mi][2 * np + 1]);
            }
        }
    }
#else
    // each lane its own elements: rows g, g + 8 of A, rows 8n + 2t, +1 of Bt, four k at a time
    static_assert(!Tile::SWIZZLED, "the scalar products read plain row-major tiles");
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
        const floatX* a_rows = a[mi].tile + (a[mi].row0 + fragment_row(0)) * Tile::WIDTH;
        const floatX* b_rows = bt + (bt_row0 + fragment_col(0, 0)) * Tile::WIDTH;
#pragma unroll 1
        for (int k = 0; k < K; k += Tile::ELEMS) {
            float4 x[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                x[r] = *reinterpret_cast<const float4*>(a_rows + r * (MMA_M / 2) * Tile::WIDTH + k);
            }
#pragma unroll
            for (int n = 0; n < N / MMA_N; n++) {
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    const float4 y = *reinterpret_cast<const float4*>(b_rows + (MMA_N * n + c) * Tile::WIDTH + k);
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        acc[mi][n][2 * r + c] += x[r].x * y.x + x[r].y * y.y + x[r].z * y.z + x[r].w * y.w;
                    }
                }
            }
        }
    }
#endif
}

// acc[mi] (16 x N) += P[mi] (16 x K, C fragments in registers) @ B, with B the K rows b_row0.. of a
// shared tile (K x N, row-major): O += P V, dV += P^T dO, dK += dS^T Q, dQ += dS K.
template <int M_TILES, int K, int N, class Tile>
__device__ inline void mma_ab_regs(float (&acc)[M_TILES][N / MMA_N][4], const float (&p)[M_TILES][K / MMA_N][4],
                                   const floatX* b, int b_row0) {
    static_assert(N % (2 * MMA_N) == 0 && K % MMA_K == 0, "whole 16 x 16 tiles");
#if defined(ENABLE_BF16)
    // ldmatrix.x4.trans of B rows 16kk.. (k), columns 16np.. (n): lane l gives row 16kk + l%16,
    // column 16np + 8(l/16); the transposed quadrants (k 0-7, n 0-7), (k 8-15, n 0-7),
    // (k 0-7, n 8-15), (k 8-15, n 8-15) are b0, b1 of n-tile 2np, then b0, b1 of n-tile 2np+1
    const int lane = threadIdx.x % WARP_SIZE;
    const LdmatrixLanes<Tile> lanes(b_row0, lane % 16, lane / 16);
#pragma unroll
    for (int kk = 0; kk < K / MMA_K; kk++) {
        // P's C fragments of n-tiles 2kk, 2kk+1 re-packed as the A fragment of k-tile kk
        unsigned af[M_TILES][4];
#pragma unroll
        for (int mi = 0; mi < M_TILES; mi++) {
            af[mi][0] = pack_bf16x2(p[mi][2 * kk][0], p[mi][2 * kk][1]);           // (g,   16kk + 2t, +1)
            af[mi][1] = pack_bf16x2(p[mi][2 * kk][2], p[mi][2 * kk][3]);           // (g+8, 16kk + 2t, +1)
            af[mi][2] = pack_bf16x2(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);   // (g,   16kk + 8 + 2t, +1)
            af[mi][3] = pack_bf16x2(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);   // (g+8, 16kk + 8 + 2t, +1)
        }
#pragma unroll
        for (int np = 0; np < N / (2 * MMA_N); np++) {
            unsigned bf[4];
            ldmatrix_x4_trans(bf, b + lanes.offset(kk, np));
#pragma unroll
            for (int mi = 0; mi < M_TILES; mi++) {
                mma_m16n8k16_bf16(acc[mi][2 * np], af[mi], bf, acc[mi][2 * np]);
                mma_m16n8k16_bf16(acc[mi][2 * np + 1], af[mi], bf + 2, acc[mi][2 * np + 1]);
            }
        }
    }
#else
    static_assert(!Tile::SWIZZLED, "the scalar products read plain row-major tiles");
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
#pragma unroll 1                            // a rolled loop over P's n-tiles: a quarter of the code
        for (int kn = 0; kn < K / MMA_N; kn++) {
            float pk[4];                    // p[mi][kn] without indexing registers by a variable
#pragma unroll
            for (int e = 0; e < 4; e++) {
                pk[e] = p[mi][0][e];
#pragma unroll
                for (int j = 1; j < K / MMA_N; j++) {
                    pk[e] = kn == j ? p[mi][j][e] : pk[e];
                }
            }
            const floatX* b_rows = b + (b_row0 + MMA_N * kn) * Tile::WIDTH;
#pragma unroll
            for (int r = 0; r < MMA_N; r++) {
                // P[row][8 kn + r] of rows g and g + 8 is held by lane 4g + r / 2 of the row's four
                const int source = (lane & ~3) | r / 2;
                const float lo = __shfl_sync(FULL_WARP_MASK, pk[r % 2], source);
                const float hi = __shfl_sync(FULL_WARP_MASK, pk[2 + r % 2], source);
#pragma unroll
                for (int n = 0; n < N / MMA_N; n++) {
                    const float2 v = *reinterpret_cast<const float2*>(b_rows + r * Tile::WIDTH + fragment_col(n, 0));
                    acc[mi][n][0] += lo * v.x;
                    acc[mi][n][1] += lo * v.y;
                    acc[mi][n][2] += hi * v.x;
                    acc[mi][n][3] += hi * v.y;
                }
            }
        }
    }
#endif
}

// ----------------------------------------------------------------------------
// the online softmax of one row tile (FlashAttention-2 Alg. 1, lines 8-10), on C fragments

// s (16 x N scores, masked ones -inf) becomes p = exp2(s * scale_log2 - m_new) in place; m, l of
// the lane's two rows (g, g+8) are updated, alpha[r] = exp2(m_old - m_new) returned for O.
template <int N>
__device__ inline void online_softmax(float (&s)[N / MMA_N][4], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                      float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float block_max = NEGATIVE_INFINITY;
#pragma unroll
        for (int n = 0; n < N / MMA_N; n++) {
            block_max = fmaxf(block_max, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
        }
        // the row's four lanes (4g .. 4g+3): xor 1 and 2 stay inside the group
        block_max = fmaxf(block_max, __shfl_xor_sync(FULL_WARP_MASK, block_max, 1));
        block_max = fmaxf(block_max, __shfl_xor_sync(FULL_WARP_MASK, block_max, 2));
        const float m_new = fmaxf(m[r], block_max * scale_log2);
        const float m_shift = m_new == NEGATIVE_INFINITY ? 0.0f : m_new;    // a row masked so far: p = 0, not NaN
        alpha[r] = exp2f(m[r] - m_shift);                                    // m = -inf (first tile): 0
        m[r] = m_new;
        float sum = 0.0f;
#pragma unroll
        for (int n = 0; n < N / MMA_N; n++) {
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                s[n][e] = exp2f(fmaf(s[n][e], scale_log2, -m_shift));
                sum += s[n][e];
            }
        }
        l[r] = alpha[r] * l[r] + sum;                                        // this lane's columns only
    }
}

// the row sums l of the lane's rows over the row's four lanes (after the last tile)
__device__ inline float row_sum(float l) {
    l += __shfl_xor_sync(FULL_WARP_MASK, l, 1);
    return l + __shfl_xor_sync(FULL_WARP_MASK, l, 2);
}

// Write a warp's row tiles acc[mi] (16 x HS each, row half r of tile mi times factor[mi][r]) as
// floatX into its own rows row0.. of `tile`, then copy them to rows first.. of dst (row stride
// `stride`), skipping rows at or past T: 16-byte, coalesced stores.
template <int M_TILES, int HS, class Tile>
__device__ inline void store_rows(floatX* dst, size_t stride, int first, int T, const float (&acc)[M_TILES][HS / MMA_N][4],
                                  const float (&factor)[M_TILES][2], floatX* tile, int row0) {
    const int lane = threadIdx.x % WARP_SIZE;
    __syncwarp();                   // every lane is done reading these rows (the fp32 products read them)
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
#pragma unroll
        for (int n = 0; n < HS / MMA_N; n++) {
#pragma unroll
            for (int r = 0; r < 2; r++) {
                store_pair(tile + Tile::offset(row0 + MMA_M * mi + fragment_row(2 * r), fragment_col(n, 0)),
                           acc[mi][n][2 * r] * factor[mi][r], acc[mi][n][2 * r + 1] * factor[mi][r]);
            }
        }
    }
    __syncwarp();
    for (int i = lane; i < M_TILES * MMA_M * Tile::CHUNKS; i += WARP_SIZE) {
        const int r = i / Tile::CHUNKS, c = i % Tile::CHUNKS;
        if (first + r < T) {
            store128(dst + (size_t)(first + r) * stride + c * Tile::ELEMS,
                     load128(tile + Tile::offset(row0 + r, c * Tile::ELEMS)));
        }
    }
}

// ----------------------------------------------------------------------------
// the tile shapes (kernels/flash_attention.cu picks one per head size, dev/cuda/attention.cu its
// intermediate versions and candidates; llmc/attention.py restates SHARED_BYTES and the grid)
//
// STAGES: buffers of the streamed tiles. 2 or more: the pipeline of this file's header. 1
// (dev/cuda/attention.cu's version 6): one buffer, so a tile is loaded only after every warp is
// done with the last one and the warps wait for it: two __syncthreads per tile, no overlap.
// SWIZZLE: the XOR layout of SharedTile (bf16; the fp32 build never swizzles), or plain rows
// (version 7: 8-way bank conflicts on every ldmatrix at HS = 64).

// forward: WARPS warps of M_TILES row tiles (16 query rows each) own ROWS query rows; the keys
// and values stream through STAGES buffers of KEYS rows. Q's fragments stay in registers:
// M_TILES * HS/4 of them (32 at HS = 64, M_TILES = 2).
template <int HS_, int WARPS_, int M_TILES_, int KEYS_, int STAGES_, bool SWIZZLE_ = true>
struct ForwardTiles {
    static constexpr int HS = HS_, WARPS = WARPS_, M_TILES = M_TILES_, KEYS = KEYS_, STAGES = STAGES_;
    static constexpr int THREADS = WARPS * WARP_SIZE;
    static constexpr int ROWS = WARPS * M_TILES * MMA_M;
    static constexpr int Q_ELEMS = ROWS * HS, KV_ELEMS = KEYS * HS;
    static constexpr int SHARED_BYTES = (Q_ELEMS + 2 * STAGES * KV_ELEMS) * (int)sizeof(floatX);
    typedef SharedTile<HS, SWIZZLE_ && SWIZZLED_TILES> Tile;
    static_assert(KEYS % (2 * MMA_N) == 0 && STAGES >= 1, "keys in whole 16-key tiles");
    static_assert(SHARED_BYTES <= MAX_SHARED_BYTES_OPT_IN, "the tiles exceed the shared memory of an sm_80 block");
};

// dk/dv: WARPS warps of 16 keys own KEYS = 16 WARPS keys; queries (with their dout, lse and D)
// stream through STAGES buffers of QUERIES rows. K's and V's fragments stay in registers while
// HS <= 64 (HS/4 each); at HS = 128 they are loaded for each product (dK and dV alone take 128
// registers).
template <int HS_, int WARPS_, int QUERIES_, int STAGES_, bool SWIZZLE_ = true>
struct DkdvTiles {
    static constexpr int HS = HS_, WARPS = WARPS_, QUERIES = QUERIES_, STAGES = STAGES_;
    static constexpr int THREADS = WARPS * WARP_SIZE;
    static constexpr int KEYS = WARPS * MMA_M;
    static constexpr int KV_ELEMS = KEYS * HS, Q_ELEMS = QUERIES * HS;
    static constexpr int SHARED_BYTES = (2 * KV_ELEMS + 2 * STAGES * Q_ELEMS) * (int)sizeof(floatX)
                                        + 2 * STAGES * QUERIES * (int)sizeof(float);
    static constexpr bool KV_IN_REGISTERS = HS <= 64;
    typedef SharedTile<HS, SWIZZLE_ && SWIZZLED_TILES> Tile;
    static_assert(QUERIES % (2 * MMA_N) == 0 && STAGES >= 1, "queries in whole 16-row tiles");
    static_assert(SHARED_BYTES <= MAX_SHARED_BYTES_OPT_IN, "the tiles exceed the shared memory of an sm_80 block");
};

// dq: WARPS warps of 16 query rows own ROWS = 16 WARPS queries; K and V stream as in the forward.
// Q's and dO's fragments stay in registers while HS <= 64.
template <int HS_, int WARPS_, int KEYS_, int STAGES_, bool SWIZZLE_ = true>
struct DqTiles {
    static constexpr int HS = HS_, WARPS = WARPS_, KEYS = KEYS_, STAGES = STAGES_;
    static constexpr int THREADS = WARPS * WARP_SIZE;
    static constexpr int ROWS = WARPS * MMA_M;
    static constexpr int Q_ELEMS = ROWS * HS, KV_ELEMS = KEYS * HS;
    static constexpr int SHARED_BYTES = (2 * Q_ELEMS + 2 * STAGES * KV_ELEMS) * (int)sizeof(floatX);
    static constexpr bool Q_IN_REGISTERS = HS <= 64;
    typedef SharedTile<HS, SWIZZLE_ && SWIZZLED_TILES> Tile;
    static_assert(KEYS % (2 * MMA_N) == 0 && STAGES >= 1, "keys in whole 16-key tiles");
    static_assert(SHARED_BYTES <= MAX_SHARED_BYTES_OPT_IN, "the tiles exceed the shared memory of an sm_80 block");
};

// the commit groups the top of a pipelined loop may leave in flight: STAGES - 2 (0 with one buffer)
template <int STAGES>
__device__ inline void wait_for_current_tile() {
    cp_async_wait_group<(STAGES >= 2 ? STAGES - 2 : 0)>();
}

// where head h's columns start in a row of qkv / dqkv ((NH + 2 NKV) * HS wide)
struct HeadColumns {
    size_t stride;                  // elements per row of qkv
    int q, k, v;                    // the first column of q (head h), k and v (its kv head)
    __device__ HeadColumns(int h, int NH, int NKV, int HS) {
        const int kvh = h / (NH / NKV);
        stride = (size_t)(NH + 2 * NKV) * HS;
        q = h * HS;
        k = (NH + kvh) * HS;
        v = (NH + NKV + kvh) * HS;
    }
};

// ----------------------------------------------------------------------------
// forward: FlashAttention-2 Alg. 1, one block per (b, h, query block); the longest rows first

template <class Tiles>
__device__ void flash_attention_forward(floatX* out, float* lse, const floatX* qkv, int T, int NH, int NKV, char* smem) {
    constexpr int HS = Tiles::HS, M_TILES = Tiles::M_TILES, KEYS = Tiles::KEYS, STAGES = Tiles::STAGES;
    constexpr int ROWS = Tiles::ROWS, THREADS = Tiles::THREADS;
    typedef typename Tiles::Tile Tile;
    floatX* q_tile = reinterpret_cast<floatX*>(smem);                   // (ROWS, HS), then the output rows
    floatX* kv_tiles = q_tile + Tiles::Q_ELEMS;                        // buffer i: K at 2i, V at 2i+1 (KEYS, HS)

    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;                 // the longest rows start first
    const HeadColumns col(h, NH, NKV, HS);
    const floatX* qkv_b = qkv + (size_t)b * T * col.stride;
    const int warp = threadIdx.x / WARP_SIZE;
    const int row0 = warp * M_TILES * MMA_M;                             // the warp's rows in the block
    const int first_row = q0 + row0;                                     // ... in the sequence
    const int num_tiles = (min(q0 + ROWS, T) + KEYS - 1) / KEYS;         // up to the diagonal
    const float scale_log2 = LOG2E / sqrtf((float)HS);

    // key/value tile j (keys j*KEYS ..) into buffer j % STAGES; one commit group
    auto load_tile = [&](int j) {
        floatX* k_dst = kv_tiles + 2 * (j % STAGES) * Tiles::KV_ELEMS;
        if (j < num_tiles) {
            load_rows_async<Tile, KEYS, THREADS>(k_dst, qkv_b + col.k, col.stride, j * KEYS, T);
            load_rows_async<Tile, KEYS, THREADS>(k_dst + Tiles::KV_ELEMS, qkv_b + col.v, col.stride, j * KEYS, T);
        }
        cp_async_commit_group();                                         // empty past the last tile
    };
    // prologue: Q (one group), then tiles 0..STAGES-2 (tile 0 with one buffer)
    load_rows_async<Tile, ROWS, THREADS>(q_tile, qkv_b + col.q, col.stride, q0, T);
    cp_async_commit_group();
    for (int j = 0; j < (STAGES > 1 ? STAGES - 1 : 1); j++) {
        load_tile(j);
    }
    cp_async_wait_group<(STAGES > 1 ? STAGES - 1 : 1)>();                // Q has landed
    __syncthreads();
    RowsOperand<HS, Tile, true> q[M_TILES];                              // Q's fragments, for the whole loop
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
        q[mi].load(q_tile, row0 + MMA_M * mi);
    }

    float o[M_TILES][HS / MMA_N][4];                                     // O, unnormalized
    float m[M_TILES][2], l[M_TILES][2];                                  // running max (log2 domain), partial sums
    zero_fragments<M_TILES, HS>(o);
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
        m[mi][0] = m[mi][1] = NEGATIVE_INFINITY;
        l[mi][0] = l[mi][1] = 0.0f;
    }
    for (int j = 0; j < num_tiles; j++) {
        wait_for_current_tile<STAGES>();                                 // tile j has landed (this thread's copies)
        __syncthreads();                                                 // ... everyone's; tile j-1's buffer is free
        if (STAGES > 1) {
            load_tile(j + STAGES - 1);                                   // in flight while tile j is computed
        }
        const int k0 = j * KEYS;
        // skip the tile where the warp's rows are past T, or all before every key of the tile
        if (first_row < T && k0 <= first_row + M_TILES * MMA_M - 1) {
            const floatX* k_tile = kv_tiles + 2 * (j % STAGES) * Tiles::KV_ELEMS;
            const floatX* v_tile = k_tile + Tiles::KV_ELEMS;
            // 1. S = Q K^T: (16, HS) @ (HS, KEYS) per row tile
            float s[M_TILES][KEYS / MMA_N][4];
            zero_fragments<M_TILES, KEYS>(s);
            mma_abt<M_TILES, HS, KEYS, Tile>(s, q, k_tile, 0);
            // 2. the causal mask (tiles crossing the row tile's diagonal only), the online softmax
#pragma unroll
            for (int mi = 0; mi < M_TILES; mi++) {
                const int tile_row = first_row + MMA_M * mi;
                if (k0 + KEYS - 1 > tile_row) {
#pragma unroll
                    for (int n = 0; n < KEYS / MMA_N; n++) {
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            if (k0 + fragment_col(n, e) > tile_row + fragment_row(e)) {
                                s[mi][n][e] = NEGATIVE_INFINITY;
                            }
                        }
                    }
                }
                float alpha[2];
                online_softmax<KEYS>(s[mi], m[mi], l[mi], alpha, scale_log2);
#pragma unroll
                for (int n = 0; n < HS / MMA_N; n++) {
                    o[mi][n][0] *= alpha[0];
                    o[mi][n][1] *= alpha[0];
                    o[mi][n][2] *= alpha[1];
                    o[mi][n][3] *= alpha[1];
                }
            }
            // 3. O += P V: (16, KEYS) @ (KEYS, HS), P straight from the registers of S
            mma_ab_regs<M_TILES, KEYS, HS, Tile>(o, s, v_tile, 0);
        }
        if (STAGES == 1 && j + 1 < num_tiles) {     // one buffer: reloaded once every warp is done with it
            __syncthreads();
            load_tile(j + 1);
        }
    }
    if (first_row >= T) {
        return;
    }
    // out = O / l, lse = (m + log2 l) ln 2, through the warp's rows of q_tile
    float inv_l[M_TILES][2];
#pragma unroll
    for (int mi = 0; mi < M_TILES; mi++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float sum = row_sum(l[mi][r]);                         // >= 1: the row max contributes exp2(0)
            inv_l[mi][r] = 1.0f / sum;
            const int t = first_row + MMA_M * mi + fragment_row(2 * r);
            if (lane_in_group() == 0 && t < T) {
                lse[(size_t)bh * T + t] = (m[mi][r] + log2f(sum)) * LN2;
            }
        }
    }
    store_rows<M_TILES, HS, Tile>(out + (size_t)b * T * NH * HS + h * HS, (size_t)NH * HS, first_row, T, o, inv_l,
                                  q_tile, row0);
}

// ----------------------------------------------------------------------------
// backward: FlashAttention-2 Alg. 2 as two kernels that own their outputs, after
// flash_attention_backward_preprocess (kernels/flash_attention.cu) has written D = rowsum(dO * O)

// dK, dV of one key block: one block per (b, kv head, key block), key block 0 (the most queries)
// first. The warp's 16 keys are the rows of S^T = K Q^T; it streams the query tiles from the
// diagonal on, for each of the G query heads of its kv head in turn (step s: head kvh*G + s /
// tiles_per_head).
template <class Tiles>
__device__ void flash_attention_backward_dkdv(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                              const float* D, int T, int NH, int NKV, char* smem) {
    constexpr int HS = Tiles::HS, KEYS = Tiles::KEYS, QUERIES = Tiles::QUERIES, STAGES = Tiles::STAGES;
    constexpr int THREADS = Tiles::THREADS;
    typedef typename Tiles::Tile Tile;
    floatX* k_tile = reinterpret_cast<floatX*>(smem);                  // (KEYS, HS), then dK's rows
    floatX* v_tile = k_tile + Tiles::KV_ELEMS;                         // (KEYS, HS), then dV's rows
    floatX* q_tiles = v_tile + Tiles::KV_ELEMS;                        // buffer i: Q at 2i, dO at 2i+1 (QUERIES, HS)
    float* row_values = reinterpret_cast<float*>(q_tiles + 2 * STAGES * Tiles::Q_ELEMS);   // buffer i: lse at 2i, D at 2i+1

    const int G = NH / NKV;
    const int bkv = blockIdx.x, b = bkv / NKV, kvh = bkv % NKV;
    const int k0 = blockIdx.y * KEYS;
    const HeadColumns kv_col(kvh * G, NH, NKV, HS);
    const floatX* qkv_b = qkv + (size_t)b * T * kv_col.stride;
    const floatX* dout_b = dout + (size_t)b * T * NH * HS;
    const int warp = threadIdx.x / WARP_SIZE;
    const int key_row0 = warp * MMA_M;                                  // the warp's keys in the block
    const int first_key = k0 + key_row0;
    const int first_tile = k0 / QUERIES;                                // the query tile of the diagonal
    const int tiles_per_head = (T + QUERIES - 1) / QUERIES - first_tile;
    const int num_steps = G * tiles_per_head;
    const float scale = 1.0f / sqrtf((float)HS), scale_log2 = scale * LOG2E;

    // step s's query tile (Q, dO, lse, D of head kvh*G + s / tiles_per_head) into buffer s % STAGES
    auto load_step = [&](int s) {
        if (s < num_steps) {
            const int h = kvh * G + s / tiles_per_head, t0 = (first_tile + s % tiles_per_head) * QUERIES;
            floatX* q_dst = q_tiles + 2 * (s % STAGES) * Tiles::Q_ELEMS;
            float* values = row_values + 2 * (s % STAGES) * QUERIES;
            load_rows_async<Tile, QUERIES, THREADS>(q_dst, qkv_b + h * HS, kv_col.stride, t0, T);
            load_rows_async<Tile, QUERIES, THREADS>(q_dst + Tiles::Q_ELEMS, dout_b + h * HS, (size_t)NH * HS, t0, T);
            load_values_async<QUERIES, THREADS>(values, lse + ((size_t)b * NH + h) * T, t0, T);
            load_values_async<QUERIES, THREADS>(values + QUERIES, D + ((size_t)b * NH + h) * T, t0, T);
        }
        cp_async_commit_group();
    };
    // prologue: K and V (one group), then steps 0..STAGES-2 (step 0 with one buffer)
    load_rows_async<Tile, KEYS, THREADS>(k_tile, qkv_b + kv_col.k, kv_col.stride, k0, T);
    load_rows_async<Tile, KEYS, THREADS>(v_tile, qkv_b + kv_col.v, kv_col.stride, k0, T);
    cp_async_commit_group();
    for (int s = 0; s < (STAGES > 1 ? STAGES - 1 : 1); s++) {
        load_step(s);
    }
    cp_async_wait_group<(STAGES > 1 ? STAGES - 1 : 1)>();                // K and V have landed
    __syncthreads();
    RowsOperand<HS, Tile, Tiles::KV_IN_REGISTERS> k[1], v[1];
    k[0].load(k_tile, key_row0);
    v[0].load(v_tile, key_row0);

    float dk[1][HS / MMA_N][4], dv[1][HS / MMA_N][4];
    zero_fragments<1, HS>(dk);
    zero_fragments<1, HS>(dv);
    for (int s = 0; s < num_steps; s++) {
        wait_for_current_tile<STAGES>();
        __syncthreads();
        if (STAGES > 1) {
            load_step(s + STAGES - 1);
        }
        const int t0 = (first_tile + s % tiles_per_head) * QUERIES;
        // skip the tile where the warp's keys are past T, or after every query of the tile
        if (first_key < T && t0 + QUERIES - 1 >= first_key) {
            const floatX* q_tile = q_tiles + 2 * (s % STAGES) * Tiles::Q_ELEMS;
            const floatX* dout_tile = q_tile + Tiles::Q_ELEMS;
            const float* lse_tile = row_values + 2 * (s % STAGES) * QUERIES;
            const float* d_tile = lse_tile + QUERIES;
            // S^T = K Q^T: (16, HS) @ (HS, QUERIES); P^T = exp2(S^T scale log2(e) - lse log2(e)), 0 where
            // the query comes before the key or lies past T
            float p[1][QUERIES / MMA_N][4];
            zero_fragments<1, QUERIES>(p);
            mma_abt<1, HS, QUERIES, Tile>(p, k, q_tile, 0);
            const bool masked = t0 < first_key + MMA_M - 1 || t0 + QUERIES > T;
#pragma unroll
            for (int n = 0; n < QUERIES / MMA_N; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = fragment_col(n, e);
                    p[0][n][e] = exp2f(fmaf(p[0][n][e], scale_log2, -lse_tile[c] * LOG2E));
                    if (masked && (t0 + c < first_key + fragment_row(e) || t0 + c >= T)) {
                        p[0][n][e] = 0.0f;
                    }
                }
            }
            // dV += P^T dO: (16, QUERIES) @ (QUERIES, HS)
            mma_ab_regs<1, QUERIES, HS, Tile>(dv, p, dout_tile, 0);
            // dP^T = V dO^T: (16, HS) @ (HS, QUERIES); dS^T = P^T (dP^T - D), in place
            float ds[1][QUERIES / MMA_N][4];
            zero_fragments<1, QUERIES>(ds);
            mma_abt<1, HS, QUERIES, Tile>(ds, v, dout_tile, 0);
#pragma unroll
            for (int n = 0; n < QUERIES / MMA_N; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    ds[0][n][e] = p[0][n][e] * (ds[0][n][e] - d_tile[fragment_col(n, e)]);
                }
            }
            // dK += dS^T Q: (16, QUERIES) @ (QUERIES, HS); the scale is applied once, at the end
            mma_ab_regs<1, QUERIES, HS, Tile>(dk, ds, q_tile, 0);
        }
        if (STAGES == 1 && s + 1 < num_steps) {
            __syncthreads();
            load_step(s + 1);
        }
    }
    if (first_key >= T) {
        return;
    }
    const float dk_scale[1][2] = {{scale, scale}}, dv_scale[1][2] = {{1.0f, 1.0f}};
    floatX* dqkv_b = dqkv + (size_t)b * T * kv_col.stride;
    store_rows<1, HS, Tile>(dqkv_b + kv_col.k, kv_col.stride, first_key, T, dk, dk_scale, k_tile, key_row0);
    store_rows<1, HS, Tile>(dqkv_b + kv_col.v, kv_col.stride, first_key, T, dv, dv_scale, v_tile, key_row0);
}

// dQ of one query block: one block per (b, h, query block), the longest rows first. The warp's
// 16 query rows stream the key tiles up to the diagonal, recomputing P and dS.
template <class Tiles>
__device__ void flash_attention_backward_dq(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                            const float* D, int T, int NH, int NKV, char* smem) {
    constexpr int HS = Tiles::HS, KEYS = Tiles::KEYS, STAGES = Tiles::STAGES, ROWS = Tiles::ROWS;
    constexpr int THREADS = Tiles::THREADS;
    typedef typename Tiles::Tile Tile;
    floatX* q_tile = reinterpret_cast<floatX*>(smem);                  // (ROWS, HS), then dQ's rows
    floatX* dout_tile = q_tile + Tiles::Q_ELEMS;                       // (ROWS, HS)
    floatX* kv_tiles = dout_tile + Tiles::Q_ELEMS;                     // buffer i: K at 2i, V at 2i+1 (KEYS, HS)

    const int bh = blockIdx.x, b = bh / NH, h = bh % NH;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * ROWS;
    const HeadColumns col(h, NH, NKV, HS);
    const floatX* qkv_b = qkv + (size_t)b * T * col.stride;
    const int warp = threadIdx.x / WARP_SIZE;
    const int row0 = warp * MMA_M, first_row = q0 + row0;
    const int num_tiles = (min(q0 + ROWS, T) + KEYS - 1) / KEYS;
    const float scale = 1.0f / sqrtf((float)HS), scale_log2 = scale * LOG2E;

    auto load_tile = [&](int j) {
        floatX* k_dst = kv_tiles + 2 * (j % STAGES) * Tiles::KV_ELEMS;
        if (j < num_tiles) {
            load_rows_async<Tile, KEYS, THREADS>(k_dst, qkv_b + col.k, col.stride, j * KEYS, T);
            load_rows_async<Tile, KEYS, THREADS>(k_dst + Tiles::KV_ELEMS, qkv_b + col.v, col.stride, j * KEYS, T);
        }
        cp_async_commit_group();
    };
    load_rows_async<Tile, ROWS, THREADS>(q_tile, qkv_b + col.q, col.stride, q0, T);
    load_rows_async<Tile, ROWS, THREADS>(dout_tile, dout + (size_t)b * T * NH * HS + h * HS, (size_t)NH * HS, q0, T);
    cp_async_commit_group();
    for (int j = 0; j < (STAGES > 1 ? STAGES - 1 : 1); j++) {
        load_tile(j);
    }
    cp_async_wait_group<(STAGES > 1 ? STAGES - 1 : 1)>();                // Q and dO have landed
    __syncthreads();
    RowsOperand<HS, Tile, Tiles::Q_IN_REGISTERS> q[1], dO[1];
    q[0].load(q_tile, row0);
    dO[0].load(dout_tile, row0);
    // lse (log2 domain) and D of the lane's rows g, g + 8 (0 past T: those rows are never stored)
    float lse_log2[2], d_row[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int t = first_row + fragment_row(2 * r);
        lse_log2[r] = t < T ? lse[(size_t)bh * T + t] * LOG2E : 0.0f;
        d_row[r] = t < T ? D[(size_t)bh * T + t] : 0.0f;
    }

    float dq[1][HS / MMA_N][4];
    zero_fragments<1, HS>(dq);
    for (int j = 0; j < num_tiles; j++) {
        wait_for_current_tile<STAGES>();
        __syncthreads();
        if (STAGES > 1) {
            load_tile(j + STAGES - 1);
        }
        const int k0 = j * KEYS;
        // skip the tile where the warp's rows are past T, or all before every key of the tile
        if (first_row < T && k0 <= first_row + MMA_M - 1) {
            const floatX* k_tile = kv_tiles + 2 * (j % STAGES) * Tiles::KV_ELEMS;
            const floatX* v_tile = k_tile + Tiles::KV_ELEMS;
            // S = Q K^T; P = exp2(S scale log2(e) - lse log2(e)), 0 where the key comes after the query
            float p[1][KEYS / MMA_N][4];
            zero_fragments<1, KEYS>(p);
            mma_abt<1, HS, KEYS, Tile>(p, q, k_tile, 0);
            const bool diagonal = k0 + KEYS - 1 > first_row;
#pragma unroll
            for (int n = 0; n < KEYS / MMA_N; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    p[0][n][e] = exp2f(fmaf(p[0][n][e], scale_log2, -lse_log2[e / 2]));
                    if (diagonal && k0 + fragment_col(n, e) > first_row + fragment_row(e)) {
                        p[0][n][e] = 0.0f;
                    }
                }
            }
            // dP = dO V^T: (16, HS) @ (HS, KEYS); dS = P (dP - D), in place
            float ds[1][KEYS / MMA_N][4];
            zero_fragments<1, KEYS>(ds);
            mma_abt<1, HS, KEYS, Tile>(ds, dO, v_tile, 0);
#pragma unroll
            for (int n = 0; n < KEYS / MMA_N; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    ds[0][n][e] = p[0][n][e] * (ds[0][n][e] - d_row[e / 2]);
                }
            }
            // dQ += dS K: (16, KEYS) @ (KEYS, HS); the scale is applied once, at the end
            mma_ab_regs<1, KEYS, HS, Tile>(dq, ds, k_tile, 0);
        }
        if (STAGES == 1 && j + 1 < num_tiles) {
            __syncthreads();
            load_tile(j + 1);
        }
    }
    if (first_row >= T) {
        return;
    }
    const float dq_scale[1][2] = {{scale, scale}};
    store_rows<1, HS, Tile>(dqkv + (size_t)b * T * col.stride + col.q, col.stride, first_row, T, dq, dq_scale, q_tile, row0);
}
