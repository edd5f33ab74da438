"""
dev/kernel_trace.py: record one kernel launch of a training step on the emulated device, thread by
thread, for the visual debugger's "a kernel's threads" view (python -m llmc.debugger --kernel-trace).

What it does: runs gpt2_cuda.py (or llama3_cuda.py with -e llama3:dX) with --device cpu and the
given trainer flags inside the emulated device's memory counters (llmc/emulator/memory.py), keeps
every access of the n-th launch of the named kernel, and writes it as a kernel trace (format
llmc-kernel-trace-1: which thread of which warp read or wrote which element of which buffer, and
each warp's sectors per request and bank conflicts). What it is not: a profiler of a GPU.

Run:
    python dev/kernel_trace.py layernorm_forward -o trace.json -- -e d2 -b 1 -t 32 -x 1
    python -m llmc.debugger --kernel-trace trace.json
Prints the trainer's output, then one line naming the file; exit 1 (one line) when the kernel was
never launched, the trainer's own exit code when it fails.
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from llmc.cli import ArgumentParser  # noqa: E402
from llmc.emulator import memory  # noqa: E402


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, trainer_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = ArgumentParser(prog="dev/kernel_trace.py", description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("kernel", help="the kernel's name, e.g. layernorm_forward")
    parser.add_argument("-n", "--launch", type=int, default=0, help="which launch of it (0: the first)")
    parser.add_argument("-o", "--output", default="kernel_trace.json", help="the trace file to write")
    args = parser.parse_args(own)
    llama3 = any(a.startswith("llama3") for a in trainer_args)
    if llama3:
        import llama3_cuda as trainer
    else:
        import gpt2_cuda as trainer
    with memory.tracing(raw_kernel=(args.kernel, args.launch)) as report:
        code = trainer.main(["--device", "cpu", *trainer_args])
    if code:
        return code
    if report.raw is None:
        print(f"dev/kernel_trace.py: kernel {args.kernel} was not launched {args.launch + 1} time(s) "
              f"(launched: {', '.join(sorted(report.launches)) or 'none'})", file=sys.stderr)
        return 1
    precision = "fp32" if "--precision" not in trainer_args else trainer_args[trainer_args.index("--precision") + 1]
    trace = memory.kernel_trace(report.raw, precision)
    with open(args.output, "w") as f:
        json.dump(trace, f)
    print(f"wrote {args.output}: {args.kernel} launch {args.launch}, {len(trace['accesses'])} warp requests "
          f"(python -m llmc.debugger --kernel-trace {args.output})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
