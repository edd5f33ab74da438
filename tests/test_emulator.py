"""The emulated CUDA device's own rules (llmc/emulator/): its shim, launcher, arrays and cuBLAS.

What it checks, each on a small kernel written here (compiled once by g++, cached in
.emulator-cache/): __syncthreads orders shared memory between threads, threads that have left
count as arrived at it (while the others each hold a fiber stack); shared memory starts as
NaN; warp shuffles (xor, up, down, idx, widths, partial masks) and ballots give CUDA's values;
a mask that omits the calling lane, names a lane that never arrives, or a shuffle that reads a lane
outside its mask stops the launch with a message (a GPU would give garbage or hang); __nv_bfloat16
rounds exactly as llmc.formats.float32_to_bfloat16_bits; atomics from many blocks on several cores
add up exactly; launch arguments are checked against the C signature; a captured stream replays,
and nothing may wait for the device while it captures.
Device arrays refuse what CuPy's refuse: a host array as an operand, in a fill or an assignment,
np.add.at, a NumPy function CuPy does not have.
cuBLAS: gemmEx and gemmStridedBatchedEx against NumPy for every op pair, in fp32 and bf16, with
padded leading dimensions whose padding holds NaN (never read), beta = 0 never reading C, and a
leading dimension too small refused or a wrong one giving a wrong product. Planted bugs on
scratch copies of kernels/ (slow: sanitizer builds, see dev/sanitize_kernels.py): an out-of-bounds
write in cast.cu and in adamw.cu caught by AddressSanitizer, a missing __syncthreads in the block
reduction (run by global_norm.cu) by ThreadSanitizer, a wrong shuffle mask by the emulator itself.
A kernel inside `#if defined(ENABLE_BF16)` is built in bf16 only, and the fp32 build still compiles.
The warp-collective instructions (mma, ldmatrix) run clean under ThreadSanitizer (slow).

Run: python -m pytest -q tests/test_emulator.py   (the first run compiles ~20 s, then a few seconds)
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from llmc.emulator import build, cublas
from llmc.emulator import device as cp
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

FULL = 0xFFFFFFFF

TEST_KERNELS = r"""
extern "C" __global__ void rotate_through_shared(float* out, int n) {
    __shared__ float values[1024];
    const int t = threadIdx.x;
    values[t] = (float)(t * 10);
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = values[(t + 1) % n];          // another thread's write
}
// threads t % 3 == 1 leave at once (each a plain call on a reused stack); the others pass two
// barriers (each waiting thread then holds a stack of its own), at which the leavers count as arrived
extern "C" __global__ void some_threads_leave(float* out) {
    __shared__ float values[1024];
    const int t = threadIdx.x, n = blockDim.x;
    if (t % 3 == 1) {
        out[blockIdx.x * n + t] = -1.0f;
        return;
    }
    values[t] = (float)t;
    __syncthreads();
    const float a = values[t - t % 3];                                 // thread t - t % 3 stays
    __syncthreads();
    values[t] = a + 1000.0f;
    __syncthreads();
    out[blockIdx.x * n + t] = values[t - t % 3];
}
// reads its element before writing it: each block must see NaN, even after an earlier block wrote
extern "C" __global__ void read_shared_unwritten(float* out) {
    __shared__ float values[64];
    out[blockIdx.x * blockDim.x + threadIdx.x] = values[threadIdx.x];
    values[threadIdx.x] = 1.0f;
}
// out[4*lane + j]: xor 5, up 3, down 7, idx 9, all with width `width`
extern "C" __global__ void shuffles(float* out, int width) {
    const int lane = threadIdx.x % 32;
    const float v = (float)(100 + threadIdx.x);
    float* o = out + 4 * threadIdx.x;
    o[0] = __shfl_xor_sync(0xffffffffu, v, 5, width);
    o[1] = __shfl_up_sync(0xffffffffu, v, 3, width);
    o[2] = __shfl_down_sync(0xffffffffu, v, 7, width);
    o[3] = __shfl_sync(0xffffffffu, v, 9, width);
    (void)lane;
}
// the four shuffles with run-time operands, 4 floats per thread (test_shuffle_operands_as_ptx_reads_them)
extern "C" __global__ void shuffle_operands(float* out, int width, int lane_mask, unsigned delta, int src) {
    const float v = (float)(100 + threadIdx.x);
    float* o = out + 4 * threadIdx.x;
    o[0] = __shfl_xor_sync(0xffffffffu, v, lane_mask, width);
    o[1] = __shfl_up_sync(0xffffffffu, v, delta, width);
    o[2] = __shfl_down_sync(0xffffffffu, v, delta, width);
    o[3] = __shfl_sync(0xffffffffu, v, src, width);
}
// lanes below `active` shuffle among themselves with `mask`, reading lane ^ `lane_mask`
extern "C" __global__ void partial_shuffle(float* out, unsigned mask, int active, int lane_mask) {
    const int lane = threadIdx.x % 32;
    if (lane < active) {
        out[threadIdx.x] = __shfl_xor_sync(mask, (float)lane, lane_mask);
    }
}
extern "C" __global__ void ballot(unsigned* out) {
    out[threadIdx.x] = __ballot_sync(0xffffffffu, threadIdx.x % 3 == 0);
}
extern "C" __global__ void round_to_bf16(unsigned short* out, const float* inp, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(inp[i]));
    }
}
extern "C" __global__ void count_atomically(int* count, float* total) {
    atomicAdd(count, 1);
    atomicAdd(total, 0.5f);
}
extern "C" __global__ void add_one(float* x, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        x[i] += 1.0f;
    }
}
"""


@pytest.fixture(scope="module")
def kernels():
    module = cp.RawModule(code=TEST_KERNELS, options=("-DENABLE_FP32",))
    module.compile()
    return module


# ----------------------------------------------------------------------------
# barriers and shared memory

@pytest.mark.parametrize("blocks,n", [(1, 32), (3, 97), (2, 1024)])
def test_syncthreads_orders_shared_memory(kernels, blocks, n):
    out = cp.empty(blocks * n, np.float32)
    kernels.get_function("rotate_through_shared")((blocks,), (n,), (out, np.int32(n)))
    expected = np.tile((np.arange(1, n + 1) % n) * 10.0, blocks)
    np.testing.assert_array_equal(out.get(), expected)


def test_fiber_stacks_are_one_pool_for_every_library():
    """A block of 1024 threads that all wait at a barrier takes 1023 fiber stacks, two memory
    mappings each (guard page and stack), and every kernel library has its own workers. Kept by each
    library, a test run that loads many libraries reached Linux's 65530 mappings and the emulator
    aborted ("out of memory for fiber stacks"); unmapped after every launch, they cost milliseconds
    per launch. The process's one pool (shim/stack_pool.cpp) keeps them for the next launch of any
    library: a second library's launch, and a second launch, map nothing more."""
    def mappings():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    functions = [cp.RawModule(code=TEST_KERNELS + f"// library {k} of this test\n", options=("-DENABLE_FP32",))
                 .get_function("rotate_through_shared") for k in range(2)]
    out = cp.empty(1024, np.float32)
    for function in functions:
        function((1,), (32,), (out, np.int32(32)))                # both libraries loaded, few stacks used
    functions[0]((1,), (1024,), (out, np.int32(1024)))             # the pool now holds a launch's stacks
    np.testing.assert_array_equal(out.get(), (np.arange(1, 1025) % 1024) * 10.0)
    assert build.stack_pool().llmc_emu_stack_pool_size() >= 1023
    before = mappings()
    for function in functions + functions:
        function((1,), (1024,), (out, np.int32(1024)))
        np.testing.assert_array_equal(out.get(), (np.arange(1, 1025) % 1024) * 10.0)
    assert mappings() - before < 20, mappings() - before            # each launch's 1023 stacks from the pool


