/*
kernels/attention.cu: the hand-written parts of causal multi-head attention (no cuDNN).

Progression: `python dev/cuda/attention.py` shows the way here; this file is its version 2 (with
cuBLAS) of the attention forward and backward, each version validated against gpt2_cpu.py, then
timed against the GPU's measured limits.

The forward, as in llm.c dev/cuda/attention_forward.cu version 4 (permute, cuBLAS batched
matmul, softmax, cuBLAS batched matmul, unpermute); the two products are cuBLAS calls made by
gpt2_cuda.py:
    permute_qkv:      qkv (B,T,3,NH,HS) -> q, k, v each (B,NH,T,HS)
    [cuBLAS]          preatt = q @ k^T                         (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    softmax_forward:  att[t,j] = softmax_j(scale * preatt[t,j]) over j <= t, 0 for j > t,
                      scale = 1/sqrt(HS)
    [cuBLAS]          y = att @ v                              (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    unpermute:        y (B,NH,T,HS) -> out (B,T,NH*HS)
The backward walks it in reverse (dev/cuda/attention_backward.cu):
    unpermute_backward:   dout (B,T,C) -> dy (B,NH,T,HS)
    [cuBLAS]              datt = dy @ v^T,  dv = att^T @ dy
    softmax_backward:     a = softmax(s x) has da_i/dx_j = s a_i ([i==j] - a_j), so
                              dpreatt[t,j] = s * a[t,j] * (datt[t,j] - sum_{i<=t} datt[t,i] a[t,i])
                          for j <= t, and 0 above the diagonal (masked: no gradient)
    [cuBLAS]              dq = dpreatt @ k,  dk = dpreatt^T @ q   (s is already in dpreatt:
                          these products must not scale again)
    permute_qkv_backward: dq, dk, dv (B,NH,T,HS) -> dqkv (B,T,3,NH,HS)
All four permutes write (=), they never accumulate.

Kernels and launch assumptions:
- permute_qkv, permute_qkv_backward, unpermute, unpermute_backward: llm.c's permute_kernel /
  unpermute_kernel (attention_forward.cu version 4) with x128 groups along HS. Grid-stride over
  the B*NH*T*HS/x128::size groups; any grid and block size. Each thread splits its group's flat
  index into (b, nh, t, hs) with the shared helper head_coords, then copies the group (three
  groups for the qkv permutes) between the (B,NH,T,HS) and (B,T,NH,HS) layouts. Since
  HS % x128::size == 0, a group never straddles two heads, so it is contiguous in both.
  Launcher must check HS % x128::size == 0 and 16-byte aligned pointers.
- softmax_forward, softmax_backward: one warp per row of the (BNH*T, T) matrix (row r is query
  position t = r % T), grid-stride over rows; blockDim.x a multiple of 32. The forward keeps an
  online max/sum (softmax_forward.cu's online-softmax versions, attention_forward.cu
  softmax_forward_kernel5's causal skip: columns past t are never read). Each lane reads and
  writes only its own groups, and all reads of a row finish before the warp reduction that
  precedes the writes, so both may run in place (att == preatt, dpreatt == datt). x128 groups
  when T % x128::size == 0 (row starts then stay 16-byte aligned), else a scalar path.
*/
#include "common.cuh"

// ----------------------------------------------------------------------------
// permutes: (B,T,3,NH,HS) <-> 3 x (B,NH,T,HS), (B,NH,T,HS) <-> (B,T,NH,HS)

// The permutes move each element (b, nh, t, hs) between two layouts of the same values:
//   HEADS_FIRST (B,NH,T,HS): q, k, v, y and their gradients; each head's (T,HS) matrix is
//                            contiguous, which is what the batched matmuls need
//   HEADS_LAST  (B,T,NH,HS): the rows of qkv (B,T,3,NH,HS) and of out (B,T,C = NH*HS), the
//                            layout of the linear layers around attention
enum HeadLayout { HEADS_FIRST, HEADS_LAST };

struct HeadCoords {
    size_t b, nh, t, hs;
};

