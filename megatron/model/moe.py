"""Mixture of experts, one rank's view: the router, the dropless or capacity-limited routing and SwiGLU experts.

Shape legend: T tokens seen by the router (b s flattened), h hidden, E experts, k top-k, f an expert's ffn hidden.

Routing follows Megatron core's definitions (`--moe-router-*` flags), in the router's dtype (fp32 by default):

    softmax, after top-k     top-k of the logits, then a softmax over those k    (Mixtral; renormalized)
    softmax, pre-softmax     a softmax over all E, then its top-k                (Qwen2-MoE, OLMoE: not renormalized)
    sigmoid                  sigmoid of the logits; top-k of sigmoid + expert bias (the bias picks, never weighs);
                             the k picked scores divided by their sum when k > 1  (DeepSeek-V3 style)
    then                     probabilities x --moe-router-topk-scaling-factor, where set

Balancing losses (returned, never added to the LM loss here; the caller back-propagates them):

    aux_loss (Switch, Megatron's)  coeff x E / (k T^2) x sum_i (sum_x p_xi) count_i    (uniform routing: coeff)
        p: the softmax over all E (sigmoid: the sigmoids divided by their sum); count_i: tokens sent to expert i
        before dropping. transformers' MoE models define it without the 1/k (uniform: coeff x k).
    z_loss                         coeff x mean_x logsumexp(logits_x)^2

Capacity (`--moe-expert-capacity-factor c`): each expert keeps at most ceil(T k / E x c) tokens, chosen by the
largest probability ("probs") or the earliest position ("position"); None is dropless.

Experts hold their weights stacked: `linear_fc1` (E, 2f, h) with the gate rows first, `linear_fc2` (E, h, f), the
layout of transformers' fused experts and of Megatron's grouped GEMM; under expert parallelism a rank holds E / P of
them and the rows move by all-to-all (`moe_dispatch.py`). Each expert runs one GEMM pair over its rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .moe_dispatch import allgather_dispatch_combine, dispatch_combine, local_experts

__all__ = ["MoEConfig", "MoELayer", "SharedExpert", "SwiGLUExperts", "aux_loss", "capacity", "drop_over_capacity",
           "route", "swiglu", "tokens_per_expert", "z_loss"]

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    hidden_size: int
    ffn_hidden_size: int  # one expert's
    topk: int = 2
    score_function: str = "softmax"  # or "sigmoid"
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    router_dtype: str = "fp32"  # or "fp64"
    load_balancing: str = "aux_loss"  # or "none"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None  # None: dropless
    drop_policy: str = "probs"  # or "position"
    shared_ffn_hidden_size: Optional[int] = None
    shared_gate: bool = False
    expert_bias: bool = False
    dispatcher: str = "allgather"  # or "alltoall" (moe_dispatch.py); the same with one expert-parallel rank
    init_method_std: float = 0.02
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        problems = [
            (self.num_experts < 1, f"--num-experts must be >= 1, got {self.num_experts}"),
            (not 1 <= self.topk <= self.num_experts,
             f"--moe-router-topk {self.topk} must be between 1 and --num-experts {self.num_experts}"),
            (self.score_function not in ("softmax", "sigmoid"),
             f"--moe-router-score-function must be softmax or sigmoid, got {self.score_function!r}"),
            (self.pre_softmax and self.score_function != "softmax",
             "--moe-router-pre-softmax needs --moe-router-score-function softmax"),
            (self.router_dtype not in ROUTER_DTYPES, f"--moe-router-dtype must be fp32 or fp64, got "
                                                     f"{self.router_dtype!r}"),
            (self.load_balancing not in ("aux_loss", "none"),
             f"--moe-router-load-balancing-type must be aux_loss or none, got {self.load_balancing!r}"),
            (self.capacity_factor is not None and self.capacity_factor <= 0,
             f"--moe-expert-capacity-factor must be > 0, got {self.capacity_factor}"),
            (self.drop_policy not in ("probs", "position"),
             f"--moe-token-drop-policy must be probs or position, got {self.drop_policy!r}"),
            (self.expert_bias and self.score_function != "sigmoid",
             "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the bias picks experts "
             "by sigmoid score)"),
            (self.dispatcher not in ("allgather", "alltoall"),
             f"--moe-token-dispatcher-type must be allgather or alltoall, got {self.dispatcher!r}"),
            (self.shared_gate and not self.shared_ffn_hidden_size,
             "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(message)


def _sum_to_one(scores: torch.Tensor) -> torch.Tensor:
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def route(logits: torch.Tensor, cfg: MoEConfig, bias: Optional[torch.Tensor] = None
          ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probs (T, k), experts (T, k)) from the router's logits (T, E), as the module docstring defines them."""
    if cfg.score_function == "softmax":
        if cfg.pre_softmax:
            probs, experts = torch.topk(torch.softmax(logits, dim=-1), cfg.topk, dim=-1)
        else:
            top, experts = torch.topk(logits, cfg.topk, dim=-1)
            probs = torch.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        _, experts = torch.topk(scores if bias is None else scores + bias, cfg.topk, dim=-1)
        probs = scores.gather(-1, experts)
        if cfg.topk > 1:
            probs = _sum_to_one(probs)
    if cfg.topk_scaling_factor:
        probs = probs * cfg.topk_scaling_factor
    return probs, experts


