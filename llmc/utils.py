"""
llmc/utils.py: the error every command-line tool reports in one line, and writing files so that a
crash never leaves one that looks complete (llm.c's llmc/utils.h: fopenCheck and friends), and
prefix, the view of a buffer's first elements that every (B,T) of a preallocated buffer uses.
"""

import glob
import math
import os
import re


class InputError(Exception):
    """Bad user input or a bad file. The command line prints it as one `error:` line and exits 1."""


TMP_SUFFIX = ".tmp"                    # atomic_write writes `<path>.tmp<pid>`, then renames


def atomic_write(path, write_fn):
    """Write a file through `write_fn(f)` to the temporary name `<path>.tmp<pid>`, fsync, then
    rename it into place, so a crash mid-write never leaves a file that looks complete. The
    temporary file is removed on any error."""
    tmp = f"{path}{TMP_SUFFIX}{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def stale_temporaries(directory):
    """The `*.tmp<pid>` files atomic_write left in `directory` when a run was killed mid-write."""
    pattern = re.compile(re.escape(TMP_SUFFIX) + r"\d+$")
    return sorted(p for p in glob.glob(os.path.join(glob.escape(directory), "*" + TMP_SUFFIX + "*"))
                  if pattern.search(p) and os.path.isfile(p))


def prefix(buf, shape):
    """View of the first prod(shape) elements of a contiguous buffer, reshaped (no copy)."""
    return buf.reshape(-1)[:math.prod(shape)].reshape(shape)
