"""Text and JSON forms of the planner's predictions (the tool's table, `--dry-run`'s lines)."""
from __future__ import annotations

from typing import List, Optional

from .memory import StageMemory
from .search import Candidate, overflow_line

__all__ = ["gb", "stage_lines", "table", "as_json", "dry_run_lines"]


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def stage_lines(stages: List[StageMemory]) -> List[str]:
    """One line per stage: peak per rank and its parts."""
    return [f"  stage {s.stage}: peak {gb(s.peak)} GB per rank = weights {gb(s.weights)} + gradients "
            f"{gb(s.gradients)} + optimizer {gb(s.optimizer)} + " +
            (f"activations {gb(s.activations)} ({s.in_flight} micro-batch units in flight) + working "
             f"{gb(s.working)}" if s.peak_moment == "activations" else
             f"communication buffers {gb(s.buffers)} (at the gradient reduction)") +
            f"; {s.params / 1e6:.1f} M parameters" for s in stages]


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
    from dataclasses import asdict
    return [dict(layout=asdict(c.layout), fits=c.fits, budget=c.budget, peak=c.peak,
                 stages=[s.as_dict() for s in c.stages],
                 step=dict(asdict(c.step), total=c.step.total)) for c in cands]


def dry_run_lines(cand: Candidate, best: Optional[Candidate]) -> List[str]:
    """`pretrain --dry-run`: the layout's prediction per stage, or the one refusal line."""
    if not cand.fits:
        return [overflow_line(cand, best)]
    st = cand.step
    return [f"predicted for {cand.layout.short()}: peak {gb(cand.peak)} GB per rank (worst stage "
            f"{cand.worst.stage}, {gb(cand.budget)} GB usable)", *stage_lines(cand.stages),
            f"  step {st.total:.3f} s = compute {st.compute:.3f} + bubble {st.bubble:.3f} "
            f"({st.bubble_fraction:.1%}) + tp {st.tp_comm:.3f} + dp {st.dp_comm:.3f} + pp {st.pp_comm:.3f} "
            f"(predictions, not measurements)"]


def short_prediction(cand: Candidate) -> str:
    """For the start-up line."""
    return f"predicted peak {gb(cand.peak)} GB per rank (stage {cand.worst.stage})"
