"""Saving and loading during training: through the engine, published atomically, checked on load.

Order of a save: every rank writes its files -> barrier -> manifest.json (every file's size and CRC-32,
`manifest.py`) -> rank 0 replaces `latest` atomically (write a temporary file, fsync, os.replace) -> barrier.
A process killed at any point before os.replace leaves `latest` naming the previous complete checkpoint.
With --async-save the same files are written by a background thread and rank 0's thread publishes them
when every rank has finished (`async_save.py`); `latest` moves only then, so the same holds.
Every layout trains the Pipe model (one stage at pp = 1), so every layout writes the same per-layer files
and one format serves every layout and tool (`module_form` 'pipe' in megatron_args.json; pp = 1
checkpoints of the earlier plain-model path are read through the reshape below). DeepSpeed's
zero_to_fp32.py is not copied into the save directory (it cannot read these checkpoints;
`tools/convert_checkpoint.py to-fp32` does that job).

Client state: iteration, consumed_train_samples and this rank's RNG states (python, numpy, torch, device,
tensor-parallel tracker). DeepSpeed stores it once per (pipeline stage, tensor-parallel rank), written by
data-parallel rank 0; data-parallel replicas share their RNG states (see `megatron.mpu.random`).

`save_checkpoint` and `load_checkpoint` take the run's `megatron.config.run_config.RunConfig` (`cfg`): its
checkpoint and layout sections, and `cfg.record`, the resolved command line stored in megatron_args.json beside
the 'model' and 'layout' records (`names.with_records`).

Loading (`load_checkpoint`) of the tag `latest` names, or of --ckpt-step N's: first the sizes of every file
it will read (`manifest.check_files`), then (each file's CRC-32 compared with manifest.json's while it is read,
`reading.read_verified`)
    same layout            DeepSpeed's engine.load_checkpoint (weights, optimizer, LR scheduler, steps)
    another (tp, pp, dp)   rank 0 reshapes into <save or load>/.reshaped-<tag> (the `reshape` tool's code),
                           every rank loads that, rank 0 removes it; RNG streams are kept as seeded
    --finetune, or a       weights only, at any layout (`load_weights_into`): iteration 0, fresh optimizer
    weights-only ckpt      and LR schedule, 0 consumed samples
"""
from __future__ import annotations

import contextlib
import copy
import os
import shutil
from functools import partial
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.mpu import rng_states, set_rng_states
from megatron.logging_utils import print_rank_0
from megatron.model.specs.gpt import LAYER_SWITCHES
from tds.safe_load import trusted
from .async_save import save_async
from .consolidated import has_engine_state, has_optimizer, layout_of, read_consolidated
from .engine_files import files_of
from .files import (ARGS_FILE, LATEST, CheckpointMismatchError, checkpoint_folder, checkpoint_tag, folder_bytes,
                    not_published, publish_latest, read_args, read_latest, write_args)
from .manifest import WEIGHTS, check_files, checked_folder, parts_read, save_manifest
from .reading import MANIFEST, read_manifest
from .space import agree_space, writing
from .names import PIPE_FORM, layout_record, plain_pp1, virtual_stages, with_records
from .weights import load_weights_into, reshape_command

# Arguments that fix parameter shapes, the model's function or the sample layout; a resumed checkpoint must agree
# on all (a weights-only load, --finetune, checks the shapes only: `weights.SHAPE_CONFIG_FIELDS`).
SHAPE_FIELDS = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "vocab_size", "max_position_embeddings", "seq_length", "encoder_seq_length",
                "decoder_seq_length", "decoder_num_layers", "feed_forward_proj", "untie_embeddings_and_output_weights",
                "relative_attention_num_buckets", "position_embedding_type", "rotary_base", "rotary_percent",
                "use_rope_scaling", "normalization", "swiglu", "group_query_attention", "num_query_groups",
                "disable_bias_linear", "add_qkv_bias", "gelu", *LAYER_SWITCHES)


