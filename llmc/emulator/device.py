"""llmc/emulator/device.py: the emulated CUDA device's array module, the subset of CuPy that
gpt2_cuda.py and llmc/ call, with device memory as host memory.

What it is: llmc.cuda.cupy() returns this module when the device is "cpu". Arrays are NumPy
arrays (a subclass, `ndarray`) with CuPy's device-side surface: .data.ptr (a host address),
.get() / .set(); allocations start 256-byte aligned as CuPy's pool does, and empty() fills its
memory with 0xff bytes (NaN in fp32 and bf16), so a kernel that reads memory it never wrote shows
NaN instead of a lucky zero. RawModule compiles a kernel source with g++ through
llmc.emulator.build and its functions launch with CuPy's (grid, block, args). There is one
stream; work runs when it is issued, except while a stream is capturing: then kernel launches,
cp.add and the emulated vendor-library calls are recorded (enqueue) and a Graph replays them.
Streams are known by their cudaStream_t (.ptr, stream_at), which the vendor libraries take;
work on the legacy stream while a blocking stream captures is CUDA's error, as on a GPU.

What it is not: CuPy. No asynchrony, no second device, no unified-memory semantics; only the
calls listed below. Each public name is CuPy's, at CuPy's place (cp.cuda.Stream, not cp.Stream),
with a signature that accepts no call CuPy refuses, except the emulator's own machinery named in
EMULATOR_OWN (tests/test_cupy_conformance.py checks both against the CuPy installed).

    python -c "from llmc.emulator import device as cp; print(cp.zeros(3).data.ptr % 256)"   # 0
"""

import os
import re
import types
import weakref

import numpy as np
# the NumPy names CuPy re-exports (cupy.float32 is numpy.float32), so that a CuPy user's cp.float32 works
from numpy import bool_, dtype, float16, float32, float64, int8, int16, int32, int64, uint8, uint16, uint32, uint64

from llmc.emulator import build

ALLOCATION_ALIGNMENT = 256             # bytes, as CuPy's memory pool
UNINITIALIZED_BYTE = 0xFF              # what empty() leaves: NaN in fp32 and bf16
MAX_DYNAMIC_SHARED_BYTES = 49152       # per block: CUDA's limit without cudaFuncSetAttribute's opt-in
MAX_DYNAMIC_SHARED_OPTIN_BYTES = 166912    # per block with the opt-in on compute capability 8.0 (163 KiB)
EMULATED_COMPUTE_CAPABILITY = (8, 0)   # as an A100: bf16, mma.sync, ldmatrix, cp.async (shim/tensor_cores.h)
DEVICE_NAME = "emulated CUDA device (CPU)"
# The sanitizer runs (dev/sanitize_kernels.py) set these: RawModule builds in that mode ("tsan",
# "asan"), and allocations end exactly where the array does (16-byte aligned, as malloc gives),
# so that a write past the end lands in AddressSanitizer's redzone instead of alignment slack
BUILD_MODE = os.environ.get("LLMC_EMULATOR_MODE", "fibers")
EXACT_ALLOCATIONS = BUILD_MODE == "asan"

# The emulator's own machinery and settings, which CuPy does not have (tests/test_cupy_conformance.py
# checks that every other public name here is CuPy's, at the same place, and that none of these is)
EMULATOR_OWN = ("EMULATOR_OWN", "ALLOCATION_ALIGNMENT", "UNINITIALIZED_BYTE", "MAX_DYNAMIC_SHARED_BYTES",
                "MAX_DYNAMIC_SHARED_OPTIN_BYTES",
                "EMULATED_COMPUTE_CAPABILITY", "DEVICE_NAME", "BUILD_MODE", "EXACT_ALLOCATIONS", "COMPARISONS",
                "EMULATED_DEVICE_COUNT", "CUDA_ERRORS", "DYNAMIC_SHARED_PATTERN", "static_dynamic_shared",
                "enqueue", "refuse_while_capturing", "refuse_transfer_while_capturing", "stream_at",
                "stream_is_capturing", "CUBLAS_PRODUCTS", "CUBLAS_KINDS", "ALLOCATIONS", "MEMORY_TRACE",
                "CUBLAS_CAPTURE_UNSUPPORTED", "set_cublas_stream", "cublas_stream")


# ----------------------------------------------------------------------------
# arrays

class MemoryPointer:
    """cupy.cuda.MemoryPointer(mem, offset), CuPy's arr.data: .ptr is mem.ptr + offset, the address
    of the array's first element (here a host address)."""

    def __init__(self, mem, offset):
        self.mem = mem
        self.ptr = mem.ptr + offset


