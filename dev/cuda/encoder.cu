/*
dev/cuda/encoder.cu: the intermediate encoder kernels of dev/cuda/encoder.py (the last version of
each progression is kernels/encoder.cu's, launched from there by its real name).

- encoder_forward_v1: naive port of gpt2_cpu.encoder_forward, one thread per output element
  (b, t, c): out[b,t,c] = wte[inp[b,t], c] + wpe[t, c], scalar loads. Consecutive threads take
  consecutive c, so the loads coalesce, but each moves only 2 or 4 bytes.
- encoder_backward_v1: naive port of gpt2_cpu.encoder_backward (np.add.at), one thread per
  element of dout: atomicAdd of dout[b,t,c] into fp32 accumulators dwte_acc (Vp,C) and
  dwpe_acc (maxT,C) that the launcher zeroed. fp32 atomics because a bf16 atomicAdd would round
  every partial sum to 8 bits; the order of the atomic adds varies run to run, so the result is
  not bit-reproducible. Repeated tokens and every b of a position contend for the same addresses.
- encoder_backward_accumulate_v1: dwte += dwte_acc, dwpe += dwpe_acc (rounded to floatX once),
  one thread per element of the whole tables: the price of the fp32 accumulators is a pass over
  all Vp*C entries, even those of tokens absent from the batch.
Version 2 of the backward has no kernel of its own: it is kernels/encoder.cu's
encoder_backward_wte given one chunk per token (see dev/cuda/encoder.py).

Compile check: python dev/cuda/nvrtc_compile.py dev/cuda/encoder.cu
*/
#include "common.cuh"

// out (B,T,C) = wte[inp] + wpe[t]: thread i computes out.flat[i]
extern "C" __global__ void encoder_forward_v1(floatX* out, const int* inp, const floatX* wte,
                                              const floatX* wpe, int B, int T, int C) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < B * T * C) {
        const int row = i / C;                  // b*T + t
        const int c = i % C;
        const int t = row % T;
        const int token = inp[row];
        out[i] = (floatX)((float)wte[(size_t)token * C + c] + (float)wpe[t * C + c]);
    }
}

// dwte_acc[inp[b,t], c] += dout[b,t,c] and dwpe_acc[t, c] += dout[b,t,c]: thread i takes dout.flat[i]
extern "C" __global__ void encoder_backward_v1(float* dwte_acc, float* dwpe_acc, const floatX* dout,
                                               const int* inp, int B, int T, int C) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < B * T * C) {
        const int row = i / C;
        const int c = i % C;
        const int t = row % T;
        const float d = (float)dout[i];
        atomicAdd(&dwte_acc[(size_t)inp[row] * C + c], d);
        atomicAdd(&dwpe_acc[t * C + c], d);
    }
}

// dwte (n_wte,) += dwte_acc; dwpe (n_wpe,) += dwpe_acc: thread i takes element i of both tables
extern "C" __global__ void encoder_backward_accumulate_v1(floatX* dwte, floatX* dwpe,
                                                          const float* dwte_acc,
                                                          const float* dwpe_acc,
                                                          int n_wte, int n_wpe) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_wte) {
        dwte[i] = (floatX)((float)dwte[i] + dwte_acc[i]);
    }
    if (i < n_wpe) {
        dwpe[i] = (floatX)((float)dwpe[i] + dwpe_acc[i]);
    }
}
