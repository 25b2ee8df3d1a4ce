"""Points 1, 2, 3, 6: what the boundary tuple may contain. Each test trains a 2-stage (or 2x2 with TP)
pipeline for 2 steps and compares losses and parameters with a single plain-torch process (rel err 1e-5)."""
from __future__ import annotations

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import harness, layers
from tests.tds.common import D_IN, D_OUT
from tests.tds.harness import Recorder

STEPS, GAS, MBS = 2, 3, 2


def specs_of(first, mid, head, n_mid: int = 2):
    from tds.pipe import LayerSpec
    return [LayerSpec(first, 0)] + [LayerSpec(mid, 10 * (i + 1)) for i in range(n_mid)] + [LayerSpec(head, 99)]


def batches(seed: int = 0, shape=(MBS, D_IN)):
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(*shape, generator=g), torch.randn(shape[0], D_OUT, generator=g)) for _ in range(GAS)]
            for _ in range(STEPS)]


def train_rank(kind: str, decl, pp: int, tp: int = 1) -> dict:
    Recorder.events.clear()
    engine = harness.build(specs_of(*KINDS[kind]), decl, pp=pp, gas=GAS, mbs=MBS, tp=tp)
    losses = harness.train(engine, batches())
    return {"losses": losses, "params": harness.engine_params(engine), "events": list(Recorder.events),
            "stage": engine.stage_id, "stats": engine.p2p.stats if engine.p2p else None}


KINDS = {"mixed": (layers.MixedIn, layers.MixedMid, layers.MixedHead),
         "unused": (layers.UnusedIn, layers.UnusedMid, layers.UnusedHead),
         "two": (layers.TwoIn, layers.TwoMid, layers.TwoHead),
         "noncontig": (layers.NonContigIn, layers.NonContigMid, layers.NonContigHead)}


def check(kind: str, decl, pp: int = 2, tp: int = 1) -> list:
    results = run_distributed(train_rank, pp * tp, kind, decl, pp, tp, timeout=120)
    ref_losses, ref_params = harness.reference(specs_of(*KINDS[kind]), batches(), GAS)
    harness.assert_close(results, ref_losses, ref_params)
    return results


def test_point1_any_dtype_any_position():
    results = check("mixed", layers.MIXED_DECL)
    want = (torch.float32, True), (torch.bfloat16, True), (torch.int64, False), (torch.int32, False), \
        (torch.bool, False), (torch.float16, False)
    stage1 = [r for r in results if r["stage"] == 1][0]
    received = [ev for ev in stage1["events"] if ev[0][1]]  # the mid layer that reads a received tuple
    assert received and all(ev == want for ev in received), received[:1]


def test_point2_grad_only_for_declared_and_none_grad_sent_as_zeros():
    results = check("unused", layers.UNUSED_DECL)
    stage1 = [r for r in results if r["stage"] == 1][0]
    # on the receiving stage: fmask (float, declared without grad) never requires grad, e does
    assert stage1["events"] and all(ev == (False, True) for ev in stage1["events"])


@pytest.mark.parametrize("tp,partitioned", [(1, [False, False]), pytest.param(2, [True, False], marks=pytest.mark.slow),
                                             (2, [True, True])])
def test_point3_several_grad_tensors(tp, partitioned):
    check("two", ([True, True], ["float", "float"], partitioned), tp=tp)


def test_point6_non_contiguous_tensors():
    check("noncontig", layers.NONCONTIG_DECL)


def test_layout_mismatch_names_position_and_dtypes():
    decl = ([True, True, False, False, False, False], ["float", "bfloat16", "int64", "int64", "bool", "float16"],
            [False] * 6)
    with pytest.raises(AssertionError, match=r"position 3: declared type 'int64'.*got dtype torch.int32 shape \(2, 1\)"):
        run_distributed(train_rank, 2, "mixed", decl, 2, timeout=60)
