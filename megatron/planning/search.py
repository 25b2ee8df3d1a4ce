"""Enumerate the layouts of a cluster and rank them: fits first, then predicted step time.

A candidate is (tp, pp, dp, micro-batch, schedule, v, sequence parallel, recomputation, ZeRO-1) with tp x pp x dp =
the cluster's GPUs, tp within a node and dividing the heads, key/value groups and ffn, pp at most the transformer
layers, micro-batch x dp dividing the global batch, interleaved only with gas a multiple of pp and pp x v chunks at
most the layers. A mixture of experts: tp > 1 with sequence parallelism only, and its expert-parallel size given
(`ep`), not searched. A layout fits when the worst stage's peak x (1 + allocator overhead) <= GPU memory.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, List, Optional

from megatron.errors import UserError

from .memory import Layout, StageMemory, predict_memory
from .model_shape import ModelShape
from .moe import moe_config
from .shared import SharedTerms
from .speed import Cluster, StepTime, predict_step

__all__ = ["Candidate", "evaluate", "enumerate_layouts", "rank_layouts", "overflow_line"]


@dataclass
class Candidate:
    layout: Layout
    stages: List[StageMemory]
    step: StepTime
    fits: bool
    budget: float

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def peak(self) -> float:
        return self.worst.peak


def evaluate(m: ModelShape, lay: Layout, c: Cluster, shared: Optional[SharedTerms] = None) -> Candidate:
    """The layout's memory per stage and step time; `shared`: the terms other layouts of a ranking computed."""
    shared = shared or SharedTerms()
    stages = predict_memory(m, lay, shared)
    budget = c.memory_gb * 1e9 / (1 + c.allocator_overhead)
    peak = max(s.peak for s in stages)
    return Candidate(lay, stages, predict_step(m, lay, c, shared), peak <= budget, budget)


def _divisors(n: int) -> List[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def enumerate_layouts(m: ModelShape, c: Cluster, global_batch: int, precision: str = "bf16",
                      sequence_parallel_available: bool = True, max_micro_batch: int = 16, attention: str = "fused",
                      schedules: Iterable[str] = ("1f1b", "interleaved", "zb-h1"), ep: int = 1) -> List[Layout]:
    """`ep`: a mixture of experts' expert-parallel size, given (not searched): layouts whose tp x dp it divides,
    and at ep > 1 only what the code runs there (fp32, ZeRO 0: megatron/config/moe_args.py)."""
    if ep > 1 and precision != "fp32":
        raise UserError(f"--expert-model-parallel-size {ep} runs in fp32 only for now (megatron/config/moe_args.py), "
                        f"but the layouts asked for are {precision}; plan in fp32 or at --expert-model-parallel-size 1")
    out = []
    world = c.world_size
    moe = moe_config(m.config) is not None

    def sp_options(tp: int) -> tuple:  # a mixture of experts at tp > 1 routes each rank's part of the sequence
        if tp == 1 or not sequence_parallel_available:
            return () if moe and tp > 1 else (False,)
        return (True,) if moe else (False, True)

    layers = m.transformer_layers
    for tp in _divisors(min(c.gpus_per_node, world)):
        if any(size % tp for size in m.spec.tensor_parallel_sizes(m.config)) or world % tp:
            continue
        for pp in _divisors(world // tp):
            if pp > layers:
                continue
            dp = world // (tp * pp)
            if (tp * dp) % ep:
                continue
            for mb in _divisors(max_micro_batch):
                if global_batch % (mb * dp):
                    continue
                gas = global_batch // (mb * dp)
                for sched in (schedules if pp > 1 else ("1f1b",)):
                    for v in ((2, 4) if sched == "interleaved" else (1,)):
                        if sched == "interleaved" and (gas % pp or pp * v > layers):
                            continue
                        for sp in sp_options(tp):
                            for rc in ("none", "selective", "full"):
                                for zero in ((0, 1) if dp > 1 and ep == 1 else (0,)):
                                    out.append(Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, gas=gas, schedule=sched,
                                                           virtual_stages=v, sequence_parallel=sp, recompute=rc,
                                                           zero_stage=zero, precision=precision,
                                                           attention=attention, ep=ep))
    return out


def rank_layouts(m: ModelShape, c: Cluster, global_batch: int, precision: str = "bf16", top: Optional[int] = None,
                 shared: Optional[SharedTerms] = None, **kwargs) -> List[Candidate]:
    """All candidates, fitting ones first by predicted step time, then the rest by peak memory. The layouts share
    what they have in common (`shared.SharedTerms`: schedule simulations, activation peaks, partitions): pass
    `shared` to see what was computed."""
    with collector_paused():  # (the terms dropped inside: the collector does not walk them when it resumes)
        terms = shared if shared is not None else SharedTerms()
        cands = [evaluate(m, lay, c, terms) for lay in enumerate_layouts(m, c, global_batch, precision, **kwargs)]
        del terms
    cands.sort(key=lambda x: (not x.fits, round(x.step.total, 4) if x.fits else x.peak, x.peak))
    return cands[:top] if top else cands


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a ranking, on again after it whatever happens: a ranking makes
    no reference cycles (reference counts free what it drops), and the collector's passes over the hundreds of
    thousands of tuples it keeps (compute orders, message programs) cost a fifth of its time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def overflow_line(cand: Candidate, best: Optional[Candidate]) -> str:
    """One line: which part of which stage overflows, and the planner's best alternative."""
    w = cand.worst
    parts = {"weights": w.weights, "gradients": w.gradients, "optimizer state": w.optimizer,
             "activations": w.activations + w.working, "communication buffers": w.buffers}
    part = max(parts, key=parts.get)
    gb = lambda x: f"{x / 1e9:.1f} GB"  # noqa: E731
    alt = f"; the planner's best layout that fits: {best.layout.short()} (peak {gb(best.peak)})" if best else \
        "; no layout of this cluster fits"
    return (f"layout {cand.layout.short()} does not fit: stage {w.stage} needs {gb(w.peak)} per rank against "
            f"{gb(cand.budget)} usable, the largest part is {part} ({gb(parts[part])}){alt}")


def plan_for_args(args, vocab_size: int, memory_gb: float, gpus_per_node: int = 8, attention: str = "fused"):
    """(the run's own Candidate, the best fitting alternative or None) for resolved pretrain arguments;
    attention: 'fused' on GPUs, 'math' on CPU (see megatron.planning.activations)."""
    from .memory import layout_from_args
    shape = ModelShape.from_args(args, vocab_size)
    world = args.world_size
    per_node = min(gpus_per_node, world)
    c = Cluster(nodes=max(1, world // per_node), gpus_per_node=per_node, memory_gb=memory_gb)
    own = evaluate(shape, layout_from_args(args, attention), c)
    best = None
    if not own.fits:
        precision = own.layout.precision
        fitting = [x for x in rank_layouts(shape, c, args.global_batch_size, precision,
                                           sequence_parallel_available=hasattr(args, "sequence_parallel"),
                                           attention=attention, ep=own.layout.ep) if x.fits]
        best = fitting[0] if fitting else None
    return own, best
