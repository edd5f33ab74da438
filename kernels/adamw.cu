/*
kernels/adamw.cu: one AdamW step over every parameter tensor in one launch (Loshchilov & Hutter
2019, Alg. 2, with Adam's bias correction, Kingma & Ba 2015), the same update as
gpt2_cpu.gpt2_update:
    g = grad_scale * grad
    m = beta1 m + (1 - beta1) g                  (first moment, float)
    v = beta2 v + (1 - beta2) g^2                (second moment, float)
    mhat = m / beta1_correction,  vhat = v / beta2_correction,  correction_i = 1 - beta_i^t
    p -= learning_rate * (mhat / (sqrt(vhat) + eps) + weight_decay * p)

Progression: `python dev/cuda/adamw.py` shows the way here; this file is its version 4 of
adamw_update, each version validated against gpt2_cpu.py, then timed against the GPU's measured
limits.

Kernel:
- adamw_update: llm.c dev/cuda/adamw.cu's fused kernel (moments and parameter updated in one pass;
  plus train_gpt2.cu's master weights and stochastic rounding), over a table of tensors, in 16-byte
  vectors. The fp32 value of p comes from master_params when given (mixed precision: bf16
  params, fp32 master copy), else from params itself. The new value is written to master_params
  (float, exact) and to params: stochastically rounded to bf16 in the bf16 build (see
  common.cuh), stored as is in fp32.
  What changes from one step to the next is read from device memory, not passed as a launch
  argument: the learning rate and the two bias corrections (step_scalars), the gradient scale
  (grad_scale: the clipping factor, which global_norm_finalize computes on the device) and each
  tensor's stochastic-rounding seed (seeds). So the launch has the same arguments every step, and
  a CUDA graph of the whole training step replays it: the host uploads the step's values first.

The table (gpt2_cuda.adamw_table), ADAMW_TENSOR_FIELDS int64 per tensor, in parameter order:
    [ADAMW_PARAM_OFFSET]  where the tensor (or this rank's piece of it) starts in params and grads
    [ADAMW_STATE_OFFSET]  where it starts in m, v and master_params (a ZeRO-1 shard's local offset)
    [ADAMW_COUNT]         its number of elements n
    [ADAMW_FIRST_BLOCK]   its first block: tensor k owns blocks FIRST_BLOCK[k] .. FIRST_BLOCK[k+1]-1,
                    ceil(n / (blockDim.x * x128::size)) of them, so no block is idle and none
                    spans two tensors (with weight decay 0 for some: biases, LayerNorms)
    [ADAMW_DECAYED]       1: weight decay applies to it, 0: not
Thread j of a tensor's block b updates the x128::size elements from (b * blockDim.x + j) *
x128::size on: one 16-byte load of grads (and params), and the matching floats of m, v, master in
f128 loads (two per vector in bf16), when the piece's start in each array is 16-byte aligned; a
piece that starts off that alignment (a ZeRO-1 shard boundary, a view) takes the scalar path.
The rounding bits of element i are squirrel_noise5(i, seed), with i counted from the piece's
start: the launcher gives each tensor a seed per step, shifted for a piece (llmc.zero.rounding_seed),
so one launch rounds every element as per-tensor launches of version 3 did, bit for bit.

Launcher must check: blockDim.x the block size the table's FIRST_BLOCK was made for (a multiple
of 32); num_blocks = the last tensor's FIRST_BLOCK + its block count. Any grid (the blocks of the
table are a grid-stride loop).
*/
#include "common.cuh"

#define ADAMW_TENSOR_FIELDS 5
#define ADAMW_PARAM_OFFSET 0
#define ADAMW_STATE_OFFSET 1
#define ADAMW_COUNT 2
#define ADAMW_FIRST_BLOCK 3
#define ADAMW_DECAYED 4

// the step's constants and the values it reads from the device, as the update of one element uses them
struct AdamWStep {
    float learning_rate, beta1, beta2, beta1_correction, beta2_correction, eps, weight_decay, grad_scale;
};

// whether a pointer can be read and written as 16-byte vectors
__device__ inline bool is_aligned16(const void* address) {
    return ((unsigned long long)address & 15ull) == 0;
}

// one element: m, v updated in place, the new parameter returned (gpt2_cpu.adamw_update's lines)
__device__ inline float adamw_element(float param, float grad, float& m, float& v, const AdamWStep& s) {
    const float g = s.grad_scale * grad;
    m = s.beta1 * m + (1.0f - s.beta1) * g;
    v = s.beta2 * v + (1.0f - s.beta2) * g * g;
    const float m_hat = m / s.beta1_correction;
    const float v_hat = v / s.beta2_correction;
    return param - s.learning_rate * (m_hat / (sqrtf(v_hat) + s.eps) + s.weight_decay * param);
}

