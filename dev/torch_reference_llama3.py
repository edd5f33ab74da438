"""
dev/torch_reference_llama3.py: an independent Llama 3 in PyTorch with autograd, the oracle that
llama3_cpu.py is checked against (tests/test_llama3_twin.py), as dev/torch_reference.py is
gpt2_cpu.py's. Same model (Meta's Llama 3.1 reference structure, llm.c's train_llama3.py), same
initialization draws, same model file; every gradient comes from torch.autograd.

What it deliberately is not: a second copy of llama3_cpu.py. It does not import llama3_cpu.py,
nor any of llmc's model code (an oracle that shares code with what it checks cannot catch that
code's bugs): its RoPE multiplies complex numbers (Meta's way) where llama3_cpu.py rotates real
pairs, its attention repeats K/V with repeat_interleave, its model file reader and writer are its
own. What it shares with GPT-2's twin (dev/torch_reference.py, itself independent of the trainers)
is imported from there: the learning-rate schedules, the token loader, the debug-state writer, the
command line's shell (the trainers' flag checks and one-line errors, llmc.cli). A model file is
first checked by llama3_cpu.py's reader (llmc.formats: header, size, finite parameters), so a bad
file gets the trainers' one line; the twin's own reader then reads it.
It is not a trainer with validation, sampling or checkpoints: it trains a few steps and writes
test vectors.

Run it (after `make data`):
    python dev/torch_reference_llama3.py -e llama3:d2 -b 4 -t 64 -x 0 --write-model l3d2.bin
    python dev/torch_reference_llama3.py -e l3d2.bin -b 4 -t 64 -x 10
prints the model line, then one line per step:
    model: L=2 NH=4 NKV=2 C=128 H=448 maxT=1024 V=50257 | 13,308,800 parameters | float32 on cpu
    step    1/10 | loss 10.850460 | norm 1.8095 | lr 3.00e-04 | ...
    ...
    step   10/10 | loss 10.597736 | norm 1.9171 | lr 7.34e-06 | ...
and `python llama3_cpu.py -e l3d2.bin -b 4 -t 64 -x 10 -v 0 -s 0` prints the same losses and norms
(measured: equal to the 6th decimal but step 3's 10.729487, 1e-7 relative). --write-debug-state
writes llm.c's test vectors of the first batch (gradients in llama3_cpu's table order).

Dimension legend (llama3_cpu.py's):
    B, T, C, V, L, NH, HS = C // NH, maxT    as in GPT-2 (no vocabulary padding: Vp = V)
    NKV   key/value heads (grouped-query attention), NH % NKV == 0
    H     SwiGLU hidden width
"""

import math
import os
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from llmc.utils import check_input_file, require  # noqa: E402

if __name__ == "__main__":
    require("dev/torch_reference_llama3.py", "numpy", "torch")    # a package missing: one line naming its command, no traceback
import numpy as np  # noqa: E402
import torch_reference as gpt2_twin  # noqa: E402
from torch_reference import (ADAMW_BETAS, ADAMW_EPS, DEFAULT_TRAIN, HEADER_BYTES, HEADER_INTS, INIT_STD,  # noqa: E402
                             LR_SCHEDULES, TokenLoader, TwinError, check_flags, learning_rate_at,
                             write_debug_state_file, write_output)
from llmc import formats  # noqa: E402
from llmc.cli import ArgumentParser, run_main  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# ----------------------------------------------------------------------------
# constants: Llama 3.1's (Meta's reference model), and llm.c's Llama 3 model file (doc/file_formats.md)

LLAMA3_MODEL_MAGIC = 20240803
MODEL_VERSIONS = {3: "float32", 5: "bfloat16"}
LLAMA3_VERSION = (3, 1)                # int header slots 10, 11
ROPE_SCALE_FACTOR = 8                  # Llama 3.1's apply_scaling: slow channel pairs turn 8x slower,
ROPE_LOW_FREQ_FACTOR = 1               # fast ones (wavelength < 8192/4) are kept,
ROPE_HIGH_FREQ_FACTOR = 4              # in between blended
ROPE_ORIGINAL_CONTEXT = 8192
MLP_EXPANSION = 4                      # SwiGLU's H starts from 2/3 of GPT-2's 4C


