"""
llmc/logger.py: llm.c's main.log, one line per event (dev/vislog.py plots it):
    s:<step> trl:<train loss> lr:<learning rate> norm:<grad norm>
    s:<step> tel:<val loss>
    s:<step> eval:<hellaswag accuracy>
"""

import os


class Logger:
    """Appends llm.c-style lines to DIR/main.log (a no-op without a directory). A fresh run
    truncates the log; a resumed one appends."""

    def __init__(self, out_dir, resuming=False):
        self.path = os.path.join(out_dir, "main.log") if out_dir else None
        if self.path and not resuming:
            open(self.path, "w").close()

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
