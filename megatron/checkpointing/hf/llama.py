"""Hugging Face's Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) <-> this project's GPT with
the Llama-family layer (rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases but Qwen2's qkv bias).

    config.json (LlamaConfig, ...)              project
        num_hidden_layers, hidden_size, num_attention_heads, intermediate_size   num_layers, hidden_size,
                                                num_attention_heads, ffn_hidden_size (required: no default)
        num_key_value_heads, head_dim           num_query_groups (--group-query-attention), kv_channels
        max_position_embeddings                 max_position_embeddings, and the sequence length of an import
        rms_norm_eps, initializer_range, attention_dropout    layernorm_epsilon, init_method_std, attention_dropout
        rope: rope_theta, llama3 scaling        rotary_base, --use-rope-scaling with its four factors
        tie_word_embeddings                     not untie_embeddings_and_output_weights

    tensors
        model.embed_tokens                          embedding.word_embeddings
        model.layers.i.input_layernorm              layers.i.input_layernorm                   (RMSNorm)
        model.layers.i.self_attn.q_proj/k_proj/v_proj  layers.i.self_attention.query_key_value rows [Q; K; V],
                                                       (heads, groups, groups) x head_dim rows (+ biases, Qwen2)
        model.layers.i.self_attn.o_proj             layers.i.self_attention.dense
        model.layers.i.post_attention_layernorm     layers.i.post_attention_layernorm
        model.layers.i.mlp.gate_proj/up_proj        layers.i.mlp.dense_h_to_4h rows [gate; up]  (SwiGLU)
        model.layers.i.mlp.down_proj                layers.i.mlp.dense_4h_to_h
        model.norm                                  final_layernorm
        lm_head                                     lm_head (untied), or none (tie_word_embeddings)

Both config layouts are read: transformers 5's `rope_parameters` and 4's `rope_theta` / `rope_scaling` (users'
folders were written by either); export writes the 4.x keys, which both read. Options the layer does not implement
(another rope type, attention or MLP biases where the architecture has none, a sliding window shorter than the
longest sequence, partial rotary) are one line naming the field and what is supported.

A member of the family is a subclass: its names, its qkv bias, the keys its config.json adds, transformers'
defaults where they differ, when it applies a sliding window; a new layer option adds its keys in `project_args` /
`hf_config` and its tensors in `layer_rules` (or `norm_rules`, where the layer's norms sit elsewhere). Qwen3
(qwen3.py) and OLMo-2 (olmo2.py) are such subclasses, each in its own file.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from megatron.model.specs.gpt import GPTSpec
from .base import Adapter, Rule, refuse

ROPE_TYPES = ("default", "llama3")
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
LAYER = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True,
             group_query_attention=True, rotary_percent=1.0, hidden_dropout=0.0)  # the family has no hidden dropout
LLAMA3 = (("rope_scaling_factor", "factor"), ("rope_scaling_low_freq_factor", "low_freq_factor"),
          ("rope_scaling_high_freq_factor", "high_freq_factor"),
          ("rope_scaling_original_max_position_embeddings", "original_max_position_embeddings"))


def rope(cfg: Dict[str, Any], theta: float) -> Dict[str, Any]:
    """{rope_type, rope_theta, factor, ...} from either config layout (`theta` where it names none)."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", theta))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class Llama(Adapter):
    hf_model_type, architecture, model_type = "llama", "LlamaForCausalLM", GPTSpec.model_type
    qkv_bias = False        # biases on q_proj / k_proj / v_proj (Qwen2)
    EXPORT: Dict[str, Any] = dict(attention_bias=False, mlp_bias=False)  # keys the exported config.json adds
    FIELDS = dict(num_layers="num_hidden_layers", hidden_size="hidden_size", num_attention_heads="num_attention_heads",
                  ffn_hidden_size="intermediate_size", max_position_embeddings="max_position_embeddings",
                  layernorm_epsilon="rms_norm_eps", init_method_std="initializer_range",
                  attention_dropout="attention_dropout")
    HF_DEFAULTS = dict(max_position_embeddings=2048, rms_norm_eps=1e-6, initializer_range=0.02, attention_dropout=0.0,
                       hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0)  # transformers' LlamaConfig

    def window(self, cfg: Dict[str, Any]) -> Optional[int]:
        """The sliding window transformers applies (None: full attention)."""
        return cfg.get("sliding_window", self.HF_DEFAULTS.get("sliding_window"))

    # ---- config.json -> arguments ------------------------------------------------------------------------
    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        refuse([f"no positive integer {k}" for k in REQUIRED if not isinstance(cfg.get(k), int) or cfg[k] < 1], where)
        args = self.read_fields(cfg)
        h, heads = args["hidden_size"], args["num_attention_heads"]
        groups = cfg.get("num_key_value_heads") or heads
        params = rope(cfg, self.HF_DEFAULTS["rope_theta"])
        refuse(self.unsupported(cfg, params, args["max_position_embeddings"], heads, groups), where)
        positions = args["max_position_embeddings"]
        args.update(model_type=self.model_type, kv_channels=cfg.get("head_dim") or h // heads, seq_length=positions,
                    encoder_seq_length=positions, decoder_seq_length=positions, **LAYER, add_qkv_bias=self.qkv_bias,
                    num_query_groups=groups, rotary_base=float(params["rope_theta"]),
                    untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings",
                                                                    self.HF_DEFAULTS["tie_word_embeddings"]),
                    use_rope_scaling=params["rope_type"] == "llama3")
        if args["use_rope_scaling"]:
            refuse([f"llama3 rope scaling without {key}" for _, key in LLAMA3 if key not in params], where)
            args.update({name: params[key] for name, key in LLAMA3})
        return args

    def unsupported(self, cfg: Dict[str, Any], params: Dict[str, Any], positions: int, heads: int,
                    groups: int) -> List[str]:
        """What the layer does not implement, a line each with what it supports."""
        bad = []
        if cfg.get("hidden_act", self.HF_DEFAULTS["hidden_act"]) != "silu":
            bad.append(f"hidden_act = {cfg['hidden_act']!r} (supported: 'silu')")
        if params["rope_type"] not in ROPE_TYPES:
            bad.append(f"rope type {params['rope_type']!r} (supported: {', '.join(ROPE_TYPES)})")
        if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            bad.append("partial_rotary_factor != 1 (supported: 1)")
        bad += [f"{key} = true (supported: false)" for key in ("attention_bias", "mlp_bias") if cfg.get(key)]
        window = self.window(cfg)
        if window is not None and window < positions:
            bad.append(f"sliding_window = {window} is shorter than max_position_embeddings {positions} (supported: "
                       f"full attention; a window at least as long as the sequence)")
        if heads % groups:
            bad.append(f"num_key_value_heads {groups} does not divide num_attention_heads {heads}")
        return bad

    # ---- configuration -> config.json --------------------------------------------------------------------
    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        """config.json of the exported folder (transformers 4.x keys for the rope, read by 4.x and 5.x)."""
        scaling = None
        if config.rope_scaling_factor is not None:
            scaling = dict(rope_type="llama3", factor=config.rope_scaling_factor,
                           low_freq_factor=config.rope_low_freq_factor, high_freq_factor=config.rope_high_freq_factor,
                           original_max_position_embeddings=config.rope_original_max_positions)
        return {**self.head(rows, ids), **self.write_fields(config), "num_key_value_heads": config.num_query_groups,
                "head_dim": config.kv_channels, "hidden_act": "silu", "rope_theta": config.rotary_base,
                "rope_scaling": scaling, "tie_word_embeddings": config.tie_word_embeddings, **self.EXPORT}

    # ---- tensors -----------------------------------------------------------------------------------------
    def rules(self, config) -> List[Rule]:
        rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
        for i in range(config.num_layers):
            rules += self.layer_rules(config, f"layers.{i}", f"model.layers.{i}")
        rules.append(Rule("final_layernorm.weight", ("model.norm.weight",)))
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def layer_rules(self, config, ours: str, theirs: str) -> List[Rule]:
        qkv = (config.num_attention_heads, config.num_query_groups, config.num_query_groups)
        attn = f"{theirs}.self_attn"
        rules = [*self.norm_rules(ours, theirs),
                 Rule(f"{ours}.self_attention.query_key_value.weight",
                      (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), sizes=qkv),
                 Rule(f"{ours}.self_attention.dense.weight", (f"{attn}.o_proj.weight",)),
                 Rule(f"{ours}.mlp.dense_h_to_4h.weight", (f"{theirs}.mlp.gate_proj.weight",
                                                            f"{theirs}.mlp.up_proj.weight")),
                 Rule(f"{ours}.mlp.dense_4h_to_h.weight", (f"{theirs}.mlp.down_proj.weight",))]
        if config.add_qkv_bias:
            rules.append(Rule(f"{ours}.self_attention.query_key_value.bias",
                              (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), sizes=qkv))
        return rules

    def norm_rules(self, ours: str, theirs: str) -> List[Rule]:
        """The layer's two hidden-size norms: before the attention and before the MLP (pre-norm)."""
        return [Rule(f"{ours}.input_layernorm.weight", (f"{theirs}.input_layernorm.weight",)),
                Rule(f"{ours}.post_attention_layernorm.weight", (f"{theirs}.post_attention_layernorm.weight",))]


class Mistral(Llama):
    hf_model_type, architecture = "mistral", "MistralForCausalLM"
    default = False  # Llama's layer: exported as Mistral only when imported from it
    EXPORT = dict(sliding_window=None, use_sliding_window=False)
    HF_DEFAULTS = {**Llama.HF_DEFAULTS, "max_position_embeddings": 131072, "sliding_window": 4096}  # MistralConfig


class Qwen2(Llama):
    hf_model_type, architecture = "qwen2", "Qwen2ForCausalLM"
    qkv_bias = True
    EXPORT = dict(sliding_window=None, use_sliding_window=False)
    HF_DEFAULTS = {**Llama.HF_DEFAULTS, "max_position_embeddings": 32768}  # transformers' Qwen2Config

    def window(self, cfg: Dict[str, Any]) -> Optional[int]:
        return cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
