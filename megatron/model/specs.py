"""One spec per model: what the training driver, the checkpoint tools and inference need to know of it.

    spec.config(args)                   resolved arguments -> GPT2Config / T5Config (model code never reads args)
    spec.build_pipe(cfg, state)         the Pipe model of a RunConfig (`megatron.config.run_config`) over the
                                        ParallelState's groups (one stage at pp = 1); --compile compiles its
                                        transformer layers (`compile`)
    spec.plain                          the plain model class (generation, evaluation, conversion, Hugging Face)
    spec.datasets(data, tokenizer, [n_train, n_valid, n_test]) -> [train, valid, test] (None = empty split);
                                        `data` is the RunConfig's data section (or arguments of the same names)
    spec.get_batch(raw, data, tokenizer, tp_group) -> (inputs, labels): raw is the loader's dict on tp rank 0,
                                        None elsewhere; every rank of tp_group (default: mpu's) gets the same
                                        micro-batch (one broadcast)

`spec_for(model_type)` is the registry, keyed by the `model_type` that megatron_args.json stores ('gpt',
't5'); the entry scripts, `megatron.checkpointing` and `megatron.inference` all ask it.

Micro-batches (b = micro-batch, s = sequence, se / sd = encoder / decoder sequence; masks True = masked out):
    gpt  ((tokens, position_ids), (labels, loss_mask))   tokens/labels int64 (b, s), loss_mask float (b, s);
         with --reset-attention-mask ((tokens, position_ids, attention_mask), ...), attention_mask bool
         (b, 1, s, s) (otherwise attention is causal by `is_causal` and no mask exists)
    t5   ((enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask), (labels, loss_mask)): tokens/labels int64
         (b, se) / (b, sd); enc_mask (b, 1, se, se), dec_mask (b, 1, sd, sd) (causal), cross_mask (b, 1, sd, se)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from megatron import mpu
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.masks import get_ltor_masks_and_position_ids
from megatron.data.t5_dataset import build_t5_datasets
from megatron.data.token_ids import vocabulary_limit
from megatron.errors import UserError
from .config import GPT2Config, T5Config
from .gpt2_model import GPT2Model
from .t5_model import T5Model

T5_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    config: Callable[[Any], Any]
    plain: type
    pipe: Callable[..., Any]            # the Pipe class: pipe(config, parallel_state=, partition_method=, ...)
    datasets: Callable[[Any, Any, List[int]], list]
    get_batch: Callable[..., tuple]

    def build_pipe(self, cfg, parallel_state: Optional[mpu.ParallelState] = None):
        """This rank's stage(s) of the Pipe model of RunConfig `cfg`, split over its pipeline stages, over
        `parallel_state`'s groups (default: mpu's current state)."""
        method = cfg.layout.partition_method
        pipe = self.pipe(cfg.model, parallel_state=parallel_state,
                         partition_method=list(method) if isinstance(method, tuple) else method or "type:TransformerLayer",
                         verbose=cfg.logging.deepspeed_verbose or None,  # None: tds default (env TDS_VERBOSE)
                         virtual_stages=cfg.layout.virtual_pipe_stages,
                         sequence_parallel=cfg.layout.sequence_parallel)
        if cfg.model.compile_layers:  # --compile, applied from outside the model (megatron.model.compile)
            from megatron.logging_utils import print_rank_0
            from .compile import compile_layers
            print_rank_0(compile_layers(pipe, cfg.layout.pipeline_schedule))
        return pipe


def _recompute(args) -> dict:
    """The config's recomputation fields from --recompute-* (resolved; older records: --checkpoint-*)."""
    granularity = getattr(args, "recompute_granularity", None) or ("full" if args.checkpoint_activations else None)
    layers = getattr(args, "recompute_num_layers", None) or args.checkpoint_num_layers or 1
    return dict(recompute_granularity=granularity, checkpoint_num_layers=layers if granularity == "full" else 0,
                recompute_method=getattr(args, "recompute_method", None) or "uniform")


