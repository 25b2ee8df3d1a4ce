"""The replica check's parts (megatron/training/replicas.py): fingerprints that change with any flipped bit and with
moved words, the line naming the replicas that differ, the check over data-parallel groups (every rank of the world
gets the same line, whichever group found it), and what counts as replicated (the optimizer state at ZeRO stage 0
only, and not BF16_Optimizer's partitioned state: a bf16 run at stage 0 passes its checks). Through the example script, a bit flipped in one replica: tests/faults/test_replicas_e2e.py (long)."""
import pytest
import torch

from harness.dist import run_distributed
from megatron.training.replicas import check_replicas, disagreement, fingerprint, replicated_tensors
from tests.training.runner import small_argv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_flipped_bit_or_moved_words_change_the_fingerprint(dtype):
    def fingerprint_of(x):
        return fingerprint(x).tolist()
    t = torch.randn(7, 5).to(dtype)
    assert fingerprint_of(t) == fingerprint_of(t.clone())
    for word in (0, 17, t.numel() * t.element_size() // 2 - 1):
        for bit in (0, 7, 15):
            flipped = t.clone()
            flipped.view(-1).view(torch.int16)[word] ^= 1 << bit
            assert fingerprint_of(flipped)[0] != fingerprint_of(t)[0], (word, bit)
    moved = t.clone().view(-1)
    moved[[0, 1]] = moved[[1, 0]]
    assert moved[0] != moved[1] and fingerprint_of(moved)[1] != fingerprint_of(t)[1]
    odd = torch.arange(5, dtype=torch.uint8)  # 5 bytes: read as bytes
    assert fingerprint_of(odd) != fingerprint_of(odd + torch.tensor([0, 0, 1, 0, 0], dtype=torch.uint8))


def test_the_line_names_the_odd_replica_or_both_of_two():
    same = [[1, 2], [3, 4]]
    prints = torch.tensor([same, same, [[1, 2], [3, 5]], same])
    line = disagreement(["parameter a", "parameter b"], prints, [4, 5, 6, 7])
    assert line == "the data-parallel replicas disagree on parameter b: data-parallel rank 2 (global rank 6) holds " \
                   "other bits than the rest"
    two = disagreement(["parameter a"], torch.tensor([[[1, 2]], [[1, 3]]]), [0, 8])
    assert two == "the data-parallel replicas disagree on parameter a: data-parallel ranks 0 (global rank 0), 1 " \
                  "(global rank 8) hold other bits than each other"
    assert disagreement(["parameter a", "parameter b"], torch.tensor([same, same]), [0, 1]) is None


def _groups_rank(odd_rank: int) -> tuple:
    """Four ranks as two data-parallel groups {0, 1}, {2, 3} and as one group of four; rank `odd_rank` flips a bit."""
    import torch.distributed as dist
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group([0, 1, 2, 3])
    torch.manual_seed(0)
    weight = torch.randn(4, 4)
    tensors = [("parameter 0.weight", weight.clone()), ("parameter 0.bias", torch.zeros(4))]
    clean = (check_replicas(tensors, pairs[rank // 2]), check_replicas(tensors, everyone))
    if rank == odd_rank:
        tensors[0][1].view(-1).view(torch.int32)[3] ^= 1 << 20
    return clean, check_replicas(tensors, pairs[rank // 2]), check_replicas(tensors, everyone)


def test_every_rank_gets_the_line_of_the_group_that_found_it():
    results = run_distributed(_groups_rank, 4, 3, timeout=120)
    assert all(clean == (None, None) for clean, _, _ in results)
    pair = "the data-parallel replicas disagree on parameter 0.weight: data-parallel ranks 0 (global rank 2), 1 " \
           "(global rank 3) hold other bits than each other"
    four = "the data-parallel replicas disagree on parameter 0.weight: data-parallel rank 3 (global rank 3) holds " \
           "other bits than the rest"
    assert [(p, f) for _, p, f in results] == [(pair, four)] * 4


def test_optimizer_state_counts_where_replicated_only():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    zero0 = [n for n, _ in replicated_tensors(model, opt, True)]
    assert zero0[:2] == ["parameter weight", "parameter bias"]
    assert {"optimizer state exp_avg of weight", "optimizer state exp_avg_sq of bias"} <= set(zero0)
    assert [n for n, _ in replicated_tensors(model, opt, False)] == ["parameter weight", "parameter bias"]


def _checked_run(argv, world):
    from tests.training.runner import train_state
    state = train_state(argv, world)
    return state.checked_iteration, state.checked_saved


def test_bf16_at_zero_stage_0_checks_only_what_is_replicated(gpt_data, tmp_path):
    """bf16 at ZeRO stage 0 runs BF16_Optimizer (the project's FlatBF16Optimizer), whose fp32 master weights and
    their Adam state are partitioned over the data-parallel ranks: checked as replicated, they would stop a healthy
    run. A check every iteration and at every save passes at dp 2."""
    argv = small_argv(gpt_data, train_iters=4, extra=["--bf16", "--zero-stage", "0", "--check-replicas-interval", "1",
                                                      "--check-replicas-at-save", "--save", str(tmp_path / "ckpt"),
                                                      "--save-interval", "2"])
    assert run_distributed(_checked_run, 2, argv, 2, timeout=240) == [(4, 4)] * 2
