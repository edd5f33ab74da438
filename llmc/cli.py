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
import codecs
import os
import sys

from llmc.checkpoint import checkpoint_paths, latest_checkpoint_step, write_done_marker
from llmc.dataloader import DataLoader
from llmc.evalloader import evaluate_multiple_choice, read_hellaswag
from llmc.logger import Logger
from llmc.paths import DEFAULT_HELLASWAG, DEFAULT_TOKENIZER, DEFAULT_TRAIN, DEFAULT_VAL
from llmc.tokenizer import GPT2_EOT, Tokenizer, gpt2_encoding
from llmc.utils import InputError

SAMPLE_SEED = 1337                     # llm.c's sampler seed (--sample-seed)


# ----------------------------------------------------------------------------
# the flags

def build_parser(prog, description, lr_schedules):
    """The trainers' argparse parser: llm.c's one-letter flags, each with a long alias. -h is
    HellaSwag in llm.c, so help is --help only. lr_schedules: the names -k accepts (the trainer's
    learning_rate_at implements them). gpt2_cuda.py adds its GPU flags to this parser."""
    p = argparse.ArgumentParser(prog=prog, add_help=False, description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--help", action="help", help="show this help and exit")
    a("-i", "--input-bin", default=DEFAULT_TRAIN, help="train data: file or glob of shards")
    a("-j", "--input-val-bin", default=DEFAULT_VAL, help="validation data: file or glob ('' for none)")
    a("-e", "--model", default="d4", help="checkpoint .bin to start from, or a descriptor (d2 d4 d6 d12 d24 d36 d48, 124M ...)")
    a("-o", "--output-dir", default=None, help="directory for main.log and checkpoints")
    a("-b", "--batch-size", type=int, default=4, help="micro-batch size B (sequences)")
    a("-t", "--seq-len", type=int, default=64, help="sequence length T (tokens)")
    a("-d", "--total-batch-size", type=int, default=-1, help="tokens per optimizer step (-1: B*T*processes, no accumulation)")
    a("-x", "--max-steps", type=int, default=400, help="optimizer steps (-1: one epoch of the train data)")
    a("-k", "--lr-schedule", default="cosine", choices=lr_schedules, help="learning-rate schedule")
    a("-l", "--learning-rate", type=float, default=3e-4, help="peak learning rate")
    a("-u", "--warmup-iters", type=int, default=0, help="linear warmup steps")
    a("-q", "--final-lr-frac", type=float, default=0.0, help="final learning rate as a fraction of the peak")
    a("-c", "--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    a("-v", "--val-every", type=int, default=100, help="validation loss every N steps (0: never)")
    a("-m", "--val-max-steps", type=int, default=20, help="batches per validation (-1: whole split)")
    a("-s", "--sample-every", type=int, default=100, help="print a generated sample every N steps (0: never)")
    a("-g", "--gen-tokens", type=int, default=64, help="tokens per generated sample")
    a("-n", "--checkpoint-every", type=int, default=0, help="write a checkpoint every N steps and at the end (0: never; needs -o)")
    a("-y", "--resume", type=int, default=0, choices=(0, 1), help="1: resume from the newest complete checkpoint in -o")
    a("-a", "--overfit-single-batch", type=int, default=0, choices=(0, 1), help="1: train on the first batch only")
    a("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    a("--shuffle", type=int, default=0, choices=(0, 1), help="1: shuffle the train shards and batches (seeded)")
    a("--seed", type=int, default=42, help="seed for the random init and the loader shuffle")
    a("--tokenizer", default=DEFAULT_TOKENIZER, help="tokenizer .bin for printing samples")
    a("-h", "--hellaswag", type=int, default=0, choices=(0, 1), help="1: HellaSwag accuracy every -v steps")
    a("--hellaswag-file", default=DEFAULT_HELLASWAG, help="multiple-choice eval file (dev/data/hellaswag.py)")
    a("--eval-only", action="store_true", help="evaluate -e once (val loss, HellaSwag with -h 1) and exit")
    a("--generate", type=int, default=0, metavar="N", help="sample N tokens from -e after --prompt and exit")
    a("--prompt", default="", help="text to continue with --generate ('' starts from <|endoftext|>)")
    a("--temperature", type=float, default=1.0, help="sampling temperature (--generate)")
    a("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0: all)")
    a("--sample-seed", type=int, default=SAMPLE_SEED, help="seed of the sampler's xorshift RNG")
    return p


def is_checkpoint_path(spec):
    """-e names a file (a .bin or a path) rather than a descriptor such as d12."""
    return spec.endswith(".bin") or os.path.sep in spec


# ----------------------------------------------------------------------------
# --generate: a prompt in, sampled text streamed out

def sample_from_prompt(args, generate):
    """--generate N: encode --prompt, then stream N sampled tokens to stdout as they come (bytes
    are decoded incrementally, so a character split across tokens prints whole).
    generate(prompt ids, n, on_token) -> ids runs the trainer's sampler. Returns the ids."""
    tokenizer = Tokenizer(args.tokenizer)
    prompt = gpt2_encoding().encode(args.prompt, allowed_special="all") if args.prompt else [tokenizer.eot_token]
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
        self.args, self.comm = args, comm
        self.master = comm.rank == 0
        self.B, self.T = args.batch_size, args.seq_len
        if self.B <= 0 or self.T <= 0:
            raise InputError(f"batch size and sequence length must be positive (got -b {self.B} -t {self.T})")
        if args.resume and not args.output_dir and not args.generate:
            raise InputError("-y 1 needs -o DIR to find the checkpoint in")
        self.resuming = bool(args.resume) and not args.eval_only and not args.generate
        self.resume_step = latest_checkpoint_step(args.output_dir) if self.resuming else None
        if self.resuming and self.resume_step is None:
            raise InputError(f"{args.output_dir}: no complete checkpoint (DONE_* marker) to resume from")
        self.start_step = 0

    def say(self, *parts, **kwargs):
        """print() on rank 0 only."""
        if self.master:
            print(*parts, **kwargs)

    def model_spec(self):
        """Where the model comes from: the checkpoint being resumed (its shape too), else -e."""
        if self.resuming:
            return checkpoint_paths(self.args.output_dir, self.resume_step, self.comm.rank)[0]
        return self.args.model

    def prepare(self, config):
        """Everything that needs the model's shape: checks T, works out gradient accumulation,
        opens the loaders and the HellaSwag file, loads the tokenizer for samples."""
        args, comm, B, T = self.args, self.comm, self.B, self.T
        if T > config.max_seq_len:
            raise InputError(f"-t {T} exceeds the model's max_seq_len {config.max_seq_len}")
        tokens_per_micro = B * T * comm.size
        self.total_batch = args.total_batch_size if args.total_batch_size > 0 else tokens_per_micro
        if self.total_batch % tokens_per_micro:
            raise InputError(f"-d {self.total_batch} is not a multiple of B*T*processes = {tokens_per_micro}")
        self.grad_accum_steps = self.total_batch // tokens_per_micro
        self.train_loader = DataLoader(args.input_bin, B, T, comm.rank, comm.size, bool(args.shuffle), args.seed)
        self.val_loader = DataLoader(args.input_val_bin, B, T, comm.rank, comm.size) if args.input_val_bin else None
        self.num_steps = args.max_steps if args.max_steps > 0 else self.train_loader.num_tokens // self.total_batch
        if args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
        self.examples = read_hellaswag(args.hellaswag_file) if args.hellaswag else None
        self.sampling = self.master and args.sample_every > 0 and not args.eval_only
        self.tokenizer = None
        if self.sampling:
            try:
                self.tokenizer = Tokenizer(args.tokenizer)
            except InputError as e:
                self.say(f"note: {e}; samples will print token ids")

    def banner(self, config, num_parameters):
        """The model and batch lines every run starts with."""
        self.say(f"model: L={config.num_layers} NH={config.num_heads} C={config.channels} maxT={config.max_seq_len} "
                 f"V={config.vocab_size} Vp={config.padded_vocab_size} | {num_parameters:,} parameters")
        self.say(f"batch: B={self.B} T={self.T} processes={self.comm.size} grad_accum={self.grad_accum_steps} -> "
                 f"{self.total_batch} tokens/step | train {self.train_loader.num_tokens:,} tokens in "
                 f"{len(self.train_loader.files)} shard(s) | {self.num_steps} steps")

    def start(self, start_step=0):
        """Open main.log (appending when resuming) at the step the loop starts from."""
        self.start_step = start_step
        self.logger = Logger(self.args.output_dir if self.master else None, resuming=self.resuming)

    def validate(self, batch_loss):
        """Mean validation loss over -m batches (-1: the whole split), averaged across ranks.
        batch_loss(inputs (B,T), targets (B,T)) -> the batch's mean loss, a float."""
        loader, steps = self.val_loader, self.args.val_max_steps
        loader.reset()
        steps = steps if steps > 0 else loader.shard_num_samples * len(loader.files)
        total = sum(batch_loss(*loader.next_batch()) for _ in range(steps))
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

    def between_steps(self, step, batch_loss, forward_losses, generate, save):
        """The work at the top of step `step` (and after the last): validation loss every -v steps,
        HellaSwag every -v steps, a sample every -s steps, a checkpoint every -n steps, each also at
        the end. generate(prompt ids, n) -> ids; save(step) -> the DONE path it leaves to write.
        Returns True at the last step (the loop ends)."""
        args, last_step = self.args, step == self.num_steps
        if self.val_loader and args.val_every > 0 and (step % args.val_every == 0 or last_step):
            val_loss = self.validate(batch_loss)
            self.say(f"val loss {val_loss:.6f}")
            self.logger.log_val(step, val_loss)
        if self.examples and args.val_every > 0 and ((step > 0 and step % args.val_every == 0) or last_step):
            acc, n = self.hellaswag(forward_losses)
            self.say(f"HellaSwag: {acc:.4f} accuracy over {n} examples")
            self.logger.log_eval(step, acc)
        if self.sampling and ((step > 0 and step % args.sample_every == 0) or last_step):
            self.say("generating:\n---")
            ids = generate([self.tokenizer.eot_token if self.tokenizer else GPT2_EOT], args.gen_tokens)
            self.say(self.tokenizer.decode(ids) if self.tokenizer else " ".join(map(str, ids)))
            self.say("---")
        if args.output_dir and args.checkpoint_every > 0 and step > self.start_step and \
                (step % args.checkpoint_every == 0 or last_step):
            done = save(step)
            self.comm.barrier()
            if self.master:
                write_done_marker(done)
                self.say(f"checkpoint written: step {step} in {args.output_dir}")
        return last_step

    def log_step(self, step, loss, norm, lr, seconds, extra=""):
        """The step line (llm.c's, plus tok/s) and main.log's train line."""
        self.say(f"step {step + 1:4d}/{self.num_steps} | loss {loss:.6f} | norm {norm:.4f} | lr {lr:.2e} | "
                 f"{seconds * 1000:.1f} ms | {self.total_batch / seconds:.0f} tok/s{extra}")
        self.logger.log_train(step, loss, lr, norm)


def run_main(fn, args, errors=(InputError,)):
    """Run fn(args) as a command and return the exit code: fn's own if it returns an int (e.g.
    gpt2_cuda.py --check), else 0; 1 with one `error:` line on stderr for bad input (any of
    `errors`); 130 on Ctrl-C."""
    try:
        result = fn(args)
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return result if type(result) is int else 0
