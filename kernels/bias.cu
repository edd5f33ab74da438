/*
kernels/bias.cu: the bias of a matmul: added in the forward, its gradient in the backward (a
column sum over all N = B*T rows).

    out = inp @ weight^T + bias   =>   dbias[oc] += sum_{row} dout[row, oc]

The products are cuBLAS matmuls on the Python side; only the bias is hand-written.
- add_bias: out (N,OC) += bias (OC,) in place, after the GEMM (beta = 0) wrote inp @ weight^T.
  It replaces the broadcast copy of the bias into out followed by a beta = 1 GEMM: one launch of
  ours with 16-byte accesses instead of CuPy's copy kernel, and a GEMM that reads no C. The bias
  stays in L1/L2 (OC values). Grid-stride over the N*OC/WIDTH groups, WIDTH = x128::size when
  OC is a multiple of it (out then 16-byte aligned, checked by the launcher), else 1.
The backward: Deterministic in two steps (llm.c dev/cuda/matmul_backward_bias.cu version 9,
"write per-block partials to an auxiliary buffer, sum them in a second kernel", instead of the
atomics of versions 5-8):
- bias_backward: grid (X, num_chunks). Block row blockIdx.y owns the contiguous row chunk
  [y*R, min(N,(y+1)*R)), R = ceil(N / num_chunks); each thread owns one column oc (grid-stride
  over X*blockDim.x columns) and sums its chunk's rows in order into
  scratch[blockIdx.y*OC + oc] (written, not accumulated). As in version 5, consecutive threads
  read consecutive columns, so each warp reads 32 contiguous elements of a row: coalesced.
- bias_reduce: one thread per column, dbias[oc] += sum over chunks 0..num_chunks-1 in order.

Launcher: scratch holds gridDim.y * OC floats, and the same gridDim.y is bias_reduce's
num_chunks. Keep num_chunks fixed (not timing-dependent) for bit-reproducible results. Any OC
(no vector loads), any block size, any gridDim.x.
*/
#include "common.cuh"

template <int WIDTH>
__device__ void add_bias_groups(floatX* out, const floatX* bias, int N, int OC) {
    const size_t num_groups = (size_t)N * OC / WIDTH;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t i = g * WIDTH;                     // flat index of the group's first element
        const int oc = (int)(i % OC);                   // a group never crosses a row: OC % WIDTH == 0
        float values[WIDTH], biases[WIDTH];
        load_group<WIDTH>(values, out + i);
        load_group<WIDTH>(biases, bias + oc);
        for (int k = 0; k < WIDTH; k++) {
            values[k] += biases[k];
        }
        store_group<WIDTH>(out + i, values);
    }
}

// out (N,OC) += bias (OC,), broadcast over the rows
extern "C" __global__ void add_bias(floatX* out, const floatX* bias, int N, int OC) {
    if (OC % x128::size == 0) {
        add_bias_groups<x128::size>(out, bias, N, OC);
    } else {
        add_bias_groups<1>(out, bias, N, OC);
    }
}

// scratch (num_chunks, OC) float = per-chunk column sums of dout (N,OC)
extern "C" __global__ void bias_backward(float* scratch, const floatX* dout, int N, int OC) {
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

// dbias (OC,) += sum over chunks in order of scratch (num_chunks, OC)
extern "C" __global__ void bias_reduce(floatX* dbias, const float* scratch, int num_chunks, int OC) {
    for (int oc = blockIdx.x * blockDim.x + threadIdx.x; oc < OC; oc += gridDim.x * blockDim.x) {
        float sum = 0.0f;
        for (int chunk = 0; chunk < num_chunks; chunk++) {
            sum += scratch[(size_t)chunk * OC + oc];
        }
        dbias[oc] = (floatX)((float)dbias[oc] + sum);
    }
}
