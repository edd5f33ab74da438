"""The emulated device's memory counters (llmc/emulator/memory.py, shim/tracer.cpp) on kernels whose
counters can be worked out on paper from the definitions (CUDA C++ Programming Guide, "Coalesced
Access to Global Memory" and "Shared Memory"; Nsight Compute's l1tex__t_sectors / requests and
shared wavefronts / bank conflicts), not from the tracer's code:
- a warp loading 32 consecutive floats touches one 128-byte line: 4 sectors per request, every
  moved byte used;
- a stride of 32 floats puts each lane in a line of its own: 32 sectors per request, 4 of every 32
  moved bytes used (12.5%);
- a float4 load of 32 consecutive float4s: one request touching 512 bytes = 16 sectors (4 per
  quarter-warp of 8 lanes), 4x a float load's bytes, all used;
- a column read of a 32x32 float tile in shared memory: word 32 l for lane l, all in bank 0: 32
  wavefronts (a 32-way conflict, 31 beyond the ideal one); with the tile's rows padded to 33
  floats, word 33 l is in bank l: 1 wavefront;
- 32 lanes reading one word: a broadcast, 1 wavefront;
- a 16-byte shared load by 32 lanes of consecutive float4s: 4 wavefronts (quarter-warps), no
  conflict; the same with a stride of two float4s: 8 (each quarter-warp's 8 lanes span 256 bytes,
  two words per bank).
Each counter is also tied to its source line. The counting only runs inside memory.tracing();
kernels compiled outside it are the ordinary, untraced builds.

Run: pytest tests/test_memory_counters.py   (builds the traced kernels once, ~20 s)
"""

import argparse
import os
import subprocess
import sys

import numpy as np
import pytest

from llmc import gpu_cli
from llmc.emulator import build, memory
from llmc.emulator import device as cp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KERNELS = r"""
extern "C" __global__ void coalesced(float* out, const float* inp) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = inp[i];                                                     // line 4
}
extern "C" __global__ void strided(float* out, const float* inp) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = inp[i * 32];                                                // line 8
}
extern "C" __global__ void vector4(float4* out, const float4* inp) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = inp[i];                                                     // line 12
}
extern "C" __global__ void column(float* out, int padded) {
    __shared__ float tile[32 * 33];
    const int lane = threadIdx.x, ld = padded ? 33 : 32;
    for (int r = 0; r < 32; r++) tile[r * ld + lane] = (float)(r * 32 + lane);   // line 17: rows, no conflict
    __syncwarp();
    out[lane] = tile[lane * ld];                                         // line 19: column 0
}
extern "C" __global__ void broadcast(float* out) {
    __shared__ float word[1];
    if (threadIdx.x == 0) word[0] = 7.0f;
    __syncwarp();
    out[threadIdx.x] = word[0];                                          // line 25
}
extern "C" __global__ void shared_vector4(float* out, int stride) {
    __shared__ float4 tile[64];
    const int lane = threadIdx.x;
    tile[lane] = make_float4(lane, lane, lane, lane);
    tile[lane + 32] = make_float4(lane, lane, lane, lane);
    __syncwarp();
    const float4 v = tile[lane * stride];                                // line 33
    out[lane] = v.x + v.y + v.z + v.w;
}
"""


@pytest.fixture(scope="module")
def traced():
    """The kernels compiled as a traced build, and a fresh report per run."""
    with memory.tracing():
        module = cp.RawModule(code=KERNELS, options=("-DENABLE_FP32",))
        module.compile()

    def run(name, grid, block, *args):
        with memory.tracing() as report:
            module.get_function(name)((grid,), (block,), args)
        return report
    return run


def only(report, kernel, space, access, line):
    """The counters of one line, checked to be the only line of that kind."""
    sites = [(s, c) for s, c in report.sites.items() if s.kernel == kernel and s.space == space and s.access == access]
    assert len(sites) == 1, sites
    site, counters = sites[0]
    assert site.line.endswith(f":{line}"), site.line
    return counters


def test_a_coalesced_float_load_is_4_sectors_per_request(traced):
    report = traced("coalesced", 3, 64, cp.zeros(192, np.float32), cp.ones(192, np.float32))
    load = only(report, "coalesced", "global", "load", 4)
    assert (load.requests, load.sectors, load.lines, load.bytes, load.unique_bytes) == (6, 24, 6, 768, 768)  # 6 warps
    assert load.sectors_per_request == 4 and load.efficiency == 1.0
    store = only(report, "coalesced", "global", "store", 4)
    assert (store.requests, store.sectors_per_request, store.efficiency) == (6, 4, 1.0)
    assert report.launches == {"coalesced": 1}


