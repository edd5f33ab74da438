"""
dev/bench.py: training throughput of GPT-2 124M on one GPU, gpt2_cuda.py against the PyTorch twin
(dev/torch_reference.py with bf16 autocast, torch.compile, SDPA flash attention and fused AdamW),
measured in the same run on the same GPU.

For each trainer: T = 1024, bf16, the largest power-of-two micro-batch B that fits (found by
probing B = 8, 16, 32, ... until one runs out of memory; each probe is a fresh subprocess, since
an out-of-memory error can leave a process's CUDA state unusable), then `--warmup` untimed and
`--steps` timed training steps on a fixed random batch. Each step is timed on the host from its
start to the read of its loss, which waits for the GPU. Reported: median ms/step, tokens/s, MFU
(llmc.mfu.mfu: llm.c's 6N + 6LCT FLOPs per token over the GPU's dense bf16 peak), and the
device memory in use at the end (total - free: the CUDA context, the allocator's pool, library
workspaces), and the ratio of the two trainers' tokens/s.

What it deliberately is not: a kernel benchmark (dev/cuda/ times kernels one by one) or a
convergence test (the batch is random tokens; only speed is measured).

Run it (`make bench`):
    python dev/bench.py
prints a table such as
    GPT-2 124M (d12), T=1024, bf16 on NVIDIA H100 80GB HBM3
    trainer                      B   ms/step     tok/s    MFU   memory GiB
    gpt2_cuda.py (CuPy)          ..
    PyTorch twin (compile)       ..
    gpt2_cuda.py / PyTorch tokens/s: ...
Without a CUDA GPU it prints one line saying so and exits 2. Other uses:
    python dev/bench.py --only cupy -b 16          # one trainer, a fixed B (no search)
    python dev/bench.py --json dev/results/bench_h100.json
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.join(REPO_ROOT, "dev"))

import gpt2_cpu   # noqa: E402
import gpt2_cuda  # noqa: E402
import llmc.cuda  # noqa: E402
import llmc.mfu  # noqa: E402
from llmc import comm  # noqa: E402

TRAINERS = {"cupy": "gpt2_cuda.py (CuPy)", "torch": "PyTorch twin (compile)"}
OOM_EXIT = 3                      # a worker's exit status when its B does not fit
FIRST_PROBE_BATCH = 8
PROBE_STEPS = 2                   # steps a probe runs: the first allocates everything, the second reuses it
RESULT_PREFIX = "BENCH_RESULT "   # a worker's one line of JSON on stdout
LEARNING_RATE = 3e-4
SEED = 42


# ----------------------------------------------------------------------------
# workers: one trainer, one B, in its own process

def fixed_batch(config, B, T):
    """A fixed random (inputs, targets) pair of (B,T) int32 token ids."""
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, config.vocab_size, (B, T + 1)).astype(np.int32)
    return tokens[:, :-1].copy(), tokens[:, 1:].copy()


def device_memory_and_name(trainer):
    """(bytes of device memory in use, total - free as nvidia-smi counts them; the device's name),
    asked through the worker's own library so that the other one is never loaded."""
    if trainer == "torch":
        import torch
        free, total = torch.cuda.mem_get_info()
        return total - free, torch.cuda.get_device_name()
    import cupy
    free, total = cupy.cuda.runtime.memGetInfo()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return total - free, props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])


def cupy_steps(model_name, B, T, num_steps):
    """Train gpt2_cuda.py's model num_steps steps on one fixed batch; return (seconds per step, losses)."""
    cupy = llmc.cuda.cupy()
    llmc.cuda.select_device(comm.Comm())
    cfg = gpt2_cpu.config_from_descriptor(model_name)
    model = gpt2_cuda.GPT2(cfg, "bf16", master_weights=True, recompute=True)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, SEED).params)
    gpt2_cuda.gpt2_allocate(model, (B, T))
    x, y = fixed_batch(cfg, B, T)
    losses_accum = gpt2_cuda.gpt2_activations(model, B, T)["losses"]
    times, losses = [], []
    for step in range(1, num_steps + 1):
        t0 = time.perf_counter()
        gpt2_cuda.gpt2_zero_grad(model)
        gpt2_cuda.gpt2_forward(model, x, y)
        loss = losses_accum.sum(dtype=np.float64)                 # queued now, read after the update
        gpt2_cuda.gpt2_backward(model)
        norm = gpt2_cuda.gpt2_grad_norm(model)
        gpt2_cuda.gpt2_update(model, LEARNING_RATE, gpt2_cpu.ADAMW_BETA1, gpt2_cpu.ADAMW_BETA2, gpt2_cpu.ADAMW_EPS,
                              0.0, step, 1.0 / norm if norm > 1.0 else 1.0)
        losses.append(float(loss) / (B * T))                      # waits for the whole step
        times.append(time.perf_counter() - t0)
    cupy.cuda.get_current_stream().synchronize()
    return times, losses, cfg


def torch_steps(model_name, B, T, num_steps, compile_model):
    """Train the PyTorch twin num_steps steps (bf16 autocast, flash attention, fused AdamW, and
    torch.compile if compile_model); return (seconds per step, losses)."""
    import torch
    import torch_reference as tr
    cfg = gpt2_cpu.config_from_descriptor(model_name)
    twin = tr.Twin.init(cfg, SEED, dtype=torch.float32, device="cuda", flash=True, autocast=torch.bfloat16,
                        compile=compile_model)
    x, y = fixed_batch(cfg, B, T)
    times = []
    losses = twin.train_steps(((x, y) for _ in range(num_steps)), learning_rate=LEARNING_RATE, num_steps=num_steps,
                              schedule="constant", grad_clip=1.0, fused=True,
                              on_step=lambda step, loss, norm, lr, dt: times.append(dt))
    torch.cuda.synchronize()
    return times, losses, cfg


