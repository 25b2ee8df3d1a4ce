"""Points 13 and 14: repeated eval_batch (with logits, other micro-batch counts and sizes) never changes
weights; checkpoints use DeepSpeed's per-layer files and load at the same or another pipeline degree."""
from __future__ import annotations

import os

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import common, harness

GAS, MBS = 2, 2
DECL = ([True], ["float"], [False])


def batches(steps: int, seed: int, mbs: int = MBS, gas: int = GAS):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(mbs, common.D_IN, generator=g), torch.randn(mbs, common.D_OUT, generator=g))
             for _ in range(gas)] for _ in range(steps)]


def eval_rank() -> dict:
    engine = harness.build(common.stack_specs(), DECL, pp=2, gas=GAS, mbs=MBS)
    harness.train(engine, batches(1, 0))
    before = harness.engine_params(engine)
    evals = []
    for mbs, m in [(MBS, GAS), (MBS, GAS), (3, 5)]:
        items = [mb for step in batches(1, 1, mbs, m) for mb in step]
        loss, logits = engine.eval_batch(iter(items), return_logits=True, num_micro_batches=m)
        evals.append((loss.item(), logits))
    after = harness.engine_params(engine)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"evals": evals, "unchanged": unchanged, "stage": engine.stage_id}


def test_point13_eval_batch_repeated_logits_no_weight_change():
    results = run_distributed(eval_rank, 2, timeout=120)
    _, _, forward = harness.reference_model(common.stack_specs(), batches(1, 0), GAS)
    assert all(r["unchanged"] for r in results)
    for k, (mbs, m) in enumerate([(MBS, GAS), (MBS, GAS), (3, 5)]):
        items = batches(1, 1, mbs, m)[0]
        with torch.no_grad():
            outs = [forward(x) for x, _ in items]
        want = sum(common.mse(o, y).item() for o, (_, y) in zip(outs, items)) / m
        for r in results:
            loss, logits = r["evals"][k]
            assert abs(loss - want) < 1e-5 * want
            if r["stage"] == 1:
                assert len(logits) == m and all(torch.allclose(a, b, rtol=1e-5, atol=1e-7)
                                                for a, b in zip(logits, outs))
            else:
                assert logits is None


def save_rank(path: str) -> dict:
    engine = harness.build(common.stack_specs(), DECL, pp=2, gas=GAS, mbs=MBS, opt="adam")
    data = batches(3, 2)
    harness.train(engine, data[:2])
    engine.save_checkpoint(path, tag="step2")
    saved = harness.engine_params(engine)
    third = harness.train(engine, data[2:])
    return {"saved": saved, "third": third}


def load_rank(path: str, pp: int, full: bool) -> dict:
    engine = harness.build(common.stack_specs(), DECL, pp=pp, gas=GAS, mbs=MBS, opt="adam")
    if full:
        engine.load_checkpoint(path, tag="step2")
    else:
        engine.load_module_weights(path, tag="step2")
    loaded = harness.engine_params(engine)
    third = harness.train(engine, batches(3, 2)[2:]) if full else None
    return {"loaded": loaded, "third": third}


@pytest.mark.long
def test_point14_checkpoint_same_and_other_pipeline_degree(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = {}
    results = run_distributed(save_rank, 2, path, timeout=120)
    for r in results:
        saved.update(r["saved"])
    files = sorted(os.listdir(os.path.join(path, "step2")))
    assert [f for f in files if f.startswith("layer_")] == [f"layer_{i:02d}-model_00-model_states.pt"
                                                            for i in range(8)]
    # same degree, full state (optimizer included): training continues exactly
    resumed = run_distributed(load_rank, 2, path, 2, True, timeout=120)
    for r in resumed:
        assert abs(r["third"][0] - results[0]["third"][0]) < 1e-6
    # other degrees: module weights
    for pp in (1, 4):
        loaded = {}
        for r in run_distributed(load_rank, pp, path, pp, False, timeout=120):
            loaded.update(r["loaded"])
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
