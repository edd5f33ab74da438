/*
kernels/layernorm.cu: LayerNorm forward and backward, the fused residual + LayerNorm, and the
plain residual add.

LayerNorm over the C channels of each of the N = B*T rows (Ba, Kiros & Hinton 2016):
    mean = sum_c x_c / C,  var = sum_c (x_c - mean)^2 / C  (biased),  rstd = 1 / sqrt(var + eps)
    norm_c = (x_c - mean) * rstd,   out_c = norm_c * weight_c + bias_c,   eps = LN_EPS = 1e-5

Kernels (inp, out, dout, dinp (N,C) floatX; weight, bias (C,) floatX; mean, rstd (N,) float):
- layernorm_forward: one warp per row, llm.c dev/cuda/layernorm_forward.cu version 3 (warp per
  row, shuffle reductions, streaming hints), with the Packed128 loads of train_gpt2.cu's
  kernel. Two-pass variance (sum (x-mean)^2,
  not E[x^2] - mean^2 as in version 4) because the subtraction of two large squares loses bits
  when |mean| >> std. The row is re-read from L1/L2 for each pass, not from DRAM.
- fused_residual_forward: llm.c dev/cuda/fused_residual_forward.cu: residual = inp1 + inp2
  (rounded to floatX and stored), then layernorm_forward of that rounded residual, so the
  normalized output is exactly what an unfused residual_forward + layernorm_forward would give.
- layernorm_backward: dinp += (the residual stream's gradient accumulates) and per-block partial
  sums of dbias and dweight into scratch. llm.c's layernorm_backward.cu versions 2-10 sum the
  column partials with atomics (shared, then global); here each block writes its own slot and
  layernorm_param_reduce adds the slots in block order, so the result is deterministic for a
  fixed grid size (the matmul_backward_bias.cu version 9 idea, applied to LayerNorm).
- layernorm_param_reduce: one thread per channel, sums the per-block partials in order.
- residual_forward: out = inp1 + inp2, llm.c dev/cuda/residual_forward.cu version 2 (x128).

Backward math, per row (derivation in doc/layernorm.md and gpt2_cpu.layernorm_backward):
    dnorm_c = dout_c * weight_c
    dinp_c  = rstd * (dnorm_c - mean_c'(dnorm) - norm_c * mean_c'(dnorm * norm))
              term 1: direct path; term 2: through mean; term 3: through var (rstd)
    dbias_c   += sum over rows of dout_c
    dweight_c += sum over rows of dout_c * norm_c

Launcher must check: C % x128::size == 0 (8 in bf16, 4 in fp32), 16-byte aligned pointers,
blockDim.x a multiple of 32 (<= 1024) for the warp-per-row kernels. layernorm_backward's grid
size G is the number of scratch slots: scratch holds G*2*C floats, and the same G must be
passed to layernorm_param_reduce as num_blocks. Keep G fixed (not tuned per call) so results
are bit-reproducible. Any grid size is correct for the other kernels (grid-stride loops).
*/
#include "common.cuh"

#define LN_EPS 1e-5f

// ----------------------------------------------------------------------------
// forward

// Normalize one row with one warp. Lane `lane` owns the x128 groups c = lane*VS + k*32*VS,
// the same groups in every pass, so a lane only ever re-reads data it wrote itself
// (fused_residual_forward relies on that). Returns mean and rstd to every lane.
__device__ inline void layernorm_row(floatX* out_row, float* mean_out, float* rstd_out,
                                     const floatX* inp_row, const floatX* weight,
                                     const floatX* bias, int C, int lane) {
    const int lane_stride = WARP_SIZE * x128::size;
    // pass 1: mean
    float sum = 0.0f;
    for (int c = lane * x128::size; c < C; c += lane_stride) {
        const x128 x = load128(inp_row + c);
        for (int k = 0; k < x128::size; k++) {
            sum += (float)x[k];
        }
    }
    const float mean = warpReduceSum(sum) / C;
    // pass 2: biased variance around the mean
    float sum_sq = 0.0f;
    for (int c = lane * x128::size; c < C; c += lane_stride) {
        const x128 x = load128(inp_row + c);
        for (int k = 0; k < x128::size; k++) {
            const float centered = (float)x[k] - mean;
            sum_sq += centered * centered;
        }
    }
    const float rstd = rsqrtf(warpReduceSum(sum_sq) / C + LN_EPS);
    // pass 3: normalize, scale, shift; the output is not read again by this kernel
    for (int c = lane * x128::size; c < C; c += lane_stride) {
        const x128 x = load128cs(inp_row + c);
        const x128 w = load128(weight + c);
        const x128 b = load128(bias + c);
        x128 out_group;
        for (int k = 0; k < x128::size; k++) {
            const float norm = ((float)x[k] - mean) * rstd;
            out_group[k] = (floatX)(norm * (float)w[k] + (float)b[k]);
        }
        store128cs(out_row + c, out_group);
    }
    *mean_out = mean;
    *rstd_out = rstd;
}

