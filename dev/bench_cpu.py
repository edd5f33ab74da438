"""
dev/bench_cpu.py: how fast is gpt2_cpu.py's (or llama3_cpu.py's) training step against PyTorch's on
the CPU, and against its own matmuls alone?

The NumPy trainer should be BLAS-bound: every layer is vectorized, so besides the
matrix products there is only elementwise and reduction work. This benchmark
measures, in the same run, interleaved so that a change in the machine's load hits all three alike:
  1. the median time of a full training step of gpt2_cpu.py (zero_grad, forward,
     backward, grad norm, AdamW update) for the GPT-2 124M shape (d12) at B=4, T=64;
  2. the median time of the same step of the PyTorch twin (dev/torch_reference.py's Twin.train_steps:
     zero_grad, forward, autograd's backward, clipping to norm 1, torch.optim.AdamW) on the same
     model, the same batch, in fp32 with PyTorch's default threads; without torch installed this row
     is left out, saying so;
  3. the median time of the same matrix products alone (same shapes, same NumPy
     calls, random data): the forward and both backward products of every linear
     layer, the attention products and the tied classifier;
and prints the ratios step / PyTorch (goal: <= 0.9) and step / matmuls (goal: <= 1.3), and the peak
resident memory.
With -e llama3:d4 (any of llama3_cpu.py's descriptors, or a Llama 3 model file) the same for llama3_cpu.py's step
against dev/torch_reference_llama3.py's: its
matmuls are the five linear layers of a block (qkv with NKV key/value heads, attproj, the SwiGLU
pair c_fc and c_fc2, c_proj), the attention products over NH heads (after the K/V repeat) and the
untied classifier wlmhead.

Run:  python dev/bench_cpu.py [-e d12 | -e llama3:d4 | -e model.bin] [-b 4] [-t 64] [-n 5] [--no-torch]
Prints a small table (about a minute for d12 on 2 cores); numbers depend on the machine and its load,
so only the ratios travel, and only when measured in one run.
"""

import argparse
import importlib.util
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2_cpu as g  # noqa: E402
import llama3_cpu  # noqa: E402
from llmc.cli import ArgumentParser, is_checkpoint_path, run_main  # noqa: E402
from llmc.formats import is_llama3_model_file  # noqa: E402
from llmc.utils import InputError  # noqa: E402


LEARNING_RATE = 1e-4
GRAD_CLIP = 1.0                        # both steps clip the gradient to this global norm, as the trainers do
GOAL_TORCH = 0.9                       # the NumPy step at most this many PyTorch steps (issue 42)
GOAL_MATMULS = 1.3                     # the NumPy step at most this many times its matmuls alone


def torch_threads():
    """The number of threads PyTorch's CPU operations use (its default: one per core)."""
    import torch
    return torch.get_num_threads()


def median_time(fn, repeats):
    """Median wall time (s) of fn() over `repeats` calls after one warm-up call, and all times."""
    fn()                                        # warm-up: allocation, BLAS thread start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), times


# ----------------------------------------------------------------------------
# the two model families: what differs is the trainer's step and a block's linear layers

class GPT2Family:
    """gpt2_cpu.py: d12 and the other GPT-2 descriptors, or a GPT-2 model file's shape."""
    trainer = "gpt2_cpu.py"
    twin_name = "torch_reference.py"

    def config(self, spec):
        return g.model_config(spec)

    def build(self, spec):
        """The model -e names: the file's (read and checked whole), or a descriptor's random init."""
        return g.build_model(spec, seed=0)

    def forward(self, model, x, y):
        g.gpt2_forward(model, x, y)

    def backward(self, model):
        g.gpt2_backward(model)

    def update(self, model, lr, step, grad_scale):
        g.gpt2_update(model, lr, 0.9, 0.95, 1e-8, 0.0, step, grad_scale)

    def linear_shapes(self, cfg):
        """(OC, C) of each linear layer of a block: qkv, attproj, fc, fcproj."""
        C = cfg.channels
        return [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)]

    def twin(self, model):
        """dev/torch_reference.py's Twin (fp32, CPU) holding a copy of model's parameters."""
        import torch_reference
        return torch_reference.Twin(model.config, [model.P[name] for name, _ in model.param_shapes])


