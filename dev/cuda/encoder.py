"""
dev/cuda/encoder.py: the token + position embedding, forward and backward, from naive ports to
kernels/encoder.cu.

encoder_forward, out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]:
  version 1 (dev/cuda/encoder.cu encoder_forward_v1) is the naive port of
            gpt2_cpu.encoder_forward: one thread per output element, scalar loads.
  version 2 (kernels/encoder.cu encoder_forward, production) gives each thread one x128 group
            (8 bf16 or 4 floats) of a row: 16-byte loads of wte and wpe and a 16-byte store, so
            4-8x fewer memory instructions move the same bytes, and the index arithmetic
            (row, t, token lookup) is done once per group instead of once per element.
encoder_backward, dwte[v] += sum of dout[b,t] over inp[b,t] == v; dwpe[t] += sum_b dout[b,t]:
  version 1 (encoder_backward_v1 + encoder_backward_accumulate_v1) is the naive port of
            np.add.at: one thread per dout element, fp32 atomicAdd into zeroed fp32 copies of
            dwte and dwpe, then a pass adding those copies into the floatX tables. Slow for
            three reasons: zeroing and re-adding the whole (Vp,C) table even though a batch
            touches few rows, atomics contending on repeated tokens and positions, and an order
            of additions that changes run to run (not reproducible).
  version 2 (kernels/encoder.cu encoder_backward_wpe + encoder_backward_wte, one chunk per
            token) needs no atomics: dwpe has one thread per (t, x128 group) summing b in order;
            for dwte the host sorts positions by token (gpt2_cuda.encoder_backward_segments with
            unbounded chunks, not timed here), and one block per distinct token sums its rows in
            order and adds once. Only touched rows are read and written, with x128 accesses, and
            the result is deterministic; but a frequent token (the benchmark makes one 4% of the
            batch, as "the" or "," are) is one block summing hundreds of rows while the others
            sum one or two: a serial tail. It is version 3's kernel on version 2's plan: the
            kernel's chunk is a token here.
  version 3 (kernels/encoder.cu encoder_backward_wpe + encoder_backward_wte +
            encoder_backward_wte_reduce, production) cuts each token's run of positions into
            chunks of at most gpt2_cuda.WTE_CHUNK_ROWS: one block per chunk, so no block sums
            more rows than that; a token's only chunk adds into dwte directly, the chunks of a
            frequent token write fp32 partial rows that one more block per such token adds in
            chunk order. Still no atomics, still deterministic.
            gpt2_cuda.py launches the dwte kernels with block = C / x128::size rounded up to a
            warp; here every kernel takes the swept block size.
Napkin math (minimum traffic): forward reads N=B*T token ids, N*C of wte, T*C of wpe and writes
N*C; backward reads N*C of dout, reads and writes T*C of dwpe and S*C of dwte (S = distinct
tokens in the batch), plus the index arrays (version 3 also writes and reads its fp32 partial rows).

Run (needs a CUDA GPU; without one it says so and exits 2):
    python dev/cuda/encoder.py           # both progressions, every version, bf16
    python dev/cuda/encoder.py 2 -p fp32
writes dev/results/dev_cuda_encoder.md.
"""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from common import Progression, Version, dev_kernel, production_kernel  # noqa: E402

import gpt2_cpu  # noqa: E402  (common put the repository root on sys.path)
import gpt2_cuda  # noqa: E402  (host code only: the segment sort of the production backward)
from llmc.cuda import ceil_div, elementwise_grid, vector_size  # noqa: E402

OP = "encoder"
ENCODER_FORWARD_V1 = dev_kernel(OP, "encoder_forward_v1")
ENCODER_BACKWARD_V1 = dev_kernel(OP, "encoder_backward_v1")
ENCODER_BACKWARD_ACCUMULATE_V1 = dev_kernel(OP, "encoder_backward_accumulate_v1")
ENCODER_FORWARD = production_kernel("encoder", "encoder_forward")
ENCODER_BACKWARD_WPE = production_kernel("encoder", "encoder_backward_wpe")
ENCODER_BACKWARD_WTE = production_kernel("encoder", "encoder_backward_wte")
ENCODER_BACKWARD_WTE_REDUCE = production_kernel("encoder", "encoder_backward_wte_reduce")


