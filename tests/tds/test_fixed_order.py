"""tds/pipe/fixed_order.py: the sums that make --layout-invariant's bits independent of the split.

- `PairwiseSum` (streamed, at most log2(n) + 1 partial sums held) gives the bits of `pairwise_sum_rows` for every
  count, and for every power-of-two number of replicas P dividing M, summing each block of P consecutive atoms
  first (what the replicas do) and then the blocks gives the bits of one process summing all M atoms;
- the plain left-to-right sum of the same atoms differs in its last bits for even M >= 4 (the orders are not equal
  by luck);
- `tree_all_reduce` over 4 processes gives every rank the bits of `pairwise_sum_rows` over the ranks' tensors, for a
  length the group does not divide;
- torch's AdamW gives every element the same bits wherever the flat tensor is cut and with one or two threads: what
  ZeRO-1's partitions of any dp need to step like one process's parameters (tds/pipe/fixed_zero.py).
"""
from __future__ import annotations

import pytest
import torch

from harness.dist import run_distributed
from tds.pipe.fixed_order import PairwiseSum, pairwise_sum_rows, tree_all_reduce


def _atoms(m: int, n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(m)
    return torch.randn(m, n, generator=g) * torch.logspace(-3, 3, n)


def _streamed(rows: torch.Tensor) -> torch.Tensor:
    total = PairwiseSum(rows.shape[0])
    for row in rows:
        total.push(row.clone())
    return total.result()


@pytest.mark.parametrize("m", range(1, 13))
def test_streamed_and_blocked_sums_give_one_process_bits(m):
    atoms = _atoms(m)
    one = pairwise_sum_rows(atoms)
    assert torch.equal(_streamed(atoms), one)
    for p in (2, 4, 8):
        if m % p:
            continue
        blocks = torch.stack([pairwise_sum_rows(atoms[k * p:(k + 1) * p]) for k in range(m // p)])
        assert torch.equal(_streamed(blocks), one), f"M = {m}, {p} replicas"
    if m % 2 == 0 and m >= 4:  # (with odd M the tree is left to right)
        plain = atoms[0].clone()
        for row in atoms[1:]:
            plain += row
        assert not torch.equal(plain, one), f"M = {m}: left to right gave the tree's bits"


def test_a_sum_pushed_past_its_count_or_read_early_is_refused():
    total = PairwiseSum(2)
    total.push(torch.ones(3))
    with pytest.raises(RuntimeError, match="1 of 2 items pushed"):
        total.result()
    total.push(torch.ones(3))
    with pytest.raises(RuntimeError, match="a 3th item pushed into a sum of 2"):
        total.push(torch.ones(3))


def _tree_rank(n: int) -> tuple:
    import torch.distributed as dist
    mine = _atoms(4, n)[dist.get_rank()]
    return tree_all_reduce(mine.clone(), None, dist.get_world_size()), pairwise_sum_rows(_atoms(4, n))


def test_tree_all_reduce_gives_every_rank_the_fixed_tree():
    for got, want in run_distributed(_tree_rank, 4, 1001, timeout=120):
        assert torch.equal(got, want)


def _adamw(cuts: list, threads: int, n: int = 100_003, steps: int = 3) -> torch.Tensor:
    """One flat tensor cut at `cuts` into parameters, stepped by AdamW `steps` times; the parameters joined again."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(1)
        flat, grads = torch.randn(n, generator=g), [torch.randn(n, generator=g) for _ in range(steps)]
        bounds = [0, *cuts, n]
        parts = [torch.nn.Parameter(flat[a:b].clone()) for a, b in zip(bounds, bounds[1:])]
        opt = torch.optim.AdamW(parts, lr=1e-3, weight_decay=0.1)
        for grad in grads:
            for p, a, b in zip(parts, bounds, bounds[1:]):
                p.grad = grad[a:b].clone()
            opt.step()
        return torch.cat([p.detach() for p in parts])
    finally:
        torch.set_num_threads(before)


def test_adamw_gives_each_element_the_same_bits_wherever_the_tensor_is_cut():
    whole = _adamw([], 1)
    for cuts, threads in (([], 2), ([50_001], 1), ([50_004], 2), ([17, 33_335, 66_671], 1), ([5], 2)):
        assert torch.equal(_adamw(cuts, threads), whole), (cuts, threads)


def test_zero_optimizers_it_cannot_keep_fixed_are_refused_in_one_line():
    from types import SimpleNamespace

    from tds.pipe.fixed_zero import adopt
    offload = SimpleNamespace(partition_gradients=False, cpu_offload=True, dtype=torch.bfloat16, has_moe_layers=False)
    with pytest.raises(ValueError) as err:
        adopt(offload, lambda: torch.zeros(()))
    assert str(err.value) == ("pipeline.layout_invariant runs ZeRO stage 1 in fp32 without cpu_offload or MoE layers; "
                              "got cpu_offload, dtype torch.bfloat16")
