"""Point 9: tied weights (embedding on the first stage, head on the last) get identical summed gradients,
stay identical, and match a single process that uses one module twice. The head uses only the tied
weight, so the tied bias has a None gradient on the last stage: it must count as zeros, not skip the
all-reduce (which would hang the first stage)."""
from __future__ import annotations

import torch

from harness.dist import run_distributed
from tests.tds import harness, layers
from tests.tds.common import D_IN

GAS, MBS, STEPS = 2, 2, 3


def specs():
    from tds.pipe import LayerSpec, TiedLayerSpec
    attrs = ["weight", "bias"]
    return [TiedLayerSpec("embed", layers.TiedProj, 0, tied_weight_attr=attrs),
            TiedLayerSpec("alpha", layers.HiddenLayer, 5, tied_weight_attr=["lin.weight", "lin.bias"]),
            LayerSpec(layers.HiddenLayer, 10), LayerSpec(layers.HiddenLayer, 20),
            TiedLayerSpec("alpha", layers.HiddenLayer, 5, tied_weight_attr=["lin.weight", "lin.bias"]),
            TiedLayerSpec("embed", layers.TiedProj, 0, forward_fn=layers.tied_head, tied_weight_attr=attrs)]


def batches():
    g = torch.Generator().manual_seed(9)
    return [[(torch.randn(MBS, D_IN, generator=g), torch.randn(MBS, D_IN, generator=g)) for _ in range(GAS)]
            for _ in range(STEPS)]


def train_rank(opt: str) -> dict:
    engine = harness.build(specs(), ([True], ["float"], [False]), pp=2, gas=GAS, mbs=MBS, opt=opt)
    losses = harness.train(engine, batches())
    return {"losses": losses, "params": harness.engine_params(engine), "stage": engine.stage_id}


def test_point9_tied_weights_identical_and_correct():
    for opt in ("sgd", "adam"):
        results = run_distributed(train_rank, 2, opt, timeout=120)
        first, last = results[0]["params"], results[1]["params"]
        for name in [n for n in first if n.startswith("tied.")]:
            assert torch.equal(first[name], last[name]), f"{opt}: tied {name} differs between stages"
        ref_losses, ref_params = harness.reference(specs(), batches(), GAS, opt=opt)
        harness.assert_close(results, ref_losses, ref_params)
