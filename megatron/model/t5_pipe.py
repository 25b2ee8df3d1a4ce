"""T5ModelPipe: the T5 modules of `t5_model` as one TDS pipeline, encoder layers then decoder layers.

    spec 0            TiedLayerSpec('embed')   (enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask) -> T
    encoder layers    T5EncoderTransformerLayerPipe: T -> T with enc_h updated
    encoder final     T5EncoderFinalNormPipe: enc_h = drop(RMS(enc_h)); drops the encoder bias
    decoder layers    T5DecoderTransformerLayerPipe: T -> T with dec_h updated (cross-attends to enc_h)
    decoder final     T5DecoderFinalNormPipe: T -> drop(RMS(dec_h))
    last              TiedLayerSpec('embed')   -> vocab-parallel logits (h^-0.5 scaling, tied table)
                      or, untied (T5 v1.1), LayerSpec(T5LMHead) -> logits (own weight, no scaling); the
                      embedding is then a plain LayerSpec

Tuple T crossing every stage boundary (boundaries may fall anywhere, inside or between the stacks):

    pos  tensor                                  type   grad   tp-partitioned
    0    enc_h (b, se, h)                        float  yes    yes
    1    enc_mask (b, 1, se, se)                 bool   no     no
    2    dec_h (b, sd, h)                        float  yes    yes
    3    dec_mask (b, 1, sd, sd)                 bool   no     no
    4    cross_mask (b, 1, sd, se)               bool   no     no
    5    encoder compact bias (n_r, 2 se - 1)    float  yes    no (each tp rank holds its own heads)
    6    decoder compact bias (n_r, 2 sd - 1)    float  yes    no

With sequence parallelism (tp > 1) enc_h and dec_h are this tp rank's parts of their sequences,
(b, se/t, h) and (b, sd/t, h), different on every tp rank: they are declared not tp-partitioned, so each rank
sends its part to its peer of the same tp rank and nothing is gathered or re-split at the boundary.

Relative position bias. The first layer of each stack owns the bucketed table (as in T5 and in T5Model);
later layers of the stack, possibly on other stages, need its output. Choice: pass the computed bias, in
compact form, as declared tensors 5 and 6 with gradient. Compared with the alternatives:
- full bias (n_r, s, s) in the tuple: n_r s^2 values per hop per micro-batch, e.g. 12 heads x 512^2 x 4 B
  = 12.6 MB (fp32), as large as the hidden state itself (8 x 512 x 768 x 2 B = 6.3 MB);
- compact bias: n_r (2s - 1) values, 12 x 1023 x 4 B = 49 KB per hop, 0.8% of that hidden state; for the
  tiny test model (4 heads, s = 16) 4 x 31 x 4 B = 496 B next to 2 x 16 x 32 x 4 B = 4 KB of hidden;
- tied per-stack tables (TiedLayerSpec): no per-hop bytes, but the table must live in a glue spec before
  every layer (a TiedLayerSpec builds one module per stage) and stage boundaries must never separate a
  glue spec from its layer, and the table no longer sits in the first layer as in T5 checkpoints.
The compact bias keeps T5's ownership (pipeline layer files equal the plain model's layers), puts no
constraint on boundaries and costs < 1% of the hidden-state traffic; the gradient reaching it is the
sum over the stack's layers, exactly as for the plain model. Before a stack's first layer, and after the
encoder, the slot holds a 1-element placeholder (its gradient, zeros, is discarded).
Each layer expands the compact bias and adds its mask itself (the plain model does this once per stack).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from megatron import mpu
from tds.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from .attention import mask_to_bias
from .config import T5Config
from .language_model import LMLoss
from .pipe_common import (ReplayCheckpoint, SequenceParallelGrads, check_sequence_parallel, mark_block_recompute,
                          pipe_groups, uniform_interval)
from .t5_model import (T5Embedding, T5FinalNorm, T5LMHead, attention_bias, decoder_layer_numbers,
                       encoder_layer_numbers, lm_head_number)
from .transformer import T5TransformerLayer, recompute_whole

Boundary = Tuple[torch.Tensor, ...]  # the 7-tensor tuple T


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(1, dtype=like.dtype, device=like.device)


class T5EmbeddingPipe(T5Embedding):
    """(enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask) -> T."""

    def forward(self, inputs: Boundary) -> Boundary:
        enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask = inputs
        enc, dec = super().forward(enc_tokens, dec_tokens)
        return enc, enc_mask, dec, dec_mask, cross_mask, _placeholder(enc), _placeholder(dec)


def _lm_head(embedding: T5Embedding, dec: torch.Tensor) -> torch.Tensor:
    return embedding.logits(dec)


class T5EncoderTransformerLayerPipe(T5TransformerLayer):
    def __init__(self, config: T5Config, layer_number: int, owns_position_bias: bool, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__(config, layer_number, False, owns_position_bias, tp_group, sequence_parallel)

    def forward(self, inputs: Boundary) -> Boundary:
        return recompute_whole(self, self._forward, inputs)

    def _forward(self, inputs: Boundary) -> Boundary:
        enc, enc_mask, dec, dec_mask, cross_mask, enc_pos, dec_pos = inputs
        if self.position_bias is not None:
            enc_pos = self.position_bias.compact(*enc_mask.shape[-2:])
        enc = super().forward(enc, attention_bias(enc_pos, enc_mask))
        return enc, enc_mask, dec, dec_mask, cross_mask, enc_pos, dec_pos


class T5DecoderTransformerLayerPipe(T5TransformerLayer):
    def __init__(self, config: T5Config, layer_number: int, owns_position_bias: bool, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__(config, layer_number, True, owns_position_bias, tp_group, sequence_parallel)

    def forward(self, inputs: Boundary) -> Boundary:
        return recompute_whole(self, self._forward, inputs)

    def _forward(self, inputs: Boundary) -> Boundary:
        enc, enc_mask, dec, dec_mask, cross_mask, enc_pos, dec_pos = inputs
        if self.position_bias is not None:
            dec_pos = self.position_bias.compact(*dec_mask.shape[-2:])
        dec = super().forward(dec, attention_bias(dec_pos, dec_mask), enc, mask_to_bias(cross_mask, dec.dtype))
        return enc, enc_mask, dec, dec_mask, cross_mask, enc_pos, dec_pos


class T5EncoderFinalNormPipe(T5FinalNorm):
    def forward(self, inputs: Boundary) -> Boundary:
        enc, enc_mask, dec, dec_mask, cross_mask, enc_pos, dec_pos = inputs
        return super().forward(enc), enc_mask, dec, dec_mask, cross_mask, _placeholder(enc_pos), dec_pos


class T5DecoderFinalNormPipe(T5FinalNorm):
    def forward(self, inputs: Boundary) -> torch.Tensor:
        return super().forward(inputs[2])


def _embedding_and_head_specs(config: T5Config, tp_group, sp: bool) -> tuple:
    """(first spec, last spec): the tied word table twice, or (untied) the table and T5LMHead."""
    if not config.tie_word_embeddings:
        return (LayerSpec(T5EmbeddingPipe, config, tp_group, sp),
                LayerSpec(T5LMHead, config, lm_head_number(config), tp_group, sp))
    embed = dict(tied_weight_attr="word_embeddings.weight")
    return (TiedLayerSpec("embed", T5EmbeddingPipe, config, tp_group, sp, **embed),
            TiedLayerSpec("embed", T5EmbeddingPipe, config, tp_group, sp, forward_fn=_lm_head, **embed))


def t5_layer_specs(config: T5Config, tp_group=None, sequence_parallel: bool = False) -> list:
    enc, dec = encoder_layer_numbers(config), decoder_layer_numbers(config)
    sp = sequence_parallel
    first, last = _embedding_and_head_specs(config, tp_group, sp)
    return [first,
            *(LayerSpec(T5EncoderTransformerLayerPipe, config, n, i == 0, tp_group, sp) for i, n in enumerate(enc)),
            LayerSpec(T5EncoderFinalNormPipe, config, enc.stop, tp_group, sp),
            *(LayerSpec(T5DecoderTransformerLayerPipe, config, n, i == 0, tp_group, sp) for i, n in enumerate(dec)),
            LayerSpec(T5DecoderFinalNormPipe, config, dec.stop, tp_group, sp),
            last]


class T5ModelPipe(SequenceParallelGrads, ReplayCheckpoint, PipelineModule):
    """T5 as a pipeline; see the module docstring. Arguments as GPTModelPipe; 'type:TransformerLayer'
    balances encoder plus decoder layers together. Labels: (labels, loss_mask) of the decoder."""

    def __init__(self, config: T5Config, topology=None, num_stages: Optional[int] = None,
                 partition_method: Union[str, list] = "type:TransformerLayer", tp_group=None,
                 verbose: Optional[bool] = None, virtual_stages: int = 1,
                 parallel_state: Optional[mpu.ParallelState] = None, sequence_parallel: bool = False):
        tp_group, groups = pipe_groups(parallel_state, topology, num_stages, tp_group)
        sp = check_sequence_parallel(sequence_parallel, tp_group, config.seq_length, config.decoder_seq_length)
        super().__init__(t5_layer_specs(config, tp_group, sp), **groups,
                         loss_fn=LMLoss(tp_group, config.cross_entropy_loss_fusion), partition_method=partition_method,
                         activation_checkpoint_interval=uniform_interval(config),
                         activation_checkpoint_func=self._checkpoint,
                         input_grad=[True, False, True, False, False, True, True],
                         input_type=["float", "bool", "float", "bool", "bool", "float", "float"],
                         input_pipe_partitioned=[not sp, False, not sp, False, False, False, False], verbose=verbose,
                         virtual_stages=virtual_stages)
        self.config = config
        self.sequence_parallel_group = tp_group if sp else None
        mark_block_recompute(self, config, T5TransformerLayer)
