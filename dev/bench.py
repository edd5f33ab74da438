"""
dev/bench.py: training throughput of GPT-2 124M on one GPU, gpt2_cuda.py against the PyTorch twin
(dev/torch_reference.py with bf16 autocast, torch.compile, SDPA flash attention and fused AdamW),
measured in the same run on the same GPU; with -e llama3:dX, llama3_cuda.py against
dev/torch_reference_llama3.py (below).

For each micro-batch size B of --batch-sizes (default 16, 32, 64) and each trainer: T = 1024,
bf16, `--warmup` untimed and `--steps` timed training steps on a fixed random batch, each in a
fresh subprocess (an out-of-memory error can leave a process's CUDA state unusable; a B that does
not fit is reported as such). gpt2_cuda.py's step is its train()'s: all on the device, its loss
read a step late, after the next step is queued; each step is timed on the host from the read of
the step before to the read of its own loss (which waits for the GPU), so a step's time is its
period with the next one queued behind it, the host's work overlapped as in training. The twin's
and llama3_cuda.py's steps are timed from their start to the read of their loss. Reported: median ms/step, tokens/s, MFU (llmc.mfu.mfu: llm.c's
6N + 6LCT FLOPs per token over the GPU's dense bf16 peak), the device memory in use at the end
(total - free: the CUDA context, the allocator's pool, library workspaces), and the ratio of the
two trainers' tokens/s. Our trainer's options (--attention, --cuda-graph, --cublaslt,
--residual-epilogue, --autotune, --gelu-fusion, --bias-grad-epilogue, --ln-bias-grad, -r, --cudnn-deterministic, --classifier-chunk) are passed through, with the trainer's defaults; --compile 0 runs the twin without torch.compile (where it cannot build: no C compiler).
Every B of ours is timed before the twin's, and each (trainer, B) prints its line as soon as it is
done: a worker that fails (a traceback, an error) is one line saying so, and the rest still run, so
a bench that is cut short or fails at its end keeps the numbers it has (exit status 1 if any failed).
Then, for gpt2_cuda.py, a breakdown of one step by kernel (BREAKDOWN_STEPS more steps launched
kernel by kernel, CUDA events around every launch, cuBLAS, cuBLASLt and cuDNN call, each call's
median over those steps; the events themselves cost a little), largest first. It ends with
one line per configuration, in a fixed form that later runs can be compared with:
    bench: model=d12 T=1024 B=16 precision=bf16 ours=<tok/s> torch=<tok/s> ratio=<ours/torch> mfu=<%> mem_ours_gib=<x> mem_torch_gib=<y>
(`n/a` where a trainer did not run or B did not fit). `--search` also probes for the largest
power-of-two B that fits each trainer (B = 8, 16, 32, ...), as the first version of this script did.
`--candidate OP:VERSION` (e.g. classifier:5) times our step with a dev/cuda candidate kernel in
place of the production one it would replace (llmc.cuda.replace_kernel): only a candidate marked
drop_in (dev/cuda/common.Version), whose kernels take the production kernels' arguments, grids,
blocks and shared memory as they are; what it would gain in the step, measured before it is adopted.

Llama 3 (`-e llama3:d4`, any llama3_cpu.py descriptor llama3:dX): llama3_cuda.py's training step as
its train() runs it (bf16 with fp32 master weights; zero_grad, forward + backward
(llama3_cuda.llama3_micro_batch, a CUDA graph with --cuda-graph 1), the global norm, AdamW on the
clipped gradient; cuBLAS, its only matmul backend; --attention as for GPT-2) against
dev/torch_reference_llama3.py's model and training step (Twin.train_steps) with what that twin has:
it has no autocast, so its parameters and AdamW state are bf16 (no fp32 master weights); it has no
fused AdamW, so torch.optim.AdamW runs unfused; SDPA flash attention; --compile 1 compiles its module
with torch.compile as the GPT-2 twin compiles its own (inductor leaves its complex-number RoPE
uncompiled). The heading of the table says so. --cublaslt 1 is refused in one `error:` line
(llama3_cuda.py has no cuBLASLt backend). The MFU uses the same 6N + 6LCT per token, which holds
for grouped-query attention too: the attention core's FLOPs are those of all NH query heads (the
NKV key/value heads only shrink the qkv projection, which N counts). N is every parameter of
llama3_cpu.parameter_shapes except wte: llm.c's formula counts GPT-2's wte because it is also the
classifier, but Llama 3's untied wte is only looked up (its classifier, wlmhead, is counted);
counting it would overstate the MFU 1.74x at llama3:d4, T=1024, where wte is 44% of all parameters.

What it deliberately is not: a kernel benchmark (dev/cuda/ times kernels one by one) or a
convergence test (the batch is random tokens; only speed is measured).

Run it (`make bench`):
    python dev/bench.py
prints one line per (trainer, B) as it completes (trainer, B, ms/step, tok/s, MFU, memory GiB),
then the table of them all, the breakdowns and the summary lines.
Without a CUDA GPU it prints one line saying so and exits 2. Other uses:
    python dev/bench.py --only cupy -b 16          # one trainer, one B
    python dev/bench.py --attention flash --cuda-graph 0
    python dev/bench.py -b 64 --residual-epilogue 1 --classifier-chunk 4
    python dev/bench.py --only cupy -b 16 --autotune 8   # and what each GEMM's and attention graph's tuning found
    python dev/bench.py --only cupy -b 16 --gelu-fusion 0          # the GELU in our kernels, not the GEMMs'
    python dev/bench.py --only cupy -b 16 -r 1                     # recompute GELU's output (llm.c's default)
    python dev/bench.py --only cupy -b 16 --bias-grad-epilogue 0   # plain dweight GEMMs, the bias gradients ours
    python dev/bench.py --only cupy -b 16 --bias-grad-epilogue 2   # ... but the fc's in the DGELU epilogue
    python dev/bench.py --only cupy -b 16 --ln-bias-grad 1       # the projections' bias gradients by the LayerNorms
    python dev/bench.py --only cupy -b 16 --candidate classifier:5  # dev/cuda's classifier candidate 5 in the step
    python dev/bench.py --cublaslt 1 --compile 0   # ours through cuBLASLt; the twin eager
    python dev/bench.py --json dev/results/bench_h100.json
    python dev/bench.py -e llama3:d4                # llama3_cuda.py against dev/torch_reference_llama3.py
    python dev/bench.py -e llama3:d4 --pad-vocab 1  # the same, llama3_cuda.py's classifier over Vp = 50304
"""

