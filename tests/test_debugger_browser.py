"""The visual debugger's page in a real browser (Playwright driving Debian's Chromium): start
`python -m llmc.debugger` on a d2 model as a user would, click through a whole training step and
check what the page shows against gpt2_cpu.py run here: a heatmap cell's hover equals the tensor
element, the loss shown equals the loss the trainer prints, an attention row sums to 1, the
per-token losses, and after "Next training step" the parameter and its update shown equal the
reference's after one AdamW update. Also the GPU-against-reference view on a --check-save file
made here, and the kernel-threads view on a hand-written trace. About half a minute.
Skipped, saying why, without Playwright or /usr/bin/chromium (make test's set-up installs both)."""

import json
import os
import re

import numpy as np
import pytest

import gpt2_cpu as g
from llmc.check import TOLERANCES, save_comparison
from llmc.debugger.harness import (DebuggerProcess, browser_page, choose, chromium_unavailable_reason, click,
                                   click_and_wait, hover_cell, op_index, show_view, wait_ready)
from llmc.paths import DEFAULT_TRAIN
from test_debugger import B, T, reference_gpt2  # noqa: E402  (tests/ is on sys.path: the same reference)

STEPS = 2                                         # test_debugger's ARGS: -b 2 -t 16 -x 2
REASON = chromium_unavailable_reason() or (None if os.path.exists(DEFAULT_TRAIN) else "no Shakespeare data: make data")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"browser tests: {REASON}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def hover_value(page, div, row, col):
    """The number a heatmap's hover label shows for cell (row, col), as the float32 it names."""
    text = hover_cell(page, div, row, col)
    return np.float32(float(NUMBER.findall(text.split("\n")[-1])[-1])), text


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A --check-save file with one known error, and a kernel trace of two warps."""
    d = tmp_path_factory.mktemp("debugger")
    ref = np.linspace(-1.0, 1.0, 2 * 4 * 8, dtype=np.float32).reshape(2, 4, 8)
    got = ref.copy()
    atol, rtol = TOLERANCES["cuda_fp32"]["activation"]
    got[0, 1, 2] += np.float32(2 * (atol * 1.0 + rtol * abs(ref[0, 1, 2])))           # twice its tolerance
    save_comparison(str(d / "check.npz"), [("encoded", "activation", got, ref), ("lnf", "activation", ref, ref)],
                    "cuda_fp32", model="d2", B=2, T=4, L=1, NH=1, C=8, V=8, precision="fp32", attention="naive",
                    device="cpu", reference_dtype="float32", ok=False)
    trace = {"format": "llmc-kernel-trace-1", "kernel": "copy_kernel", "source": "kernels/copy.cu",
             "grid": [1, 1, 1], "block": [64, 1, 1], "warp_size": 32,
             "buffers": [{"name": "inp", "space": "global", "elements": 64, "row": 32}],
             "accesses": [{"block": [0, 0, 0], "warp": w, "line": 7, "op": "read", "buffer": "inp",
                           "lanes": list(range(32)), "elements": [32 * w + lane for lane in range(32)]}
                          for w in range(2)],
             "warps": [{"block": [0, 0, 0], "warp": w, "requests": 1, "sectors_per_request": 4, "bank_conflicts": 0}
                       for w in range(2)]}
    (d / "trace.json").write_text(json.dumps(trace))
    return d


@pytest.fixture(scope="module")
def session(files):
    args = ["-e", "d2", "-b", str(B), "-t", str(T), "-x", str(STEPS), "--check-run", str(files / "check.npz"),
            "--kernel-trace", str(files / "trace.json")]
    with DebuggerProcess(args) as dbg, browser_page() as page:
        page.goto(dbg.url)
        wait_ready(page)
        yield dbg, page
        assert not page.errors, page.errors



def test_a_whole_step_in_the_browser(session):
    dbg, page = session
    ref, after, _, _ = reference_gpt2()             # tests/test_debugger.py's: the same run, B, T, steps
    status = page.inner_text("#status")
    assert status.startswith("step 1 · micro-batch 1 · forward · op 1/51") and "encoder_forward" in status
    ln1 = op_index(page, "layernorm_forward -> ln1", 0)
    loss_op = op_index(page, "crossentropy_forward")
    att_back = op_index(page, "attention_backward", 0)
    n_ops = len(page.query_selector_all("#oplist li[data-op]"))
    shown_step_line = None
    for i in range(1, n_ops):                                  # every op of the step, one click each
        click_and_wait(page, "#btn-step")
        assert f"op {i + 1}/{n_ops}" in page.inner_text("#status")
        if i == ln1:                                          # a cell's hover is the tensor's element
            value, text = hover_value(page, "heatmap", 3, 5)
            assert "t 3, c 5" in text and value == ref.acts["ln1"][0][0, 3, 5]
        if i == loss_op:
            assert page.inner_text("#loss-value") == f"loss {ref.mean_loss:.6f}"
            show_view(page, "attention")
            choose(page, "#att-layer", "1")
            choose(page, "#att-head", "2")
            row = page.evaluate("document.getElementById('att-heatmap').data[0].z[5]")
            assert sum(row) == pytest.approx(1.0, abs=1e-6)
            np.testing.assert_array_equal(np.float32(row), ref.acts["att"][1][0, 2, 5])
            show_view(page, "loss")
            titles = [s.get_attribute("title") for s in page.query_selector_all("#loss-text span")]
            assert len(titles) == T
            assert [float(t.rsplit("loss ", 1)[1]) for t in titles] == \
                [float(f"{v:.6f}") for v in ref.acts["losses"][0]]
            show_view(page, "op")
        if i == att_back:                                     # the gradient of the probabilities
            show_view(page, "attention")
            choose(page, "#att-layer", "0")
            choose(page, "#att-kind", "1")
            assert "attention_backward's local datt" in page.inner_text("#att-info")
            choose(page, "#att-kind", "0")
            show_view(page, "op")
        if i == n_ops - 1:
            shown_step_line = page.inner_text("#step-line")
            assert shown_step_line.startswith(f"loss {ref.mean_loss:.6f} | norm {g.gpt2_grad_norm(ref):.4f}")
    click_and_wait(page, "#btn-next-step")
    assert page.inner_text("#status").startswith("step 2 · micro-batch 1 · forward · op 1/51")
    printed = dbg.wait_for_line(r"step\s+1/2 \| loss")
    assert printed and f"loss {ref.mean_loss:.6f}" in printed                  # the loss the trainer printed
    # the parameter after one update, and the update itself, as the reference computes them
    attproj = op_index(page, "matmul_forward -> attproj", 0)
    click(page, f"#oplist li[data-op='{attproj}']")
    click_and_wait(page, "#btn-run-to")
    assert f"op {attproj + 1}/51" in page.inner_text("#status")
    click(page, "#params tr[data-param='attprojw']")
    page.wait_for_function("document.querySelector('#params td.ratio') !== null")
    assert "(step 1)" in page.inner_text("#params")
    value, _ = hover_value(page, "param-heatmap", 7, 9)
    assert value == after.P["attprojw"][0][7, 9]
    choose(page, "#param-which", "update")
    value, _ = hover_value(page, "param-heatmap", 7, 9)
    assert value == after.P["attprojw"][0][7, 9] - ref.P["attprojw"][0][7, 9]
    show_view(page, "adamw")
    assert len(page.query_selector_all("#adamw-table tr")) == 1 + 4 + 2 * 12   # a header, wte, wpe, lnfw, lnfb, 12 per layer
    show_view(page, "op")
    click(page, "#op-title a[data-src]")
    assert "gpt2_cpu.py, line" in page.inner_text("#source-name")
    assert "a[\"attproj\"] = matmul_forward" in page.inner_text("#source-text .line.hl")


def test_gpu_against_reference_view(session):
    dbg, page = session
    show_view(page, "check")
    rows = page.query_selector_all("#check-table tr[data-tensor]")
    cells = [c.inner_text() for c in rows[0].query_selector_all("td")]
    assert cells[0] == "encoded" and cells[-1] == "1" and float(cells[-2]) == pytest.approx(2.0, rel=1e-3)
    assert float(rows[1].query_selector_all("td")[-1].inner_text()) == 0
    value, _ = hover_value(page, "check-ratio", 1, 2)
    assert value == pytest.approx(2.0, rel=1e-3)


def test_kernel_threads_view(session):
    dbg, page = session
    show_view(page, "kernel")
    assert "copy_kernel" in page.inner_text("#kernel-message")
    text = hover_cell(page, "kernel-heatmap", 1, 3)                # element 35: warp 1, lane 3
    assert "element 35: read by block (0,0,0) warp 1 lane 3, line 7" in text
    assert page.inner_text("#kernel-warps").count("\t4\t") == 2 or "4" in page.inner_text("#kernel-warps")
