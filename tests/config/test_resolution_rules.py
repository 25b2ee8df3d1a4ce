"""ZeRO stage rules (stage 1 at dp=1 runs as stage 0; fp16 with stage 0 is refused) and explicit partitions."""
import pytest

from megatron.config.arguments import parse_args

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"]


def _resolve(extra, world_size):
    return parse_args(BASE + extra, world_size=world_size)


@pytest.mark.parametrize("world_size,fp16,expected", [(1, False, 0), (2, False, 1), (1, True, 1)])
def test_stage_deepspeed_receives(world_size, fp16, expected):
    args = _resolve(["--zero-stage", "1"] + (["--fp16"] if fp16 else []), world_size)
    assert args.zero_stage == 1
    assert args.ds_config["zero_optimization"]["stage"] == expected


def test_fp16_with_stage_0_refused():
    with pytest.raises(ValueError, match=r"--fp16 with --zero-stage 0 is refused"):
        _resolve(["--zero-stage", "0", "--fp16"], 2)


def test_explicit_partition_boundaries():
    args = _resolve(["--pipe-parallel-size", "2", "--partition-method", "0,3,5"], 2)  # GPT, 2 layers: 5 specs
    assert args.partition_method == [0, 3, 5]
    with pytest.raises(ValueError, match=r"--partition-method 0,6 gives 2 boundaries but --pipe-parallel-size 4 needs 5"):
        _resolve(["--pipe-parallel-size", "4", "--partition-method", "0,6"], 4)
    assert _resolve(["--partition-method", "parameters"], 1).partition_method == "parameters"


def test_distributed_timeout_is_one_setting_in_flag_and_json(tmp_path):
    """--distributed-timeout-minutes (Megatron's name, default 10) and the JSON's pipeline.timeout_s (seconds)
    are one setting: either fills the other, both given and different is an error naming both."""
    import json
    assert _resolve([], 1).ds_config["pipeline"]["timeout_s"] == 600
    assert _resolve(["--distributed-timeout-minutes", "0.5"], 1).ds_config["pipeline"]["timeout_s"] == 30
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"pipeline": {"timeout_s": 90}}))
    args = _resolve(["--deepspeed_config", str(cfg)], 1)
    assert args.distributed_timeout_minutes == 1.5 and args.ds_config["pipeline"]["timeout_s"] == 90
    with pytest.raises(ValueError, match=r"--distributed-timeout-minutes 2.0 conflicts with pipeline.timeout_s = 90"):
        _resolve(["--deepspeed_config", str(cfg), "--distributed-timeout-minutes", "2"], 1)
    with pytest.raises(ValueError, match=r"--distributed-timeout-minutes must be > 0, got 0.0"):
        _resolve(["--distributed-timeout-minutes", "0"], 1)
