"""
llama3_cuda.py: Llama 3 on NVIDIA GPUs in Python, the twin of llama3_cpu.py as gpt2_cuda.py is of
gpt2_cpu.py: CuPy for memory and launches, our own kernels for the layers Llama 3 adds
(kernels/rmsnorm.cu, rope.cu, swiglu.cu, repeat_kv.cu), and everything Llama 3 shares with GPT-2
imported from gpt2_cuda.py (the launcher contract, the token embedding, the matmul backends,
the attention paths, the fused classifier, the casts). Each new layer is a thin *launcher*
written as gpt2_cuda.py's are: it checks its arguments, computes the grid and launches a kernel
that writes into preallocated arrays, outputs first, like llm.c:
`rmsnorm_forward(out, rstd, inp, weight, B, T, C)`.

What it deliberately is not (yet): a trainer with gpt2_cuda.py's options (CUDA graphs,
recomputation, ZeRO, several GPUs, the KV-cached sampler); it runs the model once against
llama3_cpu.py (--check), on a GPU or on the emulated device.

Run it (after `make data`; without CuPy and a GPU it says so in one line and exits 2):
    python llama3_cuda.py --device cpu --check -e llama3:d2 -b 1 -t 16 --precision fp32
    ... every activation and gradient: TENSOR OK ... then `check: all tensors OK`

Dimensions as in llama3_cpu.py (B T C V L NH NKV HS H maxT), plus N = B*T, the rows of a matmul,
and QKV = (NH+2NKV)*HS, the width of the qkv projection.
Gradient convention (gpt2_cuda.py's, llm.c's): a launcher *writes* (=) its input's gradient into
the `dinp` it is given, except RMSNorm's backward, which *accumulates* (+=) into dinp, the
residual stream's gradient; parameter gradients always accumulate.
"""

import numpy as np

from llmc import cuda
from llmc.cuda import (BLOCK_SIZE, WARP_ROW_BLOCK_SIZE, check_launch, elementwise_grid, require, vector_size,
                       warp_row_grid)

# ----------------------------------------------------------------------------
# constants: launch configuration

LLAMA3_KERNEL_FILES = ("rmsnorm", "rope", "swiglu", "repeat_kv")
RMSNORM_BACKWARD_BLOCK_SIZE = 512
RMSNORM_BACKWARD_GRID = 512            # partial-sum slots of rmsnorm_backward: fixed, so results reproduce


# ----------------------------------------------------------------------------
# layers: launchers of Llama 3's new kernels, forward/backward pairs, in llama3_cpu.py's order

def rmsnorm_forward(out, rstd, inp, weight, B, T, C):
    """out (B,T,C) = inp * rstd * weight over the last axis, rstd (B,T) fp32 = 1/sqrt(mean(inp^2) + eps)
    written for the backward (llama3_cpu.rmsnorm_forward). One warp per row (kernels/rmsnorm.cu).
    Raises TypeError or ValueError for arrays of the wrong dtype, size or alignment."""
    N = B * T
    precision = check_launch("rmsnorm_forward", [("out", out, N * C), ("inp", inp, N * C), ("weight", weight, C)],
                             float32=[("rstd", rstd, N)], vector_dim=("C", C))
    cuda.launch("rmsnorm", precision, "rmsnorm_forward", warp_row_grid(N), WARP_ROW_BLOCK_SIZE,
                (out, rstd, inp, weight, np.int32(N), np.int32(C)))


def rmsnorm_backward(dinp, dweight, partial, dout, inp, weight, rstd, B, T, C):
    """Accumulate dinp (B,T,C) (the residual stream's gradient) and dweight (C,) from dout:
        dinp += rstd * (dnorm - norm * mean(dnorm * norm)),  dnorm = dout * weight, norm = inp * rstd
        dweight += sum over rows of dout * norm
    (derivation: llama3_cpu.rmsnorm_backward). Two kernels: per-block partial sums of dweight
    into partial (G, C) fp32, G = rmsnorm_backward_grid(N), then their in-order sum."""
    N = B * T
    G = rmsnorm_backward_grid(N)
    precision = check_launch("rmsnorm_backward",
                             [("dinp", dinp, N * C), ("dweight", dweight, C), ("dout", dout, N * C),
                              ("inp", inp, N * C), ("weight", weight, C)],
                             float32=[("rstd", rstd, N)], vector_dim=("C", C), unaligned=("dweight",))
    require(partial.dtype == np.float32 and partial.size >= G * C, f"rmsnorm partial sums need {G * C} floats")
    cuda.launch("rmsnorm", precision, "rmsnorm_backward", G, RMSNORM_BACKWARD_BLOCK_SIZE,
                (dinp, partial, dout, inp, weight, rstd, np.int32(N), np.int32(C)))
    cuda.launch("rmsnorm", precision, "rmsnorm_param_reduce", elementwise_grid(C), BLOCK_SIZE,
                (dweight, partial, np.int32(G), np.int32(C)))


def rmsnorm_backward_grid(N):
    """Scratch slots of rmsnorm_backward (blocks, each owning ceil(N/G) rows): fixed per N."""
    return min(RMSNORM_BACKWARD_GRID, N)