@pytest.mark.parametrize("blocks,n", [(1, 100), (5, 1024)])
def test_threads_that_leave_count_as_arrived_at_barriers(kernels, blocks, n):
    out = cp.empty(blocks * n, np.float32)
    kernels.get_function("some_threads_leave")((blocks,), (n,), (out,))
    t = np.arange(n)
    expected = np.where(t % 3 == 1, -1.0, t - t % 3 + 1000.0)
    np.testing.assert_array_equal(out.get(), np.tile(expected, blocks))


def test_shared_memory_starts_as_nan(kernels):
    out = cp.zeros(5 * 64, np.float32)
    kernels.get_function("read_shared_unwritten")((5,), (64,), (out,))
    assert np.isnan(out.get()).all()


def test_empty_device_memory_is_nan():
    assert np.isnan(cp.empty(7, np.float32).get()).all()
    assert np.isnan(bfloat16_bits_to_float32(cp.empty(7, np.uint16).get())).all()
    assert cp.zeros(5).data.ptr % cp.ALLOCATION_ALIGNMENT == 0


# ----------------------------------------------------------------------------
# the border between host and device: what CuPy refuses, the emulated arrays refuse
# (CuPy's rules as its source states them: cupy/_core/core.pyx __array_ufunc__ and
# __array_function__, ndarray.fill, cupy.copyto)

def _host_and_device():
    host = np.arange(4, dtype=np.float32)
    return host, cp.asarray(host)


REFUSED = {
    "dev + host":              (TypeError, lambda h, d: d + h),
    "host * dev":              (TypeError, lambda h, d: h * d),
    "ufunc out= a device array": (TypeError, lambda h, d: np.exp(h, out=d)),
    "np.add.at":               (TypeError, lambda h, d: np.add.at(d, [0, 0], 1.0)),
    "np.multiply.outer":       (TypeError, lambda h, d: np.multiply.outer(d, d)),
    "dev[...] = host":         (ValueError, lambda h, d: d.__setitem__(Ellipsis, h)),
    "dev[1:3] = host[1:3]":    (ValueError, lambda h, d: d.__setitem__(slice(1, 3), h[1:3])),
    "dev.fill(host)":          (ValueError, lambda h, d: d.fill(h)),
    "np.copyto(dev, host)":    (ValueError, lambda h, d: np.copyto(d, h)),
    "np.concatenate":          (ValueError, lambda h, d: np.concatenate([d, h])),
    "np.where, a host mask":   (ValueError, lambda h, d: np.where(h > 1, d, 0.0)),
}


@pytest.mark.parametrize("case", REFUSED)
def test_host_arrays_are_not_device_operands(case):
    error, operation = REFUSED[case]
    host, device = _host_and_device()
    with pytest.raises(error, match="host numpy.ndarray|ufunc calls and reductions only"):
        operation(host, device)
    np.testing.assert_array_equal(device.get(), host)              # refused before anything was written


