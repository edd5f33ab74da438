"""
dev/torch_reference.py: an independent GPT-2 in PyTorch with autograd, the oracle that
gpt2_cpu.py (and later gpt2_cuda.py) is checked against. It plays the role of llm.c's
train_gpt2.py: same model, same initialization draws, same files, but every gradient comes
from torch.autograd instead of a hand-written backward pass.

What it deliberately is not: a second copy of gpt2_cpu.py. It does not import gpt2_cpu.py
(an oracle that shares code with what it checks cannot catch that code's bugs); it has its own
config, file readers and writers, token loader and learning-rate schedules, written from the
format docs (doc/file_formats.md). From llmc it takes only the command line's shell, so that bad
input gets the trainers' one `error:` line: the flag checks (llmc.cli.check_args), the error lines
and exit codes (llmc.cli.run_main), and the trainers' check of a model file (llmc.formats: header,
size, finite parameters) before its own reader reads it. It is not a trainer with validation,
sampling or checkpoints for resume either: it trains a few steps and writes test vectors.

Run it (--write-model and --write-debug-state save the starting model and llm.c-style test
vectors for the first batch, before any training, as llm.c's train_gpt2.py does; check_gpt2.py
then checks gpt2_cpu.py against them):
    python dev/torch_reference.py -e d2 -i data/tinyshakespeare/tiny_shakespeare_train.bin \
        -b 4 -t 64 -x 10 --write-model d2.bin --write-debug-state d2_debug_state.bin
    python tests/check_gpt2.py -e d2.bin -s d2_debug_state.bin
prints one line per step, e.g.
    step    1/10 | loss 10.820799 | norm 2.5701 | lr 3.00e-04 | 474.1 ms | 540 tok/s
    ...
    step   10/10 | loss 10.494607 | norm 1.7023 | lr 7.34e-06 | 651.8 ms | 393 tok/s
The same flags on gpt2_cpu.py (`python gpt2_cpu.py -e d2 -b 4 -t 64 -x 10 -v 0 -s 0`) print the
same losses to within 1e-6. `--help` lists every flag; `--flash 1 --compile 1 --autocast
bfloat16 --device cuda` is the fast GPU configuration, `--dtype float64` the tight reference.

Dimension legend (as in gpt2_cpu.py):
    B     batch size              T     sequence length (T <= maxT)
    C     channels                V     vocabulary size (50257 for GPT-2)
    Vp    V padded to a multiple of 128 (50304)
    L     layers                  NH    attention heads        HS    head size, C // NH
    maxT  longest sequence the position embedding covers (1024 for GPT-2)
"""

import argparse
import glob
import math
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmc.utils import require  # noqa: E402

if __name__ == "__main__":
    require("dev/torch_reference.py", "numpy", "torch")    # a package missing: one line naming its command, no traceback
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmc import formats  # noqa: E402
from llmc.cli import ArgumentParser, build_parser, check_args, run_main  # noqa: E402
from llmc.utils import InputError, check_input_file  # noqa: E402

# ----------------------------------------------------------------------------
# constants: file magics and versions (doc/file_formats.md)

HEADER_INTS = 256                  # every file starts with 256 int32 = 1024 bytes
HEADER_BYTES = 4 * HEADER_INTS
MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
DEBUG_STATE_MAGIC = 20240327
DEBUG_STATE_VERSION = 2
SHARD_MAGIC = 20240520
SHARD_VERSION = 1

LN_EPS = 1e-5                      # LayerNorm epsilon of GPT-2
INIT_STD = 0.02                    # GPT-2 init std for weights and embeddings
VOCAB_PAD_MULTIPLE = 128           # Vp = V rounded up to this
ADAMW_BETAS = (0.9, 0.95)
ADAMW_EPS = 1e-8
WSD_COOLDOWN_FRACTION = 0.2        # warmup-stable-decay cools down over the last 20% of steps

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TRAIN = os.path.join(REPO_ROOT, "data", "tinyshakespeare", "tiny_shakespeare_train.bin")


class TwinError(InputError):
    """Bad user input or a bad file. The CLI prints it as one line and exits 1 (llmc.cli.run_main)."""


# ----------------------------------------------------------------------------
# configuration

@dataclass(frozen=True)
class Config:
    max_seq_len: int = 1024        # maxT
    vocab_size: int = 50257        # V
    padded_vocab_size: int = 50304  # Vp: 50257 padded up to a multiple of 128
    num_layers: int = 12           # L
    num_heads: int = 12            # NH
    channels: int = 768            # C


