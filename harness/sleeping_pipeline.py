"""A pipeline whose layers sleep: p = 4 stages of 2 layers, each layer's forward, input-gradient (B) and
weight-gradient (W) step sleeping a fixed time, so that a stage's F, B and W cost what the caller asks whatever the
shared cores are doing; and a bare gloo hop between two of the same processes, no engine. bench/pipeline_bubble.py
measures the bubble of each schedule on it, bench/probes/pipeline_hops.py where the time of one hop goes.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

P, LAYERS_PER_STAGE, HIDDEN, MBS = 4, 2, 8, 2


class _Sleep(torch.autograd.Function):
    """y = x * w with fixed sleeps: forward, B (dx = dy w) and W (dw = sum dy x, deferred while the store
    defers, as weight_grad.linear does)."""

    @staticmethod
    def forward(ctx, x, weight, seconds, store):  # x (b, h) -> (b, h)
        time.sleep(seconds)
        ctx.save_for_backward(x, weight)
        ctx.seconds, ctx.store, ctx.weight = seconds, store, weight
        return x * weight

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        time.sleep(ctx.seconds)

        def weight_grad():
            time.sleep(ctx.seconds)
            return [(dy * x).sum().reshape(1)]
        if ctx.store is not None and ctx.store.deferring:
            ctx.store.put([ctx.weight], weight_grad)
            return dy * weight, None, None, None
        return dy * weight, weight_grad()[0], None, None


class SleepLayer(nn.Module):
    """A layer costing `seconds` in each of F, B and W (the engine attaches its store for ZB-H1)."""
    weight_grad_store = None

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Sleep.apply(x, self.weight, self.seconds, self.weight_grad_store)


def mse(out, label):
    return ((out - label) ** 2).mean()


def build(schedule: str, v: int, m: int, seconds: float, trace: str):
    import tds
    from tds.pipe import LayerSpec, PipelineModule
    specs = [LayerSpec(SleepLayer, seconds) for _ in range(P * LAYERS_PER_STAGE)]
    model = PipelineModule(specs, num_stages=P, loss_fn=mse, partition_method="uniform", virtual_stages=v,
                           input_grad=[True], input_type=["float"])
    cfg = {"train_micro_batch_size_per_gpu": MBS, "gradient_accumulation_steps": m, "train_batch_size": MBS * m,
           "steps_per_print": 10 ** 9, "zero_optimization": {"stage": 0},
           "pipeline": {"schedule": schedule, "virtual_stages": v, "timeline": trace, "timeline_batches": [2, 3]}}
    engine, _, _, _ = tds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3), config=cfg)
    return engine


def data():
    g = torch.Generator().manual_seed(0)
    while True:
        yield torch.randn(MBS, HIDDEN, generator=g), torch.randn(MBS, HIDDEN, generator=g)


def bare_hop_ms(ms: float, rounds: int = 40) -> float | None:
    """Median one-way time (ms) of a bare gloo send/recv whose receiver waits idle in its posted receive, as a
    stage waits in the bubble: ranks (0, 1) and (2, 3) ping-pong an activation-sized message, each side
    sleeping `ms` before it answers; the time runs from the sender's stamp to the receiver's wait returning.
    No engine is involved: this is the machine's and gloo's floor for one hop. Rank 0 returns it."""
    import torch.distributed as dist
    peer = dist.get_rank() ^ 1
    msg, latencies = torch.zeros(MBS, HIDDEN, dtype=torch.float64), []
    for k in range(rounds):
        if (k % 2 == 0) == (dist.get_rank() % 2 == 0):
            time.sleep(ms / 1e3)
            msg[0, 0] = time.perf_counter()  # one clock for every process on this host (CLOCK_MONOTONIC)
            dist.send(msg, peer)
        else:
            dist.recv(msg, peer)
            latencies.append(time.perf_counter() - msg[0, 0].item())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, latencies)
    merged = sorted(x for part in everyone for x in part[2:])  # each side's first answer warms up
    return merged[len(merged) // 2] * 1e3 if dist.get_rank() == 0 else None
