"""LoRA in the CUDA trainers (llmc/lora_device.py: the adapters' cuBLAS GEMMs, the adapters' buffers,
the LoRA matmul backend; gpt2_cuda.py / llama3_cuda.py: the frozen model, the step on the adapters)
on the emulated CUDA device, each against llama3_cpu.py / gpt2_cpu.py (tests/test_lora.py checks
those against finite differences and tests/test_lora_peft.py against PEFT):
  - --check's comparison (llmc/cuda_check.py) with adapters on every linear layer, lora_B made
    nonzero: every activation and every adapter gradient in fp32 and bf16, on the naive and flash
    attention paths, for both families, and with GPT-2's GPU defaults (cuBLASLt's fused epilogues
    on the frozen layers, cuDNN attention); the same comparison fails when an adapter's backward is broken;
  - a LoRA training run (fp32) prints the NumPy trainer's losses and saves its adapters (PEFT's
    files), the frozen base unchanged on the device, with no gradient, moment or master-weight buffer;
  - the KV-cached sampler on the device draws the NumPy trainer's ids from the adapted model;
  - a micro-batch replayed as a CUDA graph equals the eager one bit for bit (the adapters' GEMMs,
    their h buffers and scratch inside the capture);
  - mpiexec -n 2 (llama3_cuda.py) and -pm fs (gpt2_cuda.py) with ZeRO-1 (the adapters' AdamW state
    sharded) train the adapters the NumPy trainer trains on the whole batch in one process, and fs
    ranks started with different LoRA flags stop at once;
  - the device memory of LoRA against full training, counted by the emulated device's pool, is
    smaller by the gradients, moments and master weights the frozen base does without (a bound
    from the parameter count, not a measured number: dev/lora_memory.py prints those).
Run: python -m pytest -q tests/test_lora_cuda.py   (a few minutes on 2 cores once the kernels are built)
"""

import os
import sys

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llama3_cpu
import llama3_cuda
import llmc.lora_device
import llmc.matmul
from emulated_gpu import _train_losses
from llmc import cuda
from llmc import lora as lora_files
from llmc.cuda_check import check_against_cpu, check_llama3_against_cpu
from llmc.formats import write_shard
from mpi_marks import needs_mpi, run_ok
from test_cuda_graph import capture  # noqa: F401 (the fixture, used by name)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# tiny models the kernels run (HS = 16: flash attention's smallest tile; bf16's 8-value vectors)
GPT2_TINY = gpt2_cpu.GPT2Config(max_seq_len=16, vocab_size=75, padded_vocab_size=128, num_layers=2, num_heads=2,
                                channels=32)
LLAMA_TINY = llama3_cpu.LlamaConfig(max_seq_len=16, vocab_size=75, num_layers=2, num_heads=4, num_kv_heads=2,
                                    channels=64, multiple_of=32)
RANK, ALPHA = 4, 8.0
B, T = 2, 16
FAMILIES = {"gpt2": (gpt2_cpu, gpt2_cuda, GPT2_TINY), "llama3": (llama3_cpu, llama3_cuda, LLAMA_TINY)}


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda, "_device", "cpu")
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)      # the same kernel, a shorter fixed order


def device_model(name, precision, attention="naive", seed=3, matmul=None):
    """A tiny model of family `name` on the device with rank-RANK adapters on every linear layer
    (fresh: lora_B 0, as --check finds them), the base frozen; matmul: GPT-2's backend (Cublas)."""
    cpu, trainer, config = FAMILIES[name]
    host = gpt2_cpu.gpt2_init(config, seed) if cpu is gpt2_cpu else llama3_cpu.llama3_init(config, seed)
    lora = gpt2_cpu.lora_init(cpu.lora_targets(config), config.num_layers, RANK, ALPHA, seed)
    if cpu is gpt2_cpu:
        model = gpt2_cuda.GPT2(config, precision, recompute=0, attention=attention, trainable=False, matmul=matmul)
    else:
        model = llama3_cuda.Llama3(config, precision, attention, trainable=False)
    trainer.upload_parameters(model, host.params)
    gpt2_cuda.attach_lora(model, lora)
    return model


