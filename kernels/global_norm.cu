/*
kernels/global_norm.cu: the global L2 norm of all gradients, sqrt(sum of squares), used for
gradient clipping (gpt2_cpu.gpt2_grad_norm), in two deterministic steps.

Progression: `python dev/cuda/global_norm.py` shows the way here; this file is its version 3 of
global_norm, each version validated against gpt2_cpu.py, then timed against the GPU's measured
limits.

Kernels:
- global_norm_squared: grid-stride sum of squares (x128 groups, then a scalar tail), reduced
  over the block in one barrier (common.cuh blockSumToThread0: every thread's sum into shared
  memory, warp 0 adds them), written (=) to partial[num_slots_offset + blockIdx.x]. llm.c
  dev/cuda/global_norm.cu's grid-stride + block reduction, but writing one slot per block
  instead of an atomicAdd, so the sum order is fixed (as train_gpt2.cu does). The launcher
  either makes one call over the flat gradient buffer, or one call per tensor with disjoint
  slot ranges (num_slots_offset += gridDim.x after each); with a fixed grid size the slot
  layout, and therefore the result, is the same every step.
- global_norm_finalize: one block sums the num_partials slots (each thread a fixed strided
  subset, in order, then blockSumToThread0) and writes out[0] = sqrt(total) and out[1] = the
  gradient clipping factor (grad_clip / norm above grad_clip, else 1), so AdamW reads it on the
  device and the step needs no host round trip. Blocks other than block 0 exit at once.

Launcher must check: blockDim.x a multiple of 32 (<= 1024) for both; partial holds at least
num_slots_offset + gridDim.x floats; 16-byte aligned data. Any n.
*/
#include "common.cuh"

// partial[num_slots_offset + blockIdx.x] = sum over this block's share of data (n,) of x^2
extern "C" __global__ void global_norm_squared(float* partial, const floatX* data, size_t n,
                                               int num_slots_offset) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    float sum = 0.0f;
    for (size_t g = thread; g < num_groups; g += stride) {
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
    sum = blockSumToThread0(sum);
    if (threadIdx.x == 0) {
        partial[num_slots_offset + blockIdx.x] = sum;
    }
}

// out[0] = sqrt(sum of partial[0 .. num_partials)); out[1] = the clipping factor: grad_clip / out[0]
// where 0 < grad_clip < out[0], else 1 (grad_clip 0: no clipping), which adamw_update reads
extern "C" __global__ void global_norm_finalize(float* out, const float* partial, int num_partials,
                                                float grad_clip) {
    if (blockIdx.x != 0) {
        return;                                 // whole blocks leave: no __syncthreads is split
    }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < num_partials; i += blockDim.x) {
        sum += partial[i];
    }
    sum = blockSumToThread0(sum);
    if (threadIdx.x == 0) {
        const float norm = sqrtf(sum);
        out[0] = norm;
        out[1] = (grad_clip > 0.0f && norm > grad_clip) ? grad_clip / norm : 1.0f;
    }
}
