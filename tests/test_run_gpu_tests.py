"""dev/run_gpu_tests.py --emulated: the rehearsal of the first GPU run on the emulated CUDA device.

What it checks: the rehearsal runs the very commands of the GPU run (same trainer flags, same
precisions and attention paths, in the same order), changed only by `--device cpu` and the model
and batch shapes, with the GPU-only steps (pytest -m gpu, the bench) replaced one for one; and
that main() with --emulated passes the GPU gate, names its log `_test-gpu-emulated.log` and says
in the header that no GPU ran; the order of the first contact (the five checks, the bench of ours,
the training run, the tests, the twin, the long checks, Llama 3's bench), and that with a planted
failure in a later step (a test module that does not import, run by the real pytest) the bench line
is in the log and the steps after the failure still run. The rehearsal itself (minutes) is run by
hand and its log kept under dev/results/.
Run: python -m pytest -q tests/test_run_gpu_tests.py
"""

import importlib.util
import os
import re
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_run_gpu_tests():
    spec = importlib.util.spec_from_file_location("run_gpu_tests", os.path.join(ROOT, "dev", "run_gpu_tests.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _without_shapes(cmd, shapes):
    """cmd with --device cpu and every model/batch shape argument of `shapes` taken out."""
    shape_args = {(flag, value) for args in shapes.values() for flag, value in zip(args[::2], args[1::2])}
    out, i = [], 0
    while i < len(cmd):
        if i + 1 < len(cmd) and ((cmd[i], cmd[i + 1]) in shape_args or (cmd[i], cmd[i + 1]) == ("--device", "cpu")):
            i += 2
            continue
        out.append(cmd[i])
        i += 1
    return out


def test_emulated_rehearsal_runs_the_gpu_commands_on_the_cpu_device():
    rgt = _load_run_gpu_tests()
    for quick in (False, True):
        gpu, emulated = rgt._commands(quick), rgt._commands(quick, emulated=True)
        assert len(gpu) == len(emulated) == 13
        for g, e in zip(gpu, emulated):
            assert rgt.kind_of(g) == rgt.kind_of(e), (g, e)
            if "gpt2_cuda.py" not in g:                                  # pytest -m gpu and the bench: replaced
                assert "gpt2_cuda.py" not in e and "-m gpu" not in " ".join(e) and "dev/bench.py" not in e
                continue
            assert e[1:4] == ["gpt2_cuda.py", "--device", "cpu"]
            assert "d12" not in e and "1024" not in e                   # the 124M shapes stay on the GPU
            assert _without_shapes(g, rgt.GPU_SHAPES) == _without_shapes(e, rgt.EMULATED_SHAPES), (g, e)


def test_emulated_main_passes_the_gate_and_names_its_log(tmp_path, monkeypatch):
    rgt = _load_run_gpu_tests()
    monkeypatch.setattr(rgt.cuda, "cuda_unavailable_reason", lambda: "no GPU here")
    ok = [sys.executable, "-c", "print('rehearsed')"]
    monkeypatch.setattr(rgt, "emulated_commands", lambda quick: [ok])
    assert rgt.main(["--emulated", "--quick", "--results-dir", str(tmp_path)]) == 0
    (name,) = os.listdir(tmp_path)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_emulated-cuda-device-cpu_test-gpu-quick-emulated\.log", name)
    text = (tmp_path / name).read_text()
    assert "# device: emulated CUDA device (CPU) (emulated: kernels compiled by " in text and "; no GPU)" in text
    assert "rehearsed" in text and "# all passed" in text
    assert rgt.main(["--quick", "--results-dir", str(tmp_path / "gpu")]) == rgt.NO_GPU_EXIT   # no --emulated: the gate holds
    assert not os.path.exists(tmp_path / "gpu")


ORDER = ["check"] * 5 + ["bench", "train", "pytest", "twin"] + ["check-long"] * 3 + ["bench-llama3"]


def test_first_contact_order_brings_a_bench_number_early():
    """The five checks, then our bench (B=16, a few steps), the training run, the GPU tests (a module
    that fails to import does not stop them), the twin, the long checks, and last Llama 3's bench
    against its twin (it runs if time is left); the same on the emulated device."""
    rgt = _load_run_gpu_tests()
    for quick in (False, True):
        for emulated in (False, True):
            cmds = rgt._commands(quick, emulated)
            assert [rgt.kind_of(c) for c in cmds] == ORDER, (quick, emulated)
            tests = cmds[ORDER.index("pytest")]
            assert "--continue-on-collection-errors" in tests
            if not emulated:
                bench, twin = cmds[ORDER.index("bench")], cmds[ORDER.index("twin")]
                assert bench[1:] == ["dev/bench.py", "--only", "cupy", "-b", "16", "--steps", "10", "--warmup", "3"]
                assert twin[1:6] == ["dev/bench.py", "--only", "torch", "-b", "16"]
                assert "gpu" in tests and tests[-1] == "tests"
        assert rgt.limit_s(rgt._commands(True)[ORDER.index("bench")], True) <= 120     # back inside 2 minutes


def test_a_failing_later_step_keeps_the_bench_line(tmp_path, monkeypatch):
    """--quick --emulated with the rehearsal's own order; every step a stand-in printing its kind
    except the tests, which run the real pytest on a folder holding a module that fails to import
    (planted) and one that passes: the log has the bench line, the tests FAIL with the passing test
    run all the same, and the twin and the long checks after them still run."""
    rgt = _load_run_gpu_tests()
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "test_broken.py").write_text("import module_that_does_not_exist  # planted\n")
    (planted / "test_fine.py").write_text("def test_fine():\n    assert 1 + 1 == 2\n")

    def stand_in(cmd):
        kind = rgt.kind_of(cmd)
        if kind == "pytest":
            return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(planted),
                    "--continue-on-collection-errors", str(planted)]
        said = "bench: model=d2 stand-in ours=123" if kind == "bench" else f"{kind} ran"
        return [sys.executable, "-c", f"print({said!r})"]
    cmds = [stand_in(c) for c in rgt._commands(True, emulated=True)]
    monkeypatch.setattr(rgt, "emulated_commands", lambda quick: cmds)
    out = tmp_path / "out"
    assert rgt.main(["--emulated", "--quick", "--results-dir", str(out)]) == 1
    (name,) = os.listdir(out)
    text = (out / name).read_text()
    assert "\nbench: model=d2 stand-in ours=123\n" in text                 # the line printed (not the header's)
    assert re.search(r"1 passed, 1 error", text) and "module_that_does_not_exist" in text
    summary = text.split("# summary")[1].splitlines()[1:len(ORDER) + 1]
    verdicts = [line.split()[1] for line in summary]
    assert verdicts == ["PASS"] * 7 + ["FAIL"] + ["PASS"] * 5, summary
    assert text.index("\nbench: model=d2") < text.index("module_that_does_not_exist") < text.index("\ntwin ran\n")
