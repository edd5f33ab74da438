"""
tests/emulated_gpu.py: the test scaffolding that runs gpt2_cuda.py's whole orchestration without a
GPU, shared by the test modules (which never import each other): cuBLAS's gemm and every kernel
of kernels/*.cu emulated in NumPy from their C signatures, a NumPy stand-in for the few CuPy calls
gpt2_cuda makes, the `emulated_gpu` fixture that installs them, the tiny model TINY, and helpers
for training runs (a token shard, the losses of a main.log). Not a test module.
"""

import math
import re
import types

import numpy as np
import pytest

import gpt2_cpu
import llmc.attention
import llmc.cuda
from gpt2_cpu import GPT2Config
from llmc import formats
from llmc.formats import bfloat16_bits_to_float32, float32_to_bfloat16_bits

TINY = GPT2Config(max_seq_len=32, vocab_size=100, padded_vocab_size=128, num_layers=2, num_heads=2, channels=32)


# ----------------------------------------------------------------------------
# cuBLAS, emulated: column-major gemm on flat buffers

def _colmajor_index(rows, cols, ld):
    """Offsets of a column-major rows x cols matrix with leading dimension ld: element (r, c) is at r + c*ld."""
    assert ld >= max(1, rows), f"leading dimension {ld} < rows {rows}: cuBLAS would reject it"
    return np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld


def emulated_gemm(transa, transb, m, n, k, A, lda, B, ldb, C, ldc, accumulate=False, batch=1,
                  stride_a=0, stride_b=0, stride_c=0, tf32=False):
    """cublasGemmEx / cublasGemmStridedBatchedEx on NumPy floatX buffers (float32 or bf16 bits),
    taking every argument literally: C = op(A) @ op(B) (+ C), column-major, fp32 arithmetic
    (tf32 chooses cuBLAS's compute type; the emulation computes in fp32 either way)."""
    precision = llmc.cuda.precision_of(C)
    for arr in (A, B, C):
        assert llmc.cuda.precision_of(arr) == precision and arr.flags.c_contiguous
    a_flat, b_flat, c_flat = A.reshape(-1), B.reshape(-1), C.reshape(-1)
    a_shape = (m, k) if transa == llmc.cuda.CUBLAS_OP_N else (k, m)
    b_shape = (k, n) if transb == llmc.cuda.CUBLAS_OP_N else (n, k)
    ia, ib, ic = _colmajor_index(*a_shape, lda), _colmajor_index(*b_shape, ldb), _colmajor_index(m, n, ldc)
    for i in range(batch):
        for flat, idx, stride in ((a_flat, ia, stride_a), (b_flat, ib, stride_b), (c_flat, ic, stride_c)):
            assert i * stride + idx.max() < flat.size, "gemm reads or writes past the end of a buffer"
        a = _to_f32(a_flat[i * stride_a + ia])
        b = _to_f32(b_flat[i * stride_b + ib])
        a = a if transa == llmc.cuda.CUBLAS_OP_N else a.T
        b = b if transb == llmc.cuda.CUBLAS_OP_N else b.T
        out = a.astype(np.float64) @ b.astype(np.float64)
        if accumulate:
            out += _to_f32(c_flat[i * stride_c + ic])
        c_flat[i * stride_c + ic] = _from_f32(out.astype(np.float32), precision)


def _to_f32(a):
    return bfloat16_bits_to_float32(a) if a.dtype == np.uint16 else a.astype(np.float32)


def _from_f32(x, precision):
    return float32_to_bfloat16_bits(x) if precision == "bf16" else x.astype(np.float32)


# ----------------------------------------------------------------------------
# part 1c: the kernels, emulated in NumPy by their C signatures (kernels/*.cu headers), and a
# NumPy-backed stand-in for the few CuPy calls gpt2_cuda makes. Pointers arrive as the NumPy
# (view) arrays the launchers pass, read as flat buffers from their first element; NULL is the
# np.uint64(0) the launchers pass. Arithmetic in fp32, stores rounded to floatX (bf16: nearest
# even; AdamW's stochastic rounding is emulated as nearest even too).

def _prec(arr):
    return llmc.cuda.precision_of(arr)


def _load(ptr, n, offset=0):
    return _to_f32(ptr.reshape(-1)[offset:offset + n])


def _store(ptr, values, offset=0):
    flat = ptr.reshape(-1)
    values = np.asarray(values, dtype=np.float32).ravel()
    flat[offset:offset + values.size] = _from_f32(values, _prec(ptr))


