"""The optimizer-state layouts DeepSpeed 0.19 writes for this project, read into and written from one form.

The one form, per (pipeline stage, tp rank): `StageOptim` holds, for every parameter of the stage (by its
module name), its fp32 master weight and Adam moments as tensors of the local parameter's shape, plus the
two parameter groups' hyper-parameters and step and the loss-scaling state. Which layout a run writes
follows from its precision, DeepSpeed's ZeRO stage (ZeRO-1 at dp = 1 runs as stage 0) and pp:

    kind     when                          where                                   master weights
    zero     ZeRO-1 (fp32, bf16, fp16)     [bf16_]zero_pp_rank_D_mp_rank_MM files  flat fp32 partition per dp rank
    client   stage 0, fp32                 mp_rank file 'optimizer' (torch AdamW)  the module's own weights
    unfused  stage 0, bf16, plain pp = 1   mp_rank file 'optimizer'                fp32_groups (per parameter)
             (the earlier path's checkpoints, `names.plain_pp1`)
    bf16     stage 0, bf16                 mp_rank file 'optimizer' and            flat fp32 partition (dp = 1)
             (DeepSpeed's BF16_Optimizer)  bf16_zero_pp_rank_0_mp_rank_MM file

Flat layouts (zero, bf16). A group's parameters are concatenated in module order (N elements), padded with
zeros to Np = ceil(N / (2 dp)) * 2 dp (DeepSpeed's nccl alignment) and cut into dp partitions of P = Np / dp;
dp rank d owns [d P, (d + 1) P). Adam moments are stored padded (P); ZeRO's fp32 partition is stored without
its padding, BF16_Optimizer's with it. Re-cutting for a new dp is re-concatenating and re-cutting, exact.

Parameter groups follow megatron/training/optimizer.py: matrices (ndim > 1, weight decay) first, then vectors (no
decay); an empty group is dropped.
"""
from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

from .names import plain_pp1

STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class StageOptim:
    groups: List[Tuple[str, List[str]]]                 # (group kind, module names in flat order)
    tensors: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> fp32/exp_avg/exp_avg_sq
    hyper: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # group kind -> param_group without params
    step: Dict[str, Any] = field(default_factory=dict)  # group kind -> Adam step (as saved; None: no step yet)
    extras: Dict[str, Any] = field(default_factory=dict)  # loss scaling and clipping state


def optimizer_kind(args: Dict[str, Any]) -> str:
    """The layout DeepSpeed writes for a run with these resolved arguments (see the module docstring)."""
    stage = args["ds_config"]["zero_optimization"]["stage"]
    if stage >= 1:
        return "zero"
    if args.get("bf16"):
        return "unfused" if plain_pp1(args) else "bf16"
    return "client"


def make_groups(names: Sequence[str], ndims: Dict[str, int]) -> List[Tuple[str, List[str]]]:
    decay = [n for n in names if ndims[n] > 1]
    no_decay = [n for n in names if ndims[n] <= 1]
    return [(kind, g) for kind, g in (("decay", decay), ("no_decay", no_decay)) if g]


def _copy(step: Any) -> Any:
    """Adam's step is a tensor that torch increments in place: every parameter needs its own."""
    return step.clone() if torch.is_tensor(step) else step


