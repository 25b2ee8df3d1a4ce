"""Reading checkpoint files: torch.load through the allowlist, each file checked against manifest.json's CRC-32.

    load_file(path)           tds.safe_load (weights_only=True, the allowlist) with one-line errors; when the
                              file's folder has a manifest.json listing it, its CRC-32 is computed while the
                              file is read (`read_verified`) and a mismatch is refused before the result is used
    read_verified(path, read) the same check around any reader (DeepSpeed's engine reads through it on --load)

The CRC-32 runs on a thread beside the read (zlib releases the GIL; the file is hashed through a memory map,
from the page cache the read fills): with a core to spare a load costs little more than the read itself; on
busy cores the hash's own CPU time (bench/checkpoint_manifest.py measures the ratio). A mismatch names the file,
what it holds, both checksums and the newest checkpoint of the directory whose files all match their manifest
(`newest_verified`). megatron_args.json is not checked here: its paths may be edited (moved tokenizer files),
and `files.read_args` checks the CRC-32 of its other fields.
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import re
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, TypeVar

from tds.safe_load import UnsafeCheckpointError, load as safe_load
from .files import MANIFEST, ARGS_FILE, CheckpointFileError, UntrustedCheckpointError, read_args, read_manifest

CHUNK = 16 << 20
TAG = re.compile(r"iter_(\d+)$")
T = TypeVar("T")


class ChecksumError(CheckpointFileError):
    """A checkpoint file whose bytes differ from what manifest.json recorded at the save."""


def crc32(path: str) -> str:
    """The file's CRC-32 (hex), read through a memory map (no copy into a buffer)."""
    value = 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return f"{value:08x}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start in range(0, size, CHUNK):
                    value = zlib.crc32(view[start:start + CHUNK], value)
            finally:
                view.release()
    return f"{value:08x}"


_LISTED: Dict[str, Tuple[Tuple[int, int, int], Optional[Dict[str, Dict[str, Any]]]]] = {}
_LISTED_LOCK = threading.Lock()


def listed_crc(path: str) -> Optional[str]:
    """The CRC-32 the manifest beside `path` lists for it; None without a (valid) manifest or entry, and for
    megatron_args.json. The manifest is parsed once per version of it (its inode, size and mtime)."""
    folder, name = os.path.split(os.path.abspath(path))
    if name == ARGS_FILE:
        return None
    try:
        st = os.stat(os.path.join(folder, MANIFEST))
    except OSError:
        return None
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    with _LISTED_LOCK:
        cached = _LISTED.get(folder)
    if cached is None or cached[0] != stamp:
        try:
            files = read_manifest(folder)
        except (OSError, ValueError):
            files = None  # a damaged manifest is reported by manifest.check_files before any read
        cached = (stamp, files)
        with _LISTED_LOCK:
            _LISTED[folder] = cached
    entry = (cached[1] or {}).get(name)
    return None if entry is None else entry["crc32"]


class _Hashing:
    """crc32(path) on a daemon thread."""

    def __init__(self, path: str):
        self.path, self.value, self.error = path, None, None
        self.thread = threading.Thread(target=self._run, name="crc32", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.value = crc32(self.path)
        except OSError as err:
            self.error = err

    def result(self) -> Optional[str]:
        self.thread.join()
        return self.value


def read_verified(path: str, read: Callable[[], T], beside: bool = True) -> T:
    """`read()` (which reads `path`), with the file's CRC-32 computed beside it (`beside`; else only when
    `read` fails) and compared with the manifest's entry; ChecksumError on a mismatch, also when `read` itself
    failed on the damaged bytes."""
    expected = listed_crc(path)
    if expected is None:
        return read()
    hashing = _Hashing(path) if beside else None
    try:
        out = read()
    except BaseException:
        actual = (hashing or _Hashing(path)).result()
        if actual is not None and actual != expected:
            raise checksum_error(path, actual, expected) from None
        raise
    actual = hashing.result() if hashing else expected
    if actual is not None and actual != expected:
        raise checksum_error(path, actual, expected)
    return out


def load_file(path: str, mmap: bool = True, allow: Optional[Dict[str, Any]] = None,
              stub_modules: Iterable[str] = (), verify: bool = True) -> Any:
    """torch.load of a checkpoint file on CPU with weights_only=True and an allowlist (`tds.safe_load`: the
    globals this project's files hold, or `allow`; `stub_modules` for files of other code bases);
    CheckpointFileError naming the file if missing, truncated or (a folder with a manifest) not the bytes the
    save wrote (`verify=False`: checked only when the read fails; metadata reads); UntrustedCheckpointError naming it and the global its pickle would call
    (--trust-checkpoint is the opt-in for a trusted legacy file).

    mmap=True maps the tensors' storage instead of reading it (only what is used is read; `verify` still
    hashes the whole file)."""
    if not os.path.isfile(path):
        raise CheckpointFileError(f"checkpoint file {path} is missing; the checkpoint is incomplete (was the run "
                                  f"killed while saving?) or was written at another layout than its "
                                  f"{ARGS_FILE} says")

    def read() -> Any:
        try:
            return safe_load(path, map_location="cpu", mmap=mmap, allow=allow, stub_modules=stub_modules)
        except UnsafeCheckpointError as err:
            raise UntrustedCheckpointError(str(err)) from None
        except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, KeyError, ValueError,
                IndexError, TypeError, AttributeError, OverflowError, MemoryError, UnicodeDecodeError) as err:
            if isinstance(err, CheckpointFileError):
                raise
            size = os.path.getsize(path)
            detail = " | ".join(str(err).split("\n"))[:120]
            raise CheckpointFileError(f"checkpoint file {path} ({size} bytes) cannot be read, it is truncated or "
                                      f"damaged ({type(err).__name__}: {detail})") from None
    return read_verified(path, read, beside=verify)


