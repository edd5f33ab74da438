"""gpt2_cuda.py's CUDA graph of a micro-batch (--cuda-graph 1), without a GPU: the real kernels of
kernels/*.cu on the emulated CUDA device (llmc/emulator/), whose stream capture is CUDA's: while a
created stream captures, every device operation (kernel launch, cuBLAS or cuBLASLt call, fill,
add, a broadcast copy `out[...] = bias`) is recorded with its arguments as they are at capture
time, and not run; launching the graph replays the recording (llmc/emulator/device.py, Stream and
Graph). Its cuBLAS is as capturable as the real one's bindings: CuPy 14's refuse any call while
the stream captures (NotImplementedError, cupy_backends/cuda/libs/cublas.pyx v14.2.0, 642-668),
nvmath-python's record it on the handle's stream (llmc/emulator/cublas.py, nvmath_cublas.py).
Scalars are recorded by value and buffers by reference, exactly what a CUDA graph holds (kernel
parameters and device pointers), so a launch argument that should change from one micro-batch to
the next but was captured once makes the replayed run differ from the eager one, and the tests fail.
Checked: training steps with the graph equal eager steps bitwise (parameters, AdamW moments, the
accumulated losses) in fp32 and bf16 on the naive attention path, with cuBLAS and with cuBLASLt
(--cublaslt 1); the whole step on the device (train()'s: the gradients set to 0, forward, backward,
the norm, the clipping factor computed on the device, AdamW reading its per-step values from the
device) as one graph, and as three with gradient accumulation (first, middle, last), bitwise the
eager launches, close to the host's step (norm read, factor computed on the host), and with no
host synchronization inside it (the loss and norm copied back at its end without waiting); CuPy's cuBLAS refuses calls and cuBLAS products (dev @ dev) during a capture with
CuPy's exact error, nvmath's cuBLAS runs on its handle's stream (recorded when that stream
captures), llmc.cuda.gemm sets that stream outside captures only, and without nvmath-python
--cuda-graph 1 is refused with one `error:` line before training starts; the first micro-batch of a
(B,T,loss_scale) runs eagerly before its capture (first-time library work stays outside it), one
capture per key, replays after; an error inside the capture propagates as itself, not as the
"capture invalidated" of ending it; a reallocation drops the graphs (they point into the old
buffers); and a whole training run with --cuda-graph 1 prints the same losses as --cuda-graph 0.
With --attention cudnn, cuDNN's graphs execute on the handle's stream and are recorded with the rest
(the emulated cuDNN did not record them until 2026-11-26: replays then skipped the attention, and the
bf16 cudnn case here caught it). The first H100 run showed CuPy's stream capture accepting cuBLAS
through nvmath-python, our kernels and flash attention (the GPU test below); what a GPU must still
show: cuBLASLt's and cuDNN's execution under capture (the GPU defaults, the last case below, added
after that run) and the speed-up.
Run: pytest tests/test_cuda_graph.py   (~1 minute on 2 cores once the emulated device's kernels are
built, see tests/test_emulated_kernels.py)
"""

import importlib
import inspect
import re
import sys

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc.cuda
import llmc.matmul
from llmc import cublaslt, cudnn_attention
from emulated_gpu import TINY, _train_losses, _write_shards
from llmc.emulator import device


class Counts:
    """How many captures the emulated device began and how many graphs it replayed."""

    def __init__(self):
        self.captures = 0
        self.replays = 0


@pytest.fixture
def capture(monkeypatch):
    """gpt2_cuda on the emulated device, on a created stream (the legacy one cannot capture); its
    stream captures and graph launches counted, and the current stream restored after (train()
    makes its own the current one)."""
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")
    monkeypatch.setattr(device.cuda.Stream, "_current", device.cuda.Stream._current)
    counts = Counts()
    begin_capture, launch = device.cuda.Stream.begin_capture, device.cuda.Graph.launch

    def counted_begin_capture(self, *args, **kwargs):
        counts.captures += 1
        return begin_capture(self, *args, **kwargs)

    def counted_launch(self, *args, **kwargs):
        counts.replays += 1
        return launch(self, *args, **kwargs)
    monkeypatch.setattr(device.cuda.Stream, "begin_capture", counted_begin_capture)
    monkeypatch.setattr(device.cuda.Graph, "launch", counted_launch)
    device.cuda.Stream().use()
    return counts


def _capturing():
    return device.cuda.get_current_stream().is_capturing()


def _model(precision, matmul=None, attention="naive", classifier_chunk=0, recompute=True, ln_bias_grad=False):
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, recompute=recompute, matmul=matmul, attention=attention,
                           classifier_chunk=classifier_chunk, ln_bias_grad=ln_bias_grad)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(TINY, 42).params)
    return model


