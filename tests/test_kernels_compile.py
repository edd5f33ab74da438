"""The CUDA kernels compile, without a GPU: every kernels/*.cu through NVRTC (the compiler that
cupy.RawModule uses), for both storage precisions and for compute_80/compute_90 (PTX) and
sm_80/sm_90 (cubin, which also runs ptxas).

Checked against independent facts rather than the compiler's say-so alone:
- the PTX defines exactly the kernels of the launcher contract below (gpt2_cuda.py looks them up
  by these names, so a renamed or missing `extern "C"` kernel fails here, not on a GPU);
- the precision macro reaches the code: the bf16 build converts with cvt.rn.bf16.f32, the fp32
  build never does;
- a broken source fails with an error that names the file and carries NVRTC's own diagnostic;
- the options are llmc.cuda.kernel_compile_options itself (one source for the check and the
  trainer), and importing the script needs no CuPy.
Skips (with the reason) only when the NVRTC library cannot be loaded at all.
Run: pytest tests/test_kernels_compile.py   (about 15 s on 2 cores)
"""

import hashlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "dev", "cuda", "nvrtc_compile.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("nvrtc_compile", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nc = _load_script()
try:
    nc.load_nvrtc()
    nc.cuda_include_dir()
except nc.NvrtcUnavailable as error:
    pytest.skip(f"NVRTC cannot be loaded: {error}", allow_module_level=True)

PRECISIONS = ("bf16", "fp32")
ARCHS = nc.PTX_ARCHS + nc.CUBIN_ARCHS
ELF_MAGIC = b"\x7fELF"

# The kernel contract that gpt2_cuda.py and llama3_cuda.py launch against: file -> its extern "C" kernels.
KERNEL_CONTRACT = {
    "encoder.cu": ("encoder_forward", "encoder_backward_wpe", "encoder_backward_wte", "encoder_backward_wte_reduce"),
    "layernorm.cu": ("layernorm_forward", "fused_residual_forward", "layernorm_backward",
                     "layernorm_param_reduce", "residual_forward"),
    "gelu.cu": ("gelu_forward", "gelu_backward_inplace"),
    "bias.cu": ("add_bias", "bias_backward", "bias_reduce"),
    "attention.cu": ("permute_qkv", "permute_qkv_backward", "unpermute", "unpermute_backward",
                     "softmax_forward", "softmax_backward"),
    "classifier.cu": ("fused_classifier",),
    "adamw.cu": ("adamw_update",),
    "global_norm.cu": ("global_norm_squared", "global_norm_finalize"),
    "cast.cu": ("cast_float_to_floatX", "cast_floatX_to_float"),
    # Llama 3's (llama3_cuda.py)
    "rmsnorm.cu": ("rmsnorm_forward", "rmsnorm_backward", "rmsnorm_param_reduce"),
    "rope.cu": ("rope_forward", "rope_backward"),
    "swiglu.cu": ("swiglu_forward", "swiglu_backward"),
    "repeat_kv.cu": ("repeat_kv_forward", "repeat_kv_backward"),
    "flash_attention.cu": ("flash_attention_backward_preprocess",)
                          + tuple(f"flash_attention_{kind}_hs{HS}" for kind in ("forward", "backward_dkdv", "backward_dq")
                                  for HS in (16, 32, 64, 128)),
}


def kernel_path(name):
    return os.path.join(nc.KERNELS_DIR, name)


def test_kernel_files_match_the_contract():
    on_disk = sorted(os.path.basename(p) for p in nc.kernel_files())
    assert on_disk == sorted(KERNEL_CONTRACT)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(KERNEL_CONTRACT))
def test_kernel_compiles(name, precision, arch):
    result = nc.compile_kernel(kernel_path(name), precision, arch)
    if arch.startswith("sm_"):
        assert isinstance(result, bytes) and result[:4] == ELF_MAGIC
    else:
        assert sorted(nc.ptx_entry_names(result)) == sorted(KERNEL_CONTRACT[name])
        assert f".target sm_{arch.split('_')[1]}" in result


def test_precision_macro_selects_floatX():
    bf16_ptx = nc.compile_kernel(kernel_path("cast.cu"), "bf16", "compute_80")
    fp32_ptx = nc.compile_kernel(kernel_path("cast.cu"), "fp32", "compute_80")
    assert "cvt.rn.bf16.f32" in bf16_ptx
    assert "bf16" not in fp32_ptx


