"""
gpt2_cpu.py: GPT-2 training in pure NumPy, float32, with hand-derived gradients.

This file *defines* the algorithm of llm.cupy. Every layer is a forward/backward
pair written out by hand (no autograd), followed by the model, AdamW, the data
loader, the tokenizer, the sampler and the training loop, in that reading order.
It is the Python twin of llm.c's train_gpt2.c and the reference that the CUDA
trainer (gpt2_cuda.py) is checked against, layer by layer.

What it deliberately is not: fast on big models, or clever. There are no Python
loops over B, T or heads (everything is vectorized NumPy), but there is also no
fusion, no caching beyond what a backward pass needs, and no mixed precision.

Run it (after `make data`):
    python gpt2_cpu.py
trains a small GPT-2 (d4, 16M parameters) from scratch on Shakespeare: 400 steps of
B=4 x T=64 tokens, about two minutes on 2 CPU cores, printing one line per step, e.g.
    step    1/400 | loss 10.925585 | norm 6.6749 | lr 3.00e-04 | 316.7 ms | 808 tok/s
the validation loss every 100 steps (10.9 at the start, about 6.1 at the end) and a sample
of generated text every 100 steps, which turns from noise into verse-shaped lines. `python gpt2_cpu.py --help`
lists every flag (llm.c's one-letter flags, each with a long alias).
Step through one training step in a debugger: `python -m pdb gpt2_cpu.py -x 1`.

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

Gradient convention: backward functions *return* the gradient of their input
(written fresh, `=`) and *accumulate* (`+=`) into the parameter gradients they
are given, so that gradient accumulation over micro-batches is just calling
backward again. The residual stream's gradient is accumulated explicitly in
gpt2_backward.
"""

import argparse
import codecs
import glob
import math
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

# ----------------------------------------------------------------------------
# constants: file magics and versions (shared/docs/file-formats.md), math

HEADER_INTS = 256                      # every file starts with 256 int32
HEADER_BYTES = HEADER_INTS * 4
MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
DEBUG_STATE_MAGIC = 20240327
DEBUG_STATE_VERSION = 2
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
EVAL_MAGIC = 20240522
EVAL_VERSION = 1
STATE_MAGIC = 20240527
STATE_VERSION = 1

GPT2_EOT = 50256                       # <|endoftext|>, precedes every document
LN_EPS = 1e-5                          # LayerNorm epsilon, as in GPT-2
GELU_SCALING_FACTOR = math.sqrt(2.0 / math.pi)
GELU_CUBIC_COEFF = 0.044715            # tanh-approximation GELU (Hendrycks & Gimpel 2016)
INIT_STD = 0.02                        # GPT-2 weight init std (Radford et al. 2019)
VOCAB_PAD_MULTIPLE = 128               # Vp is V rounded up to this (tensor-core friendly)
ADAMW_CHUNK = 1 << 17                  # floats per AdamW chunk: its 6 slices (3 MiB) stay in cache
ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS = 0.9, 0.95, 1e-8   # llm.c's CUDA trainer defaults

DEFAULT_DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_TRAIN = os.path.join(DEFAULT_DATA_DIR, "tinyshakespeare", "tiny_shakespeare_train.bin")
DEFAULT_VAL = os.path.join(DEFAULT_DATA_DIR, "tinyshakespeare", "tiny_shakespeare_val.bin")
DEFAULT_TOKENIZER = os.path.join(DEFAULT_DATA_DIR, "gpt2_tokenizer.bin")
DEFAULT_BPE = os.path.join(DEFAULT_DATA_DIR, "gpt2.tiktoken")
DEFAULT_HELLASWAG = os.path.join(DEFAULT_DATA_DIR, "hellaswag", "hellaswag_val.bin")
GPT2_BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"


class InputError(Exception):
    """Bad user input or a bad file. The CLI prints it as one line and exits 1."""


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


# depth descriptor -> (L, NH, C). d12..d48 are llm.c's descriptors and the GPT-2
# sizes; d2..d6 are small enough to train on a 2-core CPU.
MODEL_DESCRIPTORS = {
    "d2": (2, 4, 128),      # 6,966,784 params, 6.4M of them the (tied) token embedding
    "d4": (4, 4, 256),      # 16,299,520 params: the default CPU run
    "d6": (6, 6, 384),      # 30,357,504 params: nanoGPT's Shakespeare "baby GPT" shape, GPT-2 vocabulary
    "d12": (12, 12, 768),   # GPT-2 124M
    "d24": (24, 16, 1024),  # GPT-2 350M
    "d36": (36, 20, 1280),  # GPT-2 774M
    "d48": (48, 25, 1600),  # GPT-2 1558M
}
MODEL_SIZES = {"124M": "d12", "350M": "d24", "774M": "d36", "1558M": "d48"}


def config_from_descriptor(name):
    """GPT2Config for a descriptor ("d12") or a GPT-2 size ("124M"). Raises InputError."""
    key = MODEL_SIZES.get(name, name)
    if key not in MODEL_DESCRIPTORS:
        known = ", ".join(list(MODEL_DESCRIPTORS) + list(MODEL_SIZES))
        raise InputError(f"unknown model '{name}': expected a .bin file or one of {known}")
    L, NH, C = MODEL_DESCRIPTORS[key]
    return GPT2Config(num_layers=L, num_heads=NH, channels=C)


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
    the token ids have no gradient.
    out[b,t] = wte[inp[b,t]] + wpe[t]  =>  dwte[v] += sum of dout[b,t] over all (b,t) with inp[b,t]==v,
                                           dwpe[t] += sum_b dout[b,t]."""
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
    Derivation: doc/layernorm.md."""
    norm = (inp - mean[..., None]) * rstd[..., None]          # (B,T,C)
    dnorm = dout * weight                                     # (B,T,C)
    dbias += dout.sum(axis=(0, 1))
    dweight += (dout * norm).sum(axis=(0, 1))
    dinp = dnorm - dnorm.mean(axis=-1, keepdims=True) - norm * (dnorm * norm).mean(axis=-1, keepdims=True)
    return dinp * rstd[..., None]


def matmul_forward(inp, weight, bias):
    """Linear layer, PyTorch nn.Linear layout.
    inp (B,T,C); weight (OC,C); bias (OC,) or None -> out (B,T,OC) = inp @ weight.T + bias.
    The (B,T) rows are flattened into one (B*T,C) matrix: one BLAS call instead of B smaller ones
    (NumPy loops over the leading axis of a 3-D operand), about 1.4x faster here."""
    B, T, C = inp.shape
    OC = weight.shape[0]
    out = inp.reshape(B * T, C) @ weight.T                    # (B*T,C) @ (C,OC) -> (B*T,OC)
    if bias is not None:
        out += bias
    return out.reshape(B, T, OC)


def matmul_backward(dweight, dbias, dout, inp, weight):
    """Return dinp (B,T,C); accumulate dweight (OC,C) and dbias (OC,) (dbias may be None).
    out = inp @ weight.T + bias  =>  dinp = dout @ weight; dweight += dout^T @ inp; dbias += sum dout."""
    B, T, C = inp.shape
    OC = weight.shape[0]
    dout2 = dout.reshape(B * T, OC)                           # (B*T,OC)
    dweight += dout2.T @ inp.reshape(B * T, C)                # (OC,B*T) @ (B*T,C) -> (OC,C)
    if dbias is not None:
        dbias += dout2.sum(axis=0)
    return (dout2 @ weight).reshape(B, T, C)                  # (B*T,OC) @ (OC,C) -> (B*T,C)


def _split_heads(qkv, NH):
    """(B,T,3C) -> q, k, v each (B,NH,T,HS): views, no copies."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    qkv = qkv.reshape(B, T, 3, NH, HS)
    return (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))


def attention_forward(qkv, NH):
    """Causal multi-head self-attention on the fused QKV projection (Vaswani et al. 2017, eq. 1).
    qkv (B,T,3C) holding [q | k | v] -> out (B,T,C), att (B,NH,T,T)
    att = softmax(q k^T / sqrt(HS) + causal mask), out = att v with the heads concatenated.
    The mask is applied by setting future positions to -inf before the softmax, so their
    probability is exactly 0 (and so is their gradient)."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    HS = C // NH
    q, k, v = _split_heads(qkv, NH)                           # each (B,NH,T,HS)
    preatt = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(HS))  # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    future = np.triu(np.ones((T, T), dtype=bool), k=1)        # (T,T) True above the diagonal
    preatt[..., future] = -np.inf
    preatt -= preatt.max(axis=-1, keepdims=True)              # the diagonal is never masked: max is finite
    att = np.exp(preatt)
    att /= att.sum(axis=-1, keepdims=True)
    out = att @ v                                             # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    return out.transpose(0, 2, 1, 3).reshape(B, T, C), att


