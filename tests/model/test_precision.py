"""fp16 and bf16: GPT2ModelPipe and T5ModelPipe train to completion in every layout of the acceptance set,
with finite losses that decrease at every step on one repeated batch (SGD, ZeRO-1).

fp16 runs through DeepSpeed's dynamic loss scaler. ZeRO-1 is used for both: with ZeRO-0 and a client
(torch) optimizer, DeepSpeed 0.19.8 wraps it in FP16_UnfusedOptimizer, whose gradients come out divided
by the loss scale once too often (engine.backward scales the loss only for ZeRO optimizers), so fp16
training would crawl. Softmax (inside SDPA), norms and the loss are computed in fp32.
"""
from __future__ import annotations

import math

import pytest

from tests.dist import run_distributed
from tests.model import common

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 2)]
STEPS = 5


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_half_precision_trains(tp, pp, dp):
    jobs = [dict(kind=k, tp=tp, pp=pp, dp=dp, config_kw={}, steps=STEPS, precision=p, zero=1, repeat_batch=True)
            for p in ("bf16", "fp16") for k in ("gpt2", "t5")]
    per_rank = run_distributed(common.run_jobs, tp * pp * dp, jobs, timeout=500)
    for j, job in enumerate(jobs):
        losses = per_rank[0][j]["losses"]
        where = f"{job['kind']} {job['precision']} (tp, pp, dp) = {(tp, pp, dp)}: losses {losses}"
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), where
        assert all(b < a for a, b in zip(losses, losses[1:])), where
        assert all(r[j]["losses"] == losses for r in per_rank), f"{where}: ranks disagree"
