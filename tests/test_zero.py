"""Tests of ZeRO-1 in gpt2_cuda.py (-z 1: AdamW's m, v and master weights sharded over the
data-parallel ranks; the AdamW section of gpt2_cuda.py explains the design).

Part 1, no GPU needed:
- the shard arithmetic (zero_shard, shard_slices): every element of the padded flat vector in
  exactly one shard, every parameter in exactly one piece, equal aligned shards, 1/K the size;
- rounding_seed: a NumPy squirrel_noise5 (the constants read from kernels/common.cuh) shows that
  the shifted seed draws, for a piece of a tensor, the bits one launch over the tensor draws; the
  real adamw kernel on the emulated CUDA device (llmc/emulator/) updates a tensor in pieces with
  rounding_seed to the bits of one launch, and its stochastic rounding is the NumPy one;
- NcclComm's reduce-scatter and all-gather pass NCCL the in-place pointers (a recording fake);
- `mpiexec -n 2 python gpt2_cuda.py --device cpu -z 1`: two MPI processes, the real kernels on the
  emulated device and its NCCL over MPI (llmc/emulator/nccl.py). In bf16, -z 1 prints the losses of
  -z 0 and writes, bit for bit, its model file and (put together from the ranks' shards) its m, v
  and master weights, in state files of the shard's size; resuming from a -z 1 checkpoint gives the
  same files bit for bit. In fp32 the losses and parameters are gpt2_cpu.py's on the whole batch
  (one process), to fp32 rounding. -z 2 is refused.
Part 2, GPU (skipped without one): -z 1 on one rank equals -z 0 bit for bit and tracks gpt2_cpu;
the real adamw kernel's pieces on a GPU.
Run: pytest tests/test_zero.py   (~1.5 minutes on 2 cores once the emulated device's kernels are
built, see tests/test_emulated_kernels.py; mostly the mpiexec runs)
"""

import math
import os
import re
import shutil
import sys
import types

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc.comm
import llmc.cuda
from emulated_gpu import TINY, _train_losses, _write_shards
from llmc import checkpoint, zero
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from mpi_marks import logged_norms, needs_mpi, run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHAPES = gpt2_cpu.parameter_shapes(TINY)
TINY_N = gpt2_cpu.num_elements(TINY_SHAPES)


@pytest.fixture
def emulated(monkeypatch):
    """gpt2_cuda on the emulated CUDA device (llmc/emulator/): the real kernels, compiled by g++."""
    monkeypatch.setattr(llmc.cuda, "_device", "cpu")


# ----------------------------------------------------------------------------
# part 1a: the shard arithmetic

@pytest.mark.parametrize("n", [1, 7, 8, 1000, 1001, TINY_N])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 7, 8])
def test_shards_cover_the_padded_vector_exactly_once(n, K):
    shards = [zero.zero_shard(n, r, K) for r in range(K)]
    S = shards[0].size
    assert all(s.size == S and s.padded == K * S and s.num_parameters == n for s in shards)
    owner = np.zeros(K * S, int)
    for s in shards:
        owner[s.offset:s.offset + s.size] += 1
    assert np.all(owner == 1) and K * S >= n                              # each element once, all of n
    if K == 1:
        assert S == n                                                     # one process: everything, no padding
    else:
        assert S % zero.ZERO_SHARD_ALIGN == 0                        # every shard starts 16-byte aligned
        assert K * S - n < K * zero.ZERO_SHARD_ALIGN                 # the padding is small
        assert S <= math.ceil(n / K) + zero.ZERO_SHARD_ALIGN         # 1/K of the state, and a bit
    with pytest.raises(ValueError):
        zero.zero_shard(n, K, K)


