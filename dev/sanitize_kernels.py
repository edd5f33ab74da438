"""dev/sanitize_kernels.py: every kernel of kernels/*.cu run under ThreadSanitizer and under
AddressSanitizer + UndefinedBehaviorSanitizer on the emulated CUDA device (llmc/emulator/).

What it does, per sanitizer: builds a Python interpreter with the sanitizer linked in
(llmc.emulator.build.sanitizer_python: ThreadSanitizer cannot be preloaded into python3) and runs
this file again in it (--inside) with LLMC_EMULATOR_MODE set, so that every kernel file is
compiled with that sanitizer and each CUDA thread is an OS thread (fibers would serialize the
threads of a block and hide their races). Inside, through gpt2_cuda.py's own launchers:
- WORKLOAD, tests of tests/test_emulated_kernels.py: the whole model's forward and backward
  against gpt2_cpu (fp32 with naive attention, bf16 with flash attention, fp32 with cuBLASLt's
  fused epilogues), flash attention at every head size, the KV-cached sampling forward, and two
  training steps (the global norm and AdamW), at odd shapes (B = 3, T = 13, 37, 70, 33, 19, 9;
  V = 75 in Vp = 77 and 80); Llama 3's kernels through llama3_cuda.py's launchers
  (tests/test_llama3_kernels.py's grid-stride check in both precisions, tests/test_llama3_cuda.py's
  tiny model in fp32);
- the optimizer's kernels at n = OPTIMIZER_N values (a multiple of neither the vector nor the
  block size) in fp32 and in bf16 (with master weights: the stochastic rounding), against NumPy;
- DEV_WORKLOAD, the tensor-core kernels of dev/cuda/matmul.cu (versions 6-8: mma.sync, ldmatrix,
  the cp.async pipeline, the split-K reduction) through dev/cuda/matmul.py's launchers, validated
  against gpt2_cpu at tests/test_matmul_tensor_cores.py's shape with every edge (ragged rows,
  columns and K sum, the stage ring wrapping around, dweight split over the tokens); the fused
  classifier's candidates 4 and 5 of dev/cuda/classifier.cu at GPT-2's vocabulary (5 holds the row
  in registers, in one tile or several);
  layernorm_backward's candidate 6 (dev/cuda/layernorm.cu: row phases summed through shared
  memory between two barriers), with the reduce of candidate 5, at a small shape; and
  bias_backward's candidate 5 (dev/cuda/bias.cu) at its test size;
then it checks that every `extern "C" __global__` kernel of kernels/, and every kernel of the bf16
build of a DEV_FILES file that its fp32 build does not have (matmul.cu's tensor-core kernels), was
launched. A sanitizer report stops the run (exit code 66); a report, a failed check or a kernel
left out fails it.

The global norm's launcher runs a fixed grid (gpt2_cuda.GLOBAL_NORM_GRID = 1024 blocks of 512
threads, so that its slot layout and its result do not depend on n): 524,288 OS threads per call
under a sanitizer, ~100 s here. The runs set it to SANITIZER_GLOBAL_NORM_GRID blocks: the same
launcher and kernels, each thread now striding over several groups of the data.

What it is not: a check of races between blocks (blocks run one after another, each ordered
after the last) or of the GPU's memory model. tests/test_emulator.py shows on planted-bug copies
of the kernels that an out-of-bounds write (cast.cu, adamw.cu), a missing __syncthreads and a
wrong shuffle mask are each caught.

Run: python dev/sanitize_kernels.py          (or: make sanitize; --only tsan or --only asan: one)
Expect: "tsan: OK, 59 kernels in ..." and "asan+ubsan: OK, 59 kernels in ..." (~6 minutes on 2
busy cores once built; the first run compiles every kernel file twice per sanitizer, ~6 more
minutes, cached in .emulator-cache/)
"""

import glob
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmc.emulator import build  # noqa: E402

