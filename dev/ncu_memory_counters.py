"""
dev/ncu_memory_counters.py: the emulated device's memory counters (llmc/emulator/memory.py) against
Nsight Compute's on a GPU, for doc/transpose.cu's three kernels (naive, through shared memory,
padded): global load and store requests and sectors, shared-memory load wavefronts and bank
conflicts, the same kernels on the same 64 x 64 matrix.

What it does: runs itself under `ncu --csv --metrics <the metrics below>` with --launch (which
launches the three kernels once each with CuPy on the GPU), reads ncu's CSV, counts the same
launches on the emulated device (g++ needed), and prints one row per (kernel, counter): ncu's
value, the emulator's, and whether they agree. Exit 0 when every counter agrees, 1 otherwise,
2 without a GPU or ncu.

Nsight Compute's metrics (Kernel Profiling Guide, "Metrics Reference"):
    l1tex__t_requests_pipe_lsu_mem_global_op_{ld,st}.sum     global requests
    l1tex__t_sectors_pipe_lsu_mem_global_op_{ld,st}.sum      global sectors
    l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum     shared load wavefronts
    l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum shared load bank conflicts

Run (on a GPU machine with Nsight Compute):
    python dev/ncu_memory_counters.py          # ~30 s: ncu replays each kernel per metric group
"""

import csv
import glob
import io
import os
import shutil
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmc import cuda  # noqa: E402

KERNELS = ("transpose_naive", "transpose_shared", "transpose_padded")
SOURCE = os.path.join(ROOT, "doc", "transpose.cu")
N = 64
METRICS = {
    "global load requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "global load sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "global store requests": "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "global store sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "shared load wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "shared load bank conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
}


def launch_all():
    """The three kernels once each on the current device (a GPU with CuPy, or the emulated one)."""
    cp = cuda.cupy()
    with open(SOURCE) as f:
        module = cp.RawModule(code=f.read(), options=("-DENABLE_FP32",))
    inp = cp.asarray(np.arange(N * N, dtype=np.float32).reshape(N, N))
    for name in KERNELS:
        out = cp.zeros((N, N), np.float32)
        module.get_function(name)((N // 32, N // 32), (32, 32), (out, inp, np.int32(N)))
        assert np.array_equal(out.get(), inp.get().T), name


def emulated_counters():
    """{(kernel, counter): value} from the emulated device's memory counters."""
    from llmc.emulator import memory
    cuda.use_device("cpu")
    with memory.tracing() as report:
        launch_all()
    values = {}
    for kernel in KERNELS:
        ld, st = report.kernel_counters(kernel, "global", "load"), report.kernel_counters(kernel, "global", "store")
        sh = report.kernel_counters(kernel, "shared", "load")
        values |= {(kernel, "global load requests"): ld.requests, (kernel, "global load sectors"): ld.sectors,
                   (kernel, "global store requests"): st.requests, (kernel, "global store sectors"): st.sectors,
                   (kernel, "shared load wavefronts"): sh.wavefronts,
                   (kernel, "shared load bank conflicts"): sh.bank_conflicts}
    return values


def find_ncu():
    return shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)


def ncu_counters(ncu):
    """{(kernel, counter): value} from ncu's CSV of `python this --launch`."""
    command = [ncu, "--csv", "--metrics", ",".join(METRICS.values()), sys.executable, __file__, "--launch"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"ncu failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    start = result.stdout.index('"ID"')
    names = {metric: counter for counter, metric in METRICS.items()}
    values = {}
    for row in csv.DictReader(io.StringIO(result.stdout[start:])):
        kernel = next((k for k in KERNELS if row["Kernel Name"].startswith(k)), None)
        if kernel and row["Metric Name"] in names:
            values[(kernel, names[row["Metric Name"]])] = int(float(row["Metric Value"].replace(",", "")))
    return values


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--launch"]:
        launch_all()
        return 0
    reason = cuda.cuda_unavailable_reason()
    ncu = find_ncu()
    if reason or ncu is None:
        print(f"dev/ncu_memory_counters.py: needs a CUDA GPU and Nsight Compute ({reason or 'no ncu found'})",
              file=sys.stderr)
        return 2
    measured = ncu_counters(ncu)
    emulated = emulated_counters()
    agree = True
    print(f"{'kernel':18s} {'counter':28s} {'ncu':>8s} {'emulated':>9s}")
    for key in emulated:
        same = measured.get(key) == emulated[key]
        agree &= same
        print(f"{key[0]:18s} {key[1]:28s} {measured.get(key, 'n/a')!s:>8s} {emulated[key]:9d}  {'same' if same else 'DIFFERENT'}")
    print("every counter agrees" if agree else "some counters differ")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
