"""
dev/bench_generate.py: tokens per second of gpt2_cpu.generate with the KV cache against the full
recompute it replaced (issue 12: 1,100 tokens from a d2 checkpoint did not finish in 5 minutes).

Measures, in the same run, for a random-init model (-e, default d2) and each token count of -n:
  1. generate with the KV cache (the default): the whole run, timed; its tokens/s overall, and
     separately for the tokens that fit in maxT (one row each through the model) and for those
     after the context slides (each a prefill of the last maxT tokens: the cache cannot shift,
     see gpt2_cpu.generate);
  2. generate with kv_cache=False, the full forward over a fixed window of
     min(maxT, prompt + n) tokens for every token: only its first --full-tokens tokens are timed
     (stopped from on_token), since every step costs the same (the window is fixed); its time for
     all n tokens is extrapolated from that, and printed as such;
and the ratio of the two tokens/s, after checking that both drew the same tokens (the same seed).
The prompt is one <|endoftext|> token, as -s samples and --generate without --prompt start.

Run:  python dev/bench_generate.py [-e d2] [-n 256,1100] [--full-tokens 64] [--seed 1337]
Prints one block per token count; numbers depend on the machine (2 CPU cores: about 2 minutes).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gpt2_cpu as g  # noqa: E402
from llmc.cli import ArgumentParser, run_main  # noqa: E402
from llmc.tokenizer import GPT2_EOT  # noqa: E402


class Stop(Exception):
    """Raised from on_token to end a timed prefix of a generate run."""


def timed_generate(model, n, seed, kv_cache, stop_after=None):
    """generate(model, [EOT], n, SamplerRNG(seed), kv_cache=...) -> (ids, the time (s) after each
    token since the start). With stop_after, the run ends after that many tokens."""
    ids, times = [], []
    t0 = time.perf_counter()

    def on_token(token):
        ids.append(token)
        times.append(time.perf_counter() - t0)
        if stop_after is not None and len(ids) >= stop_after:
            raise Stop
    try:
        g.generate(model, [GPT2_EOT], n, g.SamplerRNG(seed), on_token=on_token, kv_cache=kv_cache)
    except Stop:
        pass
    return ids, times


def main(argv=None):
    p = ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("-e", "--model", default="d2", help="model descriptor for a random-init gpt2_init")
    p.add_argument("-n", "--tokens", default="256,1100", help="comma-separated counts of new tokens")
    p.add_argument("--full-tokens", type=int, default=64, help="tokens timed on the full-recompute path")
    p.add_argument("--seed", type=int, default=1337, help="sampler seed (both paths)")
    args = p.parse_args(argv)
    return run_main(benchmark, args)          # an unknown -e: one `error:` line, exit 1


def benchmark(args):
    """Time both paths for each count of -n; 0 if they draw the same tokens, else 1."""
    cfg = g.config_from_descriptor(args.model)
    model = g.gpt2_init(cfg, 42)
    maxT = cfg.max_seq_len
    print(f"model: {args.model} random init, L={cfg.num_layers} NH={cfg.num_heads} C={cfg.channels} maxT={maxT} "
          f"| prompt: 1 token | {os.cpu_count()} CPU cores")
    timed_generate(model, 4, args.seed, True)                     # warm-up: BLAS threads, allocations
    timed_generate(model, 4, args.seed, False)
    ok = True
    for n in [int(s) for s in args.tokens.split(",")]:
        ids, times = timed_generate(model, n, args.seed, True)
        k = min(n, args.full_tokens)
        full_ids, full_times = timed_generate(model, n, args.seed, False, stop_after=k)
        same = full_ids == ids[:k]
        ok &= same
        cached_rate, full_rate = n / times[-1], k / full_times[-1]
        fit = min(n, maxT - 1)                                    # tokens generated before the context slides
        print(f"\n{n} new tokens (window of the full path: {min(maxT, 1 + n)} tokens)")
        print(f"  KV cache:       {n:5d} tokens in {times[-1]:8.2f} s  {cached_rate:8.1f} tok/s")
        if n > fit:
            slide = n - fit
            print(f"    of which      {fit:5d} tokens in {times[fit - 1]:8.2f} s  {fit / times[fit - 1]:8.1f} tok/s"
                  f"  (the context fits maxT: one row per token)")
            print(f"    and           {slide:5d} tokens in {times[-1] - times[fit - 1]:8.2f} s  "
                  f"{slide / (times[-1] - times[fit - 1]):8.1f} tok/s  (sliding: a prefill of {maxT} tokens each)")
        extrapolated = "" if k == n else f", {n} tokens extrapolated: {n / full_rate:.1f} s"
        print(f"  full recompute: {k:5d} tokens in {full_times[-1]:8.2f} s  {full_rate:8.1f} tok/s"
              f"  (first {k} of {n} timed{extrapolated})")
        print(f"  ratio: {cached_rate / full_rate:.1f}x tokens/s | same tokens as the full path "
              f"(first {k}): {'yes' if same else 'NO'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
