"""Model weights of any checkpoint into a model built at any layout: the plain model at any tp, or this
rank's stage of a Pipe model.

For every parameter of the module: its canonical name (names.py), the full tensor merged from the saved tp
ranks' layer files (only the files this module needs are read), vocabulary rows re-padded to the module's
padded size, and this tp rank's part copied in. Shapes are checked field by field first, so a model built
with other arguments gets one line naming the argument.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Tuple

import torch

from megatron.model.specs.gpt import LAYER_SWITCHES
from .consolidated import layout_of, read_weights
from .files import CheckpointMismatchError
from .names import ModelTable
from .tp import resize_rows, split

# Config fields that decide parameter shapes (GPTConfig / T5Config); max_position_embeddings only with the learned
# position table (a rotary model may be trained at any length).
SHAPE_CONFIG_FIELDS = ("num_layers", "num_decoder_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                       "kv_channels", "vocab_size", "max_position_embeddings", "relative_attention_num_buckets",
                       "feed_forward_proj", "tie_word_embeddings", "position_embedding_type", "normalization",
                       "swiglu", "num_query_groups", "add_bias_linear", "add_qkv_bias", *LAYER_SWITCHES,
                       "moe_architecture")
# Config fields that change the model's function but no shape: a weights-only load checks them too, except under
# --finetune (a new rotary base for a longer context, say).
FUNCTION_CONFIG_FIELDS = ("layernorm_epsilon", "rotary_base", "rotary_percent", "rope_scaling_factor",
                          "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions", "gelu")


def module_tp(module: torch.nn.Module) -> Tuple[int, int]:
    """(tp_rank, tp_size) of a plain model (its `tp_group`) or of a Pipe model's stage (its grid)."""
    import torch.distributed as dist
    grid = getattr(module, "_grid", None)
    if grid is not None:
        return grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()
    group = getattr(module, "tp_group", None)
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_fields(table: ModelTable, module: torch.nn.Module, folder: str, function: bool = True) -> None:
    """The module's config agrees with the checkpoint's on every shape field and, with `function`, every field
    that changes what the model computes; one line naming the first that differs."""
    config = getattr(module, "config", None)
    kind = type(config).__name__
    if config is None:
        return
    if kind != type(table.config).__name__:
        raise CheckpointMismatchError(f"checkpoint {folder} holds a {table.kind} model, the module is built from "
                                      f"a {kind}; load it into the model type it was trained as")
    learned = getattr(config, "position_embedding_type", "learned_absolute") == "learned_absolute"
    for field in SHAPE_CONFIG_FIELDS + (FUNCTION_CONFIG_FIELDS if function else ()):
        if field == "max_position_embeddings" and not learned:
            continue
        saved, mine = getattr(table.config, field, None), getattr(config, field, None)
        if saved != mine:
            hint = "" if field in SHAPE_CONFIG_FIELDS else " (or --finetune to load the weights into another function)"
            raise CheckpointMismatchError(f"checkpoint {folder} has {field} = {saved} but the model has {mine}; "
                                          f"build the model from the checkpoint's arguments (read_checkpoint_args; "
                                          f"import-hf prints its model flags){hint}")


def _canonical(table: ModelTable, name: str):
    if name in table.by_name:
        return table.by_name[name]
    return table.pipe_to_canonical(name)


@torch.no_grad()
def load_weights_into(module: torch.nn.Module, folder: str, saved: Dict[str, Any], strict: bool = True,
                      function: bool = True) -> None:
    """Copy the checkpoint's weights into `module` (plain model or Pipe stage) at the module's own layout;
    `function`: the model must also compute the checkpoint's function (`check_fields`)."""
    table = ModelTable(saved)
    check_fields(table, module, folder, function)
    tp_rank, tp = module_tp(module)
    params = [(name, p, _canonical(table, name)) for name, p in module.named_parameters()]
    full = read_weights(folder, table, layout_of(saved)[0], {info.name for _, _, info in params})
    for name, param, info in params:
        if info.name not in full:
            if strict:
                raise CheckpointMismatchError(f"checkpoint {folder} has no weights for {name} ({info.name})")
            continue
        value = full[info.name]
        if info.vocab:
            value = resize_rows(value, param.size(0) * (tp if info.dim == 0 else 1))
        part = split(value, info, tp)[tp_rank]
        if part.shape != param.shape:
            raise CheckpointMismatchError(f"checkpoint {folder}: {info.name} has shape {tuple(part.shape)} on tp rank "
                                          f"{tp_rank} of {tp} but the model's {name} is {tuple(param.shape)}")
        param.copy_(part)


def reshape_command(folder: str, tp: int, pp: int, dp: int) -> str:
    """The converter command that writes `folder`'s checkpoint at the run's (tp, pp, dp)."""
    load_dir = os.path.dirname(os.path.normpath(folder))
    return (f"python tools/convert_checkpoint.py reshape --load {load_dir} --save {load_dir}_tp{tp}_pp{pp}_dp{dp} "
            f"--tensor-model-parallel-size {tp} --pipe-parallel-size {pp} --data-parallel-size {dp}")

