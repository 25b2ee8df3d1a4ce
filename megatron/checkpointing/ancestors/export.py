"""export-megatron: a GPT checkpoint of this project -> Megatron-LM's legacy format (`--ckpt-format torch`,
checkpoint_version 3.0) at any (tp, pp), or Megatron core's torch_dist (`--ckpt-format torch_dist`,
export_torch_dist.py). The legacy files are those Megatron-LM's own `load_checkpoint` reads, as its source reads
them (it does not run here: Megatron-LM's training package is not on PyPI); the torch_dist folder is proven with
Megatron core's own `dist_checkpointing.load` (tests/checkpoint/test_megatron_core.py). `--use-checkpoint-args`
takes the model from either.

    <out>/latest_checkpointed_iteration.txt            the iteration, or `release` for weights only
    <out>/iter_NNNNNNN|release/mp_rank_TT[_PPP]/model_optim_rng.pt
        args (argparse.Namespace: model shape and options, tp, pp, padded_vocab_size, vocab_size, iteration,
        consumed_train_samples, tokenizer), checkpoint_version 3.0, iteration, model:
        language_model.embedding.{word_embeddings, position_embeddings} (stage 0), language_model.encoder
        {layers.i.* (local to the stage), final_layernorm.* (last stage)}, language_model.output_layer (untied),
        word_embeddings_for_head (tied, pp > 1, last stage)

QKV rows per tp rank in order '2' (per query group [q heads, k, v], `qkv.split_qkv`); every other parameter
cut as Megatron-LM's layers cut it (the same partition attributes as this project's); the word table padded to
Megatron-LM's multiple of make_vocab_size_divisible_by x tp. The GELU is said by --openai-gelu (tanh) or its
absence with the fused bias-GELU off (erf); Megatron core, which has no --openai-gelu, by its fused bias-GELU kernel
(the tanh approximation, which needs the linear biases) or its absence (erf). --qk-layernorm is written to
torch_dist only (Megatron core's q_layernorm / k_layernorm; Megatron-LM's legacy model has none). No optimizer or
RNG state is written (load with --no-load-optim --no-load-rng, or --finetune).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Dict, Optional

import torch

from megatron.errors import UserError
from megatron.model.config import padded_vocab_size
from megatron.model.specs.gpt import GPTSpec, LAYER_SWITCHES
from ..consolidated import has_engine_state, layout_of, read_weights
from ..files import atomic_folder, mp_rank_file, read_args
from ..reading import load_file
from ..manifest import WEIGHTS, checked_folder
from .export_torch_dist import write_torch_dist
from .legacy import TRACKER
from .qkv import split_qkv
from .source import QKV
from ..names import ModelTable
from ..tp import resize_rows, split

DIVISIBLE_BY = 128
FORMATS = ("torch", "torch_dist")


def megatron_args(args: Dict[str, Any], tp: int, pp: int, iteration: int, consumed: int,
                  fmt: str = "torch") -> argparse.Namespace:
    """Megatron-LM's arguments for this project's saved GPT arguments, the GELU said as `fmt`'s model code reads
    it (see the module docstring)."""
    rope = args.get("position_embedding_type") == "rope"
    tanh = args.get("gelu", "tanh") == "tanh"
    fused_gelu = fmt == "torch_dist" and tanh and not args.get("swiglu")
    ns = dict(num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
              num_attention_heads=args["num_attention_heads"], kv_channels=args["kv_channels"],
              max_position_embeddings=args["max_position_embeddings"], seq_length=args["seq_length"],
              vocab_size=args["vocab_size"], make_vocab_size_divisible_by=DIVISIBLE_BY,
              padded_vocab_size=padded_vocab_size(args["vocab_size"], DIVISIBLE_BY, tp),
              tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
              position_embedding_type=args.get("position_embedding_type", "learned_absolute"),
              add_position_embedding=args.get("position_embedding_type", "learned_absolute") == "learned_absolute",
              use_rotary_position_embeddings=rope, rotary_base=args.get("rotary_base", 10000),
              rotary_percent=args.get("rotary_percent", 1.0), rotary_interleaved=False,
              normalization=args.get("normalization", "LayerNorm"), layernorm_epsilon=args["layernorm_epsilon"],
              norm_epsilon=args["layernorm_epsilon"], swiglu=bool(args.get("swiglu")),
              group_query_attention=bool(args.get("group_query_attention")),
              num_query_groups=args.get("num_query_groups") or args["num_attention_heads"],
              add_bias_linear=not args.get("disable_bias_linear"), add_qkv_bias=bool(args.get("add_qkv_bias")),
              untie_embeddings_and_output_weights=bool(args.get("untie_embeddings_and_output_weights")),
              qk_layernorm=bool(args.get("qk_layernorm")),
              openai_gelu=tanh, bias_gelu_fusion=fused_gelu, bias_swiglu_fusion=bool(args.get("swiglu")),
              onnx_safe=False,
              apply_residual_connection_post_layernorm=False, hidden_dropout=args["hidden_dropout"],
              attention_dropout=args["attention_dropout"], init_method_std=args.get("init_method_std", 0.02),
              iteration=iteration, consumed_train_samples=consumed, tokenizer_type=args.get("tokenizer_type"),
              vocab_file=args.get("vocab_file"), merge_file=args.get("merge_file"),
              tokenizer_model=args.get("tokenizer_model"), fp16=False, bf16=False, params_dtype=torch.float32,
              ckpt_format=fmt)
    if args.get("use_rope_scaling"):
        ns.update(use_rope_scaling=True, rope_scaling_factor=args["rope_scaling_factor"])
    return argparse.Namespace(**ns)


def _check(args: Dict[str, Any], pp: int, folder: str, fmt: str) -> None:
    if fmt not in FORMATS:
        raise UserError(f"--ckpt-format {fmt!r}: export-megatron writes {' or '.join(FORMATS)}")
    if args.get("model_type") != GPTSpec.model_type:
        raise UserError(f"export-megatron writes GPT checkpoints; {folder} holds model_type {args.get('model_type')!r}")
    written = ("qk_layernorm",) if fmt == "torch_dist" else ()  # core's q_layernorm / k_layernorm; not legacy's
    options = [flag for name, flag in LAYER_SWITCHES.items() if args.get(name) and name not in written]
    if options:
        raise UserError(f"export-megatron: {folder} holds a GPT with {', '.join(options)}, which export-megatron "
                        f"does not write" + (" (--qk-layernorm: with --ckpt-format torch_dist, as Megatron core "
                                             "has it)" if args.get("qk_layernorm") and not written else ""))
    if args.get("num_experts") is not None:
        raise UserError(f"export-megatron: {folder} holds a mixture of experts (--num-experts "
                        f"{args['num_experts']}), which export-megatron does not write yet (import-megatron reads "
                        f"Megatron core's MoE checkpoints)")
    if args["num_layers"] % pp:
        raise UserError(f"--pipe-parallel-size {pp} does not divide the {args['num_layers']} layers (Megatron-LM "
                        f"gives every stage as many)")
    scaling = (args.get("rope_scaling_low_freq_factor", 1.0), args.get("rope_scaling_high_freq_factor", 4.0),
               args.get("rope_scaling_original_max_position_embeddings", 8192))
    if args.get("use_rope_scaling") and scaling != (1.0, 4.0, 8192):
        raise UserError(f"export-megatron: llama3 rope scaling with (low, high, original) = {scaling}; Megatron-LM's "
                        f"--use-rope-scaling fixes them at (1.0, 4.0, 8192)")
    if fmt == "torch_dist" and args.get("gelu", "tanh") == "tanh" and not args.get("swiglu") \
            and args.get("disable_bias_linear"):
        raise UserError(f"--ckpt-format torch_dist: {folder} holds a tanh-GELU model without linear biases; Megatron "
                        f"core computes the tanh GELU only in its fused bias-GELU kernel, which needs the biases "
                        f"(--ckpt-format torch: Megatron-LM's legacy model reads --openai-gelu)")


def _position(folder: str, args: Dict[str, Any]):
    if not has_engine_state(args):
        return 0, 0
    state = load_file(os.path.join(folder, mp_rank_file(0)))
    return state.get("iteration", 0), state.get("consumed_train_samples", 0)


def export_megatron(load_dir: str, output: str, tp: int, pp: int, tag: Optional[str] = None,
                    fmt: str = "torch") -> str:
    """Write the checkpoint in `fmt` (FORMATS) into the new folder `output`; returns the tag written."""
    folder = checked_folder(load_dir, tag, (WEIGHTS,))
    args = read_args(folder)
    _check(args, pp, folder, fmt)
    table = ModelTable(args)
    weights = read_weights(folder, table, layout_of(args)[0])
    iteration, consumed = _position(folder, args)
    margs = megatron_args(args, tp, pp, iteration, consumed, fmt)
    for name, full in weights.items():
        if table.by_name[name].vocab:
            weights[name] = resize_rows(full, margs.padded_vocab_size)
    name = "release" if iteration == 0 else f"iter_{iteration:07d}"
    with atomic_folder(output) as tmp:
        with open(os.path.join(tmp, TRACKER), "w") as f:
            f.write("release" if iteration == 0 else str(iteration))
        if fmt == "torch_dist":
            write_torch_dist(os.path.join(tmp, name), weights, args, margs, iteration)
        else:
            _write_legacy(os.path.join(tmp, name), weights, table, args, margs, tp, pp, iteration)
    return name


def _write_legacy(folder: str, weights: Dict[str, torch.Tensor], table: ModelTable, args: Dict[str, Any],
                  margs: argparse.Namespace, tp: int, pp: int, iteration: int) -> None:
    """One file per (tp rank, stage) under the iteration folder."""
    heads, kv = args["num_attention_heads"], args["kv_channels"]
    groups = args.get("num_query_groups") or heads
    parts = {name: split_qkv(full, tp, heads, groups, kv) if QKV in name else split(full, table.by_name[name], tp)
             for name, full in weights.items()}
    per_stage = args["num_layers"] // pp
    for s in range(pp):
        for t in range(tp):
            model = _stage_model(parts, t, s, pp, per_stage, args)
            rank_dir = os.path.join(folder, f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir)
            torch.save(dict(args=margs, checkpoint_version=3.0, iteration=iteration, model=model),
                       os.path.join(rank_dir, "model_optim_rng.pt"))


def _stage_model(parts: Dict[str, list], t: int, s: int, pp: int, per_stage: int,
                 args: Dict[str, Any]) -> Dict[str, Any]:
    """One (tp rank, stage)'s `model` dict, nested as Megatron-LM's state_dict_for_save_checkpoint nests it."""
    lm: Dict[str, Any] = {}
    word = parts["embedding.word_embeddings.weight"][t].clone()
    if s == 0:
        lm["embedding"] = {"word_embeddings": {"weight": word}}
        if "embedding.position_embeddings.weight" in parts:
            lm["embedding"]["position_embeddings"] = {"weight": parts["embedding.position_embeddings.weight"][t]}
    encoder = {}
    for i in range(s * per_stage, (s + 1) * per_stage):
        prefix = f"layers.{i}."
        for name, split_parts in parts.items():
            if name.startswith(prefix):
                encoder[f"layers.{i - s * per_stage}.{name[len(prefix):]}"] = split_parts[t]
    if s == pp - 1:
        encoder.update({n: p[t] for n, p in parts.items() if n.startswith("final_layernorm.")})
        if "lm_head.weight" in parts:
            lm["output_layer"] = {"weight": parts["lm_head.weight"][t]}
    lm["encoder"] = encoder
    model = {"language_model": lm}
    if s == pp - 1 and pp > 1 and "lm_head.weight" not in parts:
        model["word_embeddings_for_head"] = {"weight": word}
    return model
