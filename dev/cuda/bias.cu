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
  (the same grid, block, shared memory and scratch; the same template, kernels/bias.cuh), each
  lane loading BIAS_ROWS_IN_FLIGHT = 4 of its warp's rows before adding any: the production kernel
  adds each row's 16 bytes as they arrive, about one load in flight per lane. The adds are the
  production kernel's, in its order: the same bits.

Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/bias.cu
*/
#include "common.cuh"
#include "bias.cuh"

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
// candidate 5: kernels/bias.cuh's bias_backward_columns with 4 of a lane's row loads in flight

#define BIAS_ROWS_IN_FLIGHT 4

extern "C" __global__ void bias_backward_v5(float* scratch, const floatX* dout, int N, int OC) {
    extern __shared__ float warp_sums[];                   // (warps, 32 * WIDTH): the launcher's size
    if (OC % x128::size == 0) {
        bias_backward_columns<x128::size, BIAS_ROWS_IN_FLIGHT>(warp_sums, scratch, dout, N, OC);
    } else {
        bias_backward_columns<1, BIAS_ROWS_IN_FLIGHT>(warp_sums, scratch, dout, N, OC);
    }
}
