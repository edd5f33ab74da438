"""dev/bench_emulator.py: how slow is the emulated CUDA device (llmc/emulator/)? One training step
of gpt2_cuda.py's code on it against the same step of gpt2_cpu.py, measured in one run, and the
cost of each kernel per CUDA thread. With -e llama3:d2 (a llama3_cpu.py descriptor) or a Llama 3
model file: llama3_cuda.py's step against llama3_cpu.py's
(zero_grad, forward, backward, the norm, AdamW on Llama 3's decayed tensors); a checkout without
llama3_cuda.py says so in one line. Bad flags are one `error:` line and exit 1, as for the trainers.

What it measures: the d4 model (-e d4), B=4, T=64, fp32, full fp32 matmuls; a step is zero_grad,
forward, backward, the global norm and AdamW. After one warm-up step (which also builds or loads
the kernel libraries) each side runs --repeats timed steps (3) and the fastest counts: the machine's
other load only ever adds time. Per kernel, in the emulated device's fastest step: wall time
inside its launches, the CUDA threads launched (grid x block), and microseconds per CUDA thread.
A benchmark, not a test: the numbers depend on the machine and its load (on a shared machine the
ratio moves by 2x or more from run to run). The emulated step's matmuls are NumPy's
(llmc/emulator/cublas.py), so the ratio is the cost of running our kernels thread by thread.

Run: python dev/bench_emulator.py            (a few minutes; -e d2 -b 2 --repeats 1 for a quicker look)
     python dev/bench_emulator.py -e llama3:d2 -b 1 -t 16 --repeats 1
Expect: a table of kernels by total time, then
    step (the fastest of 3): emulated device X ms, gpt2_cpu.py Y ms, ratio X/Y
(llama3_cpu.py in the last line for -e llama3:dX)
"""

import argparse
import os
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from llmc.openblas import spin_briefly_when_idle  # noqa: E402
spin_briefly_when_idle()          # as gpt2_cuda.py: before NumPy loads (both steps run with it, measured alike)

import numpy as np  # noqa: E402

import gpt2_cpu  # noqa: E402
import gpt2_cuda  # noqa: E402
import llama3_cpu  # noqa: E402
from bench_cpu import check_batch, is_llama3  # noqa: E402  (this script's directory is on the path)
from llmc import cuda  # noqa: E402
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.emulator import build  # noqa: E402
from llmc.utils import InputError  # noqa: E402

LEARNING_RATE, BETA1, BETA2, EPS, WEIGHT_DECAY = 3e-4, 0.9, 0.95, 1e-8, 0.0
INIT_SEED = 42


# ----------------------------------------------------------------------------
# the two model families: each builds its CPU model and its emulated one, and runs a step of either

class GPT2Family:
    """gpt2_cpu.py against gpt2_cuda.py (the same function names, the same order)."""
    cpu_name = "gpt2_cpu.py"

    def __init__(self, spec):
        self.spec, self.config = spec, gpt2_cpu.model_config(spec)

    def cpu_model(self):
        """The model -e names: the file's (read and checked whole), or a descriptor's random init."""
        return gpt2_cpu.build_model(self.spec, INIT_SEED)

    def emulated_model(self):
        model = gpt2_cuda.GPT2(self.config, "fp32", master_weights=False, recompute=True)
        gpt2_cuda.upload_parameters(model, self.cpu_model().params)
        return model

    def step(self, on_device, model, x, y, t):
        """AdamW step t as each trainer's train() runs it: zero_grad, forward, backward, the
        global norm, the update. On the device the zero_grad, forward and backward are
        gpt2_micro_batch's (its forward leaves the classifier to the backward's fused kernel)."""
        if on_device:
            gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, first=True)
        else:
            gpt2_cpu.gpt2_zero_grad(model)
            gpt2_cpu.gpt2_forward(model, x, y)
            gpt2_cpu.gpt2_backward(model)
        trainer = gpt2_cuda if on_device else gpt2_cpu
        trainer.gpt2_grad_norm(model)
        trainer.gpt2_update(model, LEARNING_RATE, BETA1, BETA2, EPS, WEIGHT_DECAY, t)


class Llama3Family:
    """llama3_cpu.py against llama3_cuda.py (imported here: raises ImportError without it)."""
    cpu_name = "llama3_cpu.py"

    def __init__(self, spec):
        import llama3_cuda
        self.llama3_cuda = llama3_cuda
        self.spec, self.config = spec, llama3_cpu.model_config(spec)

    def cpu_model(self):
        """The model -e names: the file's (read and checked whole), or a descriptor's random init."""
        return llama3_cpu.build_model(self.spec, INIT_SEED)

    def emulated_model(self):
        model = self.llama3_cuda.Llama3(self.config, "fp32")
        self.llama3_cuda.upload_parameters(model, self.cpu_model().params)
        return model

    def step(self, on_device, model, x, y, t):
        """AdamW step t: zero_grad, forward, backward, the global norm (gpt2's, over the flat
        buffer), the update (decaying llama3_cpu.DECAYED_PARAMETERS only)."""
        trainer = self.llama3_cuda if on_device else llama3_cpu
        norms = gpt2_cuda if on_device else gpt2_cpu
        norms.gpt2_zero_grad(model)
        if on_device:                      # the trainer's micro-batch: the classifier once, in the backward
            trainer.llama3_micro_batch(model, x, y, 1.0)
        else:
            trainer.llama3_forward(model, x, y)
            trainer.llama3_backward(model)
        norms.gpt2_grad_norm(model)
        if on_device:
            trainer.llama3_update(model, LEARNING_RATE, BETA1, BETA2, EPS, WEIGHT_DECAY, t)
        else:
            gpt2_cpu.gpt2_update(model, LEARNING_RATE, BETA1, BETA2, EPS, WEIGHT_DECAY, t,
                                 decayed=llama3_cpu.DECAYED_PARAMETERS)


