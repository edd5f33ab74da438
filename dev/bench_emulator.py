"""dev/bench_emulator.py: how slow is the emulated CUDA device (llmc/emulator/)? One training step
of gpt2_cuda.py's code on it against the same step of gpt2_cpu.py, measured in one run, and the
cost of each kernel per CUDA thread.

What it measures: the d4 model (-e d4), B=4, T=64, fp32, full fp32 matmuls; a step is zero_grad,
forward, backward, the global norm and AdamW, timed after one warm-up step (which also builds or
loads the kernel libraries). Per kernel: total wall time inside its launches during the timed step,
the CUDA threads launched (grid x block), and microseconds per CUDA thread. A benchmark, not a
test: the numbers depend on the machine and its load. The emulated step's matmuls are NumPy's
(llmc/emulator/cublas.py), so the ratio is the cost of running our kernels thread by thread.

Run: python dev/bench_emulator.py            (about a minute; -e d2 -b 2 for a quicker look)
Expect: a table of kernels by total time, then
    step: emulated device X ms, gpt2_cpu.py Y ms, ratio X/Y
"""

import argparse
import os
import sys
import time
from collections import defaultdict

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gpt2_cpu  # noqa: E402
import gpt2_cuda  # noqa: E402
from llmc import cuda  # noqa: E402
from llmc.emulator import build  # noqa: E402

LEARNING_RATE, WEIGHT_DECAY = 3e-4, 0.0


def cpu_step(model, x, y, t):
    gpt2_cpu.gpt2_zero_grad(model)
    gpt2_cpu.gpt2_forward(model, x, y)
    gpt2_cpu.gpt2_backward(model)
    gpt2_cpu.gpt2_grad_norm(model)
    gpt2_cpu.gpt2_update(model, LEARNING_RATE, 0.9, 0.95, 1e-8, WEIGHT_DECAY, t)


def emulated_step(model, x, y, t):
    gpt2_cuda.gpt2_zero_grad(model)
    gpt2_cuda.gpt2_forward(model, x, y)
    gpt2_cuda.gpt2_backward(model)
    gpt2_cuda.gpt2_grad_norm(model)
    gpt2_cuda.gpt2_update(model, LEARNING_RATE, 0.9, 0.95, 1e-8, WEIGHT_DECAY, t)


def timed(step, model, x, y):
    step(model, x, y, 1)                          # warm-up: kernel libraries, allocations
    t0 = time.perf_counter()
    step(model, x, y, 2)
    return time.perf_counter() - t0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-e", "--model", default="d4", help="model spec, as gpt2_cpu.py -e")
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=64)
    args = p.parse_args(argv)
    cfg = gpt2_cpu.model_config(args.model)
    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)

    cpu = gpt2_cpu.gpt2_init(cfg, 42)
    cpu_seconds = timed(cpu_step, cpu, x, y)

    cuda.use_device("cpu")
    model = gpt2_cuda.GPT2(cfg, "fp32", master_weights=False, recompute=True)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
    seconds, threads, launches = defaultdict(float), defaultdict(int), defaultdict(int)
    launch = build.Kernel.launch
    recording = [False]

    def timed_launch(self, grid, block, storage, pointers):
        t0 = time.perf_counter()
        launch(self, grid, block, storage, pointers)
        if recording[0]:
            seconds[self.name] += time.perf_counter() - t0
            threads[self.name] += int(np.prod(grid)) * int(np.prod(block))
            launches[self.name] += 1
    build.Kernel.launch = timed_launch
    emulated_step(model, x, y, 1)                 # warm-up
    recording[0] = True
    t0 = time.perf_counter()
    emulated_step(model, x, y, 2)
    emulated_seconds = time.perf_counter() - t0
    build.Kernel.launch = launch

    print(f"{args.model}, B={B}, T={T}, fp32: one training step on the emulated device, kernels by total time")
    print(f"{'kernel':40s} {'launches':>8s} {'CUDA threads':>13s} {'ms':>9s} {'us/thread':>10s}")
    for name in sorted(seconds, key=seconds.get, reverse=True):
        print(f"{name:40s} {launches[name]:8d} {threads[name]:13d} {1e3 * seconds[name]:9.1f} "
              f"{1e6 * seconds[name] / threads[name]:10.3f}")
    kernels = sum(seconds.values())
    print(f"{'all kernels':40s} {sum(launches.values()):8d} {sum(threads.values()):13d} {1e3 * kernels:9.1f}")
    print(f"rest of the step (emulated cuBLAS matmuls, Python): {1e3 * (emulated_seconds - kernels):.1f} ms")
    print(f"step: emulated device {1e3 * emulated_seconds:.0f} ms, gpt2_cpu.py {1e3 * cpu_seconds:.0f} ms, "
          f"ratio {emulated_seconds / cpu_seconds:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
