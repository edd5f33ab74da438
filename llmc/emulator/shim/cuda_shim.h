/*
llmc/emulator/shim/cuda_shim.h: CUDA's device-side names as host C++, so that the unmodified
kernels/*.cu compile with g++ and run on the CPU (the emulated device of llmc/emulator/).

What it is: force-included (g++ -include) before each kernel file, it defines
- the qualifiers (__global__, __device__, __shared__, __launch_bounds__, ...) as host C++;
- threadIdx, blockIdx (per CUDA thread), blockDim, gridDim (per launch), warpSize;
- __syncthreads, __syncwarp(mask), __shfl_sync / _xor / _up / _down (mask, width), __ballot_sync,
  __any_sync, __all_sync, with CUDA's rules checked: the calling lane must be in its mask, the
  mask may only name lanes that exist, every lane it names must reach a call with the same mask,
  and a shuffle may only read a lane of the mask. A broken rule stops the launch with a message
  naming the kernel's block and thread, where a GPU would silently give garbage or hang;
- __nv_bfloat16 with cuda_bf16.h's round-to-nearest-even conversions, atomics, CUDA's math
  functions, int4 / float4 and the cache-hint loads and stores;
- the tensor-core and asynchronous-copy instructions (tensor_cores.h: mma.sync m16n8k16 bf16,
  ldmatrix, cp.async with its commit and wait groups) with the PTX ISA's lane layouts, which
  kernels reach through kernels/tensor_core.cuh;
- the launcher: llmc_emu::launch runs a grid. Each CUDA thread is a fiber (a user-space context,
  switched by a few instructions, no system call; it takes a stack of its own when it first
  waits); a block's fibers run on one OS thread and switch only at a barrier or a
  warp-synchronous call, and blocks are spread over the cores. __shared__ arrays are thread_local, so each block in flight has its own copy; they are
  filled with NaN bytes (0xff) before each block, so a read before any write shows as NaN.

With -DLLMC_EMU_OS_THREADS (the sanitizer builds), each CUDA thread is an OS thread instead and
the blocks run one at a time: ThreadSanitizer then sees the real concurrency that fibers would
hide (a fiber runs until it waits, so a missing barrier rarely shows with fibers).

What it is not: a GPU. No timing, no memory model weaker than the CPU's, no warp lockstep (lanes
of a warp run one after another between their synchronizing calls, as on Volta+ with independent
thread scheduling), no timing of memory (llmc/emulator/memory.py counts sectors and bank conflicts
in a traced build, shim/tracer.cpp), glibc's expf/logf instead of CUDA's, and a tensor core's
fp32 sums rounded once (a GPU's may differ in the last bits: tensor_cores.h).
*/
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>
#include <utility>

// ----------------------------------------------------------------------------
// qualifiers

// OS-thread mode keeps __shared__ variables in one named section (below), and g++ refuses to mix,
// in one section, the statics of an inline function (a helper's __shared__, in a COMDAT group)
// with those of an ordinary function (a kernel's own __shared__): "section type conflict". A
// kernel made inline there puts its statics in COMDAT groups too (the launcher's unit uses it, so
// it is still emitted); CUDA allows both in one kernel, as in dev/cuda/classifier.cu's versions 4, 5
#ifdef LLMC_EMU_OS_THREADS
#define __global__ inline
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __constant__ static
// one copy per block in flight: blocks of one worker run one after another on its OS thread, so a
// thread_local is exactly a block's shared memory (OS-thread mode: one block at a time, one copy,
// kept in its own section so that the launcher can fill it with NaN)
#ifdef LLMC_EMU_OS_THREADS
#define __shared__ static __attribute__((section("llmc_emu_shared")))
#else
#define __shared__ static thread_local
#endif
#define warpSize 32

// ----------------------------------------------------------------------------
// vector types

struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    dim3(unsigned int x = 1, unsigned int y = 1, unsigned int z = 1) : x(x), y(y), z(z) {}
};
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(16) uint4 { unsigned int x, y, z, w; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) float2 { float x, y; };
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

// ----------------------------------------------------------------------------
// the indices: threadIdx and blockIdx belong to the running CUDA thread (the worker sets them
// at each switch), blockDim and gridDim to the launch

extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

// ----------------------------------------------------------------------------
// synchronization (implemented in emulator.cpp)

