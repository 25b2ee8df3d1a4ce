"""The four region mappings: forward and backward against hand-computed results, on the tp group only.

World 4 with tp=2 (so dp=2): tp groups [0, 1] and [2, 3]; a collective over the wrong group would mix
values of both groups and fail.
"""
import torch

from megatron import mpu
from tests.dist import run_distributed


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