def _speed(args) -> dict:
    """The config's speed fields from --cross-entropy-loss-fusion and --compile (False where args predate them)."""
    return dict(cross_entropy_loss_fusion=bool(getattr(args, "cross_entropy_loss_fusion", False)),
                compile_layers=bool(getattr(args, "compile", False)))


def gpt2_config(args) -> GPT2Config:
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    scaling = getattr(args, "use_rope_scaling", False)
    return GPT2Config(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                      seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
                      hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                      layernorm_epsilon=args.layernorm_epsilon,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      **_recompute(args), **_speed(args), seed=args.seed,
                      max_position_embeddings=args.max_position_embeddings,
                      init_method_std=args.init_method_std,
                      explicit_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
                      position_embedding_type=getattr(args, "position_embedding_type", None) or "learned_absolute",
                      rotary_base=getattr(args, "rotary_base", None) or 10000.0,
                      rotary_percent=getattr(args, "rotary_percent", None) or 1.0,
                      rope_scaling_factor=args.rope_scaling_factor if scaling else None,
                      rope_low_freq_factor=getattr(args, "rope_scaling_low_freq_factor", None) or 1.0,
                      rope_high_freq_factor=getattr(args, "rope_scaling_high_freq_factor", None) or 4.0,
                      rope_original_max_positions=getattr(args, "rope_scaling_original_max_position_embeddings",
                                                          None) or 8192,
                      normalization=getattr(args, "normalization", None) or "LayerNorm",
                      swiglu=bool(getattr(args, "swiglu", False)), num_query_groups=groups,
                      add_bias_linear=not getattr(args, "disable_bias_linear", False),
                      add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
                      tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                      gelu=getattr(args, "gelu", None) or "tanh")


def t5_config(args) -> T5Config:
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
                    **_recompute(args), **_speed(args), seed=args.seed)


def gpt2_datasets(args, tokenizer, num_samples: List[int]) -> list:
    return build_train_valid_test_datasets(args.data_path, args.split, num_samples, args.seq_length, args.seed,
                                           token_limit=vocabulary_limit(tokenizer))


def t5_datasets(args, tokenizer, num_samples: List[int]) -> list:
    return build_t5_datasets(args.data_path, args.split, num_samples, args.encoder_seq_length,
                             args.decoder_seq_length, args.seed, tokenizer, noise_density=args.mask_prob)


def gpt2_batch(raw: Optional[dict], args, tokenizer, tp_group=None) -> tuple:
    data = mpu.broadcast_data(["text"], raw, torch.int64, tp_group)["text"]  # (b, s + 1)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, tokenizer.eod, args.reset_position_ids, args.reset_attention_mask, args.eod_mask_loss)
    inputs = (tokens, position_ids) if attention_mask is None else (tokens, position_ids, attention_mask)
    return inputs, (labels, loss_mask)


def t5_batch(raw: Optional[dict], args, tokenizer, tp_group=None) -> tuple:
    as_long = {key: raw[key].long() for key in T5_KEYS} if raw is not None else None
    data = mpu.broadcast_data(T5_KEYS, as_long, torch.int64, tp_group)
    masks = [data[key].bool().unsqueeze(1) for key in ("enc_mask", "dec_mask", "enc_dec_mask")]  # (b, 1, q, k)
    return (data["text_enc"], data["text_dec"], *masks), (data["labels"], data["loss_mask"].float())


def _gpt2_pipe(*args, **kwargs):
    from .gpt2_pipe import GPT2ModelPipe  # imports tds.pipe, which plain-model users need not load
    return GPT2ModelPipe(*args, **kwargs)


def _t5_pipe(*args, **kwargs):
    from .t5_pipe import T5ModelPipe
    return T5ModelPipe(*args, **kwargs)


SPECS: Dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", gpt2_config, GPT2Model, _gpt2_pipe, gpt2_datasets, gpt2_batch),
    "t5": ModelSpec("t5", t5_config, T5Model, _t5_pipe, t5_datasets, t5_batch),
}


def spec_for(model_type: Optional[str]) -> ModelSpec:
    if model_type not in SPECS:
        raise UserError(f"model_type {model_type!r} is not one this tool handles ({', '.join(SPECS)})")
    return SPECS[model_type]
