"""Hugging Face's mixtures of experts <-> this project's GPT with the Llama-family layer and MoE MLPs
(megatron/model/moe.py): Mixtral (MixtralForCausalLM), Qwen2-MoE (Qwen2MoeForCausalLM) and Qwen3-MoE
(Qwen3MoeForCausalLM: Qwen3's layer, its per-head query / key norms, with Qwen-MoE's experts and no shared one) and
OLMoE (OlmoeForCausalLM: the Llama family's layer with OLMo-2's whole-projection query / key norms, --qk-layernorm-full,
before the rotation, and Qwen-MoE's experts in every layer, no shared one).

    config.json                                  project
        num_local_experts / num_experts          num_experts (either key)
        num_experts_per_tok                      moe_router_topk
        Mixtral, OLMoE: intermediate_size        moe_ffn_hidden_size (= ffn_hidden_size: every layer is MoE)
        Qwen-MoE: moe_intermediate_size,         moe_ffn_hidden_size, ffn_hidden_size (the dense layers'),
            intermediate_size
        Qwen-MoE, OLMoE: norm_topk_prob          not moe_router_pre_softmax (renormalized top-k = softmax of the
                                                 top-k logits; otherwise the softmax over all experts, top-k of it)
        Qwen-MoE: decoder_sparse_step,           moe_layer_freq as a list: layer i (0-based) holds experts when
            mlp_only_layers                      (i + 1) % step == 0 and i is not in mlp_only_layers
        Qwen2-MoE: shared_expert_intermediate_size   moe_shared_expert_intermediate_size, moe_shared_expert_gate
        router_jitter_noise (Mixtral)            refused unless 0 (training noise this layer does not add)
        clip_qkv (OLMoE)                         refused unless null (a clamp of q, k, v this layer does not apply;
                                                 OLMoE-1B-7B's is null)

    tensors of a MoE layer i (x = model.layers.i.block_sparse_moe (Mixtral) or model.layers.i.mlp (Qwen-MoE, OLMoE))
        x.gate                                   layers.i.mlp.moe.router
        x.experts.e.w1 / w3  (gate_proj / up_proj)   layers.i.mlp.moe.experts.linear_fc1[e] rows [gate; up]
        x.experts.e.w2  (down_proj)              layers.i.mlp.moe.experts.linear_fc2[e]
        x.shared_expert.gate_proj / up_proj / down_proj, x.shared_expert_gate   the shared expert (Qwen2-MoE)

Import reads either on-disk layout: the per-expert tensors that `save_pretrained` writes, or the fused ones newer
checkpoints ship (`model.layers.i.mlp.experts.gate_up_proj` (E, 2I, H) with the gate rows first and `down_proj`
(E, H, I), the router as `model.layers.i.mlp.gate`); export writes what `save_pretrained` writes, per expert.

The balancing loss is a training choice, not read from config.json: transformers' `router_aux_loss_coef` weighs a
loss k times Megatron's for one layer (and pooled over the layers), so give --moe-aux-loss-coeff yourself.
"""
from __future__ import annotations

from typing import Any, Dict, List

from .base import Rule, refuse
from .llama import Llama, Qwen2
from .olmo2 import Olmo2
from .qwen3 import Qwen3


def _expert_rules(config, ours: str, x: str, fused: str, names: tuple) -> List[Rule]:
    """The router and the stacked experts of one MoE layer: `x` the HF block, `fused` where the fused tensors live,
    `names` the per-expert (gate, up, down) names."""
    experts, (gate, up, down) = config.moe.num_experts, names
    return [Rule(f"{ours}.mlp.moe.router.weight", (f"{x}.gate.weight",), tied=(f"{fused}.gate.weight",)),
            Rule(f"{ours}.mlp.moe.experts.linear_fc1",
                 tuple(f"{x}.experts.{e}.{w}.weight" for e in range(experts) for w in (gate, up)), stack=experts,
                 tied=(f"{fused}.experts.gate_up_proj",)),
            Rule(f"{ours}.mlp.moe.experts.linear_fc2", tuple(f"{x}.experts.{e}.{down}.weight" for e in range(experts)),
                 stack=experts, tied=(f"{fused}.experts.down_proj",))]


