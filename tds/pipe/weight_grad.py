"""Zero-bubble weight gradients: split a linear layer's backward into B (input gradient) and W (weights).

For Y = X A^T + b with X (n, in), A (out, in), dY = dL/dY (n, out) (leading dims flattened into n):

    B:  dX = dY A                        needed by the previous layer (and stage) at once
    W:  dA = dY^T X,   db = sum_n dY     needed only by the optimizer step

so W can wait (Qi et al. 2024, ZB-H1). A layer that calls `linear(x, weight, bias, store)` computes dX in its
backward as usual; while `store.defer(key)` is active it queues a closure holding X and dY instead of
returning dA and db, and `store.run(key)` computes them later. Between B and W a micro-batch holds only X and
dY of each deferred linear; the rest of its autograd graph is freed by B. Parameters that do not go through
`linear` (LayerNorm, embeddings) get their gradients in B.

Exactness: W runs the kernels autograd runs for `F.linear` (`dY^T X`, `sum_n dY`) and hands the results to
each parameter's own accumulator (its AccumulateGrad node, through a backward whose node returns them, so
that a first gradient becomes `.grad` without a copy: `_HandOver`), so with the W's of a parameter run
in micro-batch order `.grad` is bitwise that of full backwards, and gradient hooks (DeepSpeed's) fire with
the gradient. In B those hooks fire too, with `.grad` unchanged (torch calls them for the None a Function
returns). A parameter that also gets gradients in B (a tied embedding) sums the same terms in another
order (relative error ~1e-7 in fp32).

Why not autograd's own pruning (`backward(inputs=[x], retain_graph=True)`, then `backward(inputs=params)`):
the second pass must propagate dX through every layer again to reach the earlier layers' weights, and the
whole graph stays alive until then; `python bench/probes/weight_grad_split.py` measures both.

Which layers defer: those with a `weight_grad_store` attribute (None: plain `F.linear`, no overhead), which
`attach` sets from outside, and inside `route_linears(weights, store)` every `torch.nn.functional.linear`
call whose weight is one of `weights` (a leaf that requires grad; bias None or a leaf), with grad enabled:
`nn.Linear` and its subclasses, `nn.MultiheadAttention`'s input and output projections (so
`nn.TransformerEncoderLayer`) and any layer of the user's that calls `F.linear`. The engine routes a ZB-H1
stage's forward so (not a stage that checkpoints activations: the recomputation would run outside). While
it is active the module attribute `torch.nn.functional.linear` is a function that sends those calls to
`linear(x, w, b, store)` and every other call to torch's own (so another thread calling it meanwhile gets
torch's results); it is restored on leaving, also on an exception. A layer that bound `linear` at import
(`from torch.nn.functional import linear`) or computes `x @ w.t()` is not routed (the engine's graph split
defers those). The flag saying "defer now" is a plain attribute of the store, not a
thread-local, because autograd runs CUDA backward functions on its own threads::

    store = WeightGradStore()
    attach(model, store)                  # every module with a `weight_grad_store` attribute
    with store.defer(key=mb):             # B
        torch.autograd.backward(outputs, grads)
    store.run(mb)                         # W, later

Shapes: x (..., in), weight (out, in), bias (out,), y (..., out).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Hashable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WeightGradStore", "linear", "Linear", "attach", "route_linears"]

GradFn = Callable[[], list[Optional[torch.Tensor]]]
_TORCH_LINEAR = torch._C._nn.linear  # what `F.linear` is when nothing routes it


class WeightGradStore:
    """Weight-gradient work queued during B, run per key (e.g. a (micro-batch, chunk) pair) by `run`."""

    def __init__(self) -> None:
        self._key: Optional[Hashable] = None
        self._queues: dict[Hashable, list[tuple[Optional[list[torch.Tensor]], Callable]]] = {}

    @property
    def deferring(self) -> bool:
        return self._key is not None

    @contextmanager
    def defer(self, key: Hashable) -> Iterator[None]:
        """Queue the weight-gradient work of every backward run inside under `key`."""
        if key is None or self._key is not None:
            raise RuntimeError(f"WeightGradStore.defer({key!r}) inside defer({self._key!r}); use one key at a time")
        self._key = key
        try:
            yield
        finally:
            self._key = None

    def put(self, params: list[torch.Tensor], grads: GradFn) -> None:
        """Queue `grads()`, which returns one gradient per parameter of `params` (None: no gradient)."""
        self._queues.setdefault(self._key, []).append((params, grads))

    def later(self, fn: Callable[[], None]) -> None:
        """Queue `fn`, weight-gradient work computed elsewhere (`graph_split`), under the current key."""
        self._queues.setdefault(self._key, []).append((None, fn))

    def pending(self) -> list:
        """Keys with queued work, in the order they were first deferred."""
        return list(self._queues)

    def run(self, key: Hashable) -> None:
        """W of `key`: compute its queued gradients and accumulate them into the parameters' `.grad`."""
        params, grads = [], []
        for ps, fn in self._queues.pop(key, []):
            if ps is None:
                fn()
                continue
            for p, g in zip(ps, fn()):
                if g is not None:
                    params.append(p)
                    grads.append(g)
        if params:
            out = _HandOver.apply(grads, *params)  # `grads` is emptied by the backward
            torch.autograd.backward([out], [torch.empty_like(out)])

    def clear(self) -> None:
        """Drop all queued work (after a failed batch)."""
        self._queues.clear()
        self._key = None


