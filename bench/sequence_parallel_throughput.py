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

Where the time goes, also printed per run: the collectives rank 0 called per iteration (torch.distributed's, by
name: the tensor-parallel ones of the layers, ZeRO's and the loss's) and the CPU seconds of all 8 processes
(`time.process_time`, every thread, for the whole run: waiting costs none). Sequence parallelism moves the bytes
of the all-reduce it replaces but in two collectives (a reduce-scatter after each row-parallel linear, an
all-gather before each column-parallel one, the LayerNorm between them), so where each collective costs a fixed
latency, as gloo's ~1 ms on 2 shared cores, the count shows in the wall time and not in the CPU time.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import re
import statistics
import tempfile
import time

from harness.spawn import run_on_ranks

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


COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather",
               "reduce_scatter", "broadcast")


def count_collectives() -> collections.Counter:
    """Count this process's calls of torch.distributed's collectives from now on, by name (callers look them up
    on the module at each call, as `dist.all_reduce(...)`)."""
    import torch.distributed as dist
    counts = collections.Counter()
    for name in COLLECTIVES:
        def counted(*args, _call=getattr(dist, name), _name=name, **kwargs):
            counts[_name] += 1
            return _call(*args, **kwargs)
        setattr(dist, name, counted)
    return counts


def rank_run(argv: list) -> tuple:
    """pretrain on this rank with its output captured. Returns (the logged tokens/s values, rank 0's collectives
    per iteration by name, the CPU seconds of all ranks)."""
    import torch.distributed as dist

    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import pretrain
    args = parse_args(argv, defaults=ENTRY_DEFAULTS["gpt"], world_size=dist.get_world_size())
    out, counts, cpu = io.StringIO(), count_collectives(), time.process_time()
    with contextlib.redirect_stdout(out):
        pretrain(args, spec_for("gpt"))
    cpu = time.process_time() - cpu
    per_iter = {name: n / args.train_iters for name, n in counts.items()}
    values = [float(v) for v in TOKENS.findall(out.getvalue())]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (values, cpu))
    return max((v for v, _ in everyone), key=len), per_iter, sum(c for _, c in everyone)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--log-interval", type=int, default=10)
    opts = p.parse_args()
    from harness.example_data import build_data
    with tempfile.TemporaryDirectory() as tmp:
        data = build_data(tmp, max_mb=1.0, vocab_size=2048)
        argv = job_argv(data, opts.iters, opts.log_interval)
        seen, ratios = {False: [], True: []}, []
        for r in range(opts.rounds):
            medians, cpus = {}, {}
            for sp in ((False, True) if r % 2 == 0 else (True, False)):
                values, per_iter, cpu = run_on_ranks(rank_run, 8, argv + (["--sequence-parallel"] if sp else []))
                seen[sp] += values[1:]
                cpus[sp] = cpu
                medians[sp] = statistics.median(values[1:])
                calls = ", ".join(f"{name} {n:g}" for name, n in sorted(per_iter.items()))
                print(f"round {r} SP {'on ' if sp else 'off'}: tokens/s per interval {[round(v) for v in values]}; "
                      f"collectives per iteration on rank 0: {sum(per_iter.values()):g} ({calls}); CPU of all ranks "
                      f"{cpu:.1f} s", flush=True)
            ratios.append(medians[True] / medians[False])
            print(f"round {r} ratio SP / no SP {ratios[-1]:.3f}, CPU seconds SP / no SP "
                  f"{cpus[True] / cpus[False]:.3f}", flush=True)
    off, on = statistics.median(seen[False]), statistics.median(seen[True])
    print(f"default job (tp, pp, dp) = (2, 2, 2), 8 CPU processes: without SP {off:.0f} tokens/s, with SP "
          f"{on:.0f} tokens/s (medians over all rounds, ratio {on / off:.3f}); median of the rounds' ratios "
          f"{statistics.median(ratios):.3f} (gate >= 0.95)")


if __name__ == "__main__":
    main()