namespace llmc_emu {
enum WarpOp { WARP_SYNC, WARP_SHFL, WARP_VOTE, WARP_GATHER };
// one warp-synchronous call of the calling lane: waits until every lane of `mask` has made the
// same call, then returns the 8 bytes of lane `source` (WARP_SHFL), the ballot of `predicate`
// over the mask (WARP_VOTE), or nothing (WARP_SYNC, WARP_GATHER)
unsigned long long warp_call(WarpOp op, unsigned mask, unsigned long long value, int source, const char* what);
void sync_threads();
[[noreturn]] void fail(const char* format, ...);

// The warp-collective instructions' exchange (tensor_cores.h): every one of the warp's 32 lanes
// brings `bytes` bytes (its fragment registers, its row of a matrix); when the last arrives, each
// lane receives all 32 lanes' bytes, lane l's at all + l * bytes. `what` names the instruction:
// every lane must be in the same one (the PTX ISA's .sync.aligned rule), and a warp of fewer than
// 32 lanes may not execute it.
struct Gather {
    const void* mine;
    void* all;
    int bytes;
};
inline void warp_gather(const void* mine, void* all, int bytes, const char* what) {
    Gather g = {mine, all, bytes};
    warp_call(WARP_GATHER, 0xffffffffu, (unsigned long long)(uintptr_t)&g, 0, what);
}
// whether [p, p + bytes) lies inside one __shared__ array of the running block
bool is_shared(const void* p, size_t bytes);
// cvta.to.shared and back: a shared array's generic address as the 32-bit address of the .shared
// window (fails for an address outside the block's shared memory), and that address as a pointer
unsigned shared_window_address(const void* p);
void* shared_window_pointer(unsigned address);
// cp.async (tensor_cores.h): the copy's source read now, its destination written at the wait
void cp_async(void* dst, const void* src, int cp_size, int src_size, const char* what);
void cp_async_commit_group();
void cp_async_wait_group(int pending);
#ifdef LLMC_EMU_TRACE
// the memory counters' hooks (tracer.cpp, in the traced builds of llmc/emulator/memory.py)
void trace_access(const void* p, int size, bool write, const void* pc);
void trace_block_end();
#endif

// the launcher (emulator.cpp) and what each kernel's entry points need from it (build.py's unit)
int launch(const char* name, const unsigned* grid, const unsigned* block, void (*body)(void*), void* args);

// the parameter sizes and pointer flags of a kernel, so that Python can check its arguments
template <class... P> int parameters(void (*)(P...), int* sizes, int* pointers) {
    int i = 0;
    ((sizes[i] = (int)sizeof(P), pointers[i] = std::is_pointer_v<P>, i++), ...);
    return (int)sizeof...(P);
}

// call the kernel with args[i] pointing at its i-th argument, as cuLaunchKernel takes them
template <class... P, size_t... I> void invoke(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_reference_t<P>*>(args[I])...);
}
template <class... P> void invoke(void (*kernel)(P...), void** args) {
    invoke(kernel, args, std::index_sequence_for<P...>{});
}
}

