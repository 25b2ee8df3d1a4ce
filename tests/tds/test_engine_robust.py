"""Points 11 and 12: activation checkpointing by interval (non-reentrant and reentrant, any layer class),
and a hung peer turning into an error that names stage, instruction and micro-batch within the timeout."""
from __future__ import annotations

import time

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import common, harness, layers
from tests.tds.common import D_IN, D_OUT, H
from tests.tds.harness import Recorder

GAS, MBS, STEPS = 2, 2, 2
DECL = ([True], ["float"], [False])


def specs():
    from tds.pipe import LayerSpec
    return ([LayerSpec(layers.CountingLinear, D_IN, H, 0)] + [LayerSpec(layers.CountingLinear, H, H, i)
                                                              for i in range(1, 5)]
            + [LayerSpec(layers.CountingLinear, H, D_OUT, 9)])


def batches():
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(MBS, D_IN, generator=g), torch.randn(MBS, D_OUT, generator=g)) for _ in range(GAS)]
            for _ in range(STEPS)]


def ckpt_rank(interval: int, reentrant: bool | None) -> dict:
    Recorder.events.clear()
    pipeline = {"activation_checkpoint_interval": interval}
    if reentrant is not None:
        pipeline["use_reentrant"] = reentrant
    engine = harness.build(specs(), DECL, pp=2, gas=GAS, mbs=MBS, pipeline=pipeline)
    losses = harness.train(engine, batches())
    return {"losses": losses, "params": harness.engine_params(engine), "calls": len(Recorder.events),
            "layers": len(engine.module.forward_funcs)}


@pytest.mark.parametrize("interval,reentrant", [(0, None), (2, False), (2, True),
                                                pytest.param(1, True, marks=pytest.mark.slow)])
def test_point11_activation_checkpointing(interval, reentrant):
    results = run_distributed(ckpt_rank, 2, interval, reentrant, timeout=120)
    ref_losses, ref_params = harness.reference(specs(), batches(), GAS)
    harness.assert_close(results, ref_losses, ref_params)
    for r in results:  # each checkpointed layer runs twice per micro-batch (forward + recompute)
        assert r["calls"] == (2 if interval else 1) * r["layers"] * GAS * STEPS


def hang_rank() -> dict:
    engine = harness.build(common.stack_specs(), DECL, pp=2, gas=GAS, mbs=MBS, pipeline={"timeout_s": 2})
    if engine.stage_id == 1:
        time.sleep(4)  # a hung peer: never takes part in the batch
        return {"stage": 1}
    X, Y = common.make_data(1, GAS * MBS)
    start = time.monotonic()
    try:
        engine.train_batch(common.rank_iterator(X, Y, 0, 1, GAS, MBS))
    except Exception as e:  # noqa: BLE001 - the error is the result
        return {"stage": 0, "error": f"{type(e).__name__}: {e}", "elapsed": time.monotonic() - start}
    return {"stage": 0, "error": None}


def test_point12_hung_peer_fails_within_timeout_naming_stage_and_instruction():
    r0 = run_distributed(hang_rank, 2, timeout=60)[0]
    assert r0["error"] is not None and r0["elapsed"] < 5
    assert "PipelineCommError: pipeline stage 0, instruction recv_grads(micro_batch=0)" in r0["error"], r0["error"]
    assert "rank 1" in r0["error"] and "timed out after 2s" in r0["error"]
