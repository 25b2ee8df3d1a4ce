"""Gradients of parameters spread over an expert-parallel group: a mixture of experts' experts, marked
`param.expert_parallel = True` by the model.

A rank holds E / E_p of a layer's experts, and the ranks of its expert-data-parallel group (the grid's
`experts['expert_data']`) hold the same ones. Each expert's gradient on a rank covers the tokens it received from
its expert-parallel group (every rank's tokens that chose it), so the batch's gradient is the sum over the
expert-data-parallel group, divided by the data-parallel size as every other gradient is (the loss is a mean over
the data-parallel replicas):

    g_expert = (1 / dp) x sum over the expert-data-parallel group of the local gradients

The gradient norm counts each expert once: the squares of this rank's experts, summed over the expert-model group
(one copy of every expert of every stage), added to the squares of the other parameters.

Checkpoints hold every expert (`whole_experts`): saved and loaded as if one rank held them all, so a checkpoint
does not depend on the expert-parallel size and loads at any other.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, List

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["ExpertParallelEngine", "expert_params", "is_expert", "reduce_expert_grads", "squares_summed",
           "whole_experts"]


def is_expert(param: torch.nn.Parameter) -> bool:
    return getattr(param, "expert_parallel", False)


def expert_params(module: torch.nn.Module) -> List[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad and is_expert(p)]


def reduce_expert_grads(params: Iterable[torch.nn.Parameter], group, dp_size: int) -> None:
    """Every expert gradient summed over `group` (the expert-data-parallel group) and divided by dp_size; a gradient
    that is None (an expert no token chose on this rank) counts as zeros."""
    params = list(params)
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad.data for p in params]
    flat = _flatten_dense_tensors(grads)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat.div_(dp_size)
    for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def squares_summed(params: Iterable[torch.nn.Parameter], group, device) -> torch.Tensor:
    """The sum of the squared gradient norms (fp32) of `params` that have a gradient, summed over `group`: the
    engine's norm of the counted parameters over the model-parallel group, and of the experts over the expert-model
    group."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    total = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2).sum() if grads else \
        torch.zeros((), dtype=torch.float32, device=device)
    dist.all_reduce(total, group=group)
    return total


@contextlib.contextmanager
def whole_experts(params: List[torch.nn.Parameter], optimizer, group, loading: bool) -> Iterator[None]:
    """Checkpoints hold every expert, whatever the expert-parallel size: inside this block each expert parameter
    (this rank's E / E_p experts stacked along dim 0) is the whole (E, ...) tensor, gathered over the expert-parallel
    `group` in rank order, and so are its optimizer states (saving); or an empty whole tensor the load fills, after
    which this rank keeps its rows of the weights and of the optimizer states the load brought (loading). Collective:
    every rank of the group enters it. On an error the parameters keep their own rows."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    own = [p.data for p in params]
    saved_states = [optimizer.state.get(p) for p in params] if optimizer is not None else []

    def gather(t: torch.Tensor) -> torch.Tensor:
        whole = t.new_empty((size * t.shape[0],) + tuple(t.shape[1:]))
        dist.all_gather_into_tensor(whole, t.contiguous(), group=group)
        return whole

    for i, p in enumerate(params):
        p.data = p.data.new_empty((size * own[i].shape[0],) + tuple(own[i].shape[1:])) if loading else gather(own[i])
        state = saved_states[i] if saved_states else None
        if state and not loading:
            optimizer.state[p] = {k: gather(v) if torch.is_tensor(v) and v.shape == own[i].shape else v
                                  for k, v in state.items()}
    done = False
    try:
        yield
        done = True
    finally:
        for i, p in enumerate(params):
            rows = slice(rank * own[i].shape[0], (rank + 1) * own[i].shape[0])
            if loading and done:
                own[i].copy_(p.data[rows])
            p.data = own[i]
            if optimizer is None:
                continue
            if loading and done and p in optimizer.state:
                whole = p.data.shape[0] * size
                optimizer.state[p] = {k: v[rows].clone() if torch.is_tensor(v) and v.dim() and v.shape[0] == whole
                                      else v for k, v in optimizer.state[p].items()}
            elif not loading and saved_states[i] is not None:
                optimizer.state[p] = saved_states[i]


class ExpertParallelEngine:
    """What the pipeline engine does differently for experts spread over ranks (a mixin before DeepSpeedEngine):
    the grid's expert groups where it has them (`grid.expert_rank_lists`), the start-up broadcast within the
    expert-data-parallel group, the data-parallel buckets without the experts, and checkpoints that hold them whole.
    The reduction and the norm (`reduce_expert_grads`, `squares_summed`) are called from the engine's own steps."""

    @property
    def _expert_groups(self):
        """{'expert', 'expert_data', 'expert_model'} groups where experts are spread over ranks, else None; read from
        the module, whose grid DeepSpeed's constructor uses before the engine's own is set."""
        return getattr(self.module._grid, "experts", None)

    def _broadcast_model(self):
        """DeepSpeed's start-up broadcast from the first data-parallel replica, with experts spread over ranks
        broadcast within their expert-data-parallel group instead (the data-parallel group holds other experts)."""
        experts = self._expert_groups
        if experts is None:
            return super()._broadcast_model()
        dp_group = self.module._grid.get_data_parallel_group()
        dp_src, edp_src = dist.get_global_rank(dp_group, 0), dist.get_global_rank(experts["expert_data"], 0)
        for p in self.module.parameters():
            spread = is_expert(p)
            group = experts["expert_data"] if spread else dp_group
            dist.broadcast(p.data, edp_src if spread else dp_src, group=group)

    def _get_gradients_for_reduction(self):
        """DeepSpeed's data-parallel buckets, without the experts spread over ranks (`reduce_expert_grads`)."""
        dense, by_group = super()._get_gradients_for_reduction()
        if self._expert_groups is None:
            return dense, by_group
        skip = {p.grad.data_ptr() for p in expert_params(self.module) if p.grad is not None}
        return [g for g in dense if g.data_ptr() not in skip], by_group

    def whole_experts(self, loading: bool):
        """A block in which experts spread over ranks are whole, to be saved or loaded as such (`whole_experts`);
        else nothing. `save_checkpoint` and the loads use it; a caller that reads or writes the module's weights
        itself (a weights-only load) wraps its reading in it."""
        experts = self._expert_groups
        if experts is None:
            return contextlib.nullcontext()
        return whole_experts(expert_params(self.module), self.optimizer, experts["expert"], loading)

    def save_checkpoint(self, *args, **kwargs):
        with self.whole_experts(loading=False):
            return super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args, **kwargs):
        with self.whole_experts(loading=True):
            return super().load_checkpoint(*args, **kwargs)
