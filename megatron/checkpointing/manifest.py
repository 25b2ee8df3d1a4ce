"""manifest.json: every file a save wrote, with its size and CRC-32, written last; the checks that use it.

    <dir>/<tag>/manifest.json   {"format": 2, "checksum": "crc32", "files": {name: {"bytes": n, "crc32": "08x"}}}
                                (megatron_args.json's entry also has "settings_crc32"; the formats: files.py)

A save writes every file, then the manifest (`save_manifest`: each rank hashes a share of the files, rank 0
writes it atomically), then `latest`; so a folder with a manifest is complete. Before a load reads any file,
`check_files` stats every file it will read: present, readable, of the listed size (megatron_args.json,
parsed anyway, may be edited: moved tokenizer files). A folder saved before the
manifest existed gets what can be checked without one: the files its megatron_args.json implies are present,
and each torch file (a zip archive) ends with its end-of-central-directory record, which a truncated file
lacks. `verify_checksums` (`tools/convert_checkpoint.py inspect --verify`) reads every file and compares its
CRC-32. A failure is one `CheckpointFileError` naming the file, what it holds and the newest complete
iteration of the directory, to load with --ckpt-step N.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .consolidated import has_engine_state, has_optimizer, layout_of
from .files import (ARGS_FILE, MANIFEST_FORMATS, CheckpointFileError, ManifestError, checkpoint_folder, layer_file,
                    mp_rank_file, read_args, settings_crc32, zero_file)
from .names import ModelTable, plain_pp1
from .optim import optimizer_kind
from .reading import MANIFEST, checksum_error, crc32, load_hint, newest_where, read_manifest, role
from megatron.errors import UserError

ZIP_END = b"PK\x05\x06"  # end-of-central-directory record: the last 22 bytes of a zip without a comment
ZIP_START = b"PK\x03\x04"
# what a load reads: a file serves one part (megatron_args.json and the manifest serve every load)
WEIGHTS, ENGINE, OPTIMIZER = "weights", "engine", "optimizer"
EVERY_PART = (WEIGHTS, ENGINE, OPTIMIZER)
Problem = Tuple[str, str]  # (file name, what is wrong with it)


def saved_files(folder: str) -> List[str]:
    """The files of a tag folder that a manifest lists: all but itself and temporary (hidden) files."""
    return sorted(n for n in os.listdir(folder) if n != MANIFEST and not n.startswith(".")
                  and os.path.isfile(os.path.join(folder, n)))


def entries(folder: str, names: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """name -> {bytes, crc32}; megatron_args.json also gets the CRC-32 of its settings (`files.settings_crc32`:
    every field but the file paths), so that an edit of its paths passes and any other change does not."""
    out = {n: {"bytes": os.path.getsize(os.path.join(folder, n)), "crc32": crc32(os.path.join(folder, n))}
           for n in names}
    if ARGS_FILE in out:
        with open(os.path.join(folder, ARGS_FILE)) as f:
            out[ARGS_FILE]["settings_crc32"] = settings_crc32(json.load(f))
    return out


def write_manifest(folder: str, files: Optional[Dict[str, Dict[str, Any]]] = None) -> None:
    """Write manifest.json atomically (every file of the folder hashed here unless `files` is given)."""
    files = entries(folder, saved_files(folder)) if files is None else files
    tmp = os.path.join(folder, f".{MANIFEST}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"format": MANIFEST_FORMATS[-1], "checksum": "crc32", "files": dict(sorted(files.items()))}, f,
                  indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))


def save_manifest(folder: str) -> None:
    """Collective, once every rank's files are complete: rank r hashes files r, r + world, ...; rank 0 writes."""
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    shares = [None] * world if rank == 0 else None
    dist.gather_object(entries(folder, saved_files(folder)[rank::world]), shares, dst=0)
    if rank == 0:
        write_manifest(folder, {name: entry for share in shares for name, entry in share.items()})


def part_of(name: str, saved: Dict[str, Any]) -> Optional[str]:
    """The part of a load that reads `name`; None for a file every load reads."""
    if name.startswith("layer_") or (name.startswith("mp_rank_") and plain_pp1(saved)):
        return WEIGHTS  # the earlier pp = 1 layout kept the weights in the mp_rank files
    if name.startswith("mp_rank_"):
        return ENGINE
    return OPTIMIZER if name.endswith("optim_states.pt") else None


def expected_files(folder: str, saved: Dict[str, Any]) -> List[str]:
    """The files a save of these arguments writes (for folders saved before manifests). pp = 1 checkpoints
    of earlier layouts, without any layer file, keep the weights in the mp_rank files (`read_weights`)."""
    tp, pp, dp = layout_of(saved)
    names = []
    if not plain_pp1(saved) and any(n.startswith("layer_") for n in os.listdir(folder)):
        table = ModelTable(saved)
        names += [layer_file(layer, t) for layer in range(len(table.specs)) if table.layer_params(layer)
                  for t in range(tp)]
    if has_engine_state(saved) or plain_pp1(saved):
        names += [mp_rank_file(mp) for mp in range(pp * tp)]
    kind = optimizer_kind(saved) if has_optimizer(saved) else None
    if kind in ("zero", "bf16"):
        dps = range(dp) if kind == "zero" else range(1)
        names += [zero_file(d, mp, bool(saved.get("bf16"))) for mp in range(pp * tp) for d in dps]
    return names


