"""Schedules as data, tested without processes: instruction counts, peak in-flight micro-batches against the
formulas, deadlock freedom of whole pipelines under non-blocking sends and in-order links, and bubble
fractions of a timed simulation against the closed forms (1F1B/GPipe (p-1)/(m+p-1), interleaved
(p-1)/(v*m+p-1), ZB-H1 idle (p-1)(T_F+T_B-T_W): one third of 1F1B's with equal costs), and the planner's
`compute_windows` against that simulation, to the bit."""
from __future__ import annotations

import itertools

import pytest

from tds.pipe.instructions import COMPUTE_OPS, compute_order
from tds.pipe.schedule import (Instruction, Op, check_schedule, eval_schedule, peak_in_flight, simulate,
                               train_schedule)
from tds.pipe.schedule_sim import Costs, compute_windows, expected_bubble, expected_idle, simulate_timed
from tds.pipe.timeline import bubble_fractions, compute_window

GRID = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 3, 4, 7, 16]))
INTERLEAVED = [(p, m, v) for p in (2, 3, 4, 8) for m in (p, 2 * p, 4 * p) for v in (2, 3, 4)]
BACKWARDS = (Op.BACKWARD, Op.BACKWARD_INPUT)


def count(instrs, op):
    return sum(i.op == op for i in instrs)


def pipeline(kind, p, m, v=1):
    return [train_schedule(kind, p, s, m, v) for s in range(p)]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("p,m", GRID)
def test_instruction_counts(kind, p, m):
    backward = Op.BACKWARD_INPUT if kind == "zb-h1" else Op.BACKWARD
    for s in range(p):
        instrs = train_schedule(kind, p, s, m)
        first, last = s == 0, s == p - 1
        assert count(instrs, Op.FORWARD) == count(instrs, backward) == m
        assert count(instrs, Op.BACKWARD_WEIGHT) == (m if kind == "zb-h1" else 0)
        assert count(instrs, Op.LOAD) == (m if first or last else 0)
        assert count(instrs, Op.RECV_ACT) == count(instrs, Op.SEND_GRAD) == (0 if first else m)
        assert count(instrs, Op.SEND_ACT) == count(instrs, Op.RECV_GRAD) == (0 if last else m)
        assert [i.op for i in instrs[-3:]] == [Op.REDUCE_TIED, Op.REDUCE_GRADS, Op.STEP]
        assert all(i.chunk == 0 for i in instrs)
        for op in (Op.FORWARD, backward, Op.BACKWARD_WEIGHT):  # receives on both sides come in order
            assert [i.micro_batch for i in instrs if i.op == op] in ([], list(range(m)))


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_counts_and_units(p, m, v):
    for s in range(p):
        instrs = train_schedule("interleaved", p, s, m, v)
        for c in range(v):
            mine = [i for i in instrs if i.chunk == c]
            first, last = s == 0 and c == 0, s == p - 1 and c == v - 1
            assert [i.micro_batch for i in mine if i.op == Op.FORWARD] == list(range(m))
            assert [i.micro_batch for i in mine if i.op == Op.BACKWARD] == list(range(m))
            assert count(mine, Op.LOAD) == (m if first or last else 0)
            assert count(mine, Op.RECV_ACT) == count(mine, Op.SEND_GRAD) == (0 if first else m)
            assert count(mine, Op.SEND_ACT) == count(mine, Op.RECV_GRAD) == (0 if last else m)
        fwd = [(i.micro_batch, i.chunk) for i in instrs if i.op == Op.FORWARD]
        # Megatron's order: groups of p micro-batches, chunk-major inside a group
        assert fwd[:2 * p] == [(mb, 0) for mb in range(p)] + [(mb, 1) for mb in range(p)]
        bwd = [(i.micro_batch, i.chunk) for i in instrs if i.op == Op.BACKWARD]
        assert bwd[:p] == [(mb, v - 1) for mb in range(p)]


