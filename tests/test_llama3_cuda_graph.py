"""llama3_cuda.py's CUDA graph of a micro-batch (--cuda-graph 1), without a GPU: the real kernels on
the emulated CUDA device, whose stream capture records every launch, fill and cuBLAS call (through
nvmath-python's bindings, emulated) with its arguments as they are at capture time and replays the
recording (tests/test_cuda_graph.py's fixture `capture`, which says what that catches). Checked, on a
tiny Llama 3 with grouped-query attention: training steps of two micro-batches each with the graph
equal eager steps bitwise (each micro-batch's losses, the gradients, parameters, AdamW moments and,
in bf16, the master weights) in fp32 and bf16, with one capture and replays after it, and the
replayed graph reads each micro-batch's own tokens; a training run with --cuda-graph 1 prints the
same losses as --cuda-graph 0; without nvmath-python --cuda-graph 1 is refused with one `error:`
line before training starts. What a GPU must still show is tests/test_cuda_graph.py's list.
Run: pytest tests/test_llama3_cuda_graph.py   (~half a minute on 2 cores once the emulated device's
kernels are built)
"""

import sys

import numpy as np
import pytest

import gpt2_cuda
import llama3_cpu
import llama3_cuda
import llmc.cuda
from emulated_gpu import _train_losses, _write_shards
from test_cuda_graph import CUPY_CAPTURE_REFUSAL, capture  # noqa: F401 (capture: the fixture, used by name)
from test_llama3_cuda import TINY

B, T = 2, 16
MICRO_BATCHES = 2                       # gradient accumulation over two micro-batches a step


@pytest.fixture
def graphs(capture, monkeypatch):
    """capture's counts, with the global norm's grid cut to 16 blocks (as tests/test_llama3_cuda.py's
    tiny_training: the same kernel, another fixed order) to keep each step's norm short."""
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)
    return capture


def _model(precision, attention="naive"):
    model = llama3_cuda.Llama3(TINY, precision, attention=attention)
    llama3_cuda.upload_parameters(model, llama3_cpu.llama3_init(TINY, seed=3).params)
    return model


def _batches(n, seed):
    rng = np.random.default_rng(seed)
    batches = [tuple(rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(n)]
    batches[1][0][0, :9] = 7                 # repeated tokens: fewer dwte chunks than B*T, so padding chunks
    return batches


def _train(model, batches, cuda_graph, steps):
    """`steps` AdamW steps of MICRO_BATCHES micro-batches each (another pairing each step); returns
    the sum of each micro-batch's losses (B,T), in order."""
    sums = []
    for step in range(1, steps + 1):
        gpt2_cuda.gpt2_zero_grad(model)
        for x, y in batches[step - 1:] + batches[:step - 1]:
            llama3_cuda.llama3_micro_batch(model, x, y, 1.0 / MICRO_BATCHES, cuda_graph)
            sums.append(float(llama3_cuda.llama3_activations(model, B, T)["losses"].sum(dtype=np.float64)))
        norm = gpt2_cuda.gpt2_grad_norm(model)
        llama3_cuda.llama3_update(model, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, 1.0 / max(norm, 1.0))
    return sums


@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "naive"), ("bf16", "cudnn")])
def test_graph_steps_equal_eager_steps_bitwise(graphs, precision, attention):
    steps = 2                                # the second step replays on the parameters AdamW updated in place
    batches = _batches(MICRO_BATCHES, seed=5)
    eager, graphed = _model(precision, attention), _model(precision, attention)
    eager_sums = _train(eager, batches, cuda_graph=False, steps=steps)
    assert graphs.captures == 0
    graph_sums = _train(graphed, batches, cuda_graph=True, steps=steps)
    assert graphs.captures == 1 and graphs.replays == MICRO_BATCHES * steps - 1   # the first micro-batch eager
    assert list(graphed.graphs) == [(B, T, 1.0 / MICRO_BATCHES)]
    assert graph_sums == eager_sums and len(set(graph_sums)) == len(graph_sums)
    for name in ("params", "grads", "m", "v"):
        np.testing.assert_array_equal(getattr(graphed, name).get(), getattr(eager, name).get(), err_msg=name)
    if precision == "bf16":
        np.testing.assert_array_equal(graphed.master.get(), eager.master.get(), err_msg="master")
    # and the eager micro-batch is the forward + backward it replaces: llama3_forward's losses, the
    # gradient llama3_backward accumulates
    (x, y), = _batches(MICRO_BATCHES, seed=6)[:1]
    gpt2_cuda.gpt2_zero_grad(eager)
    llama3_cuda.llama3_forward(eager, x, y)
    llama3_cuda.llama3_backward(eager, 0.25)
    losses, grads = llama3_cuda.llama3_activations(eager, B, T)["losses"].get(), eager.grads.get()
    gpt2_cuda.gpt2_zero_grad(graphed)
    llama3_cuda.llama3_micro_batch(graphed, x, y, 0.25, cuda_graph=True)     # a new key: eager, then captured
    assert graphs.captures == 2
    gpt2_cuda.gpt2_zero_grad(graphed)
    llama3_cuda.llama3_micro_batch(graphed, x, y, 0.25, cuda_graph=True)     # replayed
    np.testing.assert_array_equal(llama3_cuda.llama3_activations(graphed, B, T)["losses"].get(), losses)
    np.testing.assert_array_equal(graphed.grads.get(), grads)


