"""
llama3_cpu.py: Llama 3 training in pure NumPy, float32, with hand-derived gradients.

This file is the lesson "what changes from GPT-2 to Llama 3". Everything Llama 3 shares with
GPT-2 (the matmul, the causal attention core, residual additions, softmax + cross-entropy, AdamW,
the learning-rate schedules, the sampler) is imported from gpt2_cpu.py; what is written here is
only what differs, each new layer a forward/backward pair with its backward's math written out:
    RMSNorm             replaces LayerNorm: no mean subtracted, no bias
    RoPE                rotary position embedding of q and k, with Llama 3.1's frequency scaling,
                        replaces the learned position embedding wpe
    grouped-query attn  NKV < NH key/value heads, each shared by NH/NKV query heads (the K/V
                        repeat and its backward); after it, attention is GPT-2's
    SwiGLU              a gated MLP of three matrices (c_fc, c_fc2, c_proj), replaces GELU
    untied classifier   its own (V,C) matrix wlmhead; no biases anywhere; no vocabulary padding
LoRA fine-tuning is gpt2_cpu.py's (--lora-rank; doc/lora.md): this file only says which of its linear
layers take adapters (lora_targets: Hugging Face's q_proj, k_proj, ... as row ranges of its matrices).
The model follows llm.c's train_llama3.py (LLaMA 3.1, Meta's reference model): the same
parameters with the same meaning, so the model files of llm.c's train_llama3.py and
train_llama3.cu load here and the ones written here load there (doc/file_formats.md).

What it deliberately is not: fast, or a loader of Meta's weights (none can be fetched here; the
model family llama3:dX is random-init and small, with GPT-2's tokenizer and data). With Meta's
tokenizer instead (`python dev/data/tinyshakespeare.py --tokenizer-model tokenizer.model`, then
-i/-j the shards in data/tinyshakespeare_llama3/ and --tokenizer data/llama3_tokenizer.bin), a
descriptor's V is that tokenizer's (128,256), and --prompt is encoded with it.

Run it (after `make data`): `python llama3_cpu.py` trains a small Llama 3 (llama3:d4, 29M parameters,
25.7M of them the two untied (V,C) embeddings) from scratch on Shakespeare, 400 steps of B=4 x T=64
tokens, a step taking about as long as one of gpt2_cpu.py's d4, with gpt2_cpu.py's flags (`--help`):
    step    1/400 | loss 10.861682 | norm 6.0697 | lr 3.00e-04 | ...
with the validation loss (10.86 at the start, about 5.9 at the end) and a sample of generated text
every 100 steps.

Dimension legend (gpt2_cpu.py's, plus two):
    B, T, C, V, L, NH, HS, OC, maxT   as in gpt2_cpu.py (Vp = V: Llama 3 pads no vocabulary)
    NKV   number of key/value heads (grouped-query attention), NH % NKV == 0
    H     hidden width of the SwiGLU MLP (llm.c's hidden_dim; 4C in GPT-2)

Gradient convention (gpt2_cpu.py's): backward functions return the gradient of their input and
accumulate (+=) into the parameter gradients they are given; the residual stream's gradient is
accumulated explicitly in llama3_backward.
"""

import math
import sys
import time
from dataclasses import dataclass, fields

from llmc.interrupt import quiet_ctrl_c_while_importing
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback
from llmc.utils import require  # noqa: E402
require("llama3_cpu.py", "numpy")        # no NumPy (the environment not activated): one line, exit 1
import numpy as np  # noqa: E402

from gpt2_cpu import (ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, INIT_STD, LR_SCHEDULES, KVCache,
                      SamplingForward, attention_forward, attention_backward, build_lora, causal_softmax,
                      check_inputs, crossentropy_forward, crossentropy_softmax_backward, generate, gpt2_grad_norm,
                      gpt2_update, gpt2_zero_grad, learning_rate_at, linear_forward, lora_add_backward,
                      lora_add_forward, lora_layer, lora_merge, matmul_backward, matmul_forward, num_elements,
                      residual_backward, residual_forward, softmax_forward, tensor_views)
from llmc import lora as lora_files
from llmc.checkpoint import load_checkpoint, save_checkpoint
from llmc.cli import TrainingRun, build_parser, is_checkpoint_path, run_main, sample_from_prompt
from llmc.comm import Comm
from llmc.lora import LoraFamily, LoraTarget
from llmc.formats import (LLAMA3_LAYOUT_BRANCH, LLAMA3_LAYOUT_MASTER, read_llama3_model_file,  # noqa: F401
                          read_llama3_model_shape, write_llama3_model_file)
from llmc.sampler import SamplerRNG
from llmc.tokenizer import is_llama3_tokenizer, read_tokenizer
from llmc.utils import InputError

# ----------------------------------------------------------------------------
# constants of the math

NORM_EPS = 1e-5                        # RMSNorm epsilon of Llama 3 (LlamaConfig.norm_eps)
ROPE_THETA = 500000.0                  # RoPE base of Llama 3 (10000 in Su et al. 2021)
# Llama 3.1's RoPE frequency scaling (Meta's reference model, llm.c's apply_scaling): a channel
# pair whose wavelength is longer than the original context turns ROPE_SCALE_FACTOR times slower,
# fast pairs are kept, and those in between are blended (rope_frequencies)
ROPE_SCALE_FACTOR = 8
ROPE_LOW_FREQ_FACTOR = 1
ROPE_HIGH_FREQ_FACTOR = 4
ROPE_ORIGINAL_CONTEXT = 8192           # Llama 3's context length before 3.1's extension
FFN_DIM_MULTIPLIER = 1.3               # Llama 3 8B's SwiGLU width multiplier
FFN_MULTIPLE_OF = 1024                 # Llama 3 8B rounds the SwiGLU width up to a multiple of this
MLP_EXPANSION = 4                      # GPT-2's MLP is 4C wide; SwiGLU's 3 matrices take 2/3 of that (Shazeer 2020)

# ----------------------------------------------------------------------------
# model configuration

