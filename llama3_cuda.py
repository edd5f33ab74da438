"""
llama3_cuda.py: Llama 3 on NVIDIA GPUs in Python, the twin of llama3_cpu.py as gpt2_cuda.py is of
gpt2_cpu.py: CuPy for memory and launches, our own kernels for the layers Llama 3 adds
(kernels/rmsnorm.cu, rope.cu, swiglu.cu, repeat_kv.cu), and everything Llama 3 shares with GPT-2
imported from gpt2_cuda.py (the launcher contract, the token embedding, the matmul backends,
the attention paths, the fused classifier, the casts). Each new layer is a thin *launcher*
written as gpt2_cuda.py's are: it checks its arguments, computes the grid and launches a kernel
that writes into preallocated arrays, outputs first, like llm.c:
`rmsnorm_forward(out, rstd, inp, weight, B, T, C)`.

What it deliberately is not: gpt2_cuda.py's other trainer options (recomputation, fused
residual + norm kernels, cuBLASLt, bf16 without master weights: it has no -r, --cublaslt or -w,
and refuses them as unknown flags); it trains with llama3_cpu.py's flags and loop, data-parallel
over several processes as gpt2_cuda.py does (mpiexec or -pm tcp|fs: NCCL all-reduce of the
gradients, or with -z 1 ZeRO-1's reduce-scatter, sharded AdamW and all-gather), with --cuda-graph 1
replays each micro-batch's forward + backward as one CUDA graph (llama3_micro_batch, as
gpt2_cuda.py's), samples with a KV cache, writes and resumes llama3_cpu.py's checkpoints (-n, -y 1:
llmc/checkpoint.py's files, so either trainer resumes the other's run; one state file per rank),
fine-tunes LoRA adapters on the frozen model (--lora-rank, gpt2_cuda.py's LoRA: llmc/lora_device.py),
runs its classifier over a padded vocabulary if asked (--pad-vocab 1, as gpt2_cuda.py always does),
and checks one batch against llama3_cpu.py (--check).

Run it (after `make data`; without CuPy and a GPU it says so in one line and exits 2):
    python llama3_cuda.py --device cpu -e llama3:d2 -b 2 -t 16 -x 3   # llama3_cpu.py's losses, emulated
    step    1/3 | loss 10.87... | norm ... | lr 3.00e-04 | ... ms | ... tok/s
    python llama3_cuda.py --device cpu -e llama3:d2 -b 2 -t 16 -x 3 -n 3 -o out   # then -x 6 -y 1 goes on from step 3
    python llama3_cuda.py --device cpu -e llama3:d2 -b 2 -t 16 -x 3 --cuda-graph 1   # the same losses, replayed
    mpiexec -n 2 python llama3_cuda.py --device cpu -e llama3:d2 -b 2 -t 16 -x 3 -z 1   # 2 processes, ZeRO-1
    batch: B=2 T=16 processes=2 grad_accum=1 -> 64 tokens/step | ...
    python llama3_cuda.py --device cpu --check -e llama3:d2 -b 1 -t 16 --precision bf16
    ... one TENSOR OK line per activation and gradient, then `check: all tensors OK`
    python llama3_cuda.py --device cpu --check -e llama3:d2 -b 1 -t 16 --lora-rank 4 --pad-vocab 1
    ... the same, the gradients the adapters' (doc/lora.md), the classifier over Vp = 50304

Dimensions as in llama3_cpu.py (B T C V L NH NKV HS H maxT), plus N = B*T, the rows of a matmul,
and QKV = (NH+2NKV)*HS, the width of the qkv projection.
Gradient convention (gpt2_cuda.py's, llm.c's): a launcher *writes* (=) its input's gradient into
the `dinp` it is given, except RMSNorm's backward, which *accumulates* (+=) into dinp, the
residual stream's gradient; parameter gradients always accumulate.
"""

import sys
import time

from llmc.interrupt import quiet_ctrl_c_while_importing
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback
from llmc.openblas import spin_briefly_when_idle  # noqa: E402
spin_briefly_when_idle()                 # before NumPy loads OpenBLAS: the emulated device's kernels want the cores
from llmc.utils import require  # noqa: E402
require("llama3_cuda.py", "numpy")       # no NumPy (the environment not activated): one line, exit 1
import numpy as np  # noqa: E402

import gpt2_cuda
import llama3_cpu
from gpt2_cpu import (ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, SamplingForward, build_lora, check_inputs, generate,
                      learning_rate_at, num_elements, padded_vocab, tensor_views)
# as_float32, download_parameters and prefix are also read from this module by llmc.cuda_check, as from gpt2_cuda
from gpt2_cuda import (GLOBAL_NORM_GRID, NORM_VALUES, UPDATE_SEED, HostLogits, UpdateBuffers, as_float32,
                       attach_lora, capture_graph, download_parameters,
                       encoder_forward, fused_classifier, gpt2_average_gradients, gpt2_global_grad_norm,
                       gpt2_zero_grad, save_lora, upload_parameters, wte_partial_rows, wte_reduce_max)
from llama3_cpu import DECAYED_PARAMETERS, LORA_FAMILY, qkv_channels, read_checkpoint_model, write_checkpoint_model
from llmc import cuda, gpu_cli, multinode
from llmc import lora as lora_files
from llmc.attention import attention_path, resolve_attention
from llmc.cli import TrainingRun, agreement_config, run_main, sample_from_prompt
from llmc.comm import Comm
from llmc.cuda import (BLOCK_SIZE, FLOATX_DTYPES, MAX_THREADS_PER_BLOCK, PRECISIONS, WARP_ROW_BLOCK_SIZE, WARP_SIZE,
                       KernelCompileError, ceil_div, check_launch, elementwise_grid, require, vector_size,
                       warp_row_grid)
