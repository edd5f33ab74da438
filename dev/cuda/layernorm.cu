/*
dev/cuda/layernorm.cu: the intermediate LayerNorm kernels of dev/cuda/layernorm.py (the last
version of each progression is kernels/layernorm.cu's, launched from there by its real name).

Rows: N = B*T rows of C channels; inp, out (N,C) floatX; weight, bias (C,); mean, rstd (N,) float.
    mean = sum x / C,  rstd = 1 / sqrt(sum (x - mean)^2 / C + eps),  out = (x - mean) rstd w + b

- layernorm_forward_v1: naive port of gpt2_cpu.layernorm_forward, one thread per row looping
  over its C channels three times (mean, variance, output). Neighbouring threads read addresses
  C elements apart, so a warp's load touches 32 different cache lines: uncoalesced, and only N
  threads in all (8192 for GPT-2 at B*T = 8192: a few per SM core).
- layernorm_forward_v2: one warp per row. The 32 lanes read 32 consecutive channels (coalesced)
  and combine their partial sums with warpReduceSum (5 shuffles), two-pass variance as in the
  production kernel. Scalar loads.
- fused_residual_forward_v1 / _v2: the same two steps with residual = inp1 + inp2 stored first
  (rounded to floatX) and normalized: one thread per row / one warp per row.
- layernorm_backward_v1: naive port of gpt2_cpu.layernorm_backward, one thread per row: the two
  row means of dnorm, then dinp += rstd (dnorm - mean(dnorm) - norm mean(dnorm norm)); dbias
  and dweight are atomicAdd-ed into an fp32 scratch (2, C) = [dbias | dweight] that the launcher
  zeroed, so N threads hit the same 2C addresses.
- layernorm_backward_v2: one warp per row (coalesced, shuffle reductions); each block first
  accumulates its rows' dbias/dweight in shared memory (atomics on shared memory are cheap), then
  adds them to the global scratch with one atomic per channel per block.
Both backward versions then add the scratch into dweight/dbias with kernels/layernorm.cu's
layernorm_param_reduce over one slot. Atomics make them non-reproducible run to run; the production kernel writes
per-block slots instead.
- layernorm_param_reduce_v3: the per-block slots summed with one thread per channel, in slot
  order: version 3 of the backward is the production layernorm_backward followed by this one
  (version 4, kernels/layernorm.cu's layernorm_param_reduce, gives the slots to a block's warps).

- layernorm_param_reduce_v5 (candidate 5, with the production layernorm_backward): version 4's
  reduce, each lane keeping LN_REDUCE_SUMS = 8 running sums (its slots taken 8 at a time), so 8
  loads are in flight where version 4 waits for each. On an H200 version 4 took 0.0345 ms at
  B=8 (its reduce is the same work at any N: G = 512 slots), and in the B=16 step 14 us a call,
  0.35 ms for the 25 LayerNorms, for 3.1 MB of slots: latency, not bandwidth.
  Given dprojb (gpt2_cuda.py --ln-bias-grad), a slot's third C columns too, as production's.
- layernorm_backward_v6 (candidate 6, with layernorm_param_reduce_v5): the production kernel's
  input gradient (kernels/layernorm.cuh, the same code), then the partial sums with 16-byte loads:
  thread t takes the x128 group g = t % groups of every P-th row of the block (P = threads /
  groups row phases: 5 for GPT-2's 96 groups of 8 bf16 at 512 threads), summing 2 x x128::size
  columns in registers; the P phases meet in shared memory and are added in phase order. The
  production kernel gives a thread one channel and all 32 rows, with 2-byte loads: 8x the load
  instructions, and at C = 768 half its 512 threads take two channels while the others take one.
  With sum_dinp (--ln-bias-grad) it sums dinp's columns too, after the block's barrier, as
  production does (its shared memory sized for three sums: 48 KB, the static limit).

Warp kernels need blockDim.x a multiple of 32. Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/layernorm.cu
*/
#include "common.cuh"
#include "layernorm.cuh"