def test_what_cupy_allows_runs_and_gives_numpys_values():
    host, device = _host_and_device()
    np.testing.assert_array_equal((device * 2.0 + np.float32(1)).get(), host * 2 + 1)   # Python and NumPy scalars
    np.testing.assert_array_equal((device == np.array(2.0)).get(), host == 2)   # a 0-d host array in a comparison
    np.testing.assert_allclose(np.exp(device).get(), np.exp(host), rtol=1e-6)   # NumPy's name, CuPy's function
    mask = np.triu(np.ones_like(cp.zeros((3, 3)), dtype=bool), 1)
    assert isinstance(mask, cp.ndarray)
    np.testing.assert_array_equal(mask.get(), np.triu(np.ones((3, 3), dtype=bool), 1))
    scores = cp.zeros((3, 3))
    np.copyto(scores, -np.inf, where=mask)                        # gpt2_cpu.causal_scores' mask
    np.testing.assert_array_equal(scores.get(), np.where(np.triu(np.ones((3, 3)), 1) > 0, -np.inf, 0.0))
    device[1:3] = np.array([7.0], dtype=np.float32)               # a one-element host array: CuPy fills with it
    np.testing.assert_array_equal(device.get(), [0, 7, 7, 3])
    total = device.sum()                                          # CuPy: a 0-d device array, read by float()
    assert isinstance(total, cp.ndarray) and total.shape == () and float(total) == 17.0


def test_numpy_functions_that_cupy_lacks_are_refused():
    cupy = pytest.importorskip("cupy", reason="the emulator compares with the installed CuPy's functions")
    assert not hasattr(cupy, "insert") and hasattr(cupy, "triu")   # the premise, in the CuPy installed
    with pytest.raises(TypeError, match="numpy.insert on a device array: CuPy has no such function"):
        np.insert(cp.zeros(4), 0, 1.0)
    np.testing.assert_array_equal(np.insert(np.zeros(4), 0, 1.0), [1, 0, 0, 0, 0])   # NumPy's own, on host


# ----------------------------------------------------------------------------
# warp shuffles and their masks

def shuffle_reference(block, width):
    """CUDA's shuffle results for value 100 + thread, per thread: xor 5, up 3, down 7, idx 9."""
    out = np.zeros((block, 4), np.float32)
    for t in range(block):
        lane, base = t % 32, t - t % 32
        seg = lane - lane % width
        src_xor = lane ^ 5 if (lane ^ 5) // width == lane // width else lane
        src_up = lane - 3 if lane % width >= 3 else lane
        src_down = lane + 7 if lane % width + 7 < width else lane
        src_idx = seg + 9 % width
        out[t] = [100 + base + s for s in (src_xor, src_up, src_down, src_idx)]
    return out


@pytest.mark.parametrize("width", [32, 16, 8])
def test_shuffles_match_cuda(kernels, width):
    out = cp.empty(64 * 4, np.float32)
    kernels.get_function("shuffles")((1,), (64,), (out, np.int32(width)))
    np.testing.assert_array_equal(out.get().reshape(64, 4), shuffle_reference(64, width))


def ptx_shuffle_source(mode, lane, b, width):
    """The source lane by the PTX ISA's shfl.sync semantics, operand by operand, with the c operand
    CUDA's __shfl_*_sync pass: segment mask (32 - width), clamp 0 for up and 31 for the others."""
    c = (32 - width) << 8 | (0 if mode == "up" else 0x1F)
    bval, cval, segmask = b & 0x1F, c & 0x1F, (c >> 8) & 0x1F
    max_lane = (lane & segmask) | (cval & ~segmask & 0x1F)
    min_lane = lane & segmask
    if mode == "up":
        j, in_range = lane - bval, lane - bval >= max_lane
    elif mode == "down":
        j, in_range = lane + bval, lane + bval <= max_lane
    elif mode == "bfly":
        j, in_range = lane ^ bval, (lane ^ bval) <= max_lane
    else:
        j = min_lane | (bval & ~segmask & 0x1F)
        in_range = j <= max_lane
    return j if in_range else lane


@pytest.mark.parametrize("width,lane_mask,delta,src", [
    (16, 16, 40, -1),          # xor across segments: the upper reads the lower; delta 40 is 8; src -1 is 15
    (8, 12, 33, 37),           # xor 12 = 8 + 4: lanes of odd segments read the segment below; delta 1; src 5
    (32, 37, 31, 31),          # xor 37 reads as 5; the largest delta
    (4, 3, 2, 6),              # small segments
])
def test_shuffle_operands_as_ptx_reads_them(kernels, width, lane_mask, delta, src):
    out = cp.empty(64 * 4, np.float32)
    kernels.get_function("shuffle_operands")((1,), (64,), (out, np.int32(width), np.int32(lane_mask),
                                                              np.uint32(delta), np.int32(src)))
    expected = np.array([[100 + t - t % 32 + ptx_shuffle_source(mode, t % 32, b, width)
                          for mode, b in (("bfly", lane_mask), ("up", delta), ("down", delta), ("idx", src))]
                         for t in range(64)], np.float32)
    np.testing.assert_array_equal(out.get().reshape(64, 4), expected)


def test_partial_mask_shuffles_among_its_lanes(kernels):
    out = cp.zeros(32, np.float32)
    kernels.get_function("partial_shuffle")((1,), (32,), (out, np.uint32(0xFFFF), np.int32(16), np.int32(1)))
    np.testing.assert_array_equal(out.get()[:16], np.arange(16) ^ 1)


