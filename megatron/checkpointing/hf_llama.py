"""Hugging Face's Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) <-> this project's GPT
with the Llama-family layer: config.json <-> saved arguments, and the name table.

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

Both config layouts are read: transformers 5's `rope_parameters` and 4's `rope_theta` / `rope_scaling`; export
writes the 4.x keys, which both read. Options the layer does not implement (another rope type, attention or
MLP biases where the architecture has none, a sliding window shorter than the longest sequence, partial
rotary) are one line naming the field and what is supported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from megatron.errors import UserError
from megatron.model.specs.gpt import LAYER_SWITCHES

if TYPE_CHECKING:  # config.json <-> arguments import without torch (tools/plan_layout.py --hf-config)
    from .hf_names import Rule

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "llama3")
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
LLAMA_FLAGS = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, disable_bias_linear=True)


def is_llama_family(args: Dict[str, Any]) -> bool:
    """Whether saved arguments describe a GPT with the Llama-family layer (exported as one of ARCHITECTURES)."""
    return args.get("model_type") == "gpt" and args.get("position_embedding_type") == "rope"


def _rope(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """{rope_type, rope_theta, factor, ...} from either config layout."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _refuse(bad: List[str], where: str) -> None:
    if bad:
        raise UserError(f"{where}: {'; '.join(bad)}")