def _warp_block(block):
    assert block % 32 == 0 and block <= 1024, f"warp-based kernel launched with blockDim {block}"


def _null(ptr):
    return isinstance(ptr, np.integer) and int(ptr) == 0


def k_encoder_forward(grid, block, out, inp, wte, wpe, B, T, C):
    N = B * T
    tokens = inp.reshape(-1)[:N]
    rows = _load(wte, wte.size).reshape(-1, C)[tokens] + _load(wpe, T * C).reshape(T, C)[np.arange(N) % T]
    _store(out, rows)


def k_encoder_backward_wpe(grid, block, dwpe, dout, B, T, C):
    _store(dwpe, _load(dwpe, T * C) + _load(dout, B * T * C).reshape(B, T * C).sum(axis=0))


def k_encoder_backward_wte(grid, block, dwte, partial, dout, positions, chunk_start, chunk_token, chunk_slot,
                           num_chunks, C):
    starts, tokens, slots = chunk_start.reshape(-1), chunk_token.reshape(-1), chunk_slot.reshape(-1)
    real = [k for k in range(num_chunks) if starts[k] != starts[k + 1]]        # empty chunks are skipped
    direct = [int(tokens[k]) for k in real if slots[k] < 0]
    assert len(set(direct)) == len(direct), "two chunks would add into the same dwte row"
    d = _load(dout, dout.size).reshape(-1, C)
    pos = positions.reshape(-1)
    for k in real:
        total = d[pos[starts[k]:starts[k + 1]]].sum(axis=0)
        if slots[k] < 0:
            _store(dwte, _load(dwte, C, int(tokens[k]) * C) + total, int(tokens[k]) * C)
        else:
            partial.reshape(-1)[int(slots[k]) * C:(int(slots[k]) + 1) * C] = total


def k_encoder_backward_wte_reduce(grid, block, dwte, partial, reduce_start, reduce_token, num_reduce, C):
    starts, tokens = reduce_start.reshape(-1), reduce_token.reshape(-1)
    rows = partial.reshape(-1)
    for m in range(num_reduce):
        if starts[m] != starts[m + 1]:
            total = rows[int(starts[m]) * C:int(starts[m + 1]) * C].reshape(-1, C).sum(axis=0)
            _store(dwte, _load(dwte, C, int(tokens[m]) * C) + total, int(tokens[m]) * C)


def _layernorm_rows(x, weight, bias):
    mean = x.mean(axis=1)
    rstd = 1.0 / np.sqrt(((x - mean[:, None]) ** 2).mean(axis=1) + gpt2_cpu.LN_EPS)
    return (x - mean[:, None]) * rstd[:, None] * weight + bias, mean, rstd


def k_layernorm_forward(grid, block, out, mean, rstd, inp, weight, bias, N, C):
    _warp_block(block)
    y, m, r = _layernorm_rows(_load(inp, N * C).reshape(N, C), _load(weight, C), _load(bias, C))
    _store(out, y)
    if not _null(mean):
        mean.reshape(-1)[:N] = m
    if not _null(rstd):
        rstd.reshape(-1)[:N] = r


def k_fused_residual_forward(grid, block, residual, normed, mean, rstd, inp1, inp2, inp2_bias, weight, bias, N, C):
    shift = 0.0 if _null(inp2_bias) else _load(inp2_bias, C)
    _store(residual, _load(inp1, N * C) + (_load(inp2, N * C).reshape(N, C) + shift).ravel())
    k_layernorm_forward(grid, block, normed, mean, rstd, residual, weight, bias, N, C)


def k_residual_forward(grid, block, out, inp1, inp2, n):
    _store(out, _load(inp1, int(n)) + _load(inp2, int(n)))


def k_layernorm_backward(grid, block, dinp, scratch, dout, inp, weight, mean, rstd, N, C):
    _warp_block(block)
    (G,) = grid
    d = _load(dout, N * C).reshape(N, C)
    m, r = mean.reshape(-1)[:N], rstd.reshape(-1)[:N]
    norm = (_load(inp, N * C).reshape(N, C) - m[:, None]) * r[:, None]
    dnorm = d * _load(weight, C)
    dval = r[:, None] * (dnorm - dnorm.mean(axis=1, keepdims=True) - norm * (dnorm * norm).mean(axis=1, keepdims=True))
    _store(dinp, _load(dinp, N * C) + dval.ravel())
    rows = math.ceil(N / G)
    for b in range(G):
        part = slice(min(N, b * rows), min(N, (b + 1) * rows))
        scratch[b * 2 * C:b * 2 * C + C] = d[part].sum(axis=0)
        scratch[b * 2 * C + C:(b + 1) * 2 * C] = (d[part] * norm[part]).sum(axis=0)


