"""Gradient clipping by the whole pipeline's norm.

DeepSpeed's fp32 clip (ZeRO stage 0) given the pipeline grid counted gradients that are not tensor-parallel on
pipeline stage 0 only; the engine's `clip_fp32_gradients` counts every stage's, a tied weight once. With a clip
far below the gradient norm (so every step is clipped), pp=2 at ZeRO 0 and pp=2 x dp=2 at ZeRO-1 must train
like one process and report its norm.
"""
from __future__ import annotations

import pytest

from harness.dist import run_distributed
from tests.tds import common, harness
from tests.tds.test_engine_tied import specs

MICRO_BATCHES, MBS, STEPS, CLIP = 4, 2, 3, 0.05


def batches():
    import torch
    g = torch.Generator().manual_seed(23)
    return [[(torch.randn(MBS, 6, generator=g), torch.randn(MBS, 6, generator=g)) for _ in range(MICRO_BATCHES)]
            for _ in range(STEPS)]


def clip_rank(pp: int, dp: int, zero: int) -> dict:
    gas = MICRO_BATCHES // dp
    engine = harness.build(specs(), ([True], ["float"], [False]), pp=pp, dp=dp, gas=gas, mbs=MBS, zero=zero,
                           opt="sgd", extra_cfg={"gradient_clipping": CLIP})
    dp_rank = engine.grid.get_data_parallel_rank()
    norms, losses = [], []
    for step in batches():
        losses.append(engine.train_batch(iter(step[dp_rank * gas:(dp_rank + 1) * gas])).item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "norms": norms, "params": harness.engine_params(engine)}


@pytest.mark.parametrize("pp,dp,zero", [(2, 1, 0), (2, 2, 1)])
def test_pipeline_clips_by_the_whole_models_norm(pp, dp, zero):
    ref = run_distributed(clip_rank, 1, 1, 1, zero, timeout=120)[0]
    assert len(ref["norms"]) == STEPS and min(ref["norms"]) > 10 * CLIP  # every step is clipped
    for r in run_distributed(clip_rank, pp * dp, pp, dp, zero, timeout=120):
        assert len(r["losses"]) == STEPS
        for got, want in zip(r["norms"] + r["losses"], ref["norms"] + ref["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["norms"], ref["norms"], r["losses"], ref["losses"])
        for name, p in r["params"].items():
            assert common.max_rel_err(p, ref["params"][name]) < 1e-5, name
