"""Pipeline schedules as data: a pure function lists each stage's instructions for one batch.

A schedule knows nothing about tensors or processes. `train_schedule(kind, num_stages, stage_id, m, v)` returns
the ordered instruction list of one stage for one training batch of `m` micro-batches; the executor in
`engine.py` runs it. Instructions name the micro-batch (and model chunk) they act on, so buffers are keyed by
(micro-batch, chunk) and the number of live buffers is whatever the order implies (tested without processes).

Orders (p stages, stage s, m micro-batches, F(i)/B(i)/W(i) = forward / input gradient / weight gradient of
micro-batch i; a full backward is B and W together):

- GPipe (Huang et al. 2019): F(0..m-1) then the backwards. Peak in-flight micro-batches: m on every stage.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): w = min(p-s-1, m) warm-up forwards, then
  alternate F(w+i), backward(i) and drain the remaining backwards. Peak in-flight: min(p-s, m).
  Both have bubble fraction (p-1)/(m+p-1).
- Interleaved 1F1B (Narayanan et al. 2021 §2.2.2; Megatron-LM's order): stage s holds v >= 2 model chunks;
  chunk c of stage s is virtual stage c*p + s, so activations leaving chunk c on stage p-1 enter chunk c+1
  on stage 0 (and gradients go the other way round the ring). The (micro-batch, chunk) units run in groups
  of p micro-batches: chunk 0 of every micro-batch of the group, then chunk 1, ..., chunk v-1; the k-th
  backward unit is the k-th forward unit's micro-batch with chunk v-1-c. Warm-up 2(p-s-1) + (v-1)p forward
  units (at most v*m), then 1F1B over units, then the remaining backward units. With per-chunk costs F/v,
  B/v the bubble fraction is (p-1)/(v*m+p-1); peak in-flight units min(2(p-s-1) + (v-1)p + 1, v*m), i.e.
  ((v+1)p-1)/v micro-batches' activations on stage 0.
  Training needs p >= 2 and m a multiple of p (as Narayanan et al. and Megatron-LM: with a shorter last
  group this order can deadlock or cross messages, see test_schedule.py); forward-only evaluation takes any m
  (the last group holds the remaining m mod p micro-batches). Unlike Megatron, m = p needs no special case
  (all forwards first): this order is deadlock-free there too and has the same bubble.
- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism" §2.1): 1F1B with each backward split into B,
  at 1F1B's backward position (its gradient is sent upstream at once), and W, deferred: stage s runs the oldest
  pending W right after a B whenever more than s W's are pending, and the rest after its last B (the order of
  the paper's Figure 3). Idle time per stage with costs T_F, T_B, T_W (T_W <= T_F, T_B; m >= p) is
  (p-1)(T_F + T_B - T_W) instead of 1F1B's (p-1)(T_F + T_B + T_W): with equal costs exactly one third
  (`schedule_sim.py` has the timed simulation and the m < p case). Peak in-flight micro-batches between F and B
  equal 1F1B's, min(p-s, m); between F and W (what W still holds: each linear's input and output gradient)
  min(p, m) on every stage.

Communication is one-sided in time: sends are non-blocking and complete before the batch ends, receives
block, and the messages between two stages are matched in the order they were sent (whatever their kind,
as with NCCL and untagged gloo). Deadlock freedom therefore only needs every receive's matching send to come
earlier in the sender's list than anything the sender waits on that depends on the receiver; `simulate()`
checks it for a whole pipeline by running all stages' lists with non-blocking sends and in-order links.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Callable

__all__ = ["Op", "Instruction", "train_schedule", "compute_order", "unit_ops", "eval_schedule", "check_schedule",
           "peak_in_flight", "simulate", "route", "route_send", "expected_message", "SCHEDULES", "COMPUTE_OPS"]


class Op(str, Enum):
    LOAD = "load_micro_batch"        # first stage: inputs; last stage: labels (same iterator item)
    RECV_ACT = "recv_activations"
    FORWARD = "forward"
    SEND_ACT = "send_activations"
    RECV_GRAD = "recv_grads"
    BACKWARD = "backward"            # input and weight gradients together
    BACKWARD_INPUT = "backward_input"    # B: input gradients; weight-gradient work queued (weight_grad.py)
    BACKWARD_WEIGHT = "backward_weight"  # W: run the weight-gradient work queued by B of this micro-batch
    SEND_GRAD = "send_grads"
    REDUCE_TIED = "reduce_tied_grads"
    REDUCE_GRADS = "reduce_grads"
    STEP = "optimizer_step"


COMPUTE_OPS = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)


@dataclass(frozen=True)
class Instruction:
    """One step of a stage; `chunk` is the model chunk (virtual stage chunk*p + stage), 0 unless interleaved."""
    op: Op
    micro_batch: int = -1
    chunk: int = 0

    def __str__(self) -> str:
        if self.micro_batch < 0:
            return self.op.value
        chunk = f", chunk={self.chunk}" if self.chunk else ""
        return f"{self.op.value}(micro_batch={self.micro_batch}{chunk})"


Unit = tuple[Op, int, int]  # (compute op, micro-batch, chunk)


def unit_ops(op: Op, first: bool, last: bool) -> list[Op]:
    """The ops of one compute unit: `op` with the loads, receives and sends around it, on the first model chunk
    of the pipeline (`first`: stage 0, chunk 0), its last (`last`: stage p-1, chunk v-1) or one between."""
    if op == Op.FORWARD:
        ops = ([Op.LOAD] if first or last else []) + ([] if first else [Op.RECV_ACT]) + [op]
        return ops + ([] if last else [Op.SEND_ACT])
    if op in (Op.BACKWARD, Op.BACKWARD_INPUT):
        return ([] if last else [Op.RECV_GRAD]) + [op] + ([] if first else [Op.SEND_GRAD])
    return [op]


def _expand(unit: Unit, num_stages: int, stage_id: int, virtual_stages: int) -> list[Instruction]:
    """A compute unit with the loads, receives and sends around it."""
    op, mb, chunk = unit
    first = stage_id == 0 and chunk == 0
    last = stage_id == num_stages - 1 and chunk == virtual_stages - 1
    return [Instruction(o, mb, chunk) for o in unit_ops(op, first, last)]


# The orders read each Op member once (`Op.FORWARD` costs ten times a local name): planners build them by the
# hundred thousand units.
def _order_1f1b(p: int, s: int, m: int, v: int) -> list[Unit]:
    forward, backward = Op.FORWARD, Op.BACKWARD
    warmup = min(p - s - 1, m)
    order = [(forward, i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(forward, warmup + i, 0), (backward, i, 0)]
    return order + [(backward, i, 0) for i in range(m - warmup, m)]


def _order_gpipe(p: int, s: int, m: int, v: int) -> list[Unit]:
    forward, backward = Op.FORWARD, Op.BACKWARD
    return [(forward, i, 0) for i in range(m)] + [(backward, i, 0) for i in range(m)]


def _interleaved_units(p: int, m: int, v: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of the k-th forward unit, Megatron's order: groups of p micro-batches, chunk-major."""
    units = []
    for start in range(0, m, p):
        group = range(start, min(start + p, m))
        units += [(mb, c) for c in range(v) for mb in group]
    return units


