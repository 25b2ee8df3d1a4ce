"""Issue 13's acceptance: DeepSpeed-0.19-style pipeline programs that declare nothing train on TDS with the
losses and parameters of one plain torch process (fp32, relative error < 1e-5), and with DeepSpeed's own
engine's losses where that engine works.

Programs (tests/tds/dropin_programs.py): an AlexNet-like CNN with in-place ReLUs (a stage starts with one),
with no checkpointing and with every layer its own checkpoint segment in each checkpoint mode; shapes that
change every micro-batch (`dynamic_shape=True`); tied layers; a tuple of every dtype; a float mask without
grad next to a gradient that is never produced, evaluated before training; two gradient streams with
checkpoint intervals set on the module and in the JSON. Two distributed runs (2 and 4 ranks) cover pp = 1 (x dp 2),
2 and 4 and pp 2 x dp 2 (ZeRO-1); each runs every program in the same processes."""
from __future__ import annotations

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import dropin_programs as dropin

NAMES = sorted(dropin.programs())
CNN_MODES = [n for n in NAMES if n.startswith("cnn_k1_")]
DEEPSPEED_WORKS = ["cnn", "cnn_k1_default", "seq", "tied"]  # DeepSpeed's engine fails the others (xfail file)
DP_NAMES = ["cnn_k1_default", "unused_eval_first"]
TIMEOUT = 480


def world2_rank() -> dict:
    return {"pp2": {n: dropin.run(n, pp=2) for n in NAMES},
            "pp1_dp2": {n: dropin.run(n, pp=1, dp=2) for n in CNN_MODES},
            "deepspeed": {n: dropin.run(n, pp=2, deepspeed_engine=True) for n in DEEPSPEED_WORKS}}


def world4_rank() -> dict:
    return {"pp4": {n: dropin.run(n, pp=4) for n in NAMES},
            "pp2_dp2": {n: dropin.run(n, pp=2, dp=2) for n in DP_NAMES}}


@pytest.fixture(scope="module")
def world2() -> dict:
    return _by_run(run_distributed(world2_rank, 2, timeout=TIMEOUT))


@pytest.fixture(scope="module")
def world4() -> dict:
    return _by_run(run_distributed(world4_rank, 4, timeout=TIMEOUT))


def _by_run(ranks: list) -> dict:
    """{run: {program: [rank results]}}"""
    return {run: {n: [r[run][n] for r in ranks] for n in ranks[0][run]} for run in ranks[0]}


@pytest.mark.parametrize("name", NAMES)
def test_pp2_undeclared_matches_single_process(world2, name):
    dropin.assert_matches(world2["pp2"][name], name)


@pytest.mark.parametrize("name", NAMES)
def test_pp4_undeclared_matches_single_process(world4, name):
    dropin.assert_matches(world4["pp4"][name], name)


@pytest.mark.parametrize("name", CNN_MODES)
def test_pp1_in_place_cnn_every_checkpoint_mode(world2, name):
    dropin.assert_matches(world2["pp1_dp2"][name], name, dp=2)


@pytest.mark.parametrize("name", DP_NAMES)
def test_pp2_dp2_zero1_replicas_infer_alike(world4, name):
    results = world4["pp2_dp2"][name]
    dropin.assert_matches(results, name, dp=2)
    lines = [line for r in results for line in r["logs"] if "inferred the layout" in line]
    assert len(lines) == 1, lines  # one line for the one sending stage, not one per replica


@pytest.mark.parametrize("name", DEEPSPEED_WORKS)
def test_same_losses_as_deepspeeds_engine(world2, name):
    dropin.assert_matches(world2["deepspeed"][name], name)  # DeepSpeed's engine is right on these...
    for ours, theirs in zip(world2["pp2"][name], world2["deepspeed"][name]):  # ...and so are we, alike
        for a, b in zip(ours["losses"], theirs["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (ours["losses"], theirs["losses"])


def test_each_boundary_logs_its_own_layout_once(world4):
    """pp=4 'mixed': stages 0-2 each log the layout they send, with the declaration to paste; stage 3 sends
    nothing. The received flags are the sender's requires_grad (DeepSpeed's dtype guess would give the fp16
    no-grad tensor a gradient)."""
    results = world4["pp4"]["mixed"]
    for r in results:
        lines = [line for line in r["logs"] if "inferred the layout" in line]
        assert len(lines) == (r["stage"] < 3), lines
    stage0 = next(r for r in results if r["stage"] == 0)["logs"]
    assert "model._input_grad = [True, True, False, False, False, False]; model._input_type = ['float', 'float', " \
           "'int', 'int', 'bool', 'float']" in stage0[0]
    want = ((torch.float32, True), (torch.bfloat16, True), (torch.int64, False), (torch.int32, False),
            (torch.bool, False), (torch.float16, False))
    received = [ev for r in results if r["stage"] > 0 for ev in r["events"]]
    assert received and all(ev == want for ev in received)


def test_eval_before_training_then_train(world2, world4):
    """'unused_eval_first': eval_batch runs before any training hop (no requires_grad to infer from), returns the
    initial loss, and training then infers the gradient layout: the float mask gets none, the gradient that is
    never produced travels back as zeros with one line saying how to skip it."""
    ref_losses, _ = dropin.reference("unused_eval_first")
    for results in (world2["pp2"]["unused_eval_first"], world4["pp4"]["unused_eval_first"]):
        for r in results:
            assert abs(r["eval_loss"] - ref_losses[0]) <= 1e-5 * ref_losses[0]
        received = [ev for r in results if r["stage"] > 0 for ev in r["events"]]
        assert received and all(ev == (False, True) for ev in received)  # (fmask, e).requires_grad
        assert any("got no gradient here; zeros are sent back" in line for r in results for line in r["logs"])
