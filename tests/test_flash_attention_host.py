"""kernels/flash_attention.cu's fp32 build run on the CPU, checked against gpt2_cpu.py.

What it is: the unmodified kernels/flash_attention.cu and kernels/common.cuh, compiled by g++ as
host C++ with -DENABLE_FP32 against a small shim (HOST_SHIM below, force-included before them):
- a CUDA block is blockDim.x std::threads; blocks run one after another;
- __syncthreads is a std::barrier of the block, __syncwarp a std::barrier of each warp of 32
  threads, a warp shuffle an exchange through a per-warp array between two warp barriers;
- __shared__ arrays are `static` variables placed in one linker section, which is filled with NaN
  bytes before every block (shared memory starts as garbage on a GPU: a kernel that reads a shared
  element it never wrote gets NaN here, and the comparison fails);
- every output starts as NaN, so an element that no thread writes fails too.
The kernel names, grids, blocks and scalars are the ones llmc.attention.flash_attention_forward /
_backward pass to llmc.cuda.launch (recorded by a stand-in for it), so the launchers are checked
with the kernels. common.cuh is the real one: <cuda_bf16.h> is replaced by a stub
(HOST_CUDA_BF16) declaring __nv_bfloat16 and the two conversions that common.cuh's bf16-only
helpers name; they abort if called (the fp32 build never calls them).

What it checks: indexing, tiling, the causal mask, the tails (T not a multiple of the tiles, rows
past T), the barriers (ThreadSanitizer, below), that the dk/dv kernel
writes only the dk and dv columns of dqkv, and that two runs are bitwise equal.
What it is not: the bf16 build (inline-PTX wmma cannot run on a CPU), the GPU's speed, bank
conflicts, register use, CUDA's expf/logf (glibc's are used here), or the GPU's memory model.
Host threads never run in lockstep, which makes a missing barrier more likely to show than on a
GPU; but a shuffle here is a full barrier of the warp, so it also orders the shared-memory
accesses around it, which __shfl_xor_sync does not promise on a GPU.

A second build under ThreadSanitizer (-fsanitize=thread) reports any data race on shared memory,
i.e. a missing __syncwarp / __syncthreads, whatever order the threads happened to run in.

Run: python -m pytest -q tests/test_flash_attention_host.py
     (15 passed in about 10 s on 2 cores: two g++ builds of ~2.5 s, then a second or less per
     shape; skipped without g++ C++20 <barrier>, the TSan test also without libtsan)
"""

import math
import os
import shutil
import subprocess

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc.attention
import llmc.cuda
from llmc.check import TOLERANCES, check_tensor

FLASH_ATTENTION_CU = os.path.join(llmc.cuda.KERNELS_DIR, "flash_attention.cu")
ATOL, RTOL = TOLERANCES["kernel_fp32"]["attention"]

# (B, T, NH, HS). fp32 tiles (owned, streamed): HS 16, 32 -> (64, 32); 64 -> (32, 32); 128 -> (16, 16)
SHAPES = [
    (2, 64, 2, 16),     # one owned block per head, two streamed key blocks, two heads and batches
    (1, 70, 2, 64),     # T not a multiple of either tile: a warp whose 16 rows all lie past T
    (1, 1, 1, 64),      # a single query: every tile is all tail
    (1, 130, 1, 32),    # three owned blocks, five streamed, tail of 2 rows
    (1, 37, 2, 128),    # one warp per block, 16 x 16 tiles
]


# ----------------------------------------------------------------------------
# the shim: CUDA's device-side names as host C++

HOST_CUDA_BF16 = r"""
#pragma once
// stand-in for <cuda_bf16.h>: only what common.cuh names; the fp32 build never calls these
#include <cstdio>
#include <cstdlib>
struct __nv_bfloat16 { unsigned short bits; };
inline __nv_bfloat16 __float2bfloat16_rn(float) { fputs("bf16 is not emulated\n", stderr); abort(); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short) { fputs("bf16 is not emulated\n", stderr); abort(); }
"""

