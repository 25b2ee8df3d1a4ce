"""The engine's own cost per pipeline instruction: TDS's PipelineEngine against DeepSpeed's, with empty layers.

Protocol: p = 2 processes (gloo, 1 intra-op thread each), m micro-batches of one (1, 8) float row through
layers y = x * w (one scalar weight each, so that backward and the optimizer have something to do and the
layers themselves cost next to nothing); every engine built side by side, `--warmup` steps each, then
`--steps` steps alternating between the engines, each between barriers. Printed per engine, on stage 0:

    per instruction = median step time / instructions of stage 0's list (TDS: `train_schedule`; DeepSpeed:
                      the commands of its TrainSchedule), in microseconds
    CPU per instr.  = median CPU time of the stage-0 process over a step (`time.process_time`: every thread,
                      gloo's included; waiting costs none) / the same count: what the engine itself spends,
                      which load on a shared machine changes less than the wall time

and the ratio to DeepSpeed's 1F1B. What remains is Python and gloo: the instruction loop, the point-to-point
set-up and headers, DeepSpeed's forward/backward hooks and the optimizer step (one per batch, shared by all).
`--profile` prints the functions where TDS's 1F1B spends its time on stage 0 (cProfile, own time).

    .venv/bin/python bench/pipeline_overhead.py [--steps 60 --micro-batches 8 --profile]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn as nn

from harness.spawn import run_on_ranks

P, HIDDEN, LAYERS = 2, 8, 4


class Scale(nn.Module):
    """y = x * w, w a scalar: an (almost) empty layer (b, h) -> (b, h)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x * self.w


def mse(out, label):
    return ((out - label) ** 2).mean()


def build(name: str, m: int):
    """`name`: 'deepspeed' or 'tds <schedule>'."""
    import deepspeed

    import tds
    lib = deepspeed if name == "deepspeed" else tds
    model = lib.pipe.PipelineModule([lib.pipe.LayerSpec(Scale) for _ in range(LAYERS)], num_stages=P, loss_fn=mse,
                                    partition_method="uniform")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m, "train_batch_size": m,
           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0}}
    if name != "deepspeed":
        cfg["pipeline"] = {"schedule": name.split()[1]}
    engine, _, _, _ = lib.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                     config=cfg)
    return engine


def instructions(name: str, m: int, stage: int) -> int:
    if name == "deepspeed":
        from deepspeed.runtime.pipe.schedule import TrainSchedule
        return sum(len(cmds) for cmds in TrainSchedule(micro_batches=m, stages=P, stage_id=stage).steps())
    from tds.pipe.instructions import train_schedule
    return len(train_schedule(name.split()[1], P, stage, m, 1))


def data():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(1, HIDDEN, generator=g), torch.randn(1, HIDDEN, generator=g)


def step(engine, it) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one train_batch."""
    import torch.distributed as dist
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    engine.train_batch(it)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    dist.barrier()
    return wall, cpu


def run(args) -> dict | None:
    import torch.distributed as dist
    names = [f"tds {s}" for s in args.schedules] + ["deepspeed"]
    engines = {name: build(name, args.micro_batches) for name in names}
    its = {name: data() for name in names}
    for _ in range(args.warmup):
        for name in names:
            step(engines[name], its[name])
    times = {name: [] for name in names}
    for _ in range(args.steps):
        for name in names:
            times[name].append(step(engines[name], its[name]))
    profile = _profile(engines[names[0]], its[names[0]], args) if args.profile else None
    if dist.get_rank() != 0:
        return None
    return {"profile": profile, **{name: {"step_s": statistics.median(t[0] for t in ts),
                                          "cpu_s": statistics.median(t[1] for t in ts),
                                          "instructions": instructions(name, args.micro_batches, 0)}
                                   for name, ts in times.items()}}


def _profile(engine, it, args) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step(engine, it)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return out.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "zb-h1", "gpipe"])
    p.add_argument("--profile", action="store_true", help="cProfile TDS's first schedule on stage 0")
    args = p.parse_args()
    r = run_on_ranks(run, P, args)
    print(f"p = {P}, m = {args.micro_batches}, {LAYERS} empty layers, median of {args.steps} alternating steps")
    ds = r["deepspeed"]
    for name in [n for n in r if n != "profile"]:
        x = r[name]
        per, cpu = x["step_s"] / x["instructions"], x["cpu_s"] / x["instructions"]
        print(f"  {name:12s} step {x['step_s'] * 1e3:7.2f} ms  {x['instructions']:3d} instructions on stage 0  "
              f"{per * 1e6:6.1f} us per instruction  (x{per / (ds['step_s'] / ds['instructions']):.2f} DeepSpeed's)"
              f"  CPU {cpu * 1e6:6.1f} us per instruction  (x{cpu / (ds['cpu_s'] / ds['instructions']):.2f})")
    if r["profile"]:
        print(r["profile"])


if __name__ == "__main__":
    main()
