/*
kernels/encoder.cu: token + position embedding, forward and backward.

Progression: `python dev/cuda/encoder.py` shows the way here; this file is its version 2 of
encoder_forward and version 3 of encoder_backward, each version validated against gpt2_cpu.py,
then timed against the GPU's measured limits.

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
  (stable sort), so each token's positions form one run, and cuts each run into chunks of at most
  WTE_CHUNK_ROWS positions (gpt2_cuda.encoder_backward_segments). One block owns one chunk and
  sums its dout rows in position order in fp32: a token that is 4% of a batch (330 rows of 8192)
  is then 11 blocks of at most 32 rows, not one serial tail. A token's only chunk adds its sum into dwte directly;
  the chunks of a token with several write their sums to fp32 rows of `partial` (chunk_slot).
  Grid-stride over chunks; threads stride over the x128 groups of C.
- encoder_backward_wte_reduce: one block per token with several chunks, adding its partial rows
  in chunk order (hence in position order) and then into dwte once: deterministic.

Launcher must check: C % x128::size == 0 (8 in bf16, 4 in fp32) and 16-byte aligned pointers
(wte/wpe/dwte/dwpe views at element offsets that are multiples of x128::size); for
encoder_backward_wte, a token's single chunk (chunk_slot -1) never shares its dwte row with
another chunk or a reduce block, chunk_start[num_chunks] == N, and partial holds C floats for
every slot. Any block size (no warp-level code here).
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

// dwte (Vp,C), chunk by chunk: chunk k (a run of at most WTE_CHUNK_ROWS positions of one token,
// positions[chunk_start[k]:chunk_start[k+1]]) sums its dout rows in position order, then
//     chunk_slot[k] <  0:  dwte[chunk_token[k], :] += the sum   (the token's only chunk)
//     chunk_slot[k] >= 0:  partial[chunk_slot[k], :] = the sum  (encoder_backward_wte_reduce adds them)
// An empty chunk (chunk_start[k] == chunk_start[k+1]) is skipped before its token is read:
// gpt2_cuda pads the chunks to N with empty ones so that a captured CUDA graph's launch has fixed
// arguments.
extern "C" __global__ void encoder_backward_wte(floatX* dwte, float* partial, const floatX* dout,
                                                const int* positions, const int* chunk_start,
                                                const int* chunk_token, const int* chunk_slot,
                                                int num_chunks, int C) {
    const int groups_per_row = C / x128::size;
    for (int chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
        const int begin = chunk_start[chunk];
        const int end = chunk_start[chunk + 1];
        if (begin == end) {
            continue;      // an empty chunk (the padding of a CUDA graph's fixed grid): no token
        }
        const int slot = chunk_slot[chunk];
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
            if (slot < 0) {
                floatX* dwte_row = dwte + (size_t)chunk_token[chunk] * C;
                x128 dwte_group = load128(dwte_row + c);
                for (int k = 0; k < x128::size; k++) {
                    dwte_group[k] = (floatX)((float)dwte_group[k] + sums[k]);
                }
                store128(dwte_row + c, dwte_group);
            } else {
                float* partial_row = partial + (size_t)slot * C;
                for (int k = 0; k < x128::size; k++) {
                    partial_row[c + k] = sums[k];
                }
            }
        }
    }
}

// dwte (Vp,C): for each token m with several chunks, in chunk order (= position order),
//     dwte[reduce_token[m], :] += sum over slots reduce_start[m] .. reduce_start[m+1]-1 of partial[slot, :]
// Empty ranges (the CUDA graph's padding) are skipped.
extern "C" __global__ void encoder_backward_wte_reduce(floatX* dwte, const float* partial,
                                                       const int* reduce_start, const int* reduce_token,
                                                       int num_reduce, int C) {
    const int groups_per_row = C / x128::size;
    for (int m = blockIdx.x; m < num_reduce; m += gridDim.x) {
        const int begin = reduce_start[m];
        const int end = reduce_start[m + 1];
        if (begin == end) {
            continue;
        }
        floatX* dwte_row = dwte + (size_t)reduce_token[m] * C;
        for (int group = threadIdx.x; group < groups_per_row; group += blockDim.x) {
            const int c = group * x128::size;
            float sums[x128::size];
            for (int k = 0; k < x128::size; k++) {
                sums[k] = 0.0f;
            }
            for (int slot = begin; slot < end; slot++) {
                const float* partial_row = partial + (size_t)slot * C;
                for (int k = 0; k < x128::size; k++) {
                    sums[k] += partial_row[c + k];
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