def _train(model, batches, cuda_graph, steps):
    """`steps` AdamW steps of len(batches) micro-batches each; returns the summed losses per step."""
    B, T = batches[0][0].shape
    sums = []
    for step in range(1, steps + 1):
        A = gpt2_cuda.gpt2_activations(model, B, T)
        gpt2_cuda.gpt2_zero_grad(model)
        A["loss_accum"].fill(0)
        for x, y in batches[(step - 1) % 2::2] + batches[step % 2::2]:      # a different order each step
            gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0 / len(batches), cuda_graph)
        sums.append(float(A["loss_accum"].sum(dtype=np.float64)))
        norm = gpt2_cuda.gpt2_grad_norm(model)
        gpt2_cuda.gpt2_update(model, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, 1.0 / max(norm, 1.0))
    return sums


def _batches(B, T, n, seed):
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(n)]


# bf16 over two steps (the second replays the graph on the parameters the first step's AdamW
# updated in place), fp32 over one: each step's global norm costs seconds on the emulated device.
# cuBLASLt (--cublaslt 1): its products take the stream as an argument, and the bias and GELU
# pointers of its shared descriptors change from layer to layer: a graph must hold each call's own.
# cuDNN attention (bf16 only): its graphs execute on the handle's stream, recorded while it captures.
@pytest.mark.parametrize("precision,steps,backend,attention", [
    ("fp32", 1, "cublas", "naive"), ("bf16", 2, "cublas", "naive"), ("bf16", 1, "cublaslt", "naive"),
    ("bf16", 2, "cublas", "cudnn")])
def test_graph_steps_equal_eager_steps_bitwise(capture, precision, steps, backend, attention):
    batches = _batches(2, 16, 3, seed=5)
    batches[1][0][0, :6] = 7                                    # repeated tokens: fewer segments than B*T
    if backend == "cublaslt":
        cublaslt.clear_cache()
    matmul = {"cublas": llmc.matmul.Cublas, "cublaslt": llmc.matmul.CublasLt}[backend]
    eager, graphed = _model(precision, matmul(), attention), _model(precision, matmul(), attention)
    eager_sums = _train(eager, batches, cuda_graph=False, steps=steps)
    assert capture.captures == 0
    graph_sums = _train(graphed, batches, cuda_graph=True, steps=steps)
    assert capture.captures == 1 and capture.replays == 3 * steps - 1  # the first micro-batch eager, then replays
    assert list(graphed.graphs) == [(2, 16, 1.0 / 3, False, None)]
    assert graph_sums == eager_sums
    for name in ("params", "m", "v", "grads"):
        np.testing.assert_array_equal(getattr(graphed, name).get(), getattr(eager, name).get(), err_msg=name)
    if precision == "bf16":
        np.testing.assert_array_equal(graphed.master.get(), eager.master.get(), err_msg="master")
    else:
        assert graphed.master is None
    # the graph really reads each micro-batch's tokens: the three micro-batches' losses differ
    losses = []
    for x, y in batches:
        gpt2_cuda.gpt2_activations(graphed, 2, 16)["loss_accum"].fill(0)
        gpt2_cuda.gpt2_micro_batch(graphed, x, y, 1.0 / 3, cuda_graph=True)
        losses.append(float(gpt2_cuda.gpt2_activations(graphed, 2, 16)["losses"].get().sum()))
    assert len(set(losses)) == 3 and capture.captures == 1


def test_first_micro_batch_runs_eagerly_before_the_capture(capture, monkeypatch):
    # a library's first-time work (cuBLAS's workspace, cuDNN's plans) must not happen inside a
    # capture: this gemm refuses its very first call while capturing, as such work would fail
    calls = []
    emulated_gemm = llmc.cuda.gemm

    def gemm(*args, **kwargs):
        if not calls and _capturing():
            raise RuntimeError("first-time library work inside a stream capture")
        calls.append(not _capturing())
        return emulated_gemm(*args, **kwargs)
    monkeypatch.setattr(llmc.cuda, "gemm", gemm)
    model = _model("fp32")
    (x, y), = _batches(1, 8, 1, seed=2)
    gpt2_cuda.gpt2_activations(model, 1, 8)["loss_accum"].fill(0)
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph=True)
    assert calls[0] and capture.captures == 1 and capture.replays == 0       # eager first, then captured
    assert not all(calls)                                                    # and the capture called it too
    # the eager micro-batch did the work: its loss is the forward's loss, counted once
    loss = float(gpt2_cuda.gpt2_activations(model, 1, 8)["loss_accum"].get().sum())
    cpu = gpt2_cpu.gpt2_init(TINY, 42)
    gpt2_cpu.gpt2_forward(cpu, x, y)
    assert loss / 8 == pytest.approx(cpu.mean_loss, rel=1e-5)


