"""Autograd functions that move activations into and out of the tensor-model-parallel region.

With p tensor-parallel ranks and X replicated on every rank (Megatron paper, section 3):

    f = copy_to_tensor_model_parallel_region      forward: identity        backward: all-reduce (sum)
    g = reduce_from_tensor_model_parallel_region  forward: all-reduce      backward: identity
    sum_over_tensor_model_parallel_region         forward: all-reduce      backward: all-reduce
    scatter_to_tensor_model_parallel_region       forward: X -> X_r        backward: all-gather along last dim
    gather_from_tensor_model_parallel_region      forward: [X_1 .. X_p]    backward: split, keep X_r

so an MLP Y = GeLU(X A) B with A = [A_1, ..., A_p] split by columns and B = [B_1; ...; B_p] split by rows is
    Z = g( GeLU(f(X) A_r) B_r ).
The third is a statistic of a split tensor, S = sum_r S_r, that each rank then uses on its own part (a norm over
all heads: `megatron.model.layer_norm.ProjectionRMSNorm`): every rank's part of the loss depends on S, so
dL/dS_r = sum over ranks of dL_r'/dS.
Shapes: split/gather act on the last dim, (..., h) <-> (..., h/p).

Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): outside the tensor-parallel regions (LayerNorm,
dropout, the residual stream) rank r holds X^r, its 1/p of the sequence, X = [X^1; ...; X^p] along the sequence
dim (dim 1 of (b, s, h)). The pair f, g becomes g_sp, f_sp:

    scatter_to_sequence_parallel_region       forward: X -> X^r           backward: all-gather along s
    gather_from_sequence_parallel_region      forward: all-gather along s backward: reduce-scatter along s
                                              (split instead, with tensor_parallel_output_grad=False)
    reduce_scatter_to_sequence_parallel_region forward: reduce-scatter     backward: all-gather along s

so the MLP becomes Z^r = RS( GeLU(AG(X^r) A_r) B_r ): the all-gather before each column-parallel linear and the
reduce-scatter after each row-parallel one move the bytes of the all-reduce they replace (a ring all-reduce
is a reduce-scatter followed by an all-gather), forward and backward alike.

`group=None` means the current tensor-model-parallel group (`get_tensor_model_parallel_group()`); without one
(world size 1) every function is the identity.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .parallel_state import get_tensor_model_parallel_group
from .utils import split_tensor_along_last_dim


def resolve_group(group) -> Tuple[Optional[dist.ProcessGroup], int, int]:
    """(group, tp_rank, tp_size) for `group`, or the current tensor-parallel group when it is None.

    Without torch.distributed or parallel state this is (None, 0, 1).
    """
    if group is None:
        group = get_tensor_model_parallel_group()
    if group is None or not dist.is_initialized():
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    group, _, size = resolve_group(group)
    if size == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


SEQ_DIM = 1  # the sequence dim of (b, s, h)


def _split_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) -> (b, s/p, h): this rank's part of the sequence."""
    group, rank, size = resolve_group(group)
    if size == 1:
        return x
    n = _seq_part(x.size(SEQ_DIM), size)
    return x.narrow(SEQ_DIM, rank * n, n).contiguous()


def _to_chunks(x: torch.Tensor, size: int) -> torch.Tensor:
    """(b, s, h) -> (p, b, s/p, h), contiguous: chunk j is part j of the sequence."""
    b, n = x.size(0), _seq_part(x.size(SEQ_DIM), size)
    return x.reshape(b, size, n, *x.shape[2:]).movedim(1, 0).contiguous()


def _from_chunks(parts: torch.Tensor) -> torch.Tensor:
    """(p, b, s/p, h) -> (b, s, h)."""
    return parts.movedim(0, SEQ_DIM).flatten(SEQ_DIM, SEQ_DIM + 1)


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over dim 0 of (p, ...): block j goes to rank j; block i of the result came from rank i."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


# On CPU (gloo) the sequence collectives below are all-to-alls. gloo has no reduce-scatter of its own: torch
# 2.13's gloo `reduce_scatter` runs one all-reduce per rank's chunk and `reduce_scatter_tensor` an all-reduce of
# the whole tensor, both moving 2 (p-1)/p N elements per rank (N = b s h), twice a reduce-scatter's; its
# all-gather is a ring of p-1 steps. An all-to-all sends each block straight to its rank in one round:
#   all-gather      send this part to every rank                 (p-1)/p N per rank, as a ring all-gather
#   reduce-scatter  send chunk j to rank j, sum the p received   (p-1)/p N per rank, as a ring reduce-scatter
# so the volume is exactly that of the all-gather and reduce-scatter they stand for. Other backends (NCCL) use
# all_gather_into_tensor and reduce_scatter_tensor (which gloo runs too: tests/mpu/test_mappings.py forces them).


def _by_all_to_all(x: torch.Tensor) -> bool:
    """Whether the sequence collectives of `x` run as all-to-alls: CPU tensors (gloo)."""
    return x.device.type == "cpu"


