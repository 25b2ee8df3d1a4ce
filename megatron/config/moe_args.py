"""Mixture of experts on the command line: Megatron-LM's --moe-* flags and --expert-*-parallel-size, their
defaults and their checks (torch-free, as the rest of `megatron.config`).

`add_moe_args(parser)` declares them; `resolve_moe(args)` (after the layout, precision and ZeRO are resolved)
fills the defaults and refuses, in one line each, what does not divide or cannot run:

    --num-experts E                     E % --expert-model-parallel-size == 0; needs --swiglu (the experts are
                                        SwiGLU MLPs)
    --expert-model-parallel-size E_p    divides tp x dp (the expert-parallel ranks are folded out of each stage's
                                        tensor- and data-parallel ranks, `tds.pipe.grid.expert_rank_lists`)
    --expert-tensor-parallel-size       1 (experts whole on each rank; the default here, not Megatron's tp)
    tp > 1                              needs --sequence-parallel (each tensor-parallel rank routes its part of
                                        the sequence; Megatron requires it with expert parallelism)
    E_p > 1                             fp32 and --zero-stage 0 for now: the experts' gradients are reduced over
                                        their own group, which DeepSpeed's ZeRO-1 and bf16 / fp16 optimizers do not
                                        know
"""
from __future__ import annotations

import argparse

from megatron.errors import UserError, flag_name, require
from megatron.model.moe_config import MOE_FLAGS, moe_config_from_args

DEFAULTS = dict(moe_layer_freq="1", moe_router_topk=2, moe_router_score_function="softmax", moe_router_dtype="fp32",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=0.0,
                moe_router_bias_update_rate=1e-3, moe_token_drop_policy="probs", expert_model_parallel_size=1,
                expert_tensor_parallel_size=1, moe_token_dispatcher_type="allgather")
# flags Megatron-LM has that are not built yet: refused by name rather than accepted and ignored
NOT_YET = {"moe_pad_expert_input_to_capacity": "pads each expert's rows to its capacity",
           "moe_grouped_gemm": "runs the experts as one grouped GEMM"}


def add_moe_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (GPT; Megatron-LM's names)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per MoE layer; unset: dense")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="one expert's ffn width, default "
                   "--ffn-hidden-size")
    g.add_argument("--moe-layer-freq", type=str, default=None,
                   help="which layers hold experts: an int N (every N-th layer from the first, default 1) or a list "
                        "of 1 (MoE) / 0 (dense) per layer, written as Megatron's examples write it: '[1,0,1,1]', "
                        "'([0]+[1]*23)' (parsed, never evaluated)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token, default 2")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default=None,
                   help="softmax (default) or sigmoid (DeepSeek-V3; the top-k scores renormalized when k > 1)")
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=None,
                   help="softmax over all experts before top-k (Qwen-MoE, OLMoE; not renormalized); default: top-k "
                        "of the logits, then a softmax over those k (Mixtral)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="multiply the routing probabilities by this")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="the router's logits and probabilities: fp32 by default here (Megatron's default, the "
                        "parameters' dtype, lets bf16 rounding flip top-k choices), fp64 for bit-level agreement "
                        "tests")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "none"], default=None,
                   help="aux_loss (default: Megatron's Switch loss over the micro-batch, coeff x E / (k T^2) x "
                        "sum_i P_i c_i, 1 x coeff at uniform routing; transformers' value is k times this), "
                        "seq_aux_loss (the same for each sequence on its own, S tokens for T, averaged over the "
                        "sequences: DeepSeek-V2's) or none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None, help="default 0 (no loss)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="coeff x mean logsumexp(logits)^2, default 0")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=None,
                   help="aux-loss-free balancing (sigmoid scores): a per-expert bias that picks experts, updated "
                        "once per global batch")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=None, help="default 1e-3")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="each expert keeps at most ceil(T k / E x factor) of the T tokens its router sees; "
                        "unset: dropless")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default=None,
                   help="over capacity, keep the largest probabilities (default) or the earliest tokens")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=None, help="not built yet")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared SwiGLU expert of this width that every token passes through")
    g.add_argument("--moe-shared-expert-gate", action="store_true", default=None,
                   help="the shared expert's output times sigmoid(x w) (Qwen2-MoE)")
    g.add_argument("--expert-model-parallel-size", type=int, default=None,
                   help="ranks the experts of a layer are spread over, folded out of each stage's tensor x data "
                        "ranks; default 1")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="1 (the only value built)")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default=None,
                   help="allgather (default: every rank's tokens gathered, outputs reduce-scattered) or alltoall "
                        "(each token copy sent to its expert's rank)")
    g.add_argument("--moe-grouped-gemm", action="store_true", default=None, help="not built yet")
    g.add_argument("--moe-per-layer-logging", action="store_true", default=None,
                   help="log the balancing losses and loads of every MoE layer, not only their mean")


def resolve_moe(args: argparse.Namespace) -> None:
    """The MoE flags' defaults and checks (module docstring); a dense model refuses every MoE flag."""
    if getattr(args, "num_experts", None) is None:
        stray = [flag_name(n) for n in MOE_FLAGS if getattr(args, n, None) not in (None, False)]
        require(not stray, f"{', '.join(stray)} need --num-experts (a mixture-of-experts model)")
        args.expert_model_parallel_size = 1
        return
    for name, value in DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    for name, what in NOT_YET.items():
        require(not getattr(args, name, None), f"{flag_name(name)} ({what}) is not built yet; drop it (the experts "
                                               f"run one GEMM pair each, with the same results)")
    experts, ep, tp = args.num_experts, args.expert_model_parallel_size, args.tensor_model_parallel_size
    require(experts >= 1, f"--num-experts must be >= 1, got {experts}")
    require(args.swiglu, "--num-experts: the experts are SwiGLU MLPs; give --swiglu")
    require(ep >= 1 and experts % ep == 0,
            f"--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}")
    ranks = tp * args.data_parallel_size
    require(ranks % ep == 0, f"--expert-model-parallel-size {ep} does not divide tensor-parallel {tp} x "
                             f"data-parallel {args.data_parallel_size} = {ranks} ranks per pipeline stage")
    require(args.expert_tensor_parallel_size == 1, f"--expert-tensor-parallel-size "
            f"{args.expert_tensor_parallel_size}: only 1 is built (each expert whole on its rank)")
    require(tp == 1 or args.sequence_parallel, f"--num-experts with --tensor-model-parallel-size {tp} needs "
            f"--sequence-parallel (each tensor-parallel rank routes its own part of the sequence)")
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if ep > 1:
        require(args.zero_stage == 0, f"--expert-model-parallel-size {ep} runs with --zero-stage 0 for now (ZeRO-1 "
                                      f"would average the experts over the data-parallel group); got --zero-stage "
                                      f"{args.zero_stage}")
        require(not (args.fp16 or args.bf16), f"--expert-model-parallel-size {ep} runs in fp32 for now (the bf16 "
                                              f"and fp16 optimizers reduce the experts over the data-parallel "
                                              f"group); got {'--fp16' if args.fp16 else '--bf16'}")
    require(not (args.layout_invariant and ep > 1), f"--layout-invariant with --expert-model-parallel-size {ep}: "
            f"the experts' gradients are summed over their own group, outside the fixed order; use ep 1")
    try:
        moe_config_from_args(args)  # the layer pattern and the routing settings, checked once
    except ValueError as err:
        raise UserError(str(err)) from None
