/*
dev/cuda/rmsnorm.cu: the intermediate RMSNorm kernels of dev/cuda/rmsnorm.py (the last version of
each progression is kernels/rmsnorm.cu's, launched from there by its real name).

- rmsnorm_forward_v1: a naive port of llama3_cpu.rmsnorm_forward, one thread per row, looping
  over the C channels twice (sum of squares, then normalize). A warp's 32 threads read 32 rows
  C elements apart: every load instruction touches 32 cache lines, and only N threads exist.
- rmsnorm_backward_v1: the naive port of llama3_cpu.rmsnorm_backward, one thread per row; each
  element's dweight term is added with a global fp32 atomic into one (C,) scratch slot (N
  contending atomics per channel, and an order that changes run to run), which
  kernels/rmsnorm.cu's rmsnorm_param_reduce then adds into dweight.

Both need N*C < 2^31 (int indexing of one layer). Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/rmsnorm.cu
*/
#include "common.cuh"

#define RMSNORM_EPS 1e-5f

// out (N,C) = inp * rstd * weight; rstd (N,): thread `row` does the whole row
extern "C" __global__ void rmsnorm_forward_v1(floatX* out, float* rstd, const floatX* inp, const floatX* weight,
                                              int N, int C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) {
        return;
    }
    const floatX* x = inp + (size_t)row * C;
    float sum_sq = 0.0f;
    for (int c = 0; c < C; c++) {
        sum_sq += (float)x[c] * (float)x[c];
    }
    const float row_rstd = rsqrtf(sum_sq / C + RMSNORM_EPS);
    for (int c = 0; c < C; c++) {
        out[(size_t)row * C + c] = (floatX)((float)x[c] * row_rstd * (float)weight[c]);
    }
    rstd[row] = row_rstd;
}

// dinp (N,C) += rstd * (dnorm - norm * mean(dnorm * norm)); scratch (C,) += dout * norm (atomics)
extern "C" __global__ void rmsnorm_backward_v1(floatX* dinp, float* scratch, const floatX* dout, const floatX* inp,
                                               const floatX* weight, const float* rstd, int N, int C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) {
        return;
    }
    const size_t offset = (size_t)row * C;
    const float row_rstd = rstd[row];
    float dnorm_norm_sum = 0.0f;
    for (int c = 0; c < C; c++) {
        const float norm = (float)inp[offset + c] * row_rstd;
        dnorm_norm_sum += (float)dout[offset + c] * (float)weight[c] * norm;
        atomicAdd(scratch + c, (float)dout[offset + c] * norm);            // dweight's term
    }
    const float dnorm_norm_mean = dnorm_norm_sum / C;
    for (int c = 0; c < C; c++) {
        const float norm = (float)inp[offset + c] * row_rstd;
        const float dnorm = (float)dout[offset + c] * (float)weight[c];
        dinp[offset + c] = (floatX)((float)dinp[offset + c] + row_rstd * (dnorm - norm * dnorm_norm_mean));
    }
}