SANITIZERS = {"tsan": "tsan", "asan": "asan+ubsan"}
TESTS = os.path.join(ROOT, "tests", "test_emulated_kernels.py")
# pytest node ids (a wrong id is an error, never an empty selection)
WORKLOAD = [f"{TESTS}::{test}" for test in (
    "test_model_matches_gpt2_cpu[naive-True-77-3-13-fp32]",
    "test_model_matches_gpt2_cpu[flash-True-80-3-13-bf16]",
    "test_vendor_paths_match_gpt2_cpu[fp32-naive-True]",        # cuBLASLt's epilogues: residual_forward adds dbias
    "test_flash_attention_every_head_size[16-2-37-2-fp32]",
    "test_flash_attention_every_head_size[32-1-70-2-fp32]",
    "test_flash_attention_every_head_size[64-1-33-1-fp32]",
    "test_flash_attention_every_head_size[128-1-19-1-fp32]",
    "test_cached_sampling_forward_matches_gpt2_cpu",
    "test_training_steps_match_gpt2_cpu",
)] + [os.path.join(ROOT, "tests", test) for test in (            # Llama 3's kernels, alone and in the model
    "test_llama3_kernels.py::test_grid_stride_loops[cpu-fp32]",
    "test_llama3_kernels.py::test_grid_stride_loops[cpu-bf16]",
    "test_llama3_cuda.py::test_tiny_model_matches_llama3_cpu[fp32-naive]",
)]
MATMUL_TESTS = os.path.join(ROOT, "tests", "test_matmul_tensor_cores.py")
DEV_WORKLOAD = [f"{MATMUL_TESTS}::test_every_edge_at_once[{name}-cpu]"
                for name in ("matmul_forward_qkv", "matmul_backward_qkv", "matmul_forward_gelu_fc")] + [
    os.path.join(ROOT, "tests", "test_dev_cuda.py::test_classifier_candidate_4_is_version_3_bit_for_bit"),
    os.path.join(ROOT, "tests", "test_dev_cuda.py::test_classifier_candidate_5_holds_the_row_in_registers"),
    os.path.join(ROOT, "tests", "test_dev_cuda.py::test_layernorm_candidate_6_under_the_sanitizers"),
    os.path.join(ROOT, "tests", "test_dev_cuda.py::test_bias_candidate_5_is_version_4_bit_for_bit[test]")]
DEV_FILES = ("dev/cuda/matmul.cu",)    # their bf16-only kernels: the tensor-core versions
SANITIZER_GLOBAL_NORM_GRID = 5         # blocks of global_norm_squared (odd, and fewer than the data's groups)
OPTIMIZER_N = 1001                     # values: 1001 % 8 = 1 (the scalar tail), 1001 % 256 = 233 (idle threads)


