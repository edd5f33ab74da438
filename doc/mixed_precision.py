"""
doc/mixed_precision.py: the experiments behind doc/mixed_precision.md: bf16 emulated in NumPy,
bit for bit as the CUDA kernels round, and what rounding does to many small weight updates.

What it is: a NumPy model of the two float -> bf16 roundings the kernels use,
  - round to nearest even: every `(floatX)value` store and kernels/cast.cu
    (__float2bfloat16_rn), and
  - stochastic rounding: kernels/common.cuh `stochastic_rounding`, which kernels/adamw.cu
    applies to each updated parameter, with its random bits derived the same way (SquirrelNoise5
    of the element index and a per-step seed from an xorshift64* generator),
each checked against an independent reference, then used in the stall experiment.
compute(fig_dir) returns every number doc/mixed_precision.md quotes, formatted as the text writes
it (tests/test_docs.py checks that), and draws its figures. What it is not: a bf16 training run,
or a model of the GPU's bf16 matmuls (tensor cores accumulate in fp32; that is not emulated here).

Needs PyTorch (requirements-dev.txt) for the reference check of round-to-nearest.
Run it from the repository root (a few seconds on 2 CPU cores):
    python doc/mixed_precision.py
prints one `key = value` line per quoted number, e.g.
    rne_mismatches = 0
and redraws doc/mixed_precision_format.png and doc/mixed_precision_stall.png.
"""

import math
import os
import sys

import numpy as np

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # doc/: tutorial.py, which puts the root on sys.path
from tutorial import print_numbers, pyplot, save_figure  # noqa: E402

# ----------------------------------------------------------------------------
# bf16: the top 16 bits of a float32 (1 sign, 8 exponent, 7 mantissa bits)

BF16_SHIFT = 16                        # bf16 bits = float32 bits >> 16
BF16_LOW_MASK = np.uint32(0xFFFF)      # the 16 bits a conversion discards
BF16_HALF_ULP_MINUS_1 = np.uint32(0x7FFF)
BF16_CANONICAL_NAN = np.uint16(0x7FFF)  # what CUDA's float -> bf16 conversions write for a NaN
FLOAT32_ABS_MASK = np.uint32(0x7FFFFFFF)
FLOAT32_INF_BITS = np.uint32(0x7F800000)


def float32_bits(x):
    """float32 values (...) -> their IEEE-754 bit patterns, uint32 (...); a scalar becomes (1,)."""
    return np.array(x, dtype=np.float32, ndmin=1).view(np.uint32)


def bf16_to_float32(bits):
    """bf16 bit patterns, uint16 (...) -> float32 (...). Exact: every bf16 is a float32."""
    return (np.array(bits, dtype=np.uint16, ndmin=1).astype(np.uint32) << BF16_SHIFT).view(np.float32)


def is_nan_bits(bits):
    """uint32 float32 patterns (...) -> bool (...): exponent all ones and a nonzero mantissa."""
    return (bits & FLOAT32_ABS_MASK) > FLOAT32_INF_BITS


def bf16_round_nearest(x):
    """float32 (...) -> bf16 bits uint16 (...), rounded to nearest, ties to even: what a kernel's
    `(floatX)value` store does (__float2bfloat16_rn). Adding 0x7FFF plus the last kept bit to the
    float's bits carries into bit 16 exactly when the discarded part is more than half an ulp, or
    exactly half and the kept part is odd; a carry out of the mantissa is the correct next
    exponent (and the largest finite values round up to inf, as IEEE-754 says)."""
    bits = float32_bits(x)                                            # (...) uint32
    last_kept = (bits >> BF16_SHIFT) & np.uint32(1)                   # 1 if the bf16 mantissa is odd
    out = ((bits + BF16_HALF_ULP_MINUS_1 + last_kept) >> BF16_SHIFT).astype(np.uint16)
    out[is_nan_bits(bits)] = BF16_CANONICAL_NAN                       # any NaN -> one NaN
    return out


# ----------------------------------------------------------------------------
# stochastic rounding: kernels/common.cuh, bit for bit

