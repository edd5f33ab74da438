"""
llmc/checkpoint.py: checkpoints for resuming a run, in llm.c's files: per step a model file
model_<step>.bin (llmc/formats.py), one training-state file per rank state_<step>_<rank>.bin
(AdamW's moments, optional fp32 master weights, the step, the RNG states, the data loader's
position), this project's config_<step>.json (the flags that decide the result, so that a resume
can refuse a change: llmc/cli.py), and, written last, an empty DONE_<step> marker. Every file is
written under a temporary name and renamed, so a crash never leaves a checkpoint that looks
complete, and a resume only ever reads a step that has its marker.

Both trainers write and read the same files, so either one resumes the other's run.
"""

import glob
import json
import os
import re

import numpy as np

from llmc.formats import make_header, read_exact, read_header, read_model_file, write_model_file
from llmc.outlier import OUTLIER_STATE_FLOATS, outlier_state_problem
from llmc.utils import InputError, atomic_write, check_input_file

STATE_MAGIC = 20240527
STATE_VERSION = 1
# int32 header slots of the state file (doc/file_formats.md)
STATE_SLOT_NUM_PROCESSES = 2
STATE_SLOT_RANK = 3
STATE_SLOT_MASTER_WEIGHTS = 4          # 1 if fp32 master weights follow v
STATE_SLOT_SHUFFLE = 5                 # 1 if the loader's permutation state follows
STATE_SLOT_OUTLIERS = 6                # this project's: 1 if the outlier detectors' state follows (llmc/outlier.py)
STATE_SLOT_ZERO_STAGE = 7              # this project's: 1 if m, v (and master weights) are this rank's ZeRO-1 shard
STATE_SLOT_SHUFFLE_HAS_UINT32 = 8      # this project's: 1 if the shuffle RNG holds a buffered 32-bit half (next field)
STATE_SLOT_STEP = 10
# uint64 fields: header.view("<u8")[k] covers int32 slots 2k and 2k+1
STATE_U64_SAMPLE_RNG = 10              # slots 20-21: the sampler's xorshift state
STATE_U64_RNG_LAST_UPDATE = 11         # slots 22-23: the stochastic-rounding RNG at the last update
STATE_U64_SHUFFLE_UINTEGER = 12        # slots 24-25, this project's: PCG64's buffered 32-bit half (uinteger)
STATE_U64_SHARD = 15                   # slots 30-31: the loader's current shard index
STATE_U64_SAMPLE = 16                  # slots 32-33: the loader's sample index within the shard
UINT64_MASK = (1 << 64) - 1
OUTLIER_DETECTORS_FLOATS = 2 * OUTLIER_STATE_FLOATS   # the loss and the grad-norm detector            # the loader's 128-bit PCG64 state is stored as two uint64


# every name a run writes in -o (main.log is llmc/logger.py's): what start-up cleanup may remove
# (their dead temporaries) and what a fresh run moves aside (an older run's files)
RUN_FILE_NAMES = r"model_\d{8}\.bin|state_\d{8}_\d{5}\.bin|config_\d{8}\.json|DONE_\d{8}|main\.log"
PREVIOUS_RUN_DIR = "previous_run_{}"


def checkpoint_paths(out_dir, step, rank=0):
    """(model, state, DONE-marker) file paths of the checkpoint at `step`, llm.c's names."""
    return (os.path.join(out_dir, f"model_{step:08d}.bin"),
            os.path.join(out_dir, f"state_{step:08d}_{rank:05d}.bin"),
            os.path.join(out_dir, f"DONE_{step:08d}"))


def config_path(out_dir, step):
    """The checkpoint's run configuration, config_<step>.json (this project's; llm.c keeps none):
    the flags that decide the result, so a resume can refuse a change (llmc/cli.py)."""
    return os.path.join(out_dir, f"config_{step:08d}.json")


def write_run_config(path, config):
    """Write the run configuration (a dict of JSON values) atomically, one key a line."""
    text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def read_run_config(path):
    """The run configuration dict of a checkpoint, or None when it has none (a checkpoint written
    by llm.c, or before this file existed). Raises InputError on a corrupt file."""
    if not os.path.lexists(path):
        return None
    check_input_file(path, "run configuration")
    try:
        with open(path) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: corrupt run configuration ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{path}: corrupt run configuration (not a JSON object)")
    return config