# ----------------------------------------------------------------------------
# problems: inputs, references from gpt2_cpu.py

def token_ids(rng, B, T, V, frequent=0.0):
    """(B,T) int32 ids in [0, V), with some repeats forced so that accumulation is exercised, and
    token 1 at a share `frequent` of the positions (a common token: the dwte kernels' load balance)."""
    inp = rng.integers(0, V, (B, T)).astype(np.int32)
    inp[rng.random((B, T)) < frequent] = 1
    inp[0, :3] = inp[-1, -1] = 1
    return inp


def make_forward_case(rng, precision, B, T, C, V, Vp, maxT):
    """inp (B,T), wte (Vp,C), wpe (maxT,C) -> out (B,T,C) = gpt2_cpu.encoder_forward."""
    case = common.Case(precision)
    for name, value in dict(B=B, T=T, C=C).items():
        case.scalar(name, value)
    inp = case.input("inp", token_ids(rng, B, T, V), "i32")
    wte = case.input("wte", rng.standard_normal((Vp, C)))
    wpe = case.input("wpe", rng.standard_normal((maxT, C)))
    case.output("out", (B, T, C))
    case.check("out", gpt2_cpu.encoder_forward(inp, wte, wpe), "encoder_forward")
    case.bytes = common.napkin_bytes(precision, floatX=2 * B * T * C + T * C, int32=B * T)
    return case


def make_backward_case(rng, precision, B, T, C, V, Vp, maxT, frequent):
    """dout (B,T,C), dwte (Vp,C), dwpe (maxT,C) accumulating -> gpt2_cpu.encoder_backward."""
    case = common.Case(precision)
    inp = token_ids(rng, B, T, V, frequent)
    seg = gpt2_cuda.encoder_backward_segments(inp)                     # version 3's chunks
    whole = gpt2_cuda.encoder_backward_segments(inp, chunk_rows=B * T)  # version 2: one chunk per token
    S = whole.chunk_token.size
    for name, value in dict(B=B, T=T, C=C, num_segments=S, num_chunks=seg.chunk_token.size,
                            num_reduce=seg.reduce_token.size, n_wte=Vp * C, n_wpe=maxT * C).items():
        case.scalar(name, value)
    for name, value in dict(inp=inp, token_start=whole.chunk_start, token_id=whole.chunk_token,
                            token_slot=whole.chunk_slot, **seg._asdict()).items():
        case.input(name, value, "i32")
    dout = case.input("dout", rng.standard_normal((B, T, C)))
    dwte = case.input("dwte", rng.standard_normal((Vp, C)))           # float64 copies: the reference
    dwpe = case.input("dwpe", rng.standard_normal((maxT, C)))         # accumulates into them
    case.scratch("dwte_acc", (Vp, C))                                  # version 1's fp32 accumulators
    case.scratch("dwpe_acc", (maxT, C))
    case.scratch("partial", (max(1, int(seg.reduce_start[-1])), C))    # version 3's partial rows
    gpt2_cpu.encoder_backward(dwte, dwpe, dout, inp)
    case.check("dwte", dwte, "encoder_backward")
    case.check("dwpe", dwpe, "encoder_backward")
    case.bytes = common.napkin_bytes(precision, floatX=B * T * C + 2 * T * C + 2 * S * C, int32=B * T + 2 * S + 1)
    return case


# ----------------------------------------------------------------------------
# launchers: grids as gpt2_cuda.py computes them

def forward_v1(d, block_size):
    ENCODER_FORWARD_V1.launch(d.precision, ceil_div(d.B * d.T * d.C, block_size), block_size,
                              (d.out, d.inp, d.wte, d.wpe, np.int32(d.B), np.int32(d.T), np.int32(d.C)))


