/*
dev/cuda/global_norm.cu: the intermediate global-norm kernels of dev/cuda/global_norm.py (the
last version is kernels/global_norm.cu's global_norm_squared + global_norm_finalize, launched
from there by their real names).

norm = sqrt(sum of data^2) over n floatX values (gpt2_cpu.gpt2_grad_norm).

- global_norm_v1: the naive port of gpt2_cpu's float64 np.dot: one thread per element, each
  atomically adds its square to one double (the launcher zeroes it). Exact enough (float64
  accumulation), but every one of the n atomics goes to the same address, and the L2 serializes
  them: the time grows with n, not with the bytes.
- global_norm_v2: a grid-stride loop gives each thread a float partial sum of many elements, a
  block reduction (shuffles, then shared memory: common.cuh blockReduceSum) combines a block's,
  and one float atomicAdd per block goes to the accumulator: gridDim.x atomics instead of n.
  The order of those atomics still varies run to run, so the last bits of the norm do too.
- global_norm_sqrt_v1 / _v2: out[0] = sqrt(accumulator), one thread (double / float), and out[1]
  the clipping factor that the trainer's AdamW reads (grad_clip / norm above grad_clip, else 1),
  as the production finalize computes it.

Compile check: python dev/cuda/nvrtc_compile.py dev/cuda/global_norm.cu
*/
#include "common.cuh"

// *sum_sq += data[i]^2 (double): thread i takes element i
extern "C" __global__ void global_norm_v1(double* sum_sq, const floatX* data, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const double x = (double)(float)data[i];
        atomicAdd(sum_sq, x * x);
    }
}

extern "C" __global__ void global_norm_sqrt_v1(float* out, const double* sum_sq, float grad_clip) {
    const float norm = (float)sqrt(sum_sq[0]);
    out[0] = norm;
    out[1] = (grad_clip > 0.0f && norm > grad_clip) ? grad_clip / norm : 1.0f;
}

// *sum_sq += this block's share of sum data^2 (float): grid-stride, block reduction, one atomic
// per block. Needs blockDim.x a multiple of 32 (blockReduceSum).
extern "C" __global__ void global_norm_v2(float* sum_sq, const floatX* data, size_t n) {
    float sum = 0.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float x = (float)data[i];
        sum += x * x;
    }
    sum = blockReduceSum(sum);
    if (threadIdx.x == 0) {
        atomicAdd(sum_sq, sum);
    }
}

extern "C" __global__ void global_norm_sqrt_v2(float* out, const float* sum_sq, float grad_clip) {
    const float norm = sqrtf(sum_sq[0]);
    out[0] = norm;
    out[1] = (grad_clip > 0.0f && norm > grad_clip) ? grad_clip / norm : 1.0f;
}
