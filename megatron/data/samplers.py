"""Megatron's pretraining batch sampler and the DataLoader built on it.

Samples are consumed in dataset order in global micro-batches of micro_batch_size * dp_size indices.
Global micro-batch g = indices [c0 + g*m*P, c0 + (g+1)*m*P) with c0 = consumed_samples, m = micro-batch size,
P = data-parallel size; dp rank r gets the slice [r*m, (r+1)*m) of it. Restarting with consumed_samples = c
continues exactly where a run that had consumed c samples stopped (c a multiple of m*P).
"""
from __future__ import annotations

from typing import Iterator, List, Sequence

import numpy as np
import torch

from megatron.errors import UserError
from tds import device as tds_device


class MegatronPretrainingSampler:
    """Batch sampler: yields this dp rank's micro_batch_size indices of each global micro-batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, drop_last: bool = True):
        if total_samples <= 0 or micro_batch_size <= 0 or data_parallel_size <= 0:
            raise ValueError(f"need positive total_samples, micro_batch_size and data_parallel_size, got "
                             f"{total_samples}, {micro_batch_size}, {data_parallel_size}")
        if not 0 <= consumed_samples < total_samples:
            raise UserError(f"{consumed_samples} samples already consumed (--load) but the dataset has "
                            f"{total_samples}: no data left to train on; check --data-path, --split and "
                            f"--train-iters / --train-samples")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.global_micro_batch = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        """Number of micro-batches this rank yields."""
        remaining = self.total_samples - self.consumed_samples
        full, partial = divmod(remaining, self.global_micro_batch)
        return full + int(partial > self.data_parallel_rank * self.micro_batch_size and not self.drop_last)

    def __iter__(self) -> Iterator[List[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        for lo in range(self.consumed_samples, self.total_samples, self.global_micro_batch):
            hi = min(lo + self.global_micro_batch, self.total_samples)
            if hi - lo < self.global_micro_batch and self.drop_last:
                return
            mine = list(range(lo + start, min(lo + start + self.micro_batch_size, hi)))
            if mine:
                yield mine


def collate_numpy(samples: Sequence[dict]) -> dict:
    """Stack each key's numpy arrays into a torch tensor (b, ...); bool arrays stay torch.bool."""
    return {key: torch.from_numpy(np.stack([sample[key] for sample in samples])) for key in samples[0]}


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                                  dp_size: int, num_workers: int = 0) -> torch.utils.data.DataLoader:
    """DataLoader over `dataset` for dp rank `dp_rank`, resuming after `consumed_samples` global samples."""
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate_numpy, pin_memory=tds_device.is_cuda())