class _HandOver(torch.autograd.Function):
    """An empty output of `params` whose backward returns the gradients in `box`, so that each parameter's
    AccumulateGrad node (hooks included) gets them from a node: it keeps such a gradient as `.grad` when there
    is none yet, where `autograd.backward(params, grads)` would copy every one (the caller still holds it)."""

    @staticmethod
    def forward(ctx, box: list, *params):
        ctx.box = box
        return params[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        grads = tuple(ctx.box)
        ctx.box.clear()
        return (None, *grads)


def _weight_grads(x: torch.Tensor, dy: torch.Tensor, need_weight: bool, need_bias: bool) -> GradFn:
    def grads() -> list[Optional[torch.Tensor]]:
        dy2 = dy.reshape(-1, dy.shape[-1])                                        # (n, out)
        dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if need_weight else None      # (out, in)
        return [dw, dy2.sum(0) if need_bias else None]                            # db: (out,)
    return grads


class _Linear(torch.autograd.Function):
    """F.linear whose weight/bias gradients go to `store` while it defers."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # the parameters themselves: saved tensors come back detached when
        ctx.store = store            # activation checkpointing recomputes them
        return _TORCH_LINEAR(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # dy (..., out)
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = dy.reshape(-1, dy.shape[-1]).mm(weight).view(x.shape) if need_x else None  # (..., in)
        if not (need_w or need_b):
            return dx, None, None, None
        grads = _weight_grads(x, dy, need_w, need_b)
        if ctx.store.deferring:
            ctx.store.put(list(ctx.params), grads)
            return dx, None, None, None
        dw, db = grads()
        return dx, dw, db, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """F.linear(x, weight, bias); with a store, its weight and bias gradients can be deferred (module doc)."""
    if store is None:
        return _TORCH_LINEAR(x, weight, bias)
    return _Linear.apply(x, weight, bias, store)


class Linear(nn.Linear):
    """nn.Linear whose weight gradients can be deferred once `attach` gave it a store."""
    weight_grad_store: Optional[WeightGradStore] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return linear(x, self.weight, self.bias, self.weight_grad_store)


def attach(module: nn.Module, store: Optional[WeightGradStore]) -> int:
    """Give `store` (None: detach) to every submodule with a `weight_grad_store` attribute; returns how many."""
    n = 0
    for m in module.modules():
        if hasattr(m, "weight_grad_store"):
            m.weight_grad_store = store
            n += 1
    return n


@contextmanager
def route_linears(weights: dict[int, torch.Tensor], store: WeightGradStore) -> Iterator[list[torch.Tensor]]:
    """Inside, `F.linear(x, w, b)` with `w` in `weights` ({id: parameter}) runs as `linear(x, w, b, store)`
    (module doc); yields the list of the weights routed so far."""
    routed: list[torch.Tensor] = []

    def routing_linear(input, weight, bias=None):
        if (torch.is_grad_enabled() and weights.get(id(weight)) is weight and weight.requires_grad
                and (bias is None or bias.is_leaf)):
            routed.append(weight)
            return _Linear.apply(input, weight, bias, store)
        return _TORCH_LINEAR(input, weight, bias)

    previous, F.linear = F.linear, routing_linear
    try:
        yield routed
    finally:
        F.linear = previous
