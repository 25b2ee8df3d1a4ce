"""Activation bytes one micro-batch leaves saved for backward, per layer spec, as this code base saves them: the
model's spec computes them (`spec.saved_bytes`: megatron/model/specs/gpt.py, t5.py, the shared terms in
specs/memory.py); this module asks it, and derives what recomputation changes.

Legend: b micro-batch, s sequence, h hidden, a heads, t tensor-parallel size, e bytes per activation element.

Counted from the tensors autograd keeps in `megatron.model` (tests/planning/test_activations.py checks each
formula against `torch.autograd.graph.saved_tensors_hooks` on the real layers). On CPU (`attention="math"`) with
attention dropout the core keeps what SDPA's math path keeps (in bf16 q, k, v and the three s^2 tensors in fp32);
without attention dropout SDPA runs its CPU flash kernel. On GPU (`attention="fused"`) the flash /
memory-efficient kernels keep the log-sum-exp instead of the s^2 tensors (measured on an H100).

Sequence parallelism (Korthikanti §4.2.2) divides the replicated part by t as well. Selective recomputation drops
the attention core term (recomputed in backward) on the math path; with fused kernels it changes nothing. Full
recomputation keeps only each checkpointed chunk's input (b s h e) and, during the backward, one chunk's
activations while it is recomputed (`memory`).
"""
from __future__ import annotations

from dataclasses import replace

from megatron.model.specs.memory import ActivationOptions, PipeLayer, logit_bytes

from .model_shape import ModelShape
from .moe import MoEPipeLayer, moe_layer_bytes

__all__ = ["ActivationOptions", "spec_activation_bytes", "layer_bytes", "recomputed_core_bytes", "logit_bytes"]


def spec_activation_bytes(layer: PipeLayer, m: ModelShape, o: ActivationOptions) -> float:
    """Saved bytes of any layer spec for one micro-batch, without full recomputation (a MoE layer:
    `moe.moe_layer_bytes`)."""
    if isinstance(layer, MoEPipeLayer):
        return moe_layer_bytes(layer, m, o)
    return m.spec.saved_bytes(layer, m.config, o)


layer_bytes = spec_activation_bytes  # a transformer layer's (the same question)


def recomputed_core_bytes(layer: PipeLayer, m: ModelShape, o: ActivationOptions) -> float:
    """Selective recomputation: what a layer's attention core holds again while its backward runs -- the bytes
    selective saved (SDPA's math path; 0 where the fused kernels keep no s^2 tensors), and with tp > 1 the whole
    (a, b, s, s) dropout mask SeededDropout draws before keeping this rank's heads (`spec.core_mask_bytes`)."""
    if o.recompute != "selective" or o.attention != "math" or not layer.transformer:
        return 0.0
    saved = layer_bytes(layer, m, replace(o, recompute="none")) - layer_bytes(layer, m, o)
    return saved + m.spec.core_mask_bytes(layer, m.config, o)
