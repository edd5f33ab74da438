"""
dev/vislog.py: plot training runs from their main.log files into one PNG.

A trainer run with `-o DIR` appends one line per event to DIR/main.log
(doc/file_formats.md):
    s:<step> trl:<train loss> lr:<learning rate> norm:<grad norm>
    s:<step> tel:<val loss>
    s:<step> eval:<hellaswag accuracy>
This script draws train loss (thin) and val loss (thick, same color) against step for every run,
overlaid and labeled, and, when any run logged HellaSwag accuracy, a second panel with it.
Optional horizontal reference lines mark a target, e.g. a published GPT-2 124M result.
A step logged twice (a resumed run appends again) keeps its last value, as llm.c's vislog does.

What it is not: a live dashboard; run it again to refresh the picture.

Run it:
    python dev/vislog.py log124M log124M_edu:edu --ref-loss 3.28 --ref-acc 0.294 -o runs.png
prints
    log124M: 5000 train, 21 val, 21 eval points
    edu: 5000 train, 21 val, 21 eval points
    wrote runs.png
A run is a directory holding main.log or the log file itself, optionally followed by
:label (default label: the directory's name).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.utils import InputError, check_input_file, require  # noqa: E402

LOG_NAME = "main.log"
TRAIN_KEY, VAL_KEY, EVAL_KEY = "trl", "tel", "eval"
FIGURE_INCHES_PER_PANEL = (6.4, 4.8)
FIGURE_DPI = 100
TRAIN_ALPHA = 0.35                 # the noisy per-step train loss stays in the background
REF_STYLE = {"color": "black", "linestyle": "--", "linewidth": 1.0}
BINARY_SNIFF_BYTES = 8192          # a text log has no NUL byte; look this far before parsing
MAX_STEP = 2**63 - 1               # steps are int64 (the plot's x axis)


# ----------------------------------------------------------------------------
# parsing

def parse_log(path):
    """Parse a main.log -> {key: (steps int64 array, values float64 array)}, one entry per key
    that occurs ("trl", "lr", "norm", "tel", "eval", ...), sorted by step; when a step repeats,
    its last value wins. Blank lines are skipped. Raises InputError naming the file and line on
    anything else that is not `s:<int>` followed by `key:<float>` fields, and on a binary file
    (a NUL byte in its first BINARY_SNIFF_BYTES, as grep and git decide) or bytes not UTF-8."""
    check_input_file(path, "log file")
    series = {}                                             # key -> {step: value}
    with open(path, "rb") as f:                             # lines end at b"\n" only, as the Logger writes
        if b"\0" in f.read(BINARY_SNIFF_BYTES):
            raise InputError(f"{path}: a binary file, not a main.log (a checkpoint or token file?)")
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): "
                                 "not a main.log") from None
            fields = line.split()
            if not fields:
                continue
            try:
                name, step = fields[0].split(":")
                if name != "s" or len(fields) < 2:
                    raise ValueError
                step = int(step)
                if not 0 <= step <= MAX_STEP:
                    raise InputError(f"{path}:{lineno}: step {step} is outside [0, 2^63): not a main.log")
                for field in fields[1:]:
                    key, value = field.split(":")
                    series.setdefault(key, {})[step] = float(value)
            except ValueError:
                excerpt = repr(line.strip()[:80])           # quoted, control characters escaped: one line
                raise InputError(f"{path}:{lineno}: not a log line (expected 's:<step> key:<value> ...'): {excerpt}")
    return {key: (np.array(sorted(d), dtype=np.int64), np.array([d[s] for s in sorted(d)], dtype=np.float64))
            for key, d in series.items()}


def resolve_run(spec):
    """'DIR', 'FILE', 'DIR:label' or 'FILE:label' -> (log path, label)."""
    path, label = spec, None
    if not os.path.exists(spec) and ":" in spec:
        path, label = spec.rsplit(":", 1)
    if os.path.isdir(path):
        path = os.path.join(path, LOG_NAME)
    if label is None:
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return path, label


# ----------------------------------------------------------------------------
# drawing

def plot_runs(runs, out_path, ref_loss=None, ref_acc=None, ref_loss_label=None, ref_acc_label=None):
    """Draw runs [(label, series from parse_log)] into a PNG at out_path: panel 1 train loss (thin)
    and val loss (thick) per run in one color; panel 2, only when some run has "eval", HellaSwag
    accuracy. ref_loss / ref_acc draw labeled dashed horizontal lines."""
    import matplotlib
    matplotlib.use("Agg")                                   # files only, no display needed
    import matplotlib.pyplot as plt

    has_eval = any(EVAL_KEY in series for _, series in runs) or ref_acc is not None
    panels = 2 if has_eval else 1
    width, height = FIGURE_INCHES_PER_PANEL
    fig, axes = plt.subplots(1, panels, figsize=(width * panels, height), dpi=FIGURE_DPI, squeeze=False)
    ax_loss = axes[0, 0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, series) in enumerate(runs):
        color = colors[i % len(colors)]
        if TRAIN_KEY in series:
            ax_loss.plot(*series[TRAIN_KEY], color=color, alpha=TRAIN_ALPHA, linewidth=1, label=f"{label} train")
        if VAL_KEY in series:
            ax_loss.plot(*series[VAL_KEY], color=color, linewidth=2, marker="o", markersize=3, label=f"{label} val")
        if has_eval and EVAL_KEY in series:
            axes[0, 1].plot(*series[EVAL_KEY], color=color, linewidth=2, marker="o", markersize=3, label=label)
    if ref_loss is not None:
        ax_loss.axhline(ref_loss, label=ref_loss_label or f"reference {ref_loss:g}", **REF_STYLE)
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="train and val loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize="small")
    if has_eval:
        ax_acc = axes[0, 1]
        if ref_acc is not None:
            ax_acc.axhline(ref_acc, label=ref_acc_label or f"reference {ref_acc:g}", **REF_STYLE)
        ax_acc.set(xlabel="step", ylabel="accuracy", title="HellaSwag accuracy")
        ax_acc.grid(alpha=0.3)
        ax_acc.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)


# ----------------------------------------------------------------------------
# command line

def parse_args(argv=None):
    p = ArgumentParser(description="Plot train/val loss and HellaSwag accuracy from main.log files.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directory or main.log, optionally followed by :label")
    p.add_argument("-o", "--output", default="vislog.png", help="PNG to write")
    p.add_argument("--ref-loss", type=float, default=None, help="draw a reference val loss line (e.g. 3.28)")
    p.add_argument("--ref-acc", type=float, default=None, help="draw a reference HellaSwag accuracy line (e.g. 0.294)")
    p.add_argument("--ref-loss-label", default=None, help="legend text of the reference loss line")
    p.add_argument("--ref-acc-label", default=None, help="legend text of the reference accuracy line")
    return p.parse_args(argv)


def check_output_name(path):
    """The image format of the -o name's extension, which must be one matplotlib writes (png,
    pdf, svg, ...): a name without one would be written as a PNG under a name that does not say
    so. Raises InputError."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    extension = os.path.splitext(path)[1][1:].lower()
    if extension not in formats:
        raise InputError(f"-o {path}: not an image name: end it with one of {', '.join('.' + f for f in sorted(formats))}")
    return extension


def main(argv=None):
    args = parse_args(argv)
    require("dev/vislog.py", "matplotlib")
    try:
        check_output_name(args.output)
        runs = []
        for spec in args.runs:
            path, label = resolve_run(spec)
            series = parse_log(path)
            if not series:
                raise InputError(f"{path}: empty log")
            counts = ", ".join(f"{len(series[k][0])} {name}" for k, name in
                               ((TRAIN_KEY, "train"), (VAL_KEY, "val"), (EVAL_KEY, "eval")) if k in series)
            print(f"{label}: {counts} points")
            runs.append((label, series))
        plot_runs(runs, args.output, args.ref_loss, args.ref_acc, args.ref_loss_label, args.ref_acc_label)
    except (InputError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