@pytest.mark.parametrize("K", [1, 2, 3, 5, 16, 2000])
def test_shard_slices_cover_every_parameter_once(K):
    # every (tensor, element) is in exactly one rank's pieces, at matching flat / local / start
    # indices; K = 2000 leaves some ranks whole tensors' worth of nothing but padding
    offsets = np.cumsum([0] + [math.prod(s) for _, s in TINY_SHAPES])
    tensor_of = {name: (offsets[i], offsets[i + 1]) for i, (name, _) in enumerate(TINY_SHAPES)}
    seen = np.zeros(TINY_N, int)
    for r in range(K):
        shard = zero.zero_shard(TINY_N, r, K)
        pieces = zero.shard_slices(TINY_SHAPES, shard)
        assert [p.name for p in pieces] == [n for n, _ in TINY_SHAPES if n in {p.name for p in pieces}]  # in order
        for p in pieces:
            t0, t1 = tensor_of[p.name]
            assert t0 <= p.flat.start < p.flat.stop <= t1 and p.start == p.flat.start - t0
            assert p.local.start == p.flat.start - shard.offset and p.local.stop - p.local.start == p.flat.stop - p.flat.start
            assert 0 <= p.local.start and p.local.stop <= shard.size
            seen[p.flat] += 1
    assert np.all(seen == 1)


def test_shard_slices_by_hand():
    # shapes of 5, 6, 4 elements (n=15) over 2 ranks: S = 8 (ceil(15/2) = 8, aligned to 8)
    shapes = [("a", (5,)), ("b", (2, 3)), ("c", (4,))]
    r0, r1 = (zero.zero_shard(15, r, 2) for r in range(2))
    assert (r0.size, r0.offset, r1.offset, r1.padded) == (8, 0, 8, 16)
    P = zero.ShardPiece
    assert zero.shard_slices(shapes, r0) == [P("a", slice(0, 5), slice(0, 5), 0), P("b", slice(5, 8), slice(5, 8), 0)]
    assert zero.shard_slices(shapes, r1) == [P("b", slice(8, 11), slice(0, 3), 3), P("c", slice(11, 15), slice(3, 7), 0)]


def test_optimizer_shard_and_model_buffers(emulated):
    # -z 0: the whole vector; -z 1: m, v, master of S = ceil(n/K) (aligned) floats, params and
    # grads padded to K*S with (n,) views; -z 2, 3 refused with one InputError
    assert zero.optimizer_shard(TINY_N, 0, 0, 1) == zero.Shard(0, 1, TINY_N, TINY_N)
    for stage in (2, 3, -1):
        with pytest.raises(gpt2_cuda.InputError, match=f"-z {stage}: ZeRO stage {stage} is not supported"):
            zero.optimizer_shard(TINY_N, stage, 0, 2)
    for K in (1, 2, 3):
        for r in range(K):
            model = gpt2_cuda.GPT2(TINY, "bf16", master_weights=True, zero_stage=1, process_rank=r, num_processes=K)
            S = model.shard.size
            assert model.m.size == model.v.size == model.master.size == S == zero.zero_shard(TINY_N, r, K).size
            assert S * K < TINY_N + K * zero.ZERO_SHARD_ALIGN                 # 1/K each
            assert model.params.size == model.grads.size == TINY_N
            assert model.params_memory.size == model.grads_memory.size == K * S
            assert np.shares_memory(model.params, model.params_memory)
    # upload_parameters gives the master weights this rank's shard (padding 0)
    p = gpt2_cpu.gpt2_init(TINY, 42).params
    model = gpt2_cuda.GPT2(TINY, "bf16", zero_stage=1, process_rank=2, num_processes=3)
    gpt2_cuda.upload_parameters(model, p)
    o, S = model.shard.offset, model.shard.size
    master = model.master.get()
    np.testing.assert_array_equal(master[:TINY_N - o], p[o:])
    assert np.all(master[TINY_N - o:] == 0) and TINY_N - o < S
    np.testing.assert_array_equal(model.params.get(), float32_to_bfloat16_bits(p))


# ----------------------------------------------------------------------------
# part 1b: stochastic rounding by global index: NumPy squirrel_noise5 and AdamW, bit for bit

def _sq5_constants():
    with open(os.path.join(ROOT, "kernels", "common.cuh")) as f:
        src = f.read()
    return [int(re.search(rf"#define SQ5_BIT_NOISE{k} (0x[0-9a-fA-F]+)u", src).group(1), 16) for k in range(1, 6)]


