"""
llmc/gpu_cli.py: gpt2_cuda.py's command line: gpt2_cpu.py's flags (llmc/cli.py) plus the GPU
options in a group of their own, the precision those options and the GPU allow, and the lines it
prints about the device (the banner, -lg's status line).
"""

import argparse
import re
import sys

from llmc import cuda, multinode
from llmc.attention import ATTENTION_CHOICES, DEFAULT_ATTENTION
from llmc.cli import build_parser as build_cli_parser
from llmc.cuda import PRECISIONS
from llmc.utils import InputError

BF16_MIN_COMPUTE_CAPABILITY = 80       # sm_80 (Ampere) added bf16 tensor cores (and TF32)

GPU_FLAGS_TITLE = "GPU options (gpt2_cuda.py only)"
GPT2_ONLY_FLAGS = ("-w", "-r", "--cublaslt", "--residual-epilogue", "--autotune", "-ge", "--bias-grad-epilogue",
                   "--ln-bias-grad", "--cudnn-deterministic", "--classifier-chunk")                                       # llama3_cuda.py lacks these
MAX_AUTOTUNE = 16                      # llmc/cublaslt.py's MAX_AUTOTUNE (that module loads nvmath lazily)


def build_parser(lr_schedules, prog="gpt2_cuda.py", gpt2_options=True, description=None, model_help=None):
    """gpt2_cpu.py's flags (the same letters, defaults and meaning, llmc.cli.build_parser, with the
    trainer's lr_schedules) with the GPU flags in their own group (llm.c's -f, -w, -r letters): one
    --help lists them all. gpt2_options=False (llama3_cuda.py) leaves out GPT2_ONLY_FLAGS, which
    only gpt2_cuda.py reads (bf16 there always keeps fp32 master weights, nothing is recomputed,
    its matmuls are cuBLAS): given to it, they are an unknown flag's one error line. description,
    model_help: --help's first line and -e's help, where they are not GPT-2's (llmc.cli.build_parser)."""
    p = build_cli_parser(prog, description or "Train GPT-2 on NVIDIA GPUs (CuPy, our CUDA kernels, cuBLAS); "
                                              "gpt2_cpu.py's flags plus GPU options.", lr_schedules, model_help)
    a = p.add_argument_group(GPU_FLAGS_TITLE if prog == "gpt2_cuda.py" else f"GPU options ({prog} only)").add_argument
    a("--precision", default="auto", choices=("auto",) + PRECISIONS,
      help="storage precision; auto: bf16 on compute capability >= 8.0, else fp32")
    a("-f", "--tf32", type=int, default=1, choices=(0, 1), help="1: TF32 tensor cores for fp32 matmuls")
    if gpt2_options:
        a("-w", "--master-weights", type=int, default=1, choices=(0, 1), help="1: fp32 master weights in bf16")
        a("-r", "--recompute", type=int, default=0, choices=(0, 1, 2),
          help="activations the backward computes again instead of keeping: 0 none (the default: 2.5%% faster "
               "than 1 at 124M, B=16 on an H200, 1.0 GiB more); 1 GELU's output (saves L-1 (B,T,4C) buffers, "
               "llm.c's default); 2 GELU's and both LayerNorms' outputs (saves 2(L-1) (B,T,C) more)")
    a("-z", "--zero-stage", type=int, default=0, help="ZeRO stage: 0 off; 1 shards AdamW's m, v and the master "
                                                      "weights over the data-parallel ranks (2, 3: refused)")
    a("--attention", default=DEFAULT_ATTENTION, choices=ATTENTION_CHOICES,
      help="naive: the (T,T) matrix (cuBLAS + softmax); flash: ours, kernels/flash_attention.cu; "
           "cudnn: cuDNN's fused attention (bf16; falls back to flash, saying so, where unavailable); "
           "auto: cudnn on a GPU where it can run, else naive (naive on the emulated device)")
    if gpt2_options:
        a("--cublaslt", type=auto_or_bit, default="auto", metavar="{auto,0,1}",
          help="1: linear layers through cuBLASLt (nvmath-python) with bias, GELU and bias gradient fused; "
               "0: cuBLAS and our bias and GELU kernels; auto: 1 on a GPU (cuBLAS, saying so, where nvmath-python "
               "is missing), 0 on the emulated device")
        a("--residual-epilogue", type=int, default=0, choices=(0, 1),
          help="1: with cuBLASLt, the attention and MLP output projections add the residual stream in the GEMM "
               "(cuBLASLt's C input, beta = 1) and the LayerNorm after each only normalizes; 0: a fused residual + "
               "LayerNorm kernel adds it")
        a("--autotune", type=int, default=1, choices=range(1, MAX_AUTOTUNE + 1), metavar="N",
          help=f"N > 1: each cuBLASLt product and each cuDNN attention graph times its library's N best candidates "
               f"(algorithms, plans) at its first call and keeps the fastest (a tuned run may differ from an untuned "
               f"one in the last bits); 1: the libraries' first choice, as llm.c (1 to {MAX_AUTOTUNE})")
        a("-ge", "--gelu-fusion", type=int, default=2, choices=(0, 1, 2),
          help="with cuBLASLt (llm.c's -ge): 2 the GELU in the fc GEMM's epilogue and its derivative in the fcproj "
               "input gradient's; 1 the forward only; 0 neither (our GELU kernels)")
        a("--bias-grad-epilogue", type=int, default=1, choices=(0, 1, 2),
          help="with cuBLASLt: 1 each bias gradient summed in its dweight GEMM's epilogue (BGRADB); 0 plain dweight "
               "GEMMs and our bias_backward kernel (kernels/bias.cu); 2 as 0, but the fc's bias gradient summed in "
               "the fcproj input gradient's epilogue (DGELU_BGRAD, with -ge 2)")
        a("--ln-bias-grad", type=int, default=0, choices=(0, 1),
          help="1: the attention and MLP projections' bias gradients summed by the LayerNorm backward after each "
               "(the column sums of the residual stream's gradient it completes), their dweight GEMMs plain; 0: by "
               "the projection's backward, as --bias-grad-epilogue says")
        a("--cudnn-deterministic", type=int, default=1, choices=(0, 1),
          help="with cuDNN attention: 1 its deterministic backward (the same gradients bit for bit every run, as "
               "llm.c); 0 the backward that may sum dq in any order (as PyTorch's SDPA; runs then differ in the last "
               "bits; 1%% faster at 124M, B=16 on an H200)")
        a("--classifier-chunk", type=int, default=0, metavar="SEQUENCES",
          help="the classifier (logits, softmax + cross-entropy + dlogits, their two GEMMs) on this many sequences "
               "of a micro-batch at a time, so only (SEQUENCES,T,Vp) logits exist instead of (B,T,Vp); 0: all B")
    if gpt2_options:
        a("--cuda-graph", type=auto_or_bit, default="auto", metavar="{auto,0,1}",
          help="1: capture the training step (forward, backward, the gradient norm and clipping factor, AdamW; "
               "with gradient accumulation one graph per micro-batch, the last with the update) into CUDA graphs "
               "replayed as one launch each (needs nvmath-python: CuPy's cuBLAS refuses calls during a capture); "
               "0: launch each kernel; auto: 1 on a GPU, 0 on the emulated device")
    else:
        a("--cuda-graph", type=int, default=0, choices=(0, 1),
          help="1: capture each micro-batch's forward + backward into a CUDA graph, replayed as one launch "
               "(needs nvmath-python: CuPy's cuBLAS refuses calls during a capture)")
    a("--check", action="store_true", help="compare one batch with gpt2_cpu.py, print per-tensor errors, exit 1 on failure")
    a("--check-dtype", default="float32", choices=("float32", "float64"), help="gpt2_cpu's dtype for --check")
    a("--check-save", default=None, metavar="FILE.npz", action=CheckSaveAction,
      help="run --check and also save every compared tensor, both sides, to this .npz (python -m llmc.debugger "
           "--check-run FILE shows it)")
    a("--device", default="cuda", type=device_flag, choices=cuda.DEVICES,
      help="cpu: the emulated CUDA device (llmc/emulator/: our kernels compiled by g++ and run on the CPU, "
           "slow; defaults --precision fp32 -f 0, so the losses are gpt2_cpu.py's)")
    a("-lg", "--log-gpu-every", type=int, default=-1, help="print GPU memory and utilization every N steps (-1: never)")
    a("--memory-report", action="store_true",
      help="with --device cpu: count every kernel's global-memory sectors and shared-memory bank conflicts "
           "(llmc/emulator/memory.py, as Nsight Compute defines them) and print them per kernel and worst "
           "line at the end (slower; e.g. -e d2 -x 1)")
    multinode.add_flags(p)                     # -pm -pn -pr -pg -ps -pp -pj: one node or many
    return p