def test_an_error_inside_the_capture_propagates_as_itself(capture, monkeypatch):
    # CUDA invalidates a capture in which something failed, and ending it then raises too: the
    # error the user sees must be the first one
    end_capture = device.cuda.Stream.end_capture

    def end_capture_after_error(self):
        end_capture(self)
        raise RuntimeError("cudaErrorStreamCaptureInvalidated: capture invalidated")
    monkeypatch.setattr(device.cuda.Stream, "end_capture", end_capture_after_error)
    emulated_gemm = llmc.cuda.gemm

    def failing_gemm(*args, **kwargs):
        if _capturing():
            raise ValueError("gemm: the real cause")
        return emulated_gemm(*args, **kwargs)
    monkeypatch.setattr(llmc.cuda, "gemm", failing_gemm)
    model = _model("fp32")
    (x, y), = _batches(1, 8, 1, seed=2)
    with pytest.raises(ValueError, match="the real cause"):
        gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph=True)
    assert not _capturing() and model.graphs == {}                           # the capture was ended


def test_reallocation_drops_the_graphs(capture):
    model = _model("fp32")
    (x, y), = _batches(1, 8, 1, seed=1)
    gpt2_cuda.gpt2_activations(model, 1, 8)
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph=True)
    assert list(model.graphs) == [(1, 8, 1.0, False, None)]
    gpt2_cuda.gpt2_activations(model, 2, 16)                   # does not fit: everything is reallocated
    assert model.graphs == {}
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph=True)
    assert capture.captures == 2


UPDATE = gpt2_cuda.StepUpdate(0.9, 0.95, 1e-8, 0.1, grad_clip=1.0)      # the norms here are ~4: it clips


def _train_on_device(model, batches, cuda_graph, steps, micro_batches):
    """`steps` training steps as train() runs them on the device (gpt2_cuda's step without a host
    sync: adamw_prepare, the micro-batches, the first setting the gradients to 0, the last with the
    norm, clipping factor and AdamW; the loss and norm read back after the step). Returns
    [(summed loss, norm)] per step."""
    B, T = batches[0][0].shape
    readback, out = gpt2_cuda.StepReadback(B * T), []
    for step in range(1, steps + 1):
        gpt2_cuda.adamw_prepare(model, 1e-2, UPDATE.beta1, UPDATE.beta2, step)
        chosen = [batches[(step + i) % len(batches)] for i in range(micro_batches)]   # a different set each step
        for i, (x, y) in enumerate(chosen):
            gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0 / micro_batches, cuda_graph, first=i == 0,
                                       update=UPDATE if i == micro_batches - 1 else None)
        slot, done = readback.queue(gpt2_cuda.gpt2_activations(model, B, T)["loss_accum"], model.norm)
        out.append(readback.read(slot, done, B * T))
    return out


# the whole step as one graph (one micro-batch) and as three (first, middle, last): each graph
# equal to the eager launches bitwise; cuBLASLt with the residual in its epilogue and the
# classifier one sequence at a time, cuDNN attention; the projections' bias gradients summed by the
# LayerNorms (--ln-bias-grad 1) over three micro-batches
@pytest.mark.parametrize("precision,micro_batches,backend,attention,recompute,ln_bias_grad", [
    ("fp32", 1, "cublas", "naive", 1, False), ("bf16", 1, "cublaslt", "naive", 1, False),
    ("bf16", 3, "cublas", "naive", 1, False), ("bf16", 1, "cublas", "cudnn", 1, False),
    ("bf16", 1, "cublaslt", "naive", 0, False),           # -r 0, the default since 2026-11-27
    ("bf16", 3, "cublaslt", "naive", 0, True)])
def test_whole_step_graph_equals_eager_bitwise(capture, precision, micro_batches, backend, attention, recompute,
                                               ln_bias_grad):
    chunk = 1 if backend == "cublaslt" else 0
    batches = _batches(2, 16, 3, seed=7)
    if backend == "cublaslt":
        cublaslt.clear_cache()
    matmul = {"cublas": lambda: llmc.matmul.Cublas(), "cublaslt": lambda: llmc.matmul.CublasLt(residual_epilogue=True)}
    eager, graphed = (_model(precision, matmul[backend](), attention, chunk, recompute, ln_bias_grad) for _ in range(2))
    steps = 3
    eager_out = _train_on_device(eager, batches, cuda_graph=False, steps=steps, micro_batches=micro_batches)
    assert capture.captures == 0
    graph_out = _train_on_device(graphed, batches, cuda_graph=True, steps=steps, micro_batches=micro_batches)
    scale = 1.0 / micro_batches                                     # one graph: the whole step; three: the first
    keys = ({(2, 16, scale, True, UPDATE)} if micro_batches == 1 else   # (gradients to 0), a middle one, the last
            {(2, 16, scale, True, None), (2, 16, scale, False, None), (2, 16, scale, False, UPDATE)})
    assert set(graphed.graphs) == keys
    assert capture.captures == len(keys) and capture.replays == steps * micro_batches - len(keys)
    assert graph_out == eager_out and all(np.isfinite(x) for pair in graph_out for x in pair)
    for name in ("params", "m", "v", "grads", "norm"):
        np.testing.assert_array_equal(getattr(graphed, name).get(), getattr(eager, name).get(), err_msg=name)
    if precision == "bf16":
        np.testing.assert_array_equal(graphed.master.get(), eager.master.get(), err_msg="master")
    # the clipping factor came from the device: the norm (~4) over grad_clip 1, in fp32
    norm, factor = eager.norm.get()
    assert norm > UPDATE.grad_clip and factor == np.float32(np.float32(UPDATE.grad_clip) / norm)


