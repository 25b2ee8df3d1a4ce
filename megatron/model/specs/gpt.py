"""The GPT family: GPT-2's layer by default, the layer of today's open models (Llama, Mistral, Qwen2, Qwen3, OLMo-2)
by options, as Megatron-LM names them (where it has a name):

    --position-embedding-type   learned_absolute (default) | rope | none
    --rotary-base / --rotary-percent / --use-rope-scaling (+ --rope-scaling-*)      rope only
    --normalization             LayerNorm (default) | RMSNorm; --norm-epsilon (= --layernorm-epsilon)
    --swiglu                    ffn default int(4h x 2/3 / 64) x 64 (Megatron's rule)
    --group-query-attention --num-query-groups G   (G default 1); heads % G == 0 and G % tp == 0
    --disable-bias-linear, --add-qkv-bias, --untie-embeddings-and-output-weights, --gelu tanh|erf
    --qk-layernorm              a norm (--normalization's) over each query / key head, before rotary (Qwen3)
    --qk-layernorm-full         instead, an RMSNorm over each token's whole query / key projection (OLMo-2)
    --post-sublayer-norm        the two norms on the attention / MLP outputs before the residual add (OLMo-2)

Every combination that cannot mean anything is a one-line UserError naming the flags and values (`resolve`).
Micro-batches (b micro-batch, s sequence): ((tokens, position_ids), (labels, loss_mask)), tokens/labels int64
(b, s), loss_mask float (b, s); with --reset-attention-mask ((tokens, position_ids, attention_mask), ...),
attention_mask bool (b, 1, s, s), True = masked (otherwise attention is causal by `is_causal`, no mask exists).
Nothing here imports torch until a model, a dataset or a batch is made.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from megatron.errors import require
from megatron.model.config import swiglu_ffn_size
from .base import Location, ModelSpec, given

ROPE_SCALING_DEFAULTS = dict(rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0,
                             rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=8192)
ROPE_DEFAULTS = dict(rotary_base=10000.0, rotary_percent=1.0)
# The layer's switches that add or move parameters: one flag and one GPTConfig field of the same name each; the
# checkpoint tools read them from here (the fields a checkpoint must agree on, the flags import-hf prints).
LAYER_SWITCHES = {"qk_layernorm": "--qk-layernorm", "qk_layernorm_full": "--qk-layernorm-full",
                  "post_sublayer_norm": "--post-sublayer-norm"}
GPT_DEFAULTS = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                    group_query_attention=False, disable_bias_linear=False, add_qkv_bias=False, use_rope_scaling=False,
                    **ROPE_DEFAULTS, **ROPE_SCALING_DEFAULTS, **dict.fromkeys(LAYER_SWITCHES, False))
OPTIONS = tuple(GPT_DEFAULTS) + ("num_query_groups",)  # flags no other family takes


class GPTSpec(ModelSpec):
    model_type = "gpt"
    entry_script = "pretrain_gpt2.py"
    pipe_layer_classes = ("GPT2EmbeddingPipe", "GPT2TransformerLayerPipe", "GPT2FinalLayerNormPipe",
                          "GPT2LMHeadPipe")
    sequence_flags = ("seq_length",)
    zero_shot = True

    @property
    def config_class(self) -> type:
        from megatron.model.config import GPTConfig
        return GPTConfig

    # ---- configuration ---------------------------------------------------------------------------------------
    def default_ffn_size(self, args: argparse.Namespace) -> int:
        """--ffn-hidden-size when not given: 4h, or Megatron's SwiGLU rule (0 for a hidden size under 24: refused)."""
        if not getattr(args, "swiglu", False):
            return 4 * args.hidden_size
        size = swiglu_ffn_size(args.hidden_size)
        require(size >= 1, f"--swiglu with --hidden-size {args.hidden_size}: the default --ffn-hidden-size "
                           f"int(4h x 2/3 / 64) x 64 is 0; give --ffn-hidden-size")
        return size

    def resolve(self, args: argparse.Namespace) -> None:
        args.untie_embeddings_and_output_weights = bool(args.untie_embeddings_and_output_weights)
        rope = args.position_embedding_type == "rope"
        if not rope:
            stray = given(args, tuple(ROPE_DEFAULTS) + ("use_rope_scaling",) + tuple(ROPE_SCALING_DEFAULTS))
            require(not stray, f"{', '.join(stray)} apply to --position-embedding-type rope, not "
                               f"{args.position_embedding_type or 'learned_absolute'}")
        if not args.use_rope_scaling:
            stray = given(args, ROPE_SCALING_DEFAULTS)
            require(not stray, f"{', '.join(stray)} need --use-rope-scaling")
        groups = args.num_query_groups
        require(groups is None or args.group_query_attention,
                f"--num-query-groups {groups} needs --group-query-attention")
        for name, value in GPT_DEFAULTS.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
        heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
        if args.group_query_attention:
            groups = args.num_query_groups = 1 if groups is None else groups
            require(1 <= groups <= heads and heads % groups == 0,
                    f"--num-query-groups {groups} must divide --num-attention-heads {heads}")
            require(groups % tp == 0, f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size "
                                      f"{tp}: each tensor-parallel rank holds whole key/value groups")
        _resolve_rope(args)
        require(not (args.qk_layernorm and args.qk_layernorm_full),
                "--qk-layernorm (a norm over each head, Qwen3's) and --qk-layernorm-full (one over the whole "
                "projection, OLMo-2's) exclude each other; give one")
        require(not args.qk_layernorm_full or args.normalization == "RMSNorm",
                f"--qk-layernorm-full is OLMo-2's RMSNorm over the whole query / key projection, but --normalization "
                f"is {args.normalization}; give --normalization RMSNorm (or --qk-layernorm: a {args.normalization} "
                f"over each head)")
        if args.reset_position_ids:
            require(args.position_embedding_type == "learned_absolute",
                    f"--reset-position-ids restarts the learned position table at each document, but "
                    f"--position-embedding-type is {args.position_embedding_type} (rotary positions run 0 .. s-1 over "
                    f"each sequence); drop --reset-position-ids (--reset-attention-mask keeps documents apart)")

    def refuse_options(self, args: argparse.Namespace, script: str) -> None:
        stray = given(args, OPTIONS)
        require(not stray, f"{', '.join(stray)}: GPT options; {script} does not take them")

    def config(self, args):
        from megatron.model.config import GPTConfig
        from .common import recompute_fields, speed_fields
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
        scaling = getattr(args, "use_rope_scaling", False)
        return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                         seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
                         hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                         layernorm_epsilon=args.layernorm_epsilon,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         **recompute_fields(args), **speed_fields(args), seed=args.seed,
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
                         gelu=getattr(args, "gelu", None) or "tanh",
                         **{name: bool(getattr(args, name, False)) for name in LAYER_SWITCHES})

    # ---- building --------------------------------------------------------------------------------------------
    @property
    def plain(self) -> type:
        from megatron.model.gpt2_model import GPTModel
        return GPTModel

    def pipe(self, *args, **kwargs):
        from megatron.model.gpt2_pipe import GPTModelPipe  # imports tds.pipe, which plain-model users need not load
        return GPTModelPipe(*args, **kwargs)

    def pipe_layer_specs(self, config) -> list:
        from megatron.model.gpt2_pipe import gpt2_layer_specs
        return gpt2_layer_specs(config)

    def pipe_spec_count(self, args: argparse.Namespace) -> int:
        return args.num_layers + 3  # embedding, layers, final norm, tied or own head

    # ---- data ------------------------------------------------------------------------------------------------
    def datasets(self, data, tokenizer, num_samples: List[int]) -> list:
        from megatron.data.gpt_dataset import build_train_valid_test_datasets
        from megatron.data.token_ids import vocabulary_limit
        return build_train_valid_test_datasets(data.data_path, data.split, num_samples, data.seq_length, data.seed,
                                               token_limit=vocabulary_limit(tokenizer))

    def get_batch(self, raw: Optional[dict], data, tokenizer, tp_group=None) -> tuple:
        import torch
        from megatron import mpu
        from megatron.data.masks import get_ltor_masks_and_position_ids
        text = mpu.broadcast_data(["text"], raw, torch.int64, tp_group)["text"]  # (b, s + 1)
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss)
        inputs = (tokens, position_ids) if attention_mask is None else (tokens, position_ids, attention_mask)
        return inputs, (labels, loss_mask)

    def synthetic_raw(self, b: int, data, vocab: int, gen) -> dict:
        """'text' (b, s + 1) of random ids, never the end-of-document id 0."""
        import torch
        return {"text": torch.randint(1, vocab, (b, data.seq_length + 1), generator=gen)}

    # ---- sizes -----------------------------------------------------------------------------------------------
    def transformer_layers(self, args) -> int:
        return args.num_layers

    def tokens_per_sample(self, data) -> int:
        return data.seq_length

    def decoder_length(self, data) -> int:
        return data.seq_length

    def flops(self, config, global_batch_size: int, padded_vocab_size: int) -> float:
        from megatron.model.flops import gpt_flops_per_iteration
        return gpt_flops_per_iteration(global_batch_size, config.seq_length, config.num_layers, config.hidden_size,
                                       config.num_attention_heads * config.kv_channels, config.ffn_hidden_size,
                                       padded_vocab_size, config.checkpoint_num_layers > 0,
                                       d_kv=config.num_query_groups * config.kv_channels, gated=config.swiglu)

    # ---- checkpoints and tools -------------------------------------------------------------------------------
    def locations(self, config) -> Location:
        n = config.num_layers
        return [(r"embedding\.(.+)", lambda m: (0, m[1])),
                (r"layers\.(\d+)\.(.+)", lambda m: (1 + int(m[1]), m[2])),
                (r"(final_layernorm\..+)", lambda m: (n + 1, m[1])),
                (r"lm_head\.(.+)", lambda m: (n + 2, m[1]))]

    def example_script(self, args: dict) -> str:
        llama = args.get("swiglu") or args.get("position_embedding_type") == "rope"
        return "ds_pretrain_llama.sh" if llama else "ds_pretrain_gpt2.sh"

    def completion(self, prompt: str, text: str) -> str:
        return prompt + text


def _resolve_rope(args: argparse.Namespace) -> None:
    if args.position_embedding_type != "rope":
        return
    percent, d = args.rotary_percent, args.kv_channels
    rotated = d * percent
    require(0.0 < percent <= 1.0 and rotated == int(rotated) and int(rotated) % 2 == 0,
            f"--rotary-percent {percent} of --kv-channels {d} must leave an even number of rotated channels "
            f"(got {rotated:g})")
    require(args.rotary_base > 0, f"--rotary-base must be > 0, got {args.rotary_base}")
    if args.use_rope_scaling:
        low, high = args.rope_scaling_low_freq_factor, args.rope_scaling_high_freq_factor
        require(args.rope_scaling_factor > 0 and 0 < low < high,
                f"--rope-scaling-factor {args.rope_scaling_factor} must be > 0 and --rope-scaling-low-freq-factor "
                f"{low} < --rope-scaling-high-freq-factor {high}, both > 0")
        require(args.rope_scaling_original_max_position_embeddings >= 1,
                f"--rope-scaling-original-max-position-embeddings must be >= 1, got "
                f"{args.rope_scaling_original_max_position_embeddings}")