def with_memory_report(args, run):
    """run() (the trainer's main work, returning its exit code), inside the emulated device's memory
    counters when --memory-report asks for them (llmc/emulator/memory.py), printing their table
    afterwards. --memory-report without --device cpu: one error line, exit 1 (a GPU has Nsight
    Compute for this)."""
    if not getattr(args, "memory_report", False):
        return run()
    if args.device != "cpu":
        print("error: --memory-report counts memory accesses on the emulated device: add --device cpu "
              "(on a GPU, Nsight Compute's ncu counts them)", file=sys.stderr)
        return 1
    from llmc.emulator import memory             # the emulated device's module: loaded only when asked for
    with memory.tracing() as report:
        code = run()
    print(report.format())
    return code


class CheckSaveAction(argparse.Action):
    """--check-save FILE: the file to save --check's comparison in; it implies --check."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.check = True


def cuda_graph_choice(requested):
    """Whether --cuda-graph `requested` (0, 1 or "auto") captures the training step: auto is 1 on
    a GPU (a graph per micro-batch measured 9.5% faster than eager launches on an H100 at GPT-2
    124M, B=16, 2026-11-26: dev/results/) and 0 on the emulated device, where a replay is no faster
    (its work is the kernels themselves, run on the CPU: d2 steps took the same time either way,
    2026-11-27) and an eager launch runs where it is called, so stepping through gpt2_cuda.py in a
    debugger shows each kernel's result at its line."""
    return cuda.device() == "cuda" if requested == "auto" else bool(requested)