@pytest.mark.parametrize("mask,active,lane_mask,message", [
    (FULL, 16, 1, "deadlock"),                          # the mask names lanes 16-31, which never call
    (0xFFFF, 16, 16, "not in the mask"),                # lanes read lanes 16-31, outside the mask
    (0xFFFE, 16, 1, "not in its mask"),                 # lane 0 calls with a mask that omits it
])
def test_wrong_shuffle_masks_stop_the_launch(kernels, mask, active, lane_mask, message):
    out = cp.zeros(32, np.float32)
    with pytest.raises(build.EmulatorError, match=message) as e:
        kernels.get_function("partial_shuffle")((1,), (32,), (out, np.uint32(mask), np.int32(active),
                                                              np.int32(lane_mask)))
    assert "partial_shuffle" in str(e.value) and "block (0,0,0)" in str(e.value)


def test_mask_naming_missing_lanes_of_a_partial_warp(kernels):
    out = cp.zeros(48 * 4, np.float32)                  # warp 1 has lanes 0-15 only; 4 floats per thread
    with pytest.raises(build.EmulatorError, match="do not exist"):
        kernels.get_function("shuffles")((1,), (48,), (out, np.int32(32)))


def test_ballot(kernels):
    out = cp.zeros(64, np.uint32)
    kernels.get_function("ballot")((1,), (64,), (out,))
    bits = [sum(1 << lane for lane in range(32) if (32 * w + lane) % 3 == 0) for w in range(2)]
    np.testing.assert_array_equal(out.get(), np.repeat(bits, 32))


# ----------------------------------------------------------------------------
# bf16, atomics, arguments, capture

def test_bf16_rounds_to_nearest_even_as_llmc_formats(kernels):
    rng = np.random.default_rng(0)
    ties = (np.arange(1, 200, dtype=np.uint32) << 16 | 0x8000).view(np.float32)   # exactly halfway
    special = np.array([0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, 3.4e38, 1e-40, -1e-45, 65504.0], np.float32)
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 10, ties, special])
    out = cp.empty(x.size, np.uint16)
    kernels.get_function("round_to_bf16")((x.size // 256 + 1,), (256,), (out, cp.asarray(x), np.int32(x.size)))
    np.testing.assert_array_equal(out.get(), float32_to_bfloat16_bits(x))
    nan = cp.empty(1, np.uint16)
    kernels.get_function("round_to_bf16")((1,), (32,), (nan, cp.asarray(np.array([np.nan], np.float32)), np.int32(1)))
    assert np.isnan(bfloat16_bits_to_float32(nan.get())).all()


def test_atomics_from_many_blocks_add_up(kernels):
    count, total = cp.zeros(1, np.int32), cp.zeros(1, np.float32)
    kernels.get_function("count_atomically")((37,), (96,), (count, total))
    assert count.get()[0] == 37 * 96 and total.get()[0] == 37 * 96 * 0.5


def test_arguments_are_checked_against_the_signature(kernels):
    x = cp.zeros(4, np.float32)
    add_one = kernels.get_function("add_one")
    with pytest.raises(TypeError, match="4 bytes"):
        add_one((1,), (32,), (x, np.int64(4)))           # int n, passed as 8 bytes
    with pytest.raises(TypeError, match="host numpy array"):
        add_one((1,), (32,), (np.zeros(4, np.float32), np.int32(4)))
    with pytest.raises(TypeError, match="1 arguments, its signature has 2"):
        add_one((1,), (32,), (x,))
    with pytest.raises(build.EmulatorError, match="1025 threads"):
        add_one((1,), (1025,), (x, np.int32(4)))


def test_captured_stream_replays_its_launches(kernels):
    x = cp.zeros(5, np.float32)
    stream = cp.cuda.Stream().use()
    try:
        stream.begin_capture()
        kernels.get_function("add_one")((1,), (32,), (x, np.int32(5)))
        cp.add(x, x, out=x)
        graph = stream.end_capture()
        np.testing.assert_array_equal(x.get(), 0)       # recorded, not run
        graph.launch(stream)
        graph.launch(stream)
        np.testing.assert_array_equal(x.get(), 6)       # (0 + 1) * 2 = 2, then (2 + 1) * 2
    finally:
        cp.cuda.Stream.null.use()


@pytest.mark.parametrize("read", ["get", "float", "int", "bool", "item", "tolist", "stream.synchronize",
                                  "device.synchronize", "deviceSynchronize"])
def test_waiting_for_the_device_while_capturing_is_refused(kernels, read):
    """On a GPU the captured launch has not run, so a read would wait on work that is not there: a
    synchronize is CUDA's error (which invalidates the capture), and a copy to the host CuPy 14
    refuses itself first (cupy/cuda/memory.pyx v14.2.0, copy_to_host_async: RuntimeError). Here the
    read would give the stale 0."""
    x = cp.zeros((), np.float32)                        # one value, so that float(x) and int(x) apply
    stream = cp.cuda.Stream().use()
    reads = {"get": x.get, "float": lambda: float(x), "int": lambda: int(x), "bool": lambda: bool(x),
             "item": x.item, "tolist": x.tolist, "stream.synchronize": stream.synchronize,
             "device.synchronize": cp.cuda.Device(0).synchronize, "deviceSynchronize": cp.cuda.runtime.deviceSynchronize}
    try:
        stream.begin_capture()
        kernels.get_function("add_one")((1,), (32,), (x, np.int32(1)))
        if "ynchronize" in read:
            with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="cudaErrorStreamCaptureUnsupported"):
                reads[read]()
        else:
            with pytest.raises(RuntimeError, match="the current stream is capturing, so D2H transfers are "
                               "disallowed") as refused:
                reads[read]()
            assert type(refused.value) is RuntimeError                  # CuPy's own, not a CUDA error
        stream.end_capture().launch(stream)
        assert float(x) == 1.0                          # after the capture every read is allowed again
    finally:
        cp.cuda.Stream.null.use()


# ----------------------------------------------------------------------------
# cuBLAS: the column-major contract

def colmajor(rng, rows, cols, ld, dtype):
    """A column-major rows x cols matrix with leading dimension ld, stored in a flat device array
    whose padding rows hold NaN: returns (device array, its values as float64)."""
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if dtype == np.uint16:
        values = bfloat16_bits_to_float32(float32_to_bfloat16_bits(values))
    flat = np.full(ld * cols, np.nan, np.float32)
    for j in range(cols):
        flat[j * ld:j * ld + rows] = values[:, j]
    stored = float32_to_bfloat16_bits(flat) if dtype == np.uint16 else flat
    return cp.asarray(stored), values.astype(np.float64)


def run_gemm(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, dtype, beta=0.0, alpha=1.0):
    alpha, b = np.full(1, alpha, np.float32), np.full(1, beta, np.float32)
    t = cublas.CUDA_R_16BF if dtype == np.uint16 else cublas.CUDA_R_32F
    cublas.setPointerMode(1, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(1, transa, transb, m, n, k, alpha.ctypes.data, A.data.ptr, t, lda, B.data.ptr, t, ldb,
                  b.ctypes.data, C.data.ptr, t, ldc, cublas.CUBLAS_COMPUTE_32F, -1)


def read_colmajor(C, rows, cols, ld, dtype):
    flat = C.get()
    flat = bfloat16_bits_to_float32(flat) if dtype == np.uint16 else flat
    return np.stack([flat[j * ld:j * ld + rows] for j in range(cols)], axis=1)


# alpha 1, beta 0 is the fp32 path that writes the product straight into C's memory
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (1.0, 0.0), (0.5, 2.0)])
@pytest.mark.parametrize("dtype", [np.float32, np.uint16])
@pytest.mark.parametrize("transa,transb", [(0, 0), (0, 1), (1, 0), (1, 1)])
def test_gemm_matches_numpy_for_every_op(transa, transb, dtype, alpha, beta):
    rng = np.random.default_rng(transa * 2 + transb)
    m, n, k = 5, 7, 3
    a_shape = (m, k) if transa == 0 else (k, m)
    b_shape = (k, n) if transb == 0 else (n, k)
    A, a = colmajor(rng, *a_shape, a_shape[0] + 2, dtype)
    B, b = colmajor(rng, *b_shape, b_shape[0] + 1, dtype)
    C, c = colmajor(rng, m, n, m + 3, dtype)
    run_gemm(transa, transb, m, n, k, A, a_shape[0] + 2, B, b_shape[0] + 1, C, m + 3, dtype, beta=beta, alpha=alpha)
    expected = alpha * (a if transa == 0 else a.T) @ (b if transb == 0 else b.T) + beta * c
    tol = 1e-2 if dtype == np.uint16 else 1e-5
    np.testing.assert_allclose(read_colmajor(C, m, n, m + 3, dtype), expected, rtol=tol, atol=tol)
    # the padding rows of C are left as they were (NaN)
    assert np.isnan(C.get()[m:m + 3].astype(np.float32)).all() if dtype == np.float32 else True


