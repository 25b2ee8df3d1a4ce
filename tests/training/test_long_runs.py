"""Long runs: a time limit saves and exits, a non-finite loss or gradient stops the run before the optimizer
step and names where it appeared, fp16 skips such steps and stops after --max-skipped-steps in a row.
(Signals through the example script: test_example_script.py; SLURM: tests/slurm.)"""
import re

import pytest

from megatron.checkpointing import read_latest
from pretrain_gpt2 import DEFAULTS as GPT_DEFAULTS, SPEC as GPT_SPEC
from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tests.training.runner import small_argv, train_state


def _time_limited_rank(argv, world_size):
    state = train_state(argv, world_size, GPT_SPEC, GPT_DEFAULTS)
    return state.iteration, state.saved_iteration, len(state.losses)


def test_exit_duration_saves_and_stops(gpt_data, tmp_path):
    save = str(tmp_path / "ckpt")
    argv = small_argv(gpt_data, pp=2, train_iters=50,
                      extra=["--save", save, "--exit-duration-in-mins", "0.0001", "--hidden-dropout", "0.1"])
    results = run_distributed(_time_limited_rank, 2, argv, 2, timeout=300)
    assert len(set(results)) == 1, results  # every rank stopped at the same iteration
    iteration, saved, trained = results[0]
    assert iteration == saved == trained == 1  # the limit had passed after the first iteration
    assert read_latest(save) == "iter_0000001"


def _inject_nan(stage: int, data_rank: int, at_iteration: int, every_later: bool = False):
    """Make the transformer layers of pipeline stage `stage`, data-parallel rank `data_rank` output NaN from
    iteration `at_iteration` (only then unless `every_later`); count the optimizer steps taken."""
    from megatron import mpu
    from megatron.model.gpt2_pipe import GPT2TransformerLayerPipe
    from megatron.training import loop
    from tds.pipe.engine import PipelineEngine
    now, steps = {"iteration": 0}, {"taken": 0}
    start, forward, take_step = loop.start_iteration, GPT2TransformerLayerPipe.forward, PipelineEngine._take_model_step

    def start_iteration(module, iteration, replica=(0, 1)):
        now["iteration"] = iteration + 1
        return start(module, iteration, replica)

    def poisoned(self, inputs):
        out = forward(self, inputs)  # the hidden state, with the mask only under --reset-attention-mask
        hit = now["iteration"] >= at_iteration if every_later else now["iteration"] == at_iteration
        if hit and mpu.get_pipeline_model_parallel_rank() == stage and mpu.get_data_parallel_rank() == data_rank:
            return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")
        return out

    def counted_step(self, *args, **kwargs):
        steps["taken"] += 1
        return take_step(self, *args, **kwargs)

    loop.start_iteration, GPT2TransformerLayerPipe.forward = start_iteration, poisoned
    PipelineEngine._take_model_step = counted_step
    return steps


def _nan_rank(argv, world_size, at_iteration):
    import torch.distributed as dist
    steps = _inject_nan(stage=0, data_rank=1, at_iteration=at_iteration)
    try:
        train_state(argv, world_size, GPT_SPEC, GPT_DEFAULTS)
    except Exception as err:  # noqa: BLE001 - the test inspects what every rank raised
        return type(err).__name__, str(err), steps["taken"], dist.get_rank()
    return None


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nan_stops_before_the_step_and_names_the_stage(gpt_data, tmp_path, precision):
    save = str(tmp_path / "ckpt")
    # bf16 with --async-save: the stop waits for the save of iteration 2, then `latest` names it
    extra = ["--save", save, "--save-interval", "2"] + (["--bf16", "--async-save"] if precision == "bf16" else [])
    argv = small_argv(gpt_data, pp=2, train_iters=8, extra=extra)  # (1, 2, 2): dp rank 1 of stage 0 is rank 1
    results = run_distributed(_nan_rank, 4, argv, 4, 3, timeout=300)
    for name, message, taken, rank in results:
        assert name == "TrainingStopped", (rank, message)
        assert taken == 2, (rank, taken)  # iterations 1 and 2 stepped, 3 did not
        assert message.startswith("iteration 3: a loss or an activation is NaN or infinite, first at pipeline "
                                  "stage 0 (global rank 1;"), message
        assert "the optimizer step was not taken" in message and f"{save}/iter_0000002 (iteration 2)" in message
        assert "\n" not in message
    assert read_latest(save) == "iter_0000002"


def _fp16_rank(argv, world_size):
    steps = _inject_nan(stage=1, data_rank=0, at_iteration=3, every_later=True)
    with allow_cpu_fp16():
        try:
            train_state(argv, world_size, GPT_SPEC, GPT_DEFAULTS)
        except Exception as err:  # noqa: BLE001
            return type(err).__name__, str(err), steps["taken"]
    return None


def test_fp16_skips_non_finite_steps_then_stops_after_max_skipped(gpt_data):
    argv = small_argv(gpt_data, pp=2, train_iters=10, extra=["--fp16", "--max-skipped-steps", "3",
                                                                      "--initial-loss-scale", "128"])
    for name, message, taken in run_distributed(_fp16_rank, 2, argv, 2, timeout=300):
        assert name == "TrainingStopped", message
        # iterations 3, 4, 5 were skipped by the loss scaler (the engine's check is off in fp16), then it stopped
        assert re.match(r"iteration 5: 3 consecutive steps skipped for fp16 overflow \(loss scale \S+; "
                        r"--max-skipped-steps 3\); the last checkpoint is none", message), message
        assert taken == 5  # DeepSpeed's _take_model_step ran (and skipped inside) for every iteration


def test_the_engine_check_follows_the_flag_and_is_off_in_fp16(gpt_data):
    from megatron.config.arguments import parse_args

    def check_finite(*extra):
        argv = small_argv(gpt_data, pp=2, train_iters=4, extra=list(extra))
        return parse_args(argv, defaults=GPT_DEFAULTS, world_size=2).ds_config["pipeline"]["check_finite"]
    assert check_finite() is True and check_finite("--bf16") is True
    assert check_finite("--no-check-for-nan-in-loss-and-grad") is False
    assert check_finite("--fp16") is False  # the loss scaler skips such steps instead
