/*
dev/cuda/attention.cu: the hand-written attention kernels of dev/cuda/attention.py's intermediate
versions and candidates. The other versions are the trainer's materialized path (kernels/attention.cu
+ cuBLAS), our flash attention (kernels/flash_attention.cu, version 8), cuDNN and PyTorch, all
launched from attention.py.

Causal self-attention on the fused projection qkv (B,T,3C) = [q | k | v], NH heads of HS = C/NH
channels, s = 1/sqrt(HS) (gpt2_cpu.attention_forward / attention_backward):
    att[t, t2] = softmax over t2 <= t of s q_t . k_t2      (0 for t2 > t: the causal mask)
    out[t]     = sum over t2 of att[t, t2] v_t2

- attention_forward_v1: one thread per query row (b, h, t), the loops of gpt2_cpu's forward for
  that row written out (llm.c's attention_forward_cpu): scores and their max, exponentials and
  their sum, normalization, then each output channel as a dot product down a column of v. att is
  kept, in fp32 (B,NH,T,T), for the backward, with zeros above the diagonal as gpt2_cpu's.
  Why it is slow: a thread does O(T*HS) work alone, reading every k and v row of its head from
  global memory with scalar loads (the warp's 32 threads are 32 consecutive queries of one head,
  so those loads are broadcasts served by L1: little reuse beyond that); the att row round-trips
  through global memory three times; and threads of late queries loop longer than early ones
  (the causal triangle), so warps idle.
- attention_backward_v1: one thread per query row, the backward of that row:
      datt[t2]    = dout_t . v_t2
      dpreatt[t2] = att[t2] (datt[t2] - sum_j att[j] datt[j])          (softmax Jacobian)
      dq_t       += s dpreatt[t2] k_t2      (this thread's own row: a plain add)
      dk_t2      += s dpreatt[t2] q_t       (every query t >= t2 adds here: atomicAdd)
      dv_t2      += att[t2] dout_t          (likewise)
  into fp32 accumulators dqkv_acc (B,T,3C) that the launcher zeroed, then
  attention_backward_cast_v1 rounds them to floatX once. datt is recomputed in the second pass
  instead of being stored (a second T*T buffer). fp32 atomics because bf16 ones would round every
  partial sum; their order varies run to run, so the result is not bit-reproducible. The
  atomics, B*NH*T*(T+1)/2 * 2*HS of them, dominate its time.
- attention_{forward,backward_dkdv,backward_dq}_hs64_v3: flash attention with S and P through
  shared memory (the production kernel until the mma.sync rewrite, its 16x16 tile products now
  two mma.m16n8k16 each): a block OWNS R rows (query rows in the forward and dq kernels, key rows
  in the dk/dv kernel), 16 rows per warp, and STREAMS blocks of S rows of the other side through
  static shared memory (48 KiB: bf16 HS 64 -> R = 64, S = 32). Per streamed block a warp
      1. stores S = Q K^T (fp32) into shared memory, 16x16 tile by tile      [tensor cores]
      2. reads it back, lanes 2r and 2r+1 owning row r: the online softmax, scalar, P (floatX)
         written to shared memory again; the per-row rescale of O needs a "row index" tile
         because an accumulator's layout is treated as unknown
      3. O = diag(alpha) O + P V, P read from shared memory                  [tensor cores]
  What it leaves on the table (versions 6-8): the round trip of S and P through shared memory,
  loads not overlapped with the products, a scalar softmax, 48 KiB of static shared memory.
- attention_*_hs{64,128}_v{6,7,9,10,11}: kernels/flash_attention.cuh's templates at other tile
  shapes (dev/cuda/attention.py says what each version changes):
      version 6: S and P in registers (FlashAttention-2 on mma.sync), one buffer (STAGES 1: load,
                 wait, compute), plain row-major tiles;
      version 7: + cp.async double buffering (STAGES 2): the next tile loads during the products;
      version 8 (kernels/flash_attention.cu): + swizzled tiles, two row tiles per warp at HS 64;
      versions 9-11: candidates, the production templates at other shapes.

Indices are int (B*NH*T rows) with size_t element offsets (B*NH*T*T passes 2^31 at the 124M
shape). Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/attention.cu
*/
#include "common.cuh"
#include "flash_attention.cuh"
#include "tensor_core.cuh"

// The (b, h, t) of thread `row` = (b*NH + h)*T + t, and the rows of qkv it reads.
struct QueryRow {
    int b, h, t;
    size_t att;                    // offset of its att row, (B,NH,T,T)
};

__device__ inline QueryRow query_row(int row, int NH, int T) {
    QueryRow r;
    r.t = row % T;
    r.h = (row / T) % NH;
    r.b = row / (NH * T);
    r.att = (size_t)row * T;
    return r;
}