def attention_backward(dout, qkv, att, NH):
    """Return dqkv (B,T,3C) from dout (B,T,C), the forward's qkv (B,T,3C) and att (B,NH,T,T).
    Undoing the forward in reverse:
        out = att @ v          =>  datt = dout @ v^T,  dv = att^T @ dout
        att = softmax(preatt)  =>  dpreatt = att * (datt - sum_j(datt * att))   (softmax Jacobian)
        preatt = s q k^T       =>  dq = s dpreatt @ k,  dk = s dpreatt^T @ q,  s = 1/sqrt(HS)
    Masked entries have att == 0, so dpreatt is 0 there without an explicit mask."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    HS = C // NH
    scale = 1.0 / math.sqrt(HS)
    q, k, v = _split_heads(qkv, NH)                           # each (B,NH,T,HS)
    dout_h = dout.reshape(B, T, NH, HS).transpose(0, 2, 1, 3)  # (B,NH,T,HS)
    datt = dout_h @ v.transpose(0, 1, 3, 2)                   # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
    dv = att.transpose(0, 1, 3, 2) @ dout_h                   # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
    dpreatt = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    dq = (dpreatt @ k) * scale                                # (B,NH,T,T) @ (B,NH,T,HS)
    dk = (dpreatt.transpose(0, 1, 3, 2) @ q) * scale
    dqkv = np.stack([dq, dk, dv], axis=2)                     # (B,NH,3,T,HS)
    return dqkv.transpose(0, 3, 2, 1, 4).reshape(B, T, C3)    # -> (B,T,3,NH,HS) -> (B,T,3C)


def gelu_forward(inp):
    """GELU, tanh approximation (Hendrycks & Gimpel 2016, eq. in sec. 2), as in GPT-2:
    out = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi). Any shape."""
    cube = GELU_CUBIC_COEFF * inp * inp * inp
    return 0.5 * inp * (1.0 + np.tanh(GELU_SCALING_FACTOR * (inp + cube)))


def gelu_backward(dout, inp):
    """Return dinp = dout * gelu'(inp). With u = s (x + 0.044715 x^3) and t = tanh(u):
        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2)
    term 1: through the leading x; term 2: through tanh."""
    x = inp
    t = np.tanh(GELU_SCALING_FACTOR * (x + GELU_CUBIC_COEFF * x * x * x))
    local_grad = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_SCALING_FACTOR * (1.0 + 3.0 * GELU_CUBIC_COEFF * x * x)
    return dout * local_grad


def residual_forward(inp1, inp2):
    """out = inp1 + inp2, same shapes (the residual connection, He et al. 2016)."""
    return inp1 + inp2


def residual_backward(dout):
    """out = inp1 + inp2  =>  dinp1 = dinp2 = dout. Returns (dinp1, dinp2), the same array."""
    return dout, dout


def softmax_forward(logits, V):
    """Softmax over the first V of Vp columns. logits (B,T,Vp) -> probs (B,T,Vp); the padded
    columns V..Vp-1 get probability exactly 0 so they never contribute to loss or gradient.
    probs = exp(z - max z) / sum exp(z - max z): the shift changes nothing in exact arithmetic
    and keeps exp from overflowing."""
    probs = np.empty_like(logits)
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
# the model: parameters, forward, backward, zero_grad, update

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
    """Layer l's 12 per-layer tensors: a dict name -> view (for G as well as P)."""
    return {name: P[name][l] for name in PARAMETER_NAMES[2:14]}


def gpt2_forward(model, inputs, targets=None):
    """Forward pass. inputs (B,T) int token ids; targets (B,T) or None.
    Returns logits (B,T,Vp). With targets it also computes probs and the per-position losses,
    and sets model.mean_loss. Every activation is kept in model.acts for the backward pass.
    Raises InputError if T > maxT or a token id is out of range."""
    cfg = model.config
    B, T = inputs.shape
    C, L, NH, V = cfg.channels, cfg.num_layers, cfg.num_heads, cfg.vocab_size
    if T > cfg.max_seq_len:
        raise InputError(f"sequence length T={T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    if inputs.min() < 0 or inputs.max() >= V:
        raise InputError(f"token id out of range [0, {V}): {inputs.min()}..{inputs.max()}")
    P, A = model.P, model.activations(B, T)
    model.inputs, model.targets = inputs, targets

    A["encoded"][...] = encoder_forward(inputs, P["wte"], P["wpe"])           # (B,T,C)
    for l in range(L):
        p = layer_params(P, l)
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]          # (B,T,C)
        # forward pass 1: attention block
        A["ln1"][l], A["ln1_mean"][l], A["ln1_rstd"][l] = layernorm_forward(residual, p["ln1w"], p["ln1b"])
        A["qkv"][l] = matmul_forward(A["ln1"][l], p["qkvw"], p["qkvb"])      # (B,T,3C)
        A["atty"][l], A["att"][l] = attention_forward(A["qkv"][l], NH)       # (B,T,C), (B,NH,T,T)
        A["attproj"][l] = matmul_forward(A["atty"][l], p["attprojw"], p["attprojb"])
        A["residual2"][l] = residual_forward(residual, A["attproj"][l])
        # forward pass 2: MLP block
        A["ln2"][l], A["ln2_mean"][l], A["ln2_rstd"][l] = layernorm_forward(A["residual2"][l], p["ln2w"], p["ln2b"])
        A["fch"][l] = matmul_forward(A["ln2"][l], p["fcw"], p["fcb"])        # (B,T,4C)
        A["fch_gelu"][l] = gelu_forward(A["fch"][l])
        A["fcproj"][l] = matmul_forward(A["fch_gelu"][l], p["fcprojw"], p["fcprojb"])  # (B,T,C)
        A["residual3"][l] = residual_forward(A["residual2"][l], A["fcproj"][l])
    # forward pass 3: final LayerNorm, classifier tied to wte, softmax, cross-entropy
    A["lnf"][...], A["lnf_mean"][...], A["lnf_rstd"][...] = layernorm_forward(A["residual3"][L - 1], P["lnfw"], P["lnfb"])
    A["logits"][...] = matmul_forward(A["lnf"], P["wte"], None)             # (B,T,C) @ (C,Vp) -> (B,T,Vp)
    if targets is not None:
        A["probs"][...] = softmax_forward(A["logits"], V)
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
    gradient of loss_scale * mean(losses) into model.grads. With gradient accumulation over n
    micro-batches, loss_scale = 1/n makes the sum the gradient of the mean loss."""
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
        p, g = layer_params(P, l), layer_params(G, l)
        residual = A["encoded"] if l == 0 else A["residual3"][l - 1]
        # backward pass 2: MLP block. residual3 = residual2 + fcproj: both receive dresidual
        # (the same array: every later "dresidual = dresidual + ..." makes a new one, never +=)
        dresidual, dfcproj = residual_backward(dresidual)
        dfch_gelu = matmul_backward(g["fcprojw"], g["fcprojb"], dfcproj, A["fch_gelu"][l], p["fcprojw"])
        dfch = gelu_backward(dfch_gelu, A["fch"][l])
        dln2 = matmul_backward(g["fcw"], g["fcb"], dfch, A["ln2"][l], p["fcw"])
        dresidual = dresidual + layernorm_backward(g["ln2w"], g["ln2b"], dln2, A["residual2"][l], p["ln2w"],
                                                   A["ln2_mean"][l], A["ln2_rstd"][l])
        # backward pass 1: attention block. residual2 = residual + attproj
        dresidual, dattproj = residual_backward(dresidual)
        datty = matmul_backward(g["attprojw"], g["attprojb"], dattproj, A["atty"][l], p["attprojw"])
        dqkv = attention_backward(datty, A["qkv"][l], A["att"][l], NH)
        dln1 = matmul_backward(g["qkvw"], g["qkvb"], dqkv, A["ln1"][l], p["qkvw"])
        dresidual = dresidual + layernorm_backward(g["ln1w"], g["ln1b"], dln1, residual, p["ln1w"],
                                                   A["ln1_mean"][l], A["ln1_rstd"][l])
    # backward of the encoder: encoded = wte[inputs] + wpe
    encoder_backward(G["wte"], G["wpe"], dresidual, model.inputs)


def gpt2_grad_norm(model):
    """Global L2 norm of all parameter gradients, accumulated in float64 (a Python float)."""
    total = 0.0
    for name, _ in model.param_shapes:
        g = model.G[name].ravel()
        total += float(np.dot(g, g))
    return math.sqrt(total)


def adamw_chunk(p, g, m, v, scratch, learning_rate, beta1, beta2, bc1, bc2, eps, weight_decay, grad_scale):
    """AdamW on one contiguous slice of the flat buffers, in place (see gpt2_update for the math).
    scratch: (2, n) with n >= p.size. The bias corrections are folded into two
    scalars, using  (m / bc1) / (sqrt(v / bc2) + eps) = (sqrt(bc2) / bc1) * m / (sqrt(v) + eps sqrt(bc2)),
    so each element sees a dozen NumPy passes, all on a slice small enough to stay in cache."""
    t, gs = scratch[0, :p.size], scratch[1, :p.size]
    if grad_scale != 1.0:
        g = np.multiply(g, grad_scale, out=gs)         # g = grad_scale * grad (clipping)
    m *= beta1
    m += np.multiply(g, 1.0 - beta1, out=t)            # m = beta1 m + (1 - beta1) g
    np.multiply(g, g, out=t)
    t *= 1.0 - beta2
    v *= beta2
    v += t                                             # v = beta2 v + (1 - beta2) g^2
    np.sqrt(v, out=t)
    t += eps * math.sqrt(bc2)
    np.divide(m, t, out=t)
    t *= learning_rate * math.sqrt(bc2) / bc1          # lr * (m / bc1) / (sqrt(v / bc2) + eps)
    if weight_decay != 0.0:
        p *= 1.0 - learning_rate * weight_decay        # p - lr * weight_decay * p (decoupled decay)
    p -= t


def gpt2_update(model, learning_rate, beta1, beta2, eps, weight_decay, t, grad_scale=1.0):
    """One AdamW step over the flat buffers (Loshchilov & Hutter 2019, Alg. 2, with Adam's bias
    correction, Kingma & Ba 2015). t is the 1-based step count. grad_scale multiplies the gradient
    first (global-norm clipping passes max_norm/norm). Weight decay applies to DECAYED_PARAMETERS only:
        g = grad_scale * grad
        m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2
        p -= lr * ((m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + weight_decay * p)
    The update is memory-bound and NumPy's elementwise ops use one core, so the flat buffer is cut
    into chunks of ADAMW_CHUNK floats (each stays in cache through its dozen passes) and the chunks
    are shared out over one thread per core (NumPy releases the GIL inside its loops)."""
    if model.m is None:
        model.m = np.zeros_like(model.params)
        model.v = np.zeros_like(model.params)
    bc1 = 1.0 - beta1 ** t
    bc2 = 1.0 - beta2 ** t
    chunks, offset = [], 0                             # (slice, weight decay) in file order
    for name, shape in model.param_shapes:
        n = math.prod(shape)
        wd = weight_decay if name in DECAYED_PARAMETERS else 0.0
        chunks += [(slice(s, min(s + ADAMW_CHUNK, offset + n)), wd) for s in range(offset, offset + n, ADAMW_CHUNK)]
        offset += n

    def work(worker, num_workers):
        scratch = np.empty((2, ADAMW_CHUNK), model.params.dtype)
        for sl, wd in chunks[worker::num_workers]:
            adamw_chunk(model.params[sl], model.grads[sl], model.m[sl], model.v[sl], scratch,
                        learning_rate, beta1, beta2, bc1, bc2, eps, wd, grad_scale)

    num_workers = min(os.cpu_count() or 1, len(chunks))
    if num_workers == 1:
        work(0, 1)
    else:
        with ThreadPoolExecutor(num_workers) as pool:
            list(pool.map(work, range(num_workers), [num_workers] * num_workers))


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
# file formats (shared/docs/file-formats.md): headers, model, debug state, tokenizer, shards

def read_header(f, path, magic, versions, what):
    """Read and check a 256-int32 header. Returns it as a numpy int32 array. Raises InputError
    naming the file on truncation, bad magic or an unsupported version."""
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise InputError(f"{path}: truncated {what} file: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != magic:
        raise InputError(f"{path}: bad magic number {header[0]} (expected {magic}): not a {what} file")
    if header[1] not in versions:
        raise InputError(f"{path}: unsupported {what} version {header[1]} (expected {' or '.join(map(str, versions))})")
    return header


def make_header(values):
    """A 256-int32 header with `values` {slot: int} set and every other slot 0."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    for slot, value in values.items():
        header[slot] = value
    return header


def read_exact(f, path, count, dtype, what):
    """Read exactly `count` items of `dtype` or raise InputError(truncated)."""
    dtype = np.dtype(dtype)
    raw = f.read(count * dtype.itemsize)
    if len(raw) != count * dtype.itemsize:
        raise InputError(f"{path}: truncated {what}: expected {count * dtype.itemsize} bytes, got {len(raw)}")
    return np.frombuffer(raw, dtype=dtype).copy()


def atomic_write(path, write_fn):
    """Write a file through `write_fn(f)` to a temporary name, fsync, then rename it into place,
    so that a crash mid-write never leaves a file that looks complete."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def float32_to_bfloat16_bits(x):
    """Round float32 values to bfloat16, round-to-nearest-even, returned as uint16 bit patterns."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)         # ties go to the even mantissa
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x.ravel()).reshape(bits.shape)
    out[nan] = 0x7FC0                                         # keep NaN a (quiet) NaN
    return out