SQ5_BIT_NOISE1 = np.uint32(0xD2A80A3F)   # SquirrelNoise5's constants (Eiserloh, GDC 2017)
SQ5_BIT_NOISE2 = np.uint32(0xA884F197)
SQ5_BIT_NOISE3 = np.uint32(0x6C736F4B)
SQ5_BIT_NOISE4 = np.uint32(0xB79F3ABB)
SQ5_BIT_NOISE5 = np.uint32(0x1B56C4F5)


def squirrel_noise5(position, seed):
    """The kernels' stateless hash, uint32 (...) x uint32 (...) -> uint32 (...). NumPy's uint32
    arithmetic wraps modulo 2^32 like CUDA's unsigned int (arrays only: NumPy warns on scalars)."""
    position, seed = np.broadcast_arrays(np.array(position, dtype=np.uint32, ndmin=1),
                                         np.array(seed, dtype=np.uint32, ndmin=1))
    mangled = position * SQ5_BIT_NOISE1
    mangled += seed
    mangled ^= mangled >> 9
    mangled += SQ5_BIT_NOISE2
    mangled ^= mangled >> 11
    mangled *= SQ5_BIT_NOISE3
    mangled ^= mangled >> 13
    mangled += SQ5_BIT_NOISE4
    mangled ^= mangled >> 15
    mangled *= SQ5_BIT_NOISE5
    mangled ^= mangled >> 17
    return mangled


def bf16_round_stochastic(x, seed):
    """float32 (n,), per-element seeds uint32 (n,) -> bf16 bits uint16 (n,): common.cuh's
    stochastic_rounding. A uniform 16-bit random number is added to the float's bits, which carries
    into the kept part with probability (discarded bits) / 2^16, then the low 16 bits are cut off
    (the high half taken as it is, so +-inf stays inf and a carry out of the largest finite value
    gives inf). A NaN input rounds to nearest: the canonical NaN."""
    random = squirrel_noise5(0, seed) & BF16_LOW_MASK                  # (n,) in [0, 2^16)
    bits = float32_bits(x) + random                                   # (n,) uint32
    out = (bits >> BF16_SHIFT).astype(np.uint16)
    out[is_nan_bits(float32_bits(x))] = BF16_CANONICAL_NAN
    return out


def adamw_store_bf16(new_param, step_seed):
    """What kernels/adamw.cu stores for one tensor: new_param float32 (n,) -> bf16 bits (n,),
    element i rounded with seed squirrel_noise5(i, step_seed), i counted from the tensor's start."""
    index = np.arange(new_param.size, dtype=np.uint32)                # (n,)
    return bf16_round_stochastic(new_param, squirrel_noise5(index, step_seed))


class XorShift64Star:
    """The generator gpt2_cuda.py draws the per-tensor, per-step seeds from (llm.c's random_u32,
    Marsaglia's xorshift with Vigna's multiplier), started at llm.c's rng_state 13371337."""
    MASK64 = (1 << 64) - 1

    def __init__(self, state=13371337):
        self.state = state

    def random_u32(self):
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & self.MASK64
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & self.MASK64) >> 32


# ----------------------------------------------------------------------------
# checks of the emulation against independent references

CHECK_SEED = 2024
NUM_RANDOM_FLOATS = 1_000_000
LOW_HALVES = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF)   # exact, ties, either side of a tie


