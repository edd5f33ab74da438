"""dev/bench.py's host side, without a GPU: the fixed-form summary line that runs are compared by
(its exact text for hand-made results, and n/a where a trainer did not run or B did not fit), the
per-kernel breakdown's aggregation and table, the one-line exit without a GPU, and the driver
around the workers with their subprocesses faked (each line printed as it completes, ours before
the twin, a failed worker one line among the others, --cublaslt and --compile passed on), and
for Llama 3 (-e llama3:dX): the driver's lines, --cublaslt 1 refused in one line and --cuda-graph 1
passed on, and the emulated device's llama3_cuda.py step as the bench builds and runs it, against
llama3_cpu.py's losses, and with --cuda-graph 1 bitwise the eager step. The timings themselves need
a GPU (`make bench`).
Run: pytest tests/test_bench.py   (about a minute: six emulated steps)
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
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


def test_breakdown_takes_each_calls_median_over_the_steps():
    steps = [[("a", 1, 1.0), ("b", 2, 3.0)], [("a", 1, 2.0), ("b", 2, 1.0)], [("a", 1, 4.0)]]   # b absent: 0 ms
    assert bench.median_breakdown(steps) == [("a", 1, 2.0), ("b", 2, 1.0)]
    assert bench.median_breakdown(steps[:1]) == [("b", 2, 3.0), ("a", 1, 1.0)]


def test_breakdown_times_every_gemm_with_cublaslt_too(monkeypatch):
    """The per-kernel breakdown of one step on the emulated device (d2, B=1, T=32): with --cublaslt 1
    every linear layer's GEMM is listed as a cuBLASLt call with its epilogue, and the step makes as
    many GEMMs as through cuBLAS (the first H100 run's breakdown left cuBLASLt's out: its table
    summed to 39% of the step)."""
    from llmc import cuda
    monkeypatch.setattr(cuda, "_device", "cpu")
    gemms = {}
    for use_cublaslt in (False, True):
        model, cfg, (x, y) = bench.cupy_model("d2", 1, 32, "naive", use_cublaslt)
        rows = bench.kernel_breakdown(model, x, y, 1, repeats=2)       # one step's calls, medians of two
        gemms[use_cublaslt] = {name: calls for name, calls, _ in rows if " gemm " in name}
    L = cfg.num_layers
    attention_gemms = 6 * L                  # QK^T and att @ V forward; their four backward products
    linear_gemms = 3 * (4 * L + 1)           # forward, dinp, dweight of 4 linears per layer and the classifier
    assert sum(gemms[False].values()) == attention_gemms + linear_gemms
    assert all(name.startswith("cuBLAS gemm") for name in gemms[False])
    lt = {name: calls for name, calls in gemms[True].items() if name.startswith("cuBLASLt gemm")}
    assert sum(lt.values()) == linear_gemms
    assert sum(gemms[True].values()) - sum(lt.values()) == attention_gemms
    epilogues = {name.split()[-1] for name in lt}
    assert {"BIAS", "GELU_AUX_BIAS", "DGELU", "BGRADB"} <= epilogues, epilogues


def test_breakdown_times_the_flash_kernels(monkeypatch):
    """With --attention flash the breakdown lists the flash kernels, which launch with dynamic shared
    memory (llmc.attention.launch_with_shared_memory), not through cuda.launch: the H100 run of
    2026-11-27 listed only their backward's preprocess. One forward and one dk/dv + dq pair per layer."""
    from llmc import cuda
    monkeypatch.setattr(cuda, "_device", "cpu")
    model, cfg, (x, y) = bench.cupy_model("d2", 1, 32, "flash", False)
    rows = {name: calls for name, calls, _ in bench.kernel_breakdown(model, x, y, 1)}
    L = cfg.num_layers
    flash = {name.split(":")[1].rsplit("_hs", 1)[0]: calls for name, calls in rows.items()
             if name.startswith("flash_attention.cu:")}
    assert flash == {"flash_attention_forward": L, "flash_attention_backward_dkdv": L,
                     "flash_attention_backward_dq": L, "flash_attention_backward_preprocess": L}, flash


