"""Tests of gpt2_cuda.py: its host logic and its whole GPU orchestration on the emulated CUDA
device (llmc/emulator/: the real kernels/*.cu compiled by g++ and run on the CPU, cuBLAS, cuBLASLt
and cuDNN emulated with their contracts); then every kernel against gpt2_cpu.py, on a GPU and, at
the small shapes, on the emulated device.

Part 1, no GPU needed:
- host logic: MFU/FLOPs, the peak-FLOPS table lookup, the encoder's segment building (against
  np.add.at), grids, the activation table's prefix property;
- the command line: gpt2_cpu's parser plus the GPU flags in one --help, errors that name
  gpt2_cuda.py, the one-line exit without a GPU (of gpt2_cuda.py and dev/run_gpu_tests.py),
  and dev/run_gpu_tests.py's log name and tee; every launch names a kernel of its file;
- the column-major cuBLAS calls of matmul_forward/backward and of attention on the emulated
  cuBLAS (column-major, leading dimensions and strides taken literally), against plain row-major
  NumPy products;
- the whole model on the emulated device (tests/emulated_gpu.py's fixture): gpt2_cuda's forward,
  backward, AdamW, checkpoints, compared tensor by tensor with gpt2_cpu; which kernels a step
  launches (the classifier once, the biases on the next kernel) and its pinned, asynchronous
  uploads; one activation allocation for training, HellaSwag and sampling; gpt2_cpu.generate and
  --generate with the CUDA forward (the same tokens as gpt2_cpu.py); HellaSwag's padded
  forward_losses, --eval-only -h 1, and -h 1 / samples during training (the same main.log eval
  lines and sample text as gpt2_cpu.py); resuming CPU <-> CUDA; bf16 master weights.
Part 2, kernels: each kernel file against gpt2_cpu's NumPy layer on fresh random inputs with
outputs poisoned with NaN, tolerances in llmc.check.TOLERANCES, on a GPU (marked gpu) at every
shape and on the emulated device at the small, odd ones (the 768 / 50304 / 1<<20 shapes are
GPU-only); on a GPU only: the 124M model against gpt2_cpu in fp32 and bf16, ten d4 training
steps, resuming CPU <-> CUDA on d2.
Part 3, flash attention: its tiles, and the kernels against float64 attention and lse, at the
GPU shapes and (emulated) at the small ones tests/test_flash_attention_host.py does not run.
Run: pytest tests/test_cuda.py   (no GPU: about two minutes on 2 shared cores once the emulated
kernels are built; part 2 on an H100: minutes, mostly gpt2_cpu computing the 124M references)
"""
import ctypes
import importlib.util
import math
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpt2_cpu
from llmc import checkpoint, cli, cuda_check, dataloader, evalloader, gpu_cli, tokenizer
import gpt2_cuda
import llama3_cuda
import llmc.matmul
import llmc.attention
import llmc.cuda
import llmc.mfu
import llmc.pinned
from gpt2_cpu import GPT2Config
from llmc.check import TOLERANCES, check_tensor
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from emulated_gpu import (TINY, _train_losses, _write_shards, emulated_gpu, record_launches,  # noqa: F401  (a fixture)
                          tiny_model_parameters)
from cuda_kernel_checks import (as_input, check_adamw_norm_cast, check_attention, check_classifier, check_encoder,
                                check_gelu, check_layernorm, check_matmul_and_bias, poisoned, to_device, to_host)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------
# part 1a: host logic

def test_flops_per_token_matches_llmc_formula():
    # GPT-2 124M at T=1024: 6*N + 6*L*C*T, counted by hand
    n = 124_475_904
    assert llmc.mfu.flops_per_token(n, 12, 768, 1024) == 746_855_424 + 56_623_104    # 6N + 6LCT by hand


def test_mfu_and_peak_lookup():
    # one H100 SXM at 1e6 tok/s on 124M: 6*N*tok/s / 989.4e12
    n, tok_s = 124_475_904, 1e6
    expected = (6 * n + 6 * 12 * 768 * 1024) * tok_s / 989.4e12
    got = llmc.mfu.mfu(n, 12, 768, 1024, tok_s, "NVIDIA H100 80GB HBM3", "bf16", False)
    assert got == pytest.approx(expected, rel=1e-12)
    assert llmc.mfu.peak_flops("NVIDIA H100 PCIe", "bf16", False) == 756.0e12       # not the SXM row
    assert llmc.mfu.peak_flops("NVIDIA A100-SXM4-80GB", "fp32", True) == 156.0e12   # TF32 column
    assert llmc.mfu.peak_flops("NVIDIA A100-SXM4-80GB", "fp32", False) == 19.5e12   # CUDA cores
    assert llmc.mfu.peak_flops("NVIDIA A10", "bf16", False) == 125.0e12              # not A100
    assert llmc.mfu.peak_flops("NVIDIA L40S", "bf16", False) == 362.1e12             # not L4
    assert llmc.mfu.peak_flops("NVIDIA L4", "bf16", False) == 121.0e12
    assert llmc.mfu.peak_flops("Tesla V100-SXM2-16GB", "bf16", False) is None          # no bf16
    assert llmc.mfu.mfu(n, 12, 768, 1024, tok_s, "Some Future GPU", "bf16", False) is None


def _scatter_add_by_plan(seg, dout, V):
    """The dwte scatter-add as the two kernels perform it, in float64 on the host: each chunk's
    sum added directly (its token's only chunk) or into a partial row, then each partial range
    summed in order."""
    C = dout.shape[1]
    dwte = np.zeros((V, C))
    partial = np.full((max(1, seg.reduce_start[-1]), C), np.nan)          # unwritten rows would poison
    for k in range(seg.chunk_token.size):
        total = dout[seg.positions[seg.chunk_start[k]:seg.chunk_start[k + 1]]].sum(axis=0)
        if seg.chunk_slot[k] < 0:
            dwte[seg.chunk_token[k]] += total
        else:
            partial[seg.chunk_slot[k]] = total
    for m in range(seg.reduce_token.size):
        dwte[seg.reduce_token[m]] += partial[seg.reduce_start[m]:seg.reduce_start[m + 1]].sum(axis=0)
    return dwte


@pytest.mark.parametrize("B,T,V,frequent", [(1, 1, 5, 0), (2, 7, 3, 0), (4, 33, 50, 0), (3, 64, 50257, 0),
                                            (8, 128, 50257, 0.04), (2, 100, 7, 0.3)])
