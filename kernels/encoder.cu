/*
kernels/encoder.cu: token + position embedding, forward and backward.

Progression: `python dev/cuda/encoder.py` shows the way here; this file is its version 2 of
encoder_forward and of encoder_backward, each version validated against gpt2_cpu.py, then timed
against the GPU's measured limits. The share of the limit these kernels reach is not measured yet:
they have not run on a GPU.

    forward:  out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
    backward: dwte[v,:] += sum over all (b,t) with inp[b,t] == v of dout[b,t,:]
              dwpe[t,:] += sum_b dout[b,t,:]

Kernels (N = B*T rows; inp (B,T) int32; wte (Vp,C); wpe (maxT,C); out, dout (B,T,C)):
- encoder_forward: llm.c dev/cuda/encoder_forward.cu version 3 (one thread per x128 group of
  channels). Grid-stride over the N*C/x128::size groups: any grid is correct.
- encoder_backward_wpe: one thread per (t, x128 group of channels), summing over b in order
  b = 0..B-1, so the result is deterministic (dev/cuda/encoder_backward.cu versions 1/2 use
  atomics instead; train_gpt2.cu's deterministic wpe kernel has this shape). Grid-stride over
  T*C/x128::size groups.
- encoder_backward_wte: deterministic scatter-add without atomics, the bucketing idea of
  llm.c's train_gpt2.cu encoder_backward: the host sorts the flat positions p = b*T+t by token id
  (stable sort), so each token's positions form one segment; one block owns one segment and sums
  its dout rows in position order in fp32. Grid-stride over segments; threads stride over the
  x128 groups of C.

Launcher must check: C % x128::size == 0 (8 in bf16, 4 in fp32) and 16-byte aligned pointers
(wte/wpe/dwte/dwpe views at element offsets that are multiples of x128::size); for
encoder_backward_wte, seg_token entries distinct (two blocks must never write the same dwte
row) and seg_start[num_segments] == N. Any block size (no warp-level code here).
*/
#include "common.cuh"

// out (N,C) = wte[inp] + wpe[t]; one thread per x128 group, grid-stride
extern "C" __global__ void encoder_forward(floatX* out, const int* inp, const floatX* wte,
                                           const floatX* wpe, int B, int T, int C) {
    const size_t groups_per_row = C / x128::size;
    const size_t num_groups = (size_t)B * T * groups_per_row;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t row = g / groups_per_row;          // b*T + t
        const int c = (int)(g % groups_per_row) * x128::size;
        const int t = (int)(row % T);
        const int token = inp[row];
        const x128 wte_group = load128(wte + (size_t)token * C + c);
        const x128 wpe_group = load128(wpe + (size_t)t * C + c);
        x128 out_group;
        for (int k = 0; k < x128::size; k++) {
            out_group[k] = (floatX)((float)wte_group[k] + (float)wpe_group[k]);
        }
        store128(out + row * C + c, out_group);
    }
}

// dwpe (maxT,C) += sum_b dout[b,t,:], over t < T; b summed in order 0..B-1 (deterministic)
extern "C" __global__ void encoder_backward_wpe(floatX* dwpe, const floatX* dout,
                                                int B, int T, int C) {
    const size_t groups_per_row = C / x128::size;
    const size_t num_groups = (size_t)T * groups_per_row;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t t = g / groups_per_row;
        const int c = (int)(g % groups_per_row) * x128::size;
        float sums[x128::size];
        for (int k = 0; k < x128::size; k++) {
            sums[k] = 0.0f;
        }
        for (int b = 0; b < B; b++) {
            const x128 dout_group = load128(dout + ((size_t)b * T + t) * C + c);
            for (int k = 0; k < x128::size; k++) {
                sums[k] += (float)dout_group[k];
            }
        }
        x128 dwpe_group = load128(dwpe + t * C + c);
        for (int k = 0; k < x128::size; k++) {
            dwpe_group[k] = (floatX)((float)dwpe_group[k] + sums[k]);
        }
        store128(dwpe + t * C + c, dwpe_group);
    }
}

// dwte (Vp,C): for each segment s (a distinct token seg_token[s]),
//     dwte[seg_token[s], :] += sum over j in [seg_start[s], seg_start[s+1]) of dout[positions[j], :]
// positions (N,) are the flat positions b*T+t sorted (stably) by token id, so the sum runs in
// increasing position order: the same order every run, hence deterministic. An empty segment
// (seg_start[s] == seg_start[s+1]) is skipped before its seg_token is read: gpt2_cuda pads the
// segments to N with empty ones so that a captured CUDA graph's launch has fixed arguments.
extern "C" __global__ void encoder_backward_wte(floatX* dwte, const floatX* dout,
                                                const int* positions, const int* seg_start,
                                                const int* seg_token, int num_segments, int C) {
    const int groups_per_row = C / x128::size;
    for (int s = blockIdx.x; s < num_segments; s += gridDim.x) {
        const int begin = seg_start[s];
        const int end = seg_start[s + 1];
        if (begin == end) {
            continue;      // an empty segment (the padding of a CUDA graph's fixed grid): no token
        }
        floatX* dwte_row = dwte + (size_t)seg_token[s] * C;
        for (int group = threadIdx.x; group < groups_per_row; group += blockDim.x) {
            const int c = group * x128::size;
            float sums[x128::size];
            for (int k = 0; k < x128::size; k++) {
                sums[k] = 0.0f;
            }
            for (int j = begin; j < end; j++) {
                const x128 dout_group = load128(dout + (size_t)positions[j] * C + c);
                for (int k = 0; k < x128::size; k++) {
                    sums[k] += (float)dout_group[k];
                }
            }
            x128 dwte_group = load128(dwte_row + c);
            for (int k = 0; k < x128::size; k++) {
                dwte_group[k] = (floatX)((float)dwte_group[k] + sums[k]);
            }
            store128(dwte_row + c, dwte_group);
        }
    }
}
