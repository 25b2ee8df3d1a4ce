"""Checkpoints: written through the engine, published atomically, checked against the arguments on load.

Layout under --save (DeepSpeed's, one folder per tag):

    <save>/iter_0000100/...                       engine files: model (per layer with a pipeline), ZeRO
                                                  optimizer partitions, LR scheduler, client state
    <save>/iter_0000100/megatron_args.json        the resolved arguments (read before any tensor is loaded)
    <save>/latest                                 "iter_0000100": the checkpoint --load picks

Order of a save: every rank writes its files -> barrier -> rank 0 replaces `latest` atomically (write a
temporary file, fsync, os.replace) -> barrier. A process killed at any point before os.replace leaves
`latest` naming the previous complete checkpoint.

Client state: iteration, consumed_train_samples and this rank's RNG states (python, numpy, torch, device,
tensor-parallel tracker). DeepSpeed stores it once per (pipeline stage, tensor-parallel rank), written by
data-parallel rank 0; data-parallel replicas share their RNG states (see `megatron.initialize`), so every
rank gets its own streams back.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Dict, Optional, Tuple

import torch.distributed as dist

from megatron.initialize import rng_states, set_rng_states
from megatron.logging_utils import print_rank_0

LATEST = "latest"
ARGS_FILE = "megatron_args.json"
# Arguments that fix parameter shapes, their partitioning or the sample layout; a checkpoint must agree on all.
SHAPE_FIELDS = ("model_type", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "kv_channels", "padded_vocab_size", "max_position_embeddings", "seq_length", "encoder_seq_length",
                "decoder_seq_length", "tensor_model_parallel_size", "pipe_parallel_size")


class CheckpointMismatchError(ValueError):
    pass


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def read_latest(load_dir: str) -> Optional[str]:
    """The tag `latest` names, or None when `load_dir` has no published checkpoint."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read().strip()


def publish_latest(save_dir: str, tag: str) -> None:
    """Atomically point `latest` at `tag` (a reader sees the old or the new name, never a partial one)."""
    tmp = os.path.join(save_dir, f".{LATEST}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def commit(save_dir: str, tag: str) -> None:
    """Collective: rank 0 makes `tag` the checkpoint --load picks; the others wait for it."""
    if dist.get_rank() == 0:
        publish_latest(save_dir, tag)
    dist.barrier()


def _json_args(args: argparse.Namespace) -> Dict[str, Any]:
    return json.loads(json.dumps(vars(args), default=str))


def save_checkpoint(engine, args: argparse.Namespace, iteration: int, consumed_train_samples: int) -> str:
    """Collective: every rank calls it. Returns the checkpoint folder."""
    tag = checkpoint_tag(iteration)
    print_rank_0(f"saving checkpoint at iteration {iteration} to {args.save}/{tag}")
    client_state = dict(iteration=iteration, consumed_train_samples=consumed_train_samples, rng_states=rng_states())
    engine.save_checkpoint(args.save, tag=tag, client_state=client_state, save_latest=False)
    if dist.get_rank() == 0:
        with open(os.path.join(args.save, tag, ARGS_FILE), "w") as f:
            json.dump(_json_args(args), f, indent=1, sort_keys=True)
    dist.barrier()  # every rank's files are complete
    commit(args.save, tag)
    print_rank_0(f"saved checkpoint {args.save}/{tag}")
    return os.path.join(args.save, tag)


def check_compatible(saved: Dict[str, Any], args: argparse.Namespace, where: str) -> None:
    """Raise CheckpointMismatchError naming the first shape field that differs."""
    for field in SHAPE_FIELDS:
        mine = getattr(args, field, None)
        if field in saved and saved[field] != mine:
            raise CheckpointMismatchError(f"checkpoint {where} has {field} = {saved[field]} but the arguments give "
                                          f"{mine}; use the arguments it was trained with or a different --load")
    if args.zero_stage > 0 and saved.get("data_parallel_size") != args.data_parallel_size and \
            not args.no_load_optim:
        raise CheckpointMismatchError(
            f"checkpoint {where} has ZeRO optimizer partitions for data_parallel_size = "
            f"{saved.get('data_parallel_size')} but this run has {args.data_parallel_size}; "
            "resume with the same data-parallel size or pass --no-load-optim")


def load_checkpoint(engine, args: argparse.Namespace) -> Tuple[int, int]:
    """Load the checkpoint `latest` names under --load; returns (iteration, consumed_train_samples),
    (0, 0) when there is none."""
    tag = read_latest(args.load)
    if tag is None:
        print_rank_0(f"no checkpoint under --load {args.load} (no '{LATEST}' file): starting from scratch")
        return 0, 0
    where = os.path.join(args.load, tag)
    with open(os.path.join(where, ARGS_FILE)) as f:
        check_compatible(json.load(f), args, where)
    print_rank_0(f"loading checkpoint {where} ...")
    load_optim = not args.no_load_optim
    path, client_state = engine.load_checkpoint(args.load, tag=tag, load_optimizer_states=load_optim,
                                                load_lr_scheduler_states=load_optim)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {where}")
    if not args.no_load_rng:
        set_rng_states(client_state["rng_states"])
    iteration, consumed = client_state["iteration"], client_state["consumed_train_samples"]
    print_rank_0(f"loaded checkpoint {where}: iteration {iteration}, {consumed} samples consumed")
    return iteration, consumed
