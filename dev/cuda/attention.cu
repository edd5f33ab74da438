/*
dev/cuda/attention.cu: the naive attention kernels of dev/cuda/attention.py (version 1). The
other versions are the trainer's materialized path (kernels/attention.cu + cuBLAS), our flash
attention (kernels/flash_attention.cu), cuDNN and PyTorch, all launched from attention.py.

Causal self-attention on the fused projection qkv (B,T,3C) = [q | k | v], NH heads of HS = C/NH
channels, s = 1/sqrt(HS) (gpt2_cpu.attention_forward / attention_backward):
    att[t, t2] = softmax over t2 <= t of s q_t . k_t2      (0 for t2 > t: the causal mask)
    out[t]     = sum over t2 of att[t, t2] v_t2

- attention_forward_v1: one thread per query row (b, h, t), the loops of gpt2_cpu's forward for
  that row written out (llm.c's attention_forward_cpu): scores and their max, exponentials and
  their sum, normalization, then each output channel as a dot product down a column of v. att is
  kept, in fp32 (B,NH,T,T), for the backward, with zeros above the diagonal as gpt2_cpu's.
  Why it is slow: a thread does O(T*HS) work alone, reading every k and v row of its head from
  global memory with scalar loads (the warp's 32 threads are 32 consecutive queries of one head,
  so those loads are broadcasts served by L1: little reuse beyond that); the att row round-trips
  through global memory three times; and threads of late queries loop longer than early ones
  (the causal triangle), so warps idle.
- attention_backward_v1: one thread per query row, the backward of that row:
      datt[t2]    = dout_t . v_t2
      dpreatt[t2] = att[t2] (datt[t2] - sum_j att[j] datt[j])          (softmax Jacobian)
      dq_t       += s dpreatt[t2] k_t2      (this thread's own row: a plain add)
      dk_t2      += s dpreatt[t2] q_t       (every query t >= t2 adds here: atomicAdd)
      dv_t2      += att[t2] dout_t          (likewise)
  into fp32 accumulators dqkv_acc (B,T,3C) that the launcher zeroed, then
  attention_backward_cast_v1 rounds them to floatX once. datt is recomputed in the second pass
  instead of being stored (a second T*T buffer). fp32 atomics because bf16 ones would round every
  partial sum; their order varies run to run, so the result is not bit-reproducible. The
  atomics, B*NH*T*(T+1)/2 * 2*HS of them, dominate its time.

Indices are int (B*NH*T rows) with size_t element offsets (B*NH*T*T passes 2^31 at the 124M
shape). Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/attention.cu
*/
#include "common.cuh"

// The (b, h, t) of thread `row` = (b*NH + h)*T + t, and the rows of qkv it reads.
struct QueryRow {
    int b, h, t;
    size_t att;                    // offset of its att row, (B,NH,T,T)
};

__device__ inline QueryRow query_row(int row, int NH, int T) {
    QueryRow r;
    r.t = row % T;
    r.h = (row / T) % NH;
    r.b = row / (NH * T);
    r.att = (size_t)row * T;
    return r;
}

// offset of head h's channels of section 0 (q), 1 (k) or 2 (v) at position t of batch b in qkv
__device__ inline size_t qkv_offset(int b, int t, int section, int h, int T, int NH, int HS) {
    const int C = NH * HS;
    return ((size_t)b * T + t) * 3 * C + section * C + h * HS;
}

__device__ inline float dot_floatX(const floatX* x, const floatX* y, int n) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        sum += (float)x[i] * (float)y[i];
    }
    return sum;
}

// ----------------------------------------------------------------------------
// version 1, forward