def k_layernorm_param_reduce(grid, block, dweight, dbias, scratch, num_blocks, C):
    parts = scratch[:num_blocks * 2 * C].reshape(num_blocks, 2, C).sum(axis=0)
    _store(dbias, _load(dbias, C) + parts[0])
    _store(dweight, _load(dweight, C) + parts[1])


def _gelu(x):
    return gpt2_cpu.gelu_forward(x.astype(np.float32))


def k_gelu_forward(grid, block, out, inp, inp_bias, n, OC):
    if not _null(inp_bias):
        _store(inp, (_load(inp, int(n)).reshape(-1, OC) + _load(inp_bias, OC)).ravel())
    _store(out, _gelu(_load(inp, int(n))))


def k_gelu_backward_inplace(grid, block, d_in_out, inp, n):
    _store(d_in_out, gpt2_cpu.gelu_backward(_load(d_in_out, int(n)), _load(inp, int(n))))


def k_add_bias(grid, block, out, bias, N, OC):
    _store(out, _load(out, N * OC).reshape(N, OC) + _load(bias, OC))


def k_bias_backward(grid, block, scratch, dout, N, OC):
    chunks = grid[1]
    d = _load(dout, N * OC).reshape(N, OC)
    rows = math.ceil(N / chunks)
    for y in range(chunks):
        scratch[y * OC:(y + 1) * OC] = d[min(N, y * rows):min(N, (y + 1) * rows)].sum(axis=0)


def k_bias_reduce(grid, block, dbias, scratch, num_chunks, OC):
    _store(dbias, _load(dbias, OC) + scratch[:num_chunks * OC].reshape(num_chunks, OC).sum(axis=0))


def k_permute_qkv(grid, block, q, k, v, inp, B, T, NH, HS):
    x = _load(inp, B * T * 3 * NH * HS).reshape(B, T, 3, NH, HS)
    for i, out in enumerate((q, k, v)):
        _store(out, x[:, :, i].transpose(0, 2, 1, 3))


def k_permute_qkv_backward(grid, block, dinp, dq, dk, dv, B, T, NH, HS):
    n = B * NH * T * HS
    parts = [_load(p, n).reshape(B, NH, T, HS).transpose(0, 2, 1, 3) for p in (dq, dk, dv)]
    _store(dinp, np.stack(parts, axis=2))                                 # (B,T,3,NH,HS)


def k_unpermute(grid, block, out, inp, B, T, NH, HS):
    _store(out, _load(inp, B * NH * T * HS).reshape(B, NH, T, HS).transpose(0, 2, 1, 3))


def k_unpermute_backward(grid, block, dinp, dout, B, T, NH, HS):
    _store(dinp, _load(dout, B * T * NH * HS).reshape(B, T, NH, HS).transpose(0, 2, 1, 3))


def k_softmax_forward(grid, block, att, preatt, scale, BNH, T):
    _warp_block(block)
    x = scale * _load(preatt, BNH * T * T).reshape(BNH, T, T)
    x[:, np.triu(np.ones((T, T), bool), 1)] = -np.inf
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    _store(att, e / e.sum(axis=-1, keepdims=True))


def k_softmax_backward(grid, block, dpreatt, datt, att, scale, BNH, T):
    _warp_block(block)
    d = _load(datt, BNH * T * T).reshape(BNH, T, T)
    a = _load(att, BNH * T * T).reshape(BNH, T, T)
    _store(dpreatt, scale * a * (d - (d * a).sum(axis=-1, keepdims=True)))   # a is 0 above the diagonal


def k_fused_classifier(grid, block, logits, losses, targets, dloss, N, V, Vp, write_dlogits):
    _warp_block(block)
    z = _load(logits, N * Vp).reshape(N, Vp)
    t = targets.reshape(-1)[:N]
    real = z[:, :V].astype(np.float64)
    lse = np.log(np.exp(real - real.max(axis=1, keepdims=True)).sum(axis=1)) + real.max(axis=1)
    losses.reshape(-1)[:N] = lse - real[np.arange(N), t]
    if write_dlogits:
        d = np.zeros((N, Vp))
        d[:, :V] = np.exp(real - lse[:, None])
        d[np.arange(N), t] -= 1.0
        _store(logits, d * dloss)