SQ5 = [np.uint32(c) for c in _sq5_constants()]


def squirrel_noise5(position, seed):
    """kernels/common.cuh's squirrel_noise5 on uint32 arrays (wrapping arithmetic)."""
    m = np.asarray(position, dtype=np.uint32) * SQ5[0]
    m = m + np.uint32(seed)
    m ^= m >> np.uint32(9)
    m = m + SQ5[1]
    m ^= m >> np.uint32(11)
    m = m * SQ5[2]
    m ^= m >> np.uint32(13)
    m = m + SQ5[3]
    m ^= m >> np.uint32(15)
    m = m * SQ5[4]
    m ^= m >> np.uint32(17)
    return m


def stochastic_round_bf16(x, index, seed):
    """kernels/common.cuh's stochastic_rounding of float32 x to bf16 bits, element `index` of a
    launch with `seed` (adamw.cu: squirrel_noise5(i, seed), hashed once more): add a 16-bit random
    number to the float's bits and keep the high half; NaN rounds to nearest."""
    random = squirrel_noise5(np.zeros_like(index, dtype=np.uint32), squirrel_noise5(index, seed)) & np.uint32(0xFFFF)
    bits = np.asarray(x, np.float32).view(np.uint32) + random
    out = (bits >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    out[nan] = float32_to_bfloat16_bits(np.asarray(x, np.float32)[nan])
    return out


def test_python_constant_matches_common_cuh():
    assert zero.SQ5_BIT_NOISE1 == int(SQ5[0])


def test_rounding_seed_shifts_the_hash_by_start():
    rng = np.random.default_rng(0)
    for _ in range(20):
        seed, start = int(rng.integers(0, 2 ** 32)), int(rng.integers(0, 2 ** 31))
        j = rng.integers(0, 2 ** 31, 1000).astype(np.uint32)
        whole = squirrel_noise5(j + np.uint32(start), seed)                # element start+j of the tensor
        shifted = squirrel_noise5(j, zero.rounding_seed(seed, start))  # element j of the piece
        np.testing.assert_array_equal(whole, shifted)
        assert not np.array_equal(squirrel_noise5(j, seed), whole)          # unshifted: other bits
    assert zero.rounding_seed(123, 0) == 123


def adamw_pieces_round_as_one_launch(cp):
    """The real adamw kernel on the device of the array module cp: a bf16 tensor updated in three
    pieces with rounding_seed gets the bits of one launch over it (with the plain seed it does
    not, so the check can fail); the values follow gpt2_cpu's AdamW; the rounding is stochastic
    (both bf16 neighbours of the fp32 value occur) and is stochastic_round_bf16's, bit for bit."""
    rng = np.random.default_rng(3)
    n, seed, cuts = 1 << 16, 2024, [0, 12345, 40001, 1 << 16]
    p0 = rng.standard_normal(n).astype(np.float32)
    g0 = float32_to_bfloat16_bits(rng.standard_normal(n).astype(np.float32))
    args = (1e-2, 0.9, 0.95, 0.1, 0.05, 1e-8, 0.1, 1.0)

    def run(seeds):
        params, master = cp.asarray(float32_to_bfloat16_bits(p0)), cp.asarray(p0)
        m, v, g = cp.zeros(n, np.float32), cp.zeros(n, np.float32), cp.asarray(g0)
        for (a, b), s in zip(zip(cuts, cuts[1:]), seeds):
            gpt2_cuda.adamw_update_tensor(params[a:b], master[a:b], g[a:b], m[a:b], v[a:b], b - a, *args, s)
        return params.get(), master.get()
    params1 = cp.asarray(float32_to_bfloat16_bits(p0))
    master1 = cp.asarray(p0)
    gpt2_cuda.adamw_update_tensor(params1, master1, cp.asarray(g0), cp.zeros(n, np.float32), cp.zeros(n, np.float32), n,
                           *args, seed)
    params1, master1 = params1.get(), master1.get()
    pieces, master3 = run([zero.rounding_seed(seed, a) for a in cuts[:-1]])
    np.testing.assert_array_equal(pieces, params1)
    np.testing.assert_array_equal(master3, master1)
    plain, _ = run([seed] * 3)
    assert not np.array_equal(plain, params1)
    ref = types.SimpleNamespace(params=p0.copy(), grads=bfloat16_bits_to_float32(g0), m=np.zeros(n, np.float32),
                                v=np.zeros(n, np.float32), param_shapes=[("wte", (n,))])
    gpt2_cpu.gpt2_update(ref, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, 1.0)
    np.testing.assert_allclose(master3, ref.params, rtol=1e-5, atol=1e-6)
    lo = float32_to_bfloat16_bits(master1)
    assert set(np.unique(params1.astype(np.int32) - lo.astype(np.int32)).tolist()) <= {-1, 0, 1}
    assert (params1 != lo).mean() > 0.1
    assert np.array_equal(stochastic_round_bf16(master1, np.arange(n, dtype=np.uint32), seed), params1)


def test_adamw_on_pieces_rounds_as_one_launch(emulated):
    adamw_pieces_round_as_one_launch(llmc.cuda.cupy())


# ----------------------------------------------------------------------------
# part 1c: NcclComm's collectives pass NCCL in-place pointers

class _RecordingCommunicator:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name,) + args)


