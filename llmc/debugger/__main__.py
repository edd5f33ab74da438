"""
python -m llmc.debugger: the visual debugger. One real training step of the reference trainer
(gpt2_cpu.py, or llama3_cpu.py for -e llama3:dX), op by op, in the browser.

Run it (after `make data`; `make debug` does both):
    python -m llmc.debugger                       # d4 on Shakespeare, B=4, T=64
    python -m llmc.debugger -e llama3:d4          # Llama 3
    python -m llmc.debugger -e d12 -b 4 -t 1024   # GPT-2 124M's shape (each op takes seconds here)
    python -m llmc.debugger --check-run check.npz # also a saved gpt2_cuda.py --check-save run
It prints the model and batch lines of the trainer, then
    debugger: open http://127.0.0.1:PORT/?token=...
once the step stands after its first op; open that URL. Ctrl-C quits. The trainer's flags all work
(-e model or checkpoint, -b, -t, -x, -o with -y 1 to resume, ...); validation and samples are off
by default here (-v 0 -s 0), as they would run forward passes the page does not show.

What it is not: a way to change the model's values (the page only reads), or a server for other
people (it binds 127.0.0.1 and needs the printed token).
"""

import importlib
import os
import sys
import time

from llmc.interrupt import quiet_ctrl_c_while_importing
quiet_ctrl_c_while_importing(__name__)
from llmc.utils import require  # noqa: E402
require("python -m llmc.debugger", "numpy", "plotly")

from llmc import lora  # noqa: E402
from llmc.cli import build_parser, is_checkpoint_path, run_main  # noqa: E402
from llmc.debugger.checkrun import CheckRun  # noqa: E402
from llmc.debugger.kerneltrace import KernelTrace  # noqa: E402
from llmc.debugger.server import DebuggerServer  # noqa: E402
from llmc.debugger.session import DEFAULT_KEEP_MIB, Session  # noqa: E402
from llmc.debugger.stepper import GPT2, LLAMA3, discover_ops, run_hooked  # noqa: E402
from llmc.formats import is_llama3_model_file  # noqa: E402
from llmc.tokenizer import Tokenizer  # noqa: E402
from llmc.utils import InputError  # noqa: E402

DEBUGGER_DEFAULTS = {"val_every": 0, "sample_every": 0}
IDLE_SLEEP_S = 3600
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    """The trainers' flags (llmc.cli.build_parser) plus the debugger's own."""
    if REPO_ROOT not in sys.path:                       # the trainers live at the repository's root
        sys.path.insert(0, REPO_ROOT)
    import gpt2_cpu                                     # the reference (llmc never imports it at load)
    p = build_parser("python -m llmc.debugger", "The visual debugger: one training step of gpt2_cpu.py "
                     "(or llama3_cpu.py, -e llama3:dX), op by op, in the browser.", gpt2_cpu.LR_SCHEDULES)
    lora.add_flags(p, gpt2_cpu.LORA_FAMILY.default_targets)   # the reference's step runs with its adapters, if any
    p.set_defaults(**DEBUGGER_DEFAULTS)
    a = p.add_argument_group("debugger options").add_argument
    a("--host", default="127.0.0.1", help="address to listen on (only this machine by default)")
    a("--port", type=int, default=0, help="port to listen on (0: any free one)")
    a("--check-run", action="append", default=[], metavar="FILE.npz",
      help="a saved gpt2_cuda.py/llama3_cuda.py --check-save FILE to show beside the reference (repeatable)")
    a("--kernel-trace", default=None, metavar="FILE.json", help="one kernel launch's memory trace to show")
    a("--keep-mib", type=int, default=DEFAULT_KEEP_MIB,
      help="MiB of the step's own arrays (gradients, datt) kept for going back to earlier ops")
    return p.parse_args(argv)


def choose_family(spec, resume):
    """GPT-2 or Llama 3 from -e: a llama3:dX descriptor or a Llama 3 model file is Llama 3."""
    if spec.startswith("llama3:"):
        return LLAMA3
    if is_checkpoint_path(spec) and not resume and os.path.isfile(spec) and is_llama3_model_file(spec):
        return LLAMA3
    return GPT2


def model_config(module, family, args):
    """The config -e names, without building the model (the discovery run needs only its shape)."""
    if family is LLAMA3:
        return module.model_config(args.model, module.descriptor_vocab_size(args.tokenizer))
    return module.model_config(args.model)


def debug(args):
    """Start the server, run the trainer's train(args) under the stepper, and keep serving after
    it finishes until Ctrl-C. Returns the exit code."""
    family = choose_family(args.model, args.resume)
    module = importlib.import_module(family.module)
    if args.keep_mib < 0:
        raise InputError(f"--keep-mib {args.keep_mib}: must be >= 0")
    ops = discover_ops(module, family, model_config(module, family, args))
    check_runs = [CheckRun(path) for path in args.check_run]
    kernel_trace = KernelTrace(args.kernel_trace)
    try:
        tokenizer = Tokenizer(args.tokenizer)
    except InputError as e:
        print(f"debugger: {e}; tokens are shown as ids")
        tokenizer = None
    sources = sorted({os.path.abspath(op.def_file) for op in ops} | {os.path.abspath(op.call_file) for op in ops})
    holder = {}

    def announce():
        print(f"debugger: {family.module}.py's train() stands after the first op of {len(ops)} per step; "
              f"open {holder['server'].url(args.host if args.host not in ('0.0.0.0', '::') else '127.0.0.1')}",
              flush=True)

    session = Session(module, family, ops, args.keep_mib, tokenizer, on_first_stop=announce)
    try:
        server = DebuggerServer(args.host, args.port, session, check_runs, kernel_trace, sources)
    except OSError as e:
        raise InputError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    holder["server"] = server
    server.serve_in_thread()
    try:
        run_hooked(session.hook, module.train, args)
    except BaseException as e:
        session.finished(f"{type(e).__name__}: {e}")
        raise
    session.finished()
    if session.step is None:
        print("debugger: the trainer ran no training step (nothing to show)")
        return 0
    print("debugger: the trainer finished; the page stays open until Ctrl-C", flush=True)
    try:
        while True:
            time.sleep(IDLE_SLEEP_S)
    except KeyboardInterrupt:
        return 0


def main(argv=None):
    try:
        args = parse_args(argv)
    except SystemExit as e:                    # --help, or a bad flag (its one error line printed)
        return e.code
    return run_main(debug, args)


if __name__ == "__main__":
    sys.exit(main())
