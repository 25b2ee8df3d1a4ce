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

from typing import List, Optional, Sequence

import torch

from megatron.model.attention import mask_to_bias
from megatron.model.t5_model import attention_bias
from megatron.model.transformer import run_layers
from .kv_cache import LayerCache, decoder_caches
from .prompts import left_pad, right_pad


class _Runner:
    """The step protocol; subclasses define `_forward(start, end)` over positions [start, end)."""

    def __init__(self, use_cache: bool):
        self.use_cache = use_cache
        self.length = 0  # positions fed so far

    def first(self) -> torch.Tensor:
        return self._forward(0, self.length)

    def next(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b,) -> logits (b, V_r) after them."""
        self.tokens[:, self.length] = tokens
        self.length += 1
        return self._forward(self.length - 1 if self.use_cache else 0, self.length)

    def _forward(self, start: int, end: int) -> torch.Tensor:
        raise NotImplementedError


class GPT2Runner(_Runner):
    """GPT2Model over left-padded prompts; room for `max_new_tokens` more positions."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                 use_cache: bool = True):
        super().__init__(use_cache)
        self.model = model
        device = model.embedding.word_embeddings.weight.device
        batch = left_pad(prompts, pad_id, device)
        b, self.length = batch.tokens.shape
        capacity = self.length + max_new_tokens
        self.tokens = torch.full((b, capacity), pad_id, dtype=torch.long, device=device)
        self.tokens[:, :self.length] = batch.tokens
        self.pads = batch.pads  # (b,)
        self.max_position = model.config.max_position_embeddings - 1
        self.caches: Optional[List[LayerCache]] = (decoder_caches(len(model.layers), capacity)
                                                   if use_cache else None)

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
        return m.embedding.logits(m.final_layernorm(x[:, -1:]))[:, 0]  # (b, V_r)


def t5_head(model, hidden: torch.Tensor) -> torch.Tensor:
    """Decoder output (b, q, h) -> vocab-parallel logits (b, q, V_r): tied table or the untied head."""
    head = getattr(model, "lm_head", None)
    return model.embedding.logits(hidden) if head is None else head(hidden)


class T5Runner(_Runner):
    """T5Model: encoder over right-padded prompts once, then the decoder one token at a time."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                 use_cache: bool = True):
        super().__init__(use_cache)
        self.model = model
        device = model.embedding.word_embeddings.weight.device
        enc_tokens, lengths = right_pad(prompts, pad_id, device)
        pad_key = torch.arange(enc_tokens.size(1), device=device).unsqueeze(0) >= lengths.unsqueeze(1)  # (b, L)
        self.encoder_output = self._encode(enc_tokens, pad_key)  # (b, L, h)
        self.cross_bias = mask_to_bias(pad_key[:, None, None, :], self.encoder_output.dtype)  # (b, 1, 1, L)
        capacity = 1 + max_new_tokens
        self.tokens = torch.full((len(prompts), capacity), pad_id, dtype=torch.long, device=device)
        self.length = 1  # the decoder start token, pad
        self.caches = (decoder_caches(len(model.decoder_layers), capacity, cross_attention=True)
                       if use_cache else None)

    def _encode(self, enc_tokens: torch.Tensor, pad_key: torch.Tensor) -> torch.Tensor:
        m = self.model
        length = enc_tokens.size(1)
        enc_mask = pad_key[:, None, None, :].expand(-1, 1, length, length)  # (b, 1, L, L) pad keys masked
        x = m.embedding.encoder_embedding_dropout(m.embedding.word_embeddings(enc_tokens))
        bias = attention_bias(m.encoder_layers[0].position_bias.compact(length, length), enc_mask)
        return m.encoder_final(run_layers(m.encoder_layers, x, 0, bias))

    def _forward(self, start: int, end: int) -> torch.Tensor:
        m = self.model
        x = m.embedding.decoder_embedding_dropout(m.embedding.word_embeddings(self.tokens[:, start:end]))
        bias = m.decoder_layers[0].position_bias.bias(start, end - start, end)  # (1, n_r, q, end)
        if end - start > 1:
            i = torch.arange(start, end, device=x.device).unsqueeze(1)
            bias = bias + mask_to_bias(torch.arange(end, device=x.device).unsqueeze(0) > i, bias.dtype)
        for layer, cache in zip(m.decoder_layers, self.caches or [None] * len(m.decoder_layers)):
            x = layer(x, bias, self.encoder_output, self.cross_bias, kv_cache=cache)
        return t5_head(m, m.decoder_final(x[:, -1:]))[:, 0]  # (b, V_r)


def make_runner(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int,
                use_cache: bool = True) -> _Runner:
    """GPT2Runner or T5Runner by the model's kind."""
    runner = T5Runner if hasattr(model, "decoder_layers") else GPT2Runner
    return runner(model, prompts, max_new_tokens, pad_id, use_cache)
