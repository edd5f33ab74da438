"""
dev/cuda/attention.py: causal self-attention, forward and backward, from a naive kernel to flash
attention on tensor cores, cuDNN and PyTorch.

attention_forward, out (B,T,C) from qkv (B,T,3C) (gpt2_cpu.attention_forward, NH heads of HS):
  version 1 (dev/cuda/attention.cu attention_forward_v1) is the naive port: one thread per query
            row (b, h, t) runs gpt2_cpu's loops for its row (scores and their max, exp and sum,
            normalize, weighted sum of v) alone, from global memory, keeping att (B,NH,T,T) fp32.
  version 2 (llmc.attention.attention_forward, the materialized production path): permute qkv into
            heads, preatt = q k^T with cuBLAS (batched, tensor cores), the softmax kernel, y = att v
            with cuBLAS, unpermute. The GEMMs are fast; the price is writing and reading the
            (B,NH,T,T) matrix, twice as preatt and att, which at T=1024 is most of the traffic.
            (The timing includes one copy of qkv into the path's scratch, where the trainer's
            qkv matmul writes it: 2 x B*T*3C floatX, a few % of the whole.)
  version 3 (dev/cuda/attention.cu attention_forward_hs64_v3): flash attention with S and P through
            shared memory, FlashAttention-1 style: one block per (head, block of query rows) streams
            the keys and values through static shared memory with an online softmax, so nothing of
            size T x T exists in global memory; it reads qkv in place and keeps the row's
            log-sum-exp (lse, B,NH,T fp32) for the backward. Its 16x16 tile products run on tensor
            cores, but S goes to shared memory, comes back for a scalar softmax, and P goes there
            again before O += P V; the loads are not overlapped with the products.
  version 4 (library call: cuDNN, llmc.cudnn_attention.attention_forward_cudnn): NVIDIA's fused
            attention, bf16 only; skipped with its reason where cuDNN is missing (and in fp32).
            Grouped-query attention (the _gqa progressions): repeat_kv_forward first, as
            llama3_cuda.py's cuDNN path does.
  version 5 (library call: PyTorch's scaled_dot_product_attention, a reference row, not ours):
            timed in the same run when torch with CUDA is importable, on the same memory (DLPack);
            its time includes writing the heads back into (B,T,C), a copy.
  version 6 (dev/cuda/attention.cu attention_forward_hs64_v6): FlashAttention-2 on mma.sync:
            S = Q K^T and O += P V on mma.m16n8k16 with S and P never leaving registers (the
            accumulator of Q K^T is, register for register, the A operand of P V), Q's fragments
            held for the whole loop, K by ldmatrix and V by ldmatrix.trans, the online softmax on
            the registers with exp2 (four lanes per row, two shuffles). Faster than version 3
            because the round trips of S and P through shared memory and the scalar softmax are
            gone. Still: one buffer, so each tile is loaded after the last is done and the warps
            wait for it; plain row-major tiles, whose ldmatrix reads conflict 8 ways at HS = 64.
  version 7 (..._v7): + cp.async double buffering: tile j+1 streams into the second buffer while
            tile j is computed, one __syncthreads per tile instead of two and no idle wait.
  version 8 (kernels/flash_attention.cu, llmc.attention.flash_attention_forward, production):
            + XOR-swizzled tiles (conflict-free ldmatrix) and, at HS = 64, two 16-row tiles per
            warp (each K and V fragment loaded from shared memory feeds two mma: half the
            shared-memory traffic per product).
  version 9 (candidate, ..._v9): version 8's templates at another tile shape, timed beside it so
            that the best can be chosen: one row tile per warp (64-row blocks: fewer registers,
            more blocks per SM, each K/V fragment feeding one mma).
  version 10 (candidate, ..._v10): 8 warps of one row tile (128-row blocks: half the global loads
            of K and V per query row of version 9, the shared-memory traffic of version 7).
  version 11 (candidate, ..._v11): version 8's tiles with three stages (two tiles in flight).
  The hand-written versions 3, 6, 7, 9-11 are compiled for GPT-2's head size 64. The _gqa
  progressions (Llama 3's grouped-query attention) time version 8, which reads the shared
  key/value heads in place, against versions 4 and 5.
attention_backward, dqkv (B,T,3C) from dout (B,T,C) (gpt2_cpu.attention_backward), versions as
the forward: 1 naive (one thread per query row, fp32 atomicAdd for dk and dv, then a cast),
2 llmc.attention.attention_backward (cuBLAS + softmax_backward + permutes, reads att), 3 flash
with S, P, dS through shared memory (dk/dv and dq kernels, probabilities recomputed from lse),
4 cuDNN's backward, 5 PyTorch's (torch.autograd.grad through SDPA, the forward's graph built once
and kept), 6 FlashAttention-2's backward on mma.sync, S^T, P^T, dP^T, dS^T in registers, still two
kernels that own their outputs (dk/dv per key block, dq per query block: deterministic, no
atomics), one buffer, 7 + cp.async double buffering, 8 the production kernels
(llmc.attention.flash_attention_backward: + swizzled tiles), 9 (candidate) 8 warps a block,
10 (candidate) three stages. Each version gets what its forward keeps, computed by gpt2_cpu from
the same inputs: att (v1 in fp32, v2 in floatX), the per-head q, k, v (v2), out and lse (v3-v11).

FLOPs, FlashAttention-2's convention (Dao 2023, sec. 4.1), the same numerator for every version:
forward = 4 B NH T^2 HS / 2: two GEMMs (q k^T and att v) of 2 T^2 HS each per head, halved
because the causal mask leaves half of the (T,T) matrix to compute; backward = 2.5 x forward:
five such GEMMs (the recomputed q k^T, dv, datt, dq, dk), although the materialized versions do
not recompute q k^T and our two-kernel flash backward computes seven (q k^T and dout v^T again in
the dq kernel). Bytes: the least any version must move, qkv read and out written (forward), qkv
and dout read and dqkv written (backward); the materialized path moves far more.

Shapes: GPT-2 124M's (B=16, T=1024, NH=12, HS=64), a small one (B=4, T=256), and Llama 3 8B's
grouped-query attention (B=2, T=1024, NH=32, NKV=8, HS=128; the _gqa progressions).
Run (needs a CUDA GPU; without one it says so in one line and exits 2):
    python dev/cuda/attention.py          # every version, every shape, forward and backward, bf16
    python dev/cuda/attention.py 2 -p fp32
    python dev/cuda/attention.py --versions 4,6,7,8,9 --progressions attention_forward,attention_backward
    python dev/cuda/attention.py --device cpu     # validate every version on the emulated device
prints a validation line per (version, block size), then one table per progression (time,
TFLOP/s, % of the measured cuBLAS GEMM), written to dev/results/dev_cuda_attention.md (with
--versions and --progressions too: the table of what ran).
"""

