"""dev/sanitize_kernels.py: the kernels of kernels/*.cu run under ThreadSanitizer and under
AddressSanitizer + UndefinedBehaviorSanitizer on the emulated CUDA device (llmc/emulator/).

What it does, per sanitizer: builds a Python interpreter with the sanitizer linked in
(llmc.emulator.build.sanitizer_python: ThreadSanitizer cannot be preloaded into python3), then runs
a selection of tests/test_emulated_kernels.py (WORKLOAD below; --all: its every-kernel test) in
it with LLMC_EMULATOR_MODE set, so every kernel file is compiled with that sanitizer and each CUDA
thread is an OS thread (fibers would serialize the threads of a block and hide their races), at
the tests' odd shapes (T = 13, 37, 70, 33, 19; V = 75 in Vp = 77 and 80). A report stops the
run (exit code 66) and this script exits 1.
tests/test_emulator.py shows on planted-bug copies that an out-of-bounds write, a missing
__syncthreads and a wrong shuffle mask are each caught.

Run: python dev/sanitize_kernels.py          (or: make sanitize; --all adds AdamW and the global norm)
Expect: "tsan: OK" and "asan+ubsan: OK" (the first run compiles every kernel file twice per
sanitizer: ~10 minutes on 2 cores; cached in .emulator-cache/)
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmc.emulator import build  # noqa: E402

SANITIZERS = {"tsan": "tsan", "asan": "asan+ubsan"}
# every kernel of the forward and backward (naive attention in fp32, flash in bf16), flash at each
# head size, the sampling path's cast and residual kernels: the small shapes of
# tests/test_emulated_kernels.py. AdamW and the global norm (1024 blocks of 512 OS threads under a
# sanitizer) run at the end of the training test: --all adds it.
WORKLOAD = [os.path.join(ROOT, "tests", "test_emulated_kernels.py"), "-k",
            "test_model_matches_gpt2_cpu and (fp32-naive-True-77-3-13 or bf16-flash-True-80-3-13) "
            "or test_flash_attention_every_head_size and fp32 or test_cached_sampling"]
WORKLOAD_ALL = [os.path.join(ROOT, "tests", "test_emulated_kernels.py"), "-k", "test_every_kernel_in_kernels_is_executed"]


def run(mode, workload):
    """Run the workload under `mode`'s sanitizer; returns (ok, output tail)."""
    python = build.sanitizer_python(mode)
    result = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workload], cwd=ROOT,
                            env=build.sanitizer_environment(mode), capture_output=True, text=True)
    return result.returncode == 0, f"exit code {result.returncode}\n" + (result.stdout + result.stderr)[-6000:]


def main(argv=None):
    workload = WORKLOAD_ALL if "--all" in (sys.argv[1:] if argv is None else argv) else WORKLOAD
    failed = False
    for mode, label in SANITIZERS.items():
        try:
            ok, output = run(mode, workload)
        except build.EmulatorError as e:
            print(f"error: {label}: {e}", file=sys.stderr)
            return 1
        print(f"{label}: {'OK' if ok else 'FAILED'}")
        if not ok:
            print(output)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