// offset of head h's channels of section 0 (q), 1 (k) or 2 (v) at position t of batch b in qkv
__device__ inline size_t qkv_offset(int b, int t, int section, int h, int T, int NH, int HS) {
    const int C = NH * HS;
    return ((size_t)b * T + t) * 3 * C + section * C + h * HS;
}

__device__ inline float dot_floatX(const floatX* x, const floatX* y, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        sum += (float)x[i] * (float)y[i];
    }
    return sum;
}

// ----------------------------------------------------------------------------
// version 1, forward

// grid ceil(B*NH*T / blockDim.x): thread `row` computes out[b, t, h*HS : (h+1)*HS] and att[b,h,t,:]
extern "C" __global__ void attention_forward_v1(floatX* out, float* att, const floatX* qkv,
                                                int B, int T, int NH, int HS) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NH * T) {
        return;
    }
    const QueryRow r = query_row(row, NH, T);
    const float scale = rsqrtf((float)HS);
    const floatX* q = qkv + qkv_offset(r.b, r.t, 0, r.h, T, NH, HS);
    float* att_row = att + r.att;

    // pass 1: scores s q . k_t2 of the keys t2 <= t (later keys are never read: the mask) and their max
    float maxval = NEGATIVE_INFINITY;
    for (int t2 = 0; t2 <= r.t; t2++) {
        const float score = scale * dot_floatX(q, qkv + qkv_offset(r.b, t2, 1, r.h, T, NH, HS), HS);
        att_row[t2] = score;
        maxval = fmaxf(maxval, score);
    }
    // pass 2: exp(score - max) (the diagonal is never masked: max is finite, every exp <= 1) and their sum
    float sum = 0.0f;
    for (int t2 = 0; t2 <= r.t; t2++) {
        const float e = expf(att_row[t2] - maxval);
        att_row[t2] = e;
        sum += e;
    }
    // pass 3: normalize; masked keys get probability 0, as in gpt2_cpu (the backward reads them)
    const float inv_sum = 1.0f / sum;
    for (int t2 = 0; t2 < T; t2++) {
        att_row[t2] = t2 <= r.t ? att_row[t2] * inv_sum : 0.0f;
    }
    // pass 4: out_t = att_row @ v, one output channel at a time
    floatX* out_row = out + ((size_t)r.b * T + r.t) * NH * HS + r.h * HS;
    for (int i = 0; i < HS; i++) {
        float value = 0.0f;
        for (int t2 = 0; t2 <= r.t; t2++) {
            value += att_row[t2] * (float)qkv[qkv_offset(r.b, t2, 2, r.h, T, NH, HS) + i];
        }
        out_row[i] = (floatX)value;
    }
}

// ----------------------------------------------------------------------------
// version 1, backward

// grid ceil(B*NH*T / blockDim.x): thread `row` adds its query's terms to dqkv_acc (B,T,3C) fp32,
// zeroed by the launcher. att (B,NH,T,T) fp32 from attention_forward_v1 (or gpt2_cpu).
extern "C" __global__ void attention_backward_v1(float* dqkv_acc, const floatX* dout, const floatX* qkv,
                                                 const float* att, int B, int T, int NH, int HS) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NH * T) {
        return;
    }
    const QueryRow r = query_row(row, NH, T);
    const float scale = rsqrtf((float)HS);
    const floatX* q = qkv + qkv_offset(r.b, r.t, 0, r.h, T, NH, HS);
    const floatX* dout_row = dout + ((size_t)r.b * T + r.t) * NH * HS + r.h * HS;
    const float* att_row = att + r.att;

    // pass 1: the softmax Jacobian's shared term, sum_j att[j] datt[j], datt[j] = dout_t . v_j
    float att_datt = 0.0f;
    for (int t2 = 0; t2 <= r.t; t2++) {
        att_datt += att_row[t2] * dot_floatX(dout_row, qkv + qkv_offset(r.b, t2, 2, r.h, T, NH, HS), HS);
    }
    // pass 2: per key t2 <= t (masked keys have att = 0, so dpreatt = 0: nothing to add)
    float* dq = dqkv_acc + qkv_offset(r.b, r.t, 0, r.h, T, NH, HS);
    for (int t2 = 0; t2 <= r.t; t2++) {
        const floatX* k = qkv + qkv_offset(r.b, t2, 1, r.h, T, NH, HS);
        const floatX* v = qkv + qkv_offset(r.b, t2, 2, r.h, T, NH, HS);
        float* dk = dqkv_acc + qkv_offset(r.b, t2, 1, r.h, T, NH, HS);
        float* dv = dqkv_acc + qkv_offset(r.b, t2, 2, r.h, T, NH, HS);
        const float datt = dot_floatX(dout_row, v, HS);          // recomputed, not stored
        const float dpreatt = att_row[t2] * (datt - att_datt);
        for (int i = 0; i < HS; i++) {
            dq[i] += scale * dpreatt * (float)k[i];
            atomicAdd(&dk[i], scale * dpreatt * (float)q[i]);
            atomicAdd(&dv[i], att_row[t2] * (float)dout_row[i]);
        }
    }
}