class ndarray(np.ndarray):
    """A NumPy array standing for a CuPy array on the emulated device. Views stay ndarray.

    It keeps CuPy's border between host and device (cupy/_core/core.pyx: __array_ufunc__,
    __array_function__, fill; cupy.copyto), so that code that would fail on a GPU fails here:
      - a host numpy.ndarray as an operand of a ufunc or operator (dev + host, np.exp(host) into a
        device out=) is a TypeError: CuPy does not copy host arrays to the device implicitly. A
        0-d host array compared with a device array is allowed (CuPy takes its .item());
      - a NumPy function on device arrays runs only where CuPy has the function of that name (found
        in the CuPy installed, when one imports; np.triu -> cupy.triu), else TypeError, as NumPy
        raises when CuPy's __array_function__ declines; a host array of more than one element
        among its arguments is a ValueError (cupy.copyto's rule; CuPy's other functions refuse
        them too);
      - ufunc methods other than a call or a reduction (np.add.at, np.multiply.outer) are a
        TypeError: CuPy's __array_ufunc__ takes only calls (its arrays have scatter_add instead);
      - `dev[...] = host` with more than one element is a ValueError, as CuPy's fill;
      - a reduction to one value (dev.sum(), dev.max()) is a 0-d device array, not a NumPy
        scalar: float() and .item() read it, as on a GPU;
      - reading to the host (.get(), float(), int(), bool(), .item(), .tolist()) or .set() while
        the stream captures is CuPy 14's RuntimeError (refuse_transfer_while_capturing), and a
        synchronize then is CUDA's error (refuse_while_capturing);
      - a product that CuPy computes with cuBLAS (dev @ dev, np.matmul, np.dot, np.vdot, np.inner,
        np.tensordot on floating or complex operands) while the stream captures raises CuPy's
        NotImplementedError (set_cublas_stream, which llmc/emulator/cublas.py's setStream is).
    What it cannot refuse: np.asarray(dev) and np.array(dev), which CuPy refuses through
    __array__ (NumPy never asks an ndarray subclass for that), and a NumPy reduction called as a
    ufunc method, np.add.reduce(dev) (dev.sum() reaches __array_ufunc__ the same way)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method not in ("__call__", "reduce", "accumulate"):
            raise TypeError(f"numpy.{ufunc.__name__}.{method} on a device array: CuPy's arrays take ufunc calls "
                            f"and reductions only (use cupyx.scatter_add for add.at)")
        outputs = kwargs.get("out") or ()
        for x in _host_arrays(inputs + tuple(outputs)):
            if not (x.ndim == 0 and ufunc.__name__ in COMPARISONS):
                raise TypeError(f"numpy.{ufunc.__name__}: a host numpy.ndarray {x.shape} among device operands; "
                                f"CuPy does not copy to the device implicitly (cp.asarray it first)")
        if method == "__call__":
            _cupy_cublas_call(ufunc.__name__, inputs)
        inputs = tuple(_host_view(x) for x in inputs)
        if outputs:
            kwargs["out"] = tuple(_host_view(x) for x in outputs)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        if outputs:
            return outputs[0] if len(outputs) == 1 else tuple(outputs)
        if isinstance(result, tuple):
            return tuple(_on_device(r) for r in result)
        return _on_device(result)

    def __array_function__(self, func, types, args, kwargs):
        name = f"{func.__module__}.{func.__name__}"
        if not _cupy_has(func):
            raise TypeError(f"{name} on a device array: CuPy has no such function (cupy.{name[6:]})")
        for x in _host_arrays(tuple(args) + tuple(kwargs.values())):
            if x.size != 1:
                raise ValueError(f"{name}: a host numpy.ndarray {x.shape} among device arguments; CuPy does not "
                                 f"copy to the device implicitly (cp.asarray it first)")
        if func.__module__ == "numpy":
            _cupy_cublas_call(func.__name__, args)
        # NumPy's own code on plain views (CuPy runs its function of the same name: NumPy's helper
        # calls inside it, np.triu's np.where on a host mask, are not ours to check)
        result = func._implementation(*_host_views(args), **dict(zip(kwargs, _host_views(kwargs.values()))))
        if isinstance(result, tuple):
            return tuple(_on_device(r) for r in result)
        return _on_device(result)

    @property
    def data(self):
        return cuda.MemoryPointer(types.SimpleNamespace(ptr=self.__array_interface__["data"][0]), 0)

    def fill(self, value):
        """An elementwise kernel in CuPy, so it is recorded while a stream captures. A host
        array of more than one element is a ValueError, as CuPy's."""
        if isinstance(value, np.ndarray) and not isinstance(value, ndarray) and value.size != 1:
            raise ValueError(f"fill: a host numpy.ndarray {value.shape}; CuPy fills with a scalar only")
        enqueue(lambda: np.ndarray.fill(self, value))

    def __setitem__(self, index, value):
        """Assignment into a device array is a CuPy kernel too: recorded while capturing. The
        value is a scalar or a device array: CuPy fills with a host array's one element and
        refuses a larger one (ValueError)."""
        if isinstance(value, np.ndarray) and not isinstance(value, ndarray) and value.size != 1:
            raise ValueError(f"dev[...] = a host numpy.ndarray {value.shape}: CuPy does not copy it implicitly "
                             f"(cp.asarray it, or .set() a whole array)")
        enqueue(lambda: np.ndarray.__setitem__(self, index, value))

    def get(self, stream=None, order="C", out=None, blocking=True):
        """A host (NumPy) copy, as cupy.ndarray.get(). While `stream` (default: the current one)
        captures, CuPy 14 refuses the copy itself (RuntimeError, refuse_transfer_while_capturing):
        it would wait for work that the capture has not run. blocking=False queues the copy on the
        stream on a GPU (into `out`, pinned memory); here the stream's work is done when issued, so
        it is the same copy. Only order "C" (NotImplementedError otherwise, as _allocate)."""
        refuse_transfer_while_capturing("D2H", stream)
        if order != "C":
            raise NotImplementedError(f"get(order={order!r}): the emulated device copies row-major (order 'C') only")
        host = np.array(self.view(np.ndarray), copy=True)
        if out is not None:
            out[...] = host
            return out
        return host

    def __float__(self):
        """float(dev): cupy reads the value with .get(), a synchronizing copy."""
        return float(self.get())

    def __int__(self):
        """int(dev): read with .get(), as cupy's (refused while a stream captures)."""
        return int(self.get())

    def __bool__(self):
        """bool(dev): read with .get(), as cupy's (refused while a stream captures)."""
        return bool(self.get())

    def item(self):
        """The one element as a Python scalar, read with .get() (refused while a stream captures).
        CuPy's item() takes no index."""
        return self.get().item()

    def tolist(self):
        """The values as nested Python lists, read with .get() (refused while a stream captures)."""
        return self.get().tolist()

    def set(self, arr, stream=None):
        """Copy the host array `arr` in, as cupy.ndarray.set(): same shape and dtype, and `self`
        C-contiguous. Raises TypeError / ValueError otherwise. CuPy issues the copy on `stream`
        (default: the current one) and refuses it while that stream captures a CUDA graph
        (RuntimeError, refuse_transfer_while_capturing), as here: upload before the capture."""
        refuse_transfer_while_capturing("H2D", stream)
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError(f"set: expected a host numpy.ndarray, got {type(arr).__name__}")
        if self.shape != arr.shape:
            raise ValueError(f"set: shape mismatch {arr.shape} -> {self.shape}")
        if self.dtype != arr.dtype:
            raise TypeError(f"set: dtype mismatch {arr.dtype} -> {self.dtype}")
        if not self.flags.c_contiguous:
            raise RuntimeError("set: cannot copy into a non-contiguous array")
        np.copyto(self.view(np.ndarray), arr)

    # NumPy's, not CuPy's: an AttributeError here as on a GPU
    ctypes = property(lambda self: _not_cupys("ctypes"))
    getfield = property(lambda self: _not_cupys("getfield"))
    resize = property(lambda self: _not_cupys("resize"))
    setfield = property(lambda self: _not_cupys("setfield"))
    setflags = property(lambda self: _not_cupys("setflags"))
    to_device = property(lambda self: _not_cupys("to_device"))


