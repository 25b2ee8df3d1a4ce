"""Cross entropy over logits whose vocabulary is split across tensor-parallel ranks.

Shape legend: ... any leading dims (b, s), V/p this rank's vocabulary slice.

For logits z (full vocabulary V, split z = [z_1, ..., z_p]) and target t, computed in fp32:
    m = max_v z_v                       (all-reduce MAX of each rank's max)
    S = sum_v exp(z_v - m)              (all-reduce SUM)
    loss = log S - (z_t - m)            (z_t - m lives on the one rank owning t; all-reduce SUM, others give 0)
    dloss/dz_v = softmax(z)_v - [v == t]
Targets outside this rank's range [r*V/p, (r+1)*V/p) contribute 0 to z_t here (Megatron's masking).
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

        partition_vocab = logits.size(-1)
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab, tp_rank, tp_size)
        target_mask = (target < vocab_start) | (target >= vocab_end)  # (...) True where another rank owns t
        local_target = (target - vocab_start).masked_fill(target_mask, 0)
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


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 tp_group=None) -> torch.Tensor:
    """Per-token loss (...) in fp32 from logits (..., V/p) and targets (...) with global vocabulary ids.

    Equals F.cross_entropy(gathered_logits.float().view(-1, V), target.view(-1), reduction='none'),
    gradient included. `tp_group=None` means the current tensor-model-parallel group.
    """
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group)
