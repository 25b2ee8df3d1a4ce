"""The pretrain_*.py model flags that rebuild a checkpoint's model: what `import-hf` prints, so that training
from an imported model starts from the same function, not only from weights of the same shapes."""
from __future__ import annotations

from typing import Any, Dict, List

from megatron.errors import flag_name
from megatron.model.moe_config import ARCHITECTURE as MOE_ARCHITECTURE
from megatron.model.specs.gpt import LAYER_SWITCHES

# (argument, flag): given with its value when the checkpoint has it and it is not None / False
VALUED = (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
          ("num_attention_heads", "--num-attention-heads"), ("kv_channels", "--kv-channels"),
          ("ffn_hidden_size", "--ffn-hidden-size"), ("max_position_embeddings", "--max-position-embeddings"),
          ("layernorm_epsilon", "--norm-epsilon"), ("position_embedding_type", "--position-embedding-type"),
          ("normalization", "--normalization"), ("num_query_groups", "--num-query-groups"),
          ("decoder_num_layers", "--decoder-num-layers"), ("feed_forward_proj", "--feed-forward-proj"),
          ("relative_attention_num_buckets", "--relative-attention-num-buckets"),
          ("relative_attention_max_distance", "--relative-attention-max-distance"), ("gelu", "--gelu"))
ROPE = (("rotary_base", "--rotary-base"), ("rotary_percent", "--rotary-percent"))
ROPE_SCALING = (("rope_scaling_factor", "--rope-scaling-factor"),
                ("rope_scaling_low_freq_factor", "--rope-scaling-low-freq-factor"),
                ("rope_scaling_high_freq_factor", "--rope-scaling-high-freq-factor"),
                ("rope_scaling_original_max_position_embeddings", "--rope-scaling-original-max-position-embeddings"))
SWITCHES = (("swiglu", "--swiglu"), ("group_query_attention", "--group-query-attention"),
            ("disable_bias_linear", "--disable-bias-linear"), ("add_qkv_bias", "--add-qkv-bias"),
            ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
            ("use_rope_scaling", "--use-rope-scaling"), *LAYER_SWITCHES.items())


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def model_flags(args: Dict[str, Any]) -> List[str]:
    """The model flags of saved arguments (GPT or T5)."""
    valued = list(VALUED)
    if args.get("position_embedding_type") == "rope":
        valued += ROPE + (ROPE_SCALING if args.get("use_rope_scaling") else ())
    if args.get("num_experts") is not None:  # a mixture of experts: its architecture's flags (switches: True)
        valued += [(key, flag_name(key)) for key in MOE_ARCHITECTURE if not isinstance(args.get(key), bool)]
    out = []
    for key, flag in valued:
        if args.get(key) is not None:
            out += [flag, _value(args[key])]
    switches = SWITCHES + tuple((key, flag_name(key)) for key in MOE_ARCHITECTURE if args.get(key) is True)
    return out + [flag for key, flag in switches if args.get(key)]