def test_gpt2_steps_read_a_step_late_match_gpt2_cpu(monkeypatch):
    """gpt2_cuda.py's steps as the bench times them (d2, B=1, T=32, bf16 as on a GPU, on the
    emulated device): all on the device, as one CUDA graph or kernel by kernel, each loss
    read after the next step is queued. Both give the same losses, bit for bit, one per step, and
    the first is gpt2_cpu.py's within bf16's error; the second checks the update (clipped at 1)."""
    import gpt2_cpu
    from llmc import cuda
    from llmc.emulator import device
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(device.cuda.Stream, "_current", device.cuda.Stream._current)    # cupy_model sets it
    runs = {graph: bench.cupy_steps("d2", 1, 32, 3, "naive", cuda_graph=graph, use_cublaslt=False)
            for graph in (False, True)}
    (times, losses, cfg, model, (x, y)), (_, graph_losses, _, graphed, _) = runs[False], runs[True]
    assert len(times) == len(losses) == 3 and all(t > 0 for t in times)
    assert graph_losses == losses and len(graphed.graphs) == 1
    cpu, expected = gpt2_cpu.gpt2_init(cfg, bench.SEED), []
    for t in (1, 2):
        gpt2_cpu.gpt2_zero_grad(cpu)
        gpt2_cpu.gpt2_forward(cpu, x, y)
        gpt2_cpu.gpt2_backward(cpu)
        norm = gpt2_cpu.gpt2_grad_norm(cpu)
        gpt2_cpu.gpt2_update(cpu, bench.LEARNING_RATE, gpt2_cpu.ADAMW_BETA1, gpt2_cpu.ADAMW_BETA2, gpt2_cpu.ADAMW_EPS,
                             0.0, t, bench.GRAD_CLIP / norm if norm > bench.GRAD_CLIP else 1.0)
        expected.append(cpu.mean_loss)
    assert losses[:2] == pytest.approx(expected, rel=1e-2), (losses, expected)
    assert losses[0] - losses[1] == pytest.approx(expected[0] - expected[1], rel=0.02)   # the update's effect (~0.5)


def test_llama3_step_on_the_emulated_device_matches_llama3_cpu(monkeypatch):
    """llama3_cuda.py's training step as the bench builds and runs it (llama3:d2, B=1, T=32, here in
    fp32 on the emulated device): two steps' losses equal llama3_cpu.py's for the same init, batch
    and AdamW step (the second loss checks the update); the breakdown times Llama 3's own kernels
    and every GEMM."""
    import gpt2_cpu
    import llama3_cpu
    from llmc import cuda
    monkeypatch.setattr(cuda, "_device", "cpu")
    model, cfg, (x, y) = bench.llama3_cupy_model("llama3:d2", 1, 32, "naive", precision="fp32")
    losses = [float(bench.llama3_cupy_step(model, x, y, t, cuda_graph=False)) / x.size for t in (1, 2)]
    cpu, expected = llama3_cpu.llama3_init(cfg, bench.SEED), []
    for t in (1, 2):                          # llama3_cpu.train's step: no weight decay, clipped at 1.0
        gpt2_cpu.gpt2_zero_grad(cpu)
        llama3_cpu.llama3_forward(cpu, x, y)
        llama3_cpu.llama3_backward(cpu)
        norm = gpt2_cpu.gpt2_grad_norm(cpu)
        gpt2_cpu.gpt2_update(cpu, bench.LEARNING_RATE, gpt2_cpu.ADAMW_BETA1, gpt2_cpu.ADAMW_BETA2, gpt2_cpu.ADAMW_EPS,
                             0.0, t, 1.0 / norm if norm > 1.0 else 1.0, decayed=llama3_cpu.DECAYED_PARAMETERS)
        expected.append(cpu.mean_loss)
    assert losses == pytest.approx(expected, rel=1e-5), (losses, expected)
    rows = bench.kernel_breakdown(model, x, y, 3)
    names = {name for name, _, _ in rows}
    for kernel in ("rmsnorm_forward", "rmsnorm_backward", "rope_forward", "rope_backward", "swiglu_forward",
                   "swiglu_backward", "repeat_kv_forward", "repeat_kv_backward"):
        assert f"{kernel.rsplit('_', 1)[0]}.cu:{kernel}" in names, (kernel, sorted(names))
    L = cfg.num_layers
    gemms = sum(calls for name, calls, _ in rows if name.startswith("cuBLAS gemm"))
    # naive attention's 6 per layer; forward, dinp, dweight of 5 linears per layer and the classifier
    assert gemms == 6 * L + 3 * (5 * L + 1)
    assert dict((name, calls) for name, calls, _ in rows)["adamw.cu:adamw_update"] == 1    # every tensor, one launch