import argparse
import functools
import importlib.util
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
import llama3_cpu  # noqa: E402
import llama3_cuda  # noqa: E402
import llmc.attention  # noqa: E402
import llmc.cuda  # noqa: E402
import llmc.gpu_cli  # noqa: E402
import llmc.matmul  # noqa: E402
import llmc.mfu  # noqa: E402
from llmc import comm  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402

TRAINERS = {"cupy": "gpt2_cuda.py (CuPy)", "torch": "PyTorch twin"}     # timed in this order
LLAMA3_TRAINERS = {"cupy": "llama3_cuda.py (CuPy)", "torch": "PyTorch twin"}
LLAMA3_PREFIX = "llama3:"         # -e llama3:dX (a llama3_cpu.py descriptor) benches Llama 3, else GPT-2
OOM_EXIT = 3                      # a worker's exit status when its B does not fit
FIRST_PROBE_BATCH = 8
PROBE_STEPS = 2                   # steps a probe runs: the first allocates everything, the second reuses it
BREAKDOWN_STEPS = 3               # eager steps the per-call breakdown takes the median of
RESULT_PREFIX = "BENCH_RESULT "   # a worker's one line of JSON on stdout
LEARNING_RATE = 3e-4
GRAD_CLIP = 1.0                   # both trainers' default: the step scales the gradient by 1/norm above it
SEED = 42


# ----------------------------------------------------------------------------
# the two model families: -e llama3:dX is Llama 3 (llama3_cpu.py's descriptors), anything else GPT-2

def is_llama3(model_name):
    return model_name.startswith(LLAMA3_PREFIX)


def num_parameters(model_name, cfg):
    """N of the MFU's 6N: the parameters whose matmuls a token goes through. GPT-2: every parameter
    (llm.c's count; its wte is also the classifier). Llama 3: every parameter but wte, which is only
    looked up (its untied classifier wlmhead is counted)."""
    if is_llama3(model_name):
        return gpt2_cpu.num_elements([(name, shape) for name, shape in llama3_cpu.parameter_shapes(cfg)
                                      if name != "wte"])
    return gpt2_cpu.num_elements(gpt2_cpu.parameter_shapes(cfg))


def trainer_names(model_name):
    """trainer -> the name its lines carry."""
    return LLAMA3_TRAINERS if is_llama3(model_name) else TRAINERS


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


def cupy_matmul(use_cublaslt, residual_epilogue=0, autotune=1, gelu_fusion=2, bias_grad_epilogue=1):
    """The linear layers' backend of the bench's model for --cublaslt 0, 1 or auto (and
    --residual-epilogue, --autotune, --gelu-fusion, --bias-grad-epilogue), as the trainer chooses it
    (llmc.matmul.matmul_backend), except that 1
    raises RuntimeError where cuBLASLt is unavailable, so that the bench never times cuBLAS under
    cuBLASLt's name."""
    matmul, fallback = llmc.matmul.matmul_backend(use_cublaslt, residual_epilogue=residual_epilogue, autotune=autotune,
                                                  gelu_fusion=gelu_fusion, bias_grad_epilogue=bias_grad_epilogue)
    if fallback and use_cublaslt == 1:
        raise RuntimeError(fallback)
    return matmul


DEV_CUDA = os.path.join(REPO_ROOT, "dev", "cuda")


