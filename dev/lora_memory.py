"""
dev/lora_memory.py: the device memory of LoRA fine-tuning against full training, measured in one
run: the CUDA trainer (gpt2_cuda.py, or llama3_cuda.py for -e llama3:dX) trains one step both
ways, and the bytes its arrays hold after the step are counted by the device's memory pool (on the
emulated device, llmc/emulator: every live array's bytes, exactly; on a GPU, CuPy's pool: the same
arrays, without the CUDA context and cuBLAS's workspace), split into the model's parameters, its
gradients, AdamW's moments and master weights, the adapters' (all of theirs), and the rest
(activations, the backward's scratch). It prints one table per model and the ratio LoRA / full.

What it is not: a speed benchmark (dev/bench.py), or the memory of a long run (the sampler's and
HellaSwag's buffers are left out: -v 0 -s 0).

Run it (on the emulated device, a few minutes on 2 cores for the defaults):
    python dev/lora_memory.py                         # d12 (GPT-2 124M) and llama3:d4, B=1, T=64
    python dev/lora_memory.py -e d4 -b 4 -t 64 --lora-targets all-linear
    python dev/lora_memory.py --device cuda -e d12 -b 16 -t 1024   # on a GPU
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from llmc.utils import require  # noqa: E402
require("dev/lora_memory.py", "numpy")
import gpt2_cuda  # noqa: E402
import llama3_cuda  # noqa: E402
from llmc import cuda  # noqa: E402
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.paths import DEFAULT_TRAIN  # noqa: E402

GIB = 2 ** 30
DEFAULT_MODELS = "d12,llama3:d4"


def trainer_of(model):
    return llama3_cuda if model.startswith("llama3:") else gpt2_cuda


def nbytes(*arrays):
    return sum(a.nbytes for a in arrays if a is not None)


def one_step(model_name, args, lora_flags):
    """Train -e model_name one step (the trainer's train(), -x 1) with the extra flags; returns
    (bytes the pool holds after it, above what it held before; the trained model)."""
    trainer = trainer_of(model_name)
    argv = ["-e", model_name, "-i", args.input_bin, "-j", "", "-b", str(args.batch_size), "-t", str(args.seq_len),
            "-x", "1", "-v", "0", "-s", "0", "--device", args.device, "--precision", args.precision] + lora_flags
    pool = cuda.cupy().get_default_memory_pool()
    before = pool.used_bytes()
    model = trainer.train(trainer.parse_args(argv))
    return pool.used_bytes() - before, model


def breakdown(total, model):
    """{part: bytes} of a trained model's arrays, the rest of `total` as activations and scratch."""
    lora = model.lora
    parts = {"parameters": nbytes(model.params_memory), "gradients": nbytes(model.grads_memory),
             "AdamW m, v": nbytes(model.m, model.v), "master weights": nbytes(model.master),
             "LoRA adapters (all of theirs)": nbytes(lora.params_memory, lora.grads_memory, lora.m, lora.v,
                                                     lora.master) if lora else 0}
    parts["activations and the rest"] = total - sum(parts.values())
    return parts


def measure(args):
    for model_name in args.model.split(","):
        lora_flags = ["--lora-rank", str(args.lora_rank)] + (["--lora-targets", args.lora_targets]
                                                              if args.lora_targets else [])
        full_total, full = one_step(model_name, args, [])
        lora_total, lora = one_step(model_name, args, lora_flags)
        rows = breakdown(full_total, full), breakdown(lora_total, lora)
        print(f"\n{model_name}, B={args.batch_size} T={args.seq_len}, {full.precision}, on the "
              f"{'emulated device' if args.device == 'cpu' else 'GPU'}: device memory after one training step "
              f"(LoRA r={args.lora_rank} on {', '.join(t.name for t in lora.lora.targets)}, "
              f"{lora.lora.num_parameters:,} of {lora.num_parameters:,} parameters trained)")
        print(f"{'':32s} {'full (MiB)':>12s} {'LoRA (MiB)':>12s}")
        for part in rows[0]:
            print(f"{part:32s} {rows[0][part] / 2**20:12.2f} {rows[1][part] / 2**20:12.2f}")
        print(f"{'total':32s} {full_total / 2**20:12.2f} {lora_total / 2**20:12.2f}   LoRA / full = "
              f"{lora_total / full_total:.3f}")
        del full, lora


def parse_args(argv=None):
    p = ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("-e", "--model", default=DEFAULT_MODELS, help="comma-separated descriptors (d12, llama3:d4, ...)")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="micro-batch size B")
    p.add_argument("-t", "--seq-len", type=int, default=64, help="sequence length T")
    p.add_argument("-i", "--input-bin", default=DEFAULT_TRAIN, help="train data for the one step")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="the trainers' --precision")
    p.add_argument("--lora-rank", type=int, default=8, help="LoRA's rank (PEFT's default 8)")
    p.add_argument("--lora-targets", default=None, help="LoRA's targets (default: the family's PEFT default)")
    p.add_argument("--device", default="cpu", choices=cuda.DEVICES, help="cpu: the emulated device; cuda: a GPU")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cuda.use_device(args.device)
    reason = cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/lora_memory.py: no device to run on ({reason})", file=sys.stderr)
        return 2
    return run_main(measure, args)


if __name__ == "__main__":
    sys.exit(main())