def test_gemm_beta_zero_never_reads_c():
    rng = np.random.default_rng(1)
    A, a = colmajor(rng, 4, 3, 4, np.float32)
    B, b = colmajor(rng, 3, 2, 3, np.float32)
    C = cp.empty(8, np.float32)                          # NaN
    run_gemm(0, 0, 4, 2, 3, A, 4, B, 3, C, 4, np.float32)
    np.testing.assert_allclose(read_colmajor(C, 4, 2, 4, np.float32), a @ b, rtol=1e-5)


def test_gemm_refuses_a_leading_dimension_below_the_rows():
    A, B, C = cp.zeros(20, np.float32), cp.zeros(20, np.float32), cp.zeros(20, np.float32)
    with pytest.raises(cublas.CUBLASError, match="lda=3 < 4"):
        run_gemm(0, 0, 4, 2, 3, A, 3, B, 3, C, 4, np.float32)
    with pytest.raises(cublas.CUBLASError, match="lda=2 < 3"):
        run_gemm(1, 0, 4, 2, 3, A, 2, B, 3, C, 4, np.float32)   # op T: A is stored k x m
    with pytest.raises(cublas.CUBLASError, match="ldc=3 < 4"):
        run_gemm(0, 0, 4, 2, 3, A, 4, B, 3, C, 3, np.float32)


def test_gemm_with_a_wrong_but_legal_leading_dimension_is_wrong():
    rng = np.random.default_rng(2)
    A, a = colmajor(rng, 4, 3, 4, np.float32)
    B, b = colmajor(rng, 3, 2, 3, np.float32)
    C = cp.zeros(10, np.float32)
    run_gemm(0, 0, 4, 2, 3, A, 4, B, 3, C, 5, np.float32)         # ldc 5: columns land 5 apart
    assert not np.allclose(C.get()[:8].reshape(2, 4).T, a @ b)
    np.testing.assert_allclose(read_colmajor(C, 4, 2, 5, np.float32), a @ b, rtol=1e-5)


