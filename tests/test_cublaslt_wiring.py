"""gpt2_cuda.py with --cublaslt 1, without a GPU: the whole model on the emulated CUDA device
(tests/emulated_gpu.py's fixture: the real kernels on the CPU), its linear layers through
llmc/cublaslt.py itself on the emulated device's cuBLASLt
(llmc/emulator/cublaslt.py: the epilogues bias, GELU with the pre-activation stored, DGELU and the
bias gradient, computed on the raw pointers), checked tensor by tensor against gpt2_cpu.py. This
checks the wiring (which layer passes which buffer as the GELU pre-activation, that the separate
GELU kernels are skipped, the bias-gradient fallback when cuBLASLt has no BGRADB algorithm, and with
--residual-epilogue 1 the residual added by the output projections with the LayerNorms after them
only normalizing), not
cuBLASLt itself: a GPU checks the library (tests/test_cublaslt.py part 2).
Run: pytest tests/test_cublaslt_wiring.py   (a few seconds once the emulated kernels are built)
"""

import inspect
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import gpt2_cuda
import llmc.matmul
import llmc
import llmc.attention
import llmc.gpu_cli
import llmc.cuda
from llmc import cuda_check
from emulated_gpu import TINY, emulated_gpu, record_launches, tiny_model_parameters  # noqa: F401  (a fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _recording(calls, fn, direction):
    """fn (llmc.cublaslt's matmul_forward_lt or matmul_backward_lt), each call recorded as
    (direction, OC, whether a GELU pre-activation was passed[, whether a residual was: forward])."""
    def wrapper(*args, pre_gelu=None, tf32=False, **residual):
        calls.append((direction, args[-1], pre_gelu is not None) +
                     ((residual.get("residual") is not None,) if direction == "forward" else ()))
        return fn(*args, pre_gelu=pre_gelu, tf32=tf32, **residual)
    return wrapper


def _emulated_cublaslt(monkeypatch, calls, bgrad):
    """llmc/cublaslt.py itself on the emulated device's cuBLASLt (llmc/emulator/cublaslt.py, what
    llmc.cuda.library("cublaslt") returns with the device "cpu"); without bgrad its heuristic
    finds no BGRADB algorithm, as some cuBLASLt builds do."""
    from llmc import cublaslt
    lt = llmc.cuda.library("cublaslt")
    if not bgrad:
        heuristic = lt.matmul_algo_get_heuristic

        def no_bgradb(handle, desc, *rest):
            epilogue, written = np.zeros(1, np.uint32), np.zeros(1, np.uint64)
            lt.matmul_desc_get_attribute(desc, lt.MatmulDescAttribute.EPILOGUE, epilogue.ctypes.data, 4,
                                         written.ctypes.data)
            if epilogue[0] == lt.Epilogue.BGRADB:
                raise lt.cuBLASLtError(lt.Status.NOT_SUPPORTED)
            return heuristic(handle, desc, *rest)
        monkeypatch.setattr(lt, "matmul_algo_get_heuristic", no_bgradb)
    monkeypatch.setattr(cublaslt, "matmul_forward_lt", _recording(calls, cublaslt.matmul_forward_lt, "forward"))
    monkeypatch.setattr(cublaslt, "matmul_backward_lt", _recording(calls, cublaslt.matmul_backward_lt, "backward"))
    cublaslt.clear_cache()
    return cublaslt


def _checked_against_gpt2_cpu(monkeypatch, precision, matmul, bgrad, seed, **options):
    """The TINY model with `matmul` (recompute off; GPT2's other options) on the emulated device,
    llmc/cublaslt.py on its cuBLASLt (_emulated_cublaslt), one batch checked tensor by tensor against
    gpt2_cpu.py. Returns (the recorded linear-layer calls, the recorded kernel launches, llmc.cublaslt)."""
    calls = []
    cublaslt = _emulated_cublaslt(monkeypatch, calls, bgrad)
    launches = record_launches(monkeypatch)
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, recompute=False, matmul=matmul, **options)
    gpt2_cuda.upload_parameters(model, tiny_model_parameters(TINY, 42).params)
    rng = np.random.default_rng(seed)
    x = rng.integers(0, TINY.vocab_size, (2, 16)).astype(np.int32)
    y = rng.integers(0, TINY.vocab_size, (2, 16)).astype(np.int32)
    assert cuda_check.check_against_cpu(gpt2_cuda, model, x, y, np.float64)
    return calls, launches, cublaslt


