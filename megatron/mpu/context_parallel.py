"""Context parallelism: causal attention over a sequence split across the ranks of a cp group (Megatron's
--context-parallel-size, --cp-comm-type), in plain torch, so that it runs on CPU (gloo) as on GPUs.

Shape legend: b batch, n query heads, G key/value groups (n / G query heads share one), s the whole sequence,
c = s / cp this rank's tokens, d head width.

The load-balanced split (`zigzag_indices`): the sequence is cut into 2 cp chunks and cp rank r keeps chunks r and
2 cp - 1 - r, so that under a causal mask every rank has the same work (cp 2: rank 0 holds chunks 0 and 3, rank 1
chunks 1 and 2). Tokens, labels, loss masks, position ids and document ids are all split this way.

`attention(q, k, v, group, comm, documents)`: q (b, n, c, d), k, v (b, G, c, d), this rank's tokens in that order ->
(b, n, c, d). Query i attends key j where pos_j <= pos_i (the positions of the whole sequence) and, with `documents`
(b, c) ids of packed documents, doc_j == doc_i: the result is full attention's rows of this rank's tokens.

    all_gather  K and V of every rank gathered (backward: dK, dV reduce-scattered), then this rank's c queries over
                the s keys. Messages: forward 1 all-gather (K and V in one tensor), backward 1 reduce-scatter.
    p2p         a ring of cp steps: at step t this rank holds rank (r - t)'s K and V (the un-repeated G groups, in
                one tensor), attends to them and passes them on. Each step's block gives (out_t, lse_t) with lse
                the log-sum-exp of the block's scores, merged exactly:
                    lse = log(exp(lse_a) + exp(lse_b)),  out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)
                The pass is an autograd function whose backward sends the gradient the other way: dK and dV ride
                their own ring back to their owners. Even ranks send then receive, odd ranks receive then send, so
                blocking point-to-point cannot deadlock. Messages: cp - 1 sends forward, cp - 1 backward.
    a2a         Ulysses: an all-to-all scatters heads and gathers the sequence, (b, n, c, d) -> (b, n / cp, s, d)
                (q, k and v in one exchange: G must be divisible by cp), full attention over s on n / cp heads,
                and an all-to-all back. Messages: forward 2 all-to-alls, backward 2.

Document ids (b, c) are all-gathered once per call when given (a small tensor, not counted above).
`MESSAGES` counts the collectives of the three kinds, by comm type (`tests/mpu/test_context_parallel.py`).
Attention dropout is not applied here.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .mappings import _exchange, _gather_into

COMM_TYPES = ("all_gather", "p2p", "a2a")
MESSAGES: Counter = Counter()  # (comm type, "forward" | "backward") -> collectives or sends of this process


def zigzag_indices(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """(c,) positions of the whole sequence held by cp rank `cp_rank`: chunks r and 2 cp - 1 - r of 2 cp."""
    if seq_length % (2 * cp):
        raise ValueError(f"the sequence length {seq_length} is not divisible by 2 x context-parallel size "
                         f"({2 * cp})")
    chunk = seq_length // (2 * cp)
    return torch.cat([torch.arange(i * chunk, (i + 1) * chunk) for i in (cp_rank, 2 * cp - 1 - cp_rank)])


def split_for_rank(x: torch.Tensor, dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's tokens of x along `dim` (the whole sequence there), in `zigzag_indices` order."""
    return x.index_select(dim, zigzag_indices(x.size(dim), cp, cp_rank).to(x.device))


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, q_doc: Optional[torch.Tensor],
             k_doc: Optional[torch.Tensor]) -> torch.Tensor:
    """Bool (b or 1, 1, q, k): True where the query may attend the key."""
    allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if q_doc is not None:
        allowed = allowed & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return allowed


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (b, n, q, d) over one block of keys k, v (b, G, k, d): (out (b, n, q, d), lse (b, n, q, 1)),
    fp32; a query with no allowed key gets out 0 and lse -inf (and no NaN in either direction)."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    weights = torch.exp(scores - top)
    total = weights.sum(dim=-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    out = torch.matmul(weights, v.float()) / total
    lse = torch.where(seen, top + torch.log(total), torch.full_like(total, float("-inf")))
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two blocks' results over disjoint keys as one (module docstring); `lse` must be finite."""
    merged = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - merged) + out_b * torch.exp(lse_b - merged), merged


class _RingPass(torch.autograd.Function):
    """x to the next rank of the ring, the previous rank's x back; backward: the gradient to the previous rank, the
    next rank's gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        MESSAGES["p2p", "forward"] += 1
        return _shift(x.contiguous(), group, +1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        MESSAGES["p2p", "backward"] += 1
        return _shift(grad.contiguous(), ctx.group, -1), None


def _shift(x: torch.Tensor, group, step: int) -> torch.Tensor:
    """Send x to the rank `step` ahead in the group, receive the one from `step` behind (even ranks send first)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    dst, src = dist.get_global_rank(group, (rank + step) % size), dist.get_global_rank(group, (rank - step) % size)
    received = torch.empty_like(x)
    if rank % 2 == 0:
        dist.send(x, dst, group=group)
        dist.recv(received, src, group=group)
    else:
        dist.recv(received, src, group=group)
        dist.send(x, dst, group=group)
    return received