// Split the flat index idx of a row-major tensor in `layout` into its (b, nh, t, hs). Each
// kernel loops over the tensor it writes contiguously (or reads, for permute_qkv_backward) and
// finds the element's place in the other layout from these coordinates. size_t: B*NH*T*HS can
// exceed 2^31.
__device__ inline HeadCoords head_coords(size_t idx, HeadLayout layout, int T, int NH, int HS) {
    HeadCoords e;
    e.hs = idx % HS;
    if (layout == HEADS_FIRST) {
        e.t = (idx / HS) % T;
        e.nh = (idx / ((size_t)HS * T)) % NH;
        e.b = idx / ((size_t)HS * T * NH);
    } else {
        e.nh = (idx / HS) % NH;
        e.t = (idx / ((size_t)HS * NH)) % T;
        e.b = idx / ((size_t)HS * NH * T);
    }
    return e;
}

// q, k, v (B,NH,T,HS) = inp (B,T,3,NH,HS) split and transposed
extern "C" __global__ void permute_qkv(floatX* q, floatX* k, floatX* v, const floatX* inp,
                                       int B, int T, int NH, int HS) {
    const size_t num_groups = (size_t)B * NH * T * HS / x128::size;
    const size_t C = (size_t)NH * HS;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t idx = g * x128::size;           // index into (B,NH,T,HS)
        const HeadCoords e = head_coords(idx, HEADS_FIRST, T, NH, HS);
        const size_t inp_idx = (e.b * T + e.t) * 3 * C + e.nh * HS + e.hs;   // (b, t, 0, nh, hs)
        store128(q + idx, load128cs(inp + inp_idx));
        store128(k + idx, load128cs(inp + inp_idx + C));
        store128(v + idx, load128cs(inp + inp_idx + 2 * C));
    }
}

// dinp (B,T,3,NH,HS) = dq, dk, dv (B,NH,T,HS) transposed back and interleaved (written)
extern "C" __global__ void permute_qkv_backward(floatX* dinp, const floatX* dq, const floatX* dk,
                                                const floatX* dv, int B, int T, int NH, int HS) {
    const size_t num_groups = (size_t)B * NH * T * HS / x128::size;
    const size_t C = (size_t)NH * HS;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t idx = g * x128::size;           // index into (B,NH,T,HS)
        const HeadCoords e = head_coords(idx, HEADS_FIRST, T, NH, HS);
        const size_t inp_idx = (e.b * T + e.t) * 3 * C + e.nh * HS + e.hs;   // (b, t, 0, nh, hs)
        store128(dinp + inp_idx, load128cs(dq + idx));
        store128(dinp + inp_idx + C, load128cs(dk + idx));
        store128(dinp + inp_idx + 2 * C, load128cs(dv + idx));
    }
}

// out (B,T,NH,HS) = inp (B,NH,T,HS) transposed: the heads side by side again.
// Indexed by the output so that the writes are contiguous.
extern "C" __global__ void unpermute(floatX* out, const floatX* inp, int B, int T, int NH, int HS) {
    const size_t num_groups = (size_t)B * T * NH * HS / x128::size;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t idx = g * x128::size;           // index into (B,T,NH,HS)
        const HeadCoords e = head_coords(idx, HEADS_LAST, T, NH, HS);
        store128(out + idx, load128cs(inp + ((e.b * NH + e.nh) * T + e.t) * HS + e.hs));
    }
}

// dinp (B,NH,T,HS) = dout (B,T,NH,HS) transposed (written). Indexed by dinp: contiguous writes.
extern "C" __global__ void unpermute_backward(floatX* dinp, const floatX* dout, int B, int T,
                                              int NH, int HS) {
    const size_t num_groups = (size_t)B * NH * T * HS / x128::size;
    for (size_t g = blockIdx.x * (size_t)blockDim.x + threadIdx.x; g < num_groups;
         g += (size_t)gridDim.x * blockDim.x) {
        const size_t idx = g * x128::size;           // index into (B,NH,T,HS)
        const HeadCoords e = head_coords(idx, HEADS_FIRST, T, NH, HS);
        store128(dinp + idx, load128cs(dout + ((e.b * T + e.t) * NH + e.nh) * HS + e.hs));
    }
}

// ----------------------------------------------------------------------------
// causal softmax, one warp per row

