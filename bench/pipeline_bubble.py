"""Measured pipeline bubble of 1F1B, interleaved 1F1B and ZB-H1 on the TDS engine, beside the formulas.

Protocol: p = 4 processes (gloo, 1 thread each), m in {4, 8, 16} micro-batches. Every stage holds 2 layers whose
forward, input-gradient (B) and weight-gradient (W) steps sleep for fixed times, so that a stage's F, B and W
cost `--ms` milliseconds each whatever the 2 shared cores are doing (an interleaved chunk is 1 layer: half of
it). The engine records the timeline of batches 2 and 3 (`pipeline.timeline`; batch 1 warms up) and

    bubble of a stage = 1 - (time in F, B, W) / (first compute start .. last compute end over all stages)

(`tds.pipe.timeline.bubble_fractions`), averaged over the stages and the two batches. Printed beside it:

    1F1B         (p-1) / (m + p-1)
    interleaved  (p-1) / (v m + p-1)                    v = 2 chunks per stage
    ZB-H1        (p-1) / (3m + p-1)                     idle (p-1)(F + B - W) = 1/3 of 1F1B's (p-1)(F + B + W)

and the checks of issue 12: 1F1B and interleaved within 10% of their formula (issue 20, short layers of
20 ms: 1F1B within 5%); ZB-H1's bubble at most 40% of
1F1B's at the same m, as a fraction of the batch (exactly 47% / 41% / 37% at m = 4 / 8 / 16 with F = B = W)
and as idle time per stage (exactly 33%); ZB-H1's peak live activations (units whose forward ran and whose B
did not, counted by the engine) not above 1F1B's on any stage. The fraction criterion cannot hold at m = 4
and 8 (the report marks it FAIL there and the script's exit status ignores it); the idle-time one holds.

"as hop" is the time per hop between stages at which the schedule simulator (`tds.pipe.schedule_sim`, the
same op times) gives the measured bubble: the engine's and gloo's cost per hop as the bubble sees it. At 20 ms,
p = 4, m = 8 the simulator puts 1F1B 5% over its formula at 0.79 ms per hop and interleaved 10% over at 0.78 ms.

Printed too: a bare gloo hop measured in the same processes first (`bare_hop_ms`: two ranks exchange an
activation-sized message, the receiver idle in its receive, no engine) and the simulator's bubble at that hop,
i.e. what an engine that cost nothing per hop would measure on this machine (`bench/probes/pipeline_hops.py` splits
the engine's hop). And the simulator replaying the run's own measured F, B and W spans (`replayed`), with free
hops and with that bare hop: the sleeps wake late and unevenly, which alone puts a schedule over its formula.
Last, what the 1F1B and interleaved checks leave the engine per send or receive instruction on the stage, by the
simulator with exact op times and the bare hop (`allowed_instruction_ms`): at 20 ms, m = 8 and a 0.59 ms hop
0.092 ms for 1F1B and 0.045 ms for interleaved, against a first torch op that costs ~0.17 ms on a process that
has just slept 10 ms here (`bench/probes/wake_cost.py`).

The formulas count no communication, but each send and receive instruction of the engine takes ~0.3-0.5 ms of
Python and gloo time on the stage, which the measurement counts as idle: ~1.6 ms per micro-batch and chunk,
a deviation that grows with m and with v. With the default 200 ms per op it stays under 6% of the bubble
(measured: 1F1B 0.4-1.5%, interleaved 1.5-5.1%, ZB-H1 1.4-5.5%); with --ms 30 interleaved at m = 16 is 34%
above its formula. One run takes about 3.5 minutes.

    .venv/bin/python bench/pipeline_bubble.py [--ms 200 20] [--micro-batches 4 8 16] [--save-traces DIR]

`--save-traces DIR` keeps the Chrome traces (DIR/{schedule}_m{m}.json) for tools/plot_pipeline.py.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from harness.sleeping_pipeline import LAYERS_PER_STAGE, MBS, P, bare_hop_ms, build, data
from harness.spawn import run_on_ranks

SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def measure(schedule: str, v: int, m: int, ms: float, folder: str) -> dict | None:
    """Three train batches; on rank 0 the bubble and idle time per stage of batches 2 and 3."""
    import torch.distributed as dist

    from tds.pipe.timeline import bubble_fractions, compute_window, read_trace
    trace = os.path.join(folder, f"{schedule}_m{m}" + ("" if ms == 200 else f"_{ms:g}ms") + ".json")
    seconds = ms / 1e3 / LAYERS_PER_STAGE  # per layer: a stage's F (B, W) costs ms
    engine = build(schedule, v, m, seconds, trace)
    it = data()
    for _ in range(3):
        engine.train_batch(it)
    peaks = [None] * P
    dist.all_gather_object(peaks, (engine.last_batch_stats["peak_live_activations"],
                                   engine.last_batch_stats["peak_pending_weight_grads"]))
    if dist.get_rank() != 0:
        return None
    spans, _ = read_trace(trace)
    out = {"bubble": [], "idle": []}
    for batch in (2, 3):
        fractions = bubble_fractions(spans, batch)
        window = compute_window(spans, batch)
        out["bubble"].append(sum(fractions.values()) / len(fractions))
        out["idle"].append(sum(f * window for f in fractions.values()) / len(fractions))
    durations_ms = [{(s.stage, s.op, s.micro_batch, s.chunk): (s.end - s.start) * 1e3 for s in spans
                     if s.batch == batch and s.op.startswith(("forward", "backward"))} for batch in (2, 3)]
    return {"bubble": sum(out["bubble"]) / 2, "idle_s": sum(out["idle"]) / 2, "durations_ms": durations_ms,
            "peak_live": [p[0] for p in peaks], "peak_pending_w": [p[1] for p in peaks]}


def formula(schedule: str, v: int, m: int) -> float:
    return (P - 1) / ({"1f1b": 1, "interleaved": v, "zb-h1": 3}[schedule] * m + P - 1)


def run(args, folder: str) -> dict:
    return {ms: {(s, v, m): measure(s, v, m, ms, folder) for m in args.micro_batches for s, v in SCHEDULES}
            for ms in args.ms}


def run_with_hops(args, folder: str) -> tuple[dict, dict]:
    """`run`'s results and {ms: bare_hop_ms(ms)}, the bare hops measured first."""
    hops = {ms: bare_hop_ms(ms) for ms in args.ms}
    return run(args, folder), hops