def _not_cupys(name):
    raise AttributeError(f"'ndarray' object has no attribute '{name}' (numpy.ndarray has it, cupy.ndarray does not)")


# comparisons, where CuPy's __array_ufunc__ reads a 0-d host operand as a scalar (numpy#12142)
COMPARISONS = ("greater", "greater_equal", "less", "less_equal", "equal", "not_equal")

# CuPy's products that call cuBLAS for floating and complex operands (cupy/_core/_routines_linalg.pyx
# at v14.2.0: matmul, and dot and tensordot_core under cupy/linalg/_product.py's dot, vdot, inner,
# tensordot); integer products are CuPy's own kernels, and a product with a 0-d or empty operand
# calls no library (a multiply, or a fill with zeros)
CUBLAS_PRODUCTS = ("matmul", "dot", "vdot", "inner", "tensordot")
CUBLAS_KINDS = "fc"


def _cupy_cublas_call(name, operands):
    """What CuPy's product `name` does first on device operands when it calls cuBLAS: set its
    handle to the current stream, which CuPy 14 refuses while the stream captures
    (NotImplementedError, set_cublas_stream). Other names and operands: nothing."""
    arrays = [x for x in operands if isinstance(x, np.ndarray)]
    if (name in CUBLAS_PRODUCTS and arrays and all(x.ndim and x.size for x in arrays)
            and np.result_type(*arrays).kind in CUBLAS_KINDS):
        set_cublas_stream(cuda.device.get_cublas_handle(), cuda.Stream._current.ptr)


