"""Pretraining sampler: dp ranks partition each global micro-batch; resuming reproduces the uninterrupted run."""
import numpy as np
import pytest
import torch

from megatron.data.samplers import MegatronPretrainingSampler, build_pretraining_data_loader


def batches(total, consumed, mbs, dp_size, drop_last=True):
    """Per dp rank list of micro-batches."""
    return [list(MegatronPretrainingSampler(total, consumed, mbs, r, dp_size, drop_last)) for r in range(dp_size)]


@pytest.mark.parametrize("mbs, dp_size", [(1, 1), (2, 1), (3, 2), (2, 4)])
def test_ranks_partition_each_global_batch(mbs, dp_size):
    total = 101
    per_rank = batches(total, 0, mbs, dp_size)
    gbs = mbs * dp_size
    steps = total // gbs
    for rank_batches in per_rank:
        assert len(rank_batches) == steps and all(len(b) == mbs for b in rank_batches)
    for step in range(steps):
        joined = [i for r in range(dp_size) for i in per_rank[r][step]]
        assert joined == list(range(step * gbs, (step + 1) * gbs))  # rank r holds slice [r*mbs, (r+1)*mbs)


@pytest.mark.parametrize("mbs, dp_size", [(2, 3), (4, 1)])
def test_resume_matches_uninterrupted_run(mbs, dp_size):
    total, gbs = 200, mbs * dp_size
    full = batches(total, 0, mbs, dp_size)
    for step in range(0, total // gbs):
        resumed = batches(total, step * gbs, mbs, dp_size)
        assert all(resumed[r] == full[r][step:] for r in range(dp_size)), step


def test_drop_last_false_keeps_partial_batch():
    per_rank = batches(10, 0, 2, 2, drop_last=False)  # global batches [0..3], [4..7], [8, 9]
    assert per_rank[0] == [[0, 1], [4, 5], [8, 9]] and per_rank[1] == [[2, 3], [6, 7]]
    assert [len(MegatronPretrainingSampler(10, 0, 2, r, 2, drop_last=False)) for r in (0, 1)] == [3, 2]
    assert len(MegatronPretrainingSampler(10, 0, 2, 0, 2)) == 2


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="10 samples already consumed .--load. but the dataset has 10"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 2"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)


class DictDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 50

    def __getitem__(self, i):
        return {"text": np.full(5, i, dtype=np.int64), "mask": np.eye(3, dtype=bool) ^ (i % 2 == 1)}


def test_data_loader_collates_to_tensors_and_resumes():
    loader = build_pretraining_data_loader(DictDataset(), 12, micro_batch_size=3, dp_rank=1, dp_size=2)
    batch = next(iter(loader))
    assert batch["text"].dtype == torch.int64 and batch["text"].shape == (3, 5)
    assert batch["text"][:, 0].tolist() == [15, 16, 17]  # global batch 12..17, rank 1's half
    assert batch["mask"].dtype == torch.bool and batch["mask"].shape == (3, 3, 3)
    assert torch.equal(batch["mask"][0], ~torch.eye(3, dtype=torch.bool))
    assert len(list(loader)) == (50 - 12) // 6


@pytest.mark.parametrize("consumed", [0, 1, 5, 37, 94])
def test_resume_at_any_sample_continues_the_index_stream(consumed):
    mbs, dp_size, total = 2, 3, 100
    per_rank = batches(total, consumed, mbs, dp_size)
    joined = [i for step in zip(*per_rank) for rank_batch in step for i in rank_batch]
    assert joined == list(range(consumed, consumed + (total - consumed) // 6 * 6))
