"""
tests/test_vislog.py: dev/vislog.py parses main.log files into exact series and draws a PNG.

Checks: parse_log on a hand-written log (the series compared value by value, a repeated step
keeps its last value, a malformed line is rejected naming the line); run labels from `DIR`,
`DIR:label` and a log path; the PNG: PNG magic, a non-trivial size, read back with
matplotlib.image with several distinct colors (runs, reference lines), two panels when accuracy
was logged (wider than tall) and one when not; the CLI's one-line error, also for a binary file
(a checkpoint given by mistake) and for bytes that are not UTF-8.

Run: python -m pytest tests/test_vislog.py -q   (a few seconds)
"""

import os
import subprocess
import sys

import numpy as np
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO_ROOT, "dev"))
sys.path.insert(0, REPO_ROOT)
import vislog  # noqa: E402
from llmc.logger import Logger  # noqa: E402
from llmc.utils import InputError  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 10_000            # an empty 640x480 figure is ~5 KB; curves, text and legends add more
MIN_DISTINCT_COLORS = 6           # white, black text, grid gray, >= 2 run colors, antialiasing shades

LOG_A = """s:0 tel:10.9850
s:1 trl:10.9871 lr:0.000300 norm:2.6114
s:2 trl:9.5000 lr:0.000300 norm:1.9000

s:3 trl:8.2500 lr:0.000200 norm:1.5000
s:3 tel:8.1000
s:3 eval:0.251000
s:4 trl:7.0000 lr:0.000100 norm:1.2500
s:3 trl:8.0000 lr:0.000200 norm:1.4000
s:5 tel:7.5000
s:5 eval:0.262500
"""


@pytest.fixture
def run_dirs(tmp_path):
    a = tmp_path / "runA"
    a.mkdir()
    (a / "main.log").write_text(LOG_A)
    b = tmp_path / "runB"                     # written by the trainers' own Logger: no eval lines
    b.mkdir()
    logger = Logger(str(b))
    for step in range(1, 21):
        logger.log_train(step, 6.0 * 0.95 ** step, 3e-4, 1.0)
        if step % 5 == 0:
            logger.log_val(step, 6.2 * 0.95 ** step)
    return a, b


def test_parse_log_exact(run_dirs):
    a, _ = run_dirs
    s = vislog.parse_log(str(a / "main.log"))
    assert set(s) == {"trl", "lr", "norm", "tel", "eval"}
    np.testing.assert_array_equal(s["trl"][0], [1, 2, 3, 4])
    np.testing.assert_array_equal(s["trl"][1], [10.9871, 9.5, 8.0, 7.0])        # step 3: the later line wins
    np.testing.assert_array_equal(s["norm"][1], [2.6114, 1.9, 1.4, 1.25])
    np.testing.assert_array_equal(s["lr"][1], [3e-4, 3e-4, 2e-4, 1e-4])
    np.testing.assert_array_equal(s["tel"][0], [0, 3, 5])
    np.testing.assert_array_equal(s["tel"][1], [10.985, 8.1, 7.5])
    np.testing.assert_array_equal(s["eval"][0], [3, 5])
    np.testing.assert_array_equal(s["eval"][1], [0.251, 0.2625])


def test_parse_logger_output(run_dirs):
    _, b = run_dirs
    s = vislog.parse_log(str(b / "main.log"))
    np.testing.assert_array_equal(s["trl"][0], np.arange(1, 21))
    np.testing.assert_allclose(s["trl"][1], 6.0 * 0.95 ** np.arange(1, 21), atol=5e-7)   # logged with 6 decimals
    np.testing.assert_array_equal(s["tel"][0], [5, 10, 15, 20])
    assert "eval" not in s


@pytest.mark.parametrize("bad", ["step:3 trl:1.0", "s:x trl:1.0", "s:3 trl:abc", "s:3", "s:3 trl=1.0"])
def test_parse_rejects_malformed(tmp_path, bad):
    path = tmp_path / "main.log"
    path.write_text("s:1 trl:2.0 lr:0.1 norm:1.0\n" + bad + "\n")
    with pytest.raises(InputError, match=":2: not a log line"):
        vislog.parse_log(str(path))