def check(name, model, verbose=False):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 75, (B, 13)), rng.integers(0, 75, (B, 13))
    _, trainer, _ = FAMILIES[name]
    compare = check_against_cpu if trainer is gpt2_cuda else check_llama3_against_cpu
    return compare(trainer, model, x, y, verbose=verbose)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("precision,attention", [("fp32", "naive"), ("bf16", "naive"), ("bf16", "flash")])
def test_check_passes_with_adapters_on_every_linear_layer(emulated, name, precision, attention, capsys):
    model = device_model(name, precision, attention)
    assert model.grads is None and model.m.size == 0 and model.master is None       # a frozen base
    assert check(name, model, verbose=True), capsys.readouterr().out
    out = capsys.readouterr().out
    assert "fresh lora_B (all 0): drawn" in out
    targets = FAMILIES[name][0].lora_targets(FAMILIES[name][2])
    assert out.count("TENSOR OK") >= 2 * len(targets) and "lora_A: TENSOR OK" in out


def test_check_passes_with_the_gpus_defaults(emulated):
    """gpt2_cuda.py's defaults on a GPU, bf16 with cuBLASLt (the frozen layers' forward with its fused
    bias and GELU epilogues) and cuDNN attention, under the adapters."""
    assert check("gpt2", device_model("gpt2", "bf16", "cudnn", matmul=llmc.matmul.CublasLt()))


def test_check_fails_when_an_adapters_backward_is_broken(emulated, monkeypatch):
    real = llmc.lora_device.lora_backward

    def no_input_gradient(dinp, *args, **kwargs):         # the adapters' part of dinp dropped
        real(dinp.copy(), *args, **kwargs)
    monkeypatch.setattr(llmc.lora_device, "lora_backward", no_input_gradient)
    assert not check("llama3", device_model("llama3", "fp32"))


# The adapters after a few AdamW steps at lr 1e-2, the kernels' against the NumPy trainer's: their two
# float32 AdamW formulations round differently, and Adam's m / sqrt(v) enlarges a rounding-level
# difference of a small gradient up to a fraction of a step's size (lr): 1e-5 is a thousandth of it
ADAPTER_ATOL = 1e-5


def shards(tmp_path):
    """Train shards of V = 75 with a pattern to learn: a fixed cycle, a tenth of it random."""
    rng = np.random.default_rng(4)
    tokens = np.tile(rng.permutation(75), 60)[:4000]
    noise = rng.random(tokens.size) < 0.1
    tokens[noise] = rng.integers(0, 75, noise.sum())
    path = str(tmp_path / "train.bin")
    write_shard(path, tokens.astype(np.uint16))
    return path


@pytest.mark.parametrize("name", FAMILIES)
def test_training_run_equals_the_numpy_trainer(emulated, name, tmp_path, capsys):
    cpu, trainer, config = FAMILIES[name]
    model_file = str(tmp_path / "tiny.bin")
    host = gpt2_cpu.gpt2_init(config, 3) if cpu is gpt2_cpu else llama3_cpu.llama3_init(config, 3)
    cpu.write_model(model_file, host)
    common = ["-e", model_file, "-i", shards(tmp_path), "-j", "", "-b", str(B), "-t", str(T), "-x", "4", "-v", "0",
              "-s", "0", "-l", "1e-2", "-k", "constant", "-c", "0.1", "--lora-rank", str(RANK),
              "--lora-targets", "all-linear"]
    ref = cpu.train(cpu.parse_args(common + ["-o", str(tmp_path / "cpu"), "--lora-save", str(tmp_path / "cpu_lora")]))
    model = trainer.train(trainer.parse_args(common + ["--device", "cpu", "-o", str(tmp_path / "dev"),
                                                       "--lora-save", str(tmp_path / "dev_lora")]))
    expected, got = _train_losses(str(tmp_path / "cpu" / "main.log")), _train_losses(str(tmp_path / "dev" / "main.log"))
    assert len(got) == 4 and got.keys() == expected.keys()
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    assert "lora: r=4 alpha=8" in capsys.readouterr().out
    np.testing.assert_array_equal(trainer.download_parameters(model), host.params)   # frozen, bit for bit
    assert model.grads is None and model.lora.m is not None
    family = cpu.LORA_FAMILY
    saved = lora_files.load(str(tmp_path / "dev_lora"), config, family)[3]
    for key, value in lora_files.load(str(tmp_path / "cpu_lora"), config, family)[3].items():
        np.testing.assert_allclose(saved[key], value, rtol=1e-4, atol=ADAPTER_ATOL, err_msg=key)
    assert not np.array_equal(ref.lora.params, gpt2_cpu.lora_init(ref.lora.targets, config.num_layers, RANK, ALPHA,
                                                                   42).params)   # it trained