def adamw_emulated_step(params, master_params, grads, m, v, n, learning_rate, beta1, beta2,
                        beta1_correction, beta2_correction, eps, weight_decay, grad_scale):
    """kernels/adamw.cu's arithmetic: updates m, v (and master) in place, returns the new fp32
    parameters for the caller to round into params."""
    g = grad_scale * _load(grads, n)
    m[:n] = beta1 * m[:n] + (1 - beta1) * g
    v[:n] = beta2 * v[:n] + (1 - beta2) * g * g
    p = _load(params, n) if _null(master_params) else master_params[:n].copy()
    p -= learning_rate * ((m[:n] / beta1_correction) / (np.sqrt(v[:n] / beta2_correction) + eps) + weight_decay * p)
    if not _null(master_params):
        master_params[:n] = p
    return p


def k_adamw_update(grid, block, params, master_params, grads, m, v, n, learning_rate, beta1, beta2,
                   beta1_correction, beta2_correction, eps, weight_decay, grad_scale, seed):
    _store(params, adamw_emulated_step(params, master_params, grads, m, v, int(n), learning_rate, beta1, beta2,
                                       beta1_correction, beta2_correction, eps, weight_decay, grad_scale))


def k_global_norm_squared(grid, block, partial, data, n, num_slots_offset):
    (G,) = grid
    x = _load(data, int(n)).astype(np.float64)
    partial[num_slots_offset:num_slots_offset + G] = 0.0
    partial[num_slots_offset] = (x * x).sum()


def k_global_norm_finalize(grid, block, out, partial, num_partials):
    out[0] = np.sqrt(partial[:num_partials].astype(np.float64).sum())


def k_cast_float_to_floatX(grid, block, out, inp, n):
    _store(out, inp[:int(n)])


def k_cast_floatX_to_float(grid, block, out, inp, n):
    out[:int(n)] = _load(inp, int(n))


# flash attention (kernels/flash_attention.cu), block by block as the kernels compute it: the same
# tiles (a block owns `owned` rows, streams blocks of `streamed` rows), the online softmax over key
# blocks up to the diagonal, lse, D, and the two-kernel backward; P and dS rounded to floatX before
# their products, as the kernels do. All (b, h) at once along the first axis.

def _flash_tiles(grid, block, precision, B, T, NH, HS):
    """The kernel's FlashTiles<HS>, restated from its header (not from gpt2_cuda), and checked
    against the launch: blockDim = owned/16 warps, grid = (B*NH, ceil(T/owned))."""
    owned = min(64, 8192 // (HS * llmc.cuda.FLOATX_DTYPES[precision].itemsize))
    assert block == owned // 16 * 32, f"blockDim {block} does not match FlashTiles<{HS}> ({owned} rows)"
    assert grid == (B * NH, math.ceil(T / owned)), grid
    return owned, min(32, owned)


def _heads(x, B, T, NH, HS):
    """(B,T,NH*HS) -> (B*NH,T,HS)."""
    return x.reshape(B, T, NH, HS).transpose(0, 2, 1, 3).reshape(B * NH, T, HS)


def _flash_qkv(qkv, B, T, NH, HS):
    x = _load(qkv, B * T * 3 * NH * HS).reshape(B, T, 3, NH * HS)
    return [_heads(x[:, :, i], B, T, NH, HS) for i in range(3)]            # q, k, v each (B*NH,T,HS)


def _round_floatX(x, precision):
    return _to_f32(_from_f32(x, precision))


def _flash_forward(grid, block, out, lse, qkv, B, T, NH, HS):
    precision = _prec(qkv)
    owned, streamed = _flash_tiles(grid, block, precision, B, T, NH, HS)
    q, k, v = _flash_qkv(qkv, B, T, NH, HS)
    scale = np.float32(1.0 / math.sqrt(HS))
    o, lse_bh = np.zeros((B * NH, T, HS), np.float32), np.zeros((B * NH, T), np.float32)
    for q0 in range(0, T, owned):                                         # one thread block each
        t = np.arange(q0, min(q0 + owned, T))
        m = np.full((B * NH, t.size), -np.inf, np.float32)
        l = np.zeros((B * NH, t.size), np.float32)
        acc = np.zeros((B * NH, t.size, HS), np.float32)
        for k0 in range(0, t[-1] + 1, streamed):                          # key blocks up to the diagonal
            j = np.arange(k0, min(k0 + streamed, T))
            s = scale * (q[:, t] @ k[:, j].transpose(0, 2, 1))             # (BNH,rows,HS) @ (BNH,HS,cols)
            s[:, j[None, :] > t[:, None]] = -np.inf                        # causal mask
            m_new = np.maximum(m, s.max(axis=-1))                          # finite: key 0 is in block 0
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[..., None])
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + _round_floatX(p, precision) @ v[:, j]
            m = m_new
        o[:, t] = acc / l[..., None]
        lse_bh[:, t] = m + np.log(l)
    _store(out, o.reshape(B, NH, T, HS).transpose(0, 2, 1, 3))
    lse.reshape(-1)[:B * NH * T] = lse_bh.ravel()


