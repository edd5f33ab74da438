"""
llmc/attention.py: causal multi-head self-attention on the GPU (llm.c's llmc/attention.cuh and
cudnn_att.cpp), the three paths --attention chooses between, and the object for each that the
model keeps:
    naive   the (B,NH,T,T) matrix: kernels/attention.cu's permutes and softmax around two batched
            cuBLAS products (attention_forward, attention_backward)
    flash   kernels/flash_attention.cu: tiled through shared memory, no (T,T) matrix, the
            log-sum-exp of each query's scores kept for the backward (flash_attention_forward, ...)
    cudnn   cuDNN's fused attention (llmc/cudnn_attention.py), flash's buffers
The launchers follow gpt2_cuda.py's contract: check the arguments, compute the grid, launch into
preallocated arrays, outputs first. tf32 (the model's matmul backend's) sets the cuBLAS products'
input rounding in fp32.
"""

import dataclasses
import math

import numpy as np

from llmc import cuda
from llmc.cuda import (BLOCK_SIZE, CUBLAS_OP_N, CUBLAS_OP_T, FLOATX_DTYPES, WARP_ROW_BLOCK_SIZE, WARP_SIZE, ceil_div,
                       check_launch, elementwise_grid, require, vector_size, warp_row_grid)
from llmc.cuda_check import attention_lse
from llmc.utils import InputError, prefix

ATTENTION_PATHS = ("naive", "flash", "cudnn")
ATTENTION_CHOICES = ("auto",) + ATTENTION_PATHS   # what --attention takes
# auto: cuDNN's on a GPU where it can run (the fastest path measured on an H100, 2026-11-26:
# dev/results/), else naive; naive on the emulated device, where the point is to read and debug
DEFAULT_ATTENTION = "auto"


def attention_scores(preatt, q, k, BNH, T, HS, tf32=False):
    """Library call: preatt (BNH,T,T) = q @ k^T for each of the BNH heads, q, k (BNH,T,HS).
    Column-major: preatt^T (T,T) = k (T,HS) @ q^T (HS,T); k's memory is k^T (HS,T) so op(A) = T."""
    cuda.gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, k, HS, q, HS, preatt, T,
              batch=BNH, stride_a=T * HS, stride_b=T * HS, stride_c=T * T, tf32=tf32)


def attention_values(out, att, v, BNH, T, HS, tf32=False):
    """Library call: out (BNH,T,HS) = att (BNH,T,T) @ v (BNH,T,HS).
    Column-major: out^T (HS,T) = v^T (HS,T) @ att^T (T,T), both as stored."""
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, v, HS, att, T, out, HS,
              batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS, tf32=tf32)


def attention_values_backward(datt, dv, dout, att, v, BNH, T, HS, tf32=False):
    """Library calls, the backward of out = att @ v (shapes as attention_values); both written:
        datt = dout @ v^T     column-major: datt^T (T,T) = v (T,HS) @ dout^T (HS,T), op(A) = T
        dv   = att^T @ dout   column-major: dv^T (HS,T) = dout^T (HS,T) @ att (T,T), op(B) = T"""
    cuda.gemm(CUBLAS_OP_T, CUBLAS_OP_N, T, T, HS, v, HS, dout, HS, datt, T,
              batch=BNH, stride_a=T * HS, stride_b=T * HS, stride_c=T * T, tf32=tf32)
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, dout, HS, att, T, dv, HS,
              batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS, tf32=tf32)


def attention_scores_backward(dq, dk, dpreatt, q, k, BNH, T, HS, tf32=False):
    """Library calls, the backward of preatt = q @ k^T (the 1/sqrt(HS) scale is already inside
    dpreatt, see softmax_backward); both written:
        dq = dpreatt @ k      column-major: dq^T (HS,T) = k^T (HS,T) @ dpreatt^T (T,T), both as stored
        dk = dpreatt^T @ q    column-major: dk^T (HS,T) = q^T (HS,T) @ dpreatt (T,T), op(B) = T"""
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_N, HS, T, T, k, HS, dpreatt, T, dq, HS,
              batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS, tf32=tf32)
    cuda.gemm(CUBLAS_OP_N, CUBLAS_OP_T, HS, T, T, q, HS, dpreatt, T, dk, HS,
              batch=BNH, stride_a=T * HS, stride_b=T * T, stride_c=T * HS, tf32=tf32)


