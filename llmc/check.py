"""
llmc/check.py: comparing tensors against a reference (tests, tests/check_gpt2.py, gpt2_cuda.py
--check, dev/cuda), the one table of tolerances every such comparison uses, and the file a
--check run saves its comparison in (--check-save, read by the visual debugger).
"""

import io
import json

import numpy as np

from llmc.utils import InputError, atomic_write

# ----------------------------------------------------------------------------
# the tolerances: one table, each entry with how it was chosen
#
# (atol, rtol): a tensor passes when every element has |got - ref| <= atol' + rtol * |ref|, where
# atol' = atol * max|ref| in the SCALED groups (so one entry serves gradients of 1e-6 and
# activations of 10, and a tensor of tiny values cannot pass just by being tiny), and atol' = atol
# in the others (kernel tests, whose inputs are ~N(0,1)).
TOLERANCES = {
    # gpt2_cpu fp32 vs the PyTorch twin (MKL) or a debug state (tests/check_gpt2.py, test_twin.py).
    # Measured at the GPT-2 124M shape (d12), random init, B=4, T=64: max|diff|/max|ref| reached
    # 1.1e-6 for the logits and up to 2.2e-6 for the gradients (wpe; most ~1e-6); the loss agreed
    # to 1.2e-7 relative. About 10x that: room for longer sequences and other BLAS builds, and
    # 50x tighter than one gradient element off by 1e-3 of max|ref| (test_twin.py checks that fails).
    # Llama 3 (llama3_cpu vs dev/torch_reference_llama3.py, tests/test_llama3_twin.py, L=2 C=64
    # V=256, B=4, T=32): 2.3e-7 for the logits, <= 8.4e-7 for the gradients; the same entries hold.
    "reference_fp32": {"logits": (1e-5, 0.0), "loss": (0.0, 1e-5), "grad": (2e-5, 0.0)},
    # gpt2_cpu fp64 vs the fp64 twin, from the same float32 draws: measured ~1e-15 on every tensor
    # (small config); 1e-13 leaves 100x for summation order.
    "reference_fp64": {"logits": (1e-13, 0.0), "loss": (0.0, 1e-13), "grad": (1e-13, 0.0)},
    # ten fp32 AdamW steps, gpt2_cpu vs the twin (tests/test_twin.py): Adam divides by sqrt(v),
    # which amplifies rounding differences in near-zero gradients; the losses agreed to 7e-7
    # relative (2e-6 overfitting one batch at lr 1e-2), the grad norms to ~1e-6.
    # params: the parameters after ten steps at lr 1e-2, absolute (so for that lr): Llama 3's
    # (tests/test_llama3_twin.py) measured 1.2e-5 at most; 5e-5 is 4x that, and 10x below what
    # ten steps of a weight decay left off one matrix do (6e-4; the test checks that it fails).
    "reference_train": {"loss": (0.0, 2e-5), "norm": (0.0, 1e-5), "params": (5e-5, 0.0)},
    # gpt2_cuda vs gpt2_cpu, every activation and gradient of one batch (--check). fp32: cuBLAS
    # and warp reductions sum in another order than NumPy, a few float eps per op compounded over
    # L layers. bf16: every stored tensor is rounded to 8 bits of mantissa (2^-9 relative), so
    # activations carry ~1% and gradients several % of error; TF32 matmuls (10 bits) use bf16's.
    # Measured on an H100 (2026-11-26, dev/results/), the largest error over max|ref| of any tensor
    # of GPT-2 124M (B=4, T=64 and B=1, T=1024, every attention path) and of llama3:d4: fp32
    # activations 1.8e-6 and gradients 1.2e-6 (grad atol 1e-4, was 1e-3); bf16 activations 1.6e-2
    # (ln2) and gradients 1.0e-2 (Llama 3's dlnfw; GPT-2's 8.1e-3), so bf16's grad atol is 5e-2 (was 1e-1).
    "cuda_fp32": {"activation": (1e-4, 1e-3), "statistic": (1e-4, 1e-3), "logits": (1e-4, 1e-3),
                  "loss": (0.0, 1e-5), "grad": (1e-4, 1e-2)},
    "cuda_bf16": {"activation": (3e-2, 5e-2), "statistic": (3e-2, 5e-2), "logits": (5e-2, 5e-2),
                  "loss": (0.0, 1e-2), "grad": (5e-2, 1e-1)},
    # one kernel vs its NumPy layer on inputs ~N(0,1), absolute atol (tests/test_cuda.py part 2).
    # fp32: a few ulp of reordered fp32 sums (rows of <= 4C terms); matmul's dweight sums B*T rows,
    # whose partial sums reach ~sqrt(B*T): on an H100 (2026-11-26, B*T = 4096 and 2048, |dweight| up
    # to ~200) cuBLAS's fp32 dweight differed from float64 by up to 2.6e-4 (1.2e-6 of max|ref|), so
    # its atol is 1e-3. bf16: every output rounded to
    # bf16 (2^-9 = 2e-3 relative) after fp32 arithmetic on bf16 inputs, so 1e-2 relative with an
    # atol for values near 0; sums over many rows (bias, dweight) get more.
    "kernel_fp32": {"encoder_forward": (1e-6, 1e-6), "encoder_backward": (1e-5, 1e-5),
                    "layernorm_forward": (1e-5, 1e-5), "layernorm_backward": (1e-4, 1e-4),
                    "residual_forward": (1e-6, 1e-6), "gelu": (1e-5, 1e-5), "matmul": (1e-3, 1e-4),
                    "attention": (1e-4, 1e-4), "classifier": (1e-5, 1e-5), "adamw": (1e-6, 1e-5),
                    "global_norm": (0.0, 1e-5), "cast": (0.0, 0.0),
                    # Llama 3's (llama3_cuda.py): RMSNorm as LayerNorm; RoPE's fp32 tables differ from
                    # the float64 reference's by ~1e-7 relative; repeat_kv sums NH/NKV terms
                    "rmsnorm_forward": (1e-5, 1e-5), "rmsnorm_backward": (1e-4, 1e-4), "rope": (1e-5, 1e-5),
                    "swiglu": (1e-5, 1e-5), "repeat_kv": (1e-6, 1e-6)},
    "kernel_bf16": {"encoder_forward": (1e-2, 1e-2), "encoder_backward": (5e-2, 1e-2),
                    "layernorm_forward": (2e-2, 1e-2), "layernorm_backward": (1e-1, 2e-2),
                    "residual_forward": (1e-2, 1e-2), "gelu": (1e-2, 1e-2), "matmul": (1e-1, 2e-2),
                    "attention": (5e-2, 2e-2), "classifier": (2e-2, 1e-2), "adamw": (1e-5, 1e-2),
                    "global_norm": (0.0, 1e-3), "cast": (0.0, 0.0),
                    "rmsnorm_forward": (2e-2, 1e-2), "rmsnorm_backward": (1e-1, 2e-2), "rope": (1e-2, 1e-2),
                    "swiglu": (1e-2, 1e-2), "repeat_kv": (1e-2, 1e-2)},
}
SCALED = ("reference_fp32", "reference_fp64", "cuda_fp32", "cuda_bf16")   # atol is a fraction of max|ref|


