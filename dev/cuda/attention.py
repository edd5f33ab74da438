"""
dev/cuda/attention.py: causal self-attention, forward and backward, from a naive kernel to flash
attention, cuDNN and PyTorch.

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
  version 3 (llmc.attention.flash_attention_forward, kernels/flash_attention.cu): ours, FlashAttention-2
            style: one block per (head, block of query rows) streams the keys and values through shared
            memory with an online softmax, so nothing of size T x T exists; it reads qkv in
            place and keeps the row's log-sum-exp (lse, B,NH,T fp32) for the backward.
  version 4 (library call: cuDNN, llmc.cudnn_attention.attention_forward_cudnn): NVIDIA's fused
            attention, bf16 only; skipped with its reason where cuDNN is missing (and in fp32).
  version 5 (library call: PyTorch's scaled_dot_product_attention, a reference row, not ours):
            timed in the same run when torch with CUDA is importable, on the same memory (DLPack);
            its time includes writing the heads back into (B,T,C), a copy.
attention_backward, dqkv (B,T,3C) from dout (B,T,C) (gpt2_cpu.attention_backward), versions as
the forward: 1 naive (one thread per query row, fp32 atomicAdd for dk and dv, then a cast),
2 llmc.attention.attention_backward (cuBLAS + softmax_backward + permutes, reads att), 3
llmc.attention.flash_attention_backward (recomputes the probabilities from lse), 4 cuDNN's backward,
5 PyTorch's (torch.autograd.grad through SDPA, the forward's graph built once and kept).
Each version gets what its forward keeps, computed by gpt2_cpu from the same inputs: att (v1 in
fp32, v2 in floatX), the per-head q, k, v (v2), out and lse (v3, v4).

FLOPs, FlashAttention-2's convention (Dao 2023, sec. 4.1), the same numerator for every version:
forward = 4 B NH T^2 HS / 2: two GEMMs (q k^T and att v) of 2 T^2 HS each per head, halved
because the causal mask leaves half of the (T,T) matrix to compute; backward = 2.5 x forward:
five such GEMMs (the recomputed q k^T, dv, datt, dq, dk), although the materialized versions do
not recompute q k^T. Bytes: the least any version must move, qkv read and out written (forward),
qkv and dout read and dqkv written (backward); the materialized path moves far more.

Shapes: GPT-2 124M's (B=16, T=1024, NH=12, HS=64) and a small one (B=4, T=256).
Run (needs a CUDA GPU; without one it says so in one line and exits 2):
    python dev/cuda/attention.py          # every version, both shapes, forward and backward, bf16
    python dev/cuda/attention.py 2 -p fp32
prints a validation line per (version, block size), then one table per progression (time,
TFLOP/s, % of the measured cuBLAS GEMM), written to dev/results/dev_cuda_attention.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Kernel, Progression, Version, dev_kernel, production_kernel  # noqa: E402
from matmul import LIBRARY_BLOCK_SIZES, without_unavailable  # noqa: E402  (dev/cuda/matmul.py)

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
import gpt2_cuda  # noqa: E402  (imports CuPy only when a launcher runs)
import llmc.attention  # noqa: E402
from llmc import cuda, cuda_check  # noqa: E402
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
# problems: inputs, references from gpt2_cpu.py

def _scalars(case, B, T, NH, HS):
    for name, value in dict(B=B, T=T, NH=NH, HS=HS, C=NH * HS).items():
        case.scalar(name, value)


def make_forward_case(rng, precision, B, T, NH, HS):
    """qkv (B,T,3C) ~ N(0,1) -> out (B,T,C) = gpt2_cpu.attention_forward(qkv, NH)[0]. The scratch
    buffers are what each version keeps or works in (allocated once for all versions)."""
    C = NH * HS
    case = common.Case(precision)
    _scalars(case, B, T, NH, HS)
    qkv = case.input("qkv", rng.standard_normal((B, T, 3 * C)))
    out, _ = gpt2_cpu.attention_forward(qkv, NH)
    case.output("out", (B, T, C))
    case.check("out", out, "attention")
    case.scratch("att_f32", (B, NH, T, T), "f32")                               # v1
    case.scratch("qkvr", (3, B, NH, T, HS), "X")                                # v2
    case.scratch("att", (B, NH, T, T), "X")
    case.scratch("work", (B * T * max(3 * C, NH * T),), "X")                    # v2: qkv, preatt, y
    case.scratch("lse", (B, NH, T), "f32")                                      # v3, v4
    case.bytes = common.napkin_bytes(precision, floatX=B * T * 3 * C + B * T * C)
    case.flops = attention_forward_flops(B, NH, T, HS)
    return case


def make_backward_case(rng, precision, B, T, NH, HS):
    """qkv (B,T,3C), dout (B,T,C) ~ N(0,1) -> dqkv = gpt2_cpu.attention_backward(dout, qkv, att, NH),
    with att, out and lse from gpt2_cpu's forward on the same (floatX-rounded) qkv."""
    C = NH * HS
    case = common.Case(precision)
    _scalars(case, B, T, NH, HS)
    qkv = case.input("qkv", rng.standard_normal((B, T, 3 * C)))
    dout = case.input("dout", rng.standard_normal((B, T, C)))
    out, att = gpt2_cpu.attention_forward(qkv, NH)
    case.output("dqkv", (B, T, 3 * C))
    case.check("dqkv", gpt2_cpu.attention_backward(dout, qkv, att, NH), "attention")
    # what each version's forward keeps
    case.input("att_f32", att, "f32")                                           # v1
    case.input("att", att, "X")                                                 # v2
    case.input("qkvr", qkv.reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4))   # v2: (3,B,NH,T,HS)
    case.input("out", out)                                                      # v3, v4, v5
    case.input("lse", cuda_check.attention_lse(qkv, NH), "f32")                  # v3, v4
    # scratch
    case.scratch("dqkv_acc", (B, T, 3 * C), "f32")                              # v1
    case.scratch("dqkvr", (3, B, NH, T, HS), "X")                               # v2
    case.scratch("datt", (B, NH, T, T), "X")
    case.scratch("dy", (B, NH, T, HS), "X")
    case.scratch("D", (B, NH, T), "f32")                                        # v3
    case.bytes = common.napkin_bytes(precision, floatX=B * T * 3 * C + B * T * C + B * T * 3 * C)
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


