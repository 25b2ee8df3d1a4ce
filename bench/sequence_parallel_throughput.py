"""Tokens/s of the default CPU job with and without --sequence-parallel, as a ratio measured in one run.

    .venv/bin/python bench/sequence_parallel_throughput.py [--rounds 3] [--iters 40] [--log-interval 10]

The default job is examples/ds_pretrain_gpt2.sh on CPU: GPT-2 with 4 layers, hidden 64, 4 heads, sequence 64,
micro-batch 4, gas 2, (tp, pp, dp) = (2, 2, 2) on 8 gloo processes, ZeRO-1, dropout 0.1, on a corpus built
as the test suite builds it (1 MB of stdlib docstrings, BPE vocabulary 2048).
Protocol: --rounds rounds, each running the job without then with --sequence-parallel (the order alternates
every round so machine drift hits both) for --iters iterations; tokens/s is the framework's own log line
(the mean of each --log-interval interval), the first interval of each run dropped as warm-up. Each round's
ratio is the median of its SP run's intervals over the median of its run without; the gate's figure is the
median of the rounds' ratios (the two runs of a round are back to back, so load from other jobs that changes
between rounds cancels). Also printed: each side's median over all rounds and their ratio. The issue's gate:
>= 0.95.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))  # tests' corpus

from _spawn import run_on_ranks  # noqa: E402  (bench/ is on the path when a script runs)

TOKENS = re.compile(r"\| ([0-9.]+) tokens/s \|")


def job_argv(data: dict, iters: int, log_interval: int) -> list:
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--gas", "2", "--train-iters", str(iters),
            "--lr", "2e-3", "--min-lr", "2e-4", "--lr-warmup-iters", "5", "--lr-decay-style", "cosine",
            "--clip-grad", "1.0", "--zero-stage", "1", "--tensor-model-parallel-size", "2",
            "--pipe-parallel-size", "2", "--data-path", data["data_prefix"], "--vocab-file", data["vocab"],
            "--merge-file", data["merges"], "--tokenizer-type", "GPT2BPETokenizer", "--num-workers", "0",
            "--log-interval", str(log_interval), "--eval-iters", "0", "--eval-interval", str(10 ** 6),
            "--split", "98,1,1"]


def rank_run(argv: list) -> list:
    """pretrain on this rank with its output captured; every rank returns the logged tokens/s values."""
    import torch.distributed as dist

    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import pretrain
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain(parse_args(argv, defaults=ENTRY_DEFAULTS["gpt"], world_size=dist.get_world_size()), spec_for("gpt"))
    values = [float(v) for v in TOKENS.findall(out.getvalue())]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    return max(everyone, key=len)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    opts = p.parse_args()
    from tests.training.conftest import build_data
    with tempfile.TemporaryDirectory() as tmp:
        data = build_data(tmp, max_mb=1.0, vocab_size=2048)
        argv = job_argv(data, opts.iters, opts.log_interval)
        seen, ratios = {False: [], True: []}, []
        for r in range(opts.rounds):
            medians = {}
            for sp in ((False, True) if r % 2 == 0 else (True, False)):
                values = run_on_ranks(rank_run, 8, argv + (["--sequence-parallel"] if sp else []))
                seen[sp] += values[1:]
                medians[sp] = statistics.median(values[1:])
                print(f"round {r} SP {'on ' if sp else 'off'}: tokens/s per interval {[round(v) for v in values]}",
                      flush=True)
            ratios.append(medians[True] / medians[False])
            print(f"round {r} ratio SP / no SP {ratios[-1]:.3f}", flush=True)
    off, on = statistics.median(seen[False]), statistics.median(seen[True])
    print(f"default job (tp, pp, dp) = (2, 2, 2), 8 CPU processes: without SP {off:.0f} tokens/s, with SP "
          f"{on:.0f} tokens/s (medians over all rounds, ratio {on / off:.3f}); median of the rounds' ratios "
          f"{statistics.median(ratios):.3f} (gate >= 0.95)")


if __name__ == "__main__":
    main()
