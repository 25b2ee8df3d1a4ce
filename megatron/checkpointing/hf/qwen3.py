"""Hugging Face's Qwen3 (Qwen3ForCausalLM) <-> this project's GPT with the Llama-family layer and --qk-layernorm:
an RMSNorm over each query and key head's head_dim channels, one weight (head_dim) shared by the heads, after the
projection and before the rotation (transformers' Qwen3Attention). No qkv bias (Qwen2's is gone); head_dim is its
own key, often not hidden / heads (Qwen3-0.6B: 1024 / 16 heads, head_dim 128); tied (the small ones) or untied.

    config.json (Qwen3Config)                   project
        the Llama family's keys (llama.py)      the Llama family's arguments
        (the architecture)                      qk_layernorm = True
        use_sliding_window, sliding_window,     refused where a layer's window is shorter than the positions
        max_window_layers, layer_types

    tensors: the Llama family's (llama.py), and per layer
        model.layers.i.self_attn.q_norm         layers.i.self_attention.q_layernorm   (head_dim, replicated over tp)
        model.layers.i.self_attn.k_norm         layers.i.self_attention.k_layernorm
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from .base import Rule
from .llama import Llama


class Qwen3(Llama):
    hf_model_type, architecture = "qwen3", "Qwen3ForCausalLM"
    EXPORT = dict(attention_bias=False, sliding_window=None, use_sliding_window=False)
    HF_DEFAULTS = {**Llama.HF_DEFAULTS, "max_position_embeddings": 32768, "sliding_window": 4096,
                   "max_window_layers": 28}  # transformers' Qwen3Config

    def window(self, cfg: Dict[str, Any]) -> Optional[int]:
        """Qwen3Config: with use_sliding_window, the layers that `layer_types` names sliding_attention (default:
        those from max_window_layers on) attend within sliding_window."""
        if not cfg.get("use_sliding_window", False):
            return None
        first = cfg.get("max_window_layers", self.HF_DEFAULTS["max_window_layers"])
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        return cfg.get("sliding_window", self.HF_DEFAULTS["sliding_window"]) if "sliding_attention" in types else None

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        return dict(super().project_args(cfg, where), qk_layernorm=True)

    def layer_rules(self, config, ours: str, theirs: str) -> List[Rule]:
        attn, mine = f"{theirs}.self_attn", f"{ours}.self_attention"
        return super().layer_rules(config, ours, theirs) + [
            Rule(f"{mine}.q_layernorm.weight", (f"{attn}.q_norm.weight",)),
            Rule(f"{mine}.k_layernorm.weight", (f"{attn}.k_norm.weight",))]
