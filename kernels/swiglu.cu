/*
kernels/swiglu.cu: SwiGLU's gating (Shazeer 2020, FFN_SwiGLU), forward and backward.

Progression: `python dev/cuda/swiglu.py` shows the way here; this file is its version 2 of
swiglu_forward and of swiglu_backward, each version validated against llama3_cpu.py, then timed
against the GPU's measured limits.

With fch = x W (c_fc, the linear branch) and fch2 = x W2 (c_fc2, the gate), sig = sigmoid(fch2):
    out   = fch * silu(fch2),          silu(x) = x * sigmoid(x)  (Elfwing et al. 2018)
    dfch  = dout * silu(fch2)
    dfch2 = dout * fch * silu'(fch2),  silu'(x) = sig (1 + x (1 - sig))
(derivation in llama3_cpu.swiglu_backward).

Kernels (any shape, n elements, all floatX):
- swiglu_forward: out = fch * silu(fch2).
- swiglu_backward: dfch, dfch2 from dout, fch, fch2. dfch may be dout (in place): each thread
  reads its groups of all three inputs before it writes.
Both: one thread per x128 group, then a scalar tail; grid-stride, any n, grid and block size
(llm.c dev/cuda/gelu_forward.cu version 2's pattern). Launcher must check 16-byte aligned
pointers. expf (not __expf) so that fp32 matches NumPy closely; for fch2 -> -inf, expf(-fch2) = inf
and silu = fch2 / inf = -0, the right limit.
*/
#include "common.cuh"

__device__ inline float sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// out (n,) = fch * silu(fch2)
extern "C" __global__ void swiglu_forward(floatX* out, const floatX* fch, const floatX* fch2, size_t n) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    for (size_t g = thread; g < num_groups; g += stride) {
        const x128 linear = load128cs(fch + g * x128::size);
        const x128 gate = load128cs(fch2 + g * x128::size);
        x128 out_group;
        for (int k = 0; k < x128::size; k++) {
            const float z = (float)gate[k];
            out_group[k] = (floatX)((float)linear[k] * z * sigmoid(z));
        }
        store128(out + g * x128::size, out_group);
    }
    for (size_t i = num_groups * x128::size + thread; i < n; i += stride) {
        const float z = (float)fch2[i];
        out[i] = (floatX)((float)fch[i] * z * sigmoid(z));
    }
}

// dfch, dfch2 (n,) from dout (n,): the gradients of both matmul outputs (dfch may be dout)
extern "C" __global__ void swiglu_backward(floatX* dfch, floatX* dfch2, const floatX* dout, const floatX* fch,
                                           const floatX* fch2, size_t n) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    for (size_t g = thread; g < num_groups; g += stride) {
        const x128 d = load128(dout + g * x128::size);
        const x128 linear = load128cs(fch + g * x128::size);
        const x128 gate = load128cs(fch2 + g * x128::size);
        x128 dlinear, dgate;
        for (int k = 0; k < x128::size; k++) {
            const float z = (float)gate[k];
            const float sig = sigmoid(z);
            dlinear[k] = (floatX)((float)d[k] * z * sig);
            dgate[k] = (floatX)((float)d[k] * (float)linear[k] * sig * (1.0f + z * (1.0f - sig)));
        }
        store128(dfch + g * x128::size, dlinear);
        store128(dfch2 + g * x128::size, dgate);
    }
    for (size_t i = num_groups * x128::size + thread; i < n; i += stride) {
        const float z = (float)fch2[i];
        const float sig = sigmoid(z);
        const float d = (float)dout[i];
        dfch2[i] = (floatX)(d * (float)fch[i] * sig * (1.0f + z * (1.0f - sig)));
        dfch[i] = (floatX)(d * z * sig);               // last: dfch may be dout
    }
}
