"""ZeRO-1's partitioned step under fixed-order sums (`"pipeline": {"layout_invariant": true}`, fixed_order.py).

With fixed-order sums every data-parallel replica already holds the batch's summed gradients, the same bits on
each (`MicroBatchGrads.settle`). DeepSpeed 0.19's stage-1 optimizer would sum them again over the replicas and
divide (an association that depends on dp), and take the norm over its partitions (the same). `FixedOrderZero`
keeps its partitioned fp32 master weights, Adam step and all-gather, and changes three things:

- the reduction: each rank copies its partition out of the settled gradients (`take_settled`), nothing is summed;
- the norm: the engine's fixed-order norm over the full gradients, the same on every replica;
- the clip: `clip_coefficient`, the coefficient stage 0 applies (engine.clip_fp32_gradients).

Adam is elementwise, and torch's AdamW gives one element the same bits wherever a tensor is cut (checked by
tests/tds/test_fixed_order.py), so the flat partitions of any dp step like the per-parameter tensors of one process
(ZeRO-1 at dp 1 runs as stage 0). The checkpoint files are DeepSpeed's own: nothing in their layout changes.
fp32 only: fp16 and bf16 keep their own sums (the engine refuses them with the flag).
"""
from __future__ import annotations

from typing import Callable

import torch
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["FixedOrderZero", "adopt", "clip_coefficient"]


def clip_coefficient(clip: float, norm: torch.Tensor) -> torch.Tensor:
    """min(1, clip / (norm + 1e-6)) as a tensor: what every gradient is multiplied by."""
    return (clip / (norm + 1e-6)).clamp(max=1.0)


def adopt(optimizer: DeepSpeedZeroOptimizer, norm: Callable[[], torch.Tensor]) -> DeepSpeedZeroOptimizer:
    """`optimizer` as a FixedOrderZero that takes its gradient norm from `norm`; refuses what it cannot keep fixed."""
    unfit = {"stage 2 (partitioned gradients)": optimizer.partition_gradients, "cpu_offload": optimizer.cpu_offload,
             f"dtype {optimizer.dtype}": optimizer.dtype != torch.float32, "MoE layers": optimizer.has_moe_layers}
    got = [what for what, bad in unfit.items() if bad]
    if got:  # (DeepSpeed turns overlap_comm off under pipeline parallelism)
        raise ValueError(f"pipeline.layout_invariant runs ZeRO stage 1 in fp32 without cpu_offload or MoE layers; "
                         f"got {', '.join(got)}")
    optimizer.__class__ = FixedOrderZero
    optimizer._fixed_norm = norm
    return optimizer


class FixedOrderZero(DeepSpeedZeroOptimizer):
    """DeepSpeed's stage-1 optimizer stepping the settled gradients (module docstring)."""

    _fixed_norm: Callable[[], torch.Tensor]

    def take_settled(self) -> None:
        """This rank's partition of the settled gradients (`.grad`, equal on every replica), as
        `averaged_gradients`: what DeepSpeed's reduce would leave there, without a sum over the replicas."""
        for i, params in enumerate(self.params_in_partition):
            self.all_grad_tensors[i] = self.get_all_grad_tensors(params, dtype=self.gradient_accumulation_dtype)
        self.finalize_gradient_accumulation_boundary()

    def scaled_global_norm(self, norm_type=2):
        return self._fixed_norm()

    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        if self.clip_grad > 0.0:
            torch._foreach_mul_([g for g in grad_groups_flat if not isinstance(g, list)] +
                                [g for gs in grad_groups_flat if isinstance(gs, list) for g in gs],
                                clip_coefficient(self.clip_grad, total_norm))
