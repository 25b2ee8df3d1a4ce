"""Megatron-LM's saved arguments (and, where the files record none, the weights' shapes and the import flags) ->
the saved arguments of this project's GPT that computes the same function.

Megatron-LM's MLP activation. Megatron-LM computes GELU with erf (F.gelu) unless --openai-gelu (tanh, GPT-2's);
but its fused bias-GELU kernel (--bias-gelu-fusion, on by default with biases since late 2020) is the tanh
approximation, and it replaces F.gelu whenever it runs. So: --openai-gelu -> tanh; --onnx-safe -> erf; the fused
kernel with biases -> tanh; otherwise erf. Files without arguments (2019's Megatron-LM: its GELU is the tanh
approximation; DeepSpeedExamples v1.1.5, CPM-Pretrain: their Megatron fuses bias and GELU by default) -> tanh. `--gelu` overrides all of it.

Megatron-LM's --qk-layernorm (Megatron core's q_layernorm / k_layernorm: a norm of --normalization's kind over
each query and key head, after the projection and before the rotation; Qwen3's) is this project's --qk-layernorm,
the same tensor names. Options this project's GPT does not implement are refused in one line naming the argument
(mixture of experts, the L2 query-key norm, post-layer-norm residuals, LayerNorm 1p, interleaved rotary,
multi-latent attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.errors import UserError
from .source import QKV, layer_count

# (argument, value that is refused or a test on it, what it is)
REFUSED = (("num_experts", lambda v: v not in (None, 0, 1), "mixture of experts"),
           ("qk_l2_norm", bool, "L2-normalised queries and keys (--qk-l2-norm)"),
           ("apply_residual_connection_post_layernorm", bool, "residuals after the layer norm"),
           ("apply_layernorm_1p", bool, "LayerNorm with weight + 1 (--apply-layernorm-1p)"),
           ("rotary_interleaved", bool, "interleaved rotary channels"),
           ("multi_latent_attention", bool, "multi-latent attention"),
           ("squared_relu", bool, "squared ReLU"),
           ("position_embedding_type", lambda v: v not in (None, "learned_absolute", "rope", "none"),
            "positions other than learned_absolute, rope or none"))


@dataclass
class ImportOptions:
    """The import-megatron flags that fill in or override what the files say."""
    num_attention_heads: Optional[int] = None  # files without arguments do not record it
    vocab_size: Optional[int] = None           # the tokenizer's ids (default: every row of the source's table)
    gelu: Optional[str] = None                 # 'tanh' | 'erf'
    qkv_order: Optional[str] = None            # '0' | '1' | '2'


def gelu_of(margs: Dict[str, Any], bias: bool) -> Tuple[str, str]:
    """(gelu, why) for Megatron-LM's arguments (see the module docstring)."""
    if not margs:
        return "tanh", ("no arguments recorded; 2019's Megatron-LM computes GELU with the tanh approximation, and "
                        "DeepSpeedExamples' and CPM-Pretrain's Megatron fuse bias and GELU by default (the same); "
                        "--gelu erf for a run with --no-bias-gelu-fusion")
    if margs.get("openai_gelu"):
        return "tanh", "--openai-gelu"
    if margs.get("onnx_safe"):
        return "erf", "--onnx-safe (erf GELU)"
    if margs.get("bias_gelu_fusion") and bias:
        return "tanh", "the fused bias-GELU kernel (--bias-gelu-fusion, on by default), the tanh approximation"
    return "erf", "Megatron-LM's F.gelu (no --openai-gelu, no fused bias-GELU)"


def _shape_facts(parts: Dict[str, List[torch.Tensor]]) -> Dict[str, Any]:
    """What the weights say: per-tp-rank parts summed along Megatron's partition dims (one part: global)."""
    def rows(name):
        return sum(p.size(0) for p in parts[name])
    word, pos = "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"
    return dict(layers=layer_count(parts), hidden=parts[word][0].size(1), rows=rows(word),
                positions=parts[pos][0].size(0) if pos in parts else None, qkv_rows=rows(f"layers.0.{QKV}.weight"),
                ffn_in=rows("layers.0.mlp.dense_h_to_4h.weight"),
                ffn=sum(p.size(1) for p in parts["layers.0.mlp.dense_4h_to_h.weight"]),
                linear_bias="layers.0.mlp.dense_4h_to_h.bias" in parts, qkv_bias=f"layers.0.{QKV}.bias" in parts,
                norm_bias="final_layernorm.bias" in parts, untied="lm_head.weight" in parts,
                qk_norm="layers.0.self_attention.q_layernorm.weight" in parts)


