"""Reading a raw corpus document by document: the input side of tools/preprocess_data.py and
tools/train_tokenizer.py.

Formats (`text_format`; 'auto': 'jsonl' for .jsonl/.json files, 'lines' otherwise):
    jsonl       one JSON object per line; the texts of the chosen keys (a blank line is an empty document)
    lines       one document per line
    paragraphs  documents separated by blank lines (their internal newlines are kept)
A record that cannot be a document raises `BadRecord` naming the file and line.
"""
from __future__ import annotations

import json
from typing import Dict, Iterator, List, Tuple

from megatron.errors import UserError

TEXT_FORMATS = ("auto", "jsonl", "lines", "paragraphs")


class InputError(UserError):
    """Bad input or arguments: `error: <message>` on one line and exit status 2 (megatron.errors)."""


class BadRecord(Exception):
    """One input line that cannot be turned into a document."""


def resolve_format(path: str, text_format: str) -> str:
    if text_format != "auto":
        return text_format
    return "jsonl" if path.endswith((".jsonl", ".json")) else "lines"


def iter_records(path: str, text_format: str) -> Iterator[Tuple[int, bytes]]:
    """(first line number, raw bytes) of each document, read lazily."""
    with open(path, "rb") as f:
        if text_format != "paragraphs":
            yield from enumerate(f, start=1)
            return
        lines, start = [], 0
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                start = start or line_no
                lines.append(line)
            elif lines:
                yield start, b"".join(lines)
                lines, start = [], 0
        if lines:
            yield start, b"".join(lines)


def parse_record(raw: bytes, line_no: int, path: str, text_format: str, keys: List[str]) -> Dict[str, str]:
    """Texts of one document by key; raises BadRecord naming the file and line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord(f"{path}:{line_no}: invalid UTF-8 at byte {e.start}") from None
    if text_format != "jsonl":
        return {keys[0]: text.rstrip("\r\n")}
    if not text.strip():  # a blank line (e.g. at the end of the file) is an empty document
        return {key: "" for key in keys}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRecord(f"{path}:{line_no}: malformed JSON at column {e.colno}: {e.msg}") from None
    if not isinstance(obj, dict):
        raise BadRecord(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    texts = {}
    for key in keys:
        if key not in obj:
            raise BadRecord(f"{path}:{line_no}: no key {key!r} (keys: {', '.join(sorted(obj))}); see --json-keys")
        if not isinstance(obj[key], str):
            raise BadRecord(f"{path}:{line_no}: key {key!r} holds {type(obj[key]).__name__}, expected a string")
        texts[key] = obj[key]
    if "\\ud" in text or "\\uD" in text:  # a JSON escape may decode to a lone surrogate, which has no UTF-8
        _check_surrogates(texts, line_no, path)
    return texts


def _check_surrogates(texts: Dict[str, str], line_no: int, path: str) -> None:
    for key, value in texts.items():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord(f"{path}:{line_no}: key {key!r} holds an unpaired surrogate "
                            f"\\u{ord(value[e.start]):04x}") from None