def model_family(spec):
    """The family -e names (llama3:dX or a Llama 3 model file: Llama 3, else GPT-2), built once.
    Raises InputError for a model it cannot name, or Llama 3 without llama3_cuda.py."""
    if not is_llama3(spec):
        return GPT2Family(spec)
    try:
        return Llama3Family(spec)
    except ImportError as e:
        raise InputError(f"-e {spec}: the emulated Llama 3 step needs llama3_cuda.py, which this checkout "
                         f"lacks ({e})") from None


def timed_steps(family, on_device, model, x, y, repeats, before_step=lambda t: None):
    """Seconds of each of `repeats` timed steps t = 2, 3, ..., of family.step on the emulated
    device (on_device) or the CPU, after one warm-up step (kernel libraries, allocations);
    before_step(t) is called before step t is timed."""
    family.step(on_device, model, x, y, 1)
    seconds = []
    for t in range(2, repeats + 2):
        before_step(t)
        t0 = time.perf_counter()
        family.step(on_device, model, x, y, t)
        seconds.append(time.perf_counter() - t0)
    return seconds


class KernelTimes:
    """Wraps build.Kernel.launch while in a `with` block: per step t and kernel name, the wall
    seconds inside its launches, the launches and the CUDA threads (grid x block) launched."""

    def __init__(self):
        self.step = None
        self.seconds, self.launches, self.threads = defaultdict(float), defaultdict(int), defaultdict(int)

    def __enter__(self):
        self.launch = launch = build.Kernel.launch

        def timed_launch(kernel, grid, block, storage, pointers):
            t0 = time.perf_counter()
            launch(kernel, grid, block, storage, pointers)
            if self.step is not None:
                key = (self.step, kernel.name)
                self.seconds[key] += time.perf_counter() - t0
                self.launches[key] += 1
                self.threads[key] += int(np.prod(grid)) * int(np.prod(block))
        build.Kernel.launch = timed_launch
        return self

    def __exit__(self, *exc):
        build.Kernel.launch = self.launch

    def start_step(self, t):
        self.step = t


def parse_args(argv=None):
    """The flags; a bad one is one `error:` line and exit 1 (llmc.argparser.ArgumentParser)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-e", "--model", default="d4", help="model spec, as gpt2_cpu.py -e, or llama3:dX or a Llama 3 "
                                                       "model file, as llama3_cpu.py -e")
    p.add_argument("-b", "--batch-size", type=int, default=4, help="B")
    p.add_argument("-t", "--seq-len", type=int, default=64, help="T")
    # long only: -r is llm.c's recompute flag
    p.add_argument("--repeats", type=int, default=3, help="timed steps of each; the fastest counts")
    return p.parse_args(argv)


def bench(args):
    """Time the two steps and print the kernel table and the ratio. Raises InputError for bad
    flags, before anything is built."""
    if args.repeats < 1:
        raise InputError(f"--repeats {args.repeats}: must be at least 1")
    family = model_family(args.model)
    cfg = family.config
    B, T = args.batch_size, args.seq_len
    check_batch(B, T, cfg)
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)

    cpu_seconds = min(timed_steps(family, False, family.cpu_model(), x, y, args.repeats))

    cuda.use_device("cpu")
    model = family.emulated_model()
    with KernelTimes() as times:
        steps = timed_steps(family, True, model, x, y, args.repeats, times.start_step)
    emulated_seconds = min(steps)
    fastest = 2 + steps.index(emulated_seconds)
    names = [name for (t, name) in times.seconds if t == fastest]

    print(f"{args.model}, B={B}, T={T}, fp32: the fastest of {args.repeats} training steps on the emulated "
          f"device, kernels by total time")
    print(f"{'kernel':40s} {'launches':>8s} {'CUDA threads':>13s} {'ms':>9s} {'us/thread':>10s}")
    for name in sorted(names, key=lambda name: times.seconds[fastest, name], reverse=True):
        key = (fastest, name)
        print(f"{name:40s} {times.launches[key]:8d} {times.threads[key]:13d} {1e3 * times.seconds[key]:9.1f} "
              f"{1e6 * times.seconds[key] / times.threads[key]:10.3f}")
    kernels = sum(times.seconds[fastest, name] for name in names)
    print(f"{'all kernels':40s} {sum(times.launches[fastest, name] for name in names):8d} "
          f"{sum(times.threads[fastest, name] for name in names):13d} {1e3 * kernels:9.1f}")
    print(f"rest of the step (emulated cuBLAS matmuls, Python): {1e3 * (emulated_seconds - kernels):.1f} ms")
    print(f"step (the fastest of {args.repeats}): emulated device {1e3 * emulated_seconds:.0f} ms, "
          f"{family.cpu_name} {1e3 * cpu_seconds:.0f} ms, ratio {emulated_seconds / cpu_seconds:.1f}")


def main(argv=None):
    """Command-line entry point. Returns the exit code: 0; 1 with one `error:` line for bad input
    or any other error (llmc.cli.run_main, as the trainers')."""
    try:
        args = parse_args(argv)
    except SystemExit as e:                               # --help (0), or a bad flag (1, its error line printed)
        return e.code
    return run_main(bench, args)


if __name__ == "__main__":
    sys.exit(main())
