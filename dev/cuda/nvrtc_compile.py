"""
dev/cuda/nvrtc_compile.py: compile every kernels/*.cu with NVRTC, no GPU needed.

Each kernel file is compiled for both storage precisions (-DENABLE_BF16, -DENABLE_FP32) and for
the virtual architectures compute_80 (A100) and compute_90 (H100) to PTX, and for the real
architectures sm_80 and sm_90 to cubin (which also runs ptxas, so register allocation and spills
are checked too). NVRTC is the compiler that cupy.RawModule uses at run time, driven here
through CuPy's low-level binding (cupy_backends.cuda.libs.nvrtc), which loads libnvrtc from the
nvidia-cuda-nvrtc-cu12 wheel and needs no device or driver. This is the CI check for the
kernels; it proves they compile, not that they compute the right thing (tests marked gpu do).

What it deliberately is not: a build system. Nothing is cached or written; gpt2_cuda.py compiles
the kernels itself with cupy.RawModule. The compile options have one source,
llmc.cuda.kernel_compile_options, imported here (llmc.cuda imports CuPy only when it runs on a
GPU, so importing it needs neither CuPy's device runtime nor a driver).

Run it:
    python dev/cuda/nvrtc_compile.py
prints one line per (file, precision) with OK/FAIL per architecture, e.g.
    file             precision entries  compute_80  compute_90  sm_80  sm_90
    adamw.cu         bf16            1  OK          OK          OK     OK
    ...
    all 72 compilations OK (NVRTC 12.9)
and exits 1 after printing NVRTC's log for every failure. Other uses:
    python dev/cuda/nvrtc_compile.py kernels/gelu.cu         # some files only
    python dev/cuda/nvrtc_compile.py --dev                   # kernels/*.cu, then dev/cuda/*.cu
    python dev/cuda/nvrtc_compile.py --resource-usage        # registers/spills per kernel, sm_90
"""

import argparse
import ctypes
import glob
import os
import re
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from llmc import cuda  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.cuda import KERNELS_DIR, PRECISION_DEFINES, kernel_compile_options  # noqa: E402

PTX_ARCHS = ("compute_80", "compute_90")         # virtual: PTX, JIT-compiled by the driver
CUBIN_ARCHS = ("sm_80", "sm_90")                 # real: SASS, also runs ptxas
# cupy.RawModule appends these to every NVRTC compile (cupy/cuda/compiler.py); the check adds
# them too so that it compiles exactly what runs. Repeating them is harmless.
CUPY_IMPLICIT_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
RESOURCE_USAGE_ARCH = "sm_90"
DEV_CUDA_DIR = os.path.dirname(os.path.abspath(__file__))
FILE_COLUMN_WIDTH = 16


class NvrtcUnavailable(RuntimeError):
    """The NVRTC library or CuPy's binding to it cannot be loaded."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel file; the message names the file and carries NVRTC's log."""

    def __init__(self, path, precision, arch, log):
        self.path, self.precision, self.arch, self.log = path, precision, arch, log
        super().__init__(f"{path} [{precision}, {arch}]: NVRTC compilation failed:\n{log.rstrip()}")


# ----------------------------------------------------------------------------
# locating NVRTC and the CUDA headers from the nvidia-* wheels

def _nvidia_package_dirs():
    """Directories of the `nvidia` namespace package (the pip wheels nvidia-cuda-*-cu12)."""
    try:
        import nvidia
    except ImportError:
        return []
    return list(getattr(nvidia, "__path__", []))


def cuda_include_dir():
    """The directory holding cuda_bf16.h, found as the trainer finds it (llmc.cuda.cuda_include_dir:
    the nvidia-cuda-runtime-cu12 wheel's include/, else $CUDA_PATH, $CUDA_HOME, /usr/local/cuda).
    Raises NvrtcUnavailable when none has it."""
    try:
        return cuda.cuda_include_dir()
    except cuda.KernelCompileError as error:
        raise NvrtcUnavailable(str(error)) from None