#define LN_EPS 1e-5f

// ----------------------------------------------------------------------------
// forward, one thread per row

// the row's normalization by one thread: out_row, and the statistics (either may be NULL)
__device__ inline void layernorm_row_thread(floatX* out_row, float* mean, float* rstd, const floatX* x,
                                            const floatX* weight, const floatX* bias, int row, int C) {
    float sum = 0.0f;
    for (int c = 0; c < C; c++) {
        sum += (float)x[c];
    }
    const float m = sum / C;
    float sum_sq = 0.0f;
    for (int c = 0; c < C; c++) {
        const float centered = (float)x[c] - m;
        sum_sq += centered * centered;
    }
    const float s = rsqrtf(sum_sq / C + LN_EPS);
    for (int c = 0; c < C; c++) {
        out_row[c] = (floatX)(((float)x[c] - m) * s * (float)weight[c] + (float)bias[c]);
    }
    mean[row] = m;
    rstd[row] = s;
}

// out (N,C) = layernorm(inp): thread i normalizes row i
extern "C" __global__ void layernorm_forward_v1(floatX* out, float* mean, float* rstd, const floatX* inp,
                                                const floatX* weight, const floatX* bias, int N, int C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < N) {
        layernorm_row_thread(out + (size_t)row * C, mean, rstd, inp + (size_t)row * C, weight, bias, row, C);
    }
}

// residual = inp1 + inp2, normed = layernorm(residual): thread i handles row i
extern "C" __global__ void fused_residual_forward_v1(floatX* residual, floatX* normed, float* mean, float* rstd,
                                                     const floatX* inp1, const floatX* inp2,
                                                     const floatX* weight, const floatX* bias, int N, int C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row < N) {
        const size_t offset = (size_t)row * C;
        for (int c = 0; c < C; c++) {
            residual[offset + c] = (floatX)((float)inp1[offset + c] + (float)inp2[offset + c]);
        }
        layernorm_row_thread(normed + offset, mean, rstd, residual + offset, weight, bias, row, C);
    }
}

// ----------------------------------------------------------------------------
// forward, one warp per row

// the row's normalization by one warp: lane reads channels lane, lane+32, ... (coalesced)
__device__ inline void layernorm_row_warp(floatX* out_row, float* mean, float* rstd, const floatX* x,
                                          const floatX* weight, const floatX* bias, int row, int C, int lane) {
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        sum += (float)x[c];
    }
    const float m = warpReduceSum(sum) / C;
    float sum_sq = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float centered = (float)x[c] - m;
        sum_sq += centered * centered;
    }
    const float s = rsqrtf(warpReduceSum(sum_sq) / C + LN_EPS);
    for (int c = lane; c < C; c += WARP_SIZE) {
        out_row[c] = (floatX)(((float)x[c] - m) * s * (float)weight[c] + (float)bias[c]);
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// out (N,C) = layernorm(inp): warp w of the grid normalizes row w
extern "C" __global__ void layernorm_forward_v2(floatX* out, float* mean, float* rstd, const floatX* inp,
                                                const floatX* weight, const floatX* bias, int N, int C) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    if (row < N) {                              // the whole warp agrees, so the shuffles are safe
        layernorm_row_warp(out + (size_t)row * C, mean, rstd, inp + (size_t)row * C, weight, bias, row, C,
                           threadIdx.x % WARP_SIZE);
    }
}

// residual = inp1 + inp2, normed = layernorm(residual): warp w handles row w. Each lane re-reads
// only the residual channels it stored itself, so no __syncwarp is needed between the steps.
extern "C" __global__ void fused_residual_forward_v2(floatX* residual, floatX* normed, float* mean, float* rstd,
                                                     const floatX* inp1, const floatX* inp2,
                                                     const floatX* weight, const floatX* bias, int N, int C) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row < N) {
        const size_t offset = (size_t)row * C;
        for (int c = lane; c < C; c += WARP_SIZE) {
            residual[offset + c] = (floatX)((float)inp1[offset + c] + (float)inp2[offset + c]);
        }
        layernorm_row_warp(normed + offset, mean, rstd, residual + offset, weight, bias, row, C, lane);
    }
}