def test_llama3_bench_with_cudnn_times_both_cudnn_calls(monkeypatch):
    """What `dev/bench.py -e llama3:d4` runs on a GPU by default (--attention auto: cuDNN, bf16),
    here on the emulated device (llama3:d2, B=1, T=32): the first loss is llama3_cpu.py's within
    bf16's error, and the breakdown times cuDNN's forward and backward (once each per step)."""
    import llama3_cpu
    from llmc import cuda
    monkeypatch.setattr(cuda, "_device", "cpu")
    model, cfg, (x, y) = bench.llama3_cupy_model("llama3:d2", 1, 32, "cudnn", precision="bf16")
    assert model.attention.name == "cudnn"
    loss = float(bench.llama3_cupy_step(model, x, y, 1, cuda_graph=False)) / x.size
    cpu = llama3_cpu.llama3_init(cfg, bench.SEED)
    llama3_cpu.llama3_forward(cpu, x, y)
    assert loss == pytest.approx(cpu.mean_loss, rel=1e-2), (loss, cpu.mean_loss)
    calls = {name: n for name, n, _ in bench.kernel_breakdown(model, x, y, 2)}
    L = cfg.num_layers
    assert calls["cuDNN attention_forward_cudnn"] == L and calls["cuDNN attention_backward_cudnn"] == L, calls


def test_no_gpu_is_one_line_exit_2():
    from llmc.cuda import cuda_unavailable_reason
    if cuda_unavailable_reason() is None:
        pytest.skip("a GPU is present: this checks the exit without one")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "bench.py")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("dev/bench.py: no CUDA GPU found")


# ----------------------------------------------------------------------------
# the driver with its workers' subprocesses faked: what a GPU machine would see

def fake_result(trainer, B):
    return {"trainer": trainer, "B": B, "T": 1024, "ms_median": 100.0 + B, "ms_all": [100.0 + B], "tok_s": 1000.0 * B,
            "mfu": None, "memory_bytes": 2**30, "device": "fake GPU", "losses": [11.0], "breakdown": None}


class FakeWorkers:
    """Stands in for subprocess.run of the workers: each (trainer, B) answers a result line, a
    planted failure (exit 1, a traceback's last line) or an exception raised in the driver."""

    def __init__(self, planted=None):
        self.planted, self.calls = planted or {}, []

    def __call__(self, cmd, **kwargs):
        args = bench.parse_args(cmd[2:])                          # the worker parses what it is given
        key = (args.worker, args.batch_size)
        self.calls.append((key, cmd))
        planted = self.planted.get(key)
        if isinstance(planted, BaseException):
            raise planted
        if planted:
            return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=f"Traceback ...\n{planted}\n")
        return subprocess.CompletedProcess(cmd, 0, stdout=bench.RESULT_PREFIX + json.dumps(fake_result(*key)) + "\n",
                                           stderr="")