def test_a_stride_32_float_load_is_32_sectors_per_request(traced):
    report = traced("strided", 1, 64, cp.zeros(64, np.float32), cp.ones(64 * 32, np.float32))
    load = only(report, "strided", "global", "load", 8)
    assert (load.requests, load.sectors_per_request, load.lines) == (2, 32, 64)
    assert load.bytes == 2 * 32 * 4 and load.bytes_moved == 2 * 32 * 32 and load.efficiency == 0.125
    assert report.worst_lines("strided", 1)[0][0].line.endswith(":8")


def test_a_float4_load_is_16_sectors_per_request_and_4x_the_bytes(traced):
    report = traced("vector4", 1, 32, cp.zeros(32 * 4, np.float32), cp.ones(32 * 4, np.float32))
    load = only(report, "vector4", "global", "load", 12)
    assert (load.requests, load.lanes, load.sectors, load.bytes, load.efficiency) == (1, 32, 16, 512, 1.0)


@pytest.mark.parametrize("padded,wavefronts", [(0, 32), (1, 1)])
def test_a_shared_column_read_conflicts_32_ways_and_padding_removes_it(traced, padded, wavefronts):
    report = traced("column", 1, 32, cp.zeros(32, np.float32), np.int32(padded))
    read = only(report, "column", "shared", "load", 19)
    assert (read.requests, read.wavefronts, read.bank_conflicts) == (1, wavefronts, wavefronts - 1)
    rows = only(report, "column", "shared", "store", 17)
    assert (rows.requests, rows.wavefronts, rows.bank_conflicts) == (32, 32, 0)      # a row per request


def test_a_broadcast_is_one_wavefront(traced):
    report = traced("broadcast", 1, 32, cp.zeros(32, np.float32))
    read = only(report, "broadcast", "shared", "load", 25)
    assert (read.requests, read.lanes, read.wavefronts, read.bank_conflicts) == (1, 32, 1, 0)
    assert (read.bytes, read.unique_bytes) == (128, 4)                     # 32 lanes asked for the same 4 bytes


@pytest.mark.parametrize("stride,wavefronts", [(1, 4), (2, 8)])
def test_16_byte_shared_loads_are_served_by_quarter_warps(traced, stride, wavefronts):
    report = traced("shared_vector4", 1, 32, cp.zeros(32, np.float32), np.int32(stride))
    read = only(report, "shared_vector4", "shared", "load", 33)
    assert (read.requests, read.wavefronts, read.ideal_wavefronts) == (1, wavefronts, 4)


def test_untraced_builds_count_nothing():
    module = cp.RawModule(code=KERNELS, options=("-DENABLE_FP32",))
    kernel = module.get_function("coalesced")
    assert not kernel.kernel.traced and module.library.mode == "fibers"
    with memory.tracing() as report:
        kernel((1,), (32,), (cp.zeros(32, np.float32), cp.ones(32, np.float32)))
    assert report.sites == {} and report.launches == {}


def test_one_launch_raw_trace_names_each_thread_and_address(traced):
    with memory.tracing(raw_launch=0) as report:
        module = cp.RawModule(code=KERNELS, options=("-DENABLE_FP32",))
        inp = cp.arange(64, dtype=np.float32)
        module.get_function("strided")((1,), (2,), (cp.zeros(2, np.float32), inp))
    loads = [a for a in report.raw["accesses"] if a["access"] == "load"]
    assert [(a["thread"], a["addr"] - inp.data.ptr, a["size"]) for a in loads] == [(0, 0, 4), (1, 128, 4)]
    assert all(a["line"].endswith(":8") and a["space"] == "global" for a in loads)
    assert report.raw["kernel"] == "strided" and report.raw["dropped"] == 0


def test_a_broken_rule_in_a_traced_build_still_stops_the_launch():
    source = 'extern "C" __global__ void bad(float* out) { out[threadIdx.x] = __shfl_sync(0xfffffffe, 1.0f, 0); }'
    with memory.tracing():
        module = cp.RawModule(code=source, options=("-DENABLE_FP32",))
        with pytest.raises(build.EmulatorError, match="not in its mask"):
            module.get_function("bad")((1,), (32,), (cp.zeros(32, np.float32),))


# ----------------------------------------------------------------------------
# where a learner meets them

def test_memory_report_without_the_emulated_device_is_one_error_line(capsys):
    ran = []
    code = gpu_cli.with_memory_report(argparse.Namespace(memory_report=True, device="cuda"), lambda: ran.append(1))
    assert code == 1 and ran == []
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --memory-report counts memory accesses on the emulated device: add --device cpu "
        "(on a GPU, Nsight Compute's ncu counts them)"]


