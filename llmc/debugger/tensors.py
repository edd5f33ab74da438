"""
llmc/debugger/tensors.py: what the page is sent of a tensor: its name in the model's tables, a
(rows, cols) matrix of it, a reduced tile of that matrix, summary statistics and a histogram.

What it is: pure NumPy on the trainer's own arrays, nothing copied unless reduced. A tensor is
named by where its memory lies: a view into model.params, model.grads or the activation buffer is
`model.P["qkvw"][0]`, `model.G["qkvw"][0]`, `model.acts["ln1"][0]` (the tables of gpt2_cpu.py).
Large tensors are sent reduced: a tile of at most MAX_CELLS cells, each the mean (or the largest
magnitude) of a block of elements, with the block's extent, so a 1024x50304 logits matrix costs
what a 128x512 one does; zooming in asks for a smaller region, exact once it fits.

What it is not: a plotting library (the page draws with Plotly), or a copy of any layer.
"""

import base64
import math

import numpy as np

MAX_CELLS = 1 << 16          # cells of one heatmap tile sent to the page (64K float32: 256 KiB)
MAX_ROWS, MAX_COLS = 512, 1024
HIST_BINS = 64
HIST_MAX_ELEMENTS = 1 << 20  # a histogram of more elements than this is of an evenly strided sample
STATS_CHUNK = 1 << 20        # elements per chunk of the statistics


# ----------------------------------------------------------------------------
# names: where an array lives in the model's tables

class TableNames:
    """Names arrays by the model's tables: {"P": model.P, "G": model.G, "acts": model.acts}, each a
    dict name -> view into one flat buffer. name(x) -> 'model.P["qkvw"][0]' or None."""

    def __init__(self, model):
        self.entries = []
        for label, table in (("P", model.P), ("G", model.G), ("acts", model.acts or {})):
            for name, view in table.items():
                start = view.__array_interface__["data"][0]
                self.entries.append((start, start + view.nbytes, label, name, view))

    def locate(self, x):
        """(table, name, layer or None, exact) of array x: exact when x is the whole entry or one
        layer of it; None if x lies in none of the tables."""
        if not isinstance(x, np.ndarray) or x.size == 0:
            return None
        start = x.__array_interface__["data"][0]
        for lo, hi, label, name, view in self.entries:
            if lo <= start < hi and view.dtype == x.dtype:
                if x.shape == view.shape and start == lo:
                    return label, name, None, True
                if view.ndim >= 2 and x.shape == view.shape[1:] and x.flags.c_contiguous:
                    layer_bytes = view.strides[0]
                    if (start - lo) % layer_bytes == 0:
                        return label, name, (start - lo) // layer_bytes, True
                return label, name, None, False
        return None

    def name(self, x):
        """'model.P["qkvw"][0]', 'model.acts["encoded"]', 'a view into model.acts["att"]', or None."""
        where = self.locate(x)
        if where is None:
            return None
        label, name, layer, exact = where
        text = f'model.{label}["{name}"]' + (f"[{layer}]" if layer is not None else "")
        return text if exact else f"a view into {text}"


# ----------------------------------------------------------------------------
# a tensor as a matrix

def as_matrix(x, B, T, b=0, h=0):
    """A 2-D view of tensor x for a heatmap, and the names of its axes:
        (B,T,...)   sequence b: (T, the rest flattened)  rows t
        (B,NH,T,T)  sequence b, head h: (T,T)            rows query t, cols key t
        (B,T)       sequence b: (T,1)
        (n,m)       itself; (n,) one row; more axes: (first axis, the rest)
    b and h must be in range (checked by the caller)."""
    x = np.asarray(x)
    if x.ndim == 4 and x.shape[0] == B and x.shape[2] == x.shape[3] == T:
        return x[b, h], ("query t", "key t")
    if x.ndim >= 3 and x.shape[:2] == (B, T):
        return x[b].reshape(T, -1), ("t", "c")
    if x.ndim == 2 and x.shape == (B, T):
        return x[b].reshape(T, 1), ("t", "")
    if x.ndim == 0:
        return x.reshape(1, 1), ("", "")
    if x.ndim == 1:
        return x.reshape(1, -1), ("", "c")
    return x.reshape(x.shape[0], -1), ("row", "col")


def heads_of(x, B, T):
    """The number of heads a (B,NH,T,T) tensor has (the h of as_matrix), else 1."""
    x = np.asarray(x)
    return x.shape[1] if x.ndim == 4 and x.shape[0] == B and x.shape[2] == x.shape[3] == T else 1


def tile_steps(rows, cols, max_cells=MAX_CELLS, max_rows=MAX_ROWS, max_cols=MAX_COLS):
    """Block sizes (row_step, col_step) so that a rows x cols region reduces to at most max_cells
    cells, at most max_rows x max_cols; (1, 1) when it fits as it is."""
    sr, sc = max(1, math.ceil(rows / max_rows)), max(1, math.ceil(cols / max_cols))
    while math.ceil(rows / sr) * math.ceil(cols / sc) > max_cells:
        if math.ceil(rows / sr) >= math.ceil(cols / sc):
            sr += 1
        else:
            sc += 1
    return sr, sc


