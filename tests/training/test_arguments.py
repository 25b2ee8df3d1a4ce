"""Argument resolution: derived values and one-line errors naming the conflicting values."""
import json

import pytest

from megatron.arguments import parse_args
from megatron.ds_config import ConfigConflictError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10"]


def parse(*extra, world_size=8, base=BASE):
    return parse_args(list(base) + list(extra), world_size=world_size)


def test_derived_values():
    args = parse("--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2", "--global-batch-size", "16",
                 "--lr-warmup-fraction", "0.2")
    assert (args.data_parallel_size, args.gas, args.global_batch_size) == (2, 4, 16)
    assert (args.kv_channels, args.ffn_hidden_size, args.max_position_embeddings) == (16, 256, 32)
    assert (args.lr_decay_iters, args.lr_warmup_iters, args.zero_stage) == (10, 2, 1)
    assert args.ds_config["train_batch_size"] == 16
    assert args.ds_config["train_micro_batch_size_per_gpu"] == 2
    assert args.ds_config["gradient_accumulation_steps"] == 4
    assert args.ds_config["zero_optimization"]["stage"] == 1


def test_gas_gives_global_batch_and_aliases():
    args = parse("--model-parallel-size", "4", "--gas", "3", "--ff-hidden-size", "96", "--kv-hidden-size", "8")
    assert (args.tensor_model_parallel_size, args.data_parallel_size) == (4, 2)
    assert args.global_batch_size == 2 * 3 * 2
    assert (args.ffn_hidden_size, args.kv_channels) == (96, 8)


def test_pipe_parallel_zero_means_no_pipeline():
    assert parse("--pipe-parallel-size", "0").pipe_parallel_size == 1


@pytest.mark.parametrize("extra, world, words", [
    (["--tensor-model-parallel-size", "3"], 8, ["world size 8", "3"]),
    (["--tensor-model-parallel-size", "8"], 8, ["--num-attention-heads 4", "8"]),
    (["--global-batch-size", "10"], 8, ["--global-batch-size 10", "16"]),
    (["--global-batch-size", "32", "--gas", "3"], 8, ["--global-batch-size 32", "--gas 3"]),
    (["--fp16", "--bf16"], 8, ["--fp16 and --bf16"]),
    (["--max-position-embeddings", "16"], 8, ["--seq-length 32", "16"]),
    (["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"], 8, ["--lr-warmup-iters 2", "0.1"]),
    (["--zero-stage", "2"], 8, ["--zero-stage 2"]),
    (["--save-interval", "5"], 8, ["--save-interval 5", "--save"]),
    (["--min-lr", "1", "--lr", "0.1"], 8, ["--min-lr 1.0", "0.1"]),
    (["--data-path", "0.5", "a", "b"], 8, ["WEIGHT PREFIX", "3"]),
    (["--initial-loss-scale", "1000", "--fp16"], 8, ["power of two", "1000"]),
])
def test_validation_errors_name_values(extra, world, words):
    with pytest.raises(ValueError) as err:
        parse(*extra, world_size=world)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_missing_required():
    with pytest.raises(ValueError, match="--hidden-size is required"):
        parse_args(["--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "8",
                    "--micro-batch-size", "1", "--train-iters", "1"], world_size=1)


def _write(tmp_path, cfg):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_json_fills_unset_and_cli_reaches_config(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "train_batch_size": 32, "gradient_clipping": 0.5,
                             "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 50}})
    i = BASE.index("--micro-batch-size")
    base = BASE[:i] + BASE[i + 2:]
    args = parse("--deepspeed_config", path, "--zero-stage", "1", base=base)
    assert (args.micro_batch_size, args.global_batch_size, args.gas) == (2, 32, 2)
    assert args.fp16 and args.initial_loss_scale == 256 and args.loss_scale_window == 50
    cfg = args.ds_config
    assert cfg["zero_optimization"]["stage"] == 1  # absent from the file, given on the command line
    assert cfg["gradient_clipping"] == 0.5
    assert cfg["fp16"]["enabled"] and cfg["fp16"]["initial_scale_power"] == 8 and cfg["fp16"]["loss_scale"] == 0


@pytest.mark.parametrize("cfg, extra, words", [
    ({"zero_optimization": {"stage": 0}}, ["--zero-stage", "1"], ["--zero-stage 1", "zero_optimization.stage = 0"]),
    ({"train_micro_batch_size_per_gpu": 4}, [], ["--micro-batch-size 2", "train_micro_batch_size_per_gpu = 4"]),
    ({"fp16": {"enabled": False}}, ["--fp16"], ["--fp16 True", "fp16.enabled = False"]),
    ({"gradient_clipping": 1.0}, ["--clip-grad", "0.3"], ["--clip-grad 0.3", "gradient_clipping = 1.0"]),
    ({"train_batch_size": 64}, ["--global-batch-size", "32"], ["--global-batch-size 32", "train_batch_size = 64"]),
])
def test_config_conflicts_name_both_values(tmp_path, cfg, extra, words):
    path = _write(tmp_path, cfg)
    with pytest.raises(ConfigConflictError) as err:
        parse("--deepspeed_config", path, *extra)
    for word in words:
        assert word in str(err.value), str(err.value)
    assert path in str(err.value)


def test_config_optimizer_section_rejected(tmp_path):
    path = _write(tmp_path, {"optimizer": {"type": "Adam"}})
    with pytest.raises(ConfigConflictError, match="optimizer"):
        parse("--deepspeed_config", path)


def test_shipped_configs_resolve():
    for name in ("examples/ds_config_gpt2.json", "examples/ds_config_t5.json"):
        args = parse("--deepspeed_config", name, "--global-batch-size", "16", world_size=8)
        assert args.ds_config["zero_optimization"]["stage"] == 1
