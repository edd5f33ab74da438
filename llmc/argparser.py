"""
llmc/argparser.py: the command-line parser every program of the project uses: argparse, with the
project's promise for a bad flag (one `error:` line and exit 1, said by rank 0 alone under
mpiexec, instead of argparse's usage dump and exit 2) and a hint for the flag that was meant.

Users arrive with other trainers' habits (PyTorch's examples, nanoGPT, llm.c's own): `--lr`,
`--batch_size`, `--epochs`, `--max_iters`. A flag is never guessed from a prefix (argparse's
allow_abbrev would take `--lr 1e-3` for `--lr-schedule 1e-3`); an unknown one gets the real flag it
stands for (underscores read as hyphens, then HABITS, then the closest spelling), or nothing.

What it is not: the trainers' flags themselves (llmc/cli.py build_parser) or their checks.

    python gpt2_cpu.py --epochs 3
prints `error: unrecognized arguments: --epochs 3; this trainer counts optimizer steps, not epochs:
-x N trains N steps, -x -1 one epoch of the train data (see --help)` and exits 1.
"""

import argparse
import difflib
import sys

from llmc.launcher import launched_rank

CLOSE_MATCH_CUTOFF = 0.75              # difflib's similarity ratio for "did you mean": typos, not other flags

# Flags other trainers have, as (the flag a user types, with '-' for '_') -> (our flag it stands
# for, the hint). The hint is given only where the parser has that flag.
HABITS = {
    "--epochs": ("--max-steps", "this trainer counts optimizer steps, not epochs: -x N trains N steps, -x -1 one "
                                "epoch of the train data"),
    "--num-epochs": ("--max-steps", "this trainer counts optimizer steps, not epochs: -x N trains N steps, -x -1 "
                                    "one epoch of the train data"),
    "--max-iters": ("--max-steps", "did you mean -x/--max-steps (optimizer steps)?"),
    "--iters": ("--max-steps", "did you mean -x/--max-steps (optimizer steps)?"),
    "--steps": ("--max-steps", "did you mean -x/--max-steps (optimizer steps)?"),
    "--warmup-steps": ("--warmup-iters", "did you mean -u/--warmup-iters (linear warmup steps)?"),
    "--block-size": ("--seq-len", "did you mean -t/--seq-len (sequence length T)?"),
    "--out-dir": ("--output-dir", "did you mean -o/--output-dir?"),
}
# A flag of another program: the hint where this parser does not have it
ELSEWHERE = {
    "--device": "this program runs on the CPU only; gpt2_cuda.py and llama3_cuda.py take --device cuda|cpu",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with this project's promise for a bad flag: one `error:` line (on rank 0 only
    under mpiexec) and exit 1, instead of argparse's usage dump and exit 2; no abbreviated flags
    (allow_abbrev=False: `--lr` is not a prefix of `--lr-schedule` here)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        if launched_rank() in (None, 0):
            print(f"error: {message}{self.did_you_mean(message)} (see --help)", file=sys.stderr)
        sys.exit(1)

    def did_you_mean(self, message):
        """For an unrecognized flag, what was meant ("; did you mean --learning-rate?"): the flag
        with '-' for '_' where that is one, else the HABITS hint, else the closest real flag if
        any is close (CLOSE_MATCH_CUTOFF); else ''."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        flags = [option for action in self._actions for option in action.option_strings]
        for word in message.split(":", 1)[1].split():
            if not word.startswith("-"):
                continue
            typed = word.split("=")[0]
            hyphenated = typed[:2] + typed[2:].replace("_", "-")
            if hyphenated != typed and hyphenated in flags:
                return f"; did you mean {hyphenated}?"
            if hyphenated in HABITS and HABITS[hyphenated][0] in flags:
                return f"; {HABITS[hyphenated][1]}"
            if hyphenated in ELSEWHERE and hyphenated not in flags:
                return f"; {ELSEWHERE[hyphenated]}"
            close = difflib.get_close_matches(hyphenated, flags, n=1, cutoff=CLOSE_MATCH_CUTOFF)
            if close:
                return f"; did you mean {close[0]}?"
        return ""