def capacity(tokens: int, cfg: MoEConfig) -> int:
    """Tokens one expert keeps at most: ceil(T k / E x capacity factor)."""
    return math.ceil(tokens * cfg.topk / cfg.num_experts * cfg.capacity_factor)


def drop_over_capacity(probs: torch.Tensor, experts: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """`experts` with the choices over each expert's capacity replaced by -1, no expert (kept: the largest
    probabilities, or the earliest tokens with --moe-token-drop-policy position)."""
    tokens = probs.shape[0]
    cap = capacity(tokens, cfg)
    if cap >= tokens:
        return experts
    chosen = torch.zeros(tokens, cfg.num_experts, dtype=probs.dtype, device=probs.device)
    chosen.scatter_(1, experts, probs if cfg.drop_policy == "probs" else torch.ones_like(probs))
    if cfg.drop_policy == "position":  # earlier tokens first: weight a choice by its reversed position
        order = torch.arange(tokens, 0, -1, dtype=probs.dtype, device=probs.device).unsqueeze(1)
        chosen = chosen * order
    keep = torch.zeros_like(chosen, dtype=torch.bool)
    keep.scatter_(0, torch.topk(chosen, cap, dim=0).indices, True)
    return experts.masked_fill(~keep.gather(1, experts), -1)


def tokens_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E,) choices per expert; -1 (dropped) counts for none."""
    flat = experts.reshape(-1)
    return torch.bincount(flat[flat >= 0], minlength=num_experts)


def aux_loss(logits: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Megatron's Switch load-balancing loss (module docstring): the counts are the top-k of the scores themselves
    (without the expert bias), before dropping."""
    if cfg.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = _sum_to_one(torch.sigmoid(logits))
    tokens = logits.shape[0]
    counts = tokens_per_expert(torch.topk(scores, cfg.topk, dim=-1).indices, cfg.num_experts).to(scores.dtype)
    return cfg.aux_loss_coeff * cfg.num_experts / (cfg.topk * tokens * tokens) * (scores.sum(dim=0) * counts).sum()


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def swiglu(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> torch.Tensor:
    """(silu(x W_gate) * (x W_up)) W_2 with fc1 = [W_gate; W_up] (2f, h) and fc2 (h, f)."""
    gate, up = F.linear(x, fc1).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, fc2)