def test_encoder_segments_reproduce_add_at(B, T, V, frequent):
    rng = np.random.default_rng(B * 1000 + T)
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp[rng.random((B, T)) < frequent] = 2                              # one token a share `frequent` of the batch
    seg = gpt2_cuda.encoder_backward_segments(inp)
    N, R = B * T, gpt2_cuda.WTE_CHUNK_ROWS
    assert all(a.dtype == np.int32 for a in seg)
    assert sorted(seg.positions.tolist()) == list(range(N))             # a permutation of 0..N-1
    sizes = np.diff(seg.chunk_start)
    assert seg.chunk_start[0] == 0 and seg.chunk_start[-1] == N and np.all(sizes > 0)
    assert sizes.max() <= R                                             # no block sums more than R rows
    flat = inp.ravel()
    for k in range(seg.chunk_token.size):                               # stable: increasing positions
        chunk = seg.positions[seg.chunk_start[k]:seg.chunk_start[k + 1]]
        assert np.all(flat[chunk] == seg.chunk_token[k]) and np.all(np.diff(chunk) > 0)
    # a token's chunks: one, added directly, or several, each with its own partial row, in order
    counts = np.bincount(flat, minlength=V)
    for k, token in enumerate(seg.chunk_token):
        assert (seg.chunk_slot[k] < 0) == (counts[token] <= R), (k, token)
    slots = seg.chunk_slot[seg.chunk_slot >= 0]
    assert np.array_equal(slots, np.arange(slots.size))
    assert np.array_equal(seg.reduce_token, np.flatnonzero(counts > R))
    assert np.array_equal(np.diff(seg.reduce_start), -(-counts[counts > R] // R))
    assert seg.reduce_token.size <= gpt2_cuda.wte_reduce_max(N) and slots.size <= gpt2_cuda.wte_partial_rows(N)
    if frequent >= 0.04:
        assert seg.reduce_token.size >= 1                               # the frequent token is split
    # the scatter-add the kernels perform, done here on NumPy, equals np.add.at
    dout = rng.standard_normal((N, 3))
    ref = np.zeros((V, 3))
    np.add.at(ref, flat, dout)
    np.testing.assert_allclose(_scatter_add_by_plan(seg, dout, V), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("N", [1, 33, 2048, 65536])
def test_pinned_staging_holds_the_largest_uploads(N):
    # the CUDA graph's padded uploads are the largest a micro-batch of N positions makes: they fit
    # the buffers gpt2_allocate reserves, so no pinned allocation happens inside training
    def placed(ints):
        return -(-4 * ints // llmc.pinned.PinnedStaging.ALIGNMENT) * llmc.pinned.PinnedStaging.ALIGNMENT
    R = gpt2_cuda.wte_reduce_max(N)
    batch, segments = gpt2_cuda.staging_bytes(N)
    assert batch >= 2 * placed(N)
    assert segments >= sum(placed(n) for n in (N, N + 1, N, N, R + 1, R))


def test_grids():
    assert llmc.cuda.ceil_div(10, 3) == 4 and llmc.cuda.ceil_div(9, 3) == 3
    assert llmc.cuda.elementwise_grid(0) == 1 and llmc.cuda.elementwise_grid(257) == 2
    assert llmc.cuda.warp_row_grid(17, 256) == 3                          # 8 rows per 256-thread block
    assert gpt2_cuda.layernorm_backward_grid(5) == 5
    assert gpt2_cuda.layernorm_backward_grid(10 ** 6) == gpt2_cuda.LAYERNORM_BACKWARD_GRID
    assert llmc.cuda.vector_size("bf16") == 8 and llmc.cuda.vector_size("fp32") == 4
    C = 768
    need = max(gpt2_cuda.layernorm_backward_grid(10 ** 6) * 2 * C, llmc.matmul.bias_backward_chunks(10 ** 6) * 4 * C)
    assert gpt2_cuda.partial_floats(GPT2Config(channels=C)) >= need


def test_parse_args_has_cpu_and_gpu_flags():
    args = gpt2_cuda.parse_args(["-e", "d12", "-r", "1", "-b", "4", "--precision", "fp32", "-f", "0",
                                 "-x", "-1", "-w", "0", "-l", "1e-3", "--check"])
    assert (args.model, args.batch_size, args.max_steps, args.learning_rate) == ("d12", 4, -1, 1e-3)
    assert (args.recompute, args.precision, args.tf32, args.master_weights, args.check) == (1, "fp32", 0, 0, True)
    defaults = gpt2_cuda.parse_args([])
    cpu_defaults = gpt2_cpu.parse_args([])
    for key, value in vars(cpu_defaults).items():                       # same defaults as gpt2_cpu
        assert getattr(defaults, key) == value, key
    assert (defaults.precision, defaults.tf32, defaults.master_weights, defaults.recompute) == ("auto", 1, 1, 0)
    # gpt2_cpu's newer flags arrive unchanged (-h is HellaSwag, as in llm.c)
    args = gpt2_cuda.parse_args(["-h", "1", "--eval-only", "--generate", "7", "--prompt", "Hi", "--top-k", "5",
                                 "--temperature", "0.5", "--sample-seed", "9", "--precision", "bf16"])
    assert (args.hellaswag, args.eval_only, args.generate, args.prompt, args.top_k, args.temperature,
            args.sample_seed, args.precision) == (1, True, 7, "Hi", 5, 0.5, 9, "bf16")


def _run_cuda_cli(args, timeout=120):
    return subprocess.run([sys.executable, os.path.join(ROOT, "gpt2_cuda.py")] + args, capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def test_help_is_one_block_with_cpu_and_gpu_flags():
    r = _run_cuda_cli(["--help"])                                       # exits in argparse: no GPU needed
    assert r.returncode == 0 and r.stderr == ""
    out = r.stdout
    assert out.count("usage:") == 1 and out.startswith("usage: gpt2_cuda.py ")
    cpu_help = cli.build_parser("gpt2_cuda.py", "", gpt2_cpu.LR_SCHEDULES).format_help()
    cpu_flags = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", cpu_help))
    gpu_flags = {"--precision", "-f", "--tf32", "-w", "--master-weights", "-r", "--recompute", "--check", "--check-dtype"}
    assert {"-h", "--hellaswag", "--eval-only", "--generate", "--prompt", "--sample-seed", "-e", "-x"} <= cpu_flags
    listed = set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", out))
    assert cpu_flags | gpu_flags <= listed
    # the GPU flags come last, in one group of the same help text
    body = out.split("\n\n", 1)[1]                                     # after the usage block
    assert body.count(gpu_cli.GPU_FLAGS_TITLE) == 1
    before, after = body.split(gpu_cli.GPU_FLAGS_TITLE)
    assert "--hellaswag-file" in before and "--hellaswag-file" not in after
    assert "--master-weights" in after and "--master-weights" not in before
    assert "(default: auto)" in after


def test_bad_flag_names_gpt2_cuda():
    r = _run_cuda_cli(["--precision", "fp16"])
    assert r.returncode == 1 and r.stdout == ""                # one `error:` line, exit 1 (llmc.argparser.ArgumentParser)
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert r.stderr.startswith("error: argument --precision: invalid choice")


def test_activation_table_prefix_property():
    # a smaller (B,T) uses the first elements of each buffer: its sizes never exceed the allocation's
    cfg = GPT2Config(num_layers=3, num_heads=4, channels=64)
    big = {name: math.prod(shape) for name, shape, _ in gpt2_cuda.activation_shapes(cfg, 4, 128)}
    for B, T in [(1, 1), (1, 128), (4, 127), (3, 65)]:
        for name, shape, _ in gpt2_cuda.activation_shapes(cfg, B, T):
            assert math.prod(shape) <= big[name], (name, B, T)
    # `logits` holds the logits and, on the naive path, the qkv projection and preatt (its workspace)
    (size,) = dict((n, s) for n, s, _ in gpt2_cuda.activation_shapes(cfg, 2, 1024))["logits"]
    assert size >= max(2 * 1024 * 3 * 64, 2 * 4 * 1024 * 1024, 2 * 1024 * cfg.padded_vocab_size)


def test_classifier_chunks_and_the_memory_they_save():
    assert gpt2_cuda.classifier_chunks(4, 8, 0) == [(0, 32)] == gpt2_cuda.classifier_chunks(4, 8, 4)
    assert gpt2_cuda.classifier_chunks(4, 8, 9) == [(0, 32)]
    assert gpt2_cuda.classifier_chunks(5, 8, 2) == [(0, 16), (16, 32), (32, 40)]     # the last one shorter
    # GPT-2 124M on the cuDNN path (no attention workspace in `logits`): the (B,T,Vp) logits become
    # (chunk,T,Vp), the only buffer that changes: (B - chunk) T Vp values fewer, 2 bytes each in bf16
    cfg = gpt2_cpu.config_from_descriptor("d12")
    cudnn = llmc.attention.attention_path("cudnn")
    for B, chunk in ((16, 4), (64, 4)):
        whole = dict((n, s) for n, s, _ in gpt2_cuda.activation_shapes(cfg, B, 1024, 1, cudnn))
        chunked = dict((n, s) for n, s, _ in gpt2_cuda.activation_shapes(cfg, B, 1024, 1, cudnn, chunk))
        assert {n for n in whole if whole[n] != chunked[n]} == {"logits"}
        assert whole["logits"][0] - chunked["logits"][0] == (B - chunk) * 1024 * cfg.padded_vocab_size
    # on the naive path `logits` is also the attention's workspace, (B,T,max(3C, NH T)): that much stays
    naive = dict((n, s) for n, s, _ in gpt2_cuda.activation_shapes(cfg, 16, 1024, 1, None, 1))["logits"]
    assert naive == (16 * 1024 * max(3 * cfg.channels, cfg.num_heads * 1024),)


def test_emulated_allocation_with_classifier_chunks(emulated_gpu):
    # the emulated device counts the bytes it holds: a chunk of 1 of 4 sequences allocates
    # exactly 3 sequences' logits fewer, and a training step still matches gpt2_cpu's loss
    cfg = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=1, num_heads=1, channels=16)
    pool = emulated_gpu.get_default_memory_pool()
    used = {}
    for chunk in (0, 1):
        before = pool.used_bytes()
        model = gpt2_cuda.GPT2(cfg, "fp32", attention="flash", classifier_chunk=chunk)
        gpt2_cuda.gpt2_allocate(model, (4, 8))
        used[chunk] = pool.used_bytes() - before
        x = np.arange(32, dtype=np.int32).reshape(4, 8) % cfg.vocab_size
        gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
        gpt2_cuda.gpt2_forward(model, x, (x + 1) % cfg.vocab_size)
        cpu = gpt2_cpu.gpt2_init(cfg, 42)
        gpt2_cpu.gpt2_forward(cpu, x, (x + 1) % cfg.vocab_size)
        assert gpt2_cuda.gpt2_mean_loss(model) == pytest.approx(cpu.mean_loss, rel=1e-5)
        del model
    assert used[0] - used[1] == 3 * 8 * cfg.padded_vocab_size * 4


def test_activation_table_recompute_levels():
    # -r 0 keeps every layer of ln1, ln2, fch_gelu; -r 1 fch_gelu for one layer; -r 2 ln1 and ln2 too,
    # their mean and rstd for every layer (layernorm_backward reads them); nothing else changes
    cfg = GPT2Config(num_layers=3, num_heads=4, channels=64)
    B, T, C, L = 2, 16, cfg.channels, cfg.num_layers
    tables = {r: {name: shape for name, shape, _ in gpt2_cuda.activation_shapes(cfg, B, T, r)} for r in (0, 1, 2)}
    assert [tables[r]["fch_gelu"] for r in (0, 1, 2)] == [(L, B, T, 4 * C), (1, B, T, 4 * C), (1, B, T, 4 * C)]
    for name in ("ln1", "ln2"):
        assert [tables[r][name] for r in (0, 1, 2)] == [(L, B, T, C), (L, B, T, C), (1, B, T, C)]
        assert tables[2][f"{name}_mean"] == tables[2][f"{name}_rstd"] == (L, B, T)
    changed = {name for name in tables[0] if tables[0][name] != tables[2][name]}
    assert changed == {"ln1", "ln2", "fch_gelu"}
    saved = sum(math.prod(tables[1][n]) - math.prod(tables[2][n]) for n in tables[1])
    assert saved == 2 * (L - 1) * B * T * C                # the -r help's "2(L-1) (B,T,C)"


NO_GPU = pytest.mark.skipif(llmc.cuda.cuda_unavailable_reason() is None,
                            reason="a GPU is present: the no-GPU path is not taken")


@NO_GPU
@pytest.mark.parametrize("argv", [["-x", "1"], ["--generate", "5"], ["--eval-only", "-h", "1"],
                                  ["--check", "-e", "d12", "-b", "4", "-t", "64"]])
def test_no_gpu_prints_one_line_and_exits_2(argv):
    r = _run_cuda_cli(argv)
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpt2_cuda.py: no CUDA GPU found (") and "gpt2_cpu.py" in lines[0]
    assert "add --device cpu" in lines[0]                             # the emulated device, for a newcomer


@NO_GPU
def test_no_gpu_reason_names_the_missing_driver_not_an_old_one():
    """Without an NVIDIA driver CUDA says "driver version is insufficient"; the reason says what is
    really missing, and the gpu tests' skip reason starts "no NVIDIA GPU"."""
    import conftest
    if llmc.cuda.nvidia_driver_present():
        pytest.skip("an NVIDIA driver is loaded here: the reason is CUDA's own")
    assert llmc.cuda.cuda_unavailable_reason() in ("no NVIDIA driver on this machine",) or \
        llmc.cuda.cuda_unavailable_reason().startswith("CuPy is not importable")
    assert conftest.gpu_unavailable_reason().startswith("no NVIDIA GPU (")
    assert "insufficient" not in conftest.gpu_unavailable_reason()


def _load_run_gpu_tests():
    spec = importlib.util.spec_from_file_location("run_gpu_tests", os.path.join(ROOT, "dev", "run_gpu_tests.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@NO_GPU
def test_run_gpu_tests_without_gpu_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "run_gpu_tests.py"), "--results-dir", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dev/run_gpu_tests.py: no CUDA GPU found ("), r.stderr
    assert os.listdir(tmp_path) == []                                   # no log for a run that did not happen


def test_run_gpu_tests_log_name_and_tee(tmp_path, capsys, monkeypatch):
    rgt = _load_run_gpu_tests()
    assert rgt.device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert rgt.device_slug("  Tesla V100-SXM2-16GB ") == "tesla-v100-sxm2-16gb"
    assert rgt.log_path(str(tmp_path), "2026-11-22", "NVIDIA H200") == str(tmp_path / "2026-11-22_nvidia-h200_test-gpu.log")
    # every command's output goes to the terminal and the log; the status is the worst exit code
    ok = [sys.executable, "-c", "print('first line'); print('second line')"]
    bad = [sys.executable, "-c", "import sys; print('to stderr', file=sys.stderr); sys.exit(3)"]
    log = tmp_path / "x.log"
    with open(log, "w") as f:
        statuses = [rgt.run_and_tee(cmd, f) for cmd in (ok, bad, ok)]
    assert statuses == [0, 3, 0]
    text = log.read_text()
    shown = capsys.readouterr().out
    for line in ("first line", "second line", "to stderr", "exit status 3"):
        assert line in text and line in shown, line
    lines = text.splitlines()
    assert sum(line.startswith("$ ") for line in lines) == 3 and lines.count("first line") == 2
    assert lines.index("to stderr") < lines.index("exit status 3")
    # main, past the GPU gate: the log's name and header, the summary, the exit status
    monkeypatch.setattr(rgt.cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(rgt, "device_name", lambda: "NVIDIA Test GPU 80GB")
    monkeypatch.setattr(rgt, "software_versions", lambda: "driver 0.0")
    monkeypatch.setattr(rgt, "commands", lambda: [ok, bad])
    assert rgt.main(["--results-dir", str(tmp_path / "results")]) == 1
    monkeypatch.setattr(rgt, "commands", lambda: [ok])
    assert rgt.main(["--results-dir", str(tmp_path / "ok")]) == 0
    (name,) = os.listdir(tmp_path / "results")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}_nvidia-test-gpu-80gb_test-gpu\.log", name)
    text = (tmp_path / "results" / name).read_text()
    assert text.startswith("# dev/run_gpu_tests.py, ") and "# device: NVIDIA Test GPU 80GB (driver 0.0)" in text
    assert "# commit: " in text and f"#   {' '.join(bad)}" in text
    assert "FAIL (3)" in text and "# 1 of 2 FAILED" in text
    assert "# all passed" in (tmp_path / "ok" / os.listdir(tmp_path / "ok")[0]).read_text()


def test_import_does_not_import_cupy():
    r = subprocess.run([sys.executable, "-c", "import sys, gpt2_cuda; print('cupy' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def _launched_kernels():
    """(file, kernel name) of every cuda.launch call in gpt2_cuda.py's source, the llmc modules
    holding its launchers (attention.py, matmul.py, cublaslt.py) and llama3_cuda.py's."""
    src = ""
    for path in ("gpt2_cuda.py", "llama3_cuda.py",
                 *(os.path.join("llmc", f"{name}.py") for name in ("attention", "matmul", "cublaslt"))):
        with open(os.path.join(ROOT, path)) as f:
            src += f.read()
    launched = set(re.findall(r'cuda\.launch\("(\w+)", precision, "(\w+)"', src))
    # the flash attention kernels are picked by head size from llmc.attention.FLASH_ATTENTION_KERNELS
    return launched | {("flash_attention", name) for names in llmc.attention.FLASH_ATTENTION_KERNELS.values() for name in names}


def test_every_launch_names_a_kernel_of_its_file():
    launched = _launched_kernels()
    defined = set()
    for path in sorted(os.listdir(os.path.join(ROOT, "kernels"))):
        if path.endswith(".cu"):
            with open(os.path.join(ROOT, "kernels", path)) as f:
                defined |= {(path[:-3], k) for k in re.findall(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)', f.read())}
    assert launched == defined                                           # every kernel has a launcher
    assert set(gpt2_cuda.KERNEL_FILES) | {"flash_attention"} | set(llama3_cuda.LLAMA3_KERNEL_FILES) == {
        file for file, _ in defined}                                     # flash: kernel_files(model)


# ----------------------------------------------------------------------------
# part 1b: the cuBLAS calls on the emulated cuBLAS (llmc/emulator/cublas.py): column-major, every
# leading dimension and stride taken literally

def _floatX(x, precision):
    """fp32 host values -> floatX host storage (bf16 bits, rounded to nearest even)."""
    x = np.asarray(x, dtype=np.float32)
    return float32_to_bfloat16_bits(x) if precision == "bf16" else x


def _float32(x):
    """floatX host storage -> float32 values."""
    return bfloat16_bits_to_float32(x) if x.dtype == np.uint16 else x


@pytest.mark.parametrize("precision,OC", [("fp32", 12), ("fp32", 5), ("bf16", 24), ("bf16", 7)])
def test_matmul_forward_adds_the_bias_after_a_beta_0_gemm(emulated_gpu, monkeypatch, precision, OC):
    # no broadcast copy of the bias into out and no beta = 1 GEMM reading it back: the GEMM
    # overwrites out (poisoned first), then one add_bias launch (vectorized or not by OC)
    cp, cublas = emulated_gpu, llmc.cuda.cublas_bindings()                # the bindings every gemm goes through
    betas, gemm_ex = [], cublas.gemm_ex

    def recording_gemm(*args):
        betas.append(ctypes.c_float.from_address(args[12]).value)       # beta: a host pointer (pointer mode host)
        return gemm_ex(*args)
    monkeypatch.setattr(cublas, "gemm_ex", recording_gemm)
    launches = record_launches(monkeypatch)
    B, T, C = 2, 3, 8
    rng = np.random.default_rng(OC)
    inp, weight, bias = rng.standard_normal((B, T, C)), rng.standard_normal((OC, C)), rng.standard_normal(OC)
    out = cp.asarray(_floatX(np.full((B, T, OC), np.nan), precision))
    llmc.matmul.matmul_forward(out, *(cp.asarray(_floatX(a, precision)) for a in (inp, weight, bias)), B, T, C, OC)
    assert betas == [0.0] and [launch.name for launch in launches] == ["add_bias"]
    vec = llmc.cuda.vector_size(precision) if OC % llmc.cuda.vector_size(precision) == 0 else 1
    assert launches[0].grid == (llmc.cuda.elementwise_grid(B * T * OC // vec), 1, 1)
    r = lambda a: _float32(_floatX(a, precision)).astype(np.float64)                 # noqa: E731
    atol, rtol = TOLERANCES[f"kernel_{precision}"]["matmul"]
    np.testing.assert_allclose(_float32(out.get()), r(inp) @ r(weight).T + r(bias), rtol=rtol, atol=atol)


@pytest.mark.parametrize("B,T,C,OC", [(2, 3, 4, 5), (1, 7, 8, 12), (3, 5, 6, 1)])
def test_matmul_gemm_arguments(emulated_gpu, B, T, C, OC):
    cp = emulated_gpu
    rng = np.random.default_rng(OC)
    inp = rng.standard_normal((B, T, C)).astype(np.float32)
    weight = rng.standard_normal((OC, C)).astype(np.float32)
    bias = rng.standard_normal(OC).astype(np.float32)
    out = cp.full((B, T, OC), np.nan, np.float32)
    llmc.matmul.matmul_forward(out, cp.asarray(inp), cp.asarray(weight), cp.asarray(bias), B, T, C, OC)
    np.testing.assert_allclose(out.get(), inp @ weight.T + bias, rtol=1e-5, atol=1e-5)
    llmc.matmul.matmul_forward(out, cp.asarray(inp), cp.asarray(weight), None, B, T, C, OC)
    np.testing.assert_allclose(out.get(), inp @ weight.T, rtol=1e-5, atol=1e-5)
    dout = rng.standard_normal((B, T, OC)).astype(np.float32)
    dinp = cp.full((B, T, C), np.nan, np.float32)
    dweight0 = rng.standard_normal((OC, C)).astype(np.float32)
    dweight = cp.asarray(dweight0)
    llmc.matmul.matmul_backward(dinp, dweight, None, cp.asarray(dout), cp.asarray(inp), cp.asarray(weight), None,
                                B, T, C, OC)
    np.testing.assert_allclose(dinp.get(), dout @ weight, rtol=1e-5, atol=1e-5)                  # written
    np.testing.assert_allclose(dweight.get(), dweight0 + dout.reshape(-1, OC).T @ inp.reshape(-1, C),
                               rtol=1e-5, atol=1e-5)                                              # accumulated


@pytest.mark.parametrize("BNH,T,HS", [(1, 1, 4), (3, 5, 4), (2, 16, 8)])
def test_attention_gemm_arguments(emulated_gpu, BNH, T, HS):
    cp = emulated_gpu
    rng = np.random.default_rng(T)
    q, k, v, dy = (rng.standard_normal((BNH, T, HS)).astype(np.float32) for _ in range(4))
    att, dpreatt = (rng.standard_normal((BNH, T, T)).astype(np.float32) for _ in range(2))
    tr = lambda x: x.transpose(0, 2, 1)                                                 # noqa: E731
    nan = lambda *shape: cp.full(shape, np.nan, np.float32)                             # noqa: E731
    preatt = nan(BNH, T, T)
    llmc.attention.attention_scores(preatt, cp.asarray(q), cp.asarray(k), BNH, T, HS)
    np.testing.assert_allclose(preatt.get(), q @ tr(k), rtol=1e-5, atol=1e-5)
    y = nan(BNH, T, HS)
    llmc.attention.attention_values(y, cp.asarray(att), cp.asarray(v), BNH, T, HS)
    np.testing.assert_allclose(y.get(), att @ v, rtol=1e-5, atol=1e-5)
    datt, dv = nan(BNH, T, T), nan(BNH, T, HS)
    llmc.attention.attention_values_backward(datt, dv, cp.asarray(dy), cp.asarray(att), cp.asarray(v), BNH, T, HS)
    np.testing.assert_allclose(datt.get(), dy @ tr(v), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dv.get(), tr(att) @ dy, rtol=1e-5, atol=1e-5)
    dq, dk = nan(BNH, T, HS), nan(BNH, T, HS)
    llmc.attention.attention_scores_backward(dq, dk, cp.asarray(dpreatt), cp.asarray(q), cp.asarray(k), BNH, T, HS)
    np.testing.assert_allclose(dq.get(), dpreatt @ k, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dk.get(), tr(dpreatt) @ q, rtol=1e-5, atol=1e-5)


@pytest.fixture
def emulated_training(emulated_gpu, monkeypatch):
    """The emulated device for tests that take optimizer steps, with the global norm's grid cut
    from 1024 blocks of 512 threads (seconds per step there, each CUDA thread a fiber) to 16: the
    kernel is grid-stride and its launcher and partial buffer follow the constant, so the same
    kernels compute the same norm, in another fixed summation order."""
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)
    return emulated_gpu


def _tiny_model(precision, recompute, seed=42):
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, recompute=recompute)
    gpt2_cuda.upload_parameters(model, tiny_model_parameters(TINY, seed).params)
    return model


@pytest.mark.parametrize("precision,recompute,B,T", [("fp32", False, 3, 16), ("fp32", True, 3, 15), ("bf16", True, 3, 16),
                                                     ("bf16", False, 1, 13)])
def test_emulated_model_matches_gpt2_cpu(emulated_gpu, precision, recompute, B, T):
    # every activation and gradient of the GPU code path (emulated kernels) against gpt2_cpu;
    # T < maxT, and odd T: layer 1's att then starts at an unaligned address (B*NH*T*T odd)
    model = _tiny_model(precision, recompute)
    rng = np.random.default_rng(7)
    x = rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32)
    y = rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32)
    x[0, :4] = 5                                                # repeated tokens: dwte accumulation
    x[:, T - 12:] = 9                                           # 12 B positions: over 32 (B=3) the token is chunked
    assert cuda_check.check_against_cpu(gpt2_cuda, model, x, y, np.float64)
    # twice in a row: gradients are zeroed, activations overwritten, nothing leaks between passes
    assert cuda_check.check_against_cpu(gpt2_cuda, model, x, y, np.float64)


def test_emulated_gradient_accumulation_and_update_match_gpt2_cpu(emulated_training):
    rng = np.random.default_rng(3)
    B, T, C = 2, 8, TINY.channels
    batches = [tuple(rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(2)]
    model = _tiny_model("fp32", True)
    cpu = tiny_model_parameters(TINY, 42)
    for step in range(1, 3):
        gpt2_cuda.gpt2_zero_grad(model)
        gpt2_cpu.gpt2_zero_grad(cpu)
        for x, y in batches:
            gpt2_cuda.gpt2_forward(model, x, y)
            gpt2_cuda.gpt2_backward(model, loss_scale=0.5)
            gpt2_cpu.gpt2_forward(cpu, x, y)
            gpt2_cpu.gpt2_backward(cpu, loss_scale=0.5)
        assert check_tensor(model.grads.get(), cpu.grads, "grads", 1e-6, 1e-4)
        norm, cpu_norm = gpt2_cuda.gpt2_grad_norm(model), gpt2_cpu.gpt2_grad_norm(cpu)
        assert norm == pytest.approx(cpu_norm, rel=1e-5)
        gpt2_cuda.gpt2_update(model, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, grad_scale=0.5)
        gpt2_cpu.gpt2_update(cpu, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, grad_scale=0.5)
        # the key biases' gradient is zero analytically (adding q.bk to every score of a softmax row
        # changes nothing): both trainers hold rounding noise there (~1e-12, far below AdamW's eps
        # of 1e-8), which AdamW turns into steps of lr * g/(|g| + eps) << lr of either sign. There
        # the two may part by that much each step (a real gradient would move them by ~lr = 1e-3)
        params, cpu_params = model.params.get(), cpu.params.copy()
        key_bias = np.zeros(cpu.params.size, bool)
        gpt2_cpu.tensor_views(key_bias, cpu.param_shapes)["qkvb"][:, C:2 * C] = True
        assert np.abs(params[key_bias] - cpu_params[key_bias]).max() < 2 * step * 1e-3 * 1e-2
        params[key_bias] = cpu_params[key_bias] = 0.0
        assert check_tensor(params, cpu_params, "params", 1e-6, 1e-5)
        # m = beta1 m + (1 - beta1) g inherits (1 - beta1) of the gradients' differences, which the
        # grads check above allows up to 1e-6 absolute: so 1e-7 absolute here (m itself is ~1e-3)
        assert check_tensor(model.m.get(), cpu.m, "m", 1e-7, 1e-4)


def test_emulated_micro_batch_runs_the_classifier_once(emulated_gpu, monkeypatch):
    # the training step's fused classifier is one pass writing the losses and dlogits (not a
    # forward pass for the loss and a backward pass again); the step's results are unchanged
    launched = record_launches(monkeypatch)
    rng = np.random.default_rng(4)
    x, y = (rng.integers(0, TINY.vocab_size, (2, 8)).astype(np.int32) for _ in range(2))
    model = _tiny_model("fp32", True)
    gpt2_cuda.gpt2_zero_grad(model)
    gpt2_cuda.gpt2_activations(model, 2, 8)["loss_accum"].fill(0)
    gpt2_cuda.gpt2_micro_batch(model, x, y, 0.5)
    classifier = [launch.args for launch in launched if launch.name == "fused_classifier"]
    assert len(classifier) == 1 and int(classifier[0][-1]) == 1           # write_dlogits
    cpu = tiny_model_parameters(TINY, 42)
    gpt2_cpu.gpt2_forward(cpu, x, y)
    gpt2_cpu.gpt2_zero_grad(cpu)
    gpt2_cpu.gpt2_backward(cpu, loss_scale=0.5)
    loss_accum = gpt2_cuda.gpt2_activations(model, 2, 8)["loss_accum"]
    assert float(loss_accum.sum(dtype=np.float64)) / 16 == pytest.approx(cpu.mean_loss, rel=1e-6)
    assert check_tensor(model.grads.get(), cpu.grads, "grads", 1e-6, 1e-4)


def test_emulated_biases_ride_on_the_next_kernel(emulated_gpu, monkeypatch):
    # of a layer's four linear layers only qkv adds its bias with add_bias; fc hands its bias to
    # the GELU, the attention and MLP projections theirs to the fused residual + LayerNorm (no
    # pass of their own)
    model = _tiny_model("bf16", True)
    launched = record_launches(monkeypatch)
    x = np.arange(16, dtype=np.int32).reshape(2, 8)
    gpt2_cuda.gpt2_forward(model, x, x)
    L = TINY.num_layers
    assert sum(launch.name == "add_bias" for launch in launched) == L
    fc_biases = [launch.args[2] for launch in launched if launch.name == "gelu_forward"]
    assert [llmc.cuda.address(b) for b in fc_biases] == [llmc.cuda.address(model.P["fcb"][l]) for l in range(L)]
    projection_biases = [launch.args[6] for launch in launched if launch.name == "fused_residual_forward"]
    assert [llmc.cuda.address(b) for b in projection_biases] == [
        llmc.cuda.address(model.P[name][l]) for l in range(L) for name in ("attprojb", "fcprojb")]


def test_emulated_uploads_are_async_copies_from_pinned_buffers(emulated_gpu, monkeypatch):
    # every per-micro-batch host -> device copy (ids, targets, the dwte chunks) starts in pinned
    # memory allocated once, and is queued on a stream (asynchronous)
    pinned, copies = [], []

    def alloc_pinned_memory(nbytes):
        pinned.append(bytearray(nbytes))
        return pinned[-1]

    device_array = type(emulated_gpu.zeros(1))
    device_set = device_array.set

    def recording_set(self, arr, stream=None):
        copies.append((arr, stream))
        device_set(self, arr, stream)
    monkeypatch.setattr(emulated_gpu.cuda, "alloc_pinned_memory", alloc_pinned_memory)
    monkeypatch.setattr(device_array, "set", recording_set)
    model = _tiny_model("bf16", True)
    gpt2_cuda.gpt2_allocate(model, (2, 16))
    assert len(pinned) == 4                                                # two buffers each for batch and chunks
    copies.clear()                                                         # the parameters' upload is not a micro-batch's
    rng = np.random.default_rng(5)
    for _ in range(3):
        x, y = (rng.integers(0, TINY.vocab_size, (2, 16)).astype(np.int32) for _ in range(2))
        x[0, :] = 3                                                        # 16 positions of one token
        gpt2_cuda.gpt2_micro_batch(model, x, y, 1.0 / 3)
    assert len(pinned) == 4 and len(copies) == 3 * (2 + len(gpt2_cuda.WteSegments._fields))
    buffers = [np.frombuffer(b, np.uint8) for b in pinned]
    for arr, stream in copies:
        assert stream is not None and (arr.size == 0 or any(np.shares_memory(arr, b) for b in buffers))


def test_emulated_allocation_holds_every_size_at_once(emulated_gpu):
    # one set of buffers for training (B,T), HellaSwag (4,T) and the sampler's (1,window): each
    # buffer is the largest of its sizes, every size's views are prefixes, nothing is reallocated
    cfg = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2, channels=16)
    model = gpt2_cuda.GPT2(cfg, "fp32")
    sizes = [(1, 8), (4, 8), (1, 13)]                    # 13^2 > 1*8^2: the window's att is the largest
    nbytes = gpt2_cuda.gpt2_allocate(model, *sizes)
    tables = [{n: math.prod(shape) for n, shape, _ in gpt2_cuda.activation_shapes(cfg, B, T)} for B, T in sizes]
    assert {n: b.size for n, b in model.buffers.items()} == {n: max(t[n] for t in tables) for n in tables[0]}
    assert nbytes == sum(b.nbytes for b in model.buffers.values())
    buffers = dict(model.buffers)
    for B, T in sizes:
        views = gpt2_cuda.gpt2_activations(model, B, T)
        assert views["att"].shape == (2, B, 2, T, T) and np.shares_memory(views["att"], buffers["att"])
    assert model.buffers == buffers and model.allocated == sizes                     # no reallocation
    # a size that does not fit: everything is reallocated, for it and the sizes before
    gpt2_cuda.gpt2_activations(model, 2, 16)
    assert model.allocated == sizes + [(2, 16)] and model.buffers["att"].size == 2 * 2 * 2 * 16 * 16


GEN_CONFIG = GPT2Config(max_seq_len=32, num_layers=1, num_heads=2, channels=16)   # GPT-2's V = 50257


def _gen_model():
    """A tiny model with GPT-2's vocabulary and logits of a few units (wte scaled), so that the
    draws are neither uniform nor always the same token."""
    cpu = gpt2_cpu.gpt2_init(GEN_CONFIG, 42)
    cpu.P["wte"] *= 20.0
    return cpu


@pytest.mark.parametrize("B,T,new_tokens", [(2, 16, 10), (1, 8, 12)])
def test_emulated_generate_matches_gpt2_cpu(emulated_gpu, B, T, new_tokens):
    # gpt2_cpu.generate with the CUDA forward: the same tokens as with gpt2_cpu's forward. The
    # window is min(maxT, 1 + new_tokens); (1,8,12) needs more than the training buffers hold
    cpu = _gen_model()
    model = gpt2_cuda.GPT2(GEN_CONFIG, "fp32", recompute=True)
    gpt2_cuda.upload_parameters(model, cpu.params)
    window = gpt2_cuda.sample_window(GEN_CONFIG, 1, new_tokens)
    gpt2_cuda.gpt2_allocate(model, (B, T), (1, window))
    forward = gpt2_cuda.sampling_forward(model)
    x = np.random.default_rng(0).integers(0, GEN_CONFIG.vocab_size, (1, window)).astype(np.int32)
    logits = forward(x)
    assert logits.shape == (1, window, GEN_CONFIG.padded_vocab_size)
    ref = gpt2_cpu.gpt2_forward(cpu, x)
    assert check_tensor(logits[0, 3], ref[0, 3], "one row, to the host", 1e-5, 1e-5)
    assert check_tensor(np.asarray(logits), ref, "all of it", 1e-5, 1e-5)
    ids = gpt2_cpu.generate(model, [3], new_tokens, gpt2_cpu.SamplerRNG(11), forward=forward)
    cpu_ids = gpt2_cpu.generate(cpu, [3], new_tokens, gpt2_cpu.SamplerRNG(11))
    assert ids == cpu_ids and len(set(ids)) > 1
    assert model.allocated == [(B, T), (1, window)]                  # the sampler used the allocation


# gpt2_cuda.py's flag for the emulated device, and the banner line it prints first
EMULATED = ["--device", "cpu"]


def _without_banner(out):
    """gpt2_cuda.py --device cpu's output without its first line, the emulated device's banner."""
    banner, rest = out.split("\n", 1)
    assert banner.startswith("gpt2_cuda.py --device cpu: the CUDA kernels run on the emulated device")
    return rest


def _synthetic_tokenizer(tmp_path):
    """A tokenizer file whose token i decodes to '<i>', so that printed samples give back their ids."""
    path = str(tmp_path / "tok.bin")
    tokenizer.write_tokenizer(path, [f"<{i}>".encode() for i in range(tokenizer.GPT2_EOT + 1)])
    return path


def _ids(text):
    return [int(i) for i in re.findall(r"<(\d+)>", text)]


def test_emulated_generate_flag_matches_gpt2_cpu(emulated_gpu, tmp_path, capsys):
    # --generate through gpt2_cuda.main: cli.sample_from_prompt with the CUDA forward streams
    # the same text as gpt2_cpu.py does, and it is the decoding of gpt2_cpu.generate's ids
    path = str(tmp_path / "gen.bin")
    gpt2_cpu.write_model(path, _gen_model())
    argv = ["-e", path, "--generate", "9", "--tokenizer", _synthetic_tokenizer(tmp_path), "--top-k", "40",
            "--temperature", "0.8", "--sample-seed", "5"]
    assert gpt2_cpu.main(argv) == 0
    cpu_out = capsys.readouterr().out
    assert gpt2_cuda.main(argv + ["--precision", "fp32"] + EMULATED) == 0
    cuda_out = _without_banner(capsys.readouterr().out)
    assert cuda_out == cpu_out
    ref = gpt2_cpu.generate(gpt2_cpu.read_model(path), [tokenizer.GPT2_EOT], 9, gpt2_cpu.SamplerRNG(5), 0.8, 40)
    assert _ids(cuda_out) == ref and len(set(ref)) > 1
    # the errors are gpt2_cpu's, one line each
    assert gpt2_cuda.main(["-e", path, "--generate", "3", "--tokenizer", str(tmp_path / "none.bin")] + EMULATED) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize("B,R", [(6, 4), (8, 8), (8, 4), (2, 4), (1, 4)])
def test_emulated_eval_forward_losses_pad_and_slice(emulated_gpu, B, R):
    # R rows (R <= max(B, 4)) are padded to the allocated rows; the losses of the R real rows come
    # back to the host and equal gpt2_cpu's per-position losses
    T = 12
    model = _tiny_model("fp32", True)
    rows = gpt2_cuda.eval_rows(B)
    assert rows == max(B, evalloader.NUM_COMPLETIONS)
    gpt2_cuda.gpt2_allocate(model, (B, T), (rows, T))
    forward_losses = gpt2_cuda.eval_forward_losses(model, B, T)
    rng = np.random.default_rng(B * 10 + R)
    inputs, targets = (rng.integers(0, TINY.vocab_size, (R, T)).astype(np.int32) for _ in range(2))
    losses = forward_losses(inputs, targets)
    assert type(losses) is np.ndarray and losses.shape == (R, T)            # host memory, R rows
    cpu = tiny_model_parameters(TINY, 42)
    gpt2_cpu.gpt2_forward(cpu, inputs, targets)
    assert check_tensor(losses, cpu.acts["losses"], "eval losses", 1e-5, 1e-5)
    assert model.allocated == list(dict.fromkeys([(B, T), (rows, T)])) and model.BT == (rows, T)   # no reallocation
    with pytest.raises(ValueError):
        forward_losses(np.zeros((rows + 1, T), np.int32), np.zeros((rows + 1, T), np.int32))


def _eval_file(tmp_path, n, V, seed=0):
    rng = np.random.default_rng(seed)
    examples = [{"index": i, "label": int(rng.integers(4)), "context": rng.integers(0, V, int(rng.integers(2, 6))).tolist(),
                 "completions": [rng.integers(0, V, int(rng.integers(1, 4))).tolist() for _ in range(4)]}
                for i in range(n)]
    path = str(tmp_path / "hellaswag.bin")
    evalloader.write_eval_file(path, examples)
    return path, examples


@pytest.mark.parametrize("B", [2, 8])
def test_emulated_eval_only_hellaswag_matches_gpt2_cpu(emulated_gpu, tmp_path, capsys, B):
    # --eval-only -h 1: the same val loss and the same accuracy as gpt2_cpu.py, and the accuracy
    # is the one gpt2_cpu's scoring rule gives with the CPU model (7 examples: a ragged last batch)
    data, model = _write_shards(tmp_path), _tiny_checkpoint(tmp_path)
    hs, examples = _eval_file(tmp_path, 7, TINY.vocab_size)
    argv = ["-e", model, "-i", data, "-j", data, "-b", str(B), "-t", "12", "-m", "3", "-h", "1",
            "--hellaswag-file", hs, "--eval-only"]
    assert gpt2_cpu.main(argv) == 0
    cpu_out = capsys.readouterr().out
    assert gpt2_cuda.main(argv + ["--precision", "fp32"] + EMULATED) == 0
    cuda_out = capsys.readouterr().out
    acc = re.search(r"HellaSwag: ([0-9.]+) accuracy over 7 examples", cuda_out).group(1)
    assert acc == re.search(r"HellaSwag: ([0-9.]+) accuracy over 7 examples", cpu_out).group(1)
    cpu = gpt2_cpu.read_model(model)
    correct = 0
    for ex in examples:
        inputs, targets, mask = evalloader.completion_rows(ex, 12)
        gpt2_cpu.gpt2_forward(cpu, inputs, targets)
        correct += evalloader.score_example(cpu.acts["losses"], mask) == ex["label"]
    assert float(acc) == pytest.approx(correct / 7, abs=1e-4)
    val, cpu_val = (float(re.search(r"val loss ([0-9.]+)", out).group(1)) for out in (cuda_out, cpu_out))
    assert val == pytest.approx(cpu_val, rel=1e-5)


def test_emulated_training_evals_and_samples_match_gpt2_cpu(emulated_training, tmp_path, capsys):
    # -h 1 every -v steps (logged s:<step> eval:<acc>) and samples every -s steps during training:
    # the same log and the same sample text as gpt2_cpu.py. B=1, T=8, -g 12: the sampler's
    # window (13) needs more than the training buffers, so train() allocates for both up front
    data = _write_shards(tmp_path, V=GEN_CONFIG.vocab_size)
    model = str(tmp_path / "gen.bin")
    gpt2_cpu.write_model(model, _gen_model())
    hs, _ = _eval_file(tmp_path, 5, GEN_CONFIG.vocab_size, seed=1)
    common = ["-e", model, "-i", data, "-j", "", "-b", "1", "-t", "8", "-x", "4", "-v", "2", "-s", "2", "-g", "12",
              "-l", "1e-4", "-h", "1", "--hellaswag-file", hs, "--tokenizer", _synthetic_tokenizer(tmp_path)]
    cpu_dir, cuda_dir = str(tmp_path / "cpu"), str(tmp_path / "cuda")
    assert gpt2_cpu.main(common + ["-o", cpu_dir]) == 0
    cpu_out = capsys.readouterr().out
    trained = gpt2_cuda.train(gpt2_cuda.parse_args(common + ["-o", cuda_dir, "--precision", "fp32"] + EMULATED))
    cuda_out = capsys.readouterr().out
    # one allocation for the whole run: training, HellaSwag's 4 rows, the sampler's window
    assert trained.allocated == [(1, 8), (4, 8), (1, 13)]
    samples = [re.findall(r"generating:\n---\n(.*)\n---", out) for out in (cuda_out, cpu_out)]
    assert len(samples[0]) == 2 and samples[0] == samples[1]                   # steps 2 and 4
    assert all(len(_ids(s)) == 12 for s in samples[0])
    logs = [open(os.path.join(d, "main.log")).read().splitlines() for d in (cuda_dir, cpu_dir)]
    evals = [[line for line in log if " eval:" in line] for log in logs]
    assert [e.split()[0] for e in evals[0]] == ["s:2", "s:4"] and evals[0] == evals[1]
    for got, ref in zip(_train_losses(os.path.join(cuda_dir, "main.log")).values(),
                        _train_losses(os.path.join(cpu_dir, "main.log")).values()):
        assert got == pytest.approx(ref, rel=1e-5)


def test_emulated_log_gpu_every(emulated_training, monkeypatch, tmp_path, capsys):
    # -lg 2: a memory line every 2 steps (the emulated device's memory query made to report 2 of
    # 8 GiB in use; NVML is absent here)
    monkeypatch.setattr(emulated_training.cuda.runtime, "memGetInfo", lambda: (6 * 2**30, 8 * 2**30))   # (free, total)
    data = _write_shards(tmp_path)
    model = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    common = ["-e", model, "-i", data, "-j", "", "-b", "1", "-t", "8", "-x", "4", "-s", "0", "-l", "1e-3"]
    assert gpt2_cuda.main(common + ["--precision", "fp32", "-lg", "2"] + EMULATED) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("gpu 0: memory")]
    assert len(lines) == 2 and lines[0].startswith("gpu 0: memory 2.00 of 8.00 GiB in use")


@pytest.mark.slow                      # 136 optimizer steps on the emulated device: 25-65 s on 2 shared cores
def test_emulated_outlier_skipping_matches_gpt2_cpu(emulated_training, tmp_path, capsys):
    # -sg through llmc/cli.py: once the 128-step windows are full both trainers print the same
    # z-scores and skip the same updates (fp32, so the norms agree to ~1e-6)
    data = _write_shards(tmp_path, n_tokens=20000)
    model = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    common = ["-e", model, "-i", data, "-j", "", "-b", "1", "-t", "8", "-x", "136", "-s", "0", "-l", "1e-3",
              "-k", "constant", "-sg", "0.001"]
    assert gpt2_cpu.main(common) == 0
    cpu_out = capsys.readouterr().out
    assert gpt2_cuda.main(common + ["--precision", "fp32"] + EMULATED) == 0
    cuda_out = capsys.readouterr().out

    def skips_and_z(out):
        return (re.findall(r"skipping update due to grad z-score of (-?[0-9.]+)", out),
                re.findall(r"\| norm [0-9.]+ \(([+-][0-9.]+)z\)", out))
    (cpu_skips, cpu_z), (cuda_skips, cuda_z) = skips_and_z(cpu_out), skips_and_z(cuda_out)
    assert len(cpu_z) == 8 and cuda_z == cpu_z
    assert len(cpu_skips) >= 1 and len(cuda_skips) == len(cpu_skips)
    # a z-score divides by the window's spread: 130 steps of fp32 reordering show at ~3e-3 of it
    np.testing.assert_allclose(np.array(cuda_skips, float), np.array(cpu_skips, float), rtol=1e-2)


def _tiny_checkpoint(tmp_path):
    path = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(path, gpt2_cpu.gpt2_init(TINY, 42))
    return path


def test_emulated_cross_resume_with_gpt2_cpu(emulated_training, tmp_path, capsys):
    # the CUDA trainer writes gpt2_cpu's checkpoint files: gpt2_cpu resumes them, and vice versa,
    # and the resumed losses match an uninterrupted run
    data, model = _write_shards(tmp_path), _tiny_checkpoint(tmp_path)
    common = ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "16", "-v", "0", "-s", "0", "-l", "1e-3"]
    gpu = common + ["--precision", "fp32"] + EMULATED
    straight, a, b = (str(tmp_path / d) for d in ("straight", "a", "b"))
    assert gpt2_cpu.main(common + ["-x", "6", "-o", straight]) == 0
    ref = _train_losses(os.path.join(straight, "main.log"))
    # CUDA 0..3, then CPU 3..6
    assert gpt2_cuda.main(gpu + ["-x", "6", "-n", "3", "-o", a]) == 0
    assert os.path.exists(os.path.join(a, "DONE_00000003"))
    os.remove(os.path.join(a, "DONE_00000006"))                            # pretend it stopped at step 3
    assert gpt2_cpu.main(common + ["-x", "6", "-y", "1", "-o", a]) == 0
    # CPU 0..3, then CUDA 3..6
    assert gpt2_cpu.main(common + ["-x", "6", "-n", "3", "-o", b]) == 0
    os.remove(os.path.join(b, "DONE_00000006"))
    assert gpt2_cuda.main(gpu + ["-x", "6", "-y", "1", "-o", b]) == 0
    for run in (a, b):
        got = _train_losses(os.path.join(run, "main.log"))
        assert sorted(got) == sorted(ref)
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5), (run, step)
    out = capsys.readouterr().out
    assert "MFU n/a" in out and "resumed from" in out


def test_emulated_bf16_training_writes_master_weights(emulated_training, tmp_path):
    data, model = _write_shards(tmp_path), _tiny_checkpoint(tmp_path)
    out = str(tmp_path / "run")
    args = ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "16", "-v", "0", "-s", "0", "-x", "2", "-n", "2",
            "-o", out, "--precision", "bf16"] + EMULATED
    assert gpt2_cuda.main(args) == 0
    saved = gpt2_cpu.read_model(os.path.join(out, "model_00000002.bin"))
    st = checkpoint.read_state(os.path.join(out, "state_00000002_00000.bin"), saved.num_parameters, 0, 1)
    assert st["master_weights"] is not None
    # the model file holds the bf16 values the run computes with (as llm.c's), upcast: exactly
    # representable in bf16, and not the master weights, which the state file holds
    np.testing.assert_array_equal(float32_to_bfloat16_bits(saved.params).astype(np.uint32) << 16,
                                  saved.params.view(np.uint32))
    assert not np.array_equal(st["master_weights"], saved.params)
    assert st["rng_state_last_update"] != 0 and st["step"] == 2
    # resuming restores all of it exactly: master weights, the stochastically rounded bf16
    # parameters, m, v, RNG, loader
    model = gpt2_cuda.GPT2(TINY, "bf16", master_weights=True)
    loader = dataloader.DataLoader(data, 2, 16)
    step, sample_state, _, _ = gpt2_cuda.load_model_checkpoint(out, 2, model, loader, 0, 1)
    assert step == 2 and sample_state == st["sample_rng_state"] and loader.current_sample_idx == 2
    np.testing.assert_array_equal(model.master.get(), st["master_weights"])
    np.testing.assert_array_equal(model.params.get(), float32_to_bfloat16_bits(saved.params))
    np.testing.assert_array_equal(model.m.get(), st["m"])
    np.testing.assert_array_equal(model.v.get(), st["v"])
    assert model.update_rng.state == st["rng_state_last_update"] != gpt2_cuda.UPDATE_SEED


def test_emulated_bf16_resume_equals_the_straight_run_byte_for_byte(emulated_training, tmp_path):
    """bf16 with master weights (the GPU default): a run resumed from its step-2 checkpoint prints
    the straight run's losses and writes the straight run's files, byte for byte."""
    data, model = _write_shards(tmp_path), _tiny_checkpoint(tmp_path)
    common = ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "16", "-v", "0", "-s", "0", "-l", "1e-2",
              "-x", "4", "-n", "2", "--precision", "bf16"] + EMULATED
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    assert gpt2_cuda.main(common + ["-o", straight]) == 0
    shutil.copytree(straight, resumed)
    for name in ("DONE_00000004", "model_00000004.bin", "state_00000004_00000.bin", "config_00000004.json"):
        os.remove(os.path.join(resumed, name))                           # as if it had stopped at step 2
    assert gpt2_cuda.main(common + ["-y", "1", "-o", resumed]) == 0
    assert _train_losses(os.path.join(resumed, "main.log")) == _train_losses(os.path.join(straight, "main.log"))
    for name in ("model_00000004.bin", "state_00000004_00000.bin"):
        with open(os.path.join(straight, name), "rb") as a, open(os.path.join(resumed, name), "rb") as b:
            assert a.read() == b.read(), name


# ----------------------------------------------------------------------------
# part 2: the kernels, on a GPU and on the emulated device

# Kernel tolerances: llmc.check.TOLERANCES['kernel_fp32' / 'kernel_bf16'] (absolute atol, inputs ~N(0,1)).
# The checks themselves are in tests/cuda_kernel_checks.py (tests/test_gpu_training_shapes.py runs
# them at the shapes training uses).


def _cp():
    return llmc.cuda.cupy()


PRECISION_PARAMS = pytest.mark.parametrize("precision", ["fp32", "bf16"])


def on_devices(small, large=()):
    """pytest parameters (device, *shape) for the `device` fixture: every shape on a GPU ("cuda",
    marked gpu), the small ones also on the emulated device ("cpu"); the large ones (768 channels,
    50304 logits, 1<<20 parameters) would take minutes there."""
    return ([pytest.param("cuda", *shape, marks=pytest.mark.gpu) for shape in list(small) + list(large)]
            + [pytest.param("cpu", *shape, id="emulated" + "".join(f"-{v}" for v in shape)) for shape in small])


@pytest.fixture
def device(request, monkeypatch):
    """The device of a kernel test (its parameter): "cuda", the GPU, or "cpu", the emulated
    device; llmc.cuda's device is restored after the test."""
    monkeypatch.setattr(llmc.cuda, "_device", llmc.cuda.device())
    llmc.cuda.use_device(request.param)
    return request.param


@pytest.fixture
def gpu_rng():
    return np.random.default_rng(2024)


@pytest.mark.gpu
def test_cublas_enums_match_cupy():
    from cupy_backends.cuda.libs import cublas
    from cupy_backends.cuda.api import runtime
    assert (llmc.cuda.CUBLAS_OP_N, llmc.cuda.CUBLAS_OP_T) == (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
    assert llmc.cuda.CUBLAS_COMPUTE_32F == cublas.CUBLAS_COMPUTE_32F
    assert llmc.cuda.CUBLAS_COMPUTE_32F_FAST_TF32 == cublas.CUBLAS_COMPUTE_32F_FAST_TF32
    assert llmc.cuda.CUBLAS_GEMM_DEFAULT == cublas.CUBLAS_GEMM_DEFAULT
    assert llmc.cuda.CUBLAS_POINTER_MODE_HOST == cublas.CUBLAS_POINTER_MODE_HOST
    assert (llmc.cuda.CUDA_R_32F, llmc.cuda.CUDA_R_16BF) == (runtime.CUDA_R_32F, runtime.CUDA_R_16BF)


@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,C,Vp", on_devices([(2, 3, 16, 24), (3, 37, 64, 128)], [(4, 64, 768, 256)]),
                         indirect=["device"])
def test_encoder_kernels(device, gpu_rng, precision, B, T, C, Vp):
    check_encoder(gpu_rng, precision, B, T, C, Vp, frequent=0.3)     # a third of the batch: chunked


@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,C", on_devices([(1, 1, 8), (2, 37, 96)], [(4, 64, 768), (3, 100, 1600)]),
                         indirect=["device"])
def test_layernorm_kernels(device, gpu_rng, precision, B, T, C):
    check_layernorm(gpu_rng, precision, B, T, C)


@PRECISION_PARAMS
@pytest.mark.parametrize("device,n,OC", on_devices([(1, None), (7, None), (4096 + 3, None), (3 * 37 * 4 * 96, 4 * 96)]),
                         indirect=["device"])
def test_gelu_kernels(device, gpu_rng, precision, n, OC):
    check_gelu(gpu_rng, precision, n, OC)


# OC = 13: bias_backward's one-column groups (no 16-byte loads); B*T = 2800: 11 rows per bias chunk,
# each warp of the block taking several
@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,C,OC", on_devices([(2, 3, 16, 24), (3, 37, 96, 288), (2, 5, 16, 13), (4, 700, 16, 24)],
                                                       [(4, 64, 768, 3072), (1, 5, 64, 50304)]), indirect=["device"])