def rne_test_inputs():
    """float32 (N,): every one of the 65,536 bf16 patterns (zeros, subnormals, the largest finite,
    inf, NaN, both signs) with each low half of LOW_HALVES, plus random bit patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << BF16_SHIFT                       # (65536,)
    edges = (high[:, None] | np.array(LOW_HALVES, dtype=np.uint32)[None, :]).ravel()
    rng = np.random.default_rng(CHECK_SEED)
    random = rng.integers(0, 1 << 32, size=NUM_RANDOM_FLOATS, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([edges, random]).view(np.float32)


def check_round_nearest():
    """Compare bf16_round_nearest with PyTorch's float32 -> bfloat16 conversion (c10::BFloat16,
    also round to nearest even). Bits must agree except for NaNs, where PyTorch writes 0x7FC0 and
    CUDA 0x7FFF, so a NaN only has to stay a NaN. Returns (number of inputs, mismatches)."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("doc/mixed_precision.py checks its bf16 rounding against PyTorch: "
                          "pip install -r requirements-dev.txt") from e
    x = rne_test_inputs()                                                           # (N,)
    ours = bf16_round_nearest(x)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan_in = np.isnan(x)
    nan_ours = np.isnan(bf16_to_float32(ours))
    nan_theirs = np.isnan(bf16_to_float32(theirs))
    mismatches = int(np.sum(~nan_in & (ours != theirs)) + np.sum(nan_in & ~(nan_ours & nan_theirs)))
    return x.size, mismatches


def squirrel_noise5_reference(position, seed):
    """The same hash on Python integers with explicit 32-bit masks: one value."""
    mask = 0xFFFFFFFF
    x = (position * int(SQ5_BIT_NOISE1)) & mask
    x = (x + seed) & mask
    x ^= x >> 9
    x = (x + int(SQ5_BIT_NOISE2)) & mask
    x ^= x >> 11
    x = (x * int(SQ5_BIT_NOISE3)) & mask
    x ^= x >> 13
    x = (x + int(SQ5_BIT_NOISE4)) & mask
    x ^= x >> 15
    x = (x * int(SQ5_BIT_NOISE5)) & mask
    x ^= x >> 17
    return x


def check_stochastic(num_hash=20_000, num_floats=64):
    """(1) The NumPy hash against the Python-integer one on num_hash random (position, seed) pairs.
    (2) The add-and-truncate trick, exhaustively: for each of num_floats random floats, all 2^16
    random numbers must round it up exactly (discarded low 16 bits) times, and down otherwise.
    Returns (hash pairs, hash mismatches, floats, up-count mismatches)."""
    rng = np.random.default_rng(CHECK_SEED + 1)
    positions = rng.integers(0, 1 << 32, size=num_hash, dtype=np.uint64).astype(np.uint32)
    seeds = rng.integers(0, 1 << 32, size=num_hash, dtype=np.uint64).astype(np.uint32)
    ours = squirrel_noise5(positions, seeds)
    hash_mismatches = sum(int(o) != squirrel_noise5_reference(int(p), int(s))
                          for o, p, s in zip(ours, positions, seeds))

    x = rng.uniform(-4, 4, size=num_floats).astype(np.float32)                     # (F,)
    bits = float32_bits(x)
    every_random = np.arange(1 << 16, dtype=np.uint32)                              # (65536,)
    rounded = ((bits[:, None] + every_random[None, :]) >> BF16_SHIFT)               # (F, 65536)
    up = np.sum(rounded != (bits >> BF16_SHIFT)[:, None], axis=1)                   # (F,)
    count_mismatches = int(np.sum(up != (bits & BF16_LOW_MASK)))
    return num_hash, hash_mismatches, num_floats, count_mismatches


# ----------------------------------------------------------------------------
# what rounds away: the bf16 grid

def format_numbers():
    one = np.float32(1.0)
    nearest = lambda v: float(bf16_to_float32(bf16_round_nearest(np.float32(v)))[0])  # noqa: E731
    above = float(bf16_to_float32(bf16_round_nearest(one)[0] + np.uint16(1))[0]) - 1.0  # next bf16 after 1
    below = 1.0 - float(bf16_to_float32(bf16_round_nearest(one)[0] - np.uint16(1))[0])
    largest = float(bf16_to_float32(np.uint16(0x7F7F))[0])                             # exponent 254, mantissa all ones
    return {
        "spacing_above_1": f"{above}",
        "spacing_below_1": f"{below}",
        "round_1e3": f"{nearest(1.0 + 1e-3)}",
        "round_4e3": f"{nearest(1.0 + 4e-3)}",
        "round_tie": f"{nearest(1.0 + 2.0 ** -8)}",
        "round_tie_odd": f"{nearest(1.0 + 2.0 ** -7 + 2.0 ** -8)}",
        "round_01": f"{nearest(0.1)}",
        "round_pi": f"{nearest(np.pi)}",
        "bf16_max": f"{largest:.4e}",
        "fp32_max": f"{float(np.finfo(np.float32).max):.4e}",
        "fp16_max": f"{float(np.finfo(np.float16).max):g}",
        "fp32_spacing_1": f"{float(np.spacing(np.float32(1.0))):.3e}",
        "fp32_half_spacing_1": f"{float(np.spacing(np.float32(1.0))) / 2:.2e}",
    }


