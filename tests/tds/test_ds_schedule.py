"""DeepSpeed's schedule classes as views of TDS's instruction lists (tds/pipe/ds_schedule.py): step by step the
same instructions, buffers and step count as the classes of the installed DeepSpeed, and every TDS
instruction of the stage exactly once."""
from __future__ import annotations

import collections
import itertools

import pytest

import deepspeed.runtime.pipe.schedule as ds
import tds.pipe.schedule as tds_schedule
from tds.pipe.schedule import Op, eval_schedule, train_schedule

GRID = list(itertools.product(range(1, 5), range(1, 9)))  # (stages, micro-batches)
CLASSES = ["TrainSchedule", "InferenceSchedule", "DataParallelSchedule"]


def steps(schedule) -> list[list[str]]:
    return [[repr(cmd) for cmd in step] for step in schedule]


@pytest.mark.parametrize("name", CLASSES)
def test_same_steps_as_deepspeed(name):
    for stages, m in GRID:
        for s in range(stages):
            ours, theirs = getattr(tds_schedule, name)(m, stages, s), getattr(ds, name)(m, stages, s)
            assert steps(ours) == steps(theirs), (name, stages, m, s)
            assert ours.num_pipe_buffers() == theirs.num_pipe_buffers(), (name, stages, m, s)
            assert isinstance(ours, ds.PipeSchedule)


def test_every_tds_instruction_once():
    """The adapter is a view: its instructions are exactly TDS's (mapped to DeepSpeed's class names)."""
    names = {Op.LOAD: "LoadMicroBatch", Op.FORWARD: "ForwardPass", Op.BACKWARD: "BackwardPass",
             Op.SEND_ACT: "SendActivation", Op.RECV_ACT: "RecvActivation", Op.SEND_GRAD: "SendGrad",
             Op.RECV_GRAD: "RecvGrad", Op.REDUCE_TIED: "ReduceTiedGrads", Op.REDUCE_GRADS: "ReduceGrads",
             Op.STEP: "OptimizerStep"}
    for stages, m in GRID:
        for s in range(stages):
            for ours, tds_list in ((tds_schedule.TrainSchedule(m, stages, s), train_schedule("1f1b", stages, s, m)),
                                   (tds_schedule.InferenceSchedule(m, stages, s), eval_schedule(stages, s, m))):
                got = collections.Counter(type(c).__name__ for step in ours for c in step)
                assert got == collections.Counter(names[i.op] for i in tds_list)


def test_gpipe_view_and_names_importable():
    """TDS's GPipe order gets DeepSpeed-style steps too: m forwards before the first backward, m buffers."""
    sched = tds_schedule.TrainSchedule(4, 2, 0, kind="gpipe")
    flat = [type(c).__name__ for step in sched for c in step]
    assert flat.index("BackwardPass") > max(i for i, n in enumerate(flat) if n == "ForwardPass")
    assert sched.num_pipe_buffers() == 4
    for name in ("PipeSchedule", "PipeInstruction", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass",
                 "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad", "ReduceTiedGrads",
                 "ReduceGrads", "OptimizerStep"):
        assert getattr(tds_schedule, name) is getattr(ds, name)  # DeepSpeed's own classes