def load_by_path(name, path):
    """The Python file at `path` run as a module named `name` (not put in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dev_cuda_common():
    """dev/cuda/common.py, the progressions' harness, as the module `common` their `import common` finds
    (loaded by path: dev/data/ has a common.py too, which a process may have imported under that name)."""
    common = sys.modules.get("common")
    if common is None or os.path.dirname(os.path.abspath(getattr(common, "__file__", None) or "")) != DEV_CUDA:
        sys.modules["common"] = common = load_by_path("common", os.path.join(DEV_CUDA, "common.py"))
    return common


@functools.lru_cache(maxsize=None)
def dev_cuda_script(op):
    """dev/cuda/<op>.py loaded as a module (its PROGRESSIONS), with dev/cuda/common.py as its `common`;
    once per process (the parser, the banner and the worker all ask for it)."""
    dev_cuda_common()
    return load_by_path(f"dev_cuda_{op}", os.path.join(DEV_CUDA, f"{op}.py"))


def candidate_kernels(spec):
    """--candidate OP:N -> [(file, name, kernel)]: version N of dev/cuda/OP.py, a candidate marked
    drop_in (its kernels launched exactly as the production version's, position by position), and
    each of its kernels that differs from production's, which replaces `name` of kernels/<file>.cu
    in the trainer. Raises ValueError (one line) for anything else."""
    op, colon, number = spec.partition(":")
    if not colon or not number.isdigit() or not op.isidentifier() or not os.path.isfile(os.path.join(DEV_CUDA, f"{op}.py")) \
            or op in ("common", "run_all", "nvrtc_compile"):
        raise ValueError(f"--candidate {spec}: OP:VERSION of a dev/cuda progression, e.g. classifier:5")
    script = dev_cuda_script(op)
    versions = [(progression, version) for progression in getattr(script, "PROGRESSIONS", ())
                for version in progression.versions if version.number == int(number)]
    if not versions:
        raise ValueError(f"--candidate {spec}: dev/cuda/{op}.py has no version {number}")
    common = dev_cuda_common()
    drop_ins = [(p, v) for p, v in versions if common.is_candidate(v) and v.drop_in]
    if len(drop_ins) != 1:
        raise ValueError(f"--candidate {spec}: version {number} of dev/cuda/{op}.py is not a drop-in candidate (a "
                         f"candidate marked drop_in: launched exactly as the production kernels)")
    progression, version = drop_ins[0]
    production = common.production_version(progression).kernels
    assert len(production) == len(version.kernels), f"{spec}: a drop-in has the production version's kernels"
    return [(os.path.basename(ours.path)[:-len(".cu")], ours.name, theirs)
            for ours, theirs in zip(production, version.kernels) if theirs != ours]


def install_candidates(specs):
    """Each --candidate's kernels launched in place of the production ones they replace (llmc.cuda.replace_kernel)."""
    for spec in specs:
        for file, name, kernel in candidate_kernels(spec):
            common = dev_cuda_common()
            llmc.cuda.replace_kernel(file, name, lambda precision, kernel=kernel: common.load_function(kernel, precision))


def cupy_model(model_name, B, T, attention, use_cublaslt="auto", residual_epilogue=0, classifier_chunk=0,
               autotune=1, gelu_fusion=2, recompute=0, cudnn_deterministic=True, bias_grad_epilogue=1,
               ln_bias_grad=False):
    """gpt2_cuda.py's model in bf16 with its buffers for (B,T), on a created stream (a CUDA graph
    cannot be captured on the legacy default stream), and the fixed batch."""
    cupy = llmc.cuda.cupy()
    llmc.cuda.select_device(comm.Comm())
    stream = cupy.cuda.Stream()
    stream.use()
    cfg = gpt2_cpu.config_from_descriptor(model_name)
    path, fallback = llmc.attention.resolve_attention(attention, "bf16", cfg.channels // cfg.num_heads)
    if fallback:
        print(f"dev/bench.py: {fallback}", file=sys.stderr)
    model = gpt2_cuda.GPT2(cfg, "bf16", master_weights=True, recompute=recompute, attention=path,
                           matmul=cupy_matmul(use_cublaslt, residual_epilogue, autotune, gelu_fusion, bias_grad_epilogue),
                           classifier_chunk=classifier_chunk, autotune=autotune, cudnn_deterministic=cudnn_deterministic,
                           ln_bias_grad=ln_bias_grad)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, SEED).params)
    llmc.cuda.load_modules(gpt2_cuda.kernel_files(model), model.precision)
    gpt2_cuda.gpt2_allocate(model, (B, T))
    model.bench_stream = stream                                   # kept alive with the model
    return model, cfg, fixed_batch(cfg, B, T)


def llama3_cupy_model(model_name, B, T, attention, precision="bf16", pad_vocab=False):
    """llama3_cuda.py's model as its setup_model builds it (bf16 with fp32 master weights, cuBLAS:
    its only matmul backend; precision "fp32" for the emulated device's check; pad_vocab: its
    --pad-vocab 1, the classifier over Vp), llama3_cpu.py's init, its buffers for (B,T), on a
    created stream, and the fixed batch."""
    cupy = llmc.cuda.cupy()
    llmc.cuda.select_device(comm.Comm())
    stream = cupy.cuda.Stream()
    stream.use()
    cfg = llama3_cpu.model_config(model_name)
    path, fallback = llmc.attention.resolve_attention(attention, precision, cfg.head_size)
    if fallback:
        print(f"dev/bench.py: {fallback}", file=sys.stderr)
    model = llama3_cuda.Llama3(cfg, precision, path, llmc.matmul.Cublas(), pad_vocab=pad_vocab)
    llama3_cuda.upload_parameters(model, llama3_cpu.llama3_init(cfg, SEED).params)
    llmc.cuda.load_modules(llama3_cuda.KERNEL_FILES + model.attention.kernel_files, model.precision)
    llama3_cuda.llama3_activations(model, B, T)
    model.bench_stream = stream
    return model, cfg, fixed_batch(cfg, B, T)


def llama3_cupy_step(model, x, y, step, cuda_graph):
    """One training step of llama3_cuda.py as its train() runs it (one micro-batch): zero_grad,
    forward + backward (eager, or replayed as a CUDA graph), the global norm, AdamW (weight decay
    0) on the clipped gradient; returns the summed loss as a device scalar."""
    B, T = x.shape
    A = llama3_cuda.llama3_activations(model, B, T)
    gpt2_cuda.gpt2_zero_grad(model)
    llama3_cuda.llama3_micro_batch(model, x, y, 1.0, cuda_graph)
    loss = A["losses"].sum(dtype=np.float64)                      # queued now, read after the update
    norm = gpt2_cuda.gpt2_grad_norm(model)
    llama3_cuda.llama3_update(model, LEARNING_RATE, gpt2_cpu.ADAMW_BETA1, gpt2_cpu.ADAMW_BETA2, gpt2_cpu.ADAMW_EPS,
                              0.0, step, GRAD_CLIP / norm if norm > GRAD_CLIP else 1.0)
    return loss


UPDATE = gpt2_cuda.StepUpdate(gpt2_cpu.ADAMW_BETA1, gpt2_cpu.ADAMW_BETA2, gpt2_cpu.ADAMW_EPS, 0.0, GRAD_CLIP)


def cupy_step(model, x, y, step, cuda_graph, readback):
    """One training step of gpt2_cuda.py as its train() runs it (one micro-batch, all on the
    device: the per-step values uploaded, zero_grad, forward, backward, the norm, its clipping
    factor and AdamW, as one CUDA graph with cuda_graph), its loss and norm copied back at its end
    without waiting. Returns readback.queue's (slot, event) for readback.read."""
    B, T = x.shape
    gpt2_cuda.adamw_prepare(model, LEARNING_RATE, UPDATE.beta1, UPDATE.beta2, step)
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph, first=True, update=UPDATE)
    return readback.queue(gpt2_cuda.gpt2_activations(model, B, T)["loss_accum"], model.norm)


