"""
llmc/formats.py: llm.c's binary files (doc/file_formats.md), byte for byte.

Every file opens with a header of 256 little-endian int32: slot 0 the magic number, slot 1 the
version, the rest per format (named below, never bare indices). Then the payload:
    model checkpoint   the parameters in the order of the model's parameter table, fp32 or bf16
    Llama 3 model      a second header of 256 float32, then Llama 3's parameters in GPT-2's slots
                       (llm.c's llama3 branch); or, llm.c master's layout, Llama 3's 10 tensors
    debug state        inputs, targets, logits, loss and every gradient of one batch (test vectors)
    token shard        uint16 token ids (GPT-2), or uint32 (Llama 3: another magic, version 7)
The tokenizer file lives in llmc/tokenizer.py, the multiple-choice eval file in
llmc/evalloader.py and the training-state file in llmc/checkpoint.py; they use the helpers here.

This module knows nothing of GPT-2's parameter table: the model file's readers take the number
of parameters (or the table) from the caller, so the dependency runs from the trainers to here.
"""

import math
import os
import re

import numpy as np

from llmc.utils import InputError, atomic_write, check_input_file, physical_memory_bytes

HEADER_INTS = 256                      # every file starts with 256 int32
HEADER_BYTES = HEADER_INTS * 4
SLOT_MAGIC, SLOT_VERSION = 0, 1        # the two slots every header shares

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
# model header slots 2-7: the model's shape, in llm.c's order (GPT2Config's field names)
MODEL_SLOTS = {"max_seq_len": 2, "vocab_size": 3, "num_layers": 4, "num_heads": 5, "channels": 6,
               "padded_vocab_size": 7}
MODEL_DTYPES = {MODEL_VERSION_FP32: np.dtype("<f4"), MODEL_VERSION_BF16: np.dtype("<u2")}

LLAMA3_MODEL_MAGIC = 20240803       # llm.c's Llama 3 model file (train_llama3.py / train_llama3.cu, llama3 branch)
# int32 header slots 2-11, in llm.c's order (llama3_cpu.LlamaConfig's field names)
LLAMA3_INT_SLOTS = {"max_seq_len": 2, "vocab_size": 3, "num_layers": 4, "num_heads": 5, "num_kv_heads": 6,
                    "channels": 7, "multiple_of": 8, "use_scaled_rope": 9}
