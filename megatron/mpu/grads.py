"""Gradient norm and clipping over a model split across tensor- and pipeline-parallel ranks.

    ||g||_q = ( sum over model-parallel ranks of sum over counted local grads of ||g_i||_q^q )^(1/q)
    ||g||_inf = max over model-parallel ranks and grads of max |g_i|
A gradient is counted once across the tensor-parallel group: split parameters (`tensor_model_parallel`)
on every tp rank, replicated ones (layer-norm weights, row-parallel biases) on tp rank 0 only. Parameters
marked `shared = True` (a second copy of a tied weight, e.g. the last pipeline stage's word embeddings)
are not counted. Clipping multiplies every gradient by max_norm / (||g|| + 1e-6) when that is < 1,
as torch.nn.utils.clip_grad_norm_.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from tds.device import device
from .layers import param_is_not_tensor_parallel_duplicate
from .parallel_state import get_pipe_parallel_group, get_tensor_model_parallel_group

Params = Union[torch.Tensor, Iterable[torch.Tensor]]


def _as_list(parameters: Params) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _reduce_groups(model_parallel_group) -> Sequence:
    """The groups to all-reduce over: the one given, else the tensor- then the pipeline-parallel group."""
    if model_parallel_group is not None:
        return [model_parallel_group]
    return [get_tensor_model_parallel_group(), get_pipe_parallel_group()]


def get_grad_norm(parameters: Params, norm_type: float = 2.0, model_parallel_group=None,
                  tp_group: Optional[dist.ProcessGroup] = None) -> float:
    """Total q-norm (q = norm_type, may be inf) of the gradients of the whole model, without clipping.

    `model_parallel_group`: a group spanning all tensor and pipeline ranks of one model replica; None
    reduces over the current tensor-parallel group, then the pipeline-parallel group. `tp_group` decides
    which replicated gradients this rank counts (None: the current tensor-parallel group).
    """
    norm_type = float(norm_type)
    grads = [p.grad.detach() for p in _as_list(parameters) if p.grad is not None
             and not getattr(p, "shared", False) and param_is_not_tensor_parallel_duplicate(p, tp_group)]
    if norm_type == math.inf:
        local = max((g.abs().max().float() for g in grads), default=torch.tensor(0.0))
        op = dist.ReduceOp.MAX
    else:
        local = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.tensor(0.0))
        op = dist.ReduceOp.SUM
    total = torch.as_tensor(local, dtype=torch.float32, device=device()).reshape(1)
    for group in _reduce_groups(model_parallel_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    total_norm = total.item()
    return total_norm if norm_type == math.inf else total_norm ** (1.0 / norm_type)


def clip_grad_norm(parameters: Params, max_norm: float, norm_type: float = 2.0, model_parallel_group=None,
                   tp_group: Optional[dist.ProcessGroup] = None) -> float:
    """Clip every gradient in place so the total norm is at most max_norm; return the norm before clipping."""
    params = _as_list(parameters)
    total_norm = get_grad_norm(params, norm_type, model_parallel_group, tp_group)
    clip_coef = float(max_norm) / (total_norm + 1e-6)
    if clip_coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.detach().mul_(clip_coef)
    return total_norm
