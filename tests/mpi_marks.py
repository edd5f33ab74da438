"""
tests/mpi_marks.py: the `needs_mpi` mark shared by the tests that start `mpiexec`: they skip,
saying why, where mpiexec is missing or mpi4py loads no MPI library; and two helpers of those
tests (run_ok: run a trainer, failing with its output; logged_norms: a run's grad norms). Not a
test module.
"""

import os
import re
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


def run_ok(cmd, cwd):
    """Run cmd (a trainer, possibly under mpiexec) in cwd; its stdout. Fails the test with the
    command and the ends of its output if it exits non-zero."""
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=900,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def logged_norms(out):
    """[grad norm of each step] from the main.log in the output folder out."""
    with open(os.path.join(out, "main.log")) as f:
        return [float(x) for x in re.findall(r"norm:(\S+)", f.read())]
