"""
tests/mpi_marks.py: the `needs_mpi` mark shared by the tests that start `mpiexec`: they skip,
saying why, where mpiexec is missing or mpi4py loads no MPI library. Not a test module.
"""

import shutil
import subprocess
import sys

import pytest


def mpi_unavailable_reason():
    """None where `mpiexec` runs and mpi4py loads an MPI library, else why not (the skip reason):
    mpi4py can be installed without any MPI (the GPU machine's is)."""
    if shutil.which("mpiexec") is None:
        return "no mpiexec (pip install mpich mpi4py)"
    r = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        return f"mpi4py cannot load an MPI library ({(r.stderr.strip().splitlines() or ['?'])[-1]}): pip install mpich"
    return None


MPI_UNAVAILABLE = mpi_unavailable_reason()
needs_mpi = pytest.mark.skipif(MPI_UNAVAILABLE is not None, reason=str(MPI_UNAVAILABLE))
