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
The backward: deterministic in two steps (llm.c dev/cuda/matmul_backward_bias.cu version 9,
"write per-block partials to an auxiliary buffer, sum them in a second kernel", instead of the
atomics of versions 5-8):
- bias_backward: grid (X, num_chunks), X = ceil(OC / (32 * WIDTH)) (a smaller X loops). Block
  row blockIdx.y owns the contiguous row chunk [y*R, min(N,(y+1)*R)), R = ceil(N / num_chunks);
  block column blockIdx.x owns 32 * WIDTH columns, one group of WIDTH columns per lane (WIDTH =
  x128::size when OC is a multiple of it, else 1). Warp w of the block sums rows w, w + warps,
  w + 2 warps, ... of the chunk: each row read is one 16-byte load per lane, 512 contiguous bytes
  per warp (version 3 of dev/cuda/bias.py; version 2, one column per thread and 2-byte loads,
  took 1.38 ms for the 48 calls of GPT-2 124M's step at B=16 on an H100: 2.7 GB, 65% of the copy
  bandwidth). The warps' sums then meet in shared memory (warps x 32 * WIDTH floats, the
  launcher's dynamic shared memory) and are added warp 0 first, so the order is fixed, into
  scratch[blockIdx.y*OC + column] (written, not accumulated). The code is kernels/bias.cuh's
  template, here with one row load at a time (dev/cuda/bias.py's candidate 5: four).
- bias_reduce: one thread per column, dbias[oc] += the sum over its num_chunks partials, kept as
  BIAS_REDUCE_SUMS = 16 running sums (chunk c into sum c % 16) so that 16 loads are in flight at
  once, then added in a fixed pairwise tree: deterministic. Why: the partials were just written and
  sit in L2, and a single running sum waits for each load's round trip before the next add can
  use it; with OC threads (a few blocks) nothing else hides that latency. On an H200 the previous
  one-sum version (dev/cuda/bias.cu bias_reduce_v2) took 10.6 us a call, 0.51 ms for the 48 biases
  of GPT-2 124M's step at B=16, half as long as bias_backward itself.

Launcher: scratch holds gridDim.y * OC floats, and the same gridDim.y is bias_reduce's
num_chunks; bias_backward's shared memory is blockDim.x * WIDTH floats. Keep num_chunks and the
block size fixed (not timing-dependent) for bit-reproducible results. bias_backward: any OC,
blockDim.x a multiple of 32; bias_reduce: any block size, any gridDim.x.
*/
#include "common.cuh"
#include "bias.cuh"

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

// scratch (num_chunks, OC) float = per-chunk column sums of dout (N,OC): kernels/bias.cuh's
// bias_backward_columns with one row load at a time (dev/cuda/bias.py's candidate 5 times 4)
extern "C" __global__ void bias_backward(float* scratch, const floatX* dout, int N, int OC) {
    extern __shared__ float warp_sums[];                   // (warps, 32 * WIDTH): the launcher's size
    if (OC % x128::size == 0) {
        bias_backward_columns<x128::size, 1>(warp_sums, scratch, dout, N, OC);
    } else {
        bias_backward_columns<1, 1>(warp_sums, scratch, dout, N, OC);
    }
}

#define BIAS_REDUCE_SUMS 16    // running sums per thread: loads in flight at once (a power of 2)

// dbias (OC,) += the sum over chunks of scratch (num_chunks, OC): thread oc adds chunk c of its
// column into sums[c % BIAS_REDUCE_SUMS] (the unrolled inner loop's loads do not wait for each
// other), then folds the sums pairwise, sums[k] += sums[k + half], in a fixed order
extern "C" __global__ void bias_reduce(floatX* dbias, const float* scratch, int num_chunks, int OC) {
    for (int oc = blockIdx.x * blockDim.x + threadIdx.x; oc < OC; oc += gridDim.x * blockDim.x) {
        float sums[BIAS_REDUCE_SUMS];
        for (int k = 0; k < BIAS_REDUCE_SUMS; k++) {
            sums[k] = 0.0f;
        }
        for (int first = 0; first < num_chunks; first += BIAS_REDUCE_SUMS) {
            #pragma unroll
            for (int k = 0; k < BIAS_REDUCE_SUMS; k++) {
                if (first + k < num_chunks) {
                    sums[k] += scratch[(size_t)(first + k) * OC + oc];
                }
            }
        }
        #pragma unroll
        for (int half = BIAS_REDUCE_SUMS / 2; half > 0; half /= 2) {
            for (int k = 0; k < half; k++) {
                sums[k] += sums[k + half];
            }
        }
        dbias[oc] = (floatX)((float)dbias[oc] + sums[0]);
    }
}