def test_resolve_run(run_dirs):
    a, _ = run_dirs
    assert vislog.resolve_run(str(a)) == (str(a / "main.log"), "runA")
    assert vislog.resolve_run(f"{a}:my run") == (str(a / "main.log"), "my run")
    assert vislog.resolve_run(str(a / "main.log")) == (str(a / "main.log"), "runA")


def read_png(path):
    import matplotlib.image
    raw = open(path, "rb").read()
    assert raw[:len(PNG_MAGIC)] == PNG_MAGIC
    assert len(raw) > MIN_PNG_BYTES
    img = matplotlib.image.imread(path)                       # (H, W, 4) float in [0, 1]
    colors = np.unique((img[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3), axis=0)
    return img, colors


def test_render_two_runs_with_accuracy(run_dirs, tmp_path):
    a, b = run_dirs
    out = tmp_path / "runs.png"
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "vislog.py"), str(a), f"{b}:baseline",
                        "--ref-loss", "3.28", "--ref-acc", "0.294", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["runA: 4 train, 3 val, 2 eval points", "baseline: 20 train, 4 val points",
                                     f"wrote {out}"]
    img, colors = read_png(out)
    height, width = img.shape[:2]
    assert width == 2 * height * vislog.FIGURE_INCHES_PER_PANEL[0] / vislog.FIGURE_INCHES_PER_PANEL[1]
    assert len(colors) >= MIN_DISTINCT_COLORS
    # both run colors (matplotlib's first two cycle colors) appear as opaque lines
    for hexcolor in ("#1f77b4", "#ff7f0e"):
        rgb = np.array([int(hexcolor[i:i + 2], 16) for i in (1, 3, 5)])
        assert np.any(np.all(np.abs(colors.astype(int) - rgb) <= 2, axis=1)), hexcolor


def test_render_one_panel_without_accuracy(run_dirs, tmp_path):
    _, b = run_dirs
    out = str(tmp_path / "one.png")
    vislog.plot_runs([("b", vislog.parse_log(str(b / "main.log")))], out)
    img, colors = read_png(out)
    height, width = img.shape[:2]
    assert (width, height) == tuple(int(x * vislog.FIGURE_DPI) for x in vislog.FIGURE_INCHES_PER_PANEL)
    assert len(colors) >= MIN_DISTINCT_COLORS


def test_cli_missing_log(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "vislog.py"), str(tmp_path / "nope"),
                        "-o", str(tmp_path / "x.png")], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "no such log file" in lines[0], r.stderr
    assert not os.path.exists(tmp_path / "x.png")


BINARY_FILES = {
    # a model checkpoint's start: int32 header slots (NUL bytes), then float32 weights
    "checkpoint": np.array([20240326, 3, 1024, 50257, 12, 12, 768, 50304], dtype="<i4").tobytes()
                  + np.random.default_rng(0).standard_normal(4096).astype("<f4").tobytes(),
    # no NUL byte, but line 2 is not UTF-8 (and holds \x0c, which splitlines() would break at)
    "latin1": b"s:1 trl:2.0 lr:0.1 norm:1.0\ns:2 trl:\xff\xfe\x0c1.5\n",
}


@pytest.mark.parametrize("kind", sorted(BINARY_FILES))
def test_cli_binary_file(tmp_path, kind):
    """A file that is not text: one `error:` line naming it, exit 1, no traceback, no PNG."""
    path = tmp_path / "model.bin"
    path.write_bytes(BINARY_FILES[kind])
    out = tmp_path / "x.png"
    r = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "dev", "vislog.py"), str(path), "-o", str(out)],
                       capture_output=True, text=True, errors="replace", timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {path}") and "Traceback" not in r.stderr
    assert not out.exists()