// grid ceil(B*NH*T / blockDim.x): thread `row` computes out[b, t, h*HS : (h+1)*HS] and att[b,h,t,:]
extern "C" __global__ void attention_forward_v1(floatX* out, float* att, const floatX* qkv,
                                                int B, int T, int NH, int HS) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NH * T) {
        return;
    }
    const QueryRow r = query_row(row, NH, T);
    const float scale = rsqrtf((float)HS);
    const floatX* q = qkv + qkv_offset(r.b, r.t, 0, r.h, T, NH, HS);
    float* att_row = att + r.att;

    // pass 1: scores s q . k_t2 of the keys t2 <= t (later keys are never read: the mask) and their max
    float maxval = NEGATIVE_INFINITY;
    for (int t2 = 0; t2 <= r.t; t2++) {
        const float score = scale * dot_floatX(q, qkv + qkv_offset(r.b, t2, 1, r.h, T, NH, HS), HS);
        att_row[t2] = score;
        maxval = fmaxf(maxval, score);
    }
    // pass 2: exp(score - max) (the diagonal is never masked: max is finite, every exp <= 1) and their sum
    float sum = 0.0f;
    for (int t2 = 0; t2 <= r.t; t2++) {
        const float e = expf(att_row[t2] - maxval);
        att_row[t2] = e;
        sum += e;
    }
    // pass 3: normalize; masked keys get probability 0, as in gpt2_cpu (the backward reads them)
    const float inv_sum = 1.0f / sum;
    for (int t2 = 0; t2 < T; t2++) {
        att_row[t2] = t2 <= r.t ? att_row[t2] * inv_sum : 0.0f;
    }
    // pass 4: out_t = att_row @ v, one output channel at a time
    floatX* out_row = out + ((size_t)r.b * T + r.t) * NH * HS + r.h * HS;
    for (int i = 0; i < HS; i++) {
        float value = 0.0f;
        for (int t2 = 0; t2 <= r.t; t2++) {
            value += att_row[t2] * (float)qkv[qkv_offset(r.b, t2, 2, r.h, T, NH, HS) + i];
        }
        out_row[i] = (floatX)value;
    }
}

// ----------------------------------------------------------------------------
// version 1, backward

// grid ceil(B*NH*T / blockDim.x): thread `row` adds its query's terms to dqkv_acc (B,T,3C) fp32,
// zeroed by the launcher. att (B,NH,T,T) fp32 from attention_forward_v1 (or gpt2_cpu).
extern "C" __global__ void attention_backward_v1(float* dqkv_acc, const floatX* dout, const floatX* qkv,
                                                 const float* att, int B, int T, int NH, int HS) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= B * NH * T) {
        return;
    }
    const QueryRow r = query_row(row, NH, T);
    const float scale = rsqrtf((float)HS);
    const floatX* q = qkv + qkv_offset(r.b, r.t, 0, r.h, T, NH, HS);
    const floatX* dout_row = dout + ((size_t)r.b * T + r.t) * NH * HS + r.h * HS;
    const float* att_row = att + r.att;

    // pass 1: the softmax Jacobian's shared term, sum_j att[j] datt[j], datt[j] = dout_t . v_j
    float att_datt = 0.0f;
    for (int t2 = 0; t2 <= r.t; t2++) {
        att_datt += att_row[t2] * dot_floatX(dout_row, qkv + qkv_offset(r.b, t2, 2, r.h, T, NH, HS), HS);
    }
    // pass 2: per key t2 <= t (masked keys have att = 0, so dpreatt = 0: nothing to add)
    float* dq = dqkv_acc + qkv_offset(r.b, r.t, 0, r.h, T, NH, HS);
    for (int t2 = 0; t2 <= r.t; t2++) {
        const floatX* k = qkv + qkv_offset(r.b, t2, 1, r.h, T, NH, HS);
        const floatX* v = qkv + qkv_offset(r.b, t2, 2, r.h, T, NH, HS);
        float* dk = dqkv_acc + qkv_offset(r.b, t2, 1, r.h, T, NH, HS);
        float* dv = dqkv_acc + qkv_offset(r.b, t2, 2, r.h, T, NH, HS);
        const float datt = dot_floatX(dout_row, v, HS);          // recomputed, not stored
        const float dpreatt = att_row[t2] * (datt - att_datt);
        for (int i = 0; i < HS; i++) {
            dq[i] += scale * dpreatt * (float)k[i];
            atomicAdd(&dk[i], scale * dpreatt * (float)q[i]);
            atomicAdd(&dv[i], att_row[t2] * (float)dout_row[i]);
        }
    }
}

// dinp (n,) = (floatX) dqkv_acc (n,): thread i rounds element i, once
extern "C" __global__ void attention_backward_cast_v1(floatX* dinp, const float* dqkv_acc, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        dinp[i] = (floatX)dqkv_acc[i];
    }
}
