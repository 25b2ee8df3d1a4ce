"""`Consolidated` -> the files a run at (tp, pp, dp) writes and loads, exactly as DeepSpeed would write them.

    target_args(args, tp, pp, dp)       the saved arguments of the new layout (padded vocabulary, gas,
                                        DeepSpeed's ZeRO stage, explicit partition boundaries dropped)
    layout_args(args, tp, pp)           those of an import's weights-only checkpoint at (tp, pp, 1)
    write_layout(ck, folder, args)      layer files, mp_rank files (engine, client and stage-0 optimizer
                                        state) and ZeRO partitions into `folder`

Every mp_rank file carries the source's LR scheduler, step counters, iteration and consumed samples. RNG
states are carried only when (tp, pp) is unchanged (a new dp only re-cuts the optimizer); ranks that did not
exist have no streams to carry, and loading such a checkpoint keeps the run's freshly seeded generators
(dropout masks never depend on them, see megatron/model/rng.py).
"""
from __future__ import annotations

import copy
import os
from collections import OrderedDict
from typing import Any, Dict, Tuple

import torch

from megatron.errors import UserError
from megatron.model.config import padded_vocab_size
from .consolidated import NO_OPTIMIZER, WEIGHTS_ONLY, Consolidated, layout_of, stage_names
from .files import layer_file, mp_rank_file, progress, write_args, zero_file
from .manifest import write_manifest
from .names import PIPE_FORM, ModelTable, virtual_stages, with_records
from .optim import (StageOptim, carry_extras, default_extras, make_groups, optimizer_kind, write_client,
                    write_flat, write_unfused)
from .tp import resize_rows, split


def target_args(args: Dict[str, Any], tp: int, pp: int, dp: int) -> Dict[str, Any]:
    """The resolved arguments a run at (tp, pp, dp) with the same model and global batch would save."""
    new = copy.deepcopy(args)
    old_pp = max(1, args["pipe_parallel_size"])
    new.update(tensor_model_parallel_size=tp, pipe_parallel_size=pp, data_parallel_size=dp, world_size=tp * pp * dp,
               module_form=PIPE_FORM,
               padded_vocab_size=padded_vocab_size(args["vocab_size"], args["make_vocab_size_divisible_by"], tp))
    if isinstance(args.get("partition_method"), list) and pp != old_pp:
        new["partition_method"] = None  # boundaries were for the old pp; the default balances layers
    mbs, gbs = args["micro_batch_size"], args["global_batch_size"]
    if gbs % (mbs * dp) == 0:
        new["gas"] = gbs // (mbs * dp)
    ds = new.setdefault("ds_config", {})
    ds["gradient_accumulation_steps"] = new["gas"]
    if pp != old_pp and virtual_stages(args) > 1:  # chunks were for the old pp: 1F1B, one chunk per stage
        new.update(virtual_pipe_stages=1, pipeline_schedule="1f1b")
        ds.setdefault("pipeline", {}).update(schedule="1f1b", virtual_stages=1)
    stage = args.get("zero_stage", 1)
    ds.setdefault("zero_optimization", {})["stage"] = 0 if stage == 1 and dp == 1 and not args.get("fp16") else stage
    return new


def table_rows(args: Dict[str, Any]) -> int:
    """Rows of the word table a checkpoint exports: config.json's vocab_size of an imported Hugging Face folder
    (its padding rows included), else the tokenizer's vocabulary."""
    return args.get("hf_vocab_size") or args["vocab_size"]


def layout_args(args: Dict[str, Any], tp: int, pp: int) -> Dict[str, Any]:
    """The layout and run fields a saved megatron_args.json has, for a weights-only checkpoint at (tp, pp, 1) written
    by an import. The padded vocabulary holds every row of the imported table (`table_rows` >= vocab_size)."""
    divisible = 128
    return dict(tensor_model_parallel_size=tp, pipe_parallel_size=pp, data_parallel_size=1, world_size=tp * pp,
                make_vocab_size_divisible_by=divisible,
                padded_vocab_size=padded_vocab_size(table_rows(args), divisible, tp), partition_method=None,
                micro_batch_size=1, global_batch_size=1, gas=1, zero_stage=1, fp16=False, bf16=False, seed=1234,
                checkpoint_activations=False, checkpoint_num_layers=1,
                ds_config={"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": 1})