def commit(save_dir: str, tag: str) -> None:
    """Collective: rank 0 makes `tag` the checkpoint --load picks; the others wait for it."""
    if dist.get_rank() == 0:
        publish_latest(save_dir, tag)
    dist.barrier()


def _write_args(cfg, folder: str) -> None:
    write_args(folder, with_records({**cfg.record, "module_form": PIPE_FORM}))


def save_checkpoint(engine, cfg, iteration: int, consumed_train_samples: int) -> str:
    """Collective: every rank calls it. Returns the checkpoint folder. With --async-save it returns once the
    state is copied and the writes are handed to a background thread (`async_save.py`), which publishes the
    checkpoint when every rank's files are complete; `wait_for_saves` waits for that."""
    tag, save_dir = checkpoint_tag(iteration), cfg.checkpoint.save
    print_rank_0(f"saving checkpoint at iteration {iteration} to {save_dir}/{tag}")
    client_state = dict(iteration=iteration, consumed_train_samples=consumed_train_samples, rng_states=rng_states())
    if cfg.checkpoint.async_save:
        save_async(engine, save_dir, tag, client_state, partial(_write_args, cfg) if dist.get_rank() == 0 else None,
                   60 * cfg.layout.distributed_timeout_minutes)
        print_rank_0(f"checkpoint {save_dir}/{tag} is being written in the background")
        return os.path.join(save_dir, tag)
    what, outcome, needed = f"checkpoint iteration {iteration}", not_published(save_dir, tag), \
        previous_size(save_dir, tag)
    agree_space(save_dir, needed, what, outcome)
    folder = os.path.join(save_dir, tag)
    with files_of(engine).space_checked(what, outcome, needed):
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    if dist.get_rank() == 0:
        with writing(os.path.join(folder, ARGS_FILE), needed, what, outcome):
            _write_args(cfg, folder)
    dist.barrier()  # every rank's files are complete
    with writing(os.path.join(folder, MANIFEST), needed, what, outcome):
        save_manifest(folder)
    with writing(os.path.join(save_dir, LATEST), needed, what, outcome):
        commit(save_dir, tag)
    print_rank_0(f"saved checkpoint {save_dir}/{tag}")
    return os.path.join(save_dir, tag)


def previous_size(save_dir: str, tag: str) -> int:
    """The bytes a save of `tag` will add: the size of the checkpoint `latest` names (its manifest's total),
    less what a folder `tag` already holds (files the save overwrites); 0 without a previous checkpoint."""
    previous = read_latest(save_dir)
    folder = os.path.join(save_dir, previous) if previous else None
    if folder is None or not os.path.isdir(folder):
        return 0
    try:
        listed = read_manifest(folder)
    except (OSError, ValueError):
        listed = None
    total = sum(e["bytes"] for e in listed.values()) if listed else folder_bytes(folder)
    target = os.path.join(save_dir, tag)
    present = folder_bytes(target) if os.path.isdir(target) and os.path.realpath(target) != os.path.realpath(folder) \
        else 0
    return max(0, total - present)


def check_compatible(saved: Dict[str, Any], run: Dict[str, Any], where: str) -> None:
    """Raise CheckpointMismatchError naming the first model or sample-shape field that differs (`run`: the
    run's resolved arguments, `cfg.record`)."""
    for field in SHAPE_FIELDS:
        mine = run.get(field)
        if field in saved and saved[field] != mine:
            raise CheckpointMismatchError(f"checkpoint {where} has {field} = {saved[field]} but the arguments give "
                                          f"{mine}; use the arguments it was trained with or a different --load")


def _same_layout(saved: Dict[str, Any], cfg) -> bool:
    """Same (tp, pp, dp), ZeRO stage, partition and chunks per stage (these decide each rank's files): the
    'layout' records this run would save and the checkpoint has."""
    return layout_record(saved) == layout_record(cfg.record) and not plain_pp1(saved)


def _dims(cfg) -> Tuple[int, int, int]:
    return cfg.layout.tp, cfg.layout.pp, cfg.layout.dp