def cupy_steps(model_name, B, T, num_steps, attention="auto", cuda_graph=False, use_cublaslt="auto",
               residual_epilogue=0, classifier_chunk=0, pad_vocab=False, autotune=1, gelu_fusion=2, recompute=0,
               cudnn_deterministic=True, bias_grad_epilogue=1, ln_bias_grad=False):
    """Train gpt2_cuda.py's model (llama3_cuda.py's for -e llama3:dX, pad_vocab its --pad-vocab)
    num_steps steps on one fixed batch; return (seconds per step, losses, config, the model, the batch). gpt2_cuda.py's steps
    are read a step late, as its train() logs them: step s is queued before step s-1's loss is
    read, and a step's time runs from the read of the one before to the read of its own."""
    if cuda_graph:
        reason = llmc.cuda.cuda_graph_unavailable_reason()
        if reason:                                                # the worker's one failure line
            raise RuntimeError(f"--cuda-graph 1: {reason}")
    if is_llama3(model_name):
        model, cfg, (x, y) = llama3_cupy_model(model_name, B, T, attention, pad_vocab=pad_vocab)
        times, losses = [], []
        for step in range(1, num_steps + 1):
            t0 = time.perf_counter()
            loss = llama3_cupy_step(model, x, y, step, cuda_graph)
            losses.append(float(loss) / (B * T))                  # waits for the whole step
            times.append(time.perf_counter() - t0)
        llmc.cuda.cupy().cuda.get_current_stream().synchronize()
        return times, losses, cfg, model, (x, y)
    model, cfg, (x, y) = cupy_model(model_name, B, T, attention, use_cublaslt, residual_epilogue, classifier_chunk,
                                    autotune, gelu_fusion, recompute, cudnn_deterministic, bias_grad_epilogue,
                                    ln_bias_grad)
    readback = gpt2_cuda.StepReadback(B * T)
    times, losses, pending = [], [], None
    last_read = time.perf_counter()
    for step in range(1, num_steps + 2):                          # the pass after the last reads it
        queued = cupy_step(model, x, y, step, cuda_graph, readback) if step <= num_steps else None
        if pending is not None:
            loss_sum, _ = readback.read(*pending, B * T)          # waits for the step before this one
            now = time.perf_counter()
            losses.append(loss_sum / (B * T))
            times.append(now - last_read)
            last_read = now
        pending = queued
    return times, losses, cfg, model, (x, y)


# ----------------------------------------------------------------------------
# where one step's time goes: CUDA events around every device call

def summarize_breakdown(records):
    """records: (name, ms) per device call of one step -> [(name, calls, total ms)], largest
    total first (ties by name, so the order is reproducible)."""
    totals = {}
    for name, ms in records:
        calls, total = totals.get(name, (0, 0.0))
        totals[name] = (calls + 1, total + ms)
    return sorted(((name, calls, total) for name, (calls, total) in totals.items()), key=lambda r: (-r[2], r[0]))


def format_breakdown(rows, step_ms, top=20):
    """The breakdown table: name, calls, ms, share of the summed device time and of the step."""
    device_ms = sum(total for _, _, total in rows)
    lines = [f"{'kernel / library call':44s} {'calls':>5s} {'ms':>8s} {'% device':>8s} {'% step':>7s}"]
    for name, calls, total in rows[:top]:
        lines.append(f"{name:44s} {calls:5d} {total:8.3f} {100 * total / device_ms:8.1f} {100 * total / step_ms:7.1f}")
    if len(rows) > top:
        rest = sum(total for _, _, total in rows[top:])
        lines.append(f"{f'({len(rows) - top} more)':44s} {'':5s} {rest:8.3f} {100 * rest / device_ms:8.1f} "
                     f"{100 * rest / step_ms:7.1f}")
    lines.append(f"{'sum of device calls':44s} {'':5s} {device_ms:8.3f} {100.0:8.1f} {100 * device_ms / step_ms:7.1f}")
    return lines


def kernel_breakdown(model, x, y, step, repeats=1):
    """Run `repeats` steps (from `step` on) kernel by kernel (no graph) with a pair of CUDA events
    around each kernel launch (llmc.cuda.launch), cuBLAS call (llmc.cuda.gemm), cuBLASLt call
    (llmc.cublaslt.matmul_cublaslt, named with its epilogue) and cuDNN call; return
    summarize_breakdown of one step's times, each call's total the median over the steps
    (median_breakdown)."""
    cupy = llmc.cuda.cupy()
    events = []

    def timed(name_of, fn):
        def call(*args, **kwargs):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            events.append((name_of(*args), start, end))
            return out
        return call

    launch, gemm = llmc.cuda.launch, llmc.cuda.gemm
    originals = [(llmc.cuda, "launch", launch), (llmc.cuda, "gemm", gemm)]
    llmc.cuda.launch = timed(lambda file, precision, name, *rest: f"{file}.cu:{name}", launch)
    llmc.cuda.gemm = timed(lambda transa, transb, m, n, k, *rest: f"cuBLAS gemm {m}x{n}x{k}", gemm)
    if model.matmul.name == "cuBLASLt":            # the first H100 run's breakdown left these out
        from llmc import cublaslt
        originals.append((cublaslt, "matmul_cublaslt", cublaslt.matmul_cublaslt))
        cublaslt.matmul_cublaslt = timed(lambda d, a, b, m, n, k, transa, transb, epilogue=cublaslt.NO_EPILOGUE,
                                         *rest: f"cuBLASLt gemm {m}x{n}x{k} {epilogue.name}", cublaslt.matmul_cublaslt)
    if model.attention.name == "flash":            # its kernels launch with dynamic shared memory, not cuda.launch
        originals.append((llmc.attention, "launch_with_shared_memory", llmc.attention.launch_with_shared_memory))
        llmc.attention.launch_with_shared_memory = timed(lambda kernel, *rest: f"flash_attention.cu:{kernel.name}",
                                                         llmc.attention.launch_with_shared_memory)
    if model.attention.name == "cudnn":
        from llmc import cudnn_attention
        for fn_name in ("attention_forward_cudnn", "attention_backward_cudnn"):
            fn = getattr(cudnn_attention, fn_name)
            originals.append((cudnn_attention, fn_name, fn))
            setattr(cudnn_attention, fn_name, timed(lambda *args, n=fn_name: f"cuDNN {n}", fn))
    per_step = []
    try:
        for s in range(step, step + repeats):
            events.clear()
            if isinstance(model, llama3_cuda.Llama3):
                float(llama3_cupy_step(model, x, y, s, cuda_graph=False))
            else:
                readback = gpt2_cuda.StepReadback(x.size)
                readback.read(*cupy_step(model, x, y, s, False, readback), x.size)
            per_step.append(summarize_breakdown([(name, cupy.cuda.get_elapsed_time(start, end))
                                                 for name, start, end in events]))
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)
    return median_breakdown(per_step)


