/*
kernels/layernorm.cu: LayerNorm forward and backward, the fused residual + LayerNorm, and the
plain residual add.

Progression: `python dev/cuda/layernorm.py` shows the way here; this file is its version 3 of
layernorm_forward and fused_residual_forward and its version 4 of layernorm_backward, each version
validated against gpt2_cpu.py, then timed against the GPU's measured limits.

LayerNorm over the C channels of each of the N = B*T rows (Ba, Kiros & Hinton 2016):
    mean = sum_c x_c / C,  var = sum_c (x_c - mean)^2 / C  (biased),  rstd = 1 / sqrt(var + eps)
    norm_c = (x_c - mean) * rstd,   out_c = norm_c * weight_c + bias_c,   eps = LN_EPS = 1e-5

Kernels (inp, out, dout, dinp (N,C) floatX; weight, bias (C,) floatX; mean, rstd (N,) float):
- layernorm_forward: one warp per row, llm.c dev/cuda/layernorm_forward.cu version 3 (warp per
  row, shuffle reductions, streaming hints), with the Packed128 loads of train_gpt2.cu's
  kernel. The per-row work is the __device__ helper layernorm_row. Two-pass variance
  (sum (x-mean)^2, not E[x^2] - mean^2 as in version 4) because the subtraction of two large
  squares loses bits when |mean| >> std. The row is re-read from L1/L2 for each pass, not from
  DRAM.
- fused_residual_forward: llm.c dev/cuda/fused_residual_forward.cu: one warp per row stores
  residual = inp1 + inp2 (rounded to floatX; plus inp2's projection bias when given, so the
  attention and MLP projections need no bias pass), then calls the same layernorm_row on that rounded
  residual, so the normalized output is bit for bit what an unfused residual_forward +
  layernorm_forward would give. Each lane re-reads only the residual groups it wrote itself.
- layernorm_backward: dinp += (the residual's gradient accumulates; in layernorm.cuh), per-block
  partial sums of dbias, dweight (and of dinp: a projection's dbias) into scratch. llm.c's v2-10 sum
  the column partials with atomics (shared, then global); here each block writes its own slot and
  layernorm_param_reduce adds the slots in block order, so the result is deterministic for a
  fixed grid size (the matmul_backward_bias.cu version 9 idea, applied to LayerNorm).
- layernorm_param_reduce: sums the per-block partials in a fixed order, each block's warps
  sharing the slots of 32 adjacent columns (version 4 of layernorm_backward; version 3 gave each
  channel one thread, too few threads to hide the latency of the slots' loads).
- residual_forward: out = inp1 + inp2, llm.c dev/cuda/residual_forward.cu version 2 (x128).

Backward math, per row (derivation in doc/layernorm.md and gpt2_cpu.layernorm_backward):
    dnorm_c = dout_c * weight_c
    dinp_c  = rstd * (dnorm_c - mean_c'(dnorm) - norm_c * mean_c'(dnorm * norm))
              term 1: direct path; term 2: through mean; term 3: through var (rstd)
    dbias_c   += sum over rows of dout_c
    dweight_c += sum over rows of dout_c * norm_c

Launcher must check: C % x128::size == 0 (8 in bf16, 4 in fp32), 16-byte aligned pointers,
blockDim.x a multiple of 32 (<= 1024) for the warp-per-row kernels and layernorm_param_reduce.
layernorm_backward's grid size G is the number of scratch slots: scratch holds G*(2+sum_dinp)*C
floats; pass the same G to layernorm_param_reduce as num_blocks, and dprojb with sum_dinp. Keep G, and
layernorm_param_reduce's block size, fixed (not tuned per call) so results are bit-reproducible.
Any grid size is correct for the other kernels (grid-stride loops).
*/
#include "common.cuh"

#define LN_EPS 1e-5f

// ----------------------------------------------------------------------------
// forward