@dataclass(frozen=True)
class Config:
    max_seq_len: int = 1024            # maxT
    vocab_size: int = 50257            # V
    num_layers: int = 2                # L
    num_heads: int = 4                 # NH
    num_kv_heads: int = 2              # NKV
    channels: int = 128                # C
    multiple_of: int = 32              # H rounded up to a multiple of this
    use_scaled_rope: bool = True
    ffn_dim_multiplier: float = 1.3
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def hidden_dim(self):
        """H as Meta's FeedForward computes it: int(2 * 4C / 3), times ffn_dim_multiplier, rounded up."""
        h = int(self.ffn_dim_multiplier * int(2 * MLP_EXPANSION * self.channels / 3))
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


# descriptor -> (L, NH, NKV, C, multiple_of), V = 50257 (GPT-2's tokenizer), maxT = 1024
DESCRIPTORS = {"llama3:d2": (2, 4, 2, 128, 32), "llama3:d4": (4, 4, 2, 256, 64), "llama3:d6": (6, 6, 2, 384, 64)}


def as_config(cfg):
    """Any object with the eleven config fields (e.g. llama3_cpu.LlamaConfig) -> Config."""
    return Config(**{field: getattr(cfg, field) for field in Config.__dataclass_fields__})


def config_from_name(name):
    if name not in DESCRIPTORS:
        raise TwinError(f"unknown model '{name}': expected a Llama 3 .bin file or one of {', '.join(DESCRIPTORS)}")
    L, NH, NKV, C, multiple_of = DESCRIPTORS[name]
    return Config(num_layers=L, num_heads=NH, num_kv_heads=NKV, channels=C, multiple_of=multiple_of)


# The 10 parameters in llama3_cpu.py's table order (its debug state's gradient order), each with
# where it lives in the module tree below; "layers." is one tensor per block, stacked to (L, ...).
PARAMETER_LAYOUT = (
    ("wte", "tok_embeddings.weight"), ("ln1w", "layers.attention_norm.weight"),
    ("qkvw", "layers.attention.c_attn.weight"), ("attprojw", "layers.attention.c_proj.weight"),
    ("ln2w", "layers.ffn_norm.weight"), ("fcw", "layers.mlp.c_fc.weight"), ("fcw2", "layers.mlp.c_fc2.weight"),
    ("fcprojw", "layers.mlp.c_proj.weight"), ("lnfw", "norm.weight"), ("wlmhead", "lm_head.weight"),
)
NORM_WEIGHTS = ("ln1w", "ln2w", "lnfw")                    # init 1, never decayed
RESIDUAL_PROJECTIONS = ("attprojw", "fcprojw")             # init std / sqrt(2L)


def parameter_shapes(config):
    V, C, L, H = config.vocab_size, config.channels, config.num_layers, config.hidden_dim
    QKV = (config.num_heads + 2 * config.num_kv_heads) * (C // config.num_heads)
    shapes = {"wte": (V, C), "ln1w": (L, C), "qkvw": (L, QKV, C), "attprojw": (L, C, C), "ln2w": (L, C),
              "fcw": (L, H, C), "fcw2": (L, H, C), "fcprojw": (L, C, H), "lnfw": (C,), "wlmhead": (V, C)}
    return [(name, shapes[name]) for name, _ in PARAMETER_LAYOUT]


# ----------------------------------------------------------------------------
# the model: nn.Modules shaped like Meta's reference, forward only (autograd does the backward)

def precompute_freqs_cis(HS, T, theta, use_scaled_rope):
    """(T, HS/2) complex128 e^{i t freq_j} (Su et al. 2021), with Llama 3.1's frequency scaling."""
    freqs = 1.0 / theta ** (torch.arange(0, HS, 2, dtype=torch.float64) / HS)
    if use_scaled_rope:
        wavelen = 2 * math.pi / freqs
        smooth = (ROPE_ORIGINAL_CONTEXT / wavelen - ROPE_LOW_FREQ_FACTOR) / (ROPE_HIGH_FREQ_FACTOR - ROPE_LOW_FREQ_FACTOR)
        blended = (1 - smooth) * freqs / ROPE_SCALE_FACTOR + smooth * freqs
        freqs = torch.where(wavelen < ROPE_ORIGINAL_CONTEXT / ROPE_HIGH_FREQ_FACTOR, freqs,
                            torch.where(wavelen > ROPE_ORIGINAL_CONTEXT / ROPE_LOW_FREQ_FACTOR,
                                        freqs / ROPE_SCALE_FACTOR, blended))
    angle = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angle), angle)


