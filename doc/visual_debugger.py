"""
doc/visual_debugger.py: the screenshots and numbers of doc/visual_debugger.md, the visual
debugger's tutorial.

What it is: compute(fig_dir) runs the tutorial's session for real: `python -m llmc.debugger` on
the default d4 model, driven in Chromium (llmc/debugger/harness.py) through the clicks the text
describes, a screenshot of each view into fig_dir, with a bf16 `gpt2_cuda.py --device cpu
--check-save` run of d2 on the emulated device beside it; it returns the numbers the text quotes:
the op counts, the first step's loss as the page shows it, the bf16 run's largest error, the warp
requests of the kernel trace it records with dev/kernel_trace.py (one layernorm_forward launch of a
d2 step on the emulated device) and shows, and the
speed figures of dev/bench_debugger.py's last run (dev/results/visual_debugger_bench.json, which
that script writes; a benchmark, so they are quoted from its record, not measured here).
What it is not: a test of the page's values (tests/test_debugger_browser.py is that).

Run (about a minute; needs Playwright and /usr/bin/chromium, and `make data`):
    python doc/visual_debugger.py       # prints the numbers, redraws doc/visual_debugger_*.png
"""

import json
import os
import subprocess
import sys
import tempfile

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import DOC_DIR, ROOT, print_numbers  # noqa: E402

from llmc.paths import DEFAULT_TRAIN  # noqa: E402

BENCH = os.path.join(ROOT, "dev", "results", "visual_debugger_bench.json")
CHECK_ARGS = ["-e", "d2", "-b", "1", "-t", "32", "--precision", "bf16"]
TRACE_ARGS = ["-e", "d2", "-b", "1", "-t", "32", "-x", "1", "-v", "0", "-s", "0"]


def unavailable_reason():
    """Why compute() cannot run here (no browser, no data), or None."""
    from llmc.debugger.harness import chromium_unavailable_reason
    reason = chromium_unavailable_reason()
    if reason is None and not os.path.exists(DEFAULT_TRAIN):
        reason = "no Shakespeare data: make data"
    return reason



def compute(fig_dir):
    from llmc.debugger.checkrun import CheckRun
    from llmc.debugger.harness import (DebuggerProcess, browser_page, choose, click, click_and_wait, op_index,
                                       show_view, wait_ready)
    numbers = {}
    scratch = tempfile.TemporaryDirectory()
    check = os.path.join(scratch.name, "check_bf16.npz")
    r = subprocess.run([sys.executable, "gpt2_cuda.py", "--device", "cpu", *CHECK_ARGS, "--check-save", check],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"gpt2_cuda.py --check-save failed: {r.stdout[-1000:]} {r.stderr[-1000:]}")
    run = CheckRun(check)
    numbers["check_worst_rel_err"] = f"{max(row['rel'] for row in run.rows):.0e}"
    numbers["check_tensors"] = str(len(run.rows))
    # one launch of layernorm_forward on the emulated device, thread by thread, for the kernel view
    trace = os.path.join(scratch.name, "kernel_trace.json")
    r = subprocess.run([sys.executable, "dev/kernel_trace.py", "layernorm_forward", "-o", trace, "--", *TRACE_ARGS],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"dev/kernel_trace.py failed: {r.stdout[-1000:]} {r.stderr[-1000:]}")
    with open(trace) as f:
        numbers["trace_requests"] = str(len(json.load(f)["accesses"]))

    def shot(page, name):
        page.screenshot(path=os.path.join(fig_dir, f"visual_debugger_{name}.png"))

    with DebuggerProcess(["--check-run", check, "--kernel-trace", trace]) as dbg, browser_page() as page:
        page.goto(dbg.url)
        wait_ready(page)
        ops = page.query_selector_all("#oplist li[data-op]")
        numbers["ops_d4"] = str(len(ops))
        numbers["ops_per_block"] = str(op_index(page, "layernorm_forward -> ln1", 1) - op_index(page, "layernorm_forward -> ln1", 0))
        # the op view: the qkv projection of layer 0, its parameter below
        click(page, f"#oplist li[data-op='{op_index(page, 'matmul_forward -> qkv', 0)}']")
        click_and_wait(page, "#btn-run-to")
        shot(page, "op")
        # the loss, the attention over the text, the loss per token: after the forward
        click(page, f"#oplist li[data-op='{op_index(page, 'crossentropy_forward')}']")
        click_and_wait(page, "#btn-run-to")
        numbers["loss_step1"] = page.inner_text("#loss-value").split()[1][:5]
        show_view(page, "attention")
        choose(page, "#att-layer", "3")
        shot(page, "attention")
        show_view(page, "loss")
        shot(page, "loss")
        # the backward: the gradient of layer 0's attention probabilities
        show_view(page, "op")
        click(page, f"#oplist li[data-op='{op_index(page, 'attention_backward', 0)}']")
        click_and_wait(page, "#btn-run-to")
        show_view(page, "attention")
        choose(page, "#att-layer", "0")
        choose(page, "#att-kind", "1")
        shot(page, "attention_gradient")
        choose(page, "#att-kind", "0")
        # AdamW: the update of step 1, and the op view's parameter table in step 2
        click_and_wait(page, "#btn-finish")
        show_view(page, "adamw")
        shot(page, "adamw")
        numbers["adamw_rows"] = str(len(page.query_selector_all("#adamw-table tr")) - 1)
        show_view(page, "check")
        click(page, "#check-table tr[data-tensor='ln2']")
        shot(page, "check")
        show_view(page, "kernel")
        shot(page, "kernel")
        show_view(page, "op")
        click(page, "#op-title a[data-src]")
        shot(page, "source")
    scratch.cleanup()
    with open(BENCH) as f:
        bench = json.load(f)
    d4, d12 = bench["d4"], bench.get("d12", {})
    numbers["bench_date"] = bench["date"]
    numbers["bench_load_before"] = f"{bench['load_average_before']:.1f}"
    numbers["bench_load_after"] = f"{bench['load_average_after']:.1f}"
    numbers["bench_d4_first_view"] = f"{d4['first_view_s']:.2f}"
    numbers["bench_d4_step_median"] = f"{d4['op_step_median_s']:.2f}"
    numbers["bench_d4_step_max"] = f"{d4['op_step_max_s']:.2f}"
    numbers["bench_d4_views_max"] = f"{max(d4['views_s'].values()):.2f}"
    if d12:
        numbers["bench_d12_first_view"] = f"{d12['first_view_s']:.2f}"
        views = {**d12["at_attention_views_s"], **{f"logits_{k}": v for k, v in d12["at_logits_views_s"].items()},
                 **{f"adamw_{k}": v for k, v in d12["at_adamw_views_s"].items()}}
        numbers["bench_d12_attention_view"] = f"{d12['at_attention_views_s']['attention']:.2f}"
        numbers["bench_d12_logits_view"] = f"{d12['at_logits_views_s']['op']:.2f}"
        numbers["bench_d12_adamw_view"] = f"{d12['at_adamw_views_s']['adamw']:.2f}"
        numbers["bench_d12_wte_view"] = f"{d12['wte_param_view_s']:.2f}"
        numbers["bench_d12_views_max"] = f"{max(list(views.values()) + [d12['wte_param_view_s']]):.2f}"
        numbers["bench_d12_reach_logits"] = f"{d12['reach_logits_s']:.0f}"
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
