"""Time per category from a torch.profiler run: where an iteration's device (or CPU) time goes, and how much of the
wall clock the device sits idle. Used by `bench/gpu_throughput.py --profile`; tested on CPU
(tests/bench/test_profile_categories.py), so that a GPU run changes only the profiler's activity.

    with annotated():                       # the loss and the step tail named as profiler ranges
        with profile(activities=[...], schedule=...) as prof:
            ... prof.step() per iteration
    table = category_table(prof.events(), device=True)   # device=False: CPU time (a CPU run)
    print(format_table(table))

Each profiler event's own time (self_device_time_total: the kernels it launched; or self_cpu_time_total) goes to
one category: the enclosing annotation first (`tds::loss`: the loss; `tds::step_tail`: the optimizer step, the
clip, the NaN check and the gradient accumulation), then the operator's name:

    matrix products      mm, addmm, bmm, baddbmm, matmul, linear, gemm kernels
    attention forward    scaled_dot_product / flash / efficient / cudnn attention, without "backward"
    attention backward   the same with "backward"
    communication        nccl, gloo, c10d, all_reduce / all_gather / reduce_scatter / broadcast, send, recv
    copies               copy_, _to_copy, clone, contiguous, cat, fill_, zero_, Memcpy, Memset
    elementwise / norms  every other aten operator (add, mul, gelu, layer_norm, softmax, dropout, ...)
    other                autograd's and the profiler's own events (CPU only: dispatch, not kernels)

Idle = the wall clock of the profiled iterations (their ProfilerStep ranges) less the union of the intervals the
device was busy (kernels on a GPU; the operators on a CPU run's main thread). The SDPA backend is named from the
attention kernels or operators that ran (`sdpa_backend`).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional, Tuple

import torch

CATEGORIES = ("matrix products", "attention forward", "attention backward", "loss", "elementwise / norms", "copies",
              "optimizer (step tail)", "communication", "other")
ANNOTATIONS = {"tds::loss": "loss", "tds::step_tail": "optimizer (step tail)"}
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear", "aten::_scaled_mm",
          "gemm")
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention", "flash_fwd",
             "flash_bwd", "fmha")
COMMUNICATION = ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                 "broadcast", "record_param_comms", "aten::send", "aten::recv", "barrier")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat", "aten::fill_",
          "aten::zero_", "memcpy", "memset")


def category(name: str, annotation: Optional[str] = None) -> str:
    """The category of an event named `name` inside annotation range `annotation` (module docstring)."""
    if annotation is not None:
        return ANNOTATIONS[annotation]
    low = name.lower()
    if any(key in low for key in ATTENTION):
        return "attention backward" if "backward" in low or "bwd" in low else "attention forward"
    if any(low.startswith(key) or key == "gemm" and "gemm" in low for key in MATMUL):
        return "matrix products"
    if any(key in low for key in COMMUNICATION):
        return "communication"
    if any(low.startswith(key) or key in ("memcpy", "memset") and key in low for key in COPIES):
        return "copies"
    if low.startswith("aten::"):
        return "elementwise / norms"
    return "other"


def _annotation(event) -> Optional[str]:
    node = event
    while node is not None:
        if node.name in ANNOTATIONS:
            return node.name
        node = node.cpu_parent
    return None


def _union(intervals: Iterable[Tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(intervals):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def _is_device(event) -> bool:
    return event.device_type != torch.autograd.DeviceType.CPU


def category_table(events, device: bool) -> Dict[str, float]:
    """{category: ms per iteration, 'busy': ms, 'wall': ms, 'idle': ms, 'iterations': n} over the profiled steps."""
    # the CPU's step ranges: on a GPU the profiler also reports each ProfilerStep as a device-side range, which
    # would count every iteration twice (the first H200 run's table showed half of each figure)
    steps = [e for e in events if e.name.startswith("ProfilerStep") and not _is_device(e)]
    n = max(1, len(steps))
    out = {c: 0.0 for c in CATEGORIES}
    busy: List[Tuple[float, float]] = []
    main_thread = steps[0].thread if steps else None
    for e in events:
        if e.name.startswith("ProfilerStep") or e.is_user_annotation or e.name in ANNOTATIONS:
            continue
        if device and _is_device(e):
            busy.append((e.time_range.start, e.time_range.end))  # a kernel
            continue
        if _is_device(e):
            continue
        own = e.self_device_time_total if device else e.self_cpu_time_total
        if own:
            out[category(e.name, _annotation(e))] += own / 1e3 / n
        top = e.cpu_parent is None or e.cpu_parent.name.startswith("ProfilerStep")
        if not device and top and e.thread == main_thread:
            busy.append((e.time_range.start, e.time_range.end))
    wall = sum(s.time_range.end - s.time_range.start for s in steps) / 1e3 / n
    window = [(s.time_range.start, s.time_range.end) for s in steps]
    inside = [(max(lo, a), min(hi, b)) for lo, hi in busy for a, b in window if min(hi, b) > max(lo, a)]
    used = _union(inside) / 1e3 / n
    out.update(busy=used, wall=wall, idle=max(0.0, wall - used), iterations=len(steps))
    return out


def sdpa_backend(events) -> str:
    """Which scaled_dot_product_attention kernel ran: flash, cuDNN, memory-efficient or math (by name)."""
    names = " ".join(e.name.lower() for e in events)
    if "cudnn_attention" in names or ("cudnn" in names and "sdpa" in names):
        return "cuDNN"
    if "flash_attention" in names or "flash_fwd" in names or "pytorch_flash" in names:
        return "flash (CPU kernel)" if "for_cpu" in names else "flash"
    if "efficient_attention" in names or "fmha_cutlass" in names:
        return "memory-efficient"
    if "scaled_dot_product_attention_math" in names or "aten::scaled_dot_product_attention" in names:
        return "math"
    return "none ran"


def format_table(table: Dict[str, float], what: str = "GPU") -> str:
    """The table printed per configuration: ms per iteration by category, busy, idle and the wall clock."""
    busy = max(table["busy"], 1e-9)
    lines = [f"| category | {what} ms per iteration | % of the categories |", "|---|---|---|"]
    total = sum(table[c] for c in CATEGORIES)
    for c in CATEGORIES:
        lines.append(f"| {c} | {table[c]:.2f} | {100 * table[c] / max(total, 1e-9):.1f}% |")
    lines.append(f"| sum of the categories | {total:.2f} | 100% |")
    idle = 100 * table["idle"] / max(table["wall"], 1e-9)
    lines.append(f"\n{what} busy {busy:.2f} ms, idle {table['idle']:.2f} ms ({idle:.1f}%) of {table['wall']:.2f} ms "
                 f"wall clock per iteration, {table['iterations']} iterations profiled")
    return "\n".join(lines)


@contextlib.contextmanager
def annotated():
    """Name the loss (`masked_lm_loss`, which the Pipe models' LMLoss calls) and the engine's step tail (the
    gradient accumulation after each backward, the NaN check, clip and optimizer step) as profiler ranges while
    the block runs; restored afterwards."""
    from torch.profiler import record_function

    from megatron.model import language_model
    from tds.pipe.engine import PipelineEngine
    patches = [(language_model, "masked_lm_loss", "tds::loss"), (PipelineEngine, "_step_optimizer", "tds::step_tail"),
               (PipelineEngine, "_backward_epilogue", "tds::step_tail")]
    with contextlib.ExitStack() as stack:
        for owner, name, label in patches:
            stack.enter_context(_wrapped(owner, name, label, record_function))
        yield


@contextlib.contextmanager
def _wrapped(owner, name: str, label: str, record_function):
    own = name in vars(owner)
    function = getattr(owner, name)

    def annotated_call(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)
    setattr(owner, name, annotated_call)
    try:
        yield
    finally:
        if own:
            setattr(owner, name, function)
        else:
            delattr(owner, name)


class Profiled:
    """What `profiled` leaves after its block: the category table and the SDPA backend (None if nothing ran)."""
    table: Optional[Dict[str, float]] = None
    backend: Optional[str] = None
    prof = None


@contextlib.contextmanager
def profiled(device: bool, wait: int = 10, warmup: int = 1, active: int = 3):
    """Profile engine.train_batch calls wait + warmup + 1 .. wait + warmup + active of the block (each one a
    profiler step), annotated (`annotated`); afterwards the result's table and backend are set. device: CUDA
    kernels and device time (a GPU run), else CPU time (a CPU run)."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from tds.pipe.engine import PipelineEngine
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active))
    result = Profiled()
    original = PipelineEngine.train_batch

    def train_batch(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        prof.step()
        return out
    PipelineEngine.train_batch = train_batch
    try:
        with prof, annotated():
            yield result
    finally:
        PipelineEngine.train_batch = original
    events = prof.events()
    if events is not None:
        result.prof, result.table, result.backend = prof, category_table(events, device), sdpa_backend(events)