from llmc.cuda_check import check_llama3_against_cpu, run_check
from llmc.gpu_cli import choose_precision, gpu_status_line
from llmc.matmul import Cublas
from llmc.sampler import SamplerRNG
from llmc.utils import InputError, prefix
from llmc.zero import optimizer_shard

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
    into partial (G, C) fp32, G = rmsnorm_backward_grid(N), then their in-order sum (skipped for a
    frozen RMSNorm, dweight None)."""
    N = B * T
    G = rmsnorm_backward_grid(N)
    trained = [("dweight", dweight, C)] if dweight is not None else []
    precision = check_launch("rmsnorm_backward",
                             [("dinp", dinp, N * C), ("dout", dout, N * C), ("inp", inp, N * C), ("weight", weight, C)]
                             + trained,
                             float32=[("rstd", rstd, N)], vector_dim=("C", C), unaligned=("dweight",))
    require(partial.dtype == np.float32 and partial.size >= G * C, f"rmsnorm partial sums need {G * C} floats")
    cuda.launch("rmsnorm", precision, "rmsnorm_backward", G, RMSNORM_BACKWARD_BLOCK_SIZE,
                (dinp, partial, dout, inp, weight, rstd, np.int32(N), np.int32(C)))
    if trained:
        cuda.launch("rmsnorm", precision, "rmsnorm_param_reduce", elementwise_grid(C), BLOCK_SIZE,
                    (dweight, partial, np.int32(G), np.int32(C)))


def rmsnorm_backward_grid(N):
    """Scratch slots of rmsnorm_backward (blocks, each owning ceil(N/G) rows): fixed per N."""
    return min(RMSNORM_BACKWARD_GRID, N)


def rope_check(name, out, inp, freqs_cos, freqs_sin, B, T, nh, n_rot, HS):
    """The checks rope_forward and rope_backward share (kernels/rope.cu). Returns (precision, grid, args)."""
    n = B * T * nh * HS
    precision = check_launch(name, [("out", out, n), ("inp", inp, n)],
                             float32=[("freqs_cos", freqs_cos, T * HS // 2), ("freqs_sin", freqs_sin, T * HS // 2)],
                             vector_dim=("HS", HS))
    require(0 <= n_rot <= nh, f"{name}: need 0 <= n_rot={n_rot} <= nh={nh}")
    args = (out, inp, freqs_cos, freqs_sin, np.int32(B), np.int32(T), np.int32(nh), np.int32(n_rot), np.int32(HS))
    return precision, elementwise_grid(n // vector_size(precision)), args


def rope_forward(out, inp, freqs_cos, freqs_sin, B, T, nh, n_rot, HS):
    """out (B,T,nh,HS) = inp with the first n_rot heads of each position t rotated pair by pair by
    the angles t * freq_i (llama3_cpu.rope_forward), the other heads copied: on the qkv
    projection (nh = NH+2NKV) n_rot = NH+NKV rotates q and k and passes v through. freqs_cos,
    freqs_sin (T,HS/2) fp32: rows 0..T-1 of the tables. out may be inp."""
    precision, grid, args = rope_check("rope_forward", out, inp, freqs_cos, freqs_sin, B, T, nh, n_rot, HS)
    cuda.launch("rope", precision, "rope_forward", grid, BLOCK_SIZE, args)


def rope_backward(dinp, dout, freqs_cos, freqs_sin, B, T, nh, n_rot, HS):
    """dinp (B,T,nh,HS) = dout with the first n_rot heads rotated by minus the forward's angles
    (the transpose of a rotation, llama3_cpu.rope_backward), the other heads copied. dinp may be dout."""
    precision, grid, args = rope_check("rope_backward", dinp, dout, freqs_cos, freqs_sin, B, T, nh, n_rot, HS)
    cuda.launch("rope", precision, "rope_backward", grid, BLOCK_SIZE, args)


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


def residual_forward(out, inp1, inp2, n):
    """out (n,) = inp1 + inp2 (kernels/layernorm.cu's residual_forward; out may be inp1). Llama 3's
    residual additions, and the sum of the two gradients that reach ln2 (c_fc's and c_fc2's)."""
    precision = check_launch("residual_forward", [("out", out, n), ("inp1", inp1, n), ("inp2", inp2, n)], aligned=True)
    cuda.launch("layernorm", precision, "residual_forward", elementwise_grid(ceil_div(n, vector_size(precision))),
                BLOCK_SIZE, (out, inp1, inp2, np.uint64(n)))


def encoder_backward(dwte, partial, dout, positions, chunk_start, chunk_token, chunk_slot, reduce_start, reduce_token,
                     num_chunks, num_reduce, B, T, C):
    """Accumulate dwte (V,C) from dout (B,T,C): gpt2_cuda.encoder_backward's deterministic
    scatter-add (kernels/encoder.cu) without its dwpe kernel, since Llama 3 has no wpe:
        out[b,t] = wte[inp[b,t]]  =>  dwte[v] += sum of dout[b,t] where inp[b,t] == v
    The int32 arrays are gpt2_cuda.WteSegments' on the device; partial fp32, wte_partial_rows(B*T) rows.
    dwte None: frozen (LoRA), nothing to do."""
    if dwte is None:
        return
    N = B * T
    precision = check_launch("encoder_backward", [("dwte", dwte, dwte.size), ("dout", dout, N * C)],
                             int32=[("positions", positions, N), ("chunk_start", chunk_start, num_chunks + 1),
                                    ("chunk_token", chunk_token, num_chunks), ("chunk_slot", chunk_slot, num_chunks),
                                    ("reduce_start", reduce_start, num_reduce + 1),
                                    ("reduce_token", reduce_token, num_reduce)], vector_dim=("C", C))
    require(partial.dtype == np.float32 and partial.size >= wte_partial_rows(N) * C,
            f"encoder_backward: partial needs {wte_partial_rows(N) * C} floats")
    groups_per_row = C // vector_size(precision)               # threads of a block stride over these
    block = min(MAX_THREADS_PER_BLOCK, ceil_div(groups_per_row, WARP_SIZE) * WARP_SIZE)
    cuda.launch("encoder", precision, "encoder_backward_wte", max(1, num_chunks), block,
                (dwte, partial, dout, positions, chunk_start, chunk_token, chunk_slot, np.int32(num_chunks), np.int32(C)))
    cuda.launch("encoder", precision, "encoder_backward_wte_reduce", max(1, num_reduce), block,
                (dwte, partial, reduce_start, reduce_token, np.int32(num_reduce), np.int32(C)))


# ----------------------------------------------------------------------------
# the model: parameters, activations, forward, backward (zero_grad and the grad norm are gpt2_cuda's)

KERNEL_FILES = ("encoder", "layernorm", "attention", "classifier", "adamw", "global_norm", "cast") + LLAMA3_KERNEL_FILES


def activation_table(config, B, T, attention, Vp=None):
    """Every device buffer of one forward + backward pass, in forward order: (name, shape, kind),
    kind "X" floatX, "f32" float32, "i32" int32. Names follow llama3_cpu.activation_shapes, but
    qkv_proj (llama3_cpu's qkv: "qkv" is the attention path's buffer, llama3_cpu's qkv_att in
    GPT-2's layout, or for flash, which reads the NKV key/value heads in place, the rotated
    qkv_proj). Never kept, as in gpt2_cuda.py: qkv_att for the naive path (its qkvr is), attproj,
    fcproj and probs (the fused classifier); the one-layer transients live in scratch buffers under
    the name of each role (activation_aliases)."""
    C, L, NH, H = config.channels, config.num_layers, config.num_heads, config.hidden_dim
    Vp = Vp or config.vocab_size                       # the classifier's width (Llama3's Vp)
    QKV = qkv_channels(config)
    attention_kept, logits_floats, attention_backward_buffers = attention.buffers(
        B, T, C, L, NH, B * T * Vp, QKV if attention.grouped_kv else None)      # flash keeps the NKV heads
    return [
        ("inputs", (B, T), "i32"), ("targets", (B, T), "i32"),
        ("encoded", (B, T, C), "X"),
        ("ln1", (L, B, T, C), "X"), ("ln1_rstd", (L, B, T), "f32"),
        ("qkv_proj", (L, B, T, QKV), "X"),
        *attention_kept, ("atty", (L, B, T, C), "X"),
        ("residual2", (L, B, T, C), "X"),
        ("ln2", (L, B, T, C), "X"), ("ln2_rstd", (L, B, T), "f32"),
        ("fch", (L, B, T, H), "X"), ("fch2", (L, B, T, H), "X"), ("fch_swiglu", (L, B, T, H), "X"),
        ("residual3", (L, B, T, C), "X"),
        ("lnf", (B, T, C), "X"), ("lnf_rstd", (B, T), "f32"),
        ("losses", (B, T), "f32"),
        ("logits", (logits_floats,), "X"),     # (B,T,Vp), then dlogits in place
        ("scratch_btc", (B, T, C), "X"), ("scratch_btc2", (B, T, C), "X"),
        ("scratch_bth", (B, T, H), "X"), ("scratch_bth2", (B, T, H), "X"),
        ("scratch_qkv", (B, T, QKV), "X"), ("dqkv_att", (B, T, 3 * C), "X"),
        ("dresidual", (B, T, C), "X"),         # the residual stream's gradient
        *attention_backward_buffers,
        # the dwte scatter-add's plan (gpt2_cuda.WteSegments)
        ("positions", (B * T,), "i32"), ("chunk_start", (B * T + 1,), "i32"), ("chunk_token", (B * T,), "i32"),
        ("chunk_slot", (B * T,), "i32"), ("reduce_start", (wte_reduce_max(B * T) + 1,), "i32"),
        ("reduce_token", (wte_reduce_max(B * T) + 1,), "i32"), ("wte_partial", (wte_partial_rows(B * T), C), "f32"),
    ]


def activation_aliases(config, B, T, attention):
    """The roles living in a scratch buffer, (name, buffer, shape); those of one buffer are never
    live at once: each is consumed before the next is written."""
    C, H, NH = config.channels, config.hidden_dim, config.num_heads
    QKV = qkv_channels(config)
    return [
        *[(name, "scratch_btc", (B, T, C)) for name in ("attproj", "fcproj", "dlnf", "dln2", "datty", "dln1")],
        ("dln2_gate", "scratch_btc2", (B, T, C)),         # c_fc2's part of dln2, added into dln2
        ("dfch_swiglu", "scratch_bth", (B, T, H)), ("dfch", "scratch_bth", (B, T, H)),   # swiglu_backward in place
        ("dfch2", "scratch_bth2", (B, T, H)),
        ("qkv_rope", "scratch_qkv", (B, T, QKV)), ("dqkv", "scratch_qkv", (B, T, QKV)),
        ("sampler_qkv", "dqkv_att", (B, T, 3 * C)),      # the cached forward's attention input: no backward follows
        *attention.aliases(B, T, C, NH),                  # naive: att_workspace in `logits`
    ]


class Llama3:
    """A Llama 3 on the GPU: flat floatX parameter and gradient buffers with named views in
    llama3_cpu.parameter_shapes' order, fp32 AdamW moments m, v and (bf16) fp32 master weights,
    RoPE's cos and sin tables (maxT, HS/2) in fp32, and the activation buffers of each (B,T)
    (llama3_activations). precision "bf16" or "fp32"; attention "naive" or "flash"; zero_stage 0,
    or 1 (ZeRO-1: m, v and the master weights hold only this rank's shard of the num_processes,
    gpt2_cuda.GPT2's layout); trainable=False: LoRA's frozen base (no gradients, moments or master
    weights; G's views None). pad_vocab: the classifier runs over Vp = V rounded up to a
    multiple of 128, GPT-2's padding (classifier_weight below). Raises InputError for a shape the
    kernels cannot run, a norm_eps other than the one compiled into kernels/rmsnorm.cu, or another
    zero_stage."""

    def __init__(self, config, precision="fp32", attention="naive", matmul=None, zero_stage=0, process_rank=0,
                 num_processes=1, trainable=True, pad_vocab=False):
        cp = cuda.cupy()
        llama3_cpu.check_config(config)
        if precision not in PRECISIONS:
            raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision}")
        vec = vector_size(precision)
        if config.head_size % vec or config.hidden_dim % vec:
            raise InputError(f"the CUDA kernels need the head size {config.head_size} and the SwiGLU width "
                             f"{config.hidden_dim} to be whole multiples of {vec} in {precision}")
        if config.norm_eps != llama3_cpu.NORM_EPS:           # kernels/rmsnorm.cu compiles it in
            raise InputError(f"this model's RMSNorm epsilon is {config.norm_eps:g}; llama3_cuda.py's kernel has "
                             f"Llama 3's {llama3_cpu.NORM_EPS:g} built in (kernels/rmsnorm.cu's RMSNORM_EPS): "
                             "train it with llama3_cpu.py")
        self.config, self.precision = config, precision
        self.attention = attention_path(attention)
        self.matmul = matmul or Cublas()
        self.floatX = FLOATX_DTYPES[precision]
        self.param_shapes = llama3_cpu.parameter_shapes(config)
        self.num_parameters = n = num_elements(self.param_shapes)
        # -z 1 as gpt2_cuda.GPT2: m, v and the master weights hold this rank's shard of S floats;
        # params and grads stay whole, padded to num_processes * S for NCCL's equal counts (padding
        # 0, never read by the model). -z 0: S = n, no padding
        self.zero_stage = zero_stage
        self.shard = optimizer_shard(n, zero_stage, process_rank, num_processes)
        # The padded vocabulary: the classifier's GEMM reads wlmhead (V,C), the table's last tensor, as
        # (Vp,C), its Vp-V extra rows the zeros that follow it in an allocation (Vp-V)*C longer (the
        # ZeRO padding, else a tail of their own). They are in no parameter's view: AdamW, the norm,
        # the checkpoints and NCCL never see them, so they stay 0, the logits they give (masked out of
        # the softmax by fused_classifier) and those rows' gradients (0^T @ lnf) too.
        V, C = config.vocab_size, config.channels
        self.Vp = padded_vocab(V) if pad_vocab else V
        assert self.param_shapes[-1][0] == "wlmhead", "the classifier must end the flat buffer"
        length = max(self.shard.padded, n + (self.Vp - V) * C)
        params_alloc = cp.zeros(length, dtype=self.floatX)
        grads_alloc = cp.zeros(length, dtype=self.floatX) if trainable else None
        self.params_memory = params_alloc[:self.shard.padded]  # what NCCL moves (ZeRO-1's equal shards)
        self.grads_memory = grads_alloc[:self.shard.padded] if trainable else None
        self.params = self.params_memory[:n]                  # (n,) views: what the model uses
        self.grads = self.grads_memory[:n] if trainable else None
        self.P = tensor_views(self.params, self.param_shapes)
        self.G = tensor_views(self.grads, self.param_shapes) if trainable else dict.fromkeys(self.P)
        classifier = slice(n - V * C, n - V * C + self.Vp * C)
        self.classifier_weight = params_alloc[classifier].reshape(self.Vp, C)       # wlmhead and its zero rows
        self.classifier_grad = grads_alloc[classifier].reshape(self.Vp, C) if trainable else None
        S = self.shard.size if trainable else 0
        self.master = cp.zeros(S, dtype=np.float32) if precision == "bf16" and trainable else None
        self.m = cp.zeros(S, dtype=np.float32)
        self.v = cp.zeros(S, dtype=np.float32)
        HS, maxT = config.head_size, config.max_seq_len
        cos, sin = llama3_cpu.precompute_freqs_cis(HS, maxT, config.rope_theta, config.use_scaled_rope)
        self.freqs_cos = cp.asarray(cos.astype(np.float32))   # (maxT, HS/2): fp32, not floatX
        self.freqs_sin = cp.asarray(sin.astype(np.float32))
        # Llama 3 has no position embedding: gpt2_cuda's encoder kernel adds this (maxT, C) of zeros
        # (exactly +0: the embedding is wte's row, bit for bit)
        self.no_wpe = cp.zeros((maxT, config.channels), dtype=self.floatX)
        self.partial = cp.zeros(RMSNORM_BACKWARD_GRID * config.channels, dtype=np.float32)   # rmsnorm_backward's slots
        self.norm_partial = cp.zeros(GLOBAL_NORM_GRID, dtype=np.float32)
        self.norm = cp.zeros(NORM_VALUES, dtype=np.float32)          # the gradient norm, its clipping factor
        self.update = UpdateBuffers(self.param_shapes)                # AdamW's per-step values, on the device
        self.update_rng = SamplerRNG(UPDATE_SEED)     # seeds of stochastic rounding, one per tensor per step
        self.rng_state_last_update = self.update_rng.state   # saved in a checkpoint: a resume draws on from here
        self.views = {}                                # (B,T) -> name -> view
        self.graphs = {}                               # (B,T,loss_scale) -> captured CUDA graph (llama3_micro_batch)
        self.BT = None
        self.host_inputs = None
        self.has_targets = False
        self.lora = None                               # LoRA's adapters (llmc/lora_device.py) on a frozen model


def llama3_activations(model, B, T):
    """Named views of the activation buffers of (B,T), allocated at its first use (cached)."""
    if (B, T) not in model.views:
        cp = cuda.cupy()
        dtypes = {"X": model.floatX, "f32": np.dtype(np.float32), "i32": np.dtype(np.int32)}
        views = {name: cp.zeros(shape, dtype=dtypes[kind])
                 for name, shape, kind in activation_table(model.config, B, T, model.attention, model.Vp)}
        views.update({name: prefix(views[buffer], shape)
                      for name, buffer, shape in activation_aliases(model.config, B, T, model.attention)})
        model.views[(B, T)] = views
    return model.views[(B, T)]


def layer_params(P, l):
    """Layer l's 7 per-layer tensors (llama3_cpu.layer_params): name -> view (for G as well as P)."""
    return llama3_cpu.layer_params(P, l)


def rope_tables(model, T, pos=0):
    """The cos and sin rows (T,HS/2) of positions pos..pos+T-1: contiguous row slices of the tables,
    so the RoPE kernel, which rotates row t by the table's row t, turns them by their absolute positions."""
    return model.freqs_cos[pos:pos + T], model.freqs_sin[pos:pos + T]


def llama3_forward(model, inputs, targets=None):
    """Forward pass, llama3_cpu.llama3_forward's: inputs (B,T) int token ids (host numpy); targets
    (B,T) or None. Returns the logits (B,T,V) floatX on the device (a view into the `logits`
    buffer, valid until the backward overwrites it with dlogits); with targets, the losses (B,T)
    fp32 too. Raises InputError if T passes maxT or a token id is out of range."""
    B, T = upload_batch(model, inputs, targets)
    return forward_launches(model, B, T, targets is not None)


def upload_batch(model, inputs, targets):
    """The host half of llama3_forward and llama3_micro_batch (gpt2_cuda.upload_batch's): check the
    token ids, copy them (and the targets) into the int32 device buffers of their (B,T), and
    remember them for the backward's dwte segments. Returns (B,T). Raises InputError if T passes
    maxT or a token id is out of range."""
    inputs = np.asarray(inputs)
    B, T = inputs.shape
    check_inputs(model.config, inputs, targets)
    A = llama3_activations(model, B, T)
    A["inputs"].set(np.ascontiguousarray(inputs, dtype=np.int32))
    if targets is not None:
        A["targets"].set(np.ascontiguousarray(targets, dtype=np.int32))
        model.host_inputs = inputs
    model.BT, model.has_targets = (B, T), targets is not None
    return B, T


def forward_launches(model, B, T, with_loss, attention=None, pos=0):
    """The device half of llama3_forward: every launch of the forward pass, reading the token ids
    (and targets) upload_batch put on the device. Launches only, with the same arguments every call
    for a given (B,T), so that a CUDA graph can capture it (llama3_micro_batch): RoPE's tables are
    row slices of model.freqs_cos and freqs_sin, uploaded once when the model is built. attention,
    pos: as block_forward's (the sampler's cached attention at position pos). Returns the logits
    view (B,T,V) (of the (B,T,Vp) buffer: the padded columns left out)."""
    cfg = model.config
    C, L, V, Vp = cfg.channels, cfg.num_layers, cfg.vocab_size, model.Vp
    P, A = model.P, llama3_activations(model, B, T)
    encoder_forward(A["encoded"], A["inputs"], P["wte"], model.no_wpe, B, T, C)      # (B,T,C) = wte[inputs]
    for l in range(L):
        block_forward(model, A, l, B, T, attention, pos)
    # forward pass 3: final RMSNorm, untied classifier, softmax + cross-entropy (one kernel)
    rmsnorm_forward(A["lnf"], A["lnf_rstd"], A["residual3"][L - 1], P["lnfw"], B, T, C)
    logits = prefix(A["logits"], (B, T, Vp))
    model.matmul.forward(logits, A["lnf"], model.classifier_weight, None, B, T, C, Vp)   # (B,T,C) @ (C,Vp)
    if with_loss:
        fused_classifier(logits, A["losses"], A["targets"], 0.0, B, T, V, Vp, write_dlogits=False)
    return logits[..., :V]


def block_forward(model, A, l, B, T, attention=None, pos=0):
    """Block l, llama3_cpu.block_forward's launches, on the activations A of (B,T): from its input
    (encoded, or block l-1's residual3) to residual3[l]. attention: model.attention (the default),
    or the sampler's gpt2_cuda.CachedAttention; pos: the position of the first of the T rows (the
    sampler's cache length; 0 in training)."""
    cfg, P, mm = model.config, model.P, model.matmul
    C, NH, NKV, HS, H = cfg.channels, cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.hidden_dim
    QKV = qkv_channels(cfg)
    p = layer_params(P, l)
    attention = attention or model.attention
    cos, sin = rope_tables(model, T, pos)                                              # positions pos..pos+T-1
    residual = A["encoded"] if l == 0 else A["residual3"][l - 1]                       # (B,T,C)
    # forward pass 1: attention block
    rmsnorm_forward(A["ln1"][l], A["ln1_rstd"][l], residual, p["ln1w"], B, T, C)
    mm.forward(A["qkv_proj"][l], A["ln1"][l], p["qkvw"], None, B, T, C, QKV)          # (B,T,(NH+2NKV)*HS)
    if attention.grouped_kv:        # flash: q, k rotated straight into what it reads, the NKV heads in place
        rope_forward(attention.qkv(A, l, B, T, C), A["qkv_proj"][l], cos, sin, B, T, NH + 2 * NKV, NH + NKV, HS)
    else:                           # GPT-2's layout: each key and value head repeated for its query heads
        rope_forward(A["qkv_rope"], A["qkv_proj"][l], cos, sin, B, T, NH + 2 * NKV, NH + NKV, HS)   # q, k rotated
        repeat_kv_forward(attention.qkv(A, l, B, T, C), A["qkv_rope"], B, T, NH, NKV, HS)         # (B,T,3C)
    attention.forward(A, l, B, T, C, NH, mm.tf32, NKV)                                # atty[l] (B,T,C)
    mm.forward(A["attproj"], A["atty"][l], p["attprojw"], None, B, T, C, C)
    residual_forward(A["residual2"][l], residual, A["attproj"], B * T * C)
    # forward pass 2: SwiGLU MLP block
    rmsnorm_forward(A["ln2"][l], A["ln2_rstd"][l], A["residual2"][l], p["ln2w"], B, T, C)
    mm.forward(A["fch"][l], A["ln2"][l], p["fcw"], None, B, T, C, H)                   # (B,T,H)
    mm.forward(A["fch2"][l], A["ln2"][l], p["fcw2"], None, B, T, C, H)                 # (B,T,H)
    swiglu_forward(A["fch_swiglu"][l], A["fch"][l], A["fch2"][l], B * T * H)
    mm.forward(A["fcproj"], A["fch_swiglu"][l], p["fcprojw"], None, B, T, H, C)        # (B,T,C)
    residual_forward(A["residual3"][l], A["residual2"][l], A["fcproj"], B * T * C)


def llama3_mean_loss(model):
    """Mean of the last forward's per-position losses, as a Python float (a device sync)."""
    A = llama3_activations(model, *model.BT)
    return float(A["losses"].sum(dtype=np.float64)) / A["losses"].size


def llama3_backward(model, loss_scale=1.0):
    """Backward pass of the last llama3_forward (which must have had targets): accumulates the
    gradient of loss_scale * mean(losses) into model.grads, llama3_cpu.llama3_backward's passes in
    the same reverse order. The fused classifier writes the losses again (the same values) and
    dlogits in place."""
    if not model.has_targets:
        raise RuntimeError("llama3_backward needs a forward pass with targets")
    backward_launches(model, loss_scale, *upload_segments(model, padded=False))


def upload_segments(model, padded):
    """The host half of llama3_backward (gpt2_cuda.upload_segments'): sort the last forward's token
    ids into the dwte scatter-add's chunks (gpt2_cuda.wte_segments) and copy them into their
    device buffers. Returns (num_chunks, num_reduce), the counts the kernels are launched over;
    padded: every slot filled, empty chunks past the real ones, so that a CUDA graph's launches
    always have the same counts (the empty chunks change nothing)."""
    A = llama3_activations(model, *model.BT)
    seg, K, M = gpt2_cuda.wte_segments(model.host_inputs, padded)
    for name in seg._fields:
        A[name][:getattr(seg, name).size].set(getattr(seg, name))
    return K, M


def backward_launches(model, loss_scale, num_chunks, num_reduce):
    """The device half of llama3_backward: every launch of the backward pass of the (B,T) forward,
    the dwte segments already on the device (upload_segments' counts). Launches only, with the
    same arguments every call for given (B,T), loss_scale and counts: graph-capturable."""
    cfg = model.config
    B, T = model.BT
    C, L, NH, NKV, HS, H, V = (cfg.channels, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_size,
                               cfg.hidden_dim, cfg.vocab_size)
    QKV = qkv_channels(cfg)
    P, G, A = model.P, model.G, llama3_activations(model, B, T)
    partial, mm = model.partial, model.matmul
    cos, sin = rope_tables(model, T)

    # backward pass 3: cross-entropy and softmax (one kernel), classifier, final RMSNorm
    Vp = model.Vp
    logits = prefix(A["logits"], (B, T, Vp))                                            # dlogits, 0 past V
    fused_classifier(logits, A["losses"], A["targets"], loss_scale / (B * T), B, T, V, Vp, write_dlogits=True)
    mm.backward(A["dlnf"], model.classifier_grad, None, logits, A["lnf"], model.classifier_weight, partial, B, T, C, Vp)
    dresidual = A["dresidual"]
    dresidual.fill(0)                                                                   # rmsnorm_backward accumulates
    rmsnorm_backward(dresidual, G["lnfw"], partial, A["dlnf"], A["residual3"][L - 1], P["lnfw"], A["lnf_rstd"], B, T, C)
    for l in reversed(range(L)):
        p, g = layer_params(P, l), layer_params(G, l)
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
        # backward pass 2: SwiGLU MLP block. residual3 = residual2 + fcproj: dfcproj = dresidual
        mm.backward(A["dfch_swiglu"], g["fcprojw"], None, dresidual, A["fch_swiglu"][l], p["fcprojw"], partial,
                    B, T, H, C)
        swiglu_backward(A["dfch"], A["dfch2"], A["dfch_swiglu"], A["fch"][l], A["fch2"][l], B * T * H)   # dfch in place
        # ln2 feeds both c_fc and c_fc2: its gradient is the sum of the two
        mm.backward(A["dln2"], g["fcw"], None, A["dfch"], A["ln2"][l], p["fcw"], partial, B, T, C, H)
        mm.backward(A["dln2_gate"], g["fcw2"], None, A["dfch2"], A["ln2"][l], p["fcw2"], partial, B, T, C, H)
        residual_forward(A["dln2"], A["dln2"], A["dln2_gate"], B * T * C)
        rmsnorm_backward(dresidual, g["ln2w"], partial, A["dln2"], A["residual2"][l], p["ln2w"], A["ln2_rstd"][l],
                         B, T, C)
        # backward pass 1: attention block. residual2 = residual + attproj: dattproj = dresidual
        mm.backward(A["datty"], g["attprojw"], None, dresidual, A["atty"][l], p["attprojw"], partial, B, T, C, C)
        if model.attention.grouped_kv:                   # each kv head's gradient summed over its query heads
            model.attention.backward(A["dqkv"], A["datty"], A, l, B, T, C, NH, mm.tf32, NKV)   # (B,T,(NH+2NKV)*HS)
        else:
            model.attention.backward(A["dqkv_att"], A["datty"], A, l, B, T, C, NH, mm.tf32)    # (B,T,3C)
            repeat_kv_backward(A["dqkv"], A["dqkv_att"], B, T, NH, NKV, HS)              # (B,T,(NH+2NKV)*HS)
        rope_backward(A["dqkv"], A["dqkv"], cos, sin, B, T, NH + 2 * NKV, NH + NKV, HS)  # in place
        mm.backward(A["dln1"], g["qkvw"], None, A["dqkv"], A["ln1"][l], p["qkvw"], partial, B, T, C, QKV)
        rmsnorm_backward(dresidual, g["ln1w"], partial, A["dln1"], residual, p["ln1w"], A["ln1_rstd"][l], B, T, C)
    # backward of the encoder: encoded = wte[inputs]
    K, M = num_chunks, num_reduce
    encoder_backward(G["wte"], A["wte_partial"], dresidual, A["positions"], A["chunk_start"][:K + 1],
                     A["chunk_token"][:K], A["chunk_slot"][:K], A["reduce_start"][:M + 1], A["reduce_token"][:M], K, M,
                     B, T, C)


def micro_batch_launches(model, B, T, loss_scale, num_chunks, num_reduce):
    """The device work of one micro-batch, launches only (graph-capturable): the forward without
    the classifier, then the backward, whose fused classifier writes the losses (B,T) and dlogits
    in one pass."""
    forward_launches(model, B, T, with_loss=False)
    backward_launches(model, loss_scale, num_chunks, num_reduce)


def llama3_micro_batch(model, inputs, targets, loss_scale, cuda_graph=False):
    """One micro-batch of a training step (gpt2_cuda.gpt2_micro_batch's): inputs, targets (B,T)
    token ids on the host; the forward, and the backward accumulating the gradient of
    loss_scale * mean(losses) into model.grads; the losses (B,T) fp32 left in the `losses` buffer
    (llama3_mean_loss). The fused classifier runs once, in the backward. With cuda_graph the
    micro-batch's launches (dozens per layer) are captured into a CUDA graph per ((B,T),
    loss_scale) and replayed as one launch; the first micro-batch of each key runs eagerly (the
    warm-up: cuBLAS's workspace, cuDNN's plans and CuPy's memory pool are set up then, not inside
    the capture, which follows it). The host part, upload_batch's token ids and targets and upload_segments' dwte chunks
    padded to their fixed size, runs outside the graph into fixed device buffers; RoPE's tables
    are the model's, uploaded once. Both paths give bitwise the same results: the same kernels
    with the same arguments in the same order (the padding chunks do nothing). The capture needs
    a created stream as the current one (the legacy stream cannot capture) and nvmath-python's
    cuBLAS bindings (llmc.cuda.cuda_graph_unavailable_reason)."""
    cp = cuda.cupy()
    B, T = upload_batch(model, inputs, targets)
    if not cuda_graph:
        micro_batch_launches(model, B, T, loss_scale, *upload_segments(model, padded=False))
        return
    counts = upload_segments(model, padded=True)
    stream = cp.cuda.get_current_stream()
    key = (B, T, loss_scale)
    if key in model.graphs:
        model.graphs[key].launch(stream)
        return
    micro_batch_launches(model, B, T, loss_scale, *counts)                 # the warm-up: this micro-batch, eagerly
    model.graphs[key] = capture_graph(stream, lambda: micro_batch_launches(model, B, T, loss_scale, *counts))


# ----------------------------------------------------------------------------
# AdamW: gpt2_cuda's kernel, over Llama 3's tensors

def llama3_update(model, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale=1.0, nccl=None,
                  decayed=DECAYED_PARAMETERS):
    """One AdamW step (llama3_cpu.llama3_update's math; t is the 1-based step count):
    gpt2_cuda.gpt2_update over Llama 3's tensors, with weight decay on the tensors named in
    `decayed` only (llama3_cpu's DECAYED_PARAMETERS; a LoRA's adapters: all of them). It walks model.param_shapes in order, one adamw_update launch per
    tensor (with ZeRO-1 on the tensor's piece in this rank's shard, skipping tensors wholly in other
    ranks' shards), each tensor with its own stochastic-rounding seed from model.update_rng, drawn
    on every rank for every tensor (model.rng_state_last_update after the step: a checkpoint keeps
    it); with ZeRO-1 over several ranks nccl then all-gathers the updated shards into every rank's
    params."""
    gpt2_cuda.gpt2_update(model, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale, nccl, decayed)


# ----------------------------------------------------------------------------
# sampler: gpt2_cpu.generate with a KV cache on the device (llama3_cpu.llama3_generate's, on the GPU)
#
# The prompt runs once (the prefill), then each new token alone at the next position: RoPE rotates
# its q and k by the rows pos..pos+T-1 of the tables (rope_tables), the K/V repeat turns the
# projection into GPT-2's attention input, and gpt2_cuda's cached attention appends the new keys
# and values to the cache and attends to every position so far.

def kv_cache_new(config, B):
    """An empty gpt2_cpu.KVCache on the device (gpt2_cuda.kv_cache_new): k, v (L,B,NH,maxT,HS) fp32,
    the keys rotated by RoPE at their own positions. It holds the keys and values repeated to NH
    heads, not llama3_cpu.kv_cache_new's NKV: that is the layout repeat_kv_forward writes and
    gpt2_cuda's cached attention reads, so the sampler adds no kernel and no attention code. The
    price is NH/NKV times the memory of an NKV cache, small for one sequence of this project's
    models (llama3:d2: k and v, each 2 layers x 4 heads x 1024 positions x 32 floats, 2 MiB in all)."""
    return gpt2_cuda.kv_cache_new(config, B)


def llama3_forward_cached(model, inputs, cache):
    """llama3_cpu.llama3_forward_cached on the device: inputs (B,T) int token ids (host numpy) at
    positions cache.length..cache.length+T-1, their q and k rotated at those positions, attending
    to the cached keys and values and appending theirs (gpt2_cuda.CachedAttention); the training
    forward's blocks and buffers otherwise. Returns the last position's logits (B,V), float32 on
    the host. Raises InputError if the positions pass maxT or a token id is out of range."""
    inputs = np.asarray(inputs)
    B, T = inputs.shape
    pos = cache.length
    check_inputs(model.config, inputs, None, pos)
    llama3_activations(model, B, T)["inputs"].set(np.ascontiguousarray(inputs, dtype=np.int32))
    model.BT, model.has_targets = (B, T), False                                     # no backward follows
    logits = forward_launches(model, B, T, False, gpt2_cuda.CachedAttention(cache, pos), pos)   # (B,T,V)
    cache.length = pos + T
    return as_float32(logits[:, T - 1].get())                                       # (B,V) to the host


def sampling_forward(model):
    """gpt2_cpu.generate's forwards on this model (a gpt2_cpu.SamplingForward), for token ids on
    the host: full(x (1,window)) -> HostLogits (1,window,V) from llama3_forward without targets;
    cached(x (1,T), cache) -> logits (1,V) float32 on the host from llama3_forward_cached."""
    return SamplingForward(full=lambda x: HostLogits(llama3_forward(model, x)),
                           cached=lambda x, cache: llama3_forward_cached(model, x, cache),
                           new_cache=lambda: kv_cache_new(model.config, 1))


# ----------------------------------------------------------------------------
# checkpoints: gpt2_cuda's, with llama3_cpu.py's model file, so either Llama 3 trainer resumes the other's run

def save_model_checkpoint(out_dir, step, model, loader, sample_rng_state, process_rank=0, num_processes=1,
                          outliers=None):
    """Write the checkpoint of `step` from the device (gpt2_cuda.save_model_checkpoint): a Llama 3
    model file of the parameters the run computes with (floatX upcast to fp32, exact), this rank's
    state file with AdamW's m and v, the fp32 master weights in bf16 (with ZeRO-1 its shard of
    each), the RNG states and the loader's position. Returns the DONE_<step> path for the caller to
    write last."""
    return gpt2_cuda.save_model_checkpoint(out_dir, step, model, loader, sample_rng_state, process_rank,
                                           num_processes, outliers=outliers, write_model_file=write_checkpoint_model)


def load_model_checkpoint(out_dir, step, model, loader, process_rank=0, num_processes=1):
    """Resume from the checkpoint of `step` in out_dir, written by this trainer or llama3_cpu.py
    (gpt2_cuda.load_model_checkpoint): parameters (in bf16 the model file's values and the state's
    master weights, so the run resumes bit for bit), AdamW's m and v (this rank's state file; with
    ZeRO-1 its shard), the loader position, the stochastic-rounding RNG. Returns (step,
    sample_rng_state, state_path, the outlier detectors' state or None). Raises InputError for a
    missing or mismatched file (another -z or number of processes than a ZeRO-1 checkpoint's)."""
    return gpt2_cuda.load_model_checkpoint(out_dir, step, model, loader, process_rank, num_processes,
                                           read_model_file=read_checkpoint_model)


# ----------------------------------------------------------------------------
# training loop: llama3_cpu.train's, with this model's forward, backward and update on the device

def train(args):
    """llama3_cpu.train on the device, data-parallel as gpt2_cuda.train: the same flags and loop
    (zero_grad, forward + backward over the micro-batches, NCCL all-reduce of the gradients (-z 1:
    reduce-scatter to this rank's shard), the loss averaged over the ranks, clip to the global norm
    across them, AdamW (-z 1: on the shard, then all-gather)), validation, HellaSwag and samples
    (gpt2_cpu.generate with the KV cache, sampling_forward), checkpoints every -n steps and -y 1's
    resume from the newest (llama3_cpu.py's files, one state file per rank). Processes: mpiexec,
    or -pm tcp|fs (llmc.multinode). Returns the model. Raises InputError for the flags it cannot
    honour."""
    if args.lora_merge:                                  # host work only: llama3_cpu.py merges and writes the file
        return llama3_cpu.train(args)
    comm = multinode.init_process_group(args, agreement_of=agreement_config)   # -pm mpi|tcp|fs: rank, size, local rank
    run = TrainingRun(args, comm)
    device, _, capability = cuda.select_device(comm)
    nccl = comm.connect()                                # the NCCL communicator (None for one process)
    if args.cuda_graph:                                  # refused now, not at the first capture
        reason = cuda.cuda_graph_unavailable_reason()
        if reason:
            raise InputError(f"--cuda-graph 1: {reason}")
        graph_stream = cuda.cupy().cuda.Stream()         # a created stream: the legacy one cannot capture
        graph_stream.use()                               # (blocking: ordered after any work on the legacy stream)
    model = setup_model(args, capability, run.model_spec(), say=run.say, comm=comm)
    cuda.load_modules(KERNEL_FILES + model.attention.kernel_files, model.precision)

    def generate_ids(prompt, n, rng, on_token=None):
        return generate(model, prompt, n, rng, args.temperature, args.top_k, on_token, sampling_forward(model))

    if args.generate > 0:
        rng = SamplerRNG(args.sample_seed)
        return sample_from_prompt(args, lambda prompt, n, on_token: generate_ids(prompt, n, rng, on_token),
                                  model.config)
    if run.resuming:
        run.check_resumed_model(llama3_cpu.model_config(args.model), model.config)
    run.prepare(model.config)
    B, T = run.B, run.T

    def batch_loss(inputs, targets):                      # validation
        llama3_forward(model, inputs, targets)
        return llama3_mean_loss(model)

    def forward_losses(inputs, targets):                  # HellaSwag
        llama3_forward(model, inputs, targets)
        return llama3_activations(model, *inputs.shape)["losses"].get()

    if args.eval_only:
        run.evaluate_only(batch_loss, forward_losses)
        return model
    run.banner(model.config, model.num_parameters)
    cfg = model.config
    run.say(f"llama3: NKV={cfg.num_kv_heads} H={cfg.hidden_dim} rope_theta={cfg.rope_theta:g} "
            f"scaled_rope={int(cfg.use_scaled_rope)} norm_eps={cfg.norm_eps:g} | {model.precision}, "
            f"{model.attention.name} attention{' | CUDA graph' if args.cuda_graph else ''}"
            f"{f' | classifier over Vp={model.Vp}' if model.Vp != cfg.vocab_size else ''}")
    trained = model.lora or model                        # what the step updates (LoRA: the adapters only)
    if model.lora:
        run.say(lora_files.describe(model.lora, model.num_parameters))
    sample_rng = SamplerRNG(args.sample_seed)
    start_step, outliers = 0, None
    if run.resuming:
        start_step, sample_rng.state, state_path, outliers = load_model_checkpoint(
            args.output_dir, run.resume_step, model, run.train_loader, comm.rank, comm.size)
        run.say(f"resumed from {state_path} at step {start_step}")

    def sample(prompt, n):
        return generate_ids(prompt, n, sample_rng)

    if not run.start(start_step, outliers):
        run.sample_after_the_last_checkpoint(sample)
        return model

    def save(step):
        return save_model_checkpoint(args.output_dir, step, model, run.train_loader, sample_rng.state,
                                     comm.rank, comm.size, run.outlier_state())

    for step in range(start_step, run.num_steps + 1):
        if run.between_steps(step, batch_loss, forward_losses, sample, save):
            break
        # the training step
        t0 = time.perf_counter()
        gpt2_zero_grad(trained)
        loss = 0.0
        for _ in range(run.grad_accum_steps):
            if args.overfit_single_batch:
                run.train_loader.reset()
            inputs, targets = run.train_loader.next_batch()
            # forward + backward: eager, or a CUDA graph (captured once, replayed)
            llama3_micro_batch(model, inputs, targets, 1.0 / run.grad_accum_steps, bool(args.cuda_graph))
            loss += llama3_mean_loss(model) / run.grad_accum_steps
        if nccl is not None:
            gpt2_average_gradients(trained, nccl)        # data parallel (-z 1: this rank's shard)
        norm = gpt2_global_grad_norm(trained, comm)      # the same on every rank
        loss = comm.mean(loss)
        skip, zloss, zgrad = run.skip_update(loss, norm)
        grad_scale = args.grad_clip / norm if 0 < args.grad_clip < norm else 1.0
        lr = learning_rate_at(step, args.lr_schedule, args.learning_rate, args.warmup_iters, run.num_steps,
                              args.final_lr_frac)
        if not skip:
            llama3_update(trained, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, step + 1, grad_scale,
                          nccl, trained.decayed if model.lora else DECAYED_PARAMETERS)
        cuda.cupy().cuda.get_current_stream().synchronize()  # the step's time includes the update
        run.log_step(step, loss, norm, lr, time.perf_counter() - t0, zloss, zgrad)
        if args.log_gpu_every > 0 and (step + 1) % args.log_gpu_every == 0:
            run.say(gpu_status_line(device))
    if args.lora_save and comm.rank == 0:
        save_lora(args.lora_save, model, LORA_FAMILY, args.model)
        run.say(f"LoRA adapters written to {args.lora_save}")
    return model


# ----------------------------------------------------------------------------
# the command line: training, or --check (llmc/cuda_check.py), on a GPU or the emulated device

def parse_args(argv=None):
    """llama3_cpu.py's flags plus the GPU options (llmc.gpu_cli.build_parser) -> argparse.Namespace;
    -e names a Llama 3 model file or descriptor (default llama3_cpu.DEFAULT_MODEL)."""
    parser = gpu_cli.build_parser(llama3_cpu.LR_SCHEDULES, prog="llama3_cuda.py", gpt2_options=False,
                                  description="Train Llama 3 on NVIDIA GPUs (CuPy, our CUDA kernels, cuBLAS); "
                                              "llama3_cpu.py's flags plus GPU options.",
                                  model_help=llama3_cpu.MODEL_HELP)
    parser.set_defaults(model=llama3_cpu.DEFAULT_MODEL)
    parser.add_argument("--pad-vocab", type=int, default=0, choices=(0, 1),
                        help="1: the classifier's GEMM and logits over Vp = V rounded up to a multiple of 128, as "
                             "gpt2_cuda.py's (the padded logits masked out of the softmax, their rows' gradients 0); "
                             "the model, its files and its results are the same")
    lora_files.add_flags(parser, LORA_FAMILY.default_targets)
    if parser.parse_known_args(argv)[0].device == "cpu":   # the emulated device's reference: llama3_cpu.py, fp32
        parser.set_defaults(precision="fp32", tf32=0)
    return parser.parse_args(argv)


def setup_model(args, compute_capability, spec=None, say=print, comm=None):
    """The model on the device from `spec` (default -e: a Llama 3 model file, e.g. a checkpoint's, or
    a descriptor, llama3_cpu.build_model), in the precision and attention path of the flags (a
    fallback is reported through `say`), with -z's optimizer shard of this rank of comm (default: one
    process), its matmuls cuBLAS (TF32 from -f on compute capability 8.0)."""
    precision, tf32 = choose_precision(args.precision, args.tf32, compute_capability)
    host = llama3_cpu.build_model(spec or args.model, args.seed)              # fp32 on the host
    build_lora(args, host, LORA_FAMILY, args.seed)                            # --lora-*: host.lora, host frozen
    attention, fallback = resolve_attention(args.attention, precision, host.config.head_size)
    if fallback:
        say(f"llama3_cuda.py: {fallback}")
    rank, size = (comm.rank, comm.size) if comm is not None else (0, 1)
    model = Llama3(host.config, precision, attention, Cublas(tf32), args.zero_stage, rank, size,
                   trainable=host.lora is None, pad_vocab=bool(args.pad_vocab))
    upload_parameters(model, host.params)
    if host.lora is not None:
        attach_lora(model, host.lora, rank, size)
    return model


def check(args):
    """--check: one batch through llama3_cpu.py and the device (llmc.cuda_check.run_check); 0 if
    every tensor agrees."""
    _, _, capability = cuda.select_device(Comm())
    model = setup_model(args, capability)
    cuda.load_modules(KERNEL_FILES + model.attention.kernel_files, model.precision)
    return run_check(sys.modules[__name__], args, model, check_llama3_against_cpu)


def main(argv=None):
    """Command-line entry point. Returns the exit code: 0; 1 for bad input (one `error:` line) or a
    tensor out of tolerance; 2 without a CUDA GPU or CuPy."""
    args = parse_args(argv)
    cuda.use_device(args.device)
    if args.device == "cpu":
        print("llama3_cuda.py --device cpu: the CUDA kernels run on the emulated device (compiled by g++, each "
              "CUDA thread a fiber on the CPU): slow, and its timings say nothing about a GPU")
    reason = cuda.cuda_unavailable_reason()
    if reason:
        where = "the emulated device cannot run" if args.device == "cpu" else "no CUDA GPU found"
        print(f"llama3_cuda.py: {where} ({reason}); add --device cpu to run the same kernels on the emulated "
              f"device (slowly), or use llama3_cpu.py", file=sys.stderr)
        return 2
    return gpu_cli.with_memory_report(
        args, lambda: run_main(check if args.check else train, args, (InputError, KernelCompileError)))


if __name__ == "__main__":
    sys.exit(main())
