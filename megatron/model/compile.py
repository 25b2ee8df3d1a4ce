"""--compile: torch.compile of each transformer layer of a Pipe model (regional compilation, as torchtitan's
`apply_compile`), applied from outside the model, and never to the pipeline engine.

Each transformer layer's `_forward` (its computation, inside the Pipe layer's recomputation wrapper) is replaced by
`torch.compile(layer._forward)`: dynamo guards on the layer's class and attributes, not its identity, so the
layers of one kind share one compiled graph (measured: 1 graph for 3 GPT layers). What runs between the graphs,
by design (`torch.compiler.disable`): dropout's seeded mask draws (`rng.SeededDropout`: a graph cannot seed the
device generator; this keeps the masks the eager ones, bit for bit), SDPA with dropout on a GPU (same reason) and,
under selective recomputation, the recomputed attention core (its checkpoint replays the dropout counters).
Everything else of a layer compiles: norms, GEMMs, the tensor- and sequence-parallel collectives, rotary
positions, attention without dropout, the MLP, the residuals.

What falls back (every layer of the stage runs eagerly, and one line says so):
    ZB-H1 (pipeline.schedule zb-h1)   a compiled layer's backward is one autograd node: the graph split cannot
                                      leave its weight gradients to W, and the linears' deferral to the
                                      weight-gradient store (tds.pipe.weight_grad) is not traced
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["compile_layers", "fallback_reason"]


def fallback_reason(schedule: str) -> Optional[str]:
    """Why a stage's layers cannot run compiled under this pipeline schedule, or None."""
    if schedule == "zb-h1":
        return ("ZB-H1 splits each layer's backward into B and W, and a compiled layer's backward is one "
                "autograd node whose weight gradients cannot wait for W")
    return None


def _layers(module: nn.Module) -> list:
    """This stage's transformer layers: the Pipe layers whose computation is `_forward`."""
    from .transformer import T5TransformerLayer, TransformerLayer
    return [m for m in module.modules() if isinstance(m, (TransformerLayer, T5TransformerLayer))
            and hasattr(type(m), "_forward")]


def compile_layers(module: nn.Module, schedule: str) -> str:
    """Compile this stage's transformer layers (module docstring), or leave them eager where the schedule does
    not allow it; returns the one line to print."""
    reason = fallback_reason(schedule)
    if reason is not None:
        return f"--compile: every transformer layer runs eagerly: {reason}"
    for layer in _layers(module):
        layer._forward = torch.compile(layer._forward)
    return "--compile: each transformer layer runs compiled (torch.compile, inductor; dropout's mask draws between)"