def forward_v2(d, block_size):
    grid = elementwise_grid(d.B * d.T * d.C // vector_size(d.precision), block_size)   # gpt2_cuda.encoder_forward
    ENCODER_FORWARD.launch(d.precision, grid, block_size,
                           (d.out, d.inp, d.wte, d.wpe, np.int32(d.B), np.int32(d.T), np.int32(d.C)))


def backward_v1(d, block_size):
    d.dwte_acc.fill(0)
    d.dwpe_acc.fill(0)
    ENCODER_BACKWARD_V1.launch(d.precision, ceil_div(d.B * d.T * d.C, block_size), block_size,
                               (d.dwte_acc, d.dwpe_acc, d.dout, d.inp, np.int32(d.B), np.int32(d.T), np.int32(d.C)))
    ENCODER_BACKWARD_ACCUMULATE_V1.launch(d.precision, ceil_div(max(d.n_wte, d.n_wpe), block_size), block_size,
                                          (d.dwte, d.dwpe, d.dwte_acc, d.dwpe_acc, np.int32(d.n_wte), np.int32(d.n_wpe)))


def backward_v2(d, block_size):
    vec = vector_size(d.precision)
    ENCODER_BACKWARD_WPE.launch(d.precision, elementwise_grid(d.T * d.C // vec, block_size), block_size,
                                (d.dwpe, d.dout, np.int32(d.B), np.int32(d.T), np.int32(d.C)))
    ENCODER_BACKWARD_WTE.launch(d.precision, max(1, d.num_segments), block_size,      # one chunk per token:
                                (d.dwte, d.partial, d.dout, d.positions, d.token_start, d.token_id, d.token_slot,
                                 np.int32(d.num_segments), np.int32(d.C)))          # no partial rows (slots -1)


def backward_v3(d, block_size):
    vec = vector_size(d.precision)                                   # gpt2_cuda.encoder_backward
    ENCODER_BACKWARD_WPE.launch(d.precision, elementwise_grid(d.T * d.C // vec, block_size), block_size,
                                (d.dwpe, d.dout, np.int32(d.B), np.int32(d.T), np.int32(d.C)))
    ENCODER_BACKWARD_WTE.launch(d.precision, max(1, d.num_chunks), block_size,
                                (d.dwte, d.partial, d.dout, d.positions, d.chunk_start, d.chunk_token, d.chunk_slot,
                                 np.int32(d.num_chunks), np.int32(d.C)))
    ENCODER_BACKWARD_WTE_REDUCE.launch(d.precision, max(1, d.num_reduce), block_size,
                                       (d.dwte, d.partial, d.reduce_start, d.reduce_token, np.int32(d.num_reduce),
                                        np.int32(d.C)))


SIZES = dict(B=8, T=1024, C=768, V=50257, Vp=50304, maxT=1024)      # GPT-2 124M
TEST_SIZES = dict(B=2, T=37, C=64, V=100, Vp=128, maxT=42)
FREQUENT_TOKEN_SHARE = 0.04          # the most common GPT-2 tokens ("," "the" ".") are a few % of text
PROGRESSIONS = [
    Progression("encoder_forward", make_forward_case, [
        Version(1, "naive port, one thread per output element", (ENCODER_FORWARD_V1,), forward_v1),
        Version(2, "production: one thread per x128 group, grid-stride", (ENCODER_FORWARD,), forward_v2),
    ], SIZES, TEST_SIZES),
    Progression("encoder_backward", make_backward_case, [
        Version(1, "naive port of np.add.at: fp32 atomics, then a pass over the tables",
                (ENCODER_BACKWARD_V1, ENCODER_BACKWARD_ACCUMULATE_V1), backward_v1),
        Version(2, "no atomics, in-order sums per position and per token",
                (ENCODER_BACKWARD_WPE, ENCODER_BACKWARD_WTE), backward_v2),
        Version(3, "production: version 2 with each token cut into bounded chunks, reduced in order",
                (ENCODER_BACKWARD_WPE, ENCODER_BACKWARD_WTE, ENCODER_BACKWARD_WTE_REDUCE), backward_v3),
    ], dict(SIZES, frequent=FREQUENT_TOKEN_SHARE), dict(TEST_SIZES, frequent=0.5)),
]
if __name__ == "__main__":
    sys.exit(common.main(OP, PROGRESSIONS))
