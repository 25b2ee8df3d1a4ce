"""Expert parallelism: the tokens' chosen experts live on other ranks of the expert-parallel group.

Rank r of an expert-parallel group of size P holds experts [r E_l, (r + 1) E_l), E_l = E / P. Two dispatchers, as
Megatron's `--moe-token-dispatcher-type`:

allgather (Megatron's default): every rank gathers every rank's tokens, probabilities and choices, runs its own
experts on the rows that chose them (the choices of other ranks' experts set to -1), and a reduce-scatter sums the
P partial outputs back onto each rank's tokens (backward: the gradients reduce-scattered, then all-gathered).

alltoall moves each token copy to the rank of its expert and back:

    permute     the (token, choice) pairs sorted by expert (stable: token order within an expert); -1 (dropped) left out
    counts      an all-to-all of the per-expert counts: how many rows each rank sends to each of my experts
    dispatch    an all-to-all of the rows (gradients: the same all-to-all reversed)
    compute     my experts over their rows, source rank by source rank
    combine     the all-to-all back, then each row times its probability added into its token (index_add)

Nothing here knows the model: `expert_fn(j, rows)` computes local expert j. Groups come from the caller.
"""
from __future__ import annotations

import itertools

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.mpu.mappings import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region

__all__ = ["AllToAll", "allgather_dispatch_combine", "dispatch_combine", "local_experts"]


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, out_splits: list, in_splits: list) -> torch.Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def local_experts(num_experts: int, group) -> int:
    """E / P: how many experts each rank of the expert-parallel `group` (None: one rank) holds."""
    size = dist.get_world_size(group) if group is not None else 1
    if num_experts % size:
        raise ValueError(f"--num-experts {num_experts} is not divisible by --expert-model-parallel-size {size}")
    return num_experts // size


def dispatch_combine(x: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                     expert_fn: Callable[[int, torch.Tensor], torch.Tensor], group: Optional[object] = None
                     ) -> torch.Tensor:
    """(T, h) -> (T, h): sum over each token's kept choices of prob x expert(token), the experts spread over the
    expert-parallel `group` (None: one rank holds them all); `expert_fn(j, rows)` runs this rank's j-th expert."""
    local = local_experts(num_experts, group)
    size = num_experts // local
    flat = experts.reshape(-1)
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(experts.shape[1])
    keep = flat >= 0
    order = torch.sort(flat[keep], stable=True).indices
    chosen_expert = flat[keep][order]
    chosen_token, chosen_prob = token_of[keep][order], probs.reshape(-1)[keep][order]
    rows = x[chosen_token]
    counts = torch.bincount(chosen_expert, minlength=num_experts)  # rows I send to each expert
    if size > 1:
        recv = torch.empty_like(counts)  # rows each rank sends to each of my experts: (P, E_l) after the view
        dist.all_to_all_single(recv, counts, group=group)
        recv = recv.view(size, local)
        send_splits, recv_splits = counts.view(size, local).sum(dim=1).tolist(), recv.sum(dim=1).tolist()
        rows = AllToAll.apply(rows, group, recv_splits, send_splits)
    else:
        recv = counts.view(1, local)
    out_rows = _run_experts(rows, recv, expert_fn)
    if size > 1:
        out_rows = AllToAll.apply(out_rows, group, send_splits, recv_splits)
    out = torch.zeros_like(x)
    return out.index_add_(0, chosen_token, out_rows * chosen_prob.unsqueeze(1).to(out_rows.dtype))


def _run_experts(rows: torch.Tensor, recv: torch.Tensor, expert_fn: Callable[[int, torch.Tensor], torch.Tensor]
                 ) -> torch.Tensor:
    """(R, h) rows laid out source-major, recv (P, E_l) rows per (source, local expert) block -> each row through its
    expert, in the same layout. The rows are put in expert-major order (one gather; none from a single source,
    whose blocks are already in that order), each expert runs on its contiguous slice, and the outputs go back to
    their places (one index_copy)."""
    size, local = recv.shape
    per_expert = recv.sum(dim=0).tolist()
    order = None
    if size > 1:
        counts = recv.reshape(-1).tolist()  # block src * local + j: source src's rows for expert j
        starts = [0, *itertools.accumulate(counts)]  # where each block starts
        order = torch.cat([torch.arange(starts[b], starts[b] + counts[b], device=rows.device)
                           for b in (src * local + j for j in range(local) for src in range(size))])
        rows = rows[order]
    outs = [expert_fn(j, part) if part.shape[0] else part for j, part in enumerate(rows.split(per_expert))]
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if order is None else torch.empty_like(out).index_copy(0, order, out)


def allgather_dispatch_combine(x: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor, num_experts: int,
                               expert_fn: Callable[[int, torch.Tensor], torch.Tensor], group: Optional[object] = None
                               ) -> torch.Tensor:
    """`dispatch_combine`'s result by the allgather dispatcher (module docstring); every rank the same T."""
    local = local_experts(num_experts, group)
    size = num_experts // local
    if size == 1:
        return dispatch_combine(x, probs, experts, num_experts, expert_fn)
    first = dist.get_rank(group) * local
    every_x = gather_from_sequence_parallel_region(x.unsqueeze(0), group).squeeze(0)  # (P T, h)
    every_probs = gather_from_sequence_parallel_region(probs.unsqueeze(0), group).squeeze(0)
    every_experts = torch.empty(size * experts.shape[0], experts.shape[1], dtype=experts.dtype, device=x.device)
    dist.all_gather_into_tensor(every_experts, experts.contiguous(), group=group)
    mine = (every_experts >= first) & (every_experts < first + local)
    partial = dispatch_combine(every_x, every_probs, torch.where(mine, every_experts - first, -1), local, expert_fn)
    return reduce_scatter_to_sequence_parallel_region(partial.unsqueeze(0), group).squeeze(0)
