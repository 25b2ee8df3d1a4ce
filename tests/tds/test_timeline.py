"""Timelines: the recorder, Chrome trace round trip, and tools/plot_pipeline.py on simulated schedules (its
printed bubble fractions equal the simulator's and the closed forms)."""
from __future__ import annotations

import json
import os
import re

import pytest

from megatron.errors import exit_on_user_error
from tds.pipe.schedule import Instruction, Op, train_schedule
from tds.pipe.schedule_sim import Costs, expected_bubble, simulate_timed
from tds.pipe.timeline import Span, TimelineRecorder, bubble_fractions, read_trace, write_trace
from tools import plot_pipeline

P, M = 4, 8


def simulated(kind, p=P, m=M, costs=Costs(), batch=0):
    return simulate_timed([train_schedule(kind, p, s, m) for s in range(p)], costs, batch=batch)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        self.t += 0.5
        return self.t


def test_recorder_keeps_only_chosen_batches_and_round_trips(tmp_path):
    rec = TimelineRecorder(stage_id=1, batches=[5, 6], clock=FakeClock())
    for batch in range(4, 8):
        recording = rec.begin_batch(batch)
        assert recording == (batch in (5, 6)) and rec.done == (batch == 7)
        for ins in [Instruction(Op.RECV_ACT, 0), Instruction(Op.FORWARD, 0, 1), Instruction(Op.STEP)]:
            t0 = rec.clock() if recording else 0.0
            if recording:
                rec.record(ins, t0, rec.clock())
        rec.end_batch()
        if batch == 6:
            assert rec.done
    assert [(s.batch, s.op, s.micro_batch, s.chunk) for s in rec.spans] == [
        (b, op, mb, c) for b in (5, 6) for op, mb, c in
        [("recv_activations", 0, 0), ("forward", 0, 1), ("optimizer_step", -1, 0)]]
    assert [(s.start, s.end) for s in rec.spans[:3]] == [(0.5, 1.0), (1.5, 2.0), (2.5, 3.0)]  # from the origin
    path = str(tmp_path / "t.json")
    write_trace(path, rec.spans, {"schedule": "1f1b"})
    spans, meta = read_trace(path)
    assert sorted(spans, key=lambda s: (s.batch, s.start)) == rec.spans and meta == {"schedule": "1f1b"}
    doc = json.load(open(path))
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {(e["pid"], e["tid"]) for e in x} == {(5, 1), (6, 1)}
    assert x[1]["name"] == "F0.1" and x[1]["ts"] == 1.5e6 and x[1]["dur"] == 0.5e6  # microseconds
    names = {(e["pid"], e.get("tid"), e["args"]["name"]) for e in doc["traceEvents"] if e["name"].endswith("_name")}
    assert names == {(5, None, "batch 5"), (6, None, "batch 6"), (5, 1, "stage 1"), (6, 1, "stage 1")}
    assert os.listdir(tmp_path) == ["t.json"]


def test_bubble_window_is_compute_only():
    """Receives that wait, loads and the optimizer step are idle for the bubble; the window spans compute."""
    spans = [Span(0, "forward", 0, 0, 0.0, 1.0), Span(0, "recv_grads", 0, 0, 1.0, 3.0),
             Span(0, "backward", 0, 0, 3.0, 4.0), Span(0, "optimizer_step", -1, 0, 4.0, 9.0),
             Span(1, "recv_activations", 0, 0, 0.0, 1.0), Span(1, "forward", 0, 0, 1.0, 2.0),
             Span(1, "backward", 0, 0, 2.0, 3.0), Span(1, "forward", 0, 0, 7.0, 8.0, batch=1)]
    assert bubble_fractions(spans) == {0: 0.5, 1: 0.5}
    assert bubble_fractions(spans, batch=1) == {1: 0.0}


def printed_fractions(text):
    """{panel title: {stage: fraction}} from the tool's output."""
    out, title = {}, None
    for line in text.splitlines():
        m = re.fullmatch(r"  stage (\d+): bubble ([0-9.]+)", line)
        if m:
            out[title][int(m.group(1))] = float(m.group(2))
        elif not line.startswith(" ") and not line.startswith("wrote"):
            title = line
            out[title] = {}
    return out


def test_plot_tool_on_simulated_1f1b_and_zb_h1(tmp_path, capsys):
    paths = []
    for kind in ("1f1b", "zb-h1"):
        paths.append(str(tmp_path / f"{kind}.json"))
        write_trace(paths[-1], simulated(kind), {"time_unit": "cost"})
    png = str(tmp_path / "timeline.png")
    returned = plot_pipeline.main([*paths, "-o", png])
    printed = printed_fractions(capsys.readouterr().out)
    one, zb = (P - 1) / (M + P - 1), (P - 1) / (3 * M + P - 1)  # 3/11 and 3/27 (T_F = T_B = T_W)
    assert printed == {"1f1b.json, batch 0": dict.fromkeys(range(P), round(one, 4)),
                       "zb-h1.json, batch 0": dict.fromkeys(range(P), round(zb, 4))}
    assert returned[0] == pytest.approx(dict.fromkeys(range(P), one), abs=1e-12)
    assert returned[1] == pytest.approx(bubble_fractions(simulated("zb-h1")), abs=1e-12)
    assert returned[1] == pytest.approx(dict.fromkeys(range(P), expected_bubble("zb-h1", P, M)), abs=1e-12)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["1f1b.json", "timeline.png", "zb-h1.json"]


def test_plot_tool_simulate_and_batch_selection(tmp_path, capsys):
    got = plot_pipeline.main(["--simulate", "interleaved", "gpipe", "--stages", "2", "--micro-batches", "4",
                              "--virtual-stages", "2", "--costs", "2,1,1"])
    assert got[0] == pytest.approx({0: 1 / 9, 1: 1 / 9}) and got[1] == pytest.approx({0: 1 / 5, 1: 1 / 5})
    path = str(tmp_path / "two.json")
    write_trace(path, simulated("1f1b", batch=5) + simulated("zb-h1", batch=6))
    capsys.readouterr()
    assert plot_pipeline.main([path, "--batch", "6"]) == [pytest.approx(bubble_fractions(simulated("zb-h1")))]
    assert capsys.readouterr().out.startswith("two.json, batch 6\n")


@pytest.mark.parametrize("argv,needle", [
    (["missing.json"], "trace file missing.json not found"),
    (["{trace}", "--batch", "3"], "holds batches [0], not --batch 3"),
    (["{bad}"], "is not a Chrome trace JSON object"),
    (["--simulate", "interleaved", "--stages", "4", "--micro-batches", "6"], "micro_batches=6"),
    (["--simulate", "1f1b", "--costs", "1,x"], "--costs '1,x'"),
    ([], "give trace files or --simulate"),
])
def test_plot_tool_user_errors(tmp_path, capsys, argv, needle):
    trace, bad = str(tmp_path / "t.json"), str(tmp_path / "bad.json")
    write_trace(trace, simulated("1f1b", p=2, m=2))
    with open(bad, "w") as f:
        json.dump([1, 2], f)
    argv = [a.format(trace=trace, bad=bad) for a in argv]
    with pytest.raises(SystemExit) as exc:
        exit_on_user_error(lambda: plot_pipeline.main(argv))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("error: ") and needle in err and len(err.splitlines()) == 1
