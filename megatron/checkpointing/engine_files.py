"""The project's checkpoint engine: the one object through which DeepSpeed's engine reads and writes every file of
a checkpoint (pipeline layer files, mp_rank engine state, ZeRO partitions): the engine's `checkpoint_engine`,
wrapping DeepSpeed's, given to the engine when training builds it (`tds.initialize(...,
checkpoint_engine_wrap=ProjectCheckpointEngine)`); `files_of(engine)` is it.

    reads     tds.safe_load's (weights_only=True and the allowlist: the wrapped SafeCheckpointEngine); within
              `verified(folder, saved)` each file is also checked against manifest.json's CRC-32 while it is
              read, and a file that cannot be read is one line naming it (`reading.damaged_error`)
    writes    DeepSpeed's; within `space_checked(what, outcome, needed)` a write that fails for space is a
              DiskFullError naming the file; within `recorded(copy)` nothing is written: each file's path and
              `copy(state)` are recorded (--async-save hands them to its writer thread)

The modes are the engine's own state, set and restored by context managers on every path; nothing of
DeepSpeed's is patched.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from megatron.errors import one_line
from tds.safe_load import UnsafeCheckpointError
from .files import CheckpointFileError, UntrustedCheckpointError
from .manifest import damaged_error
from .reading import read_verified
from .space import tensor_bytes, writing


class ProjectCheckpointEngine:
    """DeepSpeed's checkpoint engine `inner` with the project's checks (see the module docstring); every other
    attribute is `inner`'s."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._reads: Optional[Tuple[str, Dict[str, Any]]] = None     # (folder, saved arguments) being verified
        self._writes: Optional[Tuple[str, str, int]] = None           # (what, outcome, bytes needed)
        self._recorded: Optional[Tuple[List[Tuple[str, Any]], Callable[[Any], Any]]] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        def read():
            return self._inner.load(path, map_location=map_location)
        if self._reads is None:
            return read()
        folder, saved = self._reads
        try:
            return read_verified(path, read)
        except CheckpointFileError:
            raise
        except UnsafeCheckpointError as err:
            raise UntrustedCheckpointError(str(err)) from None
        except Exception as err:  # noqa: BLE001 (torch.load of one file: whatever it raises, the file is unreadable)
            what = f"unreadable ({type(err).__name__}: {one_line(err)[:120]})"
            raise damaged_error(folder, os.path.basename(path), what, saved) from None

    def save(self, state_dict: Any, path: str) -> None:
        if self._recorded is not None:
            files, copy = self._recorded
            files.append((path, copy(state_dict)))
            return
        if self._writes is None:
            self._inner.save(state_dict, path)
            return
        what, outcome, needed = self._writes
        with writing(path, needed or tensor_bytes(state_dict), what, outcome):
            self._inner.save(state_dict, path)

    @contextlib.contextmanager
    def verified(self, folder: str, saved: Dict[str, Any]) -> Iterator[None]:
        """Reads checked against the manifest of `folder` (whose arguments are `saved`)."""
        self._reads = (folder, saved)
        try:
            yield
        finally:
            self._reads = None

    @contextlib.contextmanager
    def space_checked(self, what: str, outcome: str, needed: int) -> Iterator[None]:
        """Writes whose failure for space names the file, `what` was saved and `outcome`."""
        self._writes = (what, outcome, needed)
        try:
            yield
        finally:
            self._writes = None

    @contextlib.contextmanager
    def recorded(self, copy: Callable[[Any], Any]) -> Iterator[List[Tuple[str, Any]]]:
        """Writes recorded as (path, copy(state)), in order, instead of written."""
        files: List[Tuple[str, Any]] = []
        self._recorded = (files, copy)
        try:
            yield files
        finally:
            self._recorded = None


def files_of(engine: Any) -> ProjectCheckpointEngine:
    """The engine's project checkpoint engine; TypeError for an engine built without it."""
    files = engine.checkpoint_engine
    if not isinstance(files, ProjectCheckpointEngine):
        raise TypeError(f"the engine's checkpoint engine is {type(files).__name__}, not the project's: build the "
                        f"engine with tds.initialize(..., checkpoint_engine_wrap=ProjectCheckpointEngine) "
                        f"(megatron.training.pretrain.setup_engine does)")
    return files
