"""Tensor-parallel split and merge by a parameter's partition attributes, and vocabulary re-padding.

Shape legend: n size along the partition dim, p tensor-parallel size, V real vocabulary, V_pad padded.

A parameter split along `dim` with `stride` s (mpu/utils.py): the full tensor is cut into p * s chunks of
n / (p s) along dim; tp rank r holds chunks r, r + p, ..., r + (s - 1) p. QKV (s = 3), T5's fused kv and
gated wi (s = 2) are therefore re-cut exactly when p changes; so is grouped-query attention's QKV, whose
stride is the block weights (heads, groups, groups). Replicated parameters (dim None) are equal on
every rank: merge takes rank 0's copy, split gives every rank the full tensor.

Optimizer moments and fp32 master weights are elementwise companions of their parameter, so they split and
merge the same way.

Vocabulary rows (word table, untied LM head): V_pad = the smallest multiple of divisible_by * p >= V, so a
new p may change V_pad. Rows [0, V) are real; `resize_rows` keeps every existing row that still fits and
fills new padding rows with zeros (padded ids are masked out of the logits, so their values never matter).
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from megatron.errors import UserError
from megatron.mpu.utils import block_sizes, merge_partitions, partition_master
from .names import ParamInfo


def merge(parts: Sequence[torch.Tensor], info: ParamInfo) -> torch.Tensor:
    """Per-tp-rank tensors (rank order) -> the full tensor."""
    if info.dim is None or len(parts) == 1:
        return parts[0]
    return merge_partitions(list(parts), info.dim, info.stride)


def split(full: torch.Tensor, info: ParamInfo, tp: int) -> List[torch.Tensor]:
    """The full tensor -> its tp per-rank tensors (contiguous copies); UserError if tp does not divide."""
    if info.dim is None:
        return [full] * tp
    try:
        block_sizes(full.size(info.dim), info.stride, tp)
    except ValueError as e:
        what = "padded vocabulary" if info.vocab else f"dimension {info.dim}"
        raise UserError(f"{info.name}: {what}: {e}; choose a tensor-model-parallel size that divides the heads, "
                        f"query groups, ffn size and vocabulary") from None
    return [part.contiguous() for part in partition_master(full, info.dim, info.stride, tp)]


def resize_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Keep the first min(rows, len(t)) rows, append zero rows up to `rows`."""
    if t.size(0) == rows:
        return t
    if t.size(0) > rows:
        return t[:rows].clone()  # not a view: torch.save would write the whole storage
    return torch.cat([t, t.new_zeros((rows - t.size(0),) + tuple(t.shape[1:]))])
