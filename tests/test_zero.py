"""Tests of ZeRO-1 in gpt2_cuda.py (-z 1: AdamW's m, v and master weights sharded over the
data-parallel ranks; the AdamW section of gpt2_cuda.py explains the design).

Part 1, no GPU needed:
- the shard arithmetic (zero_shard, shard_slices): every element of the padded flat vector in
  exactly one shard, every parameter in exactly one piece, equal aligned shards, 1/K the size;
- rounding_seed: a NumPy squirrel_noise5 (the constants read from kernels/common.cuh) shows that
  the shifted seed draws, for a piece of a tensor, the bits one launch over the tensor draws;
- NcclComm's reduce-scatter and all-gather pass NCCL the in-place pointers (a recording fake);
- K = 2 and 3 ranks in one process (threads; each rank its own GPT2, llmc.comm.NcclComm on the
  emulated device's NCCL, llmc/emulator/nccl.py, whose ranks are the threads, and an emulated MPI
  whose collectives complete when all K ranks have called them), through tests/test_cuda.py's
  emulated GPU, with AdamW's stochastic rounding emulated bit for bit (hash and all, so that a
  wrong element index would show): -z 1 gives the very parameters, m and v of -z 0 (bitwise,
  fp32 and bf16), the global gradient norm, and (fp32, to rounding) the parameters of one
  process on the whole batch; gpt2_cuda.train() itself with -z 1 on K ranks equals -z 0, writes
  per-rank state files of the shard's size and resumes from them bit for bit; -z 2 is refused.
Part 2, GPU (skipped without one): -z 1 on one rank equals -z 0 bit for bit and tracks gpt2_cpu;
the real adamw kernel on a piece with rounding_seed rounds as the whole-tensor launch.
Run: pytest tests/test_zero.py   (part 1: ~5 s on 2 cores)
"""

import concurrent.futures
import math
import os
import re
import sys
import threading
import types

import numpy as np
import pytest

import gpt2_cpu
import gpt2_cuda
import llmc.comm
import llmc.cuda
from llmc import checkpoint, cli, zero
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits
from emulated_gpu import (EMULATED_KERNELS, TINY, _train_losses, _write_shards, adamw_emulated_step,  # noqa: F401
                          emulated_gpu)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHAPES = gpt2_cpu.parameter_shapes(TINY)
TINY_N = gpt2_cpu.num_elements(TINY_SHAPES)


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


def test_optimizer_shard_and_model_buffers(emulated_gpu):
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
    np.testing.assert_array_equal(model.master[:TINY_N - o], p[o:])
    assert np.all(model.master[TINY_N - o:] == 0) and TINY_N - o < S
    np.testing.assert_array_equal(model.params, float32_to_bfloat16_bits(p))


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


def k_adamw_update_sr(grid, block, params, master_params, grads, m, v, n, learning_rate, beta1, beta2,
                      beta1_correction, beta2_correction, eps, weight_decay, grad_scale, seed):
    """kernels/adamw.cu in NumPy as tests/test_cuda.py's emulation, but with the kernel's
    stochastic rounding (element i of the launch: squirrel_noise5(i, seed)) instead of nearest."""
    n = int(n)
    p = adamw_emulated_step(params, master_params, grads, m, v, n, learning_rate, beta1, beta2,
                            beta1_correction, beta2_correction, eps, weight_decay, grad_scale)
    if params.dtype == np.uint16:
        params.reshape(-1)[:n] = stochastic_round_bf16(p, np.arange(n, dtype=np.uint32), seed)
    else:
        params.reshape(-1)[:n] = p


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


