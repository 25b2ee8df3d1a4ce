"""--use-checkpoint-args, with Megatron-LM's name and meaning: the model's architecture comes from a checkpoint's
saved arguments (its megatron_args.json), so continuing a run or an imported model needs no model flags.

    source_checkpoint(args)          --load when it holds a checkpoint (a resumed run), else
                                     --pretrained-checkpoint (the start of a continued pretraining)
    apply_checkpoint_args(args, given, model_type)
                                     ARCHITECTURE fields set from the checkpoint; one the command line also gives
                                     must agree, else one line naming the flag and both values. SEQUENCE fields
                                     are a run's choice: taken only where the command line gives none.

Read before anything is resolved, in the preflight too (megatron.checkpointing.files imports neither torch nor
DeepSpeed).
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, Optional

from megatron.model.moe_config import ARCHITECTURE as MOE_ARCHITECTURE
from megatron.model.specs.gpt import GPT_DEFAULTS, LAYER_SWITCHES
from megatron.errors import UserError

# the fields that make the model's function and its tensors' shapes (GPT and T5)
ARCHITECTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels",
                "max_position_embeddings", "position_embedding_type", "rotary_base", "rotary_percent",
                "use_rope_scaling", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                "rope_scaling_high_freq_factor", "rope_scaling_original_max_position_embeddings", "normalization",
                "layernorm_epsilon", "swiglu", "group_query_attention", "num_query_groups", "disable_bias_linear",
                "add_qkv_bias", "gelu", "untie_embeddings_and_output_weights", "decoder_num_layers",
                "feed_forward_proj", "relative_attention_num_buckets", "relative_attention_max_distance",
                *LAYER_SWITCHES, *MOE_ARCHITECTURE)
SEQUENCE = ("seq_length", "encoder_seq_length", "decoder_seq_length")


def given_options(parser: argparse.ArgumentParser, argv) -> Dict[str, str]:
    """dest -> the option string, for every option `argv` gives (defaults left out); `parser` is a fresh one
    (its defaults are changed)."""
    spelled = {}
    for action in parser._actions:  # argparse keeps its actions here; the flag each dest is spelled with
        if action.option_strings:
            spelled.setdefault(action.dest, action.option_strings[0])
            action.default = argparse.SUPPRESS  # an option not given leaves no attribute
    return {dest: spelled[dest] for dest in vars(parser.parse_args(argv)) if dest in spelled}


def source_checkpoint(args: argparse.Namespace) -> str:
    from megatron.checkpointing.files import read_latest
    load, pretrained = getattr(args, "load", None), getattr(args, "pretrained_checkpoint", None)
    if load and (getattr(args, "ckpt_step", None) is not None or read_latest(load) is not None):
        return load
    if pretrained:
        return pretrained
    raise UserError(f"--use-checkpoint-args reads the model's arguments from a checkpoint, but --load {load} holds "
                    f"none and no --pretrained-checkpoint is given: give the checkpoint to continue from")


def apply_checkpoint_args(args: argparse.Namespace, given: Dict[str, str], model_type: Optional[str]) -> str:
    """Set the model's fields of `args` from the checkpoint (see the module docstring); returns its folder."""
    from megatron.checkpointing.files import checkpoint_folder, read_args
    where = source_checkpoint(args)
    step = getattr(args, "ckpt_step", None)
    tag = f"iter_{step:07d}" if where == getattr(args, "load", None) and step is not None else None
    folder = checkpoint_folder(where, tag)
    saved = read_args(folder)
    if model_type and saved.get("model_type") != model_type:
        raise UserError(f"--use-checkpoint-args: {folder} holds a {saved.get('model_type')} model, this script "
                        f"trains {model_type}")
    for field in ARCHITECTURE:
        if field not in saved:
            continue
        mine, value = getattr(args, field, None), saved[field]
        if field in given:
            if mine != value and not (value in (None, False) and mine in (None, False)):
                shown = given[field] if mine is True else f"{given[field]} {mine}"  # a switch, or a flag's value
                raise UserError(f"--use-checkpoint-args: {shown} contradicts {field} = {value} of the checkpoint "
                                f"{folder}; drop {given[field]} (the checkpoint gives the model) or "
                                f"--use-checkpoint-args")
        elif value not in (None, False) and value != GPT_DEFAULTS.get(field):
            setattr(args, field, value)  # (a default the resolution fills alike is left to it: the rope
            # scaling factors a checkpoint records without --use-rope-scaling are not options it was given)
    for field in SEQUENCE:
        if field not in given and saved.get(field) is not None:
            setattr(args, field, saved[field])
    return os.path.normpath(folder)