def all_kernels():
    """The `extern "C" __global__` kernel names of kernels/*.cu, and of each DEV_FILES file those
    its bf16 build has and its fp32 build has not (the preprocessor decides, as for NVRTC)."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "kernels", "*.cu")):
        with open(path) as f:
            names.update(build.kernel_names(f.read()))
    for file in DEV_FILES:
        path = os.path.join(ROOT, file)
        built = {precision: set(build.built_kernel_names(path, build.compiler_flags([define], [build.KERNELS_DIR])))
                 for precision, define in build.PRECISION_DEFINES.items()}
        names.update(built["bf16"] - built["fp32"])
    return names


# ----------------------------------------------------------------------------
# inside the sanitizer's interpreter

def optimizer_check(precision, n=OPTIMIZER_N, seed=0):
    """gpt2_cuda.global_norm and gpt2_cuda.adamw_update on n values of `precision` against NumPy
    in float64 (the update of kernels/adamw.cu's header); in bf16 with fp32 master weights, so
    the new params are the master values stochastically rounded. True when all agree."""
    import gpt2_cuda
    from llmc import cuda
    from llmc.check import check_tensor
    from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
    cp, bf16 = cuda.cupy(), precision == "bf16"
    to_floatX = float32_to_bfloat16_bits if bf16 else (lambda x: x)
    from_floatX = bfloat16_bits_to_float32 if bf16 else (lambda x: x)
    rng = np.random.default_rng(seed)
    p = from_floatX(to_floatX(rng.standard_normal(n).astype(np.float32)))      # (n,) values floatX holds
    g = from_floatX(to_floatX(rng.standard_normal(n).astype(np.float32)))
    m = (0.01 * rng.standard_normal(n)).astype(np.float32)
    v = (1e-4 * rng.random(n)).astype(np.float32)

    out, partial = cp.empty(gpt2_cuda.NORM_VALUES, np.float32), cp.empty(gpt2_cuda.GLOBAL_NORM_GRID, np.float32)
    grads = cp.asarray(to_floatX(g))
    gpt2_cuda.global_norm(out, partial, grads, n)
    ok = check_tensor(out.get()[:1], [np.sqrt(np.sum(g.astype(np.float64) ** 2))], f"{precision} global norm", 0, 1e-5)

    lr, beta1, beta2, eps, weight_decay, grad_scale, t = 1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 3
    bc1, bc2 = 1.0 - beta1 ** t, 1.0 - beta2 ** t
    params, d_m, d_v = cp.asarray(to_floatX(p)), cp.asarray(m), cp.asarray(v)
    master = cp.asarray(p) if bf16 else None
    gpt2_cuda.adamw_update_tensor(params, master, grads, d_m, d_v, n, lr, beta1, beta2, bc1, bc2, eps, weight_decay,
                           grad_scale, seed=12345)
    g64 = grad_scale * g.astype(np.float64)
    m_ref = beta1 * m + (1 - beta1) * g64
    v_ref = beta2 * v + (1 - beta2) * g64 ** 2
    p_ref = p - lr * ((m_ref / bc1) / (np.sqrt(v_ref / bc2) + eps) + weight_decay * p)
    ok &= check_tensor(d_m.get(), m_ref, f"{precision} adamw m", 1e-8, 1e-5)
    ok &= check_tensor(d_v.get(), v_ref, f"{precision} adamw v", 1e-10, 1e-5)
    if bf16:
        ok &= check_tensor(master.get(), p_ref, "bf16 adamw master params", 1e-6, 1e-5)
        # stochastic rounding lands on one of the two bf16 neighbours: within one ulp, 2^-7 relative
        ok &= check_tensor(from_floatX(params.get()), p_ref, "bf16 adamw params", 0, 2.0 ** -7)
    else:
        ok &= check_tensor(params.get(), p_ref, "fp32 adamw params", 1e-6, 1e-5)
    return bool(ok)


def inside(executed_path):
    """Run WORKLOAD and optimizer_check, recording the kernels launched; write their names to
    executed_path. Returns the exit code: 0 when every check passed."""
    import pytest

    import gpt2_cuda
    from llmc import cuda
    executed = set()
    launch = build.Kernel.launch

    def recording_launch(self, *args):
        executed.add(self.name)
        return launch(self, *args)
    build.Kernel.launch = recording_launch
    gpt2_cuda.GLOBAL_NORM_GRID = SANITIZER_GLOBAL_NORM_GRID
    # --capture=sys: a sanitizer's report is written to file descriptor 2 and ends the process
    # at once, so pytest must not be holding that descriptor's output
    ok = pytest.main(["-q", "-p", "no:cacheprovider", "--capture=sys", *WORKLOAD, *DEV_WORKLOAD]) == 0
    cuda.use_device("cpu")
    for precision in ("fp32", "bf16"):
        ok = optimizer_check(precision) and ok
    with open(executed_path, "w") as f:
        f.write("\n".join(sorted(executed)))
    return 0 if ok else 1


# ----------------------------------------------------------------------------
# the runs

def run(mode):
    """Run the workload in `mode`'s sanitizer (a python linked with it); returns (ok, kernels
    launched, output tail)."""
    python = build.sanitizer_python(mode)
    with tempfile.TemporaryDirectory() as tmp:
        executed_path = os.path.join(tmp, "executed")
        result = subprocess.run([python, os.path.abspath(__file__), "--inside", executed_path], cwd=ROOT,
                                env=build.sanitizer_environment(mode), capture_output=True, text=True)
        executed = set()
        if os.path.isfile(executed_path):
            with open(executed_path) as f:
                executed = set(f.read().split())
    output = f"exit code {result.returncode}\n" + (result.stdout + result.stderr)[-6000:]
    return result.returncode == 0, executed, output


USAGE = "usage: python dev/sanitize_kernels.py [--only tsan|asan]"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inside"] and len(argv) == 2:
        return inside(argv[1])
    modes = list(SANITIZERS)
    if len(argv) == 2 and argv[0] == "--only" and argv[1] in SANITIZERS:
        modes = [argv[1]]
    elif argv:
        print(f"error: unknown arguments {' '.join(argv)} ({USAGE})", file=sys.stderr)
        return 1
    kernels = all_kernels()
    failed = False
    for mode in modes:
        label = SANITIZERS[mode]
        start = time.time()
        try:
            ok, executed, output = run(mode)
        except build.EmulatorError as e:
            print(f"error: {label}: {e}", file=sys.stderr)
            return 1
        missing = kernels - executed
        seconds = time.time() - start
        if ok and not missing:
            print(f"{label}: OK, {len(kernels)} kernels in {seconds:.0f} s")
            continue
        failed = True
        print(f"{label}: FAILED after {seconds:.0f} s")
        if not ok:
            print(output)
        else:
            print(f"{label}: kernels that the run did not launch: {', '.join(sorted(missing))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
