"""DeepSpeed 0.19's schedule classes as views of TDS's instruction lists, for tools written against DeepSpeed.

    for step_cmds in TrainSchedule(micro_batches=m, stages=p, stage_id=s):
        ...   # [SendGrad(buffer_id=1), RecvActivation(buffer_id=0), ForwardPass(buffer_id=0)], ...

The instructions are DeepSpeed's own classes (`deepspeed.runtime.pipe.schedule`), so isinstance checks and
reprs are DeepSpeed's. What they say comes from `schedule.train_schedule` / `eval_schedule`: every TDS
instruction of the stage appears once, placed on DeepSpeed's lock-step clock:

- step of a compute op: as early as the stage's own order and the op it depends on allow (forward(i) on
  stage s after forward(i) on s-1, backward(i) after backward(i) on s+1); in training stage s runs forwards
  only at steps t with t+s even and backwards at t+s odd (DeepSpeed alternates them so that blocking sends
  and receives pair up). For 1F1B that puts forward(i) at 2i+s and backward(i) at 2i+2p-s-1, 2(m+p-1) steps.
- a send goes into the step after its compute; within a step the order is DeepSpeed's (training forward step:
  SendGrad, RecvActivation, LoadMicroBatch, ForwardPass; backward step: RecvGrad, SendActivation,
  BackwardPass; inference: LoadMicroBatch, then send and receive (even stages send first), ForwardPass).
- the reduction and optimizer instructions end the last step.
- buffers: micro-batch i uses buffer i % num_pipe_buffers(), with max(2, peak in-flight micro-batches) buffers
  in training (DeepSpeed's max(2, min(p - s, m)) for 1F1B), 2 in inference and 1 for DataParallelSchedule.

The TDS engine does not execute these objects (it keys buffers by micro-batch); `PipeSchedule` is
DeepSpeed's abstract base, re-exported for subclassing and isinstance checks.
"""
from __future__ import annotations

from deepspeed.runtime.pipe.schedule import (BackwardPass, BufferOpInstruction, CommitP2P,  # noqa: F401
                                             ForwardPass, LoadMicroBatch, OptimizerStep, PipeInstruction,
                                             PipeSchedule, RecvActivation, RecvGrad, ReduceGrads,
                                             ReduceTiedGrads, SendActivation, SendGrad)

from .instructions import Op, eval_schedule, peak_in_flight, train_schedule

__all__ = ["PipeSchedule", "TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "PipeInstruction",
           "BufferOpInstruction", "LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation",
           "RecvActivation", "SendGrad", "RecvGrad", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep", "CommitP2P"]


def _ds_instruction(op, buffer_id: int):
    buffered = {Op.LOAD: LoadMicroBatch, Op.FORWARD: ForwardPass, Op.BACKWARD: BackwardPass,
                Op.SEND_ACT: SendActivation, Op.RECV_ACT: RecvActivation, Op.SEND_GRAD: SendGrad,
                Op.RECV_GRAD: RecvGrad}
    plain = {Op.REDUCE_TIED: ReduceTiedGrads, Op.REDUCE_GRADS: ReduceGrads, Op.STEP: OptimizerStep}
    if op in buffered:
        return buffered[op](buffer_id)
    if op in plain:
        return plain[op]()
    raise ValueError(f"TDS instruction {op.value!r} has no DeepSpeed 0.19 equivalent")


def _place(stage_lists: list, alternate: bool) -> dict:
    """{(stage, op, micro_batch): step} for every compute op, on DeepSpeed's clock (module docstring)."""
    p = len(stage_lists)
    orders = [[(i.op, i.micro_batch) for i in lst if i.op in (Op.FORWARD, Op.BACKWARD)] for lst in stage_lists]
    for lst in stage_lists:
        if any(getattr(i, "chunk", 0) for i in lst) or any(i.op.value.startswith("backward_") for i in lst):
            raise ValueError("DeepSpeed 0.19 has no schedule class for interleaved or split-backward schedules")
    placed, pos, last = {}, [0] * p, [-1] * p
    while any(k < len(o) for k, o in zip(pos, orders)):
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                op, mb = orders[s][pos[s]]
                dep = (s - 1, op, mb) if op == Op.FORWARD and s > 0 else \
                    (s + 1, op, mb) if op == Op.BACKWARD and s < p - 1 else None
                if dep is not None and dep not in placed:
                    break
                t = max(last[s], placed.get(dep, -1)) + 1
                if alternate and (t + s) % 2 != (op == Op.BACKWARD):
                    t += 1
                placed[(s, op, mb)] = last[s] = t
                pos[s] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"the stages' compute orders never meet (blocked at {pos})")
    return placed