def test_adamw_on_pieces_rounds_as_one_launch(emulated_gpu, monkeypatch):
    # the emulated kernel with its real rounding: a tensor updated in 3 pieces with rounding_seed
    # gives the bits of one launch; with the plain seed it does not (so the test can fail)
    monkeypatch.setitem(EMULATED_KERNELS, "adamw_update", k_adamw_update_sr)
    rng = np.random.default_rng(1)
    n, seed, cuts = 5000, 987654321, [0, 1234, 3001, 5000]
    p0 = rng.standard_normal(n).astype(np.float32)
    g = float32_to_bfloat16_bits(rng.standard_normal(n).astype(np.float32))
    args = (1e-2, 0.9, 0.95, 0.1, 0.05, 1e-8, 0.1, 1.0)

    def run(seeds):
        params, master = float32_to_bfloat16_bits(p0), p0.copy()
        m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
        for (a, b), s in zip(zip(cuts, cuts[1:]), seeds):
            gpt2_cuda.adamw_update(params[a:b], master[a:b], g[a:b], m[a:b], v[a:b], b - a, *args, s)
        return params, master

    params1, master1 = float32_to_bfloat16_bits(p0), p0.copy()
    gpt2_cuda.adamw_update(params1, master1, g, np.zeros(n, np.float32), np.zeros(n, np.float32), n, *args, seed)
    pieces, master3 = run([zero.rounding_seed(seed, a) for a in cuts[:-1]])
    np.testing.assert_array_equal(master3, master1)
    np.testing.assert_array_equal(pieces, params1)
    plain, _ = run([seed] * 3)
    assert not np.array_equal(plain, params1)
    # and the rounding is stochastic: both neighbours of the fp32 value occur, never anything else
    lo = float32_to_bfloat16_bits(master1)
    assert set(np.unique(params1.astype(np.int32) - lo.astype(np.int32)).tolist()) <= {-1, 0, 1}
    assert (params1 != lo).mean() > 0.1


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
# part 1d: K ranks in one process. Each rank is a thread with its own model; a collective is
# complete when all K ranks have called it (a barrier), and its result is computed from the K
# contributions in rank order, so it is deterministic whatever the threads' timing.

class RankGroup:
    """The meeting point of K emulated ranks."""

    def __init__(self, K):
        self.K = K
        self.barrier = threading.Barrier(K, timeout=120)
        self.slots = [None] * K

    def exchange(self, rank, value):
        """Every rank's value, in rank order, once all K ranks have given theirs."""
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()                                # no slot is overwritten before all have read
        return values


class EmulatedComm:
    """llmc.comm.Comm (MPI on host values) for rank `rank` of a RankGroup."""

    def __init__(self, group, rank):
        self.group, self.rank, self.size = group, rank, group.K
        self.local_rank = rank
        self.comm = self                                   # NcclComm reads comm.comm; never called here

    def connect(self):                                     # llmc.multinode.ProcessGroup.connect
        return RecordedNcclComm(self) if self.size > 1 else None

    def mean_(self, arr):
        arr[...] = np.sum(self.group.exchange(self.rank, np.array(arr, np.float64)), axis=0) / self.size
        return arr

    def sum(self, x):
        return float(np.sum(self.group.exchange(self.rank, float(x))))

    def mean(self, x):
        return self.sum(x) / self.size

    def barrier(self):
        self.group.exchange(self.rank, None)

    def bcast(self, value, root=0):
        """MPI's broadcast of a Python object (NcclComm sends the NCCL unique id with it)."""
        return self.group.exchange(self.rank, value)[root]


class RecordedNcclComm(llmc.comm.NcclComm):
    """llmc.comm.NcclComm itself, on the emulated device's NCCL (llmc/emulator/nccl.py, whose
    ranks here are the threads of one RankGroup), recording which collectives ran. After a
    reduce-scatter it poisons the slices that are not this rank's (NCCL leaves them holding this
    rank's own unreduced values), so that a read of them shows."""

    def __init__(self, comm):
        super().__init__(comm)
        assert self.nccl is llmc.cuda.library("nccl") and self.nccl.__name__ == "llmc.emulator.nccl"
        self.calls = []
        threading.current_thread().nccl_comm = self             # run_ranks aborts it if this rank fails

    def mean_(self, arr):
        self.calls.append("all_reduce")
        super().mean_(arr)

    def reduce_scatter_mean_(self, arr):
        self.calls.append("reduce_scatter")
        super().reduce_scatter_mean_(arr)
        S = self.shard_elements(arr)
        mine = slice(self.rank * S, (self.rank + 1) * S)
        arr[:mine.start] = arr[mine.stop:] = 0xFFFF if arr.dtype == np.uint16 else np.nan

    def all_gather_(self, arr):
        self.calls.append("all_gather")
        super().all_gather_(arr)


def _to_f64(arr):
    return (bfloat16_bits_to_float32(np.asarray(arr)) if arr.dtype == np.uint16 else np.asarray(arr)).astype(np.float64)


def run_ranks(K, fn):
    """fn(rank, comm) on K threads (ranks of one RankGroup); returns their results in rank order.
    An exception on one rank breaks the barriers (MPI's and NCCL's), so the others stop instead of
    waiting; the exception raised here is the first rank's own error, not a broken barrier of
    a rank that was waiting for it."""
    group = RankGroup(K)

    def one(rank):
        threading.current_thread().rank_comm = comm = EmulatedComm(group, rank)
        try:
            return fn(rank, comm)
        except BaseException:
            group.barrier.abort()
            nccl = getattr(threading.current_thread(), "nccl_comm", None)
            if nccl is not None:
                nccl.communicator.abort()                  # the others may wait in an NCCL collective
            raise
    with concurrent.futures.ThreadPoolExecutor(K) as pool:
        futures = [pool.submit(one, r) for r in range(K)]
        errors = [f.exception() for f in futures if f.exception() is not None]
    own = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (own or errors)[0]
    return [f.result() for f in futures]