def lost_update_threshold(update):
    """The smallest positive finite bf16 w for which w + update (float32 add, then round to nearest)
    gives w back, found by trying every positive bf16; also checks every larger w loses it too."""
    all_bits = np.arange(1, 0x7F80, dtype=np.uint16)                    # positive finite bf16, ascending
    w = bf16_to_float32(all_bits)                                        # (32639,)
    lost = bf16_round_nearest(w + np.float32(update)) == all_bits
    first = int(np.argmax(lost))
    assert lost[first:].all(), "not a clean threshold"
    return float(w[first])


def draw_format(fig_dir):
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1.2, 1]})
    # left: the bf16 numbers around 1.0, and where 1 + 1e-3 lands
    lo, hi = 0.975, 1.035
    grid = bf16_to_float32(np.arange(0x3F79, 0x3F85, dtype=np.uint16))
    grid = grid[(grid >= lo) & (grid <= hi)]
    left.vlines(grid, 0, 0.8, color="C0", lw=1.5, label="bf16 numbers")
    left.vlines([1.0 + 2.0 ** -8], 0, 0.55, color="C0", lw=1, ls=":", label="midpoint 1 + 2^-8 (a tie: goes to 1.0)")
    left.plot([1.001], [0.45], "v", color="C3", ms=9, label="1 + 1e-3: rounds to 1.0")
    left.plot([1.004], [0.45], "v", color="C2", ms=9, label="1 + 4e-3: rounds to 1 + 2^-7")
    left.set_xlim(lo, hi)
    left.set_ylim(0, 1.25)
    left.set_yticks([])
    left.set_xlabel("value")
    left.set_title("bf16 near 1.0: 2^-8 apart below, 2^-7 above")
    left.legend(fontsize=7.5, loc="upper left", ncol=2)
    # right: the spacing (one ulp) of each format against the value, over its normal range
    for name, mant, emin, emax in (("fp32: 23 mantissa bits", 23, -126, 127), ("bf16: 7 mantissa bits", 7, -126, 127),
                                   ("fp16: 10 mantissa bits", 10, -14, 15)):
        exps = np.arange(emin, emax + 2).astype(np.float64)
        right.step(2.0 ** exps, 2.0 ** (exps - mant), where="post", label=name)
    right.set_xscale("log", base=2)
    right.set_yscale("log", base=2)
    right.set_xticks(2.0 ** np.arange(-120, 129, 40))
    right.set_yticks(2.0 ** np.arange(-140, 129, 40))
    right.set_xlabel("value (normal numbers: from the smallest to the largest)")
    right.set_ylabel("spacing of neighbours (1 ulp)")
    right.set_title("range and precision of three formats")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    save_figure(fig, fig_dir, "mixed_precision_format.png", dpi=110)


# ----------------------------------------------------------------------------
# the stall experiment: 10,000 updates of +1e-4 onto weights of 1.0

NUM_STEPS = 10_000
UPDATE = np.float32(1e-4)
START = np.float32(1.0)
NUM_WEIGHTS = 1000        # one tensor of this many weights, all starting at 1.0: element i gets
                          # its own rounding bits, squirrel_noise5(i, step seed), as on the GPU