// layernorm_forward for row `row` only, computed by the one warp that calls it: out[row,:],
// mean[row], rstd[row] from inp[row,:] (mean, rstd may be NULL: not stored). Both forward
// kernels run exactly this code per row, so their outputs agree bit for bit.
// lane = threadIdx.x % WARP_SIZE (the caller has it already) owns the x128 groups that start at
// c = lane*x128::size + k*WARP_SIZE*x128::size, the same groups in every pass: a lane only ever
// re-reads data it has read itself, or written itself (fused_residual_forward's residual), so no
// __syncwarp is needed, and passes 2 and 3 find the row in L1/L2 rather than DRAM.
__device__ inline void layernorm_row(floatX* out, float* mean, float* rstd, const floatX* inp,
                                     const floatX* weight, const floatX* bias, int row, int C,
                                     int lane) {
    const int lane_stride = WARP_SIZE * x128::size;
    const floatX* inp_row = inp + (size_t)row * C;
    floatX* out_row = out + (size_t)row * C;
    // pass 1: mean
    float sum = 0.0f;
    for (int c = lane * x128::size; c < C; c += lane_stride) {
        const x128 x = load128(inp_row + c);
        for (int k = 0; k < x128::size; k++) {
            sum += (float)x[k];
        }
    }
    const float row_mean = warpReduceSum(sum) / C;     // every lane gets the same value
    // pass 2: biased variance around the mean
    float sum_sq = 0.0f;
    for (int c = lane * x128::size; c < C; c += lane_stride) {
        const x128 x = load128(inp_row + c);
        for (int k = 0; k < x128::size; k++) {
            const float centered = (float)x[k] - row_mean;
            sum_sq += centered * centered;
        }
    }
    const float row_rstd = rsqrtf(warpReduceSum(sum_sq) / C + LN_EPS);
    // pass 3: normalize, scale, shift; the last read of the row and the only write of the output,
    // hence the streaming hints
    for (int c = lane * x128::size; c < C; c += lane_stride) {
        const x128 x = load128cs(inp_row + c);
        const x128 w = load128(weight + c);
        const x128 b = load128(bias + c);
        x128 out_group;
        for (int k = 0; k < x128::size; k++) {
            const float norm = ((float)x[k] - row_mean) * row_rstd;
            out_group[k] = (floatX)(norm * (float)w[k] + (float)b[k]);
        }
        store128cs(out_row + c, out_group);
    }
    // the backward reads these instead of recomputing them; one lane stores for the warp
    if (lane == 0 && mean != nullptr) {
        mean[row] = row_mean;
    }
    if (lane == 0 && rstd != nullptr) {
        rstd[row] = row_rstd;
    }
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
        layernorm_row(out, mean, rstd, inp, weight, bias, row, C, lane);
    }
}

// residual (N,C) = inp1 + (inp2 + inp2_bias), rounded to floatX once; normed (N,C) =
// layernorm(residual). inp2_bias (C,) is the bias of the projection that wrote inp2 (its GEMM
// ran without it), or NULL: added here, it costs no pass over (N,C) of its own.
extern "C" __global__ void fused_residual_forward(floatX* residual, floatX* normed, float* mean,
                                                  float* rstd, const floatX* inp1,
                                                  const floatX* inp2, const floatX* inp2_bias,
                                                  const floatX* weight, const floatX* bias, int N,
                                                  int C) {
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
            float shift[x128::size];
            if (inp2_bias != nullptr) {                   // the same branch for the whole grid
                const x128 projection_bias = load128(inp2_bias + c);
                for (int k = 0; k < x128::size; k++) {
                    shift[k] = (float)projection_bias[k];
                }
            } else {
                for (int k = 0; k < x128::size; k++) {
                    shift[k] = 0.0f;
                }
            }
            x128 sum_group;
            for (int k = 0; k < x128::size; k++) {
                sum_group[k] = (floatX)((float)a[k] + ((float)b[k] + shift[k]));
            }
            store128(residual + offset + c, sum_group);
        }
        // normalize the rounded residual just stored, not the float sum: the same result as
        // residual_forward followed by layernorm_forward
        layernorm_row(normed, mean, rstd, residual, weight, bias, row, C, lane);
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

#include "layernorm.cuh"   // layernorm_backward_dinp_rows, the input gradient (shared with dev/cuda's candidates)