# descriptor -> (L, NH, C); d12..d48 are the GPT-2 sizes, d2..d6 fit a small CPU
DESCRIPTORS = {
    "d2": (2, 4, 128), "d4": (4, 4, 256), "d6": (6, 6, 384),
    "d12": (12, 12, 768), "d24": (24, 16, 1024), "d36": (36, 20, 1280), "d48": (48, 25, 1600),
}
GPT2_SIZES = {"124M": "d12", "350M": "d24", "774M": "d36", "1558M": "d48"}
HF_NAMES = {"gpt2": "d12", "gpt2-medium": "d24", "gpt2-large": "d36", "gpt2-xl": "d48"}


def pad_vocab(V):
    """V rounded up to a multiple of VOCAB_PAD_MULTIPLE (50257 -> 50304)."""
    return -(-V // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE


def config_from_name(name):
    """Config for a descriptor ("d12") or a GPT-2 size ("124M"). Raises TwinError."""
    key = GPT2_SIZES.get(name, name)
    if key not in DESCRIPTORS:
        raise TwinError(f"unknown model '{name}': expected a .bin checkpoint or one of "
                        f"{', '.join(list(DESCRIPTORS) + list(GPT2_SIZES))}")
    L, NH, C = DESCRIPTORS[key]
    return Config(num_layers=L, num_heads=NH, channels=C)


def as_config(cfg):
    """Any object with the six config fields (e.g. gpt2_cpu.GPT2Config) -> Config."""
    return Config(**{field: int(getattr(cfg, field)) for field in Config.__dataclass_fields__})


# The 16 checkpoint tensors in file order, and where each lives in the module tree below.
# "h." means one tensor per block, stacked over the L blocks in the file: (L, ...).
PARAMETER_LAYOUT = (
    ("wte", "wte.weight"), ("wpe", "wpe.weight"),
    ("ln1w", "h.ln_1.weight"), ("ln1b", "h.ln_1.bias"),
    ("qkvw", "h.attn.c_attn.weight"), ("qkvb", "h.attn.c_attn.bias"),
    ("attprojw", "h.attn.c_proj.weight"), ("attprojb", "h.attn.c_proj.bias"),
    ("ln2w", "h.ln_2.weight"), ("ln2b", "h.ln_2.bias"),
    ("fcw", "h.mlp.c_fc.weight"), ("fcb", "h.mlp.c_fc.bias"),
    ("fcprojw", "h.mlp.c_proj.weight"), ("fcprojb", "h.mlp.c_proj.bias"),
    ("lnfw", "ln_f.weight"), ("lnfb", "ln_f.bias"),
)
# weight decay applies to the matmul weights and embeddings; never to biases or LayerNorm
DECAYED = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")
LAYERNORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")
RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw")  # init std scaled by 1/sqrt(2L) (GPT-2 paper, 2.3)


def file_shapes(config):
    """(name, shape) of the 16 checkpoint tensors, in file order."""
    Vp, maxT, L, C = config.padded_vocab_size, config.max_seq_len, config.num_layers, config.channels
    shapes = {"wte": (Vp, C), "wpe": (maxT, C), "ln1w": (L, C), "ln1b": (L, C),
              "qkvw": (L, 3 * C, C), "qkvb": (L, 3 * C), "attprojw": (L, C, C), "attprojb": (L, C),
              "ln2w": (L, C), "ln2b": (L, C), "fcw": (L, 4 * C, C), "fcb": (L, 4 * C),
              "fcprojw": (L, C, 4 * C), "fcprojb": (L, C), "lnfw": (C,), "lnfb": (C,)}
    return [(name, shapes[name]) for name, _ in PARAMETER_LAYOUT]


# ----------------------------------------------------------------------------
# the model: nn.Modules, nanoGPT-shaped, forward only (autograd does the backward)

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (Vaswani et al. 2017) on a fused QKV projection."""

    def __init__(self, config, flash=False):
        super().__init__()
        C = config.channels
        self.NH = config.num_heads
        self.flash = flash
        self.c_attn = nn.Linear(C, 3 * C)       # weight (3C, C): rows [q | k | v]
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        B, T, C = x.shape
        NH, HS = self.NH, C // self.NH
        q, k, v = self.c_attn(x).split(C, dim=2)                # each (B,T,C)
        q = q.view(B, T, NH, HS).transpose(1, 2)                # (B,NH,T,HS)
        k = k.view(B, T, NH, HS).transpose(1, 2)
        v = v.view(B, T, NH, HS).transpose(1, 2)
        if self.flash:                                          # library call: fused kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(HS))  # (B,NH,T,HS) @ (B,NH,HS,T) -> (B,NH,T,T)
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(future, float("-inf"))        # token t sees tokens 0..t only
            att = F.softmax(att, dim=-1)
            y = att @ v                                         # (B,NH,T,T) @ (B,NH,T,HS) -> (B,NH,T,HS)
        y = y.transpose(1, 2).contiguous().view(B, T, C)        # heads side by side again
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        C = config.channels
        self.c_fc = nn.Linear(C, 4 * C)
        self.gelu = nn.GELU(approximate="tanh")                 # GPT-2's tanh approximation
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))             # (B,T,C) -> (B,T,4C) -> (B,T,C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config, flash=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.channels, eps=LN_EPS)
        self.attn = CausalSelfAttention(config, flash)
        self.ln_2 = nn.LayerNorm(config.channels, eps=LN_EPS)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 (Radford et al. 2019). The classifier is tied to the token embedding: logits =
    ln_f(x) @ wte.T over all Vp rows; the loss only sees the first V columns."""

    def __init__(self, config, flash=False):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.padded_vocab_size, config.channels)   # (Vp, C)
        self.wpe = nn.Embedding(config.max_seq_len, config.channels)         # (maxT, C)
        self.h = nn.ModuleList([Block(config, flash) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.channels, eps=LN_EPS)

    def forward(self, idx, targets=None):
        """idx (B,T) int64 -> logits (B,T,Vp), and the mean cross-entropy if targets (B,T)."""
        B, T = idx.shape
        V = self.config.vocab_size
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)                       # (B,T,C) + (T,C)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)                   # (B,T,C) @ (C,Vp) -> (B,T,Vp)
        loss = None
        if targets is not None:                                 # padded columns never enter the softmax
            loss = F.cross_entropy(logits[..., :V].reshape(B * T, V), targets.reshape(B * T))
        return logits, loss