def _host_arrays(values):
    """The host arrays (plain numpy.ndarray, not device ones) among `values` and the lists and
    tuples in them."""
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _host_arrays(v)
        elif isinstance(v, np.ndarray) and not isinstance(v, ndarray):
            yield v


def _host_view(x):
    """A device array as a plain NumPy view of the same memory (anything else as it is)."""
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _host_views(values):
    """`values` (a sequence) with every device array in it, and in its lists and tuples, as a
    plain NumPy view of the same memory."""
    return [type(v)(_host_views(v)) if isinstance(v, (list, tuple)) else _host_view(v) for v in values]


def _on_device(value):
    """A ufunc's result as CuPy gives it: arrays and scalars alike are device arrays."""
    if isinstance(value, np.ndarray):
        return value.view(ndarray)
    if isinstance(value, np.generic):
        out = _allocate((), value.dtype, 0)
        out.view(np.ndarray)[()] = value
        return out
    return value


_CUPY = []                             # [module or None]: the installed CuPy, imported once


def _cupy_has(func):
    """Whether CuPy has NumPy's function `func` under the same module path (numpy.linalg.norm ->
    cupy.linalg.norm), as CuPy's __array_function__ looks it up. True where no CuPy imports: then
    the emulator cannot tell, and lets NumPy run it."""
    if not _CUPY:
        try:
            import cupy
        except Exception:              # no CuPy here, or one that cannot load: nothing to compare with
            cupy = None
        _CUPY.append(cupy)
    module = _CUPY[0]
    if module is None:
        return True
    try:
        for part in func.__module__.split(".")[1:]:
            module = getattr(module, part)
        return getattr(module, func.__name__) is not func
    except AttributeError:
        return False


class MemoryPool:
    """get_default_memory_pool(): the bytes held by live arrays of this device."""

    def __init__(self):
        self.used = 0

    def used_bytes(self):
        return self.used

    def total_bytes(self):
        return self.used

    def free_all_blocks(self):
        pass

    def _release(self, nbytes):
        self.used -= nbytes


_POOL = MemoryPool()
# every live allocation: its first byte's address -> its size in bytes (the memory counters,
# llmc/emulator/memory.py, count an access as global when it falls inside one)
ALLOCATIONS = {}
# the memory counters' recorder while llmc.emulator.memory traces (None otherwise): kernel modules
# compiled then are traced builds, and their launches go through MEMORY_TRACE.launch
MEMORY_TRACE = None


def get_default_memory_pool():
    return _POOL


def get_default_pinned_memory_pool():
    return _POOL


def _allocate(shape, dtype, fill_byte, order="C"):
    """A device array of `shape`, `dtype` whose first byte is ALLOCATION_ALIGNMENT-aligned. Only
    row-major (order "C") arrays: NotImplementedError for another order, rather than a wrong layout."""
    if order != "C":
        raise NotImplementedError(f"order={order!r}: the emulated device allocates row-major (order 'C') arrays only")
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if EXACT_ALLOCATIONS:              # AddressSanitizer: the byte after the array is malloc's redzone
        raw = np.empty(nbytes, dtype=np.uint8)
        offset = 0
    else:
        raw = np.empty(nbytes + ALLOCATION_ALIGNMENT, dtype=np.uint8)
        offset = (-raw.ctypes.data) % ALLOCATION_ALIGNMENT
    buffer = raw[offset:offset + nbytes]
    buffer.fill(fill_byte)
    _POOL.used += nbytes
    weakref.finalize(raw, _POOL._release, nbytes)
    address = raw.ctypes.data + offset
    ALLOCATIONS[address] = nbytes
    weakref.finalize(raw, ALLOCATIONS.pop, address, None)
    return buffer.view(dtype).reshape(shape).view(ndarray)


def empty(shape, dtype=float, order="C"):
    """Uninitialized device memory: every byte 0xff (NaN in fp32 and bf16). The default dtype is
    float64, as CuPy's (and NumPy's)."""
    return _allocate(shape, dtype, UNINITIALIZED_BYTE, order)


def zeros(shape, dtype=float, order="C"):
    return _allocate(shape, dtype, 0, order)


def ones(shape, dtype=float, order="C"):
    out = _allocate(shape, dtype, 0, order)
    out.view(np.ndarray)[...] = 1
    return out


def full(shape, fill_value, dtype=None, order="C"):
    """CuPy's (and NumPy's) default dtype is fill_value's: float64 for a Python float."""
    out = _allocate(shape, np.array(fill_value).dtype if dtype is None else dtype, 0, order)
    out.view(np.ndarray)[...] = fill_value
    return out


def zeros_like(a, dtype=None):
    return zeros(a.shape, a.dtype if dtype is None else dtype)


