"""The same checks run against DeepSpeed 0.19.8's own PipelineEngine (CPU, gloo), expected to fail.

Each test documents one difference listed in /work/shared/reference/deepspeed_pipe.md; `strict=True`
makes the suite notice if a DeepSpeed upgrade fixes it. Each case names the failure it expects: the class
(`raises=`: what DeepSpeed raised on the first failing rank, or a rank that crashed, e.g. one that left
because its training hung) and a pattern of its report (`failing_with`). Any other failure (a harness
error, another exception or message, a timeout) is raised as `Unexpected` or keeps its own class, which
no case accepts, so it fails the suite."""
from __future__ import annotations

import contextlib
import os
import re

import pytest

from harness.dist import RankCrashed, rank_raised, run_distributed
from tests.tds import harness
from tests.tds import test_engine_shapes as shapes
from tests.tds import test_engine_tuples as tuples

pytestmark = pytest.mark.xfail_deepspeed
HANG_TIMEOUT = 60


class Unexpected(Exception):
    """A failure other than the one the case expects (never counted as DeepSpeed's)."""


@contextlib.contextmanager
def failing_with(pattern: str):
    """Let through only an error whose report (message and rank tracebacks) matches `pattern`."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - classified here
        if not re.search(pattern, str(err)):
            raise Unexpected(f"expected a failure matching {pattern!r}, got {type(err).__name__}: {err}") from err
        raise


def ds_tuple_rank(kind: str, tp: int) -> dict:
    engine = harness.build_deepspeed(tuples.specs_of(*tuples.KINDS[kind]), pp=2, gas=tuples.GAS,
                                     mbs=tuples.MBS, tp=tp)
    losses = harness.train(engine, tuples.batches())
    return {"losses": losses, "params": harness.engine_params(engine)}


def ds_check_tuples(kind: str, tp: int = 1) -> None:
    results = run_distributed(ds_tuple_rank, 2 * tp, kind, tp, timeout=HANG_TIMEOUT)
    ref_losses, ref_params = harness.reference(tuples.specs_of(*tuples.KINDS[kind]), tuples.batches(),
                                               tuples.GAS)
    harness.assert_close(results, ref_losses, ref_params)


@pytest.mark.xfail(strict=True, raises=rank_raised("RuntimeError"),
                   reason="DeepSpeed sets requires_grad on every received float tensor and needs a gradient for "
                          "each (checklist 1, 2): the fp16 no-grad tensor")
def test_deepspeed_point1_mixed_dtypes():
    with failing_with("element 0 of tensors does not require grad"):
        ds_check_tuples("mixed")


@pytest.mark.xfail(strict=True, raises=rank_raised("AssertionError"),
                   reason="a float tensor without grad becomes requires_grad and a None gradient trips "
                          "'buffer.grad is not None' (checklist 1, 2)")
def test_deepspeed_point2_none_grad_and_float_mask():
    with failing_with(r"assert buffer\.grad is not None"):
        ds_check_tuples("unused")


@pytest.mark.xfail(strict=True, raises=rank_raised("AssertionError"),
                   reason="with TP>1 DeepSpeed partitions only outputs[0] and asserts every other tuple element "
                          "has requires_grad=False (checklist 3, 13)")
def test_deepspeed_point3_two_grad_tensors_partitioned():
    with failing_with(r"elt\.requires_grad is False for elt in outputs\[1:\]"):
        ds_check_tuples("two", tp=2)


@pytest.mark.xfail(strict=True, raises=rank_raised("RuntimeError"),
                   reason="gloo refuses non-contiguous sends (checklist 8)")
def test_deepspeed_point6_non_contiguous():
    with failing_with("input tensor has to be contiguous"):
        ds_check_tuples("noncontig")


def ds_shapes_rank() -> dict:
    engine = harness.build_deepspeed(shapes.specs(), pp=2, gas=shapes.GAS, mbs=2)
    engine.set_has_attention_mask(True)  # DeepSpeed's bool switch: casts the last tuple element to half
    losses = harness.train(engine, shapes.batches())
    return {"losses": losses, "params": harness.engine_params(engine)}


@pytest.mark.xfail(strict=True, raises=RankCrashed,
                   reason="shapes are fixed at the first micro-batch unless dynamic_shape is set (checklist 6): "
                          "the receiver's buffer is too small and gloo aborts the process")
def test_deepspeed_point4_changing_shapes():
    with failing_with(r"exited with code -6 without reporting"):
        results = run_distributed(ds_shapes_rank, 2, timeout=HANG_TIMEOUT)
    ref_losses, ref_params = harness.reference(shapes.specs(), shapes.batches(), shapes.GAS)
    harness.assert_close(results, ref_losses, ref_params)


def ds_plain_rank() -> dict:
    from tests.tds import common
    engine = harness.build_deepspeed(common.stack_specs(), pp=2, gas=tuples.GAS, mbs=tuples.MBS)
    losses = harness.train(engine, plain_batches())
    return {"losses": losses, "params": harness.engine_params(engine)}


def plain_batches():
    from tests.tds import common
    X, Y = common.make_data(2, tuples.GAS * tuples.MBS)
    return [[(X[t, i * tuples.MBS:(i + 1) * tuples.MBS], Y[t, i * tuples.MBS:(i + 1) * tuples.MBS])
             for i in range(tuples.GAS)] for t in range(2)]


def test_deepspeed_control_single_float_tensor_passes():
    """Control: the DeepSpeed runner itself is sound; a plain one-tensor stack matches the reference."""
    from tests.tds import common
    results = run_distributed(ds_plain_rank, 2, timeout=HANG_TIMEOUT)
    ref_losses, ref_params = harness.reference(common.stack_specs(), plain_batches(), tuples.GAS)
    harness.assert_close(results, ref_losses, ref_params)


HANG_AFTER_S, HANG_EXIT = 10.0, 75


def _hang_detected(progress_dir: str, rank: int) -> None:
    open(os.path.join(progress_dir, f"hung_rank{rank}"), "w").close()
    os._exit(HANG_EXIT)  # the main thread is blocked inside a collective: leave from here


def ds_tied_rank(progress_dir: str) -> dict:
    """Training that has not finished HANG_AFTER_S seconds after it started (the engine built: start-up time
    does not count) is a hang: the rank leaves a file saying so and exits with HANG_EXIT."""
    import threading

    import torch.distributed as dist

    from tests.tds import test_engine_tied as tied
    engine = harness.build_deepspeed(tied.specs(), pp=2, gas=tied.GAS, mbs=tied.MBS)
    watchdog = threading.Timer(HANG_AFTER_S, _hang_detected, (progress_dir, dist.get_rank()))
    watchdog.start()
    try:
        losses = harness.train(engine, tied.batches())
    finally:
        watchdog.cancel()
    return {"losses": losses, "params": harness.engine_params(engine)}


@pytest.mark.slow  # a 10 s hang watchdog
@pytest.mark.xfail(strict=True, raises=RankCrashed,
                   reason="DeepSpeed skips the tied all-reduce where a tied gradient is None (the head does not "
                          "use the tied bias), so the stages' collectives no longer pair up: training hangs, "
                          "cut short here 10 s after it started (checklist 11)")
def test_deepspeed_point9_tied_weight_with_none_grad(tmp_path):
    from tests.tds import test_engine_tied as tied
    with failing_with(f"exited with code {HANG_EXIT} without reporting"):
        try:
            results = run_distributed(ds_tied_rank, 2, str(tmp_path), timeout=HANG_TIMEOUT)
        except RankCrashed:
            if not any(p.name.startswith("hung_rank") for p in tmp_path.iterdir()):
                raise Unexpected("a rank crashed, but not by hanging in training")
            raise
    ref_losses, ref_params = harness.reference(tied.specs(), tied.batches(), tied.GAS)
    harness.assert_close(results, ref_losses, ref_params)