// dinp (n,) = (floatX) dqkv_acc (n,): thread i rounds element i, once
extern "C" __global__ void attention_backward_cast_v1(floatX* dinp, const float* dqkv_acc, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        dinp[i] = (floatX)dqkv_acc[i];
    }
}

// ----------------------------------------------------------------------------
// version 3: tile sizes

#define TILE 16                     // edge of one 16x16x16 tile product (two mma.m16n8k16); one warp's rows
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
// version 3: 16x16 tile operations of one warp, the only code that differs between the two builds
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

#if defined(ENABLE_BF16)
// A 16x16x16 product is two mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"): A's fragment by ldmatrix.x4 of its four 8x8 quadrants, B's for both
// 8-column halves by one ldmatrix.x4 (.trans when B's rows are k). AccTile holds the two C
// fragments: x[4j + e] is (row g + 8(e/2), column 8j + 2t + e%2) of lane 4g + t.

template <OperandLayout LAYOUT_B>
__device__ inline void tile_mma(AccTile& d, const floatX* A, int lda, const floatX* B, int ldb) {
    const int lane = threadIdx.x % WARP_SIZE;
    unsigned a[4], b[4];
    ldmatrix_x4(a, A + (lane % 16) * lda + lane / 16 * 8);                      // rows l%16, k 8(l/16)..
    if constexpr (LAYOUT_B == ROW_MAJOR) {          // rows are k: k l%16, n 8(l/16).. transposed
        ldmatrix_x4_trans(b, B + (lane % 16) * ldb + lane / 16 * 8);
    } else {                                        // rows are n: n 8(l/16) + l%8, k 8((l/8)%2)..
        ldmatrix_x4(b, B + (lane / 16 * 8 + lane % 8) * ldb + (lane / 8) % 2 * 8);
    }
    mma_m16n8k16_bf16(d.x, a, b, d.x);
    mma_m16n8k16_bf16(d.x + 4, a, b + 2, d.x + 4);
}

__device__ inline void tile_store(float* p, int ld, const AccTile& c) {
    const int g = (threadIdx.x % WARP_SIZE) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        p[(g + 8 * (i % 4 / 2)) * ld + 8 * (i / 4) + 2 * t + i % 2] = c.x[i];
    }
}

__device__ inline void tile_load_acc(AccTile& c, const float* p, int ld) {
    const int g = (threadIdx.x % WARP_SIZE) / 4, t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        c.x[i] = p[(g + 8 * (i % 4 / 2)) * ld + 8 * (i / 4) + 2 * t + i % 2];
    }
}

#else   // ENABLE_FP32: the same operations with scalar FMAs; lane l holds row l/2, columns (l%2)*8..+7

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
// version 3, entry points (head size 64, the progression's); grids as dev/cuda/attention.py's
// v3_launch: (B*NH, ceil(T/R)), R/16 warps

extern "C" __global__ void attention_forward_hs64_v3(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH) {
    flash_attention_forward_block<64>(out, lse, qkv, B, T, NH);
}
extern "C" __global__ void attention_backward_dkdv_hs64_v3(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                          const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dkdv_block<64>(dqkv, dout, qkv, lse, D, B, T, NH);
}
extern "C" __global__ void attention_backward_dq_hs64_v3(floatX* dqkv, const floatX* dout, const floatX* qkv,
                                                        const float* lse, const float* D, int B, int T, int NH) {
    flash_attention_backward_dq_block<64>(dqkv, dout, qkv, lse, D, B, T, NH);
}

