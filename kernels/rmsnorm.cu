/*
kernels/rmsnorm.cu: RMSNorm forward and backward (Llama 3's normalization).

Progression: `python dev/cuda/rmsnorm.py` shows the way here; this file is its version 2 of
rmsnorm_forward and of rmsnorm_backward, each version validated against llama3_cpu.py, then timed
against the GPU's measured limits.

RMSNorm over the C channels of each of the N = B*T rows (Zhang & Sennrich 2019, eq. 4): LayerNorm
without the mean and without the bias,
    rstd = 1 / sqrt(sum_c x_c^2 / C + eps),   norm_c = x_c * rstd,   out_c = norm_c * weight_c
with eps = RMSNORM_EPS = 1e-5 (Llama 3's norm_eps, llama3_cpu.NORM_EPS).

Kernels (inp, out, dout, dinp (N,C) floatX; weight, dweight (C,) floatX; rstd (N,) float):
- rmsnorm_forward: one warp per row, as kernels/layernorm.cu's layernorm_forward: lane `lane`
  owns the x128 groups at c = lane*x128::size + k*WARP_SIZE*x128::size; pass 1 sums the squares
  (shuffle reduction), pass 2 normalizes and scales. One pass fewer than LayerNorm: no mean. The
  second read of the row comes from L1/L2, not DRAM; it is the last, hence the streaming hint.
- rmsnorm_backward: dinp += (the residual stream's gradient accumulates) with one warp per row,
  and per-block partial sums of dweight into scratch (gridDim.x, C): block b owns the contiguous
  rows [b*R, min(N,(b+1)*R)), R = ceil(N/G), and writes its own slot, no atomics (layernorm.cu's
  plan, so the result is deterministic for a fixed grid size G).
- rmsnorm_param_reduce: one thread per channel, dweight += the G slots summed in block order.

Backward math, per row (derivation in llama3_cpu.rmsnorm_backward):
    dnorm_c   = dout_c * weight_c
    dinp_c   += rstd * (dnorm_c - norm_c * mean_c'(dnorm * norm))
                term 1: the direct path; term 2: through rstd (LayerNorm's term through the mean
                does not exist here)
    dweight_c += sum over rows of dout_c * norm_c

Launcher must check: C % x128::size == 0 (8 in bf16, 4 in fp32), 16-byte aligned pointers,
blockDim.x a multiple of 32 (<= 1024). rmsnorm_backward's grid size G is the number of scratch
slots: scratch holds G*C floats, and the same G is rmsnorm_param_reduce's num_blocks. Any grid
size is correct for rmsnorm_forward and rmsnorm_param_reduce (grid-stride loops).
*/
#include "common.cuh"

#define RMSNORM_EPS 1e-5f

// ----------------------------------------------------------------------------
// forward

// out (N,C) = inp * rstd * weight per row; rstd (N,) float is stored for the backward
extern "C" __global__ void rmsnorm_forward(floatX* out, float* rstd, const floatX* inp, const floatX* weight,
                                           int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int lane_stride = WARP_SIZE * x128::size;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / WARP_SIZE; row < N;
         row += gridDim.x * warps_per_block) {
        const floatX* inp_row = inp + (size_t)row * C;
        floatX* out_row = out + (size_t)row * C;
        // pass 1: the mean square of the row
        float sum_sq = 0.0f;
        for (int c = lane * x128::size; c < C; c += lane_stride) {
            const x128 x = load128(inp_row + c);
            for (int k = 0; k < x128::size; k++) {
                sum_sq += (float)x[k] * (float)x[k];
            }
        }
        const float row_rstd = rsqrtf(warpReduceSum(sum_sq) / C + RMSNORM_EPS);   // every lane gets it
        // pass 2: normalize and scale, the last read of the row and the only write of the output
        for (int c = lane * x128::size; c < C; c += lane_stride) {
            const x128 x = load128cs(inp_row + c);
            const x128 w = load128(weight + c);
            x128 out_group;
            for (int k = 0; k < x128::size; k++) {
                out_group[k] = (floatX)((float)x[k] * row_rstd * (float)w[k]);
            }
            store128cs(out_row + c, out_group);
        }
        if (lane == 0) {
            rstd[row] = row_rstd;
        }
    }
}

// ----------------------------------------------------------------------------
// backward

// dinp (N,C) += RMSNorm's input gradient; scratch (gridDim.x, C) float gets this block's partial
// sums of dweight: scratch[blockIdx.x*C + c] = sum over the block's rows of dout[:,c] * norm[:,c]
extern "C" __global__ void rmsnorm_backward(floatX* dinp, float* scratch, const floatX* dout, const floatX* inp,
                                            const floatX* weight, const float* rstd, int N, int C) {
    const int rows_per_block = (N + gridDim.x - 1) / gridDim.x;
    const int row_begin = min(N, (int)blockIdx.x * rows_per_block);
    const int row_end = min(N, row_begin + rows_per_block);
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int lane_stride = WARP_SIZE * x128::size;

    // part 1, dinp: one warp per row, the row mean of dnorm * norm first, then the two-term gradient
    for (int row = row_begin + threadIdx.x / WARP_SIZE; row < row_end; row += warps_per_block) {
        const size_t offset = (size_t)row * C;
        const float row_rstd = rstd[row];
        float dnorm_norm_sum = 0.0f;
        for (int c = lane * x128::size; c < C; c += lane_stride) {
            const x128 dout_group = load128(dout + offset + c);
            const x128 inp_group = load128(inp + offset + c);
            const x128 w = load128(weight + c);
            for (int k = 0; k < x128::size; k++) {
                dnorm_norm_sum += (float)dout_group[k] * (float)w[k] * ((float)inp_group[k] * row_rstd);
            }
        }
        const float dnorm_norm_mean = warpReduceSum(dnorm_norm_sum) / C;
        for (int c = lane * x128::size; c < C; c += lane_stride) {
            const x128 dout_group = load128(dout + offset + c);
            const x128 inp_group = load128(inp + offset + c);
            const x128 w = load128(weight + c);
            x128 dinp_group = load128(dinp + offset + c);
            for (int k = 0; k < x128::size; k++) {
                const float norm = (float)inp_group[k] * row_rstd;
                const float dnorm = (float)dout_group[k] * (float)w[k];
                const float dval = row_rstd * (dnorm - norm * dnorm_norm_mean);
                dinp_group[k] = (floatX)((float)dinp_group[k] + dval);
            }
            store128(dinp + offset + c, dinp_group);
        }
    }

    // part 2, dweight partials: one thread per channel, the block's rows summed in order. It needs
    // none of part 1's results, so no __syncthreads; the rows part 1 just read come from L1/L2.
    float* dweight_partial = scratch + (size_t)blockIdx.x * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float dweight_sum = 0.0f;
        for (int row = row_begin; row < row_end; row++) {
            const size_t offset = (size_t)row * C;
            dweight_sum += (float)dout[offset + c] * ((float)inp[offset + c] * rstd[row]);
        }
        dweight_partial[c] = dweight_sum;
    }
}

// dweight (C,) += sum over b = 0..num_blocks-1 (in order) of the scratch partials (num_blocks, C)
extern "C" __global__ void rmsnorm_param_reduce(floatX* dweight, const float* scratch, int num_blocks, int C) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        float dweight_sum = 0.0f;
        for (int b = 0; b < num_blocks; b++) {
            dweight_sum += scratch[(size_t)b * C + c];
        }
        dweight[c] = (floatX)((float)dweight[c] + dweight_sum);
    }
}