@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.5, 2.0)])
def test_strided_batched_gemm(alpha, beta):
    rng = np.random.default_rng(3)
    batch, m, n, k = 3, 4, 5, 6
    ldc, stride_c = m + 1, (m + 1) * n + 2                        # padding rows and gaps between the C_i
    a = rng.standard_normal((batch, k, m)).astype(np.float32)     # each A stored k x m (op T)
    b = rng.standard_normal((batch, k, n)).astype(np.float32)     # each B stored k x n (op N)
    c = rng.standard_normal((batch, n, ldc)).astype(np.float32)   # each C stored m x n, ldc apart
    stored_c = np.full((batch, stride_c), np.nan, np.float32)
    stored_c[:, :n * ldc] = c.reshape(batch, -1)
    A, B = cp.asarray(a.transpose(0, 2, 1).copy()), cp.asarray(b.transpose(0, 2, 1).copy())
    C = cp.asarray(stored_c.ravel())
    alpha_host, beta_host = np.full(1, alpha, np.float32), np.full(1, beta, np.float32)
    cublas.gemmStridedBatchedEx(1, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k, alpha_host.ctypes.data,
                                A.data.ptr, cublas.CUDA_R_32F, k, k * m, B.data.ptr, cublas.CUDA_R_32F, k, k * n,
                                beta_host.ctypes.data, C.data.ptr, cublas.CUDA_R_32F, ldc, stride_c, batch,
                                cublas.CUBLAS_COMPUTE_32F, -1)
    # column-major (m,n) C_i = alpha A_i^T B_i + beta C_i where A_i (k,m), B_i (k,n) column-major are a[i], b[i]
    got = C.get().reshape(batch, stride_c)
    product = got[:, :n * ldc].reshape(batch, n, ldc)[:, :, :m].transpose(0, 2, 1)
    expected = alpha * np.einsum("bkm,bkn->bmn", a, b) + beta * c[:, :, :m].transpose(0, 2, 1)
    np.testing.assert_allclose(product, expected, rtol=1e-5, atol=1e-5)
    # the padding rows and the gaps between the C_i are left as they were
    np.testing.assert_array_equal(got[:, :n * ldc].reshape(batch, n, ldc)[:, :, m:], c[:, :, m:])
    assert np.isnan(got[:, n * ldc:]).all()


# ----------------------------------------------------------------------------
# planted bugs on scratch copies of the kernels, each caught (the sanitizer runs are slow: each
# compiles a kernel file with its sanitizer, and runs it in a python linked with that sanitizer)

SCRATCH_DRIVER = r"""
import sys
import numpy as np
from llmc.emulator import build, device as cp
path, mode, kernel, n, block = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
library = build.Library(path, ["-DENABLE_FP32"], (), mode)
if kernel == "cast_floatX_to_float":        # out = inp, n floats of 2.5
    out, inp = cp.empty(n, np.float32), cp.asarray(np.full(n, 2.5, np.float32))
    library.kernel(kernel)((n // block + 1,), (block,), (out, inp, np.uint64(n)))
    print("sum", float(out.get().sum()))
elif kernel == "adamw_update":              # one step from m = v = 0 on gradients of 1: p -= lr
    params, grads = cp.asarray(np.ones(n, np.float32)), cp.asarray(np.ones(n, np.float32))
    m, v = cp.asarray(np.zeros(n, np.float32)), cp.asarray(np.zeros(n, np.float32))
    vector = 4                                # x128::size in fp32
    num_blocks = -(-n // (block * vector))
    # one tensor: param offset, state offset, count, first block, decayed (kernels/adamw.cu's table)
    tensors = cp.asarray(np.array([0, 0, n, 0, 0], np.int64))
    seeds = cp.asarray(np.array([7], np.uint32))
    step_scalars = cp.asarray(np.array([0.25, 0.5, 0.25], np.float32))   # learning rate, the two corrections
    grad_scale = cp.asarray(np.array([1.0], np.float32))
    library.kernel(kernel)((num_blocks,), (block,), (params, np.uint64(0), grads, m, v, tensors, np.int32(1),
                                                     np.int64(num_blocks), seeds, step_scalars, grad_scale,
                                                     np.float32(0.5), np.float32(0.75), np.float32(0.0),
                                                     np.float32(0.0)))
    print("params", sorted(set(params.get().tolist())))
else:                                       # global_norm_finalize over n partials of 1.0
    out, partial = cp.empty(2, np.float32), cp.asarray(np.ones(n, np.float32))   # the norm, the clipping factor
    library.kernel(kernel)((1,), (block,), (out, partial, np.int32(n), np.float32(0.0)))
    print("norm", float(out.get()[0]))
"""


