"""dev/run_gpu_tests.py --emulated: the rehearsal of the first GPU run on the emulated CUDA device.

What it checks: the rehearsal runs the very commands of the GPU run (same trainer flags, same
precisions and attention paths, in the same order), changed only by `--device cpu` and the model
and batch shapes, with the GPU-only steps (pytest -m gpu, the bench) replaced one for one; and
that main() with --emulated passes the GPU gate, names its log `_test-gpu-emulated.log` and says
in the header that no GPU ran. The rehearsal itself (minutes) is run by hand and its log kept
under dev/results/.
Run: python -m pytest -q tests/test_run_gpu_tests.py
"""

import importlib.util
import os
import re
import sys

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
        assert len(gpu) == len(emulated) == 11
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
