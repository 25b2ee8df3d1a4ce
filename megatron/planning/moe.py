"""A mixture of experts as the planner counts it: the MoE layers' parameters per rank, what one micro-batch leaves
saved for backward in them, their FLOPs. Read from megatron/model/moe.py and moe_dispatch.py (what each module
holds and what autograd keeps; tests/planning/test_moe_terms.py checks the terms against the built layer and
`saved_tensors_hooks`).

Legend: h hidden, E experts, k top-k, f_e one routed expert's ffn (--moe-ffn-hidden-size), f_s the shared expert's
(--moe-shared-expert-intermediate-size, 0 without), f the dense MLP's, t tensor-parallel size, P expert-parallel size
(--expert-model-parallel-size), T = b s / t_sp the tokens this rank routes (t_sp = t under sequence parallelism,
else 1: MoE at t > 1 needs it), e bytes per activation element, r the router's (--moe-router-dtype: 4 fp32, 8 fp64).

Parameters of a MoE layer's MLP on one rank (`MoELayer`: nothing in it is tensor-parallel; under sequence
parallelism the router, the shared expert and its gate are replicated over tp, each rank routing its T tokens):

    router          E h                                  replicated over tp and P
    routed experts  (E / P) x (2 f_e h + h f_e) = 3 h f_e E / P   whole experts, E / P on each rank of the
                                                         expert-parallel group (expert tensor parallel size 1)
    shared expert   3 h f_s                              replicated (`SharedExpert`: fc1 (2 f_s, h), fc2 (h, f_s))
    shared gate     h                                    with --moe-shared-expert-gate

in place of the dense MLP's (2 f h + f h [+ 2 f]) / t [+ h] (its biases with add_bias_linear). The experts'
gradients and optimizer states follow their parameters (per rank, as the others'); at P > 1 the engine flattens
the experts' gradients once to reduce them over their expert-data-parallel group (`tds.pipe.expert_grads`: a
4 Psi_experts fp32 copy; P > 1 runs fp32 ZeRO 0 only) and the other gradients as before.

Rows: R token copies reach this rank's experts per micro-batch and MoE layer.
    dropless        R = T k: balanced routing (P T k copies over P ranks; exact at P = 1). Routing that sends
                    more to one rank's experts raises it up to P T min(k, E / P); not counted.
    capacity c      R = E C, C = ceil(T k / E x c) (each source rank keeps at most C copies per expert, so this
                    rank's E / P experts receive at most P C each): every expert at its capacity, the bound
                    (P = 1: at most T k).

Saved for backward per MoE layer and micro-batch (`moe_mlp_bytes`; the layer's input, the second norm's output, is
counted with the dense layer's terms):

    experts         R (h + 2 f_e + f_e + f_e) e   each expert's input rows, fc1 output (gate and up), silu(gate)
                                                  and the product (fc2's input)
                    + 2 R h e                     the experts' outputs (kept by the product with the
                                                  probabilities) and that product (kept by index_add)
                    + R e + 16 R                  the chosen probabilities; two int64 indices per row (its token,
                                                  its place in the sort by expert)
                    [+ 8 R]                       P > 1 with the alltoall dispatcher: the received rows' order
                                                  by expert (the allgather dispatcher's rows arrive in it)
    router          T k 8 + T k                   top-k indices, the kept-choice mask
                    + T k r                       softmax after top-k: the k probabilities
                      (T E r                      pre-softmax: the softmax over all E;
                       T E r + T k r + T r        sigmoid: the scores, the k picked, their sum)
                    + (T h + E h) r if r != e     the router's input and weight cast to its dtype
                    - T h e if r != e, no shared  the layer's input (the norm's output, counted with the dense
                                                  layer) is then kept by nothing: the router keeps its cast, the
                                                  expert rows are copies
    aux loss        T E r + E r [+ T r]           with --moe-aux-loss-coeff > 0: its softmax (sigmoid: the sigmoids
                                                  and their sum), the counts (its top-k picks no gradient: nothing
                                                  kept)
    z loss          T E r + T r                   with --moe-z-loss-coeff > 0: the logits, their logsumexp
                    + r                           either: the balancing loss `add_stage_loss` keeps
    shared expert   4 T f_s e [+ T h e + T e]     as the dense SwiGLU MLP; with the gate its output and sigmoid

in place of the dense SwiGLU MLP's 4 b s f e / t. Backward working set of a MoE layer (`moe_working_bytes`):
the gradients of the expert rows in flight, 3 R h e.

FLOPs (`moe_flops_delta`): a MoE layer's forward is 2 T_all h E (router) + k x 6 T_all h f_e (each token's k experts'
SwiGLU) + 6 T_all h f_s, T_all = B s, in place of the dense 6 B s h f; training 3x, recomputation 4x as the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from megatron.model.specs.memory import ActivationOptions, PipeLayer

__all__ = ["MoEPipeLayer", "moe_layers", "moe_config", "routed_expert_params", "moe_mlp_params", "dense_mlp_params",
           "rows_per_rank", "moe_mlp_bytes", "moe_layer_bytes", "moe_working_bytes", "moe_flops_delta",
           "moe_buffer_bytes", "ROUTER_BYTES"]

ROUTER_BYTES = {"fp32": 4, "fp64": 8}
DENSE_LAYER = PipeLayer("layer", 0, transformer=True)


@dataclass(frozen=True)
class MoEPipeLayer(PipeLayer):
    """A transformer layer whose MLP is a mixture of experts: `params` its parameters on one rank (tp and ep
    applied), `experts` those of its routed experts there (3 h f_e E / P), `ep` the expert-parallel size P."""
    experts: int = 0
    ep: int = 1


def moe_config(config):
    """The configuration's MoEConfig, or None (a dense model, or a family without experts)."""
    return getattr(config, "moe", None)