inline void __syncthreads() { llmc_emu::sync_threads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    llmc_emu::warp_call(llmc_emu::WARP_SYNC, mask, 0, 0, "__syncwarp");
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline unsigned __lane_id() {
    return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % warpSize;
}

// A shuffle's source lane depends on the calling lane; `width` splits the warp into segments. The
// shuffle passes its rule (kind, parameter, width) to warp_call, and the launcher, which knows
// the lane, applies it (shfl_source): the calling thread need not read threadIdx for it.
enum ShflKind { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR };
constexpr int SHFL_PARAM_BITS = 8, SHFL_WIDTH_BITS = 8;
inline int __shfl_rule(ShflKind kind, int param, int width) {
    return (int)kind << (SHFL_PARAM_BITS + SHFL_WIDTH_BITS) | width << SHFL_PARAM_BITS | param;
}
// the lane or offset operand as shfl.sync reads it: its low 5 bits, b[4:0] (so a delta of 33 is 1)
inline int __shfl_rule_idx(int src, int width) { return __shfl_rule(SHFL_IDX, src & 31, width); }
inline int __shfl_rule_up(unsigned delta, int width) { return __shfl_rule(SHFL_UP, (int)(delta & 31u), width); }
inline int __shfl_rule_down(unsigned delta, int width) { return __shfl_rule(SHFL_DOWN, (int)(delta & 31u), width); }
inline int __shfl_rule_xor(int lane_mask, int width) { return __shfl_rule(SHFL_XOR, lane_mask & 31, width); }
// The source lane of `lane` under a rule of __shfl_rule: the PTX ISA's shfl.sync with the c operand
// CUDA's intrinsics pass (segment mask 32 - width; clamp 0 for up, 31 otherwise). Its segment runs
// from minLane = lane & ~(width - 1) to maxLane = minLane + width - 1: idx reads minLane + (b mod
// width); up reads lane - b if that is >= minLane; down and xor read lane + b and lane ^ b if those
// are <= maxLane. Else the lane reads itself. So an xor may read an earlier segment, never a later.
inline int shfl_source(int rule, int lane) {
    const int param = rule & ((1 << SHFL_PARAM_BITS) - 1);
    const int width = (rule >> SHFL_PARAM_BITS) & ((1 << SHFL_WIDTH_BITS) - 1);
    const int min_lane = lane & ~(width - 1);
    const int max_lane = min_lane + width - 1;
    switch ((ShflKind)(rule >> (SHFL_PARAM_BITS + SHFL_WIDTH_BITS))) {
    case SHFL_IDX: return min_lane + (param & (width - 1));
    case SHFL_UP: return lane - param >= min_lane ? lane - param : lane;
    case SHFL_DOWN: return lane + param <= max_lane ? lane + param : lane;
    default: return (lane ^ param) <= max_lane ? (lane ^ param) : lane;
    }
}

template <class T> T __shfl_exchange(unsigned mask, T value, int rule, const char* what) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "a shuffle moves at most 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &value, sizeof(T));
    bits = llmc_emu::warp_call(llmc_emu::WARP_SHFL, mask, bits, rule, what);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
template <class T> T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
    return __shfl_exchange(mask, var, __shfl_rule_idx(src_lane, width), "__shfl_sync");
}
template <class T> T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return __shfl_exchange(mask, var, __shfl_rule_up(delta, width), "__shfl_up_sync");
}
template <class T> T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    return __shfl_exchange(mask, var, __shfl_rule_down(delta, width), "__shfl_down_sync");
}
template <class T> T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
    return __shfl_exchange(mask, var, __shfl_rule_xor(lane_mask, width), "__shfl_xor_sync");
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return (unsigned)llmc_emu::warp_call(llmc_emu::WARP_VOTE, mask, predicate != 0, 0, "__ballot_sync");
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

// ----------------------------------------------------------------------------
// bit casts, integer and float math

inline float __int_as_float(int bits) { float f; memcpy(&f, &bits, 4); return f; }
inline float __uint_as_float(unsigned int bits) { float f; memcpy(&f, &bits, 4); return f; }
inline int __float_as_int(float f) { int bits; memcpy(&bits, &f, 4); return bits; }
inline unsigned int __float_as_uint(float f) { unsigned int bits; memcpy(&bits, &f, 4); return bits; }
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline unsigned long min(unsigned long a, unsigned long b) { return a < b ? a : b; }
inline unsigned long max(unsigned long a, unsigned long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }

// CUDA's fast intrinsics, computed exactly here
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }

// cache hints: plain loads and stores on the CPU
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }

// ----------------------------------------------------------------------------
// atomics: blocks run concurrently on the cores, so these are real atomic operations

