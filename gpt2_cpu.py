"""
gpt2_cpu.py: GPT-2 training in pure NumPy, float32, with hand-derived gradients.

This file *defines* the algorithm of llm.cupy, in reading order: the model's shape and its
parameter table, the layers (each a forward/backward pair written out by hand, no autograd),
LoRA's low-rank adapters for fine-tuning a frozen model (doc/lora.md), the model, AdamW, the
learning-rate schedules, the sampler, and the training loop. It is the Python twin of llm.c's
train_gpt2.c and the reference the CUDA trainer (gpt2_cuda.py) is checked against, layer by layer.
Everything else (file formats, data loader, tokenizer, checkpoints, MPI, logging, the command
line) is host infrastructure in llmc/, as llm.c keeps it in llmc/*.h.

What it deliberately is not: fast on big models, or clever. No Python loops over B, T or heads
(everything is vectorized NumPy), but no fusion and no mixed precision either.

Run it (after `make data`): `python gpt2_cpu.py` trains a small GPT-2 (d4, 16M parameters) from
scratch on Shakespeare, 400 steps of B=4 x T=64 tokens in about two minutes on 2 CPU cores:
    step    1/400 | loss 10.925585 | norm 6.6749 | lr 3.00e-04 | 316.7 ms | 808 tok/s
with the validation loss (10.9 at the start, about 6.1 at the end) and a sample of generated
text every 100 steps. `--help` lists every flag (llm.c's one-letter flags, with long aliases).
Step through one training step in a debugger: `python -m pdb gpt2_cpu.py -x 1 -v 0 -s 0`.

Dimension legend (used in every shape comment):
    B     batch size (sequences per micro-batch)
    T     sequence length (tokens per sequence), T <= maxT
    C     channels (embedding width)
    V     vocabulary size (50257 for GPT-2)
    Vp    padded vocabulary size (V rounded up to a multiple of 128: 50304)
    L     number of transformer layers
    NH    number of attention heads
    HS    head size, C // NH
    OC    output channels of a matmul
    maxT  longest sequence the position embedding covers (1024 for GPT-2)

Gradient convention: backward functions *return* the gradient of their input (written fresh,
`=`) and *accumulate* (`+=`) into the parameter gradients they are given, so that gradient
accumulation over micro-batches is just calling backward again. The residual stream's gradient
is accumulated explicitly in gpt2_backward.
"""

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmc.interrupt import quiet_ctrl_c_while_importing
quiet_ctrl_c_while_importing(__name__)   # Ctrl-C while the packages below load: exit 130, no traceback
from llmc.utils import require  # noqa: E402
require("gpt2_cpu.py", "numpy")          # no NumPy (the environment not activated): one line, exit 1
import numpy as np  # noqa: E402

from llmc.checkpoint import load_checkpoint, save_checkpoint
from llmc.cli import TrainingRun, build_parser, is_checkpoint_path, run_main, sample_from_prompt
from llmc.comm import Comm
from llmc.formats import read_model_file, read_model_shape, write_model_file
from llmc import lora as lora_files
from llmc.lora import LoraFamily, LoraTarget, lora_tensor_names
from llmc.sampler import SamplerRNG, sample_token
from llmc.utils import InputError

# ----------------------------------------------------------------------------
# constants of the math

LN_EPS = 1e-5                          # LayerNorm epsilon, as in GPT-2
GELU_SCALING_FACTOR = math.sqrt(2.0 / math.pi)
GELU_CUBIC_COEFF = 0.044715            # tanh-approximation GELU (Hendrycks & Gimpel 2016)
INIT_STD = 0.02                        # GPT-2 weight init std (Radford et al. 2019)
VOCAB_PAD_MULTIPLE = 128               # Vp is V rounded up to this (tensor-core friendly)
ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS = 0.9, 0.95, 1e-8   # llm.c's CUDA trainer defaults
ADAMW_CHUNK = 1 << 15                  # floats per AdamW slice (speed only): 5 arrays of it fit a core's L2 cache

# ----------------------------------------------------------------------------
# model configuration

@dataclass(frozen=True)
class GPT2Config:
    """The shape of a GPT-2, as the checkpoint header stores it (slots 2-7)."""
    max_seq_len: int = 1024       # maxT
    vocab_size: int = 50257       # V
    padded_vocab_size: int = 50304  # Vp: V padded up to a multiple of 128
    num_layers: int = 12          # L
    num_heads: int = 12           # NH
    channels: int = 768           # C


def padded_vocab(V):
    """V rounded up to a multiple of VOCAB_PAD_MULTIPLE (50257 -> 50304)."""
    return (V + VOCAB_PAD_MULTIPLE - 1) // VOCAB_PAD_MULTIPLE * VOCAB_PAD_MULTIPLE


# The model descriptors of -e, llm.c's three forms (train_gpt2.cu, gpt_build_from_descriptor):
#   "dX" (legacy) and "gpt2:dX"   a GPT-2 of depth X, maxT 1024
#   "gpt3:cX"                     a GPT-3 of X channels, maxT 2048
# A GPT-3 here is a GPT-2 with GPT-3's hyperparameters (Brown et al. 2020, Table 2.1), as in llm.c:
# the same layers and the same dense causal attention in every layer; GPT-3's alternating dense and
# locally banded sparse attention is deliberately not implemented. Both use GPT-2's tokenizer (V).
GPT2_MAX_SEQ_LEN = 1024                # maxT of GPT-2 (Radford et al. 2019)
GPT3_MAX_SEQ_LEN = 2048                # maxT of GPT-3 (Brown et al. 2020)

# GPT-2 depth -> (L, NH, C). d12..d48 are the GPT-2 sizes; d6, d60, d72, d84 are llm.c's
# unofficial ones (gpt2_set_hyperparameters); d2 and d4 are this project's, small enough to train
# on a 2-core CPU.
MODEL_DESCRIPTORS = {
    "d2": (2, 4, 128),      # 6,966,784 params, 6.4M of them the (tied) token embedding
    "d4": (4, 4, 256),      # 16,299,520 params: the default CPU run
    "d6": (6, 6, 384),      # 30,357,504 params: llm.c's gpt2-tiny, nanoGPT's Shakespeare "baby GPT" shape
    "d12": (12, 12, 768),   # GPT-2 124M
    "d24": (24, 16, 1024),  # GPT-2 350M
    "d36": (36, 20, 1280),  # GPT-2 774M
    "d48": (48, 25, 1600),  # GPT-2 1558M
    "d60": (60, 30, 1920),  # llm.c's 2.7B
    "d72": (72, 30, 2880),  # llm.c's 7.3B
    "d84": (84, 36, 3456),  # llm.c's 12.2B
}
MODEL_SIZES = {"124M": "d12", "350M": "d24", "774M": "d36", "1558M": "d48"}

# GPT-3 channels C -> (L, HS), NH = C // HS: llm.c's gpt3_set_hyperparameters, which names a GPT-3
# by its width because GPT-3's depths repeat (24 layers for 350M, 760M and 1.3B).
GPT3_DESCRIPTORS = {
    384: (6, 64),      # llm.c's gpt3-tiny (31M)
    768: (12, 64),     # GPT-3 Small (125M)
    1024: (24, 64),    # GPT-3 Medium (350M)
    1536: (24, 96),    # GPT-3 Large (760M)
    2048: (24, 128),   # GPT-3 XL (1.3B)
    2560: (32, 80),    # GPT-3 2.7B
    4096: (32, 128),   # GPT-3 6.7B
    12288: (96, 128),  # GPT-3 175B
}
# llm.c's table also has 5140 -> (40, 128), the 13B row of the GPT-3 paper, whose d_model 5140 is
# not 40 heads x 128 (= 5120); 5140 / 128 is not whole, and llm.c stops on its own assert. We
# refuse it in one line rather than guess which of the paper's numbers is the typo.
GPT3_BROKEN = {5140: "GPT-3 13B: llm.c's head size 128 does not divide 5140 channels "
                     "(the paper's 40 x 128 is 5120)"}


