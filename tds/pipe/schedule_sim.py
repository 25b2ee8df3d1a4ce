"""Timed simulation of pipeline schedules: each stage's idle time and bubble fraction from op costs.

Every stage runs its instruction list in order, one instruction at a time. F, B and W of one model chunk
take `Costs.forward`, `.backward_input`, `.backward_weight` (a full backward takes B + W); every send and
receive instruction occupies its stage for `Costs.instruction` (the engine's own cost of a hop: packing,
posting, unpacking; a receive's after its message arrived); loads, reductions and the step take no time. A
message sent at time t (its send instruction done) arrives at t + `Costs.comm` and a receive waits for it
(sends never wait). The result is the list of `timeline.Span`s, so the same code that measures
the engine's timelines measures the simulation (`timeline.bubble_fractions`, `tools/plot_pipeline.py`).

Closed forms (p stages, m micro-batches, v chunks per stage, costs per chunk, comm = 0), with
T = T_F + T_B + T_W the compute of one unit and every stage busy v*m*T:

    1F1B, GPipe       idle (p-1) T              bubble (p-1) / (m + p-1)
    interleaved       idle (p-1) T              bubble (p-1) / (v m + p-1)      (chunk costs = stage costs / v)
    ZB-H1             idle (p-1)(T_F + T_B - T_W)   for m >= p, T_W <= T_F, T_W <= T_B (Qi et al. 2024, Table 2);
                      with m < p only m-1 W's fill the tail: (p-1)(T_F + T_B) - (m-1) T_W

so with T_F = T_B = T_W and m >= p ZB-H1 idles exactly 1/3 as long as 1F1B, and its bubble fraction is
(p-1)/(3m + p-1) against 1F1B's 3(p-1)/(3m + 3(p-1)) = (p-1)/(m+p-1).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .instructions import Instruction, Op, route, simulate
from .timeline import Span

__all__ = ["Costs", "simulate_timed", "expected_idle", "expected_bubble"]


@dataclass(frozen=True)
class Costs:
    """Time of each compute op of one model chunk, of one hop between stages (latency and transfer), and of
    one send or receive instruction on its stage."""
    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    comm: float = 0.0
    instruction: float = 0.0

    def of(self, op: Op) -> float:
        return {Op.FORWARD: self.forward, Op.BACKWARD: self.backward_input + self.backward_weight,
                Op.BACKWARD_INPUT: self.backward_input, Op.BACKWARD_WEIGHT: self.backward_weight}.get(op, 0.0)


def simulate_timed(stage_lists: list[list[Instruction]], costs: Costs = Costs(), batch: int = 0,
                   durations: dict | None = None) -> list[Span]:
    """Spans of every instruction of every stage (receives span their wait).

    Times the order `schedule.simulate` finds (which raises RuntimeError on a deadlock or crossed messages):
    in it every receive comes after its send, so one pass over it knows each message's arrival time.
    `durations` ({(stage, op name, micro_batch, chunk): time in `costs`' unit}, e.g. a measured timeline's F, B and W)
    replaces the compute ops' costs where it has them: a replay of measured op times with `costs`' hops.
    """
    p = len(stage_lists)
    arrivals: dict[tuple[int, int], deque] = {}  # (from stage, to stage) -> arrival times in sending order
    clock = [0.0] * p
    spans: list[Span] = []
    for s, ins in simulate(stage_lists):
        start = clock[s]
        if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
            src = (s - 1) % p if ins.op == Op.RECV_ACT else (s + 1) % p
            clock[s] = max(clock[s], arrivals[(src, s)].popleft()) + costs.instruction
        elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
            clock[s] += costs.instruction
            arrivals.setdefault((s, route(ins, s, p)[0]), deque()).append(clock[s] + costs.comm)
        elif durations is not None and (s, ins.op.value, ins.micro_batch, ins.chunk) in durations:
            clock[s] += durations[(s, ins.op.value, ins.micro_batch, ins.chunk)]
        else:
            clock[s] += costs.of(ins.op)
        spans.append(Span(s, ins.op.value, ins.micro_batch, ins.chunk, start, clock[s], batch))
    return spans


def expected_idle(kind: str, num_stages: int, micro_batches: int, costs: Costs = Costs()) -> float:
    """Idle time per stage of one batch by the closed forms above (costs per chunk, comm = instruction = 0)."""
    f, b, w = costs.forward, costs.backward_input, costs.backward_weight
    if kind == "zb-h1":
        return (num_stages - 1) * (f + b) - min(micro_batches - 1, num_stages - 1) * w
    return (num_stages - 1) * (f + b + w)


def expected_bubble(kind: str, num_stages: int, micro_batches: int, virtual_stages: int = 1,
                    costs: Costs = Costs()) -> float:
    """Bubble fraction idle / (busy + idle) by the closed forms above (costs per chunk, comm = instruction = 0)."""
    busy = virtual_stages * micro_batches * (costs.forward + costs.backward_input + costs.backward_weight)
    idle = expected_idle(kind, num_stages, micro_batches, costs)
    return idle / (busy + idle)