def simulated(schedule: str, v: int, m: int, ms: float, hop_ms: float, durations_ms: dict | None = None,
              instruction_ms: float = 0.0) -> float:
    """Mean bubble of the schedule simulator (`tds.pipe.schedule_sim`) with these op times (or the measured ones
    where `durations_ms` has them, as `measure` returns them per batch), `hop_ms` per hop and `instruction_ms`
    of the stage's time per send and receive instruction."""
    from tds.pipe.instructions import train_schedule
    from tds.pipe.schedule_sim import Costs, simulate_timed
    from tds.pipe.timeline import bubble_fractions
    lists = [train_schedule(schedule, P, s, m, v) for s in range(P)]
    spans = simulate_timed(lists, Costs(ms / v, ms / v, ms / v, hop_ms, instruction_ms), durations=durations_ms)
    fractions = bubble_fractions(spans, 0)
    return sum(fractions.values()) / P


def replayed(schedule: str, v: int, m: int, result: dict, hop_ms: float) -> float:
    """The simulator's bubble with the F, B and W times this run measured (mean of its two batches) and `hop_ms`
    per hop: what the layers' own variation (sleeps waking late, unevenly) and the bare hop leave of the
    formula's bubble, with no engine cost."""
    runs = result["durations_ms"]  # every F, B and W of the batch: the nominal op time is never read
    return sum(simulated(schedule, v, m, 0.0, hop_ms, d) for d in runs) / len(runs)


def _solve(bubble_at, target: float, hi: float) -> float:
    """The x in [0, hi] at which the simulator's bubble `bubble_at(x)`, growing with x, reaches `target`
    (bisection)."""
    lo = 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bubble_at(mid) < target else (lo, mid)
    return (lo + hi) / 2


def hop_latency(schedule: str, v: int, m: int, ms: float, bubble: float) -> float:
    """The time per hop (ms) at which the simulator gives `bubble`: what the formula leaves out, as latency."""
    return _solve(lambda hop: simulated(schedule, v, m, ms, hop), bubble, ms)


def allowed_instruction_ms(schedule: str, v: int, m: int, ms: float, hop_ms: float, tolerance: float) -> float:
    """The engine's time per send and receive instruction (ms, on the stage) at which the simulator, with exact op
    times and `hop_ms` per hop, is `tolerance` over the formula: what a check leaves the engine on this machine's
    hop (0 where the hop alone exceeds it)."""
    target = formula(schedule, v, m) * (1 + tolerance)
    if simulated(schedule, v, m, ms, hop_ms) >= target:
        return 0.0
    return _solve(lambda cost: simulated(schedule, v, m, ms, hop_ms, instruction_ms=cost), target, ms)