@pytest.fixture
def workers(monkeypatch):
    """bench.main with a GPU and a CUDA PyTorch pretended, and its workers' subprocesses faked."""
    import torch
    monkeypatch.setattr(bench.llmc.cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def install(planted=None):
        fake = FakeWorkers(planted)
        monkeypatch.setattr(bench.subprocess, "run", fake)
        return fake
    return install


def test_a_failed_worker_is_one_line_and_the_others_still_run(workers, capsys):
    fake = workers({("cupy", 32): "RuntimeError: planted failure"})
    status = bench.main(["--batch-sizes", "16,32"])
    out = capsys.readouterr().out
    assert status == 1
    assert [key for key, _ in fake.calls] == [("cupy", 16), ("cupy", 32), ("torch", 16), ("torch", 32)]
    rows = [line for line in out.splitlines() if line.startswith(tuple(bench.TRAINERS.values()))]
    assert len(rows) == 8                                          # as each completes, then the table again
    assert rows[:4] == rows[4:]
    assert rows[1].split()[2:] == ["32", "FAILED:", "exit", "1:", "RuntimeError:", "planted", "failure"]
    assert rows[0].split()[2:4] == ["16", "116.0"] and rows[3].split()[2:4] == ["32", "132.0"]
    summary = [line for line in out.splitlines() if line.startswith("bench:")]
    assert summary == [bench.summary_line("d12", 1024, 16, fake_result("cupy", 16), fake_result("torch", 16)),
                       bench.summary_line("d12", 1024, 32, None, fake_result("torch", 32))]
    assert "ours=n/a torch=32000 ratio=n/a" in summary[1]


def test_lines_already_done_are_printed_when_a_later_worker_never_returns(workers, capsys):
    """The bench cut at its time limit (here: the twin's worker interrupted) keeps ours' lines."""
    workers({("torch", 16): KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--batch-sizes", "16,32"])
    rows = [line.split()[:4] for line in capsys.readouterr().out.splitlines() if line.startswith("gpt2_cuda.py")]
    assert rows == [["gpt2_cuda.py", "(CuPy)", "16", "116.0"], ["gpt2_cuda.py", "(CuPy)", "32", "132.0"]]


def test_cublaslt_and_compile_reach_the_workers(workers, capsys):
    fake = workers()
    assert bench.main(["-b", "16", "--cublaslt", "1", "--compile", "0", "--residual-epilogue", "1",
                       "--classifier-chunk", "4", "--cuda-graph", "0", "--autotune", "8",
                       "--gelu-fusion", "1", "-r", "0", "--cudnn-deterministic", "0", "--bias-grad-epilogue", "0",
                       "--ln-bias-grad", "1"]) == 0
    for (trainer, B), cmd in fake.calls:
        args = bench.parse_args(cmd[2:])
        assert (args.cublaslt, args.compile, args.worker, args.batch_size) == (1, 0, trainer, 16)
        assert (args.residual_epilogue, args.classifier_chunk, args.cuda_graph) == (1, 4, 0)
        assert (args.autotune, args.gelu_fusion, args.recompute, args.cudnn_deterministic) == (8, 1, 0, 0)
        assert (args.bias_grad_epilogue, args.ln_bias_grad) == (0, 1)
    assert ("CUDA graph 0, cuBLASLt, residual epilogue 1, autotune 8, GELU fusion 1, bias gradient epilogue 0, "
            "LayerNorm bias gradients 1, recompute 0, cuDNN deterministic 0, "
            "classifier chunk 4; "
            "twin: torch.compile 0") in capsys.readouterr().out
    defaults = bench.parse_args([])
    assert (defaults.compile, defaults.cublaslt, defaults.attention) == (1, "auto", "auto")   # the trainer's defaults
    assert (defaults.cuda_graph, defaults.residual_epilogue, defaults.classifier_chunk) == ("auto", 0, 0)
    trainer = bench.gpt2_cuda.parse_args([])
    assert (defaults.autotune, defaults.gelu_fusion, defaults.recompute, defaults.cudnn_deterministic) == \
        (trainer.autotune, trainer.gelu_fusion, trainer.recompute, trainer.cudnn_deterministic)
    assert defaults.bias_grad_epilogue == trainer.bias_grad_epilogue == 1
    assert defaults.ln_bias_grad == trainer.ln_bias_grad == 0


def test_a_candidate_reaches_the_workers_the_banner_and_the_json(workers, capsys, tmp_path):
    fake = workers()
    assert bench.main(["-b", "16", "--only", "cupy", "--candidate", "classifier:5", "--json", str(tmp_path / "b.json")]) == 0
    (_, cmd), = fake.calls
    assert bench.parse_args(cmd[2:]).candidate == ["classifier:5"]
    assert ("; candidate classifier:5: dev/cuda/classifier.cu's fused_classifier_v5 in place of fused_classifier"
            in capsys.readouterr().out)
    assert json.loads((tmp_path / "b.json").read_text())["candidate"] == ["classifier:5"]
    assert bench.parse_args([]).candidate == [] and "--candidate" not in bench.worker_command("cupy", 16,
                                                                                              bench.parse_args([]), False)


@pytest.mark.parametrize("spec,words", [("classifier:3", "version 3 of dev/cuda/classifier.py is not a drop-in"),
                                        ("global_norm:4", "version 4 of dev/cuda/global_norm.py is not a drop-in"),
                                        ("classifier:9", "dev/cuda/classifier.py has no version 9"),
                                        ("classifier", "OP:VERSION"), ("nosuch:1", "OP:VERSION"),
                                        ("common:1", "OP:VERSION"), ("../bench:1", "OP:VERSION")])
def test_a_candidate_that_cannot_replace_ours_is_one_line(capsys, spec, words):
    """The production version (3), a candidate not marked drop-in (global_norm's 4, not yet made one), a
    missing version or op, and a path are refused before any run."""
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--candidate", spec])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1 and f"--candidate {spec}: {words}" in err, err


def test_a_candidate_runs_in_the_emulated_step_in_place_of_ours(monkeypatch):
    """--candidate classifier:4 on the emulated device: the trainer's fused_classifier launches run
    dev/cuda/classifier.cu's fused_classifier_v4, which gives version 3's results bit for bit, so the
    bench's losses are the production kernel's exactly; replace_kernel(..., None) gives ours back."""
    from llmc import cuda
    from llmc.emulator import device
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(device.cuda.Stream, "_current", device.cuda.Stream._current)    # cupy_model sets it

    def loaded():
        return {key[2]: f for key, f in cuda._FUNCTIONS.items() if key[1:2] == ("classifier",) and key[4] == "fused_classifier"}
    ours = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False)[1]
    production = loaded()["bf16"]
    try:
        bench.install_candidates(["classifier:4"])
        assert "bf16" not in loaded()                                   # dropped: loaded again at the next launch
        theirs = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False)[1]
        common = bench.dev_cuda_common()
        (_, _, kernel), = bench.candidate_kernels("classifier:4")
        assert loaded()["bf16"] is common.load_function(kernel, "bf16") is not production
    finally:
        cuda.replace_kernel("classifier", "fused_classifier", None)
    assert theirs == ours and len(ours) == 2
    bench.cupy_steps("d2", 1, 16, 1, "naive", cuda_graph=False, use_cublaslt=False)
    assert loaded()["bf16"] is not common.load_function(kernel, "bf16")       # ours again


def test_a_two_kernel_candidate_replaces_both_in_the_emulated_step(monkeypatch, capsys):
    """--candidate layernorm:6 (dev/cuda/layernorm.py: its own backward and the reduce of candidate 5)
    replaces both production kernels of gpt2_cuda.layernorm_backward, layernorm:5 only the reduce (its
    backward is production's). On the emulated device: the first step's loss is ours exactly (the forward
    is untouched), the second within bf16's rounding of ours (the gradients' sums run in another order),
    and the step launched the candidate's functions; the same with --ln-bias-grad 1, where they also sum
    the projections' bias gradients."""
    from llmc import cuda
    from llmc.emulator import device
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(device.cuda.Stream, "_current", device.cuda.Stream._current)    # cupy_model sets it
    assert [name for _, name, _ in bench.candidate_kernels("layernorm:5")] == ["layernorm_param_reduce"]
    assert [(file, name, kernel.name) for file, name, kernel in bench.candidate_kernels("bias:5")] == [
        ("bias", "bias_backward", "bias_backward_v5")]                  # its reduce is production's
    replaced = bench.candidate_kernels("layernorm:6")
    assert [(file, name, kernel.name) for file, name, kernel in replaced] == [
        ("layernorm", "layernorm_backward", "layernorm_backward_v6"),
        ("layernorm", "layernorm_param_reduce", "layernorm_param_reduce_v5")]

    def loaded(name):
        return next(f for key, f in cuda._FUNCTIONS.items() if key[1:3] == ("layernorm", "bf16") and key[4] == name)
    ours = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False)[1]
    try:
        bench.install_candidates(["layernorm:6"])
        theirs = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False)[1]
        # --ln-bias-grad 1: the candidates also sum the projections' bias gradients (their third sum)
        theirs_ln = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False,
                                     ln_bias_grad=True)[1]
        common = bench.dev_cuda_common()
        for _, name, kernel in replaced:
            assert loaded(name) is common.load_function(kernel, "bf16")
    finally:
        for _, name, _ in replaced:
            cuda.replace_kernel("layernorm", name, None)
    assert theirs[0] == ours[0] and abs(theirs[1] - ours[1]) < 1e-2 and len(ours) == 2
    assert theirs_ln[0] == ours[0] and abs(theirs_ln[1] - ours[1]) < 1e-2 and len(theirs_ln) == 2
    args = bench.parse_args(["--candidate", "layernorm:6"])
    assert ("candidate layernorm:6: dev/cuda/layernorm.cu's layernorm_backward_v6 in place of layernorm_backward, "
            "dev/cuda/layernorm.cu's layernorm_param_reduce_v5 in place of layernorm_param_reduce"
            in bench.candidates_words(args))