def module_tensors(model, path):
    """The tensor(s) at a PARAMETER_LAYOUT path: one Parameter, or a list of L for 'h.*'."""
    def walk(obj, dotted):
        for attr in dotted.split("."):
            obj = getattr(obj, attr)
        return obj
    if path.startswith("h."):
        return [walk(block, path[2:]) for block in model.h]
    return walk(model, path)


# ----------------------------------------------------------------------------
# initialization: the same draws as gpt2_cpu.gpt2_init, bit for bit

def init_arrays(config, seed):
    """The 16 initial tensors (float32 numpy, file order) of GPT-2's init (Radford et al. 2019):
    weights and embeddings ~ N(0, 0.02^2), residual projections ~ N(0, (0.02/sqrt(2L))^2),
    biases 0, LayerNorm weights 1, wte padding rows 0. One np.random.default_rng(seed) draws
    each weight tensor in file order, at its full stacked (L, ...) shape, in float32."""
    rng = np.random.default_rng(seed)
    arrays = []
    for name, shape in file_shapes(config):
        if name in LAYERNORM_WEIGHTS:
            a = np.ones(shape, dtype=np.float32)
        elif name in DECAYED:
            std = INIT_STD / math.sqrt(2 * config.num_layers) if name in RESIDUAL_PROJECTIONS else INIT_STD
            a = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        else:                                                   # biases: no draws
            a = np.zeros(shape, dtype=np.float32)
        arrays.append(a)
    arrays[0][config.vocab_size:] = 0.0                         # wte padding rows
    return arrays


# ----------------------------------------------------------------------------
# optimizer: torch AdamW with two parameter groups, and the learning-rate schedules

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")


def learning_rate_at(step, schedule, max_lr, warmup_iters, num_steps, final_lr_frac):
    """Learning rate of 0-based `step` out of `num_steps`, the schedules of gpt2_cpu.py:
    constant is max_lr throughout (no warmup); the others warm up linearly to max_lr over
    warmup_iters steps ((step+1)/warmup_iters of it), then
      cosine: min_lr + (max_lr - min_lr) * (1 + cos(pi * p)) / 2
      linear: max_lr - (max_lr - min_lr) * p
      wsd:    max_lr, then over the last WSD_COOLDOWN_FRACTION of steps
              min_lr + (max_lr - min_lr) * (1 - sqrt(p))     (Hägele et al. 2024)
    where min_lr = final_lr_frac * max_lr and p in [0, 1] is the progress through the decay."""
    if schedule not in LR_SCHEDULES:
        raise TwinError(f"unknown learning-rate schedule '{schedule}' (expected one of {', '.join(LR_SCHEDULES)})")
    if schedule == "constant":
        return max_lr
    if step < warmup_iters:
        return max_lr * (step + 1) / warmup_iters
    min_lr = final_lr_frac * max_lr
    if schedule == "wsd":
        decay_start = max(warmup_iters, int(num_steps * (1.0 - WSD_COOLDOWN_FRACTION)))
        if step < decay_start:
            return max_lr
        p = min(1.0, (step - decay_start) / max(1, num_steps - decay_start))
        return min_lr + (max_lr - min_lr) * (1.0 - math.sqrt(p))
    p = min(1.0, max(0.0, (step - warmup_iters) / max(1, num_steps - warmup_iters)))
    if schedule == "linear":
        return max_lr - (max_lr - min_lr) * p
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))