def bfloat16_bits_to_float32(bits):
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read_model(path, dtype=np.float32):
    """Load a model checkpoint (.bin, version 3 fp32 or 5 bf16 upcast to fp32) -> GPT2.
    Raises InputError on a missing file, bad header or truncation."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such model checkpoint")
    with open(path, "rb") as f:
        h = read_header(f, path, MODEL_MAGIC, (MODEL_VERSION_FP32, MODEL_VERSION_BF16), "model checkpoint")
        config = GPT2Config(max_seq_len=int(h[2]), vocab_size=int(h[3]), num_layers=int(h[4]),
                            num_heads=int(h[5]), channels=int(h[6]),
                            padded_vocab_size=int(h[7]) if h[7] else padded_vocab(int(h[3])))
        if min(config.max_seq_len, config.vocab_size, config.num_layers, config.num_heads, config.channels) <= 0 \
                or config.channels % config.num_heads or config.padded_vocab_size < config.vocab_size:
            raise InputError(f"{path}: inconsistent model header {config}")
        model = GPT2(config, dtype)
        if h[1] == MODEL_VERSION_FP32:
            model.params[...] = read_exact(f, path, model.num_parameters, "<f4", "fp32 parameters")
        else:
            bits = read_exact(f, path, model.num_parameters, "<u2", "bf16 parameters")
            model.params[...] = bfloat16_bits_to_float32(bits)
        if f.read(1):
            raise InputError(f"{path}: trailing bytes after the {model.num_parameters} parameters")
    return model


def model_header(config, version):
    """The 256-int32 header of a model checkpoint for `config` (version 3 fp32 or 5 bf16)."""
    return make_header({0: MODEL_MAGIC, 1: version, 2: config.max_seq_len, 3: config.vocab_size,
                        4: config.num_layers, 5: config.num_heads, 6: config.channels,
                        7: config.padded_vocab_size})


def write_model(path, model, dtype="float32"):
    """Write a model checkpoint atomically: dtype "float32" (version 3) or "bfloat16" (version 5)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
    version = MODEL_VERSION_FP32 if dtype == "float32" else MODEL_VERSION_BF16
    params = model.params.astype(np.float32)
    data = params.astype("<f4") if dtype == "float32" else float32_to_bfloat16_bits(params).astype("<u2")

    def write(f):
        f.write(model_header(model.config, version).tobytes())
        f.write(data.tobytes())
    atomic_write(path, write)


def write_debug_state(path, x, y, logits, loss, grads):
    """Write llm.c's debug-state test vectors: x, y (B,T) int32; logits (B,T,V) fp32 (unpadded);
    loss (scalar); grads: the 16 gradient tensors in file order (wte's padded to Vp)."""
    B, T = x.shape

    def write(f):
        f.write(make_header({0: DEBUG_STATE_MAGIC, 1: DEBUG_STATE_VERSION, 2: B, 3: T}).tobytes())
        f.write(np.asarray(x, "<i4").tobytes())
        f.write(np.asarray(y, "<i4").tobytes())
        f.write(np.asarray(logits, "<f4").tobytes())
        f.write(np.asarray([loss], "<f4").tobytes())
        for g in grads:
            f.write(np.asarray(g, "<f4").tobytes())
    atomic_write(path, write)


