"""What a command's result is, as the mutation campaign compares it with the unmutated run's.

    tokenizer_result(tokenizer, texts)   vocabulary size, every special id, the ids of each text (SentencePiece:
                                         and its pieces and scores)
    config_result(cfg)                   every field of the RunConfig (model, layout, batch, ..., the DeepSpeed
                                         dict, the resolved command line)
    folder_result(folder)                every file of a folder a command wrote, parsed by its owner's reader
    normalized(obj, folder)              the normalization rule (below)
    changes(a, b)                        [(path, old, new)] of every leaf that differs

The normalization rule, all of it: in every string of a result, the absolute path of the folder the command ran
in becomes "<case>". Nothing else is removed, rounded or ignored: no output holds a time (the campaign runs each
pristine command twice and requires equal results), and a manifest is compared by what it says of the files it
lists (each size and CRC-32 matches, the settings' CRC-32 matches megatron_args.json), since its numbers are a
function of those files.
"""
from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Mapping
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np
import torch

# the fixed text a tokenizer's ids are taken of: lines, unicode (accents, CJK, an emoji), runs of spaces and tabs
TEXT = ("The quick brown fox jumps over the lazy dog.\n"
        "  Two spaces,\tthen a tab;   three spaces.\n\n"
        "Ünïcödé: café, naïve, Straße, 日本語のテキスト, 🙂 and ½.\n"
        "Numbers 12345 and 3.14159; <|endoftext|> and <extra_id_0> are plain text here.\n"
        "      indented line\r\nwindows line end\n")
MISSING = "<missing>"  # a leaf that one side of a comparison does not have


def digest(obj: Any) -> Any:
    """A comparable summary of tensors, arrays and containers (CRC-32 of every tensor's bytes, with dtype and
    shape); dataclasses and mappings become dicts, tuples lists."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ["tensor", str(t.dtype), list(t.shape), zlib.crc32(data)]
    if isinstance(obj, np.ndarray):
        return ["array", str(obj.dtype), list(obj.shape), zlib.crc32(np.ascontiguousarray(obj).tobytes())]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: digest(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): digest(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [digest(v) for v in obj]
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    return repr(obj)


def normalized(obj: Any, folder: str) -> Any:
    """`obj` with the absolute path of `folder` replaced by "<case>" in every string."""
    root = os.path.abspath(folder)
    if isinstance(obj, str):
        return obj.replace(root, "<case>")
    if isinstance(obj, dict):
        return {k: normalized(v, folder) for k, v in obj.items()}
    if isinstance(obj, list):
        return [normalized(v, folder) for v in obj]
    return obj


# ---- what each command produces ---------------------------------------------------------------------------------

SPECIAL = ("eod", "eos", "pad", "bos", "unk", "cls", "sep", "mask")


def spm_pieces(processor) -> List[list]:
    """A SentencePiece model's pieces as its processor holds them: [piece, score, type] per id."""
    def kind(i: int) -> str:
        return next((name for name in ("control", "unknown", "unused", "byte")
                     if getattr(processor, f"is_{name}")(i)), "normal")
    return [[processor.id_to_piece(i), processor.get_score(i), kind(i)] for i in range(processor.get_piece_size())]


def tokenizer_result(tokenizer, texts: Sequence[str]) -> dict:
    """The vocabulary size, every special id the tokenizer has (None where it has none), the ids of `texts`, and
    for SentencePiece its pieces with their scores: a unigram model segments by the scores, so a changed score
    shows in the ids of some text only, and the table itself is what the command read."""
    special = {}
    for name in SPECIAL:
        try:
            special[name] = getattr(tokenizer, name)
        except (AttributeError, NotImplementedError):
            special[name] = None
    special["sentinel_ids"] = list(tokenizer.sentinel_ids)
    processor = getattr(tokenizer, "_sp", None)  # SentencePieceTokenizer's sentencepiece processor
    return dict(vocab_size=tokenizer.vocab_size, special=special, ids=[tokenizer.tokenize(t) for t in texts],
                pieces=spm_pieces(processor) if processor is not None else None)


def config_result(cfg) -> dict:
    """Every field of a RunConfig, the DeepSpeed dict and the resolved command line included."""
    return digest(cfg)


def _manifest(folder: str, path: str) -> dict:
    """What a manifest says of its files: its format, and for each entry whether each number matches."""
    from megatron.checkpointing.files import read_args, settings_crc32
    from megatron.checkpointing.reading import crc32
    with open(path) as f:
        manifest = json.load(f)
    listed = {}
    for name, entry in manifest["files"].items():
        file = os.path.join(folder, name)
        agrees = dict(bytes=os.path.getsize(file) == entry["bytes"], crc32=crc32(file) == entry["crc32"])
        if "settings_crc32" in entry:
            agrees["settings_crc32"] = settings_crc32(read_args(folder)) == entry["settings_crc32"]
        listed[name] = agrees
    return dict(format=manifest["format"], checksum=manifest["checksum"], files=listed)


def _file(path: str) -> Any:
    """One output file, read by its owner's reader."""
    name = os.path.basename(path)
    if name == "manifest.json":
        return _manifest(os.path.dirname(path), path)
    if name.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    if name.endswith(".safetensors"):
        from safetensors import safe_open
        with safe_open(path, framework="pt") as f:
            return dict(metadata=f.metadata(), tensors={k: digest(f.get_tensor(k)) for k in sorted(f.keys())})
    if name.endswith(".pt"):
        return digest(torch.load(path, map_location="cpu", weights_only=True))
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return ["bytes", len(data), zlib.crc32(data)]


def folder_result(folder: str) -> Dict[str, Any]:
    """Every file under `folder` (its path relative to it -> its content as its owner reads it), normalized."""
    out = {}
    for parent, _, names in sorted(os.walk(folder)):
        for name in sorted(names):
            path = os.path.join(parent, name)
            out[os.path.relpath(path, folder)] = _file(path)
    return normalized(out, folder)


# ---- comparing -------------------------------------------------------------------------------------------------

def _leaves(obj: Any, path: Tuple = ()) -> Dict[Tuple, Any]:
    """path -> value of every leaf; a digested tensor or array is one leaf."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_leaves(v, path + (k,)))
        return out or {path: {}}
    if isinstance(obj, list) and not (len(obj) == 4 and obj[0] in ("tensor", "array")):
        out = {}
        for i, v in enumerate(obj):
            out.update(_leaves(v, path + (i,)))
        return out or {path: []}
    return {path: obj}


def same(a: Any, b: Any) -> bool:
    """Equal in value and kind (True is not 1, 1 is 1.0)."""
    numbers = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, numbers) and isinstance(b, numbers):
        return a == b
    return type(a) is type(b) and a == b


def changes(before: Any, after: Any) -> List[Tuple[Tuple, Any, Any]]:
    """(path, old, new) for every leaf that differs; MISSING for a leaf one side lacks."""
    a, b = _leaves(before), _leaves(after)
    return [(p, a.get(p, MISSING), b.get(p, MISSING)) for p in sorted(set(a) | set(b), key=repr)
            if not same(a.get(p, MISSING), b.get(p, MISSING))]


def describe(diff: Sequence[Tuple[Tuple, Any, Any]], limit: int = 3) -> str:
    """The first few changes, for a report line."""
    shown = [f"{'.'.join(map(str, p))}: {_short(old)} -> {_short(new)}" for p, old, new in diff[:limit]]
    more = f" and {len(diff) - limit} more" if len(diff) > limit else ""
    return "; ".join(shown) + more


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