def run(*argv):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)


@pytest.mark.slow
def test_a_progression_prints_each_versions_counters():
    """dev/cuda/layernorm.py --device cpu --memory: version 1 of the forward (a thread per row) uses
    2 of every 32 bytes it moves (bf16), versions 2 and 3 (a warp per row) all of them."""
    result = run("dev/cuda/layernorm.py", "--device", "cpu", "--memory")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    forward = lines[:lines.index(next(l for l in lines if l.startswith("== fused_residual_forward")))]
    assert any("v1 memory, layernorm_forward_v1: global loads" in l and "(6% used)" in l for l in forward)
    assert any("v2 memory, layernorm_forward_v2: global loads" in l and "(100% used)" in l for l in forward)
    assert any("v3 memory, layernorm_forward: global loads 6.0 sectors/request (100% used)" in l for l in forward)
    assert any(l.strip().startswith("worst: dev/cuda/layernorm.cu:") for l in forward)


@pytest.mark.slow
def test_a_training_step_reports_every_kernel_it_launched_with_its_worst_line():
    result = run("gpt2_cuda.py", "--device", "cpu", "-e", "d2", "-b", "2", "-t", "32", "-x", "1", "-v", "0", "-s", "0",
                 "--memory-report")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    table = out[out.index("memory counters on the emulated device"):]
    rows = {l.split()[0] for l in table.splitlines()[3:] if l and not l.startswith((" ", "worst"))}
    assert {"encoder_forward", "layernorm_forward", "fused_residual_forward", "softmax_forward", "gelu_forward",
            "fused_classifier", "layernorm_backward", "adamw_update", "global_norm_squared"} <= rows
    worst = table[table.index("worst line of each kernel"):].splitlines()[1:]
    for kernel in rows:                                            # each kernel: its worst line, or none wasted
        assert any(l.strip().startswith(f"{kernel} ") or l.strip().startswith(f"{kernel}:") for l in worst), kernel
    assert "step    1/1 | loss" in out


def test_a_launch_becomes_the_visual_debuggers_kernel_trace(traced):
    """memory.kernel_trace: the strided kernel's launch as the debugger's file (its checker accepts
    it): buffers named by the kernel's pointer parameters, each lane's element, each warp's counters."""
    from llmc.debugger.kerneltrace import check_trace
    with memory.tracing(raw_kernel=("strided", 0)) as report:
        module = cp.RawModule(code=KERNELS, options=("-DENABLE_FP32",))
        out, inp = cp.zeros(64, np.float32), cp.ones(64 * 32, np.float32)
        module.get_function("strided")((1,), (64,), (out, inp))
    trace = check_trace(memory.kernel_trace(report.raw, "fp32"), "test")
    assert {(b["name"], b["elements"]) for b in trace["buffers"]} == {("out", 64), ("inp", 64 * 32)}
    loads = [a for a in trace["accesses"] if a["op"] == "read"]
    assert sorted((a["warp"], a["lanes"] == list(range(32))) for a in loads) == [(0, True), (1, True)]
    for a in loads:
        assert a["elements"] == [32 * (32 * a["warp"] + lane) for lane in a["lanes"]] and a["line"] == 8
    assert [w["sectors_per_request"] for w in trace["warps"]] == [18.0, 18.0]   # (32 load + 4 store) / 2 requests


@pytest.mark.slow
def test_the_recorder_writes_one_launch_of_a_training_step(tmp_path):
    from llmc.debugger.kerneltrace import KernelTrace
    path = tmp_path / "trace.json"
    result = run("dev/kernel_trace.py", "layernorm_forward", "-o", str(path), "--",
                 "-e", "d2", "-b", "1", "-t", "32", "-x", "1", "-v", "0", "-s", "0")
    assert result.returncode == 0, result.stderr
    trace = KernelTrace(str(path)).trace
    assert trace["kernel"] == "layernorm_forward" and trace["source"] == "kernels/layernorm.cu"
    assert {"inp", "out", "mean", "rstd", "weight", "bias"} == {b["name"] for b in trace["buffers"]}
    reads = {e for a in trace["accesses"] if a["buffer"] == "inp" for e in a["elements"]}
    assert reads == set(range(32 * 128))                                   # every input element read (T=32, C=128)
    missing = run("dev/kernel_trace.py", "no_such_kernel", "-o", str(path), "--", "-e", "d2", "-b", "1", "-t", "8",
                  "-x", "1", "-v", "0", "-s", "0")
    assert missing.returncode == 1 and "was not launched" in missing.stderr.strip().splitlines()[-1]
