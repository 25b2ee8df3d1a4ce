"""pipeline.check_finite's rule for where a non-finite value first appeared, and its per-batch flags."""
import torch

from tds.pipe.finite import FiniteCheck, first_appearance


def test_forward_wins_and_the_lowest_stage_is_named():
    assert first_appearance({"forward": {2: 9, 1: 5}, "gradients": {3: 12}}) == ("forward", 1, 5)


def test_gradients_only_name_the_highest_stage():
    # backward runs from the last stage to the first: the highest stage saw it first
    assert first_appearance({"forward": {}, "gradients": {0: 0, 2: 8}}) == ("gradients", 2, 8)


def test_all_finite_is_none():
    assert first_appearance({"forward": {}, "gradients": {}}) is None


def test_flags_fold_per_kind_and_skip_integer_tensors():
    check = FiniteCheck(stage_id=1, num_stages=2, world_rank=3, world_size=4, groups=())
    check.watch("forward", [torch.ones(3), torch.tensor([1, 2])])
    assert not bool(check._bad["forward"])
    check.watch("forward", [torch.tensor([1.0, float("inf")])])
    check.watch("forward", [torch.ones(2)])  # a later finite tensor does not clear the flag
    assert bool(check._bad["forward"]) and check._bad["gradients"] is None
    check.reset()
    assert check._bad == {"forward": None, "gradients": None}
