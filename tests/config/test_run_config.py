"""The run configuration is resolved once into frozen sections, each consumer reads its section, and checkpoints
store the model and layout records (derived on read for checkpoints that predate them)."""
import argparse
import dataclasses
import json
import os
import shutil

import pytest

from megatron.checkpointing.names import layout_record, model_record
from megatron.config.arguments import parse_args
from megatron.training.pretrain import settle_config
from pretrain_gpt2 import DEFAULTS as GPT_DEFAULTS, SPEC as GPT_SPEC
from pretrain_t5 import DEFAULTS as T5_DEFAULTS, SPEC as T5_SPEC
from harness.dist import run_distributed
from tests.training.runner import small_argv, train_state


def _cfg(gpt_data, extra=(), world_size=8):
    argv = small_argv(gpt_data, tp=2, pp=2, extra=["--rampup-batch-size", "4", "4", "16", "--train-samples", "64",
                                                   "--lr-warmup-samples", "8", *extra])
    for flag in ("--train-iters", "--lr-warmup-iters"):  # sample-based training instead
        del argv[argv.index(flag):argv.index(flag) + 2]
    return settle_config(parse_args(argv, defaults=GPT_DEFAULTS, world_size=world_size), GPT_SPEC)


def test_every_section_is_frozen_and_holds_the_resolved_values(gpt_data):
    cfg, tokenizer = _cfg(gpt_data)
    sections = [f.name for f in dataclasses.fields(cfg)]
    assert sections == ["model_type", "seed", "model", "layout", "batch", "optimizer", "lr", "precision", "data",
                        "tokenizer", "checkpoint", "logging", "exit", "ds_config", "record"]
    for name in ("layout", "batch", "optimizer", "lr", "precision", "data", "tokenizer", "checkpoint", "logging",
                 "exit"):
        section = getattr(cfg, name)
        field = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, field, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model_type = "t5"
    with pytest.raises(TypeError):
        cfg.ds_config["train_batch_size"] = 1
    with pytest.raises(TypeError):
        cfg.record["gas"] = 1
    assert (cfg.layout.tp, cfg.layout.pp, cfg.layout.dp, cfg.layout.world_size) == (2, 2, 2, 8)
    assert cfg.layout.ds_zero_stage == cfg.ds_config["zero_optimization"]["stage"] == 1
    assert (cfg.batch.micro_batch_size, cfg.batch.gas, cfg.batch.global_batch_size) == (2, 2, 8)
    assert cfg.batch.rampup_batch_size == (4, 4, 16)
    assert cfg.batch.schedule().global_batch(0) == 4 and cfg.batch.schedule().global_batch(16) == 8
    assert (cfg.lr.unit, cfg.lr.decay, cfg.lr.warmup) == ("samples", 64, 8)
    assert cfg.tokenizer.vocab_size == tokenizer.vocab_size
    assert cfg.tokenizer.padded_vocab_size % (8 * 2) == 0 and cfg.model.vocab_size == tokenizer.vocab_size
    assert cfg.model == GPT_SPEC.config(argparse.Namespace(**cfg.record))
    assert cfg.data.data_path == (gpt_data["data_prefix"],) and cfg.data.seq_length == 32
    assert cfg.exit.check_for_nan_in_loss_and_grad and not cfg.exit.exit_signal_handler
    assert (cfg.exit.max_skipped_steps, cfg.checkpoint.async_save) == (100, False)
    copy = cfg.deepspeed_dict()
    copy["zero_optimization"]["stage"] = 0
    assert cfg.ds_config["zero_optimization"]["stage"] == 1  # DeepSpeed gets its own copy


def test_t5_sections(gpt_data):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--encoder-seq-length", "32",
            "--decoder-seq-length", "16", "--vocab-extra-ids", "8", "--micro-batch-size", "2", "--global-batch-size",
            "8", "--train-iters", "4", "--lr", "1e-3", "--tokenizer-type", "GPT2BPETokenizer", "--data-path",
            gpt_data["data_prefix"], "--vocab-file", gpt_data["vocab"], "--merge-file", gpt_data["merges"],
            "--feed-forward-proj", "gated-gelu", "--untie-embeddings-and-output-weights"]
    cfg, tokenizer = settle_config(parse_args(argv, defaults=T5_DEFAULTS, world_size=1), T5_SPEC)
    assert cfg.model_type == "t5" and type(cfg.model).__name__ == "T5Config"
    assert (cfg.model.num_decoder_layers, cfg.model.decoder_seq_length, cfg.model.tie_word_embeddings) == (2, 16, False)
    assert (cfg.data.encoder_seq_length, cfg.data.decoder_seq_length) == (32, 16)
    assert cfg.layout.ds_zero_stage == 0 and cfg.layout.zero_stage == 1  # one replica: DeepSpeed runs stage 0


def _saved(folder):
    with open(os.path.join(folder, "megatron_args.json")) as f:
        return json.load(f)


@pytest.mark.long
def test_checkpoint_holds_model_and_layout_records(gpt_data, tmp_path):
    save, data = str(tmp_path / "ckpt"), dict(gpt_data, data_prefix=str(tmp_path / "docs"))
    for ext in (".bin", ".idx"):  # a copy of its own: index maps cached beside it are this test's
        shutil.copy(gpt_data["data_prefix"] + ext, data["data_prefix"] + ext)
    argv = small_argv(data, tp=2, pp=2, train_iters=2, extra=["--save", save])
    run_distributed(train_state, 8, argv, 8, GPT_SPEC, GPT_DEFAULTS, timeout=600)
    saved = _saved(os.path.join(save, "iter_0000002"))
    assert saved["layout"] == dict(tp=2, pp=2, dp=2, zero_stage=1, virtual_pipe_stages=1, partition_method=None)
    model = saved["model"]
    assert model["model_type"] == "gpt" and (model["num_layers"], model["hidden_size"], model["seq_length"]) == (2, 32, 32)
    assert model["vocab_size"] == saved["vocab_size"] and "params_dtype" not in model
    # a checkpoint written before the records existed: the same records, derived from its flat arguments
    old = {k: v for k, v in saved.items() if k not in ("model", "layout")}
    assert layout_record(old) == saved["layout"] and model_record(old) == saved["model"]