@pytest.mark.parametrize("attention", ["naive", "cudnn"])
def test_autotuned_graph_steps_equal_untuned_eager_steps_bitwise(capture, attention):
    """--autotune 3 with the whole step as one graph: each cuBLASLt product's trials (and, with
    cuDNN attention, each attention graph's) run in the eager warm-up step (the first call), which
    must leave no trace (the emulated algorithms and plans compute alike, so any difference is a
    trial's write left behind: an accumulation counted again, a residual added twice), and the
    capture after it records the kept choice, never a trial."""
    batches = _batches(2, 16, 3, seed=11)
    cublaslt.clear_cache()
    cudnn_attention.GRAPHS.clear()

    def model(autotune):
        m = gpt2_cuda.GPT2(TINY, "bf16", master_weights=True, recompute=True, attention=attention,
                           matmul=llmc.matmul.CublasLt(residual_epilogue=True, autotune=autotune), autotune=autotune)
        gpt2_cuda.upload_parameters(m, gpt2_cpu.gpt2_init(TINY, 42).params)
        return m
    untuned, tuned = model(1), model(3)
    untuned_out = _train_on_device(untuned, batches, cuda_graph=False, steps=2, micro_batches=1)
    tuned_out = _train_on_device(tuned, batches, cuda_graph=True, steps=2, micro_batches=1)
    assert capture.captures == 1 and capture.replays == 1
    assert tuned_out == untuned_out
    for name in ("params", "m", "v", "grads", "master", "norm"):
        np.testing.assert_array_equal(getattr(tuned, name).get(), getattr(untuned, name).get(), err_msg=name)
    tuned_plans = [plan for key, plan in cublaslt._PLANS.items() if key[-1] == 3]
    assert tuned_plans and all(len(plan.timings_ms) == 3 for plan in tuned_plans)   # every product timed, eagerly
    report = gpt2_cuda.tuning_report(tuned)
    assert len(report) == len(tuned_plans) + (2 if attention == "cudnn" else 0)     # + the forward and backward graph
    if attention == "cudnn":
        assert all(len(entry.timings_ms) == 2 for entry in cudnn_attention.GRAPHS.values())  # the emulation's 2 plans
    cublaslt.clear_cache()
    cudnn_attention.GRAPHS.clear()


def test_step_on_the_device_matches_the_host_step(capture):
    # the same steps with the norm read by the host, its clipping factor computed there and passed
    # to gpt2_update (the path of -sl / -sg): the same losses and norms, the parameters to fp32's
    # rounding (the factor is divided in float64 on the host, in fp32 on the device)
    batches = _batches(2, 16, 3, seed=8)
    device_model, host_model = _model("fp32"), _model("fp32")
    on_device = _train_on_device(device_model, batches, cuda_graph=True, steps=2, micro_batches=1)
    for step in range(1, 3):
        x, y = batches[(step + 0) % 3]
        A = gpt2_cuda.gpt2_activations(host_model, 2, 16)
        gpt2_cuda.gpt2_zero_grad(host_model)
        A["loss_accum"].fill(0)
        gpt2_cuda.gpt2_micro_batch(host_model, x, y, 1.0)
        norm = gpt2_cuda.gpt2_grad_norm(host_model)
        loss_sum = float(A["loss_accum"].sum(dtype=np.float64))
        assert (loss_sum, norm) == pytest.approx(on_device[step - 1], rel=1e-6)
        gpt2_cuda.gpt2_update(host_model, 1e-2, UPDATE.beta1, UPDATE.beta2, UPDATE.eps, UPDATE.weight_decay, step,
                              gpt2_cuda.clip_factor(UPDATE.grad_clip, norm))
    np.testing.assert_allclose(device_model.params.get(), host_model.params.get(), rtol=1e-5, atol=1e-7)


def test_no_host_synchronization_inside_a_step_on_the_device(capture, monkeypatch):
    # between the step's uploads and its readback, nothing waits for the device: no blocking copy
    # to the host, no stream synchronize (uploads wait only on events of earlier uploads)
    model = _model("bf16")
    batches = _batches(2, 16, 3, seed=9)
    _train_on_device(model, batches, cuda_graph=True, steps=2, micro_batches=1)     # eager, captured, replayed
    waits = []
    get, synchronize = device.ndarray.get, device.cuda.Stream.synchronize
    monkeypatch.setattr(device.ndarray, "get",
                        lambda self, stream=None, order="C", out=None, blocking=True:
                        (waits.append("get") if blocking else None, get(self, stream, order, out, blocking))[1])
    monkeypatch.setattr(device.cuda.Stream, "synchronize", lambda self: (waits.append("sync"), synchronize(self))[1])
    gpt2_cuda.adamw_prepare(model, 1e-2, 0.9, 0.95, 3)
    x, y = batches[0]
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, True, first=True, update=UPDATE)
    readback = gpt2_cuda.StepReadback(2 * 16)
    slot, done = readback.queue(gpt2_cuda.gpt2_activations(model, 2, 16)["loss_accum"], model.norm)
    assert waits == [] and capture.replays == 2
    assert readback.read(slot, done, 2 * 16)[1] == float(model.norm.get()[0])


