"""The planner's bubble and step-time split against the pipeline timeline, on sleeping layers.

    python bench/plan_timeline.py [--ms 100] [--micro-batches 8]

Runs bench/pipeline_bubble.py's protocol (p = 4 gloo processes, every stage's F, B and W sleep `--ms`, the
engine's timeline of batches 2 and 3) for 1F1B, interleaved (v = 2) and ZB-H1, and compares per schedule:

    idle fraction     measured: mean over stages of idle / window (tds.pipe.timeline.bubble_fractions): the
                      schedule's bubble and the time hops cost, both idle to the timeline
                      predicted: (bubble + pp comm) / step of megatron.planning.speed (bubble_fraction and
                      exposed_hops: the schedule simulator, F = B = W)
    compute           measured: window - idle per stage; predicted: m (F + B + W) per stage
    step (window)     measured: first compute start .. last compute end; predicted: compute / (1 - bubble)
                      + exposed instructions x instruction time (+ exposed hops x hop latency, 0 here)

The planner's CPU input, the stage time of one send or receive instruction, is calibrated on the 1F1B run's
timeline only (the median send instruction: a send never waits), then used for all three schedules; the hop
latency is taken as 0 (a few bytes over loopback; the stages' clocks are aligned only to a barrier's
precision, so a receive's end minus its send's end cannot measure it). Sleeps do not compete for the 2 shared
cores, so the figures hold on a loaded machine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile

from harness.spawn import run_on_ranks
from pipeline_bubble import P, run

from megatron.planning.memory import Layout
from megatron.planning.speed import bubble_fraction, exposed_hops
from tds.pipe.timeline import read_trace

def calibrate(trace: str) -> float:
    """The median send instruction (s) of batches 2-3 of a timeline."""
    spans, _ = read_trace(trace)
    return statistics.median(s.end - s.start for s in spans
                             if s.batch in (2, 3) and s.op in ("send_activations", "send_grads"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=float, default=100.0)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8])
    a = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="plan-timeline-")
    results = run_on_ranks(run, P, argparse.Namespace(ms=[a.ms], micro_batches=a.micro_batches), folder)[a.ms]
    suffix = "" if a.ms == 200 else f"_{a.ms:g}ms"
    instruction = calibrate(os.path.join(folder, f"1f1b_m{a.micro_batches[0]}{suffix}.json"))
    shutil.rmtree(folder, ignore_errors=True)
    print(f"p = {P}, F = B = W = {a.ms:g} ms per stage and micro-batch (sleeping layers); per stage, mean of "
          f"batches 2-3; calibrated on 1F1B m = {a.micro_batches[0]}: {instruction * 1e3:.2f} ms per send / "
          f"receive instruction, hop latency 0")
    print("| schedule | m | exposed hops / instructions | idle measured | idle predicted | error | compute measured "
          "(s) | predicted | step measured (s) | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (s, v, m), r in results.items():
        lay = Layout(pp=P, gas=m, schedule=s, virtual_stages=v)
        hops, instructions = exposed_hops(lay)
        window = r["idle_s"] / r["bubble"]
        compute, compute_pred = window - r["idle_s"], m * 3 * a.ms / 1e3
        step_pred = compute_pred / (1 - bubble_fraction(lay)) + instructions * instruction
        idle_pred = 1 - compute_pred / step_pred
        print(f"| {s}{f' v={v}' if v > 1 else ''} | {m} | {hops} / {instructions} | {r['bubble']:.3f} | "
              f"{idle_pred:.3f} | {(idle_pred - r['bubble']) / r['bubble']:+.1%} | {compute:.2f} | "
              f"{compute_pred:.2f} | {window:.2f} | {step_pred:.2f} | {(step_pred - window) / window:+.1%} |")


if __name__ == "__main__":
    main()