def test_the_register_row_candidate_runs_in_the_emulated_step(monkeypatch):
    """--candidate classifier:5 (the row in registers: GPT-2's Vp = 50304 at the trainer's 1024 threads is
    one tile) on the emulated device: the step's losses within bf16's rounding of ours (its max and sum
    are taken in another order than version 3's online softmax), from the candidate's function."""
    from llmc import cuda
    from llmc.emulator import device
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(device.cuda.Stream, "_current", device.cuda.Stream._current)    # cupy_model sets it
    ours = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False)[1]
    (file, name, kernel), = bench.candidate_kernels("classifier:5")
    try:
        bench.install_candidates(["classifier:5"])
        theirs = bench.cupy_steps("d2", 1, 16, 2, "naive", cuda_graph=False, use_cublaslt=False)[1]
        loaded = next(f for key, f in cuda._FUNCTIONS.items() if key[1:3] == (file, "bf16") and key[4] == name)
        assert loaded is bench.dev_cuda_common().load_function(kernel, "bf16")
    finally:
        cuda.replace_kernel(file, name, None)
    assert (file, name, kernel.name) == ("classifier", "fused_classifier", "fused_classifier_v5")
    assert len(theirs) == len(ours) == 2 and all(abs(a - b) < 1e-3 for a, b in zip(theirs, ours)), (theirs, ours)