@pytest.mark.parametrize("p,m", GRID)
def test_peak_in_flight(p, m):
    for s in range(p):
        assert peak_in_flight(train_schedule("1f1b", p, s, m)) == min(p - s, m)
        assert peak_in_flight(train_schedule("gpipe", p, s, m)) == m
        zb = train_schedule("zb-h1", p, s, m)
        assert peak_in_flight(zb) == min(p - s, m)               # activations: as 1F1B (Qi et al. M_B)
        assert peak_in_flight(zb, until_weight=True) == min(p, m)  # + pending W's (M_W each)


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_peak_in_flight(p, m, v):
    for s in range(p):
        units = min(2 * (p - s - 1) + (v - 1) * p + 1, v * m)
        assert peak_in_flight(train_schedule("interleaved", p, s, m, v)) == units
    if m > p:  # stage 0 holds ((v+1)p-1)/v micro-batches' activations (Narayanan et al. §2.2.2)
        assert peak_in_flight(train_schedule("interleaved", p, 0, m, v)) / v == ((v + 1) * p - 1) / v


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1"])
@pytest.mark.parametrize("p,m", GRID)
def test_deadlock_free(kind, p, m):
    lists = pipeline(kind, p, m)
    assert len(simulate(lists)) == sum(map(len, lists))
    simulate([eval_schedule(p, s, m) for s in range(p)])


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_deadlock_free(p, m, v):
    lists = pipeline("interleaved", p, m, v)
    assert len(simulate(lists)) == sum(map(len, lists))
    for eval_m in (1, m - 1, m):  # forward-only runs any number of micro-batches
        simulate([eval_schedule(p, s, eval_m, v) for s in range(p)])


def test_interleaved_m_not_multiple_of_p_is_refused_because_the_order_breaks():
    """Why check_schedule asks m % p == 0: Megatron's order with a short last group deadlocks (p=4, m=5,
    v=3) or crosses an activation with a gradient on the shared link of p = 2 (m=3)."""
    from tds.pipe.instructions import SCHEDULES, _expand
    for (p, m, v), error in [((4, 5, 3), "deadlock"), ((2, 3, 2), r"received \('grad', 1, 1\)")]:
        lists = [[i for u in SCHEDULES["interleaved"](p, s, m, v) for i in _expand(u, p, s, v)] for s in range(p)]
        with pytest.raises(RuntimeError, match=error):
            simulate(lists)
        with pytest.raises(ValueError, match=f"multiple of the stages.*micro_batches={m}"):
            train_schedule("interleaved", p, 0, m, v)


def test_ring_hops_of_interleaved():
    p, m, v = 3, 3, 2
    last = train_schedule("interleaved", p, p - 1, m, v)
    first = train_schedule("interleaved", p, 0, m, v)
    assert Instruction(Op.SEND_ACT, 0, 0) in last and Instruction(Op.SEND_ACT, 0, 1) not in last
    assert Instruction(Op.RECV_ACT, 0, 1) in first and Instruction(Op.RECV_ACT, 0, 0) not in first
    assert Instruction(Op.SEND_GRAD, 0, 1) in first and Instruction(Op.SEND_GRAD, 0, 0) not in first
    assert str(Instruction(Op.FORWARD, 2, 1)) == "forward(micro_batch=2, chunk=1)"
    assert str(Instruction(Op.FORWARD, 2)) == "forward(micro_batch=2)"


def test_zb_h1_order_matches_the_paper_figure():
    """Qi et al. 2024 Figure 3 (top), p = 4, m = 8; stage 2 (third device), micro-batches 1-based there."""
    got = [(i.op, i.micro_batch + 1) for i in train_schedule("zb-h1", 4, 2, 8) if i.op in
           (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)]
    F, B, W = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    want = [(F, 1), (F, 2), (B, 1), (F, 3), (B, 2), (F, 4), (B, 3), (W, 1), (F, 5), (B, 4), (W, 2), (F, 6),
            (B, 5), (W, 3), (F, 7), (B, 6), (W, 4), (F, 8), (B, 7), (W, 5), (B, 8), (W, 6), (W, 7), (W, 8)]
    assert got == want


def test_forward_precedes_its_backward_and_load_precedes_forward():
    for kind in ("1f1b", "zb-h1"):
        for s in range(4):
            instrs = train_schedule(kind, 4, s, 6)
            for mb in range(6):
                where = {i.op: k for k, i in enumerate(instrs) if i.micro_batch == mb}
                backward = where.get(Op.BACKWARD, where.get(Op.BACKWARD_INPUT))
                assert where[Op.FORWARD] < backward < where.get(Op.BACKWARD_WEIGHT, len(instrs))
                if Op.LOAD in where:
                    assert where[Op.LOAD] < where[Op.FORWARD]