def rope_launch(name, out, inp, freqs_cos, freqs_sin, B, T, nh, n_rot, HS):
    """The checks and the launch rope_forward and rope_backward share (kernels/rope.cu)."""
    n = B * T * nh * HS
    precision = check_launch(name, [("out", out, n), ("inp", inp, n)],
                             float32=[("freqs_cos", freqs_cos, T * HS // 2), ("freqs_sin", freqs_sin, T * HS // 2)],
                             vector_dim=("HS", HS))
    require(0 <= n_rot <= nh, f"{name}: need 0 <= n_rot={n_rot} <= nh={nh}")
    cuda.launch("rope", precision, name, elementwise_grid(n // vector_size(precision)), BLOCK_SIZE,
                (out, inp, freqs_cos, freqs_sin, np.int32(B), np.int32(T), np.int32(nh), np.int32(n_rot),
                 np.int32(HS)))


def rope_forward(out, inp, freqs_cos, freqs_sin, B, T, nh, n_rot, HS):
    """out (B,T,nh,HS) = inp with the first n_rot heads of each position t rotated pair by pair by
    the angles t * freq_i (llama3_cpu.rope_forward), the other heads copied: on the qkv
    projection (nh = NH+2NKV) n_rot = NH+NKV rotates q and k and passes v through. freqs_cos,
    freqs_sin (T,HS/2) fp32: rows 0..T-1 of the tables. out may be inp."""
    rope_launch("rope_forward", out, inp, freqs_cos, freqs_sin, B, T, nh, n_rot, HS)


def rope_backward(dinp, dout, freqs_cos, freqs_sin, B, T, nh, n_rot, HS):
    """dinp (B,T,nh,HS) = dout with the first n_rot heads rotated by minus the forward's angles
    (the transpose of a rotation, llama3_cpu.rope_backward), the other heads copied. dinp may be dout."""
    rope_launch("rope_backward", dinp, dout, freqs_cos, freqs_sin, B, T, nh, n_rot, HS)


def repeat_kv_forward(out, inp, B, T, NH, NKV, HS):
    """out (B,T,3C) = [q, repeat(k), repeat(v)], GPT-2's attention input, from the qkv projection
    inp (B,T,(NH+2NKV)*HS): each of the NKV key and value heads repeated for its NH/NKV query heads
    (llama3_cpu.repeat_kv_forward)."""
    QKV = (NH + 2 * NKV) * HS
    precision = check_launch("repeat_kv_forward", [("out", out, B * T * 3 * NH * HS), ("inp", inp, B * T * QKV)],
                             vector_dim=("HS", HS))
    require(NKV > 0 and NH % NKV == 0, f"repeat_kv_forward: NH={NH} is not a multiple of NKV={NKV}")
    cuda.launch("repeat_kv", precision, "repeat_kv_forward", elementwise_grid(B * T * 3 * NH * HS // vector_size(precision)),
                BLOCK_SIZE, (out, inp, np.int32(B), np.int32(T), np.int32(NH), np.int32(NKV), np.int32(HS)))


def repeat_kv_backward(dinp, dout, B, T, NH, NKV, HS):
    """dinp (B,T,(NH+2NKV)*HS) from dout (B,T,3C): the q heads' gradients copied, each key and value
    head's the sum over the NH/NKV query heads it served (llama3_cpu.repeat_kv_backward). Writes (=)."""
    QKV = (NH + 2 * NKV) * HS
    precision = check_launch("repeat_kv_backward", [("dinp", dinp, B * T * QKV), ("dout", dout, B * T * 3 * NH * HS)],
                             vector_dim=("HS", HS))
    require(NKV > 0 and NH % NKV == 0, f"repeat_kv_backward: NH={NH} is not a multiple of NKV={NKV}")
    cuda.launch("repeat_kv", precision, "repeat_kv_backward", elementwise_grid(B * T * QKV // vector_size(precision)),
                BLOCK_SIZE, (dinp, dout, np.int32(B), np.int32(T), np.int32(NH), np.int32(NKV), np.int32(HS)))


def swiglu_forward(out, fch, fch2, n):
    """out (n,) = fch * silu(fch2) (llama3_cpu.swiglu_forward); fch, fch2 the outputs of c_fc and
    c_fc2, n = B*T*H values each."""
    precision = check_launch("swiglu_forward", [("out", out, n), ("fch", fch, n), ("fch2", fch2, n)], aligned=True)
    cuda.launch("swiglu", precision, "swiglu_forward", elementwise_grid(n // vector_size(precision)), BLOCK_SIZE,
                (out, fch, fch2, np.uint64(n)))


def swiglu_backward(dfch, dfch2, dout, fch, fch2, n):
    """dfch = dout * silu(fch2), dfch2 = dout * fch * silu'(fch2), each (n,) (llama3_cpu.swiglu_backward).
    Writes (=); dfch may be dout."""
    precision = check_launch("swiglu_backward", [("dfch", dfch, n), ("dfch2", dfch2, n), ("dout", dout, n),
                                                 ("fch", fch, n), ("fch2", fch2, n)], aligned=True)
    cuda.launch("swiglu", precision, "swiglu_backward", elementwise_grid(n // vector_size(precision)), BLOCK_SIZE,
                (dfch, dfch2, dout, fch, fch2, np.uint64(n)))