def empty_like(prototype, dtype=None):
    return empty(prototype.shape, prototype.dtype if dtype is None else dtype)


def ones_like(a, dtype=None):
    return ones(a.shape, a.dtype if dtype is None else dtype)


def full_like(a, fill_value, dtype=None):
    return full(a.shape, fill_value, a.dtype if dtype is None else dtype)


def asarray(a, dtype=None):
    """A device copy of a host array (or `a` itself if it is already a device array of `dtype`).
    From the host while the current stream captures: CuPy 14's RuntimeError, as ndarray.set."""
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    if not isinstance(a, ndarray):
        refuse_transfer_while_capturing("H2D")
    host = np.asarray(a, dtype=dtype)
    out = _allocate(host.shape, host.dtype, 0)
    np.copyto(out.view(np.ndarray), host)
    return out


def array(obj, dtype=None):
    """A device copy of `obj` (a host array, a list or a device array), as cupy.array: from a
    device array a new allocation and a device-to-device copy (an elementwise kernel in CuPy,
    recorded while the stream captures), from the host an upload (refused while it captures)."""
    if isinstance(obj, ndarray):
        out = _allocate(obj.shape, obj.dtype if dtype is None else dtype, UNINITIALIZED_BYTE)
        enqueue(lambda: np.copyto(out.view(np.ndarray), obj.view(np.ndarray), casting="unsafe"))
        return out
    return asarray(np.array(obj, dtype=dtype))


def asnumpy(a, stream=None):
    """A host copy of a device array (a host array is returned as it is, as cupy.asnumpy)."""
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def arange(start, stop=None, step=1, dtype=None):
    return asarray(np.arange(start, stop, step, dtype=dtype))


def add(x1, x2, /, out=None):
    """cupy.add: an elementwise kernel, so it is recorded while a stream captures."""
    if out is None:
        out = empty(np.broadcast_shapes(np.shape(x1), np.shape(x2)), np.result_type(x1, x2))
    enqueue(lambda: np.add(x1, x2, out=out))
    return out


# ----------------------------------------------------------------------------
# streams, capture and graphs

class Stream:
    """A CUDA stream. Work runs when issued; while capturing, enqueue() records it instead.
    .ptr is its cudaStream_t (0 for the legacy stream), which stream_at() maps back to it."""

    null = None
    _current = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0 if null else id(self)
        self.non_blocking = non_blocking
        self._captured = None
        _STREAMS[self.ptr] = self

    def use(self):
        cuda.Stream._current = self
        return self

    def synchronize(self):
        refuse_while_capturing("synchronizing the capturing stream", self)

    def record(self, event=None):
        """cupy.cuda.Stream.record: an Event marking the work issued so far on this stream (done
        already: work runs when issued). Returns the event."""
        event = cuda.Event() if event is None else event
        event.record(self)
        return event

    def begin_capture(self, mode=None):
        if self._captured is not None:
            raise RuntimeError("begin_capture: this stream is already capturing")
        if self.ptr == 0:
            raise RuntimeError("begin_capture: the legacy (null) stream cannot capture")
        self._captured = []

    def is_capturing(self):
        return self._captured is not None

    def end_capture(self):
        if self._captured is None:
            raise RuntimeError("end_capture: this stream is not capturing")
        graph, self._captured = cuda.Graph(self._captured), None
        return graph

    def __enter__(self):
        self._previous = cuda.Stream._current
        return self.use()

    def __exit__(self, *exc):
        cuda.Stream._current = self._previous


_STREAMS = weakref.WeakValueDictionary()          # cudaStream_t -> the live Stream
Stream.null = Stream(null=True)
Stream._current = Stream.null


def stream_at(ptr):
    """The live Stream whose cudaStream_t is ptr (0: the legacy stream). Raises CUDARuntimeError
    for another value, as CUDA does for a destroyed or foreign stream."""
    stream = _STREAMS.get(ptr)
    if stream is None:
        raise _cuda_error(400, f"no live stream {ptr:#x}")
    return stream


def _blocking_capture():
    """Whether a created stream without non_blocking is capturing: the legacy stream then may
    not be used (it synchronizes implicitly with every blocking stream)."""
    return any(s._captured is not None and not s.non_blocking for s in list(_STREAMS.values()))


def stream_is_capturing(stream):
    """cudaStreamIsCapturing (CuPy's runtime.streamIsCapturing): whether the stream ptr is
    capturing (stream: a cudaStream_t, as CuPy's parameter is named). Asked of the legacy stream while a blocking stream captures, CUDA answers
    cudaErrorStreamCaptureImplicit (CUDARuntimeError here)."""
    stream = stream_at(stream)
    if stream.ptr == 0 and _blocking_capture():
        raise _cuda_error(906, "the legacy stream asked while a blocking stream captures")
    return stream._captured is not None