@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama 3, llm.c's LLama3Config (train_llama3.cu) with GPT2Config's names:
    the model file's header holds each field (llmc/formats.py)."""
    max_seq_len: int = 8192                 # maxT (llm.c's block_size)
    vocab_size: int = 128256                # V (n_vocab)
    num_layers: int = 32                    # L (n_layer)
    num_heads: int = 32                     # NH (n_head): query heads
    num_kv_heads: int = 8                   # NKV (n_kv_head): key/value heads
    channels: int = 4096                    # C (n_embd)
    multiple_of: int = FFN_MULTIPLE_OF      # H is rounded up to a multiple of this
    use_scaled_rope: bool = True            # Llama 3.1's RoPE frequency scaling
    ffn_dim_multiplier: float = FFN_DIM_MULTIPLIER
    norm_eps: float = NORM_EPS
    rope_theta: float = ROPE_THETA

    @property
    def padded_vocab_size(self):
        """Vp: Llama 3 pads nothing (128256 is already a multiple of 128), so Vp = V."""
        return self.vocab_size

    @property
    def head_size(self):
        """HS = C // NH, for query and key/value heads alike."""
        return self.channels // self.num_heads

    @property
    def hidden_dim(self):
        """H, the SwiGLU width, as Meta's reference computes it: 2/3 of 4C, times the multiplier,
        rounded up to a multiple of multiple_of (14336 for Llama 3 8B's C=4096)."""
        hidden = 2 * (MLP_EXPANSION * self.channels) // 3          # integer division, as Meta's int(2 * h / 3)
        hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def check_config(config):
    """Raise InputError unless the heads divide evenly: NH % NKV == 0, C % NH == 0, HS even (RoPE
    rotates channel pairs)."""
    NH, NKV, C = config.num_heads, config.num_kv_heads, config.channels
    if min(NH, NKV, C, config.num_layers, config.vocab_size, config.max_seq_len) <= 0 or NH % NKV or C % NH \
            or (C // NH) % 2:
        raise InputError(f"impossible Llama 3 shape: NH={NH} NKV={NKV} C={C} (need NH % NKV == 0, C % NH == 0 "
                         f"and an even head size)")


# descriptor -> (L, NH, NKV, C, multiple_of). Small random-init models with GPT-2's tokenizer
# (V=50257, maxT=1024), each with two query heads per key/value head, small enough for a CPU.
LLAMA3_DESCRIPTORS = {
    "llama3:d2": (2, 4, 2, 128, 32),        # H=448
    "llama3:d4": (4, 4, 2, 256, 64),        # H=896: the default CPU run
    "llama3:d6": (6, 6, 2, 384, 64),        # H=1344
}
GPT2_TOKENIZER_VOCAB = 50257
SMALL_MAX_SEQ_LEN = 1024
LLAMA3_8B = LlamaConfig()                   # Llama 3.1 8B's shape, the dataclass's defaults (32 GB in fp32)
DEFAULT_MODEL = "llama3:d4"
MODEL_HELP = f"Llama 3 model file .bin to start from, or a descriptor ({' '.join(LLAMA3_DESCRIPTORS)})"   # -e's


def config_from_descriptor(name, vocab_size=GPT2_TOKENIZER_VOCAB):
    """LlamaConfig for a descriptor (llama3:d4), of vocab_size tokens (GPT-2's, or the Llama 3
    tokenizer's: descriptor_vocab_size). Raises InputError."""
    if name not in LLAMA3_DESCRIPTORS:
        other = (" (a GPT-2 or GPT-3: train it with gpt2_cpu.py or gpt2_cuda.py)"
                 if name.startswith(("d", "gpt2:", "gpt3:")) or name in ("124M", "350M", "774M", "1558M") else "")
        raise InputError(f"unknown model '{name}'{other}: expected a Llama 3 model .bin file or one of "
                         f"{', '.join(LLAMA3_DESCRIPTORS)}")
    L, NH, NKV, C, multiple_of = LLAMA3_DESCRIPTORS[name]
    return LlamaConfig(max_seq_len=SMALL_MAX_SEQ_LEN, vocab_size=vocab_size, num_layers=L, num_heads=NH,
                       num_kv_heads=NKV, channels=C, multiple_of=multiple_of)


# ----------------------------------------------------------------------------
# parameter and activation tables: one flat buffer, named views (gpt2_cpu.tensor_views)

# train_llama3.py's tensor order. GPT-2's wpe and every bias are gone; fcw2 and wlmhead are new.
PARAMETER_NAMES = ("wte", "ln1w", "qkvw", "attprojw", "ln2w", "fcw", "fcw2", "fcprojw", "lnfw", "wlmhead")
# AdamW decays every matrix (train_llama3.py: p.dim() >= 2), never the RMSNorm weights (gpt2_update's `decayed`)
DECAYED_PARAMETERS = ("wte", "qkvw", "attprojw", "fcw", "fcw2", "fcprojw", "wlmhead")
RMSNORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")
RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw")   # init std scaled by 1/sqrt(2L), as GPT-2's


def qkv_channels(config):
    """Output channels of the qkv projection: NH query heads, NKV key and NKV value heads, (NH+2NKV)*HS."""
    return (config.num_heads + 2 * config.num_kv_heads) * config.head_size


def lora_targets(config):
    """Llama 3's linear layers LoRA can adapt (llmc.lora.LoraTarget), by Hugging Face's names: q_proj,
    k_proj and v_proj are row ranges of our fused qkvw (so each has its own adapter, as in PEFT), q's
    and k's rows rotated by RoPE; gate_proj is c_fc2 (fcw2, through SiLU), up_proj c_fc (fcw)."""
    C, H, HS = config.channels, config.hidden_dim, config.head_size
    q, kv = config.num_heads * HS, config.num_kv_heads * HS
    return [LoraTarget("self_attn.q_proj", "qkvw", slice(0, q), C, HS),
            LoraTarget("self_attn.k_proj", "qkvw", slice(q, q + kv), C, HS),
            LoraTarget("self_attn.v_proj", "qkvw", slice(q + kv, q + 2 * kv), C),
            LoraTarget("self_attn.o_proj", "attprojw", slice(0, C), C),
            LoraTarget("mlp.gate_proj", "fcw2", slice(0, H), C), LoraTarget("mlp.up_proj", "fcw", slice(0, H), C),
            LoraTarget("mlp.down_proj", "fcprojw", slice(0, C), H)]


# LlamaForCausalLM's layer names, PEFT's default targets for Llama, nn.Linear layers (W as ours)
LORA_FAMILY = LoraFamily(lora_targets, "model.layers.{l}.", ("q_proj", "v_proj"), fan_in_fan_out=False)


def parameter_shapes(config):
    """The 10 parameter tensors in train_llama3.py's order: list of (name, shape)."""
    V, C, L, H = config.vocab_size, config.channels, config.num_layers, config.hidden_dim
    return [
        ("wte", (V, C)),
        ("ln1w", (L, C)),
        ("qkvw", (L, qkv_channels(config), C)),
        ("attprojw", (L, C, C)),
        ("ln2w", (L, C)),
        ("fcw", (L, H, C)),             # c_fc: the linear branch of SwiGLU
        ("fcw2", (L, H, C)),            # c_fc2: the gate, through SiLU
        ("fcprojw", (L, C, H)),
        ("lnfw", (C,)),
        ("wlmhead", (V, C)),            # the classifier, untied from wte
    ]


def activation_shapes(config, B, T):
    """The activations of one forward pass, in forward order."""
    C, L, NH, V, H = config.channels, config.num_layers, config.num_heads, config.vocab_size, config.hidden_dim
    return [
        ("encoded", (B, T, C)),
        ("ln1", (L, B, T, C)), ("ln1_rstd", (L, B, T)),
        ("qkv", (L, B, T, qkv_channels(config))),
        ("qkv_att", (L, B, T, 3 * C)),  # q, k rotated, k and v repeated to NH heads: GPT-2's attention input
        ("att", (L, B, NH, T, T)), ("atty", (L, B, T, C)),
        ("attproj", (L, B, T, C)), ("residual2", (L, B, T, C)),
        ("ln2", (L, B, T, C)), ("ln2_rstd", (L, B, T)),
        ("fch", (L, B, T, H)), ("fch2", (L, B, T, H)), ("fch_swiglu", (L, B, T, H)),
        ("fcproj", (L, B, T, C)), ("residual3", (L, B, T, C)),
        ("lnf", (B, T, C)), ("lnf_rstd", (B, T)),
        ("logits", (B, T, V)), ("probs", (B, T, V)), ("losses", (B, T)),
    ]


# ----------------------------------------------------------------------------
# layers: the new ones, each a forward/backward pair, vectorized, any float dtype

def encoder_forward(inp, wte):
    """Token embedding only: Llama 3 has no position embedding (RoPE puts positions into q and k).
    inp (B,T) int token ids; wte (V,C) -> out (B,T,C), out[b,t] = wte[inp[b,t]]."""
    return wte[inp]


def encoder_backward(dwte, dout, inp):
    """Accumulate dwte (V,C) from dout (B,T,C): dwte[v] += the sum of dout[b,t] over every (b,t)
    with inp[b,t] == v (gpt2_cpu.encoder_backward without its wpe; dwte None: frozen, nothing to do)."""
    if dwte is None:
        return
    np.add.at(dwte, inp.ravel(), dout.reshape(-1, dout.shape[-1]))


def rmsnorm_forward(inp, weight, eps):
    """RMSNorm over the last axis (Zhang & Sennrich 2019, eq. 4): LayerNorm without the mean and
    the bias. inp (B,T,C); weight (C,) -> out (B,T,C), rstd (B,T)
    out = inp * rstd * weight, rstd = 1 / sqrt(mean(inp^2) + eps)."""
    ms = (inp * inp).mean(axis=-1)                            # (B,T) mean square
    rstd = 1.0 / np.sqrt(ms + eps)                            # (B,T)
    out = inp * rstd[..., None] * weight
    return out.astype(inp.dtype, copy=False), rstd.astype(inp.dtype, copy=False)


def rmsnorm_backward(dweight, dout, inp, weight, rstd):
    """Return dinp (B,T,C); accumulate dweight (C,).
    With norm = inp * rstd and dnorm = dout * weight: rstd = (mean(x^2) + eps)^(-1/2) depends on
    every x_j of the row, d rstd / d x_j = -rstd^3 x_j / C, so per row of C values
        dinp_j = rstd dnorm_j + sum_i dnorm_i x_i (-rstd^3 x_j / C)
               = rstd * (dnorm_j - norm_j * mean(dnorm * norm))
    term 1: the direct path; term 2: through rstd. LayerNorm's backward (gpt2_cpu.py) has one more
    term, through the mean, which RMSNorm does not subtract."""
    norm = inp * rstd[..., None]                              # (B,T,C)
    dnorm = dout * weight                                     # (B,T,C)
    if dweight is not None:                                   # None: frozen (LoRA's base)
        dweight += (dout * norm).sum(axis=(0, 1))
    dinp = dnorm - norm * (dnorm * norm).mean(axis=-1, keepdims=True)
    return dinp * rstd[..., None]


def rope_frequencies(HS, theta, use_scaled_rope):
    """The HS/2 rotation frequencies of RoPE (Su et al. 2021, eq. 15), float64:
    freq_i = theta^(-2i/HS), i = 0..HS/2-1, channel pair (2i, 2i+1) turning by t * freq_i at position t.
    use_scaled_rope: Llama 3.1's scaling. A pair whose wavelength 2 pi / freq is shorter than
    ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR keeps its frequency; one longer than
    ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR turns ROPE_SCALE_FACTOR times slower; in between
    the two are blended with smooth = (ROPE_ORIGINAL_CONTEXT / wavelen - low) / (high - low):
    freq' = (1 - smooth) freq / ROPE_SCALE_FACTOR + smooth freq (continuous at both ends)."""
    freqs = theta ** -(np.arange(0, HS, 2, dtype=np.float64) / HS)       # (HS/2,)
    if not use_scaled_rope:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR
    high_freq_wavelen = ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR
    smooth = (ROPE_ORIGINAL_CONTEXT / wavelen - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
    blended = (1 - smooth) * freqs / ROPE_SCALE_FACTOR + smooth * freqs
    return np.where(wavelen < high_freq_wavelen, freqs,
                    np.where(wavelen > low_freq_wavelen, freqs / ROPE_SCALE_FACTOR, blended))


def precompute_freqs_cis(HS, maxT, theta, use_scaled_rope):
    """RoPE's tables (llm.c's precompute_freqs_cis, as cos and sin instead of complex numbers):
    cos, sin (maxT, HS/2) float64, of the angle t * freq_i at positions t = 0..maxT-1."""
    angle = np.outer(np.arange(maxT, dtype=np.float64), rope_frequencies(HS, theta, use_scaled_rope))
    return np.cos(angle), np.sin(angle)


def rope_forward(inp, cos, sin):
    """Rotary position embedding (Su et al. 2021, eq. 34): rotate each channel pair
    (x_2i, x_2i+1) of every head at position t by the angle t * freq_i.
    inp (B,T,nh,HS) (nh: NH query or NKV key heads); cos, sin (T,HS/2) the rows of the T
    positions -> out (B,T,nh,HS):
        out_2i   = x_2i cos - x_2i+1 sin
        out_2i+1 = x_2i sin + x_2i+1 cos
    (the pairs are adjacent channels, as in Meta's reference and llm.c's model files)."""
    B, T, nh, HS = inp.shape
    x = inp.reshape(B, T, nh, HS // 2, 2)
    xe, xo = x[..., 0], x[..., 1]                             # (B,T,nh,HS/2) each
    c, s = cos[None, :, None, :], sin[None, :, None, :]       # (1,T,1,HS/2) broadcast over B and heads
    out = np.stack([xe * c - xo * s, xe * s + xo * c], axis=-1)   # (B,T,nh,HS/2,2)
    return out.reshape(B, T, nh, HS).astype(inp.dtype, copy=False)


def rope_backward(dout, cos, sin):
    """Return dinp (B,T,nh,HS) from dout (B,T,nh,HS). The forward multiplies each pair by the
    rotation matrix R = [[cos, -sin], [sin, cos]]; the gradient goes back through its transpose,
    the rotation by minus the angle:
        dx_2i   =  dout_2i cos + dout_2i+1 sin
        dx_2i+1 = -dout_2i sin + dout_2i+1 cos
    RoPE has no parameters."""
    return rope_forward(dout, cos, -sin)


def repeat_kv_forward(inp, n_rep):
    """Grouped-query attention's K/V repeat (Ainslie et al. 2023): every key/value head serves
    n_rep = NH/NKV consecutive query heads. inp (B,T,NKV,HS) -> out (B,T,NKV*n_rep,HS),
    out[:, :, h] = inp[:, :, h // n_rep]. (With NKV = NH it is a copy: multi-head attention.)"""
    return np.repeat(inp, n_rep, axis=2)


def repeat_kv_backward(dout, n_rep):
    """Return dinp (B,T,NKV,HS) from dout (B,T,NKV*n_rep,HS). A kv head feeds n_rep query heads,
    so its gradient is the sum of theirs: dinp[:, :, j] = sum_r dout[:, :, j*n_rep + r]."""
    B, T, NH, HS = dout.shape
    return dout.reshape(B, T, NH // n_rep, n_rep, HS).sum(axis=3)


def silu(x):
    """SiLU (swish), x * sigmoid(x) (Elfwing et al. 2018; Ramachandran et al. 2017)."""
    return x / (1.0 + np.exp(-x))


def swiglu_forward(fch, fch2):
    """SwiGLU's gating (Shazeer 2020, FFN_SwiGLU): fch, fch2 (B,T,H), the outputs of c_fc and
    c_fc2 -> out (B,T,H) = fch * silu(fch2)."""
    return fch * silu(fch2)


def swiglu_backward(dout, fch, fch2):
    """Return (dfch, dfch2), both (B,T,H), from dout (B,T,H). With sig = sigmoid(fch2):
        out = fch * silu(fch2)  =>  dfch  = dout * silu(fch2)
                                    dfch2 = dout * fch * silu'(fch2),
        silu'(x) = d(x sig(x))/dx = sig + x sig (1 - sig) = sig (1 + x (1 - sig))."""
    sig = 1.0 / (1.0 + np.exp(-fch2))
    dfch = dout * fch2 * sig
    dfch2 = dout * fch * sig * (1.0 + fch2 * (1.0 - sig))
    return dfch, dfch2


def split_qkv(qkv, NH, NKV):
    """(B,T,(NH+2NKV)*HS) -> q (B,T,NH,HS), k, v (B,T,NKV,HS): views, no copies (train_llama3.py's
    split of c_attn's output: all query heads, then the key heads, then the value heads)."""
    B, T, QKV = qkv.shape
    HS = QKV // (NH + 2 * NKV)
    q = qkv[..., :NH * HS].reshape(B, T, NH, HS)
    k = qkv[..., NH * HS:(NH + NKV) * HS].reshape(B, T, NKV, HS)
    v = qkv[..., (NH + NKV) * HS:].reshape(B, T, NKV, HS)
    return q, k, v


def merge_heads(*heads):
    """Arrays (B,T,nh_i,HS) -> (B,T,sum_i nh_i*HS): split_qkv's inverse, the heads side by side."""
    B, T = heads[0].shape[:2]
    return np.concatenate([h.reshape(B, T, -1) for h in heads], axis=-1)


# ----------------------------------------------------------------------------
# the model: parameters, init, forward, backward (zero_grad, the grad norm and the AdamW update
# over the flat buffer are gpt2_cpu's: gpt2_update, given DECAYED_PARAMETERS)

class Llama3:
    """A Llama 3: its config, one flat buffer each for the parameters and their gradients (AdamW's
    m and v are allocated at the first update) with named views into each, and RoPE's cos and sin
    tables (maxT, HS/2), computed once. `dtype` is float32 for training; float64 is for gradient
    checks."""

    def __init__(self, config, dtype=np.float32):
        check_config(config)
        self.config = config
        self.param_shapes = parameter_shapes(config)
        self.num_parameters = num_elements(self.param_shapes)
        self.params = np.zeros(self.num_parameters, dtype=dtype)
        self.grads = np.zeros(self.num_parameters, dtype=dtype)
        self.P = tensor_views(self.params, self.param_shapes)     # name -> view into params
        self.G = tensor_views(self.grads, self.param_shapes)      # name -> view into grads
        cos, sin = precompute_freqs_cis(config.head_size, config.max_seq_len, config.rope_theta,
                                        config.use_scaled_rope)
        self.freqs_cos, self.freqs_sin = cos.astype(dtype), sin.astype(dtype)
        self.m = self.v = None
        self.lora = None                                          # LoRA adapters (the model then frozen)
        self.acts = None
        self.acts_BT = None
        self.inputs = self.targets = None
        self.mean_loss = None

    def activations(self, B, T):
        """Named views of one flat activation buffer, (re)allocated when (B, T) changes."""
        if self.acts_BT != (B, T):
            shapes = activation_shapes(self.config, B, T)
            self.acts = tensor_views(np.empty(num_elements(shapes), self.params.dtype), shapes)
            self.acts_BT = (B, T)
        return self.acts


def llama3_init(config, seed=42, dtype=np.float32):
    """A fresh Llama 3 with GPT-2's initialization (gpt2_cpu.gpt2_init; train_llama3.py only
    loads Meta's weights): matrices ~ N(0, 0.02^2), the two residual output projections
    (attprojw, fcprojw) ~ N(0, (0.02/sqrt(2L))^2), RMSNorm weights 1. Draws come from
    np.random.default_rng(seed), float32, tensor by tensor in table order."""
    model = Llama3(config, dtype)
    rng = np.random.default_rng(seed)
    for name, shape in model.param_shapes:
        view = model.P[name]
        if name in RMSNORM_WEIGHTS:
            view[...] = 1.0
        else:
            std = INIT_STD / math.sqrt(2 * config.num_layers) if name in RESIDUAL_PROJECTIONS else INIT_STD
            view[...] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    return model


def layer_params(P, l):
    """Layer l's 7 per-layer tensors: a dict name -> view (for G as well as P; a frozen model's G: None)."""
    return {name: None if P[name] is None else P[name][l] for name in PARAMETER_NAMES[1:8]}


def block_forward(residual, p, cos, sin, config, lora=None):
    """One Llama 3 block (pre-norm, like GPT-2's) on the residual stream residual (B,T,C) with
    layer l's parameters p (layer_params) and RoPE's rows cos, sin (T,HS/2) of the T positions;
    lora: layer l's LoRA adapters or None (gpt2_cpu.block_forward's). Returns the block's
    activations, name -> array, in forward order (activation_shapes' names); "residual3" is the
    next block's input."""
    NH, NKV, eps = config.num_heads, config.num_kv_heads, config.norm_eps
    lora, a = lora or {}, {}
    # forward pass 1: attention block
    a["ln1"], a["ln1_rstd"] = rmsnorm_forward(residual, p["ln1w"], eps)
    a["qkv"] = matmul_forward(a["ln1"], p["qkvw"], None)                     # (B,T,(NH+2NKV)*HS)
    lora_add_forward(a["qkv"], a["ln1"], lora.get("qkvw", ()))               # q's, k's, v's adapters, if any
    q, k, v = split_qkv(a["qkv"], NH, NKV)                                    # (B,T,NH,HS), (B,T,NKV,HS) x2
    q, k = rope_forward(q, cos, sin), rope_forward(k, cos, sin)               # positions into q and k
    k, v = repeat_kv_forward(k, NH // NKV), repeat_kv_forward(v, NH // NKV)   # (B,T,NH,HS) each
    a["qkv_att"] = merge_heads(q, k, v)                                       # (B,T,3C): GPT-2's layout
    a["atty"], a["att"] = attention_forward(a["qkv_att"], NH)                 # (B,T,C), (B,NH,T,T)
    a["attproj"] = matmul_forward(a["atty"], p["attprojw"], None)
    lora_add_forward(a["attproj"], a["atty"], lora.get("attprojw", ()))
    a["residual2"] = residual_forward(residual, a["attproj"])
    # forward pass 2: SwiGLU MLP block
    a["ln2"], a["ln2_rstd"] = rmsnorm_forward(a["residual2"], p["ln2w"], eps)
    a["fch"] = matmul_forward(a["ln2"], p["fcw"], None)                       # (B,T,H)
    lora_add_forward(a["fch"], a["ln2"], lora.get("fcw", ()))
    a["fch2"] = matmul_forward(a["ln2"], p["fcw2"], None)                     # (B,T,H)
    lora_add_forward(a["fch2"], a["ln2"], lora.get("fcw2", ()))
    a["fch_swiglu"] = swiglu_forward(a["fch"], a["fch2"])
    a["fcproj"] = matmul_forward(a["fch_swiglu"], p["fcprojw"], None)         # (B,T,C)
    lora_add_forward(a["fcproj"], a["fch_swiglu"], lora.get("fcprojw", ()))
    a["residual3"] = residual_forward(a["residual2"], a["fcproj"])
    return a


def llama3_forward(model, inputs, targets=None):
    """Forward pass. inputs (B,T) int token ids; targets (B,T) or None. Returns logits (B,T,V).
    With targets it also computes probs and the per-position losses, and sets model.mean_loss.
    Every activation is kept in model.acts for the backward pass.
    Raises InputError if T passes maxT or a token id (input or target) is out of range."""
    cfg = model.config
    B, T = inputs.shape
    check_inputs(cfg, inputs, targets)
    P, A = model.P, model.activations(B, T)
    cos, sin = model.freqs_cos[:T], model.freqs_sin[:T]                      # (T,HS/2): positions 0..T-1
    model.inputs, model.targets = inputs, targets
    A["encoded"][...] = encoder_forward(inputs, P["wte"])                    # (B,T,C)
    residual = A["encoded"]
    for l in range(cfg.num_layers):
        block = block_forward(residual, layer_params(P, l), cos, sin, cfg, lora_layer(model, l))
        for name, value in block.items():
            A[name][l] = value                                                # kept for the backward
        residual = A["residual3"][l]
    # forward pass 3: final RMSNorm, untied classifier, softmax, cross-entropy
    A["lnf"][...], A["lnf_rstd"][...] = rmsnorm_forward(residual, P["lnfw"], cfg.norm_eps)
    matmul_forward(A["lnf"], P["wlmhead"], None, out=A["logits"])            # (B,T,C) @ (C,V) -> (B,T,V)
    if targets is not None:
        softmax_forward(A["logits"], cfg.vocab_size, out=A["probs"])
        A["losses"][...] = crossentropy_forward(A["probs"], targets)
        model.mean_loss = float(A["losses"].mean(dtype=np.float64))
    else:
        model.mean_loss = None
    return A["logits"]


def llama3_backward(model, loss_scale=1.0):
    """Backward pass of the last llama3_forward (which must have had targets): accumulates the
    gradient of loss_scale * mean(losses) into model.grads, or with LoRA into model.lora.grads
    (gpt2_cpu.gpt2_backward's contract)."""
    if model.targets is None:
        raise RuntimeError("llama3_backward needs a forward pass with targets")
    cfg = model.config
    L, NH, NKV = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
    P, G, A = model.P, model.G, model.acts
    B, T = model.inputs.shape
    cos, sin = model.freqs_cos[:T], model.freqs_sin[:T]

    # backward pass 3: cross-entropy, softmax, classifier, final RMSNorm
    dlosses = np.full((B, T), loss_scale / (B * T), dtype=model.params.dtype)  # d(mean loss)/d(losses)
    dlogits = crossentropy_softmax_backward(dlosses, A["probs"], model.targets)  # (B,T,V)
    dlnf = matmul_backward(G["wlmhead"], None, dlogits, A["lnf"], P["wlmhead"])  # (B,T,C)
    dresidual = rmsnorm_backward(G["lnfw"], dlnf, A["residual3"][L - 1], P["lnfw"], A["lnf_rstd"])
    for l in reversed(range(L)):
        p, g, lora = layer_params(P, l), layer_params(G, l), lora_layer(model, l) or {}
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
        # backward pass 2: SwiGLU MLP block. residual3 = residual2 + fcproj
        dresidual, dfcproj = residual_backward(dresidual)
        dfch_swiglu = matmul_backward(g["fcprojw"], None, dfcproj, A["fch_swiglu"][l], p["fcprojw"])
        lora_add_backward(dfch_swiglu, dfcproj, A["fch_swiglu"][l], lora.get("fcprojw", ()))
        dfch, dfch2 = swiglu_backward(dfch_swiglu, A["fch"][l], A["fch2"][l])
        # ln2 feeds both c_fc and c_fc2: its gradient is the sum of the two
        dln2 = (matmul_backward(g["fcw"], None, dfch, A["ln2"][l], p["fcw"])
                + matmul_backward(g["fcw2"], None, dfch2, A["ln2"][l], p["fcw2"]))
        lora_add_backward(dln2, dfch, A["ln2"][l], lora.get("fcw", ()))
        lora_add_backward(dln2, dfch2, A["ln2"][l], lora.get("fcw2", ()))
        dresidual = dresidual + rmsnorm_backward(g["ln2w"], dln2, A["residual2"][l], p["ln2w"], A["ln2_rstd"][l])
        # backward pass 1: attention block. residual2 = residual + attproj
        dresidual, dattproj = residual_backward(dresidual)
        datty = matmul_backward(g["attprojw"], None, dattproj, A["atty"][l], p["attprojw"])
        lora_add_backward(datty, dattproj, A["atty"][l], lora.get("attprojw", ()))
        dqkv_att = attention_backward(datty, A["qkv_att"][l], A["att"][l], NH)  # (B,T,3C)
        dq, dk, dv = split_qkv(dqkv_att, NH, NH)                              # (B,T,NH,HS) each
        dk, dv = repeat_kv_backward(dk, NH // NKV), repeat_kv_backward(dv, NH // NKV)  # (B,T,NKV,HS)
        dq, dk = rope_backward(dq, cos, sin), rope_backward(dk, cos, sin)
        dqkv = merge_heads(dq, dk, dv)                                        # (B,T,(NH+2NKV)*HS)
        dln1 = matmul_backward(g["qkvw"], None, dqkv, A["ln1"][l], p["qkvw"])
        lora_add_backward(dln1, dqkv, A["ln1"][l], lora.get("qkvw", ()))
        dresidual = dresidual + rmsnorm_backward(g["ln1w"], dln1, residual, p["ln1w"], A["ln1_rstd"][l])
    # backward of the encoder: encoded = wte[inputs]
    encoder_backward(G["wte"], dresidual, model.inputs)



# ----------------------------------------------------------------------------
# model files: llm.c's Llama 3 model file (llmc/formats.py), mapped to and from the parameter table

def file_tensors(model):
    """The model's parameters as the model file stores them, {name: array}: the table's tensors
    but fcw and fcw2, which the file stacks per layer into one fcw (L, 2H, C)."""
    P = model.P
    tensors = {name: P[name] for name in PARAMETER_NAMES if name not in ("fcw", "fcw2")}
    tensors["fcw"] = np.concatenate([P["fcw"], P["fcw2"]], axis=1)          # (L,H,C) + (L,H,C) -> (L,2H,C)
    return tensors


def ffn_dim_multiplier_for(C, H, multiple_of):
    """An ffn_dim_multiplier with which a model of C channels gets the SwiGLU width H (hidden_dim),
    for a model file that lost it (llm.c master's layout stores int(1.3) = 1): Llama 3's own
    FFN_DIM_MULTIPLIER when it gives H, else (H + 1/4) / (2/3 of 4C), whose product int()s to H,
    a multiple of multiple_of already. Raises InputError if H is not a multiple of multiple_of."""
    for multiplier in (FFN_DIM_MULTIPLIER, (H + 0.25) / (2 * (MLP_EXPANSION * C) // 3)):
        if LlamaConfig(channels=C, multiple_of=multiple_of, ffn_dim_multiplier=multiplier).hidden_dim == H:
            return multiplier
    raise InputError(f"a SwiGLU width of {H} is not a multiple of multiple_of {multiple_of}: not a Llama 3")


def config_from_header(shape):
    """LlamaConfig from a model file's header dict (llmc.formats.read_llama3_model_shape); from
    llm.c master's layout, ffn_dim_multiplier recovered from the file's SwiGLU width."""
    header = {k: v for k, v in shape.items() if k not in ("layout", "hidden_dim")}
    if header["ffn_dim_multiplier"] is None:
        header["ffn_dim_multiplier"] = ffn_dim_multiplier_for(shape["channels"], shape["hidden_dim"],
                                                              shape["multiple_of"])
    return LlamaConfig(**header)


def read_model(path, dtype=np.float32):
    """A Llama3 from llm.c's Llama 3 model file (fp32 version 3, or bf16 version 5 upcast to
    fp32). Raises InputError."""
    shape, tensors = read_llama3_model_file(path, lambda shape: config_from_header(shape).hidden_dim)
    model = Llama3(config_from_header(shape), dtype)
    H = model.config.hidden_dim
    for name in PARAMETER_NAMES:
        if name == "fcw2":
            model.P[name][...] = tensors["fcw"][:, H:]
        elif name == "fcw":
            model.P[name][...] = tensors["fcw"][:, :H]
        else:
            model.P[name][...] = tensors[name]
    return model


def write_model(path, model, dtype="float32", layout=LLAMA3_LAYOUT_BRANCH):
    """Write the model as llm.c's Llama 3 model file: dtype "float32" (version 3) or "bfloat16" (5);
    layout LLAMA3_LAYOUT_BRANCH (train_llama3.cu's, two headers) or LLAMA3_LAYOUT_MASTER (llm.c
    master's train_llama3.py write_model; doc/file_formats.md says what it loses)."""
    write_llama3_model_file(path, model.config, file_tensors(model), dtype, layout)


def write_checkpoint_model(path, config, params):
    """save_checkpoint's model writer: the flat fp32 parameters params as a Llama 3 model file."""
    model = Llama3(config)
    model.params[...] = params
    write_model(path, model)


def read_checkpoint_model(path, num_parameters_of=None):
    """load_checkpoint's model reader: (header dict, flat fp32 parameters in table order)."""
    model = read_model(path)
    return {f.name: getattr(model.config, f.name) for f in fields(LlamaConfig)}, model.params


def descriptor_vocab_size(tokenizer_path):
    """A descriptor model's V: the tokenizer file's vocabulary when it is Llama 3's (e.g. 128,256;
    dev/data/tinyshakespeare.py --tokenizer-model writes it), else GPT-2's 50,257."""
    try:
        token_bytes, first_token = read_tokenizer(tokenizer_path)
    except InputError:                                    # none (yet): GPT-2's data and samples as ids
        return GPT2_TOKENIZER_VOCAB
    return len(token_bytes) if is_llama3_tokenizer(token_bytes, first_token) else GPT2_TOKENIZER_VOCAB


def build_model(spec, seed, vocab_size=GPT2_TOKENIZER_VOCAB):
    """-e: a Llama 3 model file (fp32 or bf16), or a descriptor (llama3:d4) for a fresh llama3_init
    of vocab_size tokens."""
    return read_model(spec) if is_checkpoint_path(spec) else llama3_init(config_from_descriptor(spec, vocab_size), seed)


def model_config(spec, vocab_size=GPT2_TOKENIZER_VOCAB):
    """The LlamaConfig that -e names, without building the model (a model file's header is read)."""
    if is_checkpoint_path(spec):
        return config_from_header(read_llama3_model_shape(spec))
    return config_from_descriptor(spec, vocab_size)


# ----------------------------------------------------------------------------
# sampler: gpt2_cpu.generate, with this model's forward and a KV cache of NKV heads
#
# GQA's saving is the cache: it keeps the NKV key/value heads, rotated by RoPE at their own
# positions, and repeats them to NH heads only when a query reads them.

def kv_cache_new(config, B, dtype=np.float32):
    """An empty gpt2_cpu.KVCache for B sequences of up to maxT positions: k, v (L,B,maxT,NKV,HS)."""
    shape = (config.num_layers, B, config.max_seq_len, config.num_kv_heads, config.head_size)
    return KVCache(np.zeros(shape, dtype), np.zeros(shape, dtype))


def attention_forward_cached(qkv, k_cache, v_cache, pos, cos, sin, NH, NKV):
    """The attention of T new positions pos..pos+T-1: qkv (B,T,(NH+2NKV)*HS) their projection;
    k_cache, v_cache (B,maxT,NKV,HS) with positions 0..pos-1 filled; cos, sin (T,HS/2) their RoPE
    rows -> out (B,T,C). The new keys (rotated) and values are written at pos..pos+T-1, then the
    queries attend to every key up to their own position (gpt2_cpu.causal_softmax)."""
    B, T, _ = qkv.shape
    q, k, v = split_qkv(qkv, NH, NKV)
    q, k = rope_forward(q, cos, sin), rope_forward(k, cos, sin)
    k_cache[:, pos:pos + T], v_cache[:, pos:pos + T] = k, v
    keys = repeat_kv_forward(k_cache[:, :pos + T], NH // NKV).transpose(0, 2, 1, 3)      # (B,NH,pos+T,HS)
    values = repeat_kv_forward(v_cache[:, :pos + T], NH // NKV).transpose(0, 2, 1, 3)
    att = causal_softmax(q.transpose(0, 2, 1, 3), keys, pos)                              # (B,NH,T,pos+T)
    out = att @ values                                                                    # (B,NH,T,HS)
    return out.transpose(0, 2, 1, 3).reshape(B, T, NH * q.shape[-1])


def llama3_forward_cached(model, inputs, cache):
    """The sampler's forward pass (gpt2_cpu.gpt2_forward_cached's contract): inputs (B,T) at
    positions cache.length..cache.length+T-1 -> the logits (B,V) of the last position; their keys
    and values are appended to cache. Raises InputError if the positions pass maxT or an id is out of range."""
    cfg = model.config
    B, T = inputs.shape
    pos, P, eps = cache.length, model.P, cfg.norm_eps
    check_inputs(cfg, inputs, None, pos)
    cos, sin = model.freqs_cos[pos:pos + T], model.freqs_sin[pos:pos + T]
    residual = encoder_forward(inputs, P["wte"])                                          # (B,T,C)
    for l in range(cfg.num_layers):
        p, lora = layer_params(P, l), lora_layer(model, l) or {}
        qkv = linear_forward(rmsnorm_forward(residual, p["ln1w"], eps)[0], p["qkvw"], None, lora.get("qkvw", ()))
        atty = attention_forward_cached(qkv, cache.k[l], cache.v[l], pos, cos, sin, cfg.num_heads, cfg.num_kv_heads)
        residual = residual_forward(residual, linear_forward(atty, p["attprojw"], None, lora.get("attprojw", ())))
        ln2 = rmsnorm_forward(residual, p["ln2w"], eps)[0]
        fch_swiglu = swiglu_forward(linear_forward(ln2, p["fcw"], None, lora.get("fcw", ())),
                                    linear_forward(ln2, p["fcw2"], None, lora.get("fcw2", ())))
        residual = residual_forward(residual, linear_forward(fch_swiglu, p["fcprojw"], None, lora.get("fcprojw", ())))
    lnf = rmsnorm_forward(residual[:, T - 1:], P["lnfw"], eps)[0]                         # (B,1,C): the last position
    cache.length = pos + T
    return matmul_forward(lnf, P["wlmhead"], None)[:, 0]                                  # (B,V)


def sampling_forward(model):
    """gpt2_cpu.generate's forwards on this model: llama3_forward, and llama3_forward_cached."""
    return SamplingForward(full=lambda x: llama3_forward(model, x),
                           cached=lambda x, cache: llama3_forward_cached(model, x, cache),
                           new_cache=lambda: kv_cache_new(model.config, 1, model.params.dtype))


def llama3_generate(model, prompt, max_new_tokens, rng, temperature=1.0, top_k=0, on_token=None, kv_cache=True):
    """gpt2_cpu.generate on this model: the same sampler, this model's forwards. Returns the new ids."""
    return generate(model, prompt, max_new_tokens, rng, temperature, top_k, on_token, sampling_forward(model), kv_cache)


# ----------------------------------------------------------------------------
# training loop: gpt2_cpu.train's, with this model's forward, backward and update

def train(args):
    """Train (or, with --eval-only / --generate, evaluate / sample) as the flags say; the step is
    gpt2_cpu.train's: zero_grad, forward + backward over the micro-batches, average across
    processes, clip, AdamW. Returns the model."""
    comm = Comm()
    run = TrainingRun(args, comm)
    vocab_size = descriptor_vocab_size(args.tokenizer)
    model = build_model(run.model_spec(), args.seed, vocab_size)
    build_lora(args, model, LORA_FAMILY, args.seed)       # --lora-*: adapters on a frozen model
    if args.lora_merge:                                   # merge --lora-load's adapters into -e, write it
        lora_merge(model.P, model.lora)
        write_model(args.lora_merge, model)
        run.say(f"merged the adapters of {args.lora_load} into {args.model}: wrote {args.lora_merge}")
        return model
    if args.generate > 0:
        rng = SamplerRNG(args.sample_seed)
        return sample_from_prompt(args, lambda prompt, n, on_token: llama3_generate(
            model, prompt, n, rng, args.temperature, args.top_k, on_token), model.config)
    if run.resuming:
        run.check_resumed_model(model_config(args.model, vocab_size), model.config)
    run.prepare(model.config)

    def batch_loss(inputs, targets):                      # validation
        llama3_forward(model, inputs, targets)
        return model.mean_loss

    def forward_losses(inputs, targets):                  # HellaSwag
        llama3_forward(model, inputs, targets)
        return model.acts["losses"]

    if args.eval_only:
        run.evaluate_only(batch_loss, forward_losses)
        return model
    run.banner(model.config, model.num_parameters)
    cfg = model.config
    run.say(f"llama3: NKV={cfg.num_kv_heads} H={cfg.hidden_dim} rope_theta={cfg.rope_theta:g} "
            f"scaled_rope={int(cfg.use_scaled_rope)} norm_eps={cfg.norm_eps:g}")
    trained = model.lora or model                         # what the step updates (LoRA: the adapters only)
    if model.lora:
        run.say(lora_files.describe(model.lora, model.num_parameters))
    sample_rng = SamplerRNG(args.sample_seed)
    start_step, outliers = 0, None
    if run.resuming:
        st = load_checkpoint(args.output_dir, run.resume_step, comm.rank, comm.size, None,
                             read_model_file=read_checkpoint_model)
        model.params[...], model.m, model.v = st["params"], st["m"], st["v"]
        run.train_loader.restore(st["loader"])
        sample_rng.state, start_step, outliers = st["sample_rng_state"], st["step"], st["outliers"]
        run.say(f"resumed from {st['state_path']} at step {start_step}")

    def sample(prompt, n):
        return llama3_generate(model, prompt, n, sample_rng)

    if not run.start(start_step, outliers):
        run.sample_after_the_last_checkpoint(sample)
        return model

    def save(step):
        m = model.m if model.m is not None else np.zeros_like(model.params)
        v = model.v if model.v is not None else np.zeros_like(model.params)
        return save_checkpoint(args.output_dir, step, model.config, model.params, m, v, run.train_loader,
                               sample_rng.state, comm.rank, comm.size, outliers=run.outlier_state(),
                               write_model_file=write_checkpoint_model)

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
            llama3_forward(model, inputs, targets)
            llama3_backward(model, loss_scale=1.0 / run.grad_accum_steps)
            loss += model.mean_loss / run.grad_accum_steps
        comm.mean_(trained.grads)                         # data parallel: average over processes
        loss = comm.mean(loss)
        norm = gpt2_grad_norm(trained)
        skip, zloss, zgrad = run.skip_update(loss, norm)
        grad_scale = args.grad_clip / norm if 0 < args.grad_clip < norm else 1.0
        lr = learning_rate_at(step, args.lr_schedule, args.learning_rate, args.warmup_iters, run.num_steps,
                              args.final_lr_frac)
        if not skip:
            gpt2_update(trained, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, step + 1, grad_scale,
                        decayed=trained.decayed if model.lora else DECAYED_PARAMETERS)
        run.log_step(step, loss, norm, lr, time.perf_counter() - t0, zloss, zgrad)
    if args.lora_save and comm.rank == 0:
        lora_files.save(args.lora_save, model.lora, cfg.num_layers, LORA_FAMILY, args.model)
        run.say(f"LoRA adapters written to {args.lora_save}")
    return model


def parse_args(argv=None):
    """The command line (argv: list of str, default sys.argv[1:]) -> argparse.Namespace: gpt2_cpu.py's
    flags, -e naming a Llama 3 model file or descriptor (default DEFAULT_MODEL)."""
    parser = build_parser("llama3_cpu.py", "Train Llama 3 in NumPy (the llm.cupy reference for Llama 3).", LR_SCHEDULES,
                          model_help=MODEL_HELP)
    parser.set_defaults(model=DEFAULT_MODEL)
    lora_files.add_flags(parser, LORA_FAMILY.default_targets)
    return parser.parse_args(argv)


def main(argv=None):
    """Command-line entry point. Returns the exit code: 0; 1 with one `error:` line for bad input."""
    try:
        args = parse_args(argv)
    except SystemExit as e:                               # --help (0), or a bad flag (1, its error line printed)
        return e.code
    return run_main(train, args)


if __name__ == "__main__":
    sys.exit(main())
