"""
llmc/cuda.py: the CuPy plumbing under gpt2_cuda.py (llm.c's llmc/cuda_common.h, cublas_common.h):
CuPy imported lazily, NVRTC options, each kernels/<file>.cu compiled once per process and
precision, the launch helper, the checks every launcher makes on its arguments, launch grids,
the cuBLAS GEMM (a library call, through nvmath-python's bindings where installed, because
CuPy's refuse a CUDA graph capture) and binding a process to its GPU.

With use_device("cpu") the same calls answer for the emulated CUDA device (llmc/emulator/): the
kernels compiled by g++ and run on the CPU, cuBLAS emulated with its exact contract.

CuPy has no bfloat16 dtype, so bf16 tensors live in CuPy as uint16 arrays holding the raw bit
patterns ("floatX" is uint16 in bf16 and float32 in fp32); only the kernels and cuBLAS see them as
__nv_bfloat16. Nothing here imports CuPy until it is called, so the host logic imports without it.
"""

import hashlib
import os
import re
import subprocess
import sys

import numpy as np

from llmc.launcher import launched_rank, launcher_environment
from llmc.utils import InputError

KERNELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
PRECISIONS = ("bf16", "fp32")
PRECISION_DEFINES = {"bf16": "-DENABLE_BF16", "fp32": "-DENABLE_FP32"}
FLOATX_DTYPES = {"bf16": np.dtype(np.uint16), "fp32": np.dtype(np.float32)}
FLOATX_PRECISION = {np.dtype(np.uint16): "bf16", np.dtype(np.float32): "fp32"}
VECTOR_BYTES = 16                      # kernels/common.cuh Packed128: one 128-bit load or store
CUDA_HEADER = "cuda_bf16.h"            # the one CUDA header the kernels include (via common.cuh)
CXX_STANDARD = "--std=c++17"           # `if constexpr` in common.cuh