def test_training_run_with_cuda_graph_prints_the_same_losses(capture, tmp_path, capsys):
    data = _write_shards(tmp_path)
    model = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    common = ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "8", "-x", "2", "-s", "0", "-v", "2",
              "-l", "1e-3", "-d", "32", "--precision", "bf16", "--device", "cpu"]     # -d 32: 2 micro-batches a step
    logs = {}
    for graph in (0, 1):
        out_dir = str(tmp_path / f"graph{graph}")
        assert gpt2_cuda.main(common + ["-o", out_dir, "--cuda-graph", str(graph)]) == 0
        logs[graph] = _train_losses(f"{out_dir}/main.log")
    capsys.readouterr()
    assert len(logs[0]) == 2 and logs[1] == logs[0]
    # 2 steps of 2 micro-batches: the first (gradients set to 0) and the last (with the update) are
    # captured after running eagerly once, then replayed
    assert capture.captures == 2 and capture.replays == 2 * 2 - 2


def _printed(text):
    """The step and val lines of a run's output, in order: ("step", n, loss, norm) or ("val", loss)."""
    lines = []
    for line in text.splitlines():
        step = re.match(r"step\s+(\d+)/\d+ \| loss (\S+) \| norm (\S+)", line)
        val = re.match(r"val loss (\S+)", line)
        if step:
            lines.append(("step", int(step.group(1)), float(step.group(2)), float(step.group(3))))
        elif val:
            lines.append(("val", float(val.group(1))))
    return lines


@pytest.mark.parametrize("graph", [0, 1])
def test_steps_logged_a_step_late_print_as_gpt2_cpu(capture, tmp_path, capsys, graph):
    # train() logs each step after queueing the next: its lines must still come in gpt2_cpu.py's
    # order (each val line after the step before it), with its values, the last step's included
    data = _write_shards(tmp_path)
    model = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    common = ["-e", model, "-i", data, "-j", data, "-b", "2", "-t", "8", "-x", "5", "-s", "0", "-v", "2", "-m", "2",
              "-l", "1e-3"]
    capsys.readouterr()
    assert gpt2_cpu.main(common) == 0
    cpu = _printed(capsys.readouterr().out)
    assert gpt2_cuda.main(common + ["--device", "cpu", "--cuda-graph", str(graph)]) == 0
    gpu = _printed(capsys.readouterr().out)
    assert [line[:2] for line in cpu] == [("val", cpu[0][1]), ("step", 1), ("step", 2), ("val", cpu[3][1]), ("step", 3),
                                         ("step", 4), ("val", cpu[6][1]), ("step", 5), ("val", cpu[8][1])]
    assert [line[:2] if line[0] == "step" else line[:1] for line in gpu] == \
           [line[:2] if line[0] == "step" else line[:1] for line in cpu]
    for ours, ref in zip(gpu, cpu):
        assert ours[1:] == pytest.approx(ref[1:], rel=1e-5), (ours, ref)
    assert capture.captures == graph


# ----------------------------------------------------------------------------
# cuBLAS under capture: CuPy's bindings refuse it, nvmath-python's record it

CUPY_CAPTURE_REFUSAL = "calling cuBLAS API during stream capture is currently unsupported"   # CuPy 14.2's text


