"""Megatron-LM's legacy ("torch") checkpoints -> `Source`.

    <dir>/latest_checkpointed_iteration.txt     an iteration, or `release`
    <dir>/iter_NNNNNNN|release/mp_rank_TT[_PPP]/model_optim_rng.pt   one file per (tp rank TT, pp rank PPP)
        args                 argparse.Namespace (tensor_/pipeline_model_parallel_size; model_parallel_size
                             before checkpoint_version 3.0)
        checkpoint_version   absent (0), 1.0, 2.0, 3.0: the fused QKV's row order (`qkv`)
        iteration, model (or model0, model1, ... per virtual-pipeline chunk), optimizer, rng state, ...
        model: language_model.{embedding, encoder | transformer (Megatron-LM 1.0 to 2.4)},
               word_embeddings_for_head (last stage, tied), language_model.output_layer (untied); 2019's
               GPT2Model (before the `megatron` package, no args, no checkpoint_version) saved its own flat
               state dict: word_embeddings.weight, position_embeddings.weight, transformer.layers.i.*,
               transformer.final_layernorm.*

Layer numbers are local to a (stage, chunk); chunk c of stage s holds the layers after those of every
(chunk, stage) before it in the order c * pp + s (Megatron's interleaving), so they are numbered by counting.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, List, Tuple

from ..files import CheckpointFileError
from .qkv import order_of_version
from .source import Source, add_part, arguments, flatten, layer_count, load_ancestor, model_keys

TRACKER = "latest_checkpointed_iteration.txt"
RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
FILES = ("model_optim_rng.pt", "model_rng.pt")


def holds_ranks(folder: str) -> bool:
    return any(RANK_DIR.fullmatch(n) for n in os.listdir(folder))


def iteration_folder(root: str, holds_iteration: Callable[[str], bool] = holds_ranks) -> str:
    """The iteration folder of a Megatron-LM save directory (either format): `root` itself when
    `holds_iteration(root)` (legacy: it holds mp_rank_* folders), else the folder its tracker names."""
    if holds_iteration(root):
        return root
    tracker = os.path.join(root, TRACKER)
    with open(tracker) as f:
        value = f.read().strip()
    name = "release" if value == "release" else f"iter_{int(value):07d}" if value.isdigit() else None
    if name is None:
        raise CheckpointFileError(f"{tracker} holds {value!r}; Megatron-LM writes an iteration or 'release'")
    folder = os.path.join(root, name)
    if not os.path.isdir(folder):
        raise CheckpointFileError(f"{tracker} names {value!r}, but {folder} does not exist")
    return folder


def _rank_paths(folder: str) -> Dict[Tuple[int, int], str]:
    """(tp rank, pp rank) -> file; one-line errors for mixed naming, expert parallelism and missing ranks."""
    found, forms = {}, set()
    for name in sorted(os.listdir(folder)):
        m = RANK_DIR.fullmatch(name)
        if not m:
            continue
        if m[3] is not None:
            raise CheckpointFileError(f"{os.path.join(folder, name)}: expert-parallel ranks (mixture of experts); "
                                      f"import-megatron reads dense GPT checkpoints")
        forms.add(m[2] is None)
        path = next((os.path.join(folder, name, f) for f in FILES if os.path.isfile(os.path.join(folder, name, f))),
                    os.path.join(folder, name, FILES[0]))
        found[(int(m[1]), int(m[2] or 0))] = path
    if len(forms) > 1:
        raise CheckpointFileError(f"{folder} holds both mp_rank_TT and mp_rank_TT_PPP folders: files of runs with and "
                                  f"without pipeline parallelism in one iteration folder; keep one run's files")
    tp, pp = 1 + max(t for t, _ in found), 1 + max(p for _, p in found)
    for t in range(tp):
        for p in range(pp):
            path = found.get((t, p)) or os.path.join(folder, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""),
                                                     FILES[0])
            if not os.path.isfile(path):
                raise CheckpointFileError(f"checkpoint file {path} is missing: the folder holds tp ranks 0..{tp - 1} "
                                          f"and pp ranks 0..{pp - 1}; copy the whole iteration folder")
    return found


def _check_layout(path: str, margs: Dict[str, Any], tp: int, pp: int) -> None:
    """The file's recorded tp (and pp, recorded since checkpoint_version 3.0) are the folder's."""
    saved = (margs.get("tensor_model_parallel_size", margs.get("model_parallel_size")),
             margs.get("pipeline_model_parallel_size", pp))
    if saved[0] is not None and saved != (tp, pp):
        raise CheckpointFileError(f"{path} records (tp, pp) = {saved}, but the folder holds the files of "
                                  f"{tp} tp x {pp} pp ranks: files of runs at different layouts in one iteration "
                                  f"folder; keep one run's files")


def _chunks(state: Dict[str, Any], path: str) -> List[Dict[str, Any]]:
    """The model state dicts of a file: `model`, or model0, model1, ... (virtual pipeline)."""
    if "model" in state:
        return [state["model"]]
    chunks = sorted((int(k[5:]), v) for k, v in state.items() if re.fullmatch(r"model\d+", k))
    if not chunks:
        raise CheckpointFileError(f"{path} has no 'model' (nor model0, model1, ...); it holds {sorted(state)}")
    return [v for _, v in chunks]


def read_legacy(root: str) -> Source:
    folder = iteration_folder(root)
    paths = _rank_paths(folder)
    tp, pp = 1 + max(t for t, _ in paths), 1 + max(p for _, p in paths)
    first = load_ancestor(paths[(0, 0)])
    margs = arguments(first.get("args"))
    _check_layout(paths[(0, 0)], margs, tp, pp)
    version = first.get("checkpoint_version")
    states = {(t, s): (first if (t, s) == (0, 0) else load_ancestor(paths[(t, s)])) for s in range(pp)
              for t in range(tp)}
    for (t, s), state in states.items():
        _check_layout(paths[(t, s)], arguments(state.get("args")), tp, pp)
    chunks = {key: _chunks(state, paths[key]) for key, state in states.items()}
    v = len(chunks[(0, 0)])
    counts = {(c, s): layer_count(model_keys(flatten(chunks[(0, s)][c]), 0, paths[(0, s)])) for s in range(pp)
              for c in range(v)}
    order = sorted(counts, key=lambda cs: cs[0] * pp + cs[1])
    offsets = {cs: sum(counts[o] for o in order[:i]) for i, cs in enumerate(order)}
    recorded = version if version is not None else "absent: 0"
    src = Source(fmt=f"Megatron-LM legacy checkpoint (checkpoint_version {recorded}, tp {tp}, pp {pp}"
                     + (f", {v} virtual-pipeline chunks" if v > 1 else "") + ")",
                 where=folder, margs=margs, tp=tp, pp=pp, qkv_order=order_of_version(version))
    for (t, s), models in chunks.items():
        if len(models) != v:
            raise CheckpointFileError(f"{paths[(t, s)]} holds {len(models)} model chunks, {paths[(0, 0)]} {v}")
        for c, model in enumerate(models):
            for name, value in model_keys(flatten(model), offsets[(c, s)], paths[(t, s)]).items():
                add_part(src.parts, name, t, tp, value)
    release = os.path.basename(folder) == "release"
    src.iteration = None if release else first.get("iteration")
    src.consumed_samples = None if release else margs.get("consumed_train_samples")
    src.not_carried = ("optimizer state (Megatron-LM's optimizer, its loss scaler and distributed-optimizer "
                       "shards) and RNG states are not carried")
    return src