def _order_interleaved(p: int, s: int, m: int, v: int) -> list[Unit]:
    forward, backward = Op.FORWARD, Op.BACKWARD
    fwd = [(forward, mb, c) for mb, c in _interleaved_units(p, m, v)]
    bwd = [(backward, mb, v - 1 - c) for mb, c in _interleaved_units(p, m, v)]
    warmup = min(2 * (p - s - 1) + (v - 1) * p, v * m)
    order = fwd[:warmup]
    for k in range(v * m - warmup):
        order += [fwd[warmup + k], bwd[k]]
    return order + bwd[v * m - warmup:]


def _order_zb_h1(p: int, s: int, m: int, v: int) -> list[Unit]:
    """1F1B with B where the backward was; after a B, the oldest W if more than s are pending."""
    forward, backward_input, backward_weight = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    order: list[Unit] = []
    pending: deque[int] = deque()  # micro-batches whose B ran and whose W did not
    for op, i, _ in _order_1f1b(p, s, m, v):
        if op is forward:
            order.append((op, i, 0))
            continue
        order.append((backward_input, i, 0))
        pending.append(i)
        if len(pending) > s:
            order.append((backward_weight, pending.popleft(), 0))
    return order + [(backward_weight, i, 0) for i in pending]


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Unit]]] = {
    "1f1b": _order_1f1b, "gpipe": _order_gpipe, "interleaved": _order_interleaved, "zb-h1": _order_zb_h1}


