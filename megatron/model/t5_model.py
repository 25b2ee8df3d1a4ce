"""T5 (v1.0 / v1.1) on tensor-parallel layers (the plain model; `t5_pipe` cuts the same modules into stages).

Shape legend: b batch, se / sd encoder / decoder lengths, h = d_model, n_r heads on this tp rank,
V_r this rank's padded-vocabulary slice.

    e0 = drop(E[enc_tokens]),  d0 = drop(E[dec_tokens])             shared vocab-parallel table E, no positions
    enc_bias = expand(encoder layer 1's bucketed table, bidirectional) + mask(enc_mask)   (b, n_r, se, se)
    e = drop(RMS_e(EncoderLayers(e0, enc_bias)))
    dec_bias = expand(decoder layer 1's table, causal) + mask(dec_mask)                   (b, n_r, sd, sd)
    d = drop(RMS_d(DecoderLayers(d0, dec_bias, e, mask(cross_mask))))
    logits = (d * h^-0.5) E^T                                       tied head (v1.0) with T5's output scaling
    logits = d W^T                                                  untied head (v1.1): own W (V_pad, h),
                                                                    vocab-parallel like E, no scaling (HF T5)

Masks are bool, True = masked out: enc_mask (b, 1, se, se), dec_mask (b, 1, sd, sd) (causal included by the
data pipeline), cross_mask (b, 1, sd, se).
Module numbers: embedding 0, encoder layers 1..Le, encoder final norm Le+1, decoder layers
Le+2..Le+Ld+1, decoder final norm Le+Ld+2, untied LM head Le+Ld+3.

Sequence parallelism (T5ModelPipe's `sequence_parallel`; the plain model never splits the sequence): both
embedded sequences are scattered along the sequence after the lookup, every layer and final norm sees
(b, s/t, h), cross-attention all-gathers the encoder output in its key/value projection, and the LM head
all-gathers the decoder output before the vocab-parallel GEMM.

State-dict names of the untied head: `lm_head.weight` (V_pad / tp, h) in T5Model, `weight` in T5ModelPipe's
last layer file; it is split by vocabulary rows (partition_dim 0, stride 1) like the word table.
"""
from __future__ import annotations

import torch
from torch import nn

from megatron import mpu
from .attention import mask_to_bias, normal_init
from .config import T5Config
from .language_model import OutputLayer, lm_logits, masked_lm_loss
from .layer_norm import RMSNorm
from .position import expand_compact_bias
from .rng import SeededDropout, init_rng, sequence_split
from .transformer import T5TransformerLayer, run_layers, sequence_parallel_norm, sequence_part