// dinp (N,C) += layernorm input gradient; scratch (gridDim.x, S, C) float gets this block's
// partial sums, S = 2 + sum_dinp: scratch[blockIdx.x*S*C + c] = sum dout[:,c] (dbias),
//           scratch[blockIdx.x*S*C + C + c] = sum dout[:,c] * norm[:,c] (dweight),
// and with sum_dinp = 1 scratch[blockIdx.x*S*C + 2C + c] = sum dinp[:,c] after the add (dprojb),
// over the block's rows. Block b owns the contiguous rows [b*R, min(N,(b+1)*R)), R = ceil(N/G).
// Why dinp's column sums: dinp is the residual stream's gradient, and this kernel completes it
// (the residual's other paths added theirs before). The stream there is x + proj(y) + proj_bias,
// the output of a projection (the attention's before ln2, the MLP's before the next ln1 or lnf),
// so dproj_bias = sum over rows of dinp: the projection's bias gradient, summed here from rows
// the block has just written, instead of by another pass over them (a bias_backward, or the
// BGRADB epilogue of the projection's dweight GEMM, which made those 24 GEMMs 0.7 ms slower in
// the 124M step on an H200: gpt2_cuda.py --ln-bias-grad).
extern "C" __global__ void layernorm_backward(floatX* dinp, float* scratch, const floatX* dout,
                                              const floatX* inp, const floatX* weight,
                                              const float* mean, const float* rstd,
                                              int N, int C, int sum_dinp) {
    const int rows_per_block = (N + gridDim.x - 1) / gridDim.x;
    const int row_begin = min(N, (int)blockIdx.x * rows_per_block);
    const int row_end = min(N, row_begin + rows_per_block);

    // part 1, dinp: one warp per row (kernels/layernorm.cuh, shared with dev/cuda's candidates)
    layernorm_backward_dinp_rows(dinp, dout, inp, weight, mean, rstd, row_begin, row_end, C);

    // part 2, the partials: one thread per channel, rows summed in order. dbias and dweight do
    // not need part 1's results (only dout, inp, mean, rstd); the rows were just read by part 1
    // and are served from L1/L2. dinp's sums do: other warps of the block wrote those rows, and
    // the barrier (the same branch for the whole block) makes their stores visible. A thread per
    // channel (not per x128 group) keeps all threads busy when C / x128::size < blockDim.x.
    if (sum_dinp) {
        __syncthreads();
    }
    const int slot_width = (2 + sum_dinp) * C;
    float* dbias_partial = scratch + (size_t)blockIdx.x * slot_width;
    float* dweight_partial = dbias_partial + C;
    float* dinp_partial = dbias_partial + 2 * C;          // sum_dinp only
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float dbias_sum = 0.0f;
        float dweight_sum = 0.0f;
        float dinp_sum = 0.0f;
        for (int row = row_begin; row < row_end; row++) {
            const size_t offset = (size_t)row * C;
            const float dout_value = (float)dout[offset + c];
            const float norm = ((float)inp[offset + c] - mean[row]) * rstd[row];
            dbias_sum += dout_value;
            dweight_sum += dout_value * norm;
            if (sum_dinp) {
                dinp_sum += (float)dinp[offset + c];
            }
        }
        dbias_partial[c] = dbias_sum;
        dweight_partial[c] = dweight_sum;
        if (sum_dinp) {
            dinp_partial[c] = dinp_sum;
        }
    }
}

// dweight, dbias (C,) += the sum over the num_blocks slots of the scratch (num_blocks, S*C) =
// [dbias | dweight] per slot, S = 2; with dprojb (C,) given (not NULL), S = 3, the slots
// [dbias | dweight | dprojb] (layernorm_backward's sum_dinp = 1) and dprojb += the third sums.
// A block owns 32 adjacent columns of the S*C at a time (grid-stride over such column groups) and
// all its warps share the slots: lane l of warp w sums column l over
// slots w, w + W, w + 2W, ... (W = blockDim.x / 32 warps), so each warp reads one coalesced
// 128-byte segment per slot; then lane l of warp 0 adds the W warp sums in warp order (that end is
// layernorm.cuh's layernorm_param_reduce_store, which dev/cuda's candidate 5 shares). With one
// thread per channel instead (version 3), GPT-2's 768 threads each summed 2 x 512 slots one after
// the other: latency bound. The order of the additions is fixed by num_blocks and blockDim.x, so
// the result is bit-reproducible for the launcher's fixed block size.
extern "C" __global__ void layernorm_param_reduce(floatX* dweight, floatX* dbias, floatX* dprojb,
                                                  const float* scratch, int num_blocks, int C) {
    __shared__ float warp_sums[WARP_SIZE][WARP_SIZE + 1];   // [warp][lane]; + 1: no bank conflicts
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int slot_width = layernorm_slot_width(dprojb, C);
    const int num_groups = (slot_width + WARP_SIZE - 1) / WARP_SIZE;
    for (int group = blockIdx.x; group < num_groups; group += gridDim.x) {   // the same trip count per block
        const int col = group * WARP_SIZE + lane;           // 0..C-1: dbias, C..2C-1: dweight, then dprojb
        float sum = 0.0f;
        if (col < slot_width) {
            for (int b = warp; b < num_blocks; b += num_warps) {
                sum += scratch[(size_t)b * slot_width + col];
            }
        }
        warp_sums[warp][lane] = sum;
        layernorm_param_reduce_store(warp_sums, dweight, dbias, dprojb, col, C);
    }
}