class Graph:
    """A captured CUDA graph: the recorded work, replayed in order by launch()."""

    def __init__(self, work):
        self.work = work

    def launch(self, stream=None):
        for fn in self.work:
            fn()

    def upload(self, stream=None):
        pass


def get_current_stream():
    return cuda.Stream._current


def refuse_while_capturing(what, stream=None):
    """CUDA's rule: while a stream captures, nothing may wait for device work (a synchronize, a
    copy to host memory): the captured work has not run, so CUDA refuses and invalidates the
    capture. The emulated device refuses the same way (on it, a read would give stale values).
    stream: the stream waited for (default: the current one). Raises CUDARuntimeError."""
    if (stream or cuda.Stream._current)._captured is not None:
        raise _cuda_error(900, f"{what} while the stream is capturing")


def refuse_transfer_while_capturing(direction, stream=None):
    """CuPy 14's own check before a copy between host and device (cupy/cuda/memory.pyx v14.2.0,
    copy_to_host_async and copy_from_host_async, which ndarray.get and ndarray.set call): while
    the stream (default: the current one) captures, a RuntimeError, before CUDA is asked.
    direction: "D2H" or "H2D", as CuPy's message says."""
    if (stream or cuda.Stream._current)._captured is not None:
        raise RuntimeError(f"the current stream is capturing, so {direction} transfers are disallowed")


def enqueue(fn, stream=None):
    """Issue the device work `fn` (a function of no arguments) on `stream` (default: the current
    one): run it now, or record it while that stream captures. Every emulated device operation
    goes through here. Work on the legacy stream while a blocking stream captures is CUDA's
    cudaErrorStreamCaptureImplicit (CUDARuntimeError)."""
    stream = cuda.Stream._current if stream is None else stream
    if stream._captured is not None:
        stream._captured.append(fn)
        return
    if stream.ptr == 0 and _blocking_capture():
        raise _cuda_error(906, "work issued on the legacy stream while a blocking stream captures")
    fn()


class Event:
    """cupy.cuda.Event: record() notes the host time; elapsed time between two, in ms."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.time = None

    def record(self, stream=None):
        import time
        self.time = time.perf_counter()

    def synchronize(self):
        pass


def get_elapsed_time(start_event, end_event):
    return (end_event.time - start_event.time) * 1e3


# ----------------------------------------------------------------------------
# the runtime: one device

# the CUDA errors the emulated device raises: status -> (name, CUDA's description), cuda_runtime_api.h
CUDA_ERRORS = {1: ("cudaErrorInvalidValue", "invalid argument"),
               101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
               400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
               900: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
               906: ("cudaErrorStreamCaptureImplicit",
                     "operation would make the legacy stream depend on a capturing blocking stream")}


class CUDARuntimeError(RuntimeError):
    """cupy.cuda.runtime.CUDARuntimeError(status): "name: description" of a CUDA error status (one
    of CUDA_ERRORS); the emulator adds what it refused as a note (shown in the traceback)."""

    def __init__(self, status):
        self.status = status
        name, description = CUDA_ERRORS[status]
        super().__init__(f"{name}: {description}")


def _cuda_error(status, what):
    """CUDARuntimeError(status) with `what` as its note, and in its message after CUDA's text."""
    error = cuda.runtime.CUDARuntimeError(status)
    error.args = (f"{error.args[0]} ({what})",)
    return error