def stall_experiment(fig_dir):
    """Each step adds UPDATE to every weight, in float32 arithmetic, and stores the result as
      fp32:                 float32, exact storage
      bf16, round to nearest: the stored bf16, no master copy, rounded to nearest even
      bf16, stochastic:      the stored bf16, no master copy, stochastically rounded (-w 0)
      bf16 copy of fp32 master: fp32 master updated, bf16 copy stochastically rounded (-w 1)
    and records every step."""
    fp32 = np.full(1, START, dtype=np.float32)
    nearest = bf16_round_nearest(np.full(1, START))
    stochastic = bf16_round_nearest(np.full(NUM_WEIGHTS, START))      # 1.0 is a bf16 number: exact
    master = np.full(NUM_WEIGHTS, START, dtype=np.float32)
    copy = stochastic.copy()
    rng_stochastic, rng_master = XorShift64Star(), XorShift64Star()     # each run its own seed stream
    history = {k: np.empty(NUM_STEPS + 1) for k in ("fp32", "nearest", "sr0", "sr_mean", "sr_lo", "sr_hi", "copy0")}

    def record(step):
        sr = bf16_to_float32(stochastic)
        history["fp32"][step] = fp32[0]
        history["nearest"][step] = bf16_to_float32(nearest)[0]
        history["sr0"][step] = sr[0]
        history["sr_mean"][step] = sr.mean(dtype=np.float64)
        history["sr_lo"][step], history["sr_hi"][step] = np.percentile(sr, [5, 95])
        history["copy0"][step] = bf16_to_float32(copy)[0]

    record(0)
    for step in range(1, NUM_STEPS + 1):
        fp32 += UPDATE
        nearest = bf16_round_nearest(bf16_to_float32(nearest) + UPDATE)
        stochastic = adamw_store_bf16(bf16_to_float32(stochastic) + UPDATE, rng_stochastic.random_u32())
        master += UPDATE
        copy = adamw_store_bf16(master, rng_master.random_u32())
        record(step)

    exact = float(START) + NUM_STEPS * float(UPDATE)
    final_sr = bf16_to_float32(stochastic).astype(np.float64)           # (NUM_WEIGHTS,)
    draw_stall(fig_dir, history, final_sr, exact)
    copy_gap = np.abs(bf16_to_float32(copy).astype(np.float64) - master.astype(np.float64)).max()
    return {
        "stall_exact": f"{exact:.4f}",
        "stall_fp32": f"{history['fp32'][-1]:.6f}",
        "stall_nearest": f"{history['nearest'][-1]:.6f}",
        "stall_sr0": f"{history['sr0'][-1]:.6f}",
        "stall_sr_mean": f"{final_sr.mean():.4f}",
        "stall_sr_std": f"{final_sr.std():.3f}",
        "stall_sr_sem": f"{final_sr.std() / np.sqrt(NUM_WEIGHTS):.4f}",
        "stall_master": f"{float(master[0]):.6f}",
        "stall_copy0": f"{history['copy0'][-1]:.6f}",
        "stall_copy_gap": f"{copy_gap:.6f}",
        "ulp_at_2": f"{float(bf16_to_float32(bf16_round_nearest(np.float32(2.0)) + np.uint16(1))[0]) - 2.0}",
        "fp32_ulps_per_update": f"{float(UPDATE) / float(np.spacing(np.float32(1.0))):.2f}",
        "stall_fp32_excess": f"{history['fp32'][-1] - exact:.2e}",
        "sr_steps_per_ulp": f"{(2.0 ** -7) / float(UPDATE):.0f}",              # bf16 spacing just above 1.0
    }