def _cli(tmp_path):
    model = str(tmp_path / "tiny_llama3.bin")
    llama3_cpu.write_model(model, llama3_cpu.llama3_init(TINY, seed=3))
    data = _write_shards(tmp_path, V=TINY.vocab_size)
    return ["-e", model, "-i", data, "-j", "", "-b", str(B), "-t", str(T), "-v", "0", "-s", "0", "-l", "1e-3",
            "-k", "constant", "--device", "cpu"]


def test_training_run_with_cuda_graph_prints_the_same_losses(graphs, tmp_path, capsys):
    common = _cli(tmp_path) + ["-x", "2", "--precision", "bf16", "-d", str(MICRO_BATCHES * B * T)]
    logs = {}
    for graph in (0, 1):
        out_dir = str(tmp_path / f"graph{graph}")
        assert llama3_cuda.main(common + ["-o", out_dir, "--cuda-graph", str(graph)]) == 0
        logs[graph] = _train_losses(f"{out_dir}/main.log")
    assert "CUDA graph" in capsys.readouterr().out
    assert len(logs[0]) == 2 and logs[1] == logs[0]
    assert graphs.captures == 1 and graphs.replays == 2 * MICRO_BATCHES - 1


def test_cuda_graph_without_nvmath_is_refused_at_startup(graphs, monkeypatch, tmp_path, capsys):
    # as tests/test_cuda_graph.py's for gpt2_cuda.py: CuPy's cuBLAS would fail at the first captured GEMM
    monkeypatch.setitem(sys.modules, "llmc.emulator.nvmath_cublas", None)            # "not installed"
    monkeypatch.setattr(llmc.cuda, "_CUBLAS", {})
    assert isinstance(llmc.cuda.cublas_bindings(), llmc.cuda.CupyCublas)
    model = _model("fp32")
    (x, y), = _batches(MICRO_BATCHES, seed=2)[:1]
    llama3_cuda.llama3_micro_batch(model, x, y, 1.0, cuda_graph=False)
    with pytest.raises(NotImplementedError, match=CUPY_CAPTURE_REFUSAL):
        llama3_cuda.llama3_micro_batch(model, x, y, 1.0, cuda_graph=True)
    captures = graphs.captures
    argv = _cli(tmp_path) + ["-x", "1", "-o", str(tmp_path / "out"), "--cuda-graph", "1"]
    capsys.readouterr()
    assert llama3_cuda.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --cuda-graph 1: CUDA graphs need nvmath-python's cuBLAS "
                                               "bindings"), err
    assert "--cuda-graph 0" in err[0] and graphs.captures == captures                # refused before any step


# ----------------------------------------------------------------------------
# on a GPU: CUDA's own stream capture of the real kernels, cuBLAS (nvmath-python) and cuDNN

@pytest.mark.gpu
@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "naive"), ("bf16", "flash"),
                                                 ("bf16", "cudnn")])
def test_gpu_graph_steps_equal_eager_steps_bitwise(precision, attention):
    """tests/test_cuda_graph.py's GPU test for llama3_cuda.py: two steps of two micro-batches with the
    graph equal eager steps bitwise (losses, parameters, gradients, AdamW moments), on a tiny Llama 3
    with head size 64 (so that flash and cuDNN attention run) and grouped-query attention."""
    import cupy as cp
    from llmc import cudnn_attention
    cfg = llama3_cpu.LlamaConfig(max_seq_len=64, vocab_size=TINY.vocab_size, num_layers=2, num_heads=4,
                                 num_kv_heads=2, channels=256, multiple_of=32)          # HS = 64
    if attention == "cudnn" and cudnn_attention.unavailable_reason(precision, 64):
        pytest.skip(cudnn_attention.unavailable_reason(precision, 64))
    if llmc.cuda.cuda_graph_unavailable_reason():
        pytest.skip(llmc.cuda.cuda_graph_unavailable_reason())
    batches = _batches(MICRO_BATCHES, seed=5)
    results = {}
    with cp.cuda.Stream():                                                  # capture needs a created stream
        for graph in (False, True):
            model = llama3_cuda.Llama3(cfg, precision, attention=attention)
            llama3_cuda.upload_parameters(model, llama3_cpu.llama3_init(cfg, seed=3).params)
            llmc.cuda.load_modules(llama3_cuda.KERNEL_FILES + model.attention.kernel_files, precision)
            sums = _train(model, batches, cuda_graph=graph, steps=2)
            results[graph] = (sums, {name: getattr(model, name).get() for name in ("params", "grads", "m", "v")})
            if graph:
                assert list(model.graphs) == [(B, T, 1.0 / MICRO_BATCHES)]
    assert results[True][0] == results[False][0] and all(np.isfinite(results[True][0]))
    for name, eager in results[False][1].items():
        np.testing.assert_array_equal(results[True][1][name], eager, err_msg=name)