def _gather_into(part: torch.Tensor, group, size: int, async_op: bool = False):
    """(p, *part.shape) of every rank's `part` in rank order, by all_gather_into_tensor into p parts stacked
    along dim 0 (the layout NCCL and gloo both accept); with async_op, (parts, work)."""
    flat = part.new_empty(size * part.shape[0], *part.shape[1:])
    work = dist.all_gather_into_tensor(flat, part, group=group, async_op=async_op)
    parts = flat.view(size, *part.shape)
    return (parts, work) if async_op else parts


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s/p, h) -> (b, s, h): every rank's part, in rank order."""
    group, _, size = resolve_group(group)
    if size == 1:
        return x
    x = x.contiguous()
    if _by_all_to_all(x):
        return _from_chunks(_exchange(x.unsqueeze(0).expand(size, *x.shape).contiguous(), group))
    return _from_chunks(_gather_into(x, group, size))  # (p, b, s/p, h) -> (b, s, h)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(b, s, h) partial sums -> (b, s/p, h): this rank's part of the sum over ranks."""
    group, _, size = resolve_group(group)
    if size == 1:
        return x
    chunks = _to_chunks(x, size)  # (p, b, s/p, h): chunk j for rank j
    if _by_all_to_all(x):
        return _exchange(chunks, group).sum(0)  # the p partial sums of this rank's part, added
    out = torch.empty_like(chunks[0])
    dist.reduce_scatter_tensor(out, chunks.flatten(0, 1), group=group)
    return out


def gather_and_reduce_scatter_seq(part: torch.Tensor, compute_full: Optional[Callable[[], torch.Tensor]],
                                  group) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(AG(part), RS(compute_full())): part (b, s/p, h) -> (b, s, h); the full (b, s, h) partial sums -> (b, s/p, h)
    (None without compute_full). The backward of a column GEMM under sequence parallelism: re-gather the stored
    input part, reduce-scatter dX.

    On CPU the two travel in one all-to-all, rank j receiving [this part, chunk j of the sums]: the bytes of
    both collectives in one round. Elsewhere the all-gather starts before compute_full runs, so it overlaps it.
    """
    group, _, size = resolve_group(group)
    if size == 1:
        return part, (compute_full() if compute_full is not None else None)
    part = part.contiguous()
    if _by_all_to_all(part):
        full = compute_full() if compute_full is not None else None
        if full is None or full.dtype != part.dtype or full.shape[2:] != part.shape[2:]:
            return _gather_seq(part, group), (None if full is None else _reduce_scatter_seq(full, group))
        send = torch.stack([part.unsqueeze(0).expand(size, *part.shape), _to_chunks(full, size)], dim=1)
        received = _exchange(send, group)  # (p, 2, b, s/p, h): [i, 0] rank i's part, [i, 1] its sums of mine
        return _from_chunks(received[:, 0]), received[:, 1].sum(0)
    parts, work = _gather_into(part, group, size, async_op=True)
    reduced = _reduce_scatter_seq(compute_full(), group) if compute_full is not None else None
    work.wait()
    return _from_chunks(parts), reduced


def _seq_part(seq_length: int, size: int) -> int:
    if seq_length % size:
        raise ValueError(f"sequence parallelism: the sequence length ({seq_length}) is not divisible by the "
                         f"tensor-model-parallel size ({size})")
    return seq_length // size


def _split_last(x: torch.Tensor, group) -> torch.Tensor:
    group, rank, size = resolve_group(group)
    if size == 1:
        return x
    return split_tensor_along_last_dim(x, size)[rank].contiguous()


def _gather_last(x: torch.Tensor, group) -> torch.Tensor:
    group, rank, size = resolve_group(group)
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumOverRegion(torch.autograd.Function):
    """All-reduce forward and backward: a sum every rank uses on its own part of a split computation."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's last-dim chunk forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's chunk of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _ScatterToSequenceRegion(torch.autograd.Function):
    """Keep this rank's part of the sequence forward; all-gather the gradient along the sequence backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """All-gather along the sequence forward; backward reduce-scatter (the consumer is tensor-parallel, each
    rank holds a partial gradient) or, with tensor_parallel_output_grad=False, keep this rank's part."""

    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.reduce = group, tensor_parallel_output_grad
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_seq(grad, ctx.group) if ctx.reduce else _split_seq(grad, ctx.group)), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather the gradient along the sequence backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """f: Y = X forward, dL/dX = sum over tp ranks of dL/dY backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """g: Y = sum over tp ranks of X_r forward, dL/dX_r = dL/dY backward."""
    return _ReduceFromRegion.apply(x, group)


def sum_over_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """S = sum over tp ranks of S_r forward, on every rank; dL/dS_r = sum over tp ranks of dL/dS backward (each
    rank's use of S is its own)."""
    return _SumOverRegion.apply(x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., h) -> (..., h/p): this rank's chunk X_r of X = [X_1, ..., X_p]."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., h/p) -> (..., h): X = [X_1, ..., X_p] from every rank's X_r."""
    return _GatherFromRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s, h) -> (b, s/p, h): X^r of X = [X^1; ...; X^p] along the sequence."""
    return _ScatterToSequenceRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group=None,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """(b, s/p, h) -> (b, s, h); the gradient is reduce-scattered back (or split, see the class)."""
    return _GatherFromSequenceRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """(b, s, h) partial sums on each rank -> (b, s/p, h): this rank's part of their sum."""
    return _ReduceScatterToSequenceRegion.apply(x, group)
