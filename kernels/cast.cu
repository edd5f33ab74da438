/*
kernels/cast.cu: conversions between float and floatX.

Kernels (n elements, grid-stride, any grid and block size, any alignment):
- cast_float_to_floatX: out = round-to-nearest-even(inp) (bf16 build) or a copy (fp32 build).
  Used when parameters enter the GPU (from a float32 checkpoint or the init) and for the
  master-weight copy; stochastic rounding belongs to AdamW, not here.
- cast_floatX_to_float: exact (every bf16 is a float).
Not hot paths (once per run or per checkpoint), so scalar loads keep them alignment-free;
consecutive threads still touch consecutive elements, so the accesses coalesce.
*/
#include "common.cuh"

// out (n,) floatX = inp (n,) float, rounded to nearest even
extern "C" __global__ void cast_float_to_floatX(floatX* out, const float* inp, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
#if defined(ENABLE_BF16)
        out[i] = __float2bfloat16_rn(inp[i]);
#else
        out[i] = inp[i];
#endif
    }
}

// out (n,) float = inp (n,) floatX
extern "C" __global__ void cast_floatX_to_float(float* out, const floatX* inp, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = (float)inp[i];
    }
}