// ----------------------------------------------------------------------------
// versions 6, 7, 9-11: kernels/flash_attention.cuh's templates (those of version 8, the
// production kernels) at the tile shapes of each step, for GPT-2's head size 64. fp32 tiles take
// twice the bytes of bf16 ones: they stream 32 keys (16 with 8 warps) where bf16 streams 64,
// within the 163 KiB a block may opt in to (static_asserted). The launcher, dev/cuda/attention.py's
// DEV_TILES, restates every shape.
//                   ForwardTiles<HS, warps, row tiles per warp, keys, stages, swizzled>
//                   DkdvTiles<HS, warps (16 keys each), queries, stages, swizzled>
//                   DqTiles<HS, warps (16 rows each), keys, stages, swizzled>
// version 6: S and P in registers; one buffer, plain rows
// version 7: + cp.async double buffering
// version 9 (candidate): the forward with one row tile per warp (64-row blocks); the backward with
//            8 warps (128 keys per dk/dv block, 128 rows per dq block)
// version 10 (candidate): the forward with 8 warps of one row tile; the backward with three stages
// version 11 (candidate, forward only): version 8's shapes with three stages
#if defined(ENABLE_BF16)
typedef ForwardTiles<64, 4, 1, 64, 1, false> ForwardV6HS64;
typedef DkdvTiles<64, 4, 32, 1, false> DkdvV6HS64;
typedef DqTiles<64, 4, 64, 1, false> DqV6HS64;
typedef ForwardTiles<64, 4, 1, 64, 2, false> ForwardV7HS64;
typedef DkdvTiles<64, 4, 32, 2, false> DkdvV7HS64;
typedef DqTiles<64, 4, 64, 2, false> DqV7HS64;
typedef ForwardTiles<64, 4, 1, 64, 2> ForwardV9HS64;
typedef DkdvTiles<64, 8, 32, 2> DkdvV9HS64;
typedef DqTiles<64, 8, 64, 2> DqV9HS64;
typedef ForwardTiles<64, 8, 1, 64, 2> ForwardV10HS64;
typedef DkdvTiles<64, 4, 32, 3> DkdvV10HS64;
typedef DqTiles<64, 4, 64, 3> DqV10HS64;
typedef ForwardTiles<64, 4, 2, 64, 3> ForwardV11HS64;
#else
typedef ForwardTiles<64, 4, 1, 32, 1, false> ForwardV6HS64;
typedef DkdvTiles<64, 4, 32, 1, false> DkdvV6HS64;
typedef DqTiles<64, 4, 32, 1, false> DqV6HS64;
typedef ForwardTiles<64, 4, 1, 32, 2, false> ForwardV7HS64;
typedef DkdvTiles<64, 4, 32, 2, false> DkdvV7HS64;
typedef DqTiles<64, 4, 32, 2, false> DqV7HS64;
typedef ForwardTiles<64, 4, 1, 32, 2> ForwardV9HS64;
typedef DkdvTiles<64, 8, 16, 2> DkdvV9HS64;
typedef DqTiles<64, 8, 16, 2> DqV9HS64;
typedef ForwardTiles<64, 8, 1, 16, 2> ForwardV10HS64;
typedef DkdvTiles<64, 4, 32, 3> DkdvV10HS64;
typedef DqTiles<64, 4, 32, 3> DqV10HS64;
typedef ForwardTiles<64, 4, 1, 32, 3> ForwardV11HS64;
#endif

// the block's dynamic shared memory (versions 6-11)
extern __shared__ __align__(16) char dev_flash_smem[];

// version 6
extern "C" __global__ void __launch_bounds__(ForwardV6HS64::THREADS)
attention_forward_hs64_v6(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardV6HS64>(out, lse, qkv, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DkdvV6HS64::THREADS)
attention_backward_dkdv_hs64_v6(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvV6HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqV6HS64::THREADS)
attention_backward_dq_hs64_v6(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                              const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqV6HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}

// version 7
extern "C" __global__ void __launch_bounds__(ForwardV7HS64::THREADS)
attention_forward_hs64_v7(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardV7HS64>(out, lse, qkv, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DkdvV7HS64::THREADS)
attention_backward_dkdv_hs64_v7(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvV7HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqV7HS64::THREADS)
attention_backward_dq_hs64_v7(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                              const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqV7HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}

// version 9
extern "C" __global__ void __launch_bounds__(ForwardV9HS64::THREADS)
attention_forward_hs64_v9(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardV9HS64>(out, lse, qkv, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DkdvV9HS64::THREADS)
attention_backward_dkdv_hs64_v9(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvV9HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqV9HS64::THREADS)
attention_backward_dq_hs64_v9(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                              const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqV9HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}

// version 10
extern "C" __global__ void __launch_bounds__(ForwardV10HS64::THREADS)
attention_forward_hs64_v10(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardV10HS64>(out, lse, qkv, T, NH, NKV, dev_flash_smem);
}
// (an explicit minimum of one block per SM: without it ptxas stops at 168 registers, for three
// blocks per SM, and spills)
extern "C" __global__ void __launch_bounds__(DkdvV10HS64::THREADS, 1)
attention_backward_dkdv_hs64_v10(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dkdv<DkdvV10HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}
extern "C" __global__ void __launch_bounds__(DqV10HS64::THREADS)
attention_backward_dq_hs64_v10(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                               const float* D, int B, int T, int NH, int NKV) {
    flash_attention_backward_dq<DqV10HS64>(dqkv, dout, qkv, lse, D, T, NH, NKV, dev_flash_smem);
}

// version 11
extern "C" __global__ void __launch_bounds__(ForwardV11HS64::THREADS)
attention_forward_hs64_v11(floatX* out, float* lse, const floatX* qkv, int B, int T, int NH, int NKV) {
    flash_attention_forward<ForwardV11HS64>(out, lse, qkv, T, NH, NKV, dev_flash_smem);
}