def test_cublaslt_unavailable_fails_the_worker_instead_of_timing_cublas(monkeypatch):
    from llmc import cublaslt
    monkeypatch.setattr(cublaslt, "unavailable_reason", lambda: "nvmath-python is not installed")
    with pytest.raises(RuntimeError, match=r"cuBLASLt unavailable \(nvmath-python is not installed\)"):
        bench.cupy_matmul(True)
    assert type(bench.cupy_matmul(False)).__name__ == "Cublas"
    assert type(bench.cupy_matmul("auto")).__name__ == "Cublas"           # auto times what the trainer would run
    monkeypatch.setattr(cublaslt, "unavailable_reason", lambda: None)
    assert type(bench.cupy_matmul(True)).__name__ == "CublasLt"
    assert type(bench.cupy_matmul("auto")).__name__ == "CublasLt"


def test_cuda_graph_without_nvmath_fails_the_worker_before_the_model_is_built(monkeypatch):
    """Without nvmath's cuBLAS bindings a captured GEMM would die mid-capture in CuPy's setStream;
    the worker fails at once with the reason instead (its one line in the table)."""
    import llmc.cuda
    monkeypatch.setattr(llmc.cuda, "cuda_graph_unavailable_reason", lambda: "nvmath-python is missing")
    monkeypatch.setattr(bench, "cupy_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(RuntimeError, match=r"^--cuda-graph 1: nvmath-python is missing$"):
        bench.cupy_steps("d2", 1, 8, 1, cuda_graph=True)


def test_llama3_reaches_the_workers_and_its_summary_lines(workers, capsys):
    fake = workers()
    assert bench.main(["-e", "llama3:d4", "--batch-sizes", "16,32"]) == 0
    assert [key for key, _ in fake.calls] == [("cupy", 16), ("cupy", 32), ("torch", 16), ("torch", 32)]
    assert all(bench.parse_args(cmd[2:]).model == "llama3:d4" for _, cmd in fake.calls)
    out = capsys.readouterr().out
    assert out.startswith("Llama 3 (llama3:d4), T=1024, bf16")
    rows = [line.split()[:3] for line in out.splitlines() if line.startswith("llama3_cuda.py (CuPy) ")]
    assert rows == [["llama3_cuda.py", "(CuPy)", "16"], ["llama3_cuda.py", "(CuPy)", "32"]] * 2   # as done; the table
    assert "gpt2_cuda.py" not in out
    summary = [line for line in out.splitlines() if line.startswith("bench:")]
    assert summary == [bench.summary_line("llama3:d4", 1024, B, fake_result("cupy", B), fake_result("torch", B))
                       for B in (16, 32)]
    assert all(LINE.match(line).group(1) == "llama3:d4" for line in summary)


def test_llama3_refuses_cublaslt_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["-e", "llama3:d4", "--cublaslt", "1"])
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: --cublaslt 1: llama3_cuda.py has no cuBLASLt backend"), err


@pytest.mark.parametrize("flags", [["--autotune", "4"], ["--gelu-fusion", "0"], ["--bias-grad-epilogue", "0"], ["-r", "1"],
                                   ["--cudnn-deterministic", "0"], ["--ln-bias-grad", "1"]])