class Llama3Family:
    """llama3_cpu.py: the llama3:dX descriptors (GPT-2's vocabulary), or a Llama 3 model file's shape."""
    trainer = "llama3_cpu.py"
    twin_name = "torch_reference_llama3.py"

    def config(self, spec):
        return llama3_cpu.model_config(spec)

    def build(self, spec):
        """The model -e names: the file's (read and checked whole), or a descriptor's random init."""
        return llama3_cpu.build_model(spec, seed=0)

    def forward(self, model, x, y):
        llama3_cpu.llama3_forward(model, x, y)

    def backward(self, model):
        llama3_cpu.llama3_backward(model)

    def update(self, model, lr, step, grad_scale):
        g.gpt2_update(model, lr, 0.9, 0.95, 1e-8, 0.0, step, grad_scale, decayed=llama3_cpu.DECAYED_PARAMETERS)

    def linear_shapes(self, cfg):
        """(OC, C) of each linear layer of a block: qkv (NH query, NKV key and value heads),
        attproj, c_fc, c_fc2 (the SwiGLU pair), c_proj."""
        C, H = cfg.channels, cfg.hidden_dim
        return [(llama3_cpu.qkv_channels(cfg), C), (C, C), (H, C), (H, C), (C, H)]

    def twin(self, model):
        """dev/torch_reference_llama3.py's Twin (fp32, CPU) holding a copy of model's parameters."""
        import torch_reference_llama3
        return torch_reference_llama3.Twin(model.config, [model.P[name] for name, _ in model.param_shapes])


LLAMA3_PREFIX = "llama3:"


def is_llama3(spec):
    """Whether -e names a Llama 3: a llama3:dX descriptor, or a file that opens with the Llama 3
    model file's magic (any other file is GPT-2's to read, and to refuse in one line)."""
    return spec.startswith(LLAMA3_PREFIX) or (is_checkpoint_path(spec) and is_llama3_model_file(spec))


def model_family(spec):
    """The family that -e names: Llama 3 for llama3:dX or a Llama 3 model file, else GPT-2."""
    return Llama3Family() if is_llama3(spec) else GPT2Family()


def matmul_workload(family, cfg, B, T, rng):
    """A closure running every matrix product of one training step with the step's shapes."""
    C, L, NH, Vp = cfg.channels, cfg.num_layers, cfg.num_heads, cfg.padded_vocab_size
    HS = C // NH
    f32 = np.float32
    r = lambda *s: rng.standard_normal(s, dtype=f32)  # noqa: E731
    linear = family.linear_shapes(cfg)                   # (OC, C) of each linear layer of a block
    # every layer gets its own weights, inputs and gradients, as in the real step: reusing one
    # set would keep it in cache and time the products faster than the step can ever run them
    W = [[r(oc, c) for oc, c in linear] for _ in range(L)]
    X = [[r(B * T, c) for _, c in linear] for _ in range(L)]
    D = [[r(B * T, oc) for oc, _ in linear] for _ in range(L)]
    q, k, v = r(B, NH, T, HS), r(B, NH, T, HS), r(B, NH, T, HS)
    att = r(B, NH, T, T)
    wte, lnf, dlogits = r(Vp, C), r(B * T, C), r(B * T, Vp)

    def run():
        for l in range(L):
            for w, x, d in zip(W[l], X[l], D[l]):
                x @ w.T                          # forward
                d @ w                            # dinp
                d.T @ x                          # dweight
            q @ k.transpose(0, 1, 3, 2)          # forward QK^T
            att @ v                              # forward AV
            att @ v                              # backward: datt = dout v^T (same shape of work)
            att.transpose(0, 1, 3, 2) @ q        # dv
            att @ k                              # dq
            att.transpose(0, 1, 3, 2) @ q        # dk
        lnf @ wte.T                              # classifier forward (Llama 3: its own wlmhead, same shape)
        dlogits @ wte                            # dlnf
        dlogits.T @ lnf                          # dwte
    return run