class SharedExpert(nn.Module):
    """One SwiGLU MLP that every token passes through (`linear_fc1` (2f, h), `linear_fc2` (h, f))."""

    def __init__(self, hidden: int, ffn: int, std: float, out_std: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_fc1 = nn.Parameter(torch.empty(2 * ffn, hidden, dtype=dtype).normal_(0.0, std))
        self.linear_fc2 = nn.Parameter(torch.empty(hidden, ffn, dtype=dtype).normal_(0.0, out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.linear_fc1, self.linear_fc2)


class SwiGLUExperts(nn.Module):
    """This rank's E / P of the E SwiGLU experts (P: the expert-parallel group's size), weights stacked (module
    docstring); `forward(x, probs, experts)` sums each token's chosen experts' outputs weighted by their
    probabilities (an expert index of -1, a dropped choice, adds nothing), moving rows with `moe_dispatch`."""

    def __init__(self, num: int, hidden: int, ffn: int, std: float, out_std: float, dtype: torch.dtype,
                 ep_group=None, dispatcher: str = "allgather") -> None:
        super().__init__()
        self.num, self.ep_group = num, ep_group
        self.dispatch = allgather_dispatch_combine if dispatcher == "allgather" else dispatch_combine
        local = local_experts(num, ep_group)
        self.linear_fc1 = nn.Parameter(torch.empty(local, 2 * ffn, hidden, dtype=dtype).normal_(0.0, std))
        self.linear_fc2 = nn.Parameter(torch.empty(local, hidden, ffn, dtype=dtype).normal_(0.0, out_std))

    def forward(self, x: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return self.dispatch(x, probs, experts, self.num,
                             lambda j, rows: swiglu(rows, self.linear_fc1[j], self.linear_fc2[j]), self.ep_group)


class MoELayer(nn.Module):
    """(b, s, h) -> ((b, s, h), stats): the routed experts plus the shared expert (gated by sigmoid(x w_gate) with
    `shared_gate`). stats: "tokens_per_expert" (E,) after dropping, and where enabled "load_balancing_loss" and
    "z_loss", tensors in the autograd graph for the caller to back-propagate."""

    def __init__(self, cfg: MoEConfig, num_layers: int = 1, ep_group=None) -> None:
        """ep_group: the expert-parallel group this rank's E / P experts belong to (None: all E here)."""
        super().__init__()
        self.cfg = cfg
        std, out_std = cfg.init_method_std, cfg.init_method_std / math.sqrt(2.0 * num_layers)
        h = cfg.hidden_size
        self.router = nn.Linear(h, cfg.num_experts, bias=False, dtype=cfg.dtype)
        nn.init.normal_(self.router.weight, 0.0, std)
        if cfg.expert_bias:  # fp32 whatever the model's dtype; updated outside backward, once per global batch
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.experts = SwiGLUExperts(cfg.num_experts, h, cfg.ffn_hidden_size, std, out_std, cfg.dtype, ep_group,
                                     cfg.dispatcher)
        self.shared_expert = self.shared_gate = None
        if cfg.shared_ffn_hidden_size:
            self.shared_expert = SharedExpert(h, cfg.shared_ffn_hidden_size, std, out_std, cfg.dtype)
        if cfg.shared_gate:
            self.shared_gate = nn.Linear(h, 1, bias=False, dtype=cfg.dtype)
            nn.init.normal_(self.shared_gate.weight, 0.0, std)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        cfg, shape = self.cfg, x.shape
        x = x.reshape(-1, shape[-1])
        dtype = ROUTER_DTYPES[cfg.router_dtype]
        logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
        bias = getattr(self, "expert_bias", None)
        probs, experts = route(logits, cfg, None if bias is None else bias.to(dtype))
        stats = {}
        if cfg.load_balancing == "aux_loss" and cfg.aux_loss_coeff > 0:
            stats["load_balancing_loss"] = aux_loss(logits, cfg)
        if cfg.z_loss_coeff > 0:
            stats["z_loss"] = z_loss(logits, cfg.z_loss_coeff)
        if cfg.capacity_factor is not None:
            experts = drop_over_capacity(probs, experts, cfg)
        stats["tokens_per_expert"] = tokens_per_expert(experts, cfg.num_experts)
        out = self.experts(x, probs.to(x.dtype), experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        return out.reshape(shape), stats
