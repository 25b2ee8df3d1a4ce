"""Checkpoint files on disk: names, `latest`, the saved arguments and manifest.json, atomic outputs (checked for
space: `space.py`); one-line errors naming the file (reading the .pt files: `reading.py`).

One folder per tag under the checkpoint directory (DeepSpeed's layout, for every (tp, pp, dp), pp = 1 included):

    <dir>/latest                                     the tag `--load` picks, e.g. "iter_0000200"
    <dir>/<tag>/megatron_args.json                   resolved arguments: model shape, layout, precision, tokenizer
    <dir>/<tag>/layer_LL-model_TT-model_states.pt    weights of pipeline layer LL (global index), tp rank TT
    <dir>/<tag>/mp_rank_MM_model_states.pt           engine state of model-parallel rank MM = pp_rank * tp + tp_rank:
                                                     LR scheduler, steps, client state, stage-0 optimizer
    <dir>/<tag>/[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   optimizer partition of data-parallel rank D
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import zlib
from typing import Any, Dict, Iterable, Iterator, Optional

from megatron.errors import UserError

LATEST = "latest"
MANIFEST = "manifest.json"
# megatron_args.json: fields every checkpoint has, and the file paths a user may edit (files moved)
REQUIRED_ARGS = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "tensor_model_parallel_size",
                 "pipe_parallel_size", "data_parallel_size")
EDITABLE_ARGS = ("vocab_file", "merge_file", "tokenizer_model", "data_path", "save", "load", "tensorboard_dir",
                 "deepspeed_config", "pretrained_checkpoint")
TAG_CHARACTERS = re.compile(r"[A-Za-z0-9_.+-]+")  # a folder name: no separator, space or control character
ARGS_FILE = "megatron_args.json"


class CheckpointMismatchError(UserError):
    """The checkpoint does not fit the run (shape, layout); the message names the field and both values."""


class CheckpointFileError(UserError):
    """A checkpoint file or folder is missing, truncated or not a checkpoint of this project."""


class UntrustedCheckpointError(UserError):
    """A checkpoint file whose pickle names a global outside the allowlist (tds/safe_load.py); nothing ran."""


def checkpoint_tag(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def layer_file(layer: int, tp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def mp_rank_file(mp_rank: int) -> str:
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def zero_file(dp_rank: int, mp_rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def read_latest(load_dir: str) -> Optional[str]:
    """The tag `latest` names, or None when `load_dir` has no published checkpoint; CheckpointFileError naming
    the file when it holds no tag (empty, not text, a path rather than a folder name)."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = None
    if not tag or not TAG_CHARACTERS.fullmatch(tag) or tag in (".", ".."):
        raise CheckpointFileError(f"{path} holds {raw[:40]!r}, not the name of a checkpoint folder (such as "
                                  f"iter_0000200): the file is damaged; write the tag to load into it, or pass "
                                  f"--ckpt-step N (the tools: --tag)")
    return tag


def not_published(save_dir: str, tag: str) -> str:
    """What a save of `tag` that fails leaves (synchronous or asynchronous): `latest` as it was."""
    previous = read_latest(save_dir)
    where = f"`latest` still names {previous}" if previous else f"{save_dir} has no published checkpoint yet"
    return f"nothing was published ({where}; the incomplete {os.path.join(save_dir, tag)} can be deleted)"