def _host_memory():
    """(free, total) bytes of host memory: the emulated device's memory."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemFree"]), info["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def _device_properties(device):
    _check_device(device)
    major, minor = EMULATED_COMPUTE_CAPABILITY
    return {"name": DEVICE_NAME.encode(), "major": major, "minor": minor, "totalGlobalMem": _host_memory()[1],
            "multiProcessorCount": os.cpu_count() or 1, "warpSize": 32, "maxThreadsPerBlock": 1024,
            "sharedMemPerBlock": MAX_DYNAMIC_SHARED_BYTES, "sharedMemPerBlockOptin": MAX_DYNAMIC_SHARED_OPTIN_BYTES}


# as many emulated GPUs as one node of llm.c's recipes has, so that a data-parallel run of up to 8
# processes gives each process a device of its own (they all share the host's memory and cores)
EMULATED_DEVICE_COUNT = 8


def _check_device(index):
    if not 0 <= index < EMULATED_DEVICE_COUNT:
        raise _cuda_error(101, f"the emulated node has devices 0..{EMULATED_DEVICE_COUNT - 1}, not {index}")


runtime = types.SimpleNamespace(
    getDeviceCount=lambda: EMULATED_DEVICE_COUNT,
    getDeviceProperties=_device_properties,
    memGetInfo=_host_memory,
    deviceSynchronize=lambda: refuse_while_capturing("cudaDeviceSynchronize"),
    streamIsCapturing=stream_is_capturing,
    getDevice=lambda: cuda.Device._current,
    CUDARuntimeError=CUDARuntimeError,
)


class Device:
    """cupy.cuda.Device(i), i < EMULATED_DEVICE_COUNT; every device is the same host memory."""

    _current = 0                       # the device of this process (cudaGetDevice)

    def __init__(self, device=None):
        device = cuda.Device._current if device is None else device
        _check_device(device)
        self.id = device

    def use(self):
        cuda.Device._current = self.id

    def synchronize(self):
        refuse_while_capturing("Device.synchronize")

    @property
    def compute_capability(self):
        return "".join(map(str, EMULATED_COMPUTE_CAPABILITY))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


_CUBLAS_HANDLE = 1


def get_cublas_handle():
    """The handle llmc.emulator.cublas takes (its calls run on the current stream)."""
    return _CUBLAS_HANDLE


# A cuBLAS handle's calls run on the stream it was last set to (cublasSetStream). CuPy sets it
# before every call it makes, its own products' (cp.matmul, cp.dot) as well as llmc.cuda's gemmEx,
# so the handle's stream lives here beside the handle, and llmc.emulator.cublas's setStream and
# getStream are these two. CuPy's refusal, word for word (cupy_backends/cuda/libs/cublas.pyx
# v14.2.0, setStream):
CUBLAS_CAPTURE_UNSUPPORTED = "calling cuBLAS API during stream capture is currently unsupported"
_CUBLAS_STREAMS = {}                   # handle -> cudaStream_t its calls run on (0: the legacy stream)


def set_cublas_stream(handle, stream):
    """CuPy 14's cublas.setStream: the stream (a cudaStream_t) the handle's calls run on. Raises
    NotImplementedError while that stream captures (CuPy checks cudaStreamIsCapturing first;
    cupy/cupy#6290)."""
    if stream_is_capturing(stream):
        raise NotImplementedError(CUBLAS_CAPTURE_UNSUPPORTED)
    _CUBLAS_STREAMS[handle] = stream


def cublas_stream(handle):
    """CuPy's cublas.getStream: the stream set_cublas_stream last gave the handle (0: the legacy one)."""
    return _CUBLAS_STREAMS.get(handle, 0)


def alloc_pinned_memory(size):
    """Page-locked host memory stands for ordinary host memory here: a bytearray of `size` bytes."""
    return bytearray(size)


class CompileException(Exception):
    """g++ rejected a kernel source: cupy.cuda.compiler.CompileException(msg, source, name, options,
    backend), whose get_message() is the compiler's log."""

    def __init__(self, msg, source, name, options, backend="nvrtc"):
        super().__init__(msg)
        self.msg, self.source, self.name, self.options, self.backend = msg, source, name, options, backend

    def get_message(self):
        return self.msg


# ----------------------------------------------------------------------------
# kernel modules

# `extern __shared__ T name[];`: dynamic shared memory, sized by the launch (shared_mem bytes)
DYNAMIC_SHARED_PATTERN = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\s*\[\s*\]\s*;")


def static_dynamic_shared(code):
    """The kernel source with each dynamic shared memory array declared as a __shared__ array of
    the most a launch may ask for (MAX_DYNAMIC_SHARED_OPTIN_BYTES, 16-byte aligned as CUDA's): like
    the other __shared__ arrays, one copy per block in flight, filled with NaN before each block,
    so that a read past what the kernel wrote shows. Line numbers do not change."""
    return DYNAMIC_SHARED_PATTERN.sub(
        lambda m: f"__shared__ __align__(16) {m[1]} {m[2]}[{MAX_DYNAMIC_SHARED_OPTIN_BYTES} / sizeof({m[1]})];", code)


class RawModule:
    """cupy.RawModule(code=, options=): the source compiled by g++ against the shim (cached on
    disk), its kernels fetched by get_function(name) and called as kernel(grid, block, args).
    Options: -D and -I are used; the rest (e.g. --std=c++17) are NVRTC's and ignored."""

    def __init__(self, code=None, *, path=None, options=(), name_expressions=None):
        if code is None:
            raise ValueError("the emulated device compiles kernel sources: pass code=")
        self.code = code
        self.options = tuple(options)
        self.library = None

    def _build_arguments(self):
        """(the source file in the build cache, -D defines, -I directories) g++ compiles."""
        defines = [o for o in self.options if o.startswith("-D")]
        include_dirs = [o[2:] for o in self.options if o.startswith("-I")]
        return build.source_file(static_dynamic_shared(self.code)), defines, include_dirs

    def _is_built(self):
        """Whether compile() finds its library built in the cache, so runs no g++ (the emulator's
        own question: llmc.cuda.load_modules shows a first build's progress)."""
        return self.library is not None or build.is_built(*self._build_arguments(), BUILD_MODE)

    def compile(self, log_stream=None):
        if self.library is not None:
            return
        path, defines, include_dirs = self._build_arguments()
        mode = "trace" if MEMORY_TRACE is not None and BUILD_MODE == "fibers" else BUILD_MODE
        try:
            self.library = build.Library(path, defines, include_dirs, mode)
        except build.EmulatorError as e:
            raise cuda.compiler.CompileException(str(e), self.code, path, self.options, "g++") from None

    def get_function(self, name):
        self.compile()
        return RawKernel._of(self.library.kernel(name))


class RawKernel:
    """A compiled kernel: called as cupy.RawKernel, (grid, block, args); recorded while a stream
    captures, with its arguments as they are now (the captured graph replays the same pointers
    and scalars, as CUDA's does)."""

    def __init__(self, code, name, options=()):
        compiled = RawModule(code=code, options=options).get_function(name)
        self.kernel, self.name = compiled.kernel, name

    @classmethod
    def _of(cls, kernel):
        """The RawKernel of `kernel`, a function of a compiled build.Library (RawModule.get_function)."""
        raw = cls.__new__(cls)
        raw.kernel, raw.name = kernel, kernel.name
        return raw

    @property
    def max_dynamic_shared_size_bytes(self):
        """CuPy's RawKernel attribute (cuFuncSetAttribute's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES):
        the dynamic shared memory a launch may ask for, MAX_DYNAMIC_SHARED_BYTES (48 KiB) until set.
        Kept with the kernel (as CUDA keeps it with the function), so every RawKernel of it sees it."""
        return getattr(self.kernel, "max_dynamic_shared_size_bytes", MAX_DYNAMIC_SHARED_BYTES)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value):
        """Opt in to more than 48 KiB: up to MAX_DYNAMIC_SHARED_OPTIN_BYTES, as compute capability 8.0
        allows; more is CUDA's invalid-value error (a CUDARuntimeError here; CuPy raises its
        driver's CUDADriverError CUDA_ERROR_INVALID_VALUE)."""
        if not hasattr(value, "__index__") or not 0 <= value <= MAX_DYNAMIC_SHARED_OPTIN_BYTES:
            raise _cuda_error(1, f"kernel {self.name}: max_dynamic_shared_size_bytes {value}: a block of this "
                                 f"device may opt in to at most {MAX_DYNAMIC_SHARED_OPTIN_BYTES} bytes")
        self.kernel.max_dynamic_shared_size_bytes = int(value)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        """grid, block: tuples of 1 to 3 ints; shared_mem: dynamic shared memory bytes, an int. A
        list grid or a float shared_mem is a TypeError, as Cython's `tuple grid` and `size_t
        shared_mem` in CuPy's Function.__call__ (cupy/cuda/function.pyx)."""
        for name, value in (("grid", grid), ("block", block)):
            if not isinstance(value, tuple):
                raise TypeError(f"Argument '{name}' has incorrect type (expected tuple, got {type(value).__name__})")
        if not hasattr(shared_mem, "__index__"):
            raise TypeError(f"shared_mem: 'size_t' from a {type(shared_mem).__name__}: CuPy needs an integer")
        if not 0 <= shared_mem <= self.max_dynamic_shared_size_bytes:
            raise ValueError(f"kernel {self.name}: {shared_mem} bytes of dynamic shared memory, a block may have "
                             f"at most {self.max_dynamic_shared_size_bytes} (more needs the kernel's "
                             f"max_dynamic_shared_size_bytes set first, up to {MAX_DYNAMIC_SHARED_OPTIN_BYTES})")
        grid, block = build.dims(grid), build.dims(block)
        storage, pointers = self.kernel.argument_buffer(args)
        if self.kernel.traced and MEMORY_TRACE is not None:
            enqueue(lambda: MEMORY_TRACE.launch(self.kernel, grid, block, storage, pointers))
        else:
            enqueue(lambda: self.kernel.launch(grid, block, storage, pointers))


cuda = types.SimpleNamespace(
    Stream=Stream,
    Event=Event,
    Graph=Graph,
    Device=Device,
    get_current_stream=get_current_stream,
    get_elapsed_time=get_elapsed_time,
    runtime=runtime,
    device=types.SimpleNamespace(get_cublas_handle=get_cublas_handle, Device=Device),
    compiler=types.SimpleNamespace(CompileException=CompileException),
    alloc_pinned_memory=alloc_pinned_memory,
    MemoryPointer=MemoryPointer,
    MemoryPool=MemoryPool,
)

# CuPy has these under cupy.cuda only (a CuPy user's cp.Stream is an AttributeError): here too
del Stream, Event, Graph, Device, MemoryPointer, MemoryPool, CUDARuntimeError, CompileException, runtime
del get_current_stream, get_elapsed_time, get_cublas_handle, alloc_pinned_memory