def test_simulate_detects_deadlock_and_crossed_messages():
    bad = [train_schedule("1f1b", 2, 0, 2), list(reversed(train_schedule("1f1b", 2, 1, 2)[:-3]))]
    with pytest.raises(RuntimeError, match="deadlock|received"):
        simulate(bad)
    swapped = train_schedule("1f1b", 2, 1, 2)
    swapped[0:3], swapped[5:8] = swapped[5:8], swapped[0:3]  # receives micro-batch 1 first
    with pytest.raises(RuntimeError, match=r"received \('act', 0, 0\)"):
        simulate([train_schedule("1f1b", 2, 0, 2), swapped])
    with pytest.raises(RuntimeError, match="deadlock|received"):
        simulate_timed(bad)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="'zb'"):
        train_schedule("zb", 2, 0, 4)
    with pytest.raises(ValueError, match="virtual_stages=2"):
        check_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="num_stages=1"):
        check_schedule("interleaved", 1, 4, 2)
    with pytest.raises(ValueError, match="stage_id=2"):
        train_schedule("zb-h1", 2, 2, 4)


COSTS = [Costs(), Costs(2, 1, 1), Costs(1, 1.2, 0.8), Costs(1.5, 2, 0.3)]


def _bubbles(kind, p, m, v=1, costs=Costs()):
    return bubble_fractions(simulate_timed(pipeline(kind, p, m, v), costs))


@pytest.mark.parametrize("costs", COSTS)
def test_timed_bubble_matches_formulas(costs):
    for p, m in [(1, 4), (2, 1), (2, 8), (4, 2), (4, 4), (4, 16), (8, 5), (8, 24)]:
        for kind in ("1f1b", "gpipe", "zb-h1"):
            got = _bubbles(kind, p, m, costs=costs)
            assert got == pytest.approx({s: expected_bubble(kind, p, m, costs=costs) for s in range(p)}, abs=1e-12)
        f = (p - 1) / (m + p - 1)
        assert _bubbles("1f1b", p, m, costs=costs) == pytest.approx(dict.fromkeys(range(p), f), abs=1e-12)
    for p, m, v in [(2, 2, 2), (2, 8, 3), (4, 4, 2), (4, 16, 2), (8, 16, 4)]:
        want = (p - 1) / (v * m + p - 1)
        assert _bubbles("interleaved", p, m, v, costs) == pytest.approx(dict.fromkeys(range(p), want), abs=1e-12)


def test_zb_h1_idles_one_third_of_1f1b_with_equal_costs():
    """T_F = T_B = T_W: idle per stage (p-1) vs 3(p-1); fractions (p-1)/(3m+p-1) vs (p-1)/(m+p-1)."""
    for p, m in [(2, 2), (4, 4), (4, 8), (4, 16), (8, 64)]:
        lists_zb, lists_1f1b = pipeline("zb-h1", p, m), pipeline("1f1b", p, m)
        span_zb, span_1f1b = simulate_timed(lists_zb), simulate_timed(lists_1f1b)
        makespan_zb, makespan_1f1b = max(s.end for s in span_zb), max(s.end for s in span_1f1b)
        assert makespan_zb == 3 * m + (p - 1) and makespan_1f1b == 3 * m + 3 * (p - 1)
        assert expected_idle("zb-h1", p, m) * 3 == expected_idle("1f1b", p, m) == 3 * (p - 1)
        zb, ref = bubble_fractions(span_zb), bubble_fractions(span_1f1b)
        assert zb == pytest.approx(dict.fromkeys(range(p), (p - 1) / (3 * m + p - 1)), abs=1e-12)
        assert ref == pytest.approx(dict.fromkeys(range(p), (p - 1) / (m + p - 1)), abs=1e-12)


def test_zb_h1_with_fewer_micro_batches_than_stages():
    """m < p: only m-1 W's fill the tail, idle (p-1)(T_F+T_B) - (m-1)T_W; still below 1F1B's."""
    for p, m in [(4, 1), (4, 3), (8, 5)]:
        zb, ref = _bubbles("zb-h1", p, m), _bubbles("1f1b", p, m)
        idle = 2 * (p - 1) - (m - 1)
        assert zb == pytest.approx(dict.fromkeys(range(p), idle / (3 * m + idle)), abs=1e-12)
        assert all(zb[s] < ref[s] for s in range(p))


def test_comm_cost_per_hop():
    """GPipe pays 2 hops per stage boundary: idle (p-1)(T + 2c); 1F1B's steady state also waits on round
    trips (so more); ZB-H1 stays below 1F1B."""
    c = Costs(1, 1, 1, comm=0.25)
    for p, m in [(2, 4), (4, 8)]:
        spans = simulate_timed(pipeline("gpipe", p, m), c)
        makespan = max(s.end for s in spans)
        assert makespan == pytest.approx(3 * m + (p - 1) * (3 + 2 * 0.25))
        ref, zb = _bubbles("1f1b", p, m, costs=c), _bubbles("zb-h1", p, m, costs=c)
        assert all(zb[s] < ref[s] for s in range(p))
        assert ref[0] > expected_bubble("1f1b", p, m)


