/*
dev/cuda/adamw.cu: the intermediate AdamW kernels of dev/cuda/adamw.py (the last version is
kernels/adamw.cu's adamw_update, launched from there by its real name).

One AdamW step over n parameters (gpt2_cpu.adamw_update):
    g = grad_scale * grad;  m = beta1 m + (1-beta1) g;  v = beta2 v + (1-beta2) g^2
    p -= lr * (m / beta1_correction / (sqrt(v / beta2_correction) + eps) + weight_decay * p)
params, grads (n,) floatX; m, v (n,) float.

- adamw_moments_v1 + adamw_params_v1: the naive port, one kernel per half of the NumPy function
  (moments, then the parameter), one thread per element. Every element's m and v go to DRAM in
  the first kernel and come back in the second: 16 bytes per parameter of extra traffic.
- adamw_update_v2: both halves fused in one kernel: m and v are read once and written once, the
  parameter update uses the fresh values from registers. Stores the parameter rounded to nearest.
Both one thread per element, no grid-stride loop, int indexing (n < 2^31).
- adamw_update_v3: version 2 with what the trainer needs: a grid-stride loop (any grid, size_t
  indexing), optional fp32 master weights, stochastic rounding of the bf16 parameter (a hash per
  element and step). One launch per tensor, every per-step value (learning rate, corrections,
  gradient scale, seed) a launch argument; scalar loads. Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/adamw.cu
*/
#include "common.cuh"

// m, v (n,) updated from grads: thread i updates element i
extern "C" __global__ void adamw_moments_v1(float* m, float* v, const floatX* grads, int n,
                                            float beta1, float beta2, float grad_scale) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = grad_scale * (float)grads[i];
        m[i] = beta1 * m[i] + (1.0f - beta1) * g;
        v[i] = beta2 * v[i] + (1.0f - beta2) * g * g;
    }
}

// params (n,) updated from the new m, v: thread i updates element i
extern "C" __global__ void adamw_params_v1(floatX* params, const float* m, const float* v, int n,
                                           float learning_rate, float beta1_correction,
                                           float beta2_correction, float eps, float weight_decay) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float m_hat = m[i] / beta1_correction;
        const float v_hat = v[i] / beta2_correction;
        const float p = (float)params[i];
        params[i] = (floatX)(p - learning_rate * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * p));
    }
}

// the whole step for element i in one thread, one read and one write of each array
extern "C" __global__ void adamw_update_v2(floatX* params, const floatX* grads, float* m, float* v, int n,
                                           float learning_rate, float beta1, float beta2,
                                           float beta1_correction, float beta2_correction, float eps,
                                           float weight_decay, float grad_scale) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = grad_scale * (float)grads[i];
        const float m_new = beta1 * m[i] + (1.0f - beta1) * g;
        const float v_new = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = m_new;
        v[i] = v_new;
        const float p = (float)params[i];
        const float update = (m_new / beta1_correction) / (sqrtf(v_new / beta2_correction) + eps);
        params[i] = (floatX)(p - learning_rate * (update + weight_decay * p));
    }
}

// one tensor per launch, grid-stride, scalar loads, every per-step value a launch argument; master
// weights and stochastic rounding as in the production kernel.
// params (n,) floatX; master_params (n,) float or NULL; grads (n,) floatX; m, v (n,) float
extern "C" __global__ void adamw_update_v3(floatX* params, float* master_params, const floatX* grads,
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