def parse_args(argv=None):
    """The flags; a bad one is one `error:` line and exit 1 (llmc.argparser.ArgumentParser)."""
    p = ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-e", "--model", default="d12", help="a GPT-2 descriptor (d12) or Llama 3's (llama3:d4)")
    p.add_argument("-b", "--batch-size", type=int, default=4)
    p.add_argument("-t", "--seq-len", type=int, default=64)
    p.add_argument("-n", "--repeats", type=int, default=5)
    p.add_argument("--no-torch", action="store_true", help="leave out PyTorch's step (it is timed when torch imports)")
    return p.parse_args(argv)


def check_batch(B, T, cfg):
    """Raise InputError unless B >= 1 and 1 <= T <= the model's maxT (also bench_emulator.py's check)."""
    if B < 1 or not 1 <= T <= cfg.max_seq_len:
        raise InputError(f"-b {B} -t {T}: B must be positive and T in [1, {cfg.max_seq_len}]")


def check_args(args):
    """The model's config for args, or InputError for flags that cannot be benchmarked."""
    cfg = model_family(args.model).config(args.model)
    if args.repeats < 1:
        raise InputError(f"-n {args.repeats}: the number of repeats must be at least 1")
    check_batch(args.batch_size, args.seq_len, cfg)
    return cfg


def torch_unavailable_reason(args):
    """None when PyTorch's step is to be timed, else why not, in words (--no-torch, or no torch)."""
    if args.no_torch:
        return "--no-torch"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch, or `make test`, installs it)"
    return None


def bench(args):
    """Time the step, PyTorch's step and the matmuls, and print the table. Raises InputError for bad flags."""
    cfg = check_args(args)
    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    family = model_family(args.model)
    model = family.build(args.model)
    x = rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
    y = rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
    no_torch = torch_unavailable_reason(args)
    twin = None if no_torch else family.twin(model)      # before the first update: the same parameters
    step_no = [0]
    phases = {}

    def timed_step():
        t = [time.perf_counter()]
        step_no[0] += 1
        g.gpt2_zero_grad(model); t.append(time.perf_counter())
        family.forward(model, x, y); t.append(time.perf_counter())
        family.backward(model); t.append(time.perf_counter())
        norm = g.gpt2_grad_norm(model); t.append(time.perf_counter())
        family.update(model, LEARNING_RATE, step_no[0], min(1.0, GRAD_CLIP / norm)); t.append(time.perf_counter())
        for name, a, b in zip(("zero_grad", "forward", "backward", "grad_norm", "update"), t, t[1:]):
            phases.setdefault(name, []).append(b - a)

    def torch_step():
        twin.train_steps([(x, y)], learning_rate=LEARNING_RATE, num_steps=1, schedule="constant",
                         weight_decay=0.0, grad_clip=GRAD_CLIP)

    mm = matmul_workload(family, cfg, B, T, rng)
    # interleave the measurements so drift in machine load hits them alike; one warm-up of each first
    # (allocation, the AdamW moments, BLAS and OpenMP thread start)
    runs = {"step": timed_step, "torch": torch_step, "matmuls": mm}
    if twin is None:
        del runs["torch"]
    times = {name: [] for name in runs}
    for fn in runs.values():
        fn()
    phases.clear()
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    threads = f", PyTorch (dev/{family.twin_name}) on {torch_threads()} threads" if twin is not None else ""
    print(f"{family.trainer} step, {args.model} ({model.num_parameters:,} params), B={B} T={T}, {args.repeats} repeats, "
          f"{os.cpu_count()} cores{threads}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'what':<26}{'median ms':>12}")
    print(f"{'training step':<26}{med['step'] * 1e3:>12.1f}")
    for name, ts in phases.items():
        print(f"{'  ' + name:<26}{np.median(ts) * 1e3:>12.1f}")
    if twin is not None:
        print(f"{'PyTorch step':<26}{med['torch'] * 1e3:>12.1f}")
    print(f"{'matmuls alone':<26}{med['matmuls'] * 1e3:>12.1f}")
    if twin is not None:
        print(f"ratio step / PyTorch: {med['step'] / med['torch']:.2f}   (goal <= {GOAL_TORCH})")
    else:
        print(f"PyTorch's step not timed: {no_torch}")
    print(f"ratio step / matmuls: {med['step'] / med['matmuls']:.2f}   (goal <= {GOAL_MATMULS})")
    print(f"tokens/s: {B * T / med['step']:.0f}   peak resident memory: {peak_mib:.0f} MiB")


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
