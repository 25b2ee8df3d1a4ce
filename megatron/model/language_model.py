"""LM head tied to the vocab-parallel word embedding, and the masked LM loss.

Shape legend: b batch, s sequence, h hidden, V real vocabulary, V_pad padded (`padded_vocab_size`),
V_r = V_pad / tp this rank's slice [r V_r, (r+1) V_r).

    logits = x E^T                               (b, s, V_r), vocab-parallel
    logits[..., v] = finfo(dtype).min   for v >= V   padded ids: exp(min - max) = 0 in the fp32 softmax, so
                                                     they take no probability mass and get no gradient
    loss = sum(CE(logits, labels) * loss_mask) / sum(loss_mask)      CE in fp32 (vocab-parallel)
"""
from __future__ import annotations

from typing import Tuple

import torch

from megatron import mpu


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Set this rank's logits of padded ids (global id >= vocab_size) to the dtype's minimum, in place."""
    _, tp_rank, _ = mpu.mappings.resolve_group(tp_group)
    local = logits.size(-1)
    first_padded = max(vocab_size - tp_rank * local, 0)  # local index of the first padded id
    if first_padded < local:
        logits.narrow(-1, first_padded, local - first_padded).fill_(torch.finfo(logits.dtype).min)
    return logits


def lm_logits(hidden: torch.Tensor, word_embeddings_weight: torch.Tensor, vocab_size: int,
              tp_group=None, sequence_parallel: bool = False) -> torch.Tensor:
    """(b, s, h) -> vocab-parallel logits (b, s, V_r) with padded ids masked; with sequence_parallel hidden is
    this rank's part of the sequence (b, s/t, h), all-gathered first."""
    logits = mpu.parallel_lm_logits(hidden, word_embeddings_weight, parallel_output=True, tp_group=tp_group,
                                    sequence_parallel=sequence_parallel)
    return mask_padded_vocab(logits, vocab_size, tp_group)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   tp_group=None) -> torch.Tensor:
    """Scalar fp32 mean of the vocab-parallel cross entropy over positions where loss_mask is nonzero."""
    per_token = mpu.vocab_parallel_cross_entropy(logits, labels, tp_group)  # (b, s) fp32
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


class LMLoss:
    """`loss_fn(logits, (labels, loss_mask))` for the pipeline's last stage."""

    def __init__(self, tp_group=None):
        self.tp_group = tp_group

    def __call__(self, logits: torch.Tensor, labels: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        target, loss_mask = labels
        return masked_lm_loss(logits, target, loss_mask, self.tp_group)