@pytest.mark.parametrize("precision,bgrad,residual_epilogue", [
    ("fp32", True, False), ("fp32", False, False), ("bf16", True, False), ("fp32", True, True), ("bf16", True, True)])
def test_emulated_model_with_cublaslt_matches_gpt2_cpu(emulated_gpu, monkeypatch, precision, bgrad,
                                                       residual_epilogue):
    # the separate GELU kernels must not run: their work is in the epilogues
    monkeypatch.setattr(llmc.matmul, "gelu_backward_inplace", lambda *a: pytest.fail("gelu_backward_inplace ran"))
    calls, launches, cublaslt = _checked_against_gpt2_cpu(
        monkeypatch, precision, llmc.matmul.CublasLt(residual_epilogue=residual_epilogue), bgrad, seed=2)
    C, L = TINY.channels, TINY.num_layers
    # per layer: qkv, attproj, fc (with GELU), fcproj; then the classifier (no bias). With the residual in
    # the epilogue, the two output projections add it, and no fused residual kernel runs: LayerNorms only
    r = residual_epilogue
    assert calls[:4] == [("forward", 3 * C, False, False), ("forward", C, False, r), ("forward", 4 * C, True, False),
                         ("forward", C, False, r)]
    names = [launch.name for launch in launches]
    assert names.count("fused_residual_forward") == (0 if r else 2 * L)
    assert names.count("layernorm_forward") == 1 + (2 * L if r else 0)
    backward = [c for c in calls if c[0] == "backward"]
    assert backward[:3] == [("backward", TINY.padded_vocab_size, False), ("backward", C, True),
                            ("backward", 4 * C, False)]                   # wte; fcproj through DGELU; fc
    assert len(backward) == 1 + 4 * L
    cublaslt.clear_cache()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("gelu_fusion", [0, 1])
def test_gelu_fusion_levels_match_gpt2_cpu(emulated_gpu, monkeypatch, precision, gelu_fusion):
    """-ge 1: the GELU in the fc GEMM's epilogue, its derivative in gelu_backward_inplace after a
    plain fcproj input gradient; -ge 0: also the forward's GELU in gelu_forward after a BIAS GEMM
    into the pre-activation (llm.c's gelu_fusion levels). Each matches gpt2_cpu.py, with the GELU
    work where the level puts it (recompute=False: no other gelu_forward runs)."""
    calls, launches, cublaslt = _checked_against_gpt2_cpu(
        monkeypatch, precision, llmc.matmul.CublasLt(gelu_fusion=gelu_fusion), bgrad=True, seed=3)
    C, L = TINY.channels, TINY.num_layers
    forward = [c for c in calls if c[0] == "forward"]
    forward_fc = [forward[4 * l + 2] for l in range(L)]              # per layer: qkv, attproj, fc, fcproj
    backward_fcproj = [c for c in calls if c[0] == "backward" and c[1] == C and c[2]]
    assert forward_fc == [("forward", 4 * C, gelu_fusion >= 1, False)] * L
    assert backward_fcproj == []                                      # DGELU only at -ge 2
    names = [launch.name for launch in launches]
    fc_forwards = len(forward) // (4 * L + 1) * L                     # --check may run the forward more than once
    assert names.count("gelu_forward") == (0 if gelu_fusion >= 1 else fc_forwards)
    assert names.count("gelu_backward_inplace") == L
    cublaslt.clear_cache()


def _recorded_epilogues(monkeypatch):
    """The name of the epilogue of every llmc.cublaslt.matmul_cublaslt call from now on."""
    from llmc import cublaslt
    epilogues = []
    product = cublaslt.matmul_cublaslt

    def recorded(*args, **kwargs):
        epilogues.append(inspect.signature(product).bind(*args, **kwargs).arguments.get(
            "epilogue", cublaslt.NO_EPILOGUE).name)
        return product(*args, **kwargs)
    monkeypatch.setattr(cublaslt, "matmul_cublaslt", recorded)
    return epilogues