def _stat_problem(path: str, size: Optional[int]) -> Optional[str]:
    """What is wrong with `path` at a glance: missing, unreadable, not the listed size."""
    if not os.path.isfile(path):
        return "missing"
    if not os.access(path, os.R_OK):
        return "unreadable (no read permission)"
    actual = os.path.getsize(path)
    if size is not None and actual < size:
        return f"truncated: {actual} of the {size} bytes {MANIFEST} lists"
    if size is not None and actual != size:
        return f"{actual} bytes where {MANIFEST} lists {size}"
    return None


def _zip_problem(path: str) -> Optional[str]:
    """A torch zip archive without its end record is truncated (pre-manifest folders: the size is unknown)."""
    with open(path, "rb") as f:
        start = f.read(4)
        f.seek(max(0, os.path.getsize(path) - 22))
        end = f.read(4)
    if start == ZIP_START and end != ZIP_END:
        return f"truncated: {os.path.getsize(path)} bytes without the zip end record (saved before {MANIFEST}, " \
               f"so its size is not listed)"
    return None


def first_problem(folder: str, saved: Dict[str, Any], parts: Sequence[str] = EVERY_PART) -> Optional[Problem]:
    """The first file a load of `parts` would read that is missing, unreadable or of the wrong size, or that
    the folder's manifest does not list (its entry lost: the file would be read unchecked)."""
    try:
        listed = read_manifest(folder)
    except ManifestError as err:
        return MANIFEST, f"not a valid manifest: {err}"
    except (ValueError, OSError) as err:  # json's and utf-8's errors are ValueErrors
        return MANIFEST, f"damaged ({type(err).__name__}: {str(err)[:120]})"
    unlisted = [n for n in saved_files(folder) if listed is not None and n not in listed and n.endswith(".pt")
                and part_of(n, saved) in parts]
    if unlisted:
        return MANIFEST, f"damaged: it does not list {unlisted[0]}, which the load reads (an entry lost)"
    sizes = {n: e["bytes"] for n, e in listed.items()} if listed is not None else \
        dict.fromkeys(expected_files(folder, saved))
    for name, size in sizes.items():
        if name == ARGS_FILE or part_of(name, saved) not in (None, *parts):
            continue  # megatron_args.json was parsed already; it may have been edited (moved tokenizer files)
        path = os.path.join(folder, name)
        what = _stat_problem(path, size) or (_zip_problem(path) if listed is None else None)
        if what == "missing" and listed is not None:
            what = f"missing ({MANIFEST} lists it)"
        if what:
            return name, what
    return None


def _complete(folder: str) -> bool:
    try:
        return first_problem(folder, read_args(folder)) is None
    except (UserError, KeyError, ValueError):
        return False  # not a checkpoint of this project


def newest_complete(load_dir: str, skip: str) -> Optional[Tuple[int, str]]:
    """The newest folder of `load_dir`, other than `skip`, that passes `first_problem`."""
    return newest_where(load_dir, skip, _complete)


def damaged_error(folder: str, name: str, what: str, saved: Optional[Dict[str, Any]] = None) -> CheckpointFileError:
    """The one-line error for file `name` of `folder`: where, what it holds, what is wrong, what to load."""
    tp = layout_of(saved)[0] if saved else 1
    load_dir = os.path.dirname(os.path.abspath(folder))
    hint = load_hint(load_dir, newest_complete(load_dir, folder))
    return CheckpointFileError(f"checkpoint file {os.path.join(folder, name)} ({role(name, tp)}) is {what}; {hint}")


def check_files(folder: str, saved: Dict[str, Any], parts: Sequence[str] = EVERY_PART) -> None:
    """Before a load of `parts` reads anything: CheckpointFileError for the first bad file (see first_problem)."""
    problem = first_problem(folder, saved, parts)
    if problem is not None:
        raise damaged_error(folder, *problem, saved)


def parts_read(optimizer: bool) -> Tuple[str, ...]:
    """What a load of weights and engine state reads, with or without the optimizer state."""
    return (WEIGHTS, ENGINE, OPTIMIZER) if optimizer else (WEIGHTS, ENGINE)


def checked_folder(load_dir: str, tag: Optional[str] = None, parts: Sequence[str] = EVERY_PART) -> str:
    """`checkpoint_folder`, once the files a load of `parts` reads have passed `check_files`."""
    folder = checkpoint_folder(load_dir, tag)
    check_files(folder, read_args(folder), parts)
    return folder


def verify_checksums(folder: str, saved: Dict[str, Any]) -> str:
    """Sizes, then every file's CRC-32 against the manifest; the line `inspect --verify` prints."""
    check_files(folder, saved)
    listed = read_manifest(folder)  # valid: check_files read it
    if listed is None:
        return (f"verified         {folder} has no {MANIFEST} (saved before manifests): every file present, each "
                f"ending with its zip end record; no checksums to compare")
    edited = ""
    for name, entry in listed.items():
        actual = crc32(os.path.join(folder, name))
        if actual != entry["crc32"] and name == ARGS_FILE:
            edited = f"; {ARGS_FILE} was edited after the save (its CRC-32 differs)"
        elif actual != entry["crc32"]:
            raise checksum_error(os.path.join(folder, name), actual, entry["crc32"])
    total = sum(e["bytes"] for e in listed.values())
    return f"verified         {len(listed)} files, {total / 1e6:.1f} MB: sizes and CRC-32 as {MANIFEST} lists{edited}"
