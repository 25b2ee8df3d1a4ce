"""Pipeline schedules as data: a pure function lists each stage's instructions for one batch.

A schedule knows nothing about tensors or processes. `train_schedule(kind, num_stages, stage_id, m)` returns
the ordered instruction list of one stage for one training batch of `m` micro-batches; the executor in
`engine.py` runs it. Instructions name the micro-batch they act on, so buffers are keyed by micro-batch id
and the number of live buffers is whatever the order implies (tested below, without processes).

Orders (p stages, stage s, m micro-batches, F(i)/B(i) = forward/backward of micro-batch i):

- GPipe (Huang et al. 2019): F(0..m-1) then B(0..m-1). Peak in-flight micro-batches: m on every stage.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021 §2.2.1): w = min(p-s-1, m) warm-up forwards, then
  alternate F(w+i), B(i) and drain the remaining backwards. Peak in-flight: min(p-s, m).
  Both have bubble fraction (p-1)/(m+p-1).

Communication is one-sided in time: sends are non-blocking and complete before the batch ends, receives
block. Deadlock freedom therefore only needs every receive's matching send to come earlier in the sender's
list than anything the sender waits on that depends on the receiver; `simulate()` checks it for a whole
pipeline by running all stages' lists with non-blocking sends.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["Op", "Instruction", "train_schedule", "eval_schedule", "peak_in_flight", "simulate", "SCHEDULES"]


class Op(str, Enum):
    LOAD = "load_micro_batch"        # first stage: inputs; last stage: labels (same iterator item)
    RECV_ACT = "recv_activations"
    FORWARD = "forward"
    SEND_ACT = "send_activations"
    RECV_GRAD = "recv_grads"
    BACKWARD = "backward"
    SEND_GRAD = "send_grads"
    REDUCE_TIED = "reduce_tied_grads"
    REDUCE_GRADS = "reduce_grads"
    STEP = "optimizer_step"


@dataclass(frozen=True)
class Instruction:
    op: Op
    micro_batch: int = -1

    def __str__(self) -> str:
        return self.op.value if self.micro_batch < 0 else f"{self.op.value}(micro_batch={self.micro_batch})"


def _forward(num_stages: int, stage_id: int, mb: int) -> list[Instruction]:
    first, last = stage_id == 0, stage_id == num_stages - 1
    ops = [Op.LOAD] if first or last else []
    ops += [] if first else [Op.RECV_ACT]
    ops += [Op.FORWARD]
    ops += [] if last else [Op.SEND_ACT]
    return [Instruction(op, mb) for op in ops]


def _backward(num_stages: int, stage_id: int, mb: int) -> list[Instruction]:
    first, last = stage_id == 0, stage_id == num_stages - 1
    ops = ([] if last else [Op.RECV_GRAD]) + [Op.BACKWARD] + ([] if first else [Op.SEND_GRAD])
    return [Instruction(op, mb) for op in ops]


def _order_1f1b(num_stages: int, stage_id: int, m: int) -> list[tuple[str, int]]:
    warmup = min(num_stages - stage_id - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def _order_gpipe(num_stages: int, stage_id: int, m: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


SCHEDULES = {"1f1b": _order_1f1b, "gpipe": _order_gpipe}


def train_schedule(kind: str, num_stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """Instructions of stage `stage_id` for one training batch: compute order, then tied/DP reduction and step."""
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is not one of {sorted(SCHEDULES)}; set "
                         f"config['pipeline']['schedule'] to one of them")
    if not 0 <= stage_id < num_stages or micro_batches < 1:
        raise ValueError(f"need 0 <= stage_id < num_stages and micro_batches >= 1, got stage_id={stage_id} "
                         f"num_stages={num_stages} micro_batches={micro_batches}")
    out: list[Instruction] = []
    for phase, mb in SCHEDULES[kind](num_stages, stage_id, micro_batches):
        out += _forward(num_stages, stage_id, mb) if phase == "F" else _backward(num_stages, stage_id, mb)
    return out + [Instruction(Op.REDUCE_TIED), Instruction(Op.REDUCE_GRADS), Instruction(Op.STEP)]


def eval_schedule(num_stages: int, stage_id: int, micro_batches: int) -> list[Instruction]:
    """Forward-only instructions of one stage for `micro_batches` micro-batches."""
    return [i for mb in range(micro_batches) for i in _forward(num_stages, stage_id, mb)]


def peak_in_flight(instructions: list[Instruction]) -> int:
    """Most micro-batches whose forward ran and whose backward did not yet (= activation buffers held)."""
    live, peak = 0, 0
    for ins in instructions:
        live += (ins.op == Op.FORWARD) - (ins.op == Op.BACKWARD)
        peak = max(peak, live)
    return peak


def simulate(stage_lists: list[list[Instruction]]) -> list[tuple[int, Instruction]]:
    """Run all stages' lists with non-blocking sends and blocking receives; return the global order.

    Raises RuntimeError naming the blocked instructions if no stage can make progress (a deadlock)
    or if a receive is matched with a send of another micro-batch.
    """
    sent = {"act": [[] for _ in stage_lists], "grad": [[] for _ in stage_lists]}  # per receiving stage
    pos = [0] * len(stage_lists)
    trace: list[tuple[int, Instruction]] = []
    while any(p < len(lst) for p, lst in zip(pos, stage_lists)):
        progressed = False
        for s, lst in enumerate(stage_lists):
            while pos[s] < len(lst):
                ins = lst[pos[s]]
                if ins.op in (Op.RECV_ACT, Op.RECV_GRAD):
                    queue = sent["act" if ins.op == Op.RECV_ACT else "grad"][s]
                    if not queue:
                        break
                    got = queue.pop(0)
                    if got != ins.micro_batch:
                        raise RuntimeError(f"stage {s} {ins} received micro-batch {got}")
                elif ins.op == Op.SEND_ACT:
                    sent["act"][s + 1].append(ins.micro_batch)
                elif ins.op == Op.SEND_GRAD:
                    sent["grad"][s - 1].append(ins.micro_batch)
                trace.append((s, ins))
                pos[s] += 1
                progressed = True
        if not progressed:
            blocked = {s: str(lst[pos[s]]) for s, lst in enumerate(stage_lists) if pos[s] < len(lst)}
            raise RuntimeError(f"deadlock: blocked instructions per stage {blocked}")
    return trace