template <class T> inline T __atomic_update(T* address, T (*op)(T, T), T value) {
    T old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(address, &old, op(old, value), false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return old;
}
inline float atomicAdd(float* address, float value) {
    unsigned int* bits = reinterpret_cast<unsigned int*>(address);
    unsigned int old = __atomic_load_n(bits, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(bits, &old, __float_as_uint(__uint_as_float(old) + value), false,
                                        __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
    }
    return __uint_as_float(old);
}
inline double atomicAdd(double* address, double value) {
    unsigned long long* bits = reinterpret_cast<unsigned long long*>(address);
    unsigned long long old = __atomic_load_n(bits, __ATOMIC_RELAXED), next;
    do {
        double d;
        memcpy(&d, &old, 8);
        d += value;
        memcpy(&next, &d, 8);
    } while (!__atomic_compare_exchange_n(bits, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    double d;
    memcpy(&d, &old, 8);
    return d;
}
inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline int atomicSub(int* a, int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicSub(unsigned int* a, unsigned int v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }
inline int atomicExch(int* a, int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicExch(unsigned int* a, unsigned int v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }
inline float atomicExch(float* a, float v) {
    return __uint_as_float(__atomic_exchange_n(reinterpret_cast<unsigned int*>(a), __float_as_uint(v), __ATOMIC_SEQ_CST));
}
inline int atomicCAS(int* a, int compare, int v) {
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
inline unsigned int atomicCAS(unsigned int* a, unsigned int compare, unsigned int v) {
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
inline unsigned long long atomicCAS(unsigned long long* a, unsigned long long compare, unsigned long long v) {
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
inline int atomicMax(int* a, int v) { return __atomic_update<int>(a, [](int x, int y) { return x > y ? x : y; }, v); }
inline int atomicMin(int* a, int v) { return __atomic_update<int>(a, [](int x, int y) { return x < y ? x : y; }, v); }
inline unsigned int atomicMax(unsigned int* a, unsigned int v) {
    return __atomic_update<unsigned int>(a, [](unsigned int x, unsigned int y) { return x > y ? x : y; }, v);
}
inline unsigned int atomicMin(unsigned int* a, unsigned int v) {
    return __atomic_update<unsigned int>(a, [](unsigned int x, unsigned int y) { return x < y ? x : y; }, v);
}
inline int atomicAnd(int* a, int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline int atomicOr(int* a, int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline int atomicXor(int* a, int v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAnd(unsigned int* a, unsigned int v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicOr(unsigned int* a, unsigned int v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicXor(unsigned int* a, unsigned int v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }

// ----------------------------------------------------------------------------
// bfloat16 (cuda_bf16.h): the upper 16 bits of a float. float -> bf16 rounds to nearest, ties to
// even (a NaN becomes the canonical NaN 0x7fff, as cuda_bf16.hpp does); bf16 -> float is exact.
// Arithmetic on bf16 goes through float, rounding the result once, as sm_80's bf16 operators.

struct __nv_bfloat16;
inline unsigned short __llmc_emu_float_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fffu;
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct __align__(2) __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(__llmc_emu_float_to_bf16_bits(f)) {}
    __nv_bfloat16(double f) : __x(__llmc_emu_float_to_bf16_bits((float)f)) {}
    __nv_bfloat16(int i) : __x(__llmc_emu_float_to_bf16_bits((float)i)) {}
    operator float() const { return __uint_as_float((unsigned int)__x << 16); }
};
typedef __nv_bfloat16 nv_bfloat16;
struct __align__(4) __nv_bfloat162 { __nv_bfloat16 x, y; };
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { __nv_bfloat16 h; h.__x = bits; return h; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __ushort_as_bfloat16(__llmc_emu_float_to_bf16_bits(f)); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __float2bfloat16_rz(float f) {
    unsigned int u = __float_as_uint(f);
    return __ushort_as_bfloat16((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : (unsigned short)(u >> 16));
}
inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline float __low2float(__nv_bfloat162 h) { return (float)h.x; }
inline float __high2float(__nv_bfloat162 h) { return (float)h.y; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)}; }
inline __nv_bfloat16 __hadd(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a + (float)b); }
inline __nv_bfloat16 __hsub(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a - (float)b); }
inline __nv_bfloat16 __hmul(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a * (float)b); }
inline __nv_bfloat16 __hdiv(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn((float)a / (float)b); }
inline __nv_bfloat16 __hfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) {
    return __float2bfloat16_rn(fmaf((float)a, (float)b, (float)c));
}
inline __nv_bfloat16 __hneg(__nv_bfloat16 a) { return __ushort_as_bfloat16(a.__x ^ 0x8000u); }
inline bool __hisnan(__nv_bfloat16 a) { return (a.__x & 0x7fffu) > 0x7f80u; }
inline __nv_bfloat16 __hmax(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(fmaxf((float)a, (float)b)); }
inline __nv_bfloat16 __hmin(__nv_bfloat16 a, __nv_bfloat16 b) { return __float2bfloat16_rn(fminf((float)a, (float)b)); }

// the tensor-core and asynchronous-copy instructions (mma.sync, ldmatrix, cp.async)
#include "tensor_cores.h"
