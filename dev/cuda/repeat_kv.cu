/*
dev/cuda/repeat_kv.cu: the intermediate K/V-repeat kernels of dev/cuda/repeat_kv.py (the last
version of each progression is kernels/repeat_kv.cu's, launched from there by its real name).

- repeat_kv_forward_v1: a naive port of llama3_cpu.repeat_kv_forward on the qkv layout, one
  thread per element of out (B,T,3,NH,HS): it splits its index into (b, t, section, h, c) and
  copies one scalar from inp (B,T,NH+2NKV,HS). Coalesced, but one 2- or 4-byte access per thread.
- repeat_kv_backward_v1: the naive port of llama3_cpu.repeat_kv_backward, one thread per element
  of dinp: a q element copies its gradient, a k or v element sums the n_rep query heads' scalars.
Both need B*T*3*NH*HS < 2^31. Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/repeat_kv.cu
*/
#include "common.cuh"

extern "C" __global__ void repeat_kv_forward_v1(floatX* out, const floatX* inp, int B, int T, int NH, int NKV,
                                                int HS) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B * T * 3 * NH * HS) {
        return;
    }
    const int c = i % HS;
    const int out_head = (i / HS) % (3 * NH);          // section * NH + h
    const int bt = i / (HS * 3 * NH);
    const int section = out_head / NH, h = out_head % NH;
    const int inp_head = section == 0 ? h : NH + (section - 1) * NKV + h / (NH / NKV);
    out[i] = inp[((size_t)bt * (NH + 2 * NKV) + inp_head) * HS + c];
}

extern "C" __global__ void repeat_kv_backward_v1(floatX* dinp, const floatX* dout, int B, int T, int NH, int NKV,
                                                 int HS) {
    const int heads = NH + 2 * NKV;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= B * T * heads * HS) {
        return;
    }
    const int c = i % HS;
    const int inp_head = (i / HS) % heads;
    const int bt = i / (HS * heads);
    const floatX* dout_row = dout + (size_t)bt * 3 * NH * HS + c;
    if (inp_head < NH) {
        dinp[i] = dout_row[inp_head * HS];
        return;
    }
    const int n_rep = NH / NKV;
    const int section = inp_head < NH + NKV ? 1 : 2;
    const int j = inp_head - NH - (section - 1) * NKV;
    float sum = 0.0f;
    for (int r = 0; r < n_rep; r++) {
        sum += (float)dout_row[(section * NH + j * n_rep + r) * HS];
    }
    dinp[i] = (floatX)sum;
}
