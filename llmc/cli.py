"""
llmc/cli.py: the command line both trainers share (llm.c's one-letter flags, each with a long
alias) and the loop around the training step: the work done between steps (validation loss,
HellaSwag, samples, checkpoints), the step line and main.log, --eval-only and --generate.

The training step itself (zero_grad, micro-batches, all-reduce, clip, update) is not here: each
trainer writes its own out in full, so gpt2_cpu.train and gpt2_cuda.train read side by side.
A trainer hands this module what differs between them as plain functions (a batch's loss, the
forward for HellaSwag, sampling, saving a checkpoint).
"""

import argparse
import bdb
import codecs
import glob
import math
import os
import re
import sys
import textwrap
import time
import traceback

import numpy as np

from llmc.argparser import ArgumentParser
from llmc.checkpoint import (RUN_FILE_NAMES, checkpoint_paths, config_path, latest_checkpoint_step,
                             move_previous_run_aside, read_run_config, rotate_checkpoints, write_done_marker,
                             write_run_config)
from llmc.comm import abort_all_ranks
from llmc.dataloader import DataLoader, data_fingerprint, shard_paths
from llmc.evalloader import check_hellaswag_path, evaluate_multiple_choice, read_hellaswag
from llmc.interrupt import restore_ctrl_c
from llmc.launcher import launched_rank
from llmc.logger import Logger
from llmc.formats import check_model_path
from llmc.multinode import PROBLEM_KEY, disagreement
from llmc.sampler import SAMPLE_SEED
from llmc.paths import DEFAULT_HELLASWAG, DEFAULT_TOKENIZER, DEFAULT_TRAIN, DEFAULT_VAL
from llmc.tokenizer import GPT2_EOT, Tokenizer, prompt_encoding
from llmc.outlier import OUTLIER_STATE_FLOATS, OutlierDetector, skip_reason
from llmc.utils import (TMP_SUFFIX, InputError, check_input_file, lock_directory, release_directory_locks,
                        stale_temporaries)

WRITE_PROBE = ".write_probe"           # make_output_dir's test file in -o


# ----------------------------------------------------------------------------
# the flags

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with the defaults shown, wrapped at spaces only: a long path (a default data file)
    stays whole on a line of its own instead of being cut mid-word or at a hyphen."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)