class _GatherSequence(torch.autograd.Function):
    """(b, H, c, d) -> (cp, b, H, c, d): every rank's part, in rank order; backward: the sum of every rank's
    gradient of this rank's part (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        MESSAGES["all_gather", "forward"] += 1
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        MESSAGES["all_gather", "backward"] += 1
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return out, None


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """(...) -> (cp, ...): every rank's x in rank order."""
    return _gather_into(x.contiguous(), group, dist.get_world_size(group))


class _AllToAll(torch.autograd.Function):
    """(cp, ...) -> (cp, ...): block j to rank j, block i of the result from rank i; its own inverse."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        MESSAGES["a2a", "forward"] += 1
        return _exchange(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        MESSAGES["a2a", "backward"] += 1
        return _exchange(grad.contiguous(), ctx.group), None



def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, comm: str = "p2p",
              documents: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of this cp rank's tokens (module docstring); returns q's dtype."""
    if comm not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type must be one of {', '.join(COMM_TYPES)}, got {comm!r}")
    cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    c, scale = q.size(2), q.size(-1) ** -0.5 if scale is None else scale
    positions = [zigzag_indices(c * cp, cp, r).to(q.device) for r in range(cp)]  # of every rank
    docs = None
    if documents is not None:
        docs = _gather(documents, group)
    doc = (lambda r: None) if docs is None else (lambda r: docs[r])  # noqa: E731
    if comm == "a2a":
        return _ulysses(q, k, v, group, positions, doc, scale).to(q.dtype)
    if comm == "all_gather":
        kv = _GatherSequence.apply(torch.cat([k, v], dim=1), group)  # (cp, b, 2G, c, d)
        keys = torch.cat(list(kv.unbind(0)), dim=2)  # (b, 2G, s, d), rank-major
        k_all, v_all = keys.chunk(2, dim=1)
        k_pos, k_doc = torch.cat(positions), None if docs is None else torch.cat(list(docs.unbind(0)), dim=1)
        out, _ = _block(q, k_all, v_all, _allowed(positions[cp_rank], k_pos, doc(cp_rank), k_doc), scale)
        return out.to(q.dtype)
    kv = torch.cat([k, v], dim=1)  # (b, 2G, c, d): one message per step
    out, lse = None, None
    for step in range(cp):
        src = (cp_rank - step) % cp
        if step:
            kv = _RingPass.apply(kv, group)
        k_s, v_s = kv.chunk(2, dim=1)
        block = _block(q, k_s, v_s, _allowed(positions[cp_rank], positions[src], doc(cp_rank), doc(src)), scale)
        out, lse = block if out is None else _merge(out, lse, *block)
    return out.to(q.dtype)


def _ulysses(q, k, v, group, positions, doc, scale: float) -> torch.Tensor:
    """a2a (module docstring): heads scattered over the group, the sequence gathered in rank order."""
    cp = dist.get_world_size(group)
    n, groups = q.size(1), k.size(1)
    if groups % cp:
        raise ValueError(f"--cp-comm-type a2a scatters the key/value heads: {groups} per tensor-parallel rank is not "
                         f"divisible by the context-parallel size {cp}")

    def scatter_heads(x: torch.Tensor) -> torch.Tensor:  # (b, H, c, d) -> (cp, b, H / cp, c, d) by destination
        b, heads, c, d = x.shape
        return x.reshape(b, cp, heads // cp, c, d).movedim(1, 0)

    sent = torch.cat([scatter_heads(q), scatter_heads(k), scatter_heads(v)], dim=2)  # (cp, b, (n + 2G) / cp, c, d)
    got = _AllToAll.apply(sent, group)  # block i: rank i's tokens of my heads
    q_h, k_h, v_h = torch.cat(list(got.unbind(0)), dim=2).split([n // cp, groups // cp, groups // cp], dim=1)
    pos = torch.cat(positions)
    k_doc = None if doc(0) is None else torch.cat([doc(r) for r in range(cp)], dim=1)
    out, _ = _block(q_h, k_h, v_h, _allowed(pos, pos, k_doc, k_doc), scale)  # (b, n / cp, s, d)
    b, heads, s, d = out.shape
    back = _AllToAll.apply(out.reshape(b, heads, cp, s // cp, d).movedim(2, 0), group)  # block i: rank i's heads
    return back.movedim(0, 1).reshape(b, n, s // cp, d)