def test_nccl_comm_in_place_pointers(monkeypatch):
    fake_nccl = types.SimpleNamespace(NCCL_BFLOAT16=9, NCCL_FLOAT32=7, NCCL_AVG=4)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=77))))

    class DeviceArray:                                    # what NcclComm reads of a CuPy array
        def __init__(self, size, dtype):
            self.size, self.dtype, self.itemsize = size, np.dtype(dtype), np.dtype(dtype).itemsize
            self.data = types.SimpleNamespace(ptr=1 << 20)
            self.flags = types.SimpleNamespace(c_contiguous=True)

    for rank, dtype, code in ((0, np.uint16, 9), (2, np.uint16, 9), (1, np.float32, 7)):
        nc = object.__new__(llmc.comm.NcclComm)
        nc.nccl, nc.communicator, nc.rank, nc.size = fake_nccl, _RecordingCommunicator(), rank, 3
        arr = DeviceArray(3 * 40, dtype)
        nc.reduce_scatter_mean_(arr)
        nc.all_gather_(arr)
        nc.mean_(arr)
        mine = arr.data.ptr + rank * 40 * arr.itemsize                   # this rank's slice, in bytes
        assert nc.communicator.calls == [("reduceScatter", arr.data.ptr, mine, 40, code, 4, 77),
                                         ("allGather", mine, arr.data.ptr, 40, code, 77),
                                         ("allReduce", arr.data.ptr, arr.data.ptr, 120, code, 4, 77)]
        with pytest.raises(ValueError, match="do not split evenly"):
            nc.all_gather_(DeviceArray(3 * 40 + 1, dtype))


# ----------------------------------------------------------------------------
# part 1d: `mpiexec -n 2 python gpt2_cuda.py --device cpu -z 1`: two MPI processes on the emulated
# device, its NCCL over MPI; the runs compared through their logs and checkpoint files

K, B, T, STEPS = 2, 2, 16, 2       # each rank B rows; step 2 starts from the sharded update
CLIP = 0.5                         # below TINY's gradient norms (> 1): clipping happens every step