def read_debug_state(path, config):
    """Read a debug-state file for a model of `config`. Returns a dict with x, y (B,T) int32,
    logits (B,T,V), loss (float), grads {name: array in parameter shape}. Raises InputError."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such debug-state file")
    with open(path, "rb") as f:
        h = read_header(f, path, DEBUG_STATE_MAGIC, (DEBUG_STATE_VERSION,), "debug state")
        B, T = int(h[2]), int(h[3])
        x = read_exact(f, path, B * T, "<i4", "inputs").reshape(B, T)
        y = read_exact(f, path, B * T, "<i4", "targets").reshape(B, T)
        logits = read_exact(f, path, B * T * config.vocab_size, "<f4", "logits").reshape(B, T, config.vocab_size)
        loss = float(read_exact(f, path, 1, "<f4", "loss")[0])
        grads = {name: read_exact(f, path, math.prod(shape), "<f4", f"gradient {name}").reshape(shape)
                 for name, shape in parameter_shapes(config)}
        if f.read(1):
            raise InputError(f"{path}: trailing bytes: the debug state does not belong to this model")
    return {"x": x, "y": y, "logits": logits, "loss": loss, "grads": grads}


def write_tokenizer(path, token_bytes, eot_token=GPT2_EOT):
    """Write the tokenizer file (version 2): token_bytes is a list of bytes, one per token id."""
    def write(f):
        f.write(make_header({0: TOKENIZER_MAGIC, 1: TOKENIZER_VERSION, 2: len(token_bytes), 3: eot_token}).tobytes())
        for i, b in enumerate(token_bytes):
            if not 1 <= len(b) <= 255:
                raise ValueError(f"token {i} has {len(b)} bytes; the format allows 1..255")
            f.write(struct.pack("<B", len(b)) + b)
    atomic_write(path, write)


def read_tokenizer(path):
    """Read a tokenizer file -> (token_bytes: list of bytes, eot_token: int). Raises InputError."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such tokenizer file")
    with open(path, "rb") as f:
        h = read_header(f, path, TOKENIZER_MAGIC, (1, TOKENIZER_VERSION), "tokenizer")
        n = int(h[2])
        eot = int(h[3]) if h[1] == TOKENIZER_VERSION else GPT2_EOT
        data = f.read()
    tokens, pos = [], 0
    for i in range(n):
        if pos >= len(data):
            raise InputError(f"{path}: truncated tokenizer: {i} of {n} tokens present")
        length = data[pos]
        if length == 0 or pos + 1 + length > len(data):
            raise InputError(f"{path}: truncated or corrupt tokenizer at token {i}")
        tokens.append(data[pos + 1:pos + 1 + length])
        pos += 1 + length
    return tokens, eot


def write_shard(path, tokens):
    """Write a token data shard: header + uint16 tokens (each must be < 65536), atomically."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.uint16).max):
        raise ValueError("token ids must fit in uint16")

    def write(f):
        f.write(make_header({0: SHARD_MAGIC, 1: SHARD_VERSION, 2: tokens.size}).tobytes())
        f.write(tokens.astype("<u2").tobytes())
    atomic_write(path, write)


def read_shard(path):
    """Memory-map a token shard's tokens (uint16, read-only) after checking its header and that
    the file size is exactly 1024 + 2N bytes. Raises InputError naming the file."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such data shard")
    size = os.path.getsize(path)
    if size == 0:
        raise InputError(f"{path}: empty data shard")
    with open(path, "rb") as f:
        h = read_header(f, path, SHARD_MAGIC, (SHARD_VERSION,), "token shard")
    n = int(h[2])
    if size != HEADER_BYTES + 2 * n:
        raise InputError(f"{path}: file is {size} bytes but its header says {n} tokens ({HEADER_BYTES + 2 * n} bytes): truncated or corrupt")
    if n == 0:
        raise InputError(f"{path}: data shard holds no tokens")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


# ----------------------------------------------------------------------------
# multiple-choice evaluation (HellaSwag): the eval file and the scoring rule
#
# An example is a dict {"index", "label" (the right completion), "context": token ids,
# "completions": NUM_COMPLETIONS lists of token ids}. In the file (llm.c's dev/data/hellaswag.py
# layout) each example is a uint16 stream
#     65535 | nbytes | index | label | 4 | n_ctx ctx... | n_0 end_0... | ... | n_3 end_3...
# with nbytes counting the whole example in bytes; header slot 3 holds the longest example in
# bytes (llm.c's C loader allocates exactly that many bytes for one example).

EXAMPLE_START = 2**16 - 1          # uint16 marker that opens every example; no token may equal it
NUM_COMPLETIONS = 4                # llm.c's EvalLoader assumes 4 (ASSUMED_NUM_COMPLETIONS)
EXAMPLE_FIELDS = 5                 # start, nbytes, index, label, num_completions
UINT16_BYTES = 2
MAX_EXAMPLE_BYTES = 2**16 - 1      # nbytes is itself a uint16
MAX_EXAMPLES = 2**16 - 1           # the index is a uint16
HEADER_SLOT_NUM_EXAMPLES = 2
HEADER_SLOT_LONGEST = 3            # longest example, in bytes
PAD_TOKEN = 0                      # fills a row after its completion; causal attention never sees it


def example_stream(example):
    """One example -> its uint16 stream (list of ints), nbytes filled in.
    Raises ValueError if a field does not fit the format."""
    context, completions, label = example["context"], example["completions"], example["label"]
    if len(completions) != NUM_COMPLETIONS:
        raise ValueError(f"example {example['index']}: {len(completions)} completions, the format needs {NUM_COMPLETIONS}")
    if not 0 <= label < NUM_COMPLETIONS:
        raise ValueError(f"example {example['index']}: label {label} is not a completion index")
    if not 0 <= example["index"] < MAX_EXAMPLES:
        raise ValueError(f"example index {example['index']} does not fit in uint16")
    stream = [EXAMPLE_START, 0, example["index"], label, NUM_COMPLETIONS]
    for tokens in [context] + list(completions):
        if len(tokens) == 0:
            raise ValueError(f"example {example['index']}: empty context or completion")
        if min(tokens) < 0 or max(tokens) >= EXAMPLE_START:
            raise ValueError(f"example {example['index']}: token ids must be in [0, {EXAMPLE_START})")
        stream.append(len(tokens))
        stream.extend(int(t) for t in tokens)
    nbytes = len(stream) * UINT16_BYTES
    if nbytes > MAX_EXAMPLE_BYTES:
        raise ValueError(f"example {example['index']}: {nbytes} bytes, more than a uint16 length can say")
    stream[1] = nbytes
    return stream


def write_eval_file(path, examples):
    """Write `examples` (list of example dicts, see above) as a multiple-choice eval file,
    atomically. Header: magic, version, number of examples, longest example in bytes.
    Returns the longest example's size in bytes. Raises ValueError on an example that does not
    fit the format (not 4 completions, a token id >= 65535, an example over 65535 bytes, more
    than 65535 examples)."""
    if not examples:
        raise ValueError("no examples to write")
    if len(examples) > MAX_EXAMPLES:
        raise ValueError(f"{len(examples)} examples: the format holds at most {MAX_EXAMPLES}")
    streams = [example_stream(ex) for ex in examples]
    longest = max(s[1] for s in streams)
    header = make_header({0: EVAL_MAGIC, 1: EVAL_VERSION, HEADER_SLOT_NUM_EXAMPLES: len(examples),
                          HEADER_SLOT_LONGEST: longest})
    body = np.array([t for s in streams for t in s], dtype="<u2")

    def write(f):
        f.write(header.tobytes())
        f.write(body.tobytes())
    atomic_write(path, write)
    return longest