HOST_SHIM = r"""
#pragma once
#include <barrier>
#include <cmath>
#include <math.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// a __shared__ array is a function-local static: one per kernel instantiation, seen by all
// threads. Their addresses and sizes come from the linked program's symbol table (the test runs
// nm), as lines "address size" in shared_arrays.txt; launch() fills them with NaN before every block
#define __shared__ static
std::vector<std::pair<char*, size_t>> shared_arrays;

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x, y, z; };
struct int4 { int x, y, z, w; } __attribute__((aligned(16)));
thread_local uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

struct WarpState {                       // one warp: its barrier and its shuffle mailbox
    std::barrier<> barrier;
    unsigned long long lanes[32];
    explicit WarpState(int n) : barrier(n) {}
};
struct BlockState {
    std::barrier<> barrier;
    std::vector<std::unique_ptr<WarpState>> warps;
    explicit BlockState(int n) : barrier(n) {
        for (int w = 0; w < (n + 31) / 32; w++) warps.emplace_back(new WarpState(n - 32 * w < 32 ? n - 32 * w : 32));
    }
};
thread_local BlockState* this_block;
thread_local WarpState* this_warp;

inline void fail(const char* what) { fprintf(stderr, "shim: %s\n", what); abort(); }
inline void __syncthreads() { this_block->barrier.arrive_and_wait(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) fail("__syncwarp with a partial mask is not emulated");
    this_warp->barrier.arrive_and_wait();
}
// every lane posts its value, the warp waits, every lane reads its partner's, the warp waits again
// (so that the next shuffle cannot overwrite a value before its partner has read it)
template <class T> T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "shuffles of up to 8 bytes");
    if (mask != 0xffffffffu || width != 32) fail("__shfl_xor_sync: only full warps are emulated");
    const unsigned lane = threadIdx.x % 32, partner = lane ^ (unsigned)lane_mask;
    if (partner >= 32 || threadIdx.x / 32 == blockDim.x / 32)     // the last warp of a block of 32k+n
        fail("__shfl_xor_sync: only lanes of full warps are emulated");
    memcpy(&this_warp->lanes[lane], &value, sizeof(T));
    this_warp->barrier.arrive_and_wait();
    T other;
    memcpy(&other, &this_warp->lanes[partner], sizeof(T));
    this_warp->barrier.arrive_and_wait();
    return other;
}

inline float __int_as_float(int bits) { float f; memcpy(&f, &bits, 4); return f; }
inline int __float_as_int(float f) { int bits; memcpy(&bits, &f, 4); return bits; }
inline unsigned int __float_as_uint(float f) { unsigned int bits; memcpy(&bits, &f, 4); return bits; }
inline int4 __ldcs(const int4* p) { return *p; }
inline void __stcs(int4* p, int4 v) { *p = v; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// run kernel() as a grid of blocks of `block` threads, one block at a time
template <class Kernel> void launch(dim3 grid, unsigned block, Kernel kernel) {
    gridDim = grid;
    blockDim = {block, 1, 1};
    for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
    for (unsigned bx = 0; bx < grid.x; bx++) {
        for (auto& [address, size] : shared_arrays) memset(address, 0xff, size);   // garbage: NaN
        BlockState state(block);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; t++) {
            threads.emplace_back([&, t] {
                threadIdx = {t, 0, 0};
                blockIdx = {bx, by, bz};
                this_block = &state;
                this_warp = state.warps[t / 32].get();
                kernel();
            });
        }
        for (auto& thread : threads) thread.join();
    }
}
"""

