"""Learning-rate schedule: linear warm-up, then linear / cosine / inverse-square-root / constant decay.

With n = the schedule's position, W = warm-up length, D = decay length (all in one unit, see below):

    n <  W:  lr = max_lr * n / W
    constant:                         lr = max_lr
    n >= D:  lr = min_lr
    inverse-square-root:              lr = max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    else:    r = (n - W) / (D - W)
             linear:   lr = min_lr + (max_lr - min_lr) * (1 - r)
             cosine:   lr = min_lr + (max_lr - min_lr) * 0.5 * (cos(pi * r) + 1)

This is Megatron's `AnnealingLR` / `OptimizerParamScheduler` (inverse-square-root as Megatron-LM: continuous
with the warm-up at n = W). DeepSpeed calls `step()` after every applied optimizer step (not after steps
skipped for fp16 overflow); each call advances n by `increment`: 1 when the schedule is in iterations
(--train-iters), the iteration's global batch when it is in samples (--train-samples, set by the training
loop, so a ramped batch advances the schedule by the samples it used). The state dict makes resume exact.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from megatron.errors import UserError

DECAY_STYLES = ("linear", "cosine", "constant", "inverse-square-root")


def annealed_lr(num_steps: int, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
                decay_style: str) -> float:
    """The formula above, as a pure function."""
    if warmup_iters > 0 and num_steps < warmup_iters:
        return max_lr * num_steps / warmup_iters
    if decay_style == "constant":
        return max_lr
    if num_steps >= decay_iters:
        return min_lr
    if decay_style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup_iters, 1)) / math.sqrt(max(num_steps, 1)))
    ratio = (num_steps - warmup_iters) / max(1, decay_iters - warmup_iters)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise UserError(f"unknown --lr-decay-style {decay_style!r}, expected one of {DECAY_STYLES}")
    return min_lr + (max_lr - min_lr) * coeff


class AnnealingLR:
    """Sets the lr of every param group of `optimizer` from `annealed_lr` at each `step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, warmup_iters: int,
                 decay_iters: int, decay_style: str = "linear"):
        if decay_style not in DECAY_STYLES:
            raise UserError(f"unknown --lr-decay-style {decay_style!r}, expected one of {DECAY_STYLES}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, decay_iters
        self.decay_style = decay_style
        self.num_steps = 0
        self.increment = 1  # schedule units per optimizer step (the global batch for a schedule in samples)
        self._apply()

    def get_lr(self) -> float:
        return annealed_lr(self.num_steps, self.max_lr, self.min_lr, self.warmup_iters, self.decay_iters,
                           self.decay_style)

    def get_last_lr(self) -> list:
        return [group["lr"] for group in self.optimizer.param_groups]

    def _apply(self) -> None:
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, increment: Optional[int] = None) -> None:
        self.num_steps += self.increment if increment is None else increment
        self._apply()

    def state_dict(self) -> Dict[str, object]:
        return dict(num_steps=self.num_steps, max_lr=self.max_lr, min_lr=self.min_lr,
                    warmup_iters=self.warmup_iters, decay_iters=self.decay_iters, decay_style=self.decay_style)

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restores the step count; the schedule itself comes from the current arguments (Megatron's
        `--override-lr-scheduler` behaviour), so a resumed run can change e.g. --train-iters."""
        self.num_steps = int(state["num_steps"])
        self._apply()
