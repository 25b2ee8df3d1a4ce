"""Draw pipeline timelines and print each stage's bubble fraction.

    python tools/plot_pipeline.py out.json [more.json ...] [-o timeline.png] [--batch N]
    python tools/plot_pipeline.py --simulate 1f1b zb-h1 --stages 4 --micro-batches 8 [--virtual-stages 2]
                                  [--costs F,B,W[,COMM]] -o simulated.png

A trace is the Chrome trace JSON the engine writes (`"pipeline": {"timeline": "out.json"}`) or
`tds.pipe.timeline.write_trace` writes; `--simulate` draws schedules timed by `tds.pipe.schedule_sim` instead
(`--costs` of one stage's layers; an interleaved chunk costs 1/v of them). One panel per recorded batch (or
simulated schedule), one row per stage: F blue, B green (light when only the input gradient, ZB-H1), W dark
green, sends/receives grey (a receive's bar is its wait), reductions orange, the optimizer step gold; white is
idle; bars are labelled micro-batch[.chunk]. For every panel it prints, per stage,
bubble = 1 - compute time / window, window = first compute start to last compute end over all stages
(`tds.pipe.timeline.bubble_fractions`). Without -o it only prints (no matplotlib needed).
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron.errors import UserError, exit_on_user_error
from tds.pipe.schedule import check_schedule, train_schedule
from tds.pipe.schedule_sim import Costs, simulate_timed
from tds.pipe.timeline import Span, bubble_fractions, read_trace

COLORS = {"forward": "#4878cf", "backward": "#3a9d4a", "backward_input": "#7fcf7f", "backward_weight": "#1f5f2c",
          "send_activations": "#b0b0b0", "send_grads": "#b0b0b0", "recv_activations": "#dcdcdc",
          "recv_grads": "#dcdcdc", "load_micro_batch": "#9ab0c8", "reduce_tied_grads": "#f28e2b",
          "reduce_grads": "#f28e2b", "optimizer_step": "#e8c547"}
LABELS = {"forward": "F", "backward": "B", "backward_input": "B (input grad)", "backward_weight": "W",
          "send_activations": "send", "recv_activations": "recv (wait)", "reduce_grads": "reduce",
          "optimizer_step": "step"}

Panel = tuple[str, list[Span], str]  # (title, spans, time unit: "s" measured, "cost" simulated)


def panels_from_traces(paths: list[str], batch: Optional[int]) -> list[Panel]:
    """(title, spans) per recorded batch of each trace, or only batch `batch`."""
    panels = []
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"trace file {path} not found; record one with the engine's pipeline.timeline option")
        try:
            spans, meta = read_trace(path)
        except ValueError as e:
            raise UserError(str(e)) from e
        batches = sorted({s.batch for s in spans})
        if batch is not None and batch not in batches:
            raise UserError(f"{path} holds batches {batches}, not --batch {batch}; pick one of them")
        for b in batches if batch is None else [batch]:
            unit = meta.get("time_unit", "s")  # simulated spans written to a trace: "cost"
            panels.append((f"{os.path.basename(path)}, batch {b}", [s for s in spans if s.batch == b], unit))
    return panels


def panels_from_simulation(kinds: list[str], stages: int, micro_batches: int, virtual_stages: int,
                           costs: Costs) -> list[Panel]:
    panels = []
    for kind in kinds:
        v = virtual_stages if kind == "interleaved" else 1
        try:
            check_schedule(kind, stages, micro_batches, v)
        except ValueError as e:
            raise UserError(str(e)) from e
        lists = [train_schedule(kind, stages, s, micro_batches, v) for s in range(stages)]
        chunk = Costs(costs.forward / v, costs.backward_input / v, costs.backward_weight / v, costs.comm)
        title = f"{kind} (simulated: p={stages}, m={micro_batches}" + (f", v={v}" if v > 1 else "") + ")"
        panels.append((title, simulate_timed(lists, chunk), "cost"))
    return panels


def report(panels: list[Panel]) -> list[dict[int, float]]:
    """Print and return the bubble fraction of every stage of every panel."""
    out = []
    for title, spans, _ in panels:
        fractions = bubble_fractions(spans)
        print(title)
        for stage, f in fractions.items():
            print(f"  stage {stage}: bubble {f:.4f}")
        print(f"  mean: bubble {sum(fractions.values()) / len(fractions):.4f}")
        out.append(fractions)
    return out


def draw(panels: list[Panel], fractions: list[dict[int, float]], path: str) -> None:
    """One row per stage per panel; written under a temporary name, then renamed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise UserError(f"drawing needs matplotlib ({e}); pip install matplotlib, or leave out -o") from e
    rows = sum(len(f) for f in fractions)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 1.0 + 0.45 * rows + 0.5 * len(panels)), squeeze=False,
                             sharex=True)
    for ax, panel, frac in zip(axes[:, 0], panels, fractions):
        _draw_panel(ax, panel, frac)
    ops = sorted({s.op for _, spans, _ in panels for s in spans if s.end > s.start}, key=list(COLORS).index)
    handles = [Patch(color=COLORS[op], label=LABELS.get(op, op)) for op in ops if op in LABELS]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    tmp = f"{path}.tmp{os.getpid()}"
    fig.savefig(tmp, dpi=110, format=os.path.splitext(path)[1][1:] or "png")
    plt.close(fig)
    os.replace(tmp, path)


