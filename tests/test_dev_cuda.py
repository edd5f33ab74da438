"""Tests of dev/cuda/: the kernel progressions and their harness (dev/cuda/common.py).

No GPU needed:
- every dev/cuda/*.cu compiles with NVRTC (dev/cuda/nvrtc_compile.py's functions, the trainer's
  options) in both precisions for compute_80/compute_90 (PTX) and sm_80/sm_90 (cubin);
- every version of every op script names kernels that exist: the intermediate ones in the PTX of
  its dev/cuda/<op>.cu, the production version's (the last but any candidates) in kernels/<file>.cu,
  where it must be the kernel gpt2_cuda.py launches (tests/test_kernels_compile.py's contract);
- each op script takes its reference from gpt2_cpu (Llama 3's ops from llama3_cpu; imported, never
  redefined);
- the harness's host parts against hand-computed values: napkin bytes and FLOPs, throughput,
  tolerance choice, the table, bf16 round trips;
- every progression validates at its small test size, both precisions, every version and block
  size, on the emulated CUDA device (llmc/emulator/: the kernels of dev/cuda/*.cu and kernels/
  compiled by g++, each CUDA thread a fiber); the validation loop restores in-place inputs before
  every run and fails a version that leaves an element unwritten or swaps its arguments;
- every script says in one line that there is no GPU and exits 2, and --help works without one.
Marked gpu (skipped here): the same validations on a GPU, and a full run of one script writing its
table.
Run: pytest tests/test_dev_cuda.py   (about a minute on 2 cores once the emulated device's kernels
are built: NVRTC, and global_norm's 1024-block grids on the emulated device)
"""

import ast
import dataclasses
import functools
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

import gpt2_cpu
from llmc.check import TOLERANCES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV_CUDA = os.path.join(ROOT, "dev", "cuda")
sys.path.insert(0, DEV_CUDA)