def _refuse_dgelu_bgrad(monkeypatch):
    """The emulated cuBLASLt's heuristic answers NOT_SUPPORTED for DGELU_BGRAD, as a cuBLASLt
    build without an algorithm for it would."""
    lt = llmc.cuda.library("cublaslt")
    heuristic = lt.matmul_algo_get_heuristic

    def no_dgelu_bgrad(handle, desc, *rest):
        epilogue, written = np.zeros(1, np.uint32), np.zeros(1, np.uint64)
        lt.matmul_desc_get_attribute(desc, lt.MatmulDescAttribute.EPILOGUE, epilogue.ctypes.data, 4, written.ctypes.data)
        if epilogue[0] == lt.Epilogue.DGELU_BGRAD:
            raise lt.cuBLASLtError(lt.Status.NOT_SUPPORTED)
        return heuristic(handle, desc, *rest)
    monkeypatch.setattr(lt, "matmul_algo_get_heuristic", no_dgelu_bgrad)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("level,refused", [(1, False), (0, False), (2, False), (2, True)])
def test_bias_gradient_levels_match_gpt2_cpu(emulated_gpu, monkeypatch, precision, level, refused):
    """--bias-grad-epilogue: 1 (default) every bias gradient in its dweight product's BGRADB, no
    bias_backward; 0 plain dweight products (no BGRADB, though the emulated cuBLASLt has it) and
    bias_backward for each of a layer's 4 biases; 2 as 0, but the fc's bias gradient summed by the
    fcproj input gradient's DGELU_BGRAD (3 bias_backward a layer), or, where cuBLASLt refuses
    DGELU_BGRAD, its DGELU and bias_backward on dfch (4 again). Each matches gpt2_cpu.py."""
    from llmc import cublaslt
    epilogues = _recorded_epilogues(monkeypatch)
    if refused:
        _refuse_dgelu_bgrad(monkeypatch)
    calls, launches, _ = _checked_against_gpt2_cpu(
        monkeypatch, precision, llmc.matmul.CublasLt(bias_grad_epilogue=level), bgrad=True, seed=4)
    L = TINY.num_layers
    backwards = sum(1 for c in calls if c[0] == "backward") // (4 * L + 1)         # the backward passes --check ran
    assert backwards >= 1
    bias_backward = [launch.name for launch in launches].count("bias_backward")
    # per layer: bias_backward launches, BGRADB, DGELU_BGRAD and DGELU products (a refused DGELU_BGRAD is
    # asked for, raises before anything runs, and the DGELU product follows)
    per_layer = {1: (0, 4, 0, 1), 0: (4, 0, 0, 1), 2: (4, 0, 1, 1) if refused else (3, 0, 1, 0)}[level]
    assert (bias_backward, epilogues.count("BGRADB"), epilogues.count("DGELU_BGRAD"),
            epilogues.count("DGELU")) == tuple(n * L * backwards for n in per_layer)
    cublaslt.clear_cache()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("backend,level", [("CublasLt", 1), ("CublasLt", 0), ("CublasLt", 2), ("Cublas", 0)])
def test_ln_bias_grad_sums_the_projection_biases_in_the_layernorm_backward(emulated_gpu, monkeypatch, precision,
                                                                            backend, level):
    """--ln-bias-grad 1: the attention and MLP projections' bias gradients come from the LayerNorm
    backward after each (ln2, and the next ln1 or lnf: dprojb), so of a layer's four biases only
    qkv's and fc's are summed where --bias-grad-epilogue says (level 1 BGRADB, 0 bias_backward, 2
    the fc's in DGELU_BGRAD; cuBLAS: bias_backward): matches gpt2_cpu.py, the projections' bias
    gradients included, which no other launch then writes."""
    from llmc import cublaslt
    epilogues = _recorded_epilogues(monkeypatch)
    matmul = llmc.matmul.CublasLt(bias_grad_epilogue=level) if backend == "CublasLt" else llmc.matmul.Cublas()
    calls, launches, _ = _checked_against_gpt2_cpu(monkeypatch, precision, matmul, bgrad=True, seed=5,
                                                   ln_bias_grad=True)
    L = TINY.num_layers
    names = [launch.name for launch in launches]
    backwards = names.count("encoder_backward_wpe")                 # the backward passes --check ran
    assert backwards >= 1
    assert names.count("layernorm_backward") == (2 * L + 1) * backwards
    # per layer: bias_backward launches, BGRADB and DGELU_BGRAD products
    per_layer = {("CublasLt", 1): (0, 2, 0), ("CublasLt", 0): (2, 0, 0), ("CublasLt", 2): (1, 0, 1),
                 ("Cublas", 0): (2, 0, 0)}[backend, level]
    assert (names.count("bias_backward"), epilogues.count("BGRADB"),
            epilogues.count("DGELU_BGRAD")) == tuple(n * L * backwards for n in per_layer)
    cublaslt.clear_cache()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("level", [1, 2])
