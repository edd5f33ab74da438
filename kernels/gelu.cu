/*
kernels/gelu.cu: GELU, tanh approximation (Hendrycks & Gimpel 2016), forward and backward.

Progression: `python dev/cuda/gelu.py` shows the way here; this file is its version 2 of
gelu_forward and of gelu_backward, each version validated against gpt2_cpu.py, then timed against
the GPU's measured limits.

    u = s * (x + 0.044715 x^3),  s = sqrt(2/pi)
    gelu(x)  = 0.5 x (1 + tanh(u))
    gelu'(x) = 0.5 (1 + tanh(u)) + 0.5 x (1 - tanh(u)^2) s (1 + 3 * 0.044715 x^2)
               term 1: through the leading x; term 2: through tanh (d tanh(u)/du = 1 - tanh^2)

Kernels (any shape, n elements):
- gelu_forward: out = gelu(inp), llm.c dev/cuda/gelu_forward.cu version 2 (x128); optionally
  adding the bias of the matmul that wrote inp into inp first (inp_bias, or NULL).
- gelu_backward_inplace: d = d * gelu'(inp), in place on the incoming gradient (it is the
  matmul output gradient, not needed afterwards), llm.c dev/cuda/gelu_backward.cu version 2.
Both: x128 groups then a scalar tail, grid-stride: any n, any grid and block size. Launcher must
check 16-byte aligned pointers, and OC % x128::size == 0 with n a multiple of OC when inp_bias is
given. tanhf (not the faster tanh.approx) so fp32 matches NumPy closely.
*/
#include "common.cuh"

#define GELU_SCALING_FACTOR 0.7978845608028654f    // sqrt(2/pi)
#define GELU_CUBIC_COEFF 0.044715f

__device__ inline float gelu(float x) {
    const float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC_COEFF * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

__device__ inline float gelu_derivative(float x) {
    const float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC_COEFF * x * x * x);
    const float tanh_u = tanhf(u);
    const float du_dx = GELU_SCALING_FACTOR * (1.0f + 3.0f * GELU_CUBIC_COEFF * x * x);
    return 0.5f * (1.0f + tanh_u) + 0.5f * x * (1.0f - tanh_u * tanh_u) * du_dx;
}

// out (n,) = gelu(inp). With inp_bias (OC,) not NULL, inp holds n/OC rows of OC matmul outputs
// computed without their bias: inp += inp_bias first (rounded to floatX and stored: the backward
// reads it), and out = gelu of that. The MLP's first layer then needs no bias pass of its own.
extern "C" __global__ void gelu_forward(floatX* out, floatX* inp, const floatX* inp_bias, size_t n,
                                        int OC) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    for (size_t g = thread; g < num_groups; g += stride) {
        x128 x = load128(inp + g * x128::size);
        if (inp_bias != nullptr) {                 // the same branch for the whole grid
            const x128 bias = load128(inp_bias + (g * x128::size) % OC);   // OC % x128::size == 0
            for (int k = 0; k < x128::size; k++) {
                x[k] = (floatX)((float)x[k] + (float)bias[k]);
            }
            store128(inp + g * x128::size, x);
        }
        x128 out_group;
        for (int k = 0; k < x128::size; k++) {
            out_group[k] = (floatX)gelu((float)x[k]);
        }
        store128(out + g * x128::size, out_group);
    }
    for (size_t i = num_groups * x128::size + thread; i < n; i += stride) {
        if (inp_bias != nullptr) {
            inp[i] = (floatX)((float)inp[i] + (float)inp_bias[i % OC]);
        }
        out[i] = (floatX)gelu((float)inp[i]);
    }
}

// d_in_out (n,) = d_in_out * gelu'(inp): dout comes in, dinp goes out
extern "C" __global__ void gelu_backward_inplace(floatX* d_in_out, const floatX* inp, size_t n) {
    const size_t thread = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const size_t num_groups = n / x128::size;
    for (size_t g = thread; g < num_groups; g += stride) {
        const x128 x = load128cs(inp + g * x128::size);
        x128 d = load128(d_in_out + g * x128::size);
        for (int k = 0; k < x128::size; k++) {
            d[k] = (floatX)((float)d[k] * gelu_derivative((float)x[k]));
        }
        store128(d_in_out + g * x128::size, d);
    }
    for (size_t i = num_groups * x128::size + thread; i < n; i += stride) {
        d_in_out[i] = (floatX)((float)d_in_out[i] * gelu_derivative((float)inp[i]));
    }
}
