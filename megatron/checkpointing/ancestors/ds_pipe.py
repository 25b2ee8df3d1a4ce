"""DeepSpeed pipeline checkpoints of this project's ancestors -> `Source`: Megatron-DeepSpeed's GPTModelPipe,
DeepSpeedExamples' Megatron-LM-v1.1.5-3D_parallelism and CPM-Pretrain's GPT2ModelPipe.

    <dir>/latest                                   the tag, e.g. global_step1000
    <dir>/<tag>/layer_LL-model_TT-model_states.pt  pipeline layer LL (its index in the module's spec list), tp
                                                   rank TT: the layer's own state dict
    <dir>/<tag>/mp_rank_MM_model_states.pt         MM = stage x tp + tp rank: `module` None, DeepSpeed's engine
                                                   state and the client state (Megatron-DeepSpeed: args,
                                                   checkpoint_version 3.0, iteration; v1.1.5 / CPM: iteration)

The spec indices differ (Megatron-DeepSpeed: embedding 1, layers 2 .. L+1, final norm L+2; v1.1.5 and CPM:
embedding 0, layers 2 .. L+1, final norm L+3), so each layer file is classified by its keys: the word table is
the embedding, weight [and bias] alone the final norm, `lm_head.weight` an untied head, attention keys a
transformer layer (numbered in file order). A checkpoint without layer files whose mp_rank files hold the
`module` (Megatron-DeepSpeed without a pipeline) is Megatron-LM's model state dict, one file per tp rank.

v1.1.5 and CPM-Pretrain record no checkpoint_version, and a run resumed there read its QKV rows in version 0's
order while one started from scratch wrote version 2.0's: the order is not in the files (`--qkv-order`,
`--data-path`). CPM-Pretrain's T5 (T5ModelPipe) is refused: one learned absolute position table shared by
encoder and decoder, no final encoder norm and the decoder's post-attention norm applied twice, which this
project's T5 (relative position bias, a norm per sub-layer) cannot compute.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Tuple

from megatron.errors import UserError
from ..files import CheckpointFileError
from .qkv import order_of_version
from .source import T5_REFUSED, Source, add_part, arguments, canonical_name, flatten, load_ancestor, model_keys

LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt")
MP_FILE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
T5_KEY = re.compile(r"(^|\.)(cross_attention|inter_attention|key_value)\.")  # a decoder layer's cross-attention


def tag_folder(root: str) -> str:
    names = os.listdir(root)
    if any(LAYER_FILE.fullmatch(n) or MP_FILE.fullmatch(n) for n in names):
        return root
    with open(os.path.join(root, "latest")) as f:
        tag = f.read().strip()
    folder = os.path.join(root, tag)
    if not os.path.isdir(folder):
        raise CheckpointFileError(f"{os.path.join(root, 'latest')} names {tag!r}, but {folder} does not exist")
    return folder


def is_ds_pipe(root: str) -> bool:
    try:
        folder = tag_folder(root)
    except (OSError, ValueError):
        return False
    return any(MP_FILE.fullmatch(n) for n in os.listdir(folder))


def _kind(state: Dict[str, Any], path: str) -> str:
    keys = [k for k in state if not k.endswith("_extra_state")]
    if any(T5_KEY.search(k) for k in keys):
        raise UserError(f"{path} is a T5 decoder layer (cross-attention): {T5_REFUSED}")
    if "word_embeddings.weight" in keys:
        return "embedding"
    if "lm_head.weight" in keys:
        return "head"
    if set(keys) <= {"weight", "bias"} and keys:
        return "final"
    if any("attention." in k for k in keys):
        return "layer"
    raise UserError(f"{path} holds {sorted(keys)}: not a GPT pipeline layer import-megatron knows")


def _layer_files(folder: str) -> Tuple[Dict[int, Dict[int, str]], int]:
    """{layer index: {tp rank: path}} and tp; one line naming a missing tp rank's file."""
    files: Dict[int, Dict[int, str]] = {}
    for name in os.listdir(folder):
        m = LAYER_FILE.fullmatch(name)
        if m:
            files.setdefault(int(m[1]), {})[int(m[2])] = os.path.join(folder, name)
    tp = max(len(ranks) for ranks in files.values())
    for layer, ranks in sorted(files.items()):
        for t in range(tp):
            if t not in ranks:
                missing = os.path.join(folder, f"layer_{layer:02d}-model_{t:02d}-model_states.pt")
                raise CheckpointFileError(f"checkpoint file {missing} is missing: other layers have {tp} tp ranks; "
                                          f"copy the whole {os.path.basename(folder)} folder")
    return files, tp


