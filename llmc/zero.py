"""
llmc/zero.py: ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", stage 1 = optimizer state partitioning; llm.c's llmc/zero.cuh): which
part of the flat parameter vector each data-parallel rank keeps AdamW's state for, and how that
part cuts the parameter tensors. Host arithmetic only; gpt2_cuda.gpt2_update runs AdamW on the
pieces and llmc.comm.NcclComm moves the gradients and parameters.

With N data-parallel ranks, rank r keeps AdamW's m, v and the fp32 master weights only for its
shard, elements [r*S, (r+1)*S) of the flat parameter vector, so each rank holds 1/N of the 8 (12
with master weights) bytes per parameter. A step becomes: reduce-scatter the gradients (each rank
receives the mean of its shard only), AdamW on the shard, all-gather the updated parameters into
every rank's full buffer. Without ZeRO-1 the "shard" is rank 0 of 1: the whole vector, so one code
path serves both. Unlike llm.c, which splits every tensor into N pieces (every tensor's size must
divide by N; where the total does not, it runs stage 0), the flat vector is cut once, padded to
N*S: a cut may fall inside a tensor, and the update then covers the intersection of the shard with
each tensor.
"""

import math
from typing import NamedTuple

from llmc.cuda import ceil_div
from llmc.utils import InputError

ZERO_STAGES = (0, 1)                   # llm.c's -z also names 2 and 3, but runs only 0 and 1
ZERO_SHARD_ALIGN = 8                   # S is a multiple of 8 elements: every shard starts 16-byte aligned
SQ5_BIT_NOISE1 = 0xD2A80A3F            # kernels/common.cuh's squirrel_noise5 multiplier (tests check it)
UINT32_MASK = 0xFFFFFFFF


class Shard(NamedTuple):
    """One rank's part of the flat parameter vector (zero_shard): elements [offset, offset + size)
    of the vector padded to `padded` = num_processes * size elements; the real parameters are the
    first num_parameters, so the last shards may end in padding (never updated, never read)."""
    rank: int
    num_processes: int
    num_parameters: int                # n, the real parameters
    size: int                          # S, the elements of every shard (m, v, master weights hold S floats)

    @property
    def offset(self):
        return self.rank * self.size

    @property
    def padded(self):
        return self.num_processes * self.size


class ShardPiece(NamedTuple):
    """The intersection of a shard with one parameter tensor (shard_slices)."""
    name: str                          # the tensor (gpt2_cpu.parameter_shapes)
    flat: slice                        # its elements in the flat parameter / gradient vector
    local: slice                       # the same elements in the shard's m, v, master weights
    start: int                         # the index of its first element within the tensor


def zero_shard(n, rank, num_processes):
    """Rank `rank`'s shard of a flat vector of n elements split over num_processes ranks:
    S = ceil(n / num_processes) rounded up to a multiple of ZERO_SHARD_ALIGN, so all shards are
    the same size (NCCL's reduce-scatter and all-gather take one count for every rank) and start
    aligned. The shards cover [0, num_processes * S) exactly once; the padding is < num_processes
    * ZERO_SHARD_ALIGN elements. One process: S = n, no padding (one shard is everything).
    Raises ValueError for a rank outside [0, num_processes)."""
    if not 0 <= rank < num_processes:
        raise ValueError(f"rank {rank} is not one of {num_processes} processes")
    if num_processes == 1:
        return Shard(0, 1, n, n)
    S = ceil_div(ceil_div(n, num_processes), ZERO_SHARD_ALIGN) * ZERO_SHARD_ALIGN
    return Shard(rank, num_processes, n, S)


def optimizer_shard(n, zero_stage, rank, num_processes):
    """The shard of the optimizer state this rank keeps for -z zero_stage: with 1, zero_shard;
    with 0, everything (zero_shard's rank 0 of 1). Raises InputError for another stage."""
    if zero_stage not in ZERO_STAGES:
        raise InputError(f"-z {zero_stage}: ZeRO stage {zero_stage} is not supported (stages 0 and 1 are; "
                         f"llm.c runs stage 2 and 3 as 0)")
    return zero_shard(n, rank, num_processes) if zero_stage == 1 else zero_shard(n, 0, 1)


def shard_slices(param_shapes, shard):
    """The pieces (ShardPiece, in parameter order) in which `shard` cuts the tensors of
    param_shapes: for each tensor [t0, t1) of the flat vector that meets the shard [o, o+S), its
    intersection [max(t0, o), min(t1, o+S)): at the same indices in params and grads (`flat`), at
    those minus o in m, v, master (`local`), and `start` = max(t0, o) - t0 into the tensor. A shard
    is one contiguous range, so a tensor has at most one piece."""
    pieces, t0 = [], 0
    lo_shard, hi_shard = shard.offset, shard.offset + shard.size
    for name, shape in param_shapes:
        t1 = t0 + math.prod(shape)
        lo, hi = max(t0, lo_shard), min(t1, hi_shard)
        if lo < hi:
            pieces.append(ShardPiece(name, slice(lo, hi), slice(lo - lo_shard, hi - lo_shard), lo - t0))
        t0 = t1
    return pieces


def rounding_seed(seed, start):
    """The seed that makes adamw_update's stochastic rounding of a piece of a tensor that begins
    at element `start` draw the same bits as one launch over the whole tensor: the kernel hashes
    squirrel_noise5(i, seed) with i counted from the launch's first element, and the hash begins
    with i * SQ5_BIT_NOISE1 + seed (mod 2^32), so
        squirrel_noise5(start + j, seed) == squirrel_noise5(j, seed + start * SQ5_BIT_NOISE1).
    Then a sharded run rounds every element as the unsharded one does (same bits, bf16 too)."""
    return (seed + start * SQ5_BIT_NOISE1) & UINT32_MASK