def role(name: str, tp: int) -> str:
    """What the file `name` holds, from its name and the saved tensor-parallel size."""
    numbers = [int(x) for x in re.findall(r"\d+", name)]
    if name.startswith("layer_") and len(numbers) >= 2:
        return f"weights of pipeline layer {numbers[0]}, tp rank {numbers[1]}"
    if name.startswith("mp_rank_") and numbers:
        return f"engine state of pipeline stage {numbers[0] // tp}, tp rank {numbers[0] % tp}: LR scheduler, " \
               f"steps, client state, RNG"
    if "zero_pp_rank_" in name and len(numbers) >= 2:
        dp, mp = numbers[-2], numbers[-1]
        return f"optimizer partition of dp rank {dp}, pipeline stage {mp // tp}, tp rank {mp % tp}"
    if name == MANIFEST:
        return "the size and CRC-32 of every file of the save"
    return "the run's resolved arguments" if name == ARGS_FILE else "a file of the save"


def saved_tp(folder: str) -> int:
    """The checkpoint's tensor-parallel size, for naming its files (1 when its arguments cannot be read)."""
    try:
        return int(read_args(folder).get("tensor_model_parallel_size", 1))
    except (CheckpointFileError, AttributeError, TypeError, ValueError):
        return 1


def iteration_tags(load_dir: str) -> List[Tuple[int, str]]:
    """(iteration, tag) of the tag folders in `load_dir`, newest first."""
    names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
    return sorted(((int(m.group(1)), n) for n in names
                   if (m := TAG.match(n)) and os.path.isdir(os.path.join(load_dir, n))), reverse=True)


def verifies(folder: str) -> bool:
    """Every file manifest.json lists is there with its size and CRC-32 (megatron_args.json: present)."""
    try:
        listed = read_manifest(folder)
    except (OSError, ValueError):
        return False
    if listed is None:
        return False
    paths = {n: os.path.join(folder, n) for n in listed}
    try:
        if any(os.path.getsize(p) != listed[n]["bytes"] for n, p in paths.items() if n != ARGS_FILE):
            return False
    except OSError:
        return False
    others = [n for n in listed if n != ARGS_FILE]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        try:
            return all(a == listed[n]["crc32"] for n, a in zip(others, pool.map(crc32, [paths[n] for n in others])))
        except OSError:
            return False


def newest_where(load_dir: str, skip: str, good: Callable[[str], bool]) -> Optional[Tuple[int, str]]:
    """(iteration, tag) of the newest tag folder of `load_dir`, other than `skip`, for which `good(folder)`."""
    for iteration, tag in iteration_tags(load_dir):
        folder = os.path.join(load_dir, tag)
        if os.path.realpath(folder) != os.path.realpath(skip) and good(folder):
            return iteration, tag
    return None


def newest_verified(load_dir: str, skip: str) -> Optional[Tuple[int, str]]:
    """The newest folder of `load_dir` other than `skip` whose files match its manifest."""
    return newest_where(load_dir, skip, verifies)


def load_hint(load_dir: str, other: Optional[Tuple[int, str]], what: str = "complete") -> str:
    """What to load instead: the iteration `other` names, or that there is none."""
    if other is not None:
        return (f"the newest {what} checkpoint in {load_dir} is iteration {other[0]}: load it with --ckpt-step "
                f"{other[0]} (the tools: --tag {other[1]})")
    return (f"{load_dir} holds no other {what} checkpoint: restore the file, or start over with another "
            f"--save/--load directory")


def checksum_error(path: str, actual: str, expected: str) -> ChecksumError:
    """The one line for a file whose CRC-32 is not the manifest's, with the newest checkpoint that verifies."""
    folder, name = os.path.split(os.path.abspath(path))
    load_dir = os.path.dirname(folder)
    hint = load_hint(load_dir, newest_verified(load_dir, folder), "verified")
    return ChecksumError(f"checkpoint file {os.path.join(folder, name)} ({role(name, saved_tp(folder))}) is "
                         f"damaged: CRC-32 {actual} where {MANIFEST} lists {expected} (its bytes changed after the "
                         f"save: a bad disk or copy); {hint}")
