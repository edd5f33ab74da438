"""
llmc/interrupt.py: Ctrl-C while a program is still importing its packages ends it quietly.

NumPy, PyTorch and CuPy take seconds to import. A Ctrl-C in that time would raise
KeyboardInterrupt in the middle of some package's import and print a traceback through it, before
any of our code could catch it. Each program therefore calls quiet_ctrl_c_while_importing at its
top, before those imports: until llmc.cli.run_main takes over (it restores Python's own Ctrl-C and
turns KeyboardInterrupt into exit 130 itself), Ctrl-C exits with code 130 and prints nothing.

What it is not: a handler for the run itself (run_main is), or anything that changes Ctrl-C for a
module imported by another program (tests, notebooks): then it does nothing.
"""

import os
import signal
import sys

INTERRUPTED_EXIT_CODE = 130            # 128 + SIGINT (2): what a shell reports for a program Ctrl-C stopped


def exit_on_interrupt(signum, frame):
    """The SIGINT handler while a program imports: flush what was printed, then end the process
    at once with exit code 130 (os._exit). Not sys.exit: its SystemExit, raised inside a C
    extension's import (NumPy's), comes back out as an ImportError with a traceback; and
    nothing a half-done import could leave needs cleaning up."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):   # closed, or None: nothing to flush
            pass
    os._exit(INTERRUPTED_EXIT_CODE)


def quiet_ctrl_c_while_importing(module_name):
    """Make Ctrl-C exit 130 without a traceback, until restore_ctrl_c. module_name is the calling
    file's __name__: nothing changes unless it runs as the program ("__main__"), nor when SIGINT
    has another handler than Python's own (pdb's, which breaks into the debugger on Ctrl-C)."""
    if module_name == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, exit_on_interrupt)


def restore_ctrl_c():
    """Python's own Ctrl-C again (KeyboardInterrupt), if quiet_ctrl_c_while_importing had set ours."""
    if signal.getsignal(signal.SIGINT) is exit_on_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
