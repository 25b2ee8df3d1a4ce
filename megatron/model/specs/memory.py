"""What the planner (`megatron.planning`) asks a model's spec about memory, and the terms every family shares.
Torch-free: the planner ranks thousands of layouts without importing torch.

Shape legend: b micro-batch, s sequence, h hidden, V_p padded vocabulary, t tensor-parallel size, e bytes per
activation element (4 fp32, 2 bf16).

    PipeLayer           one layer spec of the Pipe model as the planner sees it: the spec's own name for it (its
                        tables dispatch on it), its parameters on one tensor-parallel rank, whether it is a
                        transformer layer (what 'type:transformer' balances and recomputation checkpoints), the
                        module it is tied to (a tied embedding and head on one stage are one module), whether it is a table lookup
    ActivationOptions   how one micro-batch runs (what its saved bytes depend on besides the model)
    LinearWidths        the output widths of a transformer layer's four linears (ZB-H1 keeps their inputs and
                        output gradients from B to W)
    mask_bytes, logit_bytes, head_bytes     the terms both families share

The families' own terms (each spec's `pipe_layers`, `saved_bytes`, ...: gpt.py, t5.py) are checked against the
tensors autograd saves in tests/planning/test_activations.py and against measured peaks in bench/memory_error.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["PipeLayer", "ActivationOptions", "LinearWidths", "STATS", "mask_bytes", "logit_bytes", "head_bytes"]

STATS = 4  # LayerNorm mean / rstd and RMSNorm rstd are kept in fp32


@dataclass(frozen=True)
class PipeLayer:
    """One layer spec of the Pipe model: its kind (the spec's name: embed, layer, enc, dec, norm, head), its
    parameters on one tp rank, whether it is a transformer layer, the module it is tied to ('' if none), and
    whether it is a table lookup (an embedding: its backward makes a dense gradient of its whole table, then adds
    it to the parameters' .grad)."""
    kind: str
    params: int
    first_of_stack: bool = False
    transformer: bool = False
    tie: str = ""
    lookup: bool = False


@dataclass(frozen=True)
class ActivationOptions:
    micro_batch: int
    tp: int
    element_bytes: int
    sequence_parallel: bool = False
    recompute: str = "none"     # none | selective | full
    attention: str = "math"     # math: CPU (s^2 probabilities with attention dropout); fused: GPU flash kernels
    loss_fusion: bool = False   # --cross-entropy-loss-fusion: the loss saves the logits (e), not an fp32 softmax


class LinearWidths(NamedTuple):
    """Widths of a transformer layer's linears, whole (before the division by t): the QKV projection's output,
    the output projection's input, the MLP's input projection's output and its output projection's input."""
    qkv: int
    dense: int
    fc1: int
    fc2: int


def mask_bytes(o: ActivationOptions) -> int:
    """Bytes per element of a hidden dropout mask: CUDA's dropout keeps a bool mask (`attention="fused"` stands for
    a GPU), CPU's keeps it in the activations' dtype, and so does SeededDropout's own mask for a sequence-parallel
    slice (megatron/model/rng.py), on either."""
    return 1 if o.attention == "fused" and not o.sequence_parallel else o.element_bytes


def logit_bytes(o: ActivationOptions) -> int:
    """Bytes the loss saves per logit: the fp32 softmax (4), or with the fused loss the logits (e)."""
    return o.element_bytes if o.loss_fusion else 4


def head_bytes(s_out: int, padded_vocab: int, o: ActivationOptions) -> float:
    """The LM head and loss of one micro-batch over `s_out` positions: the fp32 softmax the vocab-parallel cross
    entropy saves, b s V_p / t x 4 in every precision (the bf16/fp16 logits themselves are not kept), labels and
    loss mask (8 + 4 + 1 bytes per token); its fused form (`loss_fusion`) saves the logits themselves,
    b s V_p / t x e, and m and S (8 bytes per token). The head's GEMM keeps only its input (the final norm's
    output, counted there) and its weight."""
    b, t = o.micro_batch, o.tp
    return b * s_out * padded_vocab // t * logit_bytes(o) + (21 if o.loss_fusion else 13) * b * s_out