def forward_v3(d, block_size):
    llmc.attention.flash_attention_forward(d.out, d.lse, d.qkv, d.B, d.T, d.C, d.NH)


def forward_v4(d, block_size):
    from llmc import cudnn_attention
    cudnn_attention.attention_forward_cudnn(d.out, d.lse, d.qkv, d.B, d.T, d.NH, d.HS)


def forward_v5(d, block_size):
    import torch.nn.functional as F
    views = torch_views(d)
    qkv = views["qkv"].view(d.B, d.T, 3, d.NH, d.HS)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))                # each (B,NH,T,HS), strided
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)               # (B,NH,T,HS)
    views["out"].view(d.B, d.T, d.NH, d.HS).copy_(y.transpose(1, 2))          # -> (B,T,NH,HS)


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


def backward_v3(d, block_size):
    llmc.attention.flash_attention_backward(d.dqkv, d.D, d.dout, d.out, d.qkv, d.lse, d.B, d.T, d.C, d.NH)


def backward_v4(d, block_size):
    from llmc import cudnn_attention
    cudnn_attention.attention_backward_cudnn(d.dqkv, d.dout, d.qkv, d.out, d.lse, d.B, d.T, d.NH, d.HS)


def backward_v5(d, block_size):
    """torch.autograd.grad through SDPA; the forward's graph is built on the first call and kept
    (retain_graph), so each call times the backward alone."""
    import torch
    import torch.nn.functional as F
    views = torch_views(d)
    if "graph" not in views:
        qkv = views["qkv"].view(d.B, d.T, 3, d.NH, d.HS)
        q, k, v = (qkv[:, :, i].transpose(1, 2).detach().requires_grad_() for i in range(3))
        views["graph"] = (F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))
    y, leaves = views["graph"]
    dy = views["dout"].view(d.B, d.T, d.NH, d.HS).transpose(1, 2)             # (B,NH,T,HS)
    grads = torch.autograd.grad(y, leaves, dy, retain_graph=True)            # dq, dk, dv (B,NH,T,HS)
    dqkv = views["dqkv"].view(d.B, d.T, 3, d.NH, d.HS)
    for i, g in enumerate(grads):
        dqkv[:, :, i].copy_(g.transpose(1, 2))


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