class Runs:
    """The training runs of part 1d, each started once (the first test that needs it) in one
    temporary folder: tiny.bin (gpt2_cpu's TINY, seed 42) and a shard of random tokens."""

    def __init__(self, root):
        self.root = root
        self.data = _write_shards(root)
        self.model = str(root / "tiny.bin")
        gpt2_cpu.write_model(self.model, gpt2_cpu.gpt2_init(TINY, 42))
        self.done = {}

    def argv(self, out, grad_clip, B=B, extra=()):
        """The flags both trainers take: STEPS steps of B x T tokens per process, gradients
        clipped at grad_clip (0: never), a checkpoint after every step."""
        return ["-e", self.model, "-i", self.data, "-j", "", "-b", str(B), "-t", str(T), "-x", str(STEPS), "-v", "0",
                "-s", "0", "-l", "1e-3", "-c", "0.1", "--grad-clip", str(grad_clip), "-n", "1", "-o", str(out), *extra]

    def gpt2_cuda(self, precision, zero_stage, grad_clip, out=None, extra=()):
        """The output folder of `mpiexec -n K gpt2_cuda.py --device cpu --precision P -z Z`; its
        stdout in self.done[folder]."""
        out = out or self.root / f"{precision}-z{zero_stage}-clip{grad_clip}"
        if out not in self.done:
            cmd = ["mpiexec", "-n", str(K), sys.executable, os.path.join(ROOT, "gpt2_cuda.py"), "--device", "cpu",
                   "--precision", precision, "-z", str(zero_stage), *self.argv(out, grad_clip, extra=extra)]
            self.done[out] = _run(cmd)
        return out

    def gpt2_cpu(self):
        """The output folder of gpt2_cpu.py, gradients clipped at CLIP, on the whole batch (K*B
        rows: rank r's rows are rows r*B..(r+1)*B-1 of it) in one process."""
        out = self.root / "gpt2_cpu"
        if out not in self.done:
            self.done[out] = _run([sys.executable, os.path.join(ROOT, "gpt2_cpu.py"), *self.argv(out, CLIP, B=K * B)])
        return out


def _run(cmd):
    return run_ok(cmd, ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("zero"))


def _model_file(out, step):
    return checkpoint.checkpoint_paths(str(out), step)[0]


def _states(out, zero_stage):
    """The K ranks' state files of the last step: [dict of checkpoint.read_state], rank order."""
    size = zero.zero_shard(TINY_N, 0, K).size if zero_stage == 1 else TINY_N
    return [checkpoint.read_state(checkpoint.checkpoint_paths(str(out), STEPS, rank)[1], size, rank, K, zero_stage)
            for rank in range(K)]


def _gathered(states, key):
    """The K ranks' shards of m / v / master_weights put together, cut to the real parameters."""
    return np.concatenate([st[key] for st in states])[:TINY_N]


@needs_mpi
def test_zero1_on_two_processes_equals_zero0_bitwise_bf16(runs):
    # without clipping: the norm of -z 1 adds the shards' squares over the ranks, in another order
    # than -z 0's one pass, so a clipping scale would differ in its last bit (as in llm.c)
    z0, z1 = runs.gpt2_cuda("bf16", 0, grad_clip=0), runs.gpt2_cuda("bf16", 1, grad_clip=0)
    losses = _train_losses(z1 / "main.log")
    assert len(losses) == STEPS and losses == _train_losses(z0 / "main.log")
    assert logged_norms(z1) == logged_norms(z0)                                      # the global norm, from shards
    # each rank's state file holds its shard of m, v and master weights, 1/K of -z 0's
    shards, whole = _states(z1, 1), _states(z0, 0)
    S = zero.zero_shard(TINY_N, 0, K).size
    assert all(st["zero_stage"] == 1 and st["m"].size == S < TINY_N for st in shards)
    for key in ("m", "v", "master_weights"):
        np.testing.assert_array_equal(_gathered(shards, key), whole[0][key], err_msg=key)
    # the model file holds the bf16 parameters upcast, -z 0's and -z 1's alike (the values the run
    # computes with), each its master weight stochastically rounded (1 bf16 ulp)
    params = gpt2_cpu.read_model(_model_file(z1, STEPS)).params
    bits = float32_to_bfloat16_bits(params)
    np.testing.assert_array_equal(bfloat16_bits_to_float32(bits), params)
    np.testing.assert_array_equal(gpt2_cpu.read_model(_model_file(z0, STEPS)).params, params)
    master = whole[0]["master_weights"]
    ulps = bits.astype(np.int32) - float32_to_bfloat16_bits(master).astype(np.int32)
    assert set(np.unique(ulps).tolist()) <= {-1, 0, 1}
    path = checkpoint.checkpoint_paths(str(z1), STEPS, 0)[1]
    assert os.path.getsize(path) < os.path.getsize(checkpoint.checkpoint_paths(str(z0), STEPS, 0)[1])
    # the steps did move the model; the shards do not resume as -z 0
    init, final = gpt2_cpu.read_model(runs.model).params, gpt2_cpu.read_model(_model_file(z1, STEPS)).params
    assert (init != final).mean() > 0.5
    with pytest.raises(gpt2_cuda.InputError, match="written with -z 1, but this run has -z 0: resume with -z 1"):
        checkpoint.read_state(path, TINY_N, 0, K, zero_stage=0)