def _draw_panel(ax, panel: Panel, fractions: dict[int, float]) -> None:
    title, spans, unit = panel
    stages = sorted(fractions)
    t0 = min(s.start for s in spans)
    unit, factor = ("ms", 1e3) if unit == "s" else ("time (cost units)", 1.0)
    width = (max(s.end for s in spans) - t0) * factor
    bars: dict[tuple[int, str], list] = {}  # (row, op) -> [(x, w)]: one collection each
    for s in spans:
        if s.end <= s.start:
            continue
        y = stages.index(s.stage)
        x, w = (s.start - t0) * factor, (s.end - s.start) * factor
        bars.setdefault((y, s.op), []).append((x, w))
        if s.op in ("forward", "backward", "backward_input", "backward_weight") and w > width / 60:
            label = str(s.micro_batch) + (f".{s.chunk}" if s.chunk else "")
            ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=7,
                    color="white" if s.op in ("forward", "backward_weight", "backward") else "black")
    for (y, op), xranges in bars.items():
        ax.broken_barh(xranges, (y - 0.4, 0.8), facecolors=COLORS.get(op, "#888888"), edgecolor="white",
                       linewidth=0.5)
    ax.set_yticks(range(len(stages)), [f"stage {st}\nbubble {fractions[st]:.1%}" for st in stages], fontsize=8)
    ax.set_ylim(len(stages) - 0.5, -0.5)
    ax.set_xlim(0, max(ax.get_xlim()[1], width))
    ax.set_xlabel(unit, fontsize=8)
    ax.set_title(title, fontsize=9, loc="left")


def parse_costs(text: str) -> Costs:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (3, 4) or min(values) < 0:
        raise UserError(f"--costs {text!r}: give F,B,W or F,B,W,COMM as non-negative numbers, e.g. 1,1,1")
    return Costs(*values)


def main(argv: Optional[list[str]] = None) -> list[dict[int, float]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*", help="Chrome trace JSON files (engine timelines)")
    ap.add_argument("-o", "--output", help="picture to write (.png, .svg, .pdf); without it only print")
    ap.add_argument("--batch", type=int, help="draw only this recorded batch (default: all)")
    ap.add_argument("--simulate", nargs="+", metavar="SCHEDULE", help="simulate these schedules instead")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--virtual-stages", type=int, default=2, help="model chunks per stage for 'interleaved'")
    ap.add_argument("--costs", default="1,1,1",
                    help="F,B,W[,COMM] of one stage's layers for --simulate (an interleaved chunk costs 1/v)")
    args = ap.parse_args(argv)
    if bool(args.traces) == bool(args.simulate):
        raise UserError("give trace files or --simulate SCHEDULE..., not both or neither")
    if args.simulate:
        panels = panels_from_simulation(args.simulate, args.stages, args.micro_batches, args.virtual_stages,
                                        parse_costs(args.costs))
    else:
        panels = panels_from_traces(args.traces, args.batch)
    fractions = report(panels)
    if args.output:
        draw(panels, fractions, args.output)
        print(f"wrote {args.output}")
    return fractions


if __name__ == "__main__":
    exit_on_user_error(main)