def make_optimizer(model, learning_rate, weight_decay, fused=False):
    """torch.optim.AdamW (Loshchilov & Hutter 2019) with betas (0.9, 0.95), eps 1e-8, and weight
    decay only on DECAYED tensors (the tied wte counts once)."""
    decay, no_decay = [], []
    for name, path in PARAMETER_LAYOUT:
        t = module_tensors(model, path)
        (decay if name in DECAYED else no_decay).extend(t if isinstance(t, list) else [t])
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=learning_rate, betas=ADAMW_BETAS, eps=ADAMW_EPS, **extra)


# ----------------------------------------------------------------------------
# files: model checkpoints, debug state, token shards

def _read_header(f, path, magic, versions, what):
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise TwinError(f"{path}: truncated {what}: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != magic:
        raise TwinError(f"{path}: bad magic {header[0]} (expected {magic}): not a {what}")
    if header[1] not in versions:
        raise TwinError(f"{path}: {what} version {header[1]} not supported (expected {' or '.join(map(str, versions))})")
    return header


def _header(values):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    for slot, value in values.items():
        header[slot] = value
    return header


def _write_file(path, chunks):
    """Write byte chunks to path through a temporary name, so a crash never leaves half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_checkpoint(path):
    """Read an llm.c model checkpoint (version 3 fp32 or 5 bf16) -> (Config, list of 16 float32
    arrays in file order). Raises TwinError on a missing, truncated or inconsistent file."""
    check_input_file(path, "model checkpoint")
    with open(path, "rb") as f:
        h = _read_header(f, path, MODEL_MAGIC, (MODEL_VERSION_FP32, MODEL_VERSION_BF16), "model checkpoint")
        maxT, V, L, NH, C, Vp = (int(v) for v in h[2:8])
        config = Config(max_seq_len=maxT, vocab_size=V, padded_vocab_size=Vp or pad_vocab(V),
                        num_layers=L, num_heads=NH, channels=C)
        if min(maxT, V, L, NH, C) <= 0 or C % NH or config.padded_vocab_size < V:
            raise TwinError(f"{path}: inconsistent model header {config}")
        shapes = file_shapes(config)
        count = sum(math.prod(s) for _, s in shapes)
        bf16 = h[1] == MODEL_VERSION_BF16
        itemsize = 2 if bf16 else 4
        raw = f.read(count * itemsize)
        if len(raw) != count * itemsize or f.read(1):
            raise TwinError(f"{path}: expected exactly {count} parameters after the header: truncated or trailing bytes")
    if bf16:       # bf16 is the top half of an fp32: shift the 16 bits back up
        flat = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        flat = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    arrays, offset = [], 0
    for _, shape in shapes:
        n = math.prod(shape)
        arrays.append(flat[offset:offset + n].reshape(shape))
        offset += n
    return config, arrays


def write_checkpoint(path, config, arrays, dtype="float32"):
    """Write the 16 arrays (file order) as an llm.c checkpoint: "float32" (version 3) or
    "bfloat16" (version 5, rounded to nearest even by torch's own conversion)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"checkpoint dtype must be float32 or bfloat16, not {dtype}")
    version = MODEL_VERSION_FP32 if dtype == "float32" else MODEL_VERSION_BF16
    header = _header({0: MODEL_MAGIC, 1: version, 2: config.max_seq_len, 3: config.vocab_size,
                      4: config.num_layers, 5: config.num_heads, 6: config.channels,
                      7: config.padded_vocab_size})

    def encode(a):
        a32 = np.ascontiguousarray(a, dtype=np.float32)
        if dtype == "float32":
            return a32.astype("<f4").tobytes()
        return torch.from_numpy(a32).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    _write_file(path, [header.tobytes()] + [encode(a) for a in arrays])


def write_debug_state_file(path, x, y, logits, loss, grads):
    """llm.c's debug state: header (B, T), x and y int32 (B,T), logits fp32 (B,T,V) unpadded,
    loss fp32, then the 16 gradients fp32 in file order (wte's padded to Vp)."""
    B, T = x.shape
    header = _header({0: DEBUG_STATE_MAGIC, 1: DEBUG_STATE_VERSION, 2: B, 3: T})
    chunks = [header.tobytes(), np.asarray(x, "<i4").tobytes(), np.asarray(y, "<i4").tobytes(),
              np.asarray(logits, "<f4").tobytes(), np.asarray([loss], "<f4").tobytes()]
    chunks += [np.asarray(g, "<f4").tobytes() for g in grads]
    _write_file(path, chunks)


def read_tokens(path):
    """A token shard's tokens (uint16 numpy, memory-mapped). Raises TwinError."""
    check_input_file(path, "token shard")
    with open(path, "rb") as f:
        h = _read_header(f, path, SHARD_MAGIC, (SHARD_VERSION,), "token shard")
    n = int(h[2])
    if os.path.getsize(path) != HEADER_BYTES + 2 * n:
        raise TwinError(f"{path}: header says {n} tokens but the file is {os.path.getsize(path)} bytes")
    return np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,))