def att_unaligned(att, T):
    """The softmax reads rows of att with 16-byte loads only when T is a multiple of the vector
    size (then every row, and every layer's att, starts aligned); otherwise element by element,
    and att need not be aligned: check_launch's `unaligned` for att."""
    return () if T % vector_size(cuda.precision_of(att)) == 0 else ("att",)


def attention_forward(out, qkvr, att, workspace, B, T, C, NH, tf32=False):
    """Causal multi-head self-attention (Vaswani et al. 2017), llm.c's attention_forward:
    workspace (>= B*T*max(3C, NH*T) floatX) holds on entry the qkv projection (B,T,3C) in its first
    B*T*3C elements, and is then reused for preatt and the per-head outputs (clobbered).
    Writes qkvr (3,B,NH,T,HS) = q, k, v per head and att (B,NH,T,T) (both kept for the backward),
    and out (B,T,C) = the heads of softmax(q k^T / sqrt(HS), causal) @ v side by side. tf32: the
    two cuBLAS products' input rounding (the model's matmul backend)."""
    require(C % NH == 0, f"attention_forward: C={C} is not a multiple of NH={NH}")
    HS, BNH = C // NH, B * NH
    precision = check_launch("attention_forward", [("out", out, B * T * C), ("qkvr", qkvr, 3 * B * T * C),
                                                   ("att", att, BNH * T * T)],
                             vector_dim=("HS", HS), unaligned=att_unaligned(att, T))
    require(workspace.size >= B * T * max(3 * C, NH * T), "attention workspace too small")
    q, k, v = (qkvr.reshape(3, BNH * T * HS)[i] for i in range(3))     # each (B,NH,T,HS), contiguous
    qkv = prefix(workspace, (B, T, 3 * C))
    cuda.launch("attention", precision, "permute_qkv", elementwise_grid(B * T * C // vector_size(precision)), BLOCK_SIZE,
                (q, k, v, qkv, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))
    preatt = prefix(workspace, (BNH, T, T))                              # qkv is dead now
    attention_scores(preatt, q, k, BNH, T, HS, tf32)                     # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    cuda.launch("attention", precision, "softmax_forward", warp_row_grid(BNH * T), WARP_ROW_BLOCK_SIZE,
                (att, preatt, np.float32(1.0 / math.sqrt(HS)), np.int32(BNH), np.int32(T)))
    y = prefix(workspace, (BNH, T, HS))                                  # preatt is dead now
    attention_values(y, att, v, BNH, T, HS, tf32)                       # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    cuda.launch("attention", precision, "unpermute", elementwise_grid(B * T * C // vector_size(precision)), BLOCK_SIZE,
                (out, y, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))