def _mp_files(folder: str) -> List[str]:
    found = sorted((int(m[1]), n) for n in os.listdir(folder) for m in [MP_FILE.fullmatch(n)] if m)
    for i, (rank, name) in enumerate(found):
        if rank != i:
            raise CheckpointFileError(f"checkpoint file {os.path.join(folder, f'mp_rank_{i:02d}_model_states.pt')} "
                                      f"is missing (the folder has {name})")
    return [os.path.join(folder, n) for _, n in found]


def _check_layout(mp: List[str], tp: int, margs: Dict[str, Any]) -> int:
    if len(mp) % tp:
        raise CheckpointFileError(f"{os.path.dirname(mp[0])} holds {len(mp)} mp_rank files and layer files of {tp} "
                                  f"tp ranks: files of runs at different tp in one folder; keep one run's files")
    pp = len(mp) // tp
    saved = (margs.get("tensor_model_parallel_size"), margs.get("pipeline_model_parallel_size") or pp)
    if margs and saved != (tp, pp):
        raise CheckpointFileError(f"{mp[0]} records (tp, pp) = {saved}, but the folder holds files of (tp, pp) = "
                                  f"({tp}, {pp}): files of runs at different layouts in one folder")
    return pp


def read_ds_pipe(root: str) -> Source:
    folder = tag_folder(root)
    mp = _mp_files(folder)
    if not mp:
        raise CheckpointFileError(f"{folder} has no mp_rank_XX_model_states.pt (DeepSpeed's engine state)")
    first = load_ancestor(mp[0])
    margs = arguments(first.get("args"))
    version = first.get("checkpoint_version")
    if not any(LAYER_FILE.fullmatch(n) for n in os.listdir(folder)):
        return _read_modules(folder, mp, first, margs)
    files, tp = _layer_files(folder)
    pp = _check_layout(mp, tp, margs)
    origin = "Megatron-DeepSpeed GPTModelPipe" if margs else "GPT2ModelPipe of DeepSpeedExamples v1.1.5 / CPM-Pretrain"
    recorded = version if version is not None else "not recorded"
    src = Source(fmt=f"DeepSpeed pipeline checkpoint ({origin}, tp {tp}, pp {pp}, checkpoint_version {recorded})",
                 where=folder, margs=margs, tp=tp, pp=pp,
                 qkv_order=None if version is None else order_of_version(version))
    layer = 0
    for index in sorted(files):
        for t in range(tp):
            path = files[index][t]
            state = load_ancestor(path)
            kind = _kind(state, path)
            for key, value in state.items():
                if key.endswith("_extra_state"):
                    continue
                name = {"embedding": f"embedding.{key}", "head": key,
                        "final": f"final_layernorm.{key}"}.get(kind) or f"layers.{layer}.{canonical_name(key, path)}"
                add_part(src.parts, name, t, tp, value)
        layer += kind == "layer"
    _position(src, first, margs)
    return src


def _read_modules(folder: str, mp: List[str], first: Dict[str, Any], margs: Dict[str, Any]) -> Source:
    """Megatron-DeepSpeed without a pipeline: Megatron-LM's model state dict in each mp_rank file's `module`."""
    if not isinstance(first.get("module"), dict):
        raise CheckpointFileError(f"{folder} has no layer_*-model_*-model_states.pt files and {mp[0]} no module")
    version = first.get("checkpoint_version")
    src = Source(fmt=f"DeepSpeed checkpoint without a pipeline (Megatron-DeepSpeed, tp {len(mp)}, checkpoint_version "
                     f"{version})", where=folder, margs=margs, tp=len(mp), pp=1,
                 qkv_order=None if version is None else order_of_version(version))
    for t, path in enumerate(mp):
        state = first if t == 0 else load_ancestor(path)
        for name, value in model_keys(flatten(state["module"]), 0, path).items():
            add_part(src.parts, name, t, len(mp), value)
    _position(src, first, margs)
    return src


def _position(src: Source, first: Dict[str, Any], margs: Dict[str, Any]) -> None:
    src.iteration = first.get("iteration")
    src.consumed_samples = margs.get("consumed_train_samples")
    src.not_carried = "optimizer state (DeepSpeed's ZeRO / fp16 optimizer files) and RNG states are not carried"
