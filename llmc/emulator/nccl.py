"""
llmc/emulator/nccl.py: NCCL for the emulated CUDA device, the subset of `cupy.cuda.nccl` that
llmc/comm.py calls: get_unique_id, NcclCommunicator(size, uid, rank) and its allReduce,
reduceScatter and allGather on host addresses, with the same arguments (integer buffer
addresses, element counts, NCCL's datatype and op codes, a stream). llmc.cuda.library("nccl")
returns this module on the emulated device and CuPy's on a GPU, so llmc/comm.py runs unchanged.
The unique id has the installed CuPy's form (ID_TYPE): bytes from CuPy 14 on, CuPy 13's tuple of
signed chars before; NcclCommunicator refuses the other form with the TypeError CuPy raises.

Who the ranks are: under mpiexec with more than one process (llmc.launcher.launched_size() > 1),
one MPI process each (mpi4py; the communicator is COMM_WORLD split in NCCL rank order); without
it, processes started without MPI (llmc/multinode.py's -pm tcp and fs) or threads of one process
(NCCL allows several ranks per process, one thread each), which meet in files of a folder named
from the unique id (_FileRanks: /dev/shm or the temporary folder). A collective returns when every
rank has called it; without MPI a rank waits at most LLMC_NCCL_EMULATION_TIMEOUT_S seconds (300)
for the others, and abort() makes the waiting ranks raise NcclAborted.

The buffers, as NCCL's documentation defines them (count in elements of the datatype):
    allReduce(send, recv, count)         recv[i] = op over ranks r of send_r[i],            i < count
    reduceScatter(send, recv, count)     recv[i] = op over ranks r of send_r[rank*count + i], i < count
    allGather(send, recv, count)         recv[r*count + i] = send_r[i]
In place means NCCL's exact offsets: recv == send (allReduce), recv == send + rank*count
(reduceScatter), send == recv + rank*count (allGather); any other overlap of send and recv is
refused (NcclError), as NCCL leaves it undefined. So a wrong offset moves data to the wrong place.

Arithmetic: the reductions run elementwise in rank order, in float32 for bf16, fp16 and fp32
(bf16 and fp16 widened exactly, the result rounded once per element to the buffer's type, bf16
to nearest even) and in float64 for fp64; NCCL_AVG is the sum divided by the number of ranks.
The results are deterministic and the same on every rank. What it deliberately is not: NCCL's
ring or tree order of summation, its average (a pre-multiplied sum for floats), asynchrony (a call
issued on a stream completes before it returns; on a stream that captures a CUDA graph it is
recorded, as NCCL's kernels are, and runs at each replay), or more than these three collectives.

Run its tests: python -m pytest -q tests/test_vendor_emulation.py -k nccl   (mpiexec -n 2 and -n 3)
"""

import atexit
import glob
import os
import pickle
import shutil
import tempfile
import threading
import time

import numpy as np

from llmc.emulator.device import enqueue, stream_at
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from llmc.launcher import launched_size

# ----------------------------------------------------------------------------
# constants (nccl.h's ncclDataType_t and ncclRedOp_t, as cupy.cuda.nccl names them)

NCCL_UNIQUE_ID_BYTES = 128
CUPY_BYTES_ID_MAJOR = 14               # the first CuPy whose unique id is bytes (before: a tuple of ints)
NCCL_FLOAT16, NCCL_HALF = 6, 6
NCCL_FLOAT32, NCCL_FLOAT = 7, 7
NCCL_FLOAT64, NCCL_DOUBLE = 8, 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_SYSTEM_ERROR, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_REMOTE_ERROR = 2, 4, 5, 6   # ncclResult_t

STORAGE = {NCCL_FLOAT16: np.dtype(np.float16), NCCL_FLOAT32: np.dtype(np.float32),
           NCCL_FLOAT64: np.dtype(np.float64), NCCL_BFLOAT16: np.dtype(np.uint16)}   # bf16 as its bits
ACCUMULATE = {NCCL_FLOAT16: np.float32, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64,
              NCCL_BFLOAT16: np.float32}
OPS = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}


class NcclError(RuntimeError):
    """A call NCCL would refuse (ncclInvalidArgument, ncclInvalidUsage)."""

    def __init__(self, status, why):
        self.status = status
        super().__init__(f"NCCL error {status}: {why}")


class NcclAborted(NcclError, threading.BrokenBarrierError):
    """ncclRemoteError: another rank aborted the communicator while this one waited for it (also a
    threading.BrokenBarrierError, as for any other group of threads whose wait was broken)."""

    def __init__(self, why):
        super().__init__(NCCL_REMOTE_ERROR, why)


