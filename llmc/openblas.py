"""
llmc/openblas.py: how long NumPy's OpenBLAS keeps its idle threads spinning, set before NumPy
loads it.

After each matrix product OpenBLAS's worker threads spin, waiting for the next one, for
2^OPENBLAS_THREAD_TIMEOUT CPU cycles (default 28: about 0.1 s), a value read once, when the
library loads. On the emulated device (llmc/emulator/) a cuBLAS call is NumPy's product and the
kernels launched after it want every core: the spinning threads took about a fifth of a d4 step
(dev/bench_emulator.py on the 2-core machine, 2026-11-27: the step 740-764 ms with the default,
572-628 ms with 10 or 16, while gpt2_cpu.py's step stayed at 190-202 ms, its products following
one another within microseconds). The CUDA trainers, the emulator's benchmark and the tests call
spin_briefly_when_idle first; a value the user set wins.
"""

import os

IDLE_SPIN_LOG2_CYCLES = 16           # 2^16 cycles: about 25 microseconds at 2.5 GHz


def spin_briefly_when_idle():
    """Set OPENBLAS_THREAD_TIMEOUT to IDLE_SPIN_LOG2_CYCLES unless it is set. It takes effect only
    if NumPy has not been imported yet in this process (OpenBLAS reads it once, when it loads)."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(IDLE_SPIN_LOG2_CYCLES))
