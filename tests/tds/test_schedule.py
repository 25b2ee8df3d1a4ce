"""Schedules as data, tested without processes: instruction counts, peak in-flight micro-batches
(1F1B: min(p - s, m); GPipe: m), and deadlock freedom of whole pipelines under non-blocking sends."""
from __future__ import annotations

import itertools

import pytest

from tds.pipe.schedule import Op, eval_schedule, peak_in_flight, simulate, train_schedule

GRID = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 7, 16]))


def count(instrs, op):
    return sum(i.op == op for i in instrs)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", GRID)
def test_instruction_counts(kind, p, m):
    for s in range(p):
        instrs = train_schedule(kind, p, s, m)
        first, last = s == 0, s == p - 1
        assert count(instrs, Op.FORWARD) == count(instrs, Op.BACKWARD) == m
        assert count(instrs, Op.LOAD) == (m if first or last else 0)
        assert count(instrs, Op.RECV_ACT) == count(instrs, Op.SEND_GRAD) == (0 if first else m)
        assert count(instrs, Op.SEND_ACT) == count(instrs, Op.RECV_GRAD) == (0 if last else m)
        assert [i.op for i in instrs[-3:]] == [Op.REDUCE_TIED, Op.REDUCE_GRADS, Op.STEP]
        fwd = [i.micro_batch for i in instrs if i.op == Op.FORWARD]
        bwd = [i.micro_batch for i in instrs if i.op == Op.BACKWARD]
        assert fwd == bwd == list(range(m))  # receives on both sides come in micro-batch order


@pytest.mark.parametrize("p,m", GRID)
def test_peak_in_flight(p, m):
    for s in range(p):
        assert peak_in_flight(train_schedule("1f1b", p, s, m)) == min(p - s, m)
        assert peak_in_flight(train_schedule("gpipe", p, s, m)) == m


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", GRID)
def test_deadlock_free(kind, p, m):
    trace = simulate([train_schedule(kind, p, s, m) for s in range(p)])
    assert len(trace) == sum(len(train_schedule(kind, p, s, m)) for s in range(p))
    simulate([eval_schedule(p, s, m) for s in range(p)])


def test_forward_precedes_its_backward_and_load_precedes_forward():
    for s in range(4):
        instrs = train_schedule("1f1b", 4, s, 6)
        for mb in range(6):
            where = {i.op: k for k, i in enumerate(instrs) if i.micro_batch == mb}
            assert where[Op.FORWARD] < where[Op.BACKWARD]
            if Op.LOAD in where:
                assert where[Op.LOAD] < where[Op.FORWARD]


def test_simulate_detects_deadlock():
    bad = [train_schedule("1f1b", 2, 0, 2), list(reversed(train_schedule("1f1b", 2, 1, 2)[:-3]))]
    with pytest.raises(RuntimeError, match="deadlock|received micro-batch"):
        simulate(bad)


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="'zb'"):
        train_schedule("zb", 2, 0, 4)