def check_layout(table: ModelTable, args: Dict[str, Any], tp: int, pp: int) -> None:
    """One-line errors for a target layout the model cannot take."""
    heads, ffn = args["num_attention_heads"], args["ffn_hidden_size"]
    groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
    for what, n in (("num_attention_heads", heads), ("num_query_groups", groups), ("ffn_hidden_size", ffn)):
        if n % tp:
            raise UserError(f"tensor-model-parallel size {tp} does not divide {what} = {n}; choose a tp that "
                            f"divides the heads ({heads}), the query groups ({groups}) and the ffn size ({ffn})")
    if tp < 1 or pp < 1:
        raise UserError(f"tp and pp must be >= 1, got tp = {tp}, pp = {pp}")
    n = len(table.specs)
    if pp > n:
        raise UserError(f"pipe-parallel size {pp} is larger than the {n} pipeline layers of this model "
                        f"({args['num_layers']} transformer layers + embedding, norms, head)")


def _tp_parts(ck: Consolidated, table: ModelTable, tp: int, rows: int) -> Tuple[dict, dict]:
    """Per-tp-rank weights and optimizer tensors of every parameter, vocabulary re-padded to `rows`."""
    def fit(name, t):
        return resize_rows(t, rows) if table.by_name[name].vocab else t

    weights = {n: split(fit(n, w), table.by_name[n], tp) for n, w in ck.weights.items()}
    optim = {}
    for n, state in (ck.optim or {}).items():
        per_key = {k: split(fit(n, v), table.by_name[n], tp) for k, v in state.items()}
        optim[n] = [{k: per_key[k][t] for k in per_key} for t in range(tp)]
    return weights, optim


def write_layout(ck: Consolidated, folder: str, new_args: Dict[str, Any], with_optimizer: bool = True) -> None:
    """Write `ck` into `folder` at the layout of `new_args` (see `target_args`)."""
    table = ModelTable(new_args)
    tp, pp, dp = layout_of(new_args)
    check_layout(table, new_args, tp, pp)
    with_optimizer = with_optimizer and ck.optim is not None
    args = dict(new_args)
    args.pop("checkpoint_content", None)
    if not ck.engine:
        args["checkpoint_content"] = WEIGHTS_ONLY
    elif not with_optimizer:
        args["checkpoint_content"] = NO_OPTIMIZER
    weights, optim = _tp_parts(ck, table, tp, args["padded_vocab_size"])
    layers = [layer for layer in range(len(table.specs)) if table.layer_params(layer)]
    for layer in progress(layers, len(layers), f"writing {folder}"):
        for t in range(tp):
            state = OrderedDict((p.local, weights[p.name][t]) for p in table.layer_params(layer))
            torch.save(state, os.path.join(folder, layer_file(layer, t)))
    bounds = table.stage_bounds(pp * virtual_stages(args), args.get("partition_method"), tp,
                                {n: w.shape for n, w in ck.weights.items()})
    ranks = [(s, t) for s in range(pp) for t in range(tp)]
    extras = _target_extras(ck, args) if with_optimizer else None
    for s, t in progress(ranks if ck.engine else [], len(ranks), f"writing {folder} engine/optimizer"):
        _write_rank(ck, folder, args, table, bounds, s, t, weights, optim, extras)
    write_args(folder, with_records(args))
    write_manifest(folder)


def _target_extras(ck: Consolidated, args: Dict[str, Any]) -> Dict[str, Any]:
    """The loss-scaling and clipping state every rank's optimizer carries (the same on all ranks)."""
    defaults = default_extras(args, ck.engine.get("global_steps", 0), ck.engine.get("skipped_steps", 0))
    return carry_extras(ck.extras, defaults)


