"""The GPT layer's options (Megatron-LM's flags) resolved and checked: GPT-2's layer by default, the layer of
today's open models (Llama, Mistral, Qwen2) by flags.

    --position-embedding-type   learned_absolute (default) | rope | none
    --rotary-base / --rotary-percent / --use-rope-scaling (+ --rope-scaling-*)      rope only
    --normalization             LayerNorm (default) | RMSNorm; --norm-epsilon (= --layernorm-epsilon)
    --swiglu                    ffn default int(4h x 2/3 / 64) x 64 (Megatron's rule)
    --group-query-attention --num-query-groups G   (G default 1); heads % G == 0 and G % tp == 0
    --disable-bias-linear, --add-qkv-bias
    --untie-embeddings-and-output-weights       (GPT and T5)

Every combination that cannot mean anything is a one-line UserError naming the flags and values. Nothing
here imports torch.
"""
from __future__ import annotations

import argparse

from megatron.errors import flag_name, require

ROPE_SCALING_DEFAULTS = dict(rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0,
                             rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=8192)
ROPE_DEFAULTS = dict(rotary_base=10000.0, rotary_percent=1.0)
GPT_DEFAULTS = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                    group_query_attention=False, disable_bias_linear=False, add_qkv_bias=False, use_rope_scaling=False,
                    **ROPE_DEFAULTS, **ROPE_SCALING_DEFAULTS)
GPT_ONLY = tuple(GPT_DEFAULTS) + ("num_query_groups",)


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's --ffn-hidden-size default with --swiglu (megatron.model.config has the same rule)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def _given(args: argparse.Namespace, names) -> list:
    return [flag_name(n) for n in names if getattr(args, n, None) not in (None, False)]


def refuse_gpt_options(args: argparse.Namespace, script: str) -> None:
    """A T5 run given GPT-layer flags: one line naming them."""
    given = _given(args, GPT_ONLY)
    require(not given, f"{', '.join(given)}: GPT options; {script} does not take them")


def resolve_gpt_layer(args: argparse.Namespace) -> None:
    """Fill the GPT layer's defaults and check the combination (see the module docstring)."""
    rope = args.position_embedding_type == "rope"
    if not rope:
        stray = _given(args, tuple(ROPE_DEFAULTS) + ("use_rope_scaling",) + tuple(ROPE_SCALING_DEFAULTS))
        require(not stray, f"{', '.join(stray)} apply to --position-embedding-type rope, not "
                           f"{args.position_embedding_type or 'learned_absolute'}")
    if not args.use_rope_scaling:
        stray = _given(args, ROPE_SCALING_DEFAULTS)
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
    if args.reset_position_ids:
        require(args.position_embedding_type == "learned_absolute",
                f"--reset-position-ids restarts the learned position table at each document, but "
                f"--position-embedding-type is {args.position_embedding_type} (rotary positions run 0 .. s-1 over "
                f"each sequence); drop --reset-position-ids (--reset-attention-mask keeps documents apart)")


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


def default_ffn_size(args: argparse.Namespace) -> int:
    """--ffn-hidden-size when not given: 4h, or Megatron's SwiGLU rule (0 for a hidden size under 24: refused)."""
    if not getattr(args, "swiglu", False):
        return 4 * args.hidden_size
    size = swiglu_ffn_size(args.hidden_size)
    require(size >= 1, f"--swiglu with --hidden-size {args.hidden_size}: the default --ffn-hidden-size "
                       f"int(4h x 2/3 / 64) x 64 is 0; give --ffn-hidden-size")
    return size