def _column_major_operands(m, n, k, seed):
    """fp32 device A (m,k), B (k,n), C (m,n) for a column-major GEMM, as row-major arrays of their
    transposes (A^T (k,m) etc.), and the expected C^T = (A B)^T = B^T A^T in float64."""
    rng = np.random.default_rng(seed)
    at, bt = rng.standard_normal((k, m)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
    ct = device.full((n, m), np.nan, np.float32)
    return device.asarray(at), device.asarray(bt), ct, bt.astype(np.float64) @ at.astype(np.float64)


def _gemm_args(m, n, k, at, bt, ct, alpha, beta, batch=None):
    """cublasGemmEx's arguments after the handle (op N N, fp32); with batch, those of
    cublasGemmStridedBatchedEx (strides 0: the same product `batch` times)."""
    f32, N = llmc.cuda.CUDA_R_32F, llmc.cuda.CUBLAS_OP_N
    stride, count = ((), ()) if batch is None else ((0,), (batch,))
    return (N, N, m, n, k, alpha.ctypes.data, at.data.ptr, f32, m, *stride, bt.data.ptr, f32, k, *stride,
            beta.ctypes.data, ct.data.ptr, f32, m, *stride, *count, llmc.cuda.CUBLAS_COMPUTE_32F,
            llmc.cuda.CUBLAS_GEMM_DEFAULT)


def test_copies_while_the_stream_captures(capture):
    """While the stream captures, CuPy 14 refuses a copy from the host itself (ndarray.set,
    cupy.asarray or cupy.array of host data: cupy/cuda/memory.pyx v14.2.0, copy_from_host_async),
    and so does the emulated device, which copied at once before (a replay would then not have
    copied); a device-to-device cupy.array is a kernel, recorded and run at the replay."""
    dev = device.zeros(4, np.float32)
    stream = device.cuda.get_current_stream()
    stream.begin_capture()
    with pytest.raises(RuntimeError, match="the current stream is capturing, so H2D transfers are disallowed"):
        dev.set(np.ones(4, np.float32))
    with pytest.raises(RuntimeError, match="the current stream is capturing, so H2D transfers are disallowed"):
        device.asarray(np.ones(4, np.float32))                     # cupy.asarray of a host array: the same copy
    assert device.asarray(dev) is dev                              # a device array: no copy, allowed
    copied = device.array(dev, dtype=np.float64)                   # device to device: recorded, not run
    with pytest.raises(RuntimeError, match="H2D transfers are disallowed"):
        device.array([1.0, 2.0])
    graph = stream.end_capture()
    dev.set(np.ones(4, np.float32))
    np.testing.assert_array_equal(dev.get(), np.ones(4, np.float32))
    graph.launch()                                                 # the replay copies what dev holds now
    assert copied.dtype == np.float64 and copied.get().tolist() == [1.0] * 4


def test_cupy_cublas_refuses_every_call_while_the_stream_captures(capture):
    # CuPy 14's gemmEx and gemmStridedBatchedEx set the handle's stream first, and setStream
    # raises while that stream captures (cupy_backends/cuda/libs/cublas.pyx v14.2.0, 642-668)
    cublas = llmc.cuda.library("cublas")
    handle = device.cuda.device.get_cublas_handle()
    m, n, k = 3, 2, 4
    at, bt, ct, expected = _column_major_operands(m, n, k, seed=1)
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
    cublas.gemmEx(handle, *_gemm_args(m, n, k, at, bt, ct, alpha, beta))             # not capturing: computed
    np.testing.assert_allclose(ct.get(), expected, rtol=1e-5)
    a = device.asarray(np.ones((2, 3), np.float32))             # uploaded before the capture (CuPy refuses it in one)
    ints = device.asarray(np.ones((2, 3), np.int32))
    stream = device.cuda.get_current_stream()
    stream.begin_capture()
    with pytest.raises(NotImplementedError) as refused:
        cublas.gemmEx(handle, *_gemm_args(m, n, k, at, bt, ct, alpha, beta))
    assert str(refused.value) == CUPY_CAPTURE_REFUSAL
    with pytest.raises(NotImplementedError, match=CUPY_CAPTURE_REFUSAL):
        cublas.gemmStridedBatchedEx(handle, *_gemm_args(m, n, k, at, bt, ct, alpha, beta, batch=1))
    # CuPy's own products of floating arrays are cuBLAS calls too (cupy/_core/_routines_linalg.pyx)
    for product in (lambda: a @ a.T, lambda: np.matmul(a, a.T), lambda: np.dot(a, a.T), lambda: np.inner(a, a),
                    lambda: np.tensordot(a, a.T, 1), lambda: np.vdot(a, a)):
        with pytest.raises(NotImplementedError, match=CUPY_CAPTURE_REFUSAL):
            product()
    assert (ints @ ints.T).shape == (2, 2)                      # integer products are CuPy's own kernels
    assert stream.end_capture().work == []                     # nothing was recorded


def test_nvmath_cublas_runs_on_its_handles_stream(capture):
    # nvmath's bindings check nothing: a GEMM goes on the stream the handle was last set to,
    # recorded if that stream captures, run at once if it does not (and then missing from the
    # graph), and on the legacy stream during a blocking capture it fails as CUDA does
    nv = llmc.cuda.library("nvmath_cublas")
    handle = nv.create()
    nv.set_pointer_mode(handle, nv.PointerMode.HOST)
    m, n, k = 4, 3, 5
    at, bt, ct, expected = _column_major_operands(m, n, k, seed=2)
    alpha, beta = np.full(1, 2.0, np.float32), np.zeros(1, np.float32)
    stream = device.cuda.get_current_stream()
    nv.set_stream(handle, stream.ptr)
    assert nv.get_stream(handle) == stream.ptr
    stream.begin_capture()
    nv.gemm_ex(handle, *_gemm_args(m, n, k, at, bt, ct, alpha, beta))
    alpha[0] = 3.0                                             # host scalars are read at the call, as cuBLAS
    graph = stream.end_capture()
    assert np.isnan(ct.get()).all()                            # recorded, not run
    graph.launch(stream)
    np.testing.assert_allclose(ct.get(), 2.0 * expected, rtol=1e-5)

    other = device.cuda.Stream()
    nv.set_stream(handle, other.ptr)
    ct.fill(np.nan)
    stream.begin_capture()
    nv.gemm_ex(handle, *_gemm_args(m, n, k, at, bt, ct, alpha, beta))                # on `other`: runs now
    assert stream.end_capture().work == []
    np.testing.assert_allclose(ct.get(), 3.0 * expected, rtol=1e-5)

    nv.set_stream(handle, 0)
    stream.begin_capture()
    with pytest.raises(nv.cuBLASError, match="cudaErrorStreamCaptureImplicit") as failed:
        nv.gemm_ex(handle, *_gemm_args(m, n, k, at, bt, ct, alpha, beta))
    assert failed.value.status == nv.Status.EXECUTION_FAILED
    stream.end_capture()
    nv.destroy(handle)


def test_emulated_nvmath_cublas_has_nvmaths_calls_and_enums():
    nv = pytest.importorskip("nvmath.bindings.cublas", reason="nvmath-python not installed")
    emulated = importlib.import_module("llmc.emulator.nvmath_cublas")
    for name in ("create", "destroy", "get_version", "set_stream", "get_stream", "set_pointer_mode", "get_pointer_mode",
                 "gemm_ex", "gemm_strided_batched_ex"):
        assert inspect.signature(getattr(emulated, name)) == inspect.signature(getattr(nv, name)), name
    for enum_name in ("Status", "Operation", "PointerMode", "ComputeType", "GemmAlgo"):
        for member in getattr(emulated, enum_name):
            assert member == getattr(getattr(nv, enum_name), member.name), f"{enum_name}.{member.name}"
    assert issubclass(nv.cuBLASError, Exception) and issubclass(emulated.cuBLASError, Exception)


def test_gemm_sets_the_handles_stream_before_the_capture_only(capture, monkeypatch):
    monkeypatch.setattr(llmc.cuda, "_CUBLAS", {})
    bindings = llmc.cuda.cublas_bindings()
    assert isinstance(bindings, llmc.cuda.NvmathCublas) and llmc.cuda.cuda_graph_unavailable_reason() is None
    set_streams = []
    set_stream = bindings.lib.set_stream
    monkeypatch.setattr(bindings.lib, "set_stream", lambda h, s: (set_streams.append(s), set_stream(h, s)))
    m, n, k = 2, 2, 3
    at, bt, ct, expected = _column_major_operands(m, n, k, seed=3)
    stream = device.cuda.get_current_stream()
    llmc.cuda.gemm(0, 0, m, n, k, at, m, bt, k, ct, m)
    llmc.cuda.gemm(0, 0, m, n, k, at, m, bt, k, ct, m)
    assert set_streams == [stream.ptr]                         # once: the handle keeps its stream
    stream.begin_capture()
    llmc.cuda.gemm(0, 0, m, n, k, at, m, bt, k, ct, m, accumulate=True)
    assert len(stream.end_capture().work) == 1 and set_streams == [stream.ptr]
    fresh = device.cuda.Stream().use()                              # not used eagerly: the handle is elsewhere
    fresh.begin_capture()
    with pytest.raises(RuntimeError, match="another stream than the capturing one"):
        llmc.cuda.gemm(0, 0, m, n, k, at, m, bt, k, ct, m)
    fresh.end_capture()
    np.testing.assert_allclose(ct.get(), expected, rtol=1e-5)


def test_cuda_graph_without_nvmath_is_refused_at_startup(capture, monkeypatch, tmp_path, capsys):
    # without nvmath-python, GEMMs go through CuPy's cuBLAS: eager micro-batches work, a captured
    # one fails at its first GEMM as on a GPU, so --cuda-graph 1 is refused before training starts
    monkeypatch.setitem(sys.modules, "llmc.emulator.nvmath_cublas", None)            # "not installed"
    monkeypatch.setattr(llmc.cuda, "_CUBLAS", {})
    assert isinstance(llmc.cuda.cublas_bindings(), llmc.cuda.CupyCublas)
    model = _model("fp32")
    (x, y), = _batches(1, 8, 1, seed=2)
    gpt2_cuda.gpt2_activations(model, 1, 8)["loss_accum"].fill(0)
    gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph=False)
    with pytest.raises(NotImplementedError, match=CUPY_CAPTURE_REFUSAL):
        gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0, cuda_graph=True)
    captures = capture.captures
    data = _write_shards(tmp_path)
    model_path = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model_path, gpt2_cpu.gpt2_init(TINY, 42))
    capsys.readouterr()
    argv = ["-e", model_path, "-i", data, "-j", "", "-b", "2", "-t", "8", "-x", "1", "-v", "0", "-s", "0",
            "--device", "cpu", "-o", str(tmp_path / "out"), "--cuda-graph", "1"]
    assert gpt2_cuda.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --cuda-graph 1: CUDA graphs need nvmath-python's cuBLAS "
                                               "bindings")
    assert "unavailable (ModuleNotFoundError: " in err[0]
    assert "--cuda-graph 0" in err[0] and capture.captures == captures                # refused before any step
    # --cuda-graph auto (the default), where it means 1 (on a GPU): one line, and the kernels launched one by one
    monkeypatch.setattr(gpt2_cuda.gpu_cli, "cuda_graph_choice", lambda requested: requested == "auto" or requested)
    assert gpt2_cuda.main(argv[:-2] + ["-o", str(tmp_path / "auto")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "no CUDA graph" in line] == [
        "gpt2_cuda.py: kernels launched one by one, no CUDA graph: " + err[0][len("error: --cuda-graph 1: "):]]
    assert capture.captures == captures and any(line.startswith("step    1/1") for line in out)


# ----------------------------------------------------------------------------
# on a GPU: CuPy's stream capture of the real kernels, cuBLAS calls and CuPy operations

@pytest.mark.gpu
@pytest.mark.parametrize("precision,attention,backend", [
    ("bf16", "naive", "cublas"), ("fp32", "naive", "cublas"), ("bf16", "flash", "cublas"),
    ("bf16", "cudnn", "cublaslt")])                                             # the last: the GPU defaults
def test_gpu_graph_steps_equal_eager_steps_bitwise(precision, attention, backend):
    import cupy as cp
    cfg = gpt2_cpu.GPT2Config(max_seq_len=64, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                              channels=128)                                     # HS = 64: every path has kernels
    if attention == "cudnn" and cudnn_attention.unavailable_reason(precision, 64):
        pytest.skip(cudnn_attention.unavailable_reason(precision, 64))
    if backend == "cublaslt" and cublaslt.unavailable_reason():
        pytest.skip(cublaslt.unavailable_reason())
    matmul = {"cublas": llmc.matmul.Cublas, "cublaslt": llmc.matmul.CublasLt}[backend]
    batches = _batches(4, 64, 2, seed=3)
    results = {}
    with cp.cuda.Stream():                                                      # capture needs a created stream
        for graph in (False, True):
            model = gpt2_cuda.GPT2(cfg, precision, master_weights=True, recompute=True, attention=attention,
                                   matmul=matmul())
            gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
            llmc.cuda.load_modules(gpt2_cuda.kernel_files(model), precision)
            sums = _train(model, batches, cuda_graph=graph, steps=2)
            results[graph] = (sums, {name: getattr(model, name).get() for name in ("params", "m", "v", "grads")})
            if graph:
                assert len(model.graphs) == 1
    assert results[True][0] == results[False][0] and all(np.isfinite(results[True][0]))
    for name, eager in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][name], eager, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,attention,backend,micro_batches", [
    ("bf16", "cudnn", "cublaslt", 1), ("bf16", "cudnn", "cublaslt-residual", 1), ("bf16", "cudnn", "cublaslt", 2),
    ("fp32", "naive", "cublas", 1), ("bf16", "cudnn", "cublaslt_ln", 2)])
