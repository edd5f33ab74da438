"""llmc/emulator/build.py: kernels/<file>.cu compiled by g++ into a host shared library, cached,
loaded with ctypes, and launched with CuPy's (grid, block, args).

The kernel file is compiled unmodified, but for its inline PTX (a build that includes an asm
statement compiles copies in which llmc/emulator/ptx.py has turned each into the emulator's
implementation of that instruction): a generated unit includes it after the shim
(shim/cuda_shim.h, force-included; `#include <cuda_bf16.h>` finds shim/cuda_bf16.h first), then
the launcher (shim/emulator.cpp), then one extern "C" entry per `extern "C" __global__` kernel
of the file that the preprocessor keeps with the build's defines (built_kernel_names):
llmc_emu_launch_<name>(grid[3], block[3], void** args), with args[i] pointing at the i-th
argument as cuLaunchKernel takes them, and llmc_emu_parameters_<name>(sizes, pointers), which the
launch uses to check every argument's size against the C signature (CuPy does not).

Builds are cached in .emulator-cache/ (git-ignored; $LLMC_EMULATOR_CACHE overrides it) under a
hash of the kernel file, common.cuh, the shim, the flags and the compiler's version: g++ takes
tens of seconds per file, once. Modes: "fibers" (the emulated device), "tsan" and "asan" (the
sanitizer builds: one OS thread per CUDA thread; they must run in a process that loads the
sanitizer runtime first, see dev/sanitize_kernels.py).

    python -c "from llmc.emulator import build; print(build.kernel_library('layernorm', 'fp32').path)"
"""

import ctypes
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

from llmc.emulator import ptx

EMULATOR_DIR = os.path.dirname(os.path.abspath(__file__))
SHIM_DIR = os.path.join(EMULATOR_DIR, "shim")
ROOT = os.path.dirname(os.path.dirname(EMULATOR_DIR))
KERNELS_DIR = os.path.join(ROOT, "kernels")
CACHE_DIR = os.environ.get("LLMC_EMULATOR_CACHE", os.path.join(ROOT, ".emulator-cache"))
CXX = os.environ.get("CXX", "g++")

PRECISION_DEFINES = {"bf16": "-DENABLE_BF16", "fp32": "-DENABLE_FP32"}
COMMON_FLAGS = ("-std=c++20", "-fPIC", "-shared", "-pthread", "-Wno-unknown-pragmas", "-Wno-attributes",
                "-DLLMC_EMULATED_DEVICE")
# -g everywhere: a gdb breakpoint inside a kernel works on the cached library as it is.
# LLMC_EMULATOR_DEBUG=1 compiles -O0 so that every local variable of a kernel can be printed.
# The emulated device's own build: -O3, and no errno or floating-point traps (a GPU has neither;
# results are IEEE's all the same), so that g++ may vectorize a thread's sqrtf and divisions
# (AdamW's 4 elements per thread). At d4 (dev/bench_emulator.py, three runs each, 2026-11-27) the
# kernels took 220-229 ms with these flags against 264-329 ms at -O2 (the fused classifier 60-63
# against 99-119 ms).
FIBER_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math")
MODE_FLAGS = {
    "fibers": ("-O0",) if os.environ.get("LLMC_EMULATOR_DEBUG") == "1" else FIBER_FLAGS,
    "tsan": ("-O1", "-fsanitize=thread", "-DLLMC_EMU_OS_THREADS"),
    "asan": ("-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
             "-fno-omit-frame-pointer", "-DLLMC_EMU_OS_THREADS"),
    # the memory counters (llmc/emulator/memory.py, shim/tracer.cpp): fibers as "fibers", no
    # auto-vectorization (it would merge or split accesses as no GPU compiler would); the kernel's
    # unit is instrumented (TRACE_KERNEL_FLAGS), the launcher and the tracer are not
    "trace": ("-O1", "-fno-tree-vectorize", "-fno-tree-slp-vectorize", "-DLLMC_EMU_TRACE"),
}
# ThreadSanitizer's instrumentation without its runtime: every load and store calls __tsan_readN /
# __tsan_writeN, which shim/tracer.cpp defines
TRACE_KERNEL_FLAGS = ("-fsanitize=thread", "--param", "tsan-instrument-func-entry-exit=0")
KERNEL_PATTERN = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')
UNIT_KERNEL_PATTERN = re.compile(r'extern "C" int llmc_emu_launch_(\w+)\(')
SHIM_FILES = ("cuda_shim.h", "cuda_bf16.h", "tensor_cores.h", "emulator.cpp", "tracer.cpp", "launcher_and_tracer.cpp")
MAX_PARAMETERS = 64