def test_llama3_refuses_gpt2_cuda_options_in_one_line(capsys, flags):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["-e", "llama3:d4"] + flags)
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: --autotune, --gelu-fusion, --bias-grad-epilogue, --ln-bias-grad, -r and "
                          "--cudnn-deterministic are gpt2_cuda.py's options: drop them for -e llama3:d4"), err


def test_llama3_passes_cuda_graph_to_the_workers(workers, capsys):
    fake = workers()
    assert bench.main(["-e", "llama3:d4", "-b", "16", "--cuda-graph", "1"]) == 0
    assert [key for key, _ in fake.calls] == [("cupy", 16), ("torch", 16)]
    assert all(bench.parse_args(cmd[2:]).cuda_graph == 1 for _, cmd in fake.calls)
    assert "CUDA graph 1" in capsys.readouterr().out


def test_llama3_step_with_cuda_graph_equals_the_eager_step(monkeypatch):
    """The bench's llama3_cuda.py step with --cuda-graph 1 (llama3:d2, B=1, T=32, fp32 on the emulated
    device, the global norm's grid cut to 16 blocks): the first step runs eagerly and captures,
    the second replays; both give the eager steps' losses and parameters bit for bit."""
    import gpt2_cuda
    from llmc import cuda
    from llmc.emulator import device
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(device.cuda.Stream, "_current", device.cuda.Stream._current)   # llama3_cupy_model sets it
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)
    replays = []
    launch = device.cuda.Graph.launch
    monkeypatch.setattr(device.cuda.Graph, "launch", lambda self, *a: (replays.append(self), launch(self, *a))[1])
    results = {}
    for graph in (False, True):
        model, cfg, (x, y) = bench.llama3_cupy_model("llama3:d2", 1, 32, "naive", precision="fp32")
        losses = [float(bench.llama3_cupy_step(model, x, y, t, cuda_graph=graph)) for t in (1, 2)]
        results[graph] = losses, model.params.get()
    assert list(model.graphs) == [(1, 32, 1.0)] and len(replays) == 1
    assert results[True][0] == results[False][0]
    np.testing.assert_array_equal(results[True][1], results[False][1])


def test_mfu_counts_the_parameters_a_token_multiplies():
    """6N's N: GPT-2 124M's every parameter (llm.c's count, padded vocabulary: its wte is also the
    classifier); Llama 3's every parameter but the untied wte, which is only looked up."""
    import gpt2_cpu
    import llama3_cpu
    assert bench.num_parameters("d12", gpt2_cpu.model_config("d12")) == 124_475_904
    cfg = llama3_cpu.model_config("llama3:d4")
    total = gpt2_cpu.num_elements(llama3_cpu.parameter_shapes(cfg))
    assert bench.num_parameters("llama3:d4", cfg) == total - cfg.vocab_size * cfg.channels


@pytest.mark.parametrize("model_name", ["d2", "llama3:d2"])
def test_the_twins_bench_step_runs_and_starts_at_the_reference_loss(model_name):
    """The twin's side of the bench (torch_steps, torch_llama3_steps: what `make bench` times on the
    GPU) on the CPU, uncompiled, 3 steps at B=1, T=16 on the fixed batch: the first loss is the
    NumPy reference's loss of the same init and batch (within bf16's error: autocast for GPT-2,
    bf16 parameters for Llama 3), and three AdamW steps on that one batch lower it."""
    torch = pytest.importorskip("torch")
    import gpt2_cpu
    import llama3_cpu
    torch.manual_seed(0)
    if bench.is_llama3(model_name):
        cfg = llama3_cpu.model_config(model_name)
        times, losses, _ = bench.torch_llama3_steps(model_name, 1, 16, 3, compile_model=False, device="cpu")
        reference, forward = llama3_cpu.llama3_init(cfg, bench.SEED), llama3_cpu.llama3_forward
    else:
        cfg = gpt2_cpu.config_from_descriptor(model_name)
        times, losses, _ = bench.torch_steps(model_name, 1, 16, 3, compile_model=False, device="cpu")
        reference, forward = gpt2_cpu.gpt2_init(cfg, bench.SEED), gpt2_cpu.gpt2_forward
    x, y = bench.fixed_batch(cfg, 1, 16)
    forward(reference, x, y)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert losses[0] == pytest.approx(reference.mean_loss, rel=1e-2), (losses, reference.mean_loss)
    assert losses[2] < losses[0], losses
