"""
gpt2_cuda.py: GPT-2 training on NVIDIA GPUs in Python: CuPy for memory and launches, our own CUDA
kernels (kernels/*.cu) for everything but the matmuls, cuBLAS for those. The twin of llm.c's
train_gpt2.cu, as gpt2_cpu.py is of train_gpt2.c, and read in the same order: constants, the
activation table, the launchers, the model, the update, the step, train(). A layer is a thin
*launcher*: it checks its arguments, computes the grid and launches a kernel that writes into
preallocated arrays, outputs first, like llm.c: `layernorm_forward(out, mean, rstd, inp, weight,
bias, B, T, C)`. The rest is in llmc/: the attention paths (attention.py), the matmul libraries
(cublaslt.py, cudnn_attention.py), ZeRO-1's shards (zero.py), the GPU flags (gpu_cli.py), --check
(cuda_check.py), and what gpt2_cpu.py shares (files, loaders, checkpoints, the loop around a step).

No autograd, no ZeRO beyond stage 1. All training memory is allocated before the first step (the
sampler's KV cache excepted). A step runs wholly on the device, the gradient clipping factor
included, with no device-to-host synchronization inside it; its loss and norm are copied back at
its end and logged a step late, while the next step runs (with -sl / -sg, or ZeRO-1 over several
ranks, the host reads them before the update instead). The attention path (--attention naive |
flash | cudnn) and the matmul backend (cuBLAS, or --cublaslt 1; -f 1: TF32; --residual-epilogue,
--autotune, -ge)
are objects chosen once by setup_model and kept on the model; --cuda-graph 1 (the default on a
GPU) replays the whole step as one CUDA graph (one per micro-batch with -d > B*T); --lora-rank R fine-tunes LoRA adapters on the frozen
model (llmc/lora_device.py, doc/lora.md). Precision: bf16 (the default from
compute capability 8.0) stores parameters, gradients and activations as bfloat16 with fp32
arithmetic inside every kernel, fp32 AdamW moments and (-w 1) fp32 master weights; fp32 stores
everything as float32.

Run it (after `make data`; without CuPy and a GPU it says so in one line and exits 2):
    python gpt2_cuda.py                          # d4 on Shakespeare, gpt2_cpu.py's defaults
    python gpt2_cuda.py --device cpu -e d2 -x 4  # no GPU: the same kernels on the emulated device
    python gpt2_cuda.py -e d12 -b 16 -t 1024 -x 200
    python gpt2_cuda.py --check -e d12 -b 4 -t 64 --precision fp32 -f 0
`make test-gpu` checks every kernel and the model against gpt2_cpu.py; every gpt2_cpu.py flag works
here; `mpiexec -n 8 python gpt2_cuda.py` trains on 8 GPUs.

Dimensions as in gpt2_cpu.py (B T C V Vp L NH HS OC maxT), plus N = B*T, the rows of a matmul.
Gradient convention (llm.c's): a launcher *writes* (=) its input's gradient into the `dinp` it is
given, except LayerNorm's backward, which *accumulates* (+=) into dinp, the residual stream's
gradient; parameter gradients always accumulate.
"""

import math
import sys
import time
from typing import NamedTuple

from llmc.interrupt import quiet_ctrl_c_while_importing
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback
from llmc.openblas import spin_briefly_when_idle  # noqa: E402
spin_briefly_when_idle()                 # before NumPy loads OpenBLAS: the emulated device's kernels want the cores
from llmc.utils import require  # noqa: E402
require("gpt2_cuda.py", "numpy")         # no NumPy (the environment not activated): one line, exit 1
import numpy as np  # noqa: E402

import gpt2_cpu
from gpt2_cpu import (ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, DECAYED_PARAMETERS, LORA_FAMILY, LR_SCHEDULES, KVCache,
                      SamplerRNG, SamplingForward, build_lora, build_model, check_inputs, generate, kv_cache_shape,
                      layer_params, learning_rate_at, model_config, num_elements, parameter_shapes, tensor_views)
from llmc import cuda, gpu_cli, multinode
from llmc import lora as lora_files
from llmc.attention import NaiveAttention, attention_path, resolve_attention
from llmc.checkpoint import load_checkpoint, save_checkpoint
from llmc.cli import TrainingRun, agreement_config, run_main, sample_from_prompt
from llmc.comm import Comm
from llmc.cuda import (BLOCK_SIZE, FLOATX_DTYPES, MAX_THREADS_PER_BLOCK, VECTOR_BYTES,
                       PRECISIONS, WARP_ROW_BLOCK_SIZE, WARP_SIZE, KernelCompileError, ceil_div, check_launch,
                       elementwise_grid, require, vector_size, warp_row_grid)
from llmc.cuda_check import run_check
from llmc.evalloader import NUM_COMPLETIONS, PAD_TOKEN
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits, read_model_file, write_model_file
from llmc.gpu_cli import choose_precision, device_line, gpu_status_line
from llmc.lora_device import DeviceLoRA, LoraMatmul
from llmc.matmul import BIAS_BACKWARD_CHUNKS, Cublas, gelu_forward, matmul_backend
from llmc.mfu import mfu
from llmc.pinned import PinnedStaging
from llmc.utils import InputError, prefix
from llmc.zero import ShardPiece, optimizer_shard, rounding_seed, shard_slices

# ----------------------------------------------------------------------------
# constants: launch configuration, precision

KERNEL_FILES = ("encoder", "layernorm", "attention", "gelu", "bias", "classifier", "adamw", "global_norm", "cast")
LAYERNORM_BACKWARD_BLOCK_SIZE = 512
LAYERNORM_BACKWARD_GRID = 512          # partial-sum slots of layernorm_backward: fixed, so results reproduce
LAYERNORM_PARAM_REDUCE_BLOCK_SIZE = 512   # 16 warps share each column group's slots: fixed, likewise
WTE_CHUNK_ROWS = 32                    # most positions one block of the dwte scatter-add sums
CLASSIFIER_BLOCK_SIZE = 1024           # one block per row of Vp logits (llm.c's fused_classifier)
GLOBAL_NORM_GRID = 1024                # partial sums of the gradient norm: fixed, likewise
GLOBAL_NORM_BLOCK_SIZE = 512
NORM_VALUES = 2                        # global_norm's out: the norm, then the clipping factor
NORM_CLIP_SCALE = 1                    # out[1]: what AdamW scales the gradient by
ADAMW_BLOCK_SIZE = 256                 # threads of adamw_update, one 16-byte vector each: fixes its table
ADAMW_TENSOR_FIELDS = 5                # kernels/adamw.cu's table row: offsets, count, first block, decayed
ADAMW_STEP_SCALARS = 3                 # learning rate, beta1 and beta2 bias corrections
UPDATE_SEED = 13371337                 # llm.c's initial rng_state, the seeds of stochastic rounding


# ----------------------------------------------------------------------------
# activation table: every device buffer, allocated once (parameters: gpt2_cpu.parameter_shapes)

RECOMPUTE_LEVELS = (0, 1, 2)           # llm.c's -r: 0 none, 1 GELU, 2 GELU and the LayerNorms


def recomputed_activations(recompute):
    """The per-layer activations the backward recomputes at -r `recompute` (0, 1, 2, llm.c's
    levels), each kept for one layer instead of L: 1 fch_gelu = gelu(fch); 2 also ln1 and ln2, the
    LayerNorm outputs (their mean and rstd stay kept for every layer: layernorm_backward reads them)."""
    return {0: (), 1: ("fch_gelu",), 2: ("fch_gelu", "ln1", "ln2")}[recompute]


def layer_activation(A, name, l, recompute):
    """Layer l's view of the per-layer activation `name` (in the activation views A): A[name][l],
    or the one layer's buffer A[name][0] where the backward recomputes it (recomputed_activations)."""
    return A[name][0 if name in recomputed_activations(recompute) else l]


def activation_shapes(config, B, T, recompute=1, attention=None, classifier_chunk=0):
    """Every device buffer a forward + backward pass uses, in forward order: (name, shape, kind),
    kind "X" floatX, "f32" float32, "i32" int32. Each buffer is allocated once, as large as its
    largest size over the (B,T) the run uses; a (B,T) uses its first elements. Names follow
    gpt2_cpu.activation_shapes; the differences are llm.c's: attproj, fcproj and probs are never
    kept (fused kernels consume them); -r 1 keeps fch_gelu for one layer, -r 2 also ln1 and ln2
    (recomputed_activations; -r 0 keeps every layer's); dlogits overwrite the logits in place;
    scratch_btc and scratch_bt4c hold one layer's transient values, each under the name of its
    role (activation_aliases). The attention path (an attention_path object, default naive)
    decides the attention buffers (its `buffers`):
      naive:         qkvr (q, k, v split into heads) and att (L,B,NH,T,T) are kept; `logits` is
                     sized to be its workspace too (att_workspace: qkv, preatt, the per-head outputs,
                     datt (B,NH,T,T));
      flash, cudnn:  qkv (L,B,T,3C) itself and lse (L,B,NH,T), the log-sum-exp of each query's
                     scores, are kept: no (T,T) buffer exists, and no per-head copies."""
    C, L, NH, Vp = config.channels, config.num_layers, config.num_heads, config.padded_vocab_size
    attention = attention or NaiveAttention()
    classifier_rows = max(r1 - r0 for r0, r1 in classifier_chunks(B, T, classifier_chunk))
    attention_kept, logits_floats, attention_backward_buffers = attention.buffers(B, T, C, L, NH, classifier_rows * Vp)
    recomputed = recomputed_activations(recompute)

    def layers(name):                      # how many layers of `name` are kept
        return 1 if name in recomputed else L

    return [
        ("inputs", (B, T), "i32"), ("targets", (B, T), "i32"),
        ("encoded", (B, T, C), "X"),
        ("ln1", (layers("ln1"), B, T, C), "X"), ("ln1_mean", (L, B, T), "f32"), ("ln1_rstd", (L, B, T), "f32"),
        *attention_kept, ("atty", (L, B, T, C), "X"),
        ("residual2", (L, B, T, C), "X"),
        ("ln2", (layers("ln2"), B, T, C), "X"), ("ln2_mean", (L, B, T), "f32"), ("ln2_rstd", (L, B, T), "f32"),
        ("fch", (L, B, T, 4 * C), "X"), ("fch_gelu", (layers("fch_gelu"), B, T, 4 * C), "X"),
        ("residual3", (L, B, T, C), "X"),
        ("lnf", (B, T, C), "X"), ("lnf_mean", (B, T), "f32"), ("lnf_rstd", (B, T), "f32"),
        ("losses", (B, T), "f32"), ("loss_accum", (B, T), "f32"),
        ("logits", (logits_floats,), "X"),     # (B,T,Vp) or a classifier chunk's rows, then dlogits in place
        ("scratch_btc", (B, T, C), "X"),       # one layer's (B,T,C) transients (activation_aliases)
        ("scratch_bt4c", (B, T, 4 * C), "X"),  # one layer's (B,T,4C) transients (activation_aliases)
        ("dresidual", (B, T, C), "X"),         # the residual stream's gradient
        *attention_backward_buffers,
        # the dwte scatter-add's plan (WteSegments), sized for the most chunks and tokens B*T can have
        ("positions", (B * T,), "i32"), ("chunk_start", (B * T + 1,), "i32"), ("chunk_token", (B * T,), "i32"),
        ("chunk_slot", (B * T,), "i32"), ("reduce_start", (wte_reduce_max(B * T) + 1,), "i32"),
        ("reduce_token", (wte_reduce_max(B * T) + 1,), "i32"), ("wte_partial", (wte_partial_rows(B * T), C), "f32"),
    ]


def activation_aliases(config, B, T, attention=None):
    """The roles that live in a buffer of activation_shapes, one name each: (name, buffer, shape),
    a view of the buffer's first elements (gpt2_activations). The roles of one buffer are never
    live at once: each is consumed before the next is written."""
    C = config.channels
    attention = attention or NaiveAttention()
    return [
        # the forward's bias-free projections (the fused residual after each adds the bias), and
        # the backward's input gradients, each consumed by the launch after the one writing it
        *[(name, "scratch_btc", (B, T, C)) for name in ("attproj", "fcproj", "dlnf", "dln2", "datty", "dln1")],
        ("dfch", "scratch_bt4c", (B, T, 4 * C)), ("dqkv", "scratch_bt4c", (B, T, 3 * C)),
        ("sampler_qkv", "scratch_bt4c", (B, T, 3 * C)),   # the cached forward's qkv: no backward follows it
        *attention.aliases(B, T, C, config.num_heads),    # naive: att_workspace in `logits`
    ]


# ----------------------------------------------------------------------------
# layers: launchers, forward/backward pairs, in gpt2_cpu.py's order (the linear layers and GELU are
# llmc/matmul.py's, attention llmc/attention.py's, as llm.c keeps them in llmc/matmul.cuh, attention.cuh)

