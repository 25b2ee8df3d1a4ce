"""tds/pipe/stage_loss.py: a loss a layer adds on its own stage (`add_stage_loss`) trains as if it were added to
its micro-batch's loss, without crossing a stage boundary.

The stack of tests/tds/common.py with a penalty 0.05 mean(y^2) added by hidden layers 1-4 (so that at pp 2 the
second stage adds none), trained 2 steps by SGD on 4 gloo ranks at (pp, dp) = (2, 2), gas 4, in one launch: by the
1F1B, GPipe, ZB-H1 and interleaved (2 chunks per stage; the last chunk adds none) schedules at ZeRO 1, and by 1F1B
with fixed-order sums (`layout_invariant`, dp scaled in the loss). Losses and every parameter equal one process
that back-propagates loss_i / m with the penalties scaled by 1 / m (relative error under 1e-5). Against one process
without the penalties' gradient they differ: the penalties are not too small to matter.
"""
from __future__ import annotations

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import common, harness

GAS, MBS, DP, STEPS, PENALIZED = 4, 2, 2, 2, 4  # layers 1..4 add a penalty


class PenalizedLinear(common.SeededLinear):
    def forward(self, x):
        from tds.pipe import add_stage_loss
        y = super().forward(x)
        return add_stage_loss(y, 0.05 * y.square().mean())


def _specs():
    from tds.pipe import LayerSpec
    specs = common.stack_specs()
    for i in range(1, PENALIZED + 1):
        specs[i] = LayerSpec(PenalizedLinear, common.H, common.H, i)
    return specs


def _batches():
    X, Y = common.make_data(STEPS, GAS * MBS * DP)
    return [[(X[t, j * MBS:(j + 1) * MBS], Y[t, j * MBS:(j + 1) * MBS]) for j in range(GAS * DP)]
            for t in range(STEPS)]


def _train(schedule: str, pipeline_extra: dict, zero: int, v: int = 1) -> dict:
    engine = harness.build(_specs(), ([True], ["float"], [False]), pp=2, dp=DP, gas=GAS, mbs=MBS, zero=zero,
                           pipeline=dict(schedule=schedule, **pipeline_extra, **({"virtual_stages": v} if v > 1
                                                                                  else {})), virtual_stages=v)
    r = engine.grid.get_data_parallel_rank()
    X, Y = common.make_data(STEPS, GAS * MBS * DP)
    fixed = pipeline_extra.get("layout_invariant", False)
    it = _fixed_order_iterator(r) if fixed else common.rank_iterator(X, Y, r, DP, GAS, MBS)
    losses = [engine.train_batch(it).item() for _ in range(STEPS)]
    module = engine.module  # parameters keyed by global layer index (interleaved chunks are not contiguous)
    return {"losses": losses, "params": {f"{module.layer_index[i]}.{n}": p.detach().clone()
                                         for i, layer in enumerate(module.forward_funcs)
                                         if isinstance(layer, torch.nn.Module) for n, p in layer.named_parameters()}}


def _fixed_order_iterator(dp_rank: int):
    """Fixed-order sums: replica r takes global micro-batch k dp + r as its k-th."""
    for step in _batches():
        for k in range(GAS):
            yield step[k * DP + dp_rank]


def _jobs() -> dict:
    return {"1f1b": _train("1f1b", {}, 1), "gpipe": _train("gpipe", {}, 1), "zb-h1": _train("zb-h1", {}, 1),
            "interleaved": _train("interleaved", {}, 1, v=2), "fixed": _train("1f1b", {"layout_invariant": True}, 0)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_jobs, 4, timeout=300)


def _reference(factor: float = 1.0):
    import tds.pipe.stage_loss as stage_loss
    with stage_loss.scaled(factor / (GAS * DP)):  # one process: loss_i / m with m = dp x gas micro-batches
        return harness.reference(_specs(), _batches(), GAS * DP)


@pytest.mark.parametrize("job", ["1f1b", "gpipe", "zb-h1", "interleaved", "fixed"])
def test_stage_losses_train_as_part_of_each_micro_batch_loss(results, job):
    ref_losses, ref_params = _reference()
    harness.assert_close([r[job] for r in results], ref_losses, ref_params)


def test_a_reference_without_them_differs(results):
    ref_losses, ref_params = _reference(factor=0.0)
    with pytest.raises(harness.ResultMismatch):  # the second loss differs already (4e-4 relative)
        harness.assert_close([r["1f1b"] for r in results], ref_losses, ref_params)
