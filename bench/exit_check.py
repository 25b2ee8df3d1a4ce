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
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _spawn, beside this script
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))  # tests' corpus

from _spawn import run_on_ranks  # noqa: E402


def _argv(data: dict, iters: int) -> list:
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--gas", "2", "--train-iters", str(iters),
            "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--zero-stage", "1",
            "--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2", "--data-path", data["data_prefix"],
            "--vocab-file", data["vocab"], "--merge-file", data["merges"], "--num-workers", "0",
            "--log-interval", str(10 ** 6), "--eval-iters", "0", "--split", "98,1,1"]


def _bench(data: dict, iters: int, rounds: int, calls: int) -> dict:
    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.logging_utils import TensorBoard
    from megatron.model.specs import spec_for
    from megatron.training.batches import BatchIterator
    from megatron.training.exit_conditions import ExitConditions
    from megatron.training.loop import TrainState, train
    from megatron.training.pretrain import data_loader, initialize_and_build, split_sample_counts
    spec = spec_for("gpt")
    args = parse_args(_argv(data, 3 + 2 * rounds * iters), defaults=ENTRY_DEFAULTS["gpt"], world_size=8)
    engine, tokenizer, cfg, parallel = initialize_and_build(args, spec)
    datasets = spec.datasets(cfg.data, tokenizer, split_sample_counts(cfg.batch, 0))
    batches = BatchIterator(data_loader(datasets[0], 0, cfg, parallel),
                            lambda raw: spec.get_batch(raw, data=cfg.data, tokenizer=tokenizer,
                                                       tp_group=parallel.tp_group))
    state, tb = TrainState(0, 0), TensorBoard(None)
    on, off = ExitConditions(True, 10 ** 6), ExitConditions(False, None)

    def run(n: int, exits: ExitConditions) -> float:
        dist.barrier()
        start = time.perf_counter()
        train(engine, replace(cfg, batch=replace(cfg.batch, train_iters=state.iteration + n)), state, batches,
              None, tb, exits)
        return (time.perf_counter() - start) / n

    run(3, off)
    with_checks, without = [], []
    for _ in range(rounds):
        with_checks.append(run(iters, on))
        without.append(run(iters, off))
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
    from tests.training.conftest import build_data
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