# ----------------------------------------------------------------------------
# data loader: consecutive windows, llm.c's order without shuffling

class TokenLoader:
    """Batches (x, y) of (B,T) int64 from a glob of shards: batch i of a shard is its tokens
    [i*B*T, i*B*T + B*T + 1), x the first B*T and y the last B*T of them. After a shard's last
    full batch comes the next shard, after the last shard the first again."""

    def __init__(self, pattern, B, T):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise TwinError(f"{pattern}: no token shard matches")
        self.B, self.T = B, T
        for path in self.files:
            if read_tokens(path).size < B * T + 1:
                raise TwinError(f"{path}: shorter than one batch of B*T+1 = {B * T + 1} tokens")
        self.shard, self.pos = 0, 0
        self.tokens = read_tokens(self.files[0])

    def next_batch(self):
        B, T = self.B, self.T
        if self.pos + B * T + 1 > self.tokens.size:
            self.shard = (self.shard + 1) % len(self.files)
            self.tokens, self.pos = read_tokens(self.files[self.shard]), 0
        buf = torch.from_numpy(np.asarray(self.tokens[self.pos:self.pos + B * T + 1], dtype=np.int64))
        self.pos += B * T
        return buf[:-1].view(B, T), buf[1:].view(B, T)


# ----------------------------------------------------------------------------
# the function API used by the tests

