/*
kernels/common.cuh: what every kernel file of llm.cupy shares.

Holds: the storage type floatX (picked by -DENABLE_BF16 or -DENABLE_FP32), the 16-byte vector
Packed128 with its load/store helpers, warp and block reductions, the online-softmax pair used by
the attention softmax and the fused classifier, and the hash-based stochastic rounding that the
bf16 AdamW uses. It is the counterpart of llm.c's llmc/cuda_common.h and llmc/cuda_utils.cuh,
written for NVRTC: no host code, no standard library headers (NVRTC has none), only
<cuda_bf16.h>, found through `-I <nvidia/cuda_runtime/include>`.

What it deliberately is not: a template library. Kernels are `extern "C"` so that CuPy finds
them by their plain names; the helpers here are small `__device__` functions.

Compiled as part of each kernels/<op>.cu; dev/cuda/nvrtc_compile.py checks every file with
    python dev/cuda/nvrtc_compile.py
and prints one OK line per (file, precision, arch).

Conventions shared by all kernels:
- Activations, parameters and gradients are stored as floatX; every sum, mean and product is
  computed in float (fp32) and rounded to floatX once, when stored.
- "Accumulate" means out = (floatX)((float)out + value): parameter gradients and the residual
  stream's gradient accumulate, everything else is written.
- A kernel's correctness never depends on its grid size (loops are grid-stride) except where the
  grid defines a partition of the work into scratch slots; those kernels say so.
- Warp-based kernels need blockDim.x to be a multiple of 32 and at most 1024.
- 16-byte loads need 16-byte aligned pointers; CuPy allocations are 256-byte aligned, so the
  launcher only has to check the element offsets of views (multiples of x128::size).
*/
#pragma once

#include <cuda_bf16.h>

// ----------------------------------------------------------------------------
// precision: floatX is how tensors are stored; arithmetic is always float

#if defined(ENABLE_BF16) && defined(ENABLE_FP32)
#error "define only one of ENABLE_BF16 and ENABLE_FP32"
#elif defined(ENABLE_BF16)
typedef __nv_bfloat16 floatX;
#elif defined(ENABLE_FP32)
typedef float floatX;
#else
#error "define ENABLE_BF16 or ENABLE_FP32 (the launcher passes one of them as -D)"
#endif

#define WARP_SIZE 32
#define MAX_WARPS_PER_BLOCK 32              // 1024 threads, the CUDA limit
#define FULL_WARP_MASK 0xffffffffu

// NVRTC has no <math.h>, so no INFINITY macro: these are the IEEE-754 bit patterns.
#define POSITIVE_INFINITY __int_as_float(0x7f800000)
#define NEGATIVE_INFINITY __int_as_float(0xff800000)

// ----------------------------------------------------------------------------
// Packed128: 16 bytes of T, loaded and stored with one 128-bit instruction.
// A warp of 32 threads then moves 512 contiguous bytes per instruction, which is what lets
// memory-bound kernels reach close to peak bandwidth (llm.c dev/cuda *_forward.cu "version 2/3":
// the Packed128 rewrite of each elementwise kernel).

template <class ElementType>
struct alignas(16) Packed128 {
    static constexpr int size = 16 / sizeof(ElementType);   // 8 for bf16, 4 for float
    ElementType payload[size];

    __device__ static Packed128 constant(ElementType value) {
        Packed128 result;
        for (int k = 0; k < size; k++) {
            result.payload[k] = value;
        }
        return result;
    }
    __device__ static Packed128 zeros() { return constant((ElementType)0.0f); }
    __device__ ElementType& operator[](int k) { return payload[k]; }
    __device__ const ElementType& operator[](int k) const { return payload[k]; }
};

typedef Packed128<float> f128;              // 4 floats
typedef Packed128<floatX> x128;             // 8 bf16 or 4 floats

// load a Packed128 from aligned memory (ordinary cached load: data that will be read again)
template <class ElementType>
__device__ inline Packed128<ElementType> load128(const ElementType* address) {
    return *reinterpret_cast<const Packed128<ElementType>*>(address);
}

// load with the "cache streaming" hint (__ldcs): data read exactly once, so it should not evict
// data that will be reused (weights, the row being normalized)
template <class ElementType>
__device__ inline Packed128<ElementType> load128cs(const ElementType* address) {
    int4 bits = __ldcs(reinterpret_cast<const int4*>(address));
    Packed128<ElementType> result;
    *reinterpret_cast<int4*>(result.payload) = bits;
    return result;
}

