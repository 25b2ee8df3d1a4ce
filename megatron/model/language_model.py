"""LM head (tied to the vocab-parallel word embedding, or an untied output layer), and the masked LM loss.

Shape legend: b batch, s sequence, h hidden, V real vocabulary, V_pad padded (`padded_vocab_size`),
V_r = V_pad / tp this rank's slice [r V_r, (r+1) V_r).

    logits = x E^T                               (b, s, V_r), vocab-parallel
    logits[..., v] = finfo(dtype).min   for v >= V   padded ids: exp(min - max) = 0 in the fp32 softmax, so
                                                     they take no probability mass and get no gradient
    loss = sum(CE(logits, labels) * loss_mask) / sum(loss_mask)      CE in fp32 (vocab-parallel; fused or eager)
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from megatron import mpu
from tds import device as tds_device
from .rng import init_rng


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Set this rank's logits of padded ids (global id >= vocab_size) to the dtype's minimum, in place."""
    _, tp_rank, _ = mpu.mappings.resolve_group(tp_group)
    local = logits.size(-1)
    first_padded = max(vocab_size - tp_rank * local, 0)  # local index of the first padded id
    if first_padded < local:
        logits.narrow(-1, first_padded, local - first_padded).fill_(torch.finfo(logits.dtype).min)
    return logits


def lm_logits(hidden: torch.Tensor, word_embeddings_weight: torch.Tensor, vocab_size: int,
              tp_group=None, sequence_parallel: bool = False, store=None) -> torch.Tensor:
    """(b, s, h) -> vocab-parallel logits (b, s, V_r) with padded ids masked; with sequence_parallel hidden is
    this rank's part of the sequence (b, s/t, h), all-gathered first (`store`: ZB-H1's, `mpu.parallel_lm_logits`)."""
    logits = mpu.parallel_lm_logits(hidden, word_embeddings_weight, parallel_output=True, tp_group=tp_group,
                                    sequence_parallel=sequence_parallel, store=store)
    return mask_padded_vocab(logits, vocab_size, tp_group)


class OutputLayer(nn.Module):
    """Untied LM head: hidden (b, s, h) -> vocab-parallel logits (b, s, V_r), padded ids masked.

    `weight` is this rank's rows of a (V_pad, h) table drawn N(0, std^2) from the CPU generator under module
    number `module_number` (`rng.init_rng`), then cut by vocabulary rows as the word table is (partition_dim 0,
    stride 1). With sequence_parallel the hidden state is this rank's part of the sequence, gathered first.
    `weight_grad_store`: set from outside by `tds.pipe.weight_grad.attach` (ZB-H1 defers the weight gradient).
    """
    weight_grad_store = None

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, std: float, seed: int,
                 module_number: int, dtype: torch.dtype, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        group, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
        self.vocab_size, self.tp_group = vocab_size, group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        with init_rng(seed, module_number):
            master = torch.empty(padded_vocab_size, hidden_size).normal_(0.0, std)
        part = mpu.partition_master(master, 0, 1, tp_size)[tp_rank]
        self.weight = nn.Parameter(part.to(device=tds_device.device(), dtype=dtype).contiguous())
        mpu.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return lm_logits(hidden, self.weight, self.vocab_size, self.tp_group, self.sequence_parallel,
                         self.weight_grad_store)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor,
                   tp_group=None, fused: bool = False) -> torch.Tensor:
    """Scalar fp32 mean of the vocab-parallel cross entropy over positions where loss_mask is nonzero; `fused`:
    its form without whole-size fp32 copies of the logits (--cross-entropy-loss-fusion, `mpu.cross_entropy`)."""
    per_token = mpu.vocab_parallel_cross_entropy(logits, labels, tp_group, fused=fused)  # (b, s) fp32
    mask = loss_mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


class LMLoss:
    """`loss_fn(logits, (labels, loss_mask))` for the pipeline's last stage."""

    def __init__(self, tp_group=None, fused: bool = False):
        self.tp_group, self.fused = tp_group, fused

    def __call__(self, logits: torch.Tensor, labels: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        target, loss_mask = labels
        return masked_lm_loss(logits, target, loss_mask, self.tp_group, self.fused)
