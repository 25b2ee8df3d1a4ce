"""ZeRO-1's reduce buckets, sized to the gradients this rank reduces.

DeepSpeed 0.19's stage-1 optimizer, driven by a pipeline engine (`reduce_gradients(pipeline_parallel=True)`),
allocates two buckets of `zero_optimization.reduce_bucket_size` elements (default 5e8) whatever the model's size:
4 GB per rank in fp32, 2 GB in bf16, for a model of 0.1 M parameters. A bucket never needs more elements than the
gradients of this rank's stage (a gradient larger than the bucket bypasses it), so `sized_reduce_buckets` caps the
size there:

    reduce_bucket_size = min(the JSON's value or 5e8, elements of this rank's trainable parameters)

The value the JSON gives below that is kept (the examples' JSONs give 5e7: 200 MB of buckets per rank in bf16).
The planner (`megatron.planning.memory`) applies the same cap.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner reads the sizes below without torch
    import torch

DEFAULT_REDUCE_BUCKET = 500_000_000  # DeepSpeed 0.19's zero_optimization.reduce_bucket_size default

__all__ = ["DEFAULT_REDUCE_BUCKET", "reduce_bucket_elements", "sized_reduce_buckets"]


def reduce_bucket_elements(asked: int, grad_elements: int) -> int:
    """The bucket size used: the one asked for, at most the gradients' elements (at least 1)."""
    return max(1, min(int(asked), int(grad_elements)))


def sized_reduce_buckets(config: dict, module: torch.nn.Module) -> dict:
    """`config` (a DeepSpeed JSON dict) with zero_optimization.reduce_bucket_size capped at this rank's gradient
    elements (module docstring); the dict itself when nothing changes."""
    zero = config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    asked = zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)
    try:
        asked = int(float(asked))
    except (TypeError, ValueError):  # e.g. "auto": DeepSpeed decides
        return config
    size = reduce_bucket_elements(asked, sum(p.numel() for p in module.parameters() if p.requires_grad))
    if size == asked and "reduce_bucket_size" in zero:
        return config
    return {**config, "zero_optimization": {**zero, "reduce_bucket_size": size}}