def test_graph_micro_batches_equal_eager_ones_bitwise(capture, monkeypatch):
    monkeypatch.setattr(gpt2_cuda, "GLOBAL_NORM_GRID", 16)
    rng = np.random.default_rng(5)
    batches = [tuple(rng.integers(0, 75, (B, T)).astype(np.int32) for _ in range(2)) for _ in range(2)]
    runs = {}
    for graph in (False, True):
        model = device_model("llama3", "bf16")
        adapters = np.random.default_rng(6).standard_normal(model.lora.num_parameters).astype(np.float32) * 0.1
        llama3_cuda.upload_parameters(model.lora, adapters)          # lora_B nonzero: every GEMM matters
        sums = []
        for step in (1, 2):
            gpt2_cuda.gpt2_zero_grad(model.lora)
            for x, y in batches:
                llama3_cuda.llama3_micro_batch(model, x, y, 0.5, graph)
                sums.append(float(llama3_cuda.llama3_activations(model, B, T)["losses"].sum(dtype=np.float64)))
            llama3_cuda.llama3_update(model.lora, 1e-2, 0.9, 0.95, 1e-8, 0.0, step, 1.0, None, model.lora.decayed)
        runs[graph] = sums, model.lora.params.get(), model.lora.m.get(), model.lora.master.get()
    assert capture.captures == 1 and capture.replays == 3            # the first micro-batch eager, then replays
    assert len(set(runs[True][0])) == 4
    for eager, graphed in zip(runs[False], runs[True]):
        np.testing.assert_array_equal(graphed, eager)


@needs_mpi
def test_two_processes_with_zero1_train_the_adapters_of_one(tmp_path):
    """mpiexec -n 2 llama3_cuda.py -z 1 (fp32, the adapters' m and v sharded, reduce-scatter and
    all-gather of the adapters only) against llama3_cpu.py on both ranks' rows in one process."""
    model_file = str(tmp_path / "tiny.bin")
    llama3_cpu.write_model(model_file, llama3_cpu.llama3_init(LLAMA_TINY, 3))
    common = ["-e", model_file, "-i", shards(tmp_path), "-j", "", "-t", str(T), "-x", "3", "-v", "0", "-s", "0",
              "-l", "1e-2", "-k", "constant", "--lora-rank", str(RANK), "--lora-targets", "q_proj,v_proj,down_proj"]
    run_ok(["mpiexec", "-n", "2", sys.executable, os.path.join(ROOT, "llama3_cuda.py"), "--device", "cpu", "-z", "1",
            "-b", str(B), "--lora-save", str(tmp_path / "dp")] + common, ROOT)
    run_ok([sys.executable, os.path.join(ROOT, "llama3_cpu.py"), "-b", str(2 * B), "-d", str(2 * B * T),
            "--lora-save", str(tmp_path / "one")] + common, ROOT)
    family = llama3_cpu.LORA_FAMILY
    got = lora_files.load(str(tmp_path / "dp"), LLAMA_TINY, family)[3]
    for key, value in lora_files.load(str(tmp_path / "one"), LLAMA_TINY, family)[3].items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=ADAPTER_ATOL, err_msg=key)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_frozen_base_holds_no_gradient_moment_or_master_weight(emulated, name):
    """The emulated device's pool counts the bytes of live arrays: a bf16 model with master weights
    holds 2 (params) + 2 (grads) + 4 + 4 (m, v) + 4 (master) bytes per parameter; frozen under LoRA,
    2, plus the adapters' own 16 per adapter parameter."""
    pool = cuda.cupy().get_default_memory_pool()
    _, _, config = FAMILIES[name]
    n = FAMILIES[name][0].Llama3(config).num_parameters if name == "llama3" else gpt2_cpu.GPT2(config).num_parameters
    before = pool.used_bytes()
    full = gpt2_cuda.GPT2(config, "bf16", recompute=0) if name == "gpt2" else llama3_cuda.Llama3(config, "bf16")
    full_bytes = pool.used_bytes() - before
    del full
    before = pool.used_bytes()
    lora = device_model(name, "bf16")
    lora_bytes = pool.used_bytes() - before
    adapters = lora.lora.num_parameters
    # full: its grads (2n), m, v, master (12n); LoRA: the adapters' params, grads, m, v, master (16 a),
    # their gradient norm's partial sums and result with its clipping factor (fp32), and AdamW's
    # per-step buffers of their own (the learning rate and bias corrections, a seed per tensor)
    update = lora.lora.update
    adapters_own = 4 * (gpt2_cuda.GLOBAL_NORM_GRID + gpt2_cuda.NORM_VALUES) + update.scalars.nbytes + update.seeds.nbytes
    assert update.seeds.size == len(lora.lora.param_shapes)
    assert full_bytes - lora_bytes == 14 * n - 16 * adapters - adapters_own


