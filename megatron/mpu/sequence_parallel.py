"""The column-parallel GEMM under sequence parallelism, storing only this rank's part of its input.

Shape legend: b batch, s sequence, p tp size, in / out the GEMM's widths (out_r = out / p on this rank).

    forward   X = AG(X^r)  (b, s, in) from (b, s/p, in);   Y_r = X A_r^T + b_r      (b, s, out_r)
    backward  X = AG(X^r) again;  dX = RS(dY_r A_r)  (b, s/p, in);  dA_r = dY_r^T X,  db_r = sum dY_r

Saving X^r instead of the gathered X keeps the stored GEMM input at s/p rows (Korthikanti et al. 2022,
section 4.2.2: "we only store the sequence-parallel part and all-gather it again in backward"): that re-gather
is the one all-gather that sequence parallelism adds to the communication of tensor parallelism (forward AG +
RS and backward RS + AG move what the two all-reduces they replace move). `gather_and_reduce_scatter_seq` runs
the re-gather and dX's reduce-scatter together: one all-to-all on CPU, the gather under dX's GEMM elsewhere.
With a `WeightGradStore` deferring (ZB-H1), dA_r and db_r are queued with the gathered X and dY_r and computed
in W.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tds.pipe.weight_grad import WeightGradStore
from .mappings import _gather_seq, gather_and_reduce_scatter_seq


class _SequenceParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_part, weight, bias, group, store):
        ctx.save_for_backward(x_part, weight)
        ctx.params, ctx.group, ctx.store = (weight, bias), group, store
        return F.linear(_gather_seq(x_part, group), weight, bias)  # (b, s, out_r)

    @staticmethod
    def backward(ctx, dy):  # dy (b, s, out_r)
        x_part, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        x, dx = gather_and_reduce_scatter_seq(x_part, (lambda: dy.matmul(weight)) if need_x else None,
                                              ctx.group)  # (b, s, in), (b, s/p, in)
        if not (need_w or need_b):
            return dx, None, None, None, None

        def grads():
            dy2 = dy.reshape(-1, dy.shape[-1])  # (b s, out_r)
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None  # (out_r, in)
            return [dw, dy2.sum(0) if need_b else None]

        if ctx.store is not None and ctx.store.deferring:
            ctx.store.put(list(ctx.params), grads)
            return dx, None, None, None, None
        dw, db = grads()
        return dx, dw, db, None, None


def sequence_parallel_linear(x_part: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group,
                             store: Optional[WeightGradStore] = None) -> torch.Tensor:
    """(b, s/p, in) this rank's part of the sequence -> (b, s, out_r) = AG(x) weight^T + bias (module doc)."""
    return _SequenceParallelLinear.apply(x_part, weight, bias, group, store)