def write_state(path, step, process_rank, num_processes, m, v, loader, sample_rng_state,
                rng_state_last_update=0, master_weights=None, outliers=None, zero_stage=0):
    """Write the training-state file atomically: the header, fp32 AdamW m and v (flat), optional
    fp32 master weights (with zero_stage 1 all three are this rank's shard, as in llm.c's -z 1
    state files: llmc.zero.zero_shard), then, if the loader shuffles, its permutation state: as in llm.c, uint64
    shard count, int32 shard order, uint64 sample count, int32 sample order; then, where llm.c
    puts its Mersenne-Twister state, ours: the PCG64 state as 4 uint64 (state hi/lo, inc hi/lo),
    and in the header (slot 8, slots 24-25) the 32-bit half of a 64-bit draw that PCG64 keeps
    for its next 32-bit draw (numpy's has_uint32, uinteger): without it a run resumed between two
    reshuffles would permute differently.
    Last, if given, `outliers`: the loss and grad-norm outlier detectors' state, float64 (llm.c
    keeps none and stops reading before it)."""
    ls = loader.state()
    header = make_header(STATE_MAGIC, STATE_VERSION, {
        STATE_SLOT_NUM_PROCESSES: num_processes, STATE_SLOT_RANK: process_rank,
        STATE_SLOT_MASTER_WEIGHTS: int(master_weights is not None), STATE_SLOT_SHUFFLE: int(loader.shuffle),
        STATE_SLOT_OUTLIERS: int(outliers is not None), STATE_SLOT_ZERO_STAGE: zero_stage, STATE_SLOT_STEP: step})
    as_u64 = header.view("<u8")
    as_u64[STATE_U64_SAMPLE_RNG] = sample_rng_state
    as_u64[STATE_U64_RNG_LAST_UPDATE] = rng_state_last_update
    as_u64[STATE_U64_SHARD] = ls["shard"]
    as_u64[STATE_U64_SAMPLE] = ls["sample"]
    if loader.shuffle:
        header[STATE_SLOT_SHUFFLE_HAS_UINT32] = ls["rng"]["has_uint32"]
        as_u64[STATE_U64_SHUFFLE_UINTEGER] = ls["rng"]["uinteger"]

    def write(f):
        f.write(header.tobytes())
        f.write(np.asarray(m, "<f4").tobytes())
        f.write(np.asarray(v, "<f4").tobytes())
        if master_weights is not None:
            f.write(np.asarray(master_weights, "<f4").tobytes())
        if loader.shuffle:
            f.write(np.asarray([ls["shard_order"].size], "<u8").tobytes())
            f.write(np.asarray(ls["shard_order"], "<i4").tobytes())
            f.write(np.asarray([ls["sample_order"].size], "<u8").tobytes())
            f.write(np.asarray(ls["sample_order"], "<i4").tobytes())
            st = ls["rng"]["state"]
            words = [st["state"] >> 64, st["state"] & UINT64_MASK, st["inc"] >> 64, st["inc"] & UINT64_MASK]
            f.write(np.asarray(words, "<u8").tobytes())
        if outliers is not None:
            f.write(np.asarray(outliers, "<f8").tobytes())
    atomic_write(path, write)


