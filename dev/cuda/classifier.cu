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

- fused_classifier_v4 (candidate, after the production version 3): version 3 with CLASSIFIER_UNROLL
  = 4 of a thread's groups loaded into registers before any of them is used, in both passes.
- fused_classifier_v5 (candidate): the row in registers between the two passes, so it is read from
  DRAM once: CLASSIFIER_ROW_GROUPS = 7 groups a thread hold GPT-2's whole row at 1024 threads in
  bf16; a longer row goes through in tiles of that size.
Measured dead ends, removed (their tables are in dev/results/, 2026-11-27, H200): the row kept in
dynamic shared memory between the passes (the candidate 4 of that day) took 12x version 3's time
(1.35 ms against 0.107 ms at B=4, T=256), as did the row copied in by cp.async (1.33 ms).

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

// Version 4's online softmax of one 16-byte group whose first element is column `first` (only the
// real columns, < V, count):
__device__ inline SoftmaxState softmax_state_add_group(SoftmaxState state, const x128& group, int first, int V) {
    for (int k = 0; k < x128::size; k++) {
        if (first + k < V) {
            state = softmax_state_add(state, (float)group[k]);
        }
    }
    return state;
}

// Version 4 (candidate): version 3, each thread loading CLASSIFIER_UNROLL of its groups into
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

