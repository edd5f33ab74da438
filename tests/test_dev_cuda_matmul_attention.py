"""Tests of dev/cuda/matmul.py and dev/cuda/attention.py, the matmul and attention progressions.

No GPU needed:
- dev/cuda/matmul.cu and attention.cu compile with NVRTC (dev/cuda/nvrtc_compile.py's functions,
  the trainer's options), both precisions, compute_80/compute_90 PTX and sm_80/sm_90 cubins; the
  PTX defines exactly the kernels the versions launch (matmul's tensor-core versions 6-8 in the
  bf16 build only); ptxas reports no register spills (v3 keeps its 8x8 tile in registers, and
  versions 6-8 their 64x64 warp tiles, on sm_80 and sm_90, with no stack frame);
- every launcher of a hand-written kernel passes what the kernel's C signature declares (floatX
  pointers, float pointers, np.int32), found by recording the launches and parsing the .cu file,
  and asks for more than 48 KiB of dynamic shared memory only for a kernel that opted in;
- the FLOP counts and napkin bytes against numbers worked out by hand;
- every version of every progression validates against gpt2_cpu.py through the harness's own
  validate(), both precisions, at its small test size (and matmul's hand-written versions at two
  of version 3's 128-row blocks), on the emulated CUDA device (llmc/emulator/: the kernels of
  dev/cuda/*.cu and kernels/ compiled by g++, each CUDA thread a fiber, cuBLAS, cuBLASLt and cuDNN
  emulated with their contracts); a version that drops the bias fails that same validation;
- optional versions (cuBLASLt, flash, cuDNN, PyTorch) are skipped with a reason, not crashed on;
- without a GPU each script says so in one line and exits 2.
Marked gpu (skipped here): the same validations on a GPU (optional versions skip with their
reason: PyTorch's needs a GPU, cuDNN's bf16).
Run: pytest tests/test_dev_cuda_matmul_attention.py   (about 20 s on 2 cores once the emulated
device's kernels are built: NVRTC, ptxas)
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest

import llmc
import llmc.attention
import llmc.cuda
import llmc.matmul
from llmc.emulator.device import MAX_DYNAMIC_SHARED_OPTIN_BYTES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV_CUDA = os.path.join(ROOT, "dev", "cuda")
sys.path.insert(0, DEV_CUDA)

import attention  # noqa: E402  (dev/cuda/attention.py)
import common  # noqa: E402  (dev/cuda/common.py)
import matmul  # noqa: E402  (dev/cuda/matmul.py)
import nvrtc_compile as nc  # noqa: E402

SCRIPTS = {"matmul": matmul, "attention": attention}
PRECISIONS = ("bf16", "fp32")
# the hand-written kernels of each dev/cuda/<op>.cu per precision, written out (not read from the
# scripts): matmul's tensor-core versions 6-8 are in the bf16 build only
MATMUL_TENSOR_CORE_KERNELS = {"matmul_forward_v6", "matmul_forward_v7", "matmul_split_k_reduce_v8"} | {
    f"matmul_{kind}_{tile}_v8" for kind in ("forward", "forward_gelu", "backward_dinp", "backward_dweight")
    for tile in ("128x128", "128x256")}
MATMUL_FP32_KERNELS = {"matmul_forward_v1", "matmul_forward_v2", "matmul_forward_v3"}
ATTENTION_KERNELS = ({"attention_forward_v1", "attention_backward_v1", "attention_backward_cast_v1"}
                     | {f"attention_{kind}_hs64_v{N}" for kind in ("forward", "backward_dkdv", "backward_dq")
                        for N in (3, 6, 7, 9, 10)} | {"attention_forward_hs64_v11"})
DEV_KERNELS = {
    "matmul": {"fp32": MATMUL_FP32_KERNELS, "bf16": MATMUL_FP32_KERNELS | MATMUL_TENSOR_CORE_KERNELS},
    "attention": {"fp32": ATTENTION_KERNELS, "bf16": ATTENTION_KERNELS},
}


from nvrtc_marks import needs_nvrtc  # noqa: E402  (skips where NVRTC cannot be loaded)


def cu_path(op):
    return os.path.join(DEV_CUDA, f"{op}.cu")


def dev_kernels_of(op):
    """The kernels of dev/cuda/<op>.cu that the script's versions launch."""
    return {k.name for p in SCRIPTS[op].PROGRESSIONS for v in p.versions for k in v.kernels
            if k.path == f"dev/cuda/{op}.cu"}