def read_state(path, num_parameters, process_rank, num_processes, zero_stage=0):
    """Read a training-state file. num_parameters: the floats of each of m, v, master weights
    (with zero_stage 1, this rank's shard). Returns a dict: step, sample_rng_state, rng_state_last_update,
    m, v, master_weights (or None), loader (position dict for DataLoader.restore), shuffle,
    outliers (OUTLIER_DETECTORS_FLOATS float64, or None when the file has none), zero_stage.
    Raises InputError on a missing, corrupt or mismatched file (a run of several processes must
    resume with the -z it was written with: the shards and the full state differ in size)."""
    check_input_file(path, "state file")
    with open(path, "rb") as f:
        h = read_header(f, path, STATE_MAGIC, (STATE_VERSION,), "training state")
        if h[STATE_SLOT_NUM_PROCESSES] != num_processes or h[STATE_SLOT_RANK] != process_rank:
            raise InputError(f"{path}: written by rank {h[STATE_SLOT_RANK]} of {h[STATE_SLOT_NUM_PROCESSES]} processes, "
                             f"but this is rank {process_rank} of {num_processes}")
        if num_processes > 1 and h[STATE_SLOT_ZERO_STAGE] != zero_stage:    # one process: the same layout
            raise InputError(f"{path}: written with -z {h[STATE_SLOT_ZERO_STAGE]}, but this run has -z {zero_stage}: "
                             f"resume with -z {h[STATE_SLOT_ZERO_STAGE]}")
        if h[STATE_SLOT_STEP] < 0:
            raise InputError(f"{path}: corrupt state file: step {h[STATE_SLOT_STEP]}")
        u64 = h.view("<u8")
        out = {"step": int(h[STATE_SLOT_STEP]), "sample_rng_state": int(u64[STATE_U64_SAMPLE_RNG]),
               "rng_state_last_update": int(u64[STATE_U64_RNG_LAST_UPDATE]), "shuffle": bool(h[STATE_SLOT_SHUFFLE]),
               "zero_stage": int(h[STATE_SLOT_ZERO_STAGE])}
        out["m"] = read_exact(f, path, num_parameters, "<f4", "AdamW m")
        out["v"] = read_exact(f, path, num_parameters, "<f4", "AdamW v")
        out["master_weights"] = (read_exact(f, path, num_parameters, "<f4", "master weights")
                                 if h[STATE_SLOT_MASTER_WEIGHTS] else None)
        loader = {"shard": int(u64[STATE_U64_SHARD]), "sample": int(u64[STATE_U64_SAMPLE])}
        if h[STATE_SLOT_SHUFFLE]:
            ns = int(read_exact(f, path, 1, "<u8", "shard count")[0])
            loader["shard_order"] = read_exact(f, path, ns, "<i4", "shard order")
            nb = int(read_exact(f, path, 1, "<u8", "sample count")[0])
            loader["sample_order"] = read_exact(f, path, nb, "<i4", "sample order")
            w = [int(x) for x in read_exact(f, path, 4, "<u8", "shuffle RNG state")]
            if w[3] % 2 == 0:                  # PCG64's increment is always odd
                raise InputError(f"{path}: corrupt shuffle RNG state: an even PCG64 increment")
            has_uint32, uinteger = int(h[STATE_SLOT_SHUFFLE_HAS_UINT32]), int(u64[STATE_U64_SHUFFLE_UINTEGER])
            if has_uint32 not in (0, 1) or uinteger >= 1 << 32:
                raise InputError(f"{path}: corrupt shuffle RNG state: buffered half {has_uint32}, {uinteger}")
            loader["rng"] = {"bit_generator": "PCG64", "state": {"state": (w[0] << 64) | w[1], "inc": (w[2] << 64) | w[3]},
                             "has_uint32": has_uint32, "uinteger": uinteger}
        out["outliers"] = (read_exact(f, path, OUTLIER_DETECTORS_FLOATS, "<f8", "outlier detectors")
                           if h[STATE_SLOT_OUTLIERS] else None)
        if f.read(1):
            raise InputError(f"{path}: trailing bytes: the state file does not match a model of {num_parameters} parameters")
    if not (np.isfinite(out["m"]).all() and np.isfinite(out["v"]).all() and (out["v"] >= 0).all()):
        raise InputError(f"{path}: corrupt state file: AdamW moments are not finite")
    if out["sample_rng_state"] == 0:                   # xorshift never leaves 0: every sample would be token 0
        raise InputError(f"{path}: corrupt state file: the sampler's RNG state is 0")
    for name, detector in zip(("loss", "grad-norm"), np.split(out["outliers"], 2) if out["outliers"] is not None else ()):
        problem = outlier_state_problem(detector)
        if problem:
            raise InputError(f"{path}: corrupt state file: the {name} outlier window's {problem}")
    loader["source"] = path
    out["loader"] = loader
    return out


def latest_checkpoint_step(out_dir):
    """The largest step with a DONE_<step> marker in out_dir, or None."""
    steps = [int(os.path.basename(p)[5:]) for p in glob.glob(os.path.join(glob.escape(out_dir), "DONE_*"))
             if os.path.basename(p)[5:].isdigit()]
    return max(steps) if steps else None


def save_checkpoint(out_dir, step, config, params, m, v, loader, sample_rng_state, process_rank=0,
                    num_processes=1, master_weights=None, rng_state_last_update=0, outliers=None, zero_stage=0,
                    write_model_file=write_model_file):
    """Write model_<step>.bin (fp32 params, rank 0 only) and state_<step>_<rank>.bin from host
    arrays (params, m, v, master_weights: flat fp32; with zero_stage 1, m, v and master_weights
    are this rank's shard, params still the whole model). Returns the DONE_<step> path, which the
    caller writes last with write_done_marker, after a barrier when there are several ranks.
    write_model_file(path, config, params): the model file's writer (GPT-2's by default;
    llama3_cpu.py passes its own)."""
    model_path, state_path, done_path = checkpoint_paths(out_dir, step, process_rank)
    if process_rank == 0:
        write_model_file(model_path, config, params)
    write_state(state_path, step, process_rank, num_processes, m, v, loader, sample_rng_state,
                rng_state_last_update, master_weights, outliers, zero_stage)
    return done_path