def k_flash_attention_backward_preprocess(grid, block, D, dout, out, B, T, NH, HS):
    prod = _load(dout, B * T * NH * HS) * _load(out, B * T * NH * HS)
    D.reshape(-1)[:B * NH * T] = prod.reshape(B, T, NH, HS).sum(axis=-1).transpose(0, 2, 1).ravel()


def _flash_probabilities(q, k, lse, t, j, scale):
    """p[bh, t, j] = exp(scale q_t . k_j - lse_t) where j <= t < T, else 0."""
    s = scale * (q[:, t] @ k[:, j].transpose(0, 2, 1))
    p = np.exp(s - lse[:, t, None])
    p[:, j[None, :] > t[:, None]] = 0.0
    return p


def _flash_backward_inputs(dout, qkv, lse, D, B, T, NH, HS):
    q, k, v = _flash_qkv(qkv, B, T, NH, HS)
    do = _heads(_load(dout, B * T * NH * HS), B, T, NH, HS)
    return q, k, v, do, lse.reshape(-1)[:B * NH * T].reshape(B * NH, T), D.reshape(-1)[:B * NH * T].reshape(B * NH, T)


def _flash_store_rows(dqkv, part, rows, values, B, T, NH, HS):
    """dqkv (B,T,3,NH,HS)[:, rows, part] = values (B*NH,len(rows),HS): only those elements are written."""
    dst = dqkv.reshape(-1)[:B * T * 3 * NH * HS].reshape(B, T, 3, NH, HS)
    dst[:, rows, part] = _from_f32(values.reshape(B, NH, rows.size, HS).transpose(0, 2, 1, 3), _prec(dqkv))