@pytest.fixture
def emulated_ranks(emulated_gpu, monkeypatch):
    """The emulated GPU (tests/test_cuda.py), AdamW with the kernel's stochastic rounding,
    gpt2_cuda's process group (llmc.multinode) replaced by the rank group of the calling thread,
    and its NcclComm recorded on the emulated device's NCCL (llmc.cuda.library("nccl") with the
    device "cpu", restored after)."""
    monkeypatch.setitem(EMULATED_KERNELS, "adamw_update", k_adamw_update_sr)
    monkeypatch.setattr(llmc.cuda, "_device", llmc.cuda.device())
    llmc.cuda.use_device("cpu")
    monkeypatch.setattr(gpt2_cuda.multinode, "init_process_group", lambda args: threading.current_thread().rank_comm)
    # -o's write probe is named by the process id, which the K threads share: one at a time, with
    # the ranks' closing barrier taken after the lock is released (inside it, the ranks would wait
    # for each other forever)
    lock, make_output_dir = threading.Lock(), cli.TrainingRun.make_output_dir

    def locked(self, out_dir):
        barrier = self.comm.barrier
        with lock:
            self.comm.barrier = lambda: None
            try:
                make_output_dir(self, out_dir)
            finally:
                self.comm.barrier = barrier
        barrier()
    monkeypatch.setattr(cli.TrainingRun, "make_output_dir", locked)
    return emulated_gpu


STEPS, B, T = 3, 2, 16


def _batches(K, seed=11):
    """STEPS batches of (K*B, T) token ids: rank r trains on rows r*B..(r+1)*B-1 of each."""
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, TINY.vocab_size, (K * B, T)).astype(np.int32) for _ in range(2)) for _ in range(STEPS)]


def train_rank(rank, comm, zero_stage, precision, batches, grad_clip=0.0, weight_decay=0.1):
    """train()'s training step on one rank, STEPS times: forward, backward, the gradients averaged
    over the ranks (-z 1: reduce-scattered), the global norm, clipping, AdamW (-z 1: all-gather).
    Returns (model, norms, nccl calls)."""
    K = comm.size
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True, zero_stage=zero_stage, process_rank=rank,
                           num_processes=K)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(TINY, 42).params)
    nccl = RecordedNcclComm(comm) if K > 1 else None
    norms = []
    for step, (x, y) in enumerate(batches):
        rows = slice(rank * B, (rank + 1) * B) if K > 1 else slice(None)
        gpt2_cuda.gpt2_zero_grad(model)
        gpt2_cuda.gpt2_forward(model, x[rows], y[rows])
        gpt2_cuda.gpt2_backward(model)
        if nccl is not None:
            gpt2_cuda.gpt2_average_gradients(model, nccl)
        norm = gpt2_cuda.gpt2_global_grad_norm(model, comm)
        norms.append(norm)
        grad_scale = grad_clip / norm if 0 < grad_clip < norm else 1.0
        gpt2_cuda.gpt2_update(model, 1e-3, 0.9, 0.95, 1e-8, weight_decay, step + 1, grad_scale, nccl)
    return model, norms, nccl.calls if nccl else []


def _state(model):
    """The model's parameters and full optimizer state on the host (the shard's m, v, master)."""
    return {"params": model.params.get(), "m": model.m.get(), "v": model.v.get(),
            "master": None if model.master is None else model.master.get()}


def _gathered(models, key):
    """Concatenate the K ranks' shards of m / v / master, cut to the real parameters."""
    return np.concatenate([_state(model)[key] for model in models])[:TINY_N]


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero1_equals_zero0_bitwise(emulated_ranks, K, precision):
    batches = _batches(K)
    z0 = run_ranks(K, lambda r, comm: train_rank(r, comm, 0, precision, batches))
    z1 = run_ranks(K, lambda r, comm: train_rank(r, comm, 1, precision, batches))
    ref = _state(z0[0][0])
    for (model, norms, calls), (_, ref_norms, ref_calls) in zip(z1, z0):
        np.testing.assert_array_equal(model.params.get(), ref["params"])      # every rank, every bit
        assert model.m.size == math.ceil(TINY_N / K / 8) * 8 < TINY_N         # the state is 1/K per rank
        assert calls == ["reduce_scatter", "all_gather"] * STEPS and ref_calls == ["all_reduce"] * STEPS
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-6)              # the global norm, from shards
    for key in ("m", "v") + (("master",) if precision == "bf16" else ()):   # the shards, put together
        np.testing.assert_array_equal(_gathered([z[0] for z in z1], key), ref[key])
    moved = ref["params"] != _state(_tiny_init(precision))["params"]
    assert moved.mean() > 0.5                                                # the steps did change the model


