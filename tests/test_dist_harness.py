"""The multi-rank harness itself: results come back, errors carry tracebacks, hangs name the stuck rank."""
import pytest
import torch
import torch.distributed as dist

from harness.dist import DistributedTestError, run_distributed


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), t.item(), torch.get_num_threads()


def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return "fine"


def _rank_two_hangs():
    if dist.get_rank() == 2:
        import time
        time.sleep(60)
    return "fine"


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_results_in_rank_order(world_size):
    out = run_distributed(_sum_of_ranks, world_size)
    expected = sum(range(world_size))
    assert out == [(r, expected, 1) for r in range(world_size)]


def test_exception_traceback_reaches_pytest():
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1.*ValueError: boom on purpose"):
        run_distributed(_fails_on_rank_one, 2)


def test_timeout_names_stuck_rank():
    with pytest.raises(DistributedTestError, match=r"ranks \[2\] of 3 did not finish"):
        run_distributed(_rank_two_hangs, 3, timeout=8)


def _rank_one_aborts():
    if dist.get_rank() == 1:
        import os
        os.abort()  # a C++-style crash: no traceback, no report
    return "fine"


def test_error_class_says_what_happened():
    """A rank's exception, a crash and a hang raise different classes, so an expected failure can name one."""
    from harness.dist import RankCrashed, RankTimeout, rank_raised
    with pytest.raises(rank_raised("ValueError"), match="boom on purpose") as raised:
        run_distributed(_fails_on_rank_one, 2)
    assert raised.value.rank_errors == {1: "ValueError"}
    with pytest.raises(RankCrashed, match=r"rank 1 exited with code -6 without reporting"):
        run_distributed(_rank_one_aborts, 2, timeout=30)
    with pytest.raises(RankTimeout, match=r"ranks \[2\] of 3 did not finish"):
        run_distributed(_rank_two_hangs, 3, timeout=8)
