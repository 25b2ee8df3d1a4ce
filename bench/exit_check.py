"""Cost of --exit-signal-handler / --exit-duration-in-mins: the per-iteration agreement (one asynchronous all_reduce
of two integers over the world group, posted before the iteration and read after it,
`megatron.training.exit_conditions`) against the step time of the default job.

    .venv/bin/python bench/exit_check.py [--iters 20 --rounds 3 --calls 200]

Protocol: the default CPU job of examples/ds_pretrain_gpt2.sh (8 gloo processes, (tp, pp, dp) = (2, 2, 2),
GPT-2 with 4 layers, hidden 64, 4 heads, seq 64, micro-batch 4 x gas 2, ZeRO-1, fp32, dropout on), one thread
per process. After 3 warm-up iterations, rounds alternate: --iters training iterations with the exit checks
on (signal handler and a time limit that does not expire) and --iters with them off. Prints the median step
time of each side and their ratio (noise on shared cores), and the cost: the time the training loop spends
blocked in the agreement (`ExitConditions.blocked_s`: posting it and waiting for it), per iteration and as a
share of the step (target < 1%), the largest over ranks. For comparison, --calls agreements back to back, each
waited for at once (the synchronous form: mostly the wait for 8 processes to be scheduled on shared cores).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch.distributed as dist

from _default_job import DefaultJob  # bench/ is on the path when a script runs
from harness.spawn import run_on_ranks


def _bench(data: dict, iters: int, rounds: int, calls: int) -> dict:
    from megatron.training.exit_conditions import ExitConditions
    job = DefaultJob(data, 3 + 2 * rounds * iters)
    on, off = ExitConditions(True, 10 ** 6), ExitConditions(False, None)
    job.train(3, off)
    with_checks, without = [], []
    for _ in range(rounds):
        with_checks.append(job.train(iters, on))
        without.append(job.train(iters, off))
    blocked = on.blocked_s / (rounds * iters)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        on.reason()
    per_call = (time.perf_counter() - start) / calls
    on.close()
    worst = [None] * dist.get_world_size()
    dist.all_gather_object(worst, blocked)
    return dict(step_on=statistics.median(with_checks), step_off=statistics.median(without), per_call=per_call,
                blocked=max(worst))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=200)
    opts = p.parse_args()
    from harness.example_data import build_data
    data = build_data(tempfile.mkdtemp(prefix="bench_exit_"), max_mb=1.0, vocab_size=2048)
    r = run_on_ranks(_bench, 8, data, opts.iters, opts.rounds, opts.calls)
    print(f"default CPU job, 8 processes (2, 2, 2); median of {opts.rounds} rounds of {opts.iters} iterations")
    print(f"step time: exit checks on {1e3 * r['step_on']:.1f} ms | off {1e3 * r['step_off']:.1f} ms | "
          f"ratio on/off {r['step_on'] / r['step_off']:.3f}")
    print(f"agreement, time the loop is blocked (post + wait, worst rank): {1e3 * r['blocked']:.3f} ms per "
          f"iteration = {100 * r['blocked'] / r['step_off']:.2f}% of the step (target < 1%)")
    print(f"for comparison, synchronous (post and wait at once, back to back): {1e3 * r['per_call']:.3f} ms per "
          f"call = {100 * r['per_call'] / r['step_off']:.2f}% of the step")


if __name__ == "__main__":
    main()