def build_parser(prog, description, lr_schedules, model_help=None):
    """The trainers' argparse parser: llm.c's one-letter flags, each with a long alias and llm.c's
    default (train_gpt2.cu), then NEWCOMER_DEFAULTS on top (see there). -h is HellaSwag in llm.c,
    so help is --help only. lr_schedules: the names -k accepts (the trainer's learning_rate_at
    implements them); model_help: -e's help where it names other models than GPT-2's (Llama 3's
    trainers). gpt2_cuda.py adds its GPU flags to this parser."""
    p = ArgumentParser(prog=prog, add_help=False, description=description,
                       formatter_class=HelpFormatter)
    a = p.add_argument
    a("--help", action="help", help="show this help and exit")
    a("-i", "--input-bin", default=DEFAULT_TRAIN, help="train data: file or glob of shards")
    a("-j", "--input-val-bin", default=DEFAULT_VAL, help="validation data: file or glob ('' for none)")
    a("-e", "--model", default="gpt2_124M_bf16.bin", help=model_help or "checkpoint .bin to start from, or a descriptor as in "
      "llm.c: GPT-2 dX or gpt2:dX by depth (X = 2 4 6 12 24 36 48 60 72 84; 124M = d12 ...), GPT-3 gpt3:cX by "
      "channels (X = 384 768 1024 1536 2048 2560 4096 12288; maxT 2048)")
    a("-o", "--output-dir", default=None, help="directory for main.log and checkpoints")
    a("-b", "--batch-size", type=int, default=4, help="micro-batch size B (sequences)")
    a("-t", "--seq-len", type=int, default=1024, help="sequence length T (tokens)")
    a("-d", "--total-batch-size", type=int, default=-1, help="tokens per optimizer step (-1: B*T*processes, no accumulation)")
    a("-x", "--max-steps", type=int, default=-1, help="optimizer steps (-1: one epoch of the train data)")
    a("-k", "--lr-schedule", default="cosine", choices=lr_schedules, help="learning-rate schedule")
    a("-l", "--learning-rate", "--lr", type=float, default=3e-4, help="peak learning rate")
    a("-u", "--warmup-iters", type=int, default=0, help="linear warmup steps")
    a("-q", "--final-lr-frac", type=float, default=1.0, help="final learning rate as a fraction of the peak")
    a("-c", "--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("-sl", "--skip-update-lossz", type=float, default=0.0, help="skip the update of a step whose loss z-score exceeds this (0: off)")
    a("-sg", "--skip-update-gradz", type=float, default=0.0, help="skip the update of a step whose grad-norm z-score exceeds this (0: off)")
    a("-v", "--val-every", type=int, default=20, help="validation loss every N steps (0: never)")
    a("-m", "--val-max-steps", type=int, default=20, help="batches per validation (-1: whole split)")
    a("-s", "--sample-every", type=int, default=20, help="print a generated sample every N steps (0: never)")
    a("-g", "--gen-tokens", type=int, default=64, help="tokens per generated sample")
    a("-n", "--checkpoint-every", type=int, default=0, help="write a checkpoint every N steps and at the end (0: never; needs -o)")
    a("-nk", "--checkpoints-keep", type=int, default=0, help="keep only the newest K checkpoints (0: all)")
    a("-nm", "--major-checkpoint-every", type=int, default=0, help="checkpoints at multiples of M steps are never deleted (0: none)")
    a("-y", "--resume", type=int, default=0, choices=(0, 1), help="1: resume from the newest complete checkpoint in -o")
    a("--resume-unchecked", action="store_true",
      help="with -y 1: resume a checkpoint whose config_<step>.json is missing (llm.c's own), its flags unchecked")
    a("-a", "--overfit-single-batch", type=int, default=0, choices=(0, 1), help="1: train on the first batch only")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    a("--shuffle", type=int, default=0, choices=(0, 1), help="1: shuffle the train shards and batches (seeded)")
    a("--seed", type=int, default=42, help="seed for the random init and the loader shuffle (>= 0)")
    a("--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer .bin for printing samples")
    a("-h", "--hellaswag", type=int, default=0, choices=(0, 1), help="1: HellaSwag accuracy every -v steps")
    a("--hellaswag-file", default=DEFAULT_HELLASWAG, help="multiple-choice eval file (dev/data/hellaswag.py)")
    a("--eval-only", action="store_true", help="evaluate -e once (val loss, HellaSwag with -h 1) and exit")
    a("--generate", type=int, default=0, metavar="N", help="sample N tokens from -e after --prompt and exit")
    a("--prompt", default="", help="text to continue with --generate ('' starts from <|endoftext|>)")
    a("--temperature", type=float, default=1.0, help="sampling temperature (>= 0; 0: the most likely token)")
    a("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0: all)")
    a("--sample-seed", type=int, default=SAMPLE_SEED, help="seed of the sampler's xorshift RNG (nonzero)")
    a("--traceback", action="store_true", help="an internal error prints its full traceback (also: LLMC_TRACEBACK=1)")
    newcomer_defaults(p)
    if model_help:                             # llm.c's default model is GPT-2's: no such note for another family
        next(action for action in p._actions if action.dest == "model").help = model_help
    return p


# The run `python gpt2_cpu.py` (and `make train`) gives a newcomer with no flags: a small model
# that learns Shakespeare in about two minutes on a laptop CPU. Every other default is llm.c's.
NEWCOMER_DEFAULTS = {"model": "d4", "seq_len": 64, "max_steps": 400, "final_lr_frac": 0.0,
                     "val_every": 100, "sample_every": 100}


def newcomer_defaults(parser):
    """Set NEWCOMER_DEFAULTS over llm.c's defaults, and say so in each flag's --help."""
    for action in parser._actions:
        if action.dest in NEWCOMER_DEFAULTS:
            action.help += f" [llm.c's default: {action.default}; this trainer's newcomer run sets it]"
    parser.set_defaults(**NEWCOMER_DEFAULTS)


# the flags that change what a run computes, as (flag, argparse dest): a resume must keep them
RESULT_FLAGS = (("-b", "batch_size"), ("-t", "seq_len"), ("-k", "lr_schedule"), ("-l", "learning_rate"),
                ("-u", "warmup_iters"), ("-q", "final_lr_frac"), ("-c", "weight_decay"), ("--grad-clip", "grad_clip"),
                ("-sl", "skip_update_lossz"), ("-sg", "skip_update_gradz"), ("-a", "overfit_single_batch"),
                ("--shuffle", "shuffle"), ("--seed", "seed"))
# gpt2_cuda.py's flags that change its arithmetic (compared when both runs have them, so a CPU run
# resumes a CUDA run's checkpoint and the other way round); -z is the state file's own check
DEVICE_RESULT_FLAGS = (("--precision", "precision"), ("-w", "master_weights"), ("-f", "tf32"),
                       ("--attention", "attention"), ("--cublaslt", "cublaslt"),
                       ("--residual-epilogue", "residual_epilogue"), ("--autotune", "autotune"),
                       ("-ge", "gelu_fusion"), ("--bias-grad-epilogue", "bias_grad_epilogue"),
                       ("--ln-bias-grad", "ln_bias_grad"),
                       ("--cudnn-deterministic", "cudnn_deterministic"),
                       ("--classifier-chunk", "classifier_chunk"),
                       ("--pad-vocab", "pad_vocab"))
INT32_MAX = 2**31 - 1                  # llm.c counts tokens in int
UINT64_MAX = 2**64 - 1                 # the seeds are 64-bit states


def check_args(args):
    """One InputError for flags that make no sense, before anything runs (llm.c accepts some of
    these silently; here each is one clear line)."""
    checks = [
        (args.batch_size > 0 and args.seq_len > 0,
         f"batch size and sequence length must be positive (got -b {args.batch_size} -t {args.seq_len})"),
        (args.max_steps > 0 or args.max_steps == -1, f"-x {args.max_steps}: the number of steps must be positive, or -1 for one epoch"),
        (args.total_batch_size > 0 or args.total_batch_size == -1, f"-d {args.total_batch_size}: tokens per step must be positive, or -1"),
        (math.isfinite(args.learning_rate) and args.learning_rate >= 0, f"-l {args.learning_rate}: the learning rate must be a number >= 0"),
        (args.warmup_iters >= 0, f"-u {args.warmup_iters}: warmup steps must be >= 0"),
        (math.isfinite(args.final_lr_frac) and 0 <= args.final_lr_frac <= 1, f"-q {args.final_lr_frac}: must be in [0, 1]"),
        (math.isfinite(args.weight_decay) and args.weight_decay >= 0, f"-c {args.weight_decay}: weight decay must be >= 0"),
        (math.isfinite(args.grad_clip) and args.grad_clip >= 0, f"--grad-clip {args.grad_clip}: must be >= 0"),
        (args.skip_update_lossz >= 0 and args.skip_update_gradz >= 0, "-sl and -sg must be >= 0 (0: off)"),
        (args.checkpoint_every >= 0 and args.checkpoints_keep >= 0 and args.major_checkpoint_every >= 0,
         "-n, -nk and -nm must be >= 0"),
        (args.checkpoint_every == 0 or args.output_dir, f"-n {args.checkpoint_every} needs -o DIR to write the checkpoints in"),
        (not args.resume or args.output_dir, "-y 1 needs -o DIR to find the checkpoint in"),
        (args.generate or (args.temperature == 1.0 and args.top_k == 0),
         f"--temperature {args.temperature} --top-k {args.top_k}: they shape --generate's sampling only (the "
         f"samples of a training run, -s, draw from the model's distribution, as llm.c's)"),
        (not args.eval_only or args.input_val_bin or args.hellaswag,
         "--eval-only with -j '' and -h 0: nothing to evaluate (give validation data with -j, or -h 1)"),
        (args.val_every >= 0 and args.sample_every >= 0 and args.gen_tokens >= 0, "-v, -s and -g must be >= 0"),
        (args.val_max_steps > 0 or args.val_max_steps == -1, f"-m {args.val_max_steps}: must be positive, or -1 for the whole split"),
        (args.batch_size * args.seq_len <= INT32_MAX,
         f"-b {args.batch_size} -t {args.seq_len}: B*T = {args.batch_size * args.seq_len:,} tokens per micro-batch "
         f"do not fit in a 32-bit count (at most {INT32_MAX:,})"),
        (args.total_batch_size <= INT32_MAX, f"-d {args.total_batch_size}: tokens per step must fit in a 32-bit count "
                                             f"(at most {INT32_MAX:,})"),
        (0 <= args.seed <= UINT64_MAX, f"--seed {args.seed}: seeds must be in [0, 2^64)"),
        (math.isfinite(args.temperature) and args.temperature >= 0, f"--temperature {args.temperature}: must be >= 0"),
        (args.top_k >= 0, f"--top-k {args.top_k}: must be >= 0"),
        (0 < args.sample_seed <= UINT64_MAX,
         f"--sample-seed {args.sample_seed}: must be in [1, 2^64) (xorshift's 64-bit state is never 0)"),
        (args.generate >= 0, f"--generate {args.generate}: must be >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise InputError(message)


def same_kind(saved, now):
    """Whether a config_<step>.json value can be compared with this run's: both numbers (JSON
    keeps 1e-3 and 3 apart, bool counts as a number), or both of one other type."""
    def number(x):
        return isinstance(x, (int, float))
    return number(saved) == number(now) and (number(now) or type(saved) is type(now))


def is_checkpoint_path(spec):
    """-e names a file (a .bin or a path) or a directory (refused later, naming the model in it)
    rather than a descriptor such as d12."""
    return spec.endswith(".bin") or os.path.sep in spec or os.path.isdir(spec)


# ----------------------------------------------------------------------------
# the ranks of one job: started alike, and an error they all find is said once

class AgreedError(InputError):
    """Bad input that every rank finds alike (the flags agree, so each rank's checks of them do):
    rank 0 says it in one line and ends the job; the other ranks stay quiet (run_main)."""


# flags that may differ between the ranks of one job (-pm tcp|fs): each process's own rank; the
# server address (rank 0 listens on every interface of its node, whatever its -ps); the shared
# directory's path (a mount point may differ from node to node); the GPUs of its node
PER_RANK_DESTS = ("process_rank", "server_ip", "fs_path", "gpus_per_node")


def start_problem(args):
    """The one line this process would stop with for want of its input files, or None: -i (unless
    --eval-only or --generate) or -j matching no file or naming one that is not a regular file,
    -e naming no model checkpoint (a path; with -y 1 the model comes from -o), -h 1's eval file
    missing. Each rank checks its own before the ranks compare, so a rank given a wrong path is
    named with it (llmc.multinode.disagreement), not only as differing from rank 0."""
    try:
        patterns = [] if args.generate else ([args.input_val_bin] if args.input_val_bin else [])
        patterns += [] if args.eval_only or args.generate else [args.input_bin]
        for pattern in patterns:
            for path in shard_paths(pattern):
                check_input_file(path, "data shard")
        if is_checkpoint_path(args.model) and not (args.resume and args.output_dir):
            check_model_path(args.model)
        if args.hellaswag:
            check_hellaswag_path(args.hellaswag_file)
    except InputError as e:
        return str(e)
    return None


def agreement_config(args):
    """What decides a rank's part of the result, to compare with rank 0's: every flag but
    PER_RANK_DESTS (a different -x hangs the job; a different -l or -t trains silently wrong),
    fingerprints of the train data's and the model file's content (the same path can hold other
    files on another node), and this rank's start_problem (PROBLEM_KEY), without fingerprints
    where it has one."""
    config = {f"--{dest.replace('_', '-')}": value for dest, value in sorted(vars(args).items())
              if dest not in PER_RANK_DESTS}
    config[PROBLEM_KEY] = start_problem(args)
    if config[PROBLEM_KEY] is not None:
        return config
    files = sorted(glob.glob(args.input_bin)) if not os.path.isfile(args.input_bin) else [args.input_bin]
    config["-i content"] = data_fingerprint(files) if files else None
    config["-e content"] = data_fingerprint([args.model]) if os.path.isfile(args.model) else None
    return config


def check_ranks_agree(args, comm):
    """Under mpiexec, before anything else: every rank's agreement_config must be rank 0's. One
    small collective (mpi4py's allgather of the dicts); all ranks then stop at once, rank 0
    naming every differing flag in one line (AgreedError). Without MPI: nothing to compare here
    (-pm tcp|fs compare in their rendezvous: llmc.multinode.init_process_group)."""
    if getattr(comm, "comm", None) is None or comm.size == 1:
        return
    everyone = comm.comm.allgather(agreement_config(args))
    message = disagreement(dict(enumerate(everyone)))
    if message:
        raise AgreedError(message)


# ----------------------------------------------------------------------------
# --generate: a prompt in, sampled text streamed out

def check_tokenizer_vocabulary(tokenizer, path, V, fix):
    """The tokenizer read from `path` must have the model's V tokens: an id the model has and the
    tokenizer lacks could not be decoded, and a prompt id past V could not be looked up. Raises
    InputError ending with `fix` (what to pass instead)."""
    tokens = len(tokenizer.token_bytes)
    if tokens != V:
        raise InputError(f"{path}: the tokenizer has {tokens:,} tokens, but the model's vocabulary is V={V:,}, so "
                         f"its samples could not be decoded: {fix}")


def sample_from_prompt(args, generate, config):
    """--generate N: encode --prompt, then stream N sampled tokens to stdout as they come (bytes
    are decoded incrementally, so a character split across tokens prints whole).
    generate(prompt ids, n, on_token) -> ids runs the trainer's sampler; config: the model's
    (its max_seq_len and vocab_size V). Returns the ids. Raises InputError, before printing
    anything, if the tokenizer's size is not V or the prompt is longer than max_seq_len tokens."""
    tokenizer = Tokenizer(args.tokenizer)
    check_tokenizer_vocabulary(tokenizer, args.tokenizer, config.vocab_size, "pass the model's --tokenizer")
    prompt = prompt_encoding(tokenizer).encode(args.prompt, allowed_special="all") if args.prompt else [tokenizer.eot_token]
    if len(prompt) > config.max_seq_len:
        raise InputError(f"--prompt is {len(prompt)} tokens, longer than max_seq_len {config.max_seq_len}")
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(args.prompt)

    def stream(token):
        sys.stdout.write(decoder.decode(tokenizer.token_bytes[token]))
        sys.stdout.flush()
    ids = generate(prompt, args.generate, stream)
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    return ids


# ----------------------------------------------------------------------------
# a training run: everything around the training step

class TrainingRun:
    """The parts of llm.c's main() that both trainers share. Construct it from the flags (checks
    what needs no model), then prepare(config) once the model's shape is known (loaders, steps,
    gradient accumulation, HellaSwag examples, tokenizer), then per step between_steps() before
    the training step and log_step() after it. Raises InputError on bad flags or files."""

    def __init__(self, args, comm):
        check_ranks_agree(args, comm)
        try:
            check_args(args)
        except InputError as e:                            # the ranks agree: each found this
            raise AgreedError(str(e)) from None
        self.args, self.comm = args, comm
        self.master = comm.rank == 0
        self.B, self.T = args.batch_size, args.seq_len
        self.training = not args.eval_only and not args.generate
        self.resuming = bool(args.resume) and self.training
        self.from_checkpoint = bool(args.resume) and bool(args.output_dir)    # --eval-only/--generate -y 1 too
        if self.resuming and self.master and os.path.isdir(args.output_dir):
            lock_directory(args.output_dir)                    # before the checkpoint is read
        self.resume_step = latest_checkpoint_step(args.output_dir) if self.from_checkpoint else None
        if self.from_checkpoint and self.resume_step is None:
            raise InputError(f"{args.output_dir}: no complete checkpoint (DONE_* marker) to resume from")
        self.start_step = self.step = 0
        self.loss_outliers, self.grad_outliers = OutlierDetector(), OutlierDetector()

    def say(self, *parts, **kwargs):
        """print() on rank 0 only."""
        if self.master:
            print(*parts, **kwargs)

    def model_spec(self):
        """Where the model comes from: with -y 1 the newest checkpoint in -o (resumed, or for
        --eval-only / --generate evaluated), else -e."""
        if self.from_checkpoint:
            return checkpoint_paths(self.args.output_dir, self.resume_step, self.comm.rank)[0]
        return self.args.model

    def check_resumed_model(self, requested, loaded):
        """Resuming: the checkpoint's model (loaded, a config) must be the one -e asks for
        (requested), or the run would silently continue another run. Raises InputError."""
        if requested != loaded:
            def shape(c):
                return f"L={c.num_layers} NH={c.num_heads} C={c.channels} maxT={c.max_seq_len} V={c.vocab_size}"
            raise InputError(f"{self.model_spec()}: the checkpoint in -o {self.args.output_dir} is a model of "
                             f"{shape(loaded)}, but -e {self.args.model} is {shape(requested)}: pass the -e it was "
                             f"trained with, or another -o")

    def prepare(self, config):
        """Everything that needs the model's shape: checks T, works out gradient accumulation,
        opens the loaders and the HellaSwag file, loads the tokenizer for samples, and for a
        training run makes -o (and removes the temporary files a killed run left there); --eval-only
        and --generate write nothing there, so a read-only -o serves them."""
        args, comm, B, T = self.args, self.comm, self.B, self.T
        if T > config.max_seq_len:
            raise AgreedError(f"-t {T} exceeds the model's max_seq_len {config.max_seq_len}")
        tokens_per_micro = B * T * comm.size
        self.total_batch = args.total_batch_size if args.total_batch_size > 0 else tokens_per_micro
        if self.total_batch % tokens_per_micro:
            raise AgreedError(f"-d {self.total_batch} is not a multiple of B*T*processes = {tokens_per_micro}")
        self.grad_accum_steps = self.total_batch // tokens_per_micro
        V = config.vocab_size
        self.val_loader = DataLoader(args.input_val_bin, B, T, comm.rank, comm.size, vocab_size=V) \
            if args.input_val_bin else None
        if args.eval_only:                                 # evaluates -e: the train data is never read
            self.train_loader, self.num_steps = None, 0
        else:
            self.train_loader = DataLoader(args.input_bin, B, T, comm.rank, comm.size, bool(args.shuffle), args.seed, V)
            self.num_steps = args.max_steps if args.max_steps > 0 else self.train_loader.num_tokens // self.total_batch
        if self.num_steps == 0 and not args.eval_only:
            raise InputError(f"-d {self.total_batch}: one step needs more tokens than the train data's "
                             f"{self.train_loader.num_tokens:,}, so -x -1 (one epoch) is no step at all")
        if self.resuming:
            self.check_resumed_config()
        self.examples = read_hellaswag(args.hellaswag_file, config.vocab_size) if args.hellaswag else None
        self.sampling = self.master and args.sample_every > 0 and not args.eval_only
        self.tokenizer = None
        if self.sampling:
            try:
                self.tokenizer = Tokenizer(args.tokenizer)
            except InputError as e:
                self.say(f"note: {e}; samples will print token ids")
            self.check_sampling_vocabulary(config.vocab_size)
        if args.output_dir and self.training:              # last: a run refused above moved nothing aside
            self.make_output_dir(args.output_dir)          # (--eval-only and --generate only read -o)

    def check_sampling_vocabulary(self, V):
        """Before the first step, not at the first sample: the model's vocabulary V must be the
        tokenizer's (a sampled id it lacks could not be decoded), and the samples' first token,
        <|endoftext|>, must be inside V. Raises InputError naming the fix."""
        if self.tokenizer:
            check_tokenizer_vocabulary(self.tokenizer, self.args.tokenizer, V,
                                       "pass the model's --tokenizer, or -s 0 for no samples")
        eot = self.tokenizer.eot_token if self.tokenizer else GPT2_EOT
        if eot >= V:
            raise InputError(f"samples start from <|endoftext|> (token {eot}), outside the model's vocabulary "
                             f"V={V:,}: pass -s 0 for no samples")

    def run_config(self):
        """What decides the result of a run besides the model: the flags (RESULT_FLAGS, and the
        DEVICE_RESULT_FLAGS this trainer has) and a fingerprint of the train data (its tokens and
        shards), as written to config_<step>.json."""
        config = {flag: getattr(self.args, dest) for flag, dest in RESULT_FLAGS + DEVICE_RESULT_FLAGS
                  if hasattr(self.args, dest)}
        config.update({"-d": self.total_batch, "-x": self.num_steps, "processes": self.comm.size,
                       "-i": f"{self.train_loader.num_tokens} tokens in {len(self.train_loader.files)} shard(s), "
                             f"content {data_fingerprint(self.train_loader.files)}"})
        return config

    def check_resumed_config(self):
        """Resuming: refuse, listing every difference, a run whose flags would change the result
        from the checkpoint's (config_<step>.json): any of RESULT_FLAGS (DEVICE_RESULT_FLAGS when
        both runs have them), the number of processes, the train data (its token and shard counts
        and a fingerprint of its content), or a smaller -x (the schedule's length). -v, -s, -g, -n,
        -nk, -nm, -h and a larger -x change nothing that was trained. A checkpoint without the file
        (llm.c's) is refused unless --resume-unchecked says to go on without the check; a file
        that lacks a key every run writes, or holds a value of another type, is refused as
        damaged. Raises InputError."""
        path = config_path(self.args.output_dir, self.resume_step)
        saved = read_run_config(path)
        if saved is None:
            if not self.args.resume_unchecked:
                raise InputError(f"{path} is missing, so this run's flags cannot be checked against the checkpoint's: "
                                 f"pass --resume-unchecked to resume anyway (as for llm.c's own checkpoints)")
            self.say(f"note: {path} is missing: resuming with the flags unchecked (--resume-unchecked)")
            return
        now = self.run_config()
        required = [flag for flag, _ in RESULT_FLAGS] + ["-d", "-x", "processes", "-i"]   # written by every run
        damaged = [key for key in required if key not in saved] + [
            key for key in now if key in saved and not same_kind(saved[key], now[key])]
        if damaged:
            raise InputError(f"{path}: damaged run configuration ({', '.join(damaged)} missing or of the wrong type): "
                             f"restore it, or pass --resume-unchecked to resume without the check")
        changed = [key for key in now if key in saved and saved[key] != now[key] and
                   not (key == "-x" and now[key] >= saved[key])]
        if changed:
            def flags(config):
                return " ".join(f"{key} {config[key]}" if key != "-i" else f"-i ({config[key]})" for key in changed)
            raise InputError(f"{path}: the checkpoint was written with {flags(saved)}, but this run has {flags(now)}: "
                             f"resume with the checkpoint's flags, or start a fresh run in another -o")

    def make_output_dir(self, out_dir):
        """Create -o if needed and check it can be written. A training run then, on rank 0, takes
        the directory's lock (one run at a time: llmc.utils.lock_directory), removes the
        temporaries that a run killed mid-write left behind (its own file names only, writer
        gone), and, unless resuming, moves an older run's files aside (saying where), so two runs
        never mix. Raises InputError."""
        try:
            os.makedirs(out_dir, exist_ok=True)
            probe = os.path.join(out_dir, f"{WRITE_PROBE}{TMP_SUFFIX}{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            raise InputError(f"-o {out_dir}: cannot write there ({e.strerror or e}): a training run writes its "
                             f"lock, checkpoints and main.log in -o") from None
        if self.master and self.training:
            lock_directory(out_dir)
            for path in stale_temporaries(out_dir, f"{RUN_FILE_NAMES}|{re.escape(WRITE_PROBE)}"):
                os.remove(path)
            aside = None if self.resuming else move_previous_run_aside(out_dir)
            if aside:
                self.say(f"note: -o {out_dir} held another run's files (checkpoints, main.log): moved them to {aside}")
        self.comm.barrier()

    def banner(self, config, num_parameters):
        """The model and batch lines every run starts with."""
        self.say(f"model: L={config.num_layers} NH={config.num_heads} C={config.channels} maxT={config.max_seq_len} "
                 f"V={config.vocab_size} Vp={config.padded_vocab_size} | {num_parameters:,} parameters")
        self.say(f"batch: B={self.B} T={self.T} processes={self.comm.size} grad_accum={self.grad_accum_steps} -> "
                 f"{self.total_batch} tokens/step | train {self.train_loader.num_tokens:,} tokens in "
                 f"{len(self.train_loader.files)} shard(s) | {self.num_steps} steps")

    def start(self, start_step=0, outliers=None):
        """Open main.log (appending when resuming) at the step the loop starts from; restore the
        outlier detectors' state (a checkpoint's `outliers`) if given. Returns False, having said
        why, when a resumed run is already at or past -x: nothing to train."""
        self.start_step = start_step
        if outliers is not None:
            self.loss_outliers.restore(outliers[:OUTLIER_STATE_FLOATS])
            self.grad_outliers.restore(outliers[OUTLIER_STATE_FLOATS:])
        if start_step >= self.num_steps:
            self.say(f"the checkpoint is at step {start_step}, at or past -x {self.num_steps}: nothing to train "
                     f"(raise -x to train further)")
            return False
        self.logger = Logger(self.args.output_dir if self.master else None, start_step if self.resuming else None)
        return True

    def outlier_state(self):
        """Both outlier detectors' state, for the checkpoint (llmc.checkpoint's `outliers`)."""
        return np.concatenate([self.loss_outliers.state(), self.grad_outliers.state()])

    def skip_update(self, loss, norm, step=None):
        """Feed this step's loss and gradient norm to the outlier detectors (llm.c's -sl / -sg).
        Returns (skip, zloss, zgrad): skip is True, having said so, when the update is to be
        skipped. A non-finite loss or norm is never fed to the detectors: with -sl or -sg the
        step is skipped, else it raises InputError naming the step (training never goes on on NaN).
        step: the step they are of (default: the one between_steps last began; a trainer that
        reads them a step late passes it)."""
        step = self.step if step is None else step
        if not (math.isfinite(loss) and math.isfinite(norm)):
            what, value = ("loss", loss) if not math.isfinite(loss) else ("grad norm", norm)
            if self.args.skip_update_lossz > 0 or self.args.skip_update_gradz > 0:
                self.say(f"skipping update due to a non-finite {what} at step {step + 1} ({value})")
                return True, math.nan, math.nan
            raise InputError(f"step {step + 1}: the {what} is {value}, not finite: training diverged (lower -l, "
                             f"or let -sl/-sg skip such steps)")
        zloss, zgrad = self.loss_outliers.update(loss), self.grad_outliers.update(norm)
        reason = skip_reason(zloss, zgrad, self.args.skip_update_lossz, self.args.skip_update_gradz)
        if reason:
            self.say(reason)
        return reason is not None, zloss, zgrad

    def validate(self, batch_loss):
        """Mean validation loss over -m batches (-1: the whole split), averaged across ranks.
        batch_loss(inputs (B,T), targets (B,T)) -> the batch's mean loss, a float."""
        loader, steps = self.val_loader, self.args.val_max_steps
        loader.reset()
        steps = steps if steps > 0 else loader.num_batches
        total = math.fsum(batch_loss(*loader.next_batch()) for _ in range(steps))
        return self.comm.mean(total / steps)

    def hellaswag(self, forward_losses):
        """HellaSwag accuracy over every example (llmc.evalloader.evaluate_multiple_choice)."""
        return evaluate_multiple_choice(forward_losses, self.examples, self.B, self.T, self.comm)

    def evaluate_only(self, batch_loss, forward_losses):
        """--eval-only: the validation loss and (with -h 1) HellaSwag, once."""
        if self.val_loader:
            self.say(f"val loss {self.validate(batch_loss):.6f}")
        if self.examples:
            acc, n = self.hellaswag(forward_losses)
            self.say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")

    def acts_between(self, step):
        """Whether between_steps(step) does anything (evaluates, samples, checkpoints, or ends the
        loop at the last step): a trainer that logs each step a step late logs the previous one
        first, so that the lines keep their order and a checkpoint follows the step's checks."""
        due = self.due(step)
        return step == self.num_steps or any(due)

    def due(self, step):
        """What between_steps(step) does: (validation, HellaSwag, a sample on the -s grid, a
        checkpoint), each a bool."""
        args, last_step = self.args, step == self.num_steps
        # resumed at this step: its evaluations and sample came before the checkpoint was written
        # (and advanced the sampler's RNG then): doing them again would print them twice and
        # draw a different sample from then on
        if self.resuming and step == self.start_step and not last_step:
            return False, False, False, False
        return (bool(self.val_loader) and args.val_every > 0 and (step % args.val_every == 0 or last_step),
                bool(self.examples) and args.val_every > 0 and ((step > 0 and step % args.val_every == 0) or last_step),
                self.sampling and step > 0 and step % args.sample_every == 0,
                bool(args.output_dir) and args.checkpoint_every > 0 and step > self.start_step and
                (step % args.checkpoint_every == 0 or last_step))

    def between_steps(self, step, batch_loss, forward_losses, generate, save):
        """The work at the top of step `step` (and after the last): validation loss every -v steps,
        HellaSwag every -v steps, a sample every -s steps, a checkpoint every -n steps, each also at
        the end (where the last sample, off the -s grid, follows the checkpoint). generate(prompt
        ids, n) -> ids; save(step) -> the DONE path it leaves to write. Returns True at the last
        step (the loop ends)."""
        args, last_step = self.args, step == self.num_steps
        self.step = step
        if self.resuming and step == self.start_step and not last_step:     # see due()
            return False
        validate, hellaswag, on_grid_sample, checkpoint = self.due(step)
        if validate:
            val_loss = self.validate(batch_loss)
            self.say(f"val loss {val_loss:.6f}")
            self.logger.log_val(step, val_loss)
        if hellaswag:
            acc, n = self.hellaswag(forward_losses)
            self.say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")
            self.logger.log_eval(step, acc)
        if on_grid_sample:
            self.sample(generate)
        if checkpoint:
            done = save(step)
            self.comm.barrier()
            if self.master:
                write_run_config(config_path(args.output_dir, step), self.run_config())
                write_done_marker(done)
                self.say(f"checkpoint written: step {step} in {args.output_dir}")
            rotate_checkpoints(args.output_dir, step, args.checkpoints_keep, args.major_checkpoint_every, self.comm.rank)
        # the last step's sample off the -s grid comes after the checkpoint: drawn before it, it
        # would advance the sampler's RNG saved there, and a run resumed from that checkpoint would
        # sample differently from a straight one, which draws no sample at this step
        if self.sampling and last_step and not on_grid_sample:
            self.sample(generate)
        return last_step

    def sample_after_the_last_checkpoint(self, generate):
        """A resume that finds its checkpoint at -x (start() returned False): a run that ends off
        the -s grid draws its last sample after its last checkpoint, so a run killed between the
        two never printed it. Print it now: drawn from the checkpoint's sampler state, it is the
        sample that run would have printed (printed again if it got that far)."""
        args = self.args
        if self.sampling and self.start_step == self.num_steps and self.num_steps % args.sample_every:
            self.say(f"the run's last sample, which follows its step-{self.num_steps} checkpoint:")
            self.sample(generate)

    def sample(self, generate):
        """Print one sample of -g tokens from <|endoftext|> (decoded, or token ids without a
        tokenizer). generate(prompt ids, n) -> ids."""
        self.say("generating:\n---")
        ids = generate([self.tokenizer.eot_token if self.tokenizer else GPT2_EOT], self.args.gen_tokens)
        self.say(self.tokenizer.decode(ids) if self.tokenizer else " ".join(map(str, ids)))
        self.say("---")

    def log_step(self, step, loss, norm, lr, seconds, zloss=math.nan, zgrad=math.nan, extra=""):
        """The step line (llm.c's, plus tok/s; the z-scores once the outlier windows are full) and
        main.log's train line."""
        def z(score):
            return f" ({score:+.2f}z)" if math.isfinite(score) else ""
        self.say(f"step {step + 1:4d}/{self.num_steps} | loss {loss:.6f}{z(zloss)} | norm {norm:.4f}{z(zgrad)} | "
                 f"lr {lr:.2e} | {seconds * 1000:.1f} ms | {self.total_batch / seconds:.0f} tok/s{extra}")
        self.logger.log_train(step, loss, lr, norm)


def error_line(e, expected):
    """The one line that reports exception e: its message for bad input or a failed write
    (`expected`); otherwise the exception's type, message and the file and line that raised it
    (an internal error); under mpiexec prefixed with the rank it happened on. A message of
    several lines is joined into one."""
    if isinstance(e, expected):
        text = str(e)
    elif isinstance(e, MemoryError):
        text = "out of memory (MemoryError): lower -b or -t, or use a smaller model"
    else:
        frames = traceback.extract_tb(e.__traceback__)
        where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
        text = f"internal error: {type(e).__name__}: {e}{where}"
    rank = launched_rank()
    return f"error: {'' if rank is None else f'rank {rank}: '}{' '.join(text.splitlines())}"


TRACEBACK_ENV = "LLMC_TRACEBACK"       # =1: an internal error prints its full traceback too
AGREED_ERROR_WAIT_S = 10               # how long a quiet rank waits for rank 0 to end the job (then it does)


def debugger_attached():
    """Whether a debugger traces this process (pdb, and the debuggers of IDEs, set a trace
    function; Python 3.12's sys.monitoring has a tool id for debuggers)."""
    monitoring = getattr(sys, "monitoring", None)
    return sys.gettrace() is not None or (monitoring is not None and
                                          monitoring.get_tool(monitoring.DEBUGGER_ID) is not None)


def run_main(fn, args, errors=(InputError,)):
    """Run fn(args) as a command and return the exit code: fn's own if it returns an int (e.g.
    gpt2_cuda.py --check), else 0; 1 with one `error:` line on stderr for bad input (any of
    `errors`), a failed write (OSError: disk full, permissions; atomic_write leaves no temporary
    file), or any other exception (error_line); 130 on Ctrl-C. Under mpiexec any of these on one
    rank ends every rank within seconds (MPI_Abort), so no rank waits forever in a collective.
    For a learner's debugging: pdb's `q` (bdb.BdbQuit) passes through, and so does an internal
    error while a debugger is attached (pdb's post-mortem then stops where it was raised);
    `--traceback` or LLMC_TRACEBACK=1 prints an internal error's full traceback before its line.
    Bad input stays one line."""
    restore_ctrl_c()                                       # from here on Ctrl-C is KeyboardInterrupt, caught below
    if hasattr(sys.stdout, "reconfigure"):                 # a terminal that cannot show a sampled
        sys.stdout.reconfigure(errors="replace")           # character gets '?', not an error
    expected = errors + (OSError,)
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):   # non-finite values are checked, not warned
            result = fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        abort_all_ranks(130)
        return 130
    except bdb.BdbQuit:                                     # pdb's q: the debugger ends the program
        raise
    except Exception as e:                                  # noqa: BLE001: every exception is one line
        if not isinstance(e, expected) and debugger_attached():
            raise                                           # to the debugger's post-mortem
        if not isinstance(e, expected) and (getattr(args, "traceback", False) or os.environ.get(TRACEBACK_ENV) == "1"):
            traceback.print_exc()
        if isinstance(e, AgreedError) and launched_rank() not in (None, 0):
            time.sleep(AGREED_ERROR_WAIT_S)                 # rank 0 says it and ends the job meanwhile
        else:
            print(error_line(e, expected), file=sys.stderr)
        abort_all_ranks(1)
        return 1
    finally:
        release_directory_locks()
    return result if type(result) is int else 0