def draw_stall(fig_dir, h, final_sr, exact):
    plt = pyplot()

    steps = np.arange(NUM_STEPS + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    left.plot(steps, 1.0 + steps * float(UPDATE), color="k", lw=1, ls=":", label="exact: 1 + step x 1e-4")
    left.plot(steps, h["fp32"], color="C0", lw=2.5, alpha=0.5, label="fp32 (also the fp32 master weight)")
    left.plot(steps, h["nearest"], color="C3", lw=2, label="bf16, round to nearest (stalls at 1.0)")
    left.fill_between(steps, h["sr_lo"], h["sr_hi"], color="C2", alpha=0.2,
                      label=f"bf16, stochastic: 5-95% of {NUM_WEIGHTS} weights")
    left.plot(steps, h["sr0"], color="C2", lw=0.8, label="bf16, stochastic: weight 0")
    left.plot(steps, h["sr_mean"], color="C2", lw=1.5, ls="--", label=f"bf16, stochastic: mean of {NUM_WEIGHTS}")
    left.plot(steps, h["copy0"], color="C1", lw=0.8, label="bf16 copy of an fp32 master weight")
    left.set_xlabel("step")
    left.set_ylabel("weight")
    left.set_title("10,000 updates of +1e-4 onto a weight of 1.0")
    left.grid(alpha=0.3)
    left.legend(fontsize=7.5, loc="upper left")
    # bf16 numbers are 2^-7 apart below 2 and 2^-6 above: bins 2^-6 wide, centred on 2 + k 2^-6,
    # hold two bf16 values below 2 and one above, so every bin covers the same width
    wide = 2.0 ** -6
    edges = exact - wide / 2 + wide * np.arange(np.floor((final_sr.min() - exact) / wide) - 1,
                                                np.ceil((final_sr.max() - exact) / wide) + 2)
    right.hist(final_sr, bins=edges, color="C2", alpha=0.7)
    right.axvline(exact, color="k", ls=":", label=f"exact {exact:g}")
    right.axvline(final_sr.mean(), color="C2", ls="--", label=f"mean {final_sr.mean():.4f}")
    right.set_xlabel("final weight (bf16, stochastic rounding)")
    right.set_ylabel(f"count of {NUM_WEIGHTS} weights (bins 2^-6 wide)")
    right.set_title("where the stochastic runs end")
    right.legend(fontsize=8)
    save_figure(fig, fig_dir, "mixed_precision_stall.png", dpi=110)


# ----------------------------------------------------------------------------
# the tutorial's numbers

ADAM_LR = 6e-4            # GPT-2 small's peak learning rate in llm.c; Adam moves a weight by about lr
INIT_STD = 0.02           # GPT-2's initial weight standard deviation (Radford et al. 2019)
ADAM_MIN_LR = 6e-5        # the same at the end of a cosine schedule with final_lr_frac 0.1

# bytes kept per parameter during training: (parameter, gradient, AdamW m, AdamW v, master copy),
# the buffers of gpt2_cuda.GPT2 in each mode
TRAINING_BYTES = {"fp32": (4, 4, 4, 4, 0), "bf16_master": (2, 2, 4, 4, 4), "bf16_nomaster": (2, 2, 4, 4, 0)}


def compute(fig_dir):
    """Run every check and experiment of doc/mixed_precision.md, draw its figures, return {key: text}."""
    numbers = format_numbers()
    num_inputs, mismatches = check_round_nearest()
    numbers |= {"rne_inputs": f"{num_inputs:,}", "rne_mismatches": f"{mismatches}"}
    hash_pairs, hash_mismatches, floats, count_mismatches = check_stochastic()
    numbers |= {"sq5_pairs": f"{hash_pairs:,}", "sq5_mismatches": f"{hash_mismatches}",
                "sr_floats": f"{floats}", "sr_count_mismatches": f"{count_mismatches}"}
    numbers |= {"lost_lr": f"{ADAM_LR:g}", "lost_threshold_lr": f"{lost_update_threshold(ADAM_LR):g}",
                "lost_min_lr": f"{ADAM_MIN_LR:g}", "lost_threshold_min_lr": f"{lost_update_threshold(ADAM_MIN_LR):g}"}
    # share of weights drawn from GPT-2's init N(0, INIT_STD^2) at or above that threshold in magnitude
    share = math.erfc(lost_update_threshold(ADAM_MIN_LR) / (INIT_STD * math.sqrt(2.0)))
    numbers |= {"init_std": f"{INIT_STD:g}", "lost_share_init": f"{100 * share:.0f}%"}
    numbers |= {f"bytes_{mode}": f"{sum(b)}" for mode, b in TRAINING_BYTES.items()}
    numbers |= stall_experiment(fig_dir)
    draw_format(fig_dir)
    return numbers


if __name__ == "__main__":
    print_numbers(compute)