// params (P,), grads (P,) floatX; master_params (S,) float or NULL; m, v (S,) float; tensors
// (num_tensors, ADAMW_TENSOR_FIELDS) int64; seeds (num_tensors,); step_scalars (3,) = learning rate,
// beta1_correction, beta2_correction; grad_scale (1,)
extern "C" __global__ void adamw_update(floatX* params, float* master_params, const floatX* grads,
                                        float* m, float* v, const long long* tensors, int num_tensors,
                                        long long num_blocks, const unsigned int* seeds,
                                        const float* step_scalars, const float* grad_scale,
                                        float beta1, float beta2, float eps, float weight_decay) {
    AdamWStep step = {step_scalars[0], beta1, beta2, step_scalars[1], step_scalars[2], eps, 0.0f,
                      grad_scale[0]};
    const long long block_elements = (long long)blockDim.x * x128::size;
    for (long long block = blockIdx.x; block < num_blocks; block += gridDim.x) {
        // the tensor of this block: the last whose first block is <= block (a few dozen at most)
        int t = 0;
        while (t + 1 < num_tensors && tensors[(t + 1) * ADAMW_TENSOR_FIELDS + ADAMW_FIRST_BLOCK] <= block) {
            t++;
        }
        const long long* row = tensors + t * ADAMW_TENSOR_FIELDS;
        const long long n = row[ADAMW_COUNT];
        const long long begin = (block - row[ADAMW_FIRST_BLOCK]) * block_elements + threadIdx.x * x128::size;
        if (begin >= n) {
            continue;                                   // the tensor's last block, past its end
        }
        floatX* p = params + row[ADAMW_PARAM_OFFSET];
        const floatX* g = grads + row[ADAMW_PARAM_OFFSET];
        float* m_t = m + row[ADAMW_STATE_OFFSET];
        float* v_t = v + row[ADAMW_STATE_OFFSET];
        float* master = master_params != nullptr ? master_params + row[ADAMW_STATE_OFFSET] : nullptr;
        step.weight_decay = row[ADAMW_DECAYED] ? weight_decay : 0.0f;
        const unsigned int seed = seeds[t];
        // begin is a whole number of vectors in: a tensor's vectors are aligned where its starts are
        const bool aligned = is_aligned16(p) && is_aligned16(m_t) && is_aligned16(v_t) &&
                             (master == nullptr || is_aligned16(master));
        if (aligned && begin + x128::size <= n) {
            // one vector: x128::size elements, their floats in x128::size / f128::size f128 groups
            const x128 grad_group = load128cs(g + begin);
            const x128 param_group = master == nullptr ? load128(p + begin) : x128::zeros();
            x128 new_params;
            for (int q = 0; q < x128::size / f128::size; q++) {
                const long long at = begin + q * f128::size;
                f128 m_group = load128(m_t + at);
                f128 v_group = load128(v_t + at);
                f128 master_group = master != nullptr ? load128(master + at) : f128::zeros();
                for (int k = 0; k < f128::size; k++) {
                    const int e = q * f128::size + k;         // element of the x128 vector
                    const float old = master != nullptr ? master_group[k] : (float)param_group[e];
                    const float param = adamw_element(old, (float)grad_group[e], m_group[k], v_group[k], step);
                    master_group[k] = param;
                    stochastic_rounding(param, &new_params[e], squirrel_noise5((unsigned int)(begin + e), seed));
                }
                store128(m_t + at, m_group);
                store128(v_t + at, v_group);
                if (master != nullptr) {
                    store128(master + at, master_group);
                }
            }
            store128(p + begin, new_params);
        } else {
            // a piece off the 16-byte alignment, or the tensor's last elements: one at a time
            for (long long i = begin; i < begin + x128::size && i < n; i++) {
                float m_i = m_t[i];
                float v_i = v_t[i];
                const float old = master != nullptr ? master[i] : (float)p[i];
                const float param = adamw_element(old, (float)g[i], m_i, v_i, step);
                m_t[i] = m_i;
                v_t[i] = v_i;
                if (master != nullptr) {
                    master[i] = param;
                }
                stochastic_rounding(param, &p[i], squirrel_noise5((unsigned int)i, seed));
            }
        }
    }
}