def _id_type_of_cupy(version):
    """The Python type of an NCCL unique id in CuPy `version` ("14.2.0"; None: no CuPy installed,
    taken as the CuPy the project installs): bytes from CuPy 14 on (nccl.pyx v14.2.0: get_unique_id
    returns bytes, `NcclCommunicator(int ndev, bytes commId, int rank)`), before that a tuple of 128
    signed chars (`tuple commId`)."""
    return bytes if version is None or int(version.split(".")[0]) >= CUPY_BYTES_ID_MAJOR else tuple


def _installed_cupy_version():
    """The version of the installed CuPy wheel (cupy, cupy-cuda12x, cupy-cuda13x, ...), read from
    its metadata without importing it; None if there is none."""
    from importlib import metadata
    for name in metadata.packages_distributions().get("cupy", []):
        return metadata.version(name)
    return None


ID_TYPE = _id_type_of_cupy(_installed_cupy_version())    # the form the installed CuPy gives and takes


def get_unique_id():
    """A new communicator id of 128 random bytes, in the installed CuPy's form (ID_TYPE): bytes, or
    CuPy 13's tuple of signed chars. It is sent to every rank (llmc/comm.py broadcasts it over MPI)."""
    data = os.urandom(NCCL_UNIQUE_ID_BYTES)
    return data if ID_TYPE is bytes else tuple(b - 256 if b > 127 else b for b in data)


# ----------------------------------------------------------------------------
# host memory, and the values of a buffer

def _buffer(ptr, count, datatype):
    """The `count` elements of `datatype` at host address ptr, as a writable NumPy view."""
    import ctypes
    if datatype not in STORAGE:
        raise NcclError(NCCL_INVALID_ARGUMENT, f"datatype {datatype} (the emulation has fp16, bf16, fp32, fp64)")
    if not ptr and count:
        raise NcclError(NCCL_INVALID_ARGUMENT, "null buffer")
    dtype = STORAGE[datatype]
    if count == 0:
        return np.zeros(0, dtype)
    return np.ctypeslib.as_array((ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)).view(dtype)


def _widen(values, datatype):
    """Stored values -> the accumulation type (exact: bf16 and fp16 widen to float32 without rounding)."""
    if datatype == NCCL_BFLOAT16:
        return bfloat16_bits_to_float32(values)
    return values.astype(ACCUMULATE[datatype])


def _narrow(values, datatype):
    """Accumulated values rounded once to the buffer's type (bf16: nearest even)."""
    if datatype == NCCL_BFLOAT16:
        return float32_to_bfloat16_bits(values)
    return values.astype(STORAGE[datatype])


def _reduce(parts, op, datatype):
    """op over the ranks' arrays (rank order), elementwise, in the accumulation type."""
    acc = _widen(parts[0], datatype)
    for part in parts[1:]:
        x = _widen(part, datatype)
        if op in (NCCL_SUM, NCCL_AVG):
            acc = acc + x
        elif op == NCCL_PROD:
            acc = acc * x
        elif op == NCCL_MAX:
            acc = np.maximum(acc, x)
        else:
            acc = np.minimum(acc, x)
    if op == NCCL_AVG:
        acc = acc / acc.dtype.type(len(parts))
    return _narrow(acc, datatype)


def _check_overlap(send, send_bytes, recv, recv_bytes, in_place_recv, what):
    """Refuse send/recv ranges that overlap unless recv starts at NCCL's in-place address."""
    overlap = send < recv + recv_bytes and recv < send + send_bytes
    if overlap and recv != in_place_recv:
        raise NcclError(NCCL_INVALID_USAGE, f"{what}: send [{send:#x}, +{send_bytes}) and recv [{recv:#x}, "
                                            f"+{recv_bytes}) overlap, but not at NCCL's in-place offset")


# ----------------------------------------------------------------------------
# how the ranks meet: MPI processes, or threads of one process

class _MpiRanks:
    """The ranks are the processes of the MPI job, ordered by NCCL rank."""

    def __init__(self, size, uid, rank):
        from mpi4py import MPI
        self.comm = MPI.COMM_WORLD.Split(0, rank)
        if self.comm.Get_size() != size:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"{size} ranks asked, but the MPI job has {self.comm.Get_size()}")
        ids = self.comm.allgather((uid, rank))
        if len({u for u, _ in ids}) != 1 or sorted(r for _, r in ids) != list(range(size)):
            raise NcclError(NCCL_INVALID_ARGUMENT, "the ranks do not share one unique id, or repeat a rank")

    def allgather(self, rank, value):
        return self.comm.allgather(value)

    def close(self):
        self.comm.Free()

    def abort(self):
        """End every rank of the job now (they may be waiting in a collective)."""
        self.comm.Abort(1)