def _preload_nvrtc_from_wheel():
    """dlopen the wheel's libnvrtc (RTLD_GLOBAL) so CuPy's binding finds it even where its own
    search does not look (older CuPy, unusual site-packages layouts)."""
    for d in _nvidia_package_dirs():
        for lib in sorted(glob.glob(os.path.join(d, "cuda_nvrtc", "lib", "libnvrtc*.so*"))):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass


def load_nvrtc():
    """Return CuPy's NVRTC binding module, loading libnvrtc if needed. Raises NvrtcUnavailable."""
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
        return nvrtc
    except Exception as first_error:            # ImportError, OSError or CuPy's RuntimeError
        _preload_nvrtc_from_wheel()
        try:
            from cupy_backends.cuda.libs import nvrtc
            nvrtc.getVersion()
            return nvrtc
        except Exception as error:
            raise NvrtcUnavailable(f"cannot load NVRTC through CuPy ({error}; first try: "
                                   f"{first_error}): {cuda.pip_advice('cupy', 'nvrtc', 'runtime')}") from error


# ----------------------------------------------------------------------------
# compiling

def _compile(path, precision, arch, source, extra_options):
    """Run NVRTC once; return (PTX str or cubin bytes, NVRTC's log)."""
    nvrtc = load_nvrtc()
    if source is None:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    options = ((f"-arch={arch}",) + kernel_compile_options(precision) + CUPY_IMPLICIT_OPTIONS
               + tuple(extra_options))
    # the program's name is the path: NVRTC prefixes every diagnostic with it
    program = nvrtc.createProgram(source, os.path.relpath(path, REPO_ROOT), [], [])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise KernelCompileError(path, precision, arch,
                                     nvrtc.getProgramLog(program) or str(error)) from None
        if arch.startswith("sm_"):
            result = nvrtc.getCUBIN(program)
        else:
            result = nvrtc.getPTX(program).decode("utf-8").rstrip("\0")
        return result, nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


def compile_kernel(path, precision, arch, source=None, extra_options=()):
    """Compile one kernel file with NVRTC. arch is "compute_XX" (returns the PTX as str) or
    "sm_XX" (returns the cubin as bytes). source replaces the file's text (tests use it).
    Raises KernelCompileError (names the file, carries NVRTC's log), NvrtcUnavailable."""
    return _compile(path, precision, arch, source, extra_options)[0]


def ptx_entry_names(ptx):
    """Names of the kernels (`.entry name(`) defined in a PTX text, in order."""
    return re.findall(r"\.entry\s+([A-Za-z_][A-Za-z0-9_$]*)\s*\(", ptx)


def kernel_files():
    """kernels/*.cu, sorted."""
    return sorted(glob.glob(os.path.join(KERNELS_DIR, "*.cu")))


def dev_kernel_files():
    """dev/cuda/*.cu, sorted: the intermediate versions of the kernel progressions (they include
    kernels/common.cuh and compile with the same options)."""
    return sorted(glob.glob(os.path.join(DEV_CUDA_DIR, "*.cu")))


def file_label(path):
    """How the table names a file: kernels/*.cu by basename (as always), others by their path
    relative to the repository (dev/cuda/layernorm.cu is not kernels/layernorm.cu)."""
    if os.path.dirname(os.path.abspath(path)) == os.path.abspath(KERNELS_DIR):
        return os.path.basename(path)
    return os.path.relpath(path, REPO_ROOT)


# ----------------------------------------------------------------------------
# resource usage (ptxas -v through NVRTC)

