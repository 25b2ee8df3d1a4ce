"""What every reader of an ancestor checkpoint (Megatron-LM legacy, Megatron core torch_dist, the DeepSpeed pipeline
formats) hands the importer: per-tp-rank tensors under this project's canonical GPT names, the Megatron-LM
arguments when the files record them, and the run's position.

    Source.parts        canonical name -> [tp rank 0, 1, ...] tensors (one entry: a global tensor); the fused QKV
                        still in the source's row order (`qkv`)
    canonical_name(key) a layer-free Megatron key -> its canonical name (old and new spellings: attention. /
                        self_attention., input_layernorm / input_norm, ...; core's linear_qkv, linear_proj,
                        linear_fc1, linear_fc2, fused layer-norm weights)
    canonical_weights(src, args, order)   Source -> full tensors by canonical name (tp parts merged by the model's
                        partition attributes, the QKV rows into [Q; K; V] by their order)
    load_ancestor(path) safe_load with the globals these files pickle (argparse.Namespace, numpy RNG state) and
                        Megatron's own classes (enums in its arguments, its old loss scaler) as inert records

Canonical GPT names (the plain model's): embedding.word_embeddings.weight, embedding.position_embeddings.weight,
layers.i.{input_layernorm, self_attention.query_key_value, self_attention.dense, post_attention_layernorm,
mlp.dense_h_to_4h, mlp.dense_4h_to_h}.{weight, bias}, layers.i.self_attention.{q_layernorm, k_layernorm}.{weight,
bias} (--qk-layernorm: Megatron core's names too, one (kv_channels) weight replicated over tp),
layers.i.mlp.moe.* of a MoE layer (MOE_PARTS, in place of mlp.dense_*), final_layernorm.{weight, bias},
lm_head.weight.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from megatron.errors import UserError
from tds.safe_load import Opaque, engine_globals
from ..files import CheckpointFileError
from ..reading import load_file
from .qkv import merge_qkv
from ..names import ModelTable
from ..tp import merge, resize_rows

# packages of the ancestors' own code, whose globals in a pickle become inert records (tds.safe_load.Opaque)
ANCESTOR_CODE = ("megatron.", "megatron_ds.", "fp16.", "apex.", "transformer_engine.")
LAYER_PARTS = ("input_layernorm", "self_attention.query_key_value", "self_attention.dense", "post_attention_layernorm",
               "mlp.dense_h_to_4h", "mlp.dense_4h_to_h",
               "self_attention.q_layernorm", "self_attention.k_layernorm")  # Megatron core's --qk-layernorm, our names
QKV = "self_attention.query_key_value"
# a MoE layer's MLP (megatron/model/moe.py): the router (E, h), the experts stacked, linear_fc1 (E, 2f, h) with the
# gate rows first and linear_fc2 (E, h, f), the shared expert and its gate (1, h)
MOE_PARTS = ("mlp.moe.router.weight", "mlp.moe.experts.linear_fc1", "mlp.moe.experts.linear_fc2",
             "mlp.moe.shared_expert.linear_fc1", "mlp.moe.shared_expert.linear_fc2", "mlp.moe.shared_gate.weight")
# Megatron-LM spellings -> this project's, applied in order to a key inside a layer (or the final norm)
RENAMES = ((r"^attention\.", "self_attention."), (r"^input_norm\.", "input_layernorm."),
           (r"^post_attention_norm\.", "post_attention_layernorm."), (r"^final_norm\.", "final_layernorm."),
           # Megatron core (torch_dist): Transformer Engine's norms fused into the next linear, or local modules
           (r"^self_attention\.linear_qkv\.layer_norm_(weight|bias)$", r"input_layernorm.\1"),
           (r"^mlp\.linear_fc1\.layer_norm_(weight|bias)$", r"post_attention_layernorm.\1"),
           (r"^pre_mlp_layernorm\.", "post_attention_layernorm."),
           (r"^self_attention\.linear_qkv\.", "self_attention.query_key_value."),
           (r"^self_attention\.linear_proj\.", "self_attention.dense."),
           (r"^mlp\.linear_fc1\.", "mlp.dense_h_to_4h."), (r"^mlp\.linear_fc2\.", "mlp.dense_4h_to_h."),
           # Megatron core's MoELayer: TopKRouter, SequentialMLP / TEGroupedMLP experts as one (E, ...) tensor in
           # torch_dist (`experts.experts.`), SharedExpertMLP; linear_fc1 rows [gate; up] as the dense MLP's
           (r"^mlp\.router\.weight$", "mlp.moe.router.weight"),
           (r"^mlp\.experts\.experts\.linear_fc([12])\.weight$", r"mlp.moe.experts.linear_fc\1"),
           (r"^mlp\.shared_experts\.linear_fc([12])\.weight$", r"mlp.moe.shared_expert.linear_fc\1"),
           (r"^mlp\.shared_experts\.gate_weight$", "mlp.moe.shared_gate.weight"),
           (r"^final_layernorm\.", "final_layernorm."))
T5_REFUSED = ("a T5 checkpoint; Megatron-LM's and CPM-Pretrain's T5 use a learned absolute position table (CPM-Pretrain's "
              "also no final encoder norm and one post-attention norm applied twice in the decoder), which this "
              "project's T5 (relative position bias) does not have, so it cannot compute the same function; not "
              "imported")
EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
IGNORED = re.compile(r"(^|\.)(_extra_state|inv_freq)$")  # TE's fp8 metadata, rotary buffers: no weights


@dataclass
class Source:
    fmt: str                                  # what was detected, said in the report
    where: str                                # the folder read
    margs: Dict[str, Any]                     # Megatron-LM's arguments ({} when the files record none)
    tp: int
    pp: int
    parts: Dict[str, List[torch.Tensor]] = field(default_factory=dict)
    qkv_order: Optional[str] = None           # from checkpoint_version; None: the files do not record it
    iteration: Optional[int] = None
    consumed_samples: Optional[int] = None
    not_carried: str = ""                     # what of the source is not imported (one line)


def load_ancestor(path: str, mmap: bool = True) -> Any:
    """A file of an ancestor code base, read with weights_only=True (see the module docstring)."""
    allow = {**engine_globals(), "argparse.Namespace": argparse.Namespace}
    return load_file(path, mmap=mmap, allow=allow, stub_modules=ANCESTOR_CODE)


def arguments(saved: Any) -> Dict[str, Any]:
    """Megatron-LM's saved arguments (an argparse.Namespace, or an inert record of one) as a dict."""
    if isinstance(saved, argparse.Namespace):
        return {k: (None if isinstance(v, Opaque) else v) for k, v in vars(saved).items()}
    if isinstance(saved, dict):
        return dict(saved)
    return {}


def flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested state dicts -> {dotted key: leaf} (Megatron-LM nests modules' state dicts inside its own)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def canonical_name(key: str, where: str) -> str:
    """A layer's key (`<rest>`, no layer number) or a final-norm key -> its canonical name without `layers.i.`;
    UserError naming `where` for a module this project's GPT does not have."""
    for pattern, repl in RENAMES:
        key = re.sub(pattern, repl, key)
    head, _, leaf = key.rpartition(".")
    if head in LAYER_PARTS + ("final_layernorm",) and leaf in ("weight", "bias") or key in MOE_PARTS:
        return key
    raise UserError(f"{where}: {key!r} is not a module of this project's GPT layer (layer norms, fused QKV, "
                    f"per-head query and key norms, attention output, MLP in and out, Megatron core's MoE router, "
                    f"experts and shared expert without biases; no cross-attention)")


def add_part(parts: Dict[str, List[torch.Tensor]], name: str, tp_rank: int, tp: int, value: torch.Tensor) -> None:
    slots = parts.setdefault(name, [None] * tp)
    slots[tp_rank] = value


def model_keys(flat: Dict[str, Any], layer_offset: int, where: str) -> Dict[str, Any]:
    """One legacy model state dict (flattened) of one (stage, chunk) -> canonical names; layer numbers shifted by
    `layer_offset` (they are local to the stage's chunk). `word_embeddings_for_head` (the last stage's copy of
    the tied table) and buffers are dropped."""
    out = {}
    for key, value in flat.items():
        if key.startswith("decoder.layers.") and torch.is_tensor(value):
            raise UserError(f"{where} holds {key!r}: a Megatron core model saved with --ckpt-format torch; "
                            f"import-megatron reads Megatron core's checkpoints in the torch_dist format (convert "
                            f"this one with Megatron-LM's --ckpt-convert-format torch_dist --ckpt-convert-save DIR)")
        key = re.sub(r"^language_model\.", "", key)
        key = re.sub(r"^(encoder|transformer)\.", "", key)
        key = re.sub(r"^(word|position)_embeddings\.", r"embedding.\1_embeddings.", key)  # 2019: GPT2Model's own
        if IGNORED.search(key) or key.startswith("word_embeddings_for_head.") or not torch.is_tensor(value):
            continue
        if key.startswith("decoder."):
            raise UserError(f"{where} holds {key!r}: {T5_REFUSED}")
        if key.startswith(("pooler.", "lm_head.", "binary_head.")) or "tokentype" in key:
            raise UserError(f"{where} holds {key!r}: a BERT checkpoint; import-megatron reads GPT only")
        if key in EMBEDDINGS:
            out[key] = value
            continue
        if key == "output_layer.weight":
            out["lm_head.weight"] = value
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
        if m:
            out[f"layers.{int(m[1]) + layer_offset}.{canonical_name(m[2], where)}"] = value
        else:
            out[canonical_name(key, where)] = value
    return out


def layer_count(names) -> int:
    """1 + the largest layer number among canonical names (0 without layers)."""
    numbers = [int(m[1]) for n in names for m in [re.match(r"layers\.(\d+)\.", n)] if m]
    return 1 + max(numbers) if numbers else 0


def check_complete(src: Source) -> None:
    """Every parameter has a tensor on every tp rank (a rank's file that lacks one: one line naming it)."""
    for name, slots in src.parts.items():
        missing = [t for t, s in enumerate(slots) if s is None]
        if missing:
            raise CheckpointFileError(f"{src.where}: {name} is missing on tp rank {missing[0]} of {len(slots)}")


def canonical_weights(src: Source, args: Dict[str, Any], order: str) -> Dict[str, torch.Tensor]:
    """Full tensors by canonical name, the vocabulary padded to args['padded_vocab_size']."""
    table = ModelTable(args)
    extra = sorted(set(src.parts) - set(table.by_name))
    missing = sorted(set(table.by_name) - set(src.parts))
    if extra or missing:
        what = f"has {extra[0]}" if extra else f"has no {missing[0]}"
        raise UserError(f"{src.where} {what}, which the GPT of its arguments "
                        f"{'does not have' if extra else 'needs'}; the checkpoint does not match its arguments")
    heads, kv = args["num_attention_heads"], args["kv_channels"]
    groups = args.get("num_query_groups") or heads
    out = {}
    for name, parts in src.parts.items():
        info = table.by_name[name]
        if QKV in name:
            full = merge_qkv(parts, order, heads, groups, kv)
        else:
            full = merge(parts, info) if len(parts) > 1 else parts[0]
        if info.vocab:
            full = resize_rows(full, args["padded_vocab_size"])
        out[name] = full.contiguous()
    return out