WARP_SIZE = 32
BLOCK_SIZE = 256                       # elementwise and grid-stride kernels
WARP_ROW_BLOCK_SIZE = 256              # warp-per-row kernels (LayerNorm, softmax): 8 rows per block
MAX_THREADS_PER_BLOCK = 1024


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernels/*.cu file; the message names the file and carries NVRTC's log."""


def ceil_div(a, b):
    """Smallest integer >= a / b, for positive ints (grid sizes)."""
    return -(-a // b)


def vector_size(precision):
    """Elements per 16-byte vector (x128::size in kernels/common.cuh): 8 bf16 or 4 floats."""
    return VECTOR_BYTES // FLOATX_DTYPES[precision].itemsize


# ----------------------------------------------------------------------------
# CuPy, imported lazily

def cuda_unavailable_reason():
    """None if the device can run: CuPy imports and sees a CUDA device, or (device "cpu") a C++20
    compiler builds the emulated device's kernels; else a short reason (for the one-line exit)."""
    if _device == "cpu":
        from llmc.emulator import build
        try:
            build.compiler_version()
        except build.EmulatorError as e:
            return str(e)
        return None
    try:
        import cupy
    except Exception as e:                 # ImportError, or a CUDA library that fails to load
        return f"CuPy is not importable: {type(e).__name__}: {e}".splitlines()[0]
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:                 # no driver, driver too old, no device
        if not nvidia_driver_present():    # CUDA then says "driver version is insufficient", which misleads
            return "no NVIDIA driver on this machine"
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None if count > 0 else "the CUDA runtime reports 0 devices"


# What an installed NVIDIA kernel driver leaves behind: its proc entry and its control device.
NVIDIA_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl")


def nvidia_driver_present():
    """True if the NVIDIA kernel driver is loaded (NVIDIA_DRIVER_FILES). Without it the CUDA
    runtime reports cudaErrorInsufficientDriver, as if the driver were merely too old."""
    return any(os.path.exists(path) for path in NVIDIA_DRIVER_FILES)


# The pip names of the CUDA wheels, by CUDA major version (CUDA 13's wheels carry no -cu13 suffix).
CUDA_PIP_NAMES = {12: {"cupy": "cupy-cuda12x", "nvrtc": "nvidia-cuda-nvrtc-cu12", "runtime": "nvidia-cuda-runtime-cu12"},
                  13: {"cupy": "cupy-cuda13x", "nvrtc": "'nvidia-cuda-nvrtc==13.*'",
                       "runtime": "'nvidia-cuda-runtime==13.*'"}}


def pip_advice(*wheels):
    """'pip install ...' for the CUDA wheels named ("cupy", "nvrtc", "runtime") in the forms of the
    NVIDIA driver's CUDA major version, read from nvidia-smi's "CUDA Version: 13.0"; CUDA 12's
    where there is no driver (the CPU-only compile check) or the version is another."""
    try:
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        header = ""
    match = re.search(r"CUDA Version:\s*(\d+)\.", header)
    major = int(match.group(1)) if match and int(match.group(1)) in CUDA_PIP_NAMES else 12
    return "pip install " + " ".join(CUDA_PIP_NAMES[major][w] for w in wheels)


# ----------------------------------------------------------------------------
# the device: a real GPU through CuPy, or the emulated CUDA device (llmc/emulator/) on the CPU
#
# The one switch between the two. gpt2_cuda.py never asks which one runs: it gets its array
# module from cupy() and its vendor libraries from library(), and both answer for the device
# chosen once at start-up with use_device().

DEVICES = ("cuda", "cpu")              # "cpu": the kernels compiled as host C++ and emulated
_device = "cuda"

# vendor library -> (module on a GPU, module of the emulated device with the same calls)
VENDOR_LIBRARIES = {
    "cublas": ("cupy_backends.cuda.libs.cublas", "llmc.emulator.cublas"),
    "nvmath_cublas": ("nvmath.bindings.cublas", "llmc.emulator.nvmath_cublas"),
    "cublaslt": ("nvmath.bindings.cublasLt", "llmc.emulator.cublaslt"),
    "cudnn": ("cudnn", "llmc.emulator.cudnn"),
    "nccl": ("cupy.cuda.nccl", "llmc.emulator.nccl"),
}


def use_device(name):
    """Choose the device for this process: "cuda" (CuPy on a GPU, the default) or "cpu" (the
    emulated device). Raises ValueError for another name."""
    global _device
    if name not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {name!r}")
    _device = name


def device():
    """The device chosen by use_device(): "cuda" or "cpu"."""
    return _device


def cupy():
    """The array module of the device: cupy itself on a GPU (imported on first use), or the
    emulated device's module with the same calls (llmc.emulator.device) on the CPU."""
    if _device == "cpu":
        from llmc.emulator import device as emulated
        return emulated
    import cupy as cp
    return cp


def library(name):
    """The vendor library `name` ("cublas", "nvmath_cublas", "cublaslt", "cudnn", "nccl") of the device: the real
    Python module on a GPU, its emulation (same functions, same arguments, host addresses) on the
    CPU. Raises KeyError for an unknown name, ImportError where the module is missing."""
    import importlib
    return importlib.import_module(VENDOR_LIBRARIES[name][_device == "cpu"])


def address(arr):
    """The device address of a device array's first element (CuPy's arr.data.ptr; on the
    emulated device a host address)."""
    return arr.data.ptr


def choose_device(local_rank, device_count, visible=None):
    """The CUDA device index for a process of local rank `local_rank` that sees `device_count`
    devices (visible: $CUDA_VISIBLE_DEVICES, or None). Normally the local rank itself; device 0
    when the launcher gave each process one GPU of its own (CUDA_VISIBLE_DEVICES names exactly one,
    srun --gpus-per-task=1). Raises InputError where that device does not exist, rather than put
    two processes on one GPU."""
    one_each = device_count == 1 and visible is not None and len([d for d in visible.split(",") if d.strip()]) == 1
    if one_each:
        return 0
    if local_rank >= device_count:
        raise InputError(f"local rank {local_rank} needs GPU {local_rank} but this process sees {device_count} "
                         f"GPU(s): two processes would share one (start at most one process per GPU)")
    return local_rank


def select_device(comm):
    """Bind this process to its GPU: choose_device of its local rank (comm.local_rank from
    llmc.multinode: the launcher's local rank, or -pr % -pg; for a plain llmc.comm.Comm the
    launcher's, else the rank). Returns (device index, device name, compute capability as an int,
    e.g. 90). Raises InputError rather than put two processes on one GPU."""
    cp = cupy()
    local = getattr(comm, "local_rank", None)
    if local is None:
        launcher = launcher_environment()
        local = launcher[3] if launcher and launcher[3] is not None else comm.rank
    device = choose_device(local, cp.cuda.runtime.getDeviceCount(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    cp.cuda.Device(device).use()
    props = cp.cuda.runtime.getDeviceProperties(device)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return device, name, props["major"] * 10 + props["minor"]


# ----------------------------------------------------------------------------
# kernel modules: each kernels/<file>.cu compiled once per process per precision

_MODULES = {}      # (device, file, precision, build_variant()) -> cupy.RawModule, compiled
_FUNCTIONS = {}    # (device, file, precision, build_variant(), kernel name) -> cupy.RawKernel
_REPLACED = {}     # (file, kernel name) -> load(precision): a kernel launched in its place (replace_kernel)


def cuda_include_dirs():
    """Candidate directories for the CUDA headers, in order: the pip CUDA runtime
    (nvidia-cuda-runtime-cu12/13, via cuda.pathfinder where installed, else the `nvidia` namespace
    package), then $CUDA_PATH/include, $CUDA_HOME/include, /usr/local/cuda/include."""
    dirs = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
        if found:
            dirs.append(found)
    except Exception:                      # cuda.pathfinder missing or too old: look ourselves
        pass
    try:
        import nvidia
        dirs += [os.path.join(d, "cuda_runtime", "include") for d in getattr(nvidia, "__path__", [])]
    except ImportError:
        pass
    dirs += [os.path.join(root, "include") for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"),
                                                        "/usr/local/cuda") if root]
    return list(dict.fromkeys(dirs))       # unique, in order


def cuda_include_dir():
    """The first of cuda_include_dirs() that holds cuda_bf16.h. Raises KernelCompileError (saying
    where it looked and what to install) when none does."""
    candidates = cuda_include_dirs()
    for d in candidates:
        if os.path.isfile(os.path.join(d, CUDA_HEADER)):
            return d
    raise KernelCompileError(f"{CUDA_HEADER} not found (looked in {', '.join(candidates)}): "
                             + pip_advice("runtime"))


def common_header_digest():
    """First 16 hex digits of the SHA-256 of the headers every kernel file may include: each
    kernels/*.cuh (common.cuh, flash_attention.cuh, tensor_core.cuh), its name and its bytes, in
    name order."""
    digest = hashlib.sha256()
    for name in sorted(f for f in os.listdir(KERNELS_DIR) if f.endswith(".cuh")):
        with open(os.path.join(KERNELS_DIR, name), "rb") as f:
            digest.update(name.encode() + f.read())
    return digest.hexdigest()[:16]


def kernel_compile_options(precision):
    """NVRTC options for kernels/*.cu in `precision` ("bf16" or "fp32"), without -arch (CuPy adds
    it for the current device). The one source of these options: cupy.RawModule gets this tuple,
    and dev/cuda/nvrtc_compile.py imports this function, so the CI compile check compiles exactly
    what runs (and CuPy's on-disk cache serves both). C++17, the floatX define, the kernels
    directory (for common.cuh), the CUDA headers (cuda_bf16.h), and an unused macro holding
    the kernels' headers' digest, because CuPy keys its cache on the source text and the options,
    not on included headers: without it an edit of common.cuh or tensor_core.cuh would keep
    serving stale kernels.
    The emulated device (use_device("cpu")) gets no CUDA include directory: its shim stands in
    for cuda_bf16.h.
    Raises ValueError for an unknown precision, KernelCompileError without the CUDA headers."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, not {precision!r}")
    cuda_headers = () if _device == "cpu" else (f"-I{cuda_include_dir()}",)
    return (CXX_STANDARD, PRECISION_DEFINES[precision], f"-I{KERNELS_DIR}", *cuda_headers,
            f"-DCOMMON_CUH_DIGEST=sha256_{common_header_digest()}")


def build_variant():
    """What tells one compiled module of a kernel file from another besides the device and the
    precision: on the emulated device, whether its memory counters trace the launches
    (llmc/emulator/memory.py compiles traced builds while it traces); nothing on a GPU."""
    return _device == "cpu" and cupy().MEMORY_TRACE is not None


def new_module(file, precision):
    """kernels/<file>.cu as the device's RawModule for `precision`, not yet compiled."""
    path = os.path.join(KERNELS_DIR, f"{file}.cu")
    with open(path) as f:
        code = f.read()
    if _device == "cpu":                   # g++'s messages and gdb's breakpoints name the real file
        code = f'#line 1 "{path}"\n' + code
    return cupy().RawModule(code=code, options=kernel_compile_options(precision))


def compile_module(module, file, precision):
    """RawModule compiles lazily; do it here, once. Raises KernelCompileError naming the file,
    with the compiler's log."""
    cp = cupy()
    try:
        module.compile()
    except cp.cuda.compiler.CompileException as e:
        compiler = "g++ (the emulated device)" if _device == "cpu" else "NVRTC"
        raise KernelCompileError(f"{os.path.join(KERNELS_DIR, f'{file}.cu')}: {compiler} failed to compile it with "
                                 f"{PRECISION_DEFINES[precision]}:\n{e.get_message()}") from None


def load_module(file, precision):
    """kernels/<file>.cu compiled for `precision`, once per process and device (CuPy also caches
    the binary on disk, the emulated device its g++ build). Raises KernelCompileError naming the
    file, with the compiler's log."""
    key = (_device, file, precision, build_variant())
    if key not in _MODULES:
        module = new_module(file, precision)
        compile_module(module, file, precision)
        _MODULES[key] = module
    return _MODULES[key]


# A first build shows its progress: g++ takes tens of seconds per kernel file on the emulated device
# (it asks its cache first, so a built file shows nothing); on a GPU, NVRTC's time is only known by
# waiting, so its bar appears once the loads take longer than this (CuPy's disk cache answers in less)
PROGRESS_DELAY_S = 2.0


def load_modules(files, precision):
    """Compile (or fetch from the disk cache) every kernel file before training starts, so that
    a compile error surfaces at once and the first step's time does not include the compiler.
    A first build shows on stderr, where it is a terminal (rank 0's, under mpiexec), a bar over the
    files, each named as it compiles: at once on the emulated device when g++ has a file to
    build, after PROGRESS_DELAY_S on a GPU; counted lines instead where tqdm is not installed.
    (A log or a test's captured stderr gets nothing, as a cached run would.)"""
    pending = {file: new_module(file, precision) for file in dict.fromkeys(files)
               if (_device, file, precision) not in _MODULES}
    delay = None                                       # None: nothing shown
    if launched_rank() in (None, 0) and getattr(sys.stderr, "isatty", lambda: False)():
        if _device == "cuda":
            delay = PROGRESS_DELAY_S
        elif any(not module._is_built() for module in pending.values()):
            delay = 0.0
    progress = BuildProgress(len(pending), delay)
    for file, module in pending.items():
        progress.start(f"{file}.cu")
        compile_module(module, file, precision)
        _MODULES[(_device, file, precision)] = module
        progress.done()
    progress.close()


class BuildProgress:
    """The progress of compiling `total` kernel files on stderr: a tqdm bar shown after `delay`
    seconds (None: nothing shown), or, without tqdm, one counted line per file
    ("compiling kernels for the emulated device (g++, once): 3/9 layernorm.cu")."""

    def __init__(self, total, delay):
        self.total, self.count, self.bar, self.lines, self.delay = total, 0, None, False, delay
        if delay is None or total == 0:
            return
        what = "compiling kernels for the emulated device (g++, once)" if _device == "cpu" else "compiling kernels (NVRTC)"
        try:
            from tqdm import tqdm          # make train installs it; counted lines without it
        except ImportError:
            self.lines, self.what = delay == 0, what
            return
        self.bar = tqdm(total=total, desc=what, unit="file", delay=delay, file=sys.stderr, dynamic_ncols=True)

    def start(self, name):
        self.count += 1
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=self.delay == 0)   # a delayed bar shows at its next update
        elif self.lines:
            print(f"{self.what}: {self.count}/{self.total} {name}", file=sys.stderr, flush=True)

    def done(self):
        if self.bar is not None:
            self.bar.update(1)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def launch(file, precision, name, grid, block, args, shared_mem=0):
    """Launch kernel `name` of kernels/<file>.cu. grid: int or (x, y); block: threads; args: CuPy
    arrays and NumPy scalars typed exactly as the C signature (np.int32, np.float32, np.uint64,
    ...), since CuPy does not check them against it; shared_mem: bytes of dynamic shared memory
    (the kernel's `extern __shared__` array; at most 48 KiB without an opt-in)."""
    key = (_device, file, precision, build_variant(), name)
    if key not in _FUNCTIONS:
        load = _REPLACED.get((file, name))
        _FUNCTIONS[key] = load(precision) if load else load_module(file, precision).get_function(name)
    grid = grid if isinstance(grid, tuple) else (grid,)
    _FUNCTIONS[key](grid, (block,), args, shared_mem=shared_mem)


def replace_kernel(file, name, load):
    """From now on launch(file, ..., name, ...) runs load(precision), a compiled kernel with the same C
    signature, instead of `name` of kernels/<file>.cu, with the launcher's grid, block, arguments and
    shared memory (dev/bench.py --candidate: a dev/cuda candidate timed in the whole training step
    before it is adopted). load None: ours again."""
    if load is None:
        _REPLACED.pop((file, name), None)
    else:
        _REPLACED[(file, name)] = load
    for key in [key for key in _FUNCTIONS if key[1] == file and key[4] == name]:
        del _FUNCTIONS[key]                # loaded again, replaced or not, at the next launch


# ----------------------------------------------------------------------------
# launch grids and argument checks

def elementwise_grid(n, block_size=BLOCK_SIZE):
    """Blocks for a grid-stride kernel over n work items: one item per thread, at least 1 block."""
    return max(1, ceil_div(n, block_size))


def warp_row_grid(num_rows, block_size=WARP_ROW_BLOCK_SIZE):
    """Blocks for a warp-per-row kernel: block_size // 32 rows per block."""
    return max(1, ceil_div(num_rows, block_size // WARP_SIZE))


def precision_of(arr):
    """'bf16' or 'fp32' from a floatX array's dtype (uint16 bits or float32). Raises TypeError."""
    try:
        return FLOATX_PRECISION[np.dtype(arr.dtype)]
    except KeyError:
        raise TypeError(f"floatX arrays are uint16 (bf16 bits) or float32, not {arr.dtype}") from None


def check_array(arr, dtype, size, name, aligned=True):
    """Raise unless arr has `dtype`, is C-contiguous, holds exactly `size` elements and (for
    kernels with 16-byte vector loads) starts 16-byte aligned."""
    if np.dtype(arr.dtype) != np.dtype(dtype):
        raise TypeError(f"{name}: dtype {arr.dtype}, expected {np.dtype(dtype).name}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous")
    if arr.size != size:
        raise ValueError(f"{name}: has {arr.size} elements, expected {size}")
    if aligned and address(arr) % VECTOR_BYTES:
        raise ValueError(f"{name}: not {VECTOR_BYTES}-byte aligned (address {address(arr):#x})")


def require(condition, message):
    """Raise ValueError(message) unless condition holds."""
    if not condition:
        raise ValueError(message)


def check_launch(kernel, floatX, float32=(), int32=(), vector_dim=None, aligned=None, unaligned=()):
    """The checks every launcher makes, in one call. floatX, float32, int32: (name, array, size)
    for each argument of that type; the floatX arrays share one precision, which is returned.
    vector_dim: (name, value) of the dimension the kernel reads in 16-byte vectors, which must
    then be a multiple of the vector size. aligned (default: whether there is a vector_dim): every
    floatX array not named in `unaligned` must start 16-byte aligned, for the kernel's vector
    loads. Raises TypeError or ValueError naming the kernel and the argument."""
    precision = precision_of(floatX[0][1])
    X, vec = FLOATX_DTYPES[precision], vector_size(precision)
    if vector_dim is not None:
        require(vector_dim[1] % vec == 0, f"{kernel}: {vector_dim[0]}={vector_dim[1]} must be a multiple of {vec}")
    aligned = vector_dim is not None if aligned is None else aligned
    for name, arr, size in floatX:
        check_array(arr, X, size, f"{kernel}: {name}", aligned=aligned and name not in unaligned)
    for name, arr, size in float32:
        check_array(arr, np.float32, size, f"{kernel}: {name}", aligned=False)
    for name, arr, size in int32:
        check_array(arr, np.int32, size, f"{kernel}: {name}", aligned=False)
    return precision


# ----------------------------------------------------------------------------
# cuBLAS (library call) on raw pointers
#
# cuBLAS is column-major; our tensors are row-major. A row-major (R, K) matrix is, byte for byte,
# the column-major (K, R) matrix with leading dimension K: its transpose. So every row-major
# product out = X @ Y is computed as the column-major product out^T = Y^T X^T, where each ^T
# costs nothing (it is how cuBLAS reads our memory) and an explicit op T undoes a transpose.
# gpt2_cuda.py works out each call's transposes next to it.

# cuBLAS / CUDA library enums (cublas_api.h, library_types.h); tests/test_cuda.py checks them
# against CuPy's copies
CUBLAS_OP_N = 0                        # use the matrix as stored
CUBLAS_OP_T = 1                        # use its transpose
CUDA_R_32F = 0                         # cudaDataType_t: float
CUDA_R_16BF = 14                       # cudaDataType_t: __nv_bfloat16
CUBLAS_COMPUTE_32F = 68                # fp32 accumulation (bf16 inputs still use tensor cores)
CUBLAS_COMPUTE_32F_FAST_TF32 = 77      # fp32 inputs rounded to TF32 for tensor cores
CUBLAS_GEMM_DEFAULT = -1               # let cuBLAS pick the algorithm
CUBLAS_POINTER_MODE_HOST = 0           # alpha and beta are read from host memory
CUBLAS_DATA_TYPES = {"bf16": CUDA_R_16BF, "fp32": CUDA_R_32F}


def compute_type(precision, tf32):
    """cuBLAS's compute type: fp32 accumulation; with tf32 (-f 1), fp32 inputs rounded to TF32
    for the tensor cores (bf16 inputs use them anyway)."""
    return CUBLAS_COMPUTE_32F_FAST_TF32 if precision == "fp32" and tf32 else CUBLAS_COMPUTE_32F


# Two Python bindings reach the same cuBLAS, and they differ in the one thing --cuda-graph 1 needs:
# whether a GEMM may be issued while the stream captures a CUDA graph. cuBLAS allows it; CuPy's
# bindings do not (CupyCublas says why). One binding serves every GEMM of a process, eager and
# captured alike, so that a graph replays exactly the library calls of the eager run before it.

class CupyCublas:
    """cuBLAS through CuPy's bindings (cupy_backends.cuda.libs.cublas) on CuPy's handle for the
    device. Not capturable: CuPy 14 sets the handle's stream to the current one before every BLAS
    call (_setStream, cupy_backends/cuda/libs/cublas.pyx at v14.2.0, lines 666-668), and its
    setStream raises NotImplementedError('calling cuBLAS API during stream capture is currently
    unsupported') while that stream captures (lines 642-655; cupy/cupy#6290): the first GEMM of a
    capture would fail. `why_not`: why nvmath-python's bindings could not be used (one line)."""
    capturable = False

    def __init__(self, lib, why_not):
        self.lib, self.why_not = lib, why_not

    def handle(self):
        """CuPy's handle for the current device, in host pointer mode (set per call: CuPy's own
        linear algebra shares the handle)."""
        handle = cupy().cuda.device.get_cublas_handle()
        self.lib.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        return handle

    def gemm_ex(self, *args):
        """cublasGemmEx on the current stream; args as cuBLAS's after the handle."""
        self.lib.gemmEx(self.handle(), *args)

    def gemm_strided_batched_ex(self, *args):
        """cublasGemmStridedBatchedEx on the current stream; args as cuBLAS's after the handle."""
        self.lib.gemmStridedBatchedEx(self.handle(), *args)


class NvmathCublas:
    """cuBLAS through nvmath-python's bindings (nvmath.bindings.cublas: thin wrappers of the C
    API, which check nothing of CuPy's kind) on a cuBLAS handle of our own. Capturable: a handle
    keeps the stream it was last given, so cublasSetStream runs only when the current stream
    changes, which is never inside a capture (gpt2_micro_batch runs each micro-batch once eagerly
    on the stream before capturing it); inside one the GEMMs are only recorded into the graph.
    Raises RuntimeError for a GEMM captured on a stream the handle was not set to before the
    capture (it would run on the handle's old stream, outside the graph)."""
    capturable = True
    why_not = None

    def __init__(self, lib):
        self.lib = lib
        self.handle = lib.create()
        lib.set_pointer_mode(self.handle, CUBLAS_POINTER_MODE_HOST)
        self.stream = None                 # the cudaStream_t the handle is set to (None: its default)

    def use_current_stream(self):
        """Set the handle to the current stream if it is on another one (never during a capture)."""
        stream = cupy().cuda.get_current_stream()
        if stream.ptr != self.stream:
            if stream.is_capturing():
                raise RuntimeError("gemm: the cuBLAS handle is set to another stream than the capturing one, "
                                   "and is not set during a capture: run the work once eagerly on this stream first")
            self.lib.set_stream(self.handle, stream.ptr)
            self.stream = stream.ptr

    def gemm_ex(self, *args):
        """cublasGemmEx on the current stream; args as cuBLAS's after the handle."""
        self.use_current_stream()
        self.lib.gemm_ex(self.handle, *args)

    def gemm_strided_batched_ex(self, *args):
        """cublasGemmStridedBatchedEx on the current stream; args as cuBLAS's after the handle."""
        self.use_current_stream()
        self.lib.gemm_strided_batched_ex(self.handle, *args)


_CUBLAS = {}       # device -> the NvmathCublas or CupyCublas every gemm of this process uses


def cublas_bindings():
    """The cuBLAS bindings of this process's GEMMs, chosen at the first call per device (after
    select_device: a cuBLAS handle belongs to the current GPU): nvmath-python's where they import
    and create a handle, else CuPy's, which cannot be captured into a CUDA graph."""
    if _device not in _CUBLAS:
        try:
            _CUBLAS[_device] = NvmathCublas(library("nvmath_cublas"))
        except Exception as e:             # not installed, or its cuBLAS or the driver fails to load
            why_not = f"{type(e).__name__}: {e}".splitlines()[0]
            _CUBLAS[_device] = CupyCublas(library("cublas"), why_not)
    return _CUBLAS[_device]


def cuda_graph_unavailable_reason():
    """None if a GEMM can be captured into a CUDA graph (--cuda-graph 1), else one line saying why
    not and what to do."""
    bindings = cublas_bindings()
    if bindings.capturable:
        return None
    return (f"CUDA graphs need nvmath-python's cuBLAS bindings, since CuPy's refuse cuBLAS calls while a stream "
            f"captures, and they are unavailable ({bindings.why_not}): install nvmath-python, or use --cuda-graph 0")


def gemm(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, accumulate=False,
         batch=1, stride_a=0, stride_b=0, stride_c=0, tf32=False, alpha=1.0):
    """Library call: C (m,n) = alpha op(A) (m,k) @ op(B) (k,n) [+ C], column-major, one or `batch`
    strided products. A, B, C are floatX CuPy arrays whose first elements start the matrices; all
    three have the same precision; fp32 accumulation (compute_type: TF32 inputs when tf32 is
    set in fp32 mode). alpha (1 unless given: LoRA's scale), beta = 1 if accumulate else 0, both
    host floats (pointer mode host). Issued on the current stream through cublas_bindings(), so
    that it can be captured into a CUDA graph where nvmath-python is installed."""
    precision = precision_of(C)
    for arr, name in ((A, "A"), (B, "B")):
        if precision_of(arr) != precision:
            raise TypeError(f"gemm: {name} is {arr.dtype} but C is {C.dtype}")
    data_type = CUBLAS_DATA_TYPES[precision]
    compute = compute_type(precision, tf32)
    alpha = np.full(1, alpha, np.float32)
    beta = np.full(1, 1.0 if accumulate else 0.0, np.float32)
    cublas = cublas_bindings()
    if batch == 1:
        cublas.gemm_ex(transa, transb, m, n, k, alpha.ctypes.data,
                       A.data.ptr, data_type, lda, B.data.ptr, data_type, ldb,
                       beta.ctypes.data, C.data.ptr, data_type, ldc, compute, CUBLAS_GEMM_DEFAULT)
    else:
        cublas.gemm_strided_batched_ex(transa, transb, m, n, k, alpha.ctypes.data,
                                       A.data.ptr, data_type, lda, stride_a, B.data.ptr, data_type, ldb, stride_b,
                                       beta.ctypes.data, C.data.ptr, data_type, ldc, stride_c,
                                       batch, compute, CUBLAS_GEMM_DEFAULT)