def apply_rotary_emb(x, freqs_cis):
    """x (B,T,nh,HS): adjacent channel pairs (2j, 2j+1) are the complex number x_2j + i x_2j+1,
    multiplied by freqs_cis (T,HS/2), in complex128, then cast back to x's dtype."""
    B, T, nh, HS = x.shape
    z = torch.view_as_complex(x.double().reshape(B, T, nh, HS // 2, 2).contiguous())
    return torch.view_as_real(z * freqs_cis[None, :, None, :]).reshape(B, T, nh, HS).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Grouped-query causal self-attention (Ainslie et al. 2023) with RoPE on q and k."""

    def __init__(self, config, flash=False):
        super().__init__()
        self.NH, self.NKV, self.HS = config.num_heads, config.num_kv_heads, config.channels // config.num_heads
        self.flash = flash
        self.c_attn = nn.Linear(config.channels, (self.NH + 2 * self.NKV) * self.HS, bias=False)  # [q | k | v]
        self.c_proj = nn.Linear(config.channels, config.channels, bias=False)

    def forward(self, x, freqs_cis):
        B, T, C = x.shape
        NH, NKV, HS = self.NH, self.NKV, self.HS
        q, k, v = self.c_attn(x).split([NH * HS, NKV * HS, NKV * HS], dim=-1)
        q, k, v = q.view(B, T, NH, HS), k.view(B, T, NKV, HS), v.view(B, T, NKV, HS)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        k = k.repeat_interleave(NH // NKV, dim=2)              # (B,T,NH,HS): query head h reads kv head h // (NH/NKV)
        v = v.repeat_interleave(NH // NKV, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))       # (B,NH,T,HS)
        if self.flash:                                          # library call: fused kernel
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(HS)     # (B,NH,T,T)
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = F.softmax(att.masked_fill(future, float("-inf")), dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """Shazeer 2020: c_proj(c_fc(x) * silu(c_fc2(x)))."""

    def __init__(self, config):
        super().__init__()
        C, H = config.channels, config.hidden_dim
        self.c_fc = nn.Linear(C, H, bias=False)
        self.c_fc2 = nn.Linear(C, H, bias=False)
        self.c_proj = nn.Linear(H, C, bias=False)

    def forward(self, x):
        return self.c_proj(self.c_fc(x) * F.silu(self.c_fc2(x)))


class Block(nn.Module):
    def __init__(self, config, flash=False):
        super().__init__()
        self.attention_norm = RMSNorm(config.channels, config.norm_eps)
        self.attention = Attention(config, flash)
        self.ffn_norm = RMSNorm(config.channels, config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x, freqs_cis):
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        return x + self.mlp(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama 3 (Touvron et al. 2023; Meta's Llama 3.1 reference): untied classifier, no biases."""

    def __init__(self, config, flash=False):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.channels)
        self.layers = nn.ModuleList([Block(config, flash) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.channels, config.norm_eps)
        self.lm_head = nn.Linear(config.channels, config.vocab_size, bias=False)

    def forward(self, idx, targets=None):
        """idx (B,T) int64 -> logits (B,T,V), and the mean cross-entropy if targets (B,T)."""
        B, T = idx.shape
        c = self.config
        freqs_cis = precompute_freqs_cis(c.channels // c.num_heads, T, c.rope_theta, c.use_scaled_rope).to(idx.device)
        x = self.tok_embeddings(idx)
        for block in self.layers:
            x = block(x, freqs_cis)
        logits = self.lm_head(self.norm(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
        return logits, loss


def module_tensors(model, path):
    """The tensor(s) at a PARAMETER_LAYOUT path: one Parameter, or a list of L for 'layers.*'."""
    def walk(obj, dotted):
        for attr in dotted.split("."):
            obj = getattr(obj, attr)
        return obj
    if path.startswith("layers."):
        return [walk(block, path[len("layers."):]) for block in model.layers]
    return walk(model, path)


def init_arrays(config, seed):
    """llama3_cpu.llama3_init's draws: one np.random.default_rng(seed), tensor by tensor in table
    order at the stacked shape, float32: N(0, 0.02^2), the residual projections / sqrt(2L), the
    RMSNorm weights 1 (no draws)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for name, shape in parameter_shapes(config):
        if name in NORM_WEIGHTS:
            arrays.append(np.ones(shape, np.float32))
        else:
            std = INIT_STD / math.sqrt(2 * config.num_layers) if name in RESIDUAL_PROJECTIONS else INIT_STD
            arrays.append(rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    return arrays


def global_grad_norm(params):
    """The L2 norm of all the gradients, a Python float, the squares summed in float64: torch's
    clip_grad_norm_ sums them in the parameters' float32, 2.5e-5 relative off on llama3:d2's 13M."""
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params))


def make_optimizer(model, learning_rate, weight_decay):
    """torch.optim.AdamW, betas (0.9, 0.95), eps 1e-8, decay on every matrix (p.dim() >= 2, as
    train_llama3.py), never on the RMSNorm weights."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=learning_rate, betas=ADAMW_BETAS, eps=ADAMW_EPS)


# ----------------------------------------------------------------------------
# llm.c's Llama 3 model file (train_llama3.cu's layout): int32 header, float32 header, GPT-2's 16 slots

INT_FIELDS = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "channels", "multiple_of",
              "use_scaled_rope")                    # int slots 2..9
FLOAT_FIELDS = ("ffn_dim_multiplier", "norm_eps", "rope_theta")    # float slots 0..2
# file order: wte, lm_head, then per-layer stacks each followed by its (zero) bias, the SwiGLU's
# c_fc and c_fc2 stacked per layer into one (L, 2H, C) tensor
FILE_ORDER = ("wte", "wlmhead", "ln1w", "qkvw", "attprojw", "ln2w", "fc", "fcprojw", "lnfw")


def file_arrays(arrays):
    """Table-ordered arrays -> the file's 16 tensors, biases as zeros."""
    P = dict(zip((name for name, _ in PARAMETER_LAYOUT), arrays))
    P["fc"] = np.concatenate([P["fcw"], P["fcw2"]], axis=1)       # (L,H,C) + (L,H,C) -> (L,2H,C)
    out = []
    for name in FILE_ORDER:
        out.append(P[name])
        if name not in ("wte", "wlmhead"):             # a norm's bias has its shape, a matrix's one per row
            out.append(np.zeros(P[name].shape if name in NORM_WEIGHTS else P[name].shape[:-1], np.float32))
    return out


def write_model_file(path, config, arrays, dtype="float32"):
    version = {v: k for k, v in MODEL_VERSIONS.items()}[dtype]
    ints = np.zeros(HEADER_INTS, "<i4")
    ints[:12] = [LLAMA3_MODEL_MAGIC, version] + [int(getattr(config, f)) for f in INT_FIELDS] + list(LLAMA3_VERSION)
    floats = np.zeros(HEADER_INTS, "<f4")
    floats[:3] = [getattr(config, f) for f in FLOAT_FIELDS]

    def encode(a):
        a32 = torch.from_numpy(np.ascontiguousarray(a, np.float32))
        return a32.numpy().astype("<f4").tobytes() if dtype == "float32" else \
            a32.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    gpt2_twin._write_file(path, [ints.tobytes(), floats.tobytes()] + [encode(a) for a in file_arrays(arrays)])


def check_model_file(path):
    """The trainers' check of a Llama 3 model file (llmc.formats.read_llama3_model_file: header,
    size against it, zero biases, finite parameters), so a bad file gets their one line; the twin
    reads llm.c's llama3-branch layout only, so master's is refused here. Raises InputError."""
    def hidden_dim_of(shape):
        return Config(**{field: shape[field] for field in Config.__dataclass_fields__}).hidden_dim
    shape, _ = formats.read_llama3_model_file(path, hidden_dim_of)
    if shape.get("layout") == formats.LLAMA3_LAYOUT_MASTER:
        raise TwinError(f"{path}: llm.c master's Llama 3 layout (one header, no float fields); the twin reads the "
                        f"llama3 branch's (rewrite it with llama3_cpu.write_model)")


def read_model_file(path):
    """-> (Config, the 10 arrays in table order). Raises TwinError."""
    check_input_file(path, "model file")
    raw = open(path, "rb").read()
    if len(raw) < 2 * HEADER_BYTES:
        raise TwinError(f"{path}: shorter than the two headers of a Llama 3 model file")
    ints, floats = np.frombuffer(raw[:HEADER_BYTES], "<i4"), np.frombuffer(raw[HEADER_BYTES:2 * HEADER_BYTES], "<f4")
    if ints[0] != LLAMA3_MODEL_MAGIC or int(ints[1]) not in MODEL_VERSIONS:
        raise TwinError(f"{path}: not a Llama 3 model file (magic {ints[0]}, version {ints[1]})")
    fields = {f: int(ints[2 + i]) for i, f in enumerate(INT_FIELDS)}
    fields.update({f: float(str(floats[i])) for i, f in enumerate(FLOAT_FIELDS)})   # 1.3, not 1.2999999523
    fields["use_scaled_rope"] = bool(fields["use_scaled_rope"])
    config = Config(**fields)
    template = file_arrays([np.zeros(s, np.float32) for _, s in parameter_shapes(config)])
    bf16 = MODEL_VERSIONS[int(ints[1])] == "bfloat16"
    count = sum(a.size for a in template)
    if len(raw) - 2 * HEADER_BYTES != count * (2 if bf16 else 4):
        raise TwinError(f"{path}: a Llama 3 of this header has {count} parameters; the file's size disagrees")
    payload = raw[2 * HEADER_BYTES:]
    flat = (np.frombuffer(payload, "<u2").astype(np.uint32) << 16).view(np.float32) if bf16 \
        else np.frombuffer(payload, "<f4").astype(np.float32)
    tensors, offset = [], 0
    for a in template:
        tensors.append(flat[offset:offset + a.size].reshape(a.shape))
        offset += a.size
    P = dict(zip(FILE_ORDER, tensors[:2] + tensors[2::2]))   # drop the biases: wte, wlmhead, then every other
    H = config.hidden_dim
    P["fcw"], P["fcw2"] = P["fc"][:, :H], P["fc"][:, H:]
    return config, [P[name] for name, _ in PARAMETER_LAYOUT]


# ----------------------------------------------------------------------------
# the function API used by the tests

class Twin:
    """A Llama (nn.Module) plus its optimizer, numpy in and out in llama3_cpu.py's table order.
        twin = Twin.init(config, seed=42)            # or Twin.from_model_file("model.bin")
        logits, loss, grads = twin.forward_backward(x, y)
        losses = twin.train_steps(batches, learning_rate=3e-4)"""

    def __init__(self, config, arrays, dtype=torch.float32, device="cpu", flash=False):
        self.config = as_config(config)
        self.dtype, self.device = dtype, torch.device(device)
        with torch.device("meta"):                              # set_parameters fills every tensor
            self.model = Llama(self.config, flash)
        self.model.to_empty(device=self.device).to(dtype)
        self.set_parameters(arrays)
        self.optimizer = None
        self.step = 0

    @classmethod
    def init(cls, config, seed=42, **kwargs):
        config = as_config(config)
        return cls(config, init_arrays(config, seed), **kwargs)

    @classmethod
    def from_model_file(cls, path, **kwargs):
        config, arrays = read_model_file(path)
        return cls(config, arrays, **kwargs)

    def set_parameters(self, arrays):
        with torch.no_grad():
            for (name, path), (_, shape), a in zip(PARAMETER_LAYOUT, parameter_shapes(self.config), arrays):
                if tuple(a.shape) != tuple(shape):
                    raise TwinError(f"{name}: shape {a.shape} does not match {shape}")
                t, src = module_tensors(self.model, path), torch.from_numpy(np.ascontiguousarray(a))
                for l, p in enumerate(t) if isinstance(t, list) else [(None, t)]:
                    p.copy_(src if l is None else src[l])

    def _gather(self, grad):
        get = (lambda p: p.grad.detach()) if grad else (lambda p: p.detach())
        out = []
        for _, path in PARAMETER_LAYOUT:
            t = module_tensors(self.model, path)
            out.append((torch.stack([get(p) for p in t]) if isinstance(t, list) else get(t)).cpu().numpy().copy())
        return out

    def parameters(self):
        """The 10 parameter tensors as numpy (table order, model dtype)."""
        return self._gather(grad=False)

    def gradients(self):
        """The 10 gradients of the last backward as numpy (table order)."""
        return self._gather(grad=True)

    def _as_tensor(self, tokens):
        t = torch.as_tensor(np.asarray(tokens), dtype=torch.int64)
        if t.ndim != 2 or t.shape[1] > self.config.max_seq_len or t.min() < 0 or t.max() >= self.config.vocab_size:
            raise TwinError(f"tokens must be (B,T) ids in [0, {self.config.vocab_size}) with T <= "
                            f"{self.config.max_seq_len}, got shape {tuple(t.shape)}")
        return t.to(self.device)

    def forward_backward(self, x, y):
        """One forward and backward -> logits (B,T,V) numpy, mean loss (float), 10 gradients."""
        self.model.zero_grad(set_to_none=True)
        logits, loss = self.model(self._as_tensor(x), self._as_tensor(y))
        loss.backward()
        return logits.detach().cpu().numpy(), float(loss.detach()), self.gradients()

    def train_steps(self, batches, learning_rate=3e-4, num_steps=None, schedule="cosine", warmup_iters=0,
                    final_lr_frac=0.0, weight_decay=0.0, grad_clip=1.0, on_step=None):
        """AdamW steps, one (x, y) batch each: zero grads, forward/backward, clip the global grad
        norm to grad_clip (0: off), the scheduled learning rate, AdamW. Returns each step's loss;
        on_step(step, loss, norm, lr, dt) after each."""
        batches = list(batches) if num_steps is None else batches
        num_steps = len(batches) if num_steps is None else num_steps
        if self.optimizer is None:
            self.optimizer = make_optimizer(self.model, learning_rate, weight_decay)
        params = list(self.model.parameters())
        it, losses = iter(batches), []
        for _ in range(num_steps):
            t0 = time.perf_counter()
            x, y = next(it)
            self.optimizer.zero_grad(set_to_none=True)
            _, loss = self.model(self._as_tensor(x), self._as_tensor(y))
            loss.backward()
            norm = global_grad_norm(params)
            if 0 < grad_clip < norm:                            # clip: scale the gradient onto the ball of radius grad_clip
                for p in params:
                    p.grad.mul_(grad_clip / norm)
            lr = learning_rate_at(self.step, schedule, learning_rate, warmup_iters, num_steps, final_lr_frac)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.step += 1
            losses.append(float(loss.detach()))
            if on_step:
                on_step(self.step, losses[-1], norm, lr, time.perf_counter() - t0)
        return losses

    def write_model(self, path, dtype="float32"):
        write_model_file(path, self.config, self.parameters(), dtype)

    def write_debug_state(self, path, x, y):
        """Forward/backward on (x, y) and write llm.c's debug state (gradients in table order)."""
        logits, loss, grads = self.forward_backward(x, y)
        write_debug_state_file(path, np.asarray(x), np.asarray(y), logits, loss, grads)
        return logits, loss, grads


# ----------------------------------------------------------------------------
# command line

def parse_args(argv=None):
    p = ArgumentParser(prog="torch_reference_llama3.py", add_help=False,
                           description="Llama 3 in PyTorch: the independent reference (twin) of llama3_cpu.py.")
    a = p.add_argument
    a("--help", action="help", help="show this help and exit")
    a("-e", "--model", default="llama3:d2", help=f"Llama 3 model file .bin, or one of {' '.join(DESCRIPTORS)}")
    a("--seed", type=int, default=42, help="seed of the random init")
    a("-i", "--input-bin", default=DEFAULT_TRAIN, help="train data: token shard file or glob (uint16)")
    a("-b", "--batch-size", type=int, default=4, help="batch size B")
    a("-t", "--seq-len", type=int, default=64, help="sequence length T")
    a("-x", "--max-steps", type=int, default=10, help="optimizer steps (0: only write the files)")
    a("-k", "--lr-schedule", default="cosine", choices=LR_SCHEDULES, help="learning-rate schedule")
    a("-l", "--learning-rate", type=float, default=3e-4, help="peak learning rate")
    a("-u", "--warmup-iters", type=int, default=0, help="linear warmup steps")
    a("-q", "--final-lr-frac", type=float, default=0.0, help="final learning rate as a fraction of the peak")
    a("-c", "--weight-decay", type=float, default=0.0, help="AdamW weight decay (every matrix)")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    a("--write-model", default=None, help="write the starting model here (llm.c's Llama 3 model file)")
    a("--write-debug-state", default=None, help="write llm.c's debug state of the first batch here")
    a("--dtype", default="float32", choices=("float32", "float64"), help="parameter and compute dtype")
    a("--flash", type=int, default=0, choices=(0, 1), help="1: F.scaled_dot_product_attention")
    a("--device", default="cpu", help="cpu, cuda, cuda:N")
    return p.parse_args(argv)


def run(args):
    """The command: build (or read) the model, write the requested files, train -x steps. Raises
    InputError (TwinError) for bad input."""
    check_flags(args)
    B, T = args.batch_size, args.seq_len
    kwargs = dict(dtype=getattr(torch, args.dtype), device=args.device, flash=bool(args.flash))
    if args.model.endswith(".bin") or os.path.sep in args.model:
        check_model_file(args.model)
        twin = Twin.from_model_file(args.model, **kwargs)
    else:
        twin = Twin.init(config_from_name(args.model), args.seed, **kwargs)
    c = twin.config
    if T > c.max_seq_len:
        raise TwinError(f"-t {T} exceeds the model's max_seq_len {c.max_seq_len}")
    loader = TokenLoader(args.input_bin, B, T)
    num_params = sum(math.prod(s) for _, s in parameter_shapes(c))
    print(f"model: L={c.num_layers} NH={c.num_heads} NKV={c.num_kv_heads} C={c.channels} H={c.hidden_dim} "
          f"maxT={c.max_seq_len} V={c.vocab_size} | {num_params:,} parameters | {args.dtype} on {args.device}")
    if args.write_model:
        write_output("--write-model", args.write_model, twin.write_model)
        print(f"wrote {args.write_model}")
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
              f"{dt * 1000:.1f} ms | {B * T / dt:.0f} tok/s", flush=True)

    if args.max_steps > 0:
        twin.train_steps(batches(), args.learning_rate, args.max_steps, args.lr_schedule, args.warmup_iters,
                         args.final_lr_frac, args.weight_decay, args.grad_clip, report)


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