def gpt_args(margs: Dict[str, Any], parts: Dict[str, List[torch.Tensor]], opts: ImportOptions,
             where: str) -> Tuple[Dict[str, Any], str]:
    """(saved arguments of the equivalent GPT, why its GELU is what it is); `parts` as `Source.parts`."""
    bad = [f"{what} ({name} = {margs[name]!r})" for name, test, what in REFUSED if test(margs.get(name))]
    if bad:
        raise UserError(f"{where}: {'; '.join(bad)}: this project's GPT does not implement it")
    missing = [n for n in ("embedding.word_embeddings.weight", f"layers.0.{QKV}.weight",
                           "layers.0.mlp.dense_h_to_4h.weight", "layers.0.mlp.dense_4h_to_h.weight") if n not in parts]
    if missing:
        raise UserError(f"{where} has no {missing[0]} (in Megatron-LM's names); it is not a GPT checkpoint of a "
                        f"format import-megatron knows")
    f = _shape_facts(parts)
    heads = margs.get("num_attention_heads") or opts.num_attention_heads
    if not heads:
        raise UserError(f"{where} records no arguments (2019's Megatron-LM, DeepSpeedExamples v1.1.5 and CPM-Pretrain "
                        f"save none): give --num-attention-heads N (the heads of the run that wrote it)")
    hidden = f["hidden"]
    if margs.get("hidden_size", hidden) != hidden or margs.get("num_layers", f["layers"]) != f["layers"]:
        raise UserError(f"{where}: the arguments say {margs.get('num_layers')} layers of width "
                        f"{margs.get('hidden_size')}, the weights hold {f['layers']} of width {hidden}")
    kv = margs.get("kv_channels") or hidden // heads
    groups = margs.get("num_query_groups") if margs.get("group_query_attention") else None
    groups = groups or (f["qkv_rows"] // kv - heads) // 2
    swiglu = bool(margs["swiglu"]) if "swiglu" in margs else f["ffn_in"] == 2 * f["ffn"]
    positions = margs.get("position_embedding_type") or ("rope" if margs.get("use_rotary_position_embeddings")
                                                         else "learned_absolute" if f["positions"] else "none")
    if (positions == "learned_absolute") != (f["positions"] is not None):
        raise UserError(f"{where}: position embeddings {positions!r} but the weights "
                        f"{'have' if f['positions'] else 'lack'} a position table")
    bias = bool(margs.get("add_bias_linear", f["linear_bias"]))
    gelu, why = (opts.gelu, "--gelu") if opts.gelu else gelu_of(margs, bias)
    seq = margs.get("seq_length") or margs.get("max_position_embeddings") or f["positions"]
    max_pos = f["positions"] or max(margs.get("max_position_embeddings") or 0, seq or 0)
    vocab = opts.vocab_size or margs.get("vocab_size") or f["rows"]
    if vocab > f["rows"]:
        raise UserError(f"--vocab-size {vocab} is larger than the {f['rows']} rows of the source's word table")
    args = dict(model_type="gpt", num_layers=f["layers"], hidden_size=hidden, num_attention_heads=heads,
                kv_channels=kv, ffn_hidden_size=f["ffn"], max_position_embeddings=max_pos, seq_length=seq,
                encoder_seq_length=seq, decoder_seq_length=seq,
                layernorm_epsilon=margs.get("layernorm_epsilon") or margs.get("norm_epsilon") or 1e-5,
                init_method_std=margs.get("init_method_std", 0.02), hidden_dropout=margs.get("hidden_dropout", 0.1),
                attention_dropout=margs.get("attention_dropout", 0.1), position_embedding_type=positions,
                normalization=margs.get("normalization") or ("LayerNorm" if f["norm_bias"] else "RMSNorm"),
                swiglu=swiglu, group_query_attention=groups != heads,
                num_query_groups=groups if groups != heads else None, disable_bias_linear=not bias,
                add_qkv_bias=f["qkv_bias"] and not bias, gelu=gelu, vocab_size=vocab,
                untie_embeddings_and_output_weights=bool(margs.get("untie_embeddings_and_output_weights")
                                                         or f["untied"]),
                qk_layernorm=bool(margs.get("qk_layernorm") or f["qk_norm"]))
    if positions == "rope":
        args.update(rotary_base=float(margs.get("rotary_base") or 10000), rotary_percent=margs.get("rotary_percent")
                    or 1.0)
        if margs.get("use_rope_scaling"):  # Megatron-LM's llama3 scaling: fixed factors but the first
            args.update(use_rope_scaling=True, rope_scaling_factor=float(margs.get("rope_scaling_factor") or 8.0),
                        rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                        rope_scaling_original_max_position_embeddings=8192)
    return args, why