def check_schedule(kind: str, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError naming the values if `kind` cannot run with this pipeline."""
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is not one of {sorted(SCHEDULES)}; set "
                         f"config['pipeline']['schedule'] to one of them")
    if num_stages < 1 or micro_batches < 1 or virtual_stages < 1:
        raise ValueError(f"need num_stages, micro_batches and virtual_stages >= 1, got num_stages={num_stages} "
                         f"micro_batches={micro_batches} virtual_stages={virtual_stages}")
    if kind != "interleaved" and virtual_stages != 1:
        raise ValueError(f"pipeline schedule {kind!r} runs one model chunk per stage, got virtual_stages="
                         f"{virtual_stages}; use schedule 'interleaved' or virtual_stages 1")
    if kind == "interleaved" and (virtual_stages < 2 or num_stages < 2 or micro_batches % num_stages):
        raise ValueError(f"the interleaved schedule needs virtual_stages >= 2, pipeline stages >= 2 and "
                         f"micro-batches a multiple of the stages, got virtual_stages={virtual_stages} "
                         f"num_stages={num_stages} micro_batches={micro_batches}; change them or use schedule '1f1b'")


def compute_order(kind: str, num_stages: int, stage_id: int, micro_batches: int,
                  virtual_stages: int = 1) -> list[Unit]:
    """The compute units (op, micro-batch, chunk) of stage `stage_id` for one training batch, in the order its
    `train_schedule` list runs them (one compute op per unit; `unit_ops` adds the loads, receives and sends)."""
    check_schedule(kind, num_stages, micro_batches, virtual_stages)
    if not 0 <= stage_id < num_stages:
        raise ValueError(f"need 0 <= stage_id < num_stages, got stage_id={stage_id} num_stages={num_stages}")
    return SCHEDULES[kind](num_stages, stage_id, micro_batches, virtual_stages)


def train_schedule(kind: str, num_stages: int, stage_id: int, micro_batches: int,
                   virtual_stages: int = 1) -> list[Instruction]:
    """Instructions of stage `stage_id` for one training batch: compute order, then tied/DP reduction and step."""
    out: list[Instruction] = []
    for unit in compute_order(kind, num_stages, stage_id, micro_batches, virtual_stages):
        out += _expand(unit, num_stages, stage_id, virtual_stages)
    return out + [Instruction(Op.REDUCE_TIED), Instruction(Op.REDUCE_GRADS), Instruction(Op.STEP)]


def eval_schedule(num_stages: int, stage_id: int, micro_batches: int, virtual_stages: int = 1) -> list[Instruction]:
    """Forward-only instructions of one stage for `micro_batches` micro-batches (in interleaved unit order)."""
    units = _interleaved_units(num_stages, micro_batches, virtual_stages)
    return [i for mb, c in units for i in _expand((Op.FORWARD, mb, c), num_stages, stage_id, virtual_stages)]


def peak_in_flight(instructions: list[Instruction], until_weight: bool = False) -> int:
    """Most (micro-batch, chunk) units whose forward ran and whose backward did not yet (activations held).

    B (BACKWARD_INPUT) ends a unit's activations; with `until_weight` a unit counts until its W ran too (W
    still holds each linear's input and output gradient, Qi et al.'s M_W)."""
    ends = (Op.BACKWARD, Op.BACKWARD_WEIGHT) if until_weight else (Op.BACKWARD, Op.BACKWARD_INPUT)
    live, peak = 0, 0
    for ins in instructions:
        live += (ins.op == Op.FORWARD) - (ins.op in ends)
        peak = max(peak, live)
    return peak


def route(ins: Instruction, stage_id: int, num_stages: int) -> tuple[int, tuple]:
    """(receiving stage, (kind, micro-batch, receiving chunk)) of a send: next stage round the ring for
    activations (chunk c on the last stage feeds chunk c+1 on stage 0), previous one for gradients."""
    return route_send(ins.op, ins.micro_batch, ins.chunk, stage_id, num_stages)


def route_send(op: Op, micro_batch: int, chunk: int, stage_id: int, num_stages: int) -> tuple[int, tuple]:
    """`route` of the send `op` of (micro_batch, chunk) on `stage_id`."""
    if op == Op.SEND_ACT:
        wrap = stage_id == num_stages - 1
        return (stage_id + 1) % num_stages, ("act", micro_batch, chunk + wrap)
    wrap = stage_id == 0
    return (stage_id - 1) % num_stages, ("grad", micro_batch, chunk - wrap)


def expected_message(op: Op, micro_batch: int, chunk: int) -> tuple:
    """(kind, micro-batch, chunk) the receive `op` of (micro_batch, chunk) must get."""
    return "act" if op == Op.RECV_ACT else "grad", micro_batch, chunk


def simulate(stage_lists: list[list[Instruction]]) -> list[tuple[int, Instruction]]:
    """Run all stages' lists with non-blocking sends and blocking receives; return the global order.

    Messages from one stage to another are received in the order they were sent. Raises RuntimeError naming
    the blocked instructions if no stage can make progress (a deadlock), or if a receive would get a message
    meant for another instruction (other kind, micro-batch or chunk).
    """
    p = len(stage_lists)
    links: dict[tuple[int, int], deque] = {}
    pos = [0] * p
    trace: list[tuple[int, Instruction]] = []
    while any(k < len(lst) for k, lst in zip(pos, stage_lists)):
        progressed = False
        for s, lst in enumerate(stage_lists):
            while pos[s] < len(lst):
                ins = lst[pos[s]]
                if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    src = (s - 1) % p if ins.op == Op.RECV_ACT else (s + 1) % p
                    queue = links.get((src, s))
                    if not queue:
                        break
                    got, want = queue.popleft(), expected_message(ins.op, ins.micro_batch, ins.chunk)
                    if got != want:
                        raise RuntimeError(f"stage {s} {ins} received {got} (kind, micro-batch, chunk) "
                                           f"from stage {src}")
                elif ins.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    dst, msg = route(ins, s, p)
                    links.setdefault((s, dst), deque()).append(msg)
                trace.append((s, ins))
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = {s: str(lst[pos[s]]) for s, lst in enumerate(stage_lists) if pos[s] < len(lst)}
            raise RuntimeError(f"deadlock: blocked instructions per stage {blocked}")
    return trace

