"""Next-token logits of a batch of prompts, step by step, with the key-value cache or by recomputing.

Shape legend: b batch, L longest prompt (GPT-2) / encoder input (T5), t tokens so far, q new positions
this call, h hidden, n_r heads on this tp rank, V_r this rank's padded-vocabulary slice.

A runner is built from a model in eval mode and a batch of prompt ids; `first()` returns the logits
(b, V_r) of the token after each prompt, `next(tokens)` appends one token per row and returns the logits
after it. With `use_cache` a step feeds only the new token (q = 1) and attends over the cached keys/values;
without, it recomputes the whole sequence (q = t) — same numbers, used as the reference and in the benchmark.
Only the last position goes through the LM head.

GPT-2 rows are left-padded (`prompts.left_pad`): row i's token in column j sits at position
max(j - pad_i, 0), and the mask hides pad columns (a pad query sees only itself, so no row is empty).
T5 encodes once (encoder input right-padded, pad keys masked); the decoder starts from `pad` (the training
data's decoder start) at position 0 and every row has the same length, so only causality is masked.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megatron.model.attention import mask_to_bias
from .kv_cache import decoder_caches
from .prompts import left_pad, right_pad


class _Runner:
    """The step protocol; subclasses define `_forward(start, end)` over positions [start, end)."""

    def __init__(self, model, rows: int, length: int, capacity: int, pad_id: int, caches):
        """`length` positions fed so far of `capacity`; `caches` one per decoder layer, or None to recompute."""
        self.model = model
        self.device = model.embedding.word_embeddings.weight.device
        self.tokens = torch.full((rows, capacity), pad_id, dtype=torch.long, device=self.device)
        self.length = length
        self.caches = caches

    def first(self) -> torch.Tensor:
        return self._forward(0, self.length)

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b,) -> logits (b, V_r) after them."""
        self.tokens[:, self.length] = tokens
        self.length += 1
        return self._forward(self.length - 1 if self.caches is not None else 0, self.length)

    def _forward(self, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError


class GPT2Runner(_Runner):
    """GPTModel over left-padded prompts; room for `max_new_tokens` more positions."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                 use_cache: bool = True):
        batch = left_pad(prompts, pad_id, model.embedding.word_embeddings.weight.device)
        b, length = batch.tokens.shape
        capacity = length + max_new_tokens
        super().__init__(model, b, length, capacity, pad_id,
                         decoder_caches(len(model.layers), capacity) if use_cache else None)
        self.tokens[:, :length] = batch.tokens
        self.pads = batch.pads  # (b,)
        self.max_position = model.config.max_position_embeddings - 1

    def _mask(self, start: int, end: int) -> torch.Tensor:
        """(b, 1, q, end) bool, True = masked: future columns and pad columns, except each query's own."""
        device = self.tokens.device
        i = torch.arange(start, end, device=device).unsqueeze(1)  # (q, 1)
        j = torch.arange(end, device=device).unsqueeze(0)  # (1, k)
        pad_key = j.unsqueeze(0) < self.pads.view(-1, 1, 1)  # (b, 1, k)
        masked = ((j > i).unsqueeze(0) | pad_key) & (j != i).unsqueeze(0)  # (b, q, k)
        return masked.unsqueeze(1)

    def _forward(self, start: int, end: int) -> torch.Tensor:
        m = self.model
        columns = torch.arange(start, end, device=self.tokens.device).unsqueeze(0)  # (1, q)
        positions = (columns - self.pads.unsqueeze(1)).clamp(0, self.max_position)  # (b, q)
        x = m.embedding(self.tokens[:, start:end], positions)  # (b, q, h)
        mask = self._mask(start, end)
        for layer, cache in zip(m.layers, self.caches or [None] * len(m.layers)):
            x = layer(x, mask, kv_cache=cache)
        return m.head(m.final_layernorm(x[:, -1:]))[:, 0]  # (b, V_r)


class T5Runner(_Runner):
    """T5Model: encoder over right-padded prompts once, then the decoder one token at a time."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                 use_cache: bool = True):
        capacity = 1 + max_new_tokens  # the decoder start token (pad, already in place) and the new ones
        super().__init__(model, len(prompts), 1, capacity, pad_id,
                         decoder_caches(len(model.decoder_layers), capacity, cross_attention=True)
                         if use_cache else None)
        enc_tokens, lengths = right_pad(prompts, pad_id, self.device)
        length = enc_tokens.size(1)
        pad_key = torch.arange(length, device=self.device).unsqueeze(0) >= lengths.unsqueeze(1)  # (b, L)
        enc_mask = pad_key[:, None, None, :].expand(-1, 1, length, length)  # (b, 1, L, L) pad keys masked
        x = model.embedding.encoder_embedding_dropout(model.embedding.word_embeddings(enc_tokens))
        self.encoder_output = model.encode(x, enc_mask)  # (b, L, h)
        self.cross_bias = mask_to_bias(pad_key[:, None, None, :], self.encoder_output.dtype)  # (b, 1, 1, L)

    def _forward(self, start: int, end: int) -> torch.Tensor:
        m = self.model
        x = m.embedding.decoder_embedding_dropout(m.embedding.word_embeddings(self.tokens[:, start:end]))
        bias = m.decoder_layers[0].position_bias.bias(start, end - start, end)  # (1, n_r, q, end)
        if end - start > 1:
            i = torch.arange(start, end, device=x.device).unsqueeze(1)
            bias = bias + mask_to_bias(torch.arange(end, device=x.device).unsqueeze(0) > i, bias.dtype)
        for layer, cache in zip(m.decoder_layers, self.caches or [None] * len(m.decoder_layers)):
            x = layer(x, bias, self.encoder_output, self.cross_bias, kv_cache=cache)
        return m.head(m.decoder_final(x[:, -1:]))[:, 0]  # (b, V_r)


def make_runner(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                use_cache: bool = True) -> _Runner:
    """GPT2Runner or T5Runner by the model's kind."""
    runner = T5Runner if hasattr(model, "decoder_layers") else GPT2Runner
    return runner(model, prompts, max_new_tokens, pad_id, use_cache)