def report(results: dict, ms: float, hop: float, args) -> bool:
    """The table and the checks of one op time: 1F1B within 10% of its formula at 200 ms (5% for short
    layers, < 100 ms), interleaved within 10%; ZB-H1 as in the module docstring."""
    one_tol = 0.10 if ms >= 100 else 0.05
    print(f"p = {P} stages, F = B = W = {ms:g} ms per stage and micro-batch (sleeps; backward B + W = {2 * ms:g} ms), "
          f"micro-batch {MBS}, bubble averaged over stages and batches 2-3")
    print(f"{'schedule':12s} {'m':>3s} {'measured':>9s} {'formula':>8s} {'rel.err':>8s} {'idle/stage':>11s} "
          f"{'as hop':>7s}  peak live activations per stage (pending W)")
    ok = True
    for (s, v, m), r in results.items():
        f = formula(s, v, m)
        err = abs(r["bubble"] - f) / f
        pend = f" ({r['peak_pending_w']})" if s == "zb-h1" else ""
        print(f"{s + (f' v={v}' if v > 1 else ''):12s} {m:3d} {r['bubble']:9.4f} {f:8.4f} {err:8.1%} "
              f"{r['idle_s'] * 1e3:8.0f} ms {hop_latency(s, v, m, ms, r['bubble']):5.2f}ms  {r['peak_live']}{pend}")
    floor = ", ".join(f"{s}{f' v={v}' if v > 1 else ''} m={m} {simulated(s, v, m, ms, hop) / formula(s, v, m) - 1:+.1%}"
                      for m in args.micro_batches for s, v in SCHEDULES)
    print(f"bare gloo hop on this machine, this run (idle receiver, no engine): median {hop:.2f} ms; the simulator "
          f"with that hop and no engine cost is over the formula by: {floor}")
    replay = ", ".join(f"{s}{f' v={v}' if v > 1 else ''} m={m} "
                       f"{replayed(s, v, m, results[(s, v, m)], 0.0) / formula(s, v, m) - 1:+.1%} / "
                       f"{replayed(s, v, m, results[(s, v, m)], hop) / formula(s, v, m) - 1:+.1%}"
                       for m in args.micro_batches for s, v in SCHEDULES)
    print(f"the simulator replaying this run's measured F, B and W times, with free hops / the bare hop and no "
          f"engine cost, is over the formula by: {replay}")
    allowed = ", ".join(f"{s}{f' v={v}' if v > 1 else ''} m={m} {allowed_instruction_ms(s, v, m, ms, hop, tol):.3f} ms"
                        for m in args.micro_batches for s, v, tol in (("1f1b", 1, one_tol), ("interleaved", 2, 0.10)))
    print(f"what the checks leave the engine per send or receive instruction, with the bare hop and exact op times "
          f"(the simulator): {allowed}")
    print("checks:")
    for m in args.micro_batches:
        one, inter, zb = (results[(s, v, m)] for s, v in SCHEDULES)
        checks = [
            (f"m={m:2d} 1F1B within {one_tol:.0%} of (p-1)/(m+p-1)",
             abs(one["bubble"] / formula("1f1b", 1, m) - 1) <= one_tol),
            (f"m={m:2d} interleaved within 10% of (p-1)/(vm+p-1)",
             abs(inter["bubble"] / formula("interleaved", 2, m) - 1) <= 0.10),
            (f"m={m:2d} ZB-H1 bubble fraction / 1F1B's = {zb['bubble'] / one['bubble']:.1%} "
             f"(exact {formula('zb-h1', 1, m) / formula('1f1b', 1, m):.1%}) <= 40%",
             zb["bubble"] <= 0.4 * one["bubble"]),
            (f"m={m:2d} ZB-H1 idle time per stage / 1F1B's = {zb['idle_s'] / one['idle_s']:.1%} (exact 33.3%) <= 40%",
             zb["idle_s"] <= 0.4 * one["idle_s"]),
            (f"m={m:2d} ZB-H1 peak live activations {zb['peak_live']} <= 1F1B's {one['peak_live']}",
             all(a <= b for a, b in zip(zb["peak_live"], one["peak_live"]))),
        ]
        for text, passed in checks:
            ok &= passed or "fraction" in text  # the fraction criterion cannot hold at small m (see docstring)
            print(f"  {'PASS' if passed else 'FAIL'}  {text}")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=float, nargs="+", default=[200.0, 20.0],
                   help="F, B and W time of one stage per micro-batch (ms), one run each (default: 200 and short "
                        "layers, 20 ms forward and 40 ms backward)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--save-traces", metavar="DIR", help="keep the Chrome traces here")
    args = p.parse_args()
    folder = args.save_traces or tempfile.mkdtemp(prefix="bubble-")
    os.makedirs(folder, exist_ok=True)
    results, hops = run_on_ranks(run_with_hops, P, args, folder)
    if not args.save_traces:
        shutil.rmtree(folder, ignore_errors=True)
    ok = all([report(results[ms], ms, hops[ms], args) for ms in args.ms])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