# ----------------------------------------------------------------------------
# compiling

@needs_nvrtc
@pytest.mark.parametrize("arch", nc.PTX_ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op", sorted(SCRIPTS))
def test_ptx_defines_every_version_kernel(op, precision, arch):
    ptx = nc.compile_kernel(cu_path(op), precision, arch)
    assert set(nc.ptx_entry_names(ptx)) == DEV_KERNELS[op][precision]
    assert dev_kernels_of(op) == DEV_KERNELS[op]["bf16"]
    assert f".target sm_{arch.split('_')[1]}" in ptx
    assert ("cvt.rn.bf16.f32" in ptx) == (precision == "bf16")      # floatX reached the kernels


@needs_nvrtc
@pytest.mark.parametrize("arch", nc.CUBIN_ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op", sorted(SCRIPTS))
def test_cubin_compiles(op, precision, arch):
    assert nc.compile_kernel(cu_path(op), precision, arch)[:4] == b"\x7fELF"


@needs_nvrtc
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op", sorted(SCRIPTS))
def test_no_register_spills(op, precision):
    usage = nc.resource_usage(cu_path(op), precision)
    assert set(usage) == DEV_KERNELS[op][precision]
    for name, (registers, _, spill_stores, spill_loads) in usage.items():
        assert spill_stores == 0 and spill_loads == 0, (name, usage[name])
    # v3's 8x8 accumulators alone are 64 registers; __launch_bounds__(256) caps it at 255
    if op == "matmul":
        assert 64 < usage["matmul_forward_v3"][0] <= 255
    if op == "matmul" and precision == "bf16":
        check_tensor_core_registers(usage, nc.RESOURCE_USAGE_ARCH)


def check_tensor_core_registers(usage, arch):
    """Versions 6-8 hold a 64 x 64 warp tile: 4 x 8 mma accumulators of 4 floats, 128 registers a
    lane, plus the fragments (v7, v8: two k16 steps' worth, 64 more). ptxas must fit them in the
    255 registers a thread may have, with no stack frame (a spill in the hot loop would cost more
    than the tensor cores save), and 255 x 128 threads x 2 blocks fit an SM's 65536 registers, as
    matmul.py's V8_BLOCKS_PER_SM assumes."""
    for name in MATMUL_TENSOR_CORE_KERNELS:
        registers, stack, spill_stores, spill_loads = usage[name]
        assert (stack, spill_stores, spill_loads) == (0, 0, 0), (arch, name, usage[name])
        assert registers <= 255, (arch, name, registers)
    for name in ("matmul_forward_v6", "matmul_forward_v7"):
        assert usage[name][0] > 128, (arch, name)             # the accumulators are in registers


@needs_nvrtc
def test_tensor_core_kernels_keep_their_tiles_in_registers_on_sm_80():
    """test_no_register_spills checks them for sm_90 (the H100); the same for the A100's sm_80."""
    check_tensor_core_registers(nc.resource_usage(cu_path("matmul"), "bf16", "sm_80"), "sm_80")


@needs_nvrtc
def test_production_kernels_named_by_attention_exist():
    ptx = nc.compile_kernel(os.path.join(ROOT, "kernels", "attention.cu"), "bf16", "compute_80")
    for kernel in (attention.SOFTMAX_FORWARD, attention.SOFTMAX_BACKWARD):
        assert kernel.name in nc.ptx_entry_names(ptx)


# ----------------------------------------------------------------------------
# launchers against the kernels' C signatures

_SIGNATURE = r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?{name}\s*\(([^)]*)\)'


def c_parameter_types(op, name):
    """['floatX*', 'float*', 'int', ...] of kernel `name` in dev/cuda/<op>.cu (const dropped)."""
    with open(cu_path(op), encoding="utf-8") as f:
        match = re.search(_SIGNATURE.format(name=name), f.read())
    assert match, f"{name} not found in dev/cuda/{op}.cu"
    types_ = []
    for parameter in match.group(1).split(","):
        words = parameter.replace("const", "").replace("*", " * ").split()
        types_.append(words[0] + ("*" if "*" in words else ""))
    return types_


def recorded_launches(monkeypatch, progression, version, precision):
    """Every Kernel.launch of `version` at each of its block sizes on the progression's test case,
    allocated on the emulated device: [(kernel, grid, block, args, shared_mem)]. Nothing runs."""
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")
    calls = []

    def record(self, _precision, grid, block, args, shared_mem=0):
        calls.append((self, grid, block, args, shared_mem))
    monkeypatch.setattr(common.Kernel, "launch", record)
    case = progression.make_case(np.random.default_rng(0), precision, **progression.test_sizes)
    d = common.allocate(case)
    for block_size in version.block_sizes:
        version.launch(d, block_size)
    return calls


HAND_WRITTEN = [(op, p.name, v.number) for op, m in SCRIPTS.items() for p in m.PROGRESSIONS for v in p.versions
                if any(k.path.startswith("dev/cuda/") for k in v.kernels)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op,name,number", HAND_WRITTEN)
def test_launch_arguments_match_the_c_signature(monkeypatch, op, name, number, precision):
    progression = next(p for p in SCRIPTS[op].PROGRESSIONS if p.name == name)
    version = next(v for v in progression.versions if v.number == number)
    if number in SCRIPTS[op].OPTIONAL_VERSIONS:                  # e.g. GPT-2's layout only: not at this shape
        reason = SCRIPTS[op].OPTIONAL_VERSIONS[number](precision, progression.test_sizes)
        if reason:
            pytest.skip(reason)
    calls = recorded_launches(monkeypatch, progression, version, precision)
    assert {c[0].name for c in calls} == {k.name for k in version.kernels}
    floatX = llmc.cuda.FLOATX_DTYPES[precision]
    for kernel, grid, block, args, shared_mem in calls:
        expected = c_parameter_types(op, kernel.name)
        assert len(args) == len(expected), kernel.name
        for arg, c_type in zip(args, expected):
            if c_type == "floatX*":
                assert isinstance(arg, np.ndarray) and arg.dtype == floatX, (kernel.name, c_type, arg.dtype)
            elif c_type == "float*":
                assert isinstance(arg, np.ndarray) and arg.dtype == np.float32, (kernel.name, c_type)
            else:
                assert c_type == "int" and isinstance(arg, np.int32), (kernel.name, c_type, type(arg))
        assert 0 < block <= 1024 and shared_mem <= MAX_DYNAMIC_SHARED_OPTIN_BYTES
        if shared_mem > 48 * 1024:          # above CUDA's default, only after the kernel's opt-in
            assert common.load_function(kernel, precision).max_dynamic_shared_size_bytes >= shared_mem
        grid = grid if isinstance(grid, tuple) else (grid,)
        assert all(g >= 1 for g in grid)


def test_v2_grid_and_shared_memory_by_hand(monkeypatch):
    # N = 74 rows, OC = 72 columns: tile 16 -> grid (ceil(72/16), ceil(74/16)) = (5, 5),
    # shared memory 2 tiles of 16 x 17 floats = 2176 bytes
    progression = matmul.PROGRESSIONS[0]
    calls = recorded_launches(monkeypatch, progression, progression.versions[1], "fp32")
    by_block = {c[2]: c for c in calls}
    _, grid, _, args, shared = by_block[256]
    assert grid == (5, 5) and shared == 2176 and args[-1] == np.int32(16)
    assert by_block[1024][1] == (3, 3) and by_block[1024][4] == 2 * 32 * 33 * 4


# ----------------------------------------------------------------------------
# napkin math by hand

def test_matmul_flops_by_hand():
    # GPT-2 124M, N = 8192 rows: qkv 768 -> 2304, fc 768 -> 3072, fcproj 3072 -> 768
    assert matmul.matmul_forward_flops(8192, 768, 2304) == 28_991_029_248      # 2 * 8192 * 768 * 2304
    assert matmul.matmul_forward_flops(8192, 768, 3072) == 38_654_705_664
    assert matmul.matmul_forward_flops(8192, 3072, 768) == 38_654_705_664
    assert matmul.matmul_backward_flops(8192, 768, 2304) == 57_982_058_496     # two GEMMs
    # the progressions: d12 at B = 16, T = 1024 (N = 16384), the four layer shapes and the classifier
    shapes = {p.name: p.sizes for p in matmul.PROGRESSIONS}
    assert shapes["matmul_forward_qkv"] == dict(B=16, T=1024, C=768, OC=2304)
    assert shapes["matmul_forward_attproj"] == dict(B=16, T=1024, C=768, OC=768)
    assert shapes["matmul_backward_fcproj"] == dict(B=16, T=1024, C=3072, OC=768)
    assert shapes["matmul_forward_gelu_fc"] == dict(B=16, T=1024, C=768, OC=3072)
    assert shapes["matmul_forward_classifier_gpt2"] == dict(B=16, T=1024, C=768, OC=50304)


def test_attention_flops_by_hand():
    # 4 * 16 * 12 * 1024^2 * 64 / 2: 192 heads * 1,048,576 * 64 = 12,884,901,888, times 2
    assert attention.attention_forward_flops(16, 12, 1024, 64) == 25_769_803_776
    assert attention.attention_backward_flops(16, 12, 1024, 64) == 64_424_509_440    # 2.5x
    # the small shape: 48 heads * 65,536 * 64 * 2
    assert attention.attention_forward_flops(4, 12, 256, 64) == 402_653_184
    assert attention.attention_backward_flops(4, 12, 256, 64) == 1_006_632_960


def test_case_napkin_by_hand():
    rng = np.random.default_rng(0)
    # matmul B=1, T=2, C=3, OC=4: inp 6 + weight 12 + bias 4 + out 8 = 30 floatX; 2*2*3*4 FLOPs
    progressions = {p.name: p for p in matmul.PROGRESSIONS}
    forward = progressions["matmul_forward_qkv"].make_case(rng, "bf16", B=1, T=2, C=3, OC=4)
    assert (forward.bytes, forward.flops) == (60, 48)
    # the same with GELU: a second output, pre_gelu, 8 more floatX
    gelu = progressions["matmul_forward_gelu_fc"].make_case(rng, "bf16", B=1, T=2, C=3, OC=4)
    assert (gelu.bytes, gelu.flops) == (76, 48)
    # backward: dout 8 + inp, dinp 2*6 + weight, dweight r/w 3*12 + dbias r/w 2*4 = 64 floats
    backward = progressions["matmul_backward_qkv"].make_case(rng, "fp32", B=1, T=2, C=3, OC=4)
    assert (backward.bytes, backward.flops) == (256, 96)
    # attention B=1, T=2, NH=1, HS=8: qkv 48 + out 16 floatX; 4 * 4 * 8 / 2 FLOPs
    att = attention.PROGRESSIONS[0].make_case(rng, "bf16", B=1, T=2, NH=1, HS=8)
    assert (att.bytes, att.flops) == (128, 64)
    # backward: qkv 48 + dout 16 + dqkv 48 floatX; 2.5 x 64
    datt = attention.PROGRESSIONS[2].make_case(rng, "fp32", B=1, T=2, NH=1, HS=8)
    assert (datt.bytes, datt.flops) == (448, 160)


# ----------------------------------------------------------------------------
# every version validated against gpt2_cpu.py: on the emulated CUDA device, and on a GPU

@pytest.fixture
def emulated(monkeypatch):
    """llmc.cuda (and so the harness) on the emulated device."""
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")


ALL_VERSIONS = [(op, p.name, v.number) for op, m in SCRIPTS.items() for p in m.PROGRESSIONS for v in p.versions]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("op,name,number", ALL_VERSIONS)
def test_version_validates(monkeypatch, capsys, op, name, number, precision, device):
    monkeypatch.setattr(llmc.cuda, "_device", device)
    script = SCRIPTS[op]
    progression = next(p for p in script.PROGRESSIONS if p.name == name)
    if number in script.OPTIONAL_VERSIONS:
        reason = script.OPTIONAL_VERSIONS[number](precision, progression.test_sizes)
        if reason:
            pytest.skip(reason)
    assert common.validate(progression, precision, progression.test_sizes, {number})
    version = next(v for v in progression.versions if v.number == number)
    assert capsys.readouterr().out.count(": OK") == len(version.block_sizes)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hand_written_matmuls_validate_over_two_v3_blocks(emulated, precision):
    # N = 130 rows: two of version 3's 128-row blocks; OC = 200: two of its 128-column blocks;
    # C = 37: not a multiple of its 16-column slice
    progression = matmul.PROGRESSIONS[0]
    assert common.validate(progression, precision, dict(B=2, T=65, C=37, OC=200), {1, 2, 3})


def test_a_version_without_the_bias_fails_validation(emulated, capsys):
    def no_bias(d, block_size):
        llmc.matmul.matmul_forward(d.out, d.inp, d.weight, None, d.B, d.T, d.C, d.OC)
    progression = matmul.PROGRESSIONS[0]
    broken = common.Progression(progression.name, progression.make_case,
                                [common.Version(4, "no bias", (matmul.CUBLAS_GEMM,), no_bias, (0,))],
                                progression.sizes, progression.test_sizes)
    assert not common.validate(broken, "fp32", progression.test_sizes)
    assert "FAILED" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# optional versions: skipped with a reason

def test_without_unavailable_drops_and_announces(capsys):
    optional = {5: lambda precision, sizes: f"no library for {precision}", 2: lambda precision, sizes: None}
    kept = matmul.without_unavailable(matmul.PROGRESSIONS[:1], optional, "bf16")
    assert [v.number for v in kept[0].versions] == [1, 2, 3, 4, 6, 7, 8]
    assert [v.number for v in matmul.PROGRESSIONS[0].versions] == [1, 2, 3, 4, 5, 6, 7, 8]    # not mutated
    assert capsys.readouterr().out == "matmul_forward_qkv v5 skipped: no library for bf16\n"


def test_cublaslt_missing_is_a_reason(monkeypatch):
    monkeypatch.delattr(llmc, "cublaslt", raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", None)            # import fails
    reason = matmul.cublaslt_unavailable_reason("bf16", {})
    assert reason.startswith("llmc.cublaslt is not importable")


def test_flash_and_cudnn_reasons(monkeypatch):
    if attention.flash_unavailable_reason("bf16", dict(HS=64)) is None:     # flash is in this checkout
        assert "head size 24" in attention.flash_unavailable_reason("bf16", dict(HS=24))
        monkeypatch.delattr(llmc.attention, "flash_attention_forward")
    assert "not in this checkout" in attention.flash_unavailable_reason("bf16", dict(HS=64))
    assert "bf16" in attention.cudnn_unavailable_reason("fp32", dict(HS=64))


# ----------------------------------------------------------------------------
# the command line without a GPU

@pytest.mark.parametrize("op", sorted(SCRIPTS))
def test_no_gpu_one_line_exit_2(op):
    if llmc.cuda.cuda_unavailable_reason() is None:
        pytest.skip("a CUDA GPU is present")
    run = subprocess.run([sys.executable, os.path.join(DEV_CUDA, f"{op}.py")], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dev/cuda/{op}.py: no CUDA GPU found")


@pytest.mark.parametrize("op", sorted(SCRIPTS))
def test_help_lists_every_version(op):
    run = subprocess.run([sys.executable, os.path.join(DEV_CUDA, f"{op}.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0
    for progression in SCRIPTS[op].PROGRESSIONS:
        for version in progression.versions:
            assert f"version {version.number} of {progression.name}:" in run.stdout
            assert f"version {version.number} (" in SCRIPTS[op].__doc__