def _tiny_init(precision):
    model = gpt2_cuda.GPT2(TINY, precision, master_weights=True)
    gpt2_cuda.upload_parameters(model, gpt2_cpu.gpt2_init(TINY, 42).params)
    return model


def test_zero1_with_clipping_matches_one_process_on_the_whole_batch(emulated_ranks):
    # K ranks of B rows against one process of K*B rows, fp32, clipping active: equal to fp32
    # rounding, not bitwise (the batch's sum runs in another order, the mean over K*B*T rows is
    # taken in two parts, and the norm squares the shards' fp32 norms). AdamW divides m by
    # sqrt(v), so an element whose gradient is ~0 turns a 1e-7 relative change of it into up to
    # a few thousandths of lr (1e-3): all elements within 1e-5 (1% of lr), 99.9% within 1e-6
    K, clip = 3, 0.5
    batches = _batches(K, seed=5)
    (whole, whole_norms, _), = run_ranks(1, lambda r, comm: train_rank(r, comm, 0, "fp32", batches, clip))
    ranks = run_ranks(K, lambda r, comm: train_rank(r, comm, 1, "fp32", batches, clip))
    assert min(whole_norms) > clip                                            # clipping did happen
    for model, norms, _ in ranks:
        np.testing.assert_allclose(norms, whole_norms, rtol=1e-5)
        got, ref = model.params.get(), whole.params.get()
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
        assert np.isclose(got, ref, rtol=1e-5, atol=1e-6).mean() > 0.999
    np.testing.assert_allclose(_gathered([r[0] for r in ranks], "m"), whole.m.get(), rtol=1e-4, atol=1e-8)


def test_zero1_one_process_is_zero0(emulated_ranks):
    # -z 1 with a single process: one shard is everything, the same launches, the same bits
    batches = _batches(1)
    (a, na, _), = run_ranks(1, lambda r, comm: train_rank(r, comm, 0, "bf16", batches, grad_clip=0.5))
    (b, nb, _), = run_ranks(1, lambda r, comm: train_rank(r, comm, 1, "bf16", batches, grad_clip=0.5))
    assert na == nb and b.shard == zero.Shard(0, 1, TINY_N, TINY_N)
    for key, value in _state(a).items():
        np.testing.assert_array_equal(_state(b)[key], value)


# ----------------------------------------------------------------------------
# part 1e: gpt2_cuda.train() on K emulated ranks: -z 1 against -z 0, checkpoints, resume

def _train_args(tmp_path, data, out, zero_stage, precision="bf16", steps=4, extra=()):
    model = str(tmp_path / "tiny.bin")
    if not os.path.exists(model):
        gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    argv = ["-e", model, "-i", data, "-j", "", "-b", str(B), "-t", str(T), "-x", str(steps), "-v", "0", "-s", "0",
            "-l", "1e-3", "-c", "0.1", "-n", "2", "-o", str(out), "--precision", precision, "-z", str(zero_stage),
            *extra]
    return gpt2_cuda.parse_args(argv)


def _train_on_ranks(K, args):
    return run_ranks(K, lambda rank, comm: gpt2_cuda.train(args))


