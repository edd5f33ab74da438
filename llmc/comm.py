"""
llmc/comm.py: data parallelism (llm.c's llmc/zero.cuh and the MPI parts of train_gpt2.cu).
Comm is MPI through mpi4py (rank, world size, averages of host values, barriers), imported only
under mpiexec; NcclComm all-reduces device arrays with NCCL (cupy.cuda.nccl on a GPU, its
emulation llmc/emulator/nccl.py on the emulated device: llmc.cuda.library("nccl")), one GPU per
rank, and for ZeRO-1 (gpt2_cuda.py -z 1) reduce-scatters the gradients and all-gathers the parameters.
"""

import sys
import time

import numpy as np

from llmc import cuda
from llmc.launcher import launched_size

# -pm tcp|fs (llmc/multinode.py) have no MPI_Abort: each puts here a function(code) that tells the
# other ranks over its rendezvous channel to stop, and ends this process
ABORT_HOOKS = []

# MPI_Abort ends the job at once, and MPICH's mpiexec may then drop the output of the aborting rank
# that it has not yet forwarded: seen about 1 run in 20 on a loaded 2-core machine, the rank's
# `error:` line (and MPICH's own Abort line) never reached mpiexec's stderr. A pause before the
# abort lets the line through; an error path can afford it.
ABORT_GRACE_S = 0.5


def abort_all_ranks(code):
    """After an error on this rank: under mpiexec, end every rank of the job now (MPI_Abort), so
    the others do not wait forever in a collective this rank will never reach; under -pm tcp|fs,
    the same through ABORT_HOOKS; else nothing."""
    for hook in ABORT_HOOKS:
        hook(code)
    if launched_size() > 1:
        from mpi4py import MPI         # optional (requirements-dev.txt): imported only under mpiexec
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)      # let mpiexec forward this rank's last lines before it ends the job
        MPI.COMM_WORLD.Abort(code)


class Comm:
    """Rank, world size and averaging across processes. Without mpiexec (no PMI_SIZE /
    OMPI_COMM_WORLD_SIZE in the environment) this is a single process and mpi4py is not imported."""

    def __init__(self):
        size = launched_size()
        self.comm = None
        self.rank, self.size = 0, 1
        if size > 1:
            from mpi4py import MPI
            self.MPI = MPI
            self.comm = MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def mean_(self, arr):
        """In-place mean of a numpy array across all processes."""
        if self.comm is not None:
            self.comm.Allreduce(self.MPI.IN_PLACE, arr, op=self.MPI.SUM)
            arr /= self.size
        return arr

    def sum(self, x):
        """Sum of a Python float across all processes."""
        return self.mean(x) * self.size

    def mean(self, x):
        """Mean of a Python float across all processes."""
        return float(self.mean_(np.array([x], dtype=np.float64))[0])

    def barrier(self):
        """Wait until every process gets here (a no-op without MPI)."""
        if self.comm is not None:
            self.comm.Barrier()


class NcclComm:
    """All-reduce (mean) of device arrays across the processes of `comm` (a Comm), one GPU
    each: rank 0 makes the NCCL unique id, MPI broadcasts it, every rank joins the communicator."""

    def __init__(self, comm):
        nccl = cuda.library("nccl")
        self.nccl = nccl
        uid = nccl.get_unique_id() if comm.rank == 0 else None
        uid = comm.comm.bcast(uid, root=0)
        self.communicator = nccl.NcclCommunicator(comm.size, uid, comm.rank)
        self.rank, self.size = comm.rank, comm.size

    def nccl_dtype(self, arr):
        """NCCL's name for arr's element type: bf16 (stored as uint16 bits) or fp32."""
        return {np.dtype(np.uint16): self.nccl.NCCL_BFLOAT16,
                np.dtype(np.float32): self.nccl.NCCL_FLOAT32}[np.dtype(arr.dtype)]

    def mean_(self, arr):
        """In place: arr = mean of arr over all ranks (NCCL_AVG), on the current stream."""
        ptr = cuda.address(arr)
        self.communicator.allReduce(ptr, ptr, arr.size, self.nccl_dtype(arr), self.nccl.NCCL_AVG, _stream())

    def reduce_scatter_mean_(self, arr):
        """ZeRO-1's gradient reduction, in place. arr (size * S,) contiguous, S = arr.size // size:
        afterwards this rank's slice arr[rank*S:(rank+1)*S] holds the mean over all ranks of that
        slice (NCCL_AVG); the other slices keep this rank's own, unaveraged values and must not be
        read. NCCL's in-place form: the receive buffer is the send buffer at rank * recvcount.
        Moves (size-1)/size of arr per rank, half of mean_'s all-reduce. Raises ValueError if
        arr.size is not a multiple of size (gpt2_cuda pads its buffers to one)."""
        S = self.shard_elements(arr)
        ptr = cuda.address(arr)
        self.communicator.reduceScatter(ptr, ptr + self.rank * S * arr.itemsize, S, self.nccl_dtype(arr),
                                        self.nccl.NCCL_AVG, _stream())

    def all_gather_(self, arr):
        """ZeRO-1's parameter broadcast, in place: every rank's slice arr[r*S:(r+1)*S] (S as in
        reduce_scatter_mean_) is copied into the same slice of arr on every rank, so that each
        rank ends with the full array. In-place form: the send buffer is the receive buffer at
        rank * sendcount. Raises ValueError if arr.size is not a multiple of size."""
        S = self.shard_elements(arr)
        ptr = cuda.address(arr)
        self.communicator.allGather(ptr + self.rank * S * arr.itemsize, ptr, S, self.nccl_dtype(arr), _stream())

    def shard_elements(self, arr):
        """S = arr.size // size, the elements of one rank's slice. Raises ValueError unless arr
        is contiguous and splits evenly (NCCL's counts are the same on every rank)."""
        if arr.size % self.size or not arr.flags.c_contiguous:
            raise ValueError(f"NCCL shards: {arr.size} elements (contiguous: {arr.flags.c_contiguous}) "
                             f"do not split evenly over {self.size} ranks")
        return arr.size // self.size


def _stream():
    """The device's current stream, as the integer handle NCCL takes."""
    return cuda.cupy().cuda.get_current_stream().ptr
