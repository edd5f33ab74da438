"""Llama 3's kernels (kernels/rmsnorm.cu, rope.cu, swiglu.cu, repeat_kv.cu) on the emulated CUDA
device (llmc/emulator/), through llama3_cuda.py's launchers, against llama3_cpu.py's layers
computed in float64 from the inputs as the kernel sees them (tests/cuda_kernel_checks.py's
check_rmsnorm, check_rope, check_repeat_kv, check_swiglu), with llmc.check's kernel tolerances, in
fp32 and bf16: at small odd shapes (B*T = 13 rows, partial blocks and warps), with grid-stride
loops forced to several passes, in place where the launcher allows it; and the launchers' refusals.
Marked gpu: the same checks on a GPU.

Run: python -m pytest -q tests/test_llama3_kernels.py   (the first run compiles the four kernel
files twice, fp32 and bf16, with g++: about a minute on 2 cores, cached in .emulator-cache/)
"""

import numpy as np
import pytest

import llama3_cuda
from llmc import cuda
from cuda_kernel_checks import check_repeat_kv, check_rmsnorm, check_rope, check_swiglu, few_blocks

PRECISIONS = ("fp32", "bf16")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request, monkeypatch):
    """The emulated device, or (marked gpu) the GPU."""
    monkeypatch.setattr(cuda, "_device", request.param)
    return request.param


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("B,T,C", [(1, 13, 64), (2, 5, 96)])
def test_rmsnorm(device, precision, B, T, C):
    check_rmsnorm(np.random.default_rng(0), precision, B, T, C)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("NH,NKV,HS", [(4, 2, 16), (6, 2, 8), (4, 4, 32)])   # n_rep 2, 3, 1 (multi-head)
def test_rope_and_repeat_kv(device, precision, NH, NKV, HS):
    rng = np.random.default_rng(1)
    check_rope(rng, precision, 2, 7, NH, NKV, HS)
    check_repeat_kv(rng, precision, 2, 7, NH, NKV, HS)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_rope_in_place(device, precision):
    check_rope(np.random.default_rng(2), precision, 1, 5, 4, 2, 16, in_place=True)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("n,in_place", [(448, False), (453, True)])   # 453: a scalar tail after the x128 groups
def test_swiglu(device, precision, n, in_place):
    check_swiglu(np.random.default_rng(3), precision, n, in_place)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_grid_stride_loops(device, precision, monkeypatch):
    # one or two blocks for all the work: every thread of the grid-stride kernels makes several passes
    launched = few_blocks(monkeypatch, 1)
    rng = np.random.default_rng(4)
    check_rmsnorm(rng, precision, 4, 32, 64)          # 128 rows: 16 warps' worth on one block of 8
    check_rope(rng, precision, 2, 32, 4, 2, 16)
    check_repeat_kv(rng, precision, 2, 32, 4, 2, 16)
    check_swiglu(rng, precision, 4096 + 3)
    capped = {name for name, grid, asked in launched if grid != asked}
    assert {"rmsnorm_forward", "rope_forward", "rope_backward", "repeat_kv_forward", "repeat_kv_backward",
            "swiglu_forward", "swiglu_backward"} <= capped


def test_launchers_refuse_bad_arguments(monkeypatch):
    # the checks run before any launch, and name the kernel and the argument
    monkeypatch.setattr(cuda, "_device", "cpu")
    cp = cuda.cupy()

    def zeros(n, dtype=np.float32):
        return cp.zeros(n, dtype=dtype)
    with pytest.raises(ValueError, match="rmsnorm_forward: C=6 must be a multiple of 4"):
        llama3_cuda.rmsnorm_forward(zeros(36), zeros(6), zeros(36), zeros(6), 2, 3, 6)
    with pytest.raises(ValueError, match="rmsnorm partial sums need 32 floats"):
        llama3_cuda.rmsnorm_backward(zeros(32), zeros(4), zeros(8), zeros(32), zeros(32), zeros(4), zeros(8), 1, 8, 4)
    with pytest.raises(ValueError, match="rope_forward: out: has 72 elements, expected 48"):
        llama3_cuda.rope_forward(zeros(72), zeros(48), zeros(6), zeros(6), 2, 1, 2, 2, 12)
    with pytest.raises(ValueError, match="rope_backward: need 0 <= n_rot=3 <= nh=2"):
        llama3_cuda.rope_backward(zeros(72), zeros(72), zeros(18), zeros(18), 1, 3, 2, 3, 12)
    with pytest.raises(ValueError, match="repeat_kv_forward: NH=3 is not a multiple of NKV=2"):
        llama3_cuda.repeat_kv_forward(zeros(36), zeros(28), 1, 1, 3, 2, 4)
    with pytest.raises(TypeError, match="swiglu_forward: fch2: dtype uint16, expected float32"):
        llama3_cuda.swiglu_forward(zeros(8), zeros(8), zeros(8, np.uint16), 8)
