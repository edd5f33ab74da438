/*
dev/cuda/classifier.cu: the intermediate fused-classifier kernels of dev/cuda/classifier.py (the
last version is kernels/classifier.cu's fused_classifier, launched from there by its real name).

All versions share the contract of fused_classifier: logits (N,Vp) floatX, of which the first V
columns are real tokens; losses (N,) float written (=); targets (N,) int32 in [0,V);
    loss_row = logsumexp(logits[:V]) - logits[target]
and, when write_dlogits, the logits are overwritten in place by
    dlogits_i = (softmax_i - [i == target]) * dloss  (i < V),   0 for V <= i < Vp.

- fused_classifier_v1: naive port of gpt2_cpu.softmax_forward + crossentropy_forward +
  crossentropy_softmax_backward, one thread per row: three passes over V (max, sum of exp,
  gradient). A warp's threads read 32 rows Vp elements apart, so every load touches 32
  different cache lines, and only N threads exist (1024 for the benchmark: a sliver of the GPU).
- fused_classifier_v2: one warp per row. Lanes read consecutive columns (coalesced); the row
  max and the sum of exp are each a warpReduce (5 shuffles). Still three passes over the row,
  scalar loads, and 32 lanes for 50304 columns.

- fused_classifier_v4 (candidate, after the production version 3): version 3 with the row kept
  in shared memory between its two passes, so that it is read from global memory once. On an H200
  (2026-11-27) it took 12x version 3's time (1.35 ms against 0.107 ms at B=4, T=256), as did the
  version 5 of that day, which copied the row in by cp.async (1.33 ms; removed, its table is in
  dev/results/): a measured dead end, kept to show it.
- fused_classifier_v5 (candidate): version 3 with CLASSIFIER_UNROLL = 4 of a thread's groups
  loaded into registers before any of them is used, in both passes.

Warp kernels need blockDim.x a multiple of 32. Compile check:
    python dev/cuda/nvrtc_compile.py dev/cuda/classifier.cu
*/
#include "common.cuh"

// thread i handles row i
extern "C" __global__ void fused_classifier_v1(floatX* logits, float* losses, const int* targets, float dloss,
                                               int N, int V, int Vp, int write_dlogits) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) {
        return;
    }
    floatX* z = logits + (size_t)row * Vp;
    const int target = targets[row];
    float max_z = NEGATIVE_INFINITY;                 // pass 1: the max, so that exp cannot overflow
    for (int i = 0; i < V; i++) {
        max_z = fmaxf(max_z, (float)z[i]);
    }
    float sum = 0.0f;                                // pass 2: the softmax's normalizer
    for (int i = 0; i < V; i++) {
        sum += expf((float)z[i] - max_z);
    }
    losses[row] = max_z + logf(sum) - (float)z[target];   // -log softmax[target]
    if (write_dlogits) {                             // pass 3: (p - onehot) * dloss, padding 0
        for (int i = 0; i < Vp; i++) {
            const float p = (i < V) ? expf((float)z[i] - max_z) / sum : 0.0f;
            z[i] = (floatX)((p - (i == target ? 1.0f : 0.0f)) * dloss);
        }
    }
}

// warp w handles row w; lane reads columns lane, lane+32, ...
extern "C" __global__ void fused_classifier_v2(floatX* logits, float* losses, const int* targets, float dloss,
                                               int N, int V, int Vp, int write_dlogits) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= N) {
        return;                                      // the whole warp leaves together
    }
    floatX* z = logits + (size_t)row * Vp;
    const int target = targets[row];
    const float target_logit = (float)z[target];     // read before any lane overwrites it
    float max_z = NEGATIVE_INFINITY;
    for (int i = lane; i < V; i += WARP_SIZE) {
        max_z = fmaxf(max_z, (float)z[i]);
    }
    max_z = warpReduceMax(max_z);
    float sum = 0.0f;
    for (int i = lane; i < V; i += WARP_SIZE) {
        sum += expf((float)z[i] - max_z);
    }
    sum = warpReduceSum(sum);                        // the shuffles also order all reads before the writes
    if (lane == 0) {
        losses[row] = max_z + logf(sum) - target_logit;
    }
    if (write_dlogits) {
        for (int i = lane; i < Vp; i += WARP_SIZE) {
            const float p = (i < V) ? expf((float)z[i] - max_z) / sum : 0.0f;
            z[i] = (floatX)((p - (i == target ? 1.0f : 0.0f)) * dloss);
        }
    }
}