// out (N,C) = layernorm(inp); mean, rstd (N,) float, or NULL to skip storing them (inference)
extern "C" __global__ void layernorm_forward(floatX* out, float* mean, float* rstd,
                                             const floatX* inp, const floatX* weight,
                                             const floatX* bias, int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int row_stride = gridDim.x * warps_per_block;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / WARP_SIZE; row < N;
         row += row_stride) {
        float row_mean, row_rstd;
        layernorm_row(out + (size_t)row * C, &row_mean, &row_rstd, inp + (size_t)row * C,
                      weight, bias, C, lane);
        if (lane == 0 && mean != nullptr) {
            mean[row] = row_mean;
        }
        if (lane == 0 && rstd != nullptr) {
            rstd[row] = row_rstd;
        }
    }
}

// residual (N,C) = inp1 + inp2 (rounded to floatX); normed (N,C) = layernorm(residual)
extern "C" __global__ void fused_residual_forward(floatX* residual, floatX* normed, float* mean,
                                                  float* rstd, const floatX* inp1,
                                                  const floatX* inp2, const floatX* weight,
                                                  const floatX* bias, int N, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int row_stride = gridDim.x * warps_per_block;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / WARP_SIZE; row < N;
         row += row_stride) {
        const size_t offset = (size_t)row * C;
        // same lane -> group mapping as layernorm_row, so each lane re-reads its own writes
        for (int c = lane * x128::size; c < C; c += WARP_SIZE * x128::size) {
            const x128 a = load128cs(inp1 + offset + c);
            const x128 b = load128cs(inp2 + offset + c);
            x128 sum_group;
            for (int k = 0; k < x128::size; k++) {
                sum_group[k] = (floatX)((float)a[k] + (float)b[k]);
            }
            store128(residual + offset + c, sum_group);
        }
        float row_mean, row_rstd;
        layernorm_row(normed + offset, &row_mean, &row_rstd, residual + offset, weight, bias,
                      C, lane);
        if (lane == 0 && mean != nullptr) {
            mean[row] = row_mean;
        }
        if (lane == 0 && rstd != nullptr) {
            rstd[row] = row_rstd;
        }
    }
}

// out (n,) = inp1 + inp2, any n: x128 groups, then a scalar tail
extern "C" __global__ void residual_forward(floatX* out, const floatX* inp1, const floatX* inp2,
                                            size_t n) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    for (size_t g = thread; g < num_groups; g += stride) {
        const x128 a = load128cs(inp1 + g * x128::size);
        const x128 b = load128cs(inp2 + g * x128::size);
        x128 out_group;
        for (int k = 0; k < x128::size; k++) {
            out_group[k] = (floatX)((float)a[k] + (float)b[k]);
        }
        store128(out + g * x128::size, out_group);
    }
    for (size_t i = num_groups * x128::size + thread; i < n; i += stride) {
        out[i] = (floatX)((float)inp1[i] + (float)inp2[i]);
    }
}

// ----------------------------------------------------------------------------
// backward

