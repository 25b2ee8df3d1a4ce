"""The mixture-of-experts part of a GPT configuration (`GPTConfig.moe`), torch-free, validated once.

Field names follow Megatron-LM's --moe-* flags (megatron/config/moe_args.py parses them; `moe.py` and
`moe_dispatch.py` run them). `layer_pattern` says which transformer layers hold experts: element l - 1 is 1 when
layer l is a MoE layer, 0 when it keeps the dense MLP (Megatron's --moe-layer-freq, resolved by `layer_pattern`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Tuple

SCORE_FUNCTIONS = ("softmax", "sigmoid")
ROUTER_DTYPE_NAMES = ("fp32", "fp64")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHERS = ("allgather", "alltoall")
# the arguments of `megatron.config.moe_args` besides --num-experts (GPT options: other models refuse them)
MOE_FLAGS = ("moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
             "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_dtype",
             "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
             "moe_router_enable_expert_bias", "moe_router_bias_update_rate", "moe_expert_capacity_factor",
             "moe_token_drop_policy", "moe_pad_expert_input_to_capacity", "moe_shared_expert_intermediate_size",
             "moe_shared_expert_gate", "expert_model_parallel_size", "expert_tensor_parallel_size",
             "moe_token_dispatcher_type", "moe_grouped_gemm", "moe_per_layer_logging")
OPTIONS = ("num_experts",) + MOE_FLAGS
# those that make a MoE model's function and its tensors' shapes (--use-checkpoint-args takes them from a checkpoint)
ARCHITECTURE = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_score_function",
                "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                "moe_shared_expert_gate", "moe_router_enable_expert_bias")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer's routing and experts (module docstring); `layer_pattern` () means every layer.

    ffn_hidden_size: one routed expert's (--moe-ffn-hidden-size). router_dtype: the logits' and probabilities'
    dtype, fp32 by default (Megatron's default is the parameters' dtype, in which a last-bit difference flips top-k
    choices). capacity_factor None: dropless. expert_bias: aux-loss-free balancing (sigmoid scores; the bias picks
    the experts and is updated once per global batch by bias_update_rate x sign(mean count - count)).
    """
    num_experts: int
    ffn_hidden_size: int
    layer_pattern: Tuple[int, ...] = ()
    topk: int = 2
    score_function: str = "softmax"
    pre_softmax: bool = False
    topk_scaling_factor: Optional[float] = None
    router_dtype: str = "fp32"
    load_balancing: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    drop_policy: str = "probs"
    shared_ffn_hidden_size: Optional[int] = None
    shared_gate: bool = False
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    dispatcher: str = "allgather"
    per_layer_logging: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_pattern", tuple(int(v) for v in self.layer_pattern))
        problems = [
            (self.num_experts < 1, f"--num-experts must be >= 1, got {self.num_experts}"),
            (self.ffn_hidden_size < 1, f"--moe-ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}"),
            (not 1 <= self.topk <= self.num_experts,
             f"--moe-router-topk {self.topk} must be between 1 and --num-experts {self.num_experts}"),
            (self.score_function not in SCORE_FUNCTIONS,
             f"--moe-router-score-function must be softmax or sigmoid, got {self.score_function!r}"),
            (self.pre_softmax and self.score_function != "softmax",
             "--moe-router-pre-softmax needs --moe-router-score-function softmax"),
            (self.router_dtype not in ROUTER_DTYPE_NAMES,
             f"--moe-router-dtype must be fp32 or fp64, got {self.router_dtype!r}"),
            (self.load_balancing not in LOAD_BALANCING_TYPES,
             f"--moe-router-load-balancing-type must be aux_loss, seq_aux_loss or none, got {self.load_balancing!r}"),
            (self.aux_loss_coeff < 0 or self.z_loss_coeff < 0,
             f"--moe-aux-loss-coeff and --moe-z-loss-coeff must be >= 0, got {self.aux_loss_coeff} and "
             f"{self.z_loss_coeff}"),
            (self.capacity_factor is not None and self.capacity_factor <= 0,
             f"--moe-expert-capacity-factor must be > 0, got {self.capacity_factor}"),
            (self.drop_policy not in DROP_POLICIES,
             f"--moe-token-drop-policy must be probs or position, got {self.drop_policy!r}"),
            (self.expert_bias and self.score_function != "sigmoid",
             "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the bias picks experts "
             "by sigmoid score)"),
            (self.bias_update_rate <= 0, f"--moe-router-bias-update-rate must be > 0, got {self.bias_update_rate}"),
            (self.dispatcher not in DISPATCHERS,
             f"--moe-token-dispatcher-type must be allgather or alltoall, got {self.dispatcher!r}"),
            (self.shared_gate and not self.shared_ffn_hidden_size,
             "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
            (any(v not in (0, 1) for v in self.layer_pattern),
             f"--moe-layer-freq lists 1 (MoE) or 0 (dense) per layer, got {list(self.layer_pattern)}"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(message)

    def architecture(self) -> tuple:
        """The fields that make the model's function and its tensors' shapes (the rest are training choices)."""
        return (self.num_experts, self.ffn_hidden_size, self.layer_pattern, self.topk, self.score_function,
                self.pre_softmax, self.topk_scaling_factor, self.shared_ffn_hidden_size, self.shared_gate,
                self.expert_bias)

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether transformer layer `layer_number` (1-based) holds experts."""
        return not self.layer_pattern or bool(self.layer_pattern[layer_number - 1])


_LIST_TERM = re.compile(r"^\[\s*([01](?:\s*,\s*[01])*)?\s*\](?:\s*\*\s*(\d+))?$")


def layer_pattern(freq: str, num_layers: int) -> Tuple[int, ...]:
    """Megatron's --moe-layer-freq as one 0/1 per layer: an int N (layer l, 0-based, is MoE when l % N == 0) or a
    list written as Megatron's examples write it, "[1,0,1,1]", "([0]+[1]*23)": terms `[..]` or `[..]*n` joined by
    '+', parsed without eval. Raises ValueError naming the value."""
    text = str(freq).strip()
    if re.fullmatch(r"\d+", text):
        every = int(text)
        if every < 1:
            raise ValueError(f"--moe-layer-freq {freq}: an int must be >= 1")
        return tuple(1 if layer % every == 0 else 0 for layer in range(num_layers))
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    pattern: list = []
    for term in text.split("+"):
        match = _LIST_TERM.match(term.strip())
        if match is None:
            raise ValueError(f"--moe-layer-freq {freq!r} is neither an int nor a list such as [1,0,1,1] or "
                             f"([0]+[1]*23)")
        values = [int(v) for v in match.group(1).split(",")] if match.group(1) else []
        pattern += values * int(match.group(2) or 1)
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq {freq!r} lists {len(pattern)} layers, but --num-layers is {num_layers}")
    return tuple(pattern)


def moe_config_from_args(args) -> Optional[MoEConfig]:
    """The MoEConfig of resolved arguments (`megatron.config.moe_args`), or of a record of them that names only the
    architecture (an import's: every other field at its default); None for a dense model (or arguments that predate
    experts)."""
    if getattr(args, "num_experts", None) is None:
        return None
    given = lambda name, default: default if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    return MoEConfig(
        num_experts=args.num_experts, ffn_hidden_size=args.moe_ffn_hidden_size,
        layer_pattern=layer_pattern(given("moe_layer_freq", "1"), args.num_layers),
        topk=given("moe_router_topk", 2), score_function=given("moe_router_score_function", "softmax"),
        pre_softmax=bool(given("moe_router_pre_softmax", False)),
        topk_scaling_factor=given("moe_router_topk_scaling_factor", None),
        router_dtype=given("moe_router_dtype", "fp32"),
        load_balancing=given("moe_router_load_balancing_type", "aux_loss"),
        aux_loss_coeff=given("moe_aux_loss_coeff", 0.0), z_loss_coeff=given("moe_z_loss_coeff", 0.0),
        capacity_factor=given("moe_expert_capacity_factor", None), drop_policy=given("moe_token_drop_policy", "probs"),
        shared_ffn_hidden_size=given("moe_shared_expert_intermediate_size", None),
        shared_gate=bool(given("moe_shared_expert_gate", False)),
        expert_bias=bool(given("moe_router_enable_expert_bias", False)),
        bias_update_rate=given("moe_router_bias_update_rate", 1e-3),
        dispatcher=given("moe_token_dispatcher_type", "allgather"),
        per_layer_logging=bool(given("moe_per_layer_logging", False)))