@needs_mpi
def test_zero1_on_two_processes_fp32_is_gpt2_cpu_on_the_whole_batch(runs):
    # to fp32 rounding, not bitwise: the batch's mean is taken in two halves, NCCL averages the
    # halves' gradients, and the norm adds the shards' squares. AdamW divides m by sqrt(v), so an
    # element whose gradient is ~0 turns a 1e-7 relative change of it into up to a few
    # thousandths of lr (1e-3): all parameters within 1e-5 (1% of lr), 99.9% within 1e-6
    z1, cpu = runs.gpt2_cuda("fp32", 1, grad_clip=CLIP), runs.gpt2_cpu()
    losses, ref = _train_losses(z1 / "main.log"), _train_losses(cpu / "main.log")
    assert len(losses) == STEPS and losses == pytest.approx(ref, rel=1e-5)
    np.testing.assert_allclose(logged_norms(z1), logged_norms(cpu), rtol=1e-4)       # main.log keeps 4 decimals
    assert min(logged_norms(z1)) > CLIP                                        # clipping did happen
    got = gpt2_cpu.read_model(_model_file(z1, STEPS)).params
    want = gpt2_cpu.read_model(_model_file(cpu, STEPS)).params
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.isclose(got, want, rtol=1e-5, atol=1e-6).mean() > 0.999
    whole = checkpoint.read_state(checkpoint.checkpoint_paths(str(cpu), STEPS, 0)[1], TINY_N, 0, 1)
    np.testing.assert_allclose(_gathered(_states(z1, 1), "m"), whole["m"], rtol=1e-4, atol=1e-8)


@needs_mpi
def test_zero1_resumes_from_its_checkpoint_bitwise(runs, tmp_path):
    z1 = runs.gpt2_cuda("bf16", 1, grad_clip=0)
    resumed = tmp_path / "resumed"
    shutil.copytree(z1, resumed)
    os.remove(resumed / f"DONE_{STEPS:08d}")                             # the run stopped a step earlier
    runs.gpt2_cuda("bf16", 1, grad_clip=0, out=resumed, extra=("-y", "1"))
    assert "resumed from" in runs.done[resumed]
    assert _train_losses(resumed / "main.log")[STEPS - 1] == _train_losses(z1 / "main.log")[STEPS - 1]
    with open(_model_file(resumed, STEPS), "rb") as a, open(_model_file(z1, STEPS), "rb") as b:
        assert a.read() == b.read()
    for again, first in zip(_states(resumed, 1), _states(z1, 1)):
        for key in ("m", "v", "master_weights"):
            np.testing.assert_array_equal(again[key], first[key], err_msg=key)


# ----------------------------------------------------------------------------
# part 1e: one process, and the refused stages

