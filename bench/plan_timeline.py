"""The planner's bubble and step-time split against the pipeline timeline, on sleeping layers.

    python bench/plan_timeline.py [--ms 100] [--micro-batches 8]

Runs bench/pipeline_bubble.py's protocol (p = 4 gloo processes, every stage's F, B and W sleep `--ms`, the
engine's timeline of batches 2 and 3) for 1F1B, interleaved (v = 2) and ZB-H1, and compares per schedule:

    bubble fraction   measured: mean over stages of idle / window (tds.pipe.timeline.bubble_fractions)
                      predicted: megatron.planning.speed.bubble_fraction (the schedule simulator, F = B = W)
    compute           measured: window - idle per stage; predicted: m (F + B + W) per stage
    step (window)     measured: first compute start .. last compute end; predicted: compute / (1 - bubble)

Sleeps do not compete for the 2 shared cores, so the figures hold on a loaded machine; the ~0.5 ms per send or
receive instruction of the engine shows as extra idle time (bench/pipeline_bubble.py's docstring).
"""
from __future__ import annotations

import argparse
import shutil
import tempfile

from _spawn import run_on_ranks  # bench/ is on the path when a script runs
from pipeline_bubble import P, run

from megatron.planning.memory import Layout
from megatron.planning.speed import bubble_fraction


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ms", type=float, default=100.0)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8])
    a = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="plan-timeline-")
    results = run_on_ranks(run, P, argparse.Namespace(ms=[a.ms], micro_batches=a.micro_batches), folder)[a.ms]
    shutil.rmtree(folder, ignore_errors=True)
    print(f"p = {P}, F = B = W = {a.ms:g} ms per stage and micro-batch (sleeping layers); per stage, mean of "
          f"batches 2-3")
    print("| schedule | m | bubble measured | bubble predicted | error | compute measured (s) | predicted | "
          "step measured (s) | predicted | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (s, v, m), r in results.items():
        predicted = bubble_fraction(Layout(pp=P, gas=m, schedule=s, virtual_stages=v))
        window = r["idle_s"] / r["bubble"]
        compute, step_pred = window - r["idle_s"], m * 3 * a.ms / 1e3
        step_pred_total = step_pred / (1 - predicted)
        print(f"| {s}{f' v={v}' if v > 1 else ''} | {m} | {r['bubble']:.3f} | {predicted:.3f} | "
              f"{(predicted - r['bubble']) / r['bubble']:+.1%} | {compute:.2f} | {step_pred:.2f} | {window:.2f} | "
              f"{step_pred_total:.2f} | {(step_pred_total - window) / window:+.1%} |")


if __name__ == "__main__":
    main()