# The host program. argv: B T NH HS repeats, then per launch (forward, preprocess, dk/dv, dq):
# kernel name, grid.x, grid.y, block. Reads qkv.bin, dout.bin; per repeat r writes out_r, lse_r,
# D_r, dqkv_dkdv_r (dqkv after the dk/dv kernel only) and dqkv_r. Every output starts as NaN.
HOST_MAIN = r"""
#include <string>
typedef void (*ForwardKernel)(float*, float*, const float*, int, int, int);
typedef void (*BackwardKernel)(float*, const float*, const float*, const float*, const float*, int, int, int);
template <class K> K find(const char* name, std::initializer_list<std::pair<const char*, K>> table) {
    for (auto& entry : table) if (std::string(entry.first) == name) return entry.second;
    fprintf(stderr, "no kernel %s\n", name); abort();
}
#define ENTRY(name) {#name, name}
std::vector<float> load(const char* path, size_t n) {
    std::vector<float> v(n);
    FILE* f = fopen(path, "rb");
    if (!f || fread(v.data(), 4, n, f) != n) abort();
    fclose(f);
    return v;
}
void save(const std::string& path, const std::vector<float>& v) {
    FILE* f = fopen(path.c_str(), "wb");
    fwrite(v.data(), 4, v.size(), f);
    fclose(f);
}
struct Launch { const char* name; dim3 grid; unsigned block; };
Launch parse(char** a) { return {a[0], {(unsigned)atoi(a[1]), (unsigned)atoi(a[2]), 1}, (unsigned)atoi(a[3])}; }

int main(int argc, char** argv) {
    if (argc != 6 + 4 * 4) abort();
    const int B = atoi(argv[1]), T = atoi(argv[2]), NH = atoi(argv[3]), HS = atoi(argv[4]), repeats = atoi(argv[5]);
    const Launch fwd = parse(argv + 6), pre = parse(argv + 10), dkdv = parse(argv + 14), dq = parse(argv + 18);
    const size_t C = (size_t)NH * HS, n_qkv = (size_t)B * T * 3 * C, n_out = (size_t)B * T * C, n_lse = (size_t)B * NH * T;
    ForwardKernel forward = find<ForwardKernel>(fwd.name, {ENTRY(flash_attention_forward_hs16),
        ENTRY(flash_attention_forward_hs32), ENTRY(flash_attention_forward_hs64), ENTRY(flash_attention_forward_hs128)});
    BackwardKernel dkdv_kernel = find<BackwardKernel>(dkdv.name, {ENTRY(flash_attention_backward_dkdv_hs16),
        ENTRY(flash_attention_backward_dkdv_hs32), ENTRY(flash_attention_backward_dkdv_hs64),
        ENTRY(flash_attention_backward_dkdv_hs128)});
    BackwardKernel dq_kernel = find<BackwardKernel>(dq.name, {ENTRY(flash_attention_backward_dq_hs16),
        ENTRY(flash_attention_backward_dq_hs32), ENTRY(flash_attention_backward_dq_hs64),
        ENTRY(flash_attention_backward_dq_hs128)});
    if (std::string(pre.name) != "flash_attention_backward_preprocess") abort();
    FILE* f = fopen("shared_arrays.txt", "r");
    unsigned long long address, size;
    while (f && fscanf(f, "%llx %llx", &address, &size) == 2) shared_arrays.push_back({(char*)address, size});
    if (!f || shared_arrays.empty()) abort();
    fclose(f);
    const auto qkv = load("qkv.bin", n_qkv), dout = load("dout.bin", n_out);
    for (int r = 0; r < repeats; r++) {
        std::vector<float> out(n_out, NAN), lse(n_lse, NAN), D(n_lse, NAN), dqkv(n_qkv, NAN);
        launch(fwd.grid, fwd.block, [&] { forward(out.data(), lse.data(), qkv.data(), B, T, NH); });
        launch(pre.grid, pre.block, [&] { flash_attention_backward_preprocess(D.data(), dout.data(), out.data(), B, T, NH, HS); });
        launch(dkdv.grid, dkdv.block, [&] { dkdv_kernel(dqkv.data(), dout.data(), qkv.data(), lse.data(), D.data(), B, T, NH); });
        const std::string suffix = "_" + std::to_string(r) + ".bin";
        save("dqkv_dkdv" + suffix, dqkv);
        launch(dq.grid, dq.block, [&] { dq_kernel(dqkv.data(), dout.data(), qkv.data(), lse.data(), D.data(), B, T, NH); });
        save("out" + suffix, out);
        save("lse" + suffix, lse);
        save("D" + suffix, D);
        save("dqkv" + suffix, dqkv);
    }
}
"""