# ----------------------------------------------------------------------------
# comparing

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


def scaled_tolerance(ref, group, kind):
    """(atol, rtol) of TOLERANCES[group][kind] for the reference array ref, atol scaled by max|ref|
    when the group is SCALED."""
    atol, rtol = TOLERANCES[group][kind]
    if group in SCALED:
        atol *= float(np.abs(np.asarray(ref, dtype=np.float64)).max()) if np.size(ref) else 0.0
    return atol, rtol


def check_against(a, ref, label, group, kind, verbose=True):
    """check_tensor with the tolerance TOLERANCES[group][kind], its atol scaled by max|ref| when
    the group is SCALED. Returns True/False."""
    atol, rtol = scaled_tolerance(ref, group, kind)
    return check_tensor(a, ref, label, atol, rtol, verbose=verbose)


# ----------------------------------------------------------------------------
# a saved comparison (--check-save): every tensor's two sides, and what they were compared under
#
# One .npz (numpy.savez, no pickles): "meta" is a JSON string {"format", "group" (the TOLERANCES
# row), "tensors": [{"label", "kind"}, ...] in comparison order, and whatever the caller adds
# (model shape, B, T, precision, device)}; "got_<i>" and "ref_<i>" are tensor i's values as
# compared: float32 (the GPU's upcast from bf16 where it stored bf16), or float64 where the
# comparison was in float64 (the mean loss).

COMPARISON_FORMAT = "llmc-check-1"


def save_comparison(path, entries, group, **meta):
    """Write entries [(label, kind, got, ref), ...] compared under TOLERANCES[group] to path (an
    .npz, written atomically), with meta's keys in its "meta"."""
    arrays = {"meta": np.array(json.dumps({"format": COMPARISON_FORMAT, "group": group, **meta,
                                           "tensors": [{"label": l, "kind": k} for l, k, _, _ in entries]}))}
    def as_saved(x):
        x = np.asarray(x)
        return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    for i, (_, _, got, ref) in enumerate(entries):
        arrays[f"got_{i}"], arrays[f"ref_{i}"] = as_saved(got), as_saved(ref)
    atomic_write(path, lambda f: np.savez(f, **arrays))


def load_comparison(path):
    """(meta, [(label, kind, got, ref), ...]) of a file save_comparison wrote. Raises InputError
    for a file that is not one."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
            if meta.get("format") != COMPARISON_FORMAT or meta.get("group") not in TOLERANCES:
                raise InputError(f"{path}: not a --check-save file (format {meta.get('format')!r})")
            entries = [(t["label"], t["kind"], npz[f"got_{i}"], npz[f"ref_{i}"])
                       for i, t in enumerate(meta["tensors"])]
    except (OSError, ValueError, KeyError, TypeError, EOFError, io.UnsupportedOperation) as e:
        raise InputError(f"{path}: cannot read a --check-save file ({type(e).__name__}: {e})") from None
    return meta, entries
