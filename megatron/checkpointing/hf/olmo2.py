"""Hugging Face's OLMo-2 (Olmo2ForCausalLM) <-> this project's GPT with the Llama-family layer, --qk-layernorm-full
and --post-sublayer-norm (transformers' Olmo2Attention and Olmo2DecoderLayer):

    q = q_norm(q_proj(x)), k = k_norm(k_proj(x))    an RMSNorm over each token's whole projection (heads x
                                                    head_dim; groups x head_dim for the keys), before the rotation
    h = x + post_attention_layernorm(attention(x))  the norms on the sublayers' outputs, none before them
    y = h + post_feedforward_layernorm(mlp(h))

    config.json (Olmo2Config)                   project
        the Llama family's keys (llama.py)      the Llama family's arguments (head_dim: transformers reads it when
                                                present, else hidden / heads; export writes it)
        (the architecture)                      qk_layernorm_full = True, post_sublayer_norm = True

    tensors: the Llama family's (llama.py) but the layer's norms
        model.layers.i.self_attn.q_norm             layers.i.self_attention.q_layernorm  (heads x head_dim, split
        model.layers.i.self_attn.k_norm             layers.i.self_attention.k_layernorm   over tp with the heads)
        model.layers.i.post_attention_layernorm     layers.i.post_self_attn_layernorm
        model.layers.i.post_feedforward_layernorm   layers.i.post_mlp_layernorm

OLMo-2 has no sliding window and no biases (attention_bias = true is refused, as for Llama).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .base import Rule
from .llama import Llama


class Olmo2(Llama):
    hf_model_type, architecture = "olmo2", "Olmo2ForCausalLM"
    EXPORT = dict(attention_bias=False)
    HF_DEFAULTS = {**Llama.HF_DEFAULTS, "rms_norm_eps": 1e-5}  # transformers' Olmo2Config

    def window(self, cfg: Dict[str, Any]) -> Optional[int]:
        return None  # Olmo2Attention attends over the whole sequence

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        return dict(super().project_args(cfg, where), qk_layernorm_full=True, post_sublayer_norm=True)

    def layer_rules(self, config, ours: str, theirs: str) -> List[Rule]:
        return super().layer_rules(config, ours, theirs) + self.qk_norm_rules(ours, theirs)

    @staticmethod
    def qk_norm_rules(ours: str, theirs: str) -> List[Rule]:
        """The whole-projection query / key norms (OLMo-2's, OLMoE's)."""
        attn, mine = f"{theirs}.self_attn", f"{ours}.self_attention"
        return [Rule(f"{mine}.q_layernorm.weight", (f"{attn}.q_norm.weight",)),
                Rule(f"{mine}.k_layernorm.weight", (f"{attn}.k_norm.weight",))]

    def norm_rules(self, ours: str, theirs: str) -> List[Rule]:
        return [Rule(f"{ours}.post_self_attn_layernorm.weight", (f"{theirs}.post_attention_layernorm.weight",)),
                Rule(f"{ours}.post_mlp_layernorm.weight", (f"{theirs}.post_feedforward_layernorm.weight",))]
