"""--async-save: the training loop is blocked only while the state is copied; a background thread writes it.

One asynchronous save, on every rank (`save_async`, called by `engine_io.save_checkpoint`):

    main thread   wait for this rank's previous save (on rank 0: also its publication)
                  remove this rank's markers (and, rank 0, the manifest) a killed earlier save of the tag left
                  DeepSpeed's engine.save_checkpoint with the `save(state_dict, path)` of its checkpoint engine
                  replaced for the call: DeepSpeed runs as in a synchronous save (its barriers, the state
                  dicts, the file names, in the same order on every rank), but each save only copies the
                  state into host memory (`snapshot`) and records it; rank 0 writes megatron_args.json; the
                  writes are handed to a daemon thread and the loop goes on
    thread        each recorded file through the checkpoint engine's own save (torch.save), fsync; the marker
                  .done.<rank>.json: {"files": {name: {bytes, crc32}}} of this rank's files
    rank 0's      once every rank's marker exists: manifest.json (the markers' entries and any other file of
    thread        the folder, e.g. megatron_args.json), `latest` replaced atomically, the markers removed

The thread runs no collective (gloo collectives from two threads of one process interleave and deadlock):
the ranks meet through the marker files on the shared checkpoint directory. `latest` moves only after
every rank's files are complete on disk, so a kill -9 at any moment leaves it naming the previous complete
checkpoint. A write that fails leaves .failed.<rank>.json with the one-line error, which rank 0's thread
reports instead of waiting; the error reaches the main thread of the failing rank (and of rank 0) at the
next save or at `wait_for_saves`, which every rank calls before it exits. The thread is a daemon: a run
that fails elsewhere exits at once and its unpublished save is left as an unlisted folder.

Why recorded writes (`engine_files`) rather than a copy of DeepSpeed's save: every file DeepSpeed writes (the
per-layer weights, mp_rank engine state, ZeRO partitions) goes through `checkpoint_engine.save`, so the
asynchronous save writes the same files with the same bytes as the synchronous one (`snapshot` keeps
shared storages shared), and the collectives stay on the main thread, where DeepSpeed puts them.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.errors import UserError, one_line
from megatron.logging_utils import print_rank_0
from .engine_files import files_of
from .files import not_published, publish_latest
from .manifest import MANIFEST, entries, saved_files, write_manifest
from .space import agree_space, disk_full_error, is_disk_full, tensor_bytes, writing

DONE, FAILED = ".done.{rank}.json", ".failed.{rank}.json"
POLL_S = 0.05


class AsyncSaveError(UserError):
    """A file of an asynchronous save could not be written; the message names it."""


def _host_copy(tensor: torch.Tensor, storages: Dict[int, torch.UntypedStorage]) -> torch.Tensor:
    """`tensor` on a host copy of its whole storage (one copy per storage: views stay views of one storage),
    with its class (Parameter), requires_grad and python attributes."""
    storage = tensor.untyped_storage()
    if storage._cdata not in storages:
        storages[storage._cdata] = torch.UntypedStorage(storage.nbytes(), device="cpu").copy_(storage)
    new = torch.empty(0, dtype=tensor.dtype).set_(storages[storage._cdata], tensor.storage_offset(), tensor.size(),
                                                  tensor.stride())
    if isinstance(tensor, torch.nn.Parameter):
        new = torch.nn.Parameter(new, requires_grad=tensor.requires_grad)
    else:
        new.requires_grad_(tensor.requires_grad)
    new.__dict__.update(copy.deepcopy(tensor.__dict__))  # python attributes, which torch.save writes too
    return new


def snapshot(obj: Any, memo: Optional[Dict[int, Any]] = None, storages: Optional[Dict[int, Any]] = None) -> Any:
    """A copy of a state dict that training cannot change: tensors on host copies of their storages, dicts,
    lists and tuples rebuilt (an object referenced twice is copied once), anything else deep-copied. torch.save
    of the copy writes the bytes it writes for `obj` (on CUDA the storages' location reads 'cpu')."""
    memo = {} if memo is None else memo
    storages = {} if storages is None else storages
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if id(obj) in memo:
        return memo[id(obj)]
    if torch.is_tensor(obj):
        new = _host_copy(obj, storages)
    elif isinstance(obj, dict):
        new = copy.copy(obj)  # keeps the type (OrderedDict) and the key order
        for key, value in obj.items():
            new[key] = snapshot(value, memo, storages)
    elif isinstance(obj, list):
        new = [snapshot(v, memo, storages) for v in obj]
    elif isinstance(obj, tuple):
        items = [snapshot(v, memo, storages) for v in obj]
        new = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        new = copy.deepcopy(obj)
    memo[id(obj)] = new
    return new


class BackgroundSave:
    """One save's writes on a daemon thread; `wait` joins it and raises what the thread raised."""

    def __init__(self, work: Callable[[], None]):
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="async-save", daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 (handed to the main thread by wait)
            self.error = err

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


_IN_FLIGHT: Dict[str, Optional[BackgroundSave]] = {"save": None}  # this process's unfinished save


def _wait_previous() -> bool:
    """Wait for this process's save in flight, if any (its error is raised once); True if there was one."""
    pending, _IN_FLIGHT["save"] = _IN_FLIGHT["save"], None
    if pending is not None:
        pending.wait()
    return pending is not None


def wait_for_saves() -> None:
    """Collective, before the process exits: this rank's asynchronous save is written (on rank 0, published),
    then a barrier, so on return `latest` names the last checkpoint on every rank. A no-op without one."""
    if _wait_previous():
        dist.barrier()


def save_async(engine, save_dir: str, tag: str, client_state: Dict[str, Any],
               write_args: Optional[Callable[[str], None]], timeout_s: float) -> None:
    """Collective: DeepSpeed's save with the writes queued; returns once they are handed to the thread.
    `write_args(folder)` (rank 0's: megatron_args.json) runs on the main thread after DeepSpeed's save;
    rank 0's thread waits up to `timeout_s` (--distributed-timeout-minutes) for each other rank's files."""
    _wait_previous()
    rank, world, folder = dist.get_rank(), dist.get_world_size(), os.path.join(save_dir, tag)
    _clear_stale(folder, rank)
    files = files_of(engine)
    with files.recorded(snapshot) as writes:  # each file's host copy, for the thread
        engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    write = files.save  # the real writer, for the thread
    what, outcome = f"checkpoint {tag}", not_published(save_dir, tag)
    needed = _total_bytes(writes)
    agree_space(save_dir, needed, what, outcome)
    if write_args is not None:
        with writing(folder, needed, what, outcome):
            write_args(folder)

    def work() -> None:
        _write_files(write, writes, folder, rank, (needed, what, outcome))
        if rank == 0:
            _publish(save_dir, tag, world, timeout_s)
    _IN_FLIGHT["save"] = BackgroundSave(work)


def _total_bytes(writes: List[Tuple[str, Any]]) -> int:
    """Collective: the bytes every rank's recorded files hold together (about the checkpoint's size)."""
    from tds import device as tds_device
    total = torch.tensor([sum(tensor_bytes(state) for _, state in writes)], dtype=torch.int64,
                         device=tds_device.device())
    if dist.get_world_size() > 1:
        dist.all_reduce(total)
    return int(total[0])


def _clear_stale(folder: str, rank: int) -> None:
    """Before DeepSpeed's first barrier: remove what a killed earlier save of this tag left for this rank."""
    stale = [os.path.join(folder, name.format(rank=rank)) for name in (DONE, FAILED)]
    for path in stale + ([os.path.join(folder, MANIFEST)] if rank == 0 else []):
        if os.path.exists(path):
            os.remove(path)


def _write_json(path: str, content: Dict[str, Any]) -> None:
    """Atomically: a reader sees the whole marker or none."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_files(write: Callable[[Any, str], None], writes: List[Tuple[str, Any]], folder: str, rank: int,
                 space: Tuple[int, str, str]) -> None:
    """This rank's files, fsynced, then its marker; on failure .failed.<rank>.json and AsyncSaveError (a full
    file system: the line of `space.disk_full_error`, `space` = (bytes needed, what, outcome))."""
    marker = os.path.join(folder, DONE.format(rank=rank))
    path = marker
    try:
        for path, state in writes:
            write(state, path)
            _fsync(path)
        path = marker
        _write_json(marker, {"files": entries(folder, [os.path.basename(p) for p, _ in writes])})
    except Exception as err:  # noqa: BLE001 (whatever the write raised, this file is not saved)
        message = (f"asynchronous save of {path} failed ({type(err).__name__}: {one_line(err)[:200]}); the "
                   f"checkpoint {folder} is not published and `latest` names the previous one")
        if is_disk_full(err, path):
            with contextlib.suppress(OSError):
                os.remove(path)  # the partial file: its space back
            message = str(disk_full_error(path, *space))
        with contextlib.suppress(OSError):  # the folder itself may be what cannot be written
            _write_json(os.path.join(folder, FAILED.format(rank=rank)), {"error": message})
        raise AsyncSaveError(message) from None


def _await_marker(folder: str, rank: int, deadline: float, timeout_s: float) -> Dict[str, Dict[str, Any]]:
    """Rank `rank`'s file entries once its marker exists; AsyncSaveError when it failed or is not done by
    `deadline` (time.monotonic)."""
    done, failed = (os.path.join(folder, name.format(rank=rank)) for name in (DONE, FAILED))
    while not os.path.exists(done):
        if os.path.exists(failed):
            with open(failed) as f:
                raise AsyncSaveError(f"rank {rank}: {json.load(f)['error']}")
        if time.monotonic() > deadline:
            raise AsyncSaveError(f"rank {rank} did not finish its files of {folder} ({done} missing after "
                                 f"{timeout_s:.0f} s, --distributed-timeout-minutes); the checkpoint is not "
                                 f"published")
        time.sleep(POLL_S)
    with open(done) as f:
        return json.load(f)["files"]


def _publish(save_dir: str, tag: str, world: int, timeout_s: float) -> None:
    """Rank 0's thread: the manifest once every rank's files are complete, then `latest`, then no markers."""
    folder, deadline = os.path.join(save_dir, tag), time.monotonic() + timeout_s
    files: Dict[str, Dict[str, Any]] = {}
    for rank in range(world):
        files.update(_await_marker(folder, rank, deadline, timeout_s))
    try:
        files.update(entries(folder, sorted(set(saved_files(folder)) - set(files))))
        write_manifest(folder, files)
        publish_latest(save_dir, tag)
        for rank in range(world):
            os.remove(os.path.join(folder, DONE.format(rank=rank)))
    except OSError as err:  # its message names the file
        raise AsyncSaveError(f"asynchronous save: publishing {folder} failed ({type(err).__name__}: "
                             f"{one_line(err)[:200]})") from None
    print_rank_0(f"saved checkpoint {folder} (written in the background)")