template <class ElementType>
__device__ inline void store128(ElementType* target, Packed128<ElementType> value) {
    *reinterpret_cast<Packed128<ElementType>*>(target) = value;
}

// store with the streaming hint (__stcs): output that this kernel will not read again
template <class ElementType>
__device__ inline void store128cs(ElementType* target, Packed128<ElementType> value) {
    __stcs(reinterpret_cast<int4*>(target), *reinterpret_cast<const int4*>(value.payload));
}

// Width-generic group access for kernels that take the x128 path when a row length divides
// evenly and a scalar path otherwise (softmax over T, the classifier over Vp): WIDTH is
// x128::size (one 16-byte load; address must be 16-byte aligned) or 1 (one element).
template <int WIDTH>
__device__ inline void load_group(float* values, const floatX* address) {
    static_assert(WIDTH == 1 || WIDTH == x128::size, "WIDTH is 1 or x128::size");
    if constexpr (WIDTH == 1) {
        values[0] = (float)address[0];
    } else {
        const x128 group = load128(address);
        for (int k = 0; k < WIDTH; k++) {
            values[k] = (float)group[k];
        }
    }
}

template <int WIDTH>
__device__ inline void store_group(floatX* address, const float* values) {
    static_assert(WIDTH == 1 || WIDTH == x128::size, "WIDTH is 1 or x128::size");
    if constexpr (WIDTH == 1) {
        address[0] = (floatX)values[0];
    } else {
        x128 group;
        for (int k = 0; k < WIDTH; k++) {
            group[k] = (floatX)values[k];
        }
        store128(address, group);
    }
}

// ----------------------------------------------------------------------------
// reductions

// butterfly reduction: after log2(32) = 5 xor-shuffles every lane holds the full sum, so no
// broadcast is needed afterwards. The summation order is fixed, so the result is deterministic.
__device__ inline float warpReduceSum(float value) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(FULL_WARP_MASK, value, offset);
    }
    return value;
}

__device__ inline float warpReduceMax(float value) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value = fmaxf(value, __shfl_xor_sync(FULL_WARP_MASK, value, offset));
    }
    return value;
}

// Two sums of one warp at once: each butterfly step moves both values in one 64-bit shuffle (the
// hardware issues it as two 32-bit SHFLs, the emulated device as one warp exchange). The same
// additions in the same order as two warpReduceSum calls, so the results are bitwise theirs.
__device__ inline unsigned long long pack_floats(float low, float high) {
    return ((unsigned long long)__float_as_uint(high) << 32) | __float_as_uint(low);
}
__device__ inline float low_float(unsigned long long packed) { return __uint_as_float((unsigned int)packed); }
__device__ inline float high_float(unsigned long long packed) { return __uint_as_float((unsigned int)(packed >> 32)); }

__device__ inline void warpReduceSum2(float& a, float& b) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        const unsigned long long other = __shfl_xor_sync(FULL_WARP_MASK, pack_floats(a, b), offset);
        a += low_float(other);
        b += high_float(other);
    }
}

// Sum over the whole block, returned to every thread. Needs blockDim.x a multiple of 32, at most
// 1024, and all threads of the block to call it (it contains __syncthreads). Step 1 reduces each
// warp; step 2: warp 0 reduces the per-warp sums and writes the total to shared memory, which
// every thread reads after the second __syncthreads (the other warps wait there instead of
// repeating warp 0's shuffles). Calling it again right away is safe: warp 0 has read warp_sums
// before the second barrier, and block_sum is rewritten only after the next call's first barrier,
// which every thread reaches after reading it.
__device__ inline float blockReduceSum(float value) {
    __shared__ float warp_sums[MAX_WARPS_PER_BLOCK];
    __shared__ float block_sum;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int num_warps = blockDim.x / WARP_SIZE;
    value = warpReduceSum(value);
    if (lane == 0) {
        warp_sums[warp] = value;
    }
    __syncthreads();
    if (warp == 0) {
        value = (lane < num_warps) ? warp_sums[lane] : 0.0f;
        value = warpReduceSum(value);
        if (lane == 0) {
            block_sum = value;
        }
    }
    __syncthreads();
    return block_sum;
}

