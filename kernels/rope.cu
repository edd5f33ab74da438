/*
kernels/rope.cu: rotary position embedding (RoPE), forward and backward.

Progression: `python dev/cuda/rope.py` shows the way here; this file is its version 2 of
rope_forward and of rope_backward, each version validated against llama3_cpu.py, then timed
against the GPU's measured limits.

RoPE (Su et al. 2021, eq. 34) rotates each channel pair (x_2i, x_2i+1) of a head at position t by
the angle t * freq_i (llama3_cpu.rope_frequencies: theta^(-2i/HS), with Llama 3.1's scaling):
    out_2i   = x_2i cos - x_2i+1 sin
    out_2i+1 = x_2i sin + x_2i+1 cos
The backward goes through the transpose of that rotation matrix, the rotation by minus the angle
(llama3_cpu.rope_backward): the same code with sin negated, so both kernels call rope_group.

Kernels (inp, out, dout, dinp (B,T,nh,HS) floatX; freqs_cos, freqs_sin (T,HS/2) float, the rows of
positions 0..T-1 of llama3_cpu.precompute_freqs_cis's tables, kept in fp32 because bf16 angles
would be off by ~1% at every position):
- rope_forward: heads h < n_rot of each position are rotated, heads h >= n_rot copied unchanged.
  On the qkv projection (B,T,NH+2NKV,HS) with n_rot = NH+NKV this rotates q and k and passes v
  through, in one pass over the rows.
- rope_backward: the same for the gradient, the rotation by minus the angle.
One thread per x128 group (llm.c dev/cuda's x128 elementwise pattern), grid-stride: a group is
x128::size consecutive channels, an even count starting at an even channel, so it holds whole
pairs, and (HS % x128::size == 0) lies in one head. Each thread reads its group before writing
it, so out may be inp (in place). Any grid and block size. Launcher must check
HS % x128::size == 0, 16-byte aligned floatX pointers, 0 <= n_rot <= nh.
*/
#include "common.cuh"

// The group of x128::size channels starting at flat element `start` of (B,T,nh,HS): rotated by
// the angle of its position and pairs (sin_sign = +1: forward) or minus it (-1: backward) when
// its head is below n_rot, else copied.
__device__ inline void rope_group(floatX* out, const floatX* inp, const float* freqs_cos, const float* freqs_sin,
                                  size_t start, int T, int nh, int n_rot, int HS, float sin_sign) {
    const int c = (int)(start % HS);                            // first channel of the group in its head
    const size_t head = start / HS;                             // flat (b, t, h) index
    const int h = (int)(head % nh);
    const int t = (int)((head / nh) % T);
    x128 x = load128cs(inp + start);
    if (h < n_rot) {
        const float* cos_row = freqs_cos + (size_t)t * (HS / 2);
        const float* sin_row = freqs_sin + (size_t)t * (HS / 2);
        for (int k = 0; k < x128::size; k += 2) {
            const int i = (c + k) / 2;                          // the pair's frequency index
            const float cos_angle = cos_row[i];
            const float sin_angle = sin_sign * sin_row[i];
            const float even = (float)x[k];
            const float odd = (float)x[k + 1];
            x[k] = (floatX)(even * cos_angle - odd * sin_angle);
            x[k + 1] = (floatX)(even * sin_angle + odd * cos_angle);
        }
    }
    store128(out + start, x);
}

// out (B,T,nh,HS) = inp with heads h < n_rot rotated by the angles of their position
extern "C" __global__ void rope_forward(floatX* out, const floatX* inp, const float* freqs_cos,
                                        const float* freqs_sin, int B, int T, int nh, int n_rot, int HS) {
    const size_t num_groups = (size_t)B * T * nh * HS / x128::size;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        rope_group(out, inp, freqs_cos, freqs_sin, g * x128::size, T, nh, n_rot, HS, 1.0f);
    }
}

// dinp (B,T,nh,HS) = dout with heads h < n_rot rotated back, by minus the angles (R^T = R(-angle))
extern "C" __global__ void rope_backward(floatX* dinp, const floatX* dout, const float* freqs_cos,
                                         const float* freqs_sin, int B, int T, int nh, int n_rot, int HS) {
    const size_t num_groups = (size_t)B * T * nh * HS / x128::size;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        rope_group(dinp, dout, freqs_cos, freqs_sin, g * x128::size, T, nh, n_rot, HS, -1.0f);
    }
}