def _flash_backward_dkdv(grid, block, dqkv, dout, qkv, lse, D, B, T, NH, HS):
    precision = _prec(dqkv)
    owned, streamed = _flash_tiles(grid, block, precision, B, T, NH, HS)
    q, k, v, do, lse_bh, D_bh = _flash_backward_inputs(dout, qkv, lse, D, B, T, NH, HS)
    scale = np.float32(1.0 / math.sqrt(HS))
    for k0 in range(0, T, owned):                                         # one thread block per key block
        j = np.arange(k0, min(k0 + owned, T))
        dk = np.zeros((B * NH, j.size, HS), np.float32)
        dv = np.zeros((B * NH, j.size, HS), np.float32)
        for t0 in range(k0 // streamed * streamed, T, streamed):          # query blocks from the diagonal on
            t = np.arange(t0, min(t0 + streamed, T))
            pT = _flash_probabilities(q, k, lse_bh, t, j, scale).transpose(0, 2, 1)      # (BNH,keys,queries)
            dv += _round_floatX(pT, precision) @ do[:, t]
            dpT = v[:, j] @ do[:, t].transpose(0, 2, 1)
            dsT = pT * (dpT - D_bh[:, None, t])
            dk += _round_floatX(dsT, precision) @ q[:, t]
        _flash_store_rows(dqkv, 1, j, scale * dk, B, T, NH, HS)
        _flash_store_rows(dqkv, 2, j, dv, B, T, NH, HS)


def _flash_backward_dq(grid, block, dqkv, dout, qkv, lse, D, B, T, NH, HS):
    precision = _prec(dqkv)
    owned, streamed = _flash_tiles(grid, block, precision, B, T, NH, HS)
    q, k, v, do, lse_bh, D_bh = _flash_backward_inputs(dout, qkv, lse, D, B, T, NH, HS)
    scale = np.float32(1.0 / math.sqrt(HS))
    for q0 in range(0, T, owned):                                         # one thread block per query block
        t = np.arange(q0, min(q0 + owned, T))
        dq = np.zeros((B * NH, t.size, HS), np.float32)
        for k0 in range(0, t[-1] + 1, streamed):                          # key blocks up to the diagonal
            j = np.arange(k0, min(k0 + streamed, T))
            p = _flash_probabilities(q, k, lse_bh, t, j, scale)
            dp = do[:, t] @ v[:, j].transpose(0, 2, 1)
            ds = p * (dp - D_bh[:, t, None])
            dq += _round_floatX(ds, precision) @ k[:, j]
        _flash_store_rows(dqkv, 0, t, scale * dq, B, T, NH, HS)


def _flash_entry(emulation, HS):
    """The extern "C" entry point of one head size: emulation with HS fixed, the C parameter names."""
    if emulation is _flash_forward:
        def entry(grid, block, out, lse, qkv, B, T, NH):
            emulation(grid, block, out, lse, qkv, B, T, NH, HS)
    else:
        def entry(grid, block, dqkv, dout, qkv, lse, D, B, T, NH):
            emulation(grid, block, dqkv, dout, qkv, lse, D, B, T, NH, HS)
    return entry


EMULATED_KERNELS = {name[2:]: fn for name, fn in list(globals().items()) if name.startswith("k_")}
EMULATED_KERNELS.update({name: _flash_entry(emulation, HS) for HS, names in llmc.attention.FLASH_ATTENTION_KERNELS.items()
                         for name, emulation in zip(names, (_flash_forward, _flash_backward_dkdv, _flash_backward_dq))})


def emulated_launch(file, precision, name, grid, block, args):
    grid = grid if isinstance(grid, tuple) else (grid,)
    for arg in args:                                  # the C signature's scalar types, as the launchers must pass them
        assert isinstance(arg, (np.ndarray, np.int32, np.uint32, np.uint64, np.float32)), (name, type(arg))
    pointers = [a for a in args if isinstance(a, np.ndarray)]
    assert all(_prec(p) == precision for p in pointers if p.dtype in (np.uint16,)), name
    EMULATED_KERNELS[name](grid, block, *args)


class FakeDeviceArray(np.ndarray):
    """A NumPy array with the CuPy methods gpt2_cuda calls (set, get)."""

    def set(self, arr, stream=None):
        assert arr.shape == self.shape and arr.dtype == self.dtype and self.flags.c_contiguous
        self[...] = arr

    def get(self):
        return np.array(self)


def _fake_cupy():
    def zeros(shape, dtype=np.float32):
        return np.zeros(shape, dtype).view(FakeDeviceArray)

    event = types.SimpleNamespace(synchronize=lambda: None)
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None, record=lambda: event)
    pool = types.SimpleNamespace(total_bytes=lambda: 0)
    runtime = types.SimpleNamespace(memGetInfo=lambda: (6 * 2**30, 8 * 2**30))    # (free, total) bytes
    return types.SimpleNamespace(zeros=zeros, add=np.add, get_default_memory_pool=lambda: pool,
                                 cuda=types.SimpleNamespace(get_current_stream=lambda: stream, runtime=runtime,
                                                            alloc_pinned_memory=bytearray))


@pytest.fixture
def emulated_gpu(monkeypatch):
    """gpt2_cuda with CuPy, the kernels and cuBLAS replaced by the NumPy emulations above."""
    fake = _fake_cupy()
    monkeypatch.setattr(llmc.cuda, "cupy", lambda: fake)
    monkeypatch.setattr(llmc.cuda, "launch", emulated_launch)
    monkeypatch.setattr(llmc.cuda, "gemm", emulated_gemm)
    monkeypatch.setattr(llmc.cuda, "select_device", lambda comm: (0, "Emulated GPU", 90))
    monkeypatch.setattr(llmc.cuda, "cuda_unavailable_reason", lambda: None)
    monkeypatch.setattr(llmc.cuda, "load_modules", lambda files, precision: None)
    return fake


def _write_shards(tmp_path, n_tokens=4000, V=TINY.vocab_size):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "train.bin")
    formats.write_shard(path, rng.integers(0, V, n_tokens))
    return path


def _train_losses(log_path):
    """{step: loss} from a main.log."""
    losses = {}
    with open(log_path) as f:
        for line in f:
            m = re.match(r"s:(\d+) trl:(\S+)", line)
            if m:
                losses[int(m.group(1))] = float(m.group(2))
    return losses