def test_zero1_one_process_is_zero0(emulated):
    # -z 1 with a single process: one shard is everything, the same launches, the same bits
    rng = np.random.default_rng(11)
    x, y = (rng.integers(0, TINY.vocab_size, (B, T)).astype(np.int32) for _ in range(2))
    comm = llmc.comm.Comm()
    models = []
    for zero_stage in (0, 1):
        model = gpt2_cuda.GPT2(TINY, "bf16", master_weights=True, zero_stage=zero_stage)
        gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(TINY, 42).params)
        gpt2_cuda.gpt2_zero_grad(model)
        gpt2_cuda.gpt2_forward(model, x, y)
        gpt2_cuda.gpt2_backward(model)
        norm = gpt2_cuda.gpt2_global_grad_norm(model, comm)
        gpt2_cuda.gpt2_update(model, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1, CLIP / norm)
        models.append(model)
    assert models[1].shard == zero.Shard(0, 1, TINY_N, TINY_N) and norm > CLIP
    for name in ("params", "m", "v", "master"):
        np.testing.assert_array_equal(getattr(models[1], name).get(), getattr(models[0], name).get(), err_msg=name)
    assert not np.array_equal(models[1].params.get(), float32_to_bfloat16_bits(gpt2_cpu.gpt2_init(TINY, 42).params))


def test_zero_stage_2_is_refused_with_one_line(emulated, tmp_path, capsys):
    data, model = _write_shards(tmp_path), str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    argv = ["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "16", "-x", "1", "-z", "2", "--device", "cpu"]
    assert gpt2_cuda.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: -z 2: ZeRO stage 2 is not supported")
    assert gpt2_cuda.parse_args([]).zero_stage == 0 and gpt2_cuda.parse_args(["--zero-stage", "1"]).zero_stage == 1


# ----------------------------------------------------------------------------
# part 2: on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("precision,rtol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_gpu_zero1_one_rank_equals_zero0_and_tracks_gpt2_cpu(precision, rtol, monkeypatch):
    cfg = gpt2_cpu.config_from_descriptor("d4")
    rng = np.random.default_rng(9)
    x, y = (rng.integers(0, 5000, (4, 64)).astype(np.int32) for _ in range(2))
    comm = llmc.comm.Comm()
    models = []
    for zero_stage in (0, 1):
        model = gpt2_cuda.GPT2(cfg, precision, master_weights=True, zero_stage=zero_stage)
        gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(cfg, 42).params)
        for step in range(1, 6):
            gpt2_cuda.gpt2_zero_grad(model)
            gpt2_cuda.gpt2_forward(model, x, y)
            gpt2_cuda.gpt2_backward(model)
            norm = gpt2_cuda.gpt2_global_grad_norm(model, comm)
            gpt2_cuda.gpt2_update(model, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, 1.0 / norm if norm > 1.0 else 1.0)
        models.append(model)
    assert models[1].m.size == models[1].num_parameters
    for name in ("params", "m", "v", "master"):
        if name == "master" and precision == "fp32":             # fp32 parameters are their own master copy
            assert models[0].master is None and models[1].master is None
            continue
        np.testing.assert_array_equal(getattr(models[1], name).get(), getattr(models[0], name).get())
    cpu = gpt2_cpu.gpt2_init(cfg, 42)
    for step in range(1, 6):
        gpt2_cpu.gpt2_zero_grad(cpu)
        gpt2_cpu.gpt2_forward(cpu, x, y)
        gpt2_cpu.gpt2_backward(cpu)
        norm = gpt2_cpu.gpt2_grad_norm(cpu)
        gpt2_cpu.gpt2_update(cpu, 1e-3, 0.9, 0.95, 1e-8, 0.1, step, 1.0 / norm if norm > 1.0 else 1.0)
    gpt2_cuda.gpt2_forward(models[1], x, y)
    gpt2_cpu.gpt2_forward(cpu, x, y)
    assert gpt2_cuda.gpt2_mean_loss(models[1]) == pytest.approx(cpu.mean_loss, rel=rtol)
    init = gpt2_cpu.gpt2_init(cfg, 42)
    gpt2_cpu.gpt2_forward(init, x, y)
    assert cpu.mean_loss < init.mean_loss - 0.1                              # the five steps did train


@pytest.mark.gpu
def test_gpu_adamw_pieces_with_rounding_seed_round_as_one_launch():
    import cupy as cp
    adamw_pieces_round_as_one_launch(cp)
