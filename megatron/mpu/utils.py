"""Small helpers for tensor model parallelism: divisibility checks, splits, vocab ranges, weight partitions.

Partitioning with a stride (Megatron's rule). A master weight of size n along `partition_dim` is cut into
tp * stride equal chunks of n / (tp * stride) rows; tp rank r keeps chunks r, r + tp, ..., r + (stride-1)*tp,
concatenated in that order. stride = 1 is the plain contiguous split (rank r keeps rows
[r*n/tp, (r+1)*n/tp)).

A stride may also be a tuple of block weights (w_1, ..., w_k): the master is cut into k consecutive blocks of
n w_j / sum(w) rows, each block into tp equal chunks, and rank r keeps chunk r of every block, concatenated in
block order. An int stride s is the tuple (1,) * s. Grouped-query attention's fused QKV [Q; K; V] with a query
heads and G key/value groups has stride (a, G, G): rank r keeps the queries of its a/tp heads and the keys and
values of its G/tp groups.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch

Stride = Union[int, Tuple[int, ...]]


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


def stride_blocks(stride: Stride) -> Tuple[int, ...]:
    """Block weights of a stride: an int s is s equal blocks."""
    return (1,) * stride if isinstance(stride, int) else tuple(int(w) for w in stride)


def block_sizes(n: int, stride: Stride, tp_size: int, what: str = "size") -> List[int]:
    """Rows of each block of a size-n master (see the module docstring); a ValueError naming the sizes when a
    block does not split into tp_size equal chunks."""
    if isinstance(stride, int):
        if n % (tp_size * stride):
            raise ValueError(f"{what} {n} is not divisible by tensor-model-parallel size x stride = {tp_size} x "
                             f"{stride} = {tp_size * stride}")
        return [n // stride] * stride
    weights, total = tuple(int(w) for w in stride), sum(stride)
    if total < 1 or n % total or any((n // total * w) % tp_size for w in weights):
        raise ValueError(f"{what} {n} cannot be cut into blocks of relative sizes {list(weights)} that each divide "
                         f"by the tensor-model-parallel size {tp_size}")
    return [n // total * w for w in weights]


def partition_master(master: torch.Tensor, partition_dim: int, stride: Stride, tp_size: int) -> List[torch.Tensor]:
    """Cut a full (master) tensor into the tp_size partitions that the ranks keep (see the module docstring).

    Returns a list indexed by tp rank; each entry has size n / tp_size along partition_dim.
    """
    n = master.size(partition_dim)
    sizes = block_sizes(n, stride, tp_size, f"dim {partition_dim} size")
    chunks = [c for block in torch.split(master, sizes, dim=partition_dim)
              for c in torch.split(block, block.size(partition_dim) // tp_size, dim=partition_dim)]
    return [torch.cat(chunks[r::tp_size], dim=partition_dim) for r in range(tp_size)]


def merge_partitions(parts: Sequence[torch.Tensor], partition_dim: int, stride: Stride) -> torch.Tensor:
    """Inverse of `partition_master`: rebuild the master tensor from the per-rank partitions (rank order)."""
    tp_size = len(parts)
    local = block_sizes(parts[0].size(partition_dim) * tp_size, stride, tp_size)
    per_rank_chunks = [torch.split(p, [n // tp_size for n in local], dim=partition_dim) for p in parts]
    ordered = [per_rank_chunks[r][j] for j in range(len(local)) for r in range(tp_size)]
    return torch.cat(ordered, dim=partition_dim)
