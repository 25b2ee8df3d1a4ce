"""`"pipeline": {"check_finite": true}`: stop a training batch before its optimizer step when a loss, an
activation leaving a stage or a gradient is NaN or infinite, naming where it first appeared.

Per batch each rank keeps one device flag per kind, without a host synchronisation until the step:
    forward    the activations it sends on (every float tensor, each micro-batch) and, on the last stage, the
               micro-batch losses
    gradients  the gradients the optimizer is about to read (`local_grads`): the parameters' .grad, a ZeRO
               optimizer's reduced partitions, BF16_Optimizer's fp32 accumulators
At STEP every rank agrees on the table first[kind][stage] = the lowest global rank of that stage whose flag is
set (world_size where none): a MIN all_reduce of 2p integers over the model-parallel group, then over the
data-parallel group. Every rank sees the same table, so either every rank steps or every rank raises
`NonFiniteError`. "First appeared" follows the data: forward runs stage 0 -> p-1, so the lowest stage with a
non-finite forward; with a finite forward, backward runs p-1 -> 0, so the highest stage with non-finite
gradients. Cost per batch: a foreach max-abs over the sent tensors and over the gradients, two small all_reduces,
one host read of the table (with the gradient norm, when the engine asks: the step's only host synchronisation).
fp16 leaves it off: its loss scaler already skips a step whose gradients overflowed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from tds import device as tds_device


class NonFiniteError(RuntimeError):
    """A NaN or infinity before the optimizer step; the step was not taken on any rank."""

    def __init__(self, batch: int, detail: str, kind: str, stage: int, rank: int):
        super().__init__(f"batch {batch}: {detail}")
        self.detail, self.kind, self.stage, self.rank = detail, kind, stage, rank


KINDS = ("forward", "gradients")


@dataclass
class FiniteCheck:
    """One rank's flags for the current batch and the agreement at the step (module docstring)."""
    stage_id: int
    num_stages: int
    world_rank: int
    world_size: int
    groups: tuple  # (model-parallel group, data-parallel group): together they span the world

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bad = {kind: None for kind in KINDS}

    def watch(self, kind: str, tensors: Iterable) -> None:
        """Fold `tensors` (float ones; others are skipped) into this batch's flag of `kind`."""
        floats = [t.detach() for t in tensors if torch.is_tensor(t) and t.is_floating_point() and t.numel()]
        if not floats:
            return
        # the largest |x| of each tensor is NaN or inf exactly when it holds one (and never overflows, as a sum
        # could); torch's foreach kernels take a few launches for all of them, not one per tensor
        largest = torch._foreach_norm(floats, float("inf"))
        bad = ~torch.isfinite(torch.stack(largest)).all()  # stack promotes mixed dtypes
        self._bad[kind] = bad if self._bad[kind] is None else self._bad[kind] | bad

    def agree(self, read: Optional[torch.Tensor] = None) -> tuple:
        """Collective over the model-parallel then the data-parallel group: ({kind: {stage: lowest rank}}, the
        value of the scalar tensor `read` or None). The table is built on the device and read on the host once,
        together with `read` (the step's one host synchronisation)."""
        p, dev = self.num_stages, tds_device.device()
        table = torch.full((len(KINDS), p), self.world_size, dtype=torch.int64, device=dev)
        mine = torch.tensor(self.world_rank, dtype=torch.int64, device=dev)
        for i, kind in enumerate(KINDS):
            if self._bad[kind] is not None:
                table[i, self.stage_id] = torch.where(self._bad[kind], mine, table[i, self.stage_id])
        for group in self.groups:
            dist.all_reduce(table, op=dist.ReduceOp.MIN, group=group)
        self.reset()
        host = torch.cat([table.flatten().double(), read.detach().reshape(1).double().to(dev)]) \
            if read is not None else table.flatten()
        values = host.tolist()
        found = {kind: {s: int(values[i * p + s]) for s in range(p) if values[i * p + s] < self.world_size}
                 for i, kind in enumerate(KINDS)}
        return found, (values[-1] if read is not None else None)

    def check(self, iteration: int, read: Optional[torch.Tensor] = None) -> Optional[float]:
        """Collective: raise NonFiniteError on every rank if any rank saw a non-finite value this batch; else
        return the value of `read` (a scalar tensor, e.g. the gradient norm), read with the agreement."""
        found, value = self.agree(read)
        where = first_appearance(found)
        if where is None:
            return value
        kind, stage, rank = where
        what = "a loss or an activation" if kind == "forward" else "a gradient"
        others = "; ".join(f"{k} on stages {sorted(found[k])}" for k in KINDS if found[k])
        raise NonFiniteError(iteration, f"{what} is NaN or infinite, first at pipeline stage {stage} (global rank "
                             f"{rank}; {others}); the optimizer step was not taken", kind, stage, rank)


def first_appearance(found: dict) -> Optional[tuple]:
    """(kind, stage, rank) where a non-finite value first appeared (module docstring), or None."""
    if found["forward"]:
        stage = min(found["forward"])
        return "forward", stage, found["forward"][stage]
    if found["gradients"]:
        stage = max(found["gradients"])
        return "gradients", stage, found["gradients"][stage]
    return None


def local_grads(module: torch.nn.Module, optimizer) -> list:
    """The gradients the optimizer step reads on this rank (module docstring); an optimizer that says which
    (`gradients_for_check`: bf16_tail's flat fp32 accumulators) is asked."""
    own = getattr(optimizer, "gradients_for_check", None)
    if own is not None:
        return own()
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    averaged = getattr(optimizer, "averaged_gradients", None)  # ZeRO stage 1/2 after the reduction
    if isinstance(averaged, dict):
        grads += [g for group in averaged.values() if group for g in group if g is not None]
    hp = getattr(optimizer, "fp32_groups_gradients_flat", None)  # BF16_Optimizer's fp32 accumulators
    if hp is not None:
        grads += [g for g in hp if g is not None]
    return grads
