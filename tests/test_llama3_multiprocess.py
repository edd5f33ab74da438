"""llama3_cuda.py data-parallel: `mpiexec -n 2 python llama3_cuda.py --device cpu`, two MPI processes
on the emulated CUDA device (llmc/emulator/, its NCCL over MPI), as tests/test_zero.py's part 1d
does for gpt2_cuda.py: in fp32, with -z 0 (all-reduce of the gradients) and -z 1 (ZeRO-1: AdamW's m,
v and master weights sharded, reduce-scatter + all-gather), the losses, norms and parameters of
llama3_cpu.py on the whole batch in one process; in bf16, -z 1 equals -z 0 bit for bit (losses,
norms, the gathered m, v and master weights, the model file); a run of 2 processes resumes from its
checkpoint bit for bit. The model is a tiny Llama 3 (two query heads per kv head) whose ZeRO-1 cut
falls inside a tensor, so the update runs AdamW on pieces of it. -z 2 is refused in one line.

Run: python -m pytest -q tests/test_llama3_multiprocess.py   (~1 minute on 2 cores once the
emulated device's kernels are built; mostly the mpiexec runs)
"""

import os
import shutil
import sys

import numpy as np
import pytest

import llama3_cpu
import llama3_cuda
from emulated_gpu import _train_losses, _write_shards
from llmc import checkpoint, cuda, zero
from mpi_marks import logged_norms, needs_mpi, run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NH = 4, NKV = 2: n_rep = 2; C = 64: HS = 16 (flash attention's smallest tile); V = 75
TINY = llama3_cpu.LlamaConfig(max_seq_len=32, vocab_size=75, num_layers=2, num_heads=4, num_kv_heads=2, channels=64,
                              multiple_of=32)
TINY_SHAPES = llama3_cpu.parameter_shapes(TINY)
TINY_N = sum(int(np.prod(shape)) for _, shape in TINY_SHAPES)
K, B, T, STEPS = 2, 2, 32, 3       # each rank B rows; steps 2 and 3 start from the data-parallel update
CLIP = 0.5                         # below TINY's gradient norms (> 1): clipping happens every step


class Runs:
    """The training runs of this file, each started once (the first test that needs it) in one
    temporary folder: tiny_llama3.bin (TINY, seed 3) and a shard of random tokens."""

    def __init__(self, root):
        self.root = root
        self.data = _write_shards(root, V=TINY.vocab_size)
        self.model = str(root / "tiny_llama3.bin")
        llama3_cpu.write_model(self.model, llama3_cpu.llama3_init(TINY, seed=3))
        self.done = {}

    def argv(self, out, grad_clip, B=B, extra=()):
        """The flags both trainers take: STEPS steps of B x T tokens per process, weight decay on
        (llama3_cpu.DECAYED_PARAMETERS only), gradients clipped at grad_clip (0: never), a
        checkpoint after every step."""
        return ["-e", self.model, "-i", self.data, "-j", "", "-b", str(B), "-t", str(T), "-x", str(STEPS), "-v", "0",
                "-s", "0", "-l", "1e-3", "-k", "constant", "-c", "0.1", "--grad-clip", str(grad_clip), "-n", "1",
                "-o", str(out), *extra]

    def llama3_cuda(self, precision, zero_stage, grad_clip, out=None, extra=()):
        """The output folder of `mpiexec -n K llama3_cuda.py --device cpu --precision P -z Z`; its
        stdout in self.done[folder]."""
        out = out or self.root / f"{precision}-z{zero_stage}-clip{grad_clip}"
        if out not in self.done:
            cmd = ["mpiexec", "-n", str(K), sys.executable, os.path.join(ROOT, "llama3_cuda.py"), "--device", "cpu",
                   "--precision", precision, "-z", str(zero_stage), *self.argv(out, grad_clip, extra=extra)]
            self.done[out] = _run(cmd)
        return out

    def llama3_cpu(self):
        """The output folder of llama3_cpu.py, gradients clipped at CLIP, on the whole batch (K*B
        rows, -d = K*B*T: rank r's rows are rows r*B..(r+1)*B-1 of it) in one process."""
        out = self.root / "llama3_cpu"
        if out not in self.done:
            self.done[out] = _run([sys.executable, os.path.join(ROOT, "llama3_cpu.py"),
                                   *self.argv(out, CLIP, B=K * B, extra=("-d", str(K * B * T)))])
        return out


def _run(cmd):
    return run_ok(cmd, ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("llama3_dp"))


def _params(out, step=STEPS):
    return llama3_cpu.read_model(checkpoint.checkpoint_paths(str(out), step)[0]).params


def _states(out, zero_stage, ranks=K):
    """The ranks' state files of the last step: [dict of checkpoint.read_state], rank order."""
    size = zero.zero_shard(TINY_N, 0, ranks).size if zero_stage == 1 else TINY_N
    return [checkpoint.read_state(checkpoint.checkpoint_paths(str(out), STEPS, rank)[1], size, rank, ranks, zero_stage)
            for rank in range(ranks)]


def _gathered(states, key):
    """The ranks' shards of m / v / master_weights put together, cut to the real parameters."""
    return np.concatenate([st[key] for st in states])[:TINY_N]


def test_the_zero1_cut_falls_inside_a_tensor():
    # the shards cut the flat vector once: here inside a tensor, so -z 1 runs AdamW on its two pieces
    shard = zero.zero_shard(TINY_N, 1, K)
    assert any(piece.start > 0 for piece in zero.shard_slices(TINY_SHAPES, shard))


@needs_mpi
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_two_processes_fp32_are_llama3_cpu_on_the_whole_batch(runs, zero_stage):
    # to fp32 rounding, not bitwise: the batch's mean is taken in two halves, NCCL averages the
    # halves' gradients (-z 1: each rank's shard), and the norm adds over the ranks; tolerances as
    # tests/test_zero.py's (AdamW's m/sqrt(v) turns a 1e-7 change of a ~0 gradient into ~1e-3 lr)
    dp, cpu = runs.llama3_cuda("fp32", zero_stage, grad_clip=CLIP), runs.llama3_cpu()
    losses, ref = _train_losses(dp / "main.log"), _train_losses(cpu / "main.log")
    assert len(losses) == STEPS and losses == pytest.approx(ref, rel=1e-5)
    np.testing.assert_allclose(logged_norms(dp), logged_norms(cpu), rtol=1e-4)       # main.log keeps 4 decimals
    assert min(logged_norms(dp)) > CLIP                                        # clipping did happen
    got, want = _params(dp), _params(cpu)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.isclose(got, want, rtol=1e-5, atol=1e-6).mean() > 0.999
    whole = checkpoint.read_state(checkpoint.checkpoint_paths(str(cpu), STEPS, 0)[1], TINY_N, 0, 1)
    np.testing.assert_allclose(_gathered(_states(dp, zero_stage), "m") if zero_stage else _states(dp, 0)[0]["m"],
                               whole["m"], rtol=1e-4, atol=1e-8)


@needs_mpi
def test_zero1_on_two_processes_equals_zero0_bitwise_bf16(runs):
    # without clipping: -z 1's norm adds the shards' squares in another order than -z 0's one pass,
    # so a clipping scale would differ in its last bit (as in llm.c)
    z0, z1 = runs.llama3_cuda("bf16", 0, grad_clip=0), runs.llama3_cuda("bf16", 1, grad_clip=0)
    losses = _train_losses(z1 / "main.log")
    assert len(losses) == STEPS and losses == _train_losses(z0 / "main.log")
    assert logged_norms(z1) == logged_norms(z0)
    shards, whole = _states(z1, 1), _states(z0, 0)
    S = zero.zero_shard(TINY_N, 0, K).size
    assert all(st["zero_stage"] == 1 and st["m"].size == S < TINY_N for st in shards)
    for key in ("m", "v", "master_weights"):
        np.testing.assert_array_equal(_gathered(shards, key), whole[0][key], err_msg=key)
        np.testing.assert_array_equal(whole[1][key], whole[0][key], err_msg=key)   # -z 0's ranks agree
    np.testing.assert_array_equal(_params(z1), _params(z0))
    init = llama3_cpu.read_model(runs.model).params
    assert (init != _params(z1)).mean() > 0.5                           # the steps did move the model


@needs_mpi
def test_two_processes_resume_from_their_checkpoint_bitwise(runs, tmp_path):
    z1 = runs.llama3_cuda("bf16", 1, grad_clip=0)
    resumed = tmp_path / "resumed"
    shutil.copytree(z1, resumed)
    os.remove(resumed / f"DONE_{STEPS:08d}")                             # the run stopped a step earlier
    runs.llama3_cuda("bf16", 1, grad_clip=0, out=resumed, extra=("-y", "1"))
    assert "resumed from" in runs.done[resumed]
    assert _train_losses(resumed / "main.log")[STEPS - 1] == _train_losses(z1 / "main.log")[STEPS - 1]
    with open(checkpoint.checkpoint_paths(str(resumed), STEPS)[0], "rb") as a, \
            open(checkpoint.checkpoint_paths(str(z1), STEPS)[0], "rb") as b:
        assert a.read() == b.read()
    for again, first in zip(_states(resumed, 1), _states(z1, 1)):
        for key in ("m", "v", "master_weights"):
            np.testing.assert_array_equal(again[key], first[key], err_msg=key)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(cuda, "_device", "cpu")


def test_zero_stage_2_is_refused_with_one_line(emulated, tmp_path, capsys):
    rc = llama3_cuda.main(["--device", "cpu", "-e", "llama3:d2", "-b", "2", "-t", "16", "-x", "1", "-z", "2",
                           "-o", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and "-z 2: ZeRO stage 2 is not supported" in err and "Traceback" not in err
