"""--check-replicas-interval N, --check-replicas-at-save: data-parallel replicas hold equal bits; check that they do.
(Experts spread over an expert-parallel group are compared over their expert-data-parallel group instead: the
data-parallel group holds other experts.)

Silent corruption (a bad GPU or link) that flips a bit of one replica's parameters trains on unseen, and the next
checkpoint saves it. The ranks of one data-parallel group (one pipeline stage, one tp rank) hold the same
parameters, bit for bit, after every step; at ZeRO stage 0 with a plain optimizer they also hold the same optimizer
state. So every rank fingerprints those tensors, the fingerprints are gathered over the group and compared.

    fingerprint     a tensor's bytes read as 32-bit words (16-bit or bytes where its size needs), two int64 sums:
                    plain and weighted by position (mod 65521): a flipped bit changes the first, and words moved
                    within the tensor change the second; on the tensor's device, no copy to the host
    check           the fingerprints of this rank's tensors all-gathered over its data-parallel group; the first
                    tensor on which the replicas disagree, and which of them differ from the group's most common
                    value, make the line; every rank then learns whether any group disagreed (an all_reduce of one
                    integer over the world) and, if one did, its line (all_gather_object), so all stop together
                    with the same line

What it cannot see: under ZeRO-1 (and BF16_Optimizer's partitioned master weights) each rank owns a partition of
the optimizer state and the fp32 master weights; a bit flipped there is copied to every replica by the next
all-gather of the parameters, so the replicas agree on the corrupted value. Catching that would need a checksum of
each partition carried from step to step (not built).
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

CHUNK = 1 << 22  # elements summed at a time (bounds the int64 copies' memory)
MODULUS = 65521


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    nbytes = flat.numel() * flat.element_size()
    raw = flat.view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            return raw.view(dtype)
    return raw


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """[sum of words, position-weighted sum of words], int64 with wrap-around, on t's device (no sync): equal bits
    give equal pairs."""
    words = _words(t)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), CHUNK):
        part = words[start:start + CHUNK].to(torch.int64)
        weights = (torch.arange(start, start + part.numel(), device=part.device) % MODULUS) + 1
        plain += part.sum()
        weighted += (part * weights).sum()
    return torch.stack([plain, weighted])


def replicated_tensors(module: torch.nn.Module, optimizer, state_replicated: bool,
                       experts: Optional[bool] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of what every data-parallel replica holds alike: the parameters, and where the optimizer's
    state is `state_replicated` (ZeRO stage 0 without BF16_Optimizer's partitions, `optimizer_state_replicated`) the
    state of the torch optimizer (or of the one an fp16 wrapper keeps over fp32 master weights). `experts` True:
    only the experts spread over an expert-parallel group (`param.expert_parallel`) and their state, which the
    expert-data-parallel group holds alike; False: all but those; None: everything."""
    def wanted(p) -> bool:
        return experts is None or bool(getattr(p, "expert_parallel", False)) == experts

    names = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        if wanted(p):
            yield f"parameter {name}", p
    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else getattr(optimizer, "optimizer", None)
    if not state_replicated or not isinstance(inner, torch.optim.Optimizer):
        return
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            if not wanted(p):
                continue
            for key, value in sorted(inner.state.get(p, {}).items()):
                if torch.is_tensor(value) and value.numel() > 0:
                    owner = names.get(id(p), f"group {g} parameter {i}")
                    yield f"optimizer state {key} of {owner}", value


def optimizer_state_replicated(engine, ds_zero_stage: int) -> bool:
    """Whether every data-parallel replica holds the whole optimizer state: ZeRO stage 0, and not DeepSpeed's
    BF16_Optimizer (or the project's subclass of it), which partitions its fp32 master weights and their state."""
    return ds_zero_stage == 0 and not engine.using_bf16_optimizer


def disagreement(names: Sequence[str], prints: torch.Tensor, ranks: Sequence[int]) -> Optional[str]:
    """`prints`: (replicas, tensors, 2) fingerprints in data-parallel rank order, `ranks` their global ranks. The
    first tensor whose fingerprints differ, with the ranks that differ from the most common value, or None."""
    for i, name in enumerate(names):
        values = [tuple(prints[r, i].tolist()) for r in range(prints.shape[0])]
        if len(set(values)) > 1:
            common = max(set(values), key=values.count)
            odd = [r for r, v in enumerate(values) if v != common]
            if values.count(common) * 2 <= len(values):  # no majority (two replicas): name every one
                odd = list(range(len(values)))
            who = ", ".join(f"{r} (global rank {ranks[r]})" for r in odd)
            many = len(odd) > 1
            others = "each other" if len(odd) == len(values) else "the rest"
            return f"the data-parallel replicas disagree on {name}: data-parallel rank{'s' if many else ''} {who} " \
                   f"hold{'' if many else 's'} other bits than {others}"
    return None


def check_replicas(tensors: List[Tuple[str, torch.Tensor]], dp_group, world_group=None) -> Optional[str]:
    """Every rank: compare its tensors' fingerprints over `dp_group`; returns the first disagreement any group of
    the world found (the same line on every rank), or None."""
    names = [n for n, _ in tensors]
    device = tensors[0][1].device if tensors else torch.device("cpu")
    mine = torch.stack([fingerprint(t) for _, t in tensors]) if tensors else torch.zeros(1, 2, dtype=torch.int64)
    size = dist.get_world_size(dp_group)
    found = None
    if size > 1:
        gathered = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(gathered, mine, group=dp_group)
        ranks = dist.get_process_group_ranks(dp_group) if dp_group is not None else list(range(size))
        found = disagreement(names, torch.stack(gathered).cpu(), ranks)
    anywhere = torch.tensor([found is not None], dtype=torch.int32, device=device)
    dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=world_group)  # the common case: one small all_reduce
    if not anywhere.item():
        return None
    verdicts: List[Optional[str]] = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(verdicts, found, group=world_group)
    return next(v for v in verdicts if v is not None)
