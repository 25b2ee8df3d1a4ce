"""broadcast_data sends tp rank 0's batch to the other ranks of its tensor-parallel group only."""
import pytest
import torch

from megatron import mpu
from harness.dist import run_distributed

KEYS = ["text", "mask"]


def _batch(dp_rank):
    """A batch that differs per data-parallel group, so a broadcast from the wrong source is caught."""
    text = torch.arange(2 * 5, dtype=torch.int64).view(2, 5) + 100 * dp_rank
    mask = torch.arange(3 * 1 * 4, dtype=torch.int64).view(3, 1, 4) * (dp_rank + 1)
    return {"text": text, "mask": mask}


def _receive():
    mpu.initialize_model_parallel(2)
    dp_rank = mpu.get_data_parallel_rank()
    data = _batch(dp_rank) if mpu.get_model_parallel_rank() == 0 else {}
    out = mpu.broadcast_data(KEYS, data, torch.int64)
    expected = _batch(dp_rank)
    ok = all(out[k].shape == expected[k].shape and torch.equal(out[k], expected[k]) for k in KEYS)
    mpu.destroy_model_parallel()
    return ok


def test_broadcast_world4_tp2():
    assert run_distributed(_receive, 4) == [True] * 4


def test_single_process_returns_data_and_checks_dtype():
    batch = _batch(0)
    out = mpu.broadcast_data(KEYS, batch, torch.int64)
    assert all(torch.equal(out[k], batch[k]) for k in KEYS)
    with pytest.raises(ValueError, match=r"'text' has dtype torch.int64, expected torch.float32"):
        mpu.broadcast_data(KEYS, batch, torch.float32)