LLAMA3_SLOT_MAJOR, LLAMA3_SLOT_MINOR = 10, 11      # the Llama version, e.g. 3 and 1 (not read by llm.c)
LLAMA3_VERSION = (3, 1)
# the second header, 256 float32 right after the first: its slots
LLAMA3_FLOAT_SLOTS = {"ffn_dim_multiplier": 0, "norm_eps": 1, "rope_theta": 2}
LLAMA3_HEADER_BYTES = 2 * HEADER_BYTES
# the payload: GPT-2's 16 tensors (llm.c reuses GPT-2's code paths): the classifier in wpe's slot,
# every bias present but zero, c_fc and c_fc2 stacked per layer in fcw (llama3_file_shapes)
LLAMA3_FILE_TENSORS = ("wte", "wlmhead", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
                       "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
LLAMA3_FILE_BIASES = ("ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfb")
# llm.c has two Llama 3 layouts under the one magic: the one above (the llama3 branch's
# train_llama3.py and train_llama3.cu), and master's train_llama3.py write_model: ONE int32
# header, then the 10 tensors of llama3_cpu's table, no biases. Its header, slots 2-15:
LLAMA3_MASTER_INT_SLOTS = {"max_seq_len": 2, "vocab_size": 3, "num_layers": 4, "num_heads": 5, "num_kv_heads": 6,
                           "channels": 7, "ffn_dim_multiplier": 8, "multiple_of": 9, "norm_eps": 10,
                           "rope_theta": 11, "use_scaled_rope": 12, "max_gen_batch_size": 13}
LLAMA3_MASTER_SLOT_MAJOR, LLAMA3_MASTER_SLOT_MINOR = 14, 15
# master stores the three float fields as int32 (torch casts by truncation): 1.3 -> 1, 1e-5 -> 0,
# 500000.0 -> 500000. What is lost is recovered (read_llama3_model_shape): H from the file's size,
# norm_eps as Llama 3's
LLAMA3_NORM_EPS = 1e-5                 # every Llama 3 / 3.1 (Meta's params.json, master's LlamaConfig)
LLAMA3_MAX_GEN_BATCH_SIZE = 4          # master's LlamaConfig.max_gen_batch_size, written in slot 13
LLAMA3_MASTER_FILE_TENSORS = ("wte", "ln1w", "qkvw", "attprojw", "ln2w", "fcw", "fcw2", "fcprojw", "lnfw", "wlmhead")
# the layouts' names (write_llama3_model_file's layout=); which one a file has is read from where
# its Llama version (3, 1) sits: slots 10-11 (the llama3 branch) or 14-15 (master; its slot 10 is
# int(norm_eps) = 0); the size of the file then has to fit that layout exactly
LLAMA3_LAYOUT_BRANCH = "llama3-branch"
LLAMA3_LAYOUT_MASTER = "master"
LLAMA3_LAYOUTS = (LLAMA3_LAYOUT_BRANCH, LLAMA3_LAYOUT_MASTER)

DEBUG_STATE_MAGIC = 20240327
DEBUG_STATE_VERSION = 2
DEBUG_SLOT_B, DEBUG_SLOT_T = 2, 3

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
SHARD_SLOT_NUM_TOKENS = 2
LLAMA3_SHARD_MAGIC = 20240801          # llm.c's Llama 3 shards: 128,256 token ids need 32 bits
LLAMA3_SHARD_VERSION = 7
# (magic, version) -> how each token id is stored
SHARD_TOKEN_DTYPES = {(SHARD_MAGIC, SHARD_VERSION): np.dtype("<u2"),
                      (LLAMA3_SHARD_MAGIC, LLAMA3_SHARD_VERSION): np.dtype("<u4")}


# ----------------------------------------------------------------------------
# headers

def read_header(f, path, magic, versions, what):
    """Read and check a 256-int32 header from the open file f. Returns it as an int32 array.
    Raises InputError naming the file on truncation, a bad magic or an unsupported version."""
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise InputError(f"{path}: truncated {what} file: {len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    header = np.frombuffer(raw, dtype="<i4")
    if header[SLOT_MAGIC] != magic:
        raise InputError(f"{path}: bad magic number {header[SLOT_MAGIC]} (expected {magic}): not a {what} file")
    if header[SLOT_VERSION] not in versions:
        raise InputError(f"{path}: unsupported {what} version {header[SLOT_VERSION]} "
                         f"(expected {' or '.join(map(str, versions))})")
    return header


def make_header(magic, version, values=None):
    """A 256-int32 header: magic, version, `values` {slot: int}, every other slot 0."""
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[SLOT_MAGIC], header[SLOT_VERSION] = magic, version
    for slot, value in (values or {}).items():
        header[slot] = value
    return header


def read_exact(f, path, count, dtype, what):
    """Read exactly `count` items of `dtype` from f, or raise InputError (truncated). A count
    read from the file itself may be anything: the bytes left in the file are checked first, so a
    corrupt count is never allocated."""
    dtype = np.dtype(dtype)
    left = os.fstat(f.fileno()).st_size - f.tell()
    if not 0 <= count * dtype.itemsize <= left:
        raise InputError(f"{path}: truncated {what}: expected {count * dtype.itemsize} bytes, "
                         f"{max(left, 0)} are left in the file")
    raw = f.read(count * dtype.itemsize)
    if len(raw) != count * dtype.itemsize:
        raise InputError(f"{path}: truncated {what}: expected {count * dtype.itemsize} bytes, got {len(raw)}")
    return np.frombuffer(raw, dtype=dtype).copy()


# ----------------------------------------------------------------------------
# bfloat16 bit patterns (NumPy has no bfloat16; the files and the CUDA side keep raw uint16 bits)

BF16_QUIET_NAN = 0x7FC0
BF16_ROUND_BIAS = 0x7FFF               # added before truncating: rounds to nearest, ties to even


def float32_to_bfloat16_bits(x):
    """Round float32 values to bfloat16, round-to-nearest-even, returned as uint16 bit patterns
    (the same rounding as the kernels' __float2bfloat16_rn). NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(BF16_ROUND_BIAS)      # ties go to the even mantissa
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32).ravel()).reshape(bits.shape)
    out[nan] = BF16_QUIET_NAN
    return out


def bfloat16_bits_to_float32(bits):
    """uint16 bfloat16 bit patterns -> float32 (exact)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


# ----------------------------------------------------------------------------
# model checkpoint: header, then every parameter in table order (fp32 version 3, bf16 version 5)

def check_model_path(path):
    """Raise InputError unless path is a file. A directory (most often a run's -o) gets the
    newest model_<step>.bin in it named, so the fix is in the message."""
    if os.path.isdir(path):
        steps = sorted(name for name in os.listdir(path) if re.fullmatch(r"model_\d{8}\.bin", name))
        hint = f": its newest model is -e {os.path.join(path, steps[-1])}" if steps else " (it holds no model_<step>.bin)"
        raise InputError(f"{path}: -e names a directory, not a model checkpoint{hint}")
    check_input_file(path, "model checkpoint")


def read_model_shape(path):
    """The shape dict (MODEL_SLOTS' keys) of a model checkpoint, from its header alone.
    Raises InputError on a missing file, a directory or a bad header."""
    check_model_path(path)
    with open(path, "rb") as f:
        h = read_header(f, path, MODEL_MAGIC, tuple(MODEL_DTYPES), "model checkpoint")
    return {name: int(h[slot]) for name, slot in MODEL_SLOTS.items()}


def read_model_file(path, num_parameters_of):
    """Read a model checkpoint. num_parameters_of(shape) -> int gives the parameter count of a
    model of `shape` (a dict with MODEL_SLOTS' keys, padded_vocab_size 0 in old files), so this
    module needs no parameter table. Returns (shape dict, fp32 parameters (num_parameters,)).
    The dimensions are checked for consistency and against the file's size before anything is
    allocated, and every parameter must be finite. Raises InputError on a missing file, bad header,
    impossible shape, wrong size or a NaN/inf parameter."""
    check_model_path(path)
    with open(path, "rb") as f:
        h = read_header(f, path, MODEL_MAGIC, tuple(MODEL_DTYPES), "model checkpoint")
        shape = {name: int(h[slot]) for name, slot in MODEL_SLOTS.items()}
        if min(v for k, v in shape.items() if k != "padded_vocab_size") <= 0 or shape["padded_vocab_size"] < 0 \
                or shape["channels"] % shape["num_heads"] \
                or 0 < shape["padded_vocab_size"] < shape["vocab_size"]:
            raise InputError(f"{path}: impossible model header {shape}")
        dtype = MODEL_DTYPES[int(h[SLOT_VERSION])]
        n = num_parameters_of(shape)
        payload = os.path.getsize(path) - HEADER_BYTES
        if payload != n * dtype.itemsize:
            problem = "truncated" if payload < n * dtype.itemsize else "trailing bytes after the parameters"
            raise InputError(f"{path}: {problem}: the header's model has {n:,} parameters "
                             f"({n * dtype.itemsize:,} bytes), the file holds {payload:,} bytes after the header")
        data = read_exact(f, path, n, dtype, "parameters")
    params = bfloat16_bits_to_float32(data) if dtype == MODEL_DTYPES[MODEL_VERSION_BF16] else data.astype(np.float32)
    finite = np.isfinite(params)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise InputError(f"{path}: {bad.size:,} parameters are not finite (the first, at index {bad[0]:,}, is "
                         f"{params[bad[0]]}): the model diverged before it was saved, or the file is corrupt")
    return shape, params


def write_model_file(path, config, params, dtype="float32"):
    """Write a model checkpoint atomically. config: any object with MODEL_SLOTS' attributes;
    params: the flat fp32 parameters; dtype "float32" (version 3) or "bfloat16" (version 5,
    rounded to nearest even). Raises ValueError for another dtype."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
    version = MODEL_VERSION_FP32 if dtype == "float32" else MODEL_VERSION_BF16
    params = np.asarray(params, dtype=np.float32)
    data = params.astype("<f4") if dtype == "float32" else float32_to_bfloat16_bits(params).astype("<u2")
    header = make_header(MODEL_MAGIC, version, {slot: getattr(config, name) for name, slot in MODEL_SLOTS.items()})

    def write(f):
        f.write(header.tobytes())
        f.write(data.tobytes())
    atomic_write(path, write)


# ----------------------------------------------------------------------------
# Llama 3 model file: two headers (int32, float32), then GPT-2's 16 tensor slots (fp32 version 3, bf16 version 5)

def llama3_file_shapes(shape, hidden_dim):
    """The 16 tensors of a Llama 3 model file in file order: list of (name, shape). shape: the
    header's dict (LLAMA3_INT_SLOTS' keys); hidden_dim: H, the SwiGLU width (computed by the model
    from the header's ffn_dim_multiplier and multiple_of). No vocabulary padding (llm.c's Vp = V);
    fcw is (L, 2H, C): each layer's c_fc (H,C) then its c_fc2 (H,C)."""
    V, C, L = shape["vocab_size"], shape["channels"], shape["num_layers"]
    QKV = (shape["num_heads"] + 2 * shape["num_kv_heads"]) * (C // shape["num_heads"])
    H = hidden_dim
    return [("wte", (V, C)), ("wlmhead", (V, C)), ("ln1w", (L, C)), ("ln1b", (L, C)),
            ("qkvw", (L, QKV, C)), ("qkvb", (L, QKV)), ("attprojw", (L, C, C)), ("attprojb", (L, C)),
            ("ln2w", (L, C)), ("ln2b", (L, C)), ("fcw", (L, 2 * H, C)), ("fcb", (L, 2 * H)),
            ("fcprojw", (L, C, H)), ("fcprojb", (L, C)), ("lnfw", (C,)), ("lnfb", (C,))]


def llama3_layout(h, path):
    """Which of llm.c's two Llama 3 layouts the int32 header h opens (LLAMA3_LAYOUTS): the one whose
    Llama-version slots hold major version 3. Raises InputError if neither does."""
    if h[LLAMA3_SLOT_MAJOR] == LLAMA3_VERSION[0] and not h[LLAMA3_MASTER_SLOT_MAJOR]:
        return LLAMA3_LAYOUT_BRANCH
    if h[LLAMA3_MASTER_SLOT_MAJOR] == LLAMA3_VERSION[0]:
        return LLAMA3_LAYOUT_MASTER
    raise InputError(f"{path}: Llama 3 model header without the Llama version 3 in slot {LLAMA3_SLOT_MAJOR} "
                     f"(llm.c's llama3 branch) or {LLAMA3_MASTER_SLOT_MAJOR} (llm.c master's train_llama3.py)")


def is_llama3_model_file(path):
    """Whether `path` is a file that opens with the Llama 3 model file's magic (LLAMA3_MODEL_MAGIC),
    so that a tool taking either family's file knows which reader to call; False for any other
    file or one that cannot be read (the reader then says why in one line)."""
    if not os.path.isfile(path):                 # a FIFO is never opened: it would wait for a writer
        return False
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError:
        return False
    return len(magic) == 4 and int.from_bytes(magic, "little", signed=True) == LLAMA3_MODEL_MAGIC


def read_llama3_headers(f, path):
    """The headers of an open Llama 3 model file -> (layout, int32 header, float32 header or None
    for master's layout, which has none). Raises InputError."""
    h = read_header(f, path, LLAMA3_MODEL_MAGIC, tuple(MODEL_DTYPES), "Llama 3 model")
    layout = llama3_layout(h, path)
    if layout == LLAMA3_LAYOUT_MASTER:
        return layout, h, None
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        raise InputError(f"{path}: truncated Llama 3 model file: no float header after the int header")
    return layout, h, np.frombuffer(raw, dtype="<f4")


def master_hidden_dim(path, shape, itemsize):
    """H of a master-layout file, which its header does not hold (int(ffn_dim_multiplier) is all
    there is): the payload is 2VC + 2LC + C + L*QKV*C + L*C*C + 3*L*H*C items (the three SwiGLU
    matrices are H*C each), solved for H. Raises InputError unless that is a positive integer and a
    multiple of the header's multiple_of (Meta's rounding of H, which every Llama 3 has)."""
    V, C, L = shape["vocab_size"], shape["channels"], shape["num_layers"]
    QKV = (shape["num_heads"] + 2 * shape["num_kv_heads"]) * (C // shape["num_heads"])
    payload = os.path.getsize(path) - HEADER_BYTES
    rest = payload // itemsize - (2 * V * C + 2 * L * C + C + L * QKV * C + L * C * C)
    if payload % itemsize or rest <= 0 or rest % (3 * L * C):
        raise InputError(f"{path}: {payload:,} bytes after the header do not fit a Llama 3 of this header with any "
                         f"SwiGLU width (llm.c master's layout): truncated, or not this model")
    H = rest // (3 * L * C)
    if H % shape["multiple_of"]:
        raise InputError(f"{path}: the SwiGLU width its size gives, {H}, is not a multiple of the header's multiple_of "
                         f"{shape['multiple_of']}: not a Llama 3, or a corrupt header")
    return H


def read_llama3_model_shape(path):
    """The header dict of a Llama 3 model file, of either layout: LLAMA3_INT_SLOTS' keys (ints) and
    LLAMA3_FLOAT_SLOTS' (floats; use_scaled_rope a bool). From master's layout, which stores the
    floats as truncated ints, also "layout" and "hidden_dim" (H, from the file's size), with
    ffn_dim_multiplier None (the model picks one that gives H), norm_eps LLAMA3_NORM_EPS and
    rope_theta as stored. Raises InputError on a missing file or a bad header (a model dimension
    <= 0, NH not a multiple of NKV, C not of NH, a float field infinite, NaN or out of its range,
    use_scaled_rope other than 0 or 1)."""
    check_model_path(path)
    with open(path, "rb") as f:
        layout, h, hf = read_llama3_headers(f, path)
    if layout == LLAMA3_LAYOUT_MASTER:
        shape = {name: int(h[LLAMA3_MASTER_INT_SLOTS[name]]) for name in LLAMA3_INT_SLOTS}
        shape.update(ffn_dim_multiplier=None, norm_eps=LLAMA3_NORM_EPS,
                     rope_theta=float(h[LLAMA3_MASTER_INT_SLOTS["rope_theta"]]))
    else:
        shape = {name: int(h[slot]) for name, slot in LLAMA3_INT_SLOTS.items()}
        # a float32 as the shortest decimal that rounds to it (1.3, not 1.2999999523), the value the
        # writer was given: the model computes H from ffn_dim_multiplier in float64, as Meta's does
        shape.update({name: float(str(hf[slot])) for name, slot in LLAMA3_FLOAT_SLOTS.items()})
    scaled_rope = shape["use_scaled_rope"]
    shape["use_scaled_rope"] = bool(scaled_rope)
    dims = ("max_seq_len", "vocab_size", "num_layers", "num_heads", "num_kv_heads", "channels", "multiple_of")
    multiplier = shape["ffn_dim_multiplier"]
    if min(shape[k] for k in dims) <= 0 or shape["num_heads"] % shape["num_kv_heads"] \
            or shape["channels"] % shape["num_heads"] or scaled_rope not in (0, 1) \
            or not (multiplier is None or 0 < multiplier < math.inf) \
            or not 0 <= shape["norm_eps"] < math.inf or not 0 < shape["rope_theta"] < math.inf:
        raise InputError(f"{path}: impossible Llama 3 model header {shape} (dimensions > 0, NH a multiple of NKV, "
                         "C of NH, finite ffn_dim_multiplier > 0, norm_eps >= 0, rope_theta > 0, use_scaled_rope 0 or 1)")
    # the file holds no (maxT, C) table as GPT-2's wpe, so its size does not bound maxT: the model's
    # RoPE tables do, cos and sin (maxT, HS/2) float64 each, which must fit in this machine's memory
    rope_bytes = shape["max_seq_len"] * (shape["channels"] // shape["num_heads"]) * np.dtype(np.float64).itemsize
    if rope_bytes > physical_memory_bytes():
        raise InputError(f"{path}: impossible Llama 3 model header: max_seq_len {shape['max_seq_len']:,} needs RoPE "
                         f"tables of {rope_bytes / 2**30:.1f} GiB, more than this machine's memory")
    if layout == LLAMA3_LAYOUT_MASTER:           # the branch's dict keeps exactly LlamaConfig's fields
        shape["layout"] = layout
        shape["hidden_dim"] = master_hidden_dim(path, shape, MODEL_DTYPES[int(h[SLOT_VERSION])].itemsize)
    return shape


def llama3_master_file_shapes(shape, hidden_dim):
    """The 10 tensors of master's layout in file order (llama3_cpu's table): list of (name, shape)."""
    V, C, L, H = shape["vocab_size"], shape["channels"], shape["num_layers"], hidden_dim
    QKV = (shape["num_heads"] + 2 * shape["num_kv_heads"]) * (C // shape["num_heads"])
    return [("wte", (V, C)), ("ln1w", (L, C)), ("qkvw", (L, QKV, C)), ("attprojw", (L, C, C)), ("ln2w", (L, C)),
            ("fcw", (L, H, C)), ("fcw2", (L, H, C)), ("fcprojw", (L, C, H)), ("lnfw", (C,)), ("wlmhead", (V, C))]


def read_llama3_model_file(path, hidden_dim_of):
    """Read a Llama 3 model file of either of llm.c's layouts (read_llama3_model_shape tells
    which). hidden_dim_of(shape) -> H, the SwiGLU width of a model of that header (llama3_cpu
    computes it; master's layout gives H from its size instead). Returns (shape dict, {name: fp32
    array}) with the tensors of LLAMA3_FILE_TENSORS but the biases, whichever the layout (fcw:
    c_fc and c_fc2 stacked per layer, (L, 2H, C)). The llama3 branch's zero biases are checked
    (llm.c's reader ignores them; here a nonzero one is refused, as no Llama has biases). The size
    is checked against the header before anything is allocated, and every parameter must be
    finite. Raises InputError."""
    shape = read_llama3_model_shape(path)
    master = shape.get("layout") == LLAMA3_LAYOUT_MASTER
    shapes = llama3_master_file_shapes(shape, shape["hidden_dim"]) if master \
        else llama3_file_shapes(shape, hidden_dim_of(shape))
    with open(path, "rb") as f:
        _, h, _ = read_llama3_headers(f, path)
        dtype = MODEL_DTYPES[int(h[SLOT_VERSION])]
        n = sum(math.prod(s) for _, s in shapes)
        payload = os.path.getsize(path) - (HEADER_BYTES if master else LLAMA3_HEADER_BYTES)
        if payload != n * dtype.itemsize:
            raise InputError(f"{path}: a Llama 3 of this header has {n:,} parameters ({n * dtype.itemsize:,} bytes), "
                             f"but the file holds {payload:,} bytes after its headers: truncated, or not this model")
        data = read_exact(f, path, n, dtype, "parameters")
    params = bfloat16_bits_to_float32(data) if dtype == MODEL_DTYPES[MODEL_VERSION_BF16] else data.astype(np.float32)
    if not np.isfinite(params).all():
        raise InputError(f"{path}: {int((~np.isfinite(params)).sum()):,} parameters are not finite: the model "
                         f"diverged before it was saved, or the file is corrupt")
    tensors, offset = {}, 0
    for name, s in shapes:
        tensors[name] = params[offset:offset + math.prod(s)].reshape(s)
        offset += math.prod(s)
    if master:
        tensors["fcw"] = np.concatenate([tensors["fcw"], tensors.pop("fcw2")], axis=1)   # -> (L, 2H, C)
    for name in () if master else LLAMA3_FILE_BIASES:
        if np.any(tensors.pop(name)):
            raise InputError(f"{path}: the bias {name} is not zero: Llama 3 has no biases, so this is not a Llama 3")
    return shape, tensors


def write_llama3_model_file(path, config, tensors, dtype="float32", layout=LLAMA3_LAYOUT_BRANCH):
    """Write a Llama 3 model file atomically, in one of llm.c's layouts (LLAMA3_LAYOUTS): the llama3
    branch's (two headers, GPT-2's 16 slots, the default) or master's train_llama3.py write_model
    (one int32 header with the float fields truncated to int, the 10 tensors of llama3_cpu's table).
    config: any object with the attributes LLAMA3_INT_SLOTS and LLAMA3_FLOAT_SLOTS name; tensors:
    {name: fp32 array} of LLAMA3_FILE_TENSORS but the biases, which the llama3 branch's layout
    gets as zeros (fcw: c_fc and c_fc2 stacked, (L, 2H, C)); dtype "float32" (version 3) or
    "bfloat16" (5, every tensor, rounded to nearest even). Raises ValueError for another dtype or
    layout or a tensor of the wrong shape (KeyError: a missing one)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be float32 or bfloat16, not {dtype}")
    if layout not in LLAMA3_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LLAMA3_LAYOUTS)}, not {layout}")
    version = MODEL_VERSION_FP32 if dtype == "float32" else MODEL_VERSION_BF16
    dims = {name: getattr(config, name) for name in LLAMA3_INT_SLOTS}
    shapes = dict(llama3_file_shapes(dims, hidden_dim=np.shape(tensors["fcprojw"])[-1]))
    parts = {}
    for name in LLAMA3_FILE_TENSORS:
        part = np.zeros(shapes[name], np.float32) if name in LLAMA3_FILE_BIASES else np.asarray(tensors[name], np.float32)
        if part.shape != shapes[name]:
            raise ValueError(f"{name} is {part.shape}, but a Llama 3 of this config stores {shapes[name]}")
        parts[name] = part
    if layout == LLAMA3_LAYOUT_MASTER:
        values = {slot: int(getattr(config, name)) for name, slot in LLAMA3_MASTER_INT_SLOTS.items()
                  if name != "max_gen_batch_size"}                   # int(): torch's truncation, as master's
        values.update({LLAMA3_MASTER_INT_SLOTS["max_gen_batch_size"]: LLAMA3_MAX_GEN_BATCH_SIZE,
                       LLAMA3_MASTER_SLOT_MAJOR: LLAMA3_VERSION[0], LLAMA3_MASTER_SLOT_MINOR: LLAMA3_VERSION[1]})
        headers = [make_header(LLAMA3_MODEL_MAGIC, version, values)]
        parts["fcw"], parts["fcw2"] = np.split(parts["fcw"], 2, axis=1)   # (L,2H,C) -> c_fc, c_fc2 (L,H,C)
        order = LLAMA3_MASTER_FILE_TENSORS
    else:
        values = {slot: int(dims[name]) for name, slot in LLAMA3_INT_SLOTS.items()}
        values.update({LLAMA3_SLOT_MAJOR: LLAMA3_VERSION[0], LLAMA3_SLOT_MINOR: LLAMA3_VERSION[1]})
        float_header = np.zeros(HEADER_INTS, dtype="<f4")
        for name, slot in LLAMA3_FLOAT_SLOTS.items():
            float_header[slot] = getattr(config, name)
        headers = [make_header(LLAMA3_MODEL_MAGIC, version, values), float_header]
        order = LLAMA3_FILE_TENSORS
    flat = np.concatenate([parts[name].ravel() for name in order])
    data = flat.astype("<f4") if dtype == "float32" else float32_to_bfloat16_bits(flat).astype("<u2")

    def write(f):
        for header in headers:
            f.write(header.tobytes())
        f.write(data.tobytes())
    atomic_write(path, write)


# ----------------------------------------------------------------------------
# debug state: llm.c's test vectors for one batch

def write_debug_state(path, x, y, logits, loss, grads):
    """Write llm.c's debug-state test vectors: x, y (B,T) int32; logits (B,T,V) fp32 (unpadded);
    loss (scalar); grads: the parameter gradients in table order (wte's padded to Vp)."""
    B, T = np.shape(x)

    def write(f):
        f.write(make_header(DEBUG_STATE_MAGIC, DEBUG_STATE_VERSION, {DEBUG_SLOT_B: B, DEBUG_SLOT_T: T}).tobytes())
        for arr, dtype in ((x, "<i4"), (y, "<i4"), (logits, "<f4"), ([loss], "<f4")):
            f.write(np.asarray(arr, dtype).tobytes())
        for g in grads:
            f.write(np.asarray(g, "<f4").tobytes())
    atomic_write(path, write)


def read_debug_state(path, vocab_size, param_shapes):
    """Read a debug-state file for a model with vocab_size V and parameter table param_shapes
    (list of (name, shape)). Returns a dict with x, y (B,T) int32, logits (B,T,V), loss (float),
    grads {name: array of that shape}. B, T and the file's size are checked before anything is
    read, and every token id against V. Raises InputError on a bad or mismatched file."""
    check_input_file(path, "debug-state file")
    with open(path, "rb") as f:
        h = read_header(f, path, DEBUG_STATE_MAGIC, (DEBUG_STATE_VERSION,), "debug state")
        B, T = int(h[DEBUG_SLOT_B]), int(h[DEBUG_SLOT_T])
        expected = HEADER_BYTES + 4 * (2 * B * T + B * T * vocab_size + 1 + sum(math.prod(s) for _, s in param_shapes))
        if B <= 0 or T <= 0 or os.path.getsize(path) != expected:      # checked before anything is allocated
            raise InputError(f"{path}: a debug state of B={B} T={T} for this model (V={vocab_size}) is {expected} "
                             f"bytes, the file {os.path.getsize(path)}: impossible B or T, or another model's file")
        x = read_exact(f, path, B * T, "<i4", "inputs").reshape(B, T)
        y = read_exact(f, path, B * T, "<i4", "targets").reshape(B, T)
        for ids, what in ((x, "input"), (y, "target")):
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise InputError(f"{path}: {what} token ids {ids.min()}..{ids.max()} are outside the vocabulary [0, {vocab_size})")
        logits = read_exact(f, path, B * T * vocab_size, "<f4", "logits").reshape(B, T, vocab_size)
        loss = float(read_exact(f, path, 1, "<f4", "loss")[0])
        grads = {name: read_exact(f, path, math.prod(shape), "<f4", f"gradient {name}").reshape(shape)
                 for name, shape in param_shapes}
        if f.read(1):
            raise InputError(f"{path}: trailing bytes: the debug state does not belong to this model")
    return {"x": x, "y": y, "logits": logits, "loss": loss, "grads": grads}


# ----------------------------------------------------------------------------
# token shards: header, then uint16 token ids (GPT-2) or uint32 (Llama 3)

def write_shard(path, tokens, version=SHARD_VERSION):
    """Write a token data shard atomically: header + token ids, uint16 (version SHARD_VERSION,
    GPT-2's) or uint32 (version LLAMA3_SHARD_VERSION, with LLAMA3_SHARD_MAGIC). Raises ValueError
    for another version or a token id that does not fit."""
    magic = {SHARD_VERSION: SHARD_MAGIC, LLAMA3_SHARD_VERSION: LLAMA3_SHARD_MAGIC}.get(version)
    if magic is None:
        raise ValueError(f"shard version must be {SHARD_VERSION} or {LLAMA3_SHARD_VERSION}, not {version}")
    dtype = SHARD_TOKEN_DTYPES[magic, version]
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids must fit in {dtype.name}")
    header = make_header(magic, version, {SHARD_SLOT_NUM_TOKENS: tokens.size})

    def write(f):
        f.write(header.tobytes())
        f.write(tokens.astype(dtype).tobytes())
    atomic_write(path, write)


def shard_format(path):
    """(N, dtype) of a token shard: its number of tokens and how each is stored (uint16 or
    uint32, by its magic and version: SHARD_TOKEN_DTYPES), after checking its header and that the
    file is exactly HEADER_BYTES + N * dtype.itemsize bytes. Raises InputError naming the file."""
    check_input_file(path, "data shard")
    size = os.path.getsize(path)
    if size == 0:
        raise InputError(f"{path}: empty data shard")
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
        magic = int(np.frombuffer(raw[:4], dtype="<i4")[0]) if len(raw) >= 4 else None
        magic = magic if magic == LLAMA3_SHARD_MAGIC else SHARD_MAGIC    # any other: GPT-2's magic is reported
        versions = tuple(v for m, v in SHARD_TOKEN_DTYPES if m == magic)
        f.seek(0)
        h = read_header(f, path, magic, versions, "token shard")
    dtype = SHARD_TOKEN_DTYPES[magic, int(h[SLOT_VERSION])]
    n = int(h[SHARD_SLOT_NUM_TOKENS])
    if size != HEADER_BYTES + dtype.itemsize * n:
        raise InputError(f"{path}: file is {size} bytes but its header says {n} tokens "
                         f"({HEADER_BYTES + dtype.itemsize * n} bytes): truncated or corrupt")
    if n == 0:
        raise InputError(f"{path}: data shard holds no tokens")
    return n, dtype


def shard_num_tokens(path):
    """The number of tokens N of a token shard, after checking it (shard_format). Raises InputError."""
    return shard_format(path)[0]


def read_shard(path):
    """Memory-map a token shard's tokens (uint16 or uint32, read-only) after checking its header
    and size (shard_format). For tools that read a shard whole; a training run reads with
    read_shard_tokens instead, because a mapped file that shrinks under the reader kills it with
    SIGBUS. Raises InputError naming the file."""
    n, dtype = shard_format(path)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))


def read_shard_tokens(fd, path, start, count, dtype=SHARD_TOKEN_DTYPES[SHARD_MAGIC, SHARD_VERSION]):
    """Tokens start .. start+count-1 (stored as dtype, uint16 or uint32 as shard_format says; returned
    as int32) of the shard open as file descriptor fd, copied out with one pread (never a memory
    map: a file truncated under the reader gives a short read here, which is reported, where a
    map gives SIGBUS). Raises InputError if fewer than count tokens are there."""
    dtype = np.dtype(dtype)
    raw = os.pread(fd, dtype.itemsize * count, HEADER_BYTES + dtype.itemsize * start)
    if len(raw) != dtype.itemsize * count:
        raise InputError(f"{path}: the shard changed while this run read it: tokens {start}..{start + count - 1} "
                         f"are no longer there")
    return np.frombuffer(raw, dtype=dtype).astype(np.int32)
