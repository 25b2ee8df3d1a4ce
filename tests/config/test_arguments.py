"""Argument resolution: derived values and one-line errors naming the conflicting values."""
import json

import pytest

from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.config.ds_config import ConfigConflictError
from megatron.errors import UserError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10"]


def parse(*extra, world_size=8, base=BASE):
    return parse_args(list(base) + list(extra), world_size=world_size)


def assert_one_line_error(call, words) -> None:
    """`call()` raises a UserError whose message is one line holding every one of `words`."""
    with pytest.raises(UserError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


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
    assert_one_line_error(lambda: parse(*extra, world_size=world), words)


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


# --- issue 14: one class for mistakes, sample-based training, ramp-up, T5 v1.1 options --------------------
NEW_FLAGS = ["--train-samples", "--lr-decay-samples", "--lr-warmup-samples", "--rampup-batch-size",
             "inverse-square-root", "--decoder-num-layers", "--feed-forward-proj",
             "--untie-embeddings-and-output-weights",
             "--relative-attention-num-buckets", "--relative-attention-max-distance", "--deepspeed-verbose"]


def test_new_flags_in_help():
    from megatron.config.arguments import build_parser
    text = build_parser().format_help()
    for flag in NEW_FLAGS:
        assert flag in text, flag


def _gpt(*extra, world_size=8):
    return parse_args(list(BASE) + list(extra), defaults=ENTRY_DEFAULTS["gpt"], world_size=world_size)


def _t5(*extra, world_size=8):
    return parse_args(list(BASE) + list(extra), defaults=ENTRY_DEFAULTS["t5"], world_size=world_size)


SAMPLES = ["--train-samples", "200", "--global-batch-size", "16"]


def test_sample_based_resolution():
    i = BASE.index("--train-iters")
    base = BASE[:i] + BASE[i + 2:]
    args = parse_args(base + SAMPLES + ["--lr-warmup-fraction", "0.1"], world_size=8)
    assert (args.train_iters, args.lr_schedule_unit, args.lr_decay_samples, args.lr_warmup_samples) == \
        (12, "samples", 200, 20)  # 200 // 16 iterations; decay over all samples
    args = parse_args(base + SAMPLES + ["--rampup-batch-size", "4", "4", "24", "--lr-warmup-samples", "8"],
                      world_size=2)
    assert args.train_iters == 4 + (200 - 28) // 16 and args.lr_warmup_samples == 8  # ramp 4 4 8 12, then 16
    args = parse_args(BASE, world_size=8)
    assert (args.lr_schedule_unit, args.lr_decay_iters, args.lr_warmup_iters) == ("iterations", 10, 0)


def test_t5_defaults_and_v11_flags():
    args = _t5()
    assert (args.decoder_num_layers, args.feed_forward_proj, args.untie_embeddings_and_output_weights,
            args.relative_attention_num_buckets, args.relative_attention_max_distance) == (2, "relu", False, 32, 128)
    args = _t5("--decoder-num-layers", "5", "--feed-forward-proj", "gated-gelu",
               "--untie-embeddings-and-output-weights", "--relative-attention-num-buckets", "16",
               "--relative-attention-max-distance", "64")
    assert (args.decoder_num_layers, args.feed_forward_proj, args.untie_embeddings_and_output_weights,
            args.relative_attention_num_buckets, args.relative_attention_max_distance) == \
        (5, "gated-gelu", True, 16, 64)


@pytest.mark.parametrize("kind, extra, words", [
    ("gpt", ["--train-samples", "100"], ["--train-iters 10 cannot be combined with --train-samples"]),
    ("gpt", ["--lr-decay-samples", "100"], ["--lr-decay-samples 100", "give --train-samples"]),
    ("gpt", ["--lr-warmup-samples", "10"], ["--lr-warmup-samples 10"]),
    ("gpt", ["--rampup-batch-size", "4", "4", "100"], ["--rampup-batch-size 4 4 100", "--train-samples"]),
    ("gpt", ["--decoder-num-layers", "3"], ["--decoder-num-layers: T5 options"]),
    ("t5", ["--swiglu", "--position-embedding-type", "rope"], ["--position-embedding-type, --swiglu: GPT options"]),
    ("t5", ["--qk-layernorm"], ["--qk-layernorm: GPT options; pretrain_t5.py does not take them"]),
    ("t5", ["--qk-layernorm-full", "--post-sublayer-norm"], ["--qk-layernorm-full, --post-sublayer-norm: GPT options"]),
    ("gpt", ["--qk-layernorm", "--qk-layernorm-full", "--normalization", "RMSNorm"],
     ["--qk-layernorm (a norm over each head, Qwen3's) and --qk-layernorm-full", "exclude each other"]),
    ("gpt", ["--qk-layernorm-full"], ["--qk-layernorm-full is OLMo-2's RMSNorm", "--normalization is LayerNorm"]),
    ("gpt", ["--partition-method", "0,3,4", "--pipe-parallel-size", "2"], ["rise from 0 to 5"]),
    ("gpt", ["--partition-method", "type:Conv", "--pipe-parallel-size", "2"],
     ["matches none", "GPT2TransformerLayerPipe"]),
    ("gpt", ["--partition-method", "type:(", "--pipe-parallel-size", "2"], ["not a regular expression"]),
    ("gpt", ["--partition-method", "balanced"], ["is not type:REGEX"]),
    ("t5", ["--decoder-num-layers", "0"], ["--decoder-num-layers must be >= 1"]),
    ("t5", ["--relative-attention-num-buckets", "2"], ["--relative-attention-num-buckets must be >= 4"]),
    ("t5", ["--relative-attention-max-distance", "16"], ["--relative-attention-max-distance 16", "32"]),
    ("t5", ["--feed-forward-proj", "swiglu"], ["invalid choice: 'swiglu'"]),
    ("t5", ["--lr-decay-style", "inverse-sqrt"], ["invalid choice: 'inverse-sqrt'"]),
    ("t5", ["--no-such-flag"], ["unrecognized arguments: --no-such-flag", "--help"]),
    ("t5", ["--num-layers", "x"], ["--num-layers: invalid int value: 'x'"]),
    ("gpt", ["--split", "90,x"], ["--split '90,x' must be numbers"]),
    ("gpt", ["--split", "1,1,1,1"], ["up to 3 weights"]),
    ("gpt", ["--hidden-dropout", "1.5"], ["--hidden-dropout must be in [0, 1), got 1.5"]),
    ("gpt", ["--pretrained-checkpoint", "/no/such/dir"], ["--pretrained-checkpoint /no/such/dir holds no checkpoint"]),
    ("t5", ["--mask-prob", "0"], ["--mask-prob must be in (0, 1)"]),
    ("gpt", ["--check-replicas-interval", "0"], ["--check-replicas-interval must be >= 1, got 0"]),
    ("gpt", ["--check-replicas-at-save"], ["--check-replicas-at-save needs --save DIR"]),
    ("gpt", ["--layout-invariant", "--fp16"], ["--layout-invariant runs in fp32 (the fp16 and bf16", "got --fp16"]),
    ("t5", ["--layout-invariant", "--zero-stage", "0", "--bf16"], ["got --bf16"]),
    ("gpt", ["--layout-invariant", "--zero-stage", "0", "--pipe-parallel-size", "2", "--pipeline-schedule", "zb-h1"],
     ["--pipeline-schedule zb-h1 defers the weight gradients"]),
])
def test_more_errors_are_one_line_user_errors(kind, extra, words):
    with pytest.raises(UserError) as err:
        (_gpt if kind == "gpt" else _t5)(*extra)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_layout_invariant_needs_a_power_of_two_of_replicas():
    with pytest.raises(UserError) as err:
        _gpt("--layout-invariant", "--zero-stage", "0", world_size=6)
    assert str(err.value) == ("--layout-invariant sums over the data-parallel replicas in a fixed tree, which needs "
                              "their number to be a power of two; got data-parallel size 6 (world 6 / (tp 1 x pp 1))")
    assert "layout_invariant" not in _gpt("--zero-stage", "0", world_size=6).ds_config["pipeline"]
    accepted = _gpt("--layout-invariant", "--zero-stage", "0", "--tensor-model-parallel-size", "2",
                    "--pipe-parallel-size", "2", world_size=8)  # dp 2
    assert accepted.ds_config["pipeline"]["layout_invariant"] is True


RAMP_SAMPLES = ["--train-samples", "1000"]


@pytest.mark.parametrize("extra, words", [
    (["--rampup-batch-size", "4", "4", "24", "--global-batch-size", "16", *RAMP_SAMPLES], ["multiples of", "= 16"]),
    (["--rampup-batch-size", "16", "8", "24", "--global-batch-size", "16", *RAMP_SAMPLES], ["START must be between"]),
    (["--rampup-batch-size", "8", "16", "24", "--global-batch-size", "32", *RAMP_SAMPLES],
     ["32 - START = 24", "INCREMENT 16"]),
    (["--global-batch-size", "16", "--train-samples", "8"], ["--train-samples 8 is less than one global batch (16)"]),
    (["--global-batch-size", "16", "--train-samples", "64", "--lr-warmup-samples", "100"], ["--lr-warmup-samples 100"]),
])
def test_ramp_and_sample_errors(extra, words):
    i = BASE.index("--train-iters")
    with pytest.raises(UserError) as err:
        parse_args(BASE[:i] + BASE[i + 2:] + extra, world_size=8)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_deepspeed_config_file_errors(tmp_path):
    with pytest.raises(UserError, match="cannot read it"):
        parse("--deepspeed_config", str(tmp_path / "missing.json"))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        parse("--deepspeed_config", str(broken))
    assert issubclass(ConfigConflictError, UserError)
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"zero_optimization": {"stage": 1}, "x": "\xff"}')
    with pytest.raises(UserError, match=r"binary.json: not UTF-8 text \(byte 42\)"):
        parse("--deepspeed_config", str(binary))
    typo = tmp_path / "typo.json"  # DeepSpeed itself would ignore the key, and clip at its default
    typo.write_text(json.dumps({"gradient_clippng": 0.5}))
    with pytest.raises(UserError, match=r"typo.json: unknown key 'gradient_clippng', did you mean 'gradient_clipping'"):
        parse("--deepspeed_config", str(typo))
    stage = tmp_path / "stage.json"
    stage.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(UserError) as err:
        parse("--deepspeed_config", str(stage))
    assert str(err.value).startswith("--zero-stage 3 is not supported") and \
        str(err.value).endswith(f"(set by zero_optimization.stage = 3 in {stage})"), str(err.value)