def median_breakdown(per_step):
    """summarize_breakdown's rows of several steps -> one step's rows [(name, calls, total ms)], each
    call's total the median of its per-step totals (a call missing from a step counts 0 ms there),
    its calls the first step's; largest first (ties by name). One step is one sample per call; the
    median of a few is steadier against a stray slow call. (In the fifth H100 session the three runs
    with the default options agreed within 2% per large GEMM, while the flash and epilogue runs of
    the same call timed the same fc GEMM up to 24% faster: what runs around a GEMM matters, and the
    median does not remove that; dev/bench_compare.py shows such moves.)"""
    calls = {}
    for rows in per_step:
        for name, n, _ in rows:
            calls.setdefault(name, n)
    totals = {name: statistics.median([next((t for n_, _, t in rows if n_ == name), 0.0) for rows in per_step])
              for name in calls}
    return sorted(((name, calls[name], totals[name]) for name in calls), key=lambda r: (-r[2], r[0]))


def torch_steps(model_name, B, T, num_steps, compile_model, device="cuda"):
    """Train the PyTorch twin num_steps steps (bf16 autocast, flash attention, fused AdamW, and
    torch.compile if compile_model) on `device` (the bench's "cuda"; a test's "cpu"); return
    (seconds per step, losses, config)."""
    import torch
    import torch_reference as tr
    cfg = gpt2_cpu.config_from_descriptor(model_name)
    twin = tr.Twin.init(cfg, SEED, dtype=torch.float32, device=device, flash=True, autocast=torch.bfloat16,
                        compile=compile_model)
    x, y = fixed_batch(cfg, B, T)
    times = []
    losses = twin.train_steps(((x, y) for _ in range(num_steps)), learning_rate=LEARNING_RATE, num_steps=num_steps,
                              schedule="constant", grad_clip=1.0, fused=True,
                              on_step=lambda step, loss, norm, lr, dt: times.append(dt))
    if device == "cuda":
        torch.cuda.synchronize()
    return times, losses, cfg


def torch_llama3_steps(model_name, B, T, num_steps, compile_model, device="cuda"):
    """Train dev/torch_reference_llama3.py's model num_steps steps with its own training step
    (Twin.train_steps: torch.optim.AdamW; the global norm summed in float64, one read to the host
    per parameter tensor; clipped at GRAD_CLIP)
    and what that twin has: parameters and AdamW state in bf16 (it has no autocast, so no fp32
    master weights), SDPA flash attention, the optimizer unfused (it has no fused option);
    torch.compile on its module if compile_model, as the GPT-2 twin compiles its own; on `device`
    (the bench's "cuda"; a test's "cpu"). Returns (seconds per step, losses, config)."""
    import torch
    import torch_reference_llama3 as tr
    cfg = llama3_cpu.model_config(model_name)
    twin = tr.Twin.init(cfg, SEED, dtype=torch.bfloat16, device=device, flash=True)
    if compile_model:
        twin.model = torch.compile(twin.model)
    x, y = fixed_batch(cfg, B, T)
    times = []
    losses = twin.train_steps(((x, y) for _ in range(num_steps)), learning_rate=LEARNING_RATE, num_steps=num_steps,
                              schedule="constant", grad_clip=GRAD_CLIP,
                              on_step=lambda step, loss, norm, lr, dt: times.append(dt))
    if device == "cuda":
        torch.cuda.synchronize()
    return times, losses, cfg


def cuda_graph_of(args):
    """Whether ours runs as CUDA graphs: --cuda-graph as gpt2_cuda.py reads it (auto: 1 on a GPU);
    llama3_cuda.py's flag has no auto (0 unless 1 is given)."""
    if is_llama3(args.model):
        return args.cuda_graph == 1
    return llmc.gpu_cli.cuda_graph_choice(args.cuda_graph)


def is_out_of_memory(error):
    text = f"{type(error).__name__}: {error}".lower()
    return "out of memory" in text or "outofmemory" in text or "alloc_failed" in text


