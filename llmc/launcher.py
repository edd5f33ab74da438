"""
llmc/launcher.py: who started this process. mpiexec (MPICH, Open MPI) and Slurm's srun tell each
process its rank, the number of processes and its rank on its node through environment
variables; this module reads them, and nothing else. It is the one place that knows their names:
the device binding (llmc.cuda.select_device), MPI (llmc.comm), the rendezvous (llmc.multinode)
and the command line (llmc.cli: errors said by rank 0 only) all ask here.

What it is not: a launcher. It starts no process and talks to none.

    PMI_RANK=1 PMI_SIZE=2 python -c "from llmc import launcher; print(launcher.launcher_environment())"
prints `('MPICH', 1, 2, None)`.
"""

import os

from llmc.utils import InputError

# The launchers' environment variables: (name, rank, size, local rank), checked in this order. MPI's
# come before Slurm's because mpirun inside an sbatch job inherits the batch step's SLURM_PROCID.
LAUNCHERS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


def launcher_environment(env=os.environ):
    """(launcher name, rank, size, local rank or None) from the first launcher in LAUNCHERS whose
    rank and size variables are set, or None without one. Raises InputError for a value that is
    not an integer."""
    for name, rank_var, size_var, local_var in LAUNCHERS:
        if env.get(rank_var) is not None and env.get(size_var) is not None:
            values = []
            for var in (rank_var, size_var, local_var):
                value = env.get(var)
                try:
                    values.append(None if value is None else int(value))
                except ValueError:
                    raise InputError(f"{var}={value!r} in the environment is not an integer") from None
            return (name, *values)
    return None


def launched_size(env=os.environ):
    """The number of processes mpiexec started (PMI_SIZE / OMPI_COMM_WORLD_SIZE), 1 without it.
    (Slurm's srun alone is no MPI job: llmc.multinode's -pm tcp|fs read its variables.)"""
    return int(env.get("PMI_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or 1)


def launched_rank(env=os.environ):
    """This process's rank under mpiexec (PMI_RANK / OMPI_COMM_WORLD_RANK), None without it."""
    rank = env.get("PMI_RANK") or env.get("OMPI_COMM_WORLD_RANK")
    return int(rank) if rank is not None and launched_size(env) > 1 else None