def load_checkpoint(engine, cfg) -> Tuple[int, int]:
    """Load the checkpoint `latest` names under --load; returns (iteration, consumed_train_samples),
    (0, 0) when there is none or when only weights are loaded (--finetune, weights-only checkpoints).
    Every file is read with weights_only=True and the allowlist (`tds.safe_load`), or, with
    --trust-checkpoint, as a trusted pickle."""
    with trusted(cfg.checkpoint.trust_checkpoint):
        return _load_checkpoint(engine, cfg)


def _load_checkpoint(engine, cfg) -> Tuple[int, int]:
    load_dir, step, pretrained = cfg.checkpoint.load, cfg.checkpoint.ckpt_step, cfg.checkpoint.pretrained_checkpoint
    tag = (read_latest(load_dir) if load_dir else None) if step is None else checkpoint_tag(step)
    if tag is None and pretrained:
        print_rank_0(f"no checkpoint under --load {load_dir}: starting from the weights of --pretrained-checkpoint "
                     f"{pretrained}")
        load_dir, tag = pretrained, read_latest(pretrained)
        if tag is None:
            raise CheckpointMismatchError(f"--pretrained-checkpoint {pretrained} holds no checkpoint (no 'latest' "
                                          f"file); give the directory import-hf or a training run saved into")
    if tag is None:
        print_rank_0(f"no checkpoint under --load {load_dir} (no 'latest' file): starting from scratch")
        return 0, 0
    folder = checkpoint_folder(load_dir, tag)
    saved = read_args(folder)
    weights_only = cfg.checkpoint.finetune or not has_engine_state(saved) or load_dir == pretrained
    check_files(folder, saved, (WEIGHTS,) if weights_only else parts_read(_loads_optimizer(cfg, saved)))
    if weights_only:
        why = "--finetune" if cfg.checkpoint.finetune else "it holds weights only"
        print_rank_0(f"loading the weights of {folder} ({why}): iteration 0, fresh optimizer and LR schedule")
        with engine.whole_experts(loading=True):
            load_weights_into(engine.module, folder, saved, function=not cfg.checkpoint.finetune)
        _refresh_master_weights(engine)
        return 0, 0
    check_compatible(saved, cfg.record, folder)
    if _same_layout(saved, cfg):
        return _load_same_layout(engine, cfg, load_dir, tag, saved)
    if not _project_model(cfg):
        raise CheckpointMismatchError(
            f"checkpoint {folder} was saved at (tp, pp, dp) = {layout_of(saved)}, this run is {_dims(cfg)}; the "
            f"checkpoint tools reshape GPT-2 and T5 only: resume {type(engine.module).__name__} at the saved layout")
    return _load_reshaped(engine, cfg, folder, tag, saved)


def _project_model(cfg) -> bool:
    """Whether the run trains a model of a registered family (whose spec the checkpoint tools know), not a model of
    its own (a test's toy spec)."""
    from megatron.model.specs import SPECS
    spec = SPECS.get(cfg.model_type)
    return spec is not None and isinstance(cfg.model, spec.config_class)


def _loads_optimizer(cfg, saved: Dict[str, Any]) -> bool:
    return not cfg.checkpoint.no_load_optim and has_optimizer(saved)


def _refresh_master_weights(engine) -> None:
    if hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()


def _load_same_layout(engine, cfg, load_dir: str, tag: str, saved: Dict[str, Any]) -> Tuple[int, int]:
    where, no_optim = os.path.join(load_dir, tag), cfg.checkpoint.no_load_optim
    print_rank_0(f"loading checkpoint {where} ...")
    load_optim = _loads_optimizer(cfg, saved)
    with _bf16_optimizer_load(engine), files_of(engine).verified(where, saved):
        path, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optim,
                                                    load_lr_scheduler_states=not no_optim)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {where}")
    dist.barrier()  # every rank has read its files (one that could not has reported it and left)
    if not no_optim and engine.lr_scheduler is not None:
        # DeepSpeed loads the scheduler before the ZeRO optimizer state, whose param groups then bring back
        # the learning rate of the last step before the save; set this step's rate again (exact resume)
        engine.lr_scheduler.load_state_dict(engine.lr_scheduler.state_dict())
    if not load_optim:
        _refresh_master_weights(engine)
    if cfg.checkpoint.no_load_rng:
        pass
    elif "rng_states" in client_state:
        set_rng_states(client_state["rng_states"])
    else:
        print_rank_0("the checkpoint has no RNG states for this layout: keeping the generators seeded from --seed")
    iteration, consumed = client_state["iteration"], client_state["consumed_train_samples"]
    print_rank_0(f"loaded checkpoint {where}: iteration {iteration}, {consumed} samples consumed")
    return iteration, consumed


