"""User-facing configuration: re-exported API, partition methods, and errors that name the problem."""
from __future__ import annotations

import pytest
import torch

from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tests.tds import common, harness


def test_reexports_deepspeed_api():
    import deepspeed

    import tds
    for name in ("initialize", "init_distributed", "add_config_arguments", "checkpointing", "DeepSpeedEngine",
                 "__version__", "__git_hash__"):
        assert hasattr(tds, name), name
    assert tds.utils.RepeatingLoader is deepspeed.utils.RepeatingLoader
    assert tds.pipe.LayerSpec is deepspeed.pipe.LayerSpec and tds.pipe.TiedLayerSpec is deepspeed.pipe.TiedLayerSpec
    assert issubclass(tds.pipe.PipelineModule, deepspeed.pipe.PipelineModule)
    assert issubclass(tds.pipe.PipelineEngine, deepspeed.DeepSpeedEngine)


def error_rank(case: str) -> str:
    try:
        if case == "zero2":
            harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, gas=2, zero=2)
        elif case == "bad_parts":
            harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, gas=2,
                          partition_method=[0, 9, 8])
        elif case == "grad_on_int":
            harness.build(common.stack_specs(), ([True], ["int64"], [False]), pp=2, gas=2)
        elif case == "invariant_bf16":
            harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, gas=2,
                          pipeline={"layout_invariant": True}, extra_cfg={"bf16": {"enabled": True}})
        elif case == "invariant_zb_h1":
            harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, gas=2, zero=0,
                          pipeline={"layout_invariant": True, "schedule": "zb-h1"})
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "no error"


ERRORS = {"zero2": r"zero_optimization.stage=2 is not supported with pipeline parallelism",
          "bad_parts": r"3 non-decreasing layer boundaries from 0 to 8.*got \[0, 9, 8\]",
          "grad_on_int": r"_input_grad\[0\]=True but _input_type\[0\]='int64' cannot carry a gradient",
          "invariant_bf16": r"pipeline.layout_invariant runs in fp32 \(the fp16 and bf16 optimizers .*got fp16=False, "
                            r"bf16=True$",
          "invariant_zb_h1": r"pipeline.layout_invariant needs each micro-batch's gradients complete .* use the 1f1b"}


def errors_rank() -> dict:
    return {case: error_rank(case) for case in ERRORS}


def test_errors_name_the_problem():
    import re
    for messages in run_distributed(errors_rank, 2, timeout=90):
        for case, pattern in ERRORS.items():
            assert re.search(pattern, messages[case]), (case, messages[case])


def parts_rank() -> list:
    """Stage boundaries for an explicit list and for 'type:' over [lambda, 8 x SeededLinear, lambda]."""
    specs = [lambda x: x] + common.stack_specs() + [lambda x: x]
    out = []
    for method, layer_specs in (([0, 3, 8], common.stack_specs()), ("type:seededlinear", specs)):
        engine = harness.build(layer_specs, ([True], ["float"], [False]), pp=2, gas=2, partition_method=method)
        out.append(engine.module.parts)
    return out


def test_partition_list_and_type_regex_ignore_lambdas():
    explicit, by_type = run_distributed(parts_rank, 2, timeout=90)[0]
    assert explicit == [0, 3, 8]
    assert by_type == [0, 5, 10]  # 4 matching layers per stage; the lambdas weigh nothing


def mixed_precision_rank(dtype: str) -> list:
    cfg = {"fp16": {"enabled": True, "initial_scale_power": 8}} if dtype == "fp16" else {"bf16": {"enabled": True}}
    specs = [s for s in common.stack_specs()]
    with allow_cpu_fp16():  # fp16 on every CPU (tests/cpu_fp16.py)
        engine = harness.build(specs, ([True], ["float"], [False]), pp=2, gas=2, opt="adam", extra_cfg=cfg)
    X, Y = common.make_data(8, 4)
    it = common.rank_iterator(X.to(torch.float16 if dtype == "fp16" else torch.bfloat16), Y, 0, 1, 2, 2)
    return [engine.train_batch(it).item() for _ in range(8)]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32_reference(dtype):
    """bf16 (BF16_Optimizer + ZeRO-1) and fp16 (dynamic loss scale) train and stay near the fp32 losses."""
    losses = run_distributed(mixed_precision_rank, 2, dtype, timeout=120)
    X, Y = common.make_data(8, 4)
    ref, _ = common.reference_train(X, Y, 8)
    assert losses[0] == losses[1]
    assert len(losses[0]) == len(ref) == 8
    for got, want in zip(losses[0], ref):
        assert abs(got - want) < 0.05 * abs(want) + 0.02, (dtype, losses[0], ref)


OVERFLOW_STEPS, SCALE_POWER = 8, 20


def fp16_overflow_rank() -> dict:
    """fp16 from a loss scale of 2^20 (no hysteresis) on one repeated batch: the first gradients overflow."""
    cfg = {"fp16": {"enabled": True, "initial_scale_power": SCALE_POWER, "hysteresis": 1}}
    with allow_cpu_fp16():
        engine = harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, gas=2, opt="adam",
                               extra_cfg=cfg)
    X, Y = common.make_data(1, 4)
    X, Y = X.expand(OVERFLOW_STEPS, -1, -1), Y.expand(OVERFLOW_STEPS, -1, -1)
    it = common.rank_iterator(X.half(), Y, 0, 1, 2, 2)
    losses = [engine.train_batch(it).item() for _ in range(OVERFLOW_STEPS)]
    return {"losses": losses, "skipped": engine.skipped_steps, "scale": float(engine.optimizer.loss_scale)}


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    """Dynamic loss scaling through the TDS engine: each step whose fp16 gradients overflow is skipped on
    every stage (weights and Adam state untouched: the losses repeat) and halves the scale; from the first
    finite step on, training follows the fp32 reference started at that step within 4u = 2^-9 relative
    (u = 2^-11, fp16's unit roundoff; 3 steps skipped and 1.3u seen)."""
    per_rank = run_distributed(fp16_overflow_rank, 2, timeout=120)
    assert per_rank[0] == per_rank[1]
    losses, skipped = per_rank[0]["losses"], per_rank[0]["skipped"]
    assert 1 <= skipped < OVERFLOW_STEPS - 2, per_rank[0]
    assert per_rank[0]["scale"] == 2.0 ** (SCALE_POWER - skipped)
    assert len(set(losses[:skipped + 1])) == 1, f"a skipped step changed the weights: {losses}"
    X, Y = common.make_data(1, 4)
    ref, _ = common.reference_train(X.expand(OVERFLOW_STEPS, -1, -1), Y.expand(OVERFLOW_STEPS, -1, -1),
                                    OVERFLOW_STEPS - skipped)
    assert len(losses[skipped:]) == len(ref)
    for got, want in zip(losses[skipped:], ref):
        assert abs(got - want) <= 2.0 ** -9 * abs(want), (skipped, losses, ref)