// dinp (N,C) += layernorm input gradient; scratch (gridDim.x, 2, C) float gets this block's
// partial sums: scratch[blockIdx.x*2*C + c] = sum dout[:,c] (dbias),
//           scratch[blockIdx.x*2*C + C + c] = sum dout[:,c] * norm[:,c] (dweight),
// over the block's rows. Block b owns the contiguous rows [b*R, min(N,(b+1)*R)), R = ceil(N/G).
extern "C" __global__ void layernorm_backward(floatX* dinp, float* scratch, const floatX* dout,
                                              const floatX* inp, const floatX* weight,
                                              const float* mean, const float* rstd,
                                              int N, int C) {
    const int rows_per_block = (N + gridDim.x - 1) / gridDim.x;
    const int row_begin = min(N, (int)blockIdx.x * rows_per_block);
    const int row_end = min(N, row_begin + rows_per_block);
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int lane_stride = WARP_SIZE * x128::size;

    // part 1, dinp: one warp per row, the two row means first, then the three-term gradient
    for (int row = row_begin + threadIdx.x / WARP_SIZE; row < row_end; row += warps_per_block) {
        const size_t offset = (size_t)row * C;
        const float row_mean = mean[row];
        const float row_rstd = rstd[row];
        float dnorm_sum = 0.0f;
        float dnorm_norm_sum = 0.0f;
        for (int c = lane * x128::size; c < C; c += lane_stride) {
            const x128 dout_group = load128(dout + offset + c);
            const x128 inp_group = load128(inp + offset + c);
            const x128 w = load128(weight + c);
            for (int k = 0; k < x128::size; k++) {
                const float norm = ((float)inp_group[k] - row_mean) * row_rstd;
                const float dnorm = (float)dout_group[k] * (float)w[k];
                dnorm_sum += dnorm;
                dnorm_norm_sum += dnorm * norm;
            }
        }
        const float dnorm_mean = warpReduceSum(dnorm_sum) / C;
        const float dnorm_norm_mean = warpReduceSum(dnorm_norm_sum) / C;
        for (int c = lane * x128::size; c < C; c += lane_stride) {
            const x128 dout_group = load128(dout + offset + c);
            const x128 inp_group = load128(inp + offset + c);
            const x128 w = load128(weight + c);
            x128 dinp_group = load128(dinp + offset + c);
            for (int k = 0; k < x128::size; k++) {
                const float norm = ((float)inp_group[k] - row_mean) * row_rstd;
                const float dnorm = (float)dout_group[k] * (float)w[k];
                const float dval = row_rstd * (dnorm - dnorm_mean - norm * dnorm_norm_mean);
                dinp_group[k] = (floatX)((float)dinp_group[k] + dval);
            }
            store128(dinp + offset + c, dinp_group);
        }
    }

    // part 2, dbias/dweight partials: one thread per channel, rows summed in order. It does not
    // need part 1's results (only dout, inp, mean, rstd), so no __syncthreads is needed; the
    // rows were just read by part 1 and are served from L1/L2. A thread per channel (not per
    // x128 group) keeps all threads busy when C / x128::size < blockDim.x.
    float* dbias_partial = scratch + (size_t)blockIdx.x * 2 * C;
    float* dweight_partial = dbias_partial + C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float dbias_sum = 0.0f;
        float dweight_sum = 0.0f;
        for (int row = row_begin; row < row_end; row++) {
            const size_t offset = (size_t)row * C;
            const float dout_value = (float)dout[offset + c];
            const float norm = ((float)inp[offset + c] - mean[row]) * rstd[row];
            dbias_sum += dout_value;
            dweight_sum += dout_value * norm;
        }
        dbias_partial[c] = dbias_sum;
        dweight_partial[c] = dweight_sum;
    }
}

// dweight, dbias (C,) += sum over b = 0..num_blocks-1 (in order) of the scratch partials
extern "C" __global__ void layernorm_param_reduce(floatX* dweight, floatX* dbias,
                                                  const float* scratch, int num_blocks, int C) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        float dbias_sum = 0.0f;
        float dweight_sum = 0.0f;
        for (int b = 0; b < num_blocks; b++) {
            dbias_sum += scratch[(size_t)b * 2 * C + c];
            dweight_sum += scratch[(size_t)b * 2 * C + C + c];
        }
        dbias[c] = (floatX)((float)dbias[c] + dbias_sum);
        dweight[c] = (floatX)((float)dweight[c] + dweight_sum);
    }
}