def publish_latest(save_dir: str, tag: str) -> None:
    """Atomically point `latest` at `tag` (a reader sees the old or the new name, never a partial one)."""
    tmp = os.path.join(save_dir, f".{LATEST}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, LATEST))


def checkpoint_folder(load_dir: str, tag: Optional[str] = None) -> str:
    """<load_dir>/<tag>, the tag defaulting to `latest`; CheckpointFileError naming what is missing.

    `load_dir` may also be a tag folder itself (one holding megatron_args.json)."""
    if tag is None and os.path.isfile(os.path.join(load_dir, ARGS_FILE)):
        return load_dir
    if not os.path.isdir(load_dir):
        raise CheckpointFileError(f"checkpoint directory {load_dir} does not exist")
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            raise CheckpointFileError(f"{load_dir} has no '{LATEST}' file naming a checkpoint; pass a tag folder "
                                      f"such as {load_dir}/iter_0000100 or a directory written with --save")
        where = f"{os.path.join(load_dir, LATEST)} names {tag!r}, but"
    else:
        where = f"tag {tag!r}:"
    folder = os.path.join(load_dir, tag)
    if not os.path.isdir(folder):
        raise CheckpointFileError(f"{where} folder {folder} does not exist; point {LATEST} at an existing tag")
    return folder


def read_manifest(folder: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """manifest.json's name -> {bytes, crc32[, settings_crc32]}; None for a folder saved before manifests.
    ValueError if it is not one (ManifestError: valid JSON that is not a manifest of its format; manifest.py's
    checks report it, naming the file)."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        content = json.loads(f.read().decode("utf-8"), object_pairs_hook=_unique_keys)  # UnicodeDecodeError too
    check_manifest(content)
    return content["files"]


class ManifestError(ValueError):
    """manifest.json parses but is not a manifest of the format it names (a key missing, unknown or twice)."""


# Each format's keys. Format 1 listed {bytes, crc32} per file; the entry of megatron_args.json later gained
# settings_crc32 without a new format, so a format-1 manifest may lack it. Format 2 (written since) must have it:
# a manifest whose format says it has a key and lacks it, or has a key no format has, turns a check off.
MANIFEST_FORMATS = (1, 2)
MANIFEST_KEYS = ("format", "checksum", "files")
ENTRY_KEYS = ("bytes", "crc32")
ARGS_ENTRY_KEYS = ("bytes", "crc32", "settings_crc32")


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        raise ManifestError(f"the key {twice!r} appears twice")
    return dict(pairs)


def _check_keys(obj: Any, required: Iterable[str], allowed: Iterable[str], where: str, fmt: int) -> None:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where} is a JSON {type(obj).__name__}, not an object")
    unknown = [k for k in obj if k not in allowed]
    if unknown:
        raise ManifestError(f"{where} has the unknown key {unknown[0]!r} (format {fmt}: {', '.join(allowed)})")
    missing = [k for k in required if k not in obj]
    if missing:
        raise ManifestError(f"{where} lacks {missing[0]!r}, which format {fmt} has")


def check_manifest(content: Any) -> None:
    """ManifestError naming the first key that `content` lacks, has twice or should not have for its format,
    or a value of the wrong type."""
    fmt = content.get("format") if isinstance(content, dict) else None
    if type(fmt) is not int or fmt not in MANIFEST_FORMATS:
        raise ManifestError(f"format {fmt!r}: this version reads formats {' and '.join(map(str, MANIFEST_FORMATS))}")
    _check_keys(content, MANIFEST_KEYS, MANIFEST_KEYS, "the manifest", fmt)
    if content["checksum"] != "crc32":
        raise ManifestError(f"checksum {content['checksum']!r}, expected 'crc32'")
    files = content["files"]
    if not isinstance(files, dict):
        raise ManifestError(f"'files' is a JSON {type(files).__name__}, not an object")
    if fmt >= 2 and ARGS_FILE not in files:
        raise ManifestError(f"'files' has no entry for {ARGS_FILE}, which format {fmt} lists")
    for name, entry in files.items():
        allowed = ARGS_ENTRY_KEYS if name == ARGS_FILE else ENTRY_KEYS
        _check_keys(entry, allowed if fmt >= 2 else ENTRY_KEYS, allowed, f"the entry of {name}", fmt)
        if not isinstance(entry["bytes"], int) or isinstance(entry["bytes"], bool) or entry["bytes"] < 0:
            raise ManifestError(f"the entry of {name} has bytes {entry['bytes']!r}, not a size")
        for key in ("crc32", "settings_crc32"):
            if key in entry and not (isinstance(entry[key], str) and re.fullmatch(r"[0-9a-f]{8}", entry[key])):
                raise ManifestError(f"the entry of {name} has {key} {entry[key]!r}, not 8 hex digits")


def settings_crc32(args: Dict[str, Any]) -> str:
    """CRC-32 of the saved arguments without the fields a user may edit (file paths: moved tokenizer files)."""
    settings = {k: v for k, v in args.items() if k not in EDITABLE_ARGS}
    return f"{zlib.crc32(json.dumps(settings, sort_keys=True).encode()):08x}"


def read_args(folder: str) -> Dict[str, Any]:
    """The resolved arguments saved with the checkpoint in `folder`; CheckpointFileError naming the file when
    it is not the JSON object a save writes, lacks a field every checkpoint has, or (its manifest lists the
    settings' CRC-32) was changed after the save in anything but its file paths."""
    path = os.path.join(folder, ARGS_FILE)
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path} is missing: {folder} was not written by this project's save "
                                  f"(every checkpoint folder holds the {ARGS_FILE} of its run)")
    try:
        with open(path, "rb") as f:
            args = json.loads(f.read().decode("utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointFileError(f"{path} is not valid JSON ({type(err).__name__}: {str(err)[:100]}); the "
                                  f"checkpoint is damaged") from None
    missing = [k for k in REQUIRED_ARGS if not isinstance(args, dict) or k not in args]
    if missing:
        raise CheckpointFileError(f"{path} has no {missing[0]!r}: not the arguments of a checkpoint of this project "
                                  f"(the file is damaged)")
    try:
        listed = (read_manifest(folder) or {}).get(ARGS_FILE, {}).get("settings_crc32")
    except ValueError:
        listed = None  # a damaged manifest is reported by manifest.check_files
    if listed is not None and settings_crc32(args) != listed:
        raise CheckpointFileError(f"{path} was changed after the save in more than its file paths (the CRC-32 of "
                                  f"its other fields is {settings_crc32(args)} where {MANIFEST} lists {listed}): the "
                                  f"file is damaged; only {', '.join(EDITABLE_ARGS)} may be edited")
    return args


def write_args(folder: str, args: Dict[str, Any]) -> None:
    with open(os.path.join(folder, ARGS_FILE), "w") as f:
        json.dump(args, f, indent=1, sort_keys=True)


def read_json(path: str) -> Dict[str, Any]:
    """A JSON object from `path` (a Hugging Face config.json, a tokenizer file); UserError naming the file when it
    is not one (damaged, cut short)."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{path} is not valid JSON ({type(err).__name__}: {str(err)[:120]}); the file is damaged "
                        f"or cut short") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a JSON {type(obj).__name__}, not an object")
    return obj


def write_json(path: str, obj: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def folder_bytes(folder: str, names: Optional[Iterable[str]] = None) -> int:
    """Total size of the files in `folder` (or of its files `names`, a listing the caller already has)."""
    return sum(os.path.getsize(os.path.join(folder, f)) for f in (os.listdir(folder) if names is None else names))


@contextlib.contextmanager
def atomic_folder(final: str, needed: Optional[int] = None) -> Iterator[str]:
    """Yield a temporary sibling folder to write into; it becomes `final` only when the block completes.

    Refuses to overwrite an existing `final`. On any error the temporary folder is removed. `needed` (bytes,
    an estimate of the output's size): refused before anything is written when the file system has less
    free; a write that fails for space is one line naming `final` (space.DiskFullError)."""
    if os.path.exists(final):
        raise UserError(f"output {final} already exists; choose a new directory (outputs are never overwritten)")
    parent = os.path.dirname(os.path.abspath(final)) or "."
    outcome = f"nothing was written to {final} (the partial output was removed)"
    from .space import check_space, writing  # torch: imported where a folder is written, not where one is read
    check_space(final, needed or 0, "the output", outcome)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(final)}.tmp.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(final, needed, "the output", outcome):
            os.makedirs(tmp)
            yield tmp
            os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def new_checkpoint(save_dir: str, tag: str, needed: int) -> Iterator[str]:
    """The one writer of a new checkpoint directory (reshape, import-hf, import-megatron): `save_dir` is created
    atomically (`atomic_folder`) holding the folder `tag`, which is yielded to write into, and `latest` names it
    once the block completes; refused before anything is written where the file system has less than `needed`
    bytes free."""
    with atomic_folder(save_dir, needed) as tmp:
        folder = os.path.join(tmp, tag)
        os.makedirs(folder)
        yield folder
        publish_latest(tmp, tag)


SHOW_PROGRESS = {"on": False}  # the command-line tools turn it on; training loads stay quiet
FEW_FILES = 8


def show_progress(on: bool = True) -> None:
    SHOW_PROGRESS["on"] = on


def progress(items: Iterable, total: int, desc: str) -> Iterable:
    """When enabled and more than a few files: a tqdm bar on a terminal, a counter line per 10% otherwise."""
    if not SHOW_PROGRESS["on"] or total <= FEW_FILES:
        return items
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
            return tqdm(items, total=total, desc=desc, unit="file", leave=False)
        except ImportError:
            pass
    return _counter(items, total, desc)


def _counter(items: Iterable, total: int, desc: str) -> Iterator:
    step = max(1, total // 10)
    for i, item in enumerate(items, 1):
        yield item
        if i % step == 0 or i == total:
            print(f"{desc}: {i}/{total} files", file=sys.stderr, flush=True)