class T5Embedding(nn.Module):
    """Shared word table for encoder and decoder ids; (b, s) -> (b, s, h). Also the (tied) LM head
    (`weight_grad_store`: the head's, as `OutputLayer`'s)."""
    weight_grad_store = None

    def __init__(self, config: T5Config, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        group, _, tp_size = mpu.mappings.resolve_group(tp_group)
        self.vocab_size, self.tp_group, self.hidden_size = config.vocab_size, group, config.hidden_size
        part = sequence_part(group, sequence_parallel)
        self.sequence_parallel = part[1] > 1
        with init_rng(config.seed, 0):
            self.word_embeddings = mpu.VocabParallelEmbedding(
                config.padded_vocab_size(tp_size), config.hidden_size,
                init_method=normal_init(config.initializer_factor), tp_group=group, dtype=config.dtype)
        self.encoder_embedding_dropout = SeededDropout(config.hidden_dropout, config.seed, 0, 0, part=sequence_split(part))
        self.decoder_embedding_dropout = SeededDropout(config.hidden_dropout, config.seed, 0, 1, part=sequence_split(part))

    def forward(self, enc_tokens: torch.Tensor, dec_tokens: torch.Tensor):
        """(b, se), (b, sd) -> (b, se, h), (b, sd, h) (this rank's parts, s/t, with sequence parallelism)."""
        enc, dec = self.word_embeddings(enc_tokens), self.word_embeddings(dec_tokens)
        if self.sequence_parallel:
            enc = mpu.scatter_to_sequence_parallel_region(enc, self.tp_group)
            dec = mpu.scatter_to_sequence_parallel_region(dec, self.tp_group)
        return self.encoder_embedding_dropout(enc), self.decoder_embedding_dropout(dec)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder output (b, sd, h) -> (b, sd, V_r), scaled by h^-0.5 first (tied-embedding T5)."""
        return lm_logits(hidden * self.hidden_size ** -0.5, self.word_embeddings.weight, self.vocab_size,
                         self.tp_group, self.sequence_parallel, self.weight_grad_store)


class T5LMHead(OutputLayer):
    """Untied LM head (T5 v1.1): decoder output (b, sd, h) -> vocab-parallel logits (b, sd, V_r), no scaling;
    the table drawn N(0, initializer_factor^2) (HF's lm_head init) under module number `module_number`."""

    def __init__(self, config: T5Config, module_number: int, tp_group=None, sequence_parallel: bool = False):
        tp_size = mpu.mappings.resolve_group(tp_group)[2]
        super().__init__(config.vocab_size, config.padded_vocab_size(tp_size), config.hidden_size,
                         config.initializer_factor, config.seed, module_number, config.dtype, tp_group,
                         sequence_parallel)


class T5FinalNorm(nn.Module):
    """Stack output: drop(RMS(x))."""

    def __init__(self, config: T5Config, module_number: int, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        part = sequence_part(tp_group, sequence_parallel)
        with init_rng(config.seed, module_number):
            self.final_layernorm = sequence_parallel_norm(
                RMSNorm(config.hidden_size, config.layernorm_epsilon, config.dtype), part)
        self.dropout = SeededDropout(config.hidden_dropout, config.seed, module_number, 0, part=sequence_split(part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.final_layernorm(x))


def attention_bias(compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Compact position bias (n_r, q+k-1) and bool mask (b, 1, q, k) -> additive bias (b, n_r, q, k)."""
    q, k = mask.shape[-2:]
    return expand_compact_bias(compact, q, k) + mask_to_bias(mask, compact.dtype)


def encoder_layer_numbers(config: T5Config) -> range:
    return range(1, config.num_layers + 1)


def decoder_layer_numbers(config: T5Config) -> range:
    first = config.num_layers + 2
    return range(first, first + config.num_decoder_layers)


def lm_head_number(config: T5Config) -> int:
    """Module number of the untied LM head: after the decoder's final norm."""
    return decoder_layer_numbers(config).stop + 1


class T5Model(nn.Module):
    """forward(enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask) -> vocab-parallel logits (b, sd, V_r)."""

    def __init__(self, config: T5Config, tp_group=None):
        super().__init__()
        self.config = config
        self.tp_group = mpu.mappings.resolve_group(tp_group)[0]
        g = self.tp_group
        self.embedding = T5Embedding(config, g)
        self.encoder_layers = nn.ModuleList(T5TransformerLayer(config, n, False, i == 0, g)
                                            for i, n in enumerate(encoder_layer_numbers(config)))
        self.encoder_final = T5FinalNorm(config, config.num_layers + 1)
        self.decoder_layers = nn.ModuleList(T5TransformerLayer(config, n, True, i == 0, g)
                                            for i, n in enumerate(decoder_layer_numbers(config)))
        self.decoder_final = T5FinalNorm(config, decoder_layer_numbers(config).stop)
        self.lm_head = None if config.tie_word_embeddings else T5LMHead(config, lm_head_number(config), g)

    def forward(self, enc_tokens: torch.Tensor, dec_tokens: torch.Tensor, enc_mask: torch.Tensor,
                dec_mask: torch.Tensor, cross_mask: torch.Tensor) -> torch.Tensor:
        n = self.config.checkpoint_num_layers
        enc, dec = self.embedding(enc_tokens, dec_tokens)  # (b, se, h), (b, sd, h)
        enc = self.encode(enc, enc_mask)
        dec_bias = attention_bias(self.decoder_layers[0].position_bias.compact(*dec_mask.shape[-2:]), dec_mask)
        cross_bias = mask_to_bias(cross_mask, dec.dtype)
        dec = self.decoder_final(run_layers(self.decoder_layers, dec, n, dec_bias, enc, cross_bias,
                                            method=self.config.recompute_method))
        return self.head(dec)

    def encode(self, enc: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
        """Embedded encoder input (b, se, h) -> the encoder's output (b, se, h)."""
        enc_bias = attention_bias(self.encoder_layers[0].position_bias.compact(*enc_mask.shape[-2:]), enc_mask)
        return self.encoder_final(run_layers(self.encoder_layers, enc, self.config.checkpoint_num_layers, enc_bias,
                                             method=self.config.recompute_method))

    def head(self, dec: torch.Tensor) -> torch.Tensor:
        """Decoder output (b, q, h) -> vocab-parallel logits (b, q, V_r): the tied table or the untied head."""
        return self.embedding.logits(dec) if self.lm_head is None else self.lm_head(dec)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """Masked mean of the vocab-parallel cross entropy (fp32 scalar)."""
        return masked_lm_loss(logits, labels, loss_mask, self.tp_group, self.config.cross_entropy_loss_fusion)
