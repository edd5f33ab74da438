/*
dev/cuda/bias.cu: the intermediate bias-gradient kernels of dev/cuda/bias.py (the last version is
kernels/bias.cu's bias_backward + bias_reduce, launched from there by their real names).

    dbias[oc] += sum over the N rows of dout[row, oc]     (dout (N,OC), N = B*T)

- bias_backward_v1: the naive port of gpt2_cpu.matmul_backward's `dbias += dout2.sum(axis=0)`:
  thread oc sums column oc over all N rows and accumulates it into dbias. A warp reads 32
  adjacent elements of a row (coalesced), but there are only OC threads: 3,072 for the MLP's
  widest bias, a dozen blocks on a GPU with 132 multiprocessors, each thread walking N rows.
- bias_backward_v2: the production kernel until 2026-11-27 (llm.c's "partials, then a second
  kernel" plan): grid (X, num_chunks), block row y sums its chunk of rows, one column per thread
  (grid-stride over columns), into scratch[y*OC + oc]; kernels/bias.cu's bias_reduce then adds the
  chunks in order. num_chunks times more threads than version 1, but each load is still 2 bytes.
- bias_reduce_v2: the second kernel of versions 2 and 3, production until 2026-11-27: thread oc
  adds the num_chunks partials of its column into one running sum, in order, so each add waits
  for the previous load's round trip to L2 (10.6 us a call on an H200, OC threads, a few blocks).
  Version 4 is version 3 with kernels/bias.cu's bias_reduce, 16 running sums per thread.
- bias_backward_v5 (candidate, with the production bias_reduce): kernels/bias.cu's bias_backward
  (the same grid, block, shared memory and scratch), each lane loading BIAS_ROWS_IN_FLIGHT = 4 of
  its warp's rows before adding any: the production loop adds each row's 16 bytes as they arrive,
  about one load in flight per lane. The adds are the production kernel's, in its order: the
  same bits.

Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/bias.cu
*/
#include "common.cuh"

// dbias (OC,) += column sums of dout (N,OC): thread oc sums column oc, rows in order
extern "C" __global__ void bias_backward_v1(floatX* dbias, const floatX* dout, int N, int OC) {
    const int oc = blockIdx.x * blockDim.x + threadIdx.x;
    if (oc < OC) {
        float sum = 0.0f;
        for (int row = 0; row < N; row++) {
            sum += (float)dout[(size_t)row * OC + oc];
        }
        dbias[oc] = (floatX)((float)dbias[oc] + sum);
    }
}

// scratch (num_chunks, OC) float = per-chunk column sums of dout (N,OC), one column per thread
extern "C" __global__ void bias_backward_v2(float* scratch, const floatX* dout, int N, int OC) {
    const int rows_per_chunk = (N + gridDim.y - 1) / gridDim.y;
    const int row_begin = min(N, (int)blockIdx.y * rows_per_chunk);
    const int row_end = min(N, row_begin + rows_per_chunk);
    for (int oc = blockIdx.x * blockDim.x + threadIdx.x; oc < OC; oc += gridDim.x * blockDim.x) {
        float sum = 0.0f;
        for (int row = row_begin; row < row_end; row++) {
            sum += (float)dout[(size_t)row * OC + oc];
        }
        scratch[(size_t)blockIdx.y * OC + oc] = sum;
    }
}

// dbias (OC,) += sum over chunks in order of scratch (num_chunks, OC): one running sum per column
extern "C" __global__ void bias_reduce_v2(floatX* dbias, const float* scratch, int num_chunks, int OC) {
    for (int oc = blockIdx.x * blockDim.x + threadIdx.x; oc < OC; oc += gridDim.x * blockDim.x) {
        float sum = 0.0f;
        for (int chunk = 0; chunk < num_chunks; chunk++) {
            sum += scratch[(size_t)chunk * OC + oc];
        }
        dbias[oc] = (floatX)((float)dbias[oc] + sum);
    }
}

// ----------------------------------------------------------------------------
// candidate 5: kernels/bias.cu's bias_backward with 4 of a lane's row loads in flight

#define BIAS_ROWS_IN_FLIGHT 4

// scratch (num_chunks, OC) float = per-chunk column sums of dout (N,OC), as kernels/bias.cu's
// bias_backward_columns computes them (lane: WIDTH columns; warp w: rows w, w + warps, ... of the
// chunk; the warps' sums in shared memory, warp 0 first), each lane's rows BIAS_ROWS_IN_FLIGHT at a
// time: all their loads issued, then their values added in row order
template <int WIDTH>
__device__ void bias_backward_columns_v5(float* scratch, const floatX* dout, int N, int OC) {
    extern __shared__ float warp_sums[];                   // (warps, 32 * WIDTH)
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int block_columns = WARP_SIZE * WIDTH;
    const int rows_per_chunk = (N + gridDim.y - 1) / gridDim.y;
    const int row_begin = min(N, (int)blockIdx.y * rows_per_chunk);
    const int row_end = min(N, row_begin + rows_per_chunk);
    for (int first_column = blockIdx.x * block_columns; first_column < OC; first_column += gridDim.x * block_columns) {
        const int column = first_column + lane * WIDTH;
        float sums[WIDTH];
        for (int k = 0; k < WIDTH; k++) {
            sums[k] = 0.0f;
        }
        if (column < OC) {
            for (int row = row_begin + warp; row < row_end; row += BIAS_ROWS_IN_FLIGHT * warps) {
                float values[BIAS_ROWS_IN_FLIGHT][WIDTH];
                #pragma unroll
                for (int u = 0; u < BIAS_ROWS_IN_FLIGHT; u++) {        // the loads first
                    const int r = row + u * warps;
                    if (r < row_end) {
                        load_group<WIDTH>(values[u], dout + (size_t)r * OC + column);
                    }
                }
                #pragma unroll
                for (int u = 0; u < BIAS_ROWS_IN_FLIGHT; u++) {        // then the adds, in row order
                    if (row + u * warps < row_end) {
                        #pragma unroll
                        for (int k = 0; k < WIDTH; k++) {
                            sums[k] += values[u][k];
                        }
                    }
                }
            }
        }
        for (int k = 0; k < WIDTH; k++) {
            warp_sums[warp * block_columns + lane * WIDTH + k] = sums[k];
        }
        __syncthreads();
        for (int c = threadIdx.x; c < block_columns && first_column + c < OC; c += blockDim.x) {
            float sum = 0.0f;
            for (int w = 0; w < warps; w++) {
                sum += warp_sums[w * block_columns + c];
            }
            scratch[(size_t)blockIdx.y * OC + first_column + c] = sum;
        }
        __syncthreads();
    }
}

extern "C" __global__ void bias_backward_v5(float* scratch, const floatX* dout, int N, int OC) {
    if (OC % x128::size == 0) {
        bias_backward_columns_v5<x128::size>(scratch, dout, N, OC);
    } else {
        bias_backward_columns_v5<1>(scratch, dout, N, OC);
    }
}
