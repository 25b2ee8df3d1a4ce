"""GPT on tensor-parallel layers (the plain model; `gpt2_pipe` cuts the same modules into stages).

Shape legend: b batch, s sequence, h hidden, V_r this rank's padded-vocabulary slice.

    x0 = drop(E[tokens] + P[positions])          E vocab-parallel (V_pad, h), P learned (max_pos, h); no P with
                                                 rotary positions (applied inside attention) or none
    x_l = TransformerLayer_l(x_{l-1}, mask)      l = 1..L, pre-norm (LayerNorm or RMSNorm)
    logits = N_f(x_L) E^T                        tied head, padded ids masked; (b, s, V_r)
    logits = N_f(x_L) W^T                        untied head: own vocab-parallel W (V_pad, h)

Module numbers (init seeds, dropout sites): embedding 0, layers 1..L, final norm L+1, untied head L+2.

Sequence parallelism (the Pipe model's `sequence_parallel`; the plain model never splits the sequence): x0 is
scattered along the sequence after the embedding sum, so every layer and LN_f see (b, s/t, h), and the LM head
all-gathers LN_f(x_L) (its gradient reduce-scattered back) before the vocab-parallel GEMM.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron import mpu
from tds import device as tds_device
from .attention import normal_init
from .config import GPTConfig
from .language_model import OutputLayer, lm_logits, masked_lm_loss
from .layer_norm import norm
from .rng import SeededDropout, init_rng, sequence_split
from .transformer import TransformerLayer, run_layers, sequence_parallel_norm, sequence_part


class GPT2Embedding(nn.Module):
    """(b, s) token ids [, (b, s) position ids] -> (b, s, h); the word table is also the LM head when tied.
    Position ids are used only by the learned table ('learned_absolute'). `weight_grad_store`: the tied head's,
    as `OutputLayer`'s."""
    weight_grad_store = None

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        group, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
        self.vocab_size, self.tp_group = config.vocab_size, group
        self.sequence_parallel = sequence_parallel and tp_size > 1
        part = (tp_rank, tp_size) if self.sequence_parallel else (0, 1)
        self.position_embeddings = None
        with init_rng(config.seed, 0):  # positions first: the word table's size depends on tp (padding)
            if config.position_embedding_type == "learned_absolute":
                positions = torch.empty(config.max_position_embeddings, config.hidden_size)
                normal_init(config.init_method_std)(positions)
                self.position_embeddings = nn.Embedding.from_pretrained(
                    positions.to(device=tds_device.device(), dtype=config.dtype), freeze=False)
            self.word_embeddings = mpu.VocabParallelEmbedding(
                config.padded_vocab_size(tp_size), config.hidden_size,
                init_method=normal_init(config.init_method_std), tp_group=group, dtype=config.dtype)
        self.embedding_dropout = SeededDropout(config.hidden_dropout, config.seed, 0, 0, part=sequence_split(part))

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(b, s) -> (b, s, h); with sequence parallelism this rank's part (b, s/t, h)."""
        x = self.word_embeddings(tokens)  # (b, s, h)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
            x = x + self.position_embeddings(position_ids)
        if self.sequence_parallel:
            x = mpu.scatter_to_sequence_parallel_region(x, self.tp_group)  # (b, s/t, h)
        return self.embedding_dropout(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(b, s, h) -> (b, s, V_r) against the word table (hidden (b, s/t, h) with sequence parallelism)."""
        return lm_logits(hidden, self.word_embeddings.weight, self.vocab_size, self.tp_group, self.sequence_parallel,
                         self.weight_grad_store)


def final_layernorm(config: GPTConfig, tp_group=None, sequence_parallel: bool = False) -> nn.Module:
    with init_rng(config.seed, config.num_layers + 1):
        module = norm(config.normalization, config.hidden_size, config.layernorm_epsilon, config.dtype)
    return sequence_parallel_norm(module, sequence_part(tp_group, sequence_parallel))


class GPT2LMHead(OutputLayer):
    """The untied output layer (--untie-embeddings-and-output-weights): N_f(x_L) (b, s, h) -> (b, s, V_r), drawn
    N(0, init_method_std^2) under module number L + 2."""

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel: bool = False):
        tp_size = mpu.mappings.resolve_group(tp_group)[2]
        super().__init__(config.vocab_size, config.padded_vocab_size(tp_size), config.hidden_size,
                         config.init_method_std, config.seed, config.num_layers + 2, config.dtype, tp_group,
                         sequence_parallel)


class GPTModel(nn.Module):
    """forward(tokens, position_ids, attention_mask) -> vocab-parallel logits (b, s, V_r).

    attention_mask: bool (b or 1, 1, s, s), True = masked out; None means plain causal attention.
    """

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.config = config
        self.tp_group = mpu.mappings.resolve_group(tp_group)[0]
        self.embedding = GPT2Embedding(config, self.tp_group)
        self.layers = nn.ModuleList(TransformerLayer(config, i + 1, self.tp_group) for i in range(config.num_layers))
        self.final_layernorm = final_layernorm(config)
        self.lm_head = None if config.tie_word_embeddings else GPT2LMHead(config, self.tp_group)

    def forward(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embedding(tokens, position_ids)  # (b, s, h)
        x = run_layers(self.layers, x, self.config.checkpoint_num_layers, attention_mask,
                       method=self.config.recompute_method)
        return self.head(self.final_layernorm(x))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-norm output (b, s, h) -> vocab-parallel logits (b, s, V_r): the tied table or the untied head."""
        return self.embedding.logits(hidden) if self.lm_head is None else self.lm_head(hidden)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Masked mean of the vocab-parallel cross entropy (fp32 scalar)."""
        return masked_lm_loss(logits, labels, loss_mask, self.tp_group, self.config.cross_entropy_loss_fusion)


GPT2Model = GPTModel  # the earlier name, for code written against it
