/*
dev/cuda/matmul.cu: the hand-written matmul kernels of dev/cuda/matmul.py, versions 1-3 (CUDA
cores) and 6-8 (tensor cores, bf16 builds only) of
    out (N,OC) = inp (N,C) @ weight^T + bias,   weight (OC,C) (nn.Linear's layout), bias (OC,),
N = B*T rows, and version 8 of the backward's dinp = dout @ weight and dweight += dout^T @ inp.
Versions 4 and 5 are library calls (cuBLAS, cuBLASLt), launched from matmul.py. Every kernel
reads floatX, computes in fp32 (the tensor cores: bf16 products, fp32 sums) and rounds each output
to floatX once, as the trainer's kernels do; bias is required (GPT-2 has one on every linear layer).

Both operands are read along C ("K-contiguous"): out[n,o] is the dot product of row n of inp
with row o of weight. The three versions differ only in how often each loaded value is reused:

- matmul_forward_v1: naive, one thread per output element, the loop of gpt2_cpu.matmul_forward
  (llm.c's matmul_forward_cpu) for one (n, o). Every FMA needs two loads (one from inp, one from
  weight) that come from L1/L2 at best: one FMA per 8 bytes loaded in fp32, while an H100's
  fp32 units could use ~10 FMAs per byte of DRAM (67 TFLOP/s over 3.35 TB/s, H100 SXM's data
  sheet), so it runs at the speed of the caches.
- matmul_forward_v2: shared-memory tiling. A block of tile x tile threads computes a tile x tile
  block of outputs; for each slice of `tile` columns of C it loads one (tile,tile) tile of inp and
  one of weight into shared memory (one element per thread, coalesced along C), then every thread
  runs its dot product over the slice from shared memory. Each value loaded from DRAM/L2 is now
  used by `tile` threads, so global traffic drops by the factor tile; but each FMA still needs two
  shared-memory loads, and shared memory delivers ~128 bytes/clock per SM, so the kernel is
  bound by shared-memory bandwidth.
- matmul_forward_v3: register tiling. A block of 256 threads computes a 128 x 128 block of
  outputs, each thread an 8 x 8 sub-tile held in 64 registers. Per step k of the slice, a thread
  loads 8 values of inp and 8 of weight from shared memory (four 16-byte loads) and does 8*8 = 64
  FMAs with them: an outer product. That is 4 FMAs per shared-memory load instead of v2's 0.5;
  the arithmetic intensity against shared memory grows with the thread's tile (TM*TN FMAs for
  TM+TN loads), which is what moves the kernel from shared-memory-bound towards compute-bound.
  What remains between v3 and cuBLAS, the rest of the file: the tensor cores, asynchronous copies
  that overlap loading the next slice with computing this one, and per-shape tuning.
- matmul_forward_v6: v3's 128 x 128 block on the tensor cores: 4 warps of 64 x 64 outputs, each a
  4 x 8 grid of mma.sync.m16n8k16 accumulators fed by ldmatrix.x4 from shared memory.
- matmul_forward_v7: v6's tiles through a 4-stage cp.async pipeline, the stages XOR-swizzled so
  that ldmatrix reads are free of bank conflicts.
- matmul_forward_<tile>_v8 (and _gelu_, matmul_backward_dinp_, _dweight_, matmul_split_k_reduce_v8):
  v7's pipeline with a tile per shape, grouped block order, the epilogue (bias, GELU) staged
  through shared memory with 16-byte stores, and the backward's transposed operands (ldmatrix
  .trans) with dweight's sum over tokens split across blocks.
doc/tensor_cores.md walks through versions 6-8 (fragments, ldmatrix, the swizzle, the pipeline).

Indexing is int for rows and columns and size_t for element offsets (N*OC passes 2^31 at
N = 8192 rows of the 50304-wide classifier). Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/matmul.cu
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// version 1: naive

// grid (ceil(OC/blockDim.x), N): thread (n = blockIdx.y, o) computes out[n,o]. Consecutive
// threads take consecutive o: the store coalesces, every thread of a warp reads the same inp
// element (a broadcast), and the weight loads hit 32 different rows (strided by C).
extern "C" __global__ void matmul_forward_v1(floatX* out, const floatX* inp, const floatX* weight,
                                             const floatX* bias, int N, int C, int OC) {
    const int n = blockIdx.y;
    const int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N || o >= OC) {
        return;
    }
    const floatX* inp_row = inp + (size_t)n * C;
    const floatX* weight_row = weight + (size_t)o * C;
    float sum = (float)bias[o];
    for (int c = 0; c < C; c++) {
        sum += (float)inp_row[c] * (float)weight_row[c];
    }
    out[(size_t)n * OC + o] = (floatX)sum;
}

// ----------------------------------------------------------------------------
// version 2: shared-memory tiles

// block tile*tile threads (tile = 8, 16 or 32; the launcher passes it with blockDim.x = tile^2),
// grid (ceil(OC/tile), ceil(N/tile)); dynamic shared memory 2 * tile * (tile + 1) floats.
// Thread (ty, tx) computes out[n0 + ty, o0 + tx]. The tiles are stored with a row stride of
// tile + 1 floats: the inner loop reads weight_tile[tx][k] for 32 different tx at once, and with a
// stride of exactly 32 floats those would all sit in the same shared-memory bank (a 32-way
// conflict, 32 serialized loads); the extra column puts row tx in bank (tx + k) % 32 instead.
extern "C" __global__ void matmul_forward_v2(floatX* out, const floatX* inp, const floatX* weight,
                                             const floatX* bias, int N, int C, int OC, int tile) {
    extern __shared__ float tiles[];
    const int stride = tile + 1;
    float* inp_tile = tiles;                          // (tile, tile+1): inp[n0 + r, c0 + k]
    float* weight_tile = tiles + tile * stride;       // (tile, tile+1): weight[o0 + r, c0 + k]
    const int ty = threadIdx.x / tile;
    const int tx = threadIdx.x % tile;
    const int n0 = blockIdx.y * tile;
    const int o0 = blockIdx.x * tile;
    float sum = 0.0f;
    for (int c0 = 0; c0 < C; c0 += tile) {
        // one element of each tile per thread, tx running along C: coalesced; zeros past the edges
        const int c = c0 + tx;
        inp_tile[ty * stride + tx] = (n0 + ty < N && c < C) ? (float)inp[(size_t)(n0 + ty) * C + c] : 0.0f;
        weight_tile[ty * stride + tx] = (o0 + ty < OC && c < C) ? (float)weight[(size_t)(o0 + ty) * C + c] : 0.0f;
        __syncthreads();                              // the tiles are complete
        for (int k = 0; k < tile; k++) {
            sum += inp_tile[ty * stride + k] * weight_tile[tx * stride + k];
        }
        __syncthreads();                              // everyone is done before they are overwritten
    }
    const int n = n0 + ty;
    const int o = o0 + tx;
    if (n < N && o < OC) {
        out[(size_t)n * OC + o] = (floatX)(sum + (float)bias[o]);
    }
}

// ----------------------------------------------------------------------------
// version 3: register tiles (an outer product per step)

#define V3_BLOCK_ROWS 128                  // BM: rows of out (of inp) per block
#define V3_BLOCK_COLS 128                  // BN: columns of out (rows of weight) per block
#define V3_SLICE 16                        // BK: columns of C per shared-memory slice
#define V3_THREAD_ROWS 8                   // TM: rows of out per thread
#define V3_THREAD_COLS 8                   // TN: columns of out per thread
#define V3_THREADS 256                     // (BM/TM) * (BN/TN) = 16 * 16
#define V3_GROUPS 16                       // thread groups along each side: BM/TM = BN/TN
#define V3_PAD 4                           // keeps rows 16-byte aligned; see the stores below

// The rows of a thread's tile are not 8 consecutive rows but two runs of 4, 64 apart:
// rows ty*4 + {0..3} and 64 + ty*4 + {0..3} (the same for columns with tx). One 16-byte load then
// fetches a run of 4, and the 8 threads a 16-byte shared-memory load serves together (tx = 0..7)
// read 128 consecutive bytes: all 32 banks, no conflict. With 8 consecutive columns per thread
// they would read 16-byte pieces 32 bytes apart, two per bank.
__device__ inline int v3_offset(int group, int i) {
    return (i / 4) * (V3_GROUPS * 4) + group * 4 + i % 4;
}

// block V3_THREADS threads, grid (ceil(OC/128), ceil(N/128)). Thread (ty, tx) = (t / 16, t % 16)
// computes out rows n0 + v3_offset(ty, i) and columns o0 + v3_offset(tx, j), i, j in 0..7.
extern "C" __global__ void __launch_bounds__(V3_THREADS)
matmul_forward_v3(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias,
                  int N, int C, int OC) {
    // slices stored transposed, [k][row]: a thread's 4 consecutive rows are then 16 contiguous bytes
    __shared__ __align__(16) float inp_tile[V3_SLICE][V3_BLOCK_ROWS + V3_PAD];
    __shared__ __align__(16) float weight_tile[V3_SLICE][V3_BLOCK_COLS + V3_PAD];
    const int t = threadIdx.x;
    const int ty = t / V3_GROUPS;
    const int tx = t % V3_GROUPS;
    const int n0 = blockIdx.y * V3_BLOCK_ROWS;
    const int o0 = blockIdx.x * V3_BLOCK_COLS;
    float acc[V3_THREAD_ROWS][V3_THREAD_COLS] = {};
    float a[V3_THREAD_ROWS];
    float w[V3_THREAD_COLS];

    for (int c0 = 0; c0 < C; c0 += V3_SLICE) {
        // load the (128, 16) slices of inp and weight: thread t loads column t % 16 of rows
        // t / 16 + 16 r, r = 0..7, so 16 threads read 16 consecutive elements of a row (coalesced).
        // Storing them transposed costs a 2-way bank conflict (rows 4 banks apart for a stride of
        // 132 floats): one store per 64 FMAs, cheap next to the loads it saves in the inner loop.
        const int k = t % V3_SLICE;
        const int c = c0 + k;
        for (int r = t / V3_SLICE; r < V3_BLOCK_ROWS; r += V3_THREADS / V3_SLICE) {
            const int n = n0 + r;
            const int o = o0 + r;
            inp_tile[k][r] = (n < N && c < C) ? (float)inp[(size_t)n * C + c] : 0.0f;
            weight_tile[k][r] = (o < OC && c < C) ? (float)weight[(size_t)o * C + c] : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < V3_SLICE; kk++) {
            // 8 + 8 values from shared memory in four 16-byte loads ...
            for (int i = 0; i < V3_THREAD_ROWS; i += 4) {
                const float4 va = *reinterpret_cast<const float4*>(&inp_tile[kk][v3_offset(ty, i)]);
                a[i] = va.x; a[i + 1] = va.y; a[i + 2] = va.z; a[i + 3] = va.w;
            }
            for (int j = 0; j < V3_THREAD_COLS; j += 4) {
                const float4 vw = *reinterpret_cast<const float4*>(&weight_tile[kk][v3_offset(tx, j)]);
                w[j] = vw.x; w[j + 1] = vw.y; w[j + 2] = vw.z; w[j + 3] = vw.w;
            }
            // ... feed 64 FMAs: the outer product a w^T added to the thread's tile, in registers
            for (int i = 0; i < V3_THREAD_ROWS; i++) {
                for (int j = 0; j < V3_THREAD_COLS; j++) {
                    acc[i][j] += a[i] * w[j];
                }
            }
        }
        __syncthreads();
    }
    // 16 threads (tx) write runs of 4 consecutive columns: 64 contiguous elements per row
    for (int i = 0; i < V3_THREAD_ROWS; i++) {
        const int n = n0 + v3_offset(ty, i);
        for (int j = 0; j < V3_THREAD_COLS; j++) {
            const int o = o0 + v3_offset(tx, j);
            if (n < N && o < OC) {
                out[(size_t)n * OC + o] = (floatX)(acc[i][j] + (float)bias[o]);
            }
        }
    }
}

// ============================================================================
// versions 6-8: tensor cores (bf16 builds only: mma.sync takes bf16 operands here; an fp32 build
// of this file has versions 1-3 only, and matmul.py skips 6-8 there with that reason)
#if defined(ENABLE_BF16)

#include "tensor_core.cuh"

// The instruction: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (kernels/tensor_core.cuh),
// one warp computes D (16x8, fp32) = A (16x16, bf16) B (16x8, bf16) + C. 16*8*16 = 2048 FMAs per
// instruction instead of one: an H100 SXM's tensor cores reach 989 dense bf16 TFLOP/s against the
// 67 fp32 TFLOP/s of its CUDA cores (NVIDIA's datasheet; llmc/mfu.py), which cap versions 1-3.
#define MMA_M 16
#define MMA_N 8
#define MMA_K 16
#define CHUNK_BYTES 16                     // one ldmatrix row, one cp.async, one 16-byte load
#define CHUNK_ELEMENTS 8                   // bf16 per chunk
#define BANK_LINE_CHUNKS 8                 // 32 banks x 4 bytes = 128 bytes = 8 chunks

// GPT-2's GELU (tanh approximation), as kernels/gelu.cu computes it, for the fused epilogue
#define GELU_SCALING_FACTOR 0.7978845608028654f    // sqrt(2/pi)
#define GELU_CUBIC_COEFF 0.044715f
__device__ inline float gelu_tanh(float x) {
    const float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC_COEFF * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

// ----------------------------------------------------------------------------
// the mma's fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"),
// lane = 4 g + t (g = lane / 4 the "groupID", t = lane % 4 the "threadID_in_group"):
//
//   A (16x16, row-major)                 B (16x8, ".col": column n holds k = 0..15)
//   a[0] = A[g  ][2t..2t+1]               b[0] = B[2t..2t+1  ][g]
//   a[1] = A[g+8][2t..2t+1]               b[1] = B[2t+8..2t+9][g]
//   a[2] = A[g  ][2t+8..2t+9]
//   a[3] = A[g+8][2t+8..2t+9]            C and D (16x8, fp32): c[0], c[1] = C[g][2t], C[g][2t+1]
//                                                              c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// (python dev/cuda/tensor_core.py --device cpu prints this map as the emulated device computes it.)
//
// ldmatrix.x4 loads four 8x8 bf16 matrices at once: lane 8m + i names the shared-memory address of
// row i of matrix m (16 contiguous bytes: a "chunk"), and lane 4g + t receives register r[m] =
// elements (g, 2t) and (g, 2t+1) of matrix m; with .trans, elements (2t, g) and (2t+1, g). So:
// - A stored row-major (m, k): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
//   (rows 8-15, k 8-15) give a[0..3] exactly;
// - B = weight stored (n, k), k contiguous (nn.Linear's layout): column n of B is row n of weight,
//   so matrices (n 0-7, k 0-7), (n 0-7, k 8-15) give b[0..1] of one n8 tile, no transpose;
// - B or A stored (k, n) / (k, m), n or m contiguous (the backward's weight, dout^T, inp): the
//   same matrices read with .trans.

// the A fragments (a[0..3]) of the warp's m16 tile at rows `row0`, k16 step `ks` of the tile;
// offset(row, chunk) locates chunk `chunk` (8 k's) of row `row` of a (rows, k) tile
template <class Offset>
__device__ inline void ldmatrix_a(unsigned a[4], const floatX* tile, Offset offset, int row0, int ks) {
    const int lane = threadIdx.x % WARP_SIZE, matrix = lane / 8, i = lane % 8;
    const int row = row0 + (matrix & 1) * 8 + i;             // matrices 0, 2: rows 0-7; 1, 3: rows 8-15
    const int chunk = ks * (MMA_K / CHUNK_ELEMENTS) + (matrix >> 1);   // matrices 0, 1: k 0-7; 2, 3: k 8-15
    ldmatrix_x4(a, tile + offset(row, chunk));
}

// the B fragments of two n8 tiles (b0 = n rows0..+7, b1 = n rows0+8..+15) at k16 step ks, from a
// (n, k) tile: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
template <class Offset>
__device__ inline void ldmatrix_b_pair(unsigned b0[2], unsigned b1[2], const floatX* tile, Offset offset, int row0, int ks) {
    const int lane = threadIdx.x % WARP_SIZE, matrix = lane / 8, i = lane % 8;
    const int row = row0 + (matrix >> 1) * 8 + i;
    const int chunk = ks * (MMA_K / CHUNK_ELEMENTS) + (matrix & 1);
    unsigned r[4];
    ldmatrix_x4(r, tile + offset(row, chunk));
    b0[0] = r[0]; b0[1] = r[1]; b1[0] = r[2]; b1[1] = r[3];
}

// the output of one warp tile, WM x WN, held as MI x NI mma accumulators: acc[mi][ni][i] is
// element (mi*16 + g + 8*(i >= 2), ni*8 + 2t + (i & 1)) of the warp tile (the C/D layout above)
__device__ inline int acc_row(int mi, int i) { return mi * MMA_M + (threadIdx.x % WARP_SIZE) / 4 + (i >= 2) * 8; }
__device__ inline int acc_col(int ni, int i) { return ni * MMA_N + (threadIdx.x % WARP_SIZE) % 4 * 2 + (i & 1); }

// out[row, col..col+1] = acc pair + bias, rounded once, one 4-byte store (col is even and OC a
// multiple of 8, so the pair is aligned and both or neither are inside)
__device__ inline void store_pair(floatX* out, const floatX* bias, int N, int OC, int row, int col, float v0, float v1) {
    if (row < N && col < OC) {
        *reinterpret_cast<unsigned*>(&out[(size_t)row * OC + col]) =
            pack_bf16x2(v0 + (float)bias[col], v1 + (float)bias[col + 1]);
    }
}

// ----------------------------------------------------------------------------
// version 6: tensor cores. The block tile of v3 (128 x 128 outputs, slices of 32 columns of C),
// now computed by 4 warps of 64 x 64 outputs each with mma.sync: per 16-column step a warp loads
// its A fragments (4 m16 tiles) and B fragments (8 n8 tiles) from shared memory with 8 ldmatrix.x4
// and issues 4 x 8 = 32 mma, 65536 FMAs, where v3's 256 threads issued 256 x 64 = 16384 FMAs per
// step and 16 shared loads each. The tiles are stored as they are in global memory, row after row
// (64 bytes per row); the loads are synchronous (global -> registers -> shared, then a barrier).
//
// What it leaves on the table: (1) while a block loads a slice its warps wait, and while they
// compute nothing is loaded: two barriers a slice and nothing in flight; (2) ldmatrix reads 8 rows
// 64 bytes apart, which land on only 2 of the 8 four-bank groups of shared memory (row r at bank
// group (4r + chunk) % 8): a 4-way bank conflict on every fragment load.

#define V6_BLOCK_ROWS 128                  // BM: rows of out per block
#define V6_BLOCK_COLS 128                  // BN: columns of out per block
#define V6_SLICE 32                        // BK: columns of C per shared-memory slice (2 mma k-steps)
#define V6_WARP_ROWS 64                    // WM: rows of out per warp (4 m16 tiles)
#define V6_WARP_COLS 64                    // WN: columns of out per warp (8 n8 tiles)
#define V6_WARPS_N (V6_BLOCK_COLS / V6_WARP_COLS)                      // 2 x 2 warps
#define V6_THREADS (V6_BLOCK_ROWS / V6_WARP_ROWS * V6_WARPS_N * WARP_SIZE)   // 128
#define V6_MI (V6_WARP_ROWS / MMA_M)       // 4
#define V6_NI (V6_WARP_COLS / MMA_N)       // 8
#define V6_SLICE_CHUNKS (V6_SLICE / CHUNK_ELEMENTS)                    // 4 chunks per tile row

// a (rows, V6_SLICE) tile stored plainly: chunk c of row r at element r * 32 + 8c
struct PlainOffset {
    __device__ int operator()(int row, int chunk) const { return (row * V6_SLICE_CHUNKS + chunk) * CHUNK_ELEMENTS; }
};

// block V6_THREADS, grid (ceil(OC/128), ceil(N/128)); C and OC multiples of 8 (matmul.py checks)
extern "C" __global__ void __launch_bounds__(V6_THREADS)
matmul_forward_v6(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int N, int C, int OC) {
    __shared__ __align__(16) floatX inp_tile[V6_BLOCK_ROWS * V6_SLICE];        // (128, 32): inp[n0 + r, c0 + k]
    __shared__ __align__(16) floatX weight_tile[V6_BLOCK_COLS * V6_SLICE];     // (128, 32): weight[o0 + r, c0 + k]
    const PlainOffset offset;
    const int warp = threadIdx.x / WARP_SIZE;
    const int n0 = blockIdx.y * V6_BLOCK_ROWS, o0 = blockIdx.x * V6_BLOCK_COLS;
    const int warp_row = warp / V6_WARPS_N * V6_WARP_ROWS, warp_col = warp % V6_WARPS_N * V6_WARP_COLS;
    float acc[V6_MI][V6_NI][4] = {};
    for (int c0 = 0; c0 < C; c0 += V6_SLICE) {
        // 128 rows x 4 chunks of each tile, 16 bytes per thread per load, 4 threads per row
        // (64 contiguous bytes); zeros past the matrices' edges
        for (int q = threadIdx.x; q < V6_BLOCK_ROWS * V6_SLICE_CHUNKS; q += V6_THREADS) {
            const int r = q / V6_SLICE_CHUNKS, chunk = q % V6_SLICE_CHUNKS, c = c0 + chunk * CHUNK_ELEMENTS;
            const int4 zero = make_int4(0, 0, 0, 0);
            const bool in_c = c < C;
            *reinterpret_cast<int4*>(&inp_tile[offset(r, chunk)]) =
                n0 + r < N && in_c ? *reinterpret_cast<const int4*>(&inp[(size_t)(n0 + r) * C + c]) : zero;
            *reinterpret_cast<int4*>(&weight_tile[offset(r, chunk)]) =
                o0 + r < OC && in_c ? *reinterpret_cast<const int4*>(&weight[(size_t)(o0 + r) * C + c]) : zero;
        }
        __syncthreads();
        for (int ks = 0; ks < V6_SLICE / MMA_K; ks++) {
            unsigned a[V6_MI][4], b[V6_NI][2];
            for (int mi = 0; mi < V6_MI; mi++) {
                ldmatrix_a(a[mi], inp_tile, offset, warp_row + mi * MMA_M, ks);
            }
            for (int nj = 0; nj < V6_NI; nj += 2) {
                ldmatrix_b_pair(b[nj], b[nj + 1], weight_tile, offset, warp_col + nj * MMA_N, ks);
            }
            for (int mi = 0; mi < V6_MI; mi++) {
                for (int ni = 0; ni < V6_NI; ni++) {
                    mma_m16n8k16_bf16(acc[mi][ni], a[mi], b[ni], acc[mi][ni]);
                }
            }
        }
        __syncthreads();                              // everyone is done before the tiles are overwritten
    }
    for (int mi = 0; mi < V6_MI; mi++) {
        for (int ni = 0; ni < V6_NI; ni++) {
            const int row = n0 + warp_row + acc_row(mi, 0), col = o0 + warp_col + acc_col(ni, 0);
            store_pair(out, bias, N, OC, row, col, acc[mi][ni][0], acc[mi][ni][1]);
            store_pair(out, bias, N, OC, row + 8, col, acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
}

// ----------------------------------------------------------------------------
// versions 7 and 8: the block tile streams through a ring of STAGES shared-memory stages, filled by
// cp.async while the warps compute on the stage before (the copy engine and the tensor cores work
// at the same time), with each row's chunks XOR-swizzled so that ldmatrix reads hit all banks.
//
// The pipeline (STAGES = 4, one "tile" = the block's A and B slices of BK columns of the K sum):
//
//     prologue: issue tiles 0, 1, 2 (one commit group each); wait until tile 0 has landed
//                         stage 0    stage 1    stage 2    stage 3
//     k-tile 0:           compute    landing    landing    <- issue tile 3
//     k-tile 1:           <- tile 4  compute    landing    landing
//     k-tile 2:           landing    <- tile 5  compute    landing
//     ...                 (stage kt % 4 is computed while tiles kt+1 .. kt+3 are in flight)
//
// Before the last k16 step of k-tile kt, every thread waits for its copies of tile kt+1
// (cp.async.wait_group STAGES-2: at most the 2 newest groups still in flight) and the block
// synchronizes: tile kt+1 is then visible to all warps, and no warp still reads the stage of tile
// kt-1, which the next k-tile's first step refills. The fragments of the next k16 step are loaded
// from shared memory before the mma of this one are issued (two register sets, a and b[2]), so the
// ldmatrix latency hides behind the tensor cores.
//
// The swizzle. Shared memory has 32 banks of 4 bytes: a 128-byte line, 8 chunks of 16 bytes. The
// 8 rows of one ldmatrix matrix read the same logical chunk c of 8 consecutive rows; stored
// plainly, rows 64 bytes apart (BK = 32: 4 chunks per row) put that chunk at bank group (4r + c) %
// 8, only 2 groups for 8 rows (a 4-way conflict), and rows of 128 bytes or more put it in one group
// (8-way). Stored at chunk position c ^ f(r) instead, with f(r) = (r / 2) % 4 for 4 chunks per row
// (rows r and r+1 share a line) and f(r) = r % 8 for 8 or more, the 8 rows land on 8 different bank
// groups: one pass per matrix. Unlike v2's padding it costs no memory, and a 16-byte chunk stays
// whole (XOR permutes chunks within a row), so cp.async and ldmatrix still move it in one piece.

// element offset of logical chunk `chunk` of row `row` in a tile of CHUNKS chunks per row
template <int CHUNKS>
struct SwizzledOffset {
    static constexpr int ROWS_PER_LINE = CHUNKS >= BANK_LINE_CHUNKS ? 1 : BANK_LINE_CHUNKS / CHUNKS;
    static constexpr int PERIOD = CHUNKS >= BANK_LINE_CHUNKS ? BANK_LINE_CHUNKS : CHUNKS;
    __device__ int operator()(int row, int chunk) const {
        return (row * CHUNKS + (chunk ^ (row / ROWS_PER_LINE) % PERIOD)) * CHUNK_ELEMENTS;
    }
};

// The block's tile shape. BM x BN outputs per block, BK columns of the K sum per stage, WARPS_M x
// WARPS_N warps of WM x WN outputs (MI x NI mma tiles) each.
template <int BM_, int BN_, int BK_, int WARPS_M_, int WARPS_N_, int STAGES_>
struct TileConfig {
    static constexpr int BM = BM_, BN = BN_, BK = BK_, WARPS_M = WARPS_M_, WARPS_N = WARPS_N_, STAGES = STAGES_;
    static constexpr int THREADS = WARPS_M * WARPS_N * WARP_SIZE;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    static constexpr int MI = WM / MMA_M, NI = WN / MMA_N;
    static constexpr int KSTEPS = BK / MMA_K;
    static_assert(WM % MMA_M == 0 && WN % (2 * MMA_N) == 0 && BK % MMA_K == 0, "whole mma tiles, B in pairs");
    static_assert(KSTEPS >= 2, "the pipeline switches stages before the last k16 step of a tile");
    static_assert(STAGES >= 2, "at least one tile in flight while one is computed");
};

// One operand's tile in a stage. K_MAJOR: MN rows (m or n) of BK contiguous k's (inp, and weight
// in the forward); otherwise BK rows (k) of MN contiguous m's or n's (weight in dinp = dout @
// weight; dout^T and inp in dweight = dout^T @ inp).
template <int MN, int BK, bool K_MAJOR>
struct OperandTile {
    static constexpr int ROWS = K_MAJOR ? MN : BK;
    static constexpr int COLS = K_MAJOR ? BK : MN;
    static constexpr int CHUNKS = COLS / CHUNK_ELEMENTS;
    static constexpr int ELEMENTS = MN * BK;
    using Offset = SwizzledOffset<CHUNKS>;
};

// This thread's share of the cp.async copies of one operand's tile, worked out once per block. A
// pass of the block copies PASS_ROWS whole rows (a warp: 32 consecutive chunks, whole rows, so
// its reads coalesce); this thread copies chunk `col / 8` of rows row, row + PASS_ROWS, ... Only
// the K offset changes from one k-tile to the next, so the loop keeps one pointer and one offset
// per operand instead of an address per copy.
template <class Tile, int THREADS, bool K_MAJOR>
struct TileCopy {
    static constexpr int PASS_ROWS = THREADS / Tile::CHUNKS;
    static constexpr int PASSES = Tile::ROWS / PASS_ROWS;
    static_assert(THREADS % Tile::CHUNKS == 0 && Tile::ROWS % PASS_ROWS == 0, "whole rows per pass");
    static_assert(PASS_ROWS % BANK_LINE_CHUNKS == 0, "the swizzle repeats every 8 rows: the same in every pass");
    const floatX* src;   // global: this thread's chunk of its first row at k = 0 (stored orientation)
    int ld;              // elements per global row
    int smem;            // element offset of its first chunk in the tile (swizzled)
    int row, col;        // its first row and its column within the tile (stored orientation)
    int mn_left;         // rows (K-major) or columns (MN-major) of the tile inside the matrix

    // g: the operand, ld elements per stored row; mn0: the tile's first row of A (m) or B (n); mn_end: M or N
    __device__ TileCopy(const floatX* g, int ld_, int mn0, int mn_end) : ld(ld_) {
        row = threadIdx.x / Tile::CHUNKS;
        const int chunk = threadIdx.x % Tile::CHUNKS;
        col = chunk * CHUNK_ELEMENTS;
        smem = typename Tile::Offset()(row, chunk);
        mn_left = mn_end - mn0;
        src = K_MAJOR ? g + (size_t)(mn0 + row) * ld + col : g + (size_t)row * ld + mn0 + col;
    }

    // Issue this thread's copies of the tile whose K sum starts at k0; chunks past k_end or past the
    // matrix's M or N are zero-filled (src-size 0: nothing is read from the address given).
    __device__ void issue(floatX* tile, int k0, int k_end) const {
#pragma unroll
        for (int j = 0; j < PASSES; j++) {
            const int r = row + j * PASS_ROWS;
            const bool inside = K_MAJOR ? r < mn_left && k0 + col < k_end : k0 + r < k_end && col < mn_left;
            const floatX* from = K_MAJOR ? src + (size_t)j * PASS_ROWS * ld + k0 : src + (size_t)(k0 + j * PASS_ROWS) * ld;
            cp_async_cg(tile + smem + j * PASS_ROWS * Tile::COLS, from, inside ? CHUNK_BYTES : 0);
        }
    }
};

// The warp's A fragments (MI m16 tiles from row warp_m0) at k16 step ks of a stage. A (k, m)
// tile (m contiguous) is read with .trans: matrix (k 0-7, m 0-7) transposed is the quadrant (m 0-7,
// k 0-7); the quadrant order is the same as ldmatrix_a's.
template <class Tile, int MI, bool K_MAJOR>
__device__ inline void load_a_fragments(unsigned (&a)[MI][4], const floatX* tile, int warp_m0, int ks) {
    const typename Tile::Offset offset;
    const int lane = threadIdx.x % WARP_SIZE, matrix = lane / 8, i = lane % 8;
#pragma unroll
    for (int mi = 0; mi < MI; mi++) {
        if constexpr (K_MAJOR) {
            ldmatrix_a(a[mi], tile, offset, warp_m0 + mi * MMA_M, ks);
        } else {
            const int k = ks * MMA_K + (matrix >> 1) * 8 + i;                       // matrices 2, 3: k 8-15
            const int chunk = (warp_m0 + mi * MMA_M + (matrix & 1) * 8) / CHUNK_ELEMENTS;   // 1, 3: m 8-15
            ldmatrix_x4_trans(a[mi], tile + offset(k, chunk));
        }
    }
}

// The warp's B fragments (NI n8 tiles from column warp_n0) at k16 step ks. A (k, n) tile (n
// contiguous) is read with .trans: matrix (k 0-7, n 0-7) transposed holds B[2t..2t+1][g] = b[0].
template <class Tile, int NI, bool K_MAJOR>
__device__ inline void load_b_fragments(unsigned (&b)[NI][2], const floatX* tile, int warp_n0, int ks) {
    const typename Tile::Offset offset;
    const int lane = threadIdx.x % WARP_SIZE, matrix = lane / 8, i = lane % 8;
#pragma unroll
    for (int nj = 0; nj < NI; nj += 2) {
        if constexpr (K_MAJOR) {
            ldmatrix_b_pair(b[nj], b[nj + 1], tile, offset, warp_n0 + nj * MMA_N, ks);
        } else {
            const int k = ks * MMA_K + (matrix & 1) * 8 + i;                        // matrices 1, 3: k 8-15
            const int chunk = (warp_n0 + nj * MMA_N + (matrix >> 1) * 8) / CHUNK_ELEMENTS;  // 2, 3: n 8-15
            unsigned r[4];
            ldmatrix_x4_trans(r, tile + offset(k, chunk));
            b[nj][0] = r[0]; b[nj][1] = r[1]; b[nj + 1][0] = r[2]; b[nj + 1][1] = r[3];
        }
    }
}

// acc (the warp's MI x NI accumulators) += A[m0.., k_begin..k_end) B[k_begin..k_end), n0..) through
// the pipeline above. A is (M, K) (A_K_MAJOR, lda >= K) or stored (K, M) (lda >= M); B is stored
// (N, K) (B_K_MAJOR) or (K, N). smem: STAGES stages of one A and one B tile. Rows past M and N and
// k's past k_end are loaded as zeros. Called by all threads of the block.
template <class Cfg, bool A_K_MAJOR, bool B_K_MAJOR>
__device__ inline void mma_mainloop(float (&acc)[Cfg::MI][Cfg::NI][4], floatX* smem, const floatX* A, int lda,
                                    const floatX* B, int ldb, int M, int N, int m0, int n0, int k_begin, int k_end) {
    using ATile = OperandTile<Cfg::BM, Cfg::BK, A_K_MAJOR>;
    using BTile = OperandTile<Cfg::BN, Cfg::BK, B_K_MAJOR>;
    constexpr int STAGE = ATile::ELEMENTS + BTile::ELEMENTS;       // elements per stage: A tile, then B tile
    const int warp = threadIdx.x / WARP_SIZE;
    const int warp_m0 = warp / Cfg::WARPS_N * Cfg::WM, warp_n0 = warp % Cfg::WARPS_N * Cfg::WN;
    const int k_tiles = (k_end - k_begin + Cfg::BK - 1) / Cfg::BK;
    const TileCopy<ATile, Cfg::THREADS, A_K_MAJOR> copy_a(A, lda, m0, M);
    const TileCopy<BTile, Cfg::THREADS, B_K_MAJOR> copy_b(B, ldb, n0, N);

    // prologue: tiles 0 .. STAGES-2 in flight, one commit group each (empty past the last tile,
    // so that "the g-th group holds tile g" stays true and the wait counts below hold)
#pragma unroll
    for (int s = 0; s < Cfg::STAGES - 1; s++) {
        if (s < k_tiles) {
            copy_a.issue(smem + s * STAGE, k_begin + s * Cfg::BK, k_end);
            copy_b.issue(smem + s * STAGE + ATile::ELEMENTS, k_begin + s * Cfg::BK, k_end);
        }
        cp_async_commit_group();
    }
    cp_async_wait_group<Cfg::STAGES - 2>();          // tile 0 has landed (this thread's copies) ...
    __syncthreads();                                 // ... and every thread's

    unsigned a[2][Cfg::MI][4], b[2][Cfg::NI][2];     // fragments of two k16 steps: this one, the next
    load_a_fragments<ATile, Cfg::MI, A_K_MAJOR>(a[0], smem, warp_m0, 0);
    load_b_fragments<BTile, Cfg::NI, B_K_MAJOR>(b[0], smem + ATile::ELEMENTS, warp_n0, 0);
    for (int kt = 0; kt < k_tiles; kt++) {
        const floatX* read = smem + kt % Cfg::STAGES * STAGE;
#pragma unroll
        for (int ks = 0; ks < Cfg::KSTEPS; ks++) {
            if (ks == Cfg::KSTEPS - 1) {
                cp_async_wait_group<Cfg::STAGES - 2>();   // tile kt+1 has landed (this thread's copies) ...
                __syncthreads();                          // ... every thread's; and no warp reads tile kt-1's stage
                read = smem + (kt + 1) % Cfg::STAGES * STAGE;
            }
            if (ks < Cfg::KSTEPS - 1 || kt + 1 < k_tiles) {      // the next step's fragments
                const int next = (ks + 1) % Cfg::KSTEPS;
                load_a_fragments<ATile, Cfg::MI, A_K_MAJOR>(a[(ks + 1) % 2], read, warp_m0, next);
                load_b_fragments<BTile, Cfg::NI, B_K_MAJOR>(b[(ks + 1) % 2], read + ATile::ELEMENTS, warp_n0, next);
            }
            if (ks == 0) {                                // refill the stage that tile kt-1 used
                const int fill = kt + Cfg::STAGES - 1;
                if (fill < k_tiles) {
                    floatX* stage = smem + fill % Cfg::STAGES * STAGE;
                    copy_a.issue(stage, k_begin + fill * Cfg::BK, k_end);
                    copy_b.issue(stage + ATile::ELEMENTS, k_begin + fill * Cfg::BK, k_end);
                }
                cp_async_commit_group();
            }
#pragma unroll
            for (int mi = 0; mi < Cfg::MI; mi++) {
#pragma unroll
                for (int ni = 0; ni < Cfg::NI; ni++) {
                    mma_m16n8k16_bf16(acc[mi][ni], a[ks % 2][mi], b[ks % 2][ni], acc[mi][ni]);
                }
            }
        }
    }
    cp_async_wait_all();                             // nothing in flight (the trailing groups are empty) ...
    __syncthreads();                                 // ... and every warp done with the stages: smem is free
}

// ----------------------------------------------------------------------------
// version 7: v6's block and warp tiles through the cp.async pipeline, 4 stages, swizzled; the
// same direct epilogue (each lane stores its accumulator pairs).

using V7Config = TileConfig<128, 128, 32, 2, 2, 4>;     // BM, BN, BK, WARPS_M, WARPS_N, STAGES: 64 KiB

// block V7Config::THREADS (128), grid (ceil(OC/128), ceil(N/128)), dynamic shared memory
// STAGES x (BM + BN) x BK bf16 = 64 KiB (matmul.py opts in above 48 KiB)
extern "C" __global__ void __launch_bounds__(V7Config::THREADS)
matmul_forward_v7(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    using Cfg = V7Config;
    const int n0 = blockIdx.y * Cfg::BM, o0 = blockIdx.x * Cfg::BN;
    float acc[Cfg::MI][Cfg::NI][4] = {};
    mma_mainloop<Cfg, true, true>(acc, stages, inp, C, weight, C, N, OC, n0, o0, 0, C);
    const int warp = threadIdx.x / WARP_SIZE;
    const int warp_row = warp / Cfg::WARPS_N * Cfg::WM, warp_col = warp % Cfg::WARPS_N * Cfg::WN;
#pragma unroll
    for (int mi = 0; mi < Cfg::MI; mi++) {
#pragma unroll
        for (int ni = 0; ni < Cfg::NI; ni++) {
            const int row = n0 + warp_row + acc_row(mi, 0), col = o0 + warp_col + acc_col(ni, 0);
            store_pair(out, bias, N, OC, row, col, acc[mi][ni][0], acc[mi][ni][1]);
            store_pair(out, bias, N, OC, row + 8, col, acc[mi][ni][2], acc[mi][ni][3]);
        }
    }
}

// ----------------------------------------------------------------------------
// version 8: v7's pipeline with the block tile chosen per shape, the epilogue fused and staged
// through shared memory, and the backward's two products (dinp with weight read transposed, dweight
// with both operands read transposed and the K sum over tokens split across blocks).
//
// Tile configurations (matmul.py's "block sizes" of version 8 are their thread counts):
//   128 threads: 128 x 128 outputs, 2 x 2 warps of 64 x 64, BK 32, 4 stages, 64 KiB: two blocks
//                per SM (8 warps), small tiles for shapes with few of them;
//   256 threads: 128 x 256 outputs, 2 x 4 warps of 64 x 64, BK 32, 3 stages, 72 KiB: one block per
//                SM, each B fragment reused by 4 m16 tiles and each A fragment by 8 n8 tiles as in
//                the smaller one, but each loaded byte of the block tile by more outputs.
// A warp tile of 64 x 64 holds 4 x 8 x 4 = 128 fp32 accumulators per lane and two sets of
// fragments (2 x (16 + 16) registers): about 200 of the 255 registers a thread may have, so the
// hot loop keeps everything in registers (tests/test_dev_cuda_matmul_attention.py checks ptxas's
// report: no spills).
//
// Block order: blocks are numbered down the M tiles of a group of RASTER_GROUP_M tile rows, then
// across its N tiles (grouped rasterization), so the blocks in flight at one time share a few A
// panels and a few B panels, which stay in L2, whatever the shape (the classifier's weight,
// 50304 x 768, is larger than the H100's 50 MiB L2).
//
// The epilogue: each warp writes its accumulators, plus the bias (and through GELU), rounded to
// bf16, into the (now idle) stages as a (BM, BN + 8) tile (the 8-element pad puts the 8 rows a
// warp's pairs land on into different banks), then the block stores it with 16-byte stores, a
// warp writing 512 contiguous bytes of a row, instead of v7's 4-byte stores spread over 8 rows.

using V8SmallConfig = TileConfig<128, 128, 32, 2, 2, 4>;
using V8LargeConfig = TileConfig<128, 256, 32, 2, 4, 3>;
#define RASTER_GROUP_M 16                  // M tiles per group of the block order

// this block's (M tile, N tile) in the grouped order (blockIdx.x; grid.x = tiles_m * tiles_n)
__device__ inline void block_tile(int tiles_m, int tiles_n, int& tile_m, int& tile_n) {
    const int per_group = RASTER_GROUP_M * tiles_n;
    const int first_m = blockIdx.x / per_group * RASTER_GROUP_M;
    const int group_rows = min(tiles_m - first_m, RASTER_GROUP_M);
    const int local = blockIdx.x % per_group;
    tile_m = first_m + local % group_rows;
    tile_n = local / group_rows;
}

enum EpilogueKind { EPILOGUE_PLAIN, EPILOGUE_BIAS, EPILOGUE_BIAS_GELU };

// out (M, N) tile at (m0, n0) = acc (+ bias[n]); with EPILOGUE_BIAS_GELU, pre_gelu = acc + bias and
// out = gelu(pre_gelu) (GELU of the bf16 value the backward will read). smem: the idle stages.
template <class Cfg, int EPILOGUE>
__device__ inline void store_tile(floatX* out, floatX* pre_gelu, const floatX* bias, float (&acc)[Cfg::MI][Cfg::NI][4],
                                  floatX* smem, int M, int N, int m0, int n0) {
    constexpr int LD = Cfg::BN + CHUNK_ELEMENTS;     // the padded row of the staged tile
    static_assert(Cfg::BM * LD <= Cfg::STAGES * (Cfg::BM + Cfg::BN) * Cfg::BK, "the staged tile fits in the stages");
    const int warp = threadIdx.x / WARP_SIZE;
    const int warp_m0 = warp / Cfg::WARPS_N * Cfg::WM, warp_n0 = warp % Cfg::WARPS_N * Cfg::WN;
#pragma unroll
    for (int ni = 0; ni < Cfg::NI; ni++) {
        const int col = warp_n0 + acc_col(ni, 0);
        float bias0 = 0.0f, bias1 = 0.0f;
        if (EPILOGUE != EPILOGUE_PLAIN && n0 + col < N) {
            bias0 = (float)bias[n0 + col];
            bias1 = (float)bias[n0 + col + 1];
        }
#pragma unroll
        for (int mi = 0; mi < Cfg::MI; mi++) {
            const int row = warp_m0 + acc_row(mi, 0);
            *reinterpret_cast<unsigned*>(&smem[row * LD + col]) =
                pack_bf16x2(acc[mi][ni][0] + bias0, acc[mi][ni][1] + bias1);
            *reinterpret_cast<unsigned*>(&smem[(row + 8) * LD + col]) =
                pack_bf16x2(acc[mi][ni][2] + bias0, acc[mi][ni][3] + bias1);
        }
    }
    __syncthreads();
    constexpr int ROW_CHUNKS = Cfg::BN / CHUNK_ELEMENTS;
#pragma unroll
    for (int j = 0; j < Cfg::BM * ROW_CHUNKS / Cfg::THREADS; j++) {
        const int q = threadIdx.x + j * Cfg::THREADS;
        const int r = q / ROW_CHUNKS, c = q % ROW_CHUNKS * CHUNK_ELEMENTS;
        if (m0 + r < M && n0 + c < N) {              // N is a multiple of 8: a chunk is all inside or all out
            x128 value = load128(smem + r * LD + c);
            const size_t at = (size_t)(m0 + r) * N + n0 + c;
            if constexpr (EPILOGUE == EPILOGUE_BIAS_GELU) {
                store128(pre_gelu + at, value);
                for (int k = 0; k < x128::size; k++) {
                    value[k] = (floatX)gelu_tanh((float)value[k]);
                }
            }
            store128(out + at, value);
        }
    }
}

// partial (M, N) fp32 tile at (m0, n0) = acc, each lane's pairs as 8-byte stores (4 lanes fill a
// 32-byte sector of a row)
template <class Cfg>
__device__ inline void store_partial(float* partial, float (&acc)[Cfg::MI][Cfg::NI][4], int M, int N, int m0, int n0) {
    const int warp = threadIdx.x / WARP_SIZE;
    const int warp_m0 = warp / Cfg::WARPS_N * Cfg::WM, warp_n0 = warp % Cfg::WARPS_N * Cfg::WN;
#pragma unroll
    for (int mi = 0; mi < Cfg::MI; mi++) {
#pragma unroll
        for (int ni = 0; ni < Cfg::NI; ni++) {
            const int row = m0 + warp_m0 + acc_row(mi, 0), col = n0 + warp_n0 + acc_col(ni, 0);
            if (col < N && row < M) {
                *reinterpret_cast<float2*>(&partial[(size_t)row * N + col]) = make_float2(acc[mi][ni][0], acc[mi][ni][1]);
            }
            if (col < N && row + 8 < M) {
                *reinterpret_cast<float2*>(&partial[(size_t)(row + 8) * N + col]) =
                    make_float2(acc[mi][ni][2], acc[mi][ni][3]);
            }
        }
    }
}

// out (N, OC) = inp (N, C) @ weight^T + bias [pre_gelu = that, out = gelu(it)]: GEMM M = N tokens,
// N = OC, K = C, A = inp and B = weight both K-major
template <class Cfg, int EPILOGUE>
__device__ inline void forward_v8(floatX* smem, floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight,
                                  const floatX* bias, int N, int C, int OC) {
    int tile_m, tile_n;
    block_tile((N + Cfg::BM - 1) / Cfg::BM, (OC + Cfg::BN - 1) / Cfg::BN, tile_m, tile_n);
    const int m0 = tile_m * Cfg::BM, n0 = tile_n * Cfg::BN;
    float acc[Cfg::MI][Cfg::NI][4] = {};
    mma_mainloop<Cfg, true, true>(acc, smem, inp, C, weight, C, N, OC, m0, n0, 0, C);
    store_tile<Cfg, EPILOGUE>(out, pre_gelu, bias, acc, smem, N, OC, m0, n0);
}

// dinp (N, C) = dout (N, OC) @ weight (OC, C): GEMM M = N, N = C, K = OC; A = dout K-major, B =
// weight stored (K, N): read with ldmatrix .trans
template <class Cfg>
__device__ inline void dinp_v8(floatX* smem, floatX* dinp, const floatX* dout, const floatX* weight, int N, int C, int OC) {
    int tile_m, tile_n;
    block_tile((N + Cfg::BM - 1) / Cfg::BM, (C + Cfg::BN - 1) / Cfg::BN, tile_m, tile_n);
    const int m0 = tile_m * Cfg::BM, n0 = tile_n * Cfg::BN;
    float acc[Cfg::MI][Cfg::NI][4] = {};
    mma_mainloop<Cfg, true, false>(acc, smem, dout, OC, weight, C, N, C, m0, n0, 0, OC);
    store_tile<Cfg, EPILOGUE_PLAIN>(dinp, nullptr, nullptr, acc, smem, N, C, m0, n0);
}

// partial[z] (OC, C) = dout^T (OC, tokens) @ inp (tokens, C) over split z's tokens: GEMM M = OC, N =
// C, K = N tokens; A = dout stored (K, M), B = inp stored (K, N): both read with .trans. Split z
// (blockIdx.z) sums the tokens of k-tiles [z * k_tiles_per_split, (z + 1) * k_tiles_per_split):
// dweight's GEMMs have few output tiles (768 x 768: 36 of 128 x 128, for 132 SMs) and a long K
// (16384 tokens), so splitting K gives every SM work; matmul_split_k_reduce_v8 adds the splits.
template <class Cfg>
__device__ inline void dweight_v8(floatX* smem, float* partial, const floatX* dout, const floatX* inp, int N, int C,
                                  int OC, int k_tiles_per_split) {
    int tile_m, tile_n;
    block_tile((OC + Cfg::BM - 1) / Cfg::BM, (C + Cfg::BN - 1) / Cfg::BN, tile_m, tile_n);
    const int m0 = tile_m * Cfg::BM, n0 = tile_n * Cfg::BN;
    const int k_begin = blockIdx.z * k_tiles_per_split * Cfg::BK;
    const int k_end = min(N, k_begin + k_tiles_per_split * Cfg::BK);
    float acc[Cfg::MI][Cfg::NI][4] = {};
    mma_mainloop<Cfg, false, false>(acc, smem, dout, OC, inp, C, OC, C, m0, n0, k_begin, k_end);
    store_partial<Cfg>(partial + (size_t)blockIdx.z * OC * C, acc, OC, C, m0, n0);
}

// The kernels: block Cfg::THREADS, grid (tiles_m * tiles_n [, 1, splits]), dynamic shared memory
// Cfg::STAGES * (BM + BN) * BK bf16 (matmul.py opts in above 48 KiB). C and OC multiples of 8.

extern "C" __global__ void __launch_bounds__(V8SmallConfig::THREADS)
matmul_forward_128x128_v8(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    forward_v8<V8SmallConfig, EPILOGUE_BIAS>(stages, out, nullptr, inp, weight, bias, N, C, OC);
}

extern "C" __global__ void __launch_bounds__(V8LargeConfig::THREADS)
matmul_forward_128x256_v8(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    forward_v8<V8LargeConfig, EPILOGUE_BIAS>(stages, out, nullptr, inp, weight, bias, N, C, OC);
}

extern "C" __global__ void __launch_bounds__(V8SmallConfig::THREADS)
matmul_forward_gelu_128x128_v8(floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight,
                               const floatX* bias, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    forward_v8<V8SmallConfig, EPILOGUE_BIAS_GELU>(stages, out, pre_gelu, inp, weight, bias, N, C, OC);
}

extern "C" __global__ void __launch_bounds__(V8LargeConfig::THREADS)
matmul_forward_gelu_128x256_v8(floatX* out, floatX* pre_gelu, const floatX* inp, const floatX* weight,
                               const floatX* bias, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    forward_v8<V8LargeConfig, EPILOGUE_BIAS_GELU>(stages, out, pre_gelu, inp, weight, bias, N, C, OC);
}

extern "C" __global__ void __launch_bounds__(V8SmallConfig::THREADS)
matmul_backward_dinp_128x128_v8(floatX* dinp, const floatX* dout, const floatX* weight, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    dinp_v8<V8SmallConfig>(stages, dinp, dout, weight, N, C, OC);
}

extern "C" __global__ void __launch_bounds__(V8LargeConfig::THREADS)
matmul_backward_dinp_128x256_v8(floatX* dinp, const floatX* dout, const floatX* weight, int N, int C, int OC) {
    extern __shared__ __align__(16) floatX stages[];
    dinp_v8<V8LargeConfig>(stages, dinp, dout, weight, N, C, OC);
}

extern "C" __global__ void __launch_bounds__(V8SmallConfig::THREADS)
matmul_backward_dweight_128x128_v8(float* partial, const floatX* dout, const floatX* inp, int N, int C, int OC,
                                   int k_tiles_per_split) {
    extern __shared__ __align__(16) floatX stages[];
    dweight_v8<V8SmallConfig>(stages, partial, dout, inp, N, C, OC, k_tiles_per_split);
}

extern "C" __global__ void __launch_bounds__(V8LargeConfig::THREADS)
matmul_backward_dweight_128x256_v8(float* partial, const floatX* dout, const floatX* inp, int N, int C, int OC,
                                   int k_tiles_per_split) {
    extern __shared__ __align__(16) floatX stages[];
    dweight_v8<V8LargeConfig>(stages, partial, dout, inp, N, C, OC, k_tiles_per_split);
}

// dweight (n,) += the sum of `splits` fp32 partial products (splits, n), in split order (the same
// sum every run), rounded once; 8 values per thread (16-byte accesses; n a multiple of 8)
extern "C" __global__ void matmul_split_k_reduce_v8(floatX* dweight, const float* partial, int splits, int n) {
    for (int i = (blockIdx.x * blockDim.x + threadIdx.x) * x128::size; i < n; i += gridDim.x * blockDim.x * x128::size) {
        x128 value = load128(dweight + i);
        float sum[x128::size];
        for (int k = 0; k < x128::size; k++) {
            sum[k] = (float)value[k];
        }
        for (int z = 0; z < splits; z++) {
            for (int k = 0; k < x128::size; k += f128::size) {
                const f128 part = load128(partial + (size_t)z * n + i + k);
                for (int j = 0; j < f128::size; j++) {
                    sum[k + j] += part[j];
                }
            }
        }
        for (int k = 0; k < x128::size; k++) {
            value[k] = (floatX)sum[k];
        }
        store128(dweight + i, value);
    }
}

#endif  // ENABLE_BF16
