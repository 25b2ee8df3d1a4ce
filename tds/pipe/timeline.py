"""Pipeline timelines: when each stage ran each instruction, in the Chrome trace format.

The engine records spans (stage, op, micro-batch, chunk, start, end) around every instruction of chosen
batches with a `TimelineRecorder`, which its `StageTimeline` (the `pipeline.timeline` option) hands out and
writes; `schedule_sim.simulate_timed` produces the same spans from given costs.
`write_trace` stores them as Chrome trace JSON (`chrome://tracing` and https://ui.perfetto.dev open it: one
process per batch, one thread per stage), `read_trace` reads them back and `bubble_fractions` measures:

    window  = [first compute start, last compute end] over all stages of the batch
    bubble  = 1 - (time the stage spent in F, B, W) / window        per stage

(receives that wait, sends, loads, reductions and the optimizer step are not compute). On simulated spans
it equals the closed forms of `schedule_sim` (e.g. (p-1)/(m+p-1) for 1F1B); `tools/plot_pipeline.py` draws a
trace and prints these fractions.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable

from .instructions import COMPUTE_OPS, Instruction

__all__ = ["Span", "TimelineRecorder", "StageTimeline", "write_trace", "read_trace", "bubble_fractions",
           "compute_window"]

_COMPUTE = {op.value for op in COMPUTE_OPS}


@dataclass(frozen=True)
class Span:
    """One instruction of one stage; times in seconds from the batch's origin."""
    stage: int
    op: str            # an `Op` value, e.g. "forward"
    micro_batch: int   # -1 for per-batch instructions (reductions, step)
    chunk: int
    start: float
    end: float
    batch: int = 0


@dataclass
class TimelineRecorder:
    """Records the instructions of the batches numbered in `batches` on one stage.

    Engine use, per batch number n (origins of different ranks line up when each calls `begin_batch` right
    after a barrier over the pipeline)::

        recording = recorder.begin_batch(n)
        for ins in instructions:
            t0 = recorder.clock() if recording else 0.0
            handlers[ins.op](ins, state)
            if recording:
                recorder.record(ins, t0, recorder.clock())
        recorder.end_batch()
    """
    stage_id: int
    batches: frozenset
    clock: Callable[[], float] = time.perf_counter
    spans: list = field(default_factory=list)
    _batch: int | None = None
    _origin: float = 0.0

    def __post_init__(self) -> None:
        self.batches = frozenset(int(b) for b in self.batches)

    def begin_batch(self, batch: int) -> bool:
        """Start batch `batch`; True when it is recorded."""
        self._batch = batch if batch in self.batches else None
        self._origin = self.clock()
        return self._batch is not None

    def record(self, ins: Instruction, start: float, end: float) -> None:
        """Record `ins`, run between clock readings `start` and `end`, if the current batch is recorded."""
        if self._batch is not None:
            self.spans.append(Span(self.stage_id, ins.op.value, ins.micro_batch, ins.chunk,
                                   start - self._origin, end - self._origin, self._batch))

    def end_batch(self) -> None:
        self._batch = None

    @property
    def done(self) -> bool:
        """True once every chosen batch has been recorded (time to write the trace)."""
        return {s.batch for s in self.spans} >= set(self.batches)


class StageTimeline:
    """The engine's `pipeline.timeline` option on one stage: records the chosen train batches and, once all
    are recorded, writes one trace from global rank 0 (data-parallel / tensor-parallel rank 0 stands for its
    stage). `from_config` returns None when no timeline is asked for."""

    def __init__(self, path: str, batches, grid, comm) -> None:
        self.path, self.grid, self.comm = path, grid, comm
        self.num_stages = grid.pipe_parallel_size
        self.recorder: TimelineRecorder | None = TimelineRecorder(grid.get_stage_id(), frozenset(batches))

    @classmethod
    def from_config(cls, cfg: dict, grid, comm) -> "StageTimeline | None":
        """pipeline.timeline (a Chrome trace path) records the train batches numbered in
        pipeline.timeline_batches (global step after the batch, as Megatron's iteration; default [3, 4])."""
        path = cfg.get("timeline")
        if not path:
            return None
        batches = cfg.get("timeline_batches", [3, 4])
        if isinstance(batches, int):
            batches = [batches]
        if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
            raise ValueError(f"pipeline.timeline_batches must be a list of batch numbers >= 1 (Megatron's "
                             f"iterations), got {batches!r}")
        return cls(path, batches, grid, comm)

    def begin(self, batch: int) -> TimelineRecorder | None:
        """The recorder when train batch `batch` is a chosen batch not yet written (after a barrier over the
        pipeline, so that the stages' time origins line up), else None."""
        rec = self.recorder
        if rec is None or batch not in rec.batches:
            return None
        if self.num_stages > 1:
            import torch.distributed as dist  # here: the simulation's spans import without torch
            with self.comm.guard("timeline", f"the barrier over {self.comm.describe('pipeline')}"):
                dist.barrier(group=self.grid.get_pipe_parallel_group())
        rec.begin_batch(batch)
        return rec

    def maybe_write(self, metadata: dict) -> None:
        """Once every chosen batch is recorded: gather the stages' spans over the pipeline group and write the
        trace, with `metadata`, from global rank 0."""
        rec = self.recorder
        if rec is None or not rec.done:
            return
        self.recorder = None
        import torch.distributed as dist
        spans = rec.spans
        if self.num_stages > 1:
            dst = self.grid.stage_to_global(0)
            gathered = [None] * self.num_stages if dist.get_rank() == dst else None
            with self.comm.guard("timeline", f"the span gather over {self.comm.describe('pipeline')}"):
                dist.gather_object(spans, gathered, dst=dst, group=self.grid.get_pipe_parallel_group())
            spans = [s for part in gathered or [] for s in part]
        if dist.get_rank() == 0:
            write_trace(self.path, spans, metadata)


