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
    seq_aux_loss (Megatron's)      the same for each of the micro-batch's b sequences on its own (S tokens for T,
                                   its own counts), averaged over the b sequences
    z_loss                         coeff x mean_x logsumexp(logits_x)^2

Capacity (`--moe-expert-capacity-factor c`): each expert keeps at most ceil(T k / E x c) tokens, chosen by the
largest probability ("probs") or the earliest position ("position"); None is dropless.

Experts hold their weights stacked: `linear_fc1` (E, 2f, h) with the gate rows first, `linear_fc2` (E, h, f), the
layout of transformers' fused experts and of Megatron's grouped GEMM; under expert parallelism a rank holds E / P of
them and the rows move by all-to-all (`moe_dispatch.py`). Each expert runs one GEMM pair over its rows.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tds.pipe.stage_loss import add_stage_loss
from .moe_config import MoEConfig
from .moe_dispatch import allgather_dispatch_combine, dispatch_combine, local_experts
from .rng import mix

__all__ = ["MoEConfig", "MoELayer", "MoEMLP", "SharedExpert", "SwiGLUExperts", "TALLY_FIELDS", "aux_loss", "capacity",
           "drop_over_capacity", "route", "swiglu", "take_layer_table", "tokens_per_expert", "update_expert_bias",
           "z_loss"]

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


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


def aux_loss(logits: torch.Tensor, cfg: MoEConfig, sequence_group=None, sequences: int = 1) -> torch.Tensor:
    """Megatron's Switch load-balancing loss (module docstring): the counts are the top-k of the scores themselves
    (without the expert bias), before dropping. With `sequence_group` (sequence parallelism: each rank routes its
    part of the sequence) the counts and T are the whole sequence's and each rank returns its tokens' share of the
    sum, so that the shares add up to the loss of the whole sequence. seq_aux_loss: the (T, E) logits are
    `sequences` sequences in (b, s) order, each a row with its own counts and length, the rows' losses averaged."""
    if cfg.score_function == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = _sum_to_one(torch.sigmoid(logits))
    rows = sequences if cfg.load_balancing == "seq_aux_loss" else 1  # seq_aux_loss: one loss per sequence
    scores = scores.view(rows, -1, cfg.num_experts)  # (rows, T, E)
    tokens = scores.shape[1]
    chosen = torch.topk(scores, cfg.topk, dim=-1).indices.reshape(rows, -1)  # (rows, T k)
    counts = torch.zeros(rows, cfg.num_experts, dtype=torch.int64, device=scores.device)
    counts.scatter_add_(1, chosen, torch.ones_like(chosen))
    if sequence_group is not None:
        dist.all_reduce(counts, group=sequence_group)
        tokens *= dist.get_world_size(sequence_group)
    per_row = (scores.sum(dim=1) * counts.to(scores.dtype)).sum(dim=1)  # (rows,)
    return cfg.aux_loss_coeff * cfg.num_experts / (cfg.topk * tokens * tokens) * per_row.mean()


def z_loss(logits: torch.Tensor, coeff: float, tokens: Optional[int] = None) -> torch.Tensor:
    """coeff x mean over the tokens of logsumexp(logits)^2; `tokens` the count to divide by (the whole sequence's
    under sequence parallelism, each rank adding its share)."""
    return coeff * torch.logsumexp(logits, dim=-1).square().sum() / (tokens or logits.shape[0])


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
    probabilities (an expert index of -1, a dropped choice, adds nothing), moving rows with `moe_dispatch`.

    Expert e (global index) is drawn from its own generator, seeded mix(seed, e), so it holds the same weights at
    every expert-parallel size. Its parameters are marked `expert_parallel`: their gradients are reduced over the
    expert-data-parallel group (the ranks holding the same experts), not the data-parallel one.
    """

    def __init__(self, num: int, hidden: int, ffn: int, std: float, out_std: float, dtype: torch.dtype,
                 ep_group=None, dispatcher: str = "allgather", seed: int = 0) -> None:
        super().__init__()
        self.num, self.ep_group = num, ep_group
        self.dispatch = allgather_dispatch_combine if dispatcher == "allgather" else dispatch_combine
        local = local_experts(num, ep_group)
        self.first = (dist.get_rank(ep_group) if ep_group is not None else 0) * local
        fc1, fc2 = torch.empty(local, 2 * ffn, hidden), torch.empty(local, hidden, ffn)
        for j in range(local):
            gen = torch.Generator().manual_seed(mix(seed, self.first + j))
            fc1[j].normal_(0.0, std, generator=gen)
            fc2[j].normal_(0.0, out_std, generator=gen)
        self.linear_fc1 = nn.Parameter(fc1.to(dtype))
        self.linear_fc2 = nn.Parameter(fc2.to(dtype))
        for param in (self.linear_fc1, self.linear_fc2):
            param.expert_parallel = True

    def forward(self, x: torch.Tensor, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        # unbind, not [j]: one stacked gradient in backward rather than a full-size one per expert
        fc1, fc2 = self.linear_fc1.unbind(0), self.linear_fc2.unbind(0)
        return self.dispatch(x, probs, experts, self.num, lambda j, rows: swiglu(rows, fc1[j], fc2[j]), self.ep_group)


class MoELayer(nn.Module):
    """(b, s, h) -> ((b, s, h), stats): the routed experts plus the shared expert (gated by sigmoid(x w_gate) with
    `shared_gate`). stats: "tokens_per_expert" (E,) after dropping, and where enabled "load_balancing_loss" and
    "z_loss", tensors in the autograd graph for the caller to back-propagate."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, *, init_method_std: float = 0.02, num_layers: int = 1,
                 dtype: torch.dtype = torch.float32, ep_group=None, sequence_group=None,
                 expert_seed: Optional[int] = None) -> None:
        """ep_group: the expert-parallel group this rank's E / P experts belong to (None: all E here).
        sequence_group: under sequence parallelism, the tensor-parallel group whose ranks each route their part of
        the sequence (the router, the shared expert and, without expert parallelism, the experts are then marked
        `sequence_parallel`: their gradients are partial, summed over that group).
        expert_seed: the experts' seed (`SwiGLUExperts`); None draws one from torch's generator. The router and
        shared expert are drawn from torch's generator, in that order."""
        super().__init__()
        self.cfg, self.sequence_group = cfg, sequence_group
        std, out_std = init_method_std, init_method_std / math.sqrt(2.0 * num_layers)
        h = hidden_size
        self.router = nn.Linear(h, cfg.num_experts, bias=False, dtype=dtype)
        nn.init.normal_(self.router.weight, 0.0, std)
        if cfg.expert_bias:  # fp32 whatever the model's dtype; updated outside backward, once per global batch
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.shared_expert = self.shared_gate = None
        if cfg.shared_ffn_hidden_size:
            self.shared_expert = SharedExpert(h, cfg.shared_ffn_hidden_size, std, out_std, dtype)
        if cfg.shared_gate:
            self.shared_gate = nn.Linear(h, 1, bias=False, dtype=dtype)
            nn.init.normal_(self.shared_gate.weight, 0.0, std)
        seed = int(torch.randint(0, 2 ** 62, ())) if expert_seed is None else expert_seed
        self.experts = SwiGLUExperts(cfg.num_experts, h, cfg.ffn_hidden_size, std, out_std, dtype, ep_group,
                                     cfg.dispatcher, seed)
        if sequence_group is not None:  # experts on every rank (no expert parallelism) are replicated params too
            for module in (self.router, self.shared_expert, self.shared_gate, ep_group is None and self.experts):
                for param in module.parameters() if module else ():
                    param.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        cfg, shape = self.cfg, x.shape
        x = x.reshape(-1, shape[-1])
        dtype = ROUTER_DTYPES[cfg.router_dtype]
        logits = F.linear(x.to(dtype), self.router.weight.to(dtype))
        bias = getattr(self, "expert_bias", None)
        probs, experts = route(logits, cfg, None if bias is None else bias.to(dtype))
        stats = {}
        parts = 1 if self.sequence_group is None else dist.get_world_size(self.sequence_group)
        if cfg.load_balancing != "none" and cfg.aux_loss_coeff > 0:
            stats["load_balancing_loss"] = aux_loss(logits, cfg, self.sequence_group,
                                                     shape[0] if len(shape) == 3 else 1)
        if cfg.z_loss_coeff > 0:
            stats["z_loss"] = z_loss(logits, cfg.z_loss_coeff, logits.shape[0] * parts)
        if cfg.capacity_factor is not None:
            experts = drop_over_capacity(probs, experts, cfg)
        stats["tokens_per_expert"] = tokens_per_expert(experts, cfg.num_experts)
        out = self.experts(x, probs.to(x.dtype), experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * shared)
        return out.reshape(shape), stats