// Sum over the whole block for a kernel that writes one value per block: the sum is returned to
// thread 0 only (the others get a partial sum or 0). Every thread stores its value in shared
// memory, and after one __syncthreads warp 0 adds them up: lane l the values l, l + 32, l + 64, ...
// in order (consecutive lanes read consecutive words: no bank conflicts), then the 32 lanes in a
// butterfly. The other warps are done after the barrier, and warp 0 needs no second one. The
// order is fixed, so the result is deterministic. At most one call per kernel: a second would
// overwrite values that warp 0 may still be reading.
__device__ inline float blockSumToThread0(float value) {
    __shared__ float values[MAX_WARPS_PER_BLOCK * WARP_SIZE];
    values[threadIdx.x] = value;
    __syncthreads();
    float sum = 0.0f;
    if (threadIdx.x < WARP_SIZE) {
        for (int i = threadIdx.x; i < blockDim.x; i += WARP_SIZE) {
            sum += values[i];
        }
        sum = warpReduceSum(sum);
    }
    return sum;
}

// ----------------------------------------------------------------------------
// online softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"):
// one pass keeps the running max m and the running sum s = sum_j exp(x_j - m). When a larger
// value arrives the old sum is rescaled by exp(m_old - m_new). Two partial states merge the
// same way, so lanes, warps and blocks can each reduce a part of a row.

struct SoftmaxState {
    float max;      // running max of the values seen, -inf when none seen
    float sum;      // sum of exp(x - max) over the values seen
};

__device__ inline SoftmaxState softmax_state_empty() {
    SoftmaxState state;
    state.max = NEGATIVE_INFINITY;
    state.sum = 0.0f;
    return state;
}

// A -inf input adds nothing (exp(-inf) = 0, and skipping it avoids exp(-inf - -inf) = NaN);
// a NaN input makes the sum NaN, so a diverged model shows a NaN loss instead of hiding it.
__device__ inline SoftmaxState softmax_state_add(SoftmaxState state, float x) {
    if (x > state.max) {
        state.sum = state.sum * expf(state.max - x) + 1.0f;   // exp(-inf) = 0 for the first value
        state.max = x;
    } else if (x != NEGATIVE_INFINITY) {                      // true for NaN
        state.sum += expf(x - state.max);
    }
    return state;
}

__device__ inline SoftmaxState softmax_state_merge(SoftmaxState a, SoftmaxState b) {
    const float new_max = fmaxf(a.max, b.max);
    if (new_max == NEGATIVE_INFINITY) {
        return a;                           // both empty: avoid exp(-inf - -inf) = NaN
    }
    SoftmaxState merged;
    merged.max = new_max;
    merged.sum = a.sum * expf(a.max - new_max) + b.sum * expf(b.max - new_max);
    return merged;
}

// max and sum travel together, one 64-bit shuffle per step (see warpReduceSum2)
__device__ inline SoftmaxState warpReduceSoftmax(SoftmaxState state) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        const unsigned long long packed = __shfl_xor_sync(FULL_WARP_MASK, pack_floats(state.max, state.sum), offset);
        SoftmaxState other;
        other.max = low_float(packed);
        other.sum = high_float(packed);
        state = softmax_state_merge(state, other);
    }
    return state;
}

// The block's state, returned to every thread (all threads of the block must call it). Each
// thread stores its state in shared memory; after a __syncthreads, warp 0 combines them in two
// passes, lane l over the states l, l + 32, l + 64, ... in order: the block's max M first (then a
// warp max), then the sum of every state's sum rescaled to M, sum_i s_i exp(m_i - M) (the
// rescaling of softmax_state_merge, but the exps are independent of each other, so they overlap,
// instead of a chain of merges), then a warp sum. A state that saw no values (m_i = -inf, s_i = 0)
// adds nothing, so a row of -inf keeps M = -inf and sum 0. The other warps only wait at the two
// barriers. Calling it again at once (the next row) is safe: warp 0 has read the arrays before the
// second barrier, and block_state is rewritten only after the next call's first one.
__device__ inline SoftmaxState blockReduceSoftmax(SoftmaxState state) {
    __shared__ float maxes[MAX_WARPS_PER_BLOCK * WARP_SIZE];
    __shared__ float sums[MAX_WARPS_PER_BLOCK * WARP_SIZE];
    __shared__ SoftmaxState block_state;
    maxes[threadIdx.x] = state.max;
    sums[threadIdx.x] = state.sum;
    __syncthreads();
    if (threadIdx.x < WARP_SIZE) {
        float block_max = NEGATIVE_INFINITY;
        for (int i = threadIdx.x; i < blockDim.x; i += WARP_SIZE) {
            block_max = fmaxf(block_max, maxes[i]);
        }
        block_max = warpReduceMax(block_max);
        float sum = 0.0f;
        for (int i = threadIdx.x; i < blockDim.x; i += WARP_SIZE) {
            if (maxes[i] != NEGATIVE_INFINITY) {
                sum += sums[i] * expf(maxes[i] - block_max);
            }
        }
        sum = warpReduceSum(sum);
        if (threadIdx.x == 0) {
            block_state.max = block_max;
            block_state.sum = sum;
        }
    }
    __syncthreads();
    return block_state;
}

