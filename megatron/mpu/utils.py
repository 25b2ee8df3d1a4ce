"""Small helpers for tensor model parallelism: divisibility checks, splits, vocab ranges, weight partitions.

Partitioning with a stride (Megatron's rule). A master weight of size n along `partition_dim` is cut into
tp * stride equal chunks of n / (tp * stride) rows; tp rank r keeps chunks r, r + tp, ..., r + (stride-1)*tp,
concatenated in that order. stride = 1 is the plain contiguous split (rank r keeps rows
[r*n/tp, (r+1)*n/tp)).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch


def ensure_divisibility(numerator: int, denominator: int, what: str = "value",
                        by: str = "tensor-model-parallel size", hint: str = "") -> None:
    """Raise a one-line ValueError naming both numbers if `denominator` does not divide `numerator`.

    ensure_divisibility(50257, 2, "vocab size") ->
        ValueError: vocab size 50257 is not divisible by tensor-model-parallel size 2
    `hint` (what to do) is appended after a semicolon.
    """
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(f"{what} {numerator} is not divisible by {by} {denominator}" + (f"; {hint}" if hint else ""))


def divide(numerator: int, denominator: int) -> int:
    """numerator // denominator, with a ValueError naming both if the division is not exact."""
    ensure_divisibility(numerator, denominator, "numerator", "denominator")
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Tuple[torch.Tensor, ...]:
    """Split (..., n) into num_partitions views of (..., n / num_partitions)."""
    last_dim_size = divide(tensor.size(-1), num_partitions)
    chunks = torch.split(tensor, last_dim_size, dim=-1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


class VocabUtility:
    """Vocabulary range [first, last) owned by a tensor-parallel rank: rank r owns [r*V/tp, (r+1)*V/tp)."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> Tuple[int, int]:
        ensure_divisibility(global_vocab_size, world_size, "vocab size")
        per_partition = global_vocab_size // world_size
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank, world_size)


def partition_master(master: torch.Tensor, partition_dim: int, stride: int, tp_size: int) -> List[torch.Tensor]:
    """Cut a full (master) tensor into the tp_size partitions that the ranks keep (see the module docstring).

    Returns a list indexed by tp rank; each entry has size n / tp_size along partition_dim.
    """
    n = master.size(partition_dim)
    ensure_divisibility(n, tp_size * stride, f"size {n} along dim {partition_dim}",
                        "tensor-model-parallel size x stride =")
    chunks = torch.split(master, n // (tp_size * stride), dim=partition_dim)
    return [torch.cat(chunks[r::tp_size], dim=partition_dim) for r in range(tp_size)]


def merge_partitions(parts: Sequence[torch.Tensor], partition_dim: int, stride: int) -> torch.Tensor:
    """Inverse of `partition_master`: rebuild the master tensor from the per-rank partitions (rank order)."""
    tp_size = len(parts)
    per_rank_chunks = [torch.chunk(p, stride, dim=partition_dim) for p in parts]
    ordered = [per_rank_chunks[r][j] for j in range(stride) for r in range(tp_size)]
    return torch.cat(ordered, dim=partition_dim)
