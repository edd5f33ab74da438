/*
kernels/repeat_kv.cu: grouped-query attention's K/V repeat (Ainslie et al. 2023), forward and
backward, on the layout of the qkv projection.

Grouped-query attention keeps NKV < NH key/value heads, each serving n_rep = NH/NKV consecutive
query heads (llama3_cpu.repeat_kv_forward). Repeating k and v to NH heads turns the projection
(B,T,NH+2NKV,HS) = [q heads | k heads | v heads] into GPT-2's attention input (B,T,3,NH,HS), so
that everything after it is GPT-2's attention (kernels/attention.cu, flash_attention.cu):
    out[b,t,0,h] = inp[b,t,h]                              q: copied
    out[b,t,1,h] = inp[b,t,NH + h/n_rep]                   k: kv head h/n_rep repeated
    out[b,t,2,h] = inp[b,t,NH + NKV + h/n_rep]             v: likewise
A kv head feeds n_rep query heads, so its gradient is the sum of theirs (llama3_cpu.repeat_kv_backward):
    dinp[b,t,h]            = dout[b,t,0,h]
    dinp[b,t,NH + j]       = sum_r dout[b,t,1,j*n_rep + r],   r = 0..n_rep-1
    dinp[b,t,NH + NKV + j] = sum_r dout[b,t,2,j*n_rep + r]
It is its own file, not in kernels/attention.cu: only Llama 3 compiles and launches it.

Kernels (inp, dinp (B,T,NH+2NKV,HS) floatX; out, dout (B,T,3,NH,HS) floatX):
- repeat_kv_forward: a gather, one thread per x128 group of out; reads are of whole groups of
  inp (HS % x128::size == 0: a group never straddles two heads).
- repeat_kv_backward: one thread per x128 group of dinp; a k or v group sums its n_rep source
  groups in fp32, in order r = 0..n_rep-1 (deterministic, no atomics: each dinp group has one
  writer), and writes (=).
Both grid-stride: any grid and block size. Launcher must check NH % NKV == 0, HS % x128::size == 0
and 16-byte aligned pointers.
*/
#include "common.cuh"

// out (B,T,3,NH,HS) = [q, repeat(k), repeat(v)] from inp (B,T,NH+2NKV,HS)
extern "C" __global__ void repeat_kv_forward(floatX* out, const floatX* inp, int B, int T, int NH, int NKV,
                                             int HS) {
    const int n_rep = NH / NKV;
    const int groups_per_head = HS / x128::size;
    const size_t num_groups = (size_t)B * T * 3 * NH * groups_per_head;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const int group_in_head = (int)(g % groups_per_head);
        const int out_head = (int)((g / groups_per_head) % (3 * NH));      // 0..3NH-1: section * NH + h
        const size_t bt = g / ((size_t)groups_per_head * 3 * NH);          // flat (b, t)
        const int section = out_head / NH;                                 // 0 q, 1 k, 2 v
        const int h = out_head % NH;
        const int inp_head = section == 0 ? h : NH + (section - 1) * NKV + h / n_rep;
        const floatX* source = inp + (bt * (NH + 2 * NKV) + inp_head) * HS + group_in_head * x128::size;
        store128(out + g * x128::size, load128(source));
    }
}

// dinp (B,T,NH+2NKV,HS) from dout (B,T,3,NH,HS): q copied, each kv head the sum of its n_rep query heads'
extern "C" __global__ void repeat_kv_backward(floatX* dinp, const floatX* dout, int B, int T, int NH, int NKV,
                                              int HS) {
    const int n_rep = NH / NKV;
    const int groups_per_head = HS / x128::size;
    const int heads = NH + 2 * NKV;
    const size_t num_groups = (size_t)B * T * heads * groups_per_head;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const int group_in_head = (int)(g % groups_per_head);
        const int inp_head = (int)((g / groups_per_head) % heads);
        const size_t bt = g / ((size_t)groups_per_head * heads);
        const floatX* dout_row = dout + bt * 3 * NH * HS + group_in_head * x128::size;
        if (inp_head < NH) {                                               // a query head: its own gradient
            store128(dinp + g * x128::size, load128(dout_row + (size_t)inp_head * HS));
            continue;
        }
        const int section = inp_head < NH + NKV ? 1 : 2;                   // k or v
        const int j = inp_head - NH - (section - 1) * NKV;                 // the kv head
        float sum[x128::size];
        for (int k = 0; k < x128::size; k++) {
            sum[k] = 0.0f;
        }
        for (int r = 0; r < n_rep; r++) {
            const x128 d = load128(dout_row + (size_t)(section * NH + j * n_rep + r) * HS);
            for (int k = 0; k < x128::size; k++) {
                sum[k] += (float)d[k];
            }
        }
        x128 dinp_group;
        for (int k = 0; k < x128::size; k++) {
            dinp_group[k] = (floatX)sum[k];
        }
        store128(dinp + g * x128::size, dinp_group);
    }
}