def build_host_program(workdir, kernel_source=FLASH_ATTENTION_CU, flags=("-O2",)):
    """Compile kernel_source (a flash_attention.cu next to its common.cuh) with HOST_SHIM and
    HOST_MAIN and the g++ `flags` into workdir/host, and list its __shared__ arrays in
    workdir/shared_arrays.txt. Returns workdir. Skips the test without g++ or without C++20
    <barrier>, or when a -fsanitize flag cannot link (no libtsan)."""
    if shutil.which("g++") is None or shutil.which("nm") is None:
        pytest.skip("no g++ and nm to run the kernels on the CPU")
    (workdir / "shim.h").write_text(HOST_SHIM)
    (workdir / "cuda_bf16.h").write_text(HOST_CUDA_BF16)
    (workdir / "host.cpp").write_text(f'#include "{os.path.abspath(kernel_source)}"\n' + HOST_MAIN)
    # -no-pie: the symbol table's addresses are the run-time addresses
    build = subprocess.run(["g++", "-std=c++20", *flags, "-pthread", "-no-pie", "-DENABLE_FP32", "-include", "shim.h",
                            "-I.", "host.cpp", "-o", "host"], cwd=workdir, capture_output=True, text=True,
                           timeout=300)
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"g++ without C++20 <barrier>: {build.stderr.splitlines()[0]}")
    if build.returncode != 0 and any(f.startswith("-fsanitize") for f in flags) and "-ltsan" in build.stderr:
        pytest.skip(f"g++ cannot link {flags}: {build.stderr.splitlines()[-1]}")
    assert build.returncode == 0, build.stderr
    arrays = shared_arrays(workdir / "host")
    # forward 6 tiles, dk/dv 8, dq 6, per head size: nm found them all
    assert len(arrays) == (6 + 8 + 6) * len(llmc.attention.FLASH_HEAD_SIZES), arrays
    (workdir / "shared_arrays.txt").write_text("".join(f"{address} {size}\n" for address, size, _ in arrays))
    return workdir


def shared_arrays(program):
    """(hex address, hex size, name) of every function-local static of the kernels in `program`:
    the __shared__ arrays, e.g. `flash_attention_forward_block<16>(...)::q_tile`."""
    symbols = subprocess.run(["nm", "-C", "-S", "--defined-only", str(program)], capture_output=True, text=True,
                             check=True).stdout
    arrays = []
    for line in symbols.splitlines():
        fields = line.split(maxsplit=3)
        if len(fields) == 4 and fields[2] in "bBu" and fields[3].startswith(KERNEL_FUNCTION_PREFIXES) \
                and ")::" in fields[3]:
            arrays.append((fields[0], fields[1], fields[3]))
    return arrays


KERNEL_FUNCTION_PREFIXES = ("flash_attention_", "void flash_attention_", "blockReduce")


# ----------------------------------------------------------------------------
# the launches, as gpt2_cuda's launchers make them

