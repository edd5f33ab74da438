"""
llmc/debugger/checkrun.py: a saved --check run (gpt2_cuda.py / llama3_cuda.py --check-save FILE)
for the page's "GPU against the reference" view.

What it is: the file llmc.check.save_comparison wrote, every compared tensor's two sides, read
once at start-up; for each tensor the table llmc.check prints (its tolerance atol' + rtol |ref|
from llmc.check.TOLERANCES, the largest error, how many elements are outside), and on request a
tile of one slice's error |gpu - ref| or of its error over the tolerance (<= 1 passes), each block
reduced to its worst element.

What it is not: a rerun of --check (run gpt2_cuda.py --check-save for a new one).
"""

import numpy as np

from llmc.check import SCALED, TOLERANCES, load_comparison, scaled_tolerance
from llmc.debugger import tensors
from llmc.debugger.session import BadRequest, NotFound


class CheckRun:
    """One --check-save file: meta (model shape, B, T, precision, device, group) and its tensors."""

    def __init__(self, path):
        self.path = path
        self.meta, entries = load_comparison(path)
        self.group = self.meta["group"]
        self.entries = {}
        self.rows = []
        for label, kind, got, ref in entries:
            atol, rtol = scaled_tolerance(ref, self.group, kind)
            diff = np.abs(got.astype(np.float64) - ref)
            tol = atol + rtol * np.abs(ref.astype(np.float64))
            bad = ~(diff <= tol)
            ratio = diff / np.where(tol > 0, tol, np.inf)
            max_ref = float(np.abs(ref).max()) if ref.size else 0.0
            self.entries[label] = (got, ref, atol, rtol)
            self.rows.append({"label": label, "kind": kind, "shape": list(got.shape), "atol": atol, "rtol": rtol,
                              "atol_table": TOLERANCES[self.group][kind][0], "scaled": self.group in SCALED,
                              "maxdiff": float(np.nanmax(diff)) if diff.size else 0.0,
                              "rel": float(np.nanmax(diff)) / max(max_ref, 1e-30) if diff.size else 0.0,
                              "max_ratio": float(np.nanmax(ratio)) if ratio.size else 0.0,
                              "bad": int(bad.sum()), "ok": not bad.any(),
                              "layered": self._layered(got.shape)})

    def _layered(self, shape):
        """Whether a tensor has a leading layer axis: (L,B,...) activations and (L,B,T) statistics."""
        L, B, T = self.meta["L"], self.meta["B"], self.meta["T"]
        return len(shape) >= 4 and shape[0] == L and shape[1] == B or tuple(shape) == (L, B, T)

    def table_json(self):
        return {"path": self.path, "meta": {k: v for k, v in self.meta.items() if k != "tensors"},
                "rows": self.rows}

    def tile_json(self, label, b, h, what, r0, r1, c0, c1, layer=0):
        """A tile of tensor `label`'s error (what="error": |gpu - ref|) or error over tolerance
        (what="ratio") for sequence b, head h, layer `layer` (for a tensor with layers), each
        block its worst element; with the slice's largest value."""
        if label not in self.entries:
            raise NotFound(f"{self.path} has no tensor {label!r}")
        got, ref, atol, rtol = self.entries[label]
        B, T = self.meta["B"], self.meta["T"]
        if self._layered(got.shape):
            if not 0 <= layer < got.shape[0]:
                raise BadRequest(f"layer {layer} out of range [0, {got.shape[0]})")
            got, ref = got[layer], ref[layer]
        if got.ndim >= 2 and got.shape[0] == B and not 0 <= b < B:
            raise BadRequest(f"sequence b={b} out of range [0, {B})")
        heads = tensors.heads_of(got, B, T)
        if not 0 <= h < heads:
            raise BadRequest(f"head h={h} out of range [0, {heads})")
        g, axes = tensors.as_matrix(got, B, T, b, h)
        r, _ = tensors.as_matrix(ref, B, T, b, h)
        diff = np.abs(g.astype(np.float64) - r)
        m = diff if what == "error" else diff / (atol + rtol * np.abs(r.astype(np.float64)))
        out = tensors.tile(m, r0, r1, c0, c1, how="maxabs")
        return {**out, "rows": m.shape[0], "cols": m.shape[1], "axes": axes, "heads": heads,
                "slice_max": float(np.nanmax(m)) if m.size else 0.0,
                "atol": atol, "rtol": rtol}
