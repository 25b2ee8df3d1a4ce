"""Losses a layer adds on its own stage (a mixture of experts' load-balancing and z losses, any regulariser).

`y = add_stage_loss(y, loss)` returns `y` unchanged and makes the backward pass through it add the gradient of
`loss`, multiplied by the factor the engine applies to the micro-batch's loss before its backward (the fp16 loss
scale, 1 / micro-batches, and 1 / dp with fixed-order sums). So each micro-batch trains on

    loss_i + the stage losses added during its forward

without the stage losses crossing a stage boundary: each stage back-propagates its own, at every schedule, and a
stage that adds none does nothing. The engine sets the factor once per batch (`set_scale`); outside an engine it
is 1 unless `scaled` says otherwise (a plain loop that backpropagates loss / m sets 1 / m). Megatron core does the
same with its MoEAuxLossAutoScaler.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Union

import torch

__all__ = ["add_stage_loss", "scale", "scaled", "set_scale"]

_factor: list = [1.0]  # the current factor: a float or a 0-dim tensor on the loss's device


def set_scale(factor: Union[float, torch.Tensor]) -> None:
    _factor[0] = factor


def scale() -> Union[float, torch.Tensor]:
    return _factor[0]


@contextlib.contextmanager
def scaled(factor: Union[float, torch.Tensor]) -> Iterator[None]:
    before = _factor[0]
    _factor[0] = factor
    try:
        yield
    finally:
        _factor[0] = before


class _StageLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        loss, = ctx.saved_tensors
        factor = _factor[0]
        factor = factor.to(loss.dtype) if torch.is_tensor(factor) else factor
        return grad, torch.ones_like(loss) * factor


def add_stage_loss(activation: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`activation`, with `loss` (a scalar in the autograd graph) back-propagated with it (module docstring)."""
    if not (torch.is_grad_enabled() and loss.requires_grad):
        return activation  # evaluation, or a loss that reaches no parameter
    return _StageLoss.apply(activation, loss)