def test_both_precisions_at_once_is_an_error():
    with pytest.raises(nc.KernelCompileError) as info:
        nc.compile_kernel(kernel_path("cast.cu"), "bf16", "compute_80",
                          extra_options=("-DENABLE_FP32",))
    assert "define only one of ENABLE_BF16 and ENABLE_FP32" in info.value.log


def test_compile_options():
    for precision, define in (("bf16", "-DENABLE_BF16"), ("fp32", "-DENABLE_FP32")):
        options = nc.kernel_compile_options(precision)
        assert define in options
        assert f"-I{nc.KERNELS_DIR}" in options
        include_dirs = [o[2:] for o in options if o.startswith("-I")]
        assert any(os.path.isfile(os.path.join(d, "cuda_bf16.h")) for d in include_dirs)
        assert not any(o.startswith("-arch") for o in options)   # CuPy picks the device's arch
        # CuPy's cache key covers options but not headers: the header's digest must be in them
        headers = hashlib.sha256()
        for name in ("bias.cuh", "common.cuh", "flash_attention.cuh", "layernorm.cuh", "tensor_core.cuh"):   # every kernels/*.cuh, by name
            with open(kernel_path(name), "rb") as f:
                headers.update(name.encode() + f.read())
        digest = headers.hexdigest()[:16]
        assert f"-DCOMMON_CUH_DIGEST=sha256_{digest}" in options
    with pytest.raises(ValueError):
        nc.kernel_compile_options("fp16")


def test_compile_options_have_one_source():
    # the CI check compiles with exactly the options gpt2_cuda.py hands to cupy.RawModule
    import llmc.cuda as llmc_cuda
    assert nc.kernel_compile_options is llmc_cuda.kernel_compile_options
    assert nc.KERNELS_DIR == llmc_cuda.KERNELS_DIR == os.path.join(ROOT, "kernels")
    assert nc.cuda_include_dir() == llmc_cuda.cuda_include_dir()
    assert f"-I{nc.cuda_include_dir()}" in llmc_cuda.kernel_compile_options("fp32")


def test_missing_cuda_headers_are_named(monkeypatch, tmp_path):
    import llmc.cuda as llmc_cuda
    monkeypatch.setattr(llmc_cuda, "cuda_include_dirs", lambda: [str(tmp_path)])
    with pytest.raises(llmc_cuda.KernelCompileError, match=re.escape(f"cuda_bf16.h not found (looked in {tmp_path})")):
        llmc_cuda.kernel_compile_options("bf16")
    with pytest.raises(nc.NvrtcUnavailable, match="cuda_bf16.h not found"):
        nc.cuda_include_dir()


def test_importing_the_script_needs_no_cupy():
    # both modules import without CuPy's device runtime: gpt2_cuda imports CuPy only on a GPU,
    # and the script loads NVRTC's binding only when it compiles
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('nc', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(m)\n"
            "assert m.kernel_compile_options('bf16')\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('cupy', 'cupy_backends')))\n")
    r = subprocess.run([sys.executable, "-c", code, SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_broken_source_names_file_and_carries_log():
    path = kernel_path("gelu.cu")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    broken = source.replace("gelu((float)x[k])", "gelu(undeclared_value)", 1)
    assert broken != source
    with pytest.raises(nc.KernelCompileError) as info:
        nc.compile_kernel(path, "bf16", "compute_80", source=broken)
    message = str(info.value)
    assert "kernels/gelu.cu" in message and "bf16" in message and "compute_80" in message
    # NVRTC's own diagnostic, with the file name it was given and the line of the error
    line = 1 + broken[:broken.index("undeclared_value")].count("\n")
    assert f"kernels/gelu.cu({line}): error" in info.value.log
    assert 'identifier "undeclared_value" is undefined' in info.value.log
    assert info.value.log.strip() in message


def test_cli_reports_a_broken_file(tmp_path):
    broken = tmp_path / "broken_kernel.cu"
    broken.write_text('#include "common.cuh"\n'
                      'extern "C" __global__ void broken(floatX* out) { out[0] = missing; }\n')
    run = subprocess.run([sys.executable, SCRIPT, str(broken), "-a", "compute_80"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "FAIL" in run.stdout and "2 of 2 compilations FAILED" in run.stdout
    assert "broken_kernel.cu(2): error" in run.stderr
    assert 'identifier "missing" is undefined' in run.stderr


def test_cli_missing_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.cu"
    run = subprocess.run([sys.executable, SCRIPT, str(missing)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.strip() == f"error: kernel file '{missing}' not found"
