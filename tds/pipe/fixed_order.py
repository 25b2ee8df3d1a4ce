"""Fixed-order sums (`"pipeline": {"layout_invariant": true}`): one global batch gives the same bits at every
split into data-parallel replicas, gradient-accumulation steps and pipeline stages.

A batch has M = dp x gas micro-batches, and replica r takes global micro-batch j = k dp + r as its k-th (the
sampler's order). Each micro-batch's gradient g_j is an atom, and every sum over micro-batches (the gradients,
the loss) is associated one way, whatever dp and gas are:

    adjacent pairs, level by level, while the count is even: (g0 + g1), (g2 + g3), ... then ((g0 + g1) + (g2 + g3));
    once the count is odd, the rest left to right.

With dp a power of two, the block B_k = g_{k dp} + ... + g_{k dp + dp - 1} of the replicas' k-th micro-batches is
a subtree of that tree. So the replicas sum each block right after its backward (`tree_all_reduce`, a fixed tree
over the replicas), and each replica folds the blocks B_0, B_1, ... into the rest of the tree as they come
(`PairwiseSum`): every replica ends with the same bits as one process summing the M atoms. IEEE addition is
commutative (a + b == b + a) and a + 0 == a, so only the association has to be fixed; fp64 accumulation would not
make the order irrelevant, and is not used.

Cost: one all-to-all and one all-gather of the stage's gradients per micro-batch (instead of one all-reduce per
batch), and at most log2(gas) + 1 gradient-sized partial sums held besides the gradients themselves.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["PairwiseSum", "pairwise_sum_rows", "tree_all_reduce", "power_of_two"]


def power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _pair_levels(count: int) -> int:
    """How many levels of adjacent pairs the tree over `count` items has (the factors of two in count)."""
    levels = 0
    while count > 1 and count % 2 == 0:
        count //= 2
        levels += 1
    return levels


def pairwise_sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of `rows`, associated as the module docstring says (vectorized level by level)."""
    while rows.shape[0] > 1 and rows.shape[0] % 2 == 0:
        rows = rows[0::2] + rows[1::2]
    total = rows[0]
    for i in range(1, rows.shape[0]):
        total = total + rows[i]
    return total


class PairwiseSum:
    """The sum of `count` tensors pushed in order, associated as `pairwise_sum_rows` associates them, holding at
    most log2(count) + 1 partial sums (a binary counter). Pushed tensors are summed into in place."""

    def __init__(self, count: int) -> None:
        self.count, self.levels = count, _pair_levels(count)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (level, partial sum), levels falling
        self.total: torch.Tensor | None = None
        self.pushed = 0

    def push(self, item: torch.Tensor) -> None:
        if self.pushed == self.count:
            raise RuntimeError(f"fixed-order sum: a {self.count + 1}th item pushed into a sum of {self.count}")
        self.pushed += 1
        level = 0
        while level < self.levels and self.pending and self.pending[-1][0] == level:
            item = self.pending.pop()[1].add_(item)  # left + right
            level += 1
        if level < self.levels:
            self.pending.append((level, item))
        else:
            self.total = item if self.total is None else self.total.add_(item)

    def result(self) -> torch.Tensor:
        if self.pushed != self.count:
            raise RuntimeError(f"fixed-order sum: {self.pushed} of {self.count} items pushed")
        return self.total


def tree_all_reduce(flat: torch.Tensor, group, size: int) -> torch.Tensor:
    """The sum of every replica's `flat` (1-D), associated as a fixed tree over the replicas in rank order
    (`pairwise_sum_rows`), identical on every replica: each rank sums one 1/size piece of the rows it gathers with
    an all-to-all, then the pieces are all-gathered. `size` is the group's size, a power of two."""
    if size == 1:
        return flat
    n = flat.numel()
    piece = -(-n // size)
    send = flat.new_zeros(piece * size)
    send[:n] = flat
    rows = torch.empty_like(send)
    dist.all_to_all_single(rows, send, group=group)  # row r: replica r's values of this rank's piece
    mine = pairwise_sum_rows(rows.view(size, piece))
    out = torch.empty_like(send)
    dist.all_gather_into_tensor(out, mine.contiguous(), group=group)
    return out[:n]


class MicroBatchGrads:
    """The gradients of one stage, summed in the fixed order: per model chunk, the tensors a micro-batch's backward
    fills (`slots`: the chunk's parameters, each use of a tied weight as its own leaf). `take(chunk)` moves one
    micro-batch's gradients out of them, sums them over the replicas and folds the block into the chunk's sum;
    `settle()` writes each chunk's sum back into the slots' .grad (views of one flat buffer)."""

    def __init__(self, slots: list[list[torch.Tensor]], group, size: int) -> None:
        self.slots, self.group, self.size = slots, group, size
        self.sums: list[PairwiseSum] = []
        self.peak_bytes = 0  # the most bytes of partial sums held at once (`held_bytes`), since construction

    def held_bytes(self) -> int:
        """Bytes of the partial sums held now, besides the gradients themselves."""
        held = [t for s in self.sums for t in [x for _, x in s.pending] + ([s.total] if s.total is not None else [])]
        return sum(t.numel() * t.element_size() for t in held)

    def begin(self, micro_batches: int) -> None:
        self.sums = [PairwiseSum(micro_batches) for _ in self.slots]

    def take(self, chunk: int) -> None:
        slots = self.slots[chunk]
        if not slots:
            return
        flat = torch.cat([(t.grad if t.grad is not None else torch.zeros_like(t)).reshape(-1) for t in slots])
        for t in slots:
            t.grad = None
        self.sums[chunk].push(tree_all_reduce(flat, self.group, self.size))
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())

    def settle(self) -> None:
        for slots, sums in zip(self.slots, self.sums):
            if not slots:
                continue
            total, offset = sums.result(), 0
            for t in slots:
                t.grad = total[offset:offset + t.numel()].view_as(t)
                offset += t.numel()
        self.sums = []
