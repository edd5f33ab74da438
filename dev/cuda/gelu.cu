/*
dev/cuda/gelu.cu: the intermediate GELU kernels of dev/cuda/gelu.py (the last version of each
progression is kernels/gelu.cu's, launched from there by its real name).

- gelu_forward_v1: a naive port of gpt2_cpu.gelu_forward, one thread per element, scalar loads,
  exactly n threads (no grid-stride loop). Each warp still reads 32 consecutive floatX (64 or
  128 bytes), so the accesses coalesce; what it lacks is width: one 2- or 4-byte load per thread
  keeps fewer bytes in flight than the memory system can serve.
- gelu_backward_v1: the same for gpt2_cpu.gelu_backward, in place on the incoming gradient as
  the trainer does it: d = d * gelu'(x).

Both need n < 2^31 (int indexing, fine for one layer's B*T*4C). Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/gelu.cu
*/
#include "common.cuh"

#define GELU_SCALING_FACTOR 0.7978845608028654f    // sqrt(2/pi)
#define GELU_CUBIC_COEFF 0.044715f

// out (n,) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))): thread i computes element i
extern "C" __global__ void gelu_forward_v1(floatX* out, const floatX* inp, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = (float)inp[i];
        const float cube = GELU_CUBIC_COEFF * x * x * x;
        out[i] = (floatX)(0.5f * x * (1.0f + tanhf(GELU_SCALING_FACTOR * (x + cube))));
    }
}

// d_in_out (n,) *= gelu'(inp): thread i computes element i
extern "C" __global__ void gelu_backward_v1(floatX* d_in_out, const floatX* inp, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float x = (float)inp[i];
        const float t = tanhf(GELU_SCALING_FACTOR * (x + GELU_CUBIC_COEFF * x * x * x));
        const float local_grad = 0.5f * (1.0f + t)                          // through the leading x
            + 0.5f * x * (1.0f - t * t) * GELU_SCALING_FACTOR * (1.0f + 3.0f * GELU_CUBIC_COEFF * x * x);  // through tanh
        d_in_out[i] = (floatX)((float)d_in_out[i] * local_grad);
    }
}