class EmulatorError(RuntimeError):
    """A kernel file that g++ rejects (with g++'s log), or a launch that breaks a CUDA rule."""


def kernel_names(source):
    """The `extern "C" __global__` kernel names of a .cu source text, in order."""
    return KERNEL_PATTERN.findall(source)


def preprocessed(path, flags):
    """g++'s -E -fdirectives-only output of the .cu file `path` with `flags`: the conditionals
    and the includes evaluated, the macros not expanded. Raises EmulatorError."""
    result = subprocess.run([CXX, *flags, "-x", "c++", "-E", "-fdirectives-only", path], capture_output=True, text=True)
    if result.returncode != 0:
        raise EmulatorError(f"{path}: g++ failed to preprocess it for the emulated device:\n{result.stderr[-4000:]}")
    return result.stdout


def built_kernel_names(path, flags):
    """The kernels of the .cu file `path` that exist when it is compiled with `flags`: a kernel
    inside `#if defined(ENABLE_BF16)` is one of the bf16 build's only, as NVRTC compiles it.
    KERNEL_PATTERN still finds each `extern "C" __global__` as written in the preprocessed text."""
    return kernel_names(preprocessed(path, flags))


def included_files(text):
    """The files a preprocessed text came from (its linemarkers `# N "path"`), as absolute paths."""
    return {os.path.abspath(p) for p in re.findall(r'^# \d+ "([^"<]+)"', text, re.M)}


def compiler_flags(defines, include_dirs, mode="fibers"):
    """g++ flags for a kernel library: the -D defines (e.g. "-DENABLE_BF16"), the shim, then the
    include directories in order."""
    return (COMMON_FLAGS + MODE_FLAGS[mode] + ("-g",) + tuple(defines)
            + ("-include", os.path.join(SHIM_DIR, "cuda_shim.h"), f"-I{SHIM_DIR}")
            + tuple(f"-I{d}" for d in include_dirs))


def unit_source(kernel_path, names, with_launcher=True):
    """The generated C++ unit: the kernel file, the launcher (unless with_launcher is False: the
    traced build compiles it apart, uninstrumented), one launch and one parameters entry per kernel."""
    lines = [f'#include "{kernel_path}"']
    if with_launcher:
        lines.append(f'#include "{os.path.join(SHIM_DIR, "emulator.cpp")}"')
    lines.append("")
    for name in names:
        lines += [
            f"static void llmc_emu_body_{name}(void* args) {{ llmc_emu::invoke({name}, (void**)args); }}",
            f'extern "C" int llmc_emu_launch_{name}(const unsigned* grid, const unsigned* block, void** args) {{',
            f'    return llmc_emu::launch("{name}", grid, block, llmc_emu_body_{name}, args);',
            "}",
            f'extern "C" int llmc_emu_parameters_{name}(int* sizes, int* pointers) {{',
            f"    return llmc_emu::parameters({name}, sizes, pointers);",
            "}",
        ]
    return "\n".join(lines) + "\n"


def compiler_version():
    """First line of `g++ --version` (part of the cache key). Raises EmulatorError without g++."""
    try:
        return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError) as e:
        raise EmulatorError(f"the emulated device needs a C++20 compiler ({CXX}): {e}") from None


def source_path(file):
    """kernels/<file>.cu, or `file` itself when it is a path to a .cu file (a scratch copy)."""
    return file if file.endswith(".cu") else os.path.join(KERNELS_DIR, f"{file}.cu")


def source_file(code):
    """Write a kernel source text to the cache, named by its hash (and by the file that a leading
    `#line 1 "path"` names), and return the path."""
    match = re.match(r'#line 1 "([^"]+)"', code)
    stem = os.path.splitext(os.path.basename(match.group(1)))[0] if match else "module"
    os.makedirs(CACHE_DIR, exist_ok=True)
    path = os.path.join(CACHE_DIR, f"{stem}-{hashlib.sha256(code.encode()).hexdigest()[:16]}.cu")
    if not os.path.isfile(path):
        fd, tmp = tempfile.mkstemp(suffix=".cu", dir=CACHE_DIR)
        with os.fdopen(fd, "w") as f:
            f.write(code)
        os.replace(tmp, path)
    return path


