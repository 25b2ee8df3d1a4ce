"""Cost of --check-replicas-interval N (`megatron.training.replicas`): one replica check against the step time of
the default job, and what it adds per iteration at N = 100.

    .venv/bin/python bench/replica_check.py [--iters 10 --checks 20 --zero-stage 1]

Protocol: the default CPU job of examples/ds_pretrain_gpt2.sh (8 gloo processes, (tp, pp, dp) = (2, 2, 2),
GPT-2 with 4 layers, hidden 64, 4 heads, seq 64, micro-batch 4 x gas 2, fp32, dropout on), ZeRO-1 by default
(the check covers the parameters) or --zero-stage 0 (the parameters and Adam's two states). After 3 warm-up
iterations: --iters training iterations, timed (the step), then --checks replica checks back to back, each timed
after a barrier (the check: fingerprints, the all_gather over the data-parallel group, the verdicts over the
world). Prints the medians, the worst rank's, and the cost at N = 100: check / (100 x step) (target < 1%).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch.distributed as dist

from _default_job import DefaultJob  # bench/ is on the path when a script runs
from harness.spawn import run_on_ranks


def _bench(data: dict, iters: int, checks: int, zero_stage: int) -> dict:
    from megatron.training.exit_conditions import ExitConditions
    from megatron.training.loop import check_replicas_now
    from megatron.training.replicas import optimizer_state_replicated, replicated_tensors
    job = DefaultJob(data, 3 + iters, zero_stage)
    exits = ExitConditions(False, None)
    job.train(3, exits)
    step = job.train(iters, exits)
    times = []
    for _ in range(checks):
        dist.barrier()
        start = time.perf_counter()
        check_replicas_now(job.engine, job.cfg, job.state, "bench")
        times.append(time.perf_counter() - start)
    replicated = optimizer_state_replicated(job.engine, job.cfg.layout.ds_zero_stage)
    tensors = list(replicated_tensors(job.engine.module, job.engine.optimizer, replicated))
    mine = dict(step=step, check=statistics.median(times), tensors=len(tensors),
                elements=sum(t.numel() for _, t in tensors))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return dict(step=statistics.median(r["step"] for r in every), check=max(r["check"] for r in every),
                tensors=max(r["tensors"] for r in every), elements=max(r["elements"] for r in every))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--checks", type=int, default=20)
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1))
    opts = p.parse_args()
    from harness.example_data import build_data
    data = build_data(tempfile.mkdtemp(prefix="bench_replicas_"), max_mb=1.0, vocab_size=2048)
    r = run_on_ranks(_bench, 8, data, opts.iters, opts.checks, opts.zero_stage)
    print(f"default CPU job, 8 processes (2, 2, 2), ZeRO stage {opts.zero_stage}: {r['tensors']} tensors, "
          f"{r['elements']:,} elements checked per rank (the most of any rank)")
    print(f"step time (median over ranks of {opts.iters} iterations): {1e3 * r['step']:.1f} ms")
    print(f"one replica check (median of {opts.checks}, worst rank): {1e3 * r['check']:.2f} ms = "
          f"{100 * r['check'] / r['step']:.2f}% of a step")
    print(f"--check-replicas-interval 100: {100 * r['check'] / (100 * r['step']):.4f}% of the step time "
          f"(target < 1%)")


if __name__ == "__main__":
    main()