@contextlib.contextmanager
def _instance_overrides(obj, attrs: Dict[str, Any]) -> Iterator[None]:
    """Set instance attributes that shadow methods; removed again on every path."""
    for name, value in attrs.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name in attrs:
            obj.__dict__.pop(name, None)


@contextlib.contextmanager
def _bf16_optimizer_load(engine) -> Iterator[None]:
    """DeepSpeed 0.19's BF16_Optimizer (bf16, stage 0) is given the list its loader indexes by dp rank, and
    its fp32 master weights are restored from the checkpoint."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    opt = engine.optimizer
    if isinstance(opt, BF16_Optimizer) and not engine.zero_optimization():  # tds's FlatBF16Optimizer too
        def bf16_load(state_dict, load_optimizer_states=True, **kwargs):
            opt._load_legacy_checkpoint([state_dict], load_optimizer_states, load_from_fp32_weights=True)
        with _instance_overrides(opt, {"load_state_dict": bf16_load}):
            yield
        return
    yield


def _load_reshaped(engine, cfg, folder: str, tag: str, saved: Dict[str, Any]) -> Tuple[int, int]:
    """Rank 0 writes the checkpoint at this run's layout next to --save (else --load); all ranks load it."""
    from .layouts import target_args
    from .reshape import write_checkpoint
    mine, layout = _dims(cfg), cfg.layout
    work = os.path.join(cfg.checkpoint.save or cfg.checkpoint.load, f".reshaped-{tag}")
    chunks = (f" ({virtual_stages(saved)} vs {layout.virtual_pipe_stages} chunks per pipeline stage)"
              if virtual_stages(saved) != layout.virtual_pipe_stages else "")
    print_rank_0(f"checkpoint {folder} was saved at (tp, pp, dp) = {layout_of(saved)}, this run is {mine}{chunks}: "
                 f"reshaping it into {work} (what `{reshape_command(folder, *mine)}` does)")
    if dist.get_rank() == 0:
        shutil.rmtree(work, ignore_errors=True)
        new_args = target_args(saved, *mine)
        new_args.update(copy.deepcopy({k: cfg.record[k] for k in ("partition_method", "zero_stage",
                                                                  "virtual_pipe_stages", "pipeline_schedule",
                                                                  "ds_config")}))
        with_optim = not cfg.checkpoint.no_load_optim and has_optimizer(saved)
        write_checkpoint(read_consolidated(folder, with_optimizer=with_optim), work, tag, new_args, with_optim)
    dist.barrier()
    try:
        return _load_same_layout(engine, cfg, work, tag, read_args(os.path.join(work, tag)))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)


def read_checkpoint_args(load_dir: str, tag: Optional[str] = None) -> Dict[str, Any]:
    """The saved resolved arguments of the checkpoint `latest` (or `tag`) names in `load_dir`; UserError
    (CheckpointFileError) naming what is missing."""
    return read_args(checkpoint_folder(load_dir, tag))


def load_model_weights(model: torch.nn.Module, load_dir: str, tag: Optional[str] = None) -> Dict[str, Any]:
    """Load the weights of any checkpoint of this project (saved at any tp, pp, dp) into a plain GPTModel /
    T5Model built at the current tensor-parallel size (`model.tp_group`); the vocabulary padding is adapted.
    Returns the saved arguments. UserError naming the field on a shape mismatch."""
    folder = checked_folder(load_dir, tag, (WEIGHTS,))
    saved = read_args(folder)
    load_weights_into(model, folder, saved)
    return saved

