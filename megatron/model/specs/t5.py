"""The T5 family: T5 v1.0 (ReLU feed-forward, tied head scaled by h^-0.5) and v1.1 (--feed-forward-proj gated-gelu
--untie-embeddings-and-output-weights), relative position bias, RMSNorm, no biases.

Micro-batches (b micro-batch, se / sd encoder / decoder sequence; masks True = masked out):
((enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask), (labels, loss_mask)): tokens/labels int64 (b, se) /
(b, sd); enc_mask (b, 1, se, se), dec_mask (b, 1, sd, sd) (causal), cross_mask (b, 1, sd, se).
Nothing here imports torch until a model, a dataset or a batch is made.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from megatron.errors import require
from .base import Location, ModelSpec, given

T5_DEFAULTS = dict(feed_forward_proj="relu", untie_embeddings_and_output_weights=False,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128)
OPTIONS = ("decoder_num_layers",) + tuple(k for k in T5_DEFAULTS if k != "untie_embeddings_and_output_weights")
KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")


class T5Spec(ModelSpec):
    model_type = "t5"
    entry_script = "pretrain_t5.py"
    pipe_layer_classes = ("T5EmbeddingPipe", "T5EncoderTransformerLayerPipe", "T5EncoderFinalNormPipe",
                          "T5DecoderTransformerLayerPipe", "T5DecoderFinalNormPipe", "T5LMHead")
    sequence_flags = ("encoder_seq_length", "decoder_seq_length")

    @property
    def config_class(self) -> type:
        from megatron.model.config import T5Config
        return T5Config

    # ---- configuration ---------------------------------------------------------------------------------------
    def default_ffn_size(self, args: argparse.Namespace) -> int:
        return 4 * args.hidden_size

    def resolve(self, args: argparse.Namespace) -> None:
        for name, value in T5_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        if args.decoder_num_layers is None:
            args.decoder_num_layers = args.num_layers
        require(args.decoder_num_layers >= 1, f"--decoder-num-layers must be >= 1, got {args.decoder_num_layers}")
        buckets, distance = args.relative_attention_num_buckets, args.relative_attention_max_distance
        require(buckets >= 4, f"--relative-attention-num-buckets must be >= 4, got {buckets}")
        require(distance > buckets // 2, f"--relative-attention-max-distance {distance} must exceed half of "
                                         f"--relative-attention-num-buckets {buckets}")

    def refuse_options(self, args: argparse.Namespace, script: str) -> None:
        stray = given(args, OPTIONS)
        require(not stray, f"{', '.join(stray)}: T5 options; {script} does not take them")

    def config(self, args):
        from megatron.model.config import T5Config
        from .common import recompute_fields, speed_fields
        return T5Config(num_layers=args.num_layers, num_decoder_layers=args.decoder_num_layers,
                        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                        vocab_size=args.vocab_size, seq_length=args.encoder_seq_length,
                        decoder_seq_length=args.decoder_seq_length, ffn_hidden_size=args.ffn_hidden_size,
                        kv_channels=args.kv_channels, feed_forward_proj=args.feed_forward_proj,
                        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
                        relative_attention_num_buckets=args.relative_attention_num_buckets,
                        relative_attention_max_distance=args.relative_attention_max_distance,
                        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                        layernorm_epsilon=args.layernorm_epsilon,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        **recompute_fields(args), **speed_fields(args), seed=args.seed)

    # ---- building --------------------------------------------------------------------------------------------
    @property
    def plain(self) -> type:
        from megatron.model.t5_model import T5Model
        return T5Model

    def pipe(self, *args, **kwargs):
        from megatron.model.t5_pipe import T5ModelPipe
        return T5ModelPipe(*args, **kwargs)

    def pipe_layer_specs(self, config) -> list:
        from megatron.model.t5_pipe import t5_layer_specs
        return t5_layer_specs(config)

    def pipe_spec_count(self, args: argparse.Namespace) -> int:
        return args.num_layers + args.decoder_num_layers + 4  # embedding, encoder, norm, decoder, norm, head

    # ---- data ------------------------------------------------------------------------------------------------
    def datasets(self, data, tokenizer, num_samples: List[int]) -> list:
        from megatron.data.t5_dataset import build_t5_datasets
        return build_t5_datasets(data.data_path, data.split, num_samples, data.encoder_seq_length,
                                 data.decoder_seq_length, data.seed, tokenizer, noise_density=data.mask_prob)

    def get_batch(self, raw: Optional[dict], data, tokenizer, tp_group=None) -> tuple:
        import torch
        from megatron import mpu
        as_long = {key: raw[key].long() for key in KEYS} if raw is not None else None
        batch = mpu.broadcast_data(KEYS, as_long, torch.int64, tp_group)
        masks = [batch[key].bool().unsqueeze(1) for key in ("enc_mask", "dec_mask", "enc_dec_mask")]  # (b, 1, q, k)
        return (batch["text_enc"], batch["text_dec"], *masks), (batch["labels"], batch["loss_mask"].float())

    def synthetic_raw(self, b: int, data, vocab: int, gen) -> dict:
        """The seven keys of full-length documents."""
        import torch
        se, sd = data.encoder_seq_length, data.decoder_seq_length
        dec_mask = torch.ones(sd, sd, dtype=torch.long).triu(1)
        return {"text_enc": torch.randint(vocab, (b, se), generator=gen),
                "text_dec": torch.randint(vocab, (b, sd), generator=gen),
                "labels": torch.randint(vocab, (b, sd), generator=gen), "loss_mask": torch.ones(b, sd),
                "enc_mask": torch.zeros(b, se, se, dtype=torch.long), "dec_mask": dec_mask.expand(b, -1, -1),
                "enc_dec_mask": torch.zeros(b, sd, se, dtype=torch.long)}

    # ---- sizes -----------------------------------------------------------------------------------------------
    def transformer_layers(self, args) -> int:
        return args.num_layers + (args.decoder_num_layers or 0)

    def tokens_per_sample(self, data) -> int:
        return data.encoder_seq_length + data.decoder_seq_length

    def decoder_length(self, data) -> int:
        return data.decoder_seq_length

    def flops(self, config, global_batch_size: int, padded_vocab_size: int) -> float:
        from megatron.model.flops import t5_flops_per_iteration
        return t5_flops_per_iteration(global_batch_size, config.seq_length, config.decoder_seq_length,
                                      config.num_layers, config.hidden_size,
                                      config.num_attention_heads * config.kv_channels, config.ffn_hidden_size,
                                      padded_vocab_size, config.checkpoint_num_layers > 0,
                                      num_decoder_layers=config.num_decoder_layers,
                                      gated=config.feed_forward_proj == "gated-gelu")

    # ---- checkpoints and tools -------------------------------------------------------------------------------
    def locations(self, config) -> Location:
        le, ld = config.num_layers, config.num_decoder_layers
        return [(r"embedding\.(.+)", lambda m: (0, m[1])),
                (r"encoder_layers\.(\d+)\.(.+)", lambda m: (1 + int(m[1]), m[2])),
                (r"encoder_final\.(.+)", lambda m: (le + 1, m[1])),
                (r"decoder_layers\.(\d+)\.(.+)", lambda m: (le + 2 + int(m[1]), m[2])),
                (r"decoder_final\.(.+)", lambda m: (le + ld + 2, m[1])),
                (r"lm_head\.(.+)", lambda m: (le + ld + 3, m[1]))]

    def example_script(self, args: dict) -> str:
        return "ds_pretrain_t5.sh"

    def completion(self, prompt: str, text: str) -> str:
        return f"input:  {prompt}\noutput: {text}"