import common  # noqa: E402  (dev/cuda/common.py)
from nvrtc_marks import needs_nvrtc  # noqa: E402


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(DEV_CUDA, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nc = _load("nvrtc_compile")
run_all = _load("run_all")
OPS = run_all.OPS
SCRIPTS = {op: _load(op) for op in OPS}
# this file's ops (part A of the progressions; matmul and attention have their own tests) and the
# gpt2_cpu layers each script must take its reference from
REFERENCES = {
    "encoder": ("encoder_forward", "encoder_backward"),
    "gelu": ("gelu_forward", "gelu_backward"),
    "bias": ("matmul_backward",),
    "layernorm": ("layernorm_forward", "layernorm_backward", "residual_forward"),
    "classifier": ("softmax_forward", "crossentropy_forward", "crossentropy_softmax_backward"),
    "adamw": ("adamw_update",),
    "global_norm": ("gpt2_grad_norm",),
}
PART_A = tuple(REFERENCES)
# Llama 3's ops, each with the llama3_cpu layers its script must take its reference from
LLAMA3_REFERENCES = {
    "rmsnorm": ("rmsnorm_forward", "rmsnorm_backward"),
    "rope": ("rope_forward", "rope_backward", "precompute_freqs_cis"),
    "repeat_kv": ("repeat_kv_forward", "repeat_kv_backward", "split_qkv", "merge_heads"),
    "swiglu": ("swiglu_forward", "swiglu_backward"),
}
LLAMA3 = tuple(LLAMA3_REFERENCES)
CHECKED = PART_A + LLAMA3
PRECISIONS = ("bf16", "fp32")




@functools.lru_cache(maxsize=None)
def ptx_entries(path, precision):
    """Kernel names in the compute_80 PTX of a repo-relative .cu path."""
    return frozenset(nc.ptx_entry_names(nc.compile_kernel(os.path.join(ROOT, path), precision, "compute_80")))


# ----------------------------------------------------------------------------
# compiling, and the version lists

def test_every_op_has_a_script_and_a_cu_file():
    assert set(CHECKED) <= set(OPS)             # make dev-cuda runs them all
    on_disk = {os.path.basename(p)[:-3] for p in nc.dev_kernel_files()}
    assert set(OPS) <= on_disk


@needs_nvrtc
@pytest.mark.parametrize("arch", nc.PTX_ARCHS + nc.CUBIN_ARCHS)
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("path", nc.dev_kernel_files(), ids=os.path.basename)
def test_dev_kernels_compile(path, precision, arch):
    result = nc.compile_kernel(path, precision, arch)
    if arch.startswith("sm_"):
        assert result[:4] == b"\x7fELF"
    else:
        assert nc.ptx_entry_names(result), f"{path}: no extern \"C\" kernel"
        assert f".target sm_{arch.split('_')[1]}" in result


@needs_nvrtc
@pytest.mark.parametrize("op", CHECKED)
def test_versions_name_existing_kernels(op):
    for index, progression in enumerate(SCRIPTS[op].PROGRESSIONS):
        # kernels an earlier progression of the op introduced, which a later one may launch another way
        # (layernorm_backward_projection_bias: layernorm_backward's, with a third sum)
        earlier = {k for p in SCRIPTS[op].PROGRESSIONS[:index] for v in p.versions for k in v.kernels}
        numbers = [v.number for v in progression.versions]
        assert numbers == list(range(1, len(numbers) + 1)), progression.name
        production = common.production_version(progression)
        candidates = progression.versions[progression.versions.index(production) + 1:]
        assert all(common.is_candidate(v) for v in candidates), progression.name    # only candidates after it
        assert 2 <= len(numbers) - len(candidates) <= 4 and len(candidates) <= 2    # short; candidates pass
        for version in progression.versions:
            for kernel in version.kernels:
                for precision in PRECISIONS:
                    assert kernel.name in ptx_entries(kernel.path, precision), (progression.name, kernel)
            own = [k for k in version.kernels if k.path == f"dev/cuda/{op}.cu"]
            if version is production:   # the production kernel, by its real name, from kernels/
                assert all(k.path.startswith("kernels/") for k in version.kernels), progression.name
                assert "production" in version.about
            else:              # an intermediate one or a candidate: <name>_v<number> in dev/cuda/<op>.cu, or
                               # production kernels on another plan (encoder_backward 2: one chunk per token)
                assert own or all(k.path.startswith("kernels/") for k in version.kernels), (progression.name, version)
                # its own kernels end in _v<its number>, or in an earlier version's that it reuses
                # (bias 3 keeps version 2's bias_reduce_v2)
                introduced = {f"_v{v.number}": [k.name for k in v.kernels] for v in progression.versions}
                assert all(k.name.endswith(f"_v{version.number}") or k in earlier or any(
                    k.name.endswith(suffix) and k.name in introduced[suffix]
                    for suffix in (f"_v{m}" for m in range(1, version.number))) for k in own), (progression.name, version)
                assert not common.is_candidate(version) or own, (progression.name, version)   # a kernel of its own


def test_drop_in_candidates_match_the_production_kernels_one_for_one():
    """A candidate marked drop_in (dev/bench.py --candidate launches it in the trainer's place) has as
    many kernels as its production version, and each that differs is a dev/cuda kernel of its own op in
    the position of the production kernel it replaces. Today: the classifier's 4 and 5, layernorm's 5
    and 6, bias's 5."""
    drop_ins = []
    for op in CHECKED:
        for progression in SCRIPTS[op].PROGRESSIONS:
            production = common.production_version(progression)
            for version in progression.versions:
                if not version.drop_in:
                    continue
                assert common.is_candidate(version), (progression.name, version.number)
                assert len(version.kernels) == len(production.kernels), (progression.name, version.number)
                changed = [(ours, theirs) for ours, theirs in zip(production.kernels, version.kernels) if ours != theirs]
                assert changed and all(theirs.path == f"dev/cuda/{op}.cu" and ours.path.startswith("kernels/")
                                       for ours, theirs in changed), (progression.name, version.number)
                drop_ins.append(f"{op}:{version.number}")
    assert sorted(drop_ins) == ["bias:5", "classifier:4", "classifier:5", "layernorm:5", "layernorm:6"]


def test_last_versions_are_the_kernels_gpt2_cuda_launches():
    source = "".join(open(os.path.join(ROOT, path), encoding="utf-8").read()     # the launchers' files
                     for path in ("gpt2_cuda.py", "llmc/attention.py", "llmc/matmul.py", "llmc/cublaslt.py",
                                  "llama3_cuda.py"))
    for op in CHECKED:
        for progression in SCRIPTS[op].PROGRESSIONS:
            for kernel in common.production_version(progression).kernels:
                file = os.path.basename(kernel.path)[:-3]
                assert f'"{file}"' in source and f'"{kernel.name}"' in source, kernel


@pytest.mark.parametrize("op", PART_A)
def test_reference_comes_from_gpt2_cpu(op):
    module = SCRIPTS[op]
    assert module.gpt2_cpu is gpt2_cpu
    source = open(os.path.join(DEV_CUDA, f"{op}.py"), encoding="utf-8").read()
    defined = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    for name in REFERENCES[op]:
        assert f"gpt2_cpu.{name}(" in source, f"{op}.py does not call gpt2_cpu.{name}"
        assert name not in defined, f"{op}.py redefines gpt2_cpu.{name}"


@pytest.mark.parametrize("op", LLAMA3)
def test_reference_comes_from_llama3_cpu(op):
    import llama3_cpu
    module = SCRIPTS[op]
    assert module.llama3_cpu is llama3_cpu
    source = open(os.path.join(DEV_CUDA, f"{op}.py"), encoding="utf-8").read()
    defined = {node.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    for name in LLAMA3_REFERENCES[op]:
        assert f"llama3_cpu.{name}(" in source, f"{op}.py does not call llama3_cpu.{name}"
        assert name not in defined, f"{op}.py redefines llama3_cpu.{name}"


@pytest.mark.parametrize("op", CHECKED)
def test_docstring_lists_every_version_and_the_run_line(op):
    doc = SCRIPTS[op].__doc__
    assert f"python dev/cuda/{op}.py" in doc
    for progression in SCRIPTS[op].PROGRESSIONS:
        for version in progression.versions:
            assert f"version {version.number} (" in doc, (op, version.number)


# ----------------------------------------------------------------------------
# the harness's host parts

def test_napkin_bytes_and_flops():
    # gelu forward, n = 1000: read + write n floatX
    assert common.napkin_bytes("bf16", floatX=2000) == 4000
    assert common.napkin_bytes("fp32", floatX=2000) == 8000
    # layernorm forward N=2, C=4: 2*8 + 2*4 floatX, 2*2 floats
    assert common.napkin_bytes("bf16", floatX=24, float32=4) == 48 + 16
    assert common.napkin_bytes("fp32", floatX=1, float32=1, int32=1) == 12
    assert common.gemm_flops(2, 3, 4) == 48
    assert common.gemm_flops(8192, 8192, 8192) == 2 * 8192 ** 3
    assert common.throughput(3e9, 1.5) == pytest.approx(2000.0)      # 3 GB in 1.5 ms = 2000 GB/s


def test_case_byte_counts_by_hand():
    rng = np.random.default_rng(0)
    gelu = SCRIPTS["gelu"].PROGRESSIONS
    assert gelu[0].make_case(rng, "bf16", B=1, T=3, C=37).bytes == 2 * 444 * 2      # n = 4*37*3
    assert gelu[1].make_case(rng, "fp32", B=1, T=3, C=37).bytes == 3 * 444 * 4
    adamw = SCRIPTS["adamw"].PROGRESSIONS[0]
    assert adamw.make_case(rng, "bf16", n=10).bytes == 10 * (3 * 2 + 4 * 4)
    norm = SCRIPTS["global_norm"].PROGRESSIONS[0]
    assert norm.make_case(rng, "fp32", n=10).bytes == 40


def test_tolerance_choice():
    assert common.tolerance("gelu", "bf16") == TOLERANCES["kernel_bf16"]["gelu"]
    assert common.tolerance("layernorm_forward", "fp32") == TOLERANCES["kernel_fp32"]["layernorm_forward"]
    atol, rtol = common.tolerance("classifier", "bf16", scale=0.25)
    assert (atol, rtol) == (TOLERANCES["kernel_bf16"]["classifier"][0] * 0.25, TOLERANCES["kernel_bf16"]["classifier"][1])
    with pytest.raises(KeyError):
        common.tolerance("gelu", "fp16")


def test_format_table_by_hand():
    timings = [common.Timing(1, "gelu_forward_v1", 128, 2.0), common.Timing(2, "gelu_forward", 256, 0.5)]
    text = common.format_table("gelu_forward [bf16]", timings, bytes_moved=4e9, bandwidth_gbs=3200.0)
    lines = text.splitlines()
    assert lines[0] == "### gelu_forward [bf16]"
    assert lines[2] == "| version | kernel | block | time (ms) | GB/s | % of copy BW |"
    # 4e9 bytes in 2 ms = 2000 GB/s = 62.5% of 3200; in 0.5 ms = 8000 GB/s = 250%
    assert lines[4] == "| 1 | gelu_forward_v1 | 128 | 2.0000 | 2000.0 | 62.5 |"
    assert lines[5] == "| 2 | gelu_forward | 256 | 0.5000 | 8000.0 | 250.0 |"
    with_flops = common.format_table("mm", timings[:1], 4e9, 3200.0, flops=1e12, gemm_tflops=1000.0)
    # 1e12 FLOP in 2 ms = 500 TFLOP/s = 50% of 1000
    assert with_flops.splitlines()[-1] == "| 1 | gelu_forward_v1 | 128 | 2.0000 | 2000.0 | 62.5 | 500.00 | 50.0 |"


def test_bf16_round_trip_is_what_the_kernel_sees():
    x = np.array([1.0, 1.0 + 2 ** -9, -3.14159, 1e-3])
    bits = common.to_device_dtype(x, "X", "bf16")
    assert bits.dtype == np.uint16
    seen = common.to_float64(bits, "X", "bf16")
    assert seen[0] == 1.0 and seen[1] == 1.0                       # halfway: rounds to even
    assert np.all(np.abs(seen - x) <= np.abs(x) * 2 ** -9)
    assert common.to_device_dtype(x, "X", "fp32").dtype == np.float32
    assert common.to_device_dtype([1, 2], "i32", "bf16").dtype == np.int32


@pytest.mark.parametrize("op", CHECKED)
def test_test_cases_are_consistent(op):
    # every check names an array of the case, and its reference is finite with the array's size
    for progression in SCRIPTS[op].PROGRESSIONS:
        for precision in PRECISIONS:
            case = progression.make_case(np.random.default_rng(1), precision, **progression.test_sizes)
            assert case.bytes > 0 and case.checks
            for name, ref, key, _ in case.checks:
                assert key in TOLERANCES[f"kernel_{precision}"]
                size = case.inputs[name][0].size if name in case.inputs else int(np.prod(case.outputs[name][0]))
                assert ref.size == size and np.all(np.isfinite(ref)), (progression.name, name)


# ----------------------------------------------------------------------------
# the validation loop, on the emulated CUDA device (llmc/emulator/): the real kernels, compiled by g++

@pytest.fixture
def emulated(monkeypatch):
    """llmc.cuda (and so the harness) on the emulated device."""
    monkeypatch.setattr(common.cuda, "_device", "cpu")


def _gelu(name):
    return next(p for p in SCRIPTS["gelu"].PROGRESSIONS if p.name == name)


def _only(progression, *versions):
    """The progression with only these versions."""
    return common.Progression(progression.name, progression.make_case, list(versions), progression.sizes,
                              progression.test_sizes)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_validation_accepts_a_correct_version_and_restores_inputs(emulated, monkeypatch, precision, capsys):
    # gelu_backward runs in place on d_in_out: without the inputs restored before each run, the
    # second block size would start from the first one's output (shown below by a reset that
    # restores them only once)
    backward = _gelu("gelu_backward")
    production = dataclasses.replace(backward.versions[-1], block_sizes=(32, 64, 128))
    assert common.validate(_only(backward, production), precision, backward.test_sizes)
    out = capsys.readouterr().out
    assert out.count(": OK") == 3 and "gelu_backward v2 block   64: OK" in out
    reset, resets = common.reset, []

    def restore_once(case, d):
        if not resets:
            reset(case, d)
        resets.append(case)
    monkeypatch.setattr(common, "reset", restore_once)
    assert not common.validate(_only(backward, production), precision, backward.test_sizes)
    assert "gelu_backward v2 block   64 d_in_out: TENSOR NOT OK" in capsys.readouterr().out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_validation_catches_unwritten_and_wrong_elements(emulated, precision, capsys):
    forward, backward = _gelu("gelu_forward"), _gelu("gelu_backward")
    n = backward.make_case(np.random.default_rng(0), precision, **backward.test_sizes).scalars["n"]

    def forgets_the_last(d, block_size):               # the grid one element short: it stays NaN
        kernel = forward.versions[0].kernels[0]
        kernel.launch(d.precision, common.cuda.ceil_div(d.n - 1, block_size), block_size,
                      (d.out, d.inp, np.int32(d.n - 1)))

    def swaps_its_arguments(d, block_size):            # gelu'(dout) * inp, written into inp
        kernel = backward.versions[0].kernels[0]
        kernel.launch(d.precision, common.cuda.ceil_div(d.n, block_size), block_size,
                      (d.inp, d.d_in_out, np.int32(d.n)))
    assert not common.validate(_only(forward, common.Version(1, "misses one", (), forgets_the_last, (32,))),
                               precision, forward.test_sizes)
    assert f"gelu_forward v1 block   32 out: TENSOR NOT OK (1 of {n}" in capsys.readouterr().out
    assert not common.validate(_only(backward, common.Version(1, "swapped", (), swaps_its_arguments, (32,))),
                               precision, backward.test_sizes)
    assert "gelu_backward v1 block   32 d_in_out: TENSOR NOT OK" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# the command line without a GPU

def _run(script, *args):
    return subprocess.run([sys.executable, os.path.join(DEV_CUDA, script), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


no_gpu_only = pytest.mark.skipif(common.cuda.cuda_unavailable_reason() is None, reason="a CUDA GPU is present")


@no_gpu_only
@pytest.mark.parametrize("script", [f"{op}.py" for op in CHECKED] + ["run_all.py"])
def test_no_gpu_is_one_line_and_exit_2(script):
    r = _run(script)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dev/cuda/{script}: no CUDA GPU found (")


def test_help_and_a_bad_version_need_no_gpu():
    r = _run("layernorm.py", "--help")
    assert r.returncode == 0
    assert "version 4 of layernorm_backward: production" in r.stdout
    r = _run("gelu.py", "7")
    assert r.returncode == 1
    assert r.stderr.strip() == "dev/cuda/gelu.py: no version 7 (versions: [1, 2])"


# ----------------------------------------------------------------------------
# every progression validated at its small test size: on the emulated device, and on a GPU

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", [p.name for op in CHECKED for p in SCRIPTS[op].PROGRESSIONS])
def test_progression_validates(monkeypatch, name, precision, device):
    monkeypatch.setattr(common.cuda, "_device", device)
    progression = next(p for op in CHECKED for p in SCRIPTS[op].PROGRESSIONS if p.name == name)
    assert common.validate(progression, precision, progression.test_sizes)


def test_classifier_candidate_4_is_version_3_bit_for_bit(emulated):
    """fused_classifier_v4 (a thread's loads 4 at a time before it uses them) at GPT-2's vocabulary on
    three rows: losses and dlogits equal to version 3's bit for bit (the same state updates in the same
    order), and both right against gpt2_cpu.py, at 32 threads (197 groups a thread: 49 rounds of 4 and
    one of 1) and 1024 (6 or 7 groups: one full round and one partial)."""
    progression = SCRIPTS["classifier"].PROGRESSIONS[0]
    v3, v4 = (next(v for v in progression.versions if v.number == n) for n in (3, 4))
    for precision in PRECISIONS:
        case = progression.make_case(np.random.default_rng(5), precision, B=1, T=3, V=50257, Vp=50304)
        d = common.allocate(case)
        for block_size in (32, 1024):
            results = []
            for version in (v3, v4):
                common.reset(case, d)
                version.launch(d, block_size)
                assert common.check_case(case, d, f"v{version.number} {precision} block {block_size}")
                results.append((d.logits.get(), d.losses.get()))
            assert all(np.array_equal(a, b) for a, b in zip(*results)), (precision, block_size)


def test_classifier_candidate_5_holds_the_row_in_registers(emulated):
    """fused_classifier_v5 at GPT-2's vocabulary (V = 50257, Vp = 50304) on three rows, against gpt2_cpu.py
    and within a few units of bf16's last place of version 3's dlogits (the max and sum are taken in
    another order): in bf16 at 1024 threads the row is one tile of 7 groups a thread (the trainer's case),
    at 256 threads 4 tiles (three read again in the gradient pass), in fp32 at 1024 threads 2 tiles; and
    a row of one tile with a padded tail, V = 1000 of Vp = 1024 at 32 threads (7 x 8 x 32 = 1792 columns
    in bf16, 896 in fp32: 2 tiles). Without a GPU the emulated device fills the outputs with NaN first,
    so a column left unwritten fails the check."""
    progression = SCRIPTS["classifier"].PROGRESSIONS[0]
    v3, v5 = (next(v for v in progression.versions if v.number == n) for n in (3, 5))
    for precision, sizes, block_sizes in (
            ("bf16", dict(B=1, T=3, V=50257, Vp=50304), (1024, 256)),
            ("fp32", dict(B=1, T=3, V=50257, Vp=50304), (1024,)),
            ("bf16", dict(B=2, T=3, V=1000, Vp=1024), (32,)),
            ("fp32", dict(B=2, T=3, V=1000, Vp=1024), (32,))):
        case = progression.make_case(np.random.default_rng(9), precision, **sizes)
        d = common.allocate(case)
        for block_size in block_sizes:
            results = []
            for version in (v3, v5):
                common.reset(case, d)
                version.launch(d, block_size)
                assert common.check_case(case, d, f"v{version.number} {precision} block {block_size}")
                results.append((common.to_float64(d.logits.get(), "X", precision), d.losses.get()))
            (dlogits3, losses3), (dlogits5, losses5) = results
            np.testing.assert_allclose(losses5, losses3, rtol=1e-5, atol=1e-5)
            dloss = 1.0 / (sizes["B"] * sizes["T"])
            assert np.max(np.abs(dlogits5 - dlogits3)) <= (1e-2 if precision == "bf16" else 1e-5) * dloss
            assert np.all(dlogits5[..., sizes["V"]:] == 0)                 # the padded columns


@pytest.mark.parametrize("shape", ["test", "mlp"])
def test_bias_candidate_5_is_version_4_bit_for_bit(emulated, shape):
    """bias_backward_v5 (a lane's rows loaded 4 at a time before they are added) gives the production
    version 4's dbias bit for bit (the same adds in the same order), both right against gpt2_cpu.py: at
    the test size (N = 3003: 12 rows a chunk, 3 rounds of 4 for the one warp of a 32-thread block, a
    partial round for 8 warps; the sanitizers run this one) and at the MLP's OC = 3072 with 32 rows a
    chunk, in both precisions."""
    progression = SCRIPTS["bias"].PROGRESSIONS[0]
    v4, v5 = (next(v for v in progression.versions if v.number == n) for n in (4, 5))
    for precision in PRECISIONS:
        for sizes in [progression.test_sizes if shape == "test" else dict(N=8192, OC=3072)]:
            case = progression.make_case(np.random.default_rng(11), precision, **sizes)
            d = common.allocate(case)
            for block_size in (32, 256):
                results = []
                for version in (v4, v5):
                    common.reset(case, d)
                    version.launch(d, block_size)
                    assert common.check_case(case, d, f"v{version.number} {precision} {sizes} block {block_size}")
                    results.append(d.dbias.get())
                assert np.array_equal(*results), (precision, sizes, block_size)


# layernorm_backward's two progressions: (production, candidates 5 and 6) as each numbers them
LAYERNORM_BACKWARDS = {"layernorm_backward": (4, 5, 6), "layernorm_backward_projection_bias": (2, 3, 4)}


@pytest.mark.parametrize("name", LAYERNORM_BACKWARDS)
@pytest.mark.parametrize("C", [96, 768])
def test_layernorm_candidates_over_many_rows_a_block(emulated, C, name):
    """layernorm_backward's candidates 5 and 6 (the reduce with 8 sums in flight; the partial sums by
    row phases) where a block owns several rows: N = 1200 rows over G = 512 slots (3 rows a block,
    the last blocks empty), at C = 96 (12 groups of 8 bf16, 42 row phases at 512 threads) and GPT-2's
    768 (96 groups: 5 phases at 512 threads; at 32 threads 3 passes of 32 groups, one phase), every
    block size, against gpt2_cpu.py; and their sums against version 4's (the production kernels), which
    add the same values in another order: equal to within the last bits, not bitwise. The same with
    the third sum, dinp's columns into dprojb (--ln-bias-grad)."""
    progression = next(p for p in SCRIPTS["layernorm"].PROGRESSIONS if p.name == name)
    production, *candidates = numbers = LAYERNORM_BACKWARDS[name]
    assert [v.number for v in progression.versions if common.is_candidate(v)] == candidates
    assert common.production_version(progression).number == production
    sums_names = ("dweight", "dbias") + (("dprojb",) if name.endswith("projection_bias") else ())
    for precision in PRECISIONS:
        case = progression.make_case(np.random.default_rng(7), precision, B=4, T=300, C=C)
        d = common.allocate(case)
        assert case.scalars["G"] == 512 and case.scalars["sums"] == len(sums_names)
        assert common.validate(progression, precision, None, versions=list(numbers), case=case, d=d)
        sums = {}
        for number in numbers:
            common.reset(case, d)
            next(v for v in progression.versions if v.number == number).launch(d, 512)
            sums[number] = [getattr(d, n).get() for n in sums_names + ("dinp",)]
        for number in candidates:
            for ours, theirs in zip(sums[production][:-1], sums[number][:-1]):
                decoded = [common.to_float64(x, "X", precision) for x in (ours, theirs)]
                np.testing.assert_allclose(decoded[1], decoded[0], rtol=1e-2 if precision == "bf16" else 1e-5,
                                           atol=1e-2 if precision == "bf16" else 1e-4)
            assert np.array_equal(sums[number][-1], sums[production][-1])   # dinp: the same code (layernorm.cuh)


@pytest.mark.parametrize("name", LAYERNORM_BACKWARDS)
def test_layernorm_candidate_6_under_the_sanitizers(emulated, name):
    """layernorm_backward_v6's row phases meeting in shared memory, small enough for the sanitizers
    (dev/sanitize_kernels.py runs this test under ThreadSanitizer, where a read of another thread's
    phase sum before the barrier is a report): 40 rows over G = 4 slots of 10 rows, C = 384 (48
    groups of 8 bf16: two passes of 32 groups at 32 threads; 10 phases of 48 at 512), against
    gpt2_cpu.py in both precisions. With the third sum (dinp's columns) version 4 too: its threads
    read the dinp rows other warps wrote, after the barrier."""
    progression = next(p for p in SCRIPTS["layernorm"].PROGRESSIONS if p.name == name)
    production, _, v6 = LAYERNORM_BACKWARDS[name]
    numbers = (v6,) if name == "layernorm_backward" else (production, v6)
    for precision in PRECISIONS:
        case = progression.make_case(np.random.default_rng(8), precision, B=1, T=40, C=384)
        case.scalars["G"] = 4                        # any G is correct; the launcher's is min(512, N)
        d = common.allocate(case)
        for number in numbers:
            version = next(v for v in progression.versions if v.number == number)
            for block_size in (32, 512):
                common.reset(case, d)
                version.launch(d, block_size)
                assert common.check_case(case, d, f"{name} v{number} {precision} block {block_size}")


# ----------------------------------------------------------------------------
# on a GPU: a full run of one script


@pytest.mark.gpu
def test_a_full_run_writes_its_table(tmp_path, monkeypatch):
    gelu = SCRIPTS["gelu"]
    for progression in gelu.PROGRESSIONS:                      # small problems, a quick run
        monkeypatch.setattr(progression, "sizes", dict(B=2, T=64, C=64))
    assert common.main("gelu", gelu.PROGRESSIONS, ["-r", "3", "-o", str(tmp_path)]) == 0
    text = (tmp_path / "dev_cuda_gelu.md").read_text()
    assert "- device: " in text and "CuPy" in text and "measured copy bandwidth" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 * 2 * len(common.BLOCK_SIZES)        # 2 progressions x 2 versions x block sizes
    for row in rows:
        ms, gbs = float(row.split("|")[4]), float(row.split("|")[5])
        assert ms > 0 and gbs > 0


def test_a_written_table_is_named_relative_to_the_repository_only_inside_it(tmp_path):
    """The first GPU session's tables went to $OUT (/root/out) and were announced as
    ../../root/out/dev_cuda_matmul.md; a path outside the repository is now printed whole."""
    inside = os.path.join(ROOT, "dev", "results", "dev_cuda_gelu.md")
    assert common.shown_path(inside) == os.path.join("dev", "results", "dev_cuda_gelu.md")
    outside = tmp_path / "out" / "dev_cuda_gelu.md"
    assert common.shown_path(str(outside)) == str(outside)
    assert common.shown_path(ROOT + "-other/x.md") == ROOT + "-other/x.md"   # a sibling with the same prefix


def test_run_all_sends_every_table_to_OUT_when_set(monkeypatch, tmp_path):
    """On the device machine only $OUT comes back: run_all passes -o $OUT (else dev/results, or -o's
    folder) with the precision and repeats to every op script, in OPS order, and exits 1 when one fails."""
    calls = []

    def fake_run(cmd, cwd):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1 if cmd[1].endswith("gelu.py") else 0)
    monkeypatch.setattr(run_all.cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert run_all.main(["-p", "fp32", "-r", "5"]) == 1
    assert [os.path.basename(c[1]) for c in calls] == [f"{op}.py" for op in OPS]
    assert all(c[2:] == ["-p", "fp32", "-o", str(tmp_path), "-r", "5"] for c in calls)
    calls.clear()
    monkeypatch.delenv("OUT")
    run_all.main([])
    assert calls[0][2:] == ["-p", "bf16", "-o", os.path.join(ROOT, "dev", "results")]
    calls.clear()
    run_all.main(["-o", "tables"])
    assert calls[0][2:] == ["-p", "bf16", "-o", "tables"]
    calls.clear()
    run_all.main(["rmsnorm", "attention"])                     # a cut-short run's remainder, in OPS order
    assert [os.path.basename(c[1]) for c in calls] == ["attention.py", "rmsnorm.py"]


def test_run_all_refuses_an_unknown_op_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_all.main(["attention", "softmax"])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no such op: softmax (the ops: encoder,") and err.count("\n") == 1