def recorded_launches(B, T, NH, HS):
    """[(kernel name, (grid.x, grid.y), block)] of flash_attention_forward then _backward, recorded
    by standing in for llmc.cuda.launch, in launch order; asserts the scalars each passes."""
    C = NH * HS
    launches = []

    def record(file, precision, name, grid, block, args):
        assert (file, precision) == ("flash_attention", "fp32")
        grid = grid if isinstance(grid, tuple) else (grid,)
        scalars = [a for a in args if isinstance(a, np.generic)]
        assert all(isinstance(a, np.int32) for a in scalars), (name, scalars)
        expected = (B, T, NH, HS) if name == "flash_attention_backward_preprocess" else (B, T, NH)
        assert tuple(int(a) for a in scalars) == expected, (name, scalars)
        launches.append((name, (grid + (1,))[:2], block))

    f32 = lambda *shape: np.zeros(shape, np.float32)                      # noqa: E731
    saved, llmc.cuda.launch = llmc.cuda.launch, record
    try:
        llmc.attention.flash_attention_forward(f32(B, T, C), f32(B, NH, T), f32(B, T, 3 * C), B, T, C, NH)
        llmc.attention.flash_attention_backward(f32(B, T, 3 * C), f32(B, NH, T), f32(B, T, C), f32(B, T, C),
                                           f32(B, T, 3 * C), f32(B, NH, T), B, T, C, NH)
    finally:
        llmc.cuda.launch = saved
    return launches


