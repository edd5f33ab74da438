"""
dev/bench_debugger.py: how fast the visual debugger's page answers, measured in a real browser
(Playwright driving Debian's Chromium, llmc/debugger/harness.py) as a user would click.

What it measures, each from the click (or the URL being opened) to the page having drawn it:
    d4, B=4, T=64 (the default)    the first view after opening the URL; each "Next op" over the
                                   first 30 ops (median and slowest); each view's tab at the
                                   attention op
    d12, B=4, T=1024 (GPT-2 124M)  each view at ops whose tensors are the largest: the attention
                                   (4x12x1024x1024), the logits (1024 x 50304 per sequence), and,
                                   after the step, AdamW's ratios and wte's (50304, 768) heatmap
The time the trainer takes to reach an op (seconds per d12 layer on a CPU) is not a view's time
and is reported apart. What it is not: a test (nothing is asserted), or a measure of the trainer.

The machine's 1-minute load average before and after is recorded too: on a shared machine the
figures are only as good as it was quiet.

Run (several minutes; d12 at T=1024 holds about 10 GiB):
    python dev/bench_debugger.py [--skip-d12] [-o dev/results/visual_debugger_bench.json]
prints one line per figure and writes them as JSON for doc/visual_debugger.md (doc/visual_debugger.py
reads that file).
"""

import datetime
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmc.cli import ArgumentParser  # noqa: E402  (a bad flag: one error line, exit 1)
from llmc.debugger.harness import (DebuggerProcess, browser_page, chromium_unavailable_reason,  # noqa: E402
                                   click_and_wait, op_index, redrawn, show_view, wait_ready)

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "visual_debugger_bench.json")
D4_STEPS = 30
VIEWS = ("op", "attention", "loss", "adamw", "check", "kernel")


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0



def run_to(page, index):
    """Select op `index` in the list and run to it; seconds the trainer took to get there."""
    redrawn(page, lambda: page.click(f"#oplist li[data-op='{index}']"))
    return timed(lambda: click_and_wait(page, "#btn-run-to"))


def view_times(page, views):
    """Seconds each view's tab takes to draw, in order."""
    return {v: round(timed(lambda: show_view(page, v)), 3) for v in views}


def bench_d4():
    out = {}
    with DebuggerProcess([]) as dbg, browser_page() as page:
        out["first_view_s"] = round(timed(lambda: (page.goto(dbg.url), wait_ready(page))), 3)
        steps = [timed(lambda: click_and_wait(page, "#btn-step")) for _ in range(D4_STEPS)]
        out["op_step_median_s"], out["op_step_max_s"] = round(statistics.median(steps), 3), round(max(steps), 3)
        run_to(page, op_index(page, "attention_forward", 0))
        out["views_s"] = view_times(page, VIEWS)
    return out


def bench_d12():
    out = {}
    with DebuggerProcess(["-e", "d12", "-b", "4", "-t", "1024"], timeout=600) as dbg, browser_page() as page:
        out["first_view_s"] = round(timed(lambda: (page.goto(dbg.url), wait_ready(page))), 3)
        out["reach_attention_s"] = round(run_to(page, op_index(page, "attention_forward", 0)), 1)
        out["at_attention_views_s"] = view_times(page, ("attention", "op"))
        out["reach_logits_s"] = round(run_to(page, op_index(page, "matmul_forward -> logits")), 1)
        out["at_logits_views_s"] = view_times(page, ("op", "loss"))
        out["reach_adamw_s"] = round(run_to(page, op_index(page, "gpt2_update")), 1)
        out["at_adamw_views_s"] = view_times(page, ("adamw", "op"))
        show_view(page, "op")
        redrawn(page, lambda: page.click(f"#oplist li[data-op='{op_index(page, 'matmul_forward -> logits')}']"))
        out["wte_param_view_s"] = round(timed(lambda: redrawn(page, lambda: page.click("#params tr[data-param='wte']"))), 3)
    return out


def main(argv=None):
    p = ArgumentParser(prog="dev/bench_debugger.py", description="the visual debugger's page speed, in Chromium")
    p.add_argument("--skip-d12", action="store_true", help="only the d4 figures")
    p.add_argument("-o", "--output", default=RESULT, help="JSON file to write the figures to")
    args = p.parse_args(argv)
    reason = chromium_unavailable_reason()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 1
    result = {"date": datetime.date.today().isoformat(), "machine": f"{os.cpu_count()} CPU cores, {platform.machine()}",
              "load_average_before": round(os.getloadavg()[0], 1), "d4": bench_d4()}
    print("d4 B=4 T=64:", json.dumps(result["d4"]))
    if not args.skip_d12:
        result["d12"] = bench_d12()
        print("d12 B=4 T=1024:", json.dumps(result["d12"]))
    result["load_average_after"] = round(os.getloadavg()[0], 1)     # other work on the machine meanwhile
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
