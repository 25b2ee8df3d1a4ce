"""Which function recomputes a checkpointed segment of a `PipelineModule`, and DeepSpeed's settings for it.

    activation_checkpoint_func (module argument)   default: `default_checkpoint`
    pipeline.use_reentrant (DeepSpeed JSON)        True / False: `reentrant_default` / `non_reentrant_default`
                                                   (replaces only a default, never a function the model gave)
    activation_checkpointing (DeepSpeed JSON)      applied through deepspeed.checkpointing.configure (below)

`default_checkpoint` is torch's non-reentrant `torch.utils.checkpoint` (it saves the RNG state and needs no
input that requires grad) until deepspeed.checkpointing is configured, and DeepSpeed's
`deepspeed.checkpointing.checkpoint` after, so partitioned activations (each tensor-parallel rank keeps
1/t of every saved segment input and all-gathers it for the recomputation), contiguous buffers, CPU
checkpointing, synchronisation and profiling take effect. It is configured either by the user's
`deepspeed.checkpointing.configure(...)` or, when the JSON has an "activation_checkpointing" section and the
user did not call configure, by `configure_from_config` with the module's tensor-parallel group. The choice is
made at each call, so configuring after `tds.initialize` works too.
"""
from __future__ import annotations

from typing import Callable

from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def non_reentrant_checkpoint(fn: Callable, *args):
    """torch.utils.checkpoint without reentrancy (saves RNG state, inputs need not require grad)."""
    return torch_checkpoint(fn, *args, use_reentrant=False)


def reentrant_checkpoint(fn: Callable, *args):
    """torch.utils.checkpoint's reentrant variant."""
    return torch_checkpoint(fn, *args, use_reentrant=True)


def default_checkpoint(fn: Callable, *args):
    """DeepSpeed's checkpoint once deepspeed.checkpointing is configured, else torch's non-reentrant one."""
    if ds_checkpointing.is_configured():
        return ds_checkpointing.checkpoint(fn, *args)
    return non_reentrant_checkpoint(fn, *args)


def reentrant_default(fn: Callable, *args):
    """pipeline.use_reentrant=true: DeepSpeed's checkpoint once configured, else torch's reentrant one."""
    if ds_checkpointing.is_configured():
        return ds_checkpointing.checkpoint(fn, *args)
    return reentrant_checkpoint(fn, *args)


def non_reentrant_default(fn: Callable, *args):
    """pipeline.use_reentrant=false: DeepSpeed's non-reentrant checkpoint once configured, else torch's."""
    if ds_checkpointing.is_configured():
        return ds_checkpointing.non_reentrant_checkpoint(fn, *args)
    return non_reentrant_checkpoint(fn, *args)


class TensorParallelView:
    """A pipeline grid's tensor-parallel slice under the names deepspeed.checkpointing.configure reads."""

    def __init__(self, grid):
        self.grid = grid

    def get_tensor_model_parallel_rank(self) -> int:
        return self.grid.get_slice_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.grid.get_slice_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self.grid.get_slice_parallel_group()


def configure_from_config(ds_config, grid) -> None:
    """Apply the JSON's "activation_checkpointing" section unless the user configured deepspeed.checkpointing
    already (their call wins)."""
    if ds_checkpointing.is_configured() or "activation_checkpointing" not in ds_config._param_dict:
        return
    cfg = ds_config.activation_checkpointing_config
    ds_checkpointing.configure(TensorParallelView(grid), partition_activations=cfg.partition_activations,
                               contiguous_checkpointing=cfg.contiguous_memory_optimization,
                               num_checkpoints=cfg.number_checkpoints, checkpoint_in_cpu=cfg.cpu_checkpointing,
                               synchronize=cfg.synchronize_checkpoint_boundary, profile=cfg.profile)


DEFAULTS = (default_checkpoint, reentrant_default, non_reentrant_default)  # what pipeline.use_reentrant may replace
_NON_REENTRANT = (non_reentrant_checkpoint, non_reentrant_default, ds_checkpointing.non_reentrant_checkpoint)


def by_reentrancy(use_reentrant: bool) -> Callable:
    """The function pipeline.use_reentrant selects."""
    return reentrant_default if use_reentrant else non_reentrant_default


def replaced_by_config(func: Callable, use_reentrant: bool) -> bool:
    """Whether pipeline.use_reentrant replaces the module's `func`: TDS's defaults, and with false also
    DeepSpeed's default `deepspeed.checkpointing.checkpoint` given explicitly (DeepSpeed 0.19.8 replaces it);
    a function of the model's own (e.g. one that replays its dropout) never."""
    return func in DEFAULTS or (not use_reentrant and func is ds_checkpointing.checkpoint)


def is_reentrant(func: Callable) -> bool:
    """DeepSpeed 0.19.8's answer (every function but its non-reentrant one is reentrant), knowing TDS's own:
    the non-reentrant ones are not, `default_checkpoint` is while deepspeed.checkpointing is configured."""
    if func is default_checkpoint:
        return ds_checkpointing.is_configured()
    return func not in _NON_REENTRANT