def _write_rank(ck, folder, args, table, bounds, stage, tp_rank, weights, optim, extras) -> None:
    """The mp_rank file of (stage, tp_rank) and its ZeRO / BF16 partitions; `extras` is the optimizer's
    loss-scaling state (`_target_extras`), None to write no optimizer state."""
    tp, pp, dp = layout_of(args)
    mp = stage * tp + tp_rank
    kind = optimizer_kind(args)
    state = _engine_state(ck, args, stage, tp_rank)
    if extras is not None:
        names = stage_names(table, bounds, stage, args)
        shapes = {n: weights[p.name][tp_rank].shape for n, p in names}
        st = _stage_optim(ck, names, shapes, tp_rank, optim, extras)
        if kind == "zero":
            state["param_shapes"] = [OrderedDict((n, shapes[n]) for n in names_g) for _, names_g in st.groups]
            state["shared_params"] = {}
            for d, sd in enumerate(write_flat(st, dp, "zero", shapes)):
                _save_zero(sd, args, os.path.join(folder, zero_file(d, mp, bool(args.get("bf16")))))
        elif kind == "bf16":
            (sd,) = write_flat(st, 1, "bf16", shapes)
            state["optimizer"] = sd
            _save_zero(sd, args, os.path.join(folder, zero_file(0, mp, True)))
        else:
            state["optimizer"] = (write_client(st, table.unused_copies(bounds, stage, pp)) if kind == "client"
                                  else write_unfused(st))
    torch.save(state, os.path.join(folder, mp_rank_file(mp)))


def _save_zero(sd: dict, args: Dict[str, Any], path: str) -> None:
    from deepspeed.git_version_info import version
    torch.save({"optimizer_state_dict": sd, "ds_config": args["ds_config"], "ds_version": version}, path)


def _engine_state(ck: Consolidated, args: Dict[str, Any], stage: int, tp_rank: int) -> Dict[str, Any]:
    """An mp_rank file's entries in DeepSpeed's order; the optimizer entries are filled in by the caller."""
    from deepspeed.git_version_info import version
    tp, pp, dp = layout_of(args)
    old_tp, old_pp, _ = layout_of(ck.args)
    engine = copy.deepcopy(ck.engine)
    state = dict(module=None, buffer_names=engine.pop("buffer_names", []), optimizer=None, param_shapes=None,
                 frozen_param_shapes=None, shared_params=None, frozen_param_fragments=None,
                 lr_scheduler=engine.pop("lr_scheduler", None), data_sampler=engine.pop("data_sampler", None),
                 random_ltd=engine.pop("random_ltd", None), skipped_steps=engine.pop("skipped_steps", 0),
                 global_steps=engine.pop("global_steps", 0), global_samples=engine.pop("global_samples", 0),
                 dp_world_size=dp, mp_world_size=tp * pp,
                 checkpoint_parallel_dimensions={"pp_degree": pp, "tp_degree": tp}, ds_config=args["ds_config"],
                 ds_version=engine.pop("ds_version", version))
    state.update(engine)  # client state: iteration, consumed_train_samples, ...
    if (tp, pp) == (old_tp, old_pp) and (stage, tp_rank) in ck.rng:
        state["rng_states"] = ck.rng[(stage, tp_rank)]
    return state


def _stage_optim(ck, names, shapes, tp_rank, optim, extras) -> StageOptim:
    st = StageOptim(groups=make_groups([n for n, _ in names], {n: len(s) for n, s in shapes.items()}))
    for n, p in names:
        st.tensors[n] = optim[p.name][tp_rank]
    for kind, _ in st.groups:
        st.hyper[kind] = ck.hyper[kind]
        st.step[kind] = ck.step[kind]
    st.extras = extras
    return st


def source_layout_note(ck: Consolidated, args: Dict[str, Any]) -> str:
    """What is not carried to the new layout, in one line ('' when everything is)."""
    if layout_of(ck.args)[:2] == layout_of(args)[:2] or not ck.rng:
        return ""
    return ("RNG states are not carried: tp or pp changed, so the saved per-rank streams (python, numpy, torch, "
            "device, tp tracker) have no matching rank; the resumed run keeps its seeded generators "
            "(dropout masks do not depend on them)")