def test_matmul_and_bias_kernels(device, gpu_rng, precision, B, T, C, OC):
    check_matmul_and_bias(gpu_rng, precision, B, T, C, OC)


@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,NH,HS", on_devices([(1, 1, 1, 8), (2, 37, 3, 16), (1, 128, 2, 8)], [(4, 64, 12, 64)]),
                         indirect=["device"])
def test_attention_kernels(device, gpu_rng, precision, B, T, NH, HS):
    check_attention(gpu_rng, precision, B, T, NH, HS)


@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,V,Vp", on_devices([(1, 1, 5, 8), (2, 37, 1000, 1024)], [(2, 64, 50257, 50304)]),
                         indirect=["device"])
def test_classifier_kernel(device, gpu_rng, precision, B, T, V, Vp):
    check_classifier(gpu_rng, precision, B, T, V, Vp)


@pytest.mark.parametrize("device", on_devices([()]), indirect=True)
def test_classifier_block_reduction_on_rows_that_stress_it(device):
    """kernels/common.cuh blockReduceSoftmax on the rows that test its merge, in fp32 against a
    float64 logsumexp: row 0 spans 1e4 (most threads' sums rescale to 0 against the block's max),
    row 1 has one finite logit among -inf (every other thread's state is empty: m = -inf, sum 0),
    row 2 holds a NaN (a diverged model shows a NaN loss, and NaN gradients)."""
    cp = llmc.cuda.cupy()
    V, Vp, rows = 1000, 1024, 3
    rng = np.random.default_rng(11)
    logits = np.zeros((rows, Vp), np.float32)
    logits[0] = rng.uniform(-5000, 5000, Vp)
    logits[1] = -np.inf
    logits[1, 777] = 3.0
    logits[2] = rng.standard_normal(Vp)
    logits[2, 5] = np.nan
    logits[:, V:] = 1e30                                   # padding: must be ignored
    targets = np.array([int(np.argmax(logits[0, :V])) - 1, 777, 9], np.int32)
    real = logits[:, :V].astype(np.float64)
    top = real[:2].max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(real[:2] - top).sum(axis=1))
    expected = lse - real[np.arange(2), targets[:2]]
    dev = cp.asarray(logits)
    losses = cp.full((rows,), np.nan, np.float32)
    dloss = 0.25
    gpt2_cuda.fused_classifier(dev, losses, cp.asarray(targets), dloss, 1, rows, V, Vp, write_dlogits=True)
    got, dlogits = losses.get(), dev.get()
    np.testing.assert_allclose(got[:2], expected, rtol=1e-6, atol=1e-4)
    assert got[1] == 0.0 and np.all(dlogits[1] == 0.0), "p = 1 at the one finite logit, 0 elsewhere"
    probs = np.exp(real[0] - lse[0])
    np.testing.assert_allclose(dlogits[0, :V], (probs - (np.arange(V) == targets[0])) * dloss, atol=1e-7)
    assert np.isnan(got[2]) and np.isnan(dlogits[2, :V]).all()
    assert np.all(dlogits[:, V:] == 0.0)


