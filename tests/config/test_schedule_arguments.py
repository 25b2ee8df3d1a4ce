"""Issue 12's command line: --pipeline-schedule, --virtual-pipe-stages (or Megatron's
--num-layers-per-virtual-pipeline-stage), --pipeline-timeline [--pipeline-timeline-batches]: resolved once,
written into the DeepSpeed config, never silently different from the JSON, mistakes as one-line UserErrors."""
import json

import pytest

from megatron.config.arguments import parse_args
from megatron.errors import UserError

BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--train-iters", "6", "--lr", "1e-3"]


def resolve(extra, world_size=2, defaults=None):
    return parse_args(BASE + list(extra), world_size=world_size, defaults=defaults or {"model_type": "gpt"})


def pipeline(args) -> dict:
    return {k: v for k, v in args.ds_config["pipeline"].items() if k not in ("timeout_s", "recovery_script", "check_finite")}


def test_defaults_and_what_deepspeed_receives(tmp_path):
    assert pipeline(resolve([], 1)) == {"schedule": "1f1b", "virtual_stages": 1}
    args = resolve(["--pipe-parallel-size", "2", "--gas", "4", "--virtual-pipe-stages", "2"])
    assert (args.pipeline_schedule, args.virtual_pipe_stages) == ("interleaved", 2)
    assert pipeline(args) == {"schedule": "interleaved", "virtual_stages": 2}
    args = resolve(["--pipe-parallel-size", "2", "--gas", "4", "--num-layers-per-virtual-pipeline-stage", "1"])
    assert args.virtual_pipe_stages == 2  # Megatron's flag: 4 layers / (pp 2 x 1 layer per chunk)
    trace = str(tmp_path / "t.json")
    args = resolve(["--pipe-parallel-size", "2", "--pipeline-schedule", "ZB-H1", "--pipeline-timeline", trace])
    assert pipeline(args) == {"schedule": "zb-h1", "virtual_stages": 1, "timeline": trace, "timeline_batches": [3, 4]}
    args = resolve(["--pipe-parallel-size", "2", "--gas", "2", "--virtual-pipe-stages", "2",
                    "--partition-method", "0,2,3,4,7"])  # pp x v + 1 boundaries
    assert args.partition_method == [0, 2, 3, 4, 7]


def test_json_and_flags_agree_or_fail(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"pipeline": {"schedule": "interleaved", "virtual_stages": 2}}))
    args = resolve(["--deepspeed_config", str(cfg), "--pipe-parallel-size", "2", "--gas", "2"])
    assert (args.pipeline_schedule, args.virtual_pipe_stages) == ("interleaved", 2)
    with pytest.raises(UserError, match=r"--virtual-pipe-stages 4 conflicts with pipeline.virtual_stages = 2 in"):
        resolve(["--deepspeed_config", str(cfg), "--pipe-parallel-size", "2", "--virtual-pipe-stages", "4"])
    with pytest.raises(UserError, match=r"--pipeline-schedule zb-h1 conflicts with pipeline.schedule = interleaved"):
        resolve(["--deepspeed_config", str(cfg), "--pipe-parallel-size", "2", "--pipeline-schedule", "zb-h1"])
    cfg.write_text(json.dumps({"pipeline": {"schedule": "zero-bubble"}}))
    with pytest.raises(UserError, match=r"pipeline schedule 'zero-bubble' is not one of 1f1b, gpipe, interleaved"):
        resolve(["--deepspeed_config", str(cfg), "--pipe-parallel-size", "2"])


@pytest.mark.parametrize("extra,world,needle", [
    (["--pipeline-schedule", "zb-h1"], 1, r"--pipeline-schedule zb-h1 needs --pipe-parallel-size >= 2"),
    (["--pipe-parallel-size", "2", "--pipeline-schedule", "zb-h1", "--virtual-pipe-stages", "2"], 2,
     r"--virtual-pipe-stages 2 needs --pipeline-schedule interleaved, got zb-h1"),
    (["--pipe-parallel-size", "2", "--pipeline-schedule", "interleaved"], 2,
     r"--pipeline-schedule interleaved needs --virtual-pipe-stages >= 2 \(model chunks per stage\), got None"),
    (["--pipe-parallel-size", "2", "--virtual-pipe-stages", "2", "--gas", "3"], 2,
     r"--gas 3 \(global batch 6 / \(micro batch 2 x data-parallel size 1\)\) must be a multiple of 2"),
    (["--pipe-parallel-size", "2", "--virtual-pipe-stages", "4", "--gas", "2"], 2,
     r"= 8 chunks, but the model has 4 transformer layers; every chunk needs one"),
    (["--pipe-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     r"--num-layers-per-virtual-pipeline-stage 3 x --pipe-parallel-size 2 does not divide the 4 transformer"),
    (["--pipe-parallel-size", "2", "--virtual-pipe-stages", "2", "--gas", "2", "--partition-method", "0,3,7"], 2,
     r"gives 3 boundaries but --pipe-parallel-size 2 x --virtual-pipe-stages 2 needs 5"),
    (["--pipeline-timeline-batches", "3"], 1, r"--pipeline-timeline-batches needs --pipeline-timeline OUT.json"),
    (["--pipeline-timeline", "t.json"], 1, r"--pipeline-timeline t.json needs --pipe-parallel-size >= 2"),
    (["--pipe-parallel-size", "2", "--pipeline-timeline", "/no/such/dir/t.json"], 2,
     r"folder /no/such/dir does not exist"),
    (["--pipe-parallel-size", "2", "--pipeline-timeline", "t.json", "--pipeline-timeline-batches", "0", "7"], 2,
     r"--pipeline-timeline-batches 0 7: iterations must be between 1 and --train-iters 6"),
])
def test_mistakes_are_one_line(extra, world, needle):
    with pytest.raises(UserError, match=needle):
        resolve(extra, world)


def test_interleaved_batch_ramp_up_keeps_gas_a_multiple_of_pp():
    """Every ramp-up step's gas must be a multiple of pp: START and INCREMENT multiples of micro x dp x pp."""
    base = BASE[:BASE.index("--train-iters")] + ["--lr", "1e-3", "--train-samples", "200", "--global-batch-size",
                                                 "16", "--pipe-parallel-size", "2", "--virtual-pipe-stages", "2"]
    ramp = lambda start, inc: parse_args(base + ["--rampup-batch-size", str(start), str(inc), "64"],  # noqa: E731
                                         world_size=2, defaults={"model_type": "gpt"})
    assert ramp(8, 4).virtual_pipe_stages == 2
    with pytest.raises(UserError, match=r"START and INCREMENT must be multiples of micro batch x data-parallel size "
                                        r"x pp = 4"):
        ramp(6, 2)
