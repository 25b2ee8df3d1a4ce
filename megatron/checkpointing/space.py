"""A file system that fills: checked before a checkpoint or a tool's output is written, and one line if it fills
while it is written.

    free_bytes(path)            what the file system holding `path` (or its nearest existing parent) has free
    tensor_bytes(obj)           the bytes of the tensors in a state (each storage once): about its file's size
    is_disk_full(err, path)     whether a failed write failed for space: ENOSPC / EDQUOT, or torch's and
                                safetensors' own write errors while the file system is (nearly) full
    DiskFullError               the one line: the path, the bytes needed and free, what was (not) published

A checkpoint save checks before it writes (engine_io: the previous checkpoint's size, async_save: the recorded
state's) and turns a write that fails for space into DiskFullError; nothing is published then (`latest` keeps
naming the previous checkpoint). The tools check their output the same way (files.atomic_folder).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Any, Iterator, Optional

import torch

from megatron.errors import UserError

# a write error with less than this free is taken for a full file system (torch's zip writer and safetensors
# report a failed write without its errno)
NEARLY_FULL = 4 << 20


class DiskFullError(UserError):
    """Not enough space where a checkpoint or a tool's output is written; the message names the path."""


def free_bytes(path: str) -> int:
    """Free bytes for an unprivileged writer on the file system of `path` (or of its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def tensor_bytes(obj: Any, seen: Optional[set] = None) -> int:
    """The bytes of every tensor storage in `obj` (dicts, lists, tuples), each storage counted once."""
    seen = set() if seen is None else seen
    if torch.is_tensor(obj):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen or storage.device.type == "meta":
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


def is_disk_full(err: BaseException, path: str) -> bool:
    """Whether writing `path` failed because its file system is full."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
        return True
    try:
        return free_bytes(path) < NEARLY_FULL
    except OSError:
        return False


def mb(n: int) -> str:
    return f"{n} bytes ({n / 1e6:.1f} MB)"


def disk_full_error(path: str, needed: Optional[int], what: str, outcome: str,
                    free: Optional[int] = None) -> DiskFullError:
    """The one line: `what` (e.g. 'checkpoint iteration 4') at `path` needs `needed` bytes, the file system has
    (`free`: had when the write started) what it has free; `outcome` says what was and was not published."""
    if free is None:
        try:
            free = free_bytes(path)
        except OSError:
            free = None
        had = "has" if free is not None else ""
    else:
        had = "had"
    if free is None:
        need = f"needs about {mb(needed)}, more than its file system has free" if needed else "does not fit"
    elif needed and needed > free:
        need = f"needs about {mb(needed)} and its file system {had} {mb(free)} free"
    else:  # the estimate was short (or another writer took the space)
        need = f"needs more than the {mb(free)} its file system {had} free"
    return DiskFullError(f"no space left on device: {what} at {path} {need}; {outcome}; free space there (or choose "
                         f"another directory) and run again")


def check_space(path: str, needed: int, what: str, outcome: str) -> None:
    """DiskFullError before writing when the file system of `path` has less than `needed` bytes free."""
    if needed and free_bytes(path) < needed:
        raise disk_full_error(path, needed, what, outcome)


def agree_space(path: str, needed: int, what: str, outcome: str) -> None:
    """Collective: every rank raises DiskFullError when any rank's view of `path` has less than `needed` free
    (one all_reduce of one integer), so that no rank starts a save the others give up."""
    import torch.distributed as dist
    from tds import device as tds_device
    short = torch.tensor([int(bool(needed) and free_bytes(path) < needed)], dtype=torch.int64,
                         device=tds_device.device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(short, op=dist.ReduceOp.MAX)
    if int(short[0]):
        raise disk_full_error(path, needed, what, outcome)


@contextlib.contextmanager
def writing(path: str, needed: Optional[int], what: str, outcome: str) -> Iterator[None]:
    """Within the block a write of `path` that fails for space is DiskFullError (the partial file removed)."""
    try:
        free = free_bytes(path)
    except OSError:
        free = None
    try:
        yield
    except BaseException as err:
        if isinstance(err, UserError) or not is_disk_full(err, path):
            raise
        with contextlib.suppress(OSError):
            if os.path.isfile(path):
                os.remove(path)
        raise disk_full_error(path, needed, what, outcome, free) from None
