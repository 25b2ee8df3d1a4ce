"""Text and JSON forms of the planner's predictions (the tool's table, `--dry-run`'s lines)."""
from __future__ import annotations

from dataclasses import fields
from typing import List, Optional

from .memory import StageMemory
from .search import Candidate, overflow_line

__all__ = ["gb", "stage_lines", "table", "as_json", "dry_run_lines"]


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def size(x: float) -> str:
    """Bytes as GB, or MB below 1 GB."""
    return f"{x / 1e9:.2f} GB" if x >= 1e9 else f"{x / 1e6:.2f} MB"


def secs(x: float) -> str:
    return f"{x:.3f} s" if x >= 1 else f"{x * 1e3:.2f} ms"


def stage_lines(stages: List[StageMemory]) -> List[str]:
    """One line per stage: peak per rank and its parts."""
    return [f"  stage {s.stage}: peak {size(s.peak)} per rank = weights {size(s.weights)} + gradients "
            f"{size(s.gradients - _unmade(s))} + optimizer {size(s.optimizer)} + " +
            (f"activations {size(s.activations)} ({s.in_flight} micro-batch units in flight) + working "
             f"{size(s.working)}" if s.peak_moment == "activations" else
             f"communication buffers {size(s.buffers)} (at the gradient reduction)") +
            f"; {s.params / 1e6:.2f} M parameters" for s in stages]


def _unmade(s: StageMemory) -> float:
    """The gradients not made yet at the peak (the stage's first backward makes them)."""
    return s.unmade_gradients if s.peak_moment == "activations" else 0.0


HEADER = (f"{'#':>3} {'layout':48s} {'fits':4s} {'peak GB':>8s} {'weights':>8s} {'grads':>7s} {'optim':>7s} "
          f"{'activ':>7s} {'buffers':>8s} {'step s':>8s} {'compute':>8s} {'bubble':>7s} {'tp':>6s} {'dp':>6s} "
          f"{'pp':>6s}")


def table(cands: List[Candidate]) -> str:
    rows = [HEADER]
    for i, c in enumerate(cands, 1):
        w, st = c.worst, c.step
        rows.append(f"{i:3d} {c.layout.short():48s} {'yes' if c.fits else 'no':4s} {gb(w.peak):>8s} "
                    f"{gb(w.weights):>8s} {gb(w.gradients):>7s} {gb(w.optimizer):>7s} "
                    f"{gb(w.activations + w.working):>7s} {gb(w.buffers):>8s} {st.total:8.3f} {st.compute:8.3f} "
                    f"{st.bubble:7.3f} {st.tp_comm:6.3f} {st.dp_comm:6.3f} {st.pp_comm:6.3f}")
    return "\n".join(rows)


def as_json(cands: List[Candidate]) -> list:
    """The candidates as --json prints them; a layout's expert-parallel size only where it is not 1 (a mixture of
    experts' choice: dense models' records stay as they were)."""
    return [dict(layout=_layout_fields(c.layout), fits=c.fits, budget=c.budget, peak=c.peak,
                 stages=[s.as_dict() for s in c.stages],
                 step=dict(_fields(c.step), total=c.step.total)) for c in cands]


def _layout_fields(layout) -> dict:
    return {k: v for k, v in _fields(layout).items() if k != "ep" or v != 1}


def _fields(record) -> dict:
    """A dataclass's fields by name (`dataclasses.asdict` without its deep copies: these are written, not kept)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


CPU_STEP = ("  step time: not predicted for CPU processes (the step-time model is a GPU's: GEMMs at a fraction of the "
            "peak; a CPU step of a small model is mostly per-operation costs of torch, the engine and gloo, several "
            "processes sharing each core: time a few iterations instead)")


def dry_run_lines(cand: Candidate, best: Optional[Candidate], step_time: bool = True) -> List[str]:
    """`pretrain --dry-run`: the layout's prediction per stage, or the one refusal line; without `step_time`
    (CPU processes) the step line says why there is none (`CPU_STEP`)."""
    if not cand.fits:
        return [overflow_line(cand, best)]
    st = cand.step
    step = f"  step {secs(st.total)} = compute {secs(st.compute)} + bubble {secs(st.bubble)} " \
           f"({st.bubble_fraction:.1%}) + tp {secs(st.tp_comm)} + dp {secs(st.dp_comm)} + pp {secs(st.pp_comm)} " \
           f"(predictions, not measurements)"
    return [f"predicted for {cand.layout.short()}: peak {size(cand.peak)} per rank (worst stage "
            f"{cand.worst.stage}, {size(cand.budget)} usable)", *stage_lines(cand.stages),
            step if step_time else CPU_STEP]


def short_prediction(cand: Candidate) -> str:
    """For the start-up line."""
    return f"predicted peak {size(cand.peak)} per rank (stage {cand.worst.stage})"
