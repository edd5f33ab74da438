/*
kernels/classifier.cu: fused softmax + cross-entropy forward + its backward, in place on the
logits, so the (N, Vp) probabilities are never materialized.

Progression: `python dev/cuda/classifier.py` shows the way here; this file is its version 3 of
fused_classifier, each version validated against gpt2_cpu.py, then timed against the GPU's
measured limits.

Per row (N = B*T rows of Vp logits, of which the first V are real tokens):
    lse     = log sum_{i<V} exp(logit_i)                 (online max/sum, fp32)
    loss    = lse - logit[target] = -log softmax(logit)[target]
    dlogit_i = (softmax_i - [i == target]) * dloss   for i < V,   0 for V <= i < Vp
dloss is dL/dloss for every row, e.g. 1 / (B*T*grad_accum_steps) for a mean loss. The gradient
is the softmax Jacobian and the -log's 1/p folded together: d(-log p_target)/dlogit_i =
p_i - [i == target].

Kernel:
- fused_classifier: one block per row (grid-stride over rows), the idea of llm.c
  dev/cuda/classifier_fused.cu's later versions (online softmax state reduced over the block,
  Packed128 loads, then one more pass writing the gradient over the logits). Reads the row
  twice (the second time largely from L2), writes it once, and never writes probabilities. losses[row] is written (=). With write_dlogits == 0
  the logits are left untouched (evaluation).

Launcher must check: blockDim.x a multiple of 32 (<= 1024); targets in [0, V) (not checked
here: an out-of-range target reads a wrong logit); 16-byte aligned logits. x128 groups are used
when Vp % x128::size == 0 (always true for Vp a multiple of 128), else a scalar path.
*/
#include "common.cuh"

template <int WIDTH>
__device__ void fused_classifier_rows(floatX* logits, float* losses, const int* targets,
                                      float dloss, int N, int V, int Vp, int write_dlogits) {
    const int thread_stride = blockDim.x * WIDTH;
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        floatX* row_logits = logits + (size_t)row * Vp;
        const int target = targets[row];
        // read before the block reduction: its __syncthreads orders this read before any
        // thread overwrites the row with gradients below
        const float target_logit = (float)row_logits[target];
        // pass 1: online max/sum over the V real columns (padding V..Vp-1 is excluded)
        SoftmaxState state = softmax_state_empty();
        for (int c = threadIdx.x * WIDTH; c < V; c += thread_stride) {
            float values[WIDTH];
            load_group<WIDTH>(values, row_logits + c);
            for (int k = 0; k < WIDTH; k++) {
                if (c + k < V) {
                    state = softmax_state_add(state, values[k]);
                }
            }
        }
        state = blockReduceSoftmax(state);
        if (threadIdx.x == 0) {
            losses[row] = state.max + logf(state.sum) - target_logit;   // lse - logit[target]
        }
        // pass 2: overwrite the logits with dloss * (softmax - onehot); padded columns get 0
        if (write_dlogits) {
            const float inv_sum = 1.0f / state.sum;
            for (int c = threadIdx.x * WIDTH; c < Vp; c += thread_stride) {
                float values[WIDTH];
                load_group<WIDTH>(values, row_logits + c);
                for (int k = 0; k < WIDTH; k++) {
                    const int i = c + k;
                    const float prob = (i < V) ? expf(values[k] - state.max) * inv_sum : 0.0f;
                    const float indicator = (i == target) ? 1.0f : 0.0f;
                    values[k] = (prob - indicator) * dloss;
                }
                store_group<WIDTH>(row_logits + c, values);
            }
        }
    }
}

// logits (N,Vp) floatX, overwritten by dlogits when write_dlogits; losses (N,) float;
// targets (N,) int32
extern "C" __global__ void fused_classifier(floatX* logits, float* losses, const int* targets,
                                            float dloss, int N, int V, int Vp, int write_dlogits) {
    if (Vp % x128::size == 0) {
        fused_classifier_rows<x128::size>(logits, losses, targets, dloss, N, V, Vp, write_dlogits);
    } else {
        fused_classifier_rows<1>(logits, losses, targets, dloss, N, V, Vp, write_dlogits);
    }
}