class Twin:
    """A GPT (nn.Module) plus its optimizer state, with numpy in and out in llm.c's file order.
        twin = Twin.init(config, seed=42)            # or Twin.from_checkpoint("model.bin")
        logits, loss, grads = twin.forward_backward(x, y)
        losses = twin.train_steps(batches, learning_rate=3e-4)
    dtype is torch.float32 (default) or torch.float64; flash selects F.scaled_dot_product_attention;
    autocast=torch.bfloat16 runs the forward under bf16 autocast (parameters stay in dtype)."""

    def __init__(self, config, arrays, dtype=torch.float32, device="cpu", flash=False,
                 autocast=None, compile=False):
        self.config = as_config(config)
        self.dtype, self.device, self.autocast = dtype, torch.device(device), autocast
        with torch.device("meta"):                              # no memory, no default init draws:
            self.model = GPT(self.config, flash)                # set_parameters fills every tensor
        self.model.to_empty(device=self.device).to(dtype)
        self.set_parameters(arrays)
        self.compiled = torch.compile(self.model) if compile else self.model
        self.optimizer = None
        self.step = 0              # optimizer steps taken, drives the learning-rate schedule

    @classmethod
    def init(cls, config, seed=42, **kwargs):
        config = as_config(config)
        return cls(config, init_arrays(config, seed), **kwargs)

    @classmethod
    def from_checkpoint(cls, path, **kwargs):
        config, arrays = read_checkpoint(path)
        return cls(config, arrays, **kwargs)

    @classmethod
    def from_hf(cls, name, **kwargs):
        """Hugging Face GPT-2 weights (needs `transformers` and a network or its cache).
        HF's Conv1D stores weights (in, out): they are transposed to nn.Linear's (out, in)."""
        if name not in HF_NAMES:
            raise TwinError(f"--hf {name}: expected one of {', '.join(HF_NAMES)}")
        try:
            from transformers import GPT2LMHeadModel
        except ImportError:
            raise TwinError("--hf needs the 'transformers' package, which is not installed (pip install transformers)")
        try:
            sd = GPT2LMHeadModel.from_pretrained(name).state_dict()
        except Exception as e:      # offline, no cache, ...
            raise TwinError(f"--hf {name}: could not load the weights from Hugging Face ({type(e).__name__}: {e})".splitlines()[0])
        config = config_from_name(HF_NAMES[name])
        conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        arrays = []
        for (name16, path), (_, shape) in zip(PARAMETER_LAYOUT, file_shapes(config)):
            if path.startswith("h."):
                per_layer = [sd[f"transformer.h.{l}.{path[2:]}"] for l in range(config.num_layers)]
                if path[2:] in conv1d:
                    per_layer = [w.t() for w in per_layer]
                a = torch.stack(per_layer).float().numpy()
            else:
                a = sd[f"transformer.{path}"].float().numpy()
            if name16 == "wte":                                 # pad V -> Vp with zero rows
                a = np.concatenate([a, np.zeros((shape[0] - a.shape[0], a.shape[1]), np.float32)])
            arrays.append(a.reshape(shape))
        return cls(config, arrays, **kwargs)

    # -- parameters and gradients in file order

    def set_parameters(self, arrays):
        """Copy 16 numpy arrays (file order, file shapes) into the module."""
        with torch.no_grad():
            for (name, path), (_, shape), a in zip(PARAMETER_LAYOUT, file_shapes(self.config), arrays):
                if tuple(a.shape) != tuple(shape):
                    raise TwinError(f"{name}: shape {a.shape} does not match {shape}")
                t = module_tensors(self.model, path)
                src = torch.from_numpy(np.ascontiguousarray(a))
                if isinstance(t, list):
                    for l, p in enumerate(t):
                        p.copy_(src[l])                         # casts to the model's dtype, moves to its device
                else:
                    t.copy_(src)

    def _gather(self, grad):
        """Copies (never views) of the parameters or their gradients, stacked to file shapes."""
        get = (lambda p: p.grad.detach()) if grad else (lambda p: p.detach())
        out = []
        for _, path in PARAMETER_LAYOUT:
            t = module_tensors(self.model, path)
            if isinstance(t, list):
                out.append(torch.stack([get(p) for p in t]).cpu().numpy())             # (L, ...)
            else:
                out.append(get(t).to("cpu", copy=True).numpy())
        return out

    def parameters(self):
        """The 16 parameter tensors as numpy (file order, model dtype)."""
        return self._gather(grad=False)

    def gradients(self):
        """The 16 gradients of the last backward as numpy (file order, model dtype)."""
        return self._gather(grad=True)

    # -- forward, backward, training

    def _as_tensor(self, tokens):
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
        if t.ndim != 2 or t.shape[1] > self.config.max_seq_len:
            raise TwinError(f"tokens must be (B,T) with T <= {self.config.max_seq_len}, got {tuple(t.shape)}")
        if t.min() < 0 or t.max() >= self.config.vocab_size:
            raise TwinError(f"token id out of range [0, {self.config.vocab_size})")
        return t.to(self.device)

    def _loss(self, x, y):
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16,
                            enabled=self.autocast is not None):
            return self.compiled(x, y)

    def forward_backward(self, x, y):
        """One forward and backward on (B,T) tokens x, targets y. Returns logits (B,T,V) numpy
        (the padded columns cut off), the mean loss (float) and the 16 gradients (file order)."""
        x, y = self._as_tensor(x), self._as_tensor(y)
        self.model.zero_grad(set_to_none=True)
        logits, loss = self._loss(x, y)
        loss.backward()
        V = self.config.vocab_size
        out_dtype = torch.float32 if self.autocast is not None else self.dtype   # bf16 logits -> fp32
        return logits[..., :V].detach().to(out_dtype).cpu().numpy(), float(loss.detach()), self.gradients()

    def train_steps(self, batches, learning_rate=3e-4, num_steps=None, schedule="cosine", warmup_iters=0,
                    final_lr_frac=0.0, weight_decay=0.0, grad_clip=1.0, grad_accum_steps=1,
                    fused=False, on_step=None):
        """AdamW steps on an iterable of (x, y) micro-batches, grad_accum_steps of them per step.
        num_steps (default len(batches) // grad_accum_steps) is the schedule's length. Per step:
        zero grads, forward/backward each micro-batch on loss/grad_accum_steps, clip the global
        grad norm to grad_clip (0: off), set the scheduled learning rate, AdamW. The optimizer state
        persists across calls. Returns the mean loss of each step; on_step(step, loss, norm, lr, dt)
        is called after each."""
        if num_steps is None:
            num_steps = len(batches) // grad_accum_steps
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.model, learning_rate, weight_decay, fused)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        it = iter(batches)
        losses = []
        for _ in range(num_steps):
            t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            step_loss = torch.zeros((), device=self.device, dtype=torch.float64)
            for _ in range(grad_accum_steps):
                x, y = next(it)
                _, loss = self._loss(self._as_tensor(x), self._as_tensor(y))
                (loss / grad_accum_steps).backward()
                step_loss += loss.detach().double() / grad_accum_steps
            norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip)) if grad_clip > 0 else \
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
            lr = learning_rate_at(self.step, schedule, learning_rate, warmup_iters, num_steps, final_lr_frac)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            loss_value = float(step_loss)                       # syncs the device: honest timing
            dt = time.perf_counter() - t0
            self.step += 1
            losses.append(loss_value)
            if on_step:
                on_step(self.step, loss_value, norm, lr, dt)
        return losses

    # -- files

    def save_checkpoint(self, path, dtype="float32"):
        """Write the model as an llm.c checkpoint (dtype "float32": version 3, "bfloat16": 5)."""
        write_checkpoint(path, self.config, self.parameters(), dtype)

    def write_debug_state(self, path, x, y):
        """Forward/backward on (x, y) and write llm.c's debug state for it (fp32)."""
        logits, loss, grads = self.forward_backward(x, y)
        write_debug_state_file(path, np.asarray(x), np.asarray(y), logits, loss, grads)
        return logits, loss, grads