extern "C" __global__ void fused_classifier_v4(floatX* logits, float* losses, const int* targets, float dloss,
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

// Version 5 (candidate): the row in registers, read from DRAM once. A thread holds
// CLASSIFIER_ROW_GROUPS = 7 groups of 16 bytes (28 32-bit registers): with 1024 threads a tile of
// 7 x 8 x 1024 = 57,344 bf16 values, so GPT-2's whole row (Vp = 50,304: 6 or 7 groups a thread) is one
// tile. Every load of a tile is issued before any is used; then the thread's max and sum of exp over
// it (two passes over the registers: one exp a value, none of the online softmax's rescaling), the
// block reduction, and the gradient computed from the same registers: a one-tile row crosses DRAM
// once each way, the minimum (versions 3 and 4 read it twice, the second time mostly from L2). A
// longer row (a smaller block, fp32's 4-value groups, Llama 3's 128K vocabulary) is several tiles,
// merged into the thread's state one after the other; its gradient pass starts from the last tile,
// still in registers, and reloads the others. The groups stay raw int4 (group_value decodes a value
// where it is used): held as a Packed128 of bf16, the compiler gave each value a register of its own,
// 8 a group, and spilled. __launch_bounds__(1024) keeps it within 64 registers, so that a 1024-thread
// block fits its SM (nvrtc_compile.py -r: the count, and no spill).
#define CLASSIFIER_ROW_GROUPS 7

// value k of a group held as its raw 16 bytes (k a constant once the caller's loop is unrolled): bf16
// is the high half of a float's bits, so the decode is exact, (float) of the bf16 value
__device__ inline float group_value(const int4& raw, int k) {
    constexpr int per_word = 4 / (int)sizeof(floatX);          // 2 bf16, or 1 float, per 32-bit word
    const int w = k / per_word;
    const unsigned int word = (unsigned int)(w == 0 ? raw.x : w == 1 ? raw.y : w == 2 ? raw.z : raw.w);
    if constexpr (sizeof(floatX) == 2) {
        return __uint_as_float(((word >> (16 * (k % 2))) & 0xffffu) << 16);   // little-endian: even k low
    } else {
        return __uint_as_float(word);
    }
}

// the thread's groups of a tile: groups[u] = the 16 bytes at column first + u * stride, zeros from Vp on
__device__ inline void load_tile(int4 (&groups)[CLASSIFIER_ROW_GROUPS], const floatX* row, int first, int stride,
                                 int Vp) {
    #pragma unroll
    for (int u = 0; u < CLASSIFIER_ROW_GROUPS; u++) {
        const int c = first + u * stride;
        groups[u] = c < Vp ? __ldcs(reinterpret_cast<const int4*>(row + c)) : make_int4(0, 0, 0, 0);
    }
}

// max and sum of exp(x - max) over the tile's values x in the V real columns
__device__ inline SoftmaxState tile_state(const int4 (&groups)[CLASSIFIER_ROW_GROUPS], int first, int stride, int V) {
    SoftmaxState state = softmax_state_empty();
    #pragma unroll
    for (int u = 0; u < CLASSIFIER_ROW_GROUPS; u++) {
        #pragma unroll
        for (int k = 0; k < x128::size; k++) {
            if (first + u * stride + k < V) {
                state.max = fmaxf(state.max, group_value(groups[u], k));
            }
        }
    }
    if (state.max != NEGATIVE_INFINITY) {                  // no values, or all -inf: sum 0 (not exp(NaN))
        #pragma unroll
        for (int u = 0; u < CLASSIFIER_ROW_GROUPS; u++) {
            #pragma unroll
            for (int k = 0; k < x128::size; k++) {
                if (first + u * stride + k < V) {
                    state.sum += expf(group_value(groups[u], k) - state.max);
                }
            }
        }
    }
    return state;
}

// the tile's gradient over its logits: (softmax - onehot) * dloss, 0 in the padded columns
__device__ inline void store_tile_dlogits(const int4 (&groups)[CLASSIFIER_ROW_GROUPS], floatX* row, int first,
                                          int stride, int V, int Vp, int target, SoftmaxState state, float dloss) {
    const float inv_sum = 1.0f / state.sum;
    #pragma unroll
    for (int u = 0; u < CLASSIFIER_ROW_GROUPS; u++) {
        const int c = first + u * stride;
        if (c < Vp) {
            x128 out;
            #pragma unroll
            for (int k = 0; k < x128::size; k++) {
                const int i = c + k;
                const float prob = (i < V) ? expf(group_value(groups[u], k) - state.max) * inv_sum : 0.0f;
                out[k] = (floatX)((prob - (i == target ? 1.0f : 0.0f)) * dloss);
            }
            store128cs(row + c, out);
        }
    }
}

extern "C" __global__ void __launch_bounds__(1024) fused_classifier_v5(floatX* logits, float* losses,
                                                                       const int* targets, float dloss,
                                                                       int N, int V, int Vp,
                                                                       int write_dlogits) {
    const int stride = blockDim.x * x128::size;            // columns from one of a thread's groups to its next
    const int tile = CLASSIFIER_ROW_GROUPS * stride;       // columns a block holds in registers at once
    const int tiles = (Vp + tile - 1) / tile;              // 1 for GPT-2 in bf16 at 1024 threads
    const int first = threadIdx.x * x128::size;            // the thread's first column in a tile
    for (int row = blockIdx.x; row < N; row += gridDim.x) {
        floatX* row_logits = logits + (size_t)row * Vp;
        const int target = targets[row];
        const float target_logit = (float)row_logits[target];   // before any thread overwrites it
        int4 groups[CLASSIFIER_ROW_GROUPS];
        SoftmaxState state = softmax_state_empty();
        for (int t = 0; t < tiles; t++) {                   // pass 1: the tiles' states merged in order
            load_tile(groups, row_logits, t * tile + first, stride, Vp);
            state = softmax_state_merge(state, tile_state(groups, t * tile + first, stride, V));
        }
        state = blockReduceSoftmax(state);                  // its barriers: every read above before any write
        if (threadIdx.x == 0) {
            losses[row] = state.max + logf(state.sum) - target_logit;
        }
        if (write_dlogits) {
            for (int t = tiles - 1; t >= 0; t--) {          // pass 2: the last tile is still in registers
                if (t != tiles - 1) {
                    load_tile(groups, row_logits, t * tile + first, stride, Vp);
                }
                store_tile_dlogits(groups, row_logits, t * tile + first, stride, V, Vp, target, state, dloss);
            }
        }
    }
}
