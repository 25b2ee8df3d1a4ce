"""Micro-batches: the iterator the engine reads.

A micro-batch is `(inputs, labels)`: tuples of tensors; the first pipeline stage reads `inputs`, the last
one `labels`, and the Pipe model's `loss_fn(output, labels)` gives the micro-batch's loss.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

Batch = Tuple[tuple, tuple]  # (inputs, labels) of one micro-batch


class BatchIterator:
    """Yields `get_batch(raw)` per micro-batch; `raw` is the loader's next dict on the ranks that read data
    (tensor-parallel rank 0) and None on the others, which receive the batch inside `get_batch`."""

    def __init__(self, loader: Optional[torch.utils.data.DataLoader], get_batch: Callable[[Optional[dict]], Batch]):
        # iter(DataLoader) draws a seed from torch's default generator; keep that out of the training
        # stream, so a run resumed from a checkpoint draws the same dropout masks as an uninterrupted one.
        with torch.random.fork_rng(devices=[]):
            self._raw = iter(loader) if loader is not None else None
        self._get_batch = get_batch

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> Batch:
        return self._get_batch(next(self._raw) if self._raw is not None else None)
