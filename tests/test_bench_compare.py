"""dev/bench_compare.py: the runs of several dev/bench.py JSON files against the first, checked on
two files the fifth GPU session recorded (dev/results/) and on hand-made ones: the options that
differ, each run's ratio of tokens/s to the baseline's (recomputed here from the files), the
breakdown changes on a hand-worked case, the warning for files from different GPUs, and bad input
as one `error:` line.
Run: pytest tests/test_bench_compare.py   (a second)
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import bench_compare  # noqa: E402

RESULTS = os.path.join(ROOT, "dev", "results")
DEFAULTS = os.path.join(RESULTS, "2026-11-27_nvidia-h100-80gb-hbm3_session5_bench_b16.json")
OPTIONS = os.path.join(RESULTS, "2026-11-27_nvidia-h100-80gb-hbm3_session5_bench_options_b16.json")


def run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "dev", "bench_compare.py"), *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT)


def bench_file(tmp_path, name, tok_s, device="NVIDIA H100 80GB HBM3", breakdown=(), **options):
    """A minimal dev/bench.py --json file: one run of ours at B=16."""
    result = dict(trainer="cupy", B=16, T=1024, ms_median=16384 / tok_s * 1000, tok_s=tok_s, mfu=0.4,
                  memory_bytes=2**33, device=device, breakdown=[list(row) for row in breakdown])
    path = tmp_path / name
    path.write_text(json.dumps({"model": "d12", "T": 1024, "attention": "auto", **options, "runs": [[16, {"cupy": result}]]}))
    return str(path)


def test_the_recorded_options_run_against_the_defaults():
    r = run(DEFAULTS, OPTIONS, "--top", "2")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    base, other = (json.load(open(p))["runs"][0][1]["cupy"] for p in (DEFAULTS, OPTIONS))
    lines = r.stdout.splitlines()
    options_line = next(line for line in lines if line.startswith(os.path.basename(OPTIONS)))
    assert "residual_epilogue=1, classifier_chunk=4" in options_line
    assert options_line.split()[-1] == f"{other['tok_s'] / base['tok_s']:.3f}" == "0.993"
    assert options_line.split()[-2] == f"{other['memory_bytes'] / 2**30:.2f}" == "6.92"
    twin = next(line for line in lines if " twin " in line)
    assert "(baseline)" in twin and twin.endswith("1.000")
    moved = [line for line in lines if line.startswith("  ")]
    assert len(moved) == 2 and "50304x4096x768" in moved[0]    # the chunked classifier's GEMMs: new shapes


def test_breakdown_changes_hand_worked():
    before = [["a", 1, 1.0], ["b", 2, 2.0]]
    after = [["b", 2, 2.5], ["c", 1, 0.5]]
    assert bench_compare.breakdown_changes(before, after) == [("a", 1.0, 0.0), ("b", 2.0, 2.5), ("c", 0.0, 0.5)]


def test_same_options_and_another_gpu_are_said(tmp_path):
    base = bench_file(tmp_path, "base.json", 500000, breakdown=[("k", 12, 1.0)], autotune=1)
    same = bench_file(tmp_path, "same.json", 525000, breakdown=[("k", 12, 0.5)], autotune=1)
    h200 = bench_file(tmp_path, "h200.json", 600000, device="NVIDIA H200", autotune=8)
    r = run(base, same, h200, base)                             # a file named again (a glob) counts once
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "(same options)" in lines[2] and lines[2].endswith("1.050")
    assert "autotune=8" in lines[3] and lines[3].endswith("1.200")
    assert lines[4] == ("warning: the files name 2 devices (NVIDIA H100 80GB HBM3, NVIDIA H200): their times are "
                        "not comparable")
    assert lines[-1] == "  k    1.000 ->    0.500  (-0.500)"


@pytest.mark.parametrize("content, said", [
    (None, "No such file or directory"),
    ("{not json", "not JSON"),
    ('{"model": "d12"}', 'not a dev/bench.py --json file (no "runs" list)'),
])
def test_bad_input_is_one_error_line(tmp_path, content, said):
    path = tmp_path / "x.json"
    if content is not None:
        path.write_text(content)
    r = run(DEFAULTS, str(path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {path}: ") and said in lines[0]
