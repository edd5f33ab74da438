/*
dev/cuda/matmul.cu: the hand-written matmul kernels of dev/cuda/matmul.py, versions 1-3 of
    out (N,OC) = inp (N,C) @ weight^T + bias,   weight (OC,C) (nn.Linear's layout), bias (OC,),
N = B*T rows. Versions 4 and 5 are library calls (cuBLAS, cuBLASLt), launched from matmul.py.
Every kernel reads floatX, computes in fp32 and rounds each output to floatX once, as the
trainer's kernels do; bias is required (GPT-2 has one on every linear layer).

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
  (What remains between v3 and cuBLAS: tensor cores (mma/wgmma), double-buffered asynchronous
  copies (cp.async/TMA) that overlap loading the next slice with computing this one, and
  per-shape tuning.)

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