def test_two_fs_ranks_train_the_adapters_of_one(tmp_path):
    """-pm fs (no MPI: two processes started by hand, meeting in a shared folder) of gpt2_cuda.py,
    ZeRO-1 on the adapters, against gpt2_cpu.py on both ranks' rows in one process; and ranks started
    with different LoRA flags stop at once, rank 0 naming the flag (the rank agreement checks)."""
    import subprocess
    model_file = str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model_file, gpt2_cpu.gpt2_init(GPT2_TINY, 3))
    common = ["-e", model_file, "-i", shards(tmp_path), "-j", "", "-t", str(T), "-x", "3", "-v", "0", "-s", "0",
              "-l", "1e-2", "-k", "constant", "--lora-rank", str(RANK), "--lora-targets", "c_attn,mlp.c_proj"]
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                                                            "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")}

    def ranks(job, extra):
        procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "gpt2_cuda.py"), "--device", "cpu", "-z", "1",
                                   "-b", str(B), *common, *extra[r], "-pm", "fs", "-pn", "2", "-pr", str(r),
                                   "-pp", str(tmp_path / "rendezvous"), "-pj", job],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        return [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    (tmp_path / "rendezvous").mkdir()
    results = ranks("train", [["--lora-save", str(tmp_path / "dp")]] * 2)      # rank 0 writes them
    assert all(code == 0 for _, _, code in results), results
    run_ok([sys.executable, os.path.join(ROOT, "gpt2_cpu.py"), "-b", str(2 * B), "-d", str(2 * B * T),
            "--lora-save", str(tmp_path / "one")] + common, ROOT)
    got = lora_files.load(str(tmp_path / "dp"), GPT2_TINY, gpt2_cpu.LORA_FAMILY)[3]
    for key, value in lora_files.load(str(tmp_path / "one"), GPT2_TINY, gpt2_cpu.LORA_FAMILY)[3].items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=ADAPTER_ATOL, err_msg=key)
    results = ranks("differ", [["--lora-alpha", "8"], ["--lora-alpha", "16"]])
    for _, err, code in results:
        assert code == 1 and "--lora-alpha" in err and "Traceback" not in err, err


@pytest.mark.parametrize("name", FAMILIES)
def test_the_kv_cached_sampler_samples_the_adapted_model(emulated, name):
    """gpt2_cpu.generate with the device's KV-cached forwards (LoraMatmul on every layer of the
    prefill and of each new token) draws the NumPy trainer's ids from the same adapted model."""
    from gpt2_cpu import generate
    from llmc.sampler import SamplerRNG
    cpu, trainer, config = FAMILIES[name]
    model = device_model(name, "fp32")
    adapters = np.random.default_rng(7).standard_normal(model.lora.num_parameters).astype(np.float32) * 0.3
    trainer.upload_parameters(model.lora, adapters)
    host = gpt2_cpu.gpt2_init(config, 3) if cpu is gpt2_cpu else llama3_cpu.llama3_init(config, 3)
    host.lora = gpt2_cpu.LoRA(model.lora.targets, config.num_layers, RANK, ALPHA)
    host.lora.params[...] = adapters
    host_ids = generate(host, [1, 2, 3], 10, SamplerRNG(5), forward=cpu.sampling_forward(host))
    device_ids = generate(model, [1, 2, 3], 10, SamplerRNG(5), forward=trainer.sampling_forward(model))
    assert device_ids == host_ids
    host.lora = None                                                   # the adapters do change the samples
    assert generate(host, [1, 2, 3], 10, SamplerRNG(5), forward=cpu.sampling_forward(host)) != host_ids