TALLY_FIELDS = ("load_balancing_loss", "z_loss", "dropped")  # then tokens per expert, E values


class _Tally(torch.autograd.Function):
    """Identity whose backward adds each of `values` into its buffer of `tallies`: once per trained micro-batch,
    however often the forward runs (activation recomputation repeats it, evaluation runs it without backward)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, tallies: tuple, values: tuple) -> torch.Tensor:
        ctx.pairs = list(zip(tallies, values))
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        for tally, values in ctx.pairs:
            tally.add_(values)
        return grad, None, None


class MoEMLP(nn.Module):
    """A transformer layer's MLP as a mixture of experts: (b, s, h) -> (b, s, h). Its balancing losses train through
    `tds.pipe.add_stage_loss` (each stage back-propagates its own, scaled as the micro-batch's loss), and each trained
    micro-batch adds its statistics to `tally` (fp64, `TALLY_FIELDS` then tokens per expert): the balancing losses
    without their coefficients (1 at uniform routing, as Megatron logs them), the dropped choices and the choices
    each expert kept, this rank's share (`moe_logging` reads and resets them). With the expert bias, the kept
    choices also go to `bias_counts`, which `update_expert_bias` reads and resets after each step."""

    def __init__(self, cfg: MoEConfig, hidden_size: int, **layer_kwargs) -> None:
        super().__init__()
        self.moe = MoELayer(cfg, hidden_size, **layer_kwargs)
        self.register_buffer("tally", torch.zeros(len(TALLY_FIELDS) + cfg.num_experts, dtype=torch.float64),
                             persistent=False)
        if cfg.expert_bias:
            self.register_buffer("bias_counts", torch.zeros(cfg.num_experts, dtype=torch.float64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, stats = self.moe(x)
        cfg = self.moe.cfg
        losses = [stats[name] for name in ("load_balancing_loss", "z_loss") if name in stats]
        if losses:
            out = add_stage_loss(out, sum(losses))
        if not (torch.is_grad_enabled() and out.requires_grad):
            return out
        kept = stats["tokens_per_expert"].double().to(self.tally.device)
        choices = x.numel() // x.shape[-1] * cfg.topk
        zero = kept.new_zeros(())
        values = torch.cat([torch.stack([
            stats["load_balancing_loss"].detach().double() / cfg.aux_loss_coeff if "load_balancing_loss" in stats
            else zero,
            stats["z_loss"].detach().double() / cfg.z_loss_coeff if "z_loss" in stats else zero,
            choices - kept.sum()]), kept])
        pairs = [(self.tally, values)] + ([(self.bias_counts, kept)] if cfg.expert_bias else [])
        return _Tally.apply(out, *map(tuple, zip(*pairs)))


@torch.no_grad()
def take_layer_table(buffers: Dict[int, torch.Tensor], num_layers: int, width: int, group=None) -> torch.Tensor:
    """(num_layers, width) fp64: row l - 1 the sum over every rank of `group` (None: all) of layer l's buffer (the
    ranks of the stage holding layer l fill it, the others leave zeros), one all-reduce; the buffers are reset.
    `buffers`: layer number -> this rank's buffer, for the layers it holds."""
    device = next(iter(buffers.values())).device if buffers else torch.device("cpu")
    table = torch.zeros(num_layers, width, dtype=torch.float64, device=device)
    for number, buffer in buffers.items():
        table[number - 1] = buffer
        buffer.zero_()
    dist.all_reduce(table, group=group)
    return table


@torch.no_grad()
def update_expert_bias(mlps: Dict[int, "MoEMLP"], num_layers: int, num_experts: int, group=None) -> None:
    """Aux-loss-free balancing, once per global batch (after the step): each layer's choices per expert summed over
    every micro-batch and every rank (`group`, None: all ranks; one all-reduce of a (layers, E) table in which each
    stage fills its own layers' rows), then bias_e += rate x sign(mean_e c_e - c_e), in fp32, and the counts reset.
    The counts are whole numbers, so the bias is the same at any split of the batch. `mlps`: layer number -> its
    MoE MLP, for the layers this rank holds."""
    table = take_layer_table({number: mlp.bias_counts for number, mlp in mlps.items()}, num_layers, num_experts,
                             group)
    for number, mlp in mlps.items():
        counts = table[number - 1]
        step = torch.sign(counts.mean() - counts).float() * mlp.moe.cfg.bias_update_rate
        mlp.moe.expert_bias.add_(step.to(mlp.moe.expert_bias.device))