def write_done_marker(done_path):
    """Write the empty DONE_<step> file that marks a checkpoint complete (always last)."""
    atomic_write(done_path, lambda f: None)


def load_checkpoint(out_dir, step, process_rank, num_processes, num_parameters_of, state_num_parameters=None,
                    zero_stage=0, read_model_file=read_model_file):
    """Read the checkpoint of `step` in out_dir for this rank. num_parameters_of(shape) as in
    llmc.formats.read_model_file, the model file's reader (GPT-2's by default; llama3_cpu.py passes
    its own, of the same signature); state_num_parameters: the floats of m, v, master weights in
    the state file (default: the model's; with zero_stage 1, this rank's shard). Returns
    read_state's dict plus "shape" (the model file's shape dict), "model_params" (the model
    file's fp32 parameters), "params" (fp32, the whole model: the master weights when the state
    has all of them, which are the exact fp32 values the run had, else the model file's) and
    "state_path". Raises InputError."""
    model_path, state_path, _ = checkpoint_paths(out_dir, step, process_rank)
    shape, params = read_model_file(model_path, num_parameters_of)
    st = read_state(state_path, state_num_parameters or params.size, process_rank, num_processes, zero_stage)
    if st["step"] != step:
        raise InputError(f"{state_path}: corrupt state file: step {st['step']} in the file of step {step}")
    st["shape"], st["state_path"], st["model_params"] = shape, state_path, params
    master = st["master_weights"]
    st["params"] = master if master is not None and master.size == params.size else params
    return st


def move_previous_run_aside(out_dir):
    """A fresh run into a directory that holds another run's files (RUN_FILE_NAMES: its
    checkpoints, its main.log): move them, untouched, into out_dir/previous_run_<k> (the first k
    free), so the two runs never mix and a later -y 1 resumes the new one. Returns that directory,
    or None when there was nothing to move. A move that fails half-way is undone (the files
    already moved go back, the new directory goes), so the old run is never split in two; then
    it raises InputError."""
    pattern = re.compile(RUN_FILE_NAMES)
    names = sorted(n for n in os.listdir(out_dir) if pattern.fullmatch(n) and os.path.isfile(os.path.join(out_dir, n)))
    if not names:
        return None
    k = 1
    while os.path.exists(os.path.join(out_dir, PREVIOUS_RUN_DIR.format(k))):
        k += 1
    aside = os.path.join(out_dir, PREVIOUS_RUN_DIR.format(k))
    os.mkdir(aside)
    moved = []
    try:
        for name in names:
            os.replace(os.path.join(out_dir, name), os.path.join(aside, name))
            moved.append(name)
    except OSError as e:
        for name in reversed(moved):                      # undo: the old run stays whole where it was
            os.replace(os.path.join(aside, name), os.path.join(out_dir, name))
        os.rmdir(aside)
        raise InputError(f"-o {out_dir}: could not move the previous run's files aside ({e.strerror or e}): "
                         f"they are left in place; free the directory or choose another -o") from None
    return aside


def delete_checkpoint(out_dir, step, process_rank):
    """Remove the checkpoint of `step`: its DONE marker first (so a half-deleted checkpoint never
    looks complete), then the model file and the run configuration (rank 0) and this rank's
    state file."""
    model_path, state_path, done_path = checkpoint_paths(out_dir, step, process_rank)
    rank0 = [done_path, model_path, config_path(out_dir, step)] if process_rank == 0 else []
    for path in rank0 + [state_path]:
        if os.path.exists(path):
            os.remove(path)


def rotate_checkpoints(out_dir, step, keep, major_every, process_rank):
    """llm.c's -nk / -nm, after the checkpoint of `step` was written: with keep > 0, keep only the
    newest `keep` checkpoints in out_dir up to `step` (those on disk, this rank's state files, so
    a resumed run rotates the checkpoints the run wrote before the resume too), except major ones
    (major_every > 0 and the step a multiple of it), which are never deleted. Returns the steps
    deleted."""
    if keep <= 0:
        return []
    pattern = re.compile(rf"state_(\d{{8}})_{process_rank:05d}\.bin")
    on_disk = sorted(int(m.group(1)) for m in map(pattern.fullmatch, os.listdir(out_dir)) if m)
    written = [s for s in on_disk if s <= step]
    deleted = []
    for old in written[:-keep]:
        if major_every > 0 and old % major_every == 0:
            continue
        delete_checkpoint(out_dir, old, process_rank)
        deleted.append(old)
    return deleted
