"""
llmc/logger.py: llm.c's main.log, one line per event (dev/vislog.py plots it):
    s:<step> trl:<train loss> lr:<learning rate> norm:<grad norm>
    s:<step> tel:<val loss>
    s:<step> eval:<hellaswag accuracy>
"""

import os

from llmc.utils import InputError, atomic_write, check_regular_file


class Logger:
    """Appends llm.c-style lines to DIR/main.log (a no-op without a directory). A fresh run
    truncates the log. A run resumed at step `resume_step` keeps what the run logged before its
    checkpoint there (every line of an earlier step, and that step's validation and eval lines,
    which come before the checkpoint) and drops the rest, which a run killed after the checkpoint
    had logged and this one will log again: the log then equals a straight run's."""

    def __init__(self, out_dir, resume_step=None):
        self.path = os.path.join(out_dir, "main.log") if out_dir else None
        if not self.path:
            return
        check_regular_file(self.path, "the log")
        if resume_step is None or not os.path.exists(self.path):
            open(self.path, "w").close()
            return
        kept = []
        with open(self.path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{self.path}: not a main.log (byte {e.start} is not UTF-8): move it aside to "
                             f"resume") from None
        for line in text.splitlines(keepends=True):
            step = line.split(" ", 1)[0]
            step = int(step[2:]) if step.startswith("s:") and step[2:].isdigit() else None
            if step is not None and (step < resume_step or (step == resume_step and " trl:" not in line)):
                kept.append(line)
        atomic_write(self.path, lambda f: f.write("".join(kept).encode()))

    def _write(self, line):
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def log_train(self, step, loss, lr, norm):
        """`s:<step> trl:<loss> lr:<lr> norm:<norm>`"""
        self._write(f"s:{step} trl:{loss:.6f} lr:{lr:.6f} norm:{norm:.4f}")

    def log_val(self, step, loss):
        """`s:<step> tel:<val loss>`"""
        self._write(f"s:{step} tel:{loss:.6f}")

    def log_eval(self, step, acc):
        """`s:<step> eval:<accuracy>`"""
        self._write(f"s:{step} eval:{acc:.6f}")