// ----------------------------------------------------------------------------
// backward

// dinp (N,C) += layernorm input gradient; scratch (2,C) float += [sum dout | sum dout*norm]:
// thread i handles row i
extern "C" __global__ void layernorm_backward_v1(floatX* dinp, float* scratch, const floatX* dout,
                                                 const floatX* inp, const floatX* weight,
                                                 const float* mean, const float* rstd, int N, int C) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) {
        return;
    }
    const size_t offset = (size_t)row * C;
    const float m = mean[row];
    const float s = rstd[row];
    float dnorm_sum = 0.0f;
    float dnorm_norm_sum = 0.0f;
    for (int c = 0; c < C; c++) {
        const float norm = ((float)inp[offset + c] - m) * s;
        const float dnorm = (float)dout[offset + c] * (float)weight[c];
        dnorm_sum += dnorm;
        dnorm_norm_sum += dnorm * norm;
    }
    const float dnorm_mean = dnorm_sum / C;
    const float dnorm_norm_mean = dnorm_norm_sum / C;
    for (int c = 0; c < C; c++) {
        const float norm = ((float)inp[offset + c] - m) * s;
        const float d = (float)dout[offset + c];
        const float dnorm = d * (float)weight[c];
        // term 1: direct; term 2: through the mean; term 3: through the variance
        const float dval = s * (dnorm - dnorm_mean - norm * dnorm_norm_mean);
        dinp[offset + c] = (floatX)((float)dinp[offset + c] + dval);
        atomicAdd(&scratch[c], d);                  // dbias
        atomicAdd(&scratch[C + c], d * norm);       // dweight
    }
}

// as v1, but warp w handles row w, and dbias/dweight go through shared memory: dynamic shared
// memory of 2*C floats per block (the launcher passes shared_mem = 2*C*4 bytes)
extern "C" __global__ void layernorm_backward_v2(floatX* dinp, float* scratch, const floatX* dout,
                                                 const floatX* inp, const floatX* weight,
                                                 const float* mean, const float* rstd, int N, int C) {
    extern __shared__ float block_sums[];           // (2, C): [dbias | dweight] of this block's rows
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        block_sums[c] = 0.0f;
    }
    __syncthreads();
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row < N) {
        const size_t offset = (size_t)row * C;
        const float m = mean[row];
        const float s = rstd[row];
        float dnorm_sum = 0.0f;
        float dnorm_norm_sum = 0.0f;
        for (int c = lane; c < C; c += WARP_SIZE) {
            const float norm = ((float)inp[offset + c] - m) * s;
            const float dnorm = (float)dout[offset + c] * (float)weight[c];
            dnorm_sum += dnorm;
            dnorm_norm_sum += dnorm * norm;
        }
        const float dnorm_mean = warpReduceSum(dnorm_sum) / C;
        const float dnorm_norm_mean = warpReduceSum(dnorm_norm_sum) / C;
        for (int c = lane; c < C; c += WARP_SIZE) {
            const float norm = ((float)inp[offset + c] - m) * s;
            const float d = (float)dout[offset + c];
            const float dval = s * (d * (float)weight[c] - dnorm_mean - norm * dnorm_norm_mean);
            dinp[offset + c] = (floatX)((float)dinp[offset + c] + dval);
            atomicAdd(&block_sums[c], d);
            atomicAdd(&block_sums[C + c], d * norm);
        }
    }
    __syncthreads();                                // every warp's rows are in block_sums
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) {
        atomicAdd(&scratch[c], block_sums[c]);
    }
}

