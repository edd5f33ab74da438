"""
dev/cuda/run_all.py: run every kernel progression of dev/cuda/ on a GPU (`make dev-cuda`): each
dev/cuda/<op>.py in turn, each validating all its versions against gpt2_cpu.py (llama3_cpu.py for Llama 3's ops), timing them and
writing its table to <dir>/dev_cuda_<op>.md, where <dir> is -o, else $OUT when set (the device
tool's folder that comes back, as for dev/run_gpu_tests.py), else dev/results/.

What it deliberately is not: a harness of its own; dev/cuda/common.py is. This only runs the
scripts in OPS, one process each (so a failing op does not stop the others), and sums up.

Run it:
    python dev/cuda/run_all.py           # bf16
    python dev/cuda/run_all.py -p fp32 -r 50 -o /tmp/tables
    python dev/cuda/run_all.py attention rmsnorm   # only these ops (e.g. what a cut-short run missed)
prints each script's output, then one line per op with its exit status; exits 0 if all passed,
1 if any failed, 2 (one line, nothing run) without a CUDA GPU or CuPy.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO_ROOT)

from llmc import cuda  # noqa: E402  (imports CuPy only when called)
from llmc.cli import ArgumentParser  # noqa: E402

# the progressions, in the order a forward + backward pass meets them (a new dev/cuda/<op>.py is
# added here; tests/test_dev_cuda.py checks that each listed op has its script and .cu file)
OPS = ("encoder", "layernorm", "gelu", "bias", "classifier", "global_norm", "adamw", "matmul", "attention",
       "rmsnorm", "rope", "repeat_kv", "swiglu")     # then Llama 3's (llama3_cuda.py)
NO_GPU_EXIT = 2


def default_output_dir(environ=os.environ):
    """$OUT when set and not empty (a device machine's folder that comes back), else dev/results."""
    return environ.get("OUT") or os.path.join(REPO_ROOT, "dev", "results")


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("ops", nargs="*", metavar="op",
                        help=f"the ops to run, in OPS order (default: all of {', '.join(OPS)})")
    parser.add_argument("-p", "--precision", default="bf16", choices=cuda.PRECISIONS, help="storage precision (default bf16)")
    parser.add_argument("-r", "--repeats", type=int, default=None, help="timed runs per version (default: the scripts')")
    parser.add_argument("-o", "--output-dir", default=None,
                        help="where the dev_cuda_<op>.md tables go (default: $OUT when set, else dev/results)")
    args = parser.parse_args(argv)
    unknown = [op for op in args.ops if op not in OPS]
    if unknown:
        parser.error(f"no such op: {', '.join(unknown)} (the ops: {', '.join(OPS)})")
    reason = cuda.cuda_unavailable_reason()
    if reason:
        print(f"dev/cuda/run_all.py: no CUDA GPU found ({reason}); nothing to run "
              "(`make compile-kernels` compiles the kernels without one)", file=sys.stderr)
        return NO_GPU_EXIT
    extra = ["-p", args.precision, "-o", args.output_dir or default_output_dir()]
    extra += ["-r", str(args.repeats)] if args.repeats else []
    status = {}
    for op in [op for op in OPS if op in args.ops or not args.ops]:
        status[op] = subprocess.run([sys.executable, os.path.join(HERE, f"{op}.py")] + extra, cwd=REPO_ROOT).returncode
    print("\n" + "\n".join(f"dev/cuda/{op}.py: {'OK' if rc == 0 else f'FAILED (exit {rc})'}" for op, rc in status.items()))
    return 0 if all(rc == 0 for rc in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