def test_the_first_micro_batch_writes_the_bias_gradients_in_the_epilogue(emulated_gpu, monkeypatch, precision, level):
    """gpt2_micro_batch(first=True) zeroes the gradients, so BGRADB (and at level 2 DGELU_BGRAD)
    writes each bias gradient into dbias itself: none of the accumulate launches (residual_forward
    on the bias) of the later micro-batches, and bit for bit the gradients of the accumulating path
    (zero_grad, then a micro-batch that adds), after the first micro-batch and after a second."""
    import gpt2_cpu
    from llmc import cublaslt
    _emulated_cublaslt(monkeypatch, [], bgrad=True)
    launches = record_launches(monkeypatch)
    rng = np.random.default_rng(6)
    batches = [tuple(rng.integers(0, TINY.vocab_size, (2, 8)).astype(np.int32) for _ in range(2)) for _ in range(2)]
    accumulates = {1: 4, 2: 1}[level] * TINY.num_layers           # the bias gradients an epilogue sums, per pass
    grads, counts = {}, {}
    for writes in (True, False):
        model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, recompute=False,
                               matmul=llmc.matmul.CublasLt(bias_grad_epilogue=level))
        gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(TINY, 42).params)
        if not writes:
            gpt2_cuda.gpt2_zero_grad(model)
        for i, (x, y) in enumerate(batches):
            del launches[:]
            gpt2_cuda.gpt2_micro_batch(model, x, y, 0.5, first=writes and i == 0)
            grads[writes, i] = emulated_gpu.asnumpy(model.grads).copy()
            counts[writes, i] = [launch.name for launch in launches].count("residual_forward")
    assert counts == {(True, 0): 0, (True, 1): accumulates, (False, 0): accumulates, (False, 1): accumulates}
    for i in range(2):
        assert np.array_equal(grads[True, i], grads[False, i]), f"micro-batch {i}"
    assert np.any(grads[True, 1] != grads[True, 0])                # the second micro-batch added to them
    cublaslt.clear_cache()