def read_eval_file(path):
    """Read a multiple-choice eval file -> list of example dicts (tokens as lists of int).
    Every length is checked against the others: raises InputError naming the file and the
    example on a bad magic or version, a missing start marker, a truncated example, an nbytes
    field that disagrees with the fields inside it, trailing bytes, or a header whose example
    count or longest-example size disagrees with the body."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such eval file")
    with open(path, "rb") as f:
        h = read_header(f, path, EVAL_MAGIC, (EVAL_VERSION,), "multiple-choice eval")
        body = f.read()
    if len(body) % UINT16_BYTES:
        raise InputError(f"{path}: truncated eval file: odd number of bytes after the header")
    stream = np.frombuffer(body, dtype="<u2")
    num_examples, longest = int(h[HEADER_SLOT_NUM_EXAMPLES]), int(h[HEADER_SLOT_LONGEST])
    examples, pos, seen_longest = [], 0, 0
    for i in range(num_examples):
        where = f"{path}: example {i} (byte {HEADER_BYTES + pos * UINT16_BYTES})"
        if pos + EXAMPLE_FIELDS > stream.size:
            raise InputError(f"{where}: truncated eval file, {num_examples} examples promised")
        if stream[pos] != EXAMPLE_START:
            raise InputError(f"{where}: no start marker {EXAMPLE_START} (found {stream[pos]}): corrupt eval file")
        nbytes = int(stream[pos + 1])
        n = nbytes // UINT16_BYTES                            # the example's length in uint16
        if nbytes % UINT16_BYTES or n < EXAMPLE_FIELDS:
            raise InputError(f"{where}: impossible example length {nbytes} bytes")
        if pos + n > stream.size:
            raise InputError(f"{where}: truncated: its {nbytes} bytes run past the end of the file")
        ex = stream[pos:pos + n]
        index, label, num_completions = int(ex[2]), int(ex[3]), int(ex[4])
        if num_completions != NUM_COMPLETIONS or not 0 <= label < num_completions:
            raise InputError(f"{where}: {num_completions} completions with label {label}; expected {NUM_COMPLETIONS} and a label below it")
        parts, q = [], EXAMPLE_FIELDS                         # q walks the example's uint16s
        for _ in range(1 + num_completions):                  # the context, then each completion
            if q >= n or q + 1 + int(ex[q]) > n:
                raise InputError(f"{where}: a token-list length runs past the example's {nbytes} bytes: inconsistent lengths")
            length = int(ex[q])
            parts.append(ex[q + 1:q + 1 + length].astype(np.int64).tolist())
            q += 1 + length
        if q != n:
            raise InputError(f"{where}: fields fill {q * UINT16_BYTES} of the example's {nbytes} bytes: inconsistent lengths")
        examples.append({"index": index, "label": label, "context": parts[0], "completions": parts[1:]})
        seen_longest = max(seen_longest, nbytes)
        pos += n
    if pos != stream.size:
        raise InputError(f"{path}: {(stream.size - pos) * UINT16_BYTES} bytes after the last of {num_examples} examples")
    if longest != seen_longest:
        raise InputError(f"{path}: header says the longest example is {longest} bytes, the body's is {seen_longest}")
    return examples


def completion_rows(example, T):
    """One example -> (inputs, targets, mask), each (NUM_COMPLETIONS, T): row i is the context
    followed by completion i, padded with PAD_TOKEN; targets are the inputs shifted left by one;
    mask (bool) is True at the positions whose target is a completion token, i.e. positions
    n_ctx-1 .. n_ctx+n_i-2 of row i (the last context token predicts the first completion token).
    If context + longest completion exceed T, the context loses tokens from its *start* so that
    every row still fits (llm.c asserts instead). Raises InputError if a completion alone
    needs T or more positions."""
    context, completions = example["context"], example["completions"]
    if not context:
        raise InputError(f"example {example['index']}: empty context: nothing predicts the first completion token")
    longest = max(len(c) for c in completions)
    if longest >= T:
        raise InputError(f"example {example['index']}: a completion of {longest} tokens does not fit T={T} after a context token")
    context = context[-(T - longest):]                            # keep the context's end
    n_ctx = len(context)
    rows = len(completions)
    inputs = np.full((rows, T + 1), PAD_TOKEN, dtype=np.int32)    # one extra column so targets can shift
    mask = np.zeros((rows, T), dtype=bool)
    for i, completion in enumerate(completions):
        n = len(completion)
        inputs[i, :n_ctx] = context
        inputs[i, n_ctx:n_ctx + n] = completion
        mask[i, n_ctx - 1:n_ctx - 1 + n] = True                   # targets[i, t] = inputs[i, t+1]
    return inputs[:, :T], inputs[:, 1:], mask


def completion_batches(examples, T):
    """Yield (inputs, targets, mask, label) per example: inputs and targets (NUM_COMPLETIONS, T)
    int32, mask (NUM_COMPLETIONS, T) bool (see completion_rows), label the right completion's
    index. A trainer runs the forward pass with targets on each (stacking B // 4 examples per
    batch if it likes) and hands the per-position losses to score_example."""
    for example in examples:
        inputs, targets, mask = completion_rows(example, T)
        yield inputs, targets, mask, example["label"]


def completion_losses(losses, mask):
    """Mean cross-entropy of each row over its masked positions. losses (R,T), mask (R,T) -> (R,)
    float64. Raises ValueError if a row has no masked position."""
    mask = np.asarray(mask, dtype=bool)
    counts = mask.sum(axis=1)
    if np.any(counts == 0):
        raise ValueError("every row needs at least one masked (completion) position")
    total = np.where(mask, np.asarray(losses, dtype=np.float64), 0.0).sum(axis=1)  # (R,)
    return total / counts


def score_example(losses, mask):
    """The predicted completion of one example: the row with the lowest mean cross-entropy over
    its own completion tokens (llm.c's rule; dividing by the length keeps long completions from
    losing just for being long). losses (4,T) per-position cross-entropy; mask (4,T) bool.
    Ties go to the lower index. Returns an int."""
    return int(np.argmin(completion_losses(losses, mask)))


def evaluate_multiple_choice(forward_losses, examples, B, T, comm):
    """Accuracy on multiple-choice examples (HellaSwag). Each example becomes NUM_COMPLETIONS rows
    (completion_rows); B // NUM_COMPLETIONS examples (at least one) go through one call of
    forward_losses(inputs (R,T) int32, targets (R,T) int32) -> per-position losses (R,T); the
    completion with the lowest mean loss over its own tokens is the prediction (score_example).
    Ranks take every comm.size-th example. Returns (accuracy in [0,1], number of examples)."""
    per_batch = max(1, B // NUM_COMPLETIONS)
    mine = examples[comm.rank::comm.size]
    correct = 0
    for start in range(0, len(mine), per_batch):
        batch = mine[start:start + per_batch]
        rows = [completion_rows(ex, T) for ex in batch]
        inputs = np.concatenate([r[0] for r in rows])            # (4 * len(batch), T)
        targets = np.concatenate([r[1] for r in rows])
        losses = forward_losses(inputs, targets)
        for j, (ex, (_, _, mask)) in enumerate(zip(batch, rows)):
            rows_j = slice(j * NUM_COMPLETIONS, (j + 1) * NUM_COMPLETIONS)
            correct += score_example(losses[rows_j], mask) == ex["label"]
    total = comm.sum(float(correct))
    return total / len(examples), len(examples)


# ----------------------------------------------------------------------------
# data loader: llm.c token shards, strided by rank, optionally shuffled

class DataLoader:
    """Batches of B sequences of T tokens from a glob of shards, llm.c's scheme:
    a shard holds shard_num_samples global batches of B*T*num_processes tokens; process `rank`
    reads its B*T (+1 for the targets) tokens at offset rank*B*T inside each global batch. After
    the last batch of a shard comes the next shard; after the last shard, the first (an epoch).
    With shuffle, the shard order and the order of batches inside each shard are permuted by a
    seeded RNG (numpy PCG64), reshuffled every epoch / shard.
    Raises InputError if nothing matches, a shard is bad, or a shard is shorter than one batch."""

    def __init__(self, pattern, B, T, process_rank=0, num_processes=1, shuffle=False, seed=42):
        self.pattern, self.B, self.T = pattern, B, T
        self.process_rank, self.num_processes = process_rank, num_processes
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise InputError(f"{pattern}: no data file matches (run `make data` for the default dataset)")
        need = B * T * num_processes + 1
        self.num_tokens = 0
        for path in self.files:               # validate every shard up front
            n = read_shard(path).size
            if n < need:
                raise InputError(f"{path}: {n} tokens is shorter than one batch of B*T*processes+1 = {need}")
            self.num_tokens += n
        self.shuffle = shuffle
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self):
        """Back to the first batch of the first shard (a new permutation if shuffling)."""
        self.shard_order = self.rng.permutation(len(self.files)) if self.shuffle else np.arange(len(self.files))
        self.current_shard_idx = 0
        self.load_shard(0)

    def load_shard(self, idx):
        self.current_shard_idx = idx
        self.tokens = read_shard(self.files[self.shard_order[idx]])
        self.shard_num_samples = (self.tokens.size - 1) // (self.B * self.T * self.num_processes)
        self.sample_order = (self.rng.permutation(self.shard_num_samples) if self.shuffle
                             else np.arange(self.shard_num_samples))
        self.current_sample_idx = 0

    def next_batch(self):
        """Return (inputs, targets), each (B,T) int32; targets are inputs shifted by one token."""
        if self.current_sample_idx >= self.shard_num_samples:
            if self.current_shard_idx == len(self.files) - 1:
                self.reset()
            else:
                self.load_shard(self.current_shard_idx + 1)
        B, T = self.B, self.T
        sample = int(self.sample_order[self.current_sample_idx])
        start = (sample * self.num_processes + self.process_rank) * B * T
        buf = np.asarray(self.tokens[start:start + B * T + 1], dtype=np.int32)
        self.current_sample_idx += 1
        return buf[:-1].reshape(B, T), buf[1:].reshape(B, T)

    def state(self):
        """Position to save: current shard index, current sample index, and the shuffle state."""
        return {"shard": self.current_shard_idx, "sample": self.current_sample_idx,
                "shard_order": self.shard_order.copy(), "sample_order": self.sample_order.copy(),
                "rng": self.rng.bit_generator.state}

    def restore(self, state):
        """Resume at a saved position. Raises InputError if it does not fit these files."""
        if self.shuffle:
            self.shard_order = np.asarray(state["shard_order"])
        if not 0 <= state["shard"] < len(self.files):
            raise InputError(f"saved loader position (shard {state['shard']}) does not fit {len(self.files)} shard(s) of {self.pattern}")
        self.load_shard(state["shard"])
        if self.shuffle:
            self.sample_order = np.asarray(state["sample_order"])
            self.rng.bit_generator.state = state["rng"]
        if not 0 <= state["sample"] <= self.shard_num_samples:
            raise InputError(f"saved loader position (sample {state['sample']}) does not fit shard {self.files[self.shard_order[state['shard']]]}")
        self.current_sample_idx = state["sample"]


# ----------------------------------------------------------------------------
# tokenizer: decode from gpt2_tokenizer.bin, encode through tiktoken

class Tokenizer:
    """Decodes token ids with a tokenizer .bin (list of byte strings per id)."""

    def __init__(self, path=DEFAULT_TOKENIZER):
        self.token_bytes, self.eot_token = read_tokenizer(path)

    def decode_bytes(self, ids):
        return b"".join(self.token_bytes[i] for i in ids)

    def decode(self, ids):
        """Token ids -> text (bytes that are not valid UTF-8 become U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def gpt2_encoding(bpe_path=DEFAULT_BPE):
    """tiktoken's GPT-2 encoding. Uses tiktoken's own download/cache when that works; otherwise
    builds the same encoding from a local copy of the BPE ranks (`data/gpt2.tiktoken`, checked
    against its sha256), which `make data` fetches offline. Raises InputError if neither works."""
    import tiktoken
    if os.path.isfile(bpe_path):
        from tiktoken.load import load_tiktoken_bpe
        from tiktoken_ext.openai_public import r50k_pat_str
        ranks = load_tiktoken_bpe(bpe_path, expected_hash=GPT2_BPE_SHA256)
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": GPT2_EOT})
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:     # offline and no local copy
        raise InputError(f"cannot load the GPT-2 BPE: tiktoken failed ({type(e).__name__}) and {bpe_path} is missing; run `make data`")


# ----------------------------------------------------------------------------
# sampler: llm.c's xorshift* RNG, so the CPU and CUDA trainers draw the same numbers

SAMPLE_SEED = 1337


class SamplerRNG:
    """xorshift64* (Marsaglia 2003; Vigna 2016), the RNG llm.c uses for sampling. state is a
    nonzero uint64; random_f32() returns a float in [0, 1) from the top 24 bits."""
    MASK = (1 << 64) - 1

    def __init__(self, state=SAMPLE_SEED):
        self.state = state & self.MASK

    def random_u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & self.MASK
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & self.MASK) >> 32

    def random_f32(self):
        return (self.random_u32() >> 8) / 16777216.0


