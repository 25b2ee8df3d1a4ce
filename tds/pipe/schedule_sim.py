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
from typing import Sequence

from .instructions import (COMPUTE_OPS, Instruction, Op, compute_order, expected_message, route, route_send, simulate,
                           unit_ops)
from .timeline import Span

__all__ = ["Costs", "simulate_timed", "compute_windows", "expected_idle", "expected_bubble"]


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


def compute_windows(kind: str, num_stages: int, micro_batches: int, virtual_stages: int = 1,
                    costs: Sequence[Costs] = (Costs(),), orders: Sequence[list] | None = None) -> list[float]:
    """`timeline.compute_window(simulate_timed(lists, c))` for each `c` in `costs`, `lists` the stages'
    `train_schedule` lists, equal to the bit, without building instructions, spans or a global order (a planner
    times the schedules of thousands of layouts).

    The times do not depend on how the stages' runs interleave: each stage runs its own list in order, and the k-th
    receive on a link gets the k-th message sent on it, whenever it runs. So the messages are matched once, per
    link (`_programs`, which checks each against what its receive expects, as `simulate` does), and each cost set
    runs the stages' compute units (`compute_order`, with `unit_ops`' receives and sends), a stage until its next
    message is not sent yet (`_window`); every clock takes the additions `simulate_timed` makes, in its order
    (loads, reductions and the step take no time). A deadlock or a crossed message raises RuntimeError.
    `orders`: the stages' `compute_order` lists where the caller has them already.
    """
    p, v = num_stages, virtual_stages
    if orders is None:
        orders = [compute_order(kind, p, s, micro_batches, v) for s in range(p)]
    programs, messages = _programs(orders, p, v)
    return [_window(programs, messages, c) for c in costs]


def _programs(orders: Sequence[list], p: int, v: int) -> tuple[list[list[tuple]], int]:
    """(each stage's units as (the number of the message its receive takes or -1, its op, the number of the
    message its send gives or -1), a bound on the numbers): the k-th message of link l = (from stage) p + (to stage)
    is number k p^2 + l, and a receive takes the next one of its link."""
    links = p * p
    sent: list = [[] for _ in range(links)]  # per link, (kind, micro-batch, chunk) of its messages in sending order
    wanted: list = [[] for _ in range(links)]  # per link, what its receives expect, in order
    programs = []
    for s in range(p):
        plans: dict = {}  # (op, chunk) -> (receive link or -1, its kind, send link or -1, its kind, chunk change)
        program = []
        for op, mb, chunk in orders[s]:
            plan = plans.get((op, chunk))
            if plan is None:
                plan = plans[(op, chunk)] = _plan(op, chunk, s, p, v)
            into, receive, out, send, wrap = plan
            taken = given = -1
            if into >= 0:
                queue = wanted[into]
                taken = len(queue) * links + into
                queue.append((receive, mb, chunk))
            if out >= 0:
                queue = sent[out]
                given = len(queue) * links + out
                queue.append((send, mb, chunk + wrap))
            program.append((taken, op, given))
        programs.append(program)
    for link, (got, want) in enumerate(zip(sent, wanted)):
        if got[:len(want)] != want[:len(got)]:  # (a receive without a message is a deadlock: `_window` says it)
            k = next(k for k, (g, w) in enumerate(zip(got, want)) if g != w)
            receive = Op.RECV_ACT if want[k][0] == "act" else Op.RECV_GRAD
            raise RuntimeError(f"stage {link % p} {Instruction(receive, *want[k][1:])} received {got[k]} (kind, "
                               f"micro-batch, chunk) from stage {link // p}")
    return programs, links * max(map(len, sent + wanted), default=0)


def _plan(op: Op, chunk: int, s: int, p: int, v: int) -> tuple:
    """(the link of the unit's receive or -1, the kind it expects, the link of its send or -1, the kind it sends,
    the receiving chunk's offset): `unit_ops`, `expected_message` and `route_send` of the unit."""
    ops = unit_ops(op, s == 0 and chunk == 0, s == p - 1 and chunk == v - 1)
    into = receive = out = send = None
    wrap = 0
    for o in ops:
        if o in (Op.RECV_ACT, Op.RECV_GRAD):
            receive = expected_message(o, 0, chunk)[0]
            into = ((s - 1) % p if o == Op.RECV_ACT else (s + 1) % p) * p + s
        elif o in (Op.SEND_ACT, Op.SEND_GRAD):
            dst, (send, _, to_chunk) = route_send(o, 0, chunk, s, p)
            out, wrap = s * p + dst, to_chunk - chunk
    return (-1 if into is None else into), receive, (-1 if out is None else out), send, wrap


def _window(programs: list[list[tuple]], messages: int, costs: Costs) -> float:
    """First compute start .. last compute end of the stages' `_programs` run with `costs` (`compute_windows`)."""
    took = {op: costs.of(op) for op in COMPUTE_OPS}
    hop, comm = costs.instruction, costs.comm
    p = len(programs)
    arrival: list = [None] * messages
    clocks, pos, first, last = [0.0] * p, [0] * p, float("inf"), float("-inf")
    waiting: dict = {}  # message number -> the stage whose receive waits for it
    ready = list(range(p))
    while ready:
        s = ready.pop()
        program, k, clock = programs[s], pos[s], clocks[s]
        while k < len(program):
            taken, op, given = program[k]
            if taken >= 0:
                at = arrival[taken]
                if at is None:
                    waiting[taken] = s
                    break
                clock = (at if at > clock else clock) + hop  # max(clock, at) + hop
            if clock < first:
                first = clock
            clock += took[op]
            if clock > last:
                last = clock
            if given >= 0:
                clock += hop
                arrival[given] = clock + comm
                if given in waiting:
                    ready.append(waiting.pop(given))
            k += 1
        pos[s], clocks[s] = k, clock
    if any(k < len(program) for k, program in zip(pos, programs)):
        blocked = {s: programs[s][pos[s]][1].value for s in range(p) if pos[s] < len(programs[s])}
        raise RuntimeError(f"deadlock: stages blocked at a receive before {blocked}")
    return last - first


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
