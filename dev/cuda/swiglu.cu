/*
dev/cuda/swiglu.cu: the intermediate SwiGLU kernels of dev/cuda/swiglu.py (the last version of
each progression is kernels/swiglu.cu's, launched from there by its real name).

- swiglu_forward_v1: a naive port of llama3_cpu.swiglu_forward, one thread per element, scalar
  loads, exactly n threads: out = fch * fch2 * sigmoid(fch2).
- swiglu_backward_v1: the same for llama3_cpu.swiglu_backward: dfch = dout * silu(fch2),
  dfch2 = dout * fch * sig (1 + fch2 (1 - sig)).
Coalesced (a warp reads 32 consecutive elements), but one 2- or 4-byte load per thread keeps
fewer bytes in flight than the memory system can serve. Both need n < 2^31. Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/swiglu.cu
*/
#include "common.cuh"

extern "C" __global__ void swiglu_forward_v1(floatX* out, const floatX* fch, const floatX* fch2, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float z = (float)fch2[i];
        out[i] = (floatX)((float)fch[i] * z / (1.0f + expf(-z)));
    }
}

extern "C" __global__ void swiglu_backward_v1(floatX* dfch, floatX* dfch2, const floatX* dout, const floatX* fch,
                                              const floatX* fch2, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float z = (float)fch2[i];
        const float sig = 1.0f / (1.0f + expf(-z));
        const float d = (float)dout[i];
        dfch[i] = (floatX)(d * z * sig);                                      // through the linear branch
        dfch2[i] = (floatX)(d * (float)fch[i] * sig * (1.0f + z * (1.0f - sig)));   // through silu
    }
}