# ----------------------------------------------------------------------------
# versions that need code or libraries that may be missing: skipped, with the reason

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
    try:
        import torch
    except Exception as e:                 # ImportError, or a broken install
        return f"PyTorch is not importable ({type(e).__name__}: {e})".splitlines()[0]
    return None if torch.cuda.is_available() else "PyTorch sees no CUDA device"


OPTIONAL_VERSIONS = {3: flash_unavailable_reason, 4: cudnn_unavailable_reason, 5: torch_unavailable_reason}


# ----------------------------------------------------------------------------
# the progressions

SIZES_124M = dict(B=16, T=1024, NH=12, HS=64)
SIZES_SMALL = dict(B=4, T=256, NH=12, HS=64)
TEST_SIZES = dict(B=2, T=67, NH=3, HS=16)       # T not a multiple of any tile or vector
FORWARD_VERSIONS = [
    Version(1, "naive: one thread per query row, gpt2_cpu's loops, att kept in fp32", (FORWARD_V1,), forward_v1,
            V1_BLOCK_SIZES),
    Version(2, "production (materialized): permute, cuBLAS q k^T, softmax kernel, cuBLAS att v, unpermute",
            (MATERIALIZED_FORWARD, SOFTMAX_FORWARD), forward_v2, LIBRARY_BLOCK_SIZES),
    Version(3, "flash attention (ours): online softmax, no T x T matrix", (FLASH_FORWARD,), forward_v3,
            LIBRARY_BLOCK_SIZES),
    Version(4, "library call: cuDNN fused attention", (CUDNN_FORWARD,), forward_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "reference: PyTorch scaled_dot_product_attention", (TORCH_FORWARD,), forward_v5, LIBRARY_BLOCK_SIZES),
]
BACKWARD_VERSIONS = [
    Version(1, "naive: one thread per query row, fp32 atomics for dk, dv, then a cast",
            (BACKWARD_V1, BACKWARD_CAST_V1), backward_v1, V1_BLOCK_SIZES),
    Version(2, "production (materialized): unpermute, cuBLAS, softmax_backward kernel, cuBLAS, permute",
            (MATERIALIZED_BACKWARD, SOFTMAX_BACKWARD), backward_v2, LIBRARY_BLOCK_SIZES),
    Version(3, "flash attention backward (ours): probabilities recomputed from lse", (FLASH_BACKWARD,), backward_v3,
            LIBRARY_BLOCK_SIZES),
    Version(4, "library call: cuDNN fused attention backward", (CUDNN_BACKWARD,), backward_v4, LIBRARY_BLOCK_SIZES),
    Version(5, "reference: PyTorch SDPA backward (autograd)", (TORCH_BACKWARD,), backward_v5, LIBRARY_BLOCK_SIZES),
]
PROGRESSIONS = [
    Progression("attention_forward", make_forward_case, FORWARD_VERSIONS, SIZES_124M, TEST_SIZES),
    Progression("attention_forward_small", make_forward_case, FORWARD_VERSIONS, SIZES_SMALL, TEST_SIZES),
    Progression("attention_backward", make_backward_case, BACKWARD_VERSIONS, SIZES_124M, TEST_SIZES),
    Progression("attention_backward_small", make_backward_case, BACKWARD_VERSIONS, SIZES_SMALL, TEST_SIZES),
]


def main(argv=None):
    """common.main on the versions that can run here (without a GPU: its one-line exit 2)."""
    if cuda.cuda_unavailable_reason() is not None:
        return common.main(OP, PROGRESSIONS, argv)
    precision = common.parse_args(OP, PROGRESSIONS, argv).precision
    return common.main(OP, without_unavailable(PROGRESSIONS, OPTIONAL_VERSIONS, precision), argv)


if __name__ == "__main__":
    sys.exit(main())
