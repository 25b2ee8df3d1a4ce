"""Cost of a flag in tokens/s against the same job without it: --layout-invariant (tds/pipe/fixed_order.py; also its
gradient buffers) or --keyed-dropout (megatron/model/rng.py's keyed masks).

    .venv/bin/python bench/flag_cost.py [--flag=--keyed-dropout --zero-stage 1 --iters 10 --rounds 2]

Protocol: the default CPU job of examples/ds_pretrain_gpt2.sh (8 gloo processes, (tp, pp, dp) = (2, 2, 2), GPT-2
with 4 layers, hidden 64, 4 heads, seq 64, micro-batch 4 x gas 2, fp32, dropout on) at --zero-stage (0 by default;
--layout-invariant runs at 0 and 1). Each round trains it once without and once with the flag (a fresh job each, in that
order): 3 warm-up iterations, then --iters timed ones. Prints the median step time over ranks of each run, the ratio
of the rounds' medians (with / without), and for --layout-invariant the bytes of partial sums it holds besides the
gradients (the most of any rank, counted on the tensors themselves) next to the gradients' own bytes.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile

import torch.distributed as dist

from _default_job import DefaultJob  # bench/ is on the path when a script runs
from harness.spawn import run_on_ranks

TOKENS_PER_STEP = 4 * 2 * 2 * 64  # micro-batch x gas x dp x seq


def _bench(data: dict, iters: int, zero_stage: int, flags: tuple) -> dict:
    from megatron.training.exit_conditions import ExitConditions
    job = DefaultJob(data, 3 + iters, zero_stage=zero_stage, extra=flags)
    exits = ExitConditions(False, None)
    job.train(3, exits)
    step = job.train(iters, exits)
    fixed = job.engine.fixed
    grads = sum(p.numel() * p.element_size() for p in job.engine.module.parameters() if p.requires_grad)
    mine = dict(step=step, held=fixed.peak_bytes if fixed is not None else 0, grads=grads)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return dict(step=statistics.median(r["step"] for r in every), held=max(r["held"] for r in every),
                grads=max(r["grads"] for r in every))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--flag", default="--layout-invariant", choices=("--layout-invariant", "--keyed-dropout"))
    p.add_argument("--zero-stage", type=int, default=0, choices=(0, 1))
    opts = p.parse_args()
    from harness.example_data import build_data
    data = build_data(tempfile.mkdtemp(prefix="bench_flag_"), max_mb=1.0, vocab_size=2048)
    plain, fixed = [], []
    for r in range(opts.rounds):
        plain.append(run_on_ranks(_bench, 8, data, opts.iters, opts.zero_stage, ()))
        fixed.append(run_on_ranks(_bench, 8, data, opts.iters, opts.zero_stage, (opts.flag,)))
        print(f"round {r + 1}: step {1e3 * plain[-1]['step']:.1f} ms without, {1e3 * fixed[-1]['step']:.1f} ms with "
              f"{opts.flag}")
    a, b = statistics.median(x["step"] for x in plain), statistics.median(x["step"] for x in fixed)
    print(f"default CPU job, 8 processes (2, 2, 2), ZeRO stage {opts.zero_stage}, fp32: {TOKENS_PER_STEP / a:.0f} "
          f"tokens/s without, {TOKENS_PER_STEP / b:.0f} with {opts.flag}: {100 * (1 - a / b):.1f}% fewer tokens/s "
          f"(step time x {b / a:.3f})")
    if opts.flag != "--layout-invariant":
        return
    held, grads = fixed[-1]["held"], fixed[-1]["grads"]
    print(f"partial sums held at most: {held / 2 ** 20:.2f} MiB per rank, {held / grads:.2f} x the rank's "
          f"{grads / 2 ** 20:.2f} MiB of gradients (gas 2)")


if __name__ == "__main__":
    main()