template <int WIDTH>
__device__ void softmax_forward_rows(floatX* att, const floatX* preatt, float scale, int BNH, int T) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int num_rows = BNH * T;
    const int lane_stride = WARP_SIZE * WIDTH;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / WARP_SIZE; row < num_rows;
         row += gridDim.x * warps_per_block) {
        const int t = row % T;                       // query position: columns 0..t are visible
        const floatX* x = preatt + (size_t)row * T;
        floatX* y = att + (size_t)row * T;
        // pass 1: online max and sum of exp over the visible columns only
        SoftmaxState state = softmax_state_empty();
        for (int c = lane * WIDTH; c <= t; c += lane_stride) {
            float values[WIDTH];
            load_group<WIDTH>(values, x + c);
            for (int k = 0; k < WIDTH; k++) {
                if (c + k <= t) {
                    state = softmax_state_add(state, scale * values[k]);
                }
            }
        }
        state = warpReduceSoftmax(state);            // column t is visible, so sum >= 1
        const float inv_sum = 1.0f / state.sum;
        // pass 2: normalize the visible columns, write 0 above the diagonal
        for (int c = lane * WIDTH; c < T; c += lane_stride) {
            float values[WIDTH];
            if (c <= t) {
                load_group<WIDTH>(values, x + c);
            }
            for (int k = 0; k < WIDTH; k++) {
                values[k] = (c + k <= t) ? expf(scale * values[k] - state.max) * inv_sum : 0.0f;
            }
            store_group<WIDTH>(y + c, values);
        }
    }
}

// att (BNH,T,T) = causal softmax of scale * preatt (BNH,T,T), row-wise
extern "C" __global__ void softmax_forward(floatX* att, const floatX* preatt, float scale,
                                           int BNH, int T) {
    if (T % x128::size == 0) {
        softmax_forward_rows<x128::size>(att, preatt, scale, BNH, T);
    } else {
        softmax_forward_rows<1>(att, preatt, scale, BNH, T);
    }
}

template <int WIDTH>
__device__ void softmax_backward_rows(floatX* dpreatt, const floatX* datt, const floatX* att,
                                      float scale, int BNH, int T) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warps_per_block = blockDim.x / WARP_SIZE;
    const int num_rows = BNH * T;
    const int lane_stride = WARP_SIZE * WIDTH;
    for (int row = blockIdx.x * warps_per_block + threadIdx.x / WARP_SIZE; row < num_rows;
         row += gridDim.x * warps_per_block) {
        const int t = row % T;
        const size_t offset = (size_t)row * T;
        // pass 1: the Jacobian's shared term sum_{i<=t} datt_i * a_i
        float local_dot = 0.0f;
        for (int c = lane * WIDTH; c <= t; c += lane_stride) {
            float datt_values[WIDTH], att_values[WIDTH];
            load_group<WIDTH>(datt_values, datt + offset + c);
            load_group<WIDTH>(att_values, att + offset + c);
            for (int k = 0; k < WIDTH; k++) {
                if (c + k <= t) {
                    local_dot += datt_values[k] * att_values[k];
                }
            }
        }
        const float dot = warpReduceSum(local_dot);
        // pass 2: dpreatt_j = scale * a_j * (datt_j - dot) below and on the diagonal, 0 above
        for (int c = lane * WIDTH; c < T; c += lane_stride) {
            float datt_values[WIDTH], att_values[WIDTH], dpreatt_values[WIDTH];
            if (c <= t) {
                load_group<WIDTH>(datt_values, datt + offset + c);
                load_group<WIDTH>(att_values, att + offset + c);
            }
            for (int k = 0; k < WIDTH; k++) {
                dpreatt_values[k] = (c + k <= t)
                    ? scale * att_values[k] * (datt_values[k] - dot) : 0.0f;
            }
            store_group<WIDTH>(dpreatt + offset + c, dpreatt_values);
        }
    }
}

// dpreatt (BNH,T,T) = gradient of softmax_forward's input (written, not accumulated)
extern "C" __global__ void softmax_backward(floatX* dpreatt, const floatX* datt, const floatX* att,
                                            float scale, int BNH, int T) {
    if (T % x128::size == 0) {
        softmax_backward_rows<x128::size>(dpreatt, datt, att, scale, BNH, T);
    } else {
        softmax_backward_rows<1>(dpreatt, datt, att, scale, BNH, T);
    }
}