def routed_expert_params(config, ep: int) -> int:
    """3 h f_e E / P: one MoE layer's routed experts on one rank of an expert-parallel group of `ep`."""
    moe = config.moe
    return 3 * config.hidden_size * moe.ffn_hidden_size * (moe.num_experts // ep)


def moe_mlp_params(config, ep: int) -> int:
    """A MoE layer's MLP on one rank (module docstring): router, E / P routed experts, shared expert and gate."""
    moe, h = config.moe, config.hidden_size
    shared = 3 * h * (moe.shared_ffn_hidden_size or 0) + (h if moe.shared_gate else 0)
    return moe.num_experts * h + routed_expert_params(config, ep) + shared


def dense_mlp_params(config, tp: int) -> int:
    """The dense MLP's share of `spec.pipe_layers`' layer: (h f_in + f h [+ f_in]) / t [+ h, fc2's bias]."""
    h, f = config.hidden_size, config.ffn_hidden_size
    f_in = 2 * f if config.swiglu else f
    bias = config.add_bias_linear
    return (h * f_in + f * h + (f_in if bias else 0)) // tp + (h if bias else 0)


def moe_layers(config, specs: List[PipeLayer], tp: int, ep: int) -> List[PipeLayer]:
    """`specs` (the spec's `pipe_layers` at tp) with each MoE layer (`MoEConfig.is_moe_layer`) an MoEPipeLayer:
    the dense layer's parameters less its MLP's, plus the MoE MLP's on this rank."""
    moe = moe_config(config)
    if moe is None:
        return specs
    if moe.num_experts % ep:
        from megatron.errors import UserError
        raise UserError(f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    out, number = [], 0
    for spec in specs:
        if spec.transformer:
            number += 1
            if moe.is_moe_layer(number):
                params = spec.params - dense_mlp_params(config, tp) + moe_mlp_params(config, ep)
                spec = MoEPipeLayer("moe", params, spec.first_of_stack, True, spec.tie, spec.lookup,
                                    experts=routed_expert_params(config, ep), ep=ep)
        out.append(spec)
    return out


def _tokens(config, o: ActivationOptions) -> int:
    """T: the tokens this rank routes per micro-batch (its part of the sequence under sequence parallelism)."""
    return o.micro_batch * config.seq_length // (o.tp if o.sequence_parallel else 1)


def rows_per_rank(config, o: ActivationOptions, ep: int = 1) -> int:
    """R: token copies this rank's experts receive per micro-batch (module docstring: dropless T k, balanced; with
    a capacity factor E C, at P = 1 at most T k)."""
    moe, T = config.moe, _tokens(config, o)
    if moe.capacity_factor is None:
        return T * moe.topk
    per_expert = min(T, math.ceil(T * moe.topk / moe.num_experts * moe.capacity_factor))  # `moe.capacity`
    rows = moe.num_experts * per_expert
    return min(rows, T * moe.topk) if ep == 1 else rows


def moe_mlp_bytes(config, o: ActivationOptions, ep: int = 1) -> float:
    """Saved bytes of one MoE layer's MLP for one micro-batch (module docstring, term by term)."""
    moe, h, e = config.moe, config.hidden_size, o.element_bytes
    E, k, f_e, f_s = moe.num_experts, moe.topk, moe.ffn_hidden_size, moe.shared_ffn_hidden_size or 0
    r, T, R = ROUTER_BYTES[moe.router_dtype], _tokens(config, o), rows_per_rank(config, o, ep)
    order = 8 * R if ep > 1 and moe.dispatcher == "alltoall" else 0
    experts = R * (h + 4 * f_e) * e + 2 * R * h * e + R * e + 16 * R + order
    if moe.score_function == "sigmoid":
        scores = T * E * r + T * k * r + T * r
    else:
        scores = T * E * r if moe.pre_softmax else T * k * r
    cast = (T * h + E * h) * r - (0 if f_s else T * h * e) if r != e else 0
    router = T * k * 8 + T * k + scores + cast
    balancing = moe.load_balancing != "none" and moe.aux_loss_coeff > 0
    aux = T * E * r + E * r + (T * r if moe.score_function == "sigmoid" else 0) if balancing else 0
    z = T * E * r + T * r if moe.z_loss_coeff > 0 else 0
    loss = r if aux or z else 0
    shared = 4 * T * f_s * e + ((T * h + T) * e if moe.shared_gate else 0)
    return experts + router + aux + z + loss + shared


def moe_layer_bytes(layer: PipeLayer, m, o: ActivationOptions) -> float:
    """A MoE layer's saved bytes: the spec's dense layer's, its SwiGLU MLP's 4 b s f e / t replaced by
    `moe_mlp_bytes` (its attention, norms and dropout masks are the dense layer's)."""
    c = m.config
    dense_mlp = 4 * o.micro_batch * c.seq_length * c.ffn_hidden_size * o.element_bytes / o.tp
    return m.spec.saved_bytes(DENSE_LAYER, c, o) - dense_mlp + moe_mlp_bytes(c, o, layer.ep)


def moe_working_bytes(layer: MoEPipeLayer, config, o: ActivationOptions) -> float:
    """The backward working set of a MoE layer: the gradients of its expert rows in flight, 3 R h e."""
    return 3 * rows_per_rank(config, o, layer.ep) * config.hidden_size * o.element_bytes


def moe_buffer_bytes(expert_params: int, ep: int) -> float:
    """P > 1: the flat fp32 copy the engine makes of this rank's expert gradients to reduce them
    (`tds.pipe.expert_grads.reduce_expert_grads`; P > 1 runs fp32 only); P = 1: none of its own (the experts are
    in the data-parallel buckets)."""
    return 4.0 * expert_params if ep > 1 else 0.0


def moe_flops_delta(config, global_batch: int, recompute: bool) -> float:
    """What the MoE layers add to the dense model's FLOPs per iteration (module docstring)."""
    moe = moe_config(config)
    if moe is None:
        return 0.0
    tokens, h = global_batch * config.seq_length, config.hidden_size
    layers = sum(moe.is_moe_layer(n) for n in range(1, config.num_layers + 1))
    moe_forward = 2 * tokens * h * moe.num_experts + 6 * tokens * h * (
        moe.topk * moe.ffn_hidden_size + (moe.shared_ffn_hidden_size or 0))
    dense_forward = 6 * tokens * h * config.ffn_hidden_size
    return (4 if recompute else 3) * layers * (moe_forward - dense_forward)

