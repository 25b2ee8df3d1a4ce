"""export-megatron --ckpt-format torch_dist: full GPT tensors -> the iteration folder of a Megatron core torch_dist
checkpoint, which Megatron core's `dist_checkpointing.load` reads into its GPTModel at any tp (its tensors are
global; core reshards them on load).

    <iteration folder>/metadata.json   {"sharded_backend": "torch_dist", "sharded_backend_version": 1, ...}
    <iteration folder>/.metadata, __0_0.distcp   written by torch.distributed.checkpoint (one process)
    <iteration folder>/common.pt       args (Megatron-LM's), checkpoint_version 3.0, iteration: the state that is
                                       not sharded, in the file every Megatron core release reads (0.19 and later
                                       also write it as a `common_state` item, and still read common.pt)

Tensors under the names core's GPTModel gives them (`sharded_state_dict` of the local and the Transformer Engine
layer specs alike: the norms as the fused norm-linear's `layer_norm_*`), the layers stacked on a leading axis
(core's default for homogeneous layers):
    embedding.word_embeddings.weight (padded rows), embedding.position_embeddings.weight (learned positions)
    decoder.layers.self_attention.linear_qkv.{layer_norm_weight, layer_norm_bias, weight, bias}   (L, ...)
    decoder.layers.self_attention.linear_proj.{weight, bias}, decoder.layers.mlp.linear_fc1.{layer_norm_*,
    weight, bias}, decoder.layers.mlp.linear_fc2.{weight, bias}, decoder.final_layernorm.*, output_layer.weight
    (untied), and each linear's `_extra_state` (Transformer Engine's fp8 metadata: none here) per layer;
    with --qk-layernorm decoder.layers.self_attention.{q_layernorm, k_layernorm}.* (L, kv_channels), core's names
QKV rows per query group [q heads, k, v] (order '2' of one rank holding every group); SwiGLU's fc1 [W_gate; W_up].
"""
from __future__ import annotations

import argparse
import json
import os
import warnings
from typing import Dict

import torch

from .qkv import split_qkv
from .source import QKV

BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
# this project's canonical names (inside a layer) -> Megatron core's
LAYER_NAMES = {"input_layernorm": "self_attention.linear_qkv.layer_norm_", QKV: "self_attention.linear_qkv.",
               "self_attention.dense": "self_attention.linear_proj.", "post_attention_layernorm":
               "mlp.linear_fc1.layer_norm_", "mlp.dense_h_to_4h": "mlp.linear_fc1.",
               "mlp.dense_4h_to_h": "mlp.linear_fc2.", "self_attention.q_layernorm": "self_attention.q_layernorm.",
               "self_attention.k_layernorm": "self_attention.k_layernorm."}  # the last two: --qk-layernorm
EXTRA_STATE = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def core_name(name: str) -> str:
    """A canonical name without `layers.i.` (or a top-level one) -> Megatron core's key."""
    if name.startswith("embedding."):
        return name
    if name == "lm_head.weight":
        return "output_layer.weight"
    if name.startswith("final_layernorm."):
        return "decoder." + name
    module, _, leaf = name.rpartition(".")
    return "decoder.layers." + LAYER_NAMES[module] + leaf


def core_tensors(weights: Dict[str, torch.Tensor], args: Dict, layers: int) -> Dict[str, torch.Tensor]:
    """Full canonical tensors -> Megatron core's keys, each layer parameter stacked over the layers."""
    heads, kv = args["num_attention_heads"], args["kv_channels"]
    groups = args.get("num_query_groups") or heads
    out: Dict[str, torch.Tensor] = {}
    for name, full in weights.items():
        if not name.startswith("layers."):
            out[core_name(name)] = full
    for rest in sorted({n.split(".", 2)[2] for n in weights if n.startswith("layers.")}):
        per_layer = [weights[f"layers.{i}.{rest}"] for i in range(layers)]
        if QKV in rest:  # [Q; K; V] -> per query group [q heads, k, v]
            per_layer = [split_qkv(x, 1, heads, groups, kv)[0] for x in per_layer]
        out[core_name(rest)] = torch.stack(per_layer).contiguous()  # (L, ...)
    return out


def write_torch_dist(folder: str, weights: Dict[str, torch.Tensor], args: Dict, margs: argparse.Namespace,
                     iteration: int) -> None:
    """One iteration folder (created here) of a torch_dist checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    layers = args["num_layers"]
    state: Dict[str, object] = dict(core_tensors(weights, args, layers))
    for module in EXTRA_STATE:  # as core stores each: the list of its ranks' objects, torch.save'd by the planner
        for i in range(layers):
            state[f"decoder.layers.{module}._extra_state/shard_{i}_{layers}"] = [None]
    os.makedirs(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... a single process"
        # not flattened: each [None] is one item (and the index has no flattening map, as core's has none)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True,
                 planner=DefaultSavePlanner(flatten_state_dict=False))
    torch.save(dict(args=margs, checkpoint_version=3.0, iteration=iteration), os.path.join(folder, "common.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump(BACKEND, f)
