"""What each sequence-parallel collective costs on gloo beside the all-reduce it replaces, per call.

    .venv/bin/python bench/probes/sequence_collectives.py [--world 2] [--reps 300] [--hidden 64]

One activation of the default job, (b, s, h) = (4, 64, hidden) fp32, on --world gloo processes (one thread
each). Protocol: every rep runs each operation once, in a fixed order, each after a barrier (interleaved, so
load from other jobs hits all alike); 3 warm-up reps; prints the median and quartiles of each over --reps reps.
Operations: torch's all_reduce of (b, s, h) (what tensor parallelism runs), torch's all_gather (list, then
concatenated along s) and reduce_scatter (list) and reduce_scatter_tensor, and the sequence mappings of
megatron/mpu/mappings.py (all-to-alls on CPU) with the same inputs and outputs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from harness.spawn import run_on_ranks


def measure(reps: int, hidden: int) -> dict:
    from megatron.mpu import mappings
    world = dist.get_world_size()
    b, s, h = 4, 64, hidden
    n = s // world
    group = dist.group.WORLD
    full, part = torch.randn(b, s, h), torch.randn(b, n, h)

    def all_reduce():
        dist.all_reduce(full.clone())

    def torch_all_gather():
        parts = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(parts, part)
        torch.cat(parts, 1)

    def torch_reduce_scatter():
        out = torch.empty_like(part)
        dist.reduce_scatter(out, [c.contiguous() for c in full.split(n, 1)])

    def torch_reduce_scatter_tensor():
        out = torch.empty_like(part)
        dist.reduce_scatter_tensor(out, full.view(b, world, n, h).transpose(0, 1).reshape(world * b, n, h))

    ops = {"all_reduce (b, s, h)": all_reduce, "torch all_gather + cat": torch_all_gather,
           "torch reduce_scatter": torch_reduce_scatter, "torch reduce_scatter_tensor": torch_reduce_scatter_tensor,
           "mappings all-gather": lambda: mappings._gather_seq(part, group),
           "mappings reduce-scatter": lambda: mappings._reduce_scatter_seq(full, group),
           "mappings re-gather + reduce-scatter": lambda: mappings.gather_and_reduce_scatter_seq(
               part, lambda: full, group)}
    times = {name: [] for name in ops}
    for rep in range(reps + 3):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            if rep >= 3:
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=64)
    opts = p.parse_args()
    times = run_on_ranks(measure, opts.world, opts.reps, opts.hidden)
    print(f"{opts.world} gloo processes, (b, s, h) = (4, 64, {opts.hidden}) fp32, rank 0, {opts.reps} interleaved "
          f"reps: median (quartiles) ms")
    for name, values in times.items():
        q1, _, q3 = statistics.quantiles(values, n=4)
        print(f"  {name:38s} {statistics.median(values) * 1e3:7.3f}  ({q1 * 1e3:.3f}, {q3 * 1e3:.3f})")


if __name__ == "__main__":
    main()
