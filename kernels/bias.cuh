/*
kernels/bias.cuh: the column sums of bias_backward (kernels/bias.cu) as a template over how many of
a lane's rows it loads before adding any, so that kernels/bias.cu's kernel and dev/cuda/bias.cu's
candidate 5 are the same code with another number (as kernels/flash_attention.cuh's tile shapes).
The layout and the launch contract: kernels/bias.cu.
*/
#pragma once
#include "common.cuh"

// scratch (num_chunks, OC) float = per-chunk column sums of dout (N,OC), num_chunks = gridDim.y.
// Lane: WIDTH adjacent columns; warp w: rows w, w + warps, w + 2 warps, ... of the block's chunk,
// ROWS_IN_FLIGHT of them at a time, their loads all issued before their values are added, in row
// order (so any ROWS_IN_FLIGHT gives the same sums, bit for bit); then thread c of the block adds
// column c over the warps, warp 0 first, from shared memory: warp_sums (warps, 32 * WIDTH) floats,
// the calling kernel's dynamic shared memory (its `extern __shared__` array, declared in the .cu
// file, as kernels/flash_attention.cuh's tiles are).
template <int WIDTH, int ROWS_IN_FLIGHT>
__device__ void bias_backward_columns(float* warp_sums, float* scratch, const floatX* dout, int N, int OC) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int block_columns = WARP_SIZE * WIDTH;
    const int rows_per_chunk = (N + gridDim.y - 1) / gridDim.y;
    const int row_begin = min(N, (int)blockIdx.y * rows_per_chunk);
    const int row_end = min(N, row_begin + rows_per_chunk);
    // grid-stride over the blocks of columns (the same for every thread of the block, so the
    // barriers below are reached by all of them)
    for (int first_column = blockIdx.x * block_columns; first_column < OC; first_column += gridDim.x * block_columns) {
        const int column = first_column + lane * WIDTH;    // this lane's group
        float sums[WIDTH];
        for (int k = 0; k < WIDTH; k++) {
            sums[k] = 0.0f;
        }
        if (column < OC) {                                 // a group never crosses OC: OC % WIDTH == 0
            for (int row = row_begin + warp; row < row_end; row += ROWS_IN_FLIGHT * warps) {
                float values[ROWS_IN_FLIGHT][WIDTH];
                #pragma unroll
                for (int u = 0; u < ROWS_IN_FLIGHT; u++) {            // the loads first
                    if (row + u * warps < row_end) {
                        load_group<WIDTH>(values[u], dout + (size_t)(row + u * warps) * OC + column);
                    }
                }
                #pragma unroll
                for (int u = 0; u < ROWS_IN_FLIGHT; u++) {            // then the adds, in row order
                    if (row + u * warps < row_end) {
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
            for (int w = 0; w < warps; w++) {                  // warp 0 first: a fixed order
                sum += warp_sums[w * block_columns + c];
            }
            scratch[(size_t)blockIdx.y * OC + first_column + c] = sum;
        }
        __syncthreads();                                   // warp_sums is written again next pass
    }
}