def test_instruction_cost_occupies_the_stage():
    """A send or receive instruction costs its stage `instruction` besides the hop's `comm`: with one
    micro-batch each stage boundary is crossed twice, each crossing a send, the hop and a receive, so the
    makespan is 3p + (p-1)(2 comm + 4 instruction); that time is idle, not compute, and it lengthens 1F1B."""
    c = Costs(1, 1, 1, comm=0.25, instruction=0.1)
    for p in (2, 4):
        spans = simulate_timed(pipeline("gpipe", p, 1), c)
        assert max(s.end for s in spans) == pytest.approx(3 * p + (p - 1) * (2 * 0.25 + 4 * 0.1))
        assert sum(s.end - s.start for s in spans if s.op.startswith(("forward", "backward"))) == pytest.approx(3 * p)
    plain = _bubbles("1f1b", 4, 8, costs=Costs(1, 1, 1, comm=0.25))
    assert all(b > plain[s] for s, b in _bubbles("1f1b", 4, 8, costs=c).items())


def test_replayed_durations_replace_the_costs():
    """`durations` replays measured compute spans: a run's own spans give back its spans exactly, and one
    forward on the first stage made longer by d delays GPipe's last op by d (every stage waits for it)."""
    lists = pipeline("gpipe", 4, 4)
    spans = simulate_timed(lists, Costs(1, 1, 1, comm=0.25))
    measured = {(s.stage, s.op, s.micro_batch, s.chunk): s.end - s.start for s in spans
                if s.op.startswith(("forward", "backward"))}
    assert simulate_timed(lists, Costs(5, 5, 5, comm=0.25), durations=measured) == spans
    slower = dict(measured)
    key = (0, Op.FORWARD.value, 3, 0)
    slower[key] += 0.5
    end = max(s.end for s in simulate_timed(lists, Costs(1, 1, 1, comm=0.25), durations=slower))
    assert end == pytest.approx(max(s.end for s in spans) + 0.5)


# what a planner times by the thousand: the same windows without instructions or spans
WINDOW_COSTS = [Costs(), Costs(comm=1e-3), Costs(instruction=1e-3), Costs(1.0, 0.7, 0.3, comm=0.25, instruction=0.05)]


@pytest.mark.parametrize("kind", ["1f1b", "gpipe", "zb-h1", "interleaved"])
def test_compute_windows_are_the_timed_simulations_to_the_bit(kind):
    """`compute_windows` gives `compute_window(simulate_timed(lists, c))` for every cost set, equal (==, not
    approx): each stage's clock takes the same additions in the same order, whatever order the stages run in."""
    cases = [(p, m, v) for p in (2, 3, 4) for m in (p, 2 * p) for v in (2, 3)] + [(8, 8, 4)] \
        if kind == "interleaved" else [(p, m, 1) for p, m in GRID]
    for p, m, v in cases:
        want = [compute_window(simulate_timed(pipeline(kind, p, m, v), c)) for c in WINDOW_COSTS]
        assert compute_windows(kind, p, m, v, WINDOW_COSTS) == want, (kind, p, m, v)


def test_compute_order_is_the_lists_compute_ops():
    for kind, (p, m) in itertools.product(["1f1b", "gpipe", "zb-h1"], GRID):
        for s in range(p):
            ops = [(i.op, i.micro_batch, i.chunk) for i in train_schedule(kind, p, s, m) if i.op in COMPUTE_OPS]
            assert compute_order(kind, p, s, m) == ops


def test_compute_windows_detect_deadlock_and_crossed_messages():
    with pytest.raises(RuntimeError, match="deadlock"):
        compute_windows("1f1b", 2, 1, orders=[[(Op.BACKWARD, 0, 0)], [(Op.FORWARD, 0, 0)]])
    with pytest.raises(RuntimeError, match=r"stage 1 recv_activations\(micro_batch=1\) received \('act', 0, 0\)"):
        compute_windows("1f1b", 2, 2, orders=[[(Op.FORWARD, 0, 0), (Op.FORWARD, 1, 0)],
                                               [(Op.FORWARD, 1, 0), (Op.FORWARD, 0, 0)]])