def descriptor_forms():
    """The accepted descriptors, in words, for an error message."""
    depths = " ".join(d[1:] for d in MODEL_DESCRIPTORS)
    widths = " ".join(map(str, GPT3_DESCRIPTORS))
    return (f"a GPT-2 dX or gpt2:dX with depth X in {depths}, a GPT-3 gpt3:cX with channels X in {widths}, "
            f"or a GPT-2 size {' '.join(MODEL_SIZES)}")


def config_from_descriptor(name):
    """GPT2Config for a descriptor: "d12" or "gpt2:d12" (GPT-2, by depth), "gpt3:c768" (GPT-3, by
    channels) or a GPT-2 size ("124M"). V is GPT-2's 50257 and Vp 50304 for all of them.
    Raises InputError for any other name, in one line that lists the accepted ones."""
    key = MODEL_SIZES.get(name, name)
    if key.startswith("gpt2:d"):
        key = key[len("gpt2:"):]
    if key in MODEL_DESCRIPTORS:
        L, NH, C = MODEL_DESCRIPTORS[key]
        return GPT2Config(max_seq_len=GPT2_MAX_SEQ_LEN, num_layers=L, num_heads=NH, channels=C)
    width = key[len("gpt3:c"):]
    if key.startswith("gpt3:c") and width.isdigit() and width.isascii():
        C = int(width)
        if C in GPT3_BROKEN:
            raise InputError(f"model '{name}' is refused: {GPT3_BROKEN[C]}")
        if C in GPT3_DESCRIPTORS:
            L, HS = GPT3_DESCRIPTORS[C]
            return GPT2Config(max_seq_len=GPT3_MAX_SEQ_LEN, num_layers=L, num_heads=C // HS, channels=C)
    other = " (a Llama 3: train it with llama3_cpu.py or llama3_cuda.py)" if name.startswith("llama3:") else ""
    raise InputError(f"unknown model '{name}'{other}: expected a .bin file, {descriptor_forms()}")


# ----------------------------------------------------------------------------
# parameter and activation tables: one flat buffer, named views

PARAMETER_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
                   "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
# AdamW decays the matmul weights and the embeddings, never biases or LayerNorm
DECAYED_PARAMETERS = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")
LAYERNORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")
RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw")   # init std scaled by 1/sqrt(2L)


def parameter_shapes(config):
    """The 16 parameter tensors in checkpoint-file order: list of (name, shape)."""
    Vp, C, L, maxT = config.padded_vocab_size, config.channels, config.num_layers, config.max_seq_len
    return [
        ("wte", (Vp, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)),
        ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


def activation_shapes(config, B, T):
    """The activations of one forward pass, in forward order (llm.c's names)."""
    C, L, NH, Vp = config.channels, config.num_layers, config.num_heads, config.padded_vocab_size
    return [
        ("encoded", (B, T, C)),
        ("ln1", (L, B, T, C)), ("ln1_mean", (L, B, T)), ("ln1_rstd", (L, B, T)),
        ("qkv", (L, B, T, 3 * C)), ("att", (L, B, NH, T, T)), ("atty", (L, B, T, C)),
        ("attproj", (L, B, T, C)), ("residual2", (L, B, T, C)),
        ("ln2", (L, B, T, C)), ("ln2_mean", (L, B, T)), ("ln2_rstd", (L, B, T)),
        ("fch", (L, B, T, 4 * C)), ("fch_gelu", (L, B, T, 4 * C)),
        ("fcproj", (L, B, T, C)), ("residual3", (L, B, T, C)),
        ("lnf", (B, T, C)), ("lnf_mean", (B, T)), ("lnf_rstd", (B, T)),
        ("logits", (B, T, Vp)), ("probs", (B, T, Vp)), ("losses", (B, T)),
    ]


def tensor_views(flat, shapes):
    """Split a flat 1-D buffer into named, reshaped views (no copies), in table order."""
    views, offset = {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        views[name] = flat[offset:offset + n].reshape(shape)
        offset += n
    assert offset == flat.size, "table does not cover the buffer"
    return views


def num_elements(shapes):
    """Total number of elements of a (name, shape) table."""
    return sum(math.prod(shape) for _, shape in shapes)


# ----------------------------------------------------------------------------
# layers: each a forward/backward pair, vectorized, any float dtype

def encoder_forward(inp, wte, wpe):
    """Token plus position embedding.
    inp (B,T) int token ids; wte (Vp,C); wpe (maxT,C) -> out (B,T,C), out[b,t] = wte[inp[b,t]] + wpe[t].
    Source: Radford et al. 2018/2019 (GPT, GPT-2), learned absolute positions."""
    T = inp.shape[1]
    return wte[inp] + wpe[:T]                      # (B,T,C) + (T,C) broadcast


def encoder_backward(dwte, dwpe, dout, inp):
    """Accumulate dwte (Vp,C) and dwpe (maxT,C) from dout (B,T,C). Nothing to return:
    the token ids have no gradient. (dwte None: the embeddings are frozen, nothing to do.)
    out[b,t] = wte[inp[b,t]] + wpe[t]  =>  dwte[v] += sum of dout[b,t] over all (b,t) with inp[b,t]==v,
                                           dwpe[t] += sum_b dout[b,t]."""
    if dwte is None:
        return
    T = inp.shape[1]
    np.add.at(dwte, inp.ravel(), dout.reshape(-1, dout.shape[-1]))  # unbuffered scatter-add: repeated ids sum
    dwpe[:T] += dout.sum(axis=0)


def layernorm_forward(inp, weight, bias):
    """LayerNorm over the last axis (Ba, Kiros & Hinton 2016).
    inp (B,T,C); weight, bias (C,) -> out (B,T,C), mean (B,T), rstd (B,T)
    out = (inp - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + LN_EPS) (biased variance)."""
    mean = inp.mean(axis=-1)                                  # (B,T)
    xc = inp - mean[..., None]                                # (B,T,C)
    var = (xc * xc).mean(axis=-1)                             # (B,T)
    rstd = 1.0 / np.sqrt(var + LN_EPS)                        # (B,T)
    out = xc * rstd[..., None] * weight + bias
    return out.astype(inp.dtype, copy=False), mean, rstd.astype(inp.dtype, copy=False)


def layernorm_backward(dweight, dbias, dout, inp, weight, mean, rstd):
    """Return dinp (B,T,C); accumulate dweight, dbias (C,).
    With norm = (inp - mean) * rstd and dnorm = dout * weight, differentiating through mean and
    rstd (both functions of inp) gives, per row of C values:
        dinp = rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
    term 1: the direct path; term 2: through the mean; term 3: through the variance.
    Derivation: doc/layernorm.md. (dweight, dbias None: frozen, not computed.)"""
    norm = (inp - mean[..., None]) * rstd[..., None]          # (B,T,C)
    dnorm = dout * weight                                     # (B,T,C)
    if dweight is not None:
        dbias += dout.sum(axis=(0, 1))
        dweight += (dout * norm).sum(axis=(0, 1))
    dinp = dnorm - dnorm.mean(axis=-1, keepdims=True) - norm * (dnorm * norm).mean(axis=-1, keepdims=True)
    return dinp * rstd[..., None]


def matmul_forward(inp, weight, bias, out=None):
    """Linear layer, PyTorch nn.Linear layout.
    inp (B,T,C); weight (OC,C); bias (OC,) or None -> out (B,T,OC) = inp @ weight.T + bias.
    The (B,T) rows are flattened into one (B*T,C) matrix: one BLAS call instead of B smaller ones
    (NumPy loops over the leading axis of a 3-D operand), about 1.4x faster here. out: a contiguous
    (B,T,OC) array to write into (a new 51 MB logits array costs page faults and a copy), or None."""
    B, T, C = inp.shape
    OC = weight.shape[0]
    out2 = np.matmul(inp.reshape(B * T, C), weight.T,        # (B*T,C) @ (C,OC) -> (B*T,OC)
                     out=None if out is None else out.reshape(B * T, OC))
    if bias is not None:
        out2 += bias
    return out2.reshape(B, T, OC)


def matmul_backward(dweight, dbias, dout, inp, weight):
    """Return dinp (B,T,C); accumulate dweight (OC,C) and dbias (OC,) (either may be None: a frozen
    parameter, LoRA's base, whose gradient is not computed).
    out = inp @ weight.T + bias  =>  dinp = dout @ weight; dweight += dout^T @ inp; dbias += sum dout."""
    B, T, C = inp.shape
    OC = weight.shape[0]
    dout2 = dout.reshape(B * T, OC)                           # (B*T,OC)
    if dweight is not None:
        dweight += dout2.T @ inp.reshape(B * T, C)            # (OC,B*T) @ (B*T,C) -> (OC,C)
    if dbias is not None:
        dbias += dout2.sum(axis=0)
    return (dout2 @ weight).reshape(B, T, C)                  # (B*T,OC) @ (OC,C) -> (B*T,C)


def split_heads(qkv, NH):
    """(B,T,3C) -> q, k, v each (B,NH,T,HS): views, no copies."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    qkv = qkv.reshape(B, T, 3, NH, HS)
    return (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def causal_scores(q, keys, pos=0):
    """The scaled scores q k^T / sqrt(HS) of T queries q (B,NH,T,HS) against the keys (B,NH,n,HS)
    -> (B,NH,T,n), a key after its query set to -inf (the causal mask), so its probability is
    exactly 0 (and so is its gradient). In training n = T and query t sits at position t; the
    sampler's queries sit at positions pos..pos+T-1 after pos cached keys (n = pos+T)."""
    HS = q.shape[3]
    scores = (q @ keys.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(HS))   # (B,NH,T,HS) @ (B,NH,HS,n)
    future = np.triu(np.ones_like(scores[0, 0], dtype=bool), pos + 1)   # (T,n): key j > position pos+t
    np.copyto(scores, -np.inf, where=future)                            # in place: the dtype stays
    return scores


def causal_softmax(q, keys, pos=0):
    """The attention probabilities softmax_j(causal_scores) (B,NH,T,n), the row maximum subtracted
    first (a query's own key is never masked, so the maximum is finite)."""
    att = causal_scores(q, keys, pos)
    att -= att.max(axis=-1, keepdims=True)
    att = np.exp(att)
    att /= att.sum(axis=-1, keepdims=True)
    return att


def attention_forward(qkv, NH):
    """Causal multi-head self-attention on the fused QKV projection (Vaswani et al. 2017, eq. 1).
    qkv (B,T,3C) holding [q | k | v] -> out (B,T,C), att (B,NH,T,T)
    att = softmax(q k^T / sqrt(HS) + causal mask) (causal_softmax), out = att v with the heads
    concatenated."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = split_heads(qkv, NH)                           # each (B,NH,T,HS)
    att = causal_softmax(q, k)                                # (B,NH,T,T)
    out = att @ v                                             # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    return out.transpose(0, 2, 1, 3).reshape(B, T, C), att


def attention_backward(dout, qkv, att, NH):
    """Return dqkv (B,T,3C) from dout (B,T,C), the forward's qkv (B,T,3C) and att (B,NH,T,T).
    Undoing the forward (causal_softmax, then att @ v) in reverse:
        out = att @ v          =>  datt = dout @ v^T,  dv = att^T @ dout
        att = softmax(scores)  =>  dscores = att * (datt - sum_j(datt * att))   (softmax Jacobian)
        scores = s q k^T       =>  dq = s dscores @ k,  dk = s dscores^T @ q,  s = 1/sqrt(HS)
    Masked entries have att == 0, so dscores is 0 there without an explicit mask."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    HS = C // NH
    scale = 1.0 / math.sqrt(HS)
    q, k, v = split_heads(qkv, NH)                           # each (B,NH,T,HS)
    dout_h = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B,NH,T,HS)
    datt = dout_h @ v.transpose(0, 1, 3, 2)                   # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    dv = att.transpose(0, 1, 3, 2) @ dout_h                   # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    dscores = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    dq = (dscores @ k) * scale                                # (B,NH,T,T) @ (B,NH,T,HS)
    dk = (dscores.transpose(0, 1, 3, 2) @ q) * scale
    dqkv = np.stack([dq, dk, dv], axis=2)                     # (B,NH,3,T,HS)
    return dqkv.transpose(0, 3, 2, 1, 4).reshape(B, T, C3)    # -> (B,T,3,NH,HS) -> (B,T,3C)


def gelu_forward(inp):
    """GELU, tanh approximation (Hendrycks & Gimpel 2016, eq. in sec. 2), as in GPT-2:
    out = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi). Any shape. Each statement is one
    pass over the array, in place on one temporary: 2x faster than a new array per operator."""
    u = inp * inp; u *= GELU_SCALING_FACTOR * GELU_CUBIC_COEFF; u += GELU_SCALING_FACTOR
    u *= inp                                                  # u = s (x + c x^3) = x (s + s c x^2)
    np.tanh(u, out=u); u += 1.0; u *= inp; u *= 0.5           # 0.5 x (1 + tanh(u))
    return u


def gelu_backward(dout, inp):
    """Return dinp = dout * gelu'(inp). With u = s (x + 0.044715 x^3) and t = tanh(u):
        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2)
    term 1: through the leading x; term 2: through tanh. In place, as gelu_forward."""
    x2 = inp * inp                                            # x^2
    t = x2 * (GELU_SCALING_FACTOR * GELU_CUBIC_COEFF); t += GELU_SCALING_FACTOR; t *= inp   # u
    np.tanh(t, out=t)                                         # t = tanh(u)
    term2 = t * t; np.subtract(1.0, term2, out=term2)         # 1 - t^2
    x2 *= 1.5 * GELU_SCALING_FACTOR * GELU_CUBIC_COEFF; x2 += 0.5 * GELU_SCALING_FACTOR; x2 *= inp
    term2 *= x2                                               # term 2: (1 - t^2) 0.5 x s (1 + 3 c x^2)
    t *= 0.5; t += 0.5                                        # term 1: 0.5 (1 + t)
    t += term2; t *= dout                                     # dout * gelu'(x)
    return t


def residual_forward(inp1, inp2):
    """out = inp1 + inp2, same shapes (the residual connection, He et al. 2016)."""
    return inp1 + inp2


def residual_backward(dout):
    """out = inp1 + inp2  =>  dinp1 = dinp2 = dout. Returns (dinp1, dinp2), the same array."""
    return dout, dout


def softmax_forward(logits, V, out=None):
    """Softmax over the first V of Vp columns. logits (B,T,Vp) -> probs (B,T,Vp); the padded
    columns V..Vp-1 get probability exactly 0 so they never contribute to loss or gradient.
    probs = exp(z - max z) / sum exp(z - max z): the shift changes nothing in exact arithmetic
    and keeps exp from overflowing. out: a (B,T,Vp) array to write probs into, or None for a new one."""
    probs = np.empty_like(logits) if out is None else out
    real = probs[..., :V]                                     # (B,T,V) view, written in place
    np.subtract(logits[..., :V], logits[..., :V].max(axis=-1, keepdims=True), out=real)
    np.exp(real, out=real)
    real /= real.sum(axis=-1, keepdims=True)
    probs[..., V:] = 0.0
    return probs


def crossentropy_forward(probs, targets):
    """Per-position cross-entropy. probs (B,T,Vp); targets (B,T) ints -> losses (B,T) = -log probs[target]."""
    B, T = targets.shape
    p = probs[np.arange(B)[:, None], np.arange(T)[None, :], targets]  # (B,T) gathered
    return -np.log(p)


def crossentropy_softmax_backward(dlosses, probs, targets):
    """Return dlogits (B,T,Vp) from dlosses (B,T), for loss = -log softmax(logits)[target]:
        dlogits = (probs - onehot(target)) * dlosses
    Padded columns have probs == 0 and are never a target, so their gradient is 0."""
    B, T = targets.shape
    dlogits = probs * dlosses[..., None]
    dlogits[np.arange(B)[:, None], np.arange(T)[None, :], targets] -= dlosses
    return dlogits


# ----------------------------------------------------------------------------
# LoRA: low-rank adapters on a frozen model (Hu et al. 2021); the derivation is doc/lora.md
#
# Fine-tuning with LoRA freezes every parameter of the model and learns, for a few chosen linear
# layers W (OC,C), an update of rank r << C: the layer computes inp @ (W + scale * lora_b @ lora_a)^T
# with lora_a (r,C) and lora_b (OC,r), without ever forming the (OC,C) sum. scale = alpha / r
# (the paper's 4.1: with Adam, tuning alpha is then roughly tuning the learning rate, whatever r;
# doc/lora.md measures how far that holds). lora_a starts
# random and lora_b at zero, so step 0 is the base model exactly. The frozen W needs no gradient:
# its backward runs with dweight None, skipping the largest matmul of each layer's backward.

LORA_INIT_KAIMING_A = math.sqrt(5)     # lora_a's init: kaiming_uniform_(a=sqrt(5)), as the paper's code and PEFT's


def lora_targets(config):
    """GPT-2's linear layers LoRA can adapt, by Hugging Face's names (each takes all of its weight's rows)."""
    C = config.channels
    return [LoraTarget("attn.c_attn", "qkvw", slice(0, 3 * C), C), LoraTarget("attn.c_proj", "attprojw", slice(0, C), C),
            LoraTarget("mlp.c_fc", "fcw", slice(0, 4 * C), C), LoraTarget("mlp.c_proj", "fcprojw", slice(0, C), 4 * C)]


# GPT2LMHeadModel's layer names, PEFT's default targets for GPT-2, its Conv1D layers (W stored transposed)
LORA_FAMILY = LoraFamily(lora_targets, "transformer.h.{l}.", ("c_attn",), fan_in_fan_out=True)


def lora_forward(inp, lora_a, lora_b, scale):
    """The LoRA update of a frozen linear layer (Hu et al. 2021, eq. 3): inp (B,T,C); lora_a (r,C);
    lora_b (OC,r) -> out (B,T,OC) = scale * (inp @ lora_a^T) @ lora_b^T, which the caller adds to
    the frozen layer's output, and h (B,T,r) = inp @ lora_a^T, kept for the backward."""
    h = matmul_forward(inp, lora_a, None)                     # (B,T,C) @ (C,r) -> (B,T,r): down to rank r
    return scale * matmul_forward(h, lora_b, None), h         # (B,T,r) @ (r,OC) -> (B,T,OC): back up


def lora_backward(dlora_a, dlora_b, dout, inp, h, lora_a, lora_b, scale):
    """Return the adapter's part of dinp (B,T,C); accumulate dlora_a (r,C) and dlora_b (OC,r).
    out = scale * h @ lora_b^T and h = inp @ lora_a^T are two bias-free matmuls, so matmul_backward twice:
        dlora_b += (scale dout)^T @ h,   dh = (scale dout) @ lora_b      (the up-projection)
        dlora_a += dh^T @ inp,           dinp = dh @ lora_a              (the down-projection)"""
    dh = matmul_backward(dlora_b, None, scale * dout, h, lora_b)      # (B,T,r)
    return matmul_backward(dlora_a, None, dh, inp, lora_a)            # (B,T,C)


@dataclass
class LoraAdapter:
    """One layer's adapter on one linear layer: lora_a (r,C), lora_b (OC,r) and their gradients
    (views into the LoRA's buffers), the scale, the rows of the layer's output it adds to (a slice
    of the weight's OC: Llama's q, k and v share one matrix), and h (B,T,r) of the last forward."""
    rows: slice
    a: np.ndarray
    b: np.ndarray
    da: np.ndarray
    db: np.ndarray
    scale: float
    h: np.ndarray = None


class LoRA:
    """LoRA adapters of rank r on the linear layers `targets` (llmc.lora.LoraTarget: PEFT's name,
    our weight, its rows) of every layer: per target lora_A (L,r,C) and lora_B (L,OC,r), in one flat
    parameter buffer and one gradient buffer with named views, as a model's, so that gpt2_zero_grad,
    gpt2_grad_norm and gpt2_update train it as they would a model (m, v at the first update).
    layers[l]: our weight name -> the LoraAdapters on layer l's copy of it."""

    def __init__(self, targets, num_layers, rank, alpha, dtype=np.float32):
        self.targets, self.rank, self.alpha, self.scale = targets, rank, alpha, alpha / rank
        self.param_shapes = [shape for t in targets for shape in zip(
            lora_tensor_names(t), ((num_layers, rank, t.in_features), (num_layers, t.out_features, rank)))]
        self.num_parameters = num_elements(self.param_shapes)
        self.params = np.zeros(self.num_parameters, dtype=dtype)
        self.grads = np.zeros(self.num_parameters, dtype=dtype)
        self.P = tensor_views(self.params, self.param_shapes)
        self.G = tensor_views(self.grads, self.param_shapes)
        self.m = self.v = None
        self.decayed = tuple(self.P)       # AdamW decays every adapter (Hugging Face's Trainer: all but biases, norms)
        self.layers = [{} for _ in range(num_layers)]
        for t in targets:
            a, b = lora_tensor_names(t)
            for l, adapters in enumerate(self.layers):
                adapters.setdefault(t.weight, []).append(
                    LoraAdapter(t.rows, self.P[a][l], self.P[b][l], self.G[a][l], self.G[b][l], self.scale))


def lora_init(targets, num_layers, rank, alpha, seed):
    """Fresh adapters (Hu et al. 2021, 4.1: A random, B zero, so that the adapted model starts as the
    base model): lora_B = 0 and lora_A uniform in +-sqrt(6 / ((1 + a^2) C)) = +-1/sqrt(C), PyTorch's
    kaiming_uniform_ with a = LORA_INIT_KAIMING_A (nn.Linear's own default), which the paper's code
    (loralib) and PEFT draw it from. Draws from np.random.default_rng(seed), tensor by tensor."""
    lora = LoRA(targets, num_layers, rank, alpha)
    rng = np.random.default_rng(seed)
    for t in targets:
        a = lora.P[lora_tensor_names(t)[0]]
        bound = math.sqrt(6.0 / ((1.0 + LORA_INIT_KAIMING_A ** 2) * t.in_features))
        a[...] = rng.uniform(-bound, bound, a.shape).astype(np.float32)
    return lora


def lora_add_forward(out, inp, adapters):
    """out (B,T,OC) += lora_forward of each adapter (on the layer that wrote out from inp (B,T,C))
    in its rows of out; keeps each adapter's h."""
    for ad in adapters:
        delta, ad.h = lora_forward(inp, ad.a, ad.b, ad.scale)
        out[..., ad.rows] += delta


def linear_forward(inp, weight, bias, adapters):
    """matmul_forward with the LoRA adapters on its weight (lora_add_forward): the sampler's layers."""
    out = matmul_forward(inp, weight, bias)                   # (B,T,OC)
    lora_add_forward(out, inp, adapters)
    return out


def lora_add_backward(dinp, dout, inp, adapters):
    """dinp (B,T,C) += each adapter's part of the input's gradient (lora_backward on its rows of
    dout (B,T,OC)); accumulates its dlora_a, dlora_b."""
    for ad in adapters:
        dinp += lora_backward(ad.da, ad.db, dout[..., ad.rows], inp, ad.h, ad.a, ad.b, ad.scale)


def lora_merge(P, lora):
    """Merge the adapters into the weights they adapt, in place: W[rows] += scale lora_b @ lora_a
    per layer (the paper's W = W0 + BA: the merged model computes what the adapted one did)."""
    for l, adapters in enumerate(lora.layers):
        for weight, on_weight in adapters.items():
            for ad in on_weight:
                P[weight][l][ad.rows] += ad.scale * (ad.b @ ad.a)        # (OC,r) @ (r,C) -> (OC,C)


def freeze(model):
    """Freeze every parameter of the model (LoRA's base): no gradient buffer (G's views are None),
    so every backward function skips its parameter gradients and AdamW never touches the model."""
    model.grads = None
    model.G = dict.fromkeys(model.P)


# ----------------------------------------------------------------------------
# the model: parameters, init, forward, backward, zero_grad, grad norm, checkpoint files

class GPT2:
    """A GPT-2: its config and one flat buffer each for the parameters and their gradients
    (AdamW's m and v are allocated at the first update), with named views into each.
    `dtype` is float32 for training; float64 is for gradient checks."""

    def __init__(self, config, dtype=np.float32):
        self.config = config
        self.param_shapes = parameter_shapes(config)
        self.num_parameters = num_elements(self.param_shapes)
        self.params = np.zeros(self.num_parameters, dtype=dtype)
        self.grads = np.zeros(self.num_parameters, dtype=dtype)
        self.P = tensor_views(self.params, self.param_shapes)     # name -> view into params
        self.G = tensor_views(self.grads, self.param_shapes)      # name -> view into grads
        self.m = self.v = None                                    # AdamW moments, same dtype
        self.lora = None                                          # LoRA adapters (the model then frozen)
        self.acts = None                                          # name -> activation view
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


def gpt2_init(config, seed=42, dtype=np.float32):
    """A fresh GPT-2 with the GPT-2 initialization (Radford et al. 2019, sec. 2.3):
    matmul weights and embeddings ~ N(0, 0.02^2), the two residual output projections
    (attprojw, fcprojw) ~ N(0, (0.02/sqrt(2L))^2), biases 0, LayerNorm weights 1. wte's padded
    rows V..Vp-1 are 0. Draws come from np.random.default_rng(seed), float32, tensor by tensor in
    file order, so the same seed gives the same model (the PyTorch twin draws identically)."""
    model = GPT2(config, dtype)
    rng = np.random.default_rng(seed)
    for name, shape in model.param_shapes:
        view = model.P[name]
        if name in LAYERNORM_WEIGHTS:
            view[...] = 1.0
        elif name in DECAYED_PARAMETERS:                      # every weight matrix and embedding
            std = INIT_STD / math.sqrt(2 * config.num_layers) if name in RESIDUAL_PROJECTIONS else INIT_STD
            view[...] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        # biases stay 0
    model.P["wte"][config.vocab_size:] = 0.0
    return model


def layer_params(P, l):
    """Layer l's 12 per-layer tensors: a dict name -> view (for G as well as P; a frozen model's G: None)."""
    return {name: None if P[name] is None else P[name][l] for name in PARAMETER_NAMES[2:14]}


def lora_layer(model, l):
    """Layer l's LoRA adapters (LoRA.layers[l]: weight name -> adapters), or None without LoRA."""
    return model.lora.layers[l] if model.lora is not None else None


def check_inputs(config, inputs, targets=None, pos=0):
    """The one check of a forward pass's inputs (both trainers, training and sampling): the
    positions pos..pos+T-1 of inputs (B,T) must lie below max_seq_len, and every token id (and
    target id, if targets is given) in [0, V). Raises InputError saying which does not."""
    T, V = inputs.shape[1], config.vocab_size
    if pos + T > config.max_seq_len:
        raise InputError(f"sequence length T={T} at positions {pos}..{pos + T - 1} exceeds the model's "
                         f"max_seq_len {config.max_seq_len}")
    for name, ids in (("token", inputs), ("target", targets)):
        if ids is not None and (ids.min() < 0 or ids.max() >= V):
            raise InputError(f"{name} id out of range [0, {V}): {ids.min()}..{ids.max()}")


def block_forward(residual, p, NH, lora=None):
    """One transformer block (GPT-2's pre-LayerNorm block, Radford et al. 2019) on the residual
    stream residual (B,T,C) with layer l's parameters p (layer_params) and NH heads; lora: layer
    l's adapters (LoRA.layers[l]) or None. Returns the block's activations, name -> array, in
    forward order (the names of activation_shapes); "residual3" is the next block's input."""
    lora, a = lora or {}, {}
    # forward pass 1: attention block
    a["ln1"], a["ln1_mean"], a["ln1_rstd"] = layernorm_forward(residual, p["ln1w"], p["ln1b"])
    a["qkv"] = matmul_forward(a["ln1"], p["qkvw"], p["qkvb"])                 # (B,T,3C)
    lora_add_forward(a["qkv"], a["ln1"], lora.get("qkvw", ()))                # + the adapters, if any
    a["atty"], a["att"] = attention_forward(a["qkv"], NH)                     # (B,T,C), (B,NH,T,T)
    a["attproj"] = matmul_forward(a["atty"], p["attprojw"], p["attprojb"])
    lora_add_forward(a["attproj"], a["atty"], lora.get("attprojw", ()))
    a["residual2"] = residual_forward(residual, a["attproj"])
    # forward pass 2: MLP block
    a["ln2"], a["ln2_mean"], a["ln2_rstd"] = layernorm_forward(a["residual2"], p["ln2w"], p["ln2b"])
    a["fch"] = matmul_forward(a["ln2"], p["fcw"], p["fcb"])                   # (B,T,4C)
    lora_add_forward(a["fch"], a["ln2"], lora.get("fcw", ()))
    a["fch_gelu"] = gelu_forward(a["fch"])
    a["fcproj"] = matmul_forward(a["fch_gelu"], p["fcprojw"], p["fcprojb"])   # (B,T,C)
    lora_add_forward(a["fcproj"], a["fch_gelu"], lora.get("fcprojw", ()))
    a["residual3"] = residual_forward(a["residual2"], a["fcproj"])
    return a


def gpt2_forward(model, inputs, targets=None):
    """Forward pass. inputs (B,T) int token ids; targets (B,T) or None. Returns logits (B,T,Vp).
    With targets it also computes probs and the per-position losses, and sets model.mean_loss.
    Every activation is kept in model.acts for the backward pass. (The sampler's forward, with a
    KV cache, is gpt2_forward_cached.)
    Raises InputError if T passes maxT or a token id (input or target) is out of range."""
    cfg = model.config
    B, T = inputs.shape
    L, NH, V = cfg.num_layers, cfg.num_heads, cfg.vocab_size
    check_inputs(cfg, inputs, targets)
    P, A = model.P, model.activations(B, T)
    model.inputs, model.targets = inputs, targets
    A["encoded"][...] = encoder_forward(inputs, P["wte"], P["wpe"])          # (B,T,C)
    residual = A["encoded"]
    for l in range(L):
        block = block_forward(residual, layer_params(P, l), NH, lora_layer(model, l))
        for name, value in block.items():
            A[name][l] = value                                                # kept for the backward
        residual = A["residual3"][l]                                          # the next layer's input
    # forward pass 3: final LayerNorm, classifier tied to wte, softmax, cross-entropy
    A["lnf"][...], A["lnf_mean"][...], A["lnf_rstd"][...] = layernorm_forward(residual, P["lnfw"], P["lnfb"])
    matmul_forward(A["lnf"], P["wte"], None, out=A["logits"])                # (B,T,C) @ (C,Vp) -> (B,T,Vp)
    if targets is not None:
        softmax_forward(A["logits"], V, out=A["probs"])
        A["losses"][...] = crossentropy_forward(A["probs"], targets)
        model.mean_loss = float(A["losses"].mean(dtype=np.float64))
    else:
        model.mean_loss = None
    return A["logits"]


def gpt2_zero_grad(model):
    """Set every parameter gradient to 0 (before the first micro-batch of a step)."""
    model.grads[...] = 0.0


def gpt2_backward(model, loss_scale=1.0):
    """Backward pass of the last gpt2_forward (which must have had targets): accumulates the
    gradient of loss_scale * mean(losses) into model.grads (with LoRA, of a frozen model: into
    model.lora.grads only). With gradient accumulation over n micro-batches, loss_scale = 1/n makes
    the sum the gradient of the mean loss."""
    if model.targets is None:
        raise RuntimeError("gpt2_backward needs a forward pass with targets")
    cfg = model.config
    L, NH = cfg.num_layers, cfg.num_heads
    P, G, A = model.P, model.G, model.acts
    B, T = model.inputs.shape

    # backward pass 3: cross-entropy, softmax, classifier, final LayerNorm
    dlosses = np.full((B, T), loss_scale / (B * T), dtype=model.params.dtype)  # d(mean loss)/d(losses)
    dlogits = crossentropy_softmax_backward(dlosses, A["probs"], model.targets)  # (B,T,Vp)
    dlnf = matmul_backward(G["wte"], None, dlogits, A["lnf"], P["wte"])       # (B,T,C)
    dresidual = layernorm_backward(G["lnfw"], G["lnfb"], dlnf, A["residual3"][L - 1], P["lnfw"],
                                   A["lnf_mean"], A["lnf_rstd"])              # gradient of the residual stream
    for l in reversed(range(L)):
        p, g, lora = layer_params(P, l), layer_params(G, l), lora_layer(model, l) or {}
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
        # backward pass 2: MLP block. residual3 = residual2 + fcproj: both receive dresidual
        # (the same array: every later "dresidual = dresidual + ..." makes a new one, never +=)
        dresidual, dfcproj = residual_backward(dresidual)
        dfch_gelu = matmul_backward(g["fcprojw"], g["fcprojb"], dfcproj, A["fch_gelu"][l], p["fcprojw"])
        lora_add_backward(dfch_gelu, dfcproj, A["fch_gelu"][l], lora.get("fcprojw", ()))
        dfch = gelu_backward(dfch_gelu, A["fch"][l])
        dln2 = matmul_backward(g["fcw"], g["fcb"], dfch, A["ln2"][l], p["fcw"])
        lora_add_backward(dln2, dfch, A["ln2"][l], lora.get("fcw", ()))
        dresidual = dresidual + layernorm_backward(g["ln2w"], g["ln2b"], dln2, A["residual2"][l], p["ln2w"],
                                                   A["ln2_mean"][l], A["ln2_rstd"][l])
        # backward pass 1: attention block. residual2 = residual + attproj
        dresidual, dattproj = residual_backward(dresidual)
        datty = matmul_backward(g["attprojw"], g["attprojb"], dattproj, A["atty"][l], p["attprojw"])
        lora_add_backward(datty, dattproj, A["atty"][l], lora.get("attprojw", ()))
        dqkv = attention_backward(datty, A["qkv"][l], A["att"][l], NH)
        dln1 = matmul_backward(g["qkvw"], g["qkvb"], dqkv, A["ln1"][l], p["qkvw"])
        lora_add_backward(dln1, dqkv, A["ln1"][l], lora.get("qkvw", ()))
        dresidual = dresidual + layernorm_backward(g["ln1w"], g["ln1b"], dln1, residual, p["ln1w"],
                                                   A["ln1_mean"][l], A["ln1_rstd"][l])
    # backward of the encoder: encoded = wte[inputs] + wpe
    encoder_backward(G["wte"], G["wpe"], dresidual, model.inputs)


GRAD_NORM_CHUNK = 1 << 14              # gradient values per float32 dot product (64 KiB)


def gpt2_grad_norm(model):
    """Global L2 norm of all parameter gradients, a Python float. np.dot of float32 arrays sums in
    float32: off by ~1e-4 relative over a d12's 124M values, by ~1e-9 over GRAD_NORM_CHUNK values,
    whose sums are added in float64 (a Python float)."""
    total = 0.0
    for start in range(0, model.grads.size, GRAD_NORM_CHUNK):
        g = model.grads[start:start + GRAD_NORM_CHUNK]
        total += float(np.dot(g, g))
    return math.sqrt(total)


def read_model(path, dtype=np.float32):
    """A GPT2 from a model checkpoint (fp32 version 3, or bf16 version 5 upcast to fp32), llm.c's
    gpt2_build_from_checkpoint. The file format itself is llmc/formats.py. Raises InputError."""
    def num_parameters_of(shape):
        return num_elements(parameter_shapes(config_from_header(shape)))
    shape, params = read_model_file(path, num_parameters_of)
    model = GPT2(config_from_header(shape), dtype)
    model.params[...] = params
    return model


def config_from_header(shape):
    """GPT2Config from a model file's shape dict (old files store padded_vocab_size 0)."""
    return GPT2Config(**{**shape, "padded_vocab_size": shape["padded_vocab_size"] or padded_vocab(shape["vocab_size"])})


def write_model(path, model, dtype="float32"):
    """Write the model's parameters as a checkpoint: dtype "float32" (version 3) or "bfloat16" (5)."""
    write_model_file(path, model.config, model.params.astype(np.float32), dtype)


def build_model(spec, seed):
    """-e: a checkpoint path (fp32 or bf16), or a descriptor (d12) for a fresh gpt2_init."""
    return read_model(spec) if is_checkpoint_path(spec) else gpt2_init(config_from_descriptor(spec), seed)


def build_lora(args, model, family, seed):
    """The LoRA flags (llmc/lora.py) on `model` of `family` (LORA_FAMILY): nothing without them;
    else adapters, fresh (--lora-rank: lora_init) or read (--lora-load), become model.lora and the
    model is frozen. Raises InputError."""
    lora_files.check_flags(args)
    L = model.config.num_layers
    if args.lora_load:
        rank, alpha, targets, tensors = lora_files.load(args.lora_load, model.config, family)
        model.lora = LoRA(targets, L, rank, alpha)
        for name, value in tensors.items():
            model.lora.P[name][...] = value
    elif args.lora_rank > 0:
        targets = lora_files.select_targets(args.lora_targets, family.targets_of(model.config), family.default_targets)
        alpha = args.lora_alpha if args.lora_alpha is not None else lora_files.LORA_DEFAULT_ALPHA
        model.lora = lora_init(targets, L, args.lora_rank, alpha, seed)
    if model.lora is not None:
        freeze(model)


def model_config(spec):
    """The GPT2Config that -e names, without building the model (a checkpoint's header is read)."""
    return config_from_header(read_model_shape(spec)) if is_checkpoint_path(spec) else config_from_descriptor(spec)


# ----------------------------------------------------------------------------
# AdamW

def adamw_update(p, g, m, v, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale=1.0, scratch=None):
    """One AdamW step, in place, on parameters p, gradients g and moments m, v, all (n,), t the
    1-based step (Loshchilov & Hutter 2019, Alg. 2; bias correction: Kingma & Ba 2015, Alg. 1):
        g' = grad_scale g                 the clipped gradient (clipping passes max_norm / norm)
        m  = beta1 m + (1 - beta1) g'     first moment: running mean of g'
        v  = beta2 v + (1 - beta2) g'^2   second moment: running mean of g'^2
        p -= lr (m_hat / (sqrt(v_hat) + eps) + weight_decay p),  m_hat = m / (1 - beta1^t), v_hat = v / (1 - beta2^t)
    The decay is decoupled: it shrinks p directly, so Adam's per-parameter scaling does not weaken
    it. Each statement is one pass, in place; scratch ((n,), like p, or None) holds the temporary u."""
    u = np.empty_like(p) if scratch is None else scratch
    np.multiply(g, grad_scale * (1.0 - beta1), out=u); m *= beta1; m += u       # m = beta1 m + (1 - beta1) g'
    np.multiply(g, g, out=u); u *= grad_scale * grad_scale * (1.0 - beta2)      # (1 - beta2) g'^2
    v *= beta2; v += u                                                          # v = beta2 v + (1 - beta2) g'^2
    np.sqrt(v, out=u); u *= 1.0 / math.sqrt(1.0 - beta2 ** t); u += eps       # sqrt(v_hat) + eps
    np.divide(m, u, out=u); u *= learning_rate / (1.0 - beta1 ** t)           # lr m_hat / (sqrt(v_hat) + eps)
    if weight_decay:
        p *= 1.0 - learning_rate * weight_decay               # p - lr weight_decay p
    p -= u


def gpt2_update(model, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale=1.0, decayed=DECAYED_PARAMETERS):
    """AdamW over the model: adamw_update on each parameter tensor's part of the flat buffers, weight
    decay on the tensors named in `decayed` only. A tensor is updated ADAMW_CHUNK floats at a time, so
    that a slice's p, g, m, v and u stay in cache over adamw_update's passes. A plain loop in one
    thread, so that a debugger's breakpoint in adamw_update stops."""
    if model.m is None:
        model.m = np.zeros_like(model.params)
        model.v = np.zeros_like(model.params)
    scratch = np.empty(ADAMW_CHUNK, model.params.dtype)
    offset = 0
    for name, shape in model.param_shapes:
        n = math.prod(shape)
        wd = weight_decay if name in decayed else 0.0
        for start in range(offset, offset + n, ADAMW_CHUNK):
            part = slice(start, min(start + ADAMW_CHUNK, offset + n))
            adamw_update(model.params[part], model.grads[part], model.m[part], model.v[part],
                         learning_rate, beta1, beta2, eps, wd, t, grad_scale, scratch[:part.stop - part.start])
        offset += n


# ----------------------------------------------------------------------------
# learning-rate schedules (llm.c's schedulers, plus warmup-stable-decay)

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAY_FRACTION = 0.2   # WSD decays over the last 20% of steps (Hägele et al. 2024)


def learning_rate_at(step, schedule, learning_rate, warmup_iters, train_num_batches, final_lr_frac):
    """Learning rate for 0-based `step` of `train_num_batches`. Linear warmup over warmup_iters
    steps (to lr * (step+1)/warmup), then:
      cosine:   min_lr + 0.5 (1 + cos(pi r)) (lr - min_lr), r = progress through the decay in [0,1]
      linear:   lr - r (lr - min_lr)
      constant: lr (no warmup either)
      wsd:      lr until the last WSD_DECAY_FRACTION of steps, then a 1 - sqrt(r) cool-down
    with min_lr = lr * final_lr_frac. Raises InputError on an unknown schedule name."""
    if schedule == "constant":
        return learning_rate
    if schedule not in LR_SCHEDULES:
        raise InputError(f"unknown learning-rate schedule '{schedule}', expected one of {', '.join(LR_SCHEDULES)}")
    if step < warmup_iters:
        return learning_rate * (step + 1) / warmup_iters
    min_lr = learning_rate * final_lr_frac
    if schedule == "wsd":
        decay_start = max(warmup_iters, int(train_num_batches * (1.0 - WSD_DECAY_FRACTION)))
        if step < decay_start:
            return learning_rate
        r = min(1.0, (step - decay_start) / max(1, train_num_batches - decay_start))
        return min_lr + (1.0 - math.sqrt(r)) * (learning_rate - min_lr)
    r = (step - warmup_iters) / max(1, train_num_batches - warmup_iters)
    r = min(max(r, 0.0), 1.0)
    if schedule == "linear":
        return learning_rate - r * (learning_rate - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (learning_rate - min_lr)




# ----------------------------------------------------------------------------
# sampler: generate, with a KV cache (the RNG and the draw, shared with gpt2_cuda.py: llmc/sampler.py)
#
# The KV cache. Without one, every new token reruns the whole forward over the window to read one
# row of logits. But a position's key and value depend only on the tokens up to it (causal
# attention), so they never change once computed: keep them per layer and run only the new token
# through the model, its one query row attending to every cached key; the classifier, the largest
# matmul of a small model, runs on the last row only.

@dataclass
class KVCache:
    """The keys and values of the positions run so far, per layer, for gpt2_forward_cached.
    k, v (L,B,NH,maxT,HS); positions 0..length-1 are filled (the rest is scratch)."""
    k: np.ndarray
    v: np.ndarray
    length: int = 0


def kv_cache_shape(config, B):
    """Shape of KVCache.k and .v: (L,B,NH,maxT,HS)."""
    return (config.num_layers, B, config.num_heads, config.max_seq_len, config.channels // config.num_heads)


def kv_cache_new(config, B, dtype=np.float32):
    """An empty KVCache for B sequences of up to maxT positions."""
    return KVCache(np.zeros(kv_cache_shape(config, B), dtype), np.zeros(kv_cache_shape(config, B), dtype))


def attention_forward_cached(qkv, k_cache, v_cache, pos, NH):
    """attention_forward for T new positions pos..pos+T-1, the keys and values of the positions
    before them cached. qkv (B,T,3C) of the new positions; k_cache, v_cache (B,NH,maxT,HS) with
    positions 0..pos-1 filled -> out (B,T,C). Writes the new k, v at pos..pos+T-1, then each
    query attends to the keys up to its own position. Decoding one token (T=1) is one query row
    against every cached key, the newest one included: nothing to mask. A prefill (pos=0, the
    whole context at once) masks as attention_forward does."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = split_heads(qkv, NH)                           # each (B,NH,T,HS)
    k_cache[:, :, pos:pos + T] = k
    v_cache[:, :, pos:pos + T] = v
    keys, values = k_cache[:, :, :pos + T], v_cache[:, :, :pos + T]  # (B,NH,pos+T,HS): every position so far
    att = causal_softmax(q, keys, pos)                        # (B,NH,T,pos+T)
    out = att @ values                                        # (B,NH,T,pos+T) @ (B,NH,pos+T,HS) -> (B,NH,T,HS)
    return out.transpose(0, 2, 1, 3).reshape(B, T, C)


def block_forward_cached(residual, p, k_cache, v_cache, pos, NH, lora=None):
    """block_forward for the sampler: the T new positions pos..pos+T-1 of residual (B,T,C), the
    attention reading and extending layer l's KV cache (attention_forward_cached); nothing is
    kept for a backward. Returns the block's output, the next block's input (B,T,C)."""
    lora = lora or {}
    ln1, _, _ = layernorm_forward(residual, p["ln1w"], p["ln1b"])
    qkv = linear_forward(ln1, p["qkvw"], p["qkvb"], lora.get("qkvw", ()))                  # (B,T,3C)
    atty = attention_forward_cached(qkv, k_cache, v_cache, pos, NH)                         # (B,T,C)
    residual2 = residual_forward(residual, linear_forward(atty, p["attprojw"], p["attprojb"], lora.get("attprojw", ())))
    ln2, _, _ = layernorm_forward(residual2, p["ln2w"], p["ln2b"])
    fch_gelu = gelu_forward(linear_forward(ln2, p["fcw"], p["fcb"], lora.get("fcw", ())))    # (B,T,4C)
    return residual_forward(residual2, linear_forward(fch_gelu, p["fcprojw"], p["fcprojb"], lora.get("fcprojw", ())))


def gpt2_forward_cached(model, inputs, cache):
    """The sampler's forward pass: inputs (B,T) int token ids at positions cache.length..
    cache.length+T-1, whose keys and values are appended to cache (a KVCache, kv_cache_new) while
    each attends to the cached ones before it. Returns the logits (B,Vp) of the last position
    only (the next token's); keeps no activation.
    Raises InputError if the positions pass maxT or a token id is out of range."""
    cfg = model.config
    B, T = inputs.shape
    pos, P = cache.length, model.P
    check_inputs(cfg, inputs, None, pos)
    residual = encoder_forward(inputs, P["wte"], P["wpe"][pos:])              # (B,T,C), positions pos..pos+T-1
    for l in range(cfg.num_layers):
        residual = block_forward_cached(residual, layer_params(P, l), cache.k[l], cache.v[l], pos, cfg.num_heads,
                                        lora_layer(model, l))
    lnf, _, _ = layernorm_forward(residual[:, T - 1:], P["lnfw"], P["lnfb"])  # (B,1,C): the last position
    cache.length = pos + T
    return matmul_forward(lnf, P["wte"], None)[:, 0]                          # (B,1,C) @ (C,Vp) -> (B,Vp)


@dataclass(frozen=True)
class SamplingForward:
    """generate's forwards on one model, B=1: full(x (1,window)) -> logits (1,window,Vp);
    cached(x (1,T), cache) -> logits (1,Vp) of the last position, appending T positions to the
    cache; new_cache() -> an empty cache. Calling it runs `full`, as a plain forward would."""
    full: Callable
    cached: Callable
    new_cache: Callable

    def __call__(self, x):
        return self.full(x)


def sampling_forward(model):
    """generate's forwards on this (NumPy) model: gpt2_forward, and gpt2_forward_cached with a KV cache."""
    return SamplingForward(full=lambda x: gpt2_forward(model, x),
                           cached=lambda x, cache: gpt2_forward_cached(model, x, cache),
                           new_cache=lambda: kv_cache_new(model.config, 1, model.params.dtype))


def generate(model, prompt, max_new_tokens, rng, temperature=1.0, top_k=0, on_token=None, forward=None,
             kv_cache=True):
    """Autoregressive sampling: each new token is drawn by sample_token from the logits of the
    context's last position (the context: the last maxT tokens at most); on_token(id) is called
    as each comes. Returns the new ids. Raises InputError for an empty or too long prompt.
    forward: a SamplingForward (default sampling_forward(model); gpt2_cuda.py passes its own) or
    a plain full forward x (1,window) -> logits (1,window,Vp), which runs as kv_cache=False.
    kv_cache=True: the prompt in one cached pass (the prefill), then each new token alone. Once the
    context slides past maxT every kept token sits one position earlier and, with absolute
    position embeddings, every cached key and value changes: the cache is refilled per token.
    kv_cache=False: the full forward over a fixed window of min(maxT, len(prompt)+new tokens) for
    every token (causal attention ignores the padding after the context): the reference."""
    V, maxT = model.config.vocab_size, model.config.max_seq_len
    if not prompt:
        raise InputError("empty prompt: give at least one token")
    if len(prompt) > maxT:
        raise InputError(f"prompt of {len(prompt)} tokens is longer than max_seq_len {maxT}")
    forward = forward or sampling_forward(model)
    use_cache = kv_cache and isinstance(forward, SamplingForward)
    cache = forward.new_cache() if use_cache else None
    window = min(maxT, len(prompt) + max_new_tokens)
    tokens = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        ctx = tokens[-window:]
        if use_cache:
            if cache.length in (0, maxT):               # the first token, or the context slid: (re)fill the cache
                cache.length = 0
                logits = forward.cached(np.array([ctx], dtype=np.int32), cache)[0]
            else:                                       # the cache holds ctx[:-1]: run the newest token alone
                logits = forward.cached(np.array([ctx[-1:]], dtype=np.int32), cache)[0]
        else:
            x = np.zeros((1, window), dtype=np.int32)   # positions after the context: any valid id
            x[0, :len(ctx)] = ctx
            logits = forward(x)[0, len(ctx) - 1]
        nxt = sample_token(logits, V, rng, temperature, top_k)
        tokens.append(nxt)
        out.append(nxt)
        if on_token:
            on_token(nxt)
    return out


# ----------------------------------------------------------------------------
# training loop (llm.c's main): the training step written out; the rest from llmc/cli.py

def train(args):
    """Train (or, with --eval-only / --generate, evaluate / sample) as the flags say. Each step:
    zero_grad, forward + backward over grad_accum_steps micro-batches (accumulating), average the
    gradients across processes, clip to the global norm, AdamW update. Returns the model."""
    comm = Comm()
    run = TrainingRun(args, comm)
    model = build_model(run.model_spec(), args.seed)
    build_lora(args, model, LORA_FAMILY, args.seed)       # --lora-*: adapters on a frozen model
    if args.lora_merge:                                   # merge --lora-load's adapters into -e, write it
        lora_merge(model.P, model.lora)
        write_model(args.lora_merge, model)
        run.say(f"merged the adapters of {args.lora_load} into {args.model}: wrote {args.lora_merge}")
        return model
    if args.generate > 0:
        rng = SamplerRNG(args.sample_seed)
        return sample_from_prompt(args, lambda prompt, n, on_token: generate(
            model, prompt, n, rng, args.temperature, args.top_k, on_token), model.config)
    if run.resuming:
        run.check_resumed_model(model_config(args.model), model.config)
    run.prepare(model.config)

    def batch_loss(inputs, targets):                      # validation
        gpt2_forward(model, inputs, targets)
        return model.mean_loss

    def forward_losses(inputs, targets):                  # HellaSwag
        gpt2_forward(model, inputs, targets)
        return model.acts["losses"]

    if args.eval_only:
        run.evaluate_only(batch_loss, forward_losses)
        return model
    run.banner(model.config, model.num_parameters)
    trained = model.lora or model                         # what the step updates (LoRA: the adapters only)
    if model.lora:
        run.say(lora_files.describe(model.lora, model.num_parameters))
    sample_rng = SamplerRNG(args.sample_seed)
    start_step, outliers = 0, None
    if run.resuming:
        st = load_checkpoint(args.output_dir, run.resume_step, comm.rank, comm.size,
                             lambda shape: model.num_parameters)
        model.params[...], model.m, model.v = st["params"], st["m"], st["v"]
        run.train_loader.restore(st["loader"])
        sample_rng.state, start_step, outliers = st["sample_rng_state"], st["step"], st["outliers"]
        run.say(f"resumed from {st['state_path']} at step {start_step}")
    def sample(prompt, n):
        return generate(model, prompt, n, sample_rng)

    if not run.start(start_step, outliers):
        run.sample_after_the_last_checkpoint(sample)
        return model

    def save(step):
        m = model.m if model.m is not None else np.zeros_like(model.params)
        v = model.v if model.v is not None else np.zeros_like(model.params)
        return save_checkpoint(args.output_dir, step, model.config, model.params, m, v, run.train_loader,
                               sample_rng.state, comm.rank, comm.size, outliers=run.outlier_state())

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
            gpt2_forward(model, inputs, targets)
            gpt2_backward(model, loss_scale=1.0 / run.grad_accum_steps)
            loss += model.mean_loss / run.grad_accum_steps
        comm.mean_(trained.grads)                         # data parallel: average over processes
        loss = comm.mean(loss)
        norm = gpt2_grad_norm(trained)
        skip, zloss, zgrad = run.skip_update(loss, norm)         # -sl / -sg: an outlier step is not applied
        grad_scale = args.grad_clip / norm if 0 < args.grad_clip < norm else 1.0
        lr = learning_rate_at(step, args.lr_schedule, args.learning_rate, args.warmup_iters, run.num_steps,
                              args.final_lr_frac)
        if not skip:
            gpt2_update(trained, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, step + 1, grad_scale,
                        trained.decayed if model.lora else DECAYED_PARAMETERS)
        run.log_step(step, loss, norm, lr, time.perf_counter() - t0, zloss, zgrad)
    if args.lora_save and comm.rank == 0:
        lora_files.save(args.lora_save, model.lora, model.config.num_layers, LORA_FAMILY, args.model)
        run.say(f"LoRA adapters written to {args.lora_save}")
    return model


def parse_args(argv=None):
    """The command line (argv: list of str, default sys.argv[1:]) -> argparse.Namespace."""
    parser = build_parser("gpt2_cpu.py", "Train GPT-2 in NumPy (the llm.cupy reference trainer).", LR_SCHEDULES)
    lora_files.add_flags(parser, LORA_FAMILY.default_targets)
    return parser.parse_args(argv)


def main(argv=None):
    """Command-line entry point. Returns the exit code: 0; 1 with one `error:` line for bad input
    (a bad flag included)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:                               # --help (0), or a bad flag (1, its error line printed)
        return e.code
    return run_main(train, args)


if __name__ == "__main__":
    sys.exit(main())
