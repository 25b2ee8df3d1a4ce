"""RNG tracker: dropout agrees across tp ranks outside the fork and differs inside; checkpoint replays it."""
import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from harness.dist import run_distributed

SEED = 1234


def _mask(n=64):
    return F.dropout(torch.ones(n), p=0.5, training=True)


def _masks_per_rank():
    mpu.initialize_model_parallel(2)
    tp_rank = mpu.get_model_parallel_rank()
    mpu.model_parallel_seed(SEED)
    outside = _mask()
    with mpu.get_cuda_rng_tracker().fork():
        inside = _mask()
    after = _mask()
    torch.manual_seed(SEED + 2718 + tp_rank)  # the documented seed of the model-parallel stream
    expected_inside = _mask()
    mpu.destroy_model_parallel()
    return outside, inside, after, expected_inside


def test_dropout_same_outside_fork_different_inside_world4_tp2():
    out = run_distributed(_masks_per_rank, 4)
    for outside, inside, after, expected_inside in out:
        assert torch.equal(outside, out[0][0]) and torch.equal(after, out[0][2])
        assert torch.equal(inside, expected_inside)
    assert not torch.equal(out[0][1], out[1][1]), "tp ranks 0 and 1 must draw different masks in the fork"
    assert torch.equal(out[0][1], out[2][1]), "same tp rank in another dp group: same mask"
    assert not torch.equal(out[0][0], out[0][2]), "the default stream advanced past the fork"


def test_fork_advances_stream_and_states_restore():
    mpu.model_parallel_seed(SEED, tp_rank=0)
    tracker = mpu.get_rng_tracker()
    saved = tracker.get_states()
    with tracker.fork():
        first = _mask()
    with tracker.fork():
        second = _mask()
    assert not torch.equal(first, second)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(_mask(), first)


class _Block(nn.Module):
    """Linear -> dropout on the default stream -> linear -> dropout on the model-parallel stream."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = F.dropout(torch.tanh(self.a(x)), p=0.3, training=True)
        with mpu.get_rng_tracker().fork():
            return F.dropout(self.b(h), p=0.3, training=True)


def _grads(block, x, checkpointed):
    mpu.model_parallel_seed(SEED, tp_rank=0)
    block.zero_grad()
    y = mpu.checkpoint(block, x) if checkpointed else block(x)
    rng_after = torch.get_rng_state(), mpu.get_rng_tracker().get_states()
    y.square().sum().backward()
    grads = [p.grad.clone() for p in block.parameters()]
    if x.requires_grad:
        grads.append(x.grad.clone())
        x.grad = None
    return y.detach(), grads, rng_after


def test_checkpoint_reproduces_gradients_exactly_with_dropout():
    torch.manual_seed(0)
    block = _Block()
    for requires_grad in (True, False):
        x = torch.randn(4, 8, requires_grad=requires_grad)
        y_ref, g_ref, rng_ref = _grads(block, x, checkpointed=False)
        y_ck, g_ck, rng_ck = _grads(block, x, checkpointed=True)
        assert torch.equal(y_ref, y_ck)
        assert len(g_ref) == len(g_ck) == (5 if requires_grad else 4)
        for a, b in zip(g_ref, g_ck):
            assert torch.equal(a, b)
        assert torch.equal(rng_ref[0], rng_ck[0])
        assert all(torch.equal(rng_ref[1][k], rng_ck[1][k]) for k in rng_ref[1])
        # backward must leave the streams where the forward left them
        assert torch.equal(torch.get_rng_state(), rng_ck[0])
        assert torch.equal(mpu.get_rng_tracker().get_states()["model-parallel-rng"], rng_ck[1]["model-parallel-rng"])