// What versions 4 and 5 share. The online softmax of one 16-byte group whose first element is
// column `first` (only the real columns, < V, count):
__device__ inline SoftmaxState softmax_state_add_group(SoftmaxState state, const x128& group, int first, int V) {
    for (int k = 0; k < x128::size; k++) {
        if (first + k < V) {
            state = softmax_state_add(state, (float)group[k]);
        }
    }
    return state;
}

// After the block reduction (`state` is the row's): thread 0 writes the loss; with write_dlogits
// each thread writes the gradient of the groups it holds in shared memory, streamed out (__stcs):
// (softmax - onehot) * dloss, 0 for the padded columns.
__device__ inline void loss_and_dlogits_from_shared(const x128* row_groups, floatX* row_logits, float* loss,
                                                    SoftmaxState state, float target_logit, int target, float dloss,
                                                    int V, int groups, int write_dlogits) {
    if (threadIdx.x == 0) {
        *loss = state.max + logf(state.sum) - target_logit;
    }
    if (!write_dlogits) {
        return;
    }
    const float inv_sum = 1.0f / state.sum;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        const x128 group = row_groups[g];
        x128 out;
        for (int k = 0; k < x128::size; k++) {
            const int i = g * x128::size + k;
            const float prob = (i < V) ? expf((float)group[k] - state.max) * inv_sum : 0.0f;
            out[k] = (floatX)((prob - (i == target ? 1.0f : 0.0f)) * dloss);
        }
        store128cs(row_logits + g * x128::size, out);
    }
}

// Version 4 (candidate): version 3 (kernels/classifier.cu), one block per row, with the row kept in
// shared memory between the two passes. Pass 1 streams the row in (__ldcs: DRAM read once, not kept
// in L2), stores each 16-byte group into dynamic shared memory and runs the online softmax; after
// the block reduction, pass 2 reads each thread's own groups back from shared memory and streams
// the gradient out (__stcs). A thread reads back only the groups it wrote itself, so no barrier is
// needed between its store and its load: the block reduction's barriers separate one row's pass 2
// from the next row's pass 1 for the arrays they share, and the cached groups belong to one thread.
// Why it could be faster: version 3 reads the row from global memory twice and relies on L2 for the
// second read (264 rows of 100 KB in flight on an H100 fill 26 of its 50 MB); this one moves the
// minimum, N*Vp floatX in and out. The cost: Vp * sizeof(floatX) bytes of dynamic shared memory
// per block (100.6 KB for Vp = 50304 in bf16: two blocks of 1024 threads per H100 SM, as version
// 3's thread count allows anyway); Vp a multiple of x128::size (the launcher checks).
extern "C" __global__ void fused_classifier_v4(floatX* logits, float* losses, const int* targets, float dloss,
                                               int N, int V, int Vp, int write_dlogits) {
    extern __shared__ __align__(16) x128 row_groups[];     // (Vp / x128::size) groups of this block's row
    const int groups = Vp / x128::size;
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        floatX* row_logits = logits + (size_t)row * Vp;
        const int target = targets[row];
        const float target_logit = (float)row_logits[target];   // before any thread overwrites it
        SoftmaxState state = softmax_state_empty();
        for (int g = threadIdx.x; g < groups; g += blockDim.x) {      // pass 1: global -> shared, online softmax
            const x128 group = load128cs(row_logits + g * x128::size);
            row_groups[g] = group;
            state = softmax_state_add_group(state, group, g * x128::size, V);
        }
        state = blockReduceSoftmax(state);
        loss_and_dlogits_from_shared(row_groups, row_logits, &losses[row], state, target_logit, target, dloss, V,
                                     groups, write_dlogits);                                 // pass 2
    }
}