# ----------------------------------------------------------------------------
# command line

# the twin's flags that mean what the trainers' do, checked by llmc.cli.check_args with its messages
TRAINER_FLAGS = ("batch_size", "seq_len", "total_batch_size", "learning_rate", "warmup_iters", "final_lr_frac",
                 "weight_decay", "grad_clip", "seed")
DEVICE_TYPES = ("cpu", "cuda")


def check_flags(args):
    """Raise InputError for flags that make no sense, before anything is built: the trainers'
    rules (llmc.cli.check_args on TRAINER_FLAGS, the trainers' other flags at their defaults),
    the twin's -x (0: only write the files) and --device. args: either twin's parsed flags."""
    if args.max_steps < 0:
        raise TwinError(f"-x {args.max_steps}: the number of steps must be >= 0 (0: only write the files)")
    trainer_args = build_parser(os.path.basename(sys.argv[0]), "", LR_SCHEDULES).parse_args([])
    for dest in TRAINER_FLAGS:
        if hasattr(args, dest):
            setattr(trainer_args, dest, getattr(args, dest))
    check_args(trainer_args)
    check_device(args.device)


def check_device(name):
    """Raise InputError unless name is cpu, or cuda / cuda:N of a GPU this PyTorch sees."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in DEVICE_TYPES:
        raise TwinError(f"--device {name}: expected one of cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TwinError(f"--device {name}: CUDA is not available to this PyTorch")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise TwinError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")


def write_output(flag, path, write):
    """write(path) for an output flag (--write-model ...); a path that cannot be written (a missing
    directory, no permission, a full disk) is InputError naming the flag."""
    try:
        write(path)
    except OSError as e:
        raise TwinError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_model_file(path, num_parameters_of):
    """The trainers' check of a model checkpoint (llmc.formats.read_model_file: header, size,
    finite parameters), so a bad file gets their one line before the twin's own reader reads it.
    num_parameters_of(shape dict) -> the parameter count of that header's model. Raises InputError."""
    formats.read_model_file(path, num_parameters_of)


def num_file_parameters(shape):
    """The parameter count of the model of a checkpoint's header (llmc.formats' shape dict; an
    old file's padded_vocab_size is 0)."""
    config = Config(**{**shape, "padded_vocab_size": shape["padded_vocab_size"] or pad_vocab(shape["vocab_size"])})
    return sum(math.prod(s) for _, s in file_shapes(config))