def scratch_copy(tmp_path, file, replace=None, header_replace=None):
    """kernels/<file>.cu and common.cuh copied to tmp_path, with one (old, new) text replacement
    in each (asserted to apply); returns the .cu path."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name, edit in ((f"{file}.cu", replace), ("common.cuh", header_replace)):
        with open(os.path.join(root, "kernels", name)) as f:
            text = f.read()
        if edit:
            assert edit[0] in text
            text = text.replace(edit[0], edit[1], 1)
        (tmp_path / name).write_text(text)
    return str(tmp_path / f"{file}.cu")


def run_sanitized(mode, path, kernel, n, block):
    python = build.sanitizer_python(mode)
    result = subprocess.run([python, "-c", SCRATCH_DRIVER, path, mode, kernel, str(n), str(block)],
                            env=build.sanitizer_environment(mode), capture_output=True, text=True, timeout=600)
    return result.returncode, result.stdout + result.stderr


OUT_OF_BOUNDS = ("i < n;\n         i += (size_t)gridDim.x * blockDim.x) {\n        out[i] = (float)inp[i];",
                 "i <= n;\n         i += (size_t)gridDim.x * blockDim.x) {\n        out[i] = (float)inp[i];")
ADAMW_OUT_OF_BOUNDS = ("i < begin + x128::size && i < n; i++)", "i < begin + x128::size && i <= n; i++)")
MISSING_BARRIER = ("    values[threadIdx.x] = value;\n    __syncthreads();", "    values[threadIdx.x] = value;")   # blockSumToThread0
WRONG_MASK = ("value += __shfl_xor_sync(FULL_WARP_MASK, value, offset);",
              "value += __shfl_xor_sync(0x0000ffffu, value, offset);")


# (file, kernel, the bug, what the clean run prints). adamw: grads[n] is read (then m, v and
# params[n] written) by the thread of the last, partial vector (the scalar path); clean, m = 0.5, v = 0.25 and
# mhat / sqrt(vhat) = (0.5 / 0.5) / sqrt(0.25 / 0.25) = 1, so p = 1 - 0.25 exactly
OUT_OF_BOUNDS_CASES = [("cast", "cast_floatX_to_float", OUT_OF_BOUNDS, "sum 2502.5"),
                       ("adamw", "adamw_update", ADAMW_OUT_OF_BOUNDS, "params [0.75]")]


@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("file,kernel,bug,clean", OUT_OF_BOUNDS_CASES, ids=[c[0] for c in OUT_OF_BOUNDS_CASES])
def test_out_of_bounds_write_is_caught_by_addresssanitizer(tmp_path, planted, file, kernel, bug, clean):
    path = scratch_copy(tmp_path, file, bug if planted else None)
    rc, out = run_sanitized("asan", path, kernel, 1001, 256)
    if planted:
        assert rc == build.SANITIZER_EXIT_CODE and "heap-buffer-overflow" in out, out[-3000:]
    else:
        assert rc == 0 and clean in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True])
def test_missing_syncthreads_is_caught_by_threadsanitizer(tmp_path, planted):
    path = scratch_copy(tmp_path, "global_norm", header_replace=MISSING_BARRIER if planted else None)
    rc, out = run_sanitized("tsan", path, "global_norm_finalize", 300, 128)
    if planted:
        assert rc == build.SANITIZER_EXIT_CODE and "ThreadSanitizer: data race" in out, out[-3000:]
    else:
        assert rc == 0 and f"norm {np.sqrt(np.float32(300))}" in out, out[-3000:]


@pytest.mark.slow
def test_warp_collective_instructions_are_clean_under_threadsanitizer():
    """mma and ldmatrix exchange the lanes' registers in the emulator's own code (gather_complete),
    ordered by a lock ThreadSanitizer does not see: copied with memcpy, its interceptor reported a
    race between the lanes' OS threads in every tensor-core kernel. dev/cuda/tensor_core.py's
    instruction kernels (mma, ldmatrix x1/x2/x4 and .trans, cp.async) now run clean, with the
    layouts the fiber build gives."""
    python = build.sanitizer_python("tsan")
    result = subprocess.run([python, os.path.join(ROOT, "dev", "cuda", "tensor_core.py"), "--device", "cpu"],
                            cwd=ROOT, env=build.sanitizer_environment("tsan"), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0 and "ThreadSanitizer" not in result.stderr, result.stderr[-3000:]
    assert "  lane  9: a0 ( 2, 2)  a1 ( 2, 3)  a2 (10, 2)  a3 (10, 3)" in result.stdout
    assert "after cp.async.wait_all     : group 0: 32  group 1: 32  group 2: 32" in result.stdout


@pytest.mark.parametrize("planted", [False, True])
def test_wrong_shuffle_mask_is_caught_by_the_emulator(tmp_path, planted):
    path = scratch_copy(tmp_path, "global_norm", header_replace=WRONG_MASK if planted else None)
    library = build.Library(path, ["-DENABLE_FP32"], ())
    out, partial = cp.empty(2, np.float32), cp.asarray(np.ones(300, np.float32))   # the norm, the clipping factor
    launch = lambda: library.kernel("global_norm_finalize")((1,), (128,), (out, partial, np.int32(300),  # noqa: E731
                                                                         np.float32(0.0)))
    if planted:
        with pytest.raises(build.EmulatorError, match="reads lane 16, which is not in the mask"):
            launch()
    else:
        launch()
        assert out.get()[0] == np.sqrt(np.float32(300))


# ----------------------------------------------------------------------------
# kernels the preprocessor leaves out

CONDITIONAL_KERNELS = r"""
#include "common.cuh"
extern "C" __global__ void in_every_build(floatX* x) { x[threadIdx.x] = (floatX)1.0f; }
#if defined(ENABLE_BF16)
extern "C" __global__ void bf16_only(floatX* x) { x[threadIdx.x] = (floatX)2.0f; }
#endif
"""


@pytest.mark.parametrize("precision,names", [("fp32", ["in_every_build"]), ("bf16", ["in_every_build", "bf16_only"])])
def test_a_kernel_inside_a_preprocessor_conditional_exists_only_where_it_is_compiled(tmp_path, precision, names):
    """As NVRTC compiles it: dev/cuda/matmul.cu's tensor-core kernels are bf16 only (#if
    defined(ENABLE_BF16)); the fp32 build used to fail, its generated unit naming kernels that
    the preprocessor had removed."""
    path = tmp_path / "conditional.cu"
    path.write_text(CONDITIONAL_KERNELS)
    library = build.kernel_library(str(path), precision)
    assert library.names == names
    x = cp.zeros(4, np.uint16 if precision == "bf16" else np.float32)
    library.kernel(names[-1])((1,), (4,), (x,))
    values = bfloat16_bits_to_float32(x.get()) if precision == "bf16" else x.get()
    np.testing.assert_array_equal(values, np.full(4, float(len(names))))


# ----------------------------------------------------------------------------
# the kernel cache under concurrency and damage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_KERNEL = '''extern "C" __global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { x[i] += 1.0f; }
}
'''
BUILD_AND_LAUNCH = """
import ctypes, sys
sys.path.insert(0, {root!r})
from llmc.emulator import build
library = build.kernel_library({kernel!r}, "fp32")
getattr(library.library, "llmc_emu_launch_add_one")          # the kernel is in the library
print("ok", library.path)
"""


def _build_in_subprocesses(tmp_path, cache, n):
    kernel = tmp_path / "tiny_kernel.cu"
    kernel.write_text(TINY_KERNEL)
    env = dict(os.environ, LLMC_EMULATOR_CACHE=str(cache))
    code = BUILD_AND_LAUNCH.format(root=ROOT, kernel=str(kernel))
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(n)]
    return [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]


def test_concurrent_builds_into_an_empty_cache_all_get_a_whole_library(tmp_path):
    """Four processes build one kernel into an empty cache at once: one compiles, the others
    wait for it (a lock per library), and every one loads a library that has the kernel."""
    results = _build_in_subprocesses(tmp_path, tmp_path / "cache", 4)
    assert all(code == 0 and out.startswith("ok ") for code, out, _ in results), results
    assert len({out.split()[1] for _, out, _ in results}) == 1
    leftovers = [n for n in os.listdir(tmp_path / "cache") if n.startswith("tmp")]
    assert leftovers == []                                    # every temporary renamed or removed


def test_a_truncated_cached_library_is_rebuilt_with_a_note(tmp_path):
    cache = tmp_path / "cache"
    (code, out, err), = _build_in_subprocesses(tmp_path, cache, 1)
    assert code == 0, err
    so = out.split()[1]
    with open(so, "r+b") as f:                                # a crash mid-copy, a full disk: half a library
        f.truncate(os.path.getsize(so) // 2)
    (code, out, err), = _build_in_subprocesses(tmp_path, cache, 1)
    assert code == 0 and out.startswith("ok "), err
    assert "is damaged" in err and "rebuilding it" in err
    (code, out, err), = _build_in_subprocesses(tmp_path, cache, 1)
    assert code == 0 and err == ""                            # whole again: no note


def test_the_sanitizer_python_finds_this_environments_numpy():
    """The sanitizer python is the base installation's interpreter: in a virtual environment on a
    stock Debian python3 (numpy only in the venv) it found no numpy, and every sanitizer test and
    `make sanitize` failed on a fresh machine. Its PYTHONPATH must hold numpy's folder."""
    import numpy
    env = build.sanitizer_environment("asan")
    site_dir = os.path.dirname(os.path.dirname(os.path.abspath(numpy.__file__)))
    assert site_dir in env["PYTHONPATH"].split(os.pathsep), env["PYTHONPATH"]
    assert env["PYTHONPATH"].split(os.pathsep)[0] == build.ROOT