def _steps(stage_lists: list, stage_id: int, alternate: bool, buffers: int) -> list[list]:
    """DeepSpeed-style steps of `stage_id` from every stage's TDS instruction list."""
    placed = _place(stage_lists, alternate)
    total = max(placed.values()) + 1
    # rank within a step: training forward / backward step and inference step orders (module docstring)
    even = stage_id % 2 == 0
    rank = {Op.SEND_GRAD: 0, Op.RECV_ACT: 1, Op.LOAD: 2, Op.FORWARD: 3, Op.RECV_GRAD: 0, Op.SEND_ACT: 1,
            Op.BACKWARD: 2} if alternate else \
        {Op.LOAD: 0, Op.SEND_ACT: 1 if even else 2, Op.RECV_ACT: 2 if even else 1, Op.FORWARD: 3}
    steps: list[list] = [[] for _ in range(total)]
    tail = []
    for ins in stage_lists[stage_id]:
        if ins.micro_batch < 0:
            tail.append(_ds_instruction(ins.op, 0))
            continue
        compute = Op.BACKWARD if ins.op in (Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD) else Op.FORWARD
        t = placed[(stage_id, compute, ins.micro_batch)] + (ins.op in (Op.SEND_ACT, Op.SEND_GRAD))
        steps[t].append((rank[ins.op], _ds_instruction(ins.op, ins.micro_batch % buffers)))
    out = [[cmd for _, cmd in sorted(step, key=lambda rc: rc[0])] for step in steps]
    out[-1] += tail
    return out


class TrainSchedule(PipeSchedule):
    """DeepSpeed's TrainSchedule (1F1B) over `schedule.train_schedule(kind, stages, stage_id, micro_batches)`;
    `kind` ('1f1b' by default, or 'gpipe') is the only addition to DeepSpeed's signature."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, kind: str = "1f1b"):
        super().__init__(micro_batches, stages, stage_id)
        self.kind = kind
        self.instructions = [train_schedule(kind, stages, s, micro_batches) for s in range(stages)]

    def num_pipe_buffers(self) -> int:
        return max(2, peak_in_flight(self.instructions[self.stage_id]))

    def steps(self):
        yield from _steps(self.instructions, self.stage_id, alternate=True, buffers=self.num_pipe_buffers())


class InferenceSchedule(PipeSchedule):
    """DeepSpeed's InferenceSchedule over `schedule.eval_schedule(stages, stage_id, micro_batches)`."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int):
        super().__init__(micro_batches, stages, stage_id)
        self.instructions = [eval_schedule(stages, s, micro_batches) for s in range(stages)]

    def num_pipe_buffers(self) -> int:
        return 2

    def steps(self):
        yield from _steps(self.instructions, self.stage_id, alternate=False, buffers=2)


class DataParallelSchedule(PipeSchedule):
    """DeepSpeed's DataParallelSchedule (one stage, gradient accumulation) over a 1-stage `train_schedule`:
    one step per micro-batch, ReduceGrads and OptimizerStep after the last (no tied weights to reduce)."""

    def num_pipe_buffers(self) -> int:
        return 1

    def steps(self):
        steps: list[list] = [[] for _ in range(self.micro_batches)]
        for ins in train_schedule("1f1b", 1, 0, self.micro_batches):
            if ins.micro_batch >= 0:
                steps[ins.micro_batch].append(_ds_instruction(ins.op, 0))
            elif ins.op != Op.REDUCE_TIED:
                steps[-1].append(_ds_instruction(ins.op, 0))
        yield from steps
