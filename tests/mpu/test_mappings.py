"""The four region mappings: forward and backward against hand-computed results, on the tp group only.

World 4 with tp=2 (so dp=2): tp groups [0, 1] and [2, 3]; a collective over the wrong group would mix
values of both groups and fail.
"""
import pytest
import torch

from megatron import mpu
from harness.dist import run_distributed


def _value(global_rank, shape):
    """A tensor that differs per global rank: (rank + 1) * [0.1, 0.2, ...]."""
    n = torch.Size(shape).numel()
    return (global_rank + 1) * 0.1 * torch.arange(1, n + 1, dtype=torch.float32).view(shape)


def _run_mapping(fn, x, grad):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _check_all():
    state = mpu.initialize_model_parallel(2)
    me, peers = state.global_rank, state.tp_ranks
    tp_rank = mpu.get_model_parallel_rank()
    shape = (2, 4)
    x, g = _value(me, shape), _value(me, shape) * 10
    total_x = sum(_value(r, shape) for r in peers)
    total_g = sum(_value(r, shape) * 10 for r in peers)

    y, dx = _run_mapping(mpu.copy_to_tensor_model_parallel_region, x, g)
    assert torch.equal(y, x) and torch.allclose(dx, total_g), "copy_to: identity forward, all-reduce backward"

    y, dx = _run_mapping(mpu.reduce_from_tensor_model_parallel_region, x, g)
    assert torch.allclose(y, total_x) and torch.equal(dx, g), "reduce_from: all-reduce forward, identity back"

    half = x.chunk(2, -1)[tp_rank]
    y, dx = _run_mapping(mpu.scatter_to_tensor_model_parallel_region, x, half * 10)
    gathered_g = torch.cat([_value(r, shape).chunk(2, -1)[i] * 10 for i, r in enumerate(peers)], -1)
    assert torch.equal(y, half) and torch.equal(dx, gathered_g), "scatter_to: split forward, gather backward"

    y, dx = _run_mapping(mpu.gather_from_tensor_model_parallel_region, x, torch.cat([g, g + 1], -1))
    assert torch.equal(y, torch.cat([_value(r, shape) for r in peers], -1))
    assert torch.equal(dx, [g, g + 1][tp_rank]), "gather_from: gather forward, split backward"

    # an explicit group overrides the current one: the whole world
    world = torch.distributed.group.WORLD
    y, _ = _run_mapping(lambda t: mpu.reduce_from_tensor_model_parallel_region(t, world), x, g)
    assert torch.allclose(y, sum(_value(r, shape) for r in range(4)))
    mpu.destroy_model_parallel()
    return True


def test_mappings_world4_tp2():
    assert run_distributed(_check_all, 4) == [True] * 4


def test_identity_without_distributed():
    x = torch.randn(3, 4, requires_grad=True)
    for fn in (mpu.copy_to_tensor_model_parallel_region, mpu.reduce_from_tensor_model_parallel_region,
               mpu.scatter_to_tensor_model_parallel_region, mpu.gather_from_tensor_model_parallel_region):
        y = fn(x)
        assert torch.equal(y, x)
        (g,) = torch.autograd.grad(y.sum(), x)
        assert torch.equal(g, torch.ones_like(x))


def _check_sequence(tp: int, all_to_all: bool = True):
    """The sequence-parallel mappings and the column GEMM on (b, s, h) = (2, 8, 3) against sums and
    concatenations of every peer's values, forward and backward. all_to_all=False: through the collectives
    other backends (NCCL) use, all_gather_into_tensor and reduce_scatter_tensor, which gloo runs too."""
    import torch.nn.functional as F

    from megatron.mpu import mappings
    from megatron.mpu.sequence_parallel import sequence_parallel_linear
    if not all_to_all:
        mappings._by_all_to_all = lambda x: False
    state = mpu.initialize_model_parallel(tp)
    me, peers = state.global_rank, state.tp_ranks
    tp_rank = mpu.get_model_parallel_rank()
    full, part = (2, 8, 3), (2, 8 // tp, 3)
    mine = slice(tp_rank * 8 // tp, (tp_rank + 1) * 8 // tp)

    x, g = _value(me, full), _value(me, part) * 10  # partial sums (b, s, h); a gradient of this rank's part
    y, dx = _run_mapping(mpu.reduce_scatter_to_sequence_parallel_region, x, g)
    assert torch.allclose(y, sum(_value(r, full) for r in peers)[:, mine]), "reduce-scatter forward"
    assert torch.equal(dx, torch.cat([_value(r, part) * 10 for r in peers], 1)), "reduce-scatter backward: gather"

    x, g = _value(me, part), _value(me, full) * 10
    y, dx = _run_mapping(mpu.gather_from_sequence_parallel_region, x, g)
    assert torch.equal(y, torch.cat([_value(r, part) for r in peers], 1)), "gather forward"
    assert torch.allclose(dx, sum(_value(r, full) * 10 for r in peers)[:, mine]), "gather backward: reduce-scatter"
    _, dx = _run_mapping(lambda t: mpu.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
                         x, g)
    assert torch.equal(dx, g[:, mine]), "gather backward without tensor-parallel consumers: split"

    x, g = _value(me, full), _value(me, part) * 10  # replicated input; its split, gathered back
    y, dx = _run_mapping(mpu.scatter_to_sequence_parallel_region, x, g)
    assert torch.equal(y, x[:, mine]) and torch.equal(dx, torch.cat([_value(r, part) * 10 for r in peers], 1))

    # the column GEMM on this rank's part (W_r differs per rank): Y_r = AG(X^r) W_r^T + b_r; dX^r = RS(dY_r W_r),
    # dW_r = dY_r^T X, db_r = sum dY_r
    w = torch.nn.Parameter(_value(me, (5, 3)))
    bias = torch.nn.Parameter(_value(me, (5,)))
    x = _value(me, part).requires_grad_()
    dy = _value(me, (2, 8, 5))
    y = sequence_parallel_linear(x, w, bias, state.tp_group)
    y.backward(dy)
    gathered = torch.cat([_value(r, part) for r in peers], 1)
    assert torch.allclose(y, F.linear(gathered, w, bias))
    assert torch.allclose(x.grad, sum(_value(r, (2, 8, 5)).matmul(_value(r, (5, 3))) for r in peers)[:, mine])
    assert torch.allclose(w.grad, dy.reshape(-1, 5).t().mm(gathered.reshape(-1, 3)))
    assert torch.allclose(bias.grad, dy.reshape(-1, 5).sum(0))
    mpu.destroy_model_parallel()
    return True


@pytest.mark.parametrize("all_to_all", [True, False], ids=["all-to-all", "collectives"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_mappings_world4(tp, all_to_all):
    """World 4: tp 2 (two groups, a collective over the wrong one would mix them) and tp 4; the CPU path and the
    path of other backends (NCCL's collectives, run here on gloo)."""
    assert run_distributed(_check_sequence, 4, tp, all_to_all) == [True] * 4