def test_kernels_run_where_the_compiler_fortifies_string_functions(tmp_path):
    """Ubuntu's g++ (the GPU machine's) defines _FORTIFY_SOURCE=3, whose memset checks the object a
    pointer came from: the shared arrays' NaN fill, reached from a one-char TLS anchor, aborted
    with "buffer overflow detected" there. The same build here, through a g++ that fortifies."""
    wrapper = tmp_path / "g++"
    wrapper.write_text('#!/bin/sh\nexec g++ -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=3 "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, CXX=str(wrapper), LLMC_EMULATOR_CACHE=str(tmp_path / "cache"), PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "cuda", "tensor_core.py"), "--device", "cpu"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "after cp.async.wait_all     : group 0: 32  group 1: 32  group 2: 32" in result.stdout


@pytest.mark.parametrize("mode", ["tsan", "asan"])
def test_a_kernels_shared_memory_beside_a_helpers_builds_in_os_thread_mode(tmp_path, mode):
    """OS-thread mode (the sanitizers') keeps __shared__ variables in one named section, where g++
    refused a kernel's own __shared__ array beside an inline helper's (blockReduceSoftmax's) with
    "section type conflict", though CUDA allows it (dev/cuda/classifier.cu's versions 4 and 5)."""
    source = tmp_path / "both.cu"
    source.write_text('#include "common.cuh"\n'
                      'extern "C" __global__ void both(const floatX* inp, float* out) {\n'
                      '    extern __shared__ __align__(16) x128 groups[];\n'
                      '    __shared__ float own[32];\n'
                      '    groups[threadIdx.x] = load128(inp + threadIdx.x * x128::size);\n'
                      '    own[threadIdx.x % 32] = (float)groups[threadIdx.x][0];\n'
                      '    SoftmaxState state = softmax_state_add(softmax_state_empty(), own[threadIdx.x % 32]);\n'
                      '    state = blockReduceSoftmax(state);\n'
                      '    out[threadIdx.x] = state.max + state.sum;\n'
                      '}\n')
    from llmc.emulator.device import static_dynamic_shared
    unit = tmp_path / "unit.cpp"
    unit.write_text(build.unit_source(build.source_file(static_dynamic_shared(source.read_text())), ["both"]))
    flags = build.compiler_flags(["-DENABLE_BF16"], [build.KERNELS_DIR], mode)
    result = subprocess.run([build.CXX, *flags, "-c", str(unit), "-o", str(tmp_path / "unit.o")], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr[-2000:]