@pytest.mark.parametrize("backend", ["Cublas", "CublasLt"])
def test_a_backward_through_gelu_also_sums_the_pre_gelu_bias_gradient(emulated_gpu, backend):
    """backward(..., pre_gelu=, pre_gelu_dbias=): dinp is the gradient of pre_gelu, and
    pre_gelu_dbias (the fc layer's bias gradient) accumulates its column sums, on either backend
    (CublasLt with level 2: DGELU_BGRAD; Cublas: bias_backward), against NumPy in fp32."""
    import gpt2_cpu
    cp, rng = emulated_gpu, np.random.default_rng(10)
    B, T, C, OC = 2, 5, 24, 16
    pre, w, dout = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)), rng.standard_normal((B, T, OC))
    dfcb0 = rng.standard_normal(C)
    f32 = lambda a: cp.asarray(np.ascontiguousarray(a, dtype=np.float32))             # noqa: E731
    dinp, dfcb = cp.zeros((B, T, C), np.float32), f32(dfcb0)
    partial = cp.zeros(gpt2_cuda.partial_floats(gpt2_cpu.GPT2Config(channels=C)), np.float32)
    matmul = llmc.matmul.Cublas() if backend == "Cublas" else llmc.matmul.CublasLt(bias_grad_epilogue=2)
    dw = cp.zeros((OC, C), np.float32)
    matmul.backward(dinp, dw, None, f32(dout), f32(gpt2_cpu.gelu_forward(pre)), f32(w), partial, B, T, C, OC,
                    pre_gelu=f32(pre), pre_gelu_dbias=dfcb)
    ref_dinp = gpt2_cpu.gelu_backward(dout @ w, pre)
    np.testing.assert_allclose(cp.asnumpy(dinp), ref_dinp, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cp.asnumpy(dfcb), dfcb0 + ref_dinp.sum(axis=(0, 1)), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pre_gelu_dbias without pre_gelu"):
        matmul.backward(dinp, dw, None, f32(dout), f32(pre), f32(w), partial, B, T, C, OC, pre_gelu_dbias=dfcb)
    from llmc import cublaslt
    cublaslt.clear_cache()


def test_cublaslt_flag_falls_back_with_one_line(monkeypatch, capsys):
    fake = types.SimpleNamespace(unavailable_reason=lambda: "nvmath-python is not installed")
    monkeypatch.setattr(llmc, "cublaslt", fake, raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", fake)
    monkeypatch.setattr(gpt2_cuda, "GPT2", lambda *a, **k: types.SimpleNamespace(matmul=k["matmul"]))
    monkeypatch.setattr(gpt2_cuda, "upload_parameters", lambda *a: None)
    lines = []
    model = gpt2_cuda.setup_model(gpt2_cuda.parse_args(["-e", "d2", "--cublaslt", "1", "--attention", "naive"]), 90,
                                   say=lines.append)
    assert lines == ["gpt2_cuda.py: cuBLASLt unavailable (nvmath-python is not installed): using cuBLAS"]
    assert type(model.matmul) is llmc.matmul.Cublas


@pytest.mark.parametrize("device, flag, available, expected, line", [
    ("cuda", "auto", True, "CublasLt", None),        # the default on a GPU: the faster backend measured
    ("cuda", "auto", False, "Cublas", "cuBLASLt unavailable (no nvmath): using cuBLAS"),
    ("cpu", "auto", True, "Cublas", None),           # the emulated device: our readable kernels
    ("cuda", "0", True, "Cublas", None),
    ("cpu", "1", True, "CublasLt", None)])
def test_cublaslt_flag_auto_0_1(monkeypatch, device, flag, available, expected, line):
    fake = types.SimpleNamespace(unavailable_reason=lambda: None if available else "no nvmath")
    monkeypatch.setattr(llmc, "cublaslt", fake, raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", fake)
    monkeypatch.setattr(llmc.cuda, "_device", device)
    args = gpt2_cuda.parse_args(["-e", "d2", "--cublaslt", flag] + (["--device", "cpu"] if device == "cpu" else []))
    matmul, said = llmc.matmul.matmul_backend(args.cublaslt, tf32=False)
    assert type(matmul).__name__ == expected and said == line
    assert gpt2_cuda.parse_args([]).cublaslt == "auto"


def test_library_options_reach_the_backend_the_attention_and_the_banner(monkeypatch):
    fake = types.SimpleNamespace(unavailable_reason=lambda: None)
    monkeypatch.setattr(llmc, "cublaslt", fake, raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", fake)
    built = {}
    monkeypatch.setattr(gpt2_cuda, "GPT2", lambda *a, **k: built.update(k) or types.SimpleNamespace(matmul=k["matmul"]))
    monkeypatch.setattr(gpt2_cuda, "upload_parameters", lambda *a: None)
    args = gpt2_cuda.parse_args(["--device", "cpu", "-e", "d2", "--cublaslt", "1", "--autotune", "4", "-ge", "1",
                                 "--attention", "naive", "--cudnn-deterministic", "0", "--bias-grad-epilogue", "0",
                                 "--ln-bias-grad", "1"])
    said = []
    gpt2_cuda.setup_model(args, 80, say=said.append)
    assert said == ["gpt2_cuda.py: --cudnn-deterministic 0 applies to cuDNN attention; this run has naive attention"]
    matmul = built["matmul"]
    assert (matmul.autotune, matmul.gelu_fusion, built["autotune"], built["cudnn_deterministic"]) == (4, 1, 4, False)
    assert matmul.bias_grad_epilogue == 0 and built["ln_bias_grad"] is True
    banner = llmc.gpu_cli.library_options
    assert banner(types.SimpleNamespace(matmul=matmul, attention=llmc.attention.attention_path("naive"))) == \
        " (autotune 4) (GELU fusion 1) (bias gradients by bias_backward)"
    assert banner(types.SimpleNamespace(matmul=llmc.matmul.CublasLt(), ln_bias_grad=True,
                                        attention=llmc.attention.attention_path("naive"))) == \
        " (projection bias gradients by layernorm_backward)"
    cudnn = llmc.attention.attention_path("cudnn")
    cudnn.autotune = 3                                                   # cuDNN's plans tuned, cuBLAS matmuls
    assert banner(types.SimpleNamespace(matmul=llmc.matmul.Cublas(), attention=cudnn)) == " (autotune 3)"
    cudnn.deterministic = False
    assert banner(types.SimpleNamespace(matmul=llmc.matmul.Cublas(), attention=cudnn)) == \
        " (autotune 3) (non-deterministic cuDNN backward)"
    defaults = gpt2_cuda.parse_args([])
    assert (defaults.autotune, defaults.gelu_fusion, defaults.bias_grad_epilogue, defaults.ln_bias_grad) == (1, 2, 1, 0)
    for matmul in (llmc.matmul.CublasLt(), llmc.matmul.Cublas()):
        assert banner(types.SimpleNamespace(matmul=matmul, attention=llmc.attention.attention_path("cudnn"))) == ""


@pytest.mark.parametrize("flags", [["--autotune", "0"], ["--autotune", "17"], ["-ge", "3"], ["--bias-grad-epilogue", "3"],
                                   ["--ln-bias-grad", "2"]])
def test_cublaslt_options_refuse_other_values_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpt2_cuda.parse_args(flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code != 0 and flags[0] in err[-1] and "invalid choice" in err[-1]


def test_cublaslt_flag_refuses_other_values_in_one_line():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "gpt2_cuda.py"), "--cublaslt", "2"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--cublaslt" in r.stderr and "choose from auto, 0, 1" in r.stderr


def test_bias_grad_epilogue_2_needs_the_dgelu_epilogue_and_says_so(monkeypatch):
    """--bias-grad-epilogue 2 rides in the DGELU epilogue: with -ge 2 the backend sums the fc's
    bias gradient there (pre_gelu_bias_grad) and the banner says so; with -ge 1 one line says
    that bias_backward sums it, as with 0."""
    fake = types.SimpleNamespace(unavailable_reason=lambda: None)
    monkeypatch.setattr(llmc, "cublaslt", fake, raising=False)
    monkeypatch.setitem(sys.modules, "llmc.cublaslt", fake)
    monkeypatch.setattr(gpt2_cuda, "GPT2", lambda *a, **k: types.SimpleNamespace(matmul=k["matmul"]))
    monkeypatch.setattr(gpt2_cuda, "upload_parameters", lambda *a: None)
    banner = llmc.gpu_cli.library_options
    naive = llmc.attention.attention_path("naive")
    for ge, fused, said in (("2", True, []), ("1", False, [
            "gpt2_cuda.py: --bias-grad-epilogue 2 sums the fc's bias gradient in the DGELU epilogue, which -ge 1 "
            "leaves out: bias_backward sums it, as with 0"])):
        lines = []
        args = gpt2_cuda.parse_args(["--device", "cpu", "-e", "d2", "--cublaslt", "1", "--attention", "naive",
                                     "--bias-grad-epilogue", "2", "-ge", ge])
        model = gpt2_cuda.setup_model(args, 80, say=lines.append)
        assert (model.matmul.pre_gelu_bias_grad, lines) == (fused, said)
        assert banner(types.SimpleNamespace(matmul=model.matmul, attention=naive)).endswith(
            " (bias gradients by bias_backward, the fc's in DGELU_BGRAD)" if fused else " (bias gradients by bias_backward)")
    assert not llmc.matmul.Cublas.pre_gelu_bias_grad and not llmc.matmul.CublasLt().pre_gelu_bias_grad


def test_library_options_that_reach_no_library_say_so(monkeypatch):
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")                         # auto: cuBLAS and naive attention
    monkeypatch.setattr(gpt2_cuda, "GPT2", lambda *a, **k: types.SimpleNamespace(matmul=k["matmul"]))
    monkeypatch.setattr(gpt2_cuda, "upload_parameters", lambda *a: None)
    lines = []
    args = gpt2_cuda.parse_args(["--device", "cpu", "-e", "d2", "--autotune", "4", "-ge", "0", "--cudnn-deterministic",
                                 "0", "--bias-grad-epilogue", "0"])          # the emulated device: cuBLAS, naive
    gpt2_cuda.setup_model(args, 80, say=lines.append)
    assert lines == ["gpt2_cuda.py: --autotune 4 has nothing to tune here (it times cuBLASLt's algorithms and cuDNN "
                     "attention's plans: this run has cuBLAS matmuls and naive attention)",
                     "gpt2_cuda.py: -ge 0 applies to cuBLASLt's epilogues; with cuBLAS the GELU is our kernel's",
                     "gpt2_cuda.py: --bias-grad-epilogue 0 applies to cuBLASLt's epilogues; with cuBLAS the bias "
                     "gradients are bias_backward's already",
                     "gpt2_cuda.py: --cudnn-deterministic 0 applies to cuDNN attention; this run has naive attention"]
    lines.clear()
    gpt2_cuda.setup_model(gpt2_cuda.parse_args(["--device", "cpu", "-e", "d2"]), 80, say=lines.append)
    assert lines == []                                                        # the defaults say nothing
