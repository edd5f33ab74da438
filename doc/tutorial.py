"""
doc/tutorial.py: the few helpers the tutorial scripts doc/<name>.py share.

What it is: finite differences, the relative-error measure every gradient check quotes, matplotlib
on a file-only backend and saving a figure, and the `python doc/<name>.py` entry point that prints
a script's numbers.
Importing it also puts the repository root on sys.path, so a script loaded by file path (as
tests/test_docs.py loads them) can then import gpt2_cpu, gpt2_cuda and llmc.
What it is not: a tutorial. It has no doc/tutorial.md, so tests/test_docs.py does not treat it
as one; nothing here computes a number that a tutorial quotes.

Use, at the top of a tutorial script:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))      # doc/, for tutorial.py
    from tutorial import numerical_grad, pyplot, rel_err, print_numbers  # noqa: E402
(appended, not inserted first, so that doc/data.py can never shadow a module named `data`).
"""

import os
import sys

import numpy as np

DOC_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOC_DIR)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# central differences in float64: the truncation error is ~h^2, the rounding error ~1e-16/h, so
# h = 1e-6 balances them near 1e-10; the same step as tests/test_layers.py
FD_STEP = 1e-6


def numerical_grad(loss, x, h=FD_STEP):
    """Central differences (loss(x + h e_i) - loss(x - h e_i)) / 2h of the scalar loss() for every
    element i of the array x, perturbing x in place and restoring it. Returns an array of x's shape."""
    flat = x.reshape(-1)
    grad = np.zeros(flat.size)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = loss()
        flat[i] = old - h
        down = loss()
        flat[i] = old
        grad[i] = (up - down) / (2 * h)
    return grad.reshape(x.shape)


def rel_err(a, ref):
    """max |a - ref| / max |ref|: the largest error, relative to the reference's scale."""
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (imported here, when a figure is drawn)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, fig_dir, name, dpi=100, **savefig_args):
    """Lay out fig, write it as fig_dir/name (a PNG the tutorial shows) and close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(os.path.join(fig_dir, name), dpi=dpi, **savefig_args)
    plt.close(fig)


def print_numbers(compute, argv=None):
    """`python doc/<name>.py`: run compute(doc/), which redraws the figures in place, and print
    one `key = value` line per number the tutorial quotes. It takes no flags: --help says so, and
    any other argument is one `error:` line and exit 1 (llmc.argparser.ArgumentParser), as for every tool."""
    from llmc.cli import ArgumentParser
    name = os.path.relpath(sys.argv[0], os.path.dirname(DOC_DIR)) if argv is None else "doc/<name>.py"
    ArgumentParser(prog=name, description="redraw this tutorial's figures in doc/ and print, one `key = value` "
                                          "line each, the numbers it quotes (no flags)").parse_args(argv)
    for key, value in compute(DOC_DIR).items():
        print(f"{key} = {value}")
