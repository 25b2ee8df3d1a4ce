"""reshape: a checkpoint saved at any (tp, pp, dp) -> the same checkpoint at another (tp, pp, dp).

    read_consolidated(source tag folder) -> full tensors -> write_layout(target layout) -> <out>/<tag>, <out>/latest

Weights, fp32 master weights and Adam moments are re-cut exactly (tp split/merge by partition attributes,
ZeRO-1 flat partitions re-cut for the new dp, vocabulary re-padded for the new tp); the LR scheduler,
step counters, iteration and consumed samples are carried. The output is written under a temporary name
and renamed when complete; the input is only read.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from .consolidated import Consolidated, layout_of, read_consolidated
from megatron.errors import UserError
from .files import folder_bytes, new_checkpoint, read_args
from .space import tensor_bytes
from .layouts import check_layout, source_layout_note, target_args, write_layout
from .manifest import checked_folder, parts_read
from .names import ModelTable


@dataclass
class ReshapeReport:
    source: tuple
    target: tuple
    tag: str
    note: str
    source_bytes: int
    seconds: float


def reshape(load_dir: str, save_dir: str, tp: int, pp: int, dp: Optional[int] = None, no_optimizer: bool = False,
            tag: Optional[str] = None) -> ReshapeReport:
    """Write the checkpoint `latest` (or `tag`) of `load_dir` at (tp, pp, dp) into the new directory
    `save_dir`; dp defaults to the saved one. Returns what was done."""
    start = time.perf_counter()
    folder = checked_folder(load_dir, tag, parts_read(not no_optimizer))
    saved = read_args(folder)
    new_args = target_args(saved, tp, pp, layout_of(saved)[2] if dp is None else dp)
    check_layout(ModelTable(new_args), new_args, tp, pp)  # before reading anything large
    if os.path.exists(save_dir):
        raise UserError(f"--save {save_dir} already exists; choose a new directory (outputs are never overwritten)")
    ck = read_consolidated(folder, with_optimizer=not no_optimizer)
    name = os.path.basename(os.path.normpath(folder))
    write_checkpoint(ck, save_dir, name, new_args, with_optimizer=not no_optimizer)
    return ReshapeReport(layout_of(ck.args), layout_of(new_args), name, source_layout_note(ck, new_args),
                         folder_bytes(folder), time.perf_counter() - start)


def write_checkpoint(ck: Consolidated, save_dir: str, tag: str, new_args: dict, with_optimizer: bool = True) -> None:
    """A new checkpoint directory `save_dir` holding `tag` and `latest`, created atomically."""
    with new_checkpoint(save_dir, tag, tensor_bytes(ck.weights) + tensor_bytes(ck.optim or {})) as folder:
        write_layout(ck, folder, new_args, with_optimizer)
