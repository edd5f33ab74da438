"""
dev/bench_compare.py: the runs of several `dev/bench.py --json` files side by side, each against
the first (the baseline): which options differ, ms/step, tokens/s, MFU, memory, the ratio of
tokens/s to the baseline's at the same B and trainer, and, for gpt2_cuda.py's runs, the device
calls whose time changed most between the two one-step breakdowns.

What it is for: a GPU call times the step once per option (dev/results/next_gpu.sh runs
dev/bench.py with --autotune 8, --gelu-fusion 0, --bias-grad-epilogue 2, ... one JSON file each);
an option becomes the default only if it measures faster, so what the call left must be read as
ratios against the defaults' run of the same call. Times from different calls or machines are not
comparable (dev/bench.py's own rule), and this says which GPU each file names.

What it deliberately is not: a statistics tool. Each number is dev/bench.py's median of its timed
steps; a ratio within about 1% of 1 is within the run-to-run spread the recorded sessions saw.

Run it:
    python dev/bench_compare.py $OUT/bench_b16_default.json $OUT/bench_b16_*.json   # (a file named twice: once)
    python dev/bench_compare.py base.json other.json --top 8
prints one table (file, options against the baseline's, B, trainer, ms/step, tok/s, MFU, GiB,
ratio), then per other file and B the --top device calls whose summed time moved most, with the
baseline's and that file's milliseconds. A file that is missing or not a dev/bench.py JSON is one
`error:` line and exit 1.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmc.cli import ArgumentParser, InputError  # noqa: E402

NOT_OPTIONS = ("runs", "model", "T")    # a bench JSON's keys that are not the trainer's options
TRAINERS = {"cupy": "ours", "torch": "twin"}


def load(path):
    """A dev/bench.py --json file: {option: value, ..., "runs": [[B, {trainer: result or failure}]]}.
    Raises InputError (one line) for a file that is missing or not such a file."""
    try:
        with open(path, encoding="utf-8") as f:
            bench = json.load(f)
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e})") from None
    if not (isinstance(bench, dict) and isinstance(bench.get("runs"), list)):
        raise InputError(f"{path}: not a dev/bench.py --json file (no \"runs\" list)")
    return bench


def options(bench):
    """The trainer options a bench JSON records: every key but the runs, the model and T."""
    return {key: value for key, value in bench.items() if key not in NOT_OPTIONS}


def differing(bench, base):
    """'key=value' for each option of bench that the baseline has otherwise (or lacks)."""
    base_options = options(base)
    return [f"{key}={value}" for key, value in options(bench).items() if base_options.get(key) != value]


def results(bench):
    """{(B, trainer): result dict} of the runs that finished (a failed worker is a string)."""
    return {(B, trainer): result for B, by_trainer in bench["runs"] for trainer, result in by_trainer.items()
            if isinstance(result, dict)}


def table(named, top):
    """The lines: the table of every finished run against the baseline (named[0]), then each
    other file's largest breakdown changes. named: [(name, bench)]."""
    (base_name, base), base_results = named[0], results(named[0][1])
    rows, devices = [], set()
    for name, bench in named:
        changed = "(baseline)" if bench is base else (", ".join(differing(bench, base)) or "(same options)")
        for (B, trainer), r in sorted(results(bench).items()):
            ref = base_results.get((B, trainer))
            devices.add(r.get("device", "?"))
            rows.append((name, changed, f"{B:3d} {TRAINERS.get(trainer, trainer):7s} {r['ms_median']:8.2f} "
                                        f"{r['tok_s']:9.0f} {100 * r['mfu']:5.1f}% {r['memory_bytes'] / 2**30:6.2f} "
                                        + (f"{r['tok_s'] / ref['tok_s']:6.3f}" if ref else f"{'n/a':>6s}")))
    w_name = max([len("file")] + [len(name) for name, _, _ in rows])
    w_changed = max([len("options")] + [len(changed) for _, changed, _ in rows])
    lines = [f"{'file':{w_name}s} {'options':{w_changed}s} {'B':>3s} {'trainer':7s} {'ms/step':>8s} {'tok/s':>9s} "
             f"{'MFU':>6s} {'GiB':>6s} {'ratio':>6s}"]
    lines += [f"{name:{w_name}s} {changed:{w_changed}s} {numbers}" for name, changed, numbers in rows]
    if len(devices) > 1:
        lines.append(f"warning: the files name {len(devices)} devices ({', '.join(sorted(devices))}): "
                     "their times are not comparable")
    for name, bench in named[1:]:
        for (B, trainer), r in sorted(results(bench).items()):
            ref = base_results.get((B, trainer))
            if not (ref and r.get("breakdown") and ref.get("breakdown")):
                continue
            changes = breakdown_changes(ref["breakdown"], r["breakdown"])[:top]
            width = max(len(call) for call, _, _ in changes)
            lines.append("")
            lines.append(f"{name}, B={B}: the device calls that moved most against {base_name} (ms per step)")
            lines += [f"  {call:{width}s} {before:8.3f} -> {after:8.3f}  ({after - before:+.3f})"
                      for call, before, after in changes]
    return lines


def breakdown_changes(before, after):
    """[(call, ms before, ms after)] over the calls of either breakdown ([name, calls, total ms]
    rows), a call missing on one side at 0 ms there, largest |change| first (ties by name)."""
    ms_before = {name: total for name, _, total in before}
    ms_after = {name: total for name, _, total in after}
    rows = [(name, ms_before.get(name, 0.0), ms_after.get(name, 0.0)) for name in set(ms_before) | set(ms_after)]
    return sorted(rows, key=lambda row: (-abs(row[2] - row[1]), row[0]))


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("files", nargs="+", metavar="file.json", help="dev/bench.py --json files; the first is the "
                                                                      "baseline")
    parser.add_argument("--top", type=int, default=5, help="breakdown rows per compared run (default 5)")
    args = parser.parse_args(argv)
    paths = list(dict.fromkeys(os.path.realpath(path) for path in args.files))   # a file once: base.json base*.json
    try:
        named = [(os.path.basename(path), load(path)) for path in paths]
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(table(named, args.top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
