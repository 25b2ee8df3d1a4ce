"""Measured per-rank peak memory of one training iteration (`--log-memory`).

On CUDA the rise is `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`, less what was allocated
when the iteration started. CPU torch has no such counter; there the measurement has two parts:

    live at the start   every tensor storage reachable from Python (gc), each counted once, classified as
                        parameters (the module's), gradients (their .grad), optimizer state (tensors reachable
                        from the optimizer object: DeepSpeed's fp32 partitions, Adam moments, flat buffers)
                        and other (RNG states, the data iterator's tensors, ...)
    rise to the peak    torch.profiler with profile_memory=True records every allocation and free of the CPU
                        allocator during the iteration; the largest running sum of those events, in time order
                        (frees on gloo's threads go unrecorded: each is counted when its address is reused)

    peak = live at the start + rise to the peak

Why this and not a TorchDispatchMode: the dispatcher sees tensor creation but not when a storage dies, and
misses allocations inside C++ kernels and collectives (gloo's buffers, autograd's accumulated gradients); the
profiler's allocator events see both. Why not the profiler alone: it cannot see what was allocated before it
started (weights, optimizer state), which the gc walk counts. Measured on iteration >= 2, when every lazily
created buffer (torch's AdamW moments) exists. Views share their storage and are counted once.
"""
from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Tuple

import torch

from tds import device as tds_device

__all__ = ["MemoryPeak", "measure_iteration", "live_storages", "format_peak"]


@dataclass(frozen=True)
class MemoryPeak:
    """Bytes on this rank: the parts live when the iteration starts, and the iteration's peak."""
    parameters: int
    gradients: int
    optimizer: int
    other: int
    rise: int          # the largest rise of allocated bytes above the start during the iteration

    @property
    def start(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.other

    @property
    def peak(self) -> int:
        return self.start + self.rise


def _storage_key(t: torch.Tensor) -> Tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def live_storages() -> Dict[int, int]:
    """data_ptr -> nbytes of every tensor storage on this rank's device (CUDA or CPU) reachable from Python."""
    kind = "cuda" if tds_device.is_cuda() else "cpu"
    out: Dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on deprecated torch.distributed aliases warns
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
    for obj in tensors:
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == kind and not obj.is_meta:
                ptr, n = _storage_key(obj)
                if ptr:
                    out[ptr] = n
        except Exception:  # noqa: BLE001 (half-built objects, proxies)
            continue
    return out


def _tensors_in(obj, depth: int = 4, seen=None) -> Iterable[torch.Tensor]:
    """Tensors reachable from `obj` through attributes, lists, tuples and dicts (up to `depth` hops)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        return
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        children = list(obj)
    elif isinstance(obj, torch.nn.Module):
        return  # the model's own tensors are counted as parameters
    elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "tds"):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _tensors_in(child, depth - 1, seen)


def classify(module: torch.nn.Module, optimizer) -> MemoryPeak:
    """The live bytes now, by part (rise 0)."""
    live = live_storages()
    params = {_storage_key(p)[0] for p in module.parameters()}
    grads = {_storage_key(p.grad)[0] for p in module.parameters() if p.grad is not None} - params
    opt = {_storage_key(t)[0] for t in _tensors_in(optimizer)} - params - grads
    size = lambda keys: sum(live.get(k, 0) for k in keys)  # noqa: E731
    other = sum(n for k, n in live.items() if k not in params and k not in grads and k not in opt)
    return MemoryPeak(size(params), size(grads), size(opt), other, 0)


def _rise(prof) -> int:
    """The largest running sum of the CPU allocator's events, in time order, pairing each free with its block.

    The profiler records allocations and frees on the thread that runs the iteration only. Gloo drops its last
    reference to a collective's input and output buffers on its own worker thread when the work completes, so
    those frees are never recorded (the sum would keep every such buffer and vary from run to run with the
    threads' timing). A block the allocator hands out again at an address still counted live was freed
    unseen: it is counted freed there, which is as late as it can have been, so the rise stays an upper bound.
    """
    from torch._C._profiler import _EventType
    allocations, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:  # depth first in recorded order, so that events of the same nanosecond keep theirs
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        stack.extend(reversed(node.children))
    allocations.sort(key=lambda a: a[0])  # stable
    live: Dict[int, int] = {}
    running = peak = 0
    for _, ptr, nbytes in allocations:
        if nbytes > 0:
            running += nbytes - live.pop(ptr, 0)  # an address still live was freed off this thread
            live[ptr] = nbytes
        else:
            running += nbytes if ptr not in live else -live.pop(ptr)  # blocks from before the iteration too
        peak = max(peak, running)
    return peak


def measure_iteration(module: torch.nn.Module, optimizer, step: Callable[[], object]) -> Tuple[object, MemoryPeak]:
    """Run `step()` (one engine.train_batch) under the allocator profiler; (its result, the MemoryPeak)."""
    from torch.profiler import ProfilerActivity, profile
    gc.collect()
    start = classify(module, optimizer)
    if tds_device.is_cuda():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = step()
        torch.cuda.synchronize()
        rise = torch.cuda.max_memory_allocated() - before
        other = before - start.parameters - start.gradients - start.optimizer  # what gc cannot reach counts here
        return result, MemoryPeak(start.parameters, start.gradients, start.optimizer, other, rise)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    return result, MemoryPeak(start.parameters, start.gradients, start.optimizer, start.other, _rise(prof))


def format_peak(where: str, peak: MemoryPeak, predicted: int = 0) -> str:
    """The one line per rank: peak and its parts in MiB (and the planner's prediction when given)."""
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    pred = f"; predicted {mib(predicted)} MiB ({(predicted - peak.peak) / max(peak.peak, 1):+.1%})" \
        if predicted else ""
    return (f"memory {where}: peak {mib(peak.peak)} MiB = at start {mib(peak.start)} (parameters "
            f"{mib(peak.parameters)}, gradients {mib(peak.gradients)}, optimizer {mib(peak.optimizer)}, other "
            f"{mib(peak.other)}) + rise {mib(peak.rise)} during the iteration{pred}")


class _Tokens:
    """What get_batch reads of a tokenizer: the end-of-document id (0 here, never drawn for GPT)."""
    eod = 0


def measure_engine(engine, cfg, spec, tp_group, iterations: int = 2) -> MemoryPeak:
    """Train `iterations` batches of random tokens through `spec.get_batch`; the last one is measured."""
    b, data = cfg.batch.micro_batch_size, cfg.data
    gen = torch.Generator().manual_seed(0)
    peak = None
    for it in range(iterations):
        # made when the engine loads them (its LOAD instruction), as a data loader would
        batches = (spec.get_batch(spec.synthetic_raw(b, data, cfg.tokenizer.vocab_size, gen), data, _Tokens(),
                                  tp_group) for _ in range(cfg.batch.gas))
        if it < iterations - 1:
            engine.train_batch(batches)
        else:
            _, peak = measure_iteration(engine.module, engine.optimizer, lambda: engine.train_batch(batches))
    return peak