// ----------------------------------------------------------------------------
// stochastic rounding float -> bf16 (used by AdamW, as in llm.c's adamw_kernel3)
//
// Rounding every update to the nearest bf16 loses updates smaller than half a bf16 ulp
// (2^-9 relative): small learning-rate steps would be rounded away every time. Rounding up
// with probability equal to the discarded fraction makes the rounding unbiased in expectation.

// SquirrelNoise5 (Squirrel Eiserloh, GDC 2017 "Noise-Based RNG"): a stateless integer hash,
// so random bits for element i at step s are a pure function of (i, s): reproducible, and no
// RNG state has to be stored or advanced.
#define SQ5_BIT_NOISE1 0xd2a80a3fu
#define SQ5_BIT_NOISE2 0xa884f197u
#define SQ5_BIT_NOISE3 0x6c736f4bu
#define SQ5_BIT_NOISE4 0xb79f3abbu
#define SQ5_BIT_NOISE5 0x1b56c4f5u

__device__ inline unsigned int squirrel_noise5(unsigned int position, unsigned int seed) {
    unsigned int mangled = position;
    mangled *= SQ5_BIT_NOISE1;
    mangled += seed;
    mangled ^= (mangled >> 9);
    mangled += SQ5_BIT_NOISE2;
    mangled ^= (mangled >> 11);
    mangled *= SQ5_BIT_NOISE3;
    mangled ^= (mangled >> 13);
    mangled += SQ5_BIT_NOISE4;
    mangled ^= (mangled >> 15);
    mangled *= SQ5_BIT_NOISE5;
    mangled ^= (mangled >> 17);
    return mangled;
}

#define BF16_DISCARDED_BITS 16              // bf16 is the upper 16 bits of a float
#define BF16_DISCARDED_MASK 0xffffu

// Round `in` to bf16, up (in magnitude) with probability (discarded low 16 bits) / 2^16.
// `seed` must differ per element and per step; callers build it from the element index and the
// step's seed (adamw.cu: squirrel_noise5(index, step_seed)). It is hashed once more here so
// that even structured seeds give uncorrelated rounding bits.
// How: adding a uniform random 16-bit number to the float's bits carries into bit 16 exactly
// when random >= 2^16 - low16, i.e. with probability low16 / 2^16; truncating then gives the
// rounded value (a carry into the exponent is the correct next bf16 value too, and a carry out of
// the largest finite value gives inf). The kept high 16 bits are taken as they are, not through
// __float2bfloat16_rz: the sum for +-inf (low bits 0) or for a carry out of the largest finite
// value is a NaN bit pattern as a float, which rz would turn into NaN; its high half is inf.
// A NaN input rounds to nearest (a NaN with its payload only in the low bits would become inf).
__device__ inline void stochastic_rounding(float in, __nv_bfloat16* out, unsigned int seed) {
    if (isnan(in)) {
        *out = __float2bfloat16_rn(in);
        return;
    }
    const unsigned int random = squirrel_noise5(0u, seed) & BF16_DISCARDED_MASK;
    const unsigned int bits = __float_as_uint(in) + random;
    *out = __ushort_as_bfloat16((unsigned short)(bits >> 16));   // truncate the low 16 bits
}

// fp32 build: nothing is discarded, so storing is exact
__device__ inline void stochastic_rounding(float in, float* out, unsigned int seed) {
    *out = in;
}