def worker(args):
    """Run one trainer at one B; print RESULT_PREFIX + JSON, or exit OOM_EXIT if it does not fit."""
    num_steps = PROBE_STEPS if args.probe else args.warmup + args.steps
    breakdown = None
    try:
        if args.worker == "cupy":
            install_candidates(args.candidate)
            times, losses, cfg, model, (x, y) = cupy_steps(args.model, args.batch_size, args.seq_len, num_steps,
                                                           args.attention, cuda_graph_of(args), args.cublaslt,
                                                           args.residual_epilogue, args.classifier_chunk,
                                                           bool(args.pad_vocab), args.autotune,
                                                           args.gelu_fusion, args.recompute,
                                                           bool(args.cudnn_deterministic), args.bias_grad_epilogue,
                                                           bool(args.ln_bias_grad))
            if not args.probe:
                breakdown = kernel_breakdown(model, x, y, num_steps + 1, BREAKDOWN_STEPS)
        else:
            steps = torch_llama3_steps if is_llama3(args.model) else torch_steps
            times, losses, cfg = steps(args.model, args.batch_size, args.seq_len, num_steps,
                                       compile_model=bool(args.compile) and not args.probe)
    except Exception as e:                                  # noqa: BLE001: classify, then re-raise
        if is_out_of_memory(e):
            print(f"B={args.batch_size}: out of memory ({type(e).__name__})", file=sys.stderr)
            sys.exit(OOM_EXIT)
        raise
    if not all(math.isfinite(loss) for loss in losses):
        raise RuntimeError(f"{args.worker}: non-finite loss {losses}")
    timed = times[-args.steps:] if not args.probe else times
    memory, device = device_memory_and_name(args.worker)
    ms = statistics.median(timed) * 1000
    tok_s = args.batch_size * args.seq_len / (ms / 1000)
    util = llmc.mfu.mfu(num_parameters(args.model, cfg), cfg.num_layers, cfg.channels, args.seq_len, tok_s, device,
                        "bf16", False)
    result = {"trainer": args.worker, "B": args.batch_size, "T": args.seq_len, "ms_median": ms,
              "ms_all": [t * 1000 for t in timed], "tok_s": tok_s, "mfu": util, "memory_bytes": memory,
              "device": device, "losses": losses, "breakdown": breakdown}
    if args.worker == "cupy":                               # what auto chose, for the breakdown's heading
        result.update(attention=model.attention.name, matmul=model.matmul.name, cuda_graph=cuda_graph_of(args))
        if args.autotune > 1:                      # what the autotuning found, product by product
            result["autotune"] = gpt2_cuda.tuning_report(model)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------
# the driver: find B, time, print the table

class WorkerFailed(RuntimeError):
    """A worker ended without a result (not out of memory); the message is one line: its exit
    status and its last line of output."""


def worker_command(trainer, B, args, probe):
    """The command line of one worker: this file with --worker and the bench's options."""
    return [sys.executable, os.path.abspath(__file__), "--worker", trainer, "-b", str(B), "-t", str(args.seq_len),
            "-e", args.model, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--attention", args.attention, "--cuda-graph", str(args.cuda_graph), "--cublaslt", str(args.cublaslt),
            "--residual-epilogue", str(args.residual_epilogue), "--classifier-chunk", str(args.classifier_chunk),
            "--autotune", str(args.autotune), "--gelu-fusion", str(args.gelu_fusion), "-r", str(args.recompute),
            "--bias-grad-epilogue", str(args.bias_grad_epilogue), "--ln-bias-grad", str(args.ln_bias_grad),
            "--cudnn-deterministic", str(args.cudnn_deterministic),
            "--compile", str(args.compile), "--pad-vocab", str(args.pad_vocab)] + (["--probe"] if probe else []) + \
        [flag for spec in args.candidate for flag in ("--candidate", spec)]