import argparse
import dataclasses
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Kernel, Progression, Version, dev_kernel, production_kernel  # noqa: E402
from matmul import LIBRARY_BLOCK_SIZES, without_unavailable  # noqa: E402  (dev/cuda/matmul.py)

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
import gpt2_cuda  # noqa: E402  (imports CuPy only when a launcher runs)
import llama3_cpu  # noqa: E402
import llmc.attention  # noqa: E402
from llmc import cuda, cuda_check  # noqa: E402
from llmc.attention import DkdvTiles, DqTiles, ForwardTiles  # noqa: E402
from llmc.cli import ArgumentParser  # noqa: E402
from llmc.cuda import ceil_div  # noqa: E402

OP = "attention"
FORWARD_V1 = dev_kernel(OP, "attention_forward_v1")
BACKWARD_V1 = dev_kernel(OP, "attention_backward_v1")
BACKWARD_CAST_V1 = dev_kernel(OP, "attention_backward_cast_v1")
SOFTMAX_FORWARD = production_kernel("attention", "softmax_forward")       # + cuBLAS, permutes
SOFTMAX_BACKWARD = production_kernel("attention", "softmax_backward")
# labels for the table (a version's first kernel names its row): launchers of several kernels
MATERIALIZED_FORWARD = Kernel("llmc/attention.py", "attention_forward")
MATERIALIZED_BACKWARD = Kernel("llmc/attention.py", "attention_backward")
FLASH_FILE = os.path.join(common.REPO_ROOT, "kernels", "flash_attention.cu")
# the fused versions launch kernels chosen by head size (ours) or by the library: table labels
FLASH_FORWARD = Kernel("kernels/flash_attention.cu", "flash_attention_forward")
FLASH_BACKWARD = Kernel("kernels/flash_attention.cu", "flash_attention_backward")
CUDNN_FORWARD = Kernel("llmc/cudnn_attention.py", "cudnn_sdpa_forward")
CUDNN_BACKWARD = Kernel("llmc/cudnn_attention.py", "cudnn_sdpa_backward")
TORCH_FORWARD = Kernel("torch", "scaled_dot_product_attention")
TORCH_BACKWARD = Kernel("torch", "sdpa_autograd_backward")

V1_BLOCK_SIZES = (64, 256)          # the naive kernels are slow: two points of the sweep
CAST_BLOCK_SIZE = 256
DEV_HEAD_SIZE = 64                  # versions 3, 6, 7, 9-11 (dev/cuda/attention.cu): GPT-2's head size