# the first: the GPU defaults; the second with the classifier in 2 chunks; the last with --ln-bias-grad 1
def test_gpu_whole_step_graph_equals_eager_bitwise(precision, attention, backend, micro_batches):
    import cupy as cp
    cfg = gpt2_cpu.GPT2Config(max_seq_len=64, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2,
                              channels=128)
    if attention == "cudnn" and cudnn_attention.unavailable_reason(precision, 64):
        pytest.skip(cudnn_attention.unavailable_reason(precision, 64))
    if backend.startswith("cublaslt") and cublaslt.unavailable_reason():
        pytest.skip(cublaslt.unavailable_reason())
    matmul = {"cublas": lambda: llmc.matmul.Cublas(), "cublaslt": lambda: llmc.matmul.CublasLt(),
              "cublaslt-residual": lambda: llmc.matmul.CublasLt(residual_epilogue=True),
              "cublaslt_ln": lambda: llmc.matmul.CublasLt()}[backend]
    batches = _batches(4, 64, 3, seed=3)
    results = {}
    with cp.cuda.Stream():                                                      # capture needs a created stream
        for graph in (False, True):
            model = gpt2_cuda.GPT2(cfg, precision, master_weights=True, recompute=True, attention=attention,
                                   matmul=matmul(), classifier_chunk=2 if backend == "cublaslt-residual" else 0,
                                   ln_bias_grad=backend == "cublaslt_ln")
            gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
            llmc.cuda.load_modules(gpt2_cuda.kernel_files(model), precision)
            out = _train_on_device(model, batches, cuda_graph=graph, steps=3, micro_batches=micro_batches)
            results[graph] = (out, {name: getattr(model, name).get() for name in ("params", "m", "v", "grads", "norm")})
            if graph:
                assert len(model.graphs) == (1 if micro_batches == 1 else 2)
    assert results[True][0] == results[False][0] and all(np.isfinite(x) for pair in results[True][0] for x in pair)
    for name, eager in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][name], eager, err_msg=name)