def run_worker(trainer, B, args, probe):
    """Run a worker subprocess. Returns its result dict, or None if B ran out of memory; raises
    WorkerFailed if it ended otherwise without a result."""
    r = subprocess.run(worker_command(trainer, B, args, probe), capture_output=True, text=True)
    if r.returncode == OOM_EXIT:
        return None
    lines = [line for line in r.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if r.returncode != 0 or not lines:
        tail = (r.stderr or r.stdout).strip().splitlines()
        raise WorkerFailed(f"exit {r.returncode}: " + (tail[-1].strip() if tail else "no output"))
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def largest_batch(trainer, args):
    """The largest power of two B <= --max-batch for which a short probe run fits in memory."""
    best, B = None, FIRST_PROBE_BATCH
    while B <= args.max_batch:
        fits = run_worker(trainer, B, args, probe=True) is not None
        print(f"  {trainer_names(args.model)[trainer]}: B={B} {'fits' if fits else 'does not fit'}", flush=True)
        if not fits:
            break
        best, B = B, 2 * B
    if best is None:                                  # even the first probe failed: go down
        B = FIRST_PROBE_BATCH // 2
        while B >= 1 and run_worker(trainer, B, args, probe=True) is None:
            B //= 2
        best = B if B >= 1 else None
    if best is None:
        raise WorkerFailed("not even B=1 fits in memory")
    return best


TABLE_HEADER = f"{'trainer':26s} {'B':>4s} {'ms/step':>9s} {'tok/s':>10s} {'MFU':>7s} {'memory GiB':>11s}"


def table_row(trainer, B, r, names=TRAINERS):
    """One (trainer, B) row of the table; r: the worker's result dict, None (B did not fit) or a
    WorkerFailed (its one line); names: trainer_names of the model."""
    if r is None:
        return f"{names[trainer]:26s} {B:4d} {'does not fit in memory':>40s}"
    if isinstance(r, WorkerFailed):
        return f"{names[trainer]:26s} {B:4d} FAILED: {r}"
    util = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    return (f"{names[trainer]:26s} {r['B']:4d} {r['ms_median']:9.1f} {r['tok_s']:10.0f} {util:>7s} "
            f"{r['memory_bytes'] / 2**30:11.2f}")


def options_line(args):
    """What was timed, for the heading of the table."""
    if is_llama3(args.model):
        return (f"Llama 3 ({args.model}), T={args.seq_len}, bf16, median of {args.steps} steps after {args.warmup} "
                f"warm-up; ours: {args.attention} attention, CUDA graph {args.cuda_graph}, cuBLAS, "
                f"classifier over {'Vp (--pad-vocab 1)' if args.pad_vocab else 'V'}; "
                f"twin (dev/torch_reference_llama3.py): "
                f"bf16 parameters and AdamW state (it has no autocast), unfused AdamW, SDPA flash attention, "
                f"torch.compile {args.compile}{candidates_words(args)}")
    return (f"GPT-2 ({args.model}), T={args.seq_len}, bf16, median of {args.steps} steps after {args.warmup} "
            f"warm-up; ours: {args.attention} attention, CUDA graph {args.cuda_graph}, "
            f"{ {'auto': 'cuBLASLt auto', 1: 'cuBLASLt', 0: 'cuBLAS'}[args.cublaslt]}, residual epilogue "
            f"{args.residual_epilogue}, autotune {args.autotune}, GELU fusion {args.gelu_fusion}, bias gradient "
            f"epilogue {args.bias_grad_epilogue}, LayerNorm bias gradients {args.ln_bias_grad}, recompute "
            f"{args.recompute}, cuDNN deterministic {args.cudnn_deterministic}, "
            f"classifier chunk {args.classifier_chunk}; twin: torch.compile {args.compile}{candidates_words(args)}")


def candidates_words(args):
    """The banner's words for --candidate: which dev/cuda kernels run in place of ours."""
    words = ""
    for spec in args.candidate:
        words += f"; candidate {spec}: " + ", ".join(f"{kernel.path}'s {kernel.name} in place of {name}"
                                                    for _, name, kernel in candidate_kernels(spec))
    return words


def print_table(runs, args):
    """runs: [(B, {trainer: result, None or WorkerFailed})] -> the table of every line again, in the
    order they were timed."""
    device = next((r["device"] for _, results in runs for r in results.values() if isinstance(r, dict)), "n/a")
    print(f"\n{options_line(args)}, on {device}")
    print(TABLE_HEADER)
    for trainer in TRAINERS:
        for B, results in runs:
            if trainer in results:
                print(table_row(trainer, B, results[trainer], trainer_names(args.model)))


def summary_line(model, T, B, ours, torch):
    """The fixed-form line of one configuration; ours/torch: a worker's result dict, or anything
    else (None, a WorkerFailed) where there is none."""
    def fmt(r, key, scale, digits):
        return "n/a" if r is None or r.get(key) is None else f"{r[key] * scale:.{digits}f}"
    ours, torch = (r if isinstance(r, dict) else None for r in (ours, torch))
    ratio = f"{ours['tok_s'] / torch['tok_s']:.3f}" if ours and torch else "n/a"
    return (f"bench: model={model} T={T} B={B} precision=bf16 ours={fmt(ours, 'tok_s', 1, 0)} "
            f"torch={fmt(torch, 'tok_s', 1, 0)} ratio={ratio} mfu={fmt(ours, 'mfu', 100, 1)} "
            f"mem_ours_gib={fmt(ours, 'memory_bytes', 2**-30, 2)} mem_torch_gib={fmt(torch, 'memory_bytes', 2**-30, 2)}")


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", choices=("both",) + tuple(TRAINERS), default="both", help="which trainer(s) to time")
    p.add_argument("-e", "--model", default="d12", help="model descriptor")
    p.add_argument("-t", "--seq-len", type=int, default=1024, help="sequence length T")
    p.add_argument("--batch-sizes", default="16,32,64", help="the micro-batch sizes B to time, comma-separated")
    p.add_argument("-b", "--batch-size", type=int, default=0, help="time this one B only (overrides --batch-sizes)")
    p.add_argument("--search", action="store_true", help="also find and time each trainer's largest power-of-two B")
    p.add_argument("--max-batch", type=int, default=512, help="largest B the search tries")
    p.add_argument("--attention", default=llmc.attention.DEFAULT_ATTENTION, choices=llmc.attention.ATTENTION_CHOICES,
                   help="gpt2_cuda.py's attention (auto: as the trainer chooses)")
    p.add_argument("--cuda-graph", type=llmc.gpu_cli.auto_or_bit, default="auto", metavar="{auto,0,1}",
                   help="gpt2_cuda.py: 1 replays the whole step as a CUDA graph, auto as the trainer (1 on a GPU); "
                        "llama3_cuda.py: 1 replays each micro-batch as a CUDA graph (auto: 0)")
    p.add_argument("--residual-epilogue", type=int, default=0, choices=(0, 1),
                   help="gpt2_cuda.py with cuBLASLt: 1 adds the residual in the output projections' GEMMs")
    p.add_argument("--classifier-chunk", type=int, default=0,
                   help="gpt2_cuda.py: the classifier on this many sequences at a time (0: all B)")
    p.add_argument("--autotune", type=int, default=1, choices=range(1, llmc.gpu_cli.MAX_AUTOTUNE + 1),
                   metavar="N", help="gpt2_cuda.py: time cuBLASLt's N best algorithms per product and cuDNN's N best "
                                     "plans per attention graph, keeping the fastest (1: the libraries' first); the "
                                     "tuning is in the warm-up steps")
    p.add_argument("-r", "--recompute", type=int, default=0, choices=(0, 1, 2),
                   help="gpt2_cuda.py's -r: the activations its backward computes again (0: none, the trainer's "
                        "default; 1: GELU's output, L-1 (B,T,4C) buffers less memory)")
    p.add_argument("--cudnn-deterministic", type=int, default=1, choices=(0, 1),
                   help="gpt2_cuda.py with cuDNN attention: 0 its backward that may sum dq in any order (as the "
                        "twin's SDPA), 1 the deterministic one (the trainer's default)")
    p.add_argument("--gelu-fusion", type=int, default=2, choices=(0, 1, 2),
                   help="gpt2_cuda.py with cuBLASLt (its -ge): 2 GELU and its derivative in the GEMM epilogues, "
                        "1 the forward only, 0 neither")
    p.add_argument("--bias-grad-epilogue", type=int, default=1, choices=(0, 1, 2),
                   help="gpt2_cuda.py with cuBLASLt: 1 the bias gradients in the dweight GEMMs' BGRADB epilogue, 0 "
                        "plain dweight GEMMs and our bias_backward kernel, 2 as 0 with the fc's bias gradient in the "
                        "fcproj input gradient's DGELU_BGRAD epilogue")
    p.add_argument("--ln-bias-grad", type=int, default=0, choices=(0, 1),
                   help="gpt2_cuda.py: 1 the attention and MLP projections' bias gradients summed by the LayerNorm "
                        "backward after each, their dweight GEMMs plain (its --ln-bias-grad)")
    p.add_argument("--cublaslt", type=llmc.gpu_cli.auto_or_bit, default="auto", metavar="{auto,0,1}",
                   help="gpt2_cuda.py: 1 runs the linear layers through cuBLASLt (fails where it is unavailable), "
                        "0 through cuBLAS, auto as the trainer chooses (cuBLASLt where it loads)")
    p.add_argument("--pad-vocab", type=int, default=0, choices=(0, 1),
                   help="llama3_cuda.py: 1 runs its classifier over the padded vocabulary Vp (its --pad-vocab)")
    p.add_argument("--candidate", action="append", default=[], metavar="OP:VERSION",
                   help="ours with a dev/cuda candidate kernel in place of the production one it would replace, "
                        "e.g. classifier:5 (only candidates marked drop_in: launched exactly as the production "
                        "kernel); repeatable")
    p.add_argument("--compile", type=int, default=1, choices=(0, 1),
                   help="the PyTorch twin: 1 torch.compile (needs a C compiler), 0 eager")
    p.add_argument("--breakdown-top", type=int, default=20, help="rows of the per-kernel breakdown")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, autotuning)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", choices=tuple(TRAINERS), help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pad_vocab and not is_llama3(args.model):
        p.error(f"--pad-vocab 1 is llama3_cuda.py's (gpt2_cuda.py always pads its vocabulary): drop it for -e {args.model}")
    if is_llama3(args.model) and (args.autotune != 1 or args.gelu_fusion != 2 or args.recompute != 0
                                  or args.cudnn_deterministic != 1 or args.bias_grad_epilogue != 1 or args.ln_bias_grad):
        p.error(f"--autotune, --gelu-fusion, --bias-grad-epilogue, --ln-bias-grad, -r and --cudnn-deterministic are "
                f"gpt2_cuda.py's options: drop them for -e {args.model}")
    for spec in args.candidate:
        try:
            candidate_kernels(spec)
        except ValueError as e:
            p.error(str(e))
    if is_llama3(args.model) and args.cublaslt == 1:
        p.error(f"--cublaslt 1: llama3_cuda.py has no cuBLASLt backend (cuBLAS is its only one); drop --cublaslt "
                f"for -e {args.model}")
    return args


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
    if "torch" in trainers:
        try:
            import torch
            if not torch.cuda.is_available():
                raise ImportError("this PyTorch has no CUDA")
        except ImportError as e:
            print(f"skipping the PyTorch twin: {e}", file=sys.stderr)
            trainers = tuple(t for t in trainers if t != "torch")
    sizes = [args.batch_size] if args.batch_size else [int(b) for b in args.batch_sizes.split(",")]
    if args.search:
        for trainer in trainers:
            try:
                B = largest_batch(trainer, args)
            except WorkerFailed as e:
                print(f"dev/bench.py: the search for {trainer_names(args.model)[trainer]}'s largest B failed: {e}",
                      flush=True)
                continue
            sizes += [B] if B not in sizes else []
    results = {B: {} for B in sizes}                            # B -> {trainer: result, None or WorkerFailed}
    print(options_line(args) + "\n" + TABLE_HEADER, flush=True)
    for trainer in trainers:                                     # all of ours first, then the twin
        for B in sizes:
            try:
                results[B][trainer] = run_worker(trainer, B, args, probe=False)    # None: out of memory
            except WorkerFailed as e:
                results[B][trainer] = e
            print(table_row(trainer, B, results[B][trainer], trainer_names(args.model)), flush=True)
    runs = [(B, results[B]) for B in sizes]
    failed = sum(isinstance(r, WorkerFailed) for _, rs in runs for r in rs.values())
    if not any(isinstance(r, dict) for _, rs in runs for r in rs.values()):
        print(f"dev/bench.py: nothing was timed ({failed} failed, the others did not fit in memory)", file=sys.stderr)
        return 1
    print_table(runs, args)
    for B, rs in runs:
        ours = rs.get("cupy")
        if isinstance(ours, dict) and ours.get("breakdown"):
            print(f"\n{trainer_names(args.model)['cupy'].split()[0]} at B={B}: one step by kernel (CUDA events, the "
                  f"median of {BREAKDOWN_STEPS} steps; "
                  f"kernel by kernel, {ours.get('attention', args.attention)} attention, {ours.get('matmul', '')} "
                  f"matmuls)")
            print("\n".join(format_breakdown([tuple(r) for r in ours["breakdown"]], ours["ms_median"],
                                             args.breakdown_top)))
        if isinstance(ours, dict) and ours.get("autotune"):
            print(f"\nautotune at B={B} (time per call at each product's and attention graph's first call):")
            print("\n".join(ours["autotune"]))
    print()
    for B, rs in runs:
        print(summary_line(args.model, args.seq_len, B, rs.get("cupy"), rs.get("torch")), flush=True)
    if args.json:
        runs_json = [(B, {t: str(r) if isinstance(r, WorkerFailed) else r for t, r in rs.items()}) for B, rs in runs]
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "T": args.seq_len, "attention": args.attention,
                       "cuda_graph": args.cuda_graph, "cublaslt": args.cublaslt, "compile": args.compile,
                       "residual_epilogue": args.residual_epilogue, "classifier_chunk": args.classifier_chunk,
                       "autotune": args.autotune, "gelu_fusion": args.gelu_fusion, "recompute": args.recompute,
                       "cudnn_deterministic": args.cudnn_deterministic,
                       "bias_grad_epilogue": args.bias_grad_epilogue, "ln_bias_grad": args.ln_bias_grad,
                       "pad_vocab": args.pad_vocab,
                       **({"candidate": args.candidate} if args.candidate else {}),
                       "runs": runs_json}, f, indent=1)
    if failed:
        print(f"dev/bench.py: {failed} worker(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
