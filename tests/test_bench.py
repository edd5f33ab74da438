"""dev/bench.py's host side, without a GPU: the fixed-form summary line that runs are compared by
(its exact text for hand-made results, and n/a where a trainer did not run or B did not fit), the
per-kernel breakdown's aggregation and table, and the one-line exit without a GPU. The timings
themselves need a GPU (`make bench`).
Run: pytest tests/test_bench.py   (a second)
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
import bench  # noqa: E402

LINE = re.compile(r"^bench: model=(\S+) T=(\d+) B=(\d+) precision=bf16 ours=(\S+) torch=(\S+) ratio=(\S+) "
                  r"mfu=(\S+) mem_ours_gib=(\S+) mem_torch_gib=(\S+)$")


def test_summary_line_exact_form():
    ours = {"tok_s": 412345.6, "mfu": 0.33456, "memory_bytes": 12.5 * 2**30}
    torch = {"tok_s": 400000.0, "mfu": 0.3, "memory_bytes": 20 * 2**30}
    line = bench.summary_line("d12", 1024, 32, ours, torch)
    assert line == ("bench: model=d12 T=1024 B=32 precision=bf16 ours=412346 torch=400000 ratio=1.031 "
                    "mfu=33.5 mem_ours_gib=12.50 mem_torch_gib=20.00")
    assert LINE.match(line)


def test_summary_line_without_torch_or_memory():
    ours = {"tok_s": 1000.0, "mfu": None, "memory_bytes": 2**30}
    line = bench.summary_line("d12", 1024, 64, ours, None)
    assert line.endswith("ours=1000 torch=n/a ratio=n/a mfu=n/a mem_ours_gib=1.00 mem_torch_gib=n/a")
    assert LINE.match(bench.summary_line("d12", 1024, 64, None, None)).groups()[3:] == ("n/a",) * 6


def test_breakdown_aggregates_and_sorts():
    records = [("layernorm.cu:layernorm_forward", 0.5), ("cuBLAS gemm 2304x4096x768", 2.0),
               ("layernorm.cu:layernorm_forward", 0.25), ("gelu.cu:gelu_forward", 0.75), ("adamw.cu:adamw_update", 0.75)]
    rows = bench.summarize_breakdown(records)
    assert rows == [("cuBLAS gemm 2304x4096x768", 1, 2.0), ("adamw.cu:adamw_update", 1, 0.75),
                    ("gelu.cu:gelu_forward", 1, 0.75), ("layernorm.cu:layernorm_forward", 2, 0.75)]
    lines = bench.format_breakdown(rows, step_ms=5.0, top=2)
    assert len(lines) == 1 + 2 + 1 + 1                      # header, top 2, the rest, the sum
    assert lines[1].split()[-3:] == ["2.000", "47.1", "40.0"]          # 2.0 of 4.25 ms; of the 5 ms step
    assert lines[3].startswith("(2 more)") and lines[3].split()[-3:] == ["1.500", "35.3", "30.0"]
    assert lines[4].split()[-3:] == ["4.250", "100.0", "85.0"]


def test_no_gpu_is_one_line_exit_2():
    from llmc.cuda import cuda_unavailable_reason
    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present: this checks the exit without one")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "bench.py")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("dev/bench.py: no CUDA GPU found")