def attention_backward(dinp, dqkvr, datt_workspace, dy, dout, qkvr, att, B, T, C, NH, tf32=False):
    """Backward of attention_forward: writes dinp (B,T,3C), the gradient of the qkv projection,
    from dout (B,T,C) and the forward's qkvr (3,B,NH,T,HS) and att (B,NH,T,T). Scratch: dqkvr
    (3,B,NH,T,HS), datt_workspace (>= B*NH*T*T), dy (B,NH,T,HS). Undoing the forward in reverse:
        out = unpermute(y)     =>  dy = unpermute_backward(dout)
        y = att @ v            =>  datt = dy @ v^T,  dv = att^T @ dy
        att = softmax(s preatt) => dpreatt = s att (datt - sum_j datt att)   (in place on datt)
        preatt = q @ k^T       =>  dq = dpreatt @ k,  dk = dpreatt^T @ q
        q, k, v = permute(qkv) =>  dinp = permute_backward(dq, dk, dv)
    tf32 as in attention_forward."""
    require(C % NH == 0, f"attention_backward: C={C} is not a multiple of NH={NH}")
    HS, BNH = C // NH, B * NH
    precision = check_launch("attention_backward",
                             [("dinp", dinp, 3 * B * T * C), ("dqkvr", dqkvr, 3 * B * T * C), ("dy", dy, B * T * C),
                              ("dout", dout, B * T * C), ("qkvr", qkvr, 3 * B * T * C), ("att", att, BNH * T * T)],
                             vector_dim=("HS", HS), unaligned=att_unaligned(att, T))
    vec = vector_size(precision)
    require(datt_workspace.size >= BNH * T * T, "attention datt workspace too small")
    q, k, v = (qkvr.reshape(3, BNH * T * HS)[i] for i in range(3))
    dq, dk, dv = (dqkvr.reshape(3, BNH * T * HS)[i] for i in range(3))
    datt = prefix(datt_workspace, (BNH, T, T))
    cuda.launch("attention", precision, "unpermute_backward", elementwise_grid(B * T * C // vec), BLOCK_SIZE,
                (dy, dout, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))
    attention_values_backward(datt, dv, dy, att, v, BNH, T, HS, tf32)
    cuda.launch("attention", precision, "softmax_backward", warp_row_grid(BNH * T), WARP_ROW_BLOCK_SIZE,
                (datt, datt, att, np.float32(1.0 / math.sqrt(HS)), np.int32(BNH), np.int32(T)))
    attention_scores_backward(dq, dk, datt, q, k, BNH, T, HS, tf32)     # datt now holds dpreatt
    cuda.launch("attention", precision, "permute_qkv_backward", elementwise_grid(B * T * C // vec), BLOCK_SIZE,
                (dinp, dq, dk, dv, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))


# flash attention (kernels/flash_attention.cu, templates in kernels/flash_attention.cuh): the same
# attention without the (B,NH,T,T) matrix, FlashAttention-2 on tensor cores. Each head size has its
# own kernels with compile-time tile shapes; FLASH_TILES restates them for the grids and the
# dynamic shared memory (tests/test_flash_attention_host.py checks them against the .cu file).
FLASH_HEAD_SIZES = (16, 32, 64, 128)   # GPT-2 124M's 64, Llama 3 8B's 128, the tiny test models' 16 and 32
FLASH_ROWS_PER_WARP = 16               # one mma.m16n8k16 row tile
FLASH_DEFAULT_SHARED_BYTES = 48 * 1024  # dynamic shared memory a launch may take without the kernel's opt-in
FLASH_ATTENTION_KERNELS = {            # head size -> (forward, dk/dv, dq) entry points
    HS: (f"flash_attention_forward_hs{HS}", f"flash_attention_backward_dkdv_hs{HS}", f"flash_attention_backward_dq_hs{HS}")
    for HS in FLASH_HEAD_SIZES}


@dataclasses.dataclass(frozen=True)
class ForwardTiles:
    """kernels/flash_attention.cuh's ForwardTiles: `warps` warps of `m_tiles` row tiles (16 query
    rows each) own `rows` query rows of a block; keys and values stream through `stages` buffers of
    `keys` rows."""
    warps: int
    m_tiles: int
    keys: int
    stages: int

    @property
    def rows(self):
        return self.warps * self.m_tiles * FLASH_ROWS_PER_WARP

    def shared_bytes(self, HS, itemsize):
        """Q's tile, then stages x (K, V), (rows, HS) floatX each."""
        return (self.rows + 2 * self.stages * self.keys) * HS * itemsize


@dataclasses.dataclass(frozen=True)
class DkdvTiles:
    """kernels/flash_attention.cuh's DkdvTiles: `warps` warps of 16 keys own `keys` keys of a block;
    queries, dout, lse and D stream through `stages` buffers of `queries` rows."""
    warps: int
    queries: int
    stages: int

    @property
    def keys(self):
        return self.warps * FLASH_ROWS_PER_WARP

    def shared_bytes(self, HS, itemsize):
        """K's and V's tiles, stages x (Q, dout) floatX, then stages x (lse, D) fp32."""
        return (2 * self.keys + 2 * self.stages * self.queries) * HS * itemsize + 2 * self.stages * self.queries * 4


@dataclasses.dataclass(frozen=True)
class DqTiles:
    """kernels/flash_attention.cuh's DqTiles: `warps` warps of 16 query rows own `rows` rows of a
    block; keys and values stream through `stages` buffers of `keys` rows."""
    warps: int
    keys: int
    stages: int

    @property
    def rows(self):
        return self.warps * FLASH_ROWS_PER_WARP

    def shared_bytes(self, HS, itemsize):
        """Q's and dout's tiles, then stages x (K, V)."""
        return (2 * self.rows + 2 * self.stages * self.keys) * HS * itemsize


# (precision, HS) -> (forward, dk/dv, dq) tiles: kernels/flash_attention.cu's typedefs
FLASH_TILES = {
    ("bf16", 16): (ForwardTiles(4, 1, 32, 2), DkdvTiles(4, 32, 2), DqTiles(4, 32, 2)),
    ("bf16", 32): (ForwardTiles(4, 1, 64, 2), DkdvTiles(4, 64, 2), DqTiles(4, 64, 2)),
    ("bf16", 64): (ForwardTiles(4, 2, 64, 2), DkdvTiles(4, 32, 2), DqTiles(4, 64, 2)),
    ("bf16", 128): (ForwardTiles(4, 1, 64, 2), DkdvTiles(4, 32, 2), DqTiles(4, 64, 2)),
    ("fp32", 16): (ForwardTiles(4, 1, 32, 2), DkdvTiles(4, 32, 2), DqTiles(4, 32, 2)),
    ("fp32", 32): (ForwardTiles(4, 1, 32, 2), DkdvTiles(4, 32, 2), DqTiles(4, 32, 2)),
    ("fp32", 64): (ForwardTiles(4, 1, 32, 2), DkdvTiles(4, 32, 2), DqTiles(4, 32, 2)),
    ("fp32", 128): (ForwardTiles(4, 1, 32, 2), DkdvTiles(4, 32, 2), DqTiles(4, 32, 2)),
}


def flash_attention_supported(HS):
    """True when kernels/flash_attention.cu has entry points for head size HS."""
    return HS in FLASH_HEAD_SIZES


def flash_forward_launch(tiles, HS, itemsize, B, T, NH):
    """(grid, block, shared bytes) of a forward kernel of ForwardTiles `tiles`: one block per
    (b*NH + h, block of `tiles.rows` query rows), 32 threads per warp."""
    return (B * NH, ceil_div(T, tiles.rows)), tiles.warps * WARP_SIZE, tiles.shared_bytes(HS, itemsize)


def flash_dkdv_launch(tiles, HS, itemsize, B, T, NKV):
    """(grid, block, shared bytes) of a dk/dv kernel: one block per (b*NKV + kv head, key block)."""
    return (B * NKV, ceil_div(T, tiles.keys)), tiles.warps * WARP_SIZE, tiles.shared_bytes(HS, itemsize)


def flash_dq_launch(tiles, HS, itemsize, B, T, NH):
    """(grid, block, shared bytes) of a dq kernel: one block per (b*NH + h, block of query rows)."""
    return (B * NH, ceil_div(T, tiles.rows)), tiles.warps * WARP_SIZE, tiles.shared_bytes(HS, itemsize)


def launch_with_shared_memory(kernel, grid, block, args, shared_bytes):
    """Launch a cupy.RawKernel with `shared_bytes` of dynamic shared memory; above CUDA's default
    48 KiB the kernel must first opt in (its max_dynamic_shared_size_bytes attribute,
    cuFuncSetAttribute), which stays set for later launches."""
    if shared_bytes > FLASH_DEFAULT_SHARED_BYTES and kernel.max_dynamic_shared_size_bytes < shared_bytes:
        kernel.max_dynamic_shared_size_bytes = shared_bytes
    kernel(grid, (block,), args, shared_mem=shared_bytes)


_FLASH_KERNELS = {}                     # (device, precision, build variant, name) -> cupy.RawKernel


def flash_kernel(precision, name):
    """Kernel `name` of kernels/flash_attention.cu (compiled once per device and precision)."""
    key = (cuda.device(), precision, cuda.build_variant(), name)
    if key not in _FLASH_KERNELS:
        _FLASH_KERNELS[key] = cuda.load_module("flash_attention", precision).get_function(name)
    return _FLASH_KERNELS[key]


def flash_check(kernel, HS, NH, NKV, arrays, float32):
    """The launchers' checks: the head size has kernels, NH is a multiple of NKV, the floatX arrays
    (16-byte aligned, HS a multiple of the vector size) and fp32 arrays. Returns the precision."""
    require(flash_attention_supported(HS), f"{kernel}: no kernel for head size {HS} (have {FLASH_HEAD_SIZES})")
    require(NKV >= 1 and NH % NKV == 0, f"{kernel}: NH={NH} is not a multiple of NKV={NKV}")
    return check_launch(kernel, arrays, float32=float32, vector_dim=("HS", HS))


def flash_attention_forward(out, lse, qkv, B, T, C, NH, NKV=None):
    """Causal multi-head attention, fused: out (B,T,C) and lse (B,NH,T) fp32 from qkv
    (B,T,(NH+2NKV)*HS), C = NH*HS; NKV key/value heads (grouped-query attention, each shared by
    NH/NKV consecutive query heads; default NKV = NH, GPT-2's (B,T,3C)):
        out[b,t,head h] = sum_{j<=t} softmax_j(q_t . k_j / sqrt(HS)) v_j,   lse[b,h,t] = log sum_{j<=t} exp(q_t . k_j / sqrt(HS))
    as gpt2_cpu.attention_forward (on llama3_cpu.repeat_kv_forward's repeated heads), by
    FlashAttention-2 Alg. 1 (Dao 2023): online softmax over key tiles read straight from qkv's
    columns, nothing of size T x T stored. lse is what flash_attention_backward needs in place of
    att. Raises ValueError for an unsupported head size or layout."""
    NKV = NH if NKV is None else NKV
    require(C % NH == 0 and T >= 1, f"flash_attention_forward: need C={C} a multiple of NH={NH} and T >= 1")
    HS = C // NH
    precision = flash_check("flash_attention_forward", HS, NH, NKV,
                            [("out", out, B * T * C), ("qkv", qkv, B * T * (NH + 2 * NKV) * HS)],
                            [("lse", lse, B * NH * T)])
    tiles = FLASH_TILES[precision, HS][0]
    grid, block, shared = flash_forward_launch(tiles, HS, FLOATX_DTYPES[precision].itemsize, B, T, NH)
    launch_with_shared_memory(flash_kernel(precision, FLASH_ATTENTION_KERNELS[HS][0]), grid, block,
                              (out, lse, qkv, np.int32(B), np.int32(T), np.int32(NH), np.int32(NKV)), shared)


def flash_attention_backward(dqkv, D, dout, out, qkv, lse, B, T, C, NH, NKV=None):
    """Backward of flash_attention_forward: writes dqkv (B,T,(NH+2NKV)*HS) = (dq | dk | dv) in qkv's
    layout, from dout (B,T,C) and the forward's out, qkv and lse; D (B,NH,T) fp32 is its workspace.
    FlashAttention-2 Alg. 2 (Dao 2023), recomputing p = exp(q.k / sqrt(HS) - lse) tile by tile,
    deterministic:
        D[t]  = dout_t . out_t                               (preprocess kernel)
        dS    = p (dout_t . v_j - D[t])
        dv_j  = sum_{t>=j} p dout_t,  dk_j = sum_{t>=j} dS q_t / sqrt(HS)   (one kernel, per key block;
                                                                           a kv head sums its query heads)
        dq_t  = sum_{j<=t} dS k_j / sqrt(HS)                                (one kernel, per query block)
    Every element of dqkv is written (=) by exactly one thread: no atomics, bitwise reproducible."""
    NKV = NH if NKV is None else NKV
    require(C % NH == 0 and T >= 1, f"flash_attention_backward: need C={C} a multiple of NH={NH} and T >= 1")
    HS = C // NH
    QKV = (NH + 2 * NKV) * HS
    precision = flash_check("flash_attention_backward", HS, NH, NKV,
                            [("dqkv", dqkv, B * T * QKV), ("dout", dout, B * T * C), ("out", out, B * T * C),
                             ("qkv", qkv, B * T * QKV)],
                            [("D", D, B * NH * T), ("lse", lse, B * NH * T)])
    _, dkdv_tiles, dq_tiles = FLASH_TILES[precision, HS]
    _, dkdv_name, dq_name = FLASH_ATTENTION_KERNELS[HS]
    itemsize = FLOATX_DTYPES[precision].itemsize
    cuda.launch("flash_attention", precision, "flash_attention_backward_preprocess", elementwise_grid(B * T * NH),
                BLOCK_SIZE, (D, dout, out, np.int32(B), np.int32(T), np.int32(NH), np.int32(HS)))
    args = (dqkv, dout, qkv, lse, D, np.int32(B), np.int32(T), np.int32(NH), np.int32(NKV))
    grid, block, shared = flash_dkdv_launch(dkdv_tiles, HS, itemsize, B, T, NKV)
    launch_with_shared_memory(flash_kernel(precision, dkdv_name), grid, block, args, shared)
    grid, block, shared = flash_dq_launch(dq_tiles, HS, itemsize, B, T, NH)
    launch_with_shared_memory(flash_kernel(precision, dq_name), grid, block, args, shared)


# The attention paths (--attention): one object per path, chosen once (attention_path) and kept on
# the model. Each says which buffers it keeps for the backward (activation_shapes), where the qkv
# projection goes, and runs its forward and backward; --check compares its kept buffers with
# gpt2_cpu's (check_names, references).

class NaiveAttention:
    """The (B,NH,T,T) matrix (kernels/attention.cu + cuBLAS): qkvr (q, k, v split into heads) and
    att are kept per layer; the qkv projection, preatt, the per-head outputs and datt live in
    att_workspace, an alias of the `logits` buffer (sized for the largest of them and the logits)."""
    name = "naive"
    kernel_files = ()
    check_names = ("qkvr", "att")
    grouped_kv = False          # takes GPT-2's (B,T,3C): Llama 3 repeats its NKV key/value heads first
    autotune = 1                # library candidates timed at a first call (cuDNN's plans: CudnnAttention only)
    deterministic = True        # a backward that sums in a fixed order (cuDNN's choice: CudnnAttention only)

    def buffers(self, B, T, C, L, NH, logits_floats, qkv_channels=None):
        """(kept per layer, floats of `logits`, the backward's own buffers) for activation_shapes;
        logits_floats: what the classifier needs of `logits` (B*T*Vp, or a chunk's rows);
        qkv_channels: the width of the qkv projection a grouped_kv path reads in place
        ((NH+2NKV)*HS; None: 3C)."""
        HS = C // NH
        kept = [("qkvr", (L, 3, B, NH, T, HS), "X"), ("att", (L, B, NH, T, T), "X")]
        backward = [("dqkvr", (3, B, NH, T, HS), "X"),            # attention backward: dq, dk, dv per head
                    ("dy", (B, NH, T, HS), "X")]                 # attention backward: dout per head
        return kept, max(B * T * max(3 * C, NH * T), logits_floats), backward   # and the workspace of qkv | preatt | y | datt

    def aliases(self, B, T, C, NH):
        """(name, buffer, shape) of the roles it keeps in another buffer, for activation_aliases:
        the workspace of attention_forward and attention_backward, in `logits` (free until the
        classifier writes it, and again once the backward's classifier matmul has consumed it)."""
        return [("att_workspace", "logits", (B * T * max(3 * C, NH * T),))]

    def prepare(self, sizes, NH, HS):
        """Work before the first step for these (B,T) sizes: none."""

    def qkv(self, A, l, B, T, C):
        """Where layer l's qkv projection (B,T,3C) is written."""
        return prefix(A["att_workspace"], (B, T, 3 * C))

    def forward(self, A, l, B, T, C, NH, tf32, NKV=None):
        """atty[l] (B,T,C) from the qkv projection in att_workspace (NKV: grouped_kv paths only)."""
        attention_forward(A["atty"][l], A["qkvr"][l], A["att"][l], A["att_workspace"], B, T, C, NH, tf32)

    def backward(self, dqkv, datty, A, l, B, T, C, NH, tf32, NKV=None):
        """dqkv (B,T,3C) written from datty (B,T,C) (NKV: grouped_kv paths only)."""
        attention_backward(dqkv, A["dqkvr"], A["att_workspace"], A["dy"], datty, A["qkvr"][l], A["att"][l], B, T, C, NH,
                           tf32)

    def references(self, cpu_acts, L, B, T, C, NH):
        """gpt2_cpu's counterparts of check_names that gpt2_cpu does not keep under the same name."""
        return {"qkvr": cpu_acts["qkv"].reshape(L, B, T, 3, NH, C // NH).transpose(0, 3, 1, 4, 2, 5)}  # (L,3,B,NH,T,HS)


class FlashAttention(NaiveAttention):
    """Our flash attention (kernels/flash_attention.cu): no (T,T) matrix; qkv (L,B,T,3C) itself and
    lse (L,B,NH,T), the log-sum-exp of each query's scores, are kept; `logits` holds only the logits.
    grouped_kv: its kernels read Llama 3's NKV key/value heads where the qkv projection left them,
    (B,T,(NH+2NKV)*HS), each shared by NH/NKV query heads, so nothing is repeated; kept so."""
    name = "flash"
    kernel_files = ("flash_attention",)
    check_names = ("qkv", "lse")
    grouped_kv = True

    def buffers(self, B, T, C, L, NH, logits_floats, qkv_channels=None):
        kept = [("qkv", (L, B, T, qkv_channels or 3 * C), "X"), ("lse", (L, B, NH, T), "f32")]
        return kept, logits_floats, [("att_D", (B, NH, T), "f32")]   # flash backward: rowsum(dout * out)

    def aliases(self, B, T, C, NH):
        return []

    def qkv(self, A, l, B, T, C):
        return A["qkv"][l]

    def forward(self, A, l, B, T, C, NH, tf32, NKV=None):
        flash_attention_forward(A["atty"][l], A["lse"][l], A["qkv"][l], B, T, C, NH, NKV)

    def backward(self, dqkv, datty, A, l, B, T, C, NH, tf32, NKV=None):
        flash_attention_backward(dqkv, A["att_D"], datty, A["atty"][l], A["qkv"][l], A["lse"][l], B, T, C, NH, NKV)

    def references(self, cpu_acts, L, B, T, C, NH):
        return {"lse": np.stack([attention_lse(cpu_acts["qkv"][l], NH) for l in range(L)])}       # (L,B,NH,T)


class CudnnAttention(FlashAttention):
    """cuDNN's fused attention (llmc/cudnn_attention.py): flash's buffers and lse (cuDNN's softmax
    "stats"); its graphs and workspace are built before the first step (prepare). autotune: how many
    of cuDNN's plans each graph times at its first run (gpt2_cuda.py's --autotune; 1: the first);
    deterministic: cuDNN's deterministic backward (--cudnn-deterministic; False: dq summed in any order)."""
    name = "cudnn"
    kernel_files = ()
    grouped_kv = False          # its graphs are built for GPT-2's (B,T,3C)

    def prepare(self, sizes, NH, HS):
        from llmc import cudnn_attention
        cudnn_attention.prepare(sizes, NH, HS, self.deterministic)

    def forward(self, A, l, B, T, C, NH, tf32, NKV=None):
        from llmc import cudnn_attention
        cudnn_attention.attention_forward_cudnn(A["atty"][l], A["lse"][l], A["qkv"][l], B, T, NH, C // NH,
                                                autotune=self.autotune, deterministic=self.deterministic)

    def backward(self, dqkv, datty, A, l, B, T, C, NH, tf32, NKV=None):
        from llmc import cudnn_attention
        cudnn_attention.attention_backward_cudnn(dqkv, datty, A["qkv"][l], A["atty"][l], A["lse"][l], B, T, NH, C // NH,
                                                 autotune=self.autotune, deterministic=self.deterministic)


def attention_path(name):
    """The attention path object of --attention `name` (ATTENTION_PATHS). Raises InputError."""
    paths = {"naive": NaiveAttention, "flash": FlashAttention, "cudnn": CudnnAttention}
    if name not in paths:
        raise InputError(f"attention must be one of {', '.join(ATTENTION_PATHS)}, not {name}")
    return paths[name]()


def resolve_attention(requested, precision, HS):
    """The attention path to run for --attention `requested` (ATTENTION_CHOICES): (path, None), or
    (fallback, one line saying why) where the requested path cannot run here: cudnn falls back to
    flash (or naive), flash to naive for a head size it has no kernel for. auto is cudnn on a GPU
    where cuDNN attention can run, else naive (with the line saying why not cuDNN); on the emulated
    device (llmc.cuda.device() "cpu") it is naive, silently."""
    if requested == "auto":
        if cuda.device() == "cpu":
            return "naive", None
        from llmc import cudnn_attention
        reason = cudnn_attention.unavailable_reason(precision, HS)
        if reason is None:
            return "cudnn", None
        return "naive", f"naive attention (--attention auto; cuDNN attention unavailable: {reason})"
    if requested == "cudnn":
        from llmc import cudnn_attention
        reason = cudnn_attention.unavailable_reason(precision, HS)
        if reason is None:
            return "cudnn", None
        path, _ = resolve_attention("flash", precision, HS)
        return path, f"cuDNN attention unavailable ({reason}): using {path} attention"
    if requested == "flash" and not flash_attention_supported(HS):
        return "naive", f"flash attention has no kernel for head size {HS}: using naive attention"
    return requested, None