def _short(span: Span) -> str:
    names = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W"}
    name = names.get(span.op, span.op)
    if span.micro_batch < 0:
        return name
    return f"{name}{span.micro_batch}" + (f".{span.chunk}" if span.chunk else "")


def write_trace(path: str, spans: Iterable[Span], metadata: dict | None = None) -> None:
    """Write spans (of any stages and batches) as Chrome trace JSON; the file appears complete or not at all.

    `metadata` goes to "otherData" (e.g. {"schedule": "zb-h1"}; {"time_unit": "cost"} for simulated spans,
    which tools/plot_pipeline.py then labels as cost units instead of ms)."""
    spans = sorted(spans, key=lambda s: (s.batch, s.stage, s.start))
    events = []
    for batch in sorted({s.batch for s in spans}):
        events.append({"name": "process_name", "ph": "M", "pid": batch, "args": {"name": f"batch {batch}"}})
        for stage in sorted({s.stage for s in spans if s.batch == batch}):
            events.append({"name": "thread_name", "ph": "M", "pid": batch, "tid": stage,
                           "args": {"name": f"stage {stage}"}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": batch, "tid": stage,
                           "args": {"sort_index": stage}})
    for s in spans:
        events.append({"name": _short(s), "cat": s.op, "ph": "X", "pid": s.batch, "tid": s.stage,
                       "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6, "args": asdict(s)})
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def read_trace(path: str) -> tuple[list[Span], dict]:
    """(spans, metadata) of a trace written by `write_trace`; exact times come from each event's args."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "traceEvents" not in doc:
        raise ValueError(f"{path} is not a Chrome trace JSON object with 'traceEvents'; write it with "
                         f"tds.pipe.timeline.write_trace or the engine's pipeline.timeline option")
    fields = set(Span.__dataclass_fields__)
    spans = [Span(**e["args"]) for e in doc["traceEvents"]
             if e.get("ph") == "X" and fields <= set(e.get("args", {}))]
    if not spans:
        raise ValueError(f"{path} holds no pipeline instruction spans (events with stage/op/micro_batch args)")
    return spans, doc.get("otherData", {})


def _compute_spans(spans: list[Span], batch: int | None) -> tuple[int, list[Span]]:
    """(the batch, default the first recorded; its F, B and W spans)."""
    batch = min(s.batch for s in spans) if batch is None else batch
    compute = [s for s in spans if s.batch == batch and s.op in _COMPUTE]
    if not compute:
        raise ValueError(f"batch {batch} has no forward/backward spans")
    return batch, compute


def _extent(compute: list[Span]) -> float:
    return max(s.end for s in compute) - min(s.start for s in compute)


def compute_window(spans: Iterable[Span], batch: int | None = None) -> float:
    """First compute start .. last compute end over all stages of one batch (default: the first recorded)."""
    return _extent(_compute_spans(list(spans), batch)[1])


def bubble_fractions(spans: Iterable[Span], batch: int | None = None) -> dict[int, float]:
    """{stage: idle fraction} of one batch (default: the first recorded), window as in the module docstring."""
    spans = list(spans)
    batch, compute = _compute_spans(spans, batch)
    window = _extent(compute)
    stages = sorted({s.stage for s in spans if s.batch == batch})
    busy = {st: sum(s.end - s.start for s in compute if s.stage == st) for st in stages}
    return {st: 1.0 - busy[st] / window for st in stages}