def parse_args(argv=None):
    """llm.c's flags where they exist; -h is HellaSwag in llm.c, so help is --help only."""
    p = ArgumentParser(prog="torch_reference.py", add_help=False,
                       description="GPT-2 in PyTorch: the independent reference (twin) of gpt2_cpu.py.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--help", action="help", help="show this help and exit")
    a("-e", "--model", default="d4", help="checkpoint .bin, or a descriptor (d2 d4 d6 d12 d24 d36 d48, 124M ...)")
    a("--hf", default=None, help="start from Hugging Face weights instead: gpt2, gpt2-medium, gpt2-large, gpt2-xl")
    a("--seed", type=int, default=42, help="seed of the random init")
    a("-i", "--input-bin", default=DEFAULT_TRAIN, help="train data: token shard file or glob")
    a("-b", "--batch-size", type=int, default=4, help="micro-batch size B")
    a("-t", "--seq-len", type=int, default=64, help="sequence length T")
    a("-d", "--total-batch-size", type=int, default=-1, help="tokens per step (-1: B*T, no accumulation)")
    a("-x", "--max-steps", type=int, default=10, help="optimizer steps (0: only write the files)")
    a("-k", "--lr-schedule", default="cosine", choices=LR_SCHEDULES, help="learning-rate schedule")
    a("-l", "--learning-rate", type=float, default=3e-4, help="peak learning rate")
    a("-u", "--warmup-iters", type=int, default=0, help="linear warmup steps")
    a("-q", "--final-lr-frac", type=float, default=0.0, help="final learning rate as a fraction of the peak")
    a("-c", "--weight-decay", type=float, default=0.0, help="AdamW weight decay (matmul weights, embeddings)")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    a("--write-model", default=None, help="write the starting model here (before training, as llm.c)")
    a("--bf16-model", action="store_true", help="write --write-model as bf16 (version 5), then continue from the rounded weights")
    a("--write-debug-state", default=None, help="write llm.c's debug state of the first batch here")
    a("--dtype", default="float32", choices=("float32", "float64"), help="parameter and compute dtype")
    a("--autocast", default="none", choices=("none", "bfloat16"), help="bf16 autocast for the forward")
    a("--flash", type=int, default=0, choices=(0, 1), help="1: F.scaled_dot_product_attention")
    a("--compile", type=int, default=0, choices=(0, 1), help="1: torch.compile the model")
    a("--tensorcores", type=int, default=0, choices=(0, 1), help="1: allow TF32 matmuls on CUDA")
    a("--fused-adamw", type=int, default=0, choices=(0, 1), help="1: fused AdamW kernel")
    a("--device", default="cpu", help="cpu, cuda, cuda:N")
    return p.parse_args(argv)


def run(args):
    """The command: build (or read) the model, write the requested files, train -x steps. Raises
    InputError (TwinError) for bad input."""
    check_flags(args)
    B, T = args.batch_size, args.seq_len
    if args.tensorcores:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    kwargs = dict(dtype=getattr(torch, args.dtype), device=args.device, flash=bool(args.flash),
                  autocast=torch.bfloat16 if args.autocast == "bfloat16" else None, compile=bool(args.compile))
    if args.hf:
        twin = Twin.from_hf(args.hf, **kwargs)
    elif args.model.endswith(".bin") or os.path.sep in args.model:
        check_model_file(args.model, num_file_parameters)
        twin = Twin.from_checkpoint(args.model, **kwargs)
    else:
        twin = Twin.init(config_from_name(args.model), args.seed, **kwargs)
    cfg = twin.config
    if T > cfg.max_seq_len:
        raise TwinError(f"-t {T} exceeds the model's max_seq_len {cfg.max_seq_len}")
    total = args.total_batch_size if args.total_batch_size > 0 else B * T
    if total % (B * T):
        raise TwinError(f"-d {total} is not a multiple of B*T = {B * T}")
    loader = TokenLoader(args.input_bin, B, T)
    num_params = sum(math.prod(s) for _, s in file_shapes(cfg))
    print(f"model: L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} maxT={cfg.max_seq_len} "
          f"V={cfg.vocab_size} Vp={cfg.padded_vocab_size} | {num_params:,} parameters | "
          f"{args.dtype} on {args.device}")

    if args.write_model:
        write_output("--write-model", args.write_model,
                     lambda path: twin.save_checkpoint(path, "bfloat16" if args.bf16_model else "float32"))
        print(f"wrote {args.write_model}")
        if args.bf16_model:    # continue from exactly what the file holds, so the debug state fits it
            twin.set_parameters(read_checkpoint(args.write_model)[1])
    if args.write_debug_state:
        x, y = loader.next_batch()
        write_output("--write-debug-state", args.write_debug_state,
                     lambda path: twin.write_debug_state(path, x.numpy(), y.numpy()))
        print(f"wrote {args.write_debug_state} (B={B} T={T})")
        loader = TokenLoader(args.input_bin, B, T)     # training starts from the first batch again

    def batches():
        while True:
            yield loader.next_batch()

    def report(step, loss, norm, lr, dt):
        print(f"step {step:4d}/{args.max_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.2e} | "
              f"{dt * 1000:.1f} ms | {total / dt:.0f} tok/s", flush=True)

    if args.max_steps > 0:
        twin.train_steps(batches(), args.learning_rate, args.max_steps, args.lr_schedule, args.warmup_iters,
                         args.final_lr_frac, args.weight_decay, args.grad_clip, total // (B * T),
                         bool(args.fused_adamw), report)


def main(argv=None):
    """Command-line entry point. Returns the exit code: 0; 1 with one `error:` line for bad input
    or any other error (llmc.cli.run_main, as the trainers'); 130 on Ctrl-C."""
    try:
        args = parse_args(argv)
    except SystemExit as e:                               # --help (0), or a bad flag (1, its error line printed)
        return e.code
    return run_main(run, args)


if __name__ == "__main__":
    sys.exit(main())