@pytest.mark.parametrize("zero, words", [
    ({"stage": 1, "reduce_buciet_size": 5}, "unknown key 'reduce_buciet_size' in zero_optimization, did you mean "
                                            "'reduce_bucket_size'?"),
    ({"s|age": 1}, "unknown key 's|age' in zero_optimization, did you mean 'stage'?"),
    ({"stage": 1, "my_setting": 2}, "unknown key 'my_setting' in zero_optimization (DeepSpeed refuses keys"),
    (1, "zero_optimization is a JSON int, expected an object"),
])
def test_deepspeed_config_zero_keys(tmp_path, zero, words):
    """A key DeepSpeed's ZeRO config does not have is refused naming the file, as DeepSpeed refuses it."""
    path = tmp_path / "zero.json"
    path.write_text(json.dumps({"zero_optimization": zero}))
    with pytest.raises(UserError) as err:
        parse("--deepspeed_config", str(path))
    assert f"--deepspeed_config {path}: " in str(err.value) and words in str(err.value), str(err.value)


def test_zero_keys_are_deepspeeds():
    """ds_config.ZERO_KEYS (the preflight imports no DeepSpeed) is the installed DeepSpeed's ZeRO config's fields
    and aliases."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from megatron.config.ds_config import ZERO_KEYS
    fields = DeepSpeedZeroConfig.model_fields
    assert ZERO_KEYS == set(fields) | {f.alias for f in fields.values() if f.alias}


def test_pipe_spec_classes_and_counts_match_the_models():
    """The class names and spec counts the resolution checks --partition-method against are the models'."""
    from megatron.model.specs import spec_for
    from megatron.model.config import GPT2Config, T5Config
    from megatron.model.gpt2_pipe import gpt2_layer_specs
    from megatron.model.t5_pipe import t5_layer_specs
    gpt = [gpt2_layer_specs(GPT2Config(num_layers=3, hidden_size=8, num_attention_heads=2, vocab_size=10,
                                       seq_length=4, tie_word_embeddings=tied)) for tied in (True, False)]
    t5 = [t5_layer_specs(T5Config(num_layers=2, num_decoder_layers=3, hidden_size=8, num_attention_heads=2,
                                  vocab_size=10, seq_length=4, tie_word_embeddings=tied)) for tied in (True, False)]
    assert {s.typename.__name__ for specs in gpt for s in specs} == set(spec_for("gpt").pipe_layer_classes)
    assert {s.typename.__name__ for specs in t5 for s in specs} == set(spec_for("t5").pipe_layer_classes)
    assert spec_for("gpt").pipe_spec_count(_gpt("--num-layers", "3")) == len(gpt[0]) == len(gpt[1])
    assert spec_for("t5").pipe_spec_count(_t5("--decoder-num-layers", "3")) == len(t5[0]) == len(t5[1])