def llama_args(cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
    """config.json of a Llama / Mistral / Qwen2 folder -> the saved arguments of an equivalent GPT."""
    kind = cfg.get("model_type")
    missing = [k for k in REQUIRED if not isinstance(cfg.get(k), int) or cfg[k] < 1]
    _refuse([f"no positive integer {k}" for k in missing], where)
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    positions = cfg.get("max_position_embeddings", 2048)
    rope = _rope(cfg)
    bad = []
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act = {cfg['hidden_act']!r} (supported: 'silu')")
    if rope["rope_type"] not in ROPE_TYPES:
        bad.append(f"rope type {rope['rope_type']!r} (supported: {', '.join(ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append("partial_rotary_factor != 1 (supported: 1)")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            bad.append(f"{key} = true (supported: false)")
    window = cfg.get("sliding_window")
    if kind == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if window is not None and window < positions:
        bad.append(f"sliding_window = {window} is shorter than max_position_embeddings {positions} (supported: "
                   f"full attention; a window at least as long as the sequence)")
    if heads % groups:
        bad.append(f"num_key_value_heads {groups} does not divide num_attention_heads {heads}")
    _refuse(bad, where)
    args = dict(model_type="gpt", hf_architecture=ARCHITECTURES[kind], num_layers=cfg["num_hidden_layers"],
                hidden_size=h, num_attention_heads=heads, kv_channels=head_dim,
                ffn_hidden_size=cfg["intermediate_size"], max_position_embeddings=positions, seq_length=positions,
                encoder_seq_length=positions, decoder_seq_length=positions,
                layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6), init_method_std=cfg.get("initializer_range", 0.02),
                hidden_dropout=0.0, attention_dropout=cfg.get("attention_dropout", 0.0), **LLAMA_FLAGS,
                add_qkv_bias=kind == "qwen2", group_query_attention=True, num_query_groups=groups,
                rotary_base=float(rope["rope_theta"]),
                rotary_percent=1.0, untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
                use_rope_scaling=rope["rope_type"] == "llama3")
    if args["use_rope_scaling"]:
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        _refuse([f"llama3 rope scaling without {k}" for k in keys if k not in rope], where)
        args.update(rope_scaling_factor=rope["factor"], rope_scaling_low_freq_factor=rope["low_freq_factor"],
                    rope_scaling_high_freq_factor=rope["high_freq_factor"],
                    rope_scaling_original_max_position_embeddings=rope["original_max_position_embeddings"])
    return args


def export_architecture(args: Dict[str, Any]) -> str:
    """The HF model_type a Llama-family checkpoint exports as: the imported one, else Qwen2 with a qkv bias and
    Llama without; one line naming each option no architecture of the family has."""
    bad = [f"{flag} {value}" for flag, value, ok in (
        ("--normalization", args.get("normalization"), args.get("normalization") == "RMSNorm"),
        ("--swiglu", "off", args.get("swiglu")),
        ("biases", "in every linear layer (no --disable-bias-linear)", args.get("disable_bias_linear")),
        ("--rotary-percent", args.get("rotary_percent"), args.get("rotary_percent", 1.0) == 1.0)) if not ok]
    _refuse([f"{b} (the Llama family needs RMSNorm, SwiGLU, no biases but Qwen2's qkv bias, full rotary)"
             for b in bad], "export-hf")
    _refuse([f"{flag} (no layer of {', '.join(ARCHITECTURES.values())} has it)"
             for name, flag in LAYER_SWITCHES.items() if args.get(name)], "export-hf")
    imported = {v: k for k, v in ARCHITECTURES.items()}.get(args.get("hf_architecture"))
    kind = imported or ("qwen2" if args.get("add_qkv_bias") else "llama")
    if (kind == "qwen2") != bool(args.get("add_qkv_bias")):
        raise UserError(f"export-hf: the checkpoint was imported from {ARCHITECTURES[kind]} but "
                        f"--add-qkv-bias is {'off' if kind == 'qwen2' else 'on'}")
    return kind


def llama_hf_config(args: Dict[str, Any], rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
    """config.json of the exported folder (transformers 4.x keys for the rope, read by 4.x and 5.x)."""
    kind = export_architecture(args)
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    rope_scaling = None
    if args.get("use_rope_scaling"):
        rope_scaling = dict(rope_type="llama3", factor=args["rope_scaling_factor"],
                            low_freq_factor=args["rope_scaling_low_freq_factor"],
                            high_freq_factor=args["rope_scaling_high_freq_factor"],
                            original_max_position_embeddings=args["rope_scaling_original_max_position_embeddings"])
    config = {"architectures": [ARCHITECTURES[kind]], "model_type": kind, "vocab_size": rows,
              "hidden_size": args["hidden_size"], "intermediate_size": args["ffn_hidden_size"],
              "num_hidden_layers": args["num_layers"], "num_attention_heads": heads, "num_key_value_heads": groups,
              "head_dim": args["kv_channels"], "hidden_act": "silu",
              "max_position_embeddings": args["max_position_embeddings"], "rms_norm_eps": args["layernorm_epsilon"],
              "rope_theta": args.get("rotary_base", 10000.0), "rope_scaling": rope_scaling,
              "attention_dropout": args["attention_dropout"], "initializer_range": args.get("init_method_std", 0.02),
              "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False), **ids}
    if kind == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(sliding_window=None, use_sliding_window=False)
    return config


def llama_rules(args: Dict[str, Any]) -> List[Rule]:
    from .hf_names import Rule
    heads = args["num_attention_heads"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    qkv = (heads, groups, groups)
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))]
    for i in range(args["num_layers"]):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        attn = f"{theirs}.self_attn"
        rules += [Rule(f"{ours}.input_layernorm.weight", (f"{theirs}.input_layernorm.weight",)),
                  Rule(f"{ours}.self_attention.query_key_value.weight",
                       (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), sizes=qkv),
                  Rule(f"{ours}.self_attention.dense.weight", (f"{attn}.o_proj.weight",)),
                  Rule(f"{ours}.post_attention_layernorm.weight", (f"{theirs}.post_attention_layernorm.weight",)),
                  Rule(f"{ours}.mlp.dense_h_to_4h.weight", (f"{theirs}.mlp.gate_proj.weight",
                                                             f"{theirs}.mlp.up_proj.weight")),
                  Rule(f"{ours}.mlp.dense_4h_to_h.weight", (f"{theirs}.mlp.down_proj.weight",))]
        if args.get("add_qkv_bias"):
            rules.append(Rule(f"{ours}.self_attention.query_key_value.bias",
                              (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), sizes=qkv))
    rules.append(Rule("final_layernorm.weight", ("model.norm.weight",)))
    if args.get("untie_embeddings_and_output_weights"):
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return rules