# --- flat partitions ------------------------------------------------------------------------------------
def flat_sizes(numel: int, dp: int) -> Tuple[int, int]:
    """(Np, P): padded group size and partition size for a group of `numel` elements over dp ranks."""
    align = 2 * dp
    padded = -(-numel // align) * align
    return padded, padded // dp


def zero_padding(numel: int, dp: int, dp_rank: int) -> int:
    """Zeros at the end of dp rank `dp_rank`'s partition (DeepSpeed's groups_padding)."""
    _, part = flat_sizes(numel, dp)
    left = dp_rank * part
    return part if numel <= left else max(0, left + part - numel)


def _partition(tensors: Sequence[torch.Tensor], dp_rank: int, part: int) -> torch.Tensor:
    """Elements [d P, (d + 1) P) of the zero-padded concatenation of `tensors`, as a new fp32 tensor."""
    out = torch.zeros(part)
    lo, offset = dp_rank * part, 0
    for t in tensors:
        start, end = max(offset, lo), min(offset + t.numel(), lo + part)
        if start < end:
            out[start - lo:end - lo] = t.reshape(-1)[start - offset:end - offset]
        offset += t.numel()
    return out


def _unflatten(flat: torch.Tensor, names: Sequence[str], shapes: Dict[str, torch.Size]) -> Dict[str, torch.Tensor]:
    """Views of `flat` shaped as each parameter."""
    out, offset = {}, 0
    for n in names:
        numel = shapes[n].numel()
        out[n] = flat[offset:offset + numel].view(shapes[n])
        offset += numel
    return out


def _slice_mappings(names: Sequence[str], shapes: Dict[str, torch.Size], part: int, dp_rank: int) -> OrderedDict:
    """DeepSpeed's param_slice_mappings: the fragment of each parameter inside this rank's partition."""
    from deepspeed.utils.tensor_fragment import fragment_address
    lo, hi = dp_rank * part, (dp_rank + 1) * part
    out, offset = OrderedDict(), 0
    for n in names:
        start, end = max(offset, lo), min(offset + shapes[n].numel(), hi)
        if start < end:
            out[n] = fragment_address(numel=end - start, start=start - lo)
        offset += shapes[n].numel()
    return out


def _rank_partitions(st: StageOptim, dp: int, dp_rank: int) -> Tuple[Dict[str, List[torch.Tensor]], List[int]]:
    """This dp rank's partition of every group, per key (fp32, exp_avg, exp_avg_sq), and the group sizes."""
    parts: Dict[str, List[torch.Tensor]] = {k: [] for k in ("fp32",) + STATE_KEYS}
    numels = []
    for _, names in st.groups:
        numel = sum(st.tensors[n]["fp32"].numel() for n in names)
        numels.append(numel)
        for key in parts:
            parts[key].append(_partition([st.tensors[n][key] for n in names], dp_rank, flat_sizes(numel, dp)[1]))
    return parts, numels


def _base_state(st: StageOptim, parts: Dict[str, List[torch.Tensor]]) -> dict:
    """torch AdamW state_dict of the flat partitions: one 'parameter' per group."""
    state = {g: {"step": _copy(st.step[kind]), **{key: parts[key][g] for key in STATE_KEYS}}
             for g, (kind, _) in enumerate(st.groups) if st.step[kind] is not None}
    groups = [{**st.hyper[kind], "params": [g]} for g, (kind, _) in enumerate(st.groups)]
    return {"state": state, "param_groups": groups}


def write_flat(st: StageOptim, dp: int, kind: str, shapes: Dict[str, torch.Size]) -> List[dict]:
    """The optimizer state dict of every dp rank for the 'zero' or 'bf16' layout."""
    from deepspeed.git_version_info import version
    out = []
    for d in range(dp):
        parts, numels = _rank_partitions(st, dp, d)
        sizes = [flat_sizes(n, dp) for n in numels]
        mappings = [_slice_mappings(names, shapes, p, d) for (_, names), (_, p) in zip(st.groups, sizes)]
        common = {"clip_grad": st.extras["clip_grad"], "base_optimizer_state": _base_state(st, parts),
                  "partition_count": [dp] * len(st.groups), "ds_version": version, "param_slice_mappings": mappings}
        if kind == "zero":
            from deepspeed.runtime.zero.config import ZeroStageEnum
            pads = [zero_padding(n, dp, d) for n in numels]
            sd = {"loss_scaler": st.extras["loss_scaler"], "dynamic_loss_scale": st.extras["dynamic_loss_scale"],
                  "overflow": st.extras.get("overflow", False), **common,
                  "single_partition_of_fp32_groups": [f[:f.numel() - pad] for f, pad in zip(parts["fp32"], pads)],
                  "zero_stage": ZeroStageEnum.optimizer_states, "group_paddings": pads,
                  "param_alignment_paddings": [[0] * len(names) for _, names in st.groups]}
        else:
            sd = {**common, "single_partition_of_fp32_groups": parts["fp32"],
                  "group_paddings": [(padded - n) if d == dp - 1 else 0 for n, (padded, _) in zip(numels, sizes)]}
        out.append(sd)
    return out


def read_flat(states: Sequence[dict], groups: List[Tuple[str, List[str]]], shapes: Dict[str, torch.Size],
              kind: str) -> StageOptim:
    """Inverse of `write_flat`: the dp ranks' optimizer state dicts (dp rank order) -> StageOptim."""
    st = StageOptim(groups=groups)
    first = states[0]
    for g, (gkind, names) in enumerate(groups):
        numel = sum(shapes[n].numel() for n in names)
        base = [sd["base_optimizer_state"]["state"].get(g) for sd in states]  # None: no step taken yet
        fp32 = torch.cat([sd["single_partition_of_fp32_groups"][g].reshape(-1) for sd in states])[:numel]
        flat = {"fp32": fp32}
        for key in STATE_KEYS:
            flat[key] = torch.zeros(numel) if base[0] is None else torch.cat([b[key].reshape(-1) for b in base])[:numel]
        per_key = {key: _unflatten(v, names, shapes) for key, v in flat.items()}
        for n in names:
            st.tensors[n] = {key: per_key[key][n] for key in per_key}
        hyper = dict(first["base_optimizer_state"]["param_groups"][g])
        hyper.pop("params")
        st.hyper[gkind], st.step[gkind] = hyper, None if base[0] is None else base[0]["step"]
    keys = ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad") if kind == "zero" else ("clip_grad",)
    st.extras = {k: first[k] for k in keys if k in first}
    return st


# --- per-parameter layouts (stage 0) --------------------------------------------------------------------
def _adam_state_dict(st: StageOptim, stateless: Sequence[str] = ()) -> dict:
    """torch AdamW state_dict over the stage's parameters, indexed in group order; the `stateless` ones never
    had a gradient, so torch holds no state for them."""
    state, groups, index = {}, [], 0
    for kind, names in st.groups:
        ids = []
        for n in names:
            if st.step[kind] is not None and n not in stateless:
                state[index] = {"step": _copy(st.step[kind]), **{k: st.tensors[n][k].clone() for k in STATE_KEYS}}
            ids.append(index)
            index += 1
        groups.append({**st.hyper[kind], "params": ids})
    return {"state": state, "param_groups": groups}


def _read_adam(sd: dict, st: StageOptim, shapes: Dict[str, torch.Size]) -> None:
    """A parameter without state (it never had a gradient) gets zero moments."""
    index, missing = 0, []
    for g, (kind, names) in enumerate(st.groups):
        hyper = dict(sd["param_groups"][g])
        hyper.pop("params")
        st.hyper[kind] = hyper
        for n in names:
            entry = sd["state"].get(index)
            if entry is None:
                missing.append((kind, n))
            else:
                st.tensors.setdefault(n, {}).update({k: entry[k] for k in STATE_KEYS})
                st.step[kind] = entry["step"]
            index += 1
    for kind, n in missing:
        st.tensors.setdefault(n, {}).update({k: torch.zeros(shapes[n]) for k in STATE_KEYS})
        st.step.setdefault(kind, None)


def write_client(st: StageOptim, unused: Sequence[str] = ()) -> dict:
    """Stage-0 fp32 (torch AdamW): no state for the `unused` copies a stage holds (`ModelTable.unused_copies`),
    which never get a gradient there."""
    return _adam_state_dict(st, unused)


def read_client(sd: dict, groups, weights: Dict[str, torch.Tensor]) -> StageOptim:
    """Stage-0 fp32: the master weights are the module's weights (`weights` by module name)."""
    st = StageOptim(groups=groups)
    _read_adam(sd, st, {n: w.shape for n, w in weights.items()})
    for _, names in groups:
        for n in names:
            st.tensors.setdefault(n, {})["fp32"] = weights[n].float()
    return st


def write_unfused(st: StageOptim) -> dict:
    out = {"dynamic_loss_scale": False, "cur_scale": st.extras.get("cur_scale", 1.0),
           "cur_iter": st.extras.get("cur_iter", 0)}
    out["optimizer_state_dict"] = _adam_state_dict(st)
    out["fp32_groups"] = [[st.tensors[n]["fp32"].clone() for n in names] for _, names in st.groups]
    return out


def read_unfused(sd: dict, groups, shapes: Dict[str, torch.Size]) -> StageOptim:
    st = StageOptim(groups=groups)
    _read_adam(sd["optimizer_state_dict"], st, shapes)
    for (_, names), fp32 in zip(groups, sd["fp32_groups"]):
        for n, t in zip(names, fp32):
            st.tensors.setdefault(n, {})["fp32"] = t
    st.extras = {k: sd[k] for k in ("cur_scale", "cur_iter") if k in sd}
    return st


def default_extras(args: Dict[str, Any], iteration: int, skipped: int) -> Dict[str, Any]:
    """Loss-scaling state of a run that never overflowed, for a layout the source did not have.
    (fp16 always runs ZeRO-1, so its dynamic scaler is only ever carried from a zero source.)"""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    clip = args.get("clip_grad", 1.0)
    return {"loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False, "clip_grad": clip,
            "cur_scale": 1.0, "cur_iter": iteration - skipped}


def carry_extras(source: Dict[str, Any], target_defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The source's loss-scaling state where it has it, the defaults for the rest."""
    out = dict(target_defaults)
    out.update({k: copy.deepcopy(v) for k, v in source.items()})
    return out
