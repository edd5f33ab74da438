"""
tests/test_status.py: what the docs say has run on a GPU is what dev/results/ records.

The README and doc/ quote the GPU sessions' results: which tests passed on an H100, how fast the
kernels and the CUDA graph were. Each quoted status here is recomputed from the record it depends
on (the sessions' tables, JSON files and logs under dev/results/) and must appear in the doc word
for word, as the tutorials' numbers are recomputed by their scripts (tests/test_docs.py). And the
phrases that make a doc go stale on their own ("not yet run", "still to run", "not timed": true
the day they are written, false after the next session) appear in no doc: a doc says what ran and
where it is recorded.
Run: pytest tests/test_status.py (a second; reads files only).
"""

import glob
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "dev", "results")
SESSION5 = os.path.join(RESULTS, "2026-11-26_nvidia-h100-80gb-hbm3_session5_")
DOCS = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "doc", "*.md")))
STALE_PHRASES = ("not yet run", "not yet measured", "not yet timed", "still to run", "not timed", "never ran",
                 "have not been timed", "has not been timed", "so far run", "no timings exist", "waits for the next GPU",
                 "not measured yet", "not timed yet")
# Llama 3's progressions timed in the fifth session: (the record, the op); swiglu's table was cut
# from its .md and survives in the call's log
LLAMA3_TIMINGS = (("rmsnorm.md", "rmsnorm_forward"), ("rmsnorm.md", "rmsnorm_backward"), ("rope.md", "rope_forward"),
                  ("rope.md", "rope_backward"), ("repeat_kv.md", "repeat_kv_forward"),
                  ("repeat_kv.md", "repeat_kv_backward"), ("call_a.log", "swiglu_forward"))


def text(path):
    with open(path, encoding="utf-8") as f:
        return " ".join(f.read().split())           # one line: a quote may wrap anywhere


def timing_rows(path, op):
    """The rows of a dev/cuda table (`make dev-cuda`'s .md, or the same table in a log) under
    `### <op> ...`: (version, kernel, block, time in ms, % of the copy bandwidth)."""
    rows, section = [], None
    for line in open(path, encoding="utf-8"):
        if line.startswith("### "):
            section = line.split()[1]
        elif section == op and re.match(r"\| \d+ \|", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.append((int(cells[0]), cells[1], int(cells[2]), float(cells[3]), float(cells[5])))
    assert rows, f"{path}: no table of {op}"
    return rows


def fastest(rows, keep):
    return min((r for r in rows if keep(r)), key=lambda r: r[3])


def bench_ms(path):
    """The median ms/step of ours in a dev/bench.py --json file of one batch size."""
    with open(path) as f:
        return json.load(f)["runs"][0][1]["cupy"]["ms_median"]


def record_table_row(first_cell):
    """The cells of the row of dev/results/README.md's tables that starts with `first_cell`."""
    for line in open(os.path.join(RESULTS, "README.md"), encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"dev/results/README.md: no row {first_cell}")


@pytest.mark.parametrize("path", DOCS, ids=[os.path.relpath(p, ROOT) for p in DOCS])
def test_no_doc_carries_a_status_that_goes_stale_by_itself(path):
    said = text(path).lower()
    found = [phrase for phrase in STALE_PHRASES if phrase in said]
    assert not found, f"{os.path.relpath(path, ROOT)} says {found}: say what ran and where it is recorded (dev/results/)"


def test_llama3_kernel_timings_are_the_records():
    doc = text(os.path.join(ROOT, "doc", "llama3.md"))
    slower = []
    for record, op in LLAMA3_TIMINGS:
        rows = timing_rows(SESSION5 + record, op)
        production = fastest(rows, lambda r: r[1] == op)             # the production kernel bears the op's name
        first = fastest(rows, lambda r: r[0] == 1)
        assert f"{op} {production[3]:.3f} ms ({production[4]:.0f}%)" in doc, op
        slower.append(first[3] / production[3])
    assert f"Version 1 of each took {min(slower):.1f} to {max(slower):.0f} times as long" in doc
    assert "swiglu_backward validated" in doc and "swiglu_backward [bf16]" in text(SESSION5 + "call_a.log")
    assert "run_all rc=124" in text(SESSION5 + "call_a.log")       # the step's limit cut it


def test_the_cuda_graphs_gain_and_layernorm_backward_v4_are_the_records():
    doc = text(os.path.join(ROOT, "doc", "gpu.md"))
    eager, graph = bench_ms(SESSION5 + "bench_b16_graph0.json"), bench_ms(SESSION5 + "bench_b16_graph1.json")
    gain = 100 * (eager / graph - 1)
    assert f"the graph ran {graph:.1f} ms a step against eager's {eager:.1f} in the same call, {gain:.1f}% faster" in doc
    assert f"{gain:.1f}% faster than eager ({graph:.1f} against {eager:.1f} ms a step" in doc
    rows = timing_rows(SESSION5 + "layernorm.md", "layernorm_backward")
    v3, v4 = fastest(rows, lambda r: r[0] == 3)[3], fastest(rows, lambda r: r[0] == 4)[3]
    assert f"layernorm_backward's version 4 took {v4:.4f} ms, {100 * (1 - v4 / v3):.0f}% less than the production " \
           f"version 3" in doc


def test_the_cuda_graph_tests_passed_on_the_h100():
    """The fifth session ran the two graph test files with -m gpu: 8 passed, none failed; the README
    and doc/llama3.md say the Llama 3 graph is bitwise the eager step's on an H100."""
    script, log = text(SESSION5 + "call_a.sh"), text(SESSION5 + "call_a.log")
    assert "pytest -m gpu -q -rs tests/test_cuda_graph.py tests/test_llama3_cuda_graph.py" in script
    assert "8 passed, 19 deselected" in log and "pytest rc=0" in log and "failed" not in log.split("pytest rc=0")[0]
    assert "bitwise the eager step's on an H100 too" in text(os.path.join(ROOT, "README.md"))
    assert "On an H100 (the fifth session) the same test passed" in text(os.path.join(ROOT, "doc", "llama3.md"))


def test_the_llama3_bench_is_the_records():
    ours, twin = record_table_row("llama3_cuda.py"), record_table_row("PyTorch twin")
    tok_s, gib, ratio, twin_gib = ours[2], float(ours[4]), float(ours[5]), float(twin[4])
    assert f"{tok_s} tokens/s, {ratio:.3f} of the twin's, in {gib:.2f} GiB against its {twin_gib:.2f}" in \
        text(os.path.join(ROOT, "doc", "llama3.md"))
    readme = text(os.path.join(ROOT, "README.md"))
    assert f"ran at {int(tok_s.replace(',', '')) // 1000}K tokens/s, {ratio:.2f}x its PyTorch twin, in {gib:.1f} GiB " \
           f"against the twin's {twin_gib:.1f}" in readme


def test_multi_gpu_runs_are_said_to_be_emulated_only_as_the_record_says():
    record = text(os.path.join(RESULTS, "README.md"))
    assert "multi-GPU (NCCL, ZeRO-1) needs a machine with several GPUs (none of this project's kinds has them)" in record
    assert "which has run on the emulated device only: the project's GPU machines have one GPU" in \
        text(os.path.join(ROOT, "README.md"))
    assert "Never measured on a GPU: multi-GPU (NCCL, ZeRO-1; this project's GPU machines have one GPU)" in \
        text(os.path.join(ROOT, "doc", "gpu.md"))