def run_host_program(workdir, B, T, NH, HS, qkv, dout, repeats=2):
    """Run the kernels on qkv (B,T,3C) and dout (B,T,C) with the launchers' launches, `repeats`
    times. Returns a list, one dict per repeat, of out (B,T,C), lse (B,NH,T), D (B,NH,T),
    dqkv_dkdv (B,T,3C) (after the dk/dv kernel only) and dqkv (B,T,3C), all float32."""
    qkv.astype(np.float32).tofile(workdir / "qkv.bin")
    dout.astype(np.float32).tofile(workdir / "dout.bin")
    launches = recorded_launches(B, T, NH, HS)
    assert [name for name, _, _ in launches] == [f"flash_attention_forward_hs{HS}",
                                                 "flash_attention_backward_preprocess",
                                                 f"flash_attention_backward_dkdv_hs{HS}",
                                                 f"flash_attention_backward_dq_hs{HS}"]
    args = [B, T, NH, HS, repeats] + [str(a) for name, (gx, gy), block in launches for a in (name, gx, gy, block)]
    run = subprocess.run(["./host"] + [str(a) for a in args], cwd=workdir, capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66"))
    assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stderr[:3000]
    C = NH * HS
    shapes = {"out": (B, T, C), "lse": (B, NH, T), "D": (B, NH, T), "dqkv_dkdv": (B, T, 3 * C), "dqkv": (B, T, 3 * C)}
    return [{name: np.fromfile(workdir / f"{name}_{r}.bin", np.float32).reshape(shape)
             for name, shape in shapes.items()} for r in range(repeats)]


# ----------------------------------------------------------------------------
# the references, float64

def causal_logsumexp(qkv, NH):
    """lse (B,NH,T) = log sum_{j<=t} exp(q_t . k_j / sqrt(HS)), float64, written out independently
    of gpt2_cpu: the max-shifted log-sum-exp of the masked scaled scores."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    q, k, _ = (qkv.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4))             # each (B,NH,T,HS)
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(HS)                         # (B,NH,T,T)
    scores[..., np.triu(np.ones((T, T), dtype=bool), k=1)] = -np.inf
    top = scores.max(axis=-1)                                                      # (B,NH,T)
    return top + np.log(np.exp(scores - top[..., None]).sum(axis=-1))


def random_inputs(B, T, NH, HS, seed):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((B, T, 3 * NH * HS)).astype(np.float32)
    dout = rng.standard_normal((B, T, NH * HS)).astype(np.float32)
    return qkv, dout


@pytest.fixture(scope="module")
def host_program(tmp_path_factory):
    """The host build of kernels/flash_attention.cu, compiled once per session."""
    return build_host_program(tmp_path_factory.mktemp("flash_attention_host"))


@pytest.fixture(scope="module")
def tsan_program(tmp_path_factory):
    """The same build under ThreadSanitizer: a data race on shared memory (a missing __syncwarp or
    __syncthreads) is reported whatever order the threads happened to run in."""
    return build_host_program(tmp_path_factory.mktemp("flash_attention_tsan"), flags=("-O1", "-fsanitize=thread"))


@pytest.fixture(scope="module")
def host_runs(host_program):
    """shape -> (qkv, dout, [two runs' outputs]): each shape is run once, shared by the tests."""
    runs = {}

    def get(shape):
        if shape not in runs:
            qkv, dout = random_inputs(*shape, seed=sum(shape))
            runs[shape] = qkv, dout, run_host_program(host_program, *shape, qkv, dout)
        return runs[shape]
    return get


# ----------------------------------------------------------------------------
# tests

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_NH{}_HS{}".format(*s))
def test_forward_on_the_cpu(host_runs, shape):
    B, T, NH, HS = shape
    qkv, _, runs = host_runs(shape)
    out_ref, _ = gpt2_cpu.attention_forward(qkv.astype(np.float64), NH)
    assert check_tensor(runs[0]["out"], out_ref, f"out {shape}", ATOL, RTOL)
    assert check_tensor(runs[0]["lse"], causal_logsumexp(qkv.astype(np.float64), NH), f"lse {shape}", ATOL, RTOL)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_T{}_NH{}_HS{}".format(*s))
def test_backward_on_the_cpu(host_runs, shape):
    B, T, NH, HS = shape
    C = NH * HS
    qkv, dout, runs = host_runs(shape)
    qkv64, dout64 = qkv.astype(np.float64), dout.astype(np.float64)
    out_ref, att = gpt2_cpu.attention_forward(qkv64, NH)
    dqkv_ref = gpt2_cpu.attention_backward(dout64, qkv64, att, NH)
    D_ref = (dout64 * out_ref).reshape(B, T, NH, HS).sum(axis=-1).transpose(0, 2, 1)   # (B,NH,T)
    assert check_tensor(runs[0]["D"], D_ref, f"D {shape}", ATOL, RTOL)
    assert check_tensor(runs[0]["dqkv"], dqkv_ref, f"dqkv {shape}", ATOL, RTOL)
    # the dk/dv kernel writes dk and dv (= what dqkv ends with) and leaves dq's columns alone
    after_dkdv, final = runs[0]["dqkv_dkdv"], runs[0]["dqkv"]
    assert np.isnan(after_dkdv[..., :C]).all(), "the dk/dv kernel wrote into dq's columns"
    assert np.array_equal(after_dkdv[..., C:], final[..., C:]), "the dq kernel changed dk or dv"


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "B{}_T{}_NH{}_HS{}".format(*s))
def test_two_runs_bitwise_equal(host_runs, shape):
    _, _, (first, second) = host_runs(shape)
    assert not np.isnan(first["dqkv"]).any()
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name


# streamed 32 with 2 and 4 warps (lanes read columns that other lanes' tile stores write),
# and streamed 16 with one warp
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[0], SHAPES[4]], ids=lambda s: "B{}_T{}_NH{}_HS{}".format(*s))
def test_no_data_race_under_thread_sanitizer(tsan_program, shape):
    B, T, NH, HS = shape
    qkv, dout = random_inputs(*shape, seed=sum(shape))
    (run,) = run_host_program(tsan_program, *shape, qkv, dout, repeats=1)    # asserts no race report
    qkv64 = qkv.astype(np.float64)
    out_ref, att = gpt2_cpu.attention_forward(qkv64, NH)
    dqkv_ref = gpt2_cpu.attention_backward(dout.astype(np.float64), qkv64, att, NH)
    assert check_tensor(run["out"], out_ref, f"out (tsan) {shape}", ATOL, RTOL)
    assert check_tensor(run["dqkv"], dqkv_ref, f"dqkv (tsan) {shape}", ATOL, RTOL)
