"""Adam with decoupled weight decay over two parameter groups.

Weight decay applies to matrices (linear and embedding weights) and not to vectors (biases, LayerNorm
gains and shifts): a parameter with one dimension goes to the no-decay group (Megatron's rule).
On GPU apex's FusedAdam (adam_w_mode, the same update) is used when it can be imported, else torch's own fused
CUDA AdamW (`fused=True`); on CPU torch.optim.AdamW.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from tds import device as tds_device


def param_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, object]]:
    """[{'params': matrices, 'weight_decay': wd}, {'params': vectors, 'weight_decay': 0}], empty groups dropped."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (no_decay if param.dim() <= 1 else decay).append(param)
    groups = [dict(params=decay, weight_decay=weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def _fused_adam():
    if not tds_device.is_cuda():
        return None
    try:
        from apex.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


def build_optimizer(model: torch.nn.Module, opt) -> torch.optim.Optimizer:
    """AdamW from the RunConfig's optimizer section `opt`."""
    groups = param_groups(model, opt.weight_decay)
    kwargs = dict(lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                  weight_decay=opt.weight_decay)
    fused = _fused_adam()
    if fused is not None:
        return fused(groups, adam_w_mode=True, **kwargs)
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, fused=on_cuda or None, **kwargs)
