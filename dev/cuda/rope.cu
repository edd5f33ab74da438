/*
dev/cuda/rope.cu: the intermediate RoPE kernels of dev/cuda/rope.py (the last version of each
progression is kernels/rope.cu's, launched from there by its real name).

- rope_forward_v1: a naive port of llama3_cpu.rope_forward, one thread per channel pair
  (x_2i, x_2i+1): two scalar loads of floatX and one each of cos and sin, two scalar stores.
  Adjacent threads read adjacent pairs, so the accesses coalesce; what it lacks is width (2-4
  bytes per load instruction) and it recomputes (b, t, h, i) for every pair.
- rope_backward_v1: the same with the angle negated (llama3_cpu.rope_backward).
Heads h >= n_rot are copied, as in the production kernel (v passes through). Both need
B*T*nh*HS < 2^31. Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/rope.cu
*/
#include "common.cuh"

// the pair `pair` of (B,T,nh,HS/2) pairs, rotated by sin_sign * its angle when its head is below n_rot
__device__ inline void rope_pair_v1(floatX* out, const floatX* inp, const float* freqs_cos, const float* freqs_sin,
                                    int pair, int T, int nh, int n_rot, int HS, float sin_sign) {
    const int half = HS / 2;
    const int i = pair % half;
    const int h = (pair / half) % nh;
    const int t = (pair / (half * nh)) % T;
    const float even = (float)inp[2 * pair];
    const float odd = (float)inp[2 * pair + 1];
    if (h < n_rot) {
        const float cos_angle = freqs_cos[t * half + i];
        const float sin_angle = sin_sign * freqs_sin[t * half + i];
        out[2 * pair] = (floatX)(even * cos_angle - odd * sin_angle);
        out[2 * pair + 1] = (floatX)(even * sin_angle + odd * cos_angle);
    } else {
        out[2 * pair] = (floatX)even;
        out[2 * pair + 1] = (floatX)odd;
    }
}

extern "C" __global__ void rope_forward_v1(floatX* out, const floatX* inp, const float* freqs_cos,
                                           const float* freqs_sin, int B, int T, int nh, int n_rot, int HS) {
    const int pair = blockIdx.x * blockDim.x + threadIdx.x;
    if (pair < B * T * nh * HS / 2) {
        rope_pair_v1(out, inp, freqs_cos, freqs_sin, pair, T, nh, n_rot, HS, 1.0f);
    }
}

extern "C" __global__ void rope_backward_v1(floatX* dinp, const floatX* dout, const float* freqs_cos,
                                            const float* freqs_sin, int B, int T, int nh, int n_rot, int HS) {
    const int pair = blockIdx.x * blockDim.x + threadIdx.x;
    if (pair < B * T * nh * HS / 2) {
        rope_pair_v1(dinp, dout, freqs_cos, freqs_sin, pair, T, nh, n_rot, HS, -1.0f);
    }
}