def library_base(path, defines, include_dirs, mode="fibers"):
    """(the cache path of the library without its extension, the source text, the g++ flags) of
    the .cu file `path` compiled with `defines` and `include_dirs` (searched in order; the file's
    own directory first) in `mode`: the base's name holds a hash of everything the build reads."""
    with open(path) as f:
        source = f.read()
    include_dirs = list(dict.fromkeys([os.path.dirname(os.path.abspath(path))] + list(include_dirs)))
    flags = compiler_flags(defines, include_dirs, mode)
    digest = hashlib.sha256(source.encode())
    for d in include_dirs:                       # common.cuh and any other header next to the kernels
        for name in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            if name.endswith((".cuh", ".h")):
                with open(os.path.join(d, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    for name in SHIM_FILES:
        with open(os.path.join(SHIM_DIR, name), "rb") as f:
            digest.update(f.read())
    with open(ptx.__file__, "rb") as f:                # the translation of inline PTX
        digest.update(f.read())
    digest.update(" ".join(flags + (compiler_version(), os.path.abspath(path))).encode())
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(CACHE_DIR, f"{stem}-{mode}-{digest.hexdigest()[:16]}"), source, flags


def is_built(path, defines, include_dirs, mode="fibers"):
    """Whether library_path would find the library in the cache, whole (no g++ to run)."""
    return cached_library_problem(library_base(path, defines, include_dirs, mode)[0]) is None


def library_path(path, defines, include_dirs, mode="fibers"):
    """The cached shared library of the .cu file `path` compiled with `defines` and
    `include_dirs` (library_base) in `mode`, compiled first if it is not in the cache. Raises
    EmulatorError with g++'s log."""
    base, source, flags = library_base(path, defines, include_dirs, mode)
    os.makedirs(CACHE_DIR, exist_ok=True)
    with open(base + ".lock", "a") as lock:              # one builder per library; the others wait, then load
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = cached_library_problem(base)
        if problem is None:
            return base + ".so"
        if problem != "not built yet":
            print(f"note: the emulated device's cached {os.path.basename(base)}.so is damaged ({problem}): "
                  f"rebuilding it", file=sys.stderr)
        build_library(base, path, flags, defines)
    return base + ".so"


def traced_build_commands(flags, unit, so):
    """The traced build (mode "trace") in three steps: the kernel's unit compiled with the
    instrumentation, the launcher and the tracer (shim/emulator.cpp, shim/tracer.cpp) without it,
    linked without ThreadSanitizer's runtime (the tracer stands in for it)."""
    kernel_object, launcher_object = unit + ".kernel.o", unit + ".launcher.o"
    return [[CXX, *flags, *TRACE_KERNEL_FLAGS, "-c", unit, "-o", kernel_object],
            [CXX, *flags, "-c", "-x", "c++", os.path.join(SHIM_DIR, "launcher_and_tracer.cpp"), "-o", launcher_object],
            [CXX, *flags, kernel_object, launcher_object, "-ldl", "-o", so]]


def file_digest(path):
    """(size in bytes, sha256 hex) of a file."""
    with open(path, "rb") as f:
        data = f.read()
    return len(data), hashlib.sha256(data).hexdigest()


def cached_library_problem(base):
    """None if base.so is in the cache whole: its size and sha256 are those recorded in base.sha256
    when it was built (a truncated or overwritten library would crash dlopen or the launch, with
    SIGBUS if it changes while mapped). Else what is wrong, in a few words."""
    if not os.path.isfile(base + ".so") or not os.path.isfile(base + ".sha256"):
        return "not built yet"                     # (a library from before the checksums: built again)
    try:
        with open(base + ".sha256") as f:
            recorded = f.read().split()
        size, digest = file_digest(base + ".so")
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if recorded != [str(size), digest]:
        return f"{size} bytes with sha256 {digest[:12]}..., not the recorded {' '.join(recorded)[:40]}"
    return None


def inline_ptx_translated(base, path, flags, included):
    """(the .cu file to compile, the flags) for `path`: itself and `flags` when no file it
    includes (`included`, absolute paths) holds inline asm, else the copies llmc.emulator.ptx writes under base.ptx/ with their
    asm statements turned into the emulator's instructions, and the -I directories of the copies.
    Raises EmulatorError for an instruction the emulated device lacks."""
    include_dirs = [f[2:] for f in flags if f.startswith("-I") and f[2:] != SHIM_DIR]
    try:
        compiled, dirs = ptx.emulated_sources(path, include_dirs, base + ".ptx", included)
    except ValueError as e:
        raise EmulatorError(f"{path}: {e}") from None
    kept = tuple(f for f in flags if not (f.startswith("-I") and f[2:] != SHIM_DIR))
    return compiled, kept + tuple(f"-I{d}" for d in dirs)


def build_library(base, path, flags, defines):
    """Compile the generated unit of `path` into base.so. Every file is written under a private
    temporary name and renamed into place (the unit base.cpp, kept for reading; the library; then
    its size and checksum, base.sha256, last), so a process that reads the cache never sees a
    half-written file. The caller holds base.lock. Raises EmulatorError with g++'s log."""
    text = preprocessed(path, flags)
    names = kernel_names(text)
    compiled, flags = inline_ptx_translated(base, path, flags, included_files(text))
    unit_fd, unit_tmp = tempfile.mkstemp(suffix=".cpp", dir=CACHE_DIR)
    so_fd, so_tmp = tempfile.mkstemp(suffix=".so", dir=CACHE_DIR)
    os.close(so_fd)
    try:
        traced = "-DLLMC_EMU_TRACE" in flags
        with os.fdopen(unit_fd, "w") as f:
            f.write(unit_source(os.path.abspath(compiled), names, with_launcher=not traced))
        if traced:
            commands = traced_build_commands(flags, unit_tmp, so_tmp)
        else:
            commands = [[CXX, *flags, unit_tmp, "-o", so_tmp]]
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise EmulatorError(f"{path}: g++ failed to compile it for the emulated device "
                                    f"({' '.join(defines)}):\n{result.stderr[-4000:]}")
        size, digest = file_digest(so_tmp)
        os.replace(unit_tmp, base + ".cpp")
        os.replace(so_tmp, base + ".so")
        record_fd, record_tmp = tempfile.mkstemp(suffix=".sha256", dir=CACHE_DIR)
        with os.fdopen(record_fd, "w") as f:
            f.write(f"{size} {digest}\n")
        os.replace(record_tmp, base + ".sha256")
    finally:
        for tmp in (unit_tmp, so_tmp, unit_tmp + ".kernel.o", unit_tmp + ".launcher.o"):
            if os.path.exists(tmp):
                os.unlink(tmp)


def shared_arrays(path):
    """(offsets, sizes, anchor offset) of the library's thread_local __shared__ arrays, from its
    TLS symbols (readelf -sW): every TLS symbol except the shim's own."""
    text = subprocess.run(["readelf", "-sW", path], capture_output=True, text=True, check=True).stdout
    offsets, sizes, anchor = [], [], None
    for line in text.splitlines():
        cols = line.split()
        if len(cols) < 8 or cols[3] != "TLS" or cols[6] == "UND":
            continue
        value, size, name = int(cols[1], 16), int(cols[2], 0), cols[7]
        if "llmc_emu_tls_anchor" in name:
            anchor = value
        elif "llmc_emu" not in name and name not in ("threadIdx", "blockIdx"):
            offsets.append(value)
            sizes.append(size)
    if anchor is None:
        raise EmulatorError(f"{path}: no llmc_emu_tls_anchor TLS symbol (not an emulator library)")
    return offsets, sizes, anchor


# ----------------------------------------------------------------------------
# loading and launching

class Kernel:
    """One kernel of a loaded library, called like cupy.RawKernel: kernel(grid, block, args)."""

    def __init__(self, library, name):
        self.name = name
        self.traced = False                      # set by Library.kernel: a traced build (memory counters)
        try:
            self._launch = getattr(library, f"llmc_emu_launch_{name}")
            parameters = getattr(library, f"llmc_emu_parameters_{name}")
        except AttributeError:
            raise EmulatorError(f"no kernel named {name}") from None
        self._launch.restype = ctypes.c_int
        self._error = library.llmc_emu_error
        self._error.restype = ctypes.c_char_p
        sizes, pointers = (ctypes.c_int * MAX_PARAMETERS)(), (ctypes.c_int * MAX_PARAMETERS)()
        n = parameters(sizes, pointers)
        self.parameter_sizes = list(sizes[:n])
        self.parameter_pointers = [bool(p) for p in pointers[:n]]

    def argument_buffer(self, args):
        """ctypes storage for each argument and the void* array pointing at them. Raises TypeError
        when the count or a size does not match the kernel's C signature."""
        if len(args) != len(self.parameter_sizes):
            raise TypeError(f"kernel {self.name}: {len(args)} arguments, its signature has {len(self.parameter_sizes)}")
        storage = []
        for i, (arg, size, pointer) in enumerate(zip(args, self.parameter_sizes, self.parameter_pointers)):
            if isinstance(arg, np.ndarray):
                if not hasattr(arg.data, "ptr"):     # CuPy refuses host arrays too
                    raise TypeError(f"kernel {self.name}: argument {i} is a host numpy array; "
                                    "pass a device array (llmc.emulator.device)")
                if not pointer:
                    raise TypeError(f"kernel {self.name}: argument {i} is an array, the parameter is a "
                                    f"{size}-byte scalar")
                storage.append(ctypes.c_void_p(address_of(arg)))
            elif isinstance(arg, np.generic):
                if arg.itemsize != size:
                    raise TypeError(f"kernel {self.name}: argument {i} is {arg.dtype} ({arg.itemsize} bytes), "
                                    f"the parameter has {size} bytes")
                storage.append(ctypes.create_string_buffer(arg.tobytes(), size))
            else:
                raise TypeError(f"kernel {self.name}: argument {i} is {type(arg).__name__}; pass an array or a "
                                f"NumPy scalar (np.int32, np.float32, np.uint64) typed as the C signature")
        pointers = (ctypes.c_void_p * max(1, len(storage)))(*[ctypes.addressof(s) for s in storage])
        return storage, pointers

    def launch(self, grid, block, storage, pointers):
        """Run the grid (x, y, z) of blocks (x, y, z) on the arguments argument_buffer made.
        Raises EmulatorError with the launcher's message when the launch breaks a CUDA rule."""
        rc = self._launch((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), pointers)
        if rc != 0:
            raise EmulatorError(self._error().decode())

    def __call__(self, grid, block, args):
        storage, pointers = self.argument_buffer(args)
        self.launch(dims(grid), dims(block), storage, pointers)


def dims(d):
    """An int or a tuple of up to 3 ints -> (x, y, z)."""
    d = (d,) if isinstance(d, (int, np.integer)) else tuple(d)
    if not 1 <= len(d) <= 3:
        raise ValueError(f"grid and block have 1 to 3 dimensions, not {d}")
    return tuple(int(v) for v in d) + (1,) * (3 - len(d))


def address_of(arr):
    """Host address of an emulated device array's first element."""
    return arr.data.ptr


STACK_POOL_SOURCE = os.path.join(SHIM_DIR, "stack_pool.cpp")
_stack_pool = None


def stack_pool():
    """The fiber stack pool (shim/stack_pool.cpp: every kernel library's workers take their stacks
    from it), built once into the cache and loaded once per process with RTLD_GLOBAL, so that the
    kernel libraries loaded after it find its functions. Returns the ctypes library. Raises
    EmulatorError with g++'s log."""
    global _stack_pool
    if _stack_pool is None:
        flags = COMMON_FLAGS + ("-O2", "-g")
        with open(STACK_POOL_SOURCE, "rb") as f:
            key = hashlib.sha256(f.read() + " ".join(flags + (compiler_version(),)).encode()).hexdigest()[:16]
        base = os.path.join(CACHE_DIR, f"stack_pool-{key}")
        os.makedirs(CACHE_DIR, exist_ok=True)
        with open(base + ".lock", "a") as lock:          # one builder; the others wait, then load
            fcntl.flock(lock, fcntl.LOCK_EX)
            if cached_library_problem(base) is not None:
                so_fd, so_tmp = tempfile.mkstemp(suffix=".so", dir=CACHE_DIR)
                os.close(so_fd)
                try:
                    result = subprocess.run([CXX, *flags, STACK_POOL_SOURCE, "-o", so_tmp], capture_output=True, text=True)
                    if result.returncode != 0:
                        raise EmulatorError(f"{STACK_POOL_SOURCE}: g++ failed to compile it:\n{result.stderr[-4000:]}")
                    size, digest = file_digest(so_tmp)
                    os.replace(so_tmp, base + ".so")
                    with open(base + ".sha256.tmp", "w") as f:
                        f.write(f"{size} {digest}\n")
                    os.replace(base + ".sha256.tmp", base + ".sha256")
                finally:
                    if os.path.exists(so_tmp):
                        os.unlink(so_tmp)
        _stack_pool = ctypes.CDLL(base + ".so", mode=ctypes.RTLD_GLOBAL)
        _stack_pool.llmc_emu_stack_pool_size.restype = ctypes.c_size_t
    return _stack_pool


class Library:
    """A loaded kernel library of the .cu file `path`: .kernel(name) -> Kernel; .names: the
    file's kernels in order. Compiled (or found in the cache) on construction; the fiber modes
    load the stack pool (stack_pool) first."""

    def __init__(self, path, defines, include_dirs=(KERNELS_DIR,), mode="fibers"):
        self.source_path = path
        self.path = library_path(path, defines, include_dirs, mode)
        if mode in ("fibers", "trace"):
            stack_pool()
        self.library = ctypes.CDLL(self.path)
        with open(os.path.splitext(self.path)[0] + ".cpp") as f:       # the generated unit: the kernels built
            self.names = UNIT_KERNEL_PATTERN.findall(f.read())
        self.mode = mode
        if mode in ("fibers", "trace"):
            offsets, sizes, anchor = shared_arrays(self.path)
            n = len(offsets)
            self.library.llmc_emu_set_shared(ctypes.c_int(n), (ctypes.c_long * max(1, n))(*offsets),
                                             (ctypes.c_long * max(1, n))(*sizes), ctypes.c_long(anchor))
        self._kernels = {}

    def kernel(self, name):
        if name not in self._kernels:
            self._kernels[name] = Kernel(self.library, name)
            self._kernels[name].traced = self.mode == "trace"
            self._kernels[name].library = self
        return self._kernels[name]


def kernel_library(file, precision, mode="fibers"):
    """kernels/<file>.cu (or the .cu path `file`) loaded for `precision` ("bf16", "fp32")."""
    return Library(source_path(file), [PRECISION_DEFINES[precision]], (KERNELS_DIR,), mode)


# ----------------------------------------------------------------------------
# sanitizer runs: a Python interpreter with the sanitizer linked in

SANITIZER_LINK_FLAGS = {"tsan": ("-fsanitize=thread",), "asan": ("-fsanitize=address,undefined",)}


def sanitizer_python(mode):
    """Path of a python3 executable linked with the sanitizer of `mode` ("tsan", "asan"), built
    once into the cache from shim/sanitizer_python.cpp with python3-config's flags. Raises
    EmulatorError when it cannot be built."""
    import sysconfig
    source = os.path.join(SHIM_DIR, "sanitizer_python.cpp")
    include = sysconfig.get_path("include")
    libdir = sysconfig.get_config_var("LIBDIR")
    version = sysconfig.get_config_var("LDVERSION") or sysconfig.get_python_version()
    flags = [*SANITIZER_LINK_FLAGS[mode], "-g", "-rdynamic", f"-I{include}", source, f"-L{libdir}", f"-lpython{version}",
             "-ldl", "-lm", f"-Wl,-rpath,{libdir}"]
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(flags + [compiler_version()]).encode()).hexdigest()[:16]
    out = os.path.join(CACHE_DIR, f"python-{mode}-{key}")
    if not os.path.isfile(out):
        os.makedirs(CACHE_DIR, exist_ok=True)
        result = subprocess.run([CXX, *flags, "-o", out + ".tmp"], capture_output=True, text=True)
        if result.returncode != 0:
            raise EmulatorError(f"cannot build a {mode} python (needs libpython and the sanitizer runtime):\n"
                                f"{result.stderr[-3000:]}")
        os.replace(out + ".tmp", out)
    return out


def sanitizer_environment(mode):
    """Environment for a sanitizer run: the build mode for llmc.emulator.device, the
    sanitizer's options (stop at the first report, with exit code SANITIZER_EXIT_CODE), OpenBLAS
    on one thread, and on PYTHONPATH the repository and this interpreter's site-packages: the
    sanitizer python (sanitizer_python) is the base installation's interpreter and knows nothing
    of a virtual environment, where NumPy usually is (a stock Debian python3 has none of its own)."""
    import site
    path = [ROOT, *site.getsitepackages(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = dict(os.environ, LLMC_EMULATOR_MODE=mode, PYTHONPATH=os.pathsep.join(path))
    env["TSAN_OPTIONS"] = f"halt_on_error=1 exitcode={SANITIZER_EXIT_CODE} report_signal_unsafe=0"
    # NumPy's OpenBLAS (the emulated cuBLAS, the CPU references) synchronizes its worker threads in
    # uninstrumented code: ThreadSanitizer reports its larger sgemms as races. One thread: no such reports
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["ASAN_OPTIONS"] = f"detect_leaks=0 halt_on_error=1 exitcode={SANITIZER_EXIT_CODE}"
    env["UBSAN_OPTIONS"] = f"halt_on_error=1 print_stacktrace=1 exitcode={SANITIZER_EXIT_CODE}"
    return env


SANITIZER_EXIT_CODE = 66