// Version 5 (candidate): version 3, each thread loading CLASSIFIER_UNROLL of its groups into
// registers before it uses any of them, in both passes. Why it could be faster: version 3's loop
// loads one group and feeds it to the online softmax in the same iteration, so a thread has about
// one 16-byte load in flight. With its 31 registers an SM holds 2048 of its threads: 32 KB in
// flight per SM, 4.2 MB on the H200's 132, which at the 1.93 TB/s it measured (45% of the copy
// bandwidth) means each load waited about 2.2 us (Little's law: bytes in flight = bandwidth x
// latency), a loaded DRAM's latency: the kernel waits on its loads. Here a thread keeps 4 in flight;
// at its 63 registers (nvrtc_compile.py -r) an SM holds 1024 threads, so 64 KB per SM, twice
// version 3's, at the price of half the threads (a 1024-thread block alone on its SM during the
// block reduction; 512-thread blocks overlap two rows). Which wins only a GPU can say. The
// arithmetic, the block reduction and the results are version 3's (the same state updates in the
// same order per thread: bit for bit). x128 groups only: the launcher checks that Vp is a multiple
// of x128::size.
#define CLASSIFIER_UNROLL 4

// groups[u] = the x128 group at column first + u * stride of the row, u < CLASSIFIER_UNROLL, zeros from
// column `end` on: every load issued before any is used
__device__ inline void load_groups(x128 (&groups)[CLASSIFIER_UNROLL], const floatX* row, int first, int stride,
                                   int end) {
    #pragma unroll
    for (int u = 0; u < CLASSIFIER_UNROLL; u++) {
        const int c = first + u * stride;
        groups[u] = c < end ? load128(row + c) : x128::zeros();
    }
}

extern "C" __global__ void fused_classifier_v5(floatX* logits, float* losses, const int* targets, float dloss,
                                               int N, int V, int Vp, int write_dlogits) {
    const int stride = blockDim.x * x128::size;            // columns from one of a thread's groups to its next
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        floatX* row_logits = logits + (size_t)row * Vp;
        const int target = targets[row];
        const float target_logit = (float)row_logits[target];   // before any thread overwrites it
        SoftmaxState state = softmax_state_empty();
        for (int first = threadIdx.x * x128::size; first < V; first += CLASSIFIER_UNROLL * stride) {
            x128 groups[CLASSIFIER_UNROLL];
            load_groups(groups, row_logits, first, stride, V);    // pass 1: the loads first
            #pragma unroll
            for (int u = 0; u < CLASSIFIER_UNROLL; u++) {         // then the online softmax
                state = softmax_state_add_group(state, groups[u], first + u * stride, V);
            }
        }
        state = blockReduceSoftmax(state);
        if (threadIdx.x == 0) {
            losses[row] = state.max + logf(state.sum) - target_logit;
        }
        if (write_dlogits) {
            const float inv_sum = 1.0f / state.sum;
            for (int first = threadIdx.x * x128::size; first < Vp; first += CLASSIFIER_UNROLL * stride) {
                x128 groups[CLASSIFIER_UNROLL];
                load_groups(groups, row_logits, first, stride, Vp);   // pass 2: the loads first
                #pragma unroll
                for (int u = 0; u < CLASSIFIER_UNROLL; u++) {     // then (softmax - onehot) * dloss
                    const int c = first + u * stride;
                    if (c < Vp) {
                        x128 out;
                        for (int k = 0; k < x128::size; k++) {
                            const int i = c + k;
                            const float prob = (i < V) ? expf((float)groups[u][k] - state.max) * inv_sum : 0.0f;
                            out[k] = (floatX)((prob - (i == target ? 1.0f : 0.0f)) * dloss);
                        }
                        store128(row_logits + c, out);
                    }
                }
            }
        }
    }
}