class _Experts:
    """What the MoE adapters share: a dense model is not theirs to hold."""

    def cannot_hold(self, config) -> List[str]:
        if getattr(config, "moe", None) is None:
            return ["no experts (--num-experts)"]
        return super().cannot_hold(config)


class Mixtral(_Experts, Llama):
    hf_model_type, architecture = "mixtral", "MixtralForCausalLM"
    EXPORT = dict(sliding_window=None, router_jitter_noise=0.0, output_router_logits=False)
    HF_DEFAULTS = {**Llama.HF_DEFAULTS, "max_position_embeddings": 131072, "rope_theta": 1e6, "num_local_experts": 8,
                   "num_experts_per_tok": 2, "router_jitter_noise": 0.0}  # transformers' MixtralConfig

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        refuse([f"router_jitter_noise = {cfg['router_jitter_noise']} (supported: 0)"]
               if cfg.get("router_jitter_noise") else [], where)
        args = super().project_args(cfg, where)
        experts = cfg.get("num_local_experts", cfg.get("num_experts", self.HF_DEFAULTS["num_local_experts"]))
        args.update(num_experts=experts, moe_ffn_hidden_size=args["ffn_hidden_size"],
                    moe_router_topk=cfg.get("num_experts_per_tok", self.HF_DEFAULTS["num_experts_per_tok"]))
        return args

    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        return {**super().hf_config(config, rows, ids), "num_local_experts": config.moe.num_experts,
                "num_experts_per_tok": config.moe.topk}

    def layer_rules(self, config, ours: str, theirs: str) -> List[Rule]:
        dense = super().layer_rules(config, ours, theirs)
        x = f"{theirs}.block_sparse_moe"
        return [r for r in dense if ".mlp." not in r.canonical] + \
            _expert_rules(config, ours, x, f"{theirs}.mlp", ("w1", "w3", "w2"))


class _QwenExperts(_Experts):
    """Qwen-MoE's experts (Qwen2-MoE, Qwen3-MoE): `mlp.gate`, `mlp.experts.e.gate_proj / up_proj / down_proj`, dense
    layers by decoder_sparse_step and mlp_only_layers, norm_topk_prob, and (Qwen2-MoE) a gated shared expert."""
    shared = False

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        args = super().project_args(cfg, where)
        get = lambda key: cfg.get(key, self.HF_DEFAULTS[key])  # noqa: E731
        step, dense = get("decoder_sparse_step"), set(cfg.get("mlp_only_layers") or [])
        refuse([f"decoder_sparse_step = {step} (supported: >= 1)"] if not isinstance(step, int) or step < 1 else [],
               where)
        pattern = [int((i + 1) % step == 0 and i not in dense) for i in range(args["num_layers"])]
        shared = (cfg.get("shared_expert_intermediate_size", self.HF_DEFAULTS.get("shared_expert_intermediate_size"))
                  if self.shared else None) or None
        experts = cfg.get("num_experts", cfg.get("num_local_experts", self.HF_DEFAULTS["num_experts"]))
        args.update(num_experts=experts, moe_router_topk=get("num_experts_per_tok"),
                    moe_ffn_hidden_size=get("moe_intermediate_size"), moe_layer_freq=str(pattern).replace(" ", ""),
                    moe_router_pre_softmax=not get("norm_topk_prob"), moe_shared_expert_intermediate_size=shared,
                    moe_shared_expert_gate=bool(shared))
        return args

    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        moe = config.moe
        pattern = moe.layer_pattern or (1,) * config.num_layers
        out = {**super().hf_config(config, rows, ids), "num_experts": moe.num_experts,
               "num_experts_per_tok": moe.topk, "moe_intermediate_size": moe.ffn_hidden_size, "decoder_sparse_step": 1,
               "mlp_only_layers": [i for i, v in enumerate(pattern) if not v], "norm_topk_prob": not moe.pre_softmax}
        if self.shared:
            out["shared_expert_intermediate_size"] = moe.shared_ffn_hidden_size or 0
        return out

    def layer_rules(self, config, ours: str, theirs: str) -> List[Rule]:
        dense = super().layer_rules(config, ours, theirs)
        if not config.moe.is_moe_layer(int(ours.split(".")[1]) + 1):
            return dense
        x = f"{theirs}.mlp"
        rules = [r for r in dense if ".mlp." not in r.canonical] + \
            _expert_rules(config, ours, x, x, ("gate_proj", "up_proj", "down_proj"))
        if config.moe.shared_ffn_hidden_size:
            rules += [Rule(f"{ours}.mlp.moe.shared_expert.linear_fc1",
                           (f"{x}.shared_expert.gate_proj.weight", f"{x}.shared_expert.up_proj.weight")),
                      Rule(f"{ours}.mlp.moe.shared_expert.linear_fc2", (f"{x}.shared_expert.down_proj.weight",)),
                      Rule(f"{ours}.mlp.moe.shared_gate.weight", (f"{x}.shared_expert_gate.weight",))]
        return rules