def is_out_of_memory(error):
    text = f"{type(error).__name__}: {error}".lower()
    return "out of memory" in text or "outofmemory" in text or "alloc_failed" in text


def worker(args):
    """Run one trainer at one B; print RESULT_PREFIX + JSON, or exit OOM_EXIT if it does not fit."""
    num_steps = PROBE_STEPS if args.probe else args.warmup + args.steps
    try:
        if args.worker == "cupy":
            times, losses, cfg = cupy_steps(args.model, args.batch_size, args.seq_len, num_steps)
        else:
            times, losses, cfg = torch_steps(args.model, args.batch_size, args.seq_len, num_steps,
                                             compile_model=not args.probe)
    except Exception as e:                                  # noqa: BLE001: classify, then re-raise
        if is_out_of_memory(e):
            print(f"B={args.batch_size}: out of memory ({type(e).__name__})", file=sys.stderr)
            sys.exit(OOM_EXIT)
        raise
    if not all(math.isfinite(loss) for loss in losses):
        raise RuntimeError(f"{args.worker}: non-finite loss {losses}")
    timed = times[-args.steps:] if not args.probe else times
    num_parameters = gpt2_cpu.num_elements(gpt2_cpu.parameter_shapes(cfg))
    memory, device = device_memory_and_name(args.worker)
    ms = statistics.median(timed) * 1000
    tok_s = args.batch_size * args.seq_len / (ms / 1000)
    util = llmc.mfu.mfu(num_parameters, cfg.num_layers, cfg.channels, args.seq_len, tok_s, device, "bf16", False)
    result = {"trainer": args.worker, "B": args.batch_size, "T": args.seq_len, "ms_median": ms,
              "ms_all": [t * 1000 for t in timed], "tok_s": tok_s, "mfu": util, "memory_bytes": memory,
              "device": device, "losses": losses}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------
# the driver: find B, time, print the table

def run_worker(trainer, B, args, probe):
    """Run a worker subprocess. Returns its result dict, or None if B ran out of memory."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", trainer, "-b", str(B), "-t", str(args.seq_len),
           "-e", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup)] + (["--probe"] if probe else [])
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode == OOM_EXIT:
        return None
    lines = [line for line in r.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{TRAINERS[trainer]} at B={B} failed (exit {r.returncode}):\n  " + "\n  ".join(tail))
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def largest_batch(trainer, args):
    """The largest power of two B <= --max-batch for which a short probe run fits in memory."""
    best, B = None, FIRST_PROBE_BATCH
    while B <= args.max_batch:
        fits = run_worker(trainer, B, args, probe=True) is not None
        print(f"  {TRAINERS[trainer]}: B={B} {'fits' if fits else 'does not fit'}", flush=True)
        if not fits:
            break
        best, B = B, 2 * B
    if best is None:                                  # even the first probe failed: go down
        B = FIRST_PROBE_BATCH // 2
        while B >= 1 and run_worker(trainer, B, args, probe=True) is None:
            B //= 2
        best = B if B >= 1 else None
    if best is None:
        raise RuntimeError(f"{TRAINERS[trainer]}: not even B=1 fits in memory")
    return best


def print_table(results, args):
    first = next(iter(results.values()))
    print(f"\nGPT-2 124M ({args.model}), T={args.seq_len}, bf16 on {first['device']}, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'trainer':26s} {'B':>4s} {'ms/step':>9s} {'tok/s':>10s} {'MFU':>7s} {'memory GiB':>11s}")
    for trainer, r in results.items():
        util = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        print(f"{TRAINERS[trainer]:26s} {r['B']:4d} {r['ms_median']:9.1f} {r['tok_s']:10.0f} {util:>7s} "
              f"{r['memory_bytes'] / 2**30:11.2f}")
    if "cupy" in results and "torch" in results:
        print(f"gpt2_cuda.py / PyTorch tokens/s: {results['cupy']['tok_s'] / results['torch']['tok_s']:.2f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", choices=("both",) + tuple(TRAINERS), default="both", help="which trainer(s) to time")
    p.add_argument("-e", "--model", default="d12", help="model descriptor")
    p.add_argument("-t", "--seq-len", type=int, default=1024, help="sequence length T")
    p.add_argument("-b", "--batch-size", type=int, default=0, help="micro-batch B (0: the largest power of two that fits)")
    p.add_argument("--max-batch", type=int, default=512, help="largest B the search tries")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", choices=tuple(TRAINERS), help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    reason = llmc.cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/bench.py: no CUDA GPU found ({reason}); nothing to benchmark", file=sys.stderr)
        return 2
    if args.worker:
        worker(args)
        return 0
    trainers = tuple(TRAINERS) if args.only == "both" else (args.only,)
    results = {}
    try:
        for trainer in trainers:
            if trainer == "torch":
                try:
                    import torch
                    if not torch.cuda.is_available():
                        raise ImportError("this PyTorch has no CUDA")
                except ImportError as e:
                    print(f"skipping the PyTorch twin: {e}", file=sys.stderr)
                    continue
            B = args.batch_size or largest_batch(trainer, args)
            print(f"timing {TRAINERS[trainer]} at B={B} ...", flush=True)
            result = run_worker(trainer, B, args, probe=False)
            if result is None:
                raise RuntimeError(f"{TRAINERS[trainer]}: B={B} ran out of memory")
            results[trainer] = result
    except RuntimeError as e:
        print(f"dev/bench.py: {e}", file=sys.stderr)
        return 1
    if not results:
        print("dev/bench.py: nothing was timed", file=sys.stderr)
        return 1
    print_table(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "T": args.seq_len, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