_PTXAS_FUNCTION = re.compile(r"Function properties for (\w+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def resource_usage(path, precision, arch=RESOURCE_USAGE_ARCH):
    """{kernel: (registers, stack bytes, spill store bytes, spill load bytes)} from ptxas -v."""
    log = _compile(path, precision, arch, None, ("-Xptxas=-v",))[1]
    usage, current, frame = {}, None, None
    for line in log.splitlines():
        if m := _PTXAS_FUNCTION.search(line):
            current = m.group(1)
        elif (m := _PTXAS_FRAME.search(line)) and current:
            frame = tuple(int(x) for x in m.groups())
        elif (m := _PTXAS_REGISTERS.search(line)) and current:
            usage[current] = (int(m.group(1)),) + (frame or (0, 0, 0))
            current, frame = None, None
    return usage


# ----------------------------------------------------------------------------
# command line

def print_resource_usage(files, precisions):
    """Print a registers/stack/spills table (RESOURCE_USAGE_ARCH). Returns the exit status."""
    print(f"{'kernel':26s} {'precision':9s} {'registers':>9s} {'stack':>6s} {'spill st':>8s} {'spill ld':>8s}")
    for path in files:
        for precision in precisions:
            try:
                usage = resource_usage(path, precision)
            except KernelCompileError as error:
                print(error, file=sys.stderr)
                return 1
            for name, (regs, stack, spill_st, spill_ld) in sorted(usage.items()):
                print(f"{name:26s} {precision:9s} {regs:9d} {stack:6d} {spill_st:8d} {spill_ld:8d}")
    return 0


def print_compile_table(files, precisions, archs):
    """Compile every (file, precision, arch), print the OK/FAIL table, then every failure's
    NVRTC log on stderr. Returns the exit status: 0 all OK, 1 any failure."""
    widths = [max(len(a), 4) for a in archs]
    fw = max([FILE_COLUMN_WIDTH] + [len(file_label(p)) for p in files])
    print(f"{'file':{fw}s} {'precision':9s} {'entries':>7s}  "
          + "  ".join(f"{a:{w}s}" for a, w in zip(archs, widths)).rstrip())
    failures = []
    for path in files:
        for precision in precisions:
            cells, entries = [], "-"        # entries: kernels in the PTX, from a compute_XX build
            for arch in archs:
                try:
                    result = compile_kernel(path, precision, arch)
                    if isinstance(result, str):
                        entries = str(len(ptx_entry_names(result)))
                    cells.append("OK")
                except KernelCompileError as error:
                    failures.append(error)
                    cells.append("FAIL")
            print((f"{file_label(path):{fw}s} {precision:9s} {entries:>7s}  "
                   + "  ".join(f"{c:{w}s}" for c, w in zip(cells, widths))).rstrip())
    total = len(files) * len(precisions) * len(archs)
    version = "%d.%d" % load_nvrtc().getVersion()
    for error in failures:
        print(f"\n{error}", file=sys.stderr)
    if failures:
        print(f"{len(failures)} of {total} compilations FAILED (NVRTC {version})")
        return 1
    print(f"all {total} compilations OK (NVRTC {version})")
    return 0


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("files", nargs="*", help="kernel files (default: every kernels/*.cu)")
    parser.add_argument("-d", "--dev", action="store_true",
                        help="also compile every dev/cuda/*.cu (the progressions' intermediate versions)")
    parser.add_argument("-p", "--precisions", nargs="+", default=list(PRECISION_DEFINES),
                        choices=list(PRECISION_DEFINES), help="storage precisions")
    parser.add_argument("-a", "--archs", nargs="+", default=list(PTX_ARCHS + CUBIN_ARCHS),
                        help="compute_XX (PTX) and/or sm_XX (cubin) targets")
    parser.add_argument("-r", "--resource-usage", action="store_true",
                        help=f"print registers and spills per kernel ({RESOURCE_USAGE_ARCH})")
    args = parser.parse_args(argv)

    files = (args.files or kernel_files()) + (dev_kernel_files() if args.dev else [])
    for path in files:
        if not os.path.isfile(path):
            print(f"error: kernel file '{path}' not found", file=sys.stderr)
            return 1
    bad_archs = [a for a in args.archs if not re.fullmatch(r"(compute|sm)_\d+a?", a)]
    if bad_archs:
        print(f"error: bad arch '{bad_archs[0]}': expected compute_XX or sm_XX", file=sys.stderr)
        return 1
    try:
        load_nvrtc()
        cuda_include_dir()
    except NvrtcUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    if args.resource_usage:
        return print_resource_usage(files, args.precisions)
    return print_compile_table(files, args.precisions, args.archs)


if __name__ == "__main__":
    sys.exit(main())
