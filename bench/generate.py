"""Generation throughput with and without the key-value cache (GPT-2, greedy), in the same process.

    .venv/bin/python bench/generate.py [--batch-sizes 1 8 32 --new-tokens 256 --layers 4 --hidden 128]

Protocol: a GPT-2 with random weights (seeded; the numbers do not depend on what it writes), prompts of
random ids with lengths spread over [prompt/2, 3 prompt/2] (left-padded batches), greedy decoding of exactly
--new-tokens tokens per prompt (no early stop). For each batch size: one warm-up generation of 8 tokens per
mode, then the cached and the recomputing runs back to back, every step timed in CPU seconds of this
process (time.process_time: robust to other jobs on shared cores, exact with --threads 1) and in wall
seconds. It prints tokens/s = batch x new tokens / seconds (prefill included) per mode and their ratio,
and the CPU time per step over each quarter of the generated length, with its ratio. Cached: a new token costs
O(1) per layer plus attention over the t cached positions; recomputing reruns all t positions every step,
so its cost per token grows with t and the ratio grows along the generation. Both modes must produce the
same tokens (checked).
"""
from __future__ import annotations

import argparse
import time
from typing import List, Tuple

import torch

from megatron.inference.runners import GPT2Runner
from megatron.model import GPTConfig, GPTModel


def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--prompt", type=int, default=32, help="mean prompt length")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def build_model(opts) -> GPTModel:
    positions = 2 * opts.prompt + opts.new_tokens
    config = GPTConfig(num_layers=opts.layers, hidden_size=opts.hidden, num_attention_heads=opts.heads,
                        vocab_size=opts.vocab, seq_length=positions, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config).eval()


def prompts(batch: int, mean: int, vocab: int, seed: int = 0) -> List[List[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(mean // 2, mean + mean // 2 + 1, (batch,), generator=g)
    return [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]


@torch.no_grad()
def timed_greedy(model, rows, new_tokens: int, use_cache: bool) -> Tuple[torch.Tensor, List[float], float]:
    """Generated ids (b, new_tokens), the CPU time of each step (step 0 includes the prefill), wall seconds."""
    wall, start = time.perf_counter(), time.process_time()
    runner = GPT2Runner(model, rows, new_tokens, pad_id=0, use_cache=use_cache)
    logits, out, times = runner.first(), [], []
    for step in range(new_tokens):
        out.append(logits.argmax(-1))
        if step + 1 < new_tokens:
            logits = runner.next(out[-1])
        now = time.process_time()
        times.append(now - start)
        start = now
    return torch.stack(out, 1), times, time.perf_counter() - wall


def quarters(times: List[float]) -> List[float]:
    """Mean ms per step over each quarter of the generation."""
    n = len(times)
    bounds = [round(n * k / 4) for k in range(5)]
    return [1e3 * sum(times[a:b]) / max(b - a, 1) for a, b in zip(bounds, bounds[1:])]


def main() -> None:
    opts = get_args()
    torch.set_num_threads(opts.threads)
    model = build_model(opts)
    print(f"GPT-2 {opts.layers} layers, hidden {opts.hidden}, vocab {opts.vocab}; prompts ~{opts.prompt} tokens, "
          f"{opts.new_tokens} new tokens, greedy; torch {torch.__version__}, {opts.threads} threads")
    print("tokens/s per CPU second (per wall second in brackets)")
    print(f"{'batch':>5} {'with cache':>18} {'recomputing':>18} {'ratio':>13}   ratio per quarter of the length")
    for batch in opts.batch_sizes:
        rows = prompts(batch, opts.prompt, opts.vocab)
        for use_cache in (True, False):
            timed_greedy(model, rows, 8, use_cache)  # warm-up
        cached, t_cache, wall_cache = timed_greedy(model, rows, opts.new_tokens, True)
        full, t_full, wall_full = timed_greedy(model, rows, opts.new_tokens, False)
        if not torch.equal(cached, full):
            raise SystemExit(f"batch {batch}: cached and recomputed generations differ")
        tokens = batch * opts.new_tokens
        cpu = (tokens / sum(t_cache), tokens / sum(t_full))
        wall = (tokens / wall_cache, tokens / wall_full)
        q_cache, q_full = quarters(t_cache), quarters(t_full)
        print(f"{batch:>5} {cpu[0]:>8.1f} ({wall[0]:>7.1f}) {cpu[1]:>8.1f} ({wall[1]:>7.1f}) "
              f"{cpu[0] / cpu[1]:>5.2f} ({wall[0] / wall[1]:>5.2f})   "
              + "  ".join(f"x{f / c:.2f}" for c, f in zip(q_cache, q_full)), flush=True)
        print(f"{'':>5} CPU ms per step by quarter: with cache " + " ".join(f"{c:.2f}" for c in q_cache)
              + " | recomputing " + " ".join(f"{f:.2f}" for f in q_full), flush=True)


if __name__ == "__main__":
    main()
