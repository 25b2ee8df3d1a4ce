"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

Shape legend: ... any leading dims (b, s), V/p this rank's vocabulary slice.

For logits z (full vocabulary V, split z = [z_1, ..., z_p]) and target t, computed in fp32:
    m = max_v z_v                       (all-reduce MAX of each rank's max)
    S = sum_v exp(z_v - m)              (all-reduce SUM)
    loss = log S - (z_t - m)            (z_t - m lives on the one rank owning t; all-reduce SUM, others give 0)
    dloss/dz_v = softmax(z)_v - [v == t]
Targets outside this rank's range [r*V/p, (r+1)*V/p) contribute 0 to z_t here (Megatron's masking).

Two implementations of the same values and gradient (`fused=` / Megatron's --cross-entropy-loss-fusion):
    eager   the whole (..., V/p) slice in fp32: a copy of bf16 logits, z - m, then exp and softmax in place;
            saves the fp32 softmax (4 bytes per logit); backward makes an fp32 gradient and its cast (4 + e)
    fused   m by a max over the logits as they are (no copy); S and the gradient over row chunks of at most
            CHUNK_ELEMENTS fp32 elements in one reused buffer (exp(z - m) / S recomputed where it is used);
            saves the logits themselves (e bytes per logit: 2 in bf16, 4 in fp32) and m, S (8 bytes per token);
            backward writes the gradient in the logits' dtype (e per logit), fp32 in place, else through the
            fp32 chunk
Per logit beyond the logits (bench/loss_memory.py), bf16: saved 4 -> 2 bytes, forward peak 8 -> a chunk,
backward peak 6 -> 2 + a chunk; fp32: saved 4 -> 4, forward 4 -> a chunk, backward 4 -> 4. The fused form's
operations on each row are the eager ones, in the same order: the same bits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .mappings import resolve_group
from .utils import VocabUtility


def _all_reduce(x: torch.Tensor, group, size: int, op=dist.ReduceOp.SUM) -> None:
    if size > 1:
        dist.all_reduce(x, op=op, group=group)


class _VocabParallelCrossEntropy(torch.autograd.Function):

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp_group):
        group, tp_rank, tp_size = resolve_group(tp_group)
        logits = vocab_parallel_logits.float()  # (..., V/p), a fresh fp32 copy or the input itself
        logits_max = logits.max(dim=-1)[0]
        _all_reduce(logits_max, group, tp_size, dist.ReduceOp.MAX)
        logits = logits - logits_max.unsqueeze(-1)

        target_mask, local_target = _local_targets(target, logits.size(-1), tp_rank, tp_size)  # (...) each
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
        _all_reduce(predicted, group, tp_size)

        exp_logits = logits.exp_()
        sum_exp = exp_logits.sum(dim=-1)
        _all_reduce(sum_exp, group, tp_size)
        loss = sum_exp.log() - predicted  # (...)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.input_dtype = vocab_parallel_logits.dtype
        ctx.save_for_backward(softmax, target_mask, local_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, local_target = ctx.saved_tensors
        grad_output = grad_output.unsqueeze(-1).float()  # (..., 1)
        grad_input = softmax * grad_output  # (..., V/p)
        own = (~target_mask).unsqueeze(-1).float()
        grad_input.scatter_add_(-1, local_target.unsqueeze(-1), -own * grad_output)
        return grad_input.to(ctx.input_dtype), None, None


CHUNK_ELEMENTS = 2 ** 24  # fused: fp32 elements per row chunk (64 MiB)


def _local_targets(target: torch.Tensor, partition_vocab: int, tp_rank: int, tp_size: int):
    """(mask True where another rank owns t, t's index in this rank's slice or 0) for flat targets (n,)."""
    vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(partition_vocab, tp_rank, tp_size)
    target_mask = (target < vocab_start) | (target >= vocab_end)
    return target_mask, (target - vocab_start).masked_fill(target_mask, 0)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The module docstring's fused form: logits (n, V/p) flat over the leading dims, targets (n,)."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, chunk_elements):
        group, tp_rank, tp_size = resolve_group(tp_group)
        target_mask, local_target = _local_targets(target, logits.size(-1), tp_rank, tp_size)
        logits_max = logits.max(dim=-1)[0].float()  # (n,) exact in any dtype
        _all_reduce(logits_max, group, tp_size, dist.ReduceOp.MAX)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float() - logits_max
        predicted.masked_fill_(target_mask, 0.0)
        sum_exp = torch.empty_like(logits_max)
        buffer = _chunk_buffer(logits, chunk_elements)
        for rows in _row_chunks(logits, chunk_elements):
            work = _shifted(buffer, logits[rows], logits_max[rows])  # (c, V/p) fp32: z - m
            sum_exp[rows] = work.exp_().sum(dim=-1)
        del buffer
        stats = torch.stack([predicted, sum_exp])  # (2, n): one all-reduce for both sums
        _all_reduce(stats, group, tp_size)
        predicted, sum_exp = stats[0], stats[1].clone()  # S saved alone (n,), not with its (2, n) storage
        ctx.chunk_elements = chunk_elements
        ctx.save_for_backward(logits, logits_max, sum_exp, target_mask, local_target)
        return sum_exp.log() - predicted  # (n,)

    @staticmethod
    def backward(ctx, grad_output):
        logits, logits_max, sum_exp, target_mask, local_target = ctx.saved_tensors
        grad_input = torch.empty_like(logits)  # (n, V/p) in the logits' dtype
        grad_output = grad_output.float().unsqueeze(-1)  # (n, 1)
        # fp32 logits: each chunk is computed in its place in grad_input; else in one fp32 chunk, then cast
        buffer = None if logits.dtype == torch.float32 else _chunk_buffer(logits, ctx.chunk_elements)
        for rows in _row_chunks(logits, ctx.chunk_elements):
            out = grad_input[rows]
            work = _shifted(out if buffer is None else buffer, logits[rows], logits_max[rows])
            work.exp_().div_(sum_exp[rows].unsqueeze(-1)).mul_(grad_output[rows])  # softmax x g
            own = (~target_mask[rows]).unsqueeze(-1).float()
            work.scatter_add_(-1, local_target[rows].unsqueeze(-1), -own * grad_output[rows])
            if buffer is not None:
                out.copy_(work)
        return grad_input, None, None, None


def _row_chunks(logits: torch.Tensor, chunk_elements: int):
    """Slices of at most chunk_elements // V/p rows (at least one) of logits (n, V/p)."""
    n, step = logits.size(0), max(1, chunk_elements // max(1, logits.size(-1)))
    return [slice(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _chunk_buffer(logits: torch.Tensor, chunk_elements: int) -> torch.Tensor:
    """One fp32 chunk (c, V/p), reused by every chunk."""
    rows = min(logits.size(0), max(1, chunk_elements // max(1, logits.size(-1))))
    return torch.empty(rows, logits.size(-1), dtype=torch.float32, device=logits.device)


def _shifted(buffer: torch.Tensor, logits: torch.Tensor, logits_max: torch.Tensor) -> torch.Tensor:
    """z - m in fp32 for a chunk of logits (c, V/p), written into buffer's first c rows (or buffer itself)."""
    work = buffer[:logits.size(0)]
    work.copy_(logits)  # the cast to fp32, without a copy of its own
    return work.sub_(logits_max.unsqueeze(-1))


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 tp_group=None, fused: bool = False,
                                 chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """Per-token loss (...) in fp32 from logits (..., V/p) and targets (...) with global vocabulary ids.

    Equals F.cross_entropy(gathered_logits.float().view(-1, V), target.view(-1), reduction='none'),
    gradient included. `tp_group=None` means the current tensor-model-parallel group. `fused`: without
    whole-size fp32 copies of the logits (module docstring; --cross-entropy-loss-fusion).
    """
    if not fused:
        return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
    flat = vocab_parallel_logits.reshape(-1, vocab_parallel_logits.size(-1))  # (n, V/p), a view when contiguous
    loss = _FusedVocabParallelCrossEntropy.apply(flat, target.reshape(-1), tp_group, chunk_elements)
    return loss.view(target.shape)
