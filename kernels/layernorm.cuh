/*
kernels/layernorm.cuh: the parts of LayerNorm's backward that kernels/layernorm.cu's kernels and the
candidate versions of dev/cuda/layernorm.cu share, so that a candidate changes only what it is
about and the rest is the very code the trainer runs: layernorm_backward's input gradient, the
width of its scratch slots, and the end of layernorm_param_reduce. The math and the launch contract: kernels/layernorm.cu.
*/
#pragma once
#include "common.cuh"

// dinp (N,C) += the LayerNorm input gradient of the rows [row_begin, row_end) (the calling block's):
//     dnorm = dout * weight,  dinp += rstd * (dnorm - mean_c(dnorm) - norm * mean_c(dnorm * norm))
// one warp per row (warp w of the block takes rows row_begin + w, + warps, ...), the two row means
// first, then the three-term gradient. Lane l owns the x128 groups c = l*x128::size + k*32*x128::size
// of its row in both passes, so the second pass finds the row in L1.
__device__ inline void layernorm_backward_dinp_rows(floatX* dinp, const floatX* dout, const floatX* inp,
                                                    const floatX* weight, const float* mean,
                                                    const float* rstd, int row_begin, int row_end,
                                                    int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int lane_stride = WARP_SIZE * x128::size;
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
        warpReduceSum2(dnorm_sum, dnorm_norm_sum);            // both sums, one shuffle per step
        const float dnorm_mean = dnorm_sum / C;
        const float dnorm_norm_mean = dnorm_norm_sum / C;
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
}

// The floats of one slot of layernorm_backward's scratch: [dbias | dweight] partial sums, and
// [... | dprojb] where the reduce is given the projection's bias gradient dprojb (not NULL).
__device__ inline int layernorm_slot_width(const floatX* dprojb, int C) {
    return (dprojb != nullptr ? 3 : 2) * C;
}

// The end of one column group of layernorm_param_reduce: lane l of warp w has stored its sum of
// column col over its share of the slots in warp_sums[w][l]. After a barrier, warp 0 adds the W
// warp sums in warp order (fixed: deterministic) into dbias (col < C), dweight (C <= col < 2C) or,
// where the slots have a third sum, dprojb (2C <= col < 3C; dprojb NULL: two sums); a second
// barrier keeps the next group's stores after those reads. Every thread of the block calls it.
__device__ inline void layernorm_param_reduce_store(float (&warp_sums)[WARP_SIZE][WARP_SIZE + 1], floatX* dweight,
                                                    floatX* dbias, floatX* dprojb, int col, int C) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    __syncthreads();
    if (warp == 0 && col < layernorm_slot_width(dprojb, C)) {
        float total = 0.0f;
        for (int w = 0; w < num_warps; w++) {
            total += warp_sums[w][lane];
        }
        floatX* grad = col < C ? dbias + col : col < 2 * C ? dweight + col - C : dprojb + col - 2 * C;
        *grad = (floatX)((float)*grad + total);
    }
    __syncthreads();                                        // warp 0 has read warp_sums before the next group
}
