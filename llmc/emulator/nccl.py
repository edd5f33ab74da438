"""
llmc/emulator/nccl.py: NCCL for the emulated CUDA device, the subset of `cupy.cuda.nccl` that
llmc/comm.py calls: get_unique_id, NcclCommunicator(size, uid, rank) and its allReduce,
reduceScatter and allGather on host addresses, with the same arguments (integer buffer
addresses, element counts, NCCL's datatype and op codes, a stream). llmc.cuda.library("nccl")
returns this module on the emulated device and CuPy's on a GPU, so llmc/comm.py runs unchanged.

Who the ranks are: under mpiexec with more than one process (llmc.comm.launched_size() > 1),
one MPI process each (mpi4py; the communicator is COMM_WORLD split in NCCL rank order); without
it, threads of this one process (NCCL allows several ranks per process, one thread each), which
meet through the unique id. A collective returns when every rank has called it.

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
ring or tree order of summation, its average (a pre-multiplied sum for floats), streams (each
call completes before it returns), or more than these three collectives.

Run its tests: python -m pytest -q tests/test_vendor_emulation.py -k nccl   (mpiexec -n 2 and -n 3)
"""

import os
import threading

import numpy as np

from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

# ----------------------------------------------------------------------------
# constants (nccl.h's ncclDataType_t and ncclRedOp_t, as cupy.cuda.nccl names them)

NCCL_UNIQUE_ID_BYTES = 128
NCCL_FLOAT16, NCCL_HALF = 6, 6
NCCL_FLOAT32, NCCL_FLOAT = 7, 7
NCCL_FLOAT64, NCCL_DOUBLE = 8, 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4
NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE = 4, 5          # ncclResult_t

STORAGE = {NCCL_FLOAT16: np.dtype(np.float16), NCCL_FLOAT32: np.dtype(np.float32),
           NCCL_FLOAT64: np.dtype(np.float64), NCCL_BFLOAT16: np.dtype(np.uint16)}   # bf16 as its bits
ACCUMULATE = {NCCL_FLOAT16: np.float32, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64,
              NCCL_BFLOAT16: np.float32}
OPS = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min", NCCL_AVG: "avg"}
RENDEZVOUS_TIMEOUT_S = 600              # threads of one process: how long a collective waits for the others


class NcclError(RuntimeError):
    """A call NCCL would refuse (ncclInvalidArgument, ncclInvalidUsage)."""

    def __init__(self, status, why):
        self.status = status
        super().__init__(f"NCCL error {status}: {why}")


def get_unique_id():
    """A new communicator id: 128 random bytes, as a tuple of ints (what CuPy returns), to be
    sent to every rank (llmc/comm.py broadcasts it over MPI)."""
    return tuple(os.urandom(NCCL_UNIQUE_ID_BYTES))


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


class _ThreadRanks:
    """The ranks are threads of this process that created communicators with the same unique id."""

    _groups, _lock = {}, threading.Lock()

    def __init__(self, size, uid, rank):
        with self._lock:
            group = self._groups.setdefault(tuple(uid), dict(size=size, slots=[None] * size, joined=set(),
                                                             barrier=threading.Barrier(size, timeout=RENDEZVOUS_TIMEOUT_S)))
            if group["size"] != size or not 0 <= rank < size or rank in group["joined"]:
                raise NcclError(NCCL_INVALID_ARGUMENT, f"rank {rank} of {size} joins a communicator of {group['size']} "
                                                       f"ranks, or joins it twice")
            group["joined"].add(rank)
        self.uid, self.group = tuple(uid), group

    def allgather(self, rank, value):
        """Every rank's value, in rank order, once all have given theirs."""
        group = self.group
        group["slots"][rank] = value
        group["barrier"].wait()
        values = list(group["slots"])
        group["barrier"].wait()                                  # nobody overwrites a slot before all have read
        return values

    def close(self):
        with self._lock:
            self._groups.pop(self.uid, None)

    def abort(self):
        """Release the ranks waiting in a collective: each of them raises threading.BrokenBarrierError."""
        self.group["barrier"].abort()
        self.close()


# ----------------------------------------------------------------------------
# the communicator

class NcclCommunicator:
    """Rank `rank` of a communicator of `ndev` ranks, all created with the same `commId` (from
    get_unique_id). Every call is collective: all ranks make it, with the same counts."""

    def __init__(self, ndev, commId, rank):                       # noqa: N803 (CuPy's names)
        from llmc.comm import launched_size
        if not 0 <= rank < ndev:
            raise NcclError(NCCL_INVALID_ARGUMENT, f"rank {rank} of {ndev}")
        self._rank, self._size = rank, ndev
        self._ranks = _MpiRanks(ndev, commId, rank) if launched_size() > 1 else _ThreadRanks(ndev, commId, rank)

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
        collective (threads: they raise BrokenBarrierError; MPI: the job ends)."""
        if self._ranks is not None:
            self._ranks.abort()
            self._ranks = None

    def _gather(self, call, values):
        """Every rank's send values, after checking that all ranks made the same call."""
        if self._ranks is None:
            raise NcclError(NCCL_INVALID_USAGE, "the communicator was destroyed")
        parts = self._ranks.allgather(self._rank, (call, np.array(values)))
        calls = {c for c, _ in parts}
        if len(calls) != 1:
            raise NcclError(NCCL_INVALID_USAGE, f"the ranks made different calls: {sorted(calls)}")
        return [p for _, p in parts]

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):          # noqa: N802
        """recv[i] = op over ranks of send[i], i < count; in place when recvbuf == sendbuf."""
        nbytes = count * STORAGE.get(datatype, np.dtype(np.uint8)).itemsize
        send = _buffer(sendbuf, count, datatype)
        _check_overlap(sendbuf, nbytes, recvbuf, nbytes, sendbuf, "allReduce")
        parts = self._gather(("allReduce", count, datatype, op), send)
        _buffer(recvbuf, count, datatype)[...] = _reduce(parts, _op(op), datatype)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        """recv[i] = op over ranks of send[rank*recvcount + i], i < recvcount; send holds
        size*recvcount elements; in place when recvbuf == sendbuf + rank*recvcount elements."""
        itemsize = STORAGE.get(datatype, np.dtype(np.uint8)).itemsize
        send = _buffer(sendbuf, self._size * recvcount, datatype)
        _check_overlap(sendbuf, self._size * recvcount * itemsize, recvbuf, recvcount * itemsize,
                       sendbuf + self._rank * recvcount * itemsize, "reduceScatter")
        parts = self._gather(("reduceScatter", recvcount, datatype, op), send)
        mine = slice(self._rank * recvcount, (self._rank + 1) * recvcount)
        _buffer(recvbuf, recvcount, datatype)[...] = _reduce([p[mine] for p in parts], _op(op), datatype)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):             # noqa: N802
        """recv[r*count + i] = send of rank r [i]; recv holds size*count elements; in place when
        sendbuf == recvbuf + rank*count elements."""
        itemsize = STORAGE.get(datatype, np.dtype(np.uint8)).itemsize
        send = _buffer(sendbuf, count, datatype)
        _check_overlap(recvbuf, self._size * count * itemsize, sendbuf, count * itemsize,
                       recvbuf + self._rank * count * itemsize, "allGather")
        parts = self._gather(("allGather", count, datatype), send)
        _buffer(recvbuf, self._size * count, datatype)[...] = np.concatenate(parts)


def _op(op):
    if op not in OPS:
        raise NcclError(NCCL_INVALID_ARGUMENT, f"reduction op {op}")
    return op