@pytest.mark.parametrize("device", on_devices([()]), indirect=True)
def test_stochastic_rounding_near_the_largest_float_never_gives_nan(device):
    # AdamW's bf16 store of a value just under float32's largest: the stochastic carry out of the
    # largest finite bf16 must give inf (the high half 0x7F80), never NaN (kernels/common.cuh)
    cp = _cp()
    n = 4096
    big = np.full(n, np.finfo(np.float32).max, np.float32)
    params, master = cp.asarray(float32_to_bfloat16_bits(big)), cp.asarray(big)
    zeros = cp.zeros(n, np.float32)
    grads = cp.zeros(n, np.uint16)
    gpt2_cuda.adamw_update_tensor(params, master, grads, zeros, zeros.copy(), n, 0.0, 0.9, 0.95, 0.1, 0.05, 1e-8, 0.0, 1.0, 7)
    bits = params.get()
    assert set(np.unique(bits).tolist()) <= {0x7F7F, 0x7F80}, "the largest finite bf16 or +inf"
    assert (bits == 0x7F80).any(), "some draws carry out of the largest finite value"


@PRECISION_PARAMS
@pytest.mark.parametrize("device,n", on_devices([(1,), (1000,)], [(1 << 20,)]), indirect=["device"])
def test_adamw_norm_and_cast_kernels(device, gpu_rng, precision, n):
    check_adamw_norm_cast(gpu_rng, precision, n)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_124M_matches_gpt2_cpu(precision, monkeypatch):
    # the 124M shape at B=4, T=64: every activation, the logits, the loss and every gradient
    cfg = gpt2_cpu.config_from_descriptor("d12")
    model = gpt2_cuda.GPT2(cfg, precision, master_weights=True, recompute=True)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
    rng = np.random.default_rng(5)
    x, y = (rng.integers(0, cfg.vocab_size, (4, 64)).astype(np.int32) for _ in range(2))
    assert cuda_check.check_against_cpu(gpt2_cuda, model, x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_ten_training_steps_match_gpt2_cpu(precision, rtol, monkeypatch):
    cfg = gpt2_cpu.config_from_descriptor("d4")
    model = gpt2_cuda.GPT2(cfg, precision, master_weights=True, recompute=True)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
    cpu = gpt2_cpu.gpt2_init(cfg, 42)
    rng = np.random.default_rng(9)
    x, y = (rng.integers(0, 5000, (4, 64)).astype(np.int32) for _ in range(2))   # one batch: the loss must fall
    losses, cpu_losses = [], []
    for step in range(1, 11):
        for m, fwd, bwd, zero, norm_fn, upd, out in (
                (model, gpt2_cuda.gpt2_forward, gpt2_cuda.gpt2_backward, gpt2_cuda.gpt2_zero_grad, gpt2_cuda.gpt2_grad_norm,
                 gpt2_cuda.gpt2_update, losses),
                (cpu, gpt2_cpu.gpt2_forward, gpt2_cpu.gpt2_backward, gpt2_cpu.gpt2_zero_grad, gpt2_cpu.gpt2_grad_norm,
                 gpt2_cpu.gpt2_update, cpu_losses)):
            zero(m)
            fwd(m, x, y)
            out.append(gpt2_cuda.gpt2_mean_loss(m) if m is model else m.mean_loss)
            bwd(m)
            norm = norm_fn(m)
            upd(m, 1e-3, 0.9, 0.95, 1e-8, 0.0, step, 1.0 / norm if norm > 1.0 else 1.0)
    print("cuda:", losses, "\ncpu: ", cpu_losses)
    np.testing.assert_allclose(losses, cpu_losses, rtol=rtol)
    assert cpu_losses[-1] < cpu_losses[0] - 1.0


@pytest.mark.parametrize("device", on_devices([()]), indirect=True)
def test_sampling_and_eval_forwards_match_gpt2_cpu(device):
    # the CuPy side of the two forwards handed to gpt2_cpu: HostLogits' row copies, the padded
    # HellaSwag batch; fp32 without TF32, so that a tiny model samples the very same tokens
    cpu = _gen_model()
    model = gpt2_cuda.GPT2(GEN_CONFIG, "fp32", recompute=True)
    gpt2_cuda.upload_parameters(model, cpu.params)
    B, T = 2, 16
    gpt2_cuda.gpt2_allocate(model, (B, T), (gpt2_cuda.eval_rows(B), T), (1, 21))
    ids = gpt2_cpu.generate(model, [3], 20, gpt2_cpu.SamplerRNG(11), forward=gpt2_cuda.sampling_forward(model))
    assert ids == gpt2_cpu.generate(cpu, [3], 20, gpt2_cpu.SamplerRNG(11)) and len(set(ids)) > 1
    rng = np.random.default_rng(1)
    inputs, targets = (rng.integers(0, GEN_CONFIG.vocab_size, (4, T)).astype(np.int32) for _ in range(2))
    losses = gpt2_cuda.eval_forward_losses(model, B, T)(inputs, targets)
    gpt2_cpu.gpt2_forward(cpu, inputs, targets)
    assert type(losses) is np.ndarray
    assert check_tensor(losses, cpu.acts["losses"], "eval losses", 1e-4, 1e-4)
    assert model.allocated == [(B, T), (4, T), (1, 21)]


@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_cross_resume_cpu_cuda(tmp_path, precision, rtol):
    data = _write_shards(tmp_path, n_tokens=50_000, V=50257)
    common = ["-e", "d2", "-i", data, "-j", "", "-b", "4", "-t", "64", "-v", "0", "-s", "0", "-l", "1e-3"]
    gpu = common + ["--precision", precision, "-f", "0"]
    straight, a, b = (str(tmp_path / d) for d in ("straight", "a", "b"))
    assert gpt2_cpu.main(common + ["-x", "8", "-o", straight]) == 0
    ref = _train_losses(os.path.join(straight, "main.log"))
    assert gpt2_cuda.main(gpu + ["-x", "8", "-n", "4", "-o", a]) == 0
    os.remove(os.path.join(a, "DONE_00000008"))
    assert gpt2_cpu.main(common + ["-x", "8", "-y", "1", "-o", a]) == 0
    assert gpt2_cpu.main(common + ["-x", "8", "-n", "4", "-o", b]) == 0
    os.remove(os.path.join(b, "DONE_00000008"))
    assert gpt2_cuda.main(gpu + ["-x", "8", "-y", "1", "-o", b]) == 0
    for run in (a, b):
        got = _train_losses(os.path.join(run, "main.log"))
        assert sorted(got) == sorted(ref)
        np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=rtol)