class _FileRanks:
    """The ranks are processes (started without MPI: srun-style, llmc/multinode.py's -pm tcp and fs)
    or threads of one process, meeting in a folder named from the unique id: LLMC_NCCL_EMULATION_DIR,
    else /dev/shm, else tempfile.gettempdir(), then llmc-nccl-<the id's first 16 bytes in hex>.

    Files in the folder:
        join-<rank>                 made (exclusively) when rank joins; a second rank `rank` is refused
        <seq>-<src>-<dst>           collective number seq's values of rank src for rank dst (pickle),
                                    written under a temporary name and renamed, deleted by dst once read
        abort                       made by abort(): every rank waiting in a collective raises NcclAborted
    A rank that leaves (close, abort, or this process's exit) deletes its join file, and the last to
    leave deletes the folder. A collective waits at most LLMC_NCCL_EMULATION_TIMEOUT_S seconds
    (default TIMEOUT_S) for the others, then raises NcclError naming the ranks that did not come."""

    TIMEOUT_S = 300
    _open = set()                                                # closed at exit, so nothing is left behind
    _open_lock = threading.Lock()

    def __init__(self, size, uid, rank):
        key = bytes(b & 0xFF for b in uid)
        parent = os.environ.get("LLMC_NCCL_EMULATION_DIR") or (
            "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())
        self.folder = os.path.join(parent, "llmc-nccl-" + key[:16].hex())
        self.size, self.rank, self.seq = size, rank, 0
        self.timeout = float(os.environ.get("LLMC_NCCL_EMULATION_TIMEOUT_S", self.TIMEOUT_S))
        os.makedirs(self.folder, exist_ok=True)
        try:
            os.close(os.open(self._path(f"join-{rank}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"rank {rank} joins the communicator {key[:16].hex()} twice") from None
        with self._open_lock:
            self._open.add(self)

    def _path(self, name):
        return os.path.join(self.folder, name)

    def allgather(self, rank, value):
        """Every rank's value, in rank order, once all have given theirs."""
        self.seq += 1
        for dst in range(self.size):
            if dst != rank:
                name = f"{self.seq}-{rank}-{dst}"
                with open(self._path(".tmp-" + name), "wb") as f:
                    pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(self._path(".tmp-" + name), self._path(name))
        values = [None] * self.size
        values[rank] = value
        waiting = [src for src in range(self.size) if src != rank]
        deadline, pause = time.monotonic() + self.timeout, 1e-4
        while waiting:
            for src in list(waiting):
                name = self._path(f"{self.seq}-{src}-{rank}")
                try:
                    with open(name, "rb") as f:
                        values[src] = pickle.load(f)
                except FileNotFoundError:
                    continue
                os.unlink(name)
                waiting.remove(src)
            if not waiting:
                break
            if os.path.exists(self._path("abort")):
                raise NcclAborted(f"rank {rank}: another rank aborted the communicator (collective #{self.seq})")
            if time.monotonic() > deadline:
                raise NcclError(NCCL_SYSTEM_ERROR, f"rank {rank}: rank(s) {waiting} of {self.size} did not reach "
                                                   f"collective #{self.seq} within {self.timeout:g} s "
                                                   f"(LLMC_NCCL_EMULATION_TIMEOUT_S)")
            time.sleep(pause)
            pause = min(2 * pause, 0.005)
        return values

    def close(self):
        """Leave: delete this rank's join file, and the folder when no rank is left in it."""
        with self._open_lock:
            if self not in self._open:
                return
            self._open.discard(self)
        try:
            os.unlink(self._path(f"join-{self.rank}"))
        except FileNotFoundError:
            pass
        if not glob.glob(self._path("join-*")):
            shutil.rmtree(self.folder, ignore_errors=True)

    def abort(self):
        """Make every rank waiting in a collective (now or later) raise NcclAborted, then leave;
        this rank's values no other rank will read are deleted."""
        with open(self._path("abort"), "w") as f:
            f.write(str(self.rank))
        for name in glob.glob(self._path(f"*-{self.rank}-*")) + glob.glob(self._path(f"*-*-{self.rank}")):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
        self.close()

    @classmethod
    def close_all(cls):
        for ranks in list(cls._open):
            ranks.close()


atexit.register(_FileRanks.close_all)


# ----------------------------------------------------------------------------
# the communicator

class NcclCommunicator:
    """Rank `rank` of a communicator of `ndev` ranks, all created with the same `commId` (from
    get_unique_id). Every call is collective: all ranks make it, with the same counts."""

    def __init__(self, ndev, commId, rank):                       # noqa: N803 (CuPy's names)
        if type(commId) is not ID_TYPE:                            # Cython's check of the typed argument
            raise TypeError(f"Argument 'commId' has incorrect type (expected {ID_TYPE.__name__}, "
                            f"got {type(commId).__name__})")
        if not 0 <= rank < ndev:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"rank {rank} of {ndev}")
        self._rank, self._size = rank, ndev
        self._ranks = _MpiRanks(ndev, commId, rank) if launched_size() > 1 else _FileRanks(ndev, commId, rank)

    def rank_id(self):
        return self._rank

    def size(self):
        return self._size

    def device_id(self):
        return 0

    def destroy(self):
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None

    def abort(self):
        """ncclCommAbort: after an error on this rank, stop the others waiting for it in a
        collective (without MPI: they raise NcclAborted; MPI: the job ends)."""
        if self._ranks is not None:
            self._ranks.abort()
            self._ranks = None

    def _gather(self, call, values):
        """Every rank's send values, after checking that all ranks made the same call."""
        if self._ranks is None:
            raise NcclError(NCCL_INVALID_USAGE, "the communicator was destroyed")
        parts = self._ranks.allgather(self._rank, ((call, self._size), np.array(values)))
        calls = {c for c, _ in parts}
        if len(calls) != 1:
            raise NcclError(NCCL_INVALID_USAGE, f"the ranks made different calls: {sorted(calls)}")
        return [p for _, p in parts]

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):          # noqa: N802
        """recv[i] = op over ranks of send[i], i < count; in place when recvbuf == sendbuf.
        Issued on `stream` (a cudaStream_t): run now, or recorded while it captures (_issue)."""
        nbytes = count * STORAGE.get(datatype, np.dtype(np.uint8)).itemsize
        send = _buffer(sendbuf, count, datatype)
        _check_overlap(sendbuf, nbytes, recvbuf, nbytes, sendbuf, "allReduce")
        recv = _buffer(recvbuf, count, datatype)
        self._issue(stream, self._all_reduce, ("allReduce", count, datatype, op), send, recv)

    def _all_reduce(self, call, send, recv):
        recv[...] = _reduce(self._gather(call, send), _op(call[3]), call[2])

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        """recv[i] = op over ranks of send[rank*recvcount + i], i < recvcount; send holds
        size*recvcount elements; in place when recvbuf == sendbuf + rank*recvcount elements."""
        itemsize = STORAGE.get(datatype, np.dtype(np.uint8)).itemsize
        send = _buffer(sendbuf, self._size * recvcount, datatype)
        _check_overlap(sendbuf, self._size * recvcount * itemsize, recvbuf, recvcount * itemsize,
                       sendbuf + self._rank * recvcount * itemsize, "reduceScatter")
        recv = _buffer(recvbuf, recvcount, datatype)
        self._issue(stream, self._reduce_scatter, ("reduceScatter", recvcount, datatype, op), send, recv)

    def _reduce_scatter(self, call, send, recv):
        recvcount = call[1]
        mine = slice(self._rank * recvcount, (self._rank + 1) * recvcount)
        recv[...] = _reduce([p[mine] for p in self._gather(call, send)], _op(call[3]), call[2])

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):             # noqa: N802
        """recv[r*count + i] = send of rank r [i]; recv holds size*count elements; in place when
        sendbuf == recvbuf + rank*count elements."""
        itemsize = STORAGE.get(datatype, np.dtype(np.uint8)).itemsize
        send = _buffer(sendbuf, count, datatype)
        _check_overlap(recvbuf, self._size * count * itemsize, sendbuf, count * itemsize,
                       recvbuf + self._rank * count * itemsize, "allGather")
        recv = _buffer(recvbuf, self._size * count, datatype)
        self._issue(stream, self._all_gather, ("allGather", count, datatype), send, recv)

    def _all_gather(self, call, send, recv):
        recv[...] = np.concatenate(self._gather(call, send))

    def _issue(self, stream, collective, call, send, recv):
        """Issue collective(call, send, recv) on the stream whose cudaStream_t is `stream`, as NCCL
        enqueues its kernels: it runs now, or, while that stream captures a CUDA graph, is recorded
        and runs (meeting the other ranks) at each replay, on what the buffers hold then. The
        arguments were checked above, at the call, as NCCL checks them."""
        enqueue(lambda: collective(call, send, recv), stream_at(int(stream)))


def _op(op):
    if op not in OPS:
        raise NcclError(NCCL_INVALID_ARGUMENT, f"reduction op {op}")
    return op