// ----------------------------------------------------------------------------
// the parameter gradients' reduction, one thread per channel (version 3 of layernorm_backward)

// dweight, dbias (C,) += sum over b = 0..num_blocks-1 (in order) of the scratch (num_blocks, 2C) =
// [dbias | dweight] per slot: thread c sums channel c's two columns over the slots, one after the
// other. GPT-2's C = 768 makes 768 threads on a GPU of 132 SMs, each with 2 x 512 dependent loads:
// latency bound (kernels/layernorm.cu's layernorm_param_reduce, version 4, shares the slots among
// the warps of a block instead).
extern "C" __global__ void layernorm_param_reduce_v3(floatX* dweight, floatX* dbias, const float* scratch,
                                                     int num_blocks, int C) {
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

// ----------------------------------------------------------------------------
// candidates: the slots summed with loads in flight (5), the partial sums with x128 loads (6)

#define LN_REDUCE_SUMS 8       // running sums per lane of layernorm_param_reduce_v5 (a power of 2)

// kernels/layernorm.cu's layernorm_param_reduce (the same grid, block and slots: a block owns 32
// adjacent columns of a slot's 2C or 3C, lane l of warp w sums column l over slots w, w + W,
// ...), each lane adding its slots into LN_REDUCE_SUMS running sums, slot w + (first + k) W into sums[k], so the
// unrolled loop's loads do not wait for each other's adds; the sums folded pairwise, then warp 0
// adds the W warp sums in warp order. Deterministic: the order depends on num_blocks and blockDim.x.
extern "C" __global__ void layernorm_param_reduce_v5(floatX* dweight, floatX* dbias, floatX* dprojb,
                                                     const float* scratch, int num_blocks, int C) {
    __shared__ float warp_sums[WARP_SIZE][WARP_SIZE + 1];   // [warp][lane]; + 1: no bank conflicts
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    const int slot_width = layernorm_slot_width(dprojb, C);
    const int num_groups = (slot_width + WARP_SIZE - 1) / WARP_SIZE;
    for (int group = blockIdx.x; group < num_groups; group += gridDim.x) {   // the same trip count per block
        const int col = group * WARP_SIZE + lane;           // 0..C-1: dbias, C..2C-1: dweight, then dprojb
        float sums[LN_REDUCE_SUMS];
        for (int k = 0; k < LN_REDUCE_SUMS; k++) {
            sums[k] = 0.0f;
        }
        if (col < slot_width) {
            for (int first = 0; warp + first * num_warps < num_blocks; first += LN_REDUCE_SUMS) {
                #pragma unroll
                for (int k = 0; k < LN_REDUCE_SUMS; k++) {
                    const int b = warp + (first + k) * num_warps;
                    if (b < num_blocks) {
                        sums[k] += scratch[(size_t)b * slot_width + col];
                    }
                }
            }
        }
        #pragma unroll
        for (int half = LN_REDUCE_SUMS / 2; half > 0; half /= 2) {
            for (int k = 0; k < half; k++) {
                sums[k] += sums[k + half];
            }
        }
        warp_sums[warp][lane] = sums[0];
        layernorm_param_reduce_store(warp_sums, dweight, dbias, dprojb, col, C);
    }
}

#define LN_PARTIAL_THREADS 512  // threads of a block that sum partials in layernorm_backward_v6 (its shared memory)

// kernels/layernorm.cu's layernorm_backward (the same arguments, grid, block and scratch slots),
// its part 2 with x128 loads: the block's `groups` = C / x128::size column groups are taken
// `pass_groups` = min(groups, threads) at a time; in a pass, thread t < phases * pass_groups sums
// group g0 + t % pass_groups over the rows row_begin + p, + phases, ... (p = t / pass_groups, the
// row phase), its S * x128::size sums (dbias, dweight, and with sum_dinp dinp's) kept in registers,
// then written to shared memory, where thread j adds column j's phases in phase order into the
// block's slot. S = 2 + sum_dinp; sum_dinp's barrier before part 2 is the production kernel's.
extern "C" __global__ void layernorm_backward_v6(floatX* dinp, float* scratch, const floatX* dout,
                                                 const floatX* inp, const floatX* weight,
                                                 const float* mean, const float* rstd, int N, int C,
                                                 int sum_dinp) {
    __shared__ float phase_sums[LN_PARTIAL_THREADS * 3 * 8];   // [phase][dbias | dweight | dinp][pass column]
    const int rows_per_block = (N + gridDim.x - 1) / gridDim.x;
    const int row_begin = min(N, (int)blockIdx.x * rows_per_block);
    const int row_end = min(N, row_begin + rows_per_block);

    // part 1, dinp: the production kernel's code
    layernorm_backward_dinp_rows(dinp, dout, inp, weight, mean, rstd, row_begin, row_end, C);

    // part 2, the partial sums of dbias and dweight (and dinp) over the block's rows
    if (sum_dinp) {
        __syncthreads();                                    // the block's dinp rows written
    }
    const int sums = 2 + sum_dinp;
    const int threads = min((int)blockDim.x, LN_PARTIAL_THREADS);
    const int groups = C / x128::size;
    const int pass_groups = min(groups, threads);
    const int phases = threads / pass_groups;
    const int pass_columns = pass_groups * x128::size;
    float* slot = scratch + (size_t)blockIdx.x * sums * C;   // [dbias | dweight | dinp's]
    for (int g0 = 0; g0 < groups; g0 += pass_groups) {      // one pass for C <= threads * x128::size
        const int phase = threadIdx.x / pass_groups;
        const int g = g0 + threadIdx.x % pass_groups;
        const bool summing = phase < phases && g < groups;
        float dbias_sum[x128::size], dweight_sum[x128::size], dinp_sum[x128::size];
        for (int k = 0; k < x128::size; k++) {
            dbias_sum[k] = 0.0f;
            dweight_sum[k] = 0.0f;
            dinp_sum[k] = 0.0f;
        }
        if (summing) {
            for (int row = row_begin + phase; row < row_end; row += phases) {
                const size_t offset = (size_t)row * C + g * x128::size;
                const x128 dout_group = load128(dout + offset);
                const x128 inp_group = load128(inp + offset);
                const float row_mean = mean[row];
                const float row_rstd = rstd[row];
                for (int k = 0; k < x128::size; k++) {
                    const float norm = ((float)inp_group[k] - row_mean) * row_rstd;
                    dbias_sum[k] += (float)dout_group[k];
                    dweight_sum[k] += (float)dout_group[k] * norm;
                }
                if (sum_dinp) {
                    const x128 dinp_group = load128(dinp + offset);
                    for (int k = 0; k < x128::size; k++) {
                        dinp_sum[k] += (float)dinp_group[k];
                    }
                }
            }
        }
        __syncthreads();                                    // the previous pass has read phase_sums
        if (summing) {
            float* mine = phase_sums + phase * sums * pass_columns + (g - g0) * x128::size;
            for (int k = 0; k < x128::size; k++) {
                mine[k] = dbias_sum[k];
                mine[pass_columns + k] = dweight_sum[k];
                if (sum_dinp) {
                    mine[2 * pass_columns + k] = dinp_sum[k];
                }
            }
        }
        __syncthreads();
        const int columns = min(groups - g0, pass_groups) * x128::size;
        for (int j = threadIdx.x; j < sums * columns; j += blockDim.x) {  // j: dbias columns, dweight's, dinp's
            const int which = j / columns, column = j % columns;
            float total = 0.0f;
            for (int p = 0; p < phases; p++) {
                total += phase_sums[p * sums * pass_columns + which * pass_columns + column];
            }
            slot[which * C + g0 * x128::size + column] = total;
        }
    }
}
