"""Acceptance: GPT2ModelPipe and T5ModelPipe on the TDS engine, for (tp, pp, dp) in
{(1,1,1), (2,1,1), (1,2,1), (1,4,1), (2,2,2)}, give the loss and gradients of one batch and the losses of
5 SGD steps of the single-process plain model built from the same seed, and the eval_batch loss after
training (fp32, relative error < 1e-5).

GPT-2 runs causal attention with no mask tensor (is_causal) and, at (1, 2, 1) and (2, 2, 2), also with an
explicit --reset-attention-mask style mask that crosses the stage boundaries.
T5 layouts: pp=2 balanced puts the boundary between encoder and decoder, pp=4 puts boundaries inside
both stacks, and an explicit boundary list cuts inside the decoder. GPT-2 also runs 'parameters'
partitioning. One run_distributed call per world size runs several trainings back to back.
The plain models themselves are also checked at (tp, dp) = (4, 1) and (2, 2) for one batch.
"""
from __future__ import annotations

import pytest

from harness.dist import run_distributed
from tests.model import common

STEPS = 5
TOL = 1e-5
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 4, 1), pytest.param(2, 2, 2, marks=pytest.mark.long)]


def _jobs(tp: int, pp: int, dp: int) -> list:
    jobs = [dict(kind=k, tp=tp, pp=pp, dp=dp, config_kw={}, steps=STEPS) for k in ("gpt2", "t5")]
    if (tp, pp, dp) == (1, 2, 1):
        jobs.append(dict(kind="t5", tp=1, pp=2, dp=1, config_kw={}, steps=STEPS, partition=[0, 5, 8]))
        jobs.append(dict(kind="gpt2", tp=1, pp=2, dp=1, config_kw={}, steps=STEPS, partition="parameters"))
    if (tp, pp, dp) in ((1, 2, 1), (2, 2, 2)):  # the --reset-attention-mask path: a mask crosses the boundary
        jobs.append(dict(kind="gpt2", tp=tp, pp=pp, dp=dp, config_kw={"explicit_attention_mask": True}, steps=STEPS))
    if (tp, pp, dp) == (1, 4, 1):
        jobs.append(dict(kind="t5", tp=1, pp=4, dp=1, config_kw={}, steps=STEPS, partition=[0, 1, 3, 6, 8]))
    return jobs


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_pipe_matches_plain_model(tp, pp, dp):
    jobs = _jobs(tp, pp, dp)
    per_rank = run_distributed(common.run_jobs, tp * pp * dp, jobs, timeout=500)
    references = {}
    for j, job in enumerate(jobs):
        kind, key = job["kind"], (job["kind"], tuple(job["config_kw"].items()))
        if key not in references:
            config = common.make_config(kind, **job["config_kw"])
            batches = common.make_batches(kind, config, STEPS, common.MBS * common.GAS * dp)
            references[key] = common.reference_run(kind, config, batches)
        ref = references[key]
        results = [r[j] for r in per_rank]
        where = (f"{kind} (tp, pp, dp) = {(tp, pp, dp)}, partition {job.get('partition', 'type:TransformerLayer')}"
                 f" {job['config_kw']}")
        assert len(results) == tp * pp * dp and len(ref["losses"]) == STEPS
        for r in results:
            assert len(r["losses"]) == STEPS, f"{where}: {len(r['losses'])} losses for {STEPS} steps"
            for step, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
                assert abs(got - want) <= TOL * abs(want), f"{where}: step {step} loss {got} vs plain {want}"
            got, want = r["eval_loss"], ref["eval_loss"]
            assert abs(got - want) <= TOL * abs(want), f"{where}: eval loss after training {got} vs plain {want}"
        assert common.check_grads(results, ref["grads"], tp, TOL) == len(ref["grads"])
        if isinstance(job.get("partition"), list):
            assert results[0]["parts"] == job["partition"]


def test_plain_model_tensor_and_data_parallel():
    """GPT2Model / T5Model (no pipeline, gradients reduced over dp by hand) at (tp, dp) = (4, 1) and (2, 2)."""
    jobs = [dict(kind=k, tp=tp, dp=dp) for tp, dp in ((4, 1), (2, 2)) for k in ("gpt2", "t5")]
    per_rank = run_distributed(common.run_plain_jobs, 4, jobs, timeout=500)
    for j, job in enumerate(jobs):
        config = common.make_config(job["kind"])
        ref = common.reference_run(job["kind"], config, common.make_batches(job["kind"], config, 1,
                                                                           common.MBS * common.GAS * job["dp"]))
        results = [r[j] for r in per_rank]
        for r in results:
            assert len(r["losses"]) == len(ref["losses"]) == 1, f"{job}: {r['losses']} vs {ref['losses']}"
            assert abs(r["losses"][0] - ref["losses"][0]) <= TOL * abs(ref["losses"][0]), f"{job}: {r['losses']}"
        common.check_grads(results, ref["grads"], job["tp"], TOL)