def encoder_forward(out, inp, wte, wpe, B, T, C):
    """out (B,T,C) = wte[inp] + wpe[:T]. inp (B,T) int32 on the device; wte (Vp,C); wpe (maxT,C).
    Token ids must be in [0, V): checked on the host before upload (gpt2_forward)."""
    precision = check_launch("encoder_forward", [("out", out, B * T * C), ("wte", wte, wte.size), ("wpe", wpe, wpe.size)],
                             int32=[("inp", inp, B * T)], vector_dim=("C", C))
    require(wte.size % C == 0 and wpe.size >= T * C, "encoder_forward: wte/wpe shapes do not fit C and T")
    cuda.launch("encoder", precision, "encoder_forward", elementwise_grid(B * T * C // vector_size(precision)), BLOCK_SIZE,
                (out, inp, wte, wpe, np.int32(B), np.int32(T), np.int32(C)))


class WteSegments(NamedTuple):
    """The host's plan of the deterministic dwte scatter-add (encoder_backward_segments), int32
    arrays: K chunks of at most WTE_CHUNK_ROWS positions each, M tokens with several chunks."""
    positions: np.ndarray      # (N,)   flat positions b*T+t, stably sorted by token id
    chunk_start: np.ndarray    # (K+1,) chunk k is positions[chunk_start[k]:chunk_start[k+1]]; chunk_start[K] = N
    chunk_token: np.ndarray    # (K,)   the token id of chunk k
    chunk_slot: np.ndarray     # (K,)   -1: k is its token's only chunk; else k's row of the fp32 partial sums
    reduce_start: np.ndarray   # (M+1,) token m's partial rows are reduce_start[m]:reduce_start[m+1]
    reduce_token: np.ndarray   # (M,)   the token id of token m


def encoder_backward_segments(inp, chunk_rows=WTE_CHUNK_ROWS):
    """Host side of the deterministic dwte scatter-add: inp (B,T) token ids -> WteSegments, so
    that dwte[v] += sum of dout[p] over the positions p of token v (np.add.at semantics) becomes:
    each chunk (at most chunk_rows positions of one token, in position order) summed by one GPU
    block; a token's only chunk added into dwte, the several chunks of a frequent token written
    to fp32 partial rows and added in chunk order by one more block. No atomics, the same order
    every run, and no block sums more than chunk_rows rows (a token that is 4% of a batch would
    otherwise be one block's serial tail)."""
    flat = np.ascontiguousarray(inp, dtype=np.int32).ravel()
    N = flat.size
    # a stable sort of uint16 keys is NumPy's radix sort (linear time: ~1 ms at N=65,536)
    keys = flat.astype(np.uint16) if N and flat.max() <= np.iinfo(np.uint16).max else flat
    positions = np.argsort(keys, kind="stable").astype(np.int32)
    sorted_tokens = flat[positions]
    starts = np.flatnonzero(np.diff(sorted_tokens, prepend=np.int32(-1)))   # token ids are >= 0
    counts = np.diff(np.append(starts, N))                                  # positions per distinct token
    tokens = sorted_tokens[starts]
    chunks = -(-counts // chunk_rows)                                       # chunks per token
    owner = np.repeat(np.arange(tokens.size), chunks)                       # (K,) the token of each chunk
    first = np.cumsum(chunks) - chunks                                      # each token's first chunk
    chunk_start = np.append(starts[owner] + (np.arange(owner.size) - first[owner]) * chunk_rows, N)
    several = chunks > 1
    in_several = several[owner]
    chunk_slot = np.where(in_several, np.cumsum(in_several) - 1, -1)
    reduce_start = np.append(0, np.cumsum(chunks[several]))
    return WteSegments(*(a.astype(np.int32) for a in (positions, chunk_start, tokens[owner], chunk_slot,
                                                      reduce_start, tokens[several])))


def wte_reduce_max(N):
    """Most tokens with several chunks a batch of N positions can have (each has > WTE_CHUNK_ROWS)."""
    return N // (WTE_CHUNK_ROWS + 1)


def wte_partial_rows(N):
    """Most fp32 partial rows a batch of N positions can need: a token of n > WTE_CHUNK_ROWS
    positions has ceil(n / WTE_CHUNK_ROWS) <= n / WTE_CHUNK_ROWS + 1 chunks, summed over at most
    wte_reduce_max(N) such tokens."""
    return ceil_div(N, WTE_CHUNK_ROWS) + wte_reduce_max(N)


def encoder_backward(dwte, dwpe, partial, dout, positions, chunk_start, chunk_token, chunk_slot, reduce_start,
                     reduce_token, num_chunks, num_reduce, B, T, C):
    """Accumulate dwte (Vp,C) and dwpe (maxT,C) from dout (B,T,C). The other arrays are on the
    device: WteSegments' int32 arrays (chunk_start with num_chunks+1 entries, reduce_start with
    num_reduce+1) and partial, fp32 partial sums of at least wte_partial_rows(B*T) rows of C.
        out[b,t] = wte[inp[b,t]] + wpe[t]  =>  dwte[v] += sum of dout[b,t] where inp[b,t] == v,
                                               dwpe[t] += sum_b dout[b,t]"""
    if dwte is None:                                           # frozen (LoRA): nothing to accumulate
        return
    N = B * T
    precision = check_launch("encoder_backward", [("dwte", dwte, dwte.size), ("dwpe", dwpe, dwpe.size), ("dout", dout, N * C)],
                             int32=[("positions", positions, N), ("chunk_start", chunk_start, num_chunks + 1),
                                    ("chunk_token", chunk_token, num_chunks), ("chunk_slot", chunk_slot, num_chunks),
                                    ("reduce_start", reduce_start, num_reduce + 1),
                                    ("reduce_token", reduce_token, num_reduce)], vector_dim=("C", C))
    require(partial.dtype == np.float32 and partial.size >= wte_partial_rows(N) * C,
            f"encoder_backward: partial needs {wte_partial_rows(N) * C} floats")
    vec = vector_size(precision)
    cuda.launch("encoder", precision, "encoder_backward_wpe", elementwise_grid(T * C // vec), BLOCK_SIZE,
                (dwpe, dout, np.int32(B), np.int32(T), np.int32(C)))
    groups_per_row = C // vec                                  # threads of a block stride over these
    block = min(MAX_THREADS_PER_BLOCK, ceil_div(groups_per_row, WARP_SIZE) * WARP_SIZE)
    cuda.launch("encoder", precision, "encoder_backward_wte", max(1, num_chunks), block,
                (dwte, partial, dout, positions, chunk_start, chunk_token, chunk_slot, np.int32(num_chunks), np.int32(C)))
    cuda.launch("encoder", precision, "encoder_backward_wte_reduce", max(1, num_reduce), block,
                (dwte, partial, reduce_start, reduce_token, np.int32(num_reduce), np.int32(C)))


def layernorm_forward(out, mean, rstd, inp, weight, bias, B, T, C):
    """out (B,T,C) = (inp - mean) * rstd * weight + bias over the last axis; mean, rstd (B,T) fp32
    are written for the backward. One warp per row (kernels/layernorm.cu)."""
    N = B * T
    precision = check_launch("layernorm_forward", [("out", out, N * C), ("inp", inp, N * C), ("weight", weight, C),
                                                   ("bias", bias, C)],
                             float32=[("mean", mean, N), ("rstd", rstd, N)], vector_dim=("C", C))
    cuda.launch("layernorm", precision, "layernorm_forward", warp_row_grid(N), WARP_ROW_BLOCK_SIZE,
                (out, mean, rstd, inp, weight, bias, np.int32(N), np.int32(C)))


def fused_residual_forward(residual, normed, mean, rstd, inp1, inp2, inp2_bias, weight, bias, N, C):
    """residual (N,C) = inp1 + (inp2 + inp2_bias) (rounded to floatX once), then normed, mean, rstd =
    layernorm of it: residual_forward and the next layernorm_forward in one pass over the rows.
    inp2_bias (C,) is the bias of the projection that wrote inp2 with a bias-free GEMM, or None:
    folded here, the bias costs no pass over (N,C) of its own."""
    bias_arg = [("inp2_bias", inp2_bias, C)] if inp2_bias is not None else []
    precision = check_launch("fused_residual_forward",
                             [("residual", residual, N * C), ("normed", normed, N * C), ("inp1", inp1, N * C),
                              ("inp2", inp2, N * C), ("weight", weight, C), ("bias", bias, C)] + bias_arg,
                             float32=[("mean", mean, N), ("rstd", rstd, N)], vector_dim=("C", C))
    null = np.uint64(0)                    # a NULL floatX*: no projection bias
    cuda.launch("layernorm", precision, "fused_residual_forward", warp_row_grid(N), WARP_ROW_BLOCK_SIZE,
                (residual, normed, mean, rstd, inp1, inp2, null if inp2_bias is None else inp2_bias, weight, bias,
                 np.int32(N), np.int32(C)))


def layernorm_backward(dinp, dweight, dbias, partial, dout, inp, weight, mean, rstd, B, T, C, dprojb=None):
    """Accumulate dinp (B,T,C) (the residual stream's gradient), dweight, dbias (C,), from dout:
        dinp += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),  dnorm = dout * weight
    (derivation: gpt2_cpu.layernorm_backward, doc/layernorm.md). Two kernels: per-block partial
    sums of dbias/dweight into partial (G, 2, C) fp32, then their sum in a fixed order (each block
    of layernorm_param_reduce sums 32 columns, its warps sharing the G slots); skipped for a frozen
    LayerNorm (dweight and dbias None). dprojb (C,), given: also dprojb += the column sums of dinp
    as it leaves (partial (G, 3, C)): dinp is then the whole gradient of the residual stream, whose
    last term was a projection's bias, so these are that bias's gradient (--ln-bias-grad 1)."""
    N = B * T
    G = layernorm_backward_grid(N)
    trained = [("dweight", dweight, C), ("dbias", dbias, C)] if dweight is not None else []
    require(dprojb is None or trained, "layernorm_backward sums dprojb only with its own dweight, dbias")
    projection = [("dprojb", dprojb, C)] if dprojb is not None else []
    precision = check_launch("layernorm_backward",
                             [("dinp", dinp, N * C), ("dout", dout, N * C), ("inp", inp, N * C), ("weight", weight, C)]
                             + trained + projection,
                             float32=[("mean", mean, N), ("rstd", rstd, N)], vector_dim=("C", C),
                             unaligned=("dweight", "dbias", "dprojb"))
    sums = 3 if projection else 2
    require(partial.dtype == np.float32 and partial.size >= G * sums * C,
            f"layernorm partial sums need {G * sums * C} floats")
    cuda.launch("layernorm", precision, "layernorm_backward", G, LAYERNORM_BACKWARD_BLOCK_SIZE,
                (dinp, partial, dout, inp, weight, mean, rstd, np.int32(N), np.int32(C), np.int32(sums - 2)))
    if trained:
        null = np.uint64(0)                # a NULL floatX*: two sums a slot
        cuda.launch("layernorm", precision, "layernorm_param_reduce", layernorm_param_reduce_grid(C, sums),
                    LAYERNORM_PARAM_REDUCE_BLOCK_SIZE,
                    (dweight, dbias, null if dprojb is None else dprojb, partial, np.int32(G), np.int32(C)))


def layernorm_backward_grid(N):
    """Scratch slots of layernorm_backward (blocks, each owning ceil(N/G) rows): fixed per N."""
    return min(LAYERNORM_BACKWARD_GRID, N)


def layernorm_param_reduce_grid(C, sums=2):
    """Blocks of layernorm_param_reduce: one per group of WARP_SIZE of the sums * C columns of a
    slot, [dbias | dweight] or [dbias | dweight | dprojb]."""
    return ceil_div(sums * C, WARP_SIZE)


def partial_floats(config):
    """fp32 floats the backward's partial sums need: LayerNorm (G, 3, C) or bias (chunks, OC<=4C)."""
    C = config.channels
    return max(LAYERNORM_BACKWARD_GRID * 3 * C, BIAS_BACKWARD_CHUNKS * 4 * C)


def fused_classifier(logits, losses, targets, dloss, B, T, V, Vp, write_dlogits):
    """Softmax + cross-entropy over the first V of Vp columns, per row of logits (B,T,Vp):
    losses (B,T) fp32 = logsumexp - logit[target]; with write_dlogits the logits are overwritten
    in place by dlogits = (softmax - onehot(target)) * dloss (0 in the padded columns), so the
    (B,T,Vp) probabilities never exist. Replaces gpt2_cpu's softmax_forward, crossentropy_forward
    and crossentropy_softmax_backward. targets (B,T) int32 in [0, V)."""
    N = B * T
    precision = check_launch("fused_classifier", [("logits", logits, N * Vp)], float32=[("losses", losses, N)],
                             int32=[("targets", targets, N)], aligned=True)
    require(0 < V <= Vp, f"fused_classifier: need 0 < V={V} <= Vp={Vp}")
    cuda.launch("classifier", precision, "fused_classifier", max(1, N), CLASSIFIER_BLOCK_SIZE,
                (logits, losses, targets, np.float32(dloss), np.int32(N), np.int32(V), np.int32(Vp),
                 np.int32(1 if write_dlogits else 0)))


# ----------------------------------------------------------------------------
# gradient norm and casts (gpt2_cpu needs no kernel for these: np.dot, astype)

def global_norm(out, partial, data, n, grad_clip=0.0):
    """out[0] (fp32, on the device) = sqrt(sum of data^2) over n floatX values, in two fixed-order
    steps: GLOBAL_NORM_GRID per-block partial sums into partial, then one block sums those and
    writes out[1] = the clipping factor grad_clip / out[0] where 0 < grad_clip < out[0], else 1
    (what AdamW scales the gradient by: computed on the device, no host round trip). out (2,) fp32."""
    precision = check_launch("global_norm", [("data", data, n)], aligned=True)
    require(partial.dtype == np.float32 and partial.size >= GLOBAL_NORM_GRID, "global_norm: partial too small")
    require(out.dtype == np.float32 and out.size >= NORM_VALUES, f"global_norm: out must be {NORM_VALUES} fp32")
    cuda.launch("global_norm", precision, "global_norm_squared", GLOBAL_NORM_GRID, GLOBAL_NORM_BLOCK_SIZE,
                (partial, data, np.uint64(n), np.int32(0)))
    cuda.launch("global_norm", precision, "global_norm_finalize", 1, MAX_THREADS_PER_BLOCK,
                (out, partial, np.int32(GLOBAL_NORM_GRID), np.float32(grad_clip)))


def cast_float_to_floatX(out, inp, n):
    """out (n,) floatX = inp (n,) fp32, round to nearest even (a copy in fp32 mode)."""
    precision = check_launch("cast_float_to_floatX", [("out", out, n)], float32=[("inp", inp, n)])
    cuda.launch("cast", precision, "cast_float_to_floatX", elementwise_grid(n), BLOCK_SIZE, (out, inp, np.uint64(n)))


def cast_floatX_to_float(out, inp, n):
    """out (n,) fp32 = inp (n,) floatX (exact)."""
    precision = check_launch("cast_floatX_to_float", [("inp", inp, n)], float32=[("out", out, n)])
    cuda.launch("cast", precision, "cast_floatX_to_float", elementwise_grid(n), BLOCK_SIZE, (out, inp, np.uint64(n)))


# ----------------------------------------------------------------------------
# the model: parameters, activations, forward, backward, zero_grad, grad norm

def staging_bytes(N):
    """Pinned bytes of the uploads of a micro-batch of N positions, per buffer: (batch, segments),
    each int32 array rounded up to PinnedStaging.ALIGNMENT as upload places them."""
    def ints(n):
        return ceil_div(4 * n, PinnedStaging.ALIGNMENT) * PinnedStaging.ALIGNMENT
    R = wte_reduce_max(N)
    return 2 * ints(N), ints(N) + ints(N + 1) + 2 * ints(N) + 2 * ints(R + 1)   # positions, chunks, reduce


class GPT2:
    """A GPT-2 on the GPU: flat floatX parameter and gradient buffers with named views (the order
    and shapes of gpt2_cpu.parameter_shapes, so the file loader, AdamW and the CPU model all agree),
    fp32 AdamW moments m, v, optional fp32 master weights, and the activation buffers (allocated
    by gpt2_allocate, once). precision is "bf16" or "fp32"; recompute is llm.c's -r level, 0, 1
    or 2 (recomputed_activations; True and False are 1 and 0); classifier_chunk: the sequences of a
    micro-batch the classifier takes at a time (classifier_chunks; 0: all at once); autotune: how
    many of cuDNN's plans each attention graph times at its first run (--autotune; the matmul
    backend holds its own count for cuBLASLt); cudnn_deterministic: cuDNN attention's deterministic
    backward (--cudnn-deterministic); ln_bias_grad: the attention and MLP projections' bias gradients
    summed by the LayerNorm backward that completes their output's gradient (--ln-bias-grad;
    backward_launches). Raises InputError for others. trainable=False: LoRA's
    frozen base (gpt2_cpu.freeze): no gradients, moments or master weights (G's views None); its
    adapters (lora, llmc/lora_device.py) are trained instead."""

    def __init__(self, config, precision="bf16", master_weights=True, recompute=1, attention="naive",
                 zero_stage=0, process_rank=0, num_processes=1, matmul=None, classifier_chunk=0,
                 trainable=True, autotune=1, cudnn_deterministic=True, ln_bias_grad=False):
        cp = cuda.cupy()
        if precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision}")
        if recompute not in RECOMPUTE_LEVELS:
            raise InputError(f"recompute must be one of {', '.join(map(str, RECOMPUTE_LEVELS))}, not {recompute}")
        if classifier_chunk < 0:
            raise InputError(f"--classifier-chunk {classifier_chunk}: a number of sequences, 0 for all at once")
        vec = vector_size(precision)
        if config.channels % config.num_heads or (config.channels // config.num_heads) % vec:
            raise InputError(f"the CUDA kernels need the head size C/NH = {config.channels}/{config.num_heads} "
                             f"to be a whole multiple of {vec} in {precision}")
        self.config = config
        self.precision = precision
        self.recompute = int(recompute)
        self.attention = attention_path(attention)   # the attention layer's path (NaiveAttention ...)
        self.attention.autotune = int(autotune)      # cuDNN's plans timed at a graph's first run (--autotune)
        self.attention.deterministic = bool(cudnn_deterministic)   # cuDNN's backward (--cudnn-deterministic)
        self.matmul = matmul or Cublas()             # the linear layers' backend (Cublas, CublasLt)
        self.classifier_chunk = int(classifier_chunk)   # sequences the classifier takes at a time (0: all)
        self.ln_bias_grad = bool(ln_bias_grad)       # projections' bias gradients by layernorm_backward
        self.floatX = FLOATX_DTYPES[precision]
        self.param_shapes = parameter_shapes(config)
        self.num_parameters = num_elements(self.param_shapes)
        n = self.num_parameters
        # -z 1 (ZeRO-1, the AdamW section): m, v and the master weights hold only this rank's shard
        # of S floats; params and grads stay whole, allocated padded to num_processes * S for
        # NCCL's equal counts (padding 0, never read by the model). -z 0: S = n, no padding
        self.zero_stage = zero_stage
        self.shard = optimizer_shard(n, zero_stage, process_rank, num_processes)
        self.params_memory = cp.zeros(self.shard.padded, dtype=self.floatX)
        self.grads_memory = cp.zeros(self.shard.padded, dtype=self.floatX) if trainable else None
        self.params = self.params_memory[:n]                         # (n,) views: what the model uses
        self.grads = self.grads_memory[:n] if trainable else None
        self.P = tensor_views(self.params, self.param_shapes)        # name -> view into params
        self.G = tensor_views(self.grads, self.param_shapes) if trainable else dict.fromkeys(self.P)
        S = self.shard.size if trainable else 0
        # fp32 master weights only make sense when the parameters themselves are not fp32
        self.master = cp.zeros(S, dtype=np.float32) if master_weights and precision == "bf16" and trainable else None
        self.m = cp.zeros(S, dtype=np.float32)                       # AdamW moments, fp32 always
        self.v = cp.zeros(S, dtype=np.float32)
        self.partial = cp.zeros(partial_floats(config), dtype=np.float32)   # the backward's per-block partial sums
        self.norm_partial = cp.zeros(GLOBAL_NORM_GRID, dtype=np.float32)
        self.norm = cp.zeros(NORM_VALUES, dtype=np.float32)                 # the gradient norm, its clipping factor
        self.update = UpdateBuffers(self.param_shapes)                      # AdamW's per-step values, on the device
        self.update_rng = SamplerRNG(UPDATE_SEED)    # seeds of stochastic rounding, one per tensor per step
        self.rng_state_last_update = self.update_rng.state
        self.buffers = None                          # name -> flat device buffer (gpt2_allocate)
        self.allocated = []                          # the (B,T) sizes the buffers were sized for
        self.views = {}                              # (B,T) -> name -> view
        self.graphs = {}                             # (B,T,loss_scale) -> captured CUDA graph (gpt2_micro_batch)
        self.BT = None                               # (B,T) of the last forward
        self.host_inputs = None                      # the last forward's token ids, for gpt2_backward
        self.staging = {"batch": PinnedStaging(), "segments": PinnedStaging()}   # pinned host buffers of the uploads
        self.has_targets = False
        self.lora = None                             # LoRA's adapters (llmc/lora_device.py) on a frozen model


# Per-layer buffers whose layers start on a VECTOR_BYTES boundary, each padded up to it: one layer of
# lse (L,B,NH,T) fp32 is B*NH*T floats, whole 16-byte vectors only when B*NH*T is a multiple of 4 (not
# for d48's NH = 25 at an odd B*T), and cuDNN reads each layer's lse as its stats tensor.
LAYER_ALIGNED_BUFFERS = ("lse",)


def layer_stride(name, shape, itemsize):
    """Elements from layer l of buffer `name` (shape (L, ...), elements of itemsize bytes) to
    layer l+1: one layer's elements, rounded up to whole VECTOR_BYTES for LAYER_ALIGNED_BUFFERS."""
    per_layer = math.prod(shape[1:])
    if name not in LAYER_ALIGNED_BUFFERS:
        return per_layer
    vector = VECTOR_BYTES // itemsize
    return ceil_div(per_layer, vector) * vector


def buffer_elements(name, shape, itemsize):
    """Elements the buffer of activation `name` needs for `shape` (with LAYER_ALIGNED_BUFFERS' padding)."""
    return shape[0] * layer_stride(name, shape, itemsize) if name in LAYER_ALIGNED_BUFFERS else math.prod(shape)


def carve(buf, name, shape):
    """The view of activation `name` of `shape` in its buffer: the first elements, or for
    LAYER_ALIGNED_BUFFERS layer l at element l * layer_stride, so that every layer's (contiguous)
    slice starts as aligned as the buffer (CuPy allocates on 256 bytes). No copy."""
    if name not in LAYER_ALIGNED_BUFFERS:
        return prefix(buf, shape)
    L, stride = shape[0], layer_stride(name, shape, buf.itemsize)
    return buf[:L * stride].reshape(L, stride)[:, :math.prod(shape[1:])].reshape(shape)   # (L,stride) -> (L,...)


def gpt2_allocate(model, *sizes):
    """Allocate every activation buffer, once (before training), big enough for each micro-batch
    size (B,T) in `sizes`: a buffer gets the largest of its sizes over their activation_shapes
    tables, and a (B,T) then uses the first elements of each (gpt2_activations). The trainer
    passes its (B,T), the sampler's (1, window) and HellaSwag's (rows, T): one set of buffers,
    no allocation inside the training loop. Returns the number of bytes allocated."""
    cp = cuda.cupy()
    dtypes = {"X": model.floatX, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}
    sizes = list(dict.fromkeys(sizes))                                # unique, in order
    tables = [activation_shapes(model.config, B, T, model.recompute, model.attention, model.classifier_chunk)
              for B, T in sizes]
    model.buffers = model.views = None                                # free the old set first
    model.graphs = {}                                                 # they point into the old buffers
    model.buffers = {name: cp.zeros(max(buffer_elements(name, table[i][1], dtypes[kind].itemsize) for table in tables),
                                    dtype=dtypes[kind])
                     for i, (name, _, kind) in enumerate(tables[0])}
    model.allocated = sizes
    model.views = {}
    batch_bytes, segment_bytes = staging_bytes(max(B * T for B, T in sizes))
    model.staging["batch"].reserve(batch_bytes)
    model.staging["segments"].reserve(segment_bytes)
    cfg = model.config
    model.attention.prepare(sizes, cfg.num_heads, cfg.channels // cfg.num_heads)   # before any graph capture
    return sum(buf.nbytes for buf in model.buffers.values())


def gpt2_activations(model, B, T):
    """Named views of the activation buffers shaped for (B,T) (cached): the first elements of each
    buffer (lse's layers each 16-byte aligned: carve), and of the buffers the roles of
    activation_aliases live in. If nothing is allocated,
    or some buffer is too small for (B,T), everything is reallocated for (B,T) and the sizes
    allocated before (views fetched earlier are then stale: fetch them again)."""
    if (B, T) not in model.views:
        table = activation_shapes(model.config, B, T, model.recompute, model.attention, model.classifier_chunk)
        if model.buffers is None or any(buffer_elements(name, shape, model.buffers[name].itemsize) > model.buffers[name].size
                                        for name, shape, _ in table):
            gpt2_allocate(model, *model.allocated, (B, T))
        views = {name: carve(model.buffers[name], name, shape) for name, shape, _ in table}
        views.update({name: prefix(model.buffers[buffer], shape)
                      for name, buffer, shape in activation_aliases(model.config, B, T, model.attention)})
        model.views[(B, T)] = views
    return model.views[(B, T)]


def upload_parameters(model, params):
    """Set the model's parameters from a flat fp32 host array (a checkpoint, or gpt2_cpu's init):
    the master weights get it exactly; bf16 parameters get it rounded to nearest even (the same
    rounding as cast_float_to_floatX, done on the host to need no fp32 copy on the device). With
    ZeRO-1 the master weights get this rank's shard of it (model.shard; the padding 0)."""
    params = np.ascontiguousarray(params, dtype=np.float32)
    if params.size != model.num_parameters:
        raise InputError(f"{params.size} parameters do not fit a model of {model.num_parameters}")
    if model.master is not None:
        padded = np.zeros(model.shard.padded, dtype=np.float32)
        padded[:params.size] = params
        model.master.set(padded[model.shard.offset:model.shard.offset + model.shard.size])
    model.params.set(float32_to_bfloat16_bits(params) if model.precision == "bf16" else params)


def download_parameters(model, master=True):
    """The parameters as a flat fp32 host array: the master weights when there are some, `master`,
    and this rank holds all of them (not a ZeRO-1 shard of several), else the floatX parameters
    upcast (exact). Checkpoints use the former; --check the latter (the values the kernels
    actually compute with)."""
    if master and model.master is not None and model.shard.num_processes == 1:
        return model.master.get()
    return as_float32(model.params.get())


def as_float32(host):
    """A host array of floatX (uint16 bf16 bits or float32) as float32."""
    return bfloat16_bits_to_float32(host) if host.dtype == np.uint16 else np.asarray(host, dtype=np.float32)


def gpt2_forward(model, inputs, targets=None):
    """Forward pass, gpt2_cpu.gpt2_forward's: inputs (B,T) int token ids (host numpy); targets (B,T)
    or None. Returns the logits (B,T,Vp) floatX on the device (a view into the `logits` buffer:
    valid until the next forward or backward, which overwrites it with dlogits). With targets, the
    per-position losses (B,T) fp32 are computed too (gpt2_mean_loss reads their mean), the
    classifier taking model.classifier_chunk sequences at a time: with several chunks the buffer
    keeps the last chunk's logits only (rows classifier_chunks(...)[-1]) and None is returned.
    (The sampler's forward, with a KV cache, is gpt2_forward_cached.)
    Raises InputError if T passes maxT or a token id is out of range."""
    B, T = upload_batch(model, inputs, targets)
    return forward_launches(model, B, T, targets is not None)


def upload_batch(model, inputs, targets, pos=0):
    """The host half of gpt2_forward and gpt2_micro_batch: check the token ids (at positions
    pos..pos+T-1, gpt2_cpu.check_inputs), copy them (and the targets) into the device buffers of
    their (B,T), and remember them for the backward. Returns (B,T)."""
    inputs = np.asarray(inputs)
    B, T = inputs.shape
    check_inputs(model.config, inputs, targets, pos)
    A = gpt2_activations(model, B, T)
    copies = [(A["inputs"], np.ascontiguousarray(inputs, dtype=np.int32))]
    if targets is not None:
        copies.append((A["targets"], np.ascontiguousarray(targets, dtype=np.int32)))
        model.host_inputs = inputs                    # gpt2_backward sorts them for the encoder's backward
    model.staging["batch"].upload(copies)             # pinned host memory, asynchronous copies
    model.BT, model.has_targets = (B, T), targets is not None
    return B, T


def forward_launches(model, B, T, with_loss, classifier=True):
    """The device half of gpt2_forward: every launch of the forward pass, reading the token ids
    (and targets) upload_batch put on the device. Launches only: no host work, no synchronization,
    the same arguments every call for a given (B,T), so that a CUDA graph can capture it
    (gpt2_micro_batch). Returns the logits view (B,T,Vp); with_loss: the losses too, the classifier
    in chunks of sequences (classifier_chunks), and the logits only when one chunk held them all
    (else None); classifier False (the training step, whose backward runs the classifier): up to
    lnf only, and None."""
    cfg = model.config
    C, L, Vp = cfg.channels, cfg.num_layers, cfg.padded_vocab_size
    P, A = model.P, gpt2_activations(model, B, T)
    attention = model.attention
    encoder_forward(A["encoded"], A["inputs"], P["wte"], P["wpe"], B, T, C)       # (B,T,C)
    # layer 0's ln1: every later LayerNorm is fused into the residual addition before it (block_forward)
    layernorm_forward(layer_activation(A, "ln1", 0, model.recompute), A["ln1_mean"][0], A["ln1_rstd"][0],
                      A["encoded"], P["ln1w"][0], P["ln1b"][0], B, T, C)
    for l in range(L):
        block_forward(model, A, l, B, T, attention)
    # forward pass 3: classifier tied to wte (lnf was written by the last block's fused residual), loss
    if not classifier:
        return None
    if with_loss:
        chunks = classifier_chunks(B, T, model.classifier_chunk)
        for r0, r1 in chunks:
            logits = classifier_launches(model, A, B, T, r0, r1)                   # losses[r0:r1]
        return logits.reshape(B, T, Vp) if len(chunks) == 1 else None
    require(A["logits"].size >= B * T * Vp, f"the logits of {B} sequences do not fit: --classifier-chunk "
                                            f"{model.classifier_chunk} keeps {model.classifier_chunk} at a time")
    logits = prefix(A["logits"], (B, T, Vp))
    model.matmul.forward(logits, A["lnf"], P["wte"], None, B, T, C, Vp)           # (B,T,C) @ (C,Vp) -> (B,T,Vp)
    return logits


def classifier_chunks(B, T, chunk):
    """The row ranges (r0, r1) of the B*T positions the classifier takes at a time: `chunk`
    sequences (chunk*T rows) each, the last one possibly fewer; all B*T at once for chunk 0 or >= B."""
    rows = B * T if chunk <= 0 or chunk >= B else chunk * T
    return [(r0, min(r0 + rows, B * T)) for r0 in range(0, B * T, rows)]


def classifier_launches(model, A, B, T, r0, r1, dloss=None):
    """Forward pass 3 on the rows r0..r1 of the (B,T) positions, and with dloss (d mean(loss) /
    d losses) its backward: logits (R,Vp) = lnf[r0:r1] @ wte^T in the first R = r1-r0 rows of the
    `logits` buffer, then the fused classifier's losses[r0:r1]; with dloss it overwrites those logits
    with dlogits, and dlnf[r0:r1] = dlogits @ wte, dwte += dlogits^T @ lnf[r0:r1]. So only R rows
    of (Vp,) logits ever exist. Returns the logits (or dlogits) view (R,Vp)."""
    cfg, P, G, mm = model.config, model.P, model.G, model.matmul
    C, V, Vp = cfg.channels, cfg.vocab_size, cfg.padded_vocab_size
    R = r1 - r0
    lnf = A["lnf"].reshape(B * T, C)[r0:r1]                                          # (R,C)
    logits = prefix(A["logits"], (R, Vp))
    mm.forward(logits, lnf, P["wte"], None, 1, R, C, Vp)                             # (R,C) @ (C,Vp) -> (R,Vp)
    losses, targets = A["losses"].reshape(-1)[r0:r1], A["targets"].reshape(-1)[r0:r1]
    fused_classifier(logits, losses, targets, 0.0 if dloss is None else dloss, 1, R, V, Vp,
                     write_dlogits=dloss is not None)
    if dloss is not None:                                                           # logits now hold dlogits
        dlnf = A["dlnf"].reshape(B * T, C)[r0:r1]
        mm.backward(dlnf, G["wte"], None, logits, lnf, P["wte"], model.partial, 1, R, C, Vp)
    return logits


def block_forward(model, A, l, B, T, attention):
    """Transformer block l, gpt2_cpu.block_forward's launches, on the activations A of (B,T): from
    its input (encoded, or block l-1's residual3) and ln1, the LayerNorm of it, already written
    (by forward_launches, or block l-1), to residual3[l] and the next LayerNorm: block l+1's ln1
    or the final lnf. attention: model.attention, or the sampler's CachedAttention."""
    cfg, P, mm = model.config, model.P, model.matmul
    C, L, NH = cfg.channels, cfg.num_layers, cfg.num_heads
    p = layer_params(P, l)

    def layer(name, k):                    # layer k's buffer, or the one layer's where the backward recomputes it
        return layer_activation(A, name, k, model.recompute)

    residual = A["encoded"] if l == 0 else A["residual3"][l - 1]                   # (B,T,C)
    ln1, ln2, fch_gelu = layer("ln1", l), layer("ln2", l), layer("fch_gelu", l)
    # forward pass 1: attention block
    qkv = attention.qkv(A, l, B, T, C)                                             # (B,T,3C)
    mm.forward(qkv, ln1, p["qkvw"], p["qkvb"], B, T, C, 3 * C)
    attention.forward(A, l, B, T, C, NH, mm.tf32)                                  # atty[l] (B,T,C)
    # residual2 = residual + atty @ attprojw^T + attprojb, and ln2 = layernorm(residual2)
    residual_projection_forward(mm, A["residual2"][l], ln2, A["ln2_mean"][l], A["ln2_rstd"][l], residual, A["atty"][l],
                                p["attprojw"], p["attprojb"], p["ln2w"], p["ln2b"], A["attproj"], B, T, C, C)
    # forward pass 2: MLP block
    mm.forward(fch_gelu, ln2, p["fcw"], p["fcb"], B, T, C, 4 * C, pre_gelu=A["fch"][l])   # (B,T,4C)
    # residual3 = residual2 + fch_gelu @ fcprojw^T + fcprojb, and the next LayerNorm: layer l+1's ln1, or lnf
    if l + 1 < L:
        norm = (layer("ln1", l + 1), A["ln1_mean"][l + 1], A["ln1_rstd"][l + 1], P["ln1w"][l + 1], P["ln1b"][l + 1])
    else:
        norm = (A["lnf"], A["lnf_mean"], A["lnf_rstd"], P["lnfw"], P["lnfb"])
    residual_projection_forward(mm, A["residual3"][l], norm[0], norm[1], norm[2], A["residual2"][l], fch_gelu,
                                p["fcprojw"], p["fcprojb"], norm[3], norm[4], A["fcproj"], B, T, 4 * C, C)


def residual_projection_forward(mm, residual_out, normed, mean, rstd, residual_in, inp, weight, bias, ln_weight,
                                ln_bias, scratch, B, T, IC, C):
    """An output projection adding into the residual stream, and the LayerNorm after it:
    residual_out (B,T,C) = residual_in + inp (B,T,IC) @ weight^T + bias (weight (C,IC)), then normed,
    mean, rstd = layernorm(residual_out). Two launches either way. With the backend's
    residual_epilogue (cuBLASLt) the product adds the bias and the residual itself (cuBLASLt's C input,
    beta = 1) and layernorm_forward only normalizes; else the bias-free product goes to scratch (B,T,C)
    and fused_residual_forward adds residual_in, it and the bias and normalizes in one pass."""
    if mm.residual_epilogue:
        mm.forward(residual_out, inp, weight, bias, B, T, IC, C, residual=residual_in)
        layernorm_forward(normed, mean, rstd, residual_out, ln_weight, ln_bias, B, T, C)
    else:
        mm.forward(scratch, inp, weight, None, B, T, IC, C)
        fused_residual_forward(residual_out, normed, mean, rstd, residual_in, scratch, bias, ln_weight, ln_bias, B * T, C)


def gpt2_mean_loss(model):
    """Mean of the last forward's per-position losses, as a Python float (a device sync)."""
    A = gpt2_activations(model, *model.BT)
    return float(A["losses"].sum(dtype=np.float64)) / A["losses"].size


def gpt2_zero_grad(model):
    """Set every parameter gradient to 0 (before the first micro-batch of a step)."""
    model.grads.fill(0)                    # 0 bits are +0.0 in bf16 as in fp32


def gpt2_backward(model, loss_scale=1.0):
    """Backward pass of the last gpt2_forward (which must have had targets): accumulates the
    gradient of loss_scale * mean(losses) into model.grads (loss_scale = 1/n over n micro-batches).
    Its fused classifier writes the losses again (the same values) together with dlogits: the
    forward's pass left the logits intact for whoever called gpt2_forward (--check, tests); the
    training step, gpt2_micro_batch, runs the classifier only here."""
    if not model.has_targets:
        raise RuntimeError("gpt2_backward needs a forward pass with targets")
    backward_launches(model, loss_scale, *upload_segments(model, padded=False))


def upload_segments(model, padded):
    """Sort the last forward's token ids into the dwte scatter-add's chunks (WteSegments, a host
    sort) and copy them to the device. Done at the backward rather than the forward: only a
    backward needs them (validation does not), and the GPU is still busy with the forward the
    host launched asynchronously, so the sort overlaps it. Returns (num_chunks, num_reduce), the
    counts the kernels are launched over. padded: fill all B*T chunk slots and all
    wte_reduce_max(B*T) token slots, those past the real ones empty, so that the launches always
    have the same arguments, as a CUDA graph needs; empty chunks and tokens change nothing."""
    A = gpt2_activations(model, *model.BT)
    seg, K, M = wte_segments(model.host_inputs, padded)
    model.staging["segments"].upload([(A[name][:getattr(seg, name).size], getattr(seg, name)) for name in seg._fields])
    return K, M


def wte_segments(inputs, padded):
    """The host half of upload_segments (llama3_cuda's too): inputs (B,T) token ids -> (WteSegments,
    num_chunks, num_reduce) of encoder_backward_segments; padded: every array filled up to its
    fixed length (N = B*T chunk slots, wte_reduce_max(N) token slots) with empty chunks and tokens,
    and the counts those fixed lengths."""
    N = inputs.size
    seg = encoder_backward_segments(inputs)
    if not padded:
        return seg, seg.chunk_token.size, seg.reduce_token.size
    R = wte_reduce_max(N)                  # an empty chunk starts where the last one ends
    seg = seg._replace(chunk_start=padded_to(seg.chunk_start, N + 1, N), chunk_token=padded_to(seg.chunk_token, N, -1),
                       chunk_slot=padded_to(seg.chunk_slot, N, -1),
                       reduce_start=padded_to(seg.reduce_start, R + 1, seg.reduce_start[-1]),
                       reduce_token=padded_to(seg.reduce_token, R, -1))
    return seg, N, R


def padded_to(values, length, fill):
    """The int32 array `values` followed by `fill` up to `length` entries."""
    return np.concatenate([values, np.full(length - values.size, fill, dtype=np.int32)])


def backward_launches(model, loss_scale, num_chunks, num_reduce, grads_zero=False):
    """The device half of gpt2_backward: every launch of the backward pass of the (B,T) forward,
    the dwte scatter-add's chunks already on the device (upload_segments' counts). Launches only,
    with the same arguments every call for given (B,T), loss_scale and counts: graph-capturable.
    grads_zero: model.grads hold 0 (the step's first micro-batch, just zeroed), so a backend that
    can write a bias gradient instead of adding it may (cuBLASLt's BGRADB epilogue): the same bits."""
    cfg = model.config
    B, T = model.BT
    C, L, NH = cfg.channels, cfg.num_layers, cfg.num_heads
    P, G, A = model.P, model.G, gpt2_activations(model, B, T)
    partial, mm = model.partial, model.matmul
    recomputed = recomputed_activations(model.recompute)

    def layer(name, l):                    # as in block_forward
        return layer_activation(A, name, l, model.recompute)

    # backward pass 3: the classifier's forward (the training step's forward skips it), then
    # cross-entropy and softmax in one kernel, which writes the losses and, over the logits in
    # place, dlogits (llm.c runs it at the end of the forward instead), and the classifier's
    # backward, chunk by chunk of sequences (classifier_chunks): dlnf row by row, dwte accumulated
    dloss = loss_scale / (B * T)                                                    # d(mean loss)/d(losses)
    for r0, r1 in classifier_chunks(B, T, model.classifier_chunk):
        classifier_launches(model, A, B, T, r0, r1, dloss)
    dlnf = A["dlnf"]
    dresidual = A["dresidual"]                                                      # gradient of the residual stream
    dresidual.fill(0)                                                               # layernorm_backward accumulates
    # --ln-bias-grad 1: each LayerNorm backward completes the gradient of a residual stream whose last
    # term was a projection's output, x + proj(y) + proj_bias, so it also sums that bias's gradient,
    # the column sums of dresidual (projection_dbias), and the projection's backward skips it
    layernorm_backward(dresidual, G["lnfw"], G["lnfb"], partial, dlnf, A["residual3"][L - 1], P["lnfw"],
                       A["lnf_mean"], A["lnf_rstd"], B, T, C,
                       dprojb=projection_dbias(model, G["lnfw"], layer_params(G, L - 1)["fcprojb"]))
    for l in reversed(range(L)):
        p, g = layer_params(P, l), layer_params(G, l)
        # the LayerNorm after this block (lnf, or the next block's ln1) summed the fcproj's bias gradient
        next_ln_dweight = G["lnfw"] if l == L - 1 else layer_params(G, l + 1)["ln1w"]
        fcproj_dbias = None if projection_dbias(model, next_ln_dweight, g["fcprojb"]) is not None else g["fcprojb"]
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
        ln1, ln2, fch_gelu = layer("ln1", l), layer("ln2", l), layer("fch_gelu", l)
        # -r 1, 2: the forward's `mm.forward(fch_gelu, ln2, p["fcw"], p["fcb"], ..., pre_gelu=A["fch"][l])`
        # kept fch; fch_gelu = gelu(fch), again
        if "fch_gelu" in recomputed:
            gelu_forward(fch_gelu, A["fch"][l], B * T * 4 * C)
        # -r 2: the forward's `fused_residual_forward(A["residual2"][l], ln2, A["ln2_mean"][l], ...)`
        # kept residual2; ln2 = layernorm(residual2), again: the same layernorm_row on the same rounded
        # input, so bit for bit the forward's ln2 (mean and rstd are written again, the same values)
        if "ln2" in recomputed:
            layernorm_forward(ln2, A["ln2_mean"][l], A["ln2_rstd"][l], A["residual2"][l], p["ln2w"], p["ln2b"], B, T, C)
        # backward pass 2: MLP block. residual3 = residual2 + fcproj: dfcproj = dresidual, and
        # dresidual flows on unchanged into residual2, where LayerNorm 2 adds its part. (With the
        # residual in the projection's epilogue, D = A.B + bias + C, dC = dD the same way: the
        # residual's gradient is accumulated only where it is produced, by layernorm_backward)
        # (--bias-grad-epilogue 2: the fc's bias gradient, the column sums of dfch, is summed by the
        # fcproj's input-gradient product itself, cuBLASLt's DGELU_BGRAD, and the fc's backward skips it)
        dfch = A["dfch"]
        fc_dbias_by_fcproj = mm.pre_gelu_bias_grad and g["fcb"] is not None
        mm.backward(dfch, g["fcprojw"], fcproj_dbias, dresidual, fch_gelu, p["fcprojw"], partial, B, T, 4 * C, C,
                    pre_gelu=A["fch"][l], pre_gelu_dbias=g["fcb"] if fc_dbias_by_fcproj else None,
                    bias_grads_zero=grads_zero)                                                       # dfch
        dln2 = A["dln2"]
        mm.backward(dln2, g["fcw"], None if fc_dbias_by_fcproj else g["fcb"], dfch, ln2, p["fcw"], partial, B, T, C,
                    4 * C, bias_grads_zero=grads_zero)
        attproj_dbias_by_ln = projection_dbias(model, g["ln2w"], g["attprojb"])
        layernorm_backward(dresidual, g["ln2w"], g["ln2b"], partial, dln2, A["residual2"][l], p["ln2w"],
                           A["ln2_mean"][l], A["ln2_rstd"][l], B, T, C, dprojb=attproj_dbias_by_ln)
        # backward pass 1: attention block. residual2 = residual + attproj: dattproj = dresidual
        datty = A["datty"]
        mm.backward(datty, g["attprojw"], None if attproj_dbias_by_ln is not None else g["attprojb"], dresidual,
                    A["atty"][l], p["attprojw"], partial, B, T, C, C, bias_grads_zero=grads_zero)
        dqkv = A["dqkv"]
        model.attention.backward(dqkv, datty, A, l, B, T, C, NH, mm.tf32)
        # -r 2: the forward's `layernorm_forward(ln1, ...)` (layer 0, from encoded) or the previous layer's
        # `fused_residual_forward(A["residual3"][l - 1], ln1, ...)` kept the residual; ln1 = layernorm(residual),
        # again, bit for bit as ln2 above
        if "ln1" in recomputed:
            layernorm_forward(ln1, A["ln1_mean"][l], A["ln1_rstd"][l], residual, p["ln1w"], p["ln1b"], B, T, C)
        dln1 = A["dln1"]                                                            # datty was consumed above
        mm.backward(dln1, g["qkvw"], g["qkvb"], dqkv, ln1, p["qkvw"], partial, B, T, C, 3 * C,
                    bias_grads_zero=grads_zero)
        layernorm_backward(dresidual, g["ln1w"], g["ln1b"], partial, dln1, residual, p["ln1w"],
                           A["ln1_mean"][l], A["ln1_rstd"][l], B, T, C,        # the previous block's fcproj bias
                           dprojb=projection_dbias(model, g["ln1w"], layer_params(G, l - 1)["fcprojb"]) if l else None)
    # backward of the encoder: encoded = wte[inputs] + wpe
    K, M = num_chunks, num_reduce
    encoder_backward(G["wte"], G["wpe"], A["wte_partial"], dresidual, A["positions"], A["chunk_start"][:K + 1],
                     A["chunk_token"][:K], A["chunk_slot"][:K], A["reduce_start"][:M + 1], A["reduce_token"][:M], K, M,
                     B, T, C)


def projection_dbias(model, ln_dweight, dprojb):
    """--ln-bias-grad: dprojb (C,) floatX (a view of model.grads: the gradient of a projection's
    bias), for the LayerNorm backward after the projection (whose own dweight (C,) is ln_dweight)
    to sum, or None, where the projection's backward sums it: without the option, or where the
    LayerNorm or the bias is frozen (LoRA: their views None). Raises nothing. Why the LayerNorm
    can sum it (d proj_bias = the column sums of the residual stream's gradient): doc/layernorm.md."""
    return dprojb if model.ln_bias_grad and ln_dweight is not None and dprojb is not None else None


class StepUpdate(NamedTuple):
    """The end of a training step that its last micro-batch runs on the device (step_tail_launches):
    AdamW's hyperparameters that stay the same every step, the gradient clipping threshold
    (grad_clip, 0: none) and the names of the decayed tensors. What changes every step (the learning
    rate, the bias corrections, the seeds) adamw_prepare uploads before the micro-batches."""
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip: float
    decayed: tuple = DECAYED_PARAMETERS


def micro_batch_launches(model, B, T, loss_scale, num_chunks, num_reduce, first=False, update=None, nccl=None):
    """The device work of one micro-batch, launches only (graph-capturable): with `first` (the
    step's first micro-batch) the gradients and loss_accum set to 0; the forward without the
    classifier, the backward (whose fused classifier writes the losses and dlogits in one pass),
    and the losses added into loss_accum; with `update` (a StepUpdate: the step's last micro-batch)
    the rest of the step: step_tail_launches."""
    A = gpt2_activations(model, B, T)
    if first:
        gpt2_zero_grad(model)
        A["loss_accum"].fill(0)
    forward_launches(model, B, T, with_loss=False, classifier=False)
    backward_launches(model, loss_scale, num_chunks, num_reduce, grads_zero=first)
    cuda.cupy().add(A["loss_accum"], A["losses"], out=A["loss_accum"])
    if update is not None:
        step_tail_launches(model, update, nccl)


def step_tail_launches(model, update, nccl=None):
    """The end of a training step after its last backward, launches only (graph-capturable): the
    gradients averaged over the ranks (nccl, data parallel without ZeRO-1's shards), their norm and
    clipping factor (global_norm: model.norm = [norm, factor]), and AdamW scaling the gradient by
    that factor, with the per-step values adamw_prepare uploaded. No value comes back to the host:
    the step's loss and norm are read after it (StepReadback)."""
    if nccl is not None:
        gpt2_average_gradients(model, nccl)
    global_norm_launches(model, update.grad_clip)
    adamw_launches(model, model.update.tables[tuple(update.decayed)], update.beta1, update.beta2, update.eps,
                   update.weight_decay, nccl)


def capture_graph(stream, launches):
    """Library call: a CUDA graph of the work `launches()` puts on `stream` (captured, not run).
    An error inside the capture propagates as itself: the capture is ended (its graph, invalid
    after the error, dropped) without letting end_capture's own complaint replace it."""
    stream.begin_capture()
    try:
        launches()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:                  # "capture invalidated": a consequence of the error above
            pass
        raise
    return stream.end_capture()


def gpt2_micro_batch(model, inputs, targets, loss_scale, cuda_graph=False, first=False, update=None, nccl=None):
    """One micro-batch of a training step: the forward with targets, the backward accumulating
    the gradient of loss_scale * mean(losses) into model.grads, and the losses added into
    loss_accum on the device; the fused classifier runs once, in the backward. first: the step's
    first micro-batch, which sets the gradients and loss_accum to 0 first; update (a StepUpdate):
    the step's last, which then runs the rest of the step on the device (the norm, the clipping
    factor, AdamW: step_tail_launches; adamw_prepare must have uploaded the step's values). With
    one micro-batch per step and both, the whole step is one CUDA graph.
    With cuda_graph, the launches are captured into a CUDA graph per ((B,T), loss_scale, first,
    update) and replayed as one launch: the host stops being the bottleneck. The first
    micro-batch of each key runs eagerly (PyTorch's graph warm-up): first-time work (cuBLAS's
    workspace on the stream, cuBLASLt's heuristics, cuDNN's plans, CuPy's memory pool, AdamW's
    table) happens then, not inside the capture, which follows it (a capture records, it runs
    nothing). The host part (the token ids, targets and the encoder's padded chunks, copied to
    their fixed device buffers) runs outside the graph. Both paths give bitwise the same results:
    the same kernels with the same arguments in the same order (the padding chunks do nothing)."""
    cp = cuda.cupy()
    B, T = upload_batch(model, inputs, targets)
    if not cuda_graph:
        micro_batch_launches(model, B, T, loss_scale, *upload_segments(model, padded=False), first, update, nccl)
        return
    counts = upload_segments(model, padded=True)
    stream = cp.cuda.get_current_stream()         # a created stream: the legacy one cannot capture
    key = (B, T, loss_scale, first, update)
    if key in model.graphs:
        model.graphs[key].launch(stream)
        return
    micro_batch_launches(model, B, T, loss_scale, *counts, first, update, nccl)     # the warm-up, eagerly
    model.graphs[key] = capture_graph(stream, lambda: micro_batch_launches(model, B, T, loss_scale, *counts, first,
                                                                           update, nccl))


class StepReadback:
    """What the host logs of a training step that ran wholly on the device (its loss and gradient
    norm), copied at the step's end into page-locked host memory without waiting: the
    per-position losses summed over the micro-batches (loss_accum, N floats) and model.norm. The
    host reads them a step later (llm.c, too, reads its loss back once the step is done), while the
    GPU runs the next step. Two slots used in turn: a step's copies never overwrite the slot whose
    values the host has not read yet (it reads step s-1's before it queues step s+1)."""

    def __init__(self, N):
        cp = cuda.cupy()

        def pinned(n):
            return np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n), np.float32, n)
        self.slots = [(pinned(N), pinned(NORM_VALUES)) for _ in range(2)]
        self.turn = 0

    def queue(self, loss_accum, norm):
        """Queue the copies of loss_accum (B,T) fp32 and norm (NORM_VALUES,) on the current stream,
        after the step's work; returns (slot, the event after them) for read."""
        cp = cuda.cupy()
        stream = cp.cuda.get_current_stream()
        i, self.turn = self.turn, 1 - self.turn
        losses, norms = self.slots[i]
        loss_accum.get(stream=stream, out=losses[:loss_accum.size].reshape(loss_accum.shape), blocking=False)
        norm.get(stream=stream, out=norms, blocking=False)
        return i, stream.record()

    def read(self, slot, done, N):
        """(sum of the N losses in float64, the norm) of the step whose copies `done` follows (waits for it)."""
        done.synchronize()
        losses, norms = self.slots[slot]
        return float(losses[:N].sum(dtype=np.float64)), float(norms[0])


def gpt2_grad_norm(model, grad_clip=0.0):
    """Global L2 norm of all parameter gradients, as a Python float (a device sync). The clipping
    factor for grad_clip (global_norm) stays on the device, in model.norm[1], for gpt2_update."""
    global_norm_launches(model, grad_clip)
    return float(model.norm.get()[0])


def global_norm_launches(model, grad_clip):
    """The device half of gpt2_grad_norm (launches only, graph-capturable): model.norm = [the
    gradient norm, its clipping factor for grad_clip]."""
    global_norm(model.norm, model.norm_partial, model.grads, model.num_parameters, grad_clip)


# ----------------------------------------------------------------------------
# AdamW

class UpdateBuffers:
    """AdamW's values that change every step, kept on the device for adamw_update, so that its
    launch has the same arguments every step (a CUDA graph of the whole step replays it): scalars
    (ADAMW_STEP_SCALARS,) fp32, the learning rate and the two bias corrections; seeds (K,) uint32,
    one stochastic-rounding seed per tensor piece. tables: decayed names -> (device table of
    adamw_table, its number of blocks), uploaded at first use; staging: the pinned host side of
    the per-step upload (adamw_prepare)."""

    def __init__(self, param_shapes):
        cp = cuda.cupy()
        self.scalars = cp.zeros(ADAMW_STEP_SCALARS, dtype=np.float32)
        self.seeds = cp.zeros(len(param_shapes), dtype=np.uint32)
        self.tables = {}
        self.staging = PinnedStaging()


def adamw_table(pieces, decayed, precision, block_size=ADAMW_BLOCK_SIZE):
    """kernels/adamw.cu's table of the tensor pieces (llmc.zero.ShardPiece, in parameter order):
    int64 (K, ADAMW_TENSOR_FIELDS), per piece its offset in params and grads, its offset in m, v
    and the master weights, its size n, its first block (each block updates block_size 16-byte
    vectors of one piece: ceil(n / (block_size * vector)) blocks) and 1 if it is in `decayed`
    (weight decay applies) else 0. Returns (table, total blocks)."""
    rows, first = [], 0
    per_block = block_size * vector_size(precision)
    for piece in pieces:
        n = piece.flat.stop - piece.flat.start
        rows.append((piece.flat.start, piece.local.start, n, first, int(piece.name in decayed)))
        first += ceil_div(n, per_block)
    return np.array(rows, dtype=np.int64).reshape(-1, ADAMW_TENSOR_FIELDS), first


def adamw_update(params, master_params, grads, m, v, tensors, num_blocks, seeds, step_scalars, grad_scale, beta1,
                 beta2, eps, weight_decay):
    """One AdamW step (see gpt2_cpu.gpt2_update for the math) over every tensor piece of the table
    `tensors` (int64 (K, ADAMW_TENSOR_FIELDS), adamw_table's, made for ADAMW_BLOCK_SIZE, num_blocks
    its total) in one launch. params, grads floatX (the whole flat buffers the table's offsets
    index); master_params fp32 or None; m, v fp32 (this rank's shard); seeds (K,) uint32 one
    stochastic-rounding seed per piece; step_scalars (ADAMW_STEP_SCALARS,) fp32 = learning rate,
    beta1 and beta2 bias corrections; grad_scale (1,) fp32, the factor the gradient is scaled by:
    every per-step value on the device, so the launch is graph-capturable. In bf16 the new value
    is stochastically rounded with bits hashed from (index in its piece, the piece's seed)."""
    K = tensors.shape[0]
    master = [("master_params", master_params, master_params.size)] if master_params is not None else []
    precision = check_launch("adamw_update", [("params", params, params.size), ("grads", grads, params.size)],
                             float32=[("m", m, m.size), ("v", v, m.size), ("step_scalars", step_scalars,
                                      ADAMW_STEP_SCALARS), ("grad_scale", grad_scale, 1)] + master)
    require(tensors.dtype == np.int64 and tensors.shape == (K, ADAMW_TENSOR_FIELDS) and seeds.dtype == np.uint32
            and seeds.size >= K, f"adamw_update: a table of (K, {ADAMW_TENSOR_FIELDS}) int64 and K uint32 seeds")
    null = np.uint64(0)                    # a NULL float*: 8 zero bytes in the argument buffer
    cuda.launch("adamw", precision, "adamw_update", max(1, num_blocks), ADAMW_BLOCK_SIZE,
                (params, null if master_params is None else master_params, grads, m, v, tensors, np.int32(K),
                 np.int64(num_blocks), seeds, step_scalars, grad_scale, np.float32(beta1), np.float32(beta2),
                 np.float32(eps), np.float32(weight_decay)))


def adamw_update_tensor(params, master_params, grads, m, v, n, learning_rate, beta1, beta2, beta1_correction,
                        beta2_correction, eps, weight_decay, grad_scale, seed):
    """adamw_update on one tensor of n values with the step's values given on the host (uploaded
    first, with a one-row table: not graph-capturable). params, grads floatX; master_params fp32
    or None; m, v fp32; seed: the stochastic rounding's (pass a different one per tensor and step)."""
    cp = cuda.cupy()
    precision = cuda.precision_of(params)
    piece = ShardPiece("tensor", slice(0, n), slice(0, n), 0)
    table, num_blocks = adamw_table([piece], (piece.name,), precision)          # weight_decay as given
    adamw_update(params, master_params, grads, m, v, cp.asarray(table), num_blocks,
                 cp.asarray(np.array([seed], dtype=np.uint32)),
                 cp.asarray(np.array([learning_rate, beta1_correction, beta2_correction], dtype=np.float32)),
                 cp.asarray(np.array([grad_scale], dtype=np.float32)), beta1, beta2, eps, weight_decay)


def adamw_prepare(model, learning_rate, beta1, beta2, t, decayed=DECAYED_PARAMETERS, grad_scale=None):
    """The host half of an AdamW step, before its launch (outside any CUDA graph): draw each
    tensor's stochastic-rounding seed from model.update_rng (on every rank, for every tensor, so
    all ranks and an unsharded run draw the same; a piece starting inside its tensor gets
    llmc.zero.rounding_seed's shifted seed) and upload them with the learning rate and the bias
    corrections of step t (1-based) into model.update, and grad_scale (a float) into model.norm[1]
    when given (None: the clipping factor global_norm computed on the device stays). The table of
    `decayed` (adamw_table over this rank's pieces) is made and uploaded at its first use.
    Returns (table, blocks) for adamw_launches."""
    buffers = model.update
    pieces = shard_slices(model.param_shapes, model.shard)
    key = tuple(decayed)
    if key not in buffers.tables:
        table, num_blocks = adamw_table(pieces, decayed, model.precision)
        buffers.tables[key] = (cuda.cupy().asarray(table), num_blocks)
    starts = {piece.name: piece.start for piece in pieces}
    seeds = []
    for name, _ in model.param_shapes:
        seed = model.update_rng.random_u32()
        if name in starts:                                     # else the tensor lies in other ranks' shards
            seeds.append(rounding_seed(seed, starts[name]))
    model.rng_state_last_update = model.update_rng.state
    scalars = np.array([learning_rate, 1.0 - beta1 ** t, 1.0 - beta2 ** t], dtype=np.float32)
    copies = [(buffers.scalars, scalars), (buffers.seeds[:len(seeds)], np.array(seeds, dtype=np.uint32))]
    if grad_scale is not None:
        copies.append((model.norm[NORM_CLIP_SCALE:NORM_CLIP_SCALE + 1], np.array([grad_scale], dtype=np.float32)))
    buffers.staging.upload(copies)
    return buffers.tables[key]


def adamw_launches(model, table, beta1, beta2, eps, weight_decay, nccl=None):
    """The device half of an AdamW step (launches only, graph-capturable): adamw_update over the
    table's pieces (from adamw_prepare) with the values adamw_prepare uploaded and the gradient
    scale in model.norm[1]; with ZeRO-1 over several ranks, nccl (llmc.comm.NcclComm) then
    all-gathers the updated shards into every rank's params."""
    tensors, num_blocks = table
    adamw_update(model.params_memory, model.master, model.grads_memory, model.m, model.v, tensors, num_blocks,
                 model.update.seeds, model.update.scalars, model.norm[NORM_CLIP_SCALE:], beta1, beta2, eps,
                 weight_decay)
    if nccl is not None and model.shard.num_processes > 1:
        nccl.all_gather_(model.params_memory)                  # (padded,): every rank's shard to every rank


def gpt2_update(model, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale=1.0, nccl=None,
                decayed=DECAYED_PARAMETERS):
    """One AdamW step (the math of gpt2_cpu.gpt2_update; t is the 1-based step count) in one
    launch over every parameter tensor, weight decay on the tensors named in `decayed` only
    (GPT-2's DECAYED_PARAMETERS; llama3_cuda.llama3_update passes Llama 3's), each tensor over its
    piece in this rank's shard (model.shard, shard_slices: the whole tensor without ZeRO-1), each
    with its own stochastic-rounding seed (adamw_prepare). grad_scale: the gradient's factor, a
    float, or None for the clipping factor the last global_norm computed on the device. With
    ZeRO-1 over several ranks, nccl (llmc.comm.NcclComm) then all-gathers the updated shards."""
    table = adamw_prepare(model, learning_rate, beta1, beta2, t, decayed, grad_scale)
    adamw_launches(model, table, beta1, beta2, eps, weight_decay, nccl)


def gpt2_average_gradients(model, nccl):
    """Data parallelism: average the gradients over the ranks of nccl (llmc.comm.NcclComm). Without
    ZeRO-1, all of them (all-reduce); with it, only this rank's shard receives the mean
    (reduce-scatter: half the traffic), the rest of model.grads is stale until the next step."""
    if model.shard.num_processes > 1:
        nccl.reduce_scatter_mean_(model.grads_memory)          # (padded,) -> the mean of this rank's shard
    else:
        nccl.mean_(model.grads)


def gpt2_global_grad_norm(model, comm, grad_clip=0.0):
    """The L2 norm of the whole averaged gradient, a Python float, the same on every rank. Without
    ZeRO-1 (or on one rank) gpt2_grad_norm (its clipping factor for grad_clip left on the device for
    gpt2_update). With it, each rank holds only its shard's mean, so:
    the squared norm of the shard's real elements (global_norm's kernels on grads[o:min(o+S, n)],
    never the padding, which the reduce-scatter does not promise to leave 0), summed over the
    ranks on the host (comm.sum, an MPI all-reduce of one float64), then the root. The squares of
    the shards' fp32 norms carry ~1e-7 relative error: the result agrees with the unsharded norm
    to that, not bit for bit (the kernel's sum order differs anyway)."""
    if model.shard.num_processes == 1:
        return gpt2_grad_norm(model, grad_clip)
    shard = model.shard
    grads = model.grads[shard.offset:shard.offset + shard.size]           # (n,) view: stops at n
    global_norm(model.norm, model.norm_partial, grads, grads.size)
    shard_norm = float(model.norm.get()[0])                   # a device sync, as gpt2_grad_norm
    return math.sqrt(comm.sum(shard_norm * shard_norm))


# ----------------------------------------------------------------------------
# sampler: gpt2_cpu.generate (the same SamplerRNG and draws) with forward passes on the GPU
#
# gpt2_cpu.generate draws each token from one row of logits, computed by the SamplingForward it
# is given: given forwards that run this model, the CUDA trainer samples exactly as the CPU one.
# Two forwards, as in gpt2_cpu: `full`, gpt2_forward on a fixed window of min(maxT, len(prompt) +
# new tokens) tokens (train() allocates its (1, window) activations up front), and `cached`,
# gpt2_forward_cached with a KV cache, which runs only the new tokens (generate's default). The
# cached forward runs the training forward's blocks in the same activation buffers; its attention is
# gpt2_cpu.attention_forward_cached itself, NumPy code run on CuPy arrays (cuBLAS matmuls, CuPy's
# elementwise kernels) in fp32 rather than a kernel of ours, against the KV cache (fp32
# (L,1,NH,maxT,HS) keys and values from CuPy's memory pool, once per sample).

class HostLogits:
    """The (B,T,Vp) logits of the last forward pass, left on the device; indexing copies just the
    part asked for to the host, as float32. gpt2_cpu.generate reads one row of Vp per token, so
    each token moves Vp values instead of window*Vp (100 MB in bf16 at window 1024). Valid
    until the next forward pass (the logits live in a reused buffer). np.asarray copies all."""

    def __init__(self, logits):
        self.logits = logits                                    # (B,T,Vp) floatX, on the device
        self.shape = logits.shape

    def __getitem__(self, index):
        return as_float32(self.logits[index].get())

    def __array__(self, dtype=None, copy=None):
        return as_float32(self.logits.get()).astype(dtype or np.float32, copy=False)


def kv_cache_new(config, B, dtype=np.float32):
    """An empty gpt2_cpu.KVCache on the device: k, v (L,B,NH,maxT,HS) of dtype, fp32 in either
    precision (attention_forward_cached computes in fp32; bf16 k, v convert to fp32 exactly)."""
    cp = cuda.cupy()
    shape = kv_cache_shape(config, B)
    return KVCache(cp.zeros(shape, dtype), cp.zeros(shape, dtype))


def attention_forward_cached(out, qkv, k_cache, v_cache, pos, B, T, C, NH):
    """gpt2_cpu.attention_forward_cached on the device, the same code: out (B,T,C) floatX = the
    heads of softmax(q k^T / sqrt(HS), causal) @ v for T new positions pos..pos+T-1, from qkv
    (B,T,3C) floatX, their projection. k_cache, v_cache (B,NH,maxT,HS) fp32, positions 0..pos-1
    filled, get the new k, v at pos..pos+T-1. Library calls: NumPy functions on CuPy arrays (NEP
    13 and 18 send them to CuPy) in fp32, between two cast kernels."""
    qkv32 = cuda.cupy().zeros((B, T, 3 * C), np.float32)
    cast_floatX_to_float(qkv32.reshape(-1), qkv.reshape(-1), B * T * 3 * C)
    y = gpt2_cpu.attention_forward_cached(qkv32, k_cache, v_cache, pos, NH)     # (B,T,C) fp32
    cast_float_to_floatX(out.reshape(-1), y.reshape(-1), B * T * C)


class CachedAttention:
    """The sampler's attention path for block_forward: the T new positions pos..pos+T-1 against
    the keys and values of the earlier ones in `cache` (attention_forward_cached, which appends
    theirs). Its qkv projection goes to sampler_qkv (activation_aliases)."""

    grouped_kv = False          # its cache holds NH heads (llama3_cuda repeats the NKV heads into it)

    def __init__(self, cache, pos):
        self.cache, self.pos = cache, pos

    def qkv(self, A, l, B, T, C):
        return A["sampler_qkv"]

    def forward(self, A, l, B, T, C, NH, tf32, NKV=None):
        attention_forward_cached(A["atty"][l], self.qkv(A, l, B, T, C), self.cache.k[l], self.cache.v[l], self.pos,
                                 B, T, C, NH)


def gpt2_forward_cached(model, inputs, cache):
    """gpt2_cpu.gpt2_forward_cached on the device: inputs (B,T) int token ids (host numpy) at
    positions cache.length..cache.length+T-1, attending to the cached keys and values and
    appending theirs (CachedAttention); the training forward's blocks and buffers otherwise.
    Returns the last position's logits (B,Vp), float32 on the host.
    Raises InputError if the positions pass maxT or a token id is out of range."""
    cfg = model.config
    C, L, Vp = cfg.channels, cfg.num_layers, cfg.padded_vocab_size
    pos = cache.length
    B, T = upload_batch(model, inputs, None, pos)
    P, A = model.P, gpt2_activations(model, B, T)
    attention = CachedAttention(cache, pos)
    encoder_forward(A["encoded"], A["inputs"], P["wte"], P["wpe"][pos:], B, T, C)  # (B,T,C), positions pos..
    layernorm_forward(layer_activation(A, "ln1", 0, model.recompute), A["ln1_mean"][0], A["ln1_rstd"][0],
                      A["encoded"], P["ln1w"][0], P["ln1b"][0], B, T, C)
    for l in range(L):
        block_forward(model, A, l, B, T, attention)
    logits = prefix(A["logits"], (B, T, Vp))
    model.matmul.forward(logits, A["lnf"], P["wte"], None, B, T, C, Vp)           # (B,T,C) @ (C,Vp) -> (B,T,Vp)
    cache.length = pos + T
    return as_float32(logits[:, T - 1].get())                                       # (B,Vp) to the host


def sampling_forward(model):
    """gpt2_cpu.generate's forwards on this model (a gpt2_cpu.SamplingForward), for token ids on
    the host: full(x (1,window)) -> HostLogits (1,window,Vp) from gpt2_forward without targets;
    cached(x (1,T), cache) -> logits (1,Vp) float32 on the host from gpt2_forward_cached."""
    return SamplingForward(full=lambda x: HostLogits(gpt2_forward(model, x)),
                           cached=lambda x, cache: gpt2_forward_cached(model, x, cache),
                           new_cache=lambda: kv_cache_new(model.config, 1))


# ----------------------------------------------------------------------------
# checkpoints: llmc/checkpoint.py's files, so either trainer resumes the other's run

def save_model_checkpoint(out_dir, step, model, loader, sample_rng_state, process_rank=0, num_processes=1,
                          outliers=None, write_model_file=write_model_file):
    """Write the checkpoint of `step` (llmc.checkpoint.save_checkpoint) from the device: the model
    file holds the parameters the run computes with (floatX upcast to fp32, exact; in bf16 the
    stochastically rounded values, as llm.c's model file holds its bf16 parameters), the state
    file AdamW's m and v, the fp32 master weights when there are some, and the
    stochastic-rounding RNG: together every value the next step reads, so a resume is bit for
    bit. Returns the DONE_<step> path for the caller to write last. With ZeRO-1 over several
    ranks each rank's state file holds its shard of m, v and master weights (S floats each, as
    llm.c's). write_model_file(path, config, params): the model file's writer (GPT-2's;
    llama3_cuda.py passes llama3_cpu.py's)."""
    master = model.master.get() if model.master is not None else None
    return save_checkpoint(out_dir, step, model.config, download_parameters(model, master=False), model.m.get(),
                           model.v.get(),
                           loader, sample_rng_state, process_rank, num_processes, master_weights=master,
                           rng_state_last_update=model.rng_state_last_update, outliers=outliers,
                           zero_stage=model.zero_stage, write_model_file=write_model_file)


def load_model_checkpoint(out_dir, step, model, loader, process_rank, num_processes, read_model_file=read_model_file):
    """Resume from the checkpoint of `step` in out_dir (written by either trainer): parameters,
    AdamW's m and v, the loader position, the stochastic-rounding RNG. Returns (step,
    sample_rng_state, state_path, the outlier detectors' state or None). With master weights in
    both the model and the state (bf16, -w 1) the floatX parameters are the model file's, exactly
    the run's stochastically rounded values, and the master weights the state file's (this rank's
    shard with ZeRO-1, whose -z and number of ranks must be the run's, else InputError): the run
    resumes bit for bit. Otherwise the parameters are llmc.checkpoint's choice (the master
    weights of a gpt2_cpu or fp32 run), rounded to floatX. read_model_file: the model file's reader
    (GPT-2's; llama3_cuda.py passes llama3_cpu.py's)."""
    st = load_checkpoint(out_dir, step, process_rank, num_processes, lambda shape: model.num_parameters,
                         model.shard.size, model.zero_stage, read_model_file)
    exact = model.master is not None and st["master_weights"] is not None
    upload_parameters(model, st["model_params"] if exact else st["params"])
    if model.master is not None and st["master_weights"] is not None:
        model.master.set(np.ascontiguousarray(st["master_weights"], dtype=np.float32))   # exact: this rank's shard
    model.m.set(np.ascontiguousarray(st["m"], dtype=np.float32))
    model.v.set(np.ascontiguousarray(st["v"], dtype=np.float32))
    if st["rng_state_last_update"]:                   # 0 from gpt2_cpu: keep the initial seed
        model.update_rng.state = model.rng_state_last_update = st["rng_state_last_update"]
    loader.restore(st["loader"])
    return st["step"], st["sample_rng_state"], st["state_path"], st["outliers"]


# ----------------------------------------------------------------------------
# training loop (llm.c's main): the training step written out; the rest from llmc/cli.py

def build_parser():
    """gpt2_cpu.py's flags (LoRA's too) plus the GPU options (llmc.gpu_cli.build_parser)."""
    parser = gpu_cli.build_parser(LR_SCHEDULES)
    lora_files.add_flags(parser, LORA_FAMILY.default_targets)
    return parser


def parse_args(argv=None):
    """gpt2_cpu.py's flags plus the GPU options -> argparse.Namespace."""
    parser = build_parser()
    if parser.parse_known_args(argv)[0].device == "cpu":   # the emulated device's reference: gpt2_cpu.py, fp32
        parser.set_defaults(precision="fp32", tf32=0)
    return parser.parse_args(argv)


def setup_model(args, compute_capability, spec=None, say=print, comm=None):
    """The model on the GPU from `spec` (default -e: a checkpoint or a descriptor), in the
    precision and attention path of the flags (a fallback is reported through `say`), with -z's
    optimizer shard of this rank of comm (default: one process), its matmul backend from -f and
    --cublaslt (TF32 from compute capability 8.0; cuBLAS where cuBLASLt is missing, saying so)."""
    precision, tf32 = choose_precision(args.precision, args.tf32, compute_capability)
    matmul, fallback = matmul_backend(args.cublaslt, tf32, args.residual_epilogue, args.autotune,
                                      args.gelu_fusion, args.bias_grad_epilogue)
    if fallback:
        say(f"gpt2_cuda.py: {fallback}")
    host = build_model(spec or args.model, args.seed)                           # fp32 on the host
    build_lora(args, host, LORA_FAMILY, args.seed)                              # --lora-*: host.lora, host frozen
    cfg = host.config
    attention, fallback = resolve_attention(args.attention, precision, cfg.channels // cfg.num_heads)
    if fallback:
        say(f"gpt2_cuda.py: {fallback}")
    for line in unused_library_options(args, matmul, attention):
        say(f"gpt2_cuda.py: {line}")
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    model = GPT2(cfg, precision, bool(args.master_weights), args.recompute, attention, args.zero_stage, rank, size,
                 matmul=matmul, classifier_chunk=args.classifier_chunk, trainable=host.lora is None,
                 autotune=args.autotune, cudnn_deterministic=bool(args.cudnn_deterministic),
                 ln_bias_grad=bool(args.ln_bias_grad))
    upload_parameters(model, host.params)
    if host.lora is not None:
        attach_lora(model, host.lora, rank, size)
    return model


def unused_library_options(args, matmul, attention):
    """One line for each of --autotune, -ge, --bias-grad-epilogue and --cudnn-deterministic given a
    value other than its default that no library of this run reads (they act on cuBLASLt's products
    and cuDNN's attention graphs only), so that a flag doing nothing says so."""
    lt, cudnn = matmul.name == "cuBLASLt", attention == "cudnn"
    lines = []
    if args.autotune > 1 and not (lt or cudnn):
        lines.append(f"--autotune {args.autotune} has nothing to tune here (it times cuBLASLt's algorithms and cuDNN "
                     f"attention's plans: this run has {matmul.name} matmuls and {attention} attention)")
    if args.gelu_fusion != 2 and not lt:
        lines.append(f"-ge {args.gelu_fusion} applies to cuBLASLt's epilogues; with {matmul.name} the GELU is our kernel's")
    if args.bias_grad_epilogue != 1 and not lt:
        lines.append(f"--bias-grad-epilogue {args.bias_grad_epilogue} applies to cuBLASLt's epilogues; with "
                     f"{matmul.name} the bias gradients are bias_backward's already")
    elif args.bias_grad_epilogue == 2 and args.gelu_fusion != 2:
        lines.append(f"--bias-grad-epilogue 2 sums the fc's bias gradient in the DGELU epilogue, which -ge "
                     f"{args.gelu_fusion} leaves out: bias_backward sums it, as with 0")
    if not args.cudnn_deterministic and not cudnn:
        lines.append(f"--cudnn-deterministic 0 applies to cuDNN attention; this run has {attention} attention")
    return lines


def attach_lora(model, host_lora, rank=0, size=1):
    """LoRA on the device (llmc/lora_device.py): host_lora's adapters uploaded as model.lora (with
    -z's shard of their optimizer state and AdamW's per-step buffers), applied by the model's
    matmul backend from now on."""
    model.lora = DeviceLoRA(host_lora, model.precision, model.zero_stage, rank, size, UPDATE_SEED, GLOBAL_NORM_GRID)
    model.lora.update = UpdateBuffers(model.lora.param_shapes)
    upload_parameters(model.lora, host_lora.params)
    model.matmul = LoraMatmul(model.matmul, model.lora, model.P)


def tuning_report(model):
    """What --autotune found: one line per cuBLASLt product (llmc/cublaslt.py) and per cuDNN
    attention graph (llmc/cudnn_attention.py) it timed, the library's first choice against the
    one kept."""
    lines = []
    if model.matmul.name.startswith("cuBLASLt"):
        from llmc import cublaslt
        lines += cublaslt.tuning_report()
    if model.attention.name == "cudnn":
        from llmc import cudnn_attention
        lines += cudnn_attention.tuning_report()
    return lines


def kernel_files(model):
    """The kernels/*.cu files the model launches (compiled before the first step)."""
    return KERNEL_FILES + model.attention.kernel_files


def eval_rows(B):
    """Rows of a HellaSwag forward pass: B, or NUM_COMPLETIONS if B is smaller (one example's
    completions always go through together, as in llmc.evalloader.evaluate_multiple_choice)."""
    return max(B, NUM_COMPLETIONS)


def eval_forward_losses(model, B, T):
    """forward_losses for llmc.evalloader.evaluate_multiple_choice: inputs, targets (R,T) int32
    on the host, R <= eval_rows(B) -> per-position losses (R,T) float32 on the host. The batch
    is padded to eval_rows(B) rows of PAD_TOKEN, so that every call has the same shape (a ragged
    last batch runs the same kernels and cuBLAS algorithms as the others); the padding's losses
    are dropped."""
    rows = eval_rows(B)

    def forward_losses(inputs, targets):
        R = inputs.shape[0]
        if R > rows or inputs.shape[1] != T:
            raise ValueError(f"forward_losses: got {inputs.shape}, at most ({rows},{T})")
        x = np.full((rows, T), PAD_TOKEN, dtype=np.int32)
        y = np.full((rows, T), PAD_TOKEN, dtype=np.int32)
        x[:R], y[:R] = inputs, targets
        gpt2_forward(model, x, y)
        return gpt2_activations(model, rows, T)["losses"][:R].get()       # (R,T) to the host
    return forward_losses


def sample_window(config, prompt_length, max_new_tokens):
    """Tokens per forward pass of gpt2_cpu.generate (its window), for allocating it up front."""
    return min(config.max_seq_len, prompt_length + max_new_tokens)


def train(args):
    """gpt2_cpu.train on the GPU: the same flags and loop. Each step: zero_grad, forward +
    backward over grad_accum_steps micro-batches (accumulating, the loss summed on the device),
    NCCL all-reduce of the gradients, clip to the global norm, AdamW, all on the device (a CUDA
    graph per micro-batch with --cuda-graph 1: the whole step without accumulation), the step's
    line logged a step late (StepReadback). Returns the model (the sampled ids with --generate)."""
    if args.lora_merge:                            # host work only: gpt2_cpu.py merges and writes the file
        return gpt2_cpu.train(args)
    cp = cuda.cupy()
    comm = multinode.init_process_group(args, agreement_of=agreement_config)   # -pm mpi|tcp|fs: rank, size, local rank
    run = TrainingRun(args, comm)
    device, device_name, capability = cuda.select_device(comm)
    nccl = comm.connect()                          # the NCCL communicator (None for one process)
    cuda_graph = gpu_cli.cuda_graph_choice(args.cuda_graph)
    reason = cuda.cuda_graph_unavailable_reason() if cuda_graph else None   # refused now, not at the first capture
    if reason and args.cuda_graph == "auto":
        run.say(f"gpt2_cuda.py: kernels launched one by one, no CUDA graph: {reason}")
        cuda_graph = False
    elif reason:
        raise InputError(f"--cuda-graph 1: {reason}")
    if cuda_graph:                          # a graph is captured on a created stream, never the legacy one
        graph_stream = cp.cuda.Stream()     # (blocking: ordered after any work on the legacy stream)
        graph_stream.use()
    model = setup_model(args, capability, run.model_spec(), say=run.say, comm=comm)
    if args.generate > 0:
        cuda.load_modules(kernel_files(model), model.precision)
        rng, forward = SamplerRNG(args.sample_seed), sampling_forward(model)    # allocates (1, window) itself
        return sample_from_prompt(args, lambda prompt, n, on_token: generate(
            model, prompt, n, rng, args.temperature, args.top_k, on_token, forward), model.config)
    if run.resuming:
        run.check_resumed_model(model_config(args.model), model.config)
    run.prepare(model.config)
    B, T, cfg = run.B, run.T, model.config
    sizes = [(B, T)] + ([(eval_rows(B), T)] if run.examples else [])
    if run.sampling:                                               # the samples start from one token
        sizes.append((1, sample_window(cfg, 1, args.gen_tokens)))
    cuda.load_modules(kernel_files(model), model.precision)
    activation_bytes = gpt2_allocate(model, *sizes)                # every activation, once

    def batch_loss(inputs, targets):                               # validation
        gpt2_forward(model, inputs, targets)
        return gpt2_mean_loss(model)

    forward_losses = eval_forward_losses(model, B, T)              # HellaSwag
    if args.eval_only:
        run.evaluate_only(batch_loss, forward_losses)
        return model
    run.say(device_line(device, device_name, capability, model, cuda_graph))
    run.banner(cfg, model.num_parameters)
    if model.lora:
        run.say(lora_files.describe(model.lora, model.num_parameters))
    run.say(f"memory: activations {activation_bytes / 2**30:.2f} GiB, total in use "
            f"{cp.get_default_memory_pool().total_bytes() / 2**30:.2f} GiB")
    sample_rng = SamplerRNG(args.sample_seed)
    start_step, outliers = 0, None
    if run.resuming:
        start_step, sample_rng.state, state_path, outliers = load_model_checkpoint(
            args.output_dir, run.resume_step, model, run.train_loader, comm.rank, comm.size)
        run.say(f"resumed from {state_path} at step {start_step}")
    def sample(prompt, n):
        return generate(model, prompt, n, sample_rng, forward=sampling_forward(model))

    if not run.start(start_step, outliers):
        run.sample_after_the_last_checkpoint(sample)
        return model

    def save(step):
        return save_model_checkpoint(args.output_dir, step, model, run.train_loader, sample_rng.state,
                                     comm.rank, comm.size, run.outlier_state())

    update = StepUpdate(ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, args.grad_clip)
    # the step on the device, its loss and norm read a step late: unless -sl / -sg must see them
    # before the update, or ZeRO-1's shards sum the norm on the host (gpt2_global_grad_norm), or
    # LoRA trains the adapters (host_step's)
    on_device = not (args.skip_update_lossz > 0 or args.skip_update_gradz > 0 or model.shard.num_processes > 1
                     or model.lora is not None)
    lines = StepLines(run, model, comm, args, device, device_name, StepReadback(B * T) if on_device else None)
    for step in range(start_step, run.num_steps + 1):
        if run.acts_between(step):                 # it prints or saves: the step still pending first
            lines.flush()
        if run.between_steps(step, batch_loss, forward_losses, sample, save):
            break
        # the training step
        lr = learning_rate_at(step, args.lr_schedule, args.learning_rate, args.warmup_iters, run.num_steps,
                              args.final_lr_frac)
        if on_device:
            start = cp.cuda.get_current_stream().record()
            lines.queue(step, lr, start, *device_step(model, run, args, step, lr, update, cuda_graph, nccl))
        else:
            t0 = time.perf_counter()
            lines.line(step, lr, *host_step(model, run, args, comm, step, lr, cuda_graph, nccl),
                       time.perf_counter() - t0)
    lines.flush()
    if args.autotune > 1:                          # what --autotune found, product by product, graph by graph
        for line in tuning_report(model):
            run.say(f"autotune: {line}")
    if args.lora_save and comm.rank == 0:
        save_lora(args.lora_save, model, LORA_FAMILY, args.model)
        run.say(f"LoRA adapters written to {args.lora_save}")
    return model


def save_lora(out_dir, model, family, base_model):
    """--lora-save: the device's adapters as PEFT's files (llmc.lora.save): their fp32 master
    weights, or (fp32, or ZeRO-1 over several ranks) the parameters the run computes with."""
    lora = model.lora
    host = gpt2_cpu.LoRA(lora.targets, model.config.num_layers, lora.rank, lora.alpha)
    host.params[...] = download_parameters(lora)
    lora_files.save(out_dir, host, model.config.num_layers, family, base_model)


def device_step(model, run, args, step, lr, update, cuda_graph, nccl):
    """One training step wholly on the device (train()'s, unless -sl / -sg or ZeRO-1 over several
    ranks): the step's AdamW values uploaded (adamw_prepare), then its micro-batches, the first
    setting the gradients to 0, the last running the mean over ranks, the norm, its clipping factor
    and AdamW (one CUDA graph per micro-batch with cuda_graph: the whole step with one). Nothing
    waits for the device. Returns the step's (loss_accum, norm) on the device, for StepLines.queue."""
    A = gpt2_activations(model, run.B, run.T)      # (cached) fetched per step: valid even if a sample reallocated
    adamw_prepare(model, lr, ADAMW_BETA1, ADAMW_BETA2, step + 1)
    for micro in range(run.grad_accum_steps):
        if args.overfit_single_batch:
            run.train_loader.reset()
        inputs, targets = run.train_loader.next_batch()
        last = micro == run.grad_accum_steps - 1
        gpt2_micro_batch(model, inputs, targets, 1.0 / run.grad_accum_steps, cuda_graph, first=micro == 0,
                         update=update if last else None, nccl=nccl)
    return A["loss_accum"], model.norm


def host_step(model, run, args, comm, step, lr, cuda_graph, nccl):
    """One training step whose loss and norm the host reads before the update (-sl / -sg decide
    on them whether to apply it; ZeRO-1 over several ranks sums the norm on the host): the
    micro-batches (eager or CUDA graphs), the mean over ranks, the norm and loss (two syncs), the
    outlier check, AdamW. With LoRA (model.lora) all of that trains the adapters only. Returns
    (loss, norm, zloss, zgrad), the update done."""
    trained = model.lora or model                  # what the step updates (LoRA: the adapters only)
    A = gpt2_activations(model, run.B, run.T)
    gpt2_zero_grad(trained)
    A["loss_accum"].fill(0)
    for _ in range(run.grad_accum_steps):
        if args.overfit_single_batch:
            run.train_loader.reset()
        inputs, targets = run.train_loader.next_batch()
        # forward, the loss added up on the device (no sync), backward: eager or a CUDA graph
        gpt2_micro_batch(model, inputs, targets, 1.0 / run.grad_accum_steps, cuda_graph)
    if nccl is not None:
        gpt2_average_gradients(trained, nccl)                             # data parallel (-z 1: this rank's shard)
    norm = gpt2_global_grad_norm(trained, comm, args.grad_clip)           # sync 1 of 2
    loss = float(A["loss_accum"].sum(dtype=np.float64)) / (A["loss_accum"].size * run.grad_accum_steps)  # sync 2
    loss = comm.mean(loss)
    skip, zloss, zgrad = run.skip_update(loss, norm)         # -sl / -sg: an outlier step is not applied
    if not skip:                               # one shard: the clipping factor global_norm left on the device
        grad_scale = None if trained.shard.num_processes == 1 else clip_factor(args.grad_clip, norm)
        gpt2_update(trained, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, step + 1, grad_scale, nccl,
                    trained.decayed if model.lora else DECAYED_PARAMETERS)
    cuda.cupy().cuda.get_current_stream().synchronize()                   # the step's time includes the update
    return loss, norm, zloss, zgrad


class StepLines:
    """train()'s step lines (TrainingRun.log_step with the MFU; -lg's GPU line), and for a step run
    on the device its line a step late: queue() keeps the step and prints the one before, whose
    loss and norm are back by then (readback, a StepReadback) while the GPU runs the new one;
    flush() prints the one kept, before anything between steps prints or saves, and after the last.
    Such a step's time is the device's, from the end of the step before it (or from its own start
    after work between the steps) to its end."""

    def __init__(self, run, model, comm, args, device, device_name, readback):
        self.run, self.model, self.comm, self.args = run, model, comm, args
        self.device, self.device_name, self.readback = device, device_name, readback
        self.pending = self.previous_end = None        # the step not yet printed; the end of the one before

    def line(self, step, lr, loss, norm, zloss, zgrad, seconds):
        """Print step's line (and main.log's)."""
        cfg, run = self.model.config, self.run
        util = mfu(self.model.num_parameters, cfg.num_layers, cfg.channels, run.T,
                   run.total_batch / self.comm.size / seconds, self.device_name, self.model.precision,
                   self.model.matmul.tf32)
        run.log_step(step, loss, norm, lr, seconds, zloss, zgrad, f" | MFU {'n/a' if util is None else f'{100 * util:.1f}%'}")
        if self.args.log_gpu_every > 0 and (step + 1) % self.args.log_gpu_every == 0:
            run.say(gpu_status_line(self.device))

    def queue(self, step, lr, start, loss_accum, norm):
        """A step queued on the device (its start event, its losses and norm on the device): copy
        them back without waiting, keep it, and print the step before."""
        previous = self.pending
        slot, done = self.readback.queue(loss_accum, norm)
        self.pending = (step, lr, self.previous_end or start, slot, done)
        self.previous_end = done
        if previous is not None:
            self.print_late(*previous)

    def flush(self):
        """Print the step kept, if any; the next step's time starts at its own start."""
        if self.pending is not None:
            self.print_late(*self.pending)
        self.pending = self.previous_end = None

    def print_late(self, step, lr, since, slot, done):
        run = self.run
        loss_sum, norm = self.readback.read(slot, done, run.B * run.T)   # waits for the step's end
        loss = self.comm.mean(loss_sum / (run.B * run.T * run.grad_accum_steps))
        _, zloss, zgrad = run.skip_update(loss, norm, step)   # feeds the outlier windows; raises on NaN
        self.line(step, lr, loss, norm, zloss, zgrad, cuda.cupy().cuda.get_elapsed_time(since, done) / 1000)


def clip_factor(grad_clip, norm):
    """What the gradient is scaled by for clipping at grad_clip (0: none): gpt2_cpu.train's rule,
    on the host (global_norm computes the same on the device)."""
    return grad_clip / norm if 0 < grad_clip < norm else 1.0


def main(argv=None):
    """Command-line entry point. Returns the exit code: 0; 1 for bad input (one `error:` line);
    2 without a CUDA GPU or CuPy."""
    args = parse_args(argv)
    cuda.use_device(args.device)
    if args.device == "cpu":
        print("gpt2_cuda.py --device cpu: the CUDA kernels run on the emulated device (compiled by g++, each "
              "CUDA thread a fiber on the CPU): slow, and its timings and MFU say nothing about a GPU")
    reason = cuda.cuda_unavailable_reason()
    if reason:
        if args.device == "cpu":
            print(f"gpt2_cuda.py --device cpu: the emulated device cannot run ({reason})", file=sys.stderr)
        else:
            print(f"gpt2_cuda.py: no CUDA GPU found ({reason}); add --device cpu to run the same kernels on the "
                  f"emulated device (slowly), or use gpt2_cpu.py", file=sys.stderr)
        return 2
    def check(args):
        _, _, capability = cuda.select_device(Comm())
        return run_check(sys.modules[__name__], args, setup_model(args, capability))
    return gpu_cli.with_memory_report(
        args, lambda: run_main(check if args.check else train, args, (InputError, KernelCompileError)))

if __name__ == "__main__":
    sys.exit(main())