# ----------------------------------------------------------------------------
# part 3: flash attention (kernels/flash_attention.cu): the real kernels, on a GPU and (emulated)
# at the small shapes, against gpt2_cpu's attention in float64, and lse against a float64
# log-sum-exp computed here


def _flash_reference(qkv, dout, NH):
    """out (B,T,C), lse (B,NH,T), dqkv (B,T,3C) in float64 from float64 qkv, dout: gpt2_cpu's
    attention and a log-sum-exp of the masked, scaled scores written out here."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    out, att = gpt2_cpu.attention_forward(qkv, NH)
    dqkv = gpt2_cpu.attention_backward(dout, qkv, att, NH)
    q, k = (qkv.reshape(B, T, 3, NH, HS)[:, :, i].transpose(0, 2, 1, 3) for i in range(2))   # (B,NH,T,HS)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HS)                      # (B,NH,T,T)
    s[..., np.triu(np.ones((T, T), bool), 1)] = -np.inf
    top = s.max(axis=-1)
    lse = top + np.log(np.exp(s - top[..., None]).sum(axis=-1))
    return out, lse, dqkv


def _check_flash(precision, out, lse, dqkv, ref, label):
    """out and dq, dk, dv with the attention kernels' tolerance; lse (fp32 arithmetic in both
    precisions) with the fp32 one."""
    ref_out, ref_lse, ref_dqkv = ref
    B, T, C = ref_out.shape
    atol, rtol = TOLERANCES[f"kernel_{precision}"]["attention"]
    ok = check_tensor(out, ref_out, f"{label} out [{precision}]", atol, rtol)
    ok &= check_tensor(lse, ref_lse, f"{label} lse [{precision}]", *TOLERANCES["kernel_fp32"]["attention"])
    got = np.asarray(dqkv, np.float64).reshape(B, T, 3, C)
    for i, name in enumerate(("dq", "dk", "dv")):
        ok &= check_tensor(got[:, :, i], ref_dqkv.reshape(B, T, 3, C)[:, :, i], f"{label} {name} [{precision}]", atol, rtol)
    return ok


def test_flash_attention_tiles_and_support():
    # kernels/flash_attention.cu's tile shapes (tests/test_flash_attention_host.py checks the table
    # against the .cu): bf16 HS = 64 runs 4 warps of two 16-row tiles, 128 query rows a block
    fwd, dkdv, dq = llmc.attention.FLASH_TILES["bf16", 64]
    assert (fwd.rows, fwd.keys, dkdv.keys, dkdv.queries, dq.rows, dq.keys) == (128, 64, 64, 32, 64, 64)
    assert llmc.attention.flash_forward_launch(fwd, 64, 2, 4, 1024, 12) == ((48, 8), 128, 48 * 1024)
    fwd = llmc.attention.FLASH_TILES["fp32", 128][0]
    assert llmc.attention.flash_forward_launch(fwd, 128, 4, 1, 70, 2) == ((2, 2), 128, (64 + 128) * 128 * 4)
    assert [HS for HS in range(1, 257) if llmc.attention.flash_attention_supported(HS)] == [16, 32, 64, 128]


@pytest.mark.parametrize("precision,recompute,B,T", [("fp32", True, 3, 16), ("bf16", False, 2, 13)])
def test_emulated_model_on_flash_path_matches_gpt2_cpu(emulated_gpu, precision, recompute, B, T):
    # the whole model with attention="flash": every activation and gradient against gpt2_cpu
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, recompute=recompute, attention="flash")
    gpt2_cuda.upload_parameters(model, tiny_model_parameters(TINY, 42).params)
    rng = np.random.default_rng(11)
    x, y = (rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32) for _ in range(2))
    assert cuda_check.check_against_cpu(gpt2_cuda, model, x, y, np.float64)


# (B, T, NH, HS): T = 70, a partial last block; T = 1, one row. The small shapes also run on the
# emulated device, except those tests/test_flash_attention_host.py runs there already
FLASH_SMALL_SHAPES = [(2, 64, 4, 64), (1, 70, 3, 64), (1, 70, 2, 16), (2, 70, 2, 32), (1, 70, 2, 128), (3, 1, 2, 64),
                      (1, 70, 3, 16), (1, 1, 2, 16)]
FLASH_LARGE_SHAPES = [(2, 1024, 2, 64), (1, 1024, 2, 128), (1, 1024, 2, 16)]


def _flash_on_gpu(qkv, dout, B, T, NH, precision):
    """Run the real kernels on poisoned outputs; return out, lse, dqkv on the host (float32)."""
    cp = _cp()
    C = NH * qkv.shape[-1] // 3 // NH
    qkv_d, dout_d = to_device(qkv, precision), to_device(dout, precision)
    out, lse = poisoned((B, T, C), precision), cp.full((B, NH, T), np.nan, np.float32)
    llmc.attention.flash_attention_forward(out, lse, qkv_d, B, T, C, NH)
    dqkv, D = poisoned((B, T, 3 * C), precision), cp.full((B, NH, T), np.nan, np.float32)
    llmc.attention.flash_attention_backward(dqkv, D, dout_d, out, qkv_d, lse, B, T, C, NH)
    # D = rowsum(dout * out) of the stored (floatX) out
    ref_D = (as_input(dout, precision) * to_host(out)).reshape(B, T, NH, -1).sum(axis=-1).transpose(0, 2, 1)
    assert check_tensor(D.get(), ref_D, f"D [{precision}]", *TOLERANCES["kernel_fp32"]["attention"])
    return to_host(out), lse.get(), to_host(dqkv), dqkv


@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,NH,HS", on_devices(FLASH_SMALL_SHAPES, FLASH_LARGE_SHAPES), indirect=["device"])
def test_flash_attention_kernels(device, gpu_rng, precision, B, T, NH, HS):
    C = NH * HS
    qkv, dout = gpu_rng.standard_normal((B, T, 3 * C)), gpu_rng.standard_normal((B, T, C))
    out, lse, dqkv, _ = _flash_on_gpu(qkv, dout, B, T, NH, precision)
    ref = _flash_reference(as_input(qkv, precision), as_input(dout, precision), NH)
    assert _check_flash(precision, out, lse, dqkv, ref, f"B={B} T={T} NH={NH} HS={HS}")


# (B, T, NH, NKV, HS): grouped-query attention, each kv head shared by NH/NKV query heads and read in
# place; the large ones Llama 3 8B's head size with 4 query heads per kv head
FLASH_GQA_SMALL_SHAPES = [(1, 70, 4, 2, 64), (1, 45, 4, 1, 128), (2, 33, 6, 2, 16)]
FLASH_GQA_LARGE_SHAPES = [(2, 1024, 8, 2, 128), (1, 1024, 12, 4, 64)]


@PRECISION_PARAMS
@pytest.mark.parametrize("device,B,T,NH,NKV,HS", on_devices(FLASH_GQA_SMALL_SHAPES, FLASH_GQA_LARGE_SHAPES),
                         indirect=["device"])
def test_flash_attention_grouped_kv(device, gpu_rng, precision, B, T, NH, NKV, HS):
    # against gpt2_cpu's attention on llama3_cpu's repeated heads, the kv heads' gradients summed
    import llama3_cpu
    C, G = NH * HS, NH // NKV
    qkv, dout = gpu_rng.standard_normal((B, T, (NH + 2 * NKV) * HS)), gpu_rng.standard_normal((B, T, C))
    qkv_d, dout_d = to_device(qkv, precision), to_device(dout, precision)
    out, lse = poisoned((B, T, C), precision), _cp().full((B, NH, T), np.nan, np.float32)
    llmc.attention.flash_attention_forward(out, lse, qkv_d, B, T, C, NH, NKV)
    dqkv, D = poisoned(qkv.shape, precision), _cp().full((B, NH, T), np.nan, np.float32)
    llmc.attention.flash_attention_backward(dqkv, D, dout_d, out, qkv_d, lse, B, T, C, NH, NKV)
    q, k, v = llama3_cpu.split_qkv(as_input(qkv, precision), NH, NKV)
    full = llama3_cpu.merge_heads(q, llama3_cpu.repeat_kv_forward(k, G), llama3_cpu.repeat_kv_forward(v, G))
    ref_out, ref_lse, ref_dfull = _flash_reference(full, as_input(dout, precision), NH)
    dq, dk, dv = llama3_cpu.split_qkv(ref_dfull, NH, NH)
    ref_dqkv = llama3_cpu.merge_heads(dq, llama3_cpu.repeat_kv_backward(dk, G), llama3_cpu.repeat_kv_backward(dv, G))
    atol, rtol = TOLERANCES[f"kernel_{precision}"]["attention"]
    label = f"B={B} T={T} NH={NH} NKV={NKV} HS={HS} [{precision}]"
    assert check_tensor(to_host(out), ref_out, f"{label} out", atol, rtol)
    assert check_tensor(lse.get(), ref_lse, f"{label} lse", *TOLERANCES["kernel_fp32"]["attention"])
    assert check_tensor(to_host(dqkv), ref_dqkv, f"{label} dqkv", atol, rtol)


@pytest.mark.gpu
@PRECISION_PARAMS
def test_flash_attention_backward_is_deterministic(gpu_rng, precision):
    # no atomics: two runs of the backward on the same inputs are bitwise equal
    B, T, NH, HS = 2, 1024, 4, 64
    C = NH * HS
    qkv, dout = gpu_rng.standard_normal((B, T, 3 * C)), gpu_rng.standard_normal((B, T, C))
    first = _flash_on_gpu(qkv, dout, B, T, NH, precision)[3].get()
    second = _flash_on_gpu(qkv, dout, B, T, NH, precision)[3].get()
    assert np.isfinite(gpt2_cuda.as_float32(first)).all()
    np.testing.assert_array_equal(first.view(np.uint16 if precision == "bf16" else np.uint32),
                                  second.view(np.uint16 if precision == "bf16" else np.uint32))
