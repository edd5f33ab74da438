"""
llmc/outlier.py: skipping the update of an outlier step (llm.c's llmc/outlier_detector.h).

A loss spike or a gradient-norm spike can throw a run off; llm.c keeps running statistics of the
last OUTLIER_WINDOW values of each and, with -sl / -sg, skips the AdamW update of a step whose
z-score (value - mean) / std is above the threshold. The statistics are saved in checkpoints, so
a resumed run skips exactly the steps a straight one would.
"""

import math

import numpy as np

OUTLIER_WINDOW = 128                   # llm.c's OUTLIER_DETECTOR_WINDOW_SIZE


class OutlierDetector:
    """The z-score of each new value against the last OUTLIER_WINDOW values, itself included
    (llm.c's update_detector): NaN until the window is full, 0 when the window has no spread."""

    def __init__(self):
        self.buffer = np.zeros(OUTLIER_WINDOW, dtype=np.float64)
        self.count = 0                 # values seen, up to OUTLIER_WINDOW
        self.index = 0                 # the oldest value's slot, once the window is full
        self.sum = self.sum_sq = 0.0   # running sums over the window

    def update(self, value):
        """Add `value` and return its z-score (a float, NaN while the window fills)."""
        if self.count < OUTLIER_WINDOW:
            self.buffer[self.count] = value
            self.sum += value
            self.sum_sq += value * value
            self.count += 1
            return math.nan
        old = self.buffer[self.index]
        self.sum += value - old
        self.sum_sq += value * value - old * old
        self.buffer[self.index] = value
        self.index = (self.index + 1) % OUTLIER_WINDOW
        mean = self.sum / OUTLIER_WINDOW
        variance = self.sum_sq / OUTLIER_WINDOW - mean * mean
        std = math.sqrt(max(variance, 0.0))
        return 0.0 if std == 0.0 else (value - mean) / std

    def state(self):
        """The detector as OUTLIER_STATE_FLOATS float64 (for the state file)."""
        return np.concatenate([[self.count, self.index, self.sum, self.sum_sq], self.buffer])

    def restore(self, state):
        """Set the detector from state()'s OUTLIER_STATE_FLOATS float64 (a checkpoint's)."""
        state = np.asarray(state, dtype=np.float64)
        self.count, self.index = int(state[0]), int(state[1])
        self.sum, self.sum_sq = float(state[2]), float(state[3])
        self.buffer[...] = state[4:]


OUTLIER_STATE_FLOATS = 4 + OUTLIER_WINDOW


def outlier_state_problem(state):
    """None if `state` (OUTLIER_STATE_FLOATS float64, a state file's) is one OutlierDetector.state()
    can give: count an integer in [0, OUTLIER_WINDOW], index an integer in [0, OUTLIER_WINDOW),
    every value finite (a NaN in the window would make every later z-score NaN, and a step's
    skip silently never happen). Else what is wrong, in a few words."""
    count, index = state[0], state[1]
    if not (np.isfinite(count) and count == int(count) and 0 <= count <= OUTLIER_WINDOW):
        return f"count {count} is not an integer in [0, {OUTLIER_WINDOW}]"
    if not (np.isfinite(index) and index == int(index) and 0 <= index < OUTLIER_WINDOW):
        return f"index {index} is not an integer in [0, {OUTLIER_WINDOW})"
    if not np.isfinite(state).all():
        return "a value is not finite"
    return None


def skip_reason(zloss, zgrad, loss_threshold, grad_threshold):
    """Why the update of this step is skipped (-sl / -sg, 0: off), or None: llm.c's rule, the loss
    checked first. NaN z-scores (window not yet full) never skip."""
    if loss_threshold > 0 and math.isfinite(zloss) and zloss > loss_threshold:
        return f"skipping update due to loss z-score of {zloss:f}"
    if grad_threshold > 0 and math.isfinite(zgrad) and zgrad > grad_threshold:
        return f"skipping update due to grad z-score of {zgrad:f}"
    return None
