"""Micro-batches: the iterator the engines read, and the forward(/backward) of the non-pipeline path.

A micro-batch is `(inputs, labels)`: tuples of tensors; the model is called as `model(*inputs)` and the
loss as `loss_fn(output, labels)` (the Pipe models hold the same loss function).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import mpu

Batch = Tuple[tuple, tuple]  # (inputs, labels) of one micro-batch
LossFn = Callable[[object, tuple], torch.Tensor]


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


def data_parallel_mean(value: torch.Tensor) -> float:
    group = mpu.get_data_parallel_group()
    if mpu.get_data_parallel_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, group=group)
        value /= mpu.get_data_parallel_world_size()
    return float(value)


def forward_micro_batches(engine, data_iter: Iterator[Batch], loss_fn: LossFn, gas: int, train: bool) -> float:
    """Non-pipeline path: gas micro-batches, backward + step when training; mean loss over dp.

    The accumulation boundary is set explicitly (the last of the gas micro-batches): DeepSpeed's own rule,
    (micro steps so far + 1) % gas == 0, is wrong once the number of micro-batches changes (batch ramp-up)."""
    losses = []
    for i in range(gas):
        inputs, labels = next(data_iter)
        if train:
            engine.set_gradient_accumulation_boundary(i == gas - 1)
        loss = loss_fn(engine(*inputs), labels)
        if train:
            engine.backward(loss)
            engine.step()
        losses.append(loss.detach())
    return data_parallel_mean(torch.stack(losses).mean())