def device_flag(value):
    """--device's value, "cuda" or "cpu". PyTorch's "cuda:N" is refused with the way to pick GPU N
    here (each process takes the GPU of its local rank, llmc.cuda.select_device), anything else
    with the choices: argparse.ArgumentTypeError, the parser's one error line."""
    if value in cuda.DEVICES:
        return value
    match = re.fullmatch(r"cuda:(\d+)", value)
    if match:
        raise argparse.ArgumentTypeError(
            f"{value!r}: pass --device cuda; each process takes the GPU of its local rank (GPU 0 for one "
            f"process), and CUDA_VISIBLE_DEVICES={match.group(1)} runs on GPU {match.group(1)} alone")
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(cuda.DEVICES)})")


def auto_or_bit(value):
    """A flag value that is auto, 0 or 1 (--cublaslt): "auto", or the int. Raises
    argparse.ArgumentTypeError for anything else (the parser's one error line)."""
    if value in ("auto", "0", "1"):
        return value if value == "auto" else int(value)
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from auto, 0, 1)")


def choose_precision(requested, tf32, compute_capability):
    """(precision, tf32) for --precision `requested` ("auto", "bf16", "fp32") and -f `tf32` on a GPU
    of compute_capability (e.g. 80): auto is bf16 from 8.0 on, else fp32; TF32 needs 8.0 as well.
    Raises InputError for bf16 on an older GPU."""
    precision = requested
    if precision == "auto":
        precision = "bf16" if compute_capability >= BF16_MIN_COMPUTE_CAPABILITY else "fp32"
    if precision == "bf16" and compute_capability < BF16_MIN_COMPUTE_CAPABILITY:
        raise InputError(f"--precision bf16 needs compute capability >= 8.0 (this GPU: {compute_capability / 10:.1f})")
    return precision, bool(tf32) and compute_capability >= BF16_MIN_COMPUTE_CAPABILITY


def device_line(device, device_name, compute_capability, model, cuda_graph):
    """The banner's first line: the GPU, and the choices the model was set up with."""
    return (f"device: {device_name} (cuda:{device}, compute capability {compute_capability / 10:.1f}) | {model.precision}"
            f"{' + fp32 master weights' if model.master is not None else ''}"
            f"{' | TF32 matmuls' if model.precision == 'fp32' and model.matmul.tf32 else ''}"
            f" | recompute {model.recompute} | {model.attention.name} attention | {model.matmul.name} matmuls"
            f"{library_options(model)}{' | CUDA graph' if cuda_graph else ''}")


def library_options(model):
    """The banner's words for --autotune, --gelu-fusion, --bias-grad-epilogue and
    --cudnn-deterministic where they differ from their defaults and reach a library here
    (cuBLASLt's products, cuDNN's attention graphs), and for --ln-bias-grad 1; empty otherwise."""
    words = []
    autotune = max(getattr(model.matmul, "autotune", 1), getattr(model.attention, "autotune", 1)
                   if model.attention.name == "cudnn" else 1)
    if autotune > 1:
        words.append(f"autotune {autotune}")
    if getattr(model.matmul, "gelu_fusion", 2) != 2:
        words.append(f"GELU fusion {model.matmul.gelu_fusion}")
    bias_grad_epilogue = getattr(model.matmul, "bias_grad_epilogue", 1)
    if bias_grad_epilogue != 1:
        words.append("bias gradients by bias_backward" + (", the fc's in DGELU_BGRAD" if
                                                          getattr(model.matmul, "pre_gelu_bias_grad", False) else ""))
    if getattr(model, "ln_bias_grad", False):
        words.append("projection bias gradients by layernorm_backward")
    if model.attention.name == "cudnn" and not getattr(model.attention, "deterministic", True):
        words.append("non-deterministic cuDNN backward")
    return "".join(f" ({w})" for w in words)


def gpu_status_line(device):
    """-lg: one line of this GPU's memory (the CUDA runtime) and, where NVML (nvidia-ml-py) is
    installed, its utilization, temperature and power."""
    cp = cuda.cupy()
    free, total = cp.cuda.runtime.memGetInfo()
    line = f"gpu {device}: memory {(total - free) / 2**30:.2f} of {total / 2**30:.2f} GiB in use"
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        temperature = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000
        line += f" | utilization {util.gpu}% | {temperature} C | {power:.0f} W"
    except Exception:                      # no NVML: memory only
        line += " | utilization n/a (pip install nvidia-ml-py)"
    return line
