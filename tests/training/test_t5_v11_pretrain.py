"""T5 v1.1 through pretrain_t5.py: --feed-forward-proj gated-gelu, --untie-embeddings-and-output-weights,
--decoder-num-layers, --relative-attention-num-buckets / --relative-attention-max-distance (and
--deepspeed-verbose).

On 2 gloo ranks: T5ModelPipe at (tp, pp, dp) = (1, 2, 1) and T5Model at (1, 1, 2) train with the same losses
(fp32, relative error < 1e-5); the model pretrain_t5.py builds from the flags has what they ask for (3 decoder
layers, a 16-bucket table, the gated feed-forward's 2f rows, an untied head); and a second run on the
finished checkpoint says in one line that training is already complete instead of evaluating again; that run
has --deepspeed-verbose, which lets DeepSpeed's start-up prints through (absent from the first run's log).
"""
from __future__ import annotations

import contextlib
import io
import os

from megatron.config.arguments import parse_args
from megatron.model.t5_model import T5Model
from megatron.model.specs import spec_for
from pretrain_t5 import DEFAULTS
from harness.dist import run_distributed
from tests.training.runner import train_state

V11 = ["--feed-forward-proj", "gated-gelu", "--untie-embeddings-and-output-weights", "--decoder-num-layers", "3",
       "--relative-attention-num-buckets", "16", "--relative-attention-max-distance", "20"]
HIDDEN, HEADS, FFN = 32, 4, 64


def _argv(data: dict, pp: int, save: str) -> list:
    return ["--num-layers", "2", "--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS),
            "--ffn-hidden-size", str(FFN), "--encoder-seq-length", "32", "--decoder-seq-length", "16",
            "--vocab-extra-ids", "8", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
            "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type",
            "GPT2BPETokenizer", "--data-path", data["data_prefix"], "--vocab-file", data["vocab"], "--merge-file",
            data["merges"], "--num-workers", "0", "--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1",
            "--split", "90,8,2", "--make-vocab-size-divisible-by", "8", "--pipe-parallel-size", str(pp),
            "--save", save, "--load", save, *V11]


def _runs(data: dict, tmp: str, world_size: int) -> tuple:
    from pretrain_t5 import SPEC
    quiet, log = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(quiet):
        pipe = train_state(_argv(data, 2, os.path.join(tmp, "pipe")), world_size, SPEC, DEFAULTS)
    plain = train_state(_argv(data, 1, os.path.join(tmp, "plain")), world_size, SPEC, DEFAULTS)
    with contextlib.redirect_stdout(log):
        again = train_state(_argv(data, 2, os.path.join(tmp, "pipe")) + ["--deepspeed-verbose"], world_size,
                            SPEC, DEFAULTS)
    return pipe.losses, plain.losses, again.losses, log.getvalue(), quiet.getvalue()


def test_t5_v11_flags_through_pretrain_t5(gpt_data, tmp_path):
    pipe, plain, again, log, quiet = run_distributed(_runs, 2, gpt_data, str(tmp_path), 2, timeout=600)[0]
    assert len(pipe) == len(plain) == 4
    for got, want in zip(pipe, plain):
        assert abs(got - want) <= 1e-5 * abs(want), (pipe, plain)
    args = parse_args(_argv(gpt_data, 2, str(tmp_path / "x")), defaults=DEFAULTS, world_size=2)
    args.vocab_size = 300
    config = spec_for("t5").config(args)
    assert (config.feed_forward_proj, config.tie_word_embeddings, config.num_decoder_layers,
            config.relative_attention_num_buckets, config.relative_attention_max_distance) == ("gated-gelu", False,
                                                                                              3, 16, 20)
    sd = T5Model(config).state_dict()
    assert sd["lm_head.weight"].shape == (config.padded_vocab_size(1), HIDDEN)  # the untied head
    assert sd["decoder_layers.0.self_attention.relative_attention_bias.weight"].shape == (16, HEADS)
    assert sd["decoder_layers.2.mlp.wi.weight"].shape == (2 * FFN, HIDDEN)  # gated: [Wi0; Wi1]
    assert "decoder_layers.3.mlp.wi.weight" not in sd
    assert again == [] and "training is already complete" in log and "iteration 4 of --train-iters 4" in log
    assert "TRAIN_ITERS=" in log and "test loss" not in log
    # --deepspeed-verbose lets DeepSpeed's constructor prints through; without it, our summary line only
    assert "SEED_LAYERS" in log and "Using topology" in log and "(tp, pp, dp) = (1, 2, 1)" in log
    assert "SEED_LAYERS" not in quiet and "Using topology" not in quiet and "(tp, pp, dp) = (1, 2, 1)" in quiet