def sample_token(logits, V, rng, temperature=1.0, top_k=0):
    """Draw one token id from logits (Vp,) restricted to the first V. temperature > 0 divides the
    logits; top_k > 0 keeps only the k most likely tokens. Uses one rng.random_f32() coin and
    inverse-CDF sampling, in float64, so it is deterministic given the logits and the RNG state."""
    z = np.asarray(logits[:V], dtype=np.float64) / max(temperature, 1e-8)
    if 0 < top_k < V:
        kth = np.partition(z, V - top_k)[V - top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    cdf = np.cumsum(p / p.sum())
    coin = rng.random_f32()
    return int(min(np.searchsorted(cdf, coin, side="right"), V - 1))


def generate(model, prompt, max_new_tokens, rng, temperature=1.0, top_k=0, on_token=None, forward=None):
    """Autoregressive sampling. prompt: list of token ids (at least one). Runs the full forward
    over a fixed window of min(maxT, len(prompt)+max_new_tokens) tokens each step (no KV cache:
    causal attention makes the padding after position t irrelevant) and reads the logits at t-1.
    forward(x (1,window) int32) -> logits (1,window,Vp) defaults to gpt2_forward on this model
    (gpt2_cuda.py passes its own). Calls on_token(id) as each token is produced. Returns the new
    token ids. Raises InputError if the prompt is empty or longer than max_seq_len."""
    V, maxT = model.config.vocab_size, model.config.max_seq_len
    if not prompt:
        raise InputError("empty prompt: give at least one token")
    if len(prompt) > maxT:
        raise InputError(f"prompt of {len(prompt)} tokens is longer than max_seq_len {maxT}")
    forward = forward or (lambda x: gpt2_forward(model, x))
    window = min(maxT, len(prompt) + max_new_tokens)
    tokens = list(prompt)
    out = []
    for _ in range(max_new_tokens):
        ctx = tokens[-window:]
        x = np.zeros((1, window), dtype=np.int32)       # positions after the context: any valid id
        x[0, :len(ctx)] = ctx
        logits = forward(x)
        nxt = sample_token(logits[0, len(ctx) - 1], V, rng, temperature, top_k)
        tokens.append(nxt)
        out.append(nxt)
        if on_token:
            on_token(nxt)
    return out


# ----------------------------------------------------------------------------
# training state: checkpoints for resume (model + AdamW + step + RNG + loader position)

def checkpoint_paths(out_dir, step, rank=0):
    """(model, state, DONE-marker) file paths of the checkpoint at `step`, llm.c's names."""
    return (os.path.join(out_dir, f"model_{step:08d}.bin"),
            os.path.join(out_dir, f"state_{step:08d}_{rank:05d}.bin"),
            os.path.join(out_dir, f"DONE_{step:08d}"))


def write_state(path, model, step, process_rank, num_processes, loader, sample_rng_state,
                rng_state_last_update=0, master_weights=None):
    """Write the training-state file of the formats doc, atomically: header, fp32 AdamW m, v,
    optional fp32 master weights, then (if the loader shuffles) its permutation state: as in llm.c,
    uint64 shard count, int32 shard order, uint64 sample count, int32 sample order; then, where
    llm.c puts its Mersenne-Twister state, ours: the PCG64 state as 4 uint64 (state hi/lo, inc hi/lo)."""
    n = model.num_parameters
    m = model.m if model.m is not None else np.zeros(n, np.float32)
    v = model.v if model.v is not None else np.zeros(n, np.float32)
    ls = loader.state()
    header = make_header({0: STATE_MAGIC, 1: STATE_VERSION, 2: num_processes, 3: process_rank,
                          4: int(master_weights is not None), 5: int(loader.shuffle), 10: step})
    as_u64 = header.view("<u8")                    # slots 2k, 2k+1 hold uint64 k
    as_u64[10] = sample_rng_state
    as_u64[11] = rng_state_last_update
    as_u64[15] = ls["shard"]
    as_u64[16] = ls["sample"]

    def write(f):
        f.write(header.tobytes())
        f.write(np.asarray(m, "<f4").tobytes())
        f.write(np.asarray(v, "<f4").tobytes())
        if master_weights is not None:
            f.write(np.asarray(master_weights, "<f4").tobytes())
        if loader.shuffle:
            f.write(np.asarray([ls["shard_order"].size], "<u8").tobytes())
            f.write(np.asarray(ls["shard_order"], "<i4").tobytes())
            f.write(np.asarray([ls["sample_order"].size], "<u8").tobytes())
            f.write(np.asarray(ls["sample_order"], "<i4").tobytes())
            st = ls["rng"]["state"]
            words = [st["state"] >> 64, st["state"] & SamplerRNG.MASK, st["inc"] >> 64, st["inc"] & SamplerRNG.MASK]
            f.write(np.asarray(words, "<u8").tobytes())
    atomic_write(path, write)


def read_state(path, num_parameters, process_rank, num_processes):
    """Read a training-state file. Returns a dict: step, sample_rng_state, rng_state_last_update,
    m, v, master_weights (or None), loader (position dict for DataLoader.restore), shuffle.
    Raises InputError on a missing, corrupt or mismatched file."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such state file")
    with open(path, "rb") as f:
        h = read_header(f, path, STATE_MAGIC, (STATE_VERSION,), "training state")
        if h[2] != num_processes or h[3] != process_rank:
            raise InputError(f"{path}: written by rank {h[3]} of {h[2]} processes, but this is rank {process_rank} of {num_processes}")
        u64 = h.view("<u8")
        out = {"step": int(h[10]), "sample_rng_state": int(u64[10]), "rng_state_last_update": int(u64[11]),
               "shuffle": bool(h[5])}
        out["m"] = read_exact(f, path, num_parameters, "<f4", "AdamW m")
        out["v"] = read_exact(f, path, num_parameters, "<f4", "AdamW v")
        out["master_weights"] = read_exact(f, path, num_parameters, "<f4", "master weights") if h[4] else None
        loader = {"shard": int(u64[15]), "sample": int(u64[16])}
        if h[5]:
            ns = int(read_exact(f, path, 1, "<u8", "shard count")[0])
            loader["shard_order"] = read_exact(f, path, ns, "<i4", "shard order")
            nb = int(read_exact(f, path, 1, "<u8", "sample count")[0])
            loader["sample_order"] = read_exact(f, path, nb, "<i4", "sample order")
            w = [int(x) for x in read_exact(f, path, 4, "<u8", "shuffle RNG state")]
            loader["rng"] = {"bit_generator": "PCG64", "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
                             "has_uint32": 0, "uinteger": 0}
        if f.read(1):
            raise InputError(f"{path}: trailing bytes: the state file does not match a model of {num_parameters} parameters")
    if not (np.isfinite(out["m"]).all() and np.isfinite(out["v"]).all() and (out["v"] >= 0).all()):
        raise InputError(f"{path}: corrupt state file: AdamW moments are not finite")
    out["loader"] = loader
    return out


def latest_checkpoint_step(out_dir):
    """The largest step with a DONE_<step> marker in out_dir, or None."""
    steps = [int(os.path.basename(p)[5:]) for p in glob.glob(os.path.join(out_dir, "DONE_*"))
             if os.path.basename(p)[5:].isdigit()]
    return max(steps) if steps else None


def save_checkpoint(out_dir, step, model, loader, sample_rng_state, process_rank=0, num_processes=1):
    """Write model_<step>.bin (fp32, rank 0), state_<step>_<rank>.bin, then DONE_<step> last.
    With several ranks, the caller barriers between the state files and the DONE marker."""
    model_path, state_path, done_path = checkpoint_paths(out_dir, step, process_rank)
    if process_rank == 0:
        write_model(model_path, model)
    write_state(state_path, model, step, process_rank, num_processes, loader, sample_rng_state)
    return done_path


def write_done_marker(done_path):
    """Write the empty DONE_<step> file that marks a checkpoint complete (always last)."""
    atomic_write(done_path, lambda f: None)


# ----------------------------------------------------------------------------
# data parallelism: MPI through mpi4py, imported only under mpiexec

class Comm:
    """Rank, world size and averaging across processes. Without mpiexec (no PMI_SIZE /
    OMPI_COMM_WORLD_SIZE in the environment) this is a single process and mpi4py is not imported."""

    def __init__(self):
        size = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
        self.comm = None
        self.rank, self.size = 0, 1
        if size > 1:
            from mpi4py import MPI
            self.MPI = MPI
            self.comm = MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def mean_(self, arr):
        """In-place mean of a numpy array across all processes."""
        if self.comm is not None:
            self.comm.Allreduce(self.MPI.IN_PLACE, arr, op=self.MPI.SUM)
            arr /= self.size
        return arr

    def sum(self, x):
        """Sum of a Python float across all processes."""
        return self.mean(x) * self.size

    def mean(self, x):
        """Mean of a Python float across all processes."""
        return float(self.mean_(np.array([x], dtype=np.float64))[0])

    def barrier(self):
        """Wait until every process gets here (a no-op without MPI)."""
        if self.comm is not None:
            self.comm.Barrier()


# ----------------------------------------------------------------------------
# logger (llm.c's main.log format)

class Logger:
    """Appends llm.c-style lines to DIR/main.log (no-op without a directory)."""

    def __init__(self, out_dir, resuming=False):
        self.path = os.path.join(out_dir, "main.log") if out_dir else None
        if self.path and not resuming:
            open(self.path, "w").close()

    def _write(self, line):
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")

    def log_train(self, step, loss, lr, norm):
        self._write(f"s:{step} trl:{loss:.6f} lr:{lr:.6f} norm:{norm:.4f}")

    def log_val(self, step, loss):
        self._write(f"s:{step} tel:{loss:.6f}")

    def log_eval(self, step, acc):
        self._write(f"s:{step} eval:{acc:.6f}")


# ----------------------------------------------------------------------------
# checking tensors against a reference (tests, tests/check_gpt2.py, gpt2_cuda.py --check)

def check_tensor(a, ref, label, atol, rtol, show=3, verbose=True):
    """Compare array a with reference ref elementwise: ok where |a - ref| <= atol + rtol * |ref|
    (numpy.isclose's rule) and nothing is NaN. Prints the first `show` pairs and a one-line verdict
    `label: TENSOR OK, maxdiff=...` or `TENSOR NOT OK`; returns True/False."""
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if a.shape != ref.shape:
        print(f"{label}: TENSOR NOT OK, shape {a.shape} != reference {ref.shape}")
        return False
    diff = np.abs(a - ref)
    bad = ~(diff <= atol + rtol * np.abs(ref))          # NaN compares False, so NaN is bad
    maxdiff = float(diff.max()) if diff.size else 0.0           # NaN if any NaN
    rel = maxdiff / max(float(np.abs(ref).max()) if ref.size else 0.0, 1e-30)
    ok = not bad.any()
    if verbose:
        flat_a, flat_r = a.ravel(), ref.ravel()
        pairs = " ".join(f"{flat_a[i]:.6g}/{flat_r[i]:.6g}" for i in range(min(show, flat_a.size)))
        verdict = "TENSOR OK" if ok else f"TENSOR NOT OK ({int(bad.sum())} of {bad.size} outside tolerance)"
        print(f"{label}: {verdict}, maxdiff={maxdiff:.3e} (rel to max|ref| {rel:.3e}) | first: {pairs}")
    return ok


# ----------------------------------------------------------------------------
# training loop

def build_parser(prog="gpt2_cpu.py"):
    """The trainer's argparse parser: llm.c's one-letter flags, each with a long alias. -h is
    HellaSwag in llm.c, so help is --help only. gpt2_cuda.py adds its GPU flags to this parser."""
    p = argparse.ArgumentParser(prog=prog, add_help=False,
                                description="Train GPT-2 in NumPy (the llm.cupy reference trainer).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--help", action="help", help="show this help and exit")
    a("-i", "--input-bin", default=DEFAULT_TRAIN, help="train data: file or glob of shards")
    a("-j", "--input-val-bin", default=DEFAULT_VAL, help="validation data: file or glob ('' for none)")
    a("-e", "--model", default="d4", help="checkpoint .bin to start from, or a descriptor (d2 d4 d6 d12 d24 d36 d48, 124M ...)")
    a("-o", "--output-dir", default=None, help="directory for main.log and checkpoints")
    a("-b", "--batch-size", type=int, default=4, help="micro-batch size B (sequences)")
    a("-t", "--seq-len", type=int, default=64, help="sequence length T (tokens)")
    a("-d", "--total-batch-size", type=int, default=-1, help="tokens per optimizer step (-1: B*T*processes, no accumulation)")
    a("-x", "--max-steps", type=int, default=400, help="optimizer steps (-1: one epoch of the train data)")
    a("-k", "--lr-schedule", default="cosine", choices=LR_SCHEDULES, help="learning-rate schedule")
    a("-l", "--learning-rate", type=float, default=3e-4, help="peak learning rate")
    a("-u", "--warmup-iters", type=int, default=0, help="linear warmup steps")
    a("-q", "--final-lr-frac", type=float, default=0.0, help="final learning rate as a fraction of the peak")
    a("-c", "--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("-v", "--val-every", type=int, default=100, help="validation loss every N steps (0: never)")
    a("-m", "--val-max-steps", type=int, default=20, help="batches per validation (-1: whole split)")
    a("-s", "--sample-every", type=int, default=100, help="print a generated sample every N steps (0: never)")
    a("-g", "--gen-tokens", type=int, default=64, help="tokens per generated sample")
    a("-n", "--checkpoint-every", type=int, default=0, help="write a checkpoint every N steps and at the end (0: never; needs -o)")
    a("-y", "--resume", type=int, default=0, choices=(0, 1), help="1: resume from the newest complete checkpoint in -o")
    a("-a", "--overfit-single-batch", type=int, default=0, choices=(0, 1), help="1: train on the first batch only")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    a("--shuffle", type=int, default=0, choices=(0, 1), help="1: shuffle the train shards and batches (seeded)")
    a("--seed", type=int, default=42, help="seed for the random init and the loader shuffle")
    a("--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer .bin for printing samples")
    a("-h", "--hellaswag", type=int, default=0, choices=(0, 1), help="1: HellaSwag accuracy every -v steps")
    a("--hellaswag-file", default=DEFAULT_HELLASWAG, help="multiple-choice eval file (dev/data/hellaswag.py)")
    a("--eval-only", action="store_true", help="evaluate -e once (val loss, HellaSwag with -h 1) and exit")
    a("--generate", type=int, default=0, metavar="N", help="sample N tokens from -e after --prompt and exit")
    a("--prompt", default="", help="text to continue with --generate ('' starts from <|endoftext|>)")
    a("--temperature", type=float, default=1.0, help="sampling temperature (--generate)")
    a("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0: all)")
    a("--sample-seed", type=int, default=SAMPLE_SEED, help="seed of the sampler's xorshift RNG")
    return p


def parse_args(argv=None):
    """Parse the command line (argv: list of str, default sys.argv[1:]) -> argparse.Namespace."""
    return build_parser().parse_args(argv)


def build_model(spec, seed):
    """-e: a checkpoint path (fp32 or bf16) or a descriptor."""
    if spec.endswith(".bin") or os.path.sep in spec:
        return read_model(spec)
    return gpt2_init(config_from_descriptor(spec), seed)


def validate(model, val_loader, val_max_steps, comm):
    """Mean validation loss over val_max_steps batches (-1: the whole split), averaged across ranks."""
    val_loader.reset()
    steps = val_max_steps if val_max_steps > 0 else val_loader.shard_num_samples * len(val_loader.files)
    total = 0.0
    for _ in range(steps):
        x, y = val_loader.next_batch()
        gpt2_forward(model, x, y)
        total += model.mean_loss
    return comm.mean(total / steps)


def read_hellaswag(path):
    """The HellaSwag examples for -h 1, with a hint when the file was never built."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such eval file (build it with `python dev/data/hellaswag.py`, needs internet)")
    return read_eval_file(path)


def sample_from_prompt(args, model, forward=None):
    """--generate N: encode --prompt, then stream N sampled tokens to stdout as they come
    (bytes are decoded incrementally, so a character split across tokens prints whole)."""
    tokenizer = Tokenizer(args.tokenizer)
    prompt = gpt2_encoding().encode(args.prompt, allowed_special="all") if args.prompt else [tokenizer.eot_token]
    rng = SamplerRNG(args.sample_seed)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(args.prompt)

    def stream(token):
        sys.stdout.write(decoder.decode(tokenizer.token_bytes[token]))
        sys.stdout.flush()
    ids = generate(model, prompt, args.generate, rng, args.temperature, args.top_k, stream, forward)
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return ids


def train(args):
    """The training loop (llm.c's main): validate / sample / checkpoint at the top of each step,
    then zero_grad, micro-batch forward+backward with accumulation, all-reduce, clip, update."""
    comm = Comm()
    master = comm.rank == 0
    say = print if master else (lambda *a, **k: None)
    B, T = args.batch_size, args.seq_len
    if B <= 0 or T <= 0:
        raise InputError(f"batch size and sequence length must be positive (got -b {B} -t {T})")
    model = build_model(args.model, args.seed)
    cfg = model.config
    if args.generate > 0:
        return sample_from_prompt(args, model)
    if T > cfg.max_seq_len:
        raise InputError(f"-t {T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    tokens_per_micro = B * T * comm.size
    total_batch = args.total_batch_size if args.total_batch_size > 0 else tokens_per_micro
    if total_batch % tokens_per_micro:
        raise InputError(f"-d {total_batch} is not a multiple of B*T*processes = {tokens_per_micro}")
    grad_accum_steps = total_batch // tokens_per_micro
    train_loader = DataLoader(args.input_bin, B, T, comm.rank, comm.size, bool(args.shuffle), args.seed)
    val_loader = DataLoader(args.input_val_bin, B, T, comm.rank, comm.size) if args.input_val_bin else None
    num_steps = args.max_steps if args.max_steps > 0 else train_loader.num_tokens // total_batch
    if args.resume and not args.output_dir:
        raise InputError("-y 1 needs -o DIR to find the checkpoint in")
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)

    examples = read_hellaswag(args.hellaswag_file) if args.hellaswag else None

    def forward_losses(inputs, targets):
        gpt2_forward(model, inputs, targets)
        return model.acts["losses"]

    if args.eval_only:
        if val_loader:
            say(f"val loss {validate(model, val_loader, args.val_max_steps, comm):.6f}")
        if examples:
            acc, n = evaluate_multiple_choice(forward_losses, examples, B, T, comm)
            say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")
        return model

    tokenizer = None
    if args.sample_every > 0 and master:
        try:
            tokenizer = Tokenizer(args.tokenizer)
        except InputError as e:
            say(f"note: {e}; samples will print token ids")

    say(f"model: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} maxT={cfg.max_seq_len} "
        f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} | {model.num_parameters:,} parameters")
    say(f"batch: B={B} T={T} processes={comm.size} grad_accum={grad_accum_steps} -> {total_batch} tokens/step | "
        f"train {train_loader.num_tokens:,} tokens in {len(train_loader.files)} shard(s) | {num_steps} steps")

    start_step = 0
    sample_rng = SamplerRNG(args.sample_seed)
    if args.resume:
        step0 = latest_checkpoint_step(args.output_dir)
        if step0 is None:
            raise InputError(f"{args.output_dir}: no complete checkpoint (DONE_* marker) to resume from")
        model_path, state_path, _ = checkpoint_paths(args.output_dir, step0, comm.rank)
        model = read_model(model_path)
        st = read_state(state_path, model.num_parameters, comm.rank, comm.size)
        if st["master_weights"] is not None:             # written by the bf16 CUDA trainer
            model.params[...] = st["master_weights"]
        model.m, model.v = st["m"], st["v"]
        train_loader.restore(st["loader"])
        sample_rng.state = st["sample_rng_state"]
        start_step = st["step"]
        say(f"resumed from {state_path} at step {start_step}")
    logger = Logger(args.output_dir if master else None, resuming=bool(args.resume))

    for step in range(start_step, num_steps + 1):
        last_step = step == num_steps
        if val_loader and args.val_every > 0 and (step % args.val_every == 0 or last_step):
            val_loss = validate(model, val_loader, args.val_max_steps, comm)
            say(f"val loss {val_loss:.6f}")
            logger.log_val(step, val_loss)
        if examples and args.val_every > 0 and ((step > 0 and step % args.val_every == 0) or last_step):
            acc, n = evaluate_multiple_choice(forward_losses, examples, B, T, comm)
            say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")
            logger.log_eval(step, acc)
        if master and args.sample_every > 0 and ((step > 0 and step % args.sample_every == 0) or last_step):
            say("generating:\n---")
            ids = generate(model, [tokenizer.eot_token if tokenizer else GPT2_EOT], args.gen_tokens, sample_rng)
            say(tokenizer.decode(ids) if tokenizer else " ".join(map(str, ids)))
            say("---")
        if args.output_dir and args.checkpoint_every > 0 and step > start_step and \
                (step % args.checkpoint_every == 0 or last_step):
            done = save_checkpoint(args.output_dir, step, model, train_loader, sample_rng.state, comm.rank, comm.size)
            comm.barrier()
            if master:
                write_done_marker(done)
                say(f"checkpoint written: step {step} in {args.output_dir}")
        if last_step:
            break

        t0 = time.perf_counter()
        gpt2_zero_grad(model)
        loss = 0.0
        for _ in range(grad_accum_steps):
            if args.overfit_single_batch:
                train_loader.reset()
            x, y = train_loader.next_batch()
            gpt2_forward(model, x, y)
            gpt2_backward(model, loss_scale=1.0 / grad_accum_steps)
            loss += model.mean_loss / grad_accum_steps
        comm.mean_(model.grads)
        loss = comm.mean(loss)
        norm = gpt2_grad_norm(model)
        grad_scale = args.grad_clip / norm if 0 < args.grad_clip < norm else 1.0
        lr = learning_rate_at(step, args.lr_schedule, args.learning_rate, args.warmup_iters, num_steps, args.final_lr_frac)
        gpt2_update(model, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, args.weight_decay, step + 1, grad_scale)
        dt = time.perf_counter() - t0
        say(f"step {step + 1:4d}/{num_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.2e} | "
            f"{dt * 1000:.1f} ms | {total_batch / dt:.0f} tok/s")
        logger.log_train(step, loss, lr, norm)
    return model


def main(argv=None):
    """CLI entry point: train (or evaluate / generate). Returns the exit code: 0, or 1 with one
    `error:` line on stderr for bad input."""
    args = parse_args(argv)
    try:
        train(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
