"""GPT2ModelPipe: the GPT-2 modules of `gpt2_model` as a TDS pipeline of LayerSpecs.

    spec 0      TiedLayerSpec('embed')    (tokens, position_ids, mask) -> (x, mask)
    spec 1..L   GPT2TransformerLayerPipe  (x, mask) -> (x', mask)
    spec L+1    GPT2FinalLayerNormPipe    (x, mask) -> LN_f(x)
    spec L+2    TiedLayerSpec('embed')    LN_f(x) -> vocab-parallel logits (the word table, tied)
    loss_fn     masked mean of the vocab-parallel cross entropy, labels = (labels, loss_mask)

Tuple crossing every stage boundary: (hidden (b, s, h) float, mask (b or 1, 1, s, s) bool True = masked):
    _input_grad = [True, False], _input_type = ['float', 'bool'], _input_pipe_partitioned = [True, False]
(the hidden state is replicated across the tp group, so each tp rank sends 1/tp of it).

Each spec builds the same module, from the same seed, as GPT2Model, so a pipeline of any split holds the
plain model's weights; the embedding's copy on the last stage is kept equal by the tied-gradient all-reduce.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from megatron import mpu
from tds.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from .config import GPT2Config
from .gpt2_model import GPT2Embedding, final_layernorm
from .language_model import LMLoss
from .pipe_common import ReplayCheckpoint, pipe_groups
from .transformer import TransformerLayer


class GPT2EmbeddingPipe(GPT2Embedding):
    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        tokens, position_ids, attention_mask = inputs
        return super().forward(tokens, position_ids), attention_mask


def _lm_head(embedding: GPT2Embedding, hidden: torch.Tensor) -> torch.Tensor:
    return embedding.logits(hidden)


class GPT2TransformerLayerPipe(TransformerLayer):
    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor]):
        hidden, attention_mask = inputs
        return super().forward(hidden, attention_mask), attention_mask


class GPT2FinalLayerNormPipe(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.final_layernorm = final_layernorm(config)

    def forward(self, inputs: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.final_layernorm(inputs[0])


def gpt2_layer_specs(config: GPT2Config, tp_group=None) -> list:
    embed = dict(tied_weight_attr="word_embeddings.weight")
    return [TiedLayerSpec("embed", GPT2EmbeddingPipe, config, tp_group, **embed),
            *(LayerSpec(GPT2TransformerLayerPipe, config, i + 1, tp_group) for i in range(config.num_layers)),
            LayerSpec(GPT2FinalLayerNormPipe, config),
            TiedLayerSpec("embed", GPT2EmbeddingPipe, config, tp_group, forward_fn=_lm_head, **embed)]


class GPT2ModelPipe(ReplayCheckpoint, PipelineModule):
    """GPT-2 as a pipeline; see the module docstring.

    parallel_state: the groups the layers and the pipeline use (default: mpu's current state); the model builds
    none (`pipe_common.pipe_groups`). Or topology / num_stages (a pipe x data grid) for groups of the model's
    own, built by tds. partition_method: 'type:TransformerLayer'
    (balanced layer counts), 'parameters', 'uniform' or an explicit list of num_stages + 1 spec boundaries.
    Activation checkpointing every config.checkpoint_num_layers specs, dropout replayed (`rng`).
    verbose: DeepSpeed's constructor prints and the per-stage layer listing (default: env TDS_VERBOSE).
    virtual_stages: v model chunks per stage for the interleaved schedule (the specs are cut into pp x v parts,
    stage s holds parts s, s + pp, ...; `tds.pipe.module`).
    """

    def __init__(self, config: GPT2Config, topology=None, num_stages: Optional[int] = None,
                 partition_method: Union[str, list] = "type:TransformerLayer", tp_group=None,
                 verbose: Optional[bool] = None, virtual_stages: int = 1,
                 parallel_state: Optional[mpu.ParallelState] = None):
        tp_group, groups = pipe_groups(parallel_state, topology, num_stages, tp_group)
        super().__init__(gpt2_layer_specs(config, tp_group), **groups,
                         loss_fn=LMLoss(tp_group), partition_method=partition_method,
                         activation_checkpoint_interval=config.checkpoint_num_layers,
                         activation_checkpoint_func=self._checkpoint,
                         input_grad=[True, False], input_type=["float", "bool"],
                         input_pipe_partitioned=[True, False], verbose=verbose, virtual_stages=virtual_stages)
        self.config = config