def reduce_blocks(m, sr, sc, how):
    """m (R,Cc) reduced over blocks of sr x sc elements (the last block of each axis may be
    smaller): how="mean" their mean, "maxabs" the largest |value|. float32 (R/sr, Cc/sc)."""
    if sr == sc == 1:
        return np.ascontiguousarray(m, dtype=np.float32)
    rows, cols = m.shape
    r_idx, c_idx = np.arange(0, rows, sr), np.arange(0, cols, sc)
    if how == "maxabs":
        out = np.maximum.reduceat(np.abs(m), r_idx, axis=0)
        out = np.maximum.reduceat(out, c_idx, axis=1)
        return out.astype(np.float32)
    out = np.add.reduceat(m, r_idx, axis=0, dtype=np.float64)
    out = np.add.reduceat(out, c_idx, axis=1)
    counts = np.outer(np.diff(np.append(r_idx, rows)), np.diff(np.append(c_idx, cols)))
    return (out / counts).astype(np.float32)


def encode(a):
    """float32 array -> base64 of its little-endian bytes (the page reads it as a Float32Array)."""
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def tile(m, r0, r1, c0, c1, how="mean", max_cells=MAX_CELLS):
    """The region rows r0..r1-1, cols c0..c1-1 of matrix m (clipped to it), reduced to at most
    max_cells cells: {r0, r1, c0, c1, step: [sr, sc], shape, reduce ("exact" when nothing is
    reduced), data (base64 float32)}."""
    rows, cols = m.shape
    r0, r1 = max(0, min(r0, rows - 1)), max(1, min(r1, rows))
    c0, c1 = max(0, min(c0, cols - 1)), max(1, min(c1, cols))
    r1, c1 = max(r1, r0 + 1), max(c1, c0 + 1)
    sr, sc = tile_steps(r1 - r0, c1 - c0, max_cells)
    out = reduce_blocks(m[r0:r1, c0:c1], sr, sc, how)
    return {"r0": r0, "r1": r1, "c0": c0, "c1": c1, "step": [sr, sc], "shape": list(out.shape),
            "reduce": "exact" if sr == sc == 1 else how, "data": encode(out)}


# ----------------------------------------------------------------------------
# statistics and histogram

def summary(x):
    """{n, mean, std, min, max, norm, nonfinite} of array x over its finite elements, a chunk of
    STATS_CHUNK elements at a time: sums in float64 (the squares of a chunk by BLAS's dot in x's
    dtype, each chunk's sum then added in float64: about 1e-6 relative for float32), min and max
    exact. One pass per quantity over x itself, no float64 copy."""
    flat = np.asarray(x).reshape(-1)
    n, s, ss, lo, hi, bad = 0, 0.0, 0.0, math.inf, -math.inf, 0
    for start in range(0, flat.size, STATS_CHUNK):
        part = flat[start:start + STATS_CHUNK]
        part_lo, part_hi = float(part.min()), float(part.max())
        if not (math.isfinite(part_lo) and math.isfinite(part_hi)):      # NaN or inf: the slow path
            finite = np.isfinite(part)
            bad += int(part.size - finite.sum())
            part = part[finite]
            if part.size == 0:
                continue
            part_lo, part_hi = float(part.min()), float(part.max())
        n += part.size
        s += float(np.add.reduce(part, dtype=np.float64))
        ss += float(np.dot(part, part))
        lo, hi = min(lo, part_lo), max(hi, part_hi)
    mean = s / n if n else math.nan
    var = max(ss / n - mean * mean, 0.0) if n else math.nan
    return {"n": int(flat.size), "mean": mean, "std": math.sqrt(var), "min": lo if n else math.nan,
            "max": hi if n else math.nan, "norm": math.sqrt(ss), "nonfinite": bad}


def histogram(x, bins=HIST_BINS):
    """{edges, counts, sampled_every} of array x's finite elements: an evenly strided sample of
    every k-th element when x has more than HIST_MAX_ELEMENTS (k = sampled_every, 1 otherwise)."""
    flat = np.asarray(x).reshape(-1)
    every = max(1, math.ceil(flat.size / HIST_MAX_ELEMENTS))
    sample = flat[::every]
    sample = sample[np.isfinite(sample)]
    if sample.size == 0:
        return {"edges": [], "counts": [], "sampled_every": every}
    lo, hi = float(sample.min()), float(sample.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(sample, bins=bins, range=(lo, hi))
    return {"edges": edges.tolist(), "counts": counts.tolist(), "sampled_every": every}


def finite_or_none(v):
    """A float for JSON: NaN and infinities become None (JSON has no NaN)."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def clean(d):
    """A summary dict with its non-finite floats as None."""
    return {k: finite_or_none(v) if isinstance(v, float) else v for k, v in d.items()}
