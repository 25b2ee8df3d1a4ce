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
(the L2 query-key norm, post-layer-norm residuals, LayerNorm 1p, interleaved rotary, multi-latent attention).

Megatron core's mixture of experts (`moe_args`): which layers hold experts, the number of experts and the widths
of the routed and shared experts are read from the weights (a layer with a router is a MoE layer; Megatron-LM's
--moe-layer-freq, int or list, says the same); the routing from the arguments, Megatron-LM's names and defaults:
--moe-router-topk (2), --moe-router-score-function (softmax), --moe-router-pre-softmax,
--moe-router-topk-scaling-factor; the shared expert's gate where core stored `gate_weight`. Refused in one line:
experts with biases or without SwiGLU, grouped routing (--moe-router-num-groups), the expert bias
(--moe-router-enable-expert-bias: its buffer is not carried), probabilities applied on the experts' input.
Training choices (balancing losses, capacity, dispatcher, router dtype) are not carried: give them when training.
Experts are read from Megatron core's torch_dist only; arguments with --num-experts whose weights hold no router
(Megatron-LM's legacy MoE) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron.errors import UserError
from .source import QKV, layer_count

# (argument, value that is refused or a test on it, what it is)
REFUSED = (("qk_l2_norm", bool, "L2-normalised queries and keys (--qk-l2-norm)"),
           ("apply_residual_connection_post_layernorm", bool, "residuals after the layer norm"),
           ("apply_layernorm_1p", bool, "LayerNorm with weight + 1 (--apply-layernorm-1p)"),
           ("rotary_interleaved", bool, "interleaved rotary channels"),
           ("multi_latent_attention", bool, "multi-latent attention"),
           ("squared_relu", bool, "squared ReLU"),
           ("position_embedding_type", lambda v: v not in (None, "learned_absolute", "rope", "none"),
            "positions other than learned_absolute, rope or none"))
MOE_REFUSED = (("moe_router_num_groups", bool, "group-limited routing (--moe-router-num-groups)"),
               ("moe_router_enable_expert_bias", bool, "the aux-loss-free expert bias (its buffer is not carried)"),
               ("moe_apply_probs_on_input", bool, "routing probabilities applied on the experts' input"),
               ("moe_router_score_function", lambda v: v not in (None, "softmax", "sigmoid"),
                "router scores other than softmax or sigmoid"),
               ("add_bias_linear", bool, "experts with biases (--add-bias-linear)"))
ROUTER, FC1, FC2 = "mlp.moe.router.weight", "mlp.moe.experts.linear_fc1", "mlp.moe.experts.linear_fc2"


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
    """What the weights say: per-tp-rank parts summed along Megatron's partition dims (one part: global). The MLP's
    widths are the first dense layer's (a model whose every layer holds experts: its experts', ffn None)."""
    def rows(name):
        return sum(p.size(0) for p in parts[name])
    word, pos = "embedding.word_embeddings.weight", "embedding.position_embeddings.weight"
    layers = layer_count(parts)
    dense = next((i for i in range(layers) if f"layers.{i}.mlp.dense_h_to_4h.weight" in parts), None)
    if dense is not None:
        ffn_in, ffn = rows(f"layers.{dense}.mlp.dense_h_to_4h.weight"), sum(
            p.size(1) for p in parts[f"layers.{dense}.mlp.dense_4h_to_h.weight"])
    else:
        ffn_in, ffn = parts[f"layers.0.{FC1}"][0].size(1), None  # (E, 2f, h)
    return dict(layers=layers, hidden=parts[word][0].size(1), rows=rows(word),
                positions=parts[pos][0].size(0) if pos in parts else None, qkv_rows=rows(f"layers.0.{QKV}.weight"),
                ffn_in=ffn_in, ffn=ffn, linear_bias=f"layers.{dense}.mlp.dense_4h_to_h.bias" in parts,
                qkv_bias=f"layers.0.{QKV}.bias" in parts, norm_bias="final_layernorm.bias" in parts,
                untied="lm_head.weight" in parts, qk_norm="layers.0.self_attention.q_layernorm.weight" in parts)


def moe_args(margs: Dict[str, Any], parts: Dict[str, List[torch.Tensor]], layers: int,
             where: str) -> Dict[str, Any]:
    """This project's --num-experts and --moe-* arguments (the architecture's, `MoEConfig.architecture`) of
    Megatron core's MoE layers (module docstring); {} for a dense model."""
    pattern = [int(f"layers.{i}.{ROUTER}" in parts) for i in range(layers)]
    if not any(pattern):
        return {}
    bad = [f"{what} ({name} = {margs[name]!r})" for name, test, what in MOE_REFUSED if test(margs.get(name))]
    if bad:
        raise UserError(f"{where}: mixture of experts with {'; '.join(bad)}: this project's MoE layer does not "
                        f"implement it")
    first = pattern.index(1)
    experts = parts[f"layers.{first}.{ROUTER}"][0].size(0)
    fc1, fc2 = parts[f"layers.{first}.{FC1}"][0], parts[f"layers.{first}.{FC2}"][0]  # (E, 2f, h), (E, h, f)
    if margs.get("num_experts", experts) != experts or fc1.size(1) != 2 * fc2.size(2):
        raise UserError(f"{where}: the experts are {experts} of (E, rows, h) {tuple(fc1.shape)}, "
                        f"{tuple(fc2.shape)} (arguments: --num-experts {margs.get('num_experts')}, --swiglu "
                        f"{margs.get('swiglu')}); this project's experts are SwiGLU MLPs, linear_fc1 twice the "
                        f"rows of linear_fc2's columns")
    shared = parts.get(f"layers.{first}.mlp.moe.shared_expert.linear_fc2")  # (h, s)
    return dict(num_experts=experts, moe_ffn_hidden_size=fc2.size(2),
                moe_layer_freq="1" if all(pattern) else str(pattern).replace(" ", ""),
                moe_router_topk=margs.get("moe_router_topk") or 2,
                moe_router_score_function=margs.get("moe_router_score_function") or "softmax",
                moe_router_pre_softmax=bool(margs.get("moe_router_pre_softmax")) or None,  # switches: set or None
                moe_router_topk_scaling_factor=margs.get("moe_router_topk_scaling_factor"),
                moe_shared_expert_intermediate_size=shared[0].size(1) if shared else None,
                moe_shared_expert_gate=f"layers.{first}.mlp.moe.shared_gate.weight" in parts or None)


def gpt_args(margs: Dict[str, Any], parts: Dict[str, List[torch.Tensor]], opts: ImportOptions,
             where: str) -> Tuple[Dict[str, Any], str]:
    """(saved arguments of the equivalent GPT, why its GELU is what it is); `parts` as `Source.parts`."""
    bad = [f"{what} ({name} = {margs[name]!r})" for name, test, what in REFUSED if test(margs.get(name))]
    experts_unread = margs.get("num_experts") and not any(n.endswith(ROUTER) for n in parts)
    if experts_unread:  # Megatron-LM's legacy MoE names (or none): only core's torch_dist ones are read
        bad.insert(0, f"mixture of experts (num_experts = {margs['num_experts']!r})")
    if bad:
        raise UserError(f"{where}: {'; '.join(bad)}: this project's GPT does not implement it"
                        + (" (import-megatron reads the experts of Megatron core's torch_dist checkpoints)"
                           if experts_unread else ""))
    mlp = ((f"layers.0.{ROUTER}", f"layers.0.{FC1}", f"layers.0.{FC2}") if f"layers.0.{ROUTER}" in parts else
           ("layers.0.mlp.dense_h_to_4h.weight", "layers.0.mlp.dense_4h_to_h.weight"))
    missing = [n for n in ("embedding.word_embeddings.weight", f"layers.0.{QKV}.weight") + mlp if n not in parts]
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
    moe = moe_args(margs, parts, f["layers"], where)
    ffn = f["ffn"] or margs.get("ffn_hidden_size") or moe["moe_ffn_hidden_size"]
    swiglu = bool(margs["swiglu"]) if "swiglu" in margs else f["ffn_in"] == 2 * ffn
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
                kv_channels=kv, ffn_hidden_size=ffn, max_position_embeddings=max_pos, seq_length=seq,
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
                qk_layernorm=bool(margs.get("qk_layernorm") or f["qk_norm"]), **moe)
    if positions == "rope":
        args.update(rotary_base=float(margs.get("rotary_base") or 10000), rotary_percent=margs.get("rotary_percent")
                    or 1.0)
        if margs.get("use_rope_scaling"):  # Megatron-LM's llama3 scaling: fixed factors but the first
            args.update(use_rope_scaling=True, rope_scaling_factor=float(margs.get("rope_scaling_factor") or 8.0),
                        rope_scaling_low_freq_factor=1.0, rope_scaling_high_freq_factor=4.0,
                        rope_scaling_original_max_position_embeddings=8192)
    return args, why
