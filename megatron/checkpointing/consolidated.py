"""Any checkpoint of this project -> one layout-free `Consolidated` state (full tensors by canonical name).

    read_consolidated(folder)      weights from the per-layer files (or the previous pp = 1 layout's
                                   mp_rank files), optimizer state from whichever layout the run wrote
                                   (`optim.optimizer_kind`), engine and client state, RNG per (pp, tp) rank

A tied parameter's value and optimizer state come from the stage that holds its first use (pipeline
layer 0 for the word table); the copies on later stages are equal for the tied weight itself. The copy of
the embedding's untied parts on the last stage (GPT-2's position table) is unused there and not carried.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from .files import CheckpointFileError, layer_file, mp_rank_file, progress, read_args, zero_file
from .names import ModelTable, ParamInfo, plain_pp1, virtual_stages
from .optim import StageOptim, make_groups, optimizer_kind, read_client, read_flat, read_unfused
from .reading import load_file
from .tp import merge, split

# entries of an mp_rank file that describe the layout or the optimizer, rebuilt for every written layout
LAYOUT_KEYS = ("module", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
               "ds_config", "rng_states")
# megatron_args.json "checkpoint_content": absent = everything; these two mark partial checkpoints
WEIGHTS_ONLY = "weights"  # weights only (import-hf): loading starts at iteration 0 with a fresh optimizer
NO_OPTIMIZER = "no_optimizer"  # weights and engine state (iteration, LR schedule), no optimizer state


@dataclass
class Consolidated:
    args: Dict[str, Any]
    weights: Dict[str, torch.Tensor]                       # canonical name -> full tensor (model dtype)
    optim: Optional[Dict[str, Dict[str, torch.Tensor]]] = None  # name -> fp32 / exp_avg / exp_avg_sq, full
    hyper: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # group kind -> hyper-parameters
    step: Dict[str, Any] = field(default_factory=dict)      # group kind -> Adam step
    extras: Dict[str, Any] = field(default_factory=dict)    # loss scaling / clipping state
    engine: Dict[str, Any] = field(default_factory=dict)    # lr scheduler, steps, client state (rank 0)
    rng: Dict[Tuple[int, int], Any] = field(default_factory=dict)  # (pp_rank, tp_rank) -> rng_states


def layout_of(args: Dict[str, Any]) -> Tuple[int, int, int]:
    return (args["tensor_model_parallel_size"], max(1, args["pipe_parallel_size"]), args["data_parallel_size"])


def has_optimizer(args: Dict[str, Any]) -> bool:
    return args.get("checkpoint_content") not in (WEIGHTS_ONLY, NO_OPTIMIZER)


def has_engine_state(args: Dict[str, Any]) -> bool:
    return args.get("checkpoint_content") != WEIGHTS_ONLY


def local_shape(info: ParamInfo, full: torch.Size, tp: int) -> torch.Size:
    if info.dim is None:
        return torch.Size(full)
    shape = list(full)
    shape[info.dim] //= tp
    return torch.Size(shape)


def stage_names(table: ModelTable, bounds: List[int], stage: int, args: Dict[str, Any]) -> List[Tuple[str, ParamInfo]]:
    """(module name, info) in the module's parameter order: Pipe names (`bounds` of pp x v parts with v
    virtual stages), or plain names for a pp = 1 checkpoint of the earlier plain-model path."""
    if plain_pp1(args):
        return [(p.name, p) for p in table.params]
    return table.stage_param_names(bounds, stage, layout_of(args)[1])


def read_weights(folder: str, table: ModelTable, tp: int, names=None) -> Dict[str, torch.Tensor]:
    """Full weights (all, or the canonical `names`) from the layer files; a checkpoint of the previous
    pp = 1 layout (the whole module in mp_rank_TT_model_states.pt) is read too."""
    if not os.path.isfile(os.path.join(folder, layer_file(0, 0))) and \
            os.path.isfile(os.path.join(folder, mp_rank_file(0))):
        first = load_file(os.path.join(folder, mp_rank_file(0)))
        if isinstance(first.get("module"), dict):
            return _read_module_weights(folder, table, tp, first, names)
    wanted = {p.name for p in table.params} if names is None else set(names)
    layers = [layer for layer in range(len(table.specs)) if any(p.name in wanted for p in table.layer_params(layer))]
    weights = {}
    for layer in progress(layers, len(layers), f"reading {folder}"):
        parts = [load_file(os.path.join(folder, layer_file(layer, t))) for t in range(tp)]
        for p in table.layer_params(layer):
            if p.name in wanted:
                weights[p.name] = merge([_entry(part, p.local, folder, layer, t) for t, part in enumerate(parts)],
                                        p)
    return weights


def _entry(state: dict, key: str, folder: str, layer: int, tp_rank: int) -> torch.Tensor:
    if key not in state:
        raise CheckpointFileError(f"{os.path.join(folder, layer_file(layer, tp_rank))} has no {key!r} (it holds "
                                  f"{sorted(state)}); the checkpoint does not match its {os.path.basename(folder)}"
                                  f"/megatron_args.json model")
    return state[key]


def _read_module_weights(folder: str, table: ModelTable, tp: int, first: dict, names) -> Dict[str, torch.Tensor]:
    modules = [first["module"]] + [load_file(os.path.join(folder, mp_rank_file(t)))["module"] for t in range(1, tp)]
    return {p.name: merge([m[p.name] for m in modules], p) for p in table.params if names is None or p.name in names}


def _stage_optim(folder: str, kind: str, mp: int, dp: int, bf16: bool, mp_state: dict,
                 names: List[Tuple[str, ParamInfo]], weights: Dict[str, torch.Tensor], tp: int) -> StageOptim:
    tp_rank = mp % tp
    shapes = {n: local_shape(p, weights[p.name].shape, tp) for n, p in names}
    groups = make_groups([n for n, _ in names], {n: len(s) for n, s in shapes.items()})
    _check_param_shapes(mp_state.get("param_shapes"), groups, shapes, folder, mp)
    if kind == "zero":
        states = [load_file(os.path.join(folder, zero_file(d, mp, bf16)))["optimizer_state_dict"] for d in range(dp)]
        return read_flat(states, groups, shapes, "zero")
    if kind == "bf16":
        return read_flat([mp_state["optimizer"]], groups, shapes, "bf16")
    if kind == "unfused":
        return read_unfused(mp_state["optimizer"], groups, shapes)
    local = {n: split(weights[p.name], p, tp)[tp_rank] for n, p in names}  # stage 0: the weights are the master
    return read_client(mp_state["optimizer"], groups, local)


def _check_param_shapes(saved, groups, shapes, folder: str, mp: int) -> None:
    if saved is None:
        return
    mine = [[(n, tuple(shapes[n])) for n in names] for _, names in groups]
    theirs = [[(n, tuple(s)) for n, s in g.items()] for g in saved]
    if mine != theirs:
        raise CheckpointFileError(f"{os.path.join(folder, mp_rank_file(mp))}: the optimizer's parameter list does not "
                                  f"match the model of its megatron_args.json (first difference near "
                                  f"{_first_difference(mine, theirs)}); the checkpoint was not written by this "
                                  f"version of the model code")


def _first_difference(a, b) -> str:
    flat_a, flat_b = [x for g in a for x in g], [x for g in b for x in g]
    for x, y in zip(flat_a, flat_b):
        if x != y:
            return f"{y} saved vs {x} expected"
    return f"{len(flat_b)} saved vs {len(flat_a)} expected parameters"


def read_consolidated(folder: str, with_optimizer: bool = True) -> Consolidated:
    """Read the checkpoint in `folder` (a tag folder) into full tensors; see the module docstring."""
    args = read_args(folder)
    table = ModelTable(args)
    tp, pp, dp = layout_of(args)
    weights = read_weights(folder, table, tp)
    shapes = {n: w.shape for n, w in weights.items()}
    bounds = table.stage_bounds(pp * virtual_stages(args), args.get("partition_method"), tp, shapes)
    kind = optimizer_kind(args)
    out = Consolidated(args=args, weights=weights)
    optim_parts: Dict[str, List[Optional[Dict[str, torch.Tensor]]]] = {}
    load_optim = with_optimizer and has_optimizer(args)
    ranks = [(s, t) for s in range(pp) for t in range(tp)]
    for s, t in progress(ranks if has_engine_state(args) else [], len(ranks), f"reading {folder} engine/optimizer"):
        mp = s * tp + t
        mp_state = load_file(os.path.join(folder, mp_rank_file(mp)))
        if mp == 0:
            out.engine = {k: v for k, v in mp_state.items() if k not in LAYOUT_KEYS}
        if "rng_states" in mp_state:
            out.rng[(s, t)] = mp_state["rng_states"]
        if not load_optim:
            continue
        names = stage_names(table, bounds, s, args)
        st = _stage_optim(folder, kind, mp, dp, bool(args.get("bf16")), mp_state, names, weights, tp)
        out.hyper.update(st.hyper)
        out.step.update(st.step)
        out.extras.update(st.extras)
        owned = set(table.stage_layers(bounds, s, pp))
        for n, p in names:
            if p.layer in owned:  # the owner stage
                optim_parts.setdefault(p.name, [None] * tp)[t] = st.tensors[n]
    if load_optim:
        out.optim = {name: {k: merge([part[k] for part in parts], table.by_name[name]) for k in parts[0]}
                     for name, parts in optim_parts.items()}
    return out

