"""GPTModelPipe: the GPT modules of `gpt2_model` as a TDS pipeline of LayerSpecs.

    spec 0      TiedLayerSpec('embed')    (tokens, position_ids) -> x
    spec 1..L   GPT2TransformerLayerPipe  x -> x'
    spec L+1    GPT2FinalLayerNormPipe    x -> N_f(x)
    spec L+2    TiedLayerSpec('embed')    N_f(x) -> vocab-parallel logits (the word table, tied)
                or, untied, LayerSpec(GPT2LMHeadPipe) -> logits (own weight); the embedding is then a plain
                LayerSpec
    loss_fn     masked mean of the vocab-parallel cross entropy, labels = (labels, loss_mask)

What crosses every stage boundary: the hidden state (b, s, h) float, alone; attention is causal by
`is_causal=True` (flash-eligible) and no mask tensor exists:
    _input_grad = [True], _input_type = ['float'], _input_pipe_partitioned = [True]
(the hidden state is replicated across the tp group, so each tp rank sends 1/tp of it).
With sequence parallelism the hidden state is already split along the sequence, (b, s/t, h) different on every
tp rank, so it is declared not partitioned: each rank sends its own part to the rank of the same tp rank on
the next stage, and nothing is gathered or re-split at the boundary (the same bytes as the partitioned send).
With `config.explicit_attention_mask` (--reset-attention-mask) the inputs are (tokens, position_ids, mask)
and every spec passes the tuple (hidden, mask (b, 1, s, s) bool True = masked) on:
    _input_grad = [True, False], _input_type = ['float', 'bool'], _input_pipe_partitioned = [True, False]

Each spec builds the same module, from the same seed, as GPTModel, so a pipeline of any split holds the
plain model's weights; the embedding's copy on the last stage is kept equal by the tied-gradient all-reduce.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from megatron import mpu
from tds.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from .config import GPTConfig
from .gpt2_model import GPT2Embedding, GPT2LMHead, final_layernorm
from .language_model import LMLoss
from .pipe_common import (ReplayCheckpoint, SequenceParallelGrads, check_sequence_parallel, mark_block_recompute,
                          pipe_groups, uniform_interval)
from .transformer import TransformerLayer, recompute_whole


Hidden = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]  # x, or (x, mask) with an explicit mask


class GPT2EmbeddingPipe(GPT2Embedding):
    def forward(self, inputs: tuple) -> Hidden:
        """(tokens, position_ids) -> x, or (tokens, position_ids, mask) -> (x, mask)."""
        x = super().forward(inputs[0], inputs[1])
        return x if len(inputs) == 2 else (x, inputs[2])


def _lm_head(embedding: GPT2Embedding, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)


class GPT2TransformerLayerPipe(TransformerLayer):
    def forward(self, inputs: Hidden) -> Hidden:
        return recompute_whole(self, self._forward, inputs)

    def _forward(self, inputs: Hidden) -> Hidden:
        if torch.is_tensor(inputs):
            return super().forward(inputs)  # causal: is_causal=True, no mask
        hidden, attention_mask = inputs
        return super().forward(hidden, attention_mask), attention_mask


class GPT2FinalLayerNormPipe(nn.Module):
    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel: bool = False):
        super().__init__()
        self.final_layernorm = final_layernorm(config, tp_group, sequence_parallel)

    def forward(self, inputs: Hidden) -> torch.Tensor:
        return self.final_layernorm(inputs if torch.is_tensor(inputs) else inputs[0])


class GPT2LMHeadPipe(GPT2LMHead):
    """The untied output layer as the last spec: N_f(x) -> vocab-parallel logits."""


def gpt2_layer_specs(config: GPTConfig, tp_group=None, sequence_parallel: bool = False, ep_group=None) -> list:
    sp = sequence_parallel
    layers = [LayerSpec(GPT2TransformerLayerPipe, config, i + 1, tp_group, sp, ep_group)
              for i in range(config.num_layers)]
    norm = LayerSpec(GPT2FinalLayerNormPipe, config, tp_group, sp)
    if not config.tie_word_embeddings:
        return [LayerSpec(GPT2EmbeddingPipe, config, tp_group, sp), *layers, norm,
                LayerSpec(GPT2LMHeadPipe, config, tp_group, sp)]
    embed = dict(tied_weight_attr="word_embeddings.weight")
    return [TiedLayerSpec("embed", GPT2EmbeddingPipe, config, tp_group, sp, **embed), *layers, norm,
            TiedLayerSpec("embed", GPT2EmbeddingPipe, config, tp_group, sp, forward_fn=_lm_head, **embed)]


class GPTModelPipe(SequenceParallelGrads, ReplayCheckpoint, PipelineModule):
    """GPT-2 as a pipeline; see the module docstring.

    parallel_state: the groups the layers and the pipeline use (default: mpu's current state); the model builds
    none (`pipe_common.pipe_groups`). Or topology / num_stages (a pipe x data grid) for groups of the model's
    own, built by tds. partition_method: 'type:TransformerLayer'
    (balanced layer counts), 'parameters', 'uniform' or an explicit list of num_stages + 1 spec boundaries.
    Full recomputation every config.checkpoint_num_layers specs ('uniform'), or of the first that many
    transformer layers of each stage ('block'); selective recomputation inside attention; dropout replayed
    (`rng`).
    sequence_parallel: with tp > 1, split the LayerNorm / dropout / residual regions along the sequence
    (Megatron's --sequence-parallel; see `transformer`); the sequence length must divide by tp.
    verbose: DeepSpeed's constructor prints and the per-stage layer listing (default: env TDS_VERBOSE).
    virtual_stages: v model chunks per stage for the interleaved schedule (the specs are cut into pp x v parts,
    stage s holds parts s, s + pp, ...; `tds.pipe.module`).
    """

    def __init__(self, config: GPTConfig, topology=None, num_stages: Optional[int] = None,
                 partition_method: Union[str, list] = "type:TransformerLayer", tp_group=None,
                 verbose: Optional[bool] = None, virtual_stages: int = 1,
                 parallel_state: Optional[mpu.ParallelState] = None, sequence_parallel: bool = False):
        tp_group, groups = pipe_groups(parallel_state, topology, num_stages, tp_group)
        sp = check_sequence_parallel(sequence_parallel, tp_group, config.seq_length)
        mask = [False] if config.explicit_attention_mask else []  # the bool mask, if any, after the hidden state
        ep_group = groups["grid"].experts["expert"] if getattr(groups.get("grid"), "experts", None) else None
        super().__init__(gpt2_layer_specs(config, tp_group, sp, ep_group), **groups,
                         loss_fn=LMLoss(tp_group, config.cross_entropy_loss_fusion), partition_method=partition_method,
                         activation_checkpoint_interval=uniform_interval(config),
                         activation_checkpoint_func=self._checkpoint,
                         input_grad=[True, *mask], input_type=["float", *(["bool"] if mask else [])],
                         input_pipe_partitioned=[not sp, *mask], verbose=verbose, virtual_stages=virtual_stages)
        self.config = config
        self.sequence_parallel_group = tp_group if sp else None
        mark_block_recompute(self, config, TransformerLayer)


GPT2ModelPipe = GPTModelPipe  # the earlier name, for code written against it
