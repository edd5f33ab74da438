/*
kernels/adamw.cu: one AdamW step over one parameter tensor (Loshchilov & Hutter 2019, Alg. 2,
with Adam's bias correction, Kingma & Ba 2015), the same update as gpt2_cpu.gpt2_update:
    g = grad_scale * grad
    m = beta1 m + (1 - beta1) g                  (first moment, float)
    v = beta2 v + (1 - beta2) g^2                (second moment, float)
    mhat = m / beta1_correction,  vhat = v / beta2_correction,  correction_i = 1 - beta_i^t
    p -= learning_rate * (mhat / (sqrt(vhat) + eps) + weight_decay * p)

Progression: `python dev/cuda/adamw.py` shows the way here; this file is its version 3 of
adamw_update, each version validated against gpt2_cpu.py, then timed against the GPU's measured
limits.

Kernel:
- adamw_update: one thread per element, grid-stride (llm.c dev/cuda/adamw.cu's fused kernel:
  moments and parameter updated in one pass; plus train_gpt2.cu's master weights and
  stochastic rounding). The fp32 value of
  p comes from master_params when given (mixed precision: bf16 params, fp32 master copy), else
  from params itself. The new value is written to master_params (float, exact) and to params:
  stochastically rounded to bf16 in the bf16 build (see common.cuh), stored as is in fp32.
  grad_scale carries the global-norm clipping factor (and any loss scaling) so the launcher does
  not need a separate pass to rescale gradients.

Launcher: calls it once per parameter tensor, with pointers offset to that tensor, so
weight_decay can be 0 for biases and LayerNorm parameters. The rounding bits of element i are
squirrel_noise5(i, seed), with i counted from the tensor's start, so pass a seed that differs
per tensor and per step (e.g. derived from (step, tensor index)). Any n, any grid and block
size. Scalar loads only: consecutive threads touch consecutive elements, so every warp access is
coalesced and the kernel is bandwidth-bound without vector loads.
*/
#include "common.cuh"

// params (n,) floatX; master_params (n,) float or NULL; grads (n,) floatX; m, v (n,) float
extern "C" __global__ void adamw_update(floatX* params, float* master_params, const floatX* grads,
                                        float* m, float* v, size_t n, float learning_rate,
                                        float beta1, float beta2, float beta1_correction,
                                        float beta2_correction, float eps, float weight_decay,
                                        float grad_scale, unsigned int seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const float grad = grad_scale * (float)grads[i];
        const float m_new = beta1 * m[i] + (1.0f - beta1) * grad;
        const float v_new = beta2 * v[i] + (1.0f - beta2) * grad * grad;
        m[i] = m_new;
        v[i] = v_new;
        const float m_hat = m_new / beta1_correction;
        const float v_hat = v_new / beta2_correction;
        float param = (master_params != nullptr) ? master_params[i] : (float)params[i];
        param -= learning_rate * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * param);
        if (master_params != nullptr) {
            master_params[i] = param;
        }
        stochastic_rounding(param, &params[i], squirrel_noise5((unsigned int)i, seed));
    }
}
