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

- global_norm_squared_v4 (a candidate after the production version 3): version 3's sum of squares
  with GLOBAL_NORM_UNROLL 16-byte loads in flight per thread; then the production finalize.

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

// ----------------------------------------------------------------------------
// candidate version 4: more bytes in flight per thread

#define GLOBAL_NORM_UNROLL 4                // x128 loads each thread issues before it sums any of them

// partial[blockIdx.x] = sum over this block's share of data (n,) of x^2, as the production
// global_norm_squared (x128 groups, grid-stride, one slot per block), but each thread loads
// GLOBAL_NORM_UNROLL groups, a grid stride apart, before it adds any: a block of 512 threads has
// 4 x 8 KiB of loads outstanding instead of 8 KiB, which a read-only kernel needs to keep HBM busy
// (production reads at 68% of the copy bandwidth on the H100). The order of the sums is fixed by
// the grid and block size: deterministic, though not the production order.
extern "C" __global__ void global_norm_squared_v4(float* partial, const floatX* data, size_t n) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    float sum = 0.0f;
    size_t g = thread;
    for (; g + (GLOBAL_NORM_UNROLL - 1) * stride < num_groups; g += GLOBAL_NORM_UNROLL * stride) {
        x128 groups[GLOBAL_NORM_UNROLL];
        for (int u = 0; u < GLOBAL_NORM_UNROLL; u++) {
            groups[u] = load128cs(data + (g + u * stride) * x128::size);
        }
        for (int u = 0; u < GLOBAL_NORM_UNROLL; u++) {
            for (int k = 0; k < x128::size; k++) {
                const float x = (float)groups[u][k];
                sum += x * x;
            }
        }
    }
    for (; g < num_groups; g += stride) {               // the groups left after the last full unroll
        const x128 group = load128cs(data + g * x128::size);
        for (int k = 0; k < x128::size; k++) {
            const float x = (float)group[k];
            sum += x * x;
        }
    }
    for (size_t i = num_groups * x128::size + thread; i < n; i += stride) {
        const float x = (float)data[i];
        sum += x * x;
    }
    sum = blockReduceSum(sum);
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = sum;
    }
}