def test_train_zero1_on_ranks_checkpoints_and_resumes(emulated_ranks, tmp_path, capsys):
    K = 2
    data = _write_shards(tmp_path)
    z0 = _train_on_ranks(K, _train_args(tmp_path, data, tmp_path / "z0", 0))
    z1 = _train_on_ranks(K, _train_args(tmp_path, data, tmp_path / "z1", 1))
    for a, b in zip(z0, z1):
        np.testing.assert_array_equal(b.params.get(), a.params.get())
    for key in ("m", "v", "master"):
        np.testing.assert_array_equal(_gathered(z1, key), _state(z0[0])[key][:TINY_N])
    assert _train_losses(tmp_path / "z1" / "main.log") == _train_losses(tmp_path / "z0" / "main.log")
    # each rank's state file: its shard of m, v, master (S floats each), flagged -z 1
    S = z1[0].shard.size
    for rank in range(K):
        path = checkpoint.checkpoint_paths(str(tmp_path / "z1"), 4, rank)[1]
        st = checkpoint.read_state(path, S, rank, K, zero_stage=1)
        assert st["zero_stage"] == 1 and st["m"].size == st["v"].size == st["master_weights"].size == S
        np.testing.assert_array_equal(st["master_weights"], z1[rank].master.get())
        assert os.path.getsize(path) < os.path.getsize(checkpoint.checkpoint_paths(str(tmp_path / "z0"), 4, rank)[1])
    # the model file holds the bf16 parameters the ranks share, exactly
    saved = gpt2_cpu.read_model(checkpoint.checkpoint_paths(str(tmp_path / "z1"), 4)[0])
    np.testing.assert_array_equal(saved.params, bfloat16_bits_to_float32(z1[0].params.get()))
    # resume at step 2 on K ranks: the same parameters, moments and master weights, bit for bit
    os.remove(tmp_path / "z1" / "DONE_00000004")
    resumed = _train_on_ranks(K, _train_args(tmp_path, data, tmp_path / "z1", 1, extra=("-y", "1")))
    for a, b in zip(z1, resumed):
        for key, value in _state(a).items():
            np.testing.assert_array_equal(_state(b)[key], value)
    assert "resumed from" in capsys.readouterr().out
    # a -z 1 checkpoint of several ranks does not resume with -z 0: one line saying so
    with pytest.raises(gpt2_cuda.InputError, match="written with -z 1, but this run has -z 0: resume with -z 1"):
        _train_on_ranks(K, _train_args(tmp_path, data, tmp_path / "z1", 0, extra=("-y", "1")))


def test_zero_stage_2_is_refused_with_one_line(emulated_gpu, tmp_path, capsys):
    data, model = _write_shards(tmp_path), str(tmp_path / "tiny.bin")
    gpt2_cpu.write_model(model, gpt2_cpu.gpt2_init(TINY, 42))
    assert gpt2_cuda.main(["-e", model, "-i", data, "-j", "", "-b", "2", "-t", "16", "-x", "1", "-z", "2"]) == 1
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
    # the real kernel: a bf16 tensor updated in three pieces with rounding_seed gets the bits of
    # one launch over it (and with the plain seed it does not); the values follow gpt2_cpu's AdamW
    import cupy as cp
    rng = np.random.default_rng(3)
    n, seed, cuts = 1 << 16, 2024, [0, 12345, 40001, 1 << 16]
    p0 = rng.standard_normal(n).astype(np.float32)
    g0 = float32_to_bfloat16_bits(rng.standard_normal(n).astype(np.float32))
    args = (1e-2, 0.9, 0.95, 0.1, 0.05, 1e-8, 0.1, 1.0)

    def run(seeds):
        params, master = cp.asarray(float32_to_bfloat16_bits(p0)), cp.asarray(p0)
        m, v, g = cp.zeros(n, np.float32), cp.zeros(n, np.float32), cp.asarray(g0)
        for (a, b), s in zip(zip(cuts, cuts[1:]), seeds):
            gpt2_cuda.adamw_update(params[a:b], master[a:b], g[a:b], m[a:b], v[a:b], b - a, *args, s)
        return params.get(), master.get()
    params1 = cp.asarray(float32_to_bfloat16_bits(p0))
    master1 = cp.asarray(p0)
    gpt2_cuda.adamw_update(params1, master1, cp.asarray(g0), cp.zeros(n, np.float32), cp.zeros(n, np.float32), n,
                           *args, seed)
    pieces, master3 = run([zero.rounding_seed(seed, a) for a in cuts[:-1]])
    np.testing.assert_array_equal(pieces, params1.get())
    np.testing.assert_array_equal(master3, master1.get())
    plain, _ = run([seed] * 3)
    assert not np.array_equal(plain, params1.get())
    ref = types.SimpleNamespace(params=p0.copy(), grads=bfloat16_bits_to_float32(g0), m=np.zeros(n, np.float32),
                                v=np.zeros(n, np.float32), param_shapes=[("wte", (n,))])
    gpt2_cpu.gpt2_update(ref, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, 1.0)
    np.testing.assert_allclose(master3, ref.params, rtol=1e-5, atol=1e-6)
    # the emulation's rounding (part 1) is the kernel's: the same bits from the same inputs
    assert np.array_equal(stochastic_round_bf16(master1.get(), np.arange(n, dtype=np.uint32), seed), params1.get())