class Qwen2Moe(_QwenExperts, Qwen2):
    hf_model_type, architecture = "qwen2_moe", "Qwen2MoeForCausalLM"
    shared = True
    EXPORT = dict(sliding_window=None, use_sliding_window=False, output_router_logits=False)
    HF_DEFAULTS = {**Qwen2.HF_DEFAULTS, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                   "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                   "norm_topk_prob": False}  # transformers' Qwen2MoeConfig


class Qwen3Moe(_QwenExperts, Qwen3):
    hf_model_type, architecture = "qwen3_moe", "Qwen3MoeForCausalLM"
    EXPORT = dict(Qwen3.EXPORT, output_router_logits=False)
    HF_DEFAULTS = {**Qwen3.HF_DEFAULTS, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                   "decoder_sparse_step": 1, "norm_topk_prob": False}  # transformers' Qwen3MoeConfig


class Olmoe(_Experts, Llama):
    hf_model_type, architecture = "olmoe", "OlmoeForCausalLM"
    EXPORT = dict(attention_bias=False, clip_qkv=None, output_router_logits=False)
    HF_DEFAULTS = {**Llama.HF_DEFAULTS, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "num_experts": 64,
                   "num_experts_per_tok": 8, "norm_topk_prob": False}  # transformers' OlmoeConfig

    def window(self, cfg: Dict[str, Any]):
        return None  # OlmoeAttention attends over the whole sequence

    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        clip = cfg.get("clip_qkv")
        refuse([f"clip_qkv = {clip} (supported: null)"] if clip is not None else [], where)
        args = super().project_args(cfg, where)
        get = lambda key: cfg.get(key, self.HF_DEFAULTS[key])  # noqa: E731
        args.update(qk_layernorm_full=True, num_experts=cfg.get("num_experts", cfg.get("num_local_experts",
                                                                                        get("num_experts"))),
                    moe_ffn_hidden_size=args["ffn_hidden_size"], moe_router_topk=get("num_experts_per_tok"),
                    moe_router_pre_softmax=not get("norm_topk_prob"))
        return args

    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        moe = config.moe
        return {**super().hf_config(config, rows, ids), "num_experts": moe.num_experts,
                "num_experts_per_tok": moe.topk, "norm_topk_prob": not moe.pre_softmax}

    def layer_rules(self, config, ours: str, theirs: str) -> List[Rule]:
        dense = [r for r in super().layer_rules(config, ours, theirs) if ".mlp." not in r.canonical]
        x = f"{theirs}.mlp"
        return dense + Olmo2.qk_norm_rules(ours, theirs) + \
            _expert_rules(config, ours, x, x, ("gate_proj", "up_proj", "down_proj"))
