"""Choosing the next token from full-vocabulary logits: greedy, or temperature / top-k / top-p sampling.

Shape legend: b batch, V real vocabulary, V_r this tp rank's slice of the padded vocabulary.

    full = gather_tp(logits_r)[:, :V]                 every tp rank holds the same (b, V) fp32 logits;
                                                      padded ids (>= V) are cut off, so never chosen
    greedy:   next = argmax(full)                     (first maximum, as torch / HF)
    sampling: p = softmax(top_p(top_k(full / T)))     removed ids get -inf, so probability 0
              next = min{i : cdf_i > u * cdf_V}       inverse CDF, u ~ U[0, 1) one draw per row and step

The uniforms come from one generator per prompt, seeded from (seed, prompt index) (`row_generators`), and
each row draws exactly one number per step whatever its logits. So the text of a prompt depends only on the
seed, the prompt and the model: not on the tp size, the data-parallel rank, the batch or its other rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from megatron import mpu


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (top_k / top_p unused); top_k 0 = all ids; top_p 1.0 = no nucleus cut."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got temperature="
                             f"{self.temperature}, top_k={self.top_k}, top_p={self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def gather_vocab(logits: torch.Tensor, vocab_size: int, tp_group=None) -> torch.Tensor:
    """Vocab-parallel (b, V_r) -> full (b, V) fp32 on every tp rank, padded ids dropped."""
    full = mpu.gather_from_tensor_model_parallel_region(logits.float().contiguous(), tp_group)
    return full[..., :vocab_size]


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(b, V): keep the top_k largest and the smallest set whose probability reaches top_p; others -inf."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # probability of the ids ranked above each one
        drop_sorted = before >= top_p  # the first id is always kept (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, sampling: Sampling, uniforms: Optional[torch.Tensor]) -> torch.Tensor:
    """Next ids (b,) int64 from full logits (b, V); uniforms (b,) in [0, 1), needed only when sampling."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), dim=-1)
    cdf = probs.double().cumsum(-1)  # (b, V)
    u = uniforms.to(cdf) * cdf[:, -1]  # scaled to the cdf's own total
    picked = (cdf <= u.unsqueeze(-1)).sum(-1)  # first id whose cdf exceeds u: its probability is > 0
    last_kept = probs.size(-1) - 1 - (probs > 0).flip(-1).int().argmax(-1)  # guards u rounding up to the total
    return torch.minimum(picked, last_kept)


def row_generators(seed: int, prompt_indices: Sequence[int]) -> List[torch.Generator]:
    """One CPU generator per prompt, seeded from (seed, prompt index)."""
    seeds = [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in prompt_indices]
    return [torch.Generator().manual_seed(s) for s in seeds]


def draw_uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """(b,) float64: the next uniform of each row's generator (one draw per row, always)."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
