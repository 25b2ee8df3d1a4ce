"""The step tail of DeepSpeed's BF16_Optimizer (bf16 at ZeRO stage 0) as flat and foreach operations.

DeepSpeed 0.19's BF16_Optimizer, driven by a pipeline engine, casts and adds every parameter's bf16 gradient to its
accumulator after every micro-batch's backward (`update_hp_grads`: a Python loop, two kernels per parameter; the
accumulator is bf16 unless the JSON's data_types.grad_accum_dtype is "fp32"),
zeroes the bf16 gradients with another Python loop (`clear_lp_grads`), and at the step computes the gradient norm
tensor by tensor, reads it on the host twice (the overflow test, the clip coefficient) and clips tensor by tensor.
`FlatBF16Optimizer` is the same optimizer object (its state, checkpoints and base optimizer unchanged; `adopt`
gives it this class) with those parts as:

    gradients    every bf16 parameter's .grad is a view of one flat bf16 buffer per group, laid out as its
                 accumulator `fp32_groups_gradients_flat[i]` (same offsets, same padding); autograd accumulates
                 into the views in place
    accumulate   per micro-batch and group: accumulator_flat += bf16_flat (one add, mixed-precision with an fp32
                 accumulator), bf16_flat = 0
    norm         sqrt(sum over the pipe x tensor group of the counted gradients' squared norms): one
                 torch._foreach_norm (in fp32) over the counted accumulator views and one all-reduce, a device
                 tensor. Counted as
                 DeepSpeed counts (`get_grads_for_norm`): not a tied weight's later copy (`ds_pipe_replicated`),
                 and on tensor-parallel ranks > 0 only tensor-parallel parameters
    clip         coef = min(1, clip / (norm + 1e-6)) on the device; fp32_flat *= coef per group
    overflow     a non-finite norm skips the step, as DeepSpeed's does: the norm is read on the host once per
                 step, or not at all when the engine's NaN check (finite.py) read it with its agreement (`prepare`)

The values are DeepSpeed's: the same additions and the same clip coefficient (the norm's own summation order
aside). A BF16_Optimizer with immediate_grad_update, MoE groups or Muon keeps DeepSpeed's tail.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.utils import is_model_parallel_parameter
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

__all__ = ["FlatBF16Optimizer", "adopt"]


def adopt(optimizer: BF16_Optimizer) -> BF16_Optimizer:
    """`optimizer` as a FlatBF16Optimizer where its configuration allows (module docstring), else unchanged."""
    eligible = (type(optimizer) is BF16_Optimizer and optimizer.using_real_optimizer
                and not optimizer.immediate_grad_update and not optimizer.has_moe_layers
                and not getattr(optimizer, "_uses_muon", False))
    if eligible:
        optimizer.__class__ = FlatBF16Optimizer
        optimizer._flat_setup()
    return optimizer


class FlatBF16Optimizer(BF16_Optimizer):
    """BF16_Optimizer with the module docstring's flat accumulation, foreach norm and device-side clip."""

    def _flat_setup(self) -> None:
        self._lp_flat = [torch.zeros_like(flat) for flat in self.bf16_groups_flat]  # bf16, the fp32 layout
        self._lp_views = []
        for flat, params in zip(self._lp_flat, self.bf16_groups):
            sizes = [p.numel() for p in params]
            parts = flat.narrow(0, 0, sum(sizes)).split(sizes)
            self._lp_views.append([part.view_as(p) for part, p in zip(parts, params)])
        self._lp_clean = True
        tp_rank = bwc_tensor_model_parallel_rank(mpu=self.mpu)
        self._counted = [hp for params, hps in zip(self.bf16_groups, self.fp32_groups_gradients)
                         for p, hp in zip(params, hps) if not getattr(p, "ds_pipe_replicated", False)
                         and (tp_rank == 0 or is_model_parallel_parameter(p))]
        for params, hps in zip(self.bf16_groups, self.fp32_groups_gradients):
            for p, hp in zip(params, hps):
                p._hp_grad = hp
        self._prepared: Optional[tuple] = None
        self.attach()

    def attach(self) -> None:
        """Make every parameter's .grad its view again (once per batch; a no-op unless something replaced one)."""
        for params, views in zip(self.bf16_groups, self._lp_views):
            for p, view in zip(params, views):
                if p.grad is not view:
                    p.grad = view

    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        """After a micro-batch's backward: fp32 += bf16 per group, bf16 zeroed for the next micro-batch."""
        with torch.no_grad():
            for hp, lp in zip(self.fp32_groups_gradients_flat, self._lp_flat):
                hp.add_(lp)
                lp.zero_()
        self._lp_clean = True
        self.fp32_groups_has_gradients = [[True] * len(group) for group in self.bf16_groups]

    def clear_lp_grads(self, set_to_none: bool = False) -> None:
        """Zero the flat bf16 gradients (set_to_none keeps the views: they are this optimizer's buffers)."""
        if not self._lp_clean:
            for lp in self._lp_flat:
                lp.zero_()
            self._lp_clean = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._lp_clean = False  # a backward may have stopped half-way: zero for certain
        self._prepared = None  # (after a failed batch) a norm prepared for a step that did not run
        self.clear_lp_grads()
        self.clear_hp_grads()

    def gradients_for_check(self) -> list:
        """What the NaN check watches: the fp32 accumulators (the bf16 gradients are zero after each backward)."""
        return list(self.fp32_groups_gradients_flat)

    def global_norm(self) -> torch.Tensor:
        """The module docstring's norm as a device tensor (a collective over the pipe x tensor group)."""
        norms = torch._foreach_norm(self._counted, 2.0, dtype=torch.float32) if self._counted else []
        total = torch.stack(norms).pow(2).sum() if norms else torch.zeros((), device=self._lp_flat[0].device)
        grid = self.mpu  # the engine's ProcessGrid: "model parallel" is pipe x tensor
        if grid is not None:
            dist.all_reduce(total, group=grid.get_model_parallel_group())
        return total.sqrt()

    def prepare(self, norm: torch.Tensor, value: float) -> None:
        """The engine computed the norm and read its value with the NaN check's agreement: step() uses both."""
        self._prepared = (norm, value)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support closure.")
        norm, value = self._prepared if self._prepared is not None else (self.global_norm(), None)
        self._prepared = None
        value = float(norm) if value is None else value  # the step's one host read, when not read before
        self.overflow = not (value == value and abs(value) != float("inf"))
        if self.overflow:
            self._global_grad_norm = float("inf")
            self.clear_hp_grads()
            self.zero_grad()
            return
        self._global_grad_norm = value
        if self.clip_grad > 0.0:
            coef = (self.clip_grad / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(self.fp32_groups_gradients_flat, coef)
        for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                                   self.fp32_groups_gradient_flat_partition):
            param_partition.grad = grad_partition.to(param_partition.dtype)  # a copy for a bf16 accumulator
        self.optimizer.step()
        if self.grad_acc_dtype is not torch.float32:
            for param_partition in self.fp32_groups_flat_partition:
                param_partition.grad = None
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        self.clear_hp_grads()