# ----------------------------------------------------------------------------
# napkin math

def attention_forward_flops(B, NH, T, HS):
    """FLOPs of causal attention's forward: 4 B NH T^2 HS / 2 (q k^T and att v, 2 T^2 HS each
    per head, halved for the causal mask; FlashAttention-2's convention)."""
    return 4 * B * NH * T * T * HS // 2


def attention_backward_flops(B, NH, T, HS):
    """2.5 x the forward's: five T x T x HS GEMMs (recomputed q k^T, dv, datt, dq, dk), causal half."""
    return 5 * attention_forward_flops(B, NH, T, HS) // 2


# ----------------------------------------------------------------------------
# problems: inputs, references from gpt2_cpu.py (and llama3_cpu.py's key/value repeat)

def repeated(qkv, NH, NKV):
    """qkv (B,T,(NH+2NKV)*HS) -> GPT-2's (B,T,3C), every key/value head repeated for the NH/NKV
    query heads it serves (llama3_cpu.repeat_kv_forward): the input of gpt2_cpu's attention."""
    if NKV == NH:
        return qkv
    q, k, v = llama3_cpu.split_qkv(qkv, NH, NKV)
    return llama3_cpu.merge_heads(q, llama3_cpu.repeat_kv_forward(k, NH // NKV), llama3_cpu.repeat_kv_forward(v, NH // NKV))


def grouped(dqkv, NH, NKV):
    """The gradient of `repeated`'s input from that of its output (llama3_cpu.repeat_kv_backward)."""
    if NKV == NH:
        return dqkv
    dq, dk, dv = llama3_cpu.split_qkv(dqkv, NH, NH)
    return llama3_cpu.merge_heads(dq, llama3_cpu.repeat_kv_backward(dk, NH // NKV),
                                  llama3_cpu.repeat_kv_backward(dv, NH // NKV))


def _scalars(case, B, T, NH, HS, NKV):
    for name, value in dict(B=B, T=T, NH=NH, HS=HS, C=NH * HS, NKV=NKV, QKV=(NH + 2 * NKV) * HS).items():
        case.scalar(name, value)


def make_forward_case(rng, precision, B, T, NH, HS, NKV=None):
    """qkv (B,T,(NH+2NKV)*HS) ~ N(0,1) -> out (B,T,C) = gpt2_cpu.attention_forward of it (its kv
    heads repeated when NKV < NH). The scratch buffers are what each version keeps or works in
    (allocated once for all versions; those of versions 1-3 only in GPT-2's layout)."""
    NKV = NH if NKV is None else NKV
    C, QKV = NH * HS, (NH + 2 * NKV) * HS
    case = common.Case(precision)
    _scalars(case, B, T, NH, HS, NKV)
    qkv = case.input("qkv", rng.standard_normal((B, T, QKV)))
    out, _ = gpt2_cpu.attention_forward(repeated(qkv, NH, NKV), NH)
    case.output("out", (B, T, C))
    case.check("out", out, "attention")
    if NKV == NH:
        case.scratch("att_f32", (B, NH, T, T), "f32")                           # v1
        case.scratch("qkvr", (3, B, NH, T, HS), "X")                            # v2
        case.scratch("att", (B, NH, T, T), "X")
        case.scratch("work", (B * T * max(3 * C, NH * T),), "X")                # v2: qkv, preatt, y
    else:
        case.scratch("qkv_repeated", (B, T, 3 * C), "X")                        # v4: repeat_kv_forward's
    case.scratch("lse", (B, NH, T), "f32")                                      # v3, v4, v6-v11
    case.bytes = common.napkin_bytes(precision, floatX=B * T * QKV + B * T * C)
    case.flops = attention_forward_flops(B, NH, T, HS)
    return case


def make_backward_case(rng, precision, B, T, NH, HS, NKV=None):
    """qkv (B,T,(NH+2NKV)*HS), dout (B,T,C) ~ N(0,1) -> dqkv = gpt2_cpu.attention_backward(dout,
    qkv, att, NH) (the kv heads' gradients summed over their query heads when NKV < NH), with att,
    out and lse from gpt2_cpu's forward on the same (floatX-rounded) qkv."""
    NKV = NH if NKV is None else NKV
    C, QKV = NH * HS, (NH + 2 * NKV) * HS
    case = common.Case(precision)
    _scalars(case, B, T, NH, HS, NKV)
    qkv = case.input("qkv", rng.standard_normal((B, T, QKV)))
    dout = case.input("dout", rng.standard_normal((B, T, C)))
    full = repeated(qkv, NH, NKV)                                               # (B,T,3C)
    out, att = gpt2_cpu.attention_forward(full, NH)
    case.output("dqkv", (B, T, QKV))
    case.check("dqkv", grouped(gpt2_cpu.attention_backward(dout, full, att, NH), NH, NKV), "attention")
    # what each version's forward keeps
    if NKV == NH:
        case.input("att_f32", att, "f32")                                       # v1
        case.input("att", att, "X")                                             # v2
        case.input("qkvr", qkv.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4))   # v2: (3,B,NH,T,HS)
        case.scratch("dqkv_acc", (B, T, 3 * C), "f32")                          # v1
        case.scratch("dqkvr", (3, B, NH, T, HS), "X")                           # v2
        case.scratch("datt", (B, NH, T, T), "X")
        case.scratch("dy", (B, NH, T, HS), "X")
    else:
        case.scratch("qkv_repeated", (B, T, 3 * C), "X")                        # v4: repeat_kv_forward's
        case.scratch("dqkv_repeated", (B, T, 3 * C), "X")                       # v4: cuDNN's, then summed
    case.input("out", out)                                                      # v3-v11
    case.input("lse", cuda_check.attention_lse(full, NH), "f32")
    case.scratch("D", (B, NH, T), "f32")                                        # v3, v6-v11
    case.bytes = common.napkin_bytes(precision, floatX=B * T * QKV + B * T * C + B * T * QKV)
    case.flops = attention_backward_flops(B, NH, T, HS)
    return case


# ----------------------------------------------------------------------------
# launchers, forward

def forward_v1(d, block_size):
    FORWARD_V1.launch(d.precision, ceil_div(d.B * d.NH * d.T, block_size), block_size,
                      (d.out, d.att_f32, d.qkv, np.int32(d.B), np.int32(d.T), np.int32(d.NH), np.int32(d.HS)))


def forward_v2(d, block_size):
    d.work[:d.qkv.size] = d.qkv.reshape(-1)          # where the trainer's qkv matmul leaves it
    llmc.attention.attention_forward(d.out, d.qkvr, d.att, d.work, d.B, d.T, d.C, d.NH)


def v3_launch(d):
    """(grid, block) of version 3's kernels: a block owns R = min(64, 8 KiB / (HS bytes)) rows
    (16 per warp), one block per (b*NH + h, R rows): dev/cuda/attention.cu's FlashTiles."""
    rows = min(64, 8192 // (d.HS * common.itemsize("X", d.precision)))
    return (d.B * d.NH, ceil_div(d.T, rows)), rows // llmc.attention.FLASH_ROWS_PER_WARP * cuda.WARP_SIZE


def forward_v3(d, block_size):
    grid, block = v3_launch(d)
    dev_kernel(OP, f"attention_forward_hs{d.HS}_v3").launch(
        d.precision, grid, block, (d.out, d.lse, d.qkv, np.int32(d.B), np.int32(d.T), np.int32(d.NH)))


def forward_v4(d, block_size):
    from llmc import cudnn_attention
    qkv = d.qkv
    if d.NKV != d.NH:                                 # llama3_cuda.py's cuDNN path: repeat, then attend
        import llama3_cuda
        llama3_cuda.repeat_kv_forward(d.qkv_repeated, d.qkv, d.B, d.T, d.NH, d.NKV, d.HS)
        qkv = d.qkv_repeated
    cudnn_attention.attention_forward_cudnn(d.out, d.lse, qkv, d.B, d.T, d.NH, d.HS)


def forward_v5(d, block_size):
    import torch.nn.functional as F
    q, k, v = torch_heads(d, torch_views(d)["qkv"])                           # (B,NH|NKV,T,HS), strided
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=d.NKV != d.NH)   # (B,NH,T,HS)
    torch_views(d)["out"].view(d.B, d.T, d.NH, d.HS).copy_(y.transpose(1, 2))  # -> (B,T,NH,HS)


def forward_v8(d, block_size):
    llmc.attention.flash_attention_forward(d.out, d.lse, d.qkv, d.B, d.T, d.C, d.NH, d.NKV)


def launch_dev_flash(kernel, precision, grid, block, args, shared):
    """Launch a flash kernel of dev/cuda/attention.cu with `shared` bytes of dynamic shared memory,
    after its opt-in above 48 KiB (llmc.attention.launch_with_shared_memory's rule)."""
    if shared > llmc.attention.FLASH_DEFAULT_SHARED_BYTES:
        function = common.load_function(kernel, precision)
        function.max_dynamic_shared_size_bytes = max(function.max_dynamic_shared_size_bytes, shared)
    kernel.launch(precision, grid, block, args, shared_mem=shared)


def flash_forward_dev(number):
    """The launcher of version `number`'s forward (dev/cuda/attention.cu, its DEV_TILES shape)."""
    def launch(d, block_size):
        tiles = DEV_TILES[d.precision, number][0]
        grid, block, shared = llmc.attention.flash_forward_launch(tiles, d.HS, common.itemsize("X", d.precision),
                                                                  d.B, d.T, d.NH)
        launch_dev_flash(dev_kernel(OP, f"attention_forward_hs{d.HS}_v{number}"), d.precision, grid, block,
                         (d.out, d.lse, d.qkv, np.int32(d.B), np.int32(d.T), np.int32(d.NH), np.int32(d.NKV)), shared)
    return launch


# ----------------------------------------------------------------------------
# launchers, backward

def backward_v1(d, block_size):
    d.dqkv_acc.fill(0)
    BACKWARD_V1.launch(d.precision, ceil_div(d.B * d.NH * d.T, block_size), block_size,
                       (d.dqkv_acc, d.dout, d.qkv, d.att_f32, np.int32(d.B), np.int32(d.T), np.int32(d.NH),
                        np.int32(d.HS)))
    n = d.dqkv.size
    BACKWARD_CAST_V1.launch(d.precision, ceil_div(n, CAST_BLOCK_SIZE), CAST_BLOCK_SIZE,
                            (d.dqkv, d.dqkv_acc, np.int32(n)))


def backward_v2(d, block_size):
    llmc.attention.attention_backward(d.dqkv, d.dqkvr, d.datt, d.dy, d.dout, d.qkvr, d.att, d.B, d.T, d.C, d.NH)


def backward_preprocess(d):
    """D = rowsum(dout * out): the production kernel, which every flash version's backward starts with."""
    cuda.launch("flash_attention", d.precision, "flash_attention_backward_preprocess",
                cuda.elementwise_grid(d.B * d.T * d.NH), cuda.BLOCK_SIZE,
                (d.D, d.dout, d.out, np.int32(d.B), np.int32(d.T), np.int32(d.NH), np.int32(d.HS)))


def backward_v3(d, block_size):
    backward_preprocess(d)
    grid, block = v3_launch(d)
    args = (d.dqkv, d.dout, d.qkv, d.lse, d.D, np.int32(d.B), np.int32(d.T), np.int32(d.NH))
    dev_kernel(OP, f"attention_backward_dkdv_hs{d.HS}_v3").launch(d.precision, grid, block, args)
    dev_kernel(OP, f"attention_backward_dq_hs{d.HS}_v3").launch(d.precision, grid, block, args)


def backward_v4(d, block_size):
    from llmc import cudnn_attention
    if d.NKV == d.NH:
        cudnn_attention.attention_backward_cudnn(d.dqkv, d.dout, d.qkv, d.out, d.lse, d.B, d.T, d.NH, d.HS)
        return
    import llama3_cuda                               # llama3_cuda.py's cuDNN path: on the repeated heads
    llama3_cuda.repeat_kv_forward(d.qkv_repeated, d.qkv, d.B, d.T, d.NH, d.NKV, d.HS)
    cudnn_attention.attention_backward_cudnn(d.dqkv_repeated, d.dout, d.qkv_repeated, d.out, d.lse, d.B, d.T, d.NH, d.HS)
    llama3_cuda.repeat_kv_backward(d.dqkv, d.dqkv_repeated, d.B, d.T, d.NH, d.NKV, d.HS)


def backward_v5(d, block_size):
    """torch.autograd.grad through SDPA; the forward's graph is built on the first call and kept
    (retain_graph), so each call times the backward alone."""
    import torch
    import torch.nn.functional as F
    views = torch_views(d)
    if "graph" not in views:
        leaves = tuple(x.detach().requires_grad_() for x in torch_heads(d, views["qkv"]))
        views["graph"] = (F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=d.NKV != d.NH), leaves)
    y, leaves = views["graph"]
    dy = views["dout"].view(d.B, d.T, d.NH, d.HS).transpose(1, 2)             # (B,NH,T,HS)
    grads = torch.autograd.grad(y, leaves, dy, retain_graph=True)            # dq, dk, dv (B,NH|NKV,T,HS)
    for g, section in zip(grads, torch_heads(d, views["dqkv"])):
        section.copy_(g)


def backward_v8(d, block_size):
    llmc.attention.flash_attention_backward(d.dqkv, d.D, d.dout, d.out, d.qkv, d.lse, d.B, d.T, d.C, d.NH, d.NKV)


def flash_backward_dev(number):
    """The launcher of version `number`'s backward: the production preprocess, then its dk/dv and
    dq kernels (dev/cuda/attention.cu, its DEV_TILES shapes)."""
    def launch(d, block_size):
        backward_preprocess(d)
        _, dkdv_tiles, dq_tiles = DEV_TILES[d.precision, number]
        itemsize = common.itemsize("X", d.precision)
        args = (d.dqkv, d.dout, d.qkv, d.lse, d.D, np.int32(d.B), np.int32(d.T), np.int32(d.NH), np.int32(d.NKV))
        for kind, (grid, block, shared) in (
                ("dkdv", llmc.attention.flash_dkdv_launch(dkdv_tiles, d.HS, itemsize, d.B, d.T, d.NKV)),
                ("dq", llmc.attention.flash_dq_launch(dq_tiles, d.HS, itemsize, d.B, d.T, d.NH))):
            launch_dev_flash(dev_kernel(OP, f"attention_backward_{kind}_hs{d.HS}_v{number}"), d.precision, grid, block,
                             args, shared)
    return launch


def torch_views(d):
    """torch tensors on the memory of d's CuPy arrays (DLPack, no copy), made once per case: bf16
    bits are shared as int16 and viewed as torch.bfloat16. Both libraries use the default stream."""
    if not hasattr(d, "torch"):
        import torch
        def view(arr):
            if d.precision == "bf16":
                return torch.from_dlpack(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_dlpack(arr)
        d.torch = {name: view(getattr(d, name)) for name in ("qkv", "out", "dout", "dqkv") if hasattr(d, name)}
    return d.torch


def torch_heads(d, qkv):
    """q (B,NH,T,HS), k, v (B,NKV,T,HS): strided views of a (B,T,(NH+2NKV)*HS) torch tensor."""
    heads = qkv.view(d.B, d.T, d.NH + 2 * d.NKV, d.HS).transpose(1, 2)        # (B,NH+2NKV,T,HS)
    return heads[:, :d.NH], heads[:, d.NH:d.NH + d.NKV], heads[:, d.NH + d.NKV:]


# ----------------------------------------------------------------------------
# versions 6, 7, 9-11: dev/cuda/attention.cu's tile shapes at HS = 64 (its typedefs, restated; the
# tests check the two agree): (precision, version) -> (forward, dk/dv, dq) tiles; version 11 is
# a forward only. fp32 tiles take twice the bytes: fewer keys (queries) per tile.

DEV_TILES = {
    ("bf16", 6): (ForwardTiles(4, 1, 64, 1), DkdvTiles(4, 32, 1), DqTiles(4, 64, 1)),
    ("bf16", 7): (ForwardTiles(4, 1, 64, 2), DkdvTiles(4, 32, 2), DqTiles(4, 64, 2)),
    ("bf16", 9): (ForwardTiles(4, 1, 64, 2), DkdvTiles(8, 32, 2), DqTiles(8, 64, 2)),
    ("bf16", 10): (ForwardTiles(8, 1, 64, 2), DkdvTiles(4, 32, 3), DqTiles(4, 64, 3)),
    ("bf16", 11): (ForwardTiles(4, 2, 64, 3), None, None),
    ("fp32", 6): (ForwardTiles(4, 1, 32, 1), DkdvTiles(4, 32, 1), DqTiles(4, 32, 1)),
    ("fp32", 7): (ForwardTiles(4, 1, 32, 2), DkdvTiles(4, 32, 2), DqTiles(4, 32, 2)),
    ("fp32", 9): (ForwardTiles(4, 1, 32, 2), DkdvTiles(8, 16, 2), DqTiles(8, 16, 2)),
    ("fp32", 10): (ForwardTiles(8, 1, 16, 2), DkdvTiles(4, 32, 3), DqTiles(4, 32, 3)),
    ("fp32", 11): (ForwardTiles(4, 1, 32, 3), None, None),
}


# ----------------------------------------------------------------------------
# versions that need code or libraries that may be missing, or another layout: skipped, with the reason

def gpt2_layout_reason(precision, sizes):
    if sizes.get("NKV", sizes["NH"]) != sizes["NH"]:
        return "needs GPT-2's layout (as many key/value heads as query heads)"
    return None


def v3_unavailable_reason(precision, sizes):
    if sizes["HS"] != DEV_HEAD_SIZE:
        return f"dev/cuda/attention.cu has version 3 for head size {DEV_HEAD_SIZE} only"
    return gpt2_layout_reason(precision, sizes)


def dev_flash_unavailable_reason(precision, sizes):
    if sizes["HS"] != DEV_HEAD_SIZE:
        return f"dev/cuda/attention.cu has versions 6, 7, 9-11 for head size {DEV_HEAD_SIZE} only"
    return None


def flash_unavailable_reason(precision, sizes):
    if not (os.path.isfile(FLASH_FILE) and hasattr(llmc.attention, "flash_attention_forward")):
        return "kernels/flash_attention.cu or llmc.attention.flash_attention_forward is not in this checkout"
    if hasattr(llmc.attention, "flash_attention_supported") and not llmc.attention.flash_attention_supported(sizes["HS"]):
        return f"kernels/flash_attention.cu has no kernel for head size {sizes['HS']}"
    return None


def cudnn_unavailable_reason(precision, sizes):
    from llmc import cudnn_attention
    return cudnn_attention.unavailable_reason(precision, sizes["HS"])


def torch_unavailable_reason(precision, sizes):
    """Why PyTorch's version cannot run here: not importable, or no CUDA device (on the emulated
    device, whose arrays are host memory, torch's CPU tensors share them through DLPack)."""
    try:
        import torch
    except Exception as e:                 # ImportError, or a broken install
        return f"PyTorch is not importable ({type(e).__name__}: {e})".splitlines()[0]
    return None if cuda.device() == "cpu" or torch.cuda.is_available() else "PyTorch sees no CUDA device"


OPTIONAL_VERSIONS = {1: gpt2_layout_reason, 2: gpt2_layout_reason, 3: v3_unavailable_reason,
                     4: cudnn_unavailable_reason, 5: torch_unavailable_reason, 6: dev_flash_unavailable_reason,
                     7: dev_flash_unavailable_reason, 8: flash_unavailable_reason, 9: dev_flash_unavailable_reason,
                     10: dev_flash_unavailable_reason, 11: dev_flash_unavailable_reason}


# ----------------------------------------------------------------------------
# the progressions

def _dev(kind, number):
    return dev_kernel(OP, f"attention_{kind}_hs{DEV_HEAD_SIZE}_v{number}")


FORWARD_VERSIONS = [
    Version(1, "naive: one thread per query row, gpt2_cpu's loops, att kept in fp32", (FORWARD_V1,), forward_v1,
            V1_BLOCK_SIZES),
    Version(2, "production (materialized): permute, cuBLAS q k^T, softmax kernel, cuBLAS att v, unpermute",
            (MATERIALIZED_FORWARD, SOFTMAX_FORWARD), forward_v2, LIBRARY_BLOCK_SIZES),
    Version(3, "flash attention, S and P through shared memory (16x16 tiles on mma.sync), online softmax",
            (_dev("forward", 3),), forward_v3, LIBRARY_BLOCK_SIZES),
    Version(4, "library call: cuDNN fused attention", (CUDNN_FORWARD,), forward_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "reference: PyTorch scaled_dot_product_attention", (TORCH_FORWARD,), forward_v5,
            LIBRARY_BLOCK_SIZES),
    Version(6, "FlashAttention-2 on mma.sync: S and P in registers, exp2 softmax; one buffer, plain tiles",
            (_dev("forward", 6),), flash_forward_dev(6), LIBRARY_BLOCK_SIZES),
    Version(7, "+ cp.async double buffering: the next key/value tile loads during the products",
            (_dev("forward", 7),), flash_forward_dev(7), LIBRARY_BLOCK_SIZES),
    Version(8, "production (kernels/flash_attention.cu): + swizzled tiles, two row tiles per warp at HS 64",
            (FLASH_FORWARD,), forward_v8, LIBRARY_BLOCK_SIZES),
    Version(9, "candidate: one row tile per warp (64-row blocks)",
            (_dev("forward", 9),), flash_forward_dev(9), LIBRARY_BLOCK_SIZES),
    Version(10, "candidate: 8 warps of one row tile (128-row blocks)", (_dev("forward", 10),),
            flash_forward_dev(10), LIBRARY_BLOCK_SIZES),
    Version(11, "candidate: version 8's tiles with three stages", (_dev("forward", 11),), flash_forward_dev(11),
            LIBRARY_BLOCK_SIZES),
]


def _flash_backward(number):
    """Version `number`'s dk/dv and dq kernels."""
    return (_dev("backward_dkdv", number), _dev("backward_dq", number))


BACKWARD_VERSIONS = [
    Version(1, "naive: one thread per query row, fp32 atomics for dk, dv, then a cast",
            (BACKWARD_V1, BACKWARD_CAST_V1), backward_v1, V1_BLOCK_SIZES),
    Version(2, "production (materialized): unpermute, cuBLAS, softmax_backward kernel, cuBLAS, permute",
            (MATERIALIZED_BACKWARD, SOFTMAX_BACKWARD), backward_v2, LIBRARY_BLOCK_SIZES),
    Version(3, "flash attention backward, S, P, dS through shared memory: dk/dv and dq kernels",
            _flash_backward(3), backward_v3, LIBRARY_BLOCK_SIZES),
    Version(4, "library call: cuDNN fused attention backward", (CUDNN_BACKWARD,), backward_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "reference: PyTorch SDPA backward (autograd)", (TORCH_BACKWARD,), backward_v5, LIBRARY_BLOCK_SIZES),
    Version(6, "FlashAttention-2's backward on mma.sync, S, P, dP, dS in registers; one buffer, plain tiles",
            _flash_backward(6), flash_backward_dev(6), LIBRARY_BLOCK_SIZES),
    Version(7, "+ cp.async double buffering of the streamed tiles", _flash_backward(7), flash_backward_dev(7),
            LIBRARY_BLOCK_SIZES),
    Version(8, "production (kernels/flash_attention.cu): + swizzled tiles", (FLASH_BACKWARD,), backward_v8,
            LIBRARY_BLOCK_SIZES),
    Version(9, "candidate: 8 warps a block (128 keys per dk/dv block, 128 rows per dq block)", _flash_backward(9),
            flash_backward_dev(9), LIBRARY_BLOCK_SIZES),
    Version(10, "candidate: three stages", _flash_backward(10), flash_backward_dev(10), LIBRARY_BLOCK_SIZES),
]


SIZES_124M = dict(B=16, T=1024, NH=12, HS=64)
SIZES_SMALL = dict(B=4, T=256, NH=12, HS=64)
SIZES_GQA = dict(B=2, T=1024, NH=32, NKV=8, HS=128)        # Llama 3 8B's heads
TEST_SIZES = dict(B=2, T=67, NH=3, HS=64)       # T not a multiple of any tile or vector
TEST_SIZES_GQA = dict(B=1, T=45, NH=4, NKV=2, HS=128)
GQA_VERSIONS = (4, 5, 8)              # Llama 3's shape: the production kernels against the libraries
PROGRESSIONS = [
    Progression("attention_forward", make_forward_case, FORWARD_VERSIONS, SIZES_124M, TEST_SIZES),
    Progression("attention_forward_small", make_forward_case, FORWARD_VERSIONS, SIZES_SMALL, TEST_SIZES),
    Progression("attention_backward", make_backward_case, BACKWARD_VERSIONS, SIZES_124M, TEST_SIZES),
    Progression("attention_backward_small", make_backward_case, BACKWARD_VERSIONS, SIZES_SMALL, TEST_SIZES),
    Progression("attention_forward_gqa", make_forward_case, [v for v in FORWARD_VERSIONS if v.number in GQA_VERSIONS],
                SIZES_GQA, TEST_SIZES_GQA),
    Progression("attention_backward_gqa", make_backward_case,
                [v for v in BACKWARD_VERSIONS if v.number in GQA_VERSIONS], SIZES_GQA, TEST_SIZES_GQA),
]


# ----------------------------------------------------------------------------
# the command line: common.main's, plus a subset of versions and progressions

def selection_parser():
    """The flags this script adds to common.main's (--help prints them first)."""
    parser = ArgumentParser(prog=f"dev/cuda/{OP}.py", add_help=False,
                            description="selection (added to the flags below)")
    parser.add_argument("--versions", default=None,
                        help="comma-separated version numbers to run, e.g. 4,6,7,8 (default: all); the table of "
                             "what ran is written as with all")
    parser.add_argument("--progressions", default=None,
                        help=f"comma-separated progressions to run (default: all of "
                             f"{', '.join(p.name for p in PROGRESSIONS)})")
    return parser


def selected_progressions(progressions, versions, names):
    """progressions restricted to `names` (None: all) and, in each, to `versions` (None: all).
    Raises ValueError naming an unknown progression."""
    unknown = set(names or ()) - {p.name for p in progressions}
    if unknown:
        raise ValueError(f"no progression {', '.join(sorted(unknown))} (have {', '.join(p.name for p in progressions)})")
    return [dataclasses.replace(p, versions=[v for v in p.versions if versions is None or v.number in versions])
            for p in progressions if names is None or p.name in names]


def main(argv=None):
    """common.main on the selected versions that can run here (without a GPU: its one-line exit 2;
    --device cpu: on the emulated device)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    selection, rest = selection_parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        selection_parser().print_help()
        print()
    try:
        versions = None if selection.versions is None else {int(v) for v in selection.versions.split(",")}
        names = None if selection.progressions is None else selection.progressions.split(",")
        progressions = selected_progressions(PROGRESSIONS, versions, names)
    except ValueError as e:
        print(f"dev/cuda/{OP}.py: {e}", file=sys.stderr)
        return 1
    args = common.parse_args(OP, progressions, rest)
    if args.device == "cpu":
        cuda.use_device("cpu")
    if cuda.cuda_unavailable_reason() is not None:
        return common.main(OP, progressions, rest)
    return common.main(OP, without_unavailable(progressions, OPTIONAL_VERSIONS, args.precision), rest)


if __name__ == "__main__":
    sys.exit(main())
