"""Reading a raw corpus document by document: the input side of tools/preprocess_data.py and
tools/train_tokenizer.py.

Formats (`text_format`; 'auto' decides by the name, a compression suffix aside: 'jsonl' for .jsonl/.json,
'parquet' for .parquet, 'lines' otherwise):
    jsonl       one JSON object per line; the texts of the chosen keys (a blank line is an empty document)
    lines       one document per line
    paragraphs  documents separated by blank lines (their internal newlines are kept)
    parquet     one document per row; the texts of the chosen string columns, read batch by batch
The three line formats may be compressed, as corpora ship: `.gz` (gzip, the standard library) or `.zst`/`.zstd`
(zstandard, frame by frame); they are decompressed as a stream, never whole, and read as if decompressed.

A record that cannot be a document raises `BadRecord` naming the file and line (Parquet: the row, counted from
0 as pyarrow and `datasets` index them); a null in a Parquet column is such a record, as JSON's null is. A file
that cannot be read on (a damaged stream, a Parquet file without a footer, a missing or non-string column)
raises `InputError`.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Dict, Iterator, Optional, Sequence, Tuple, Union

from megatron.errors import UserError, one_line

TEXT_FORMATS = ("auto", "jsonl", "lines", "paragraphs", "parquet")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
PARQUET_BATCH_ROWS = 1024

# (line or row, payload): the raw bytes of a line-format document, or a Parquet row's values (str or None)
Record = Tuple[int, Union[bytes, Tuple[Optional[str], ...]]]


class InputError(UserError):
    """Bad input or arguments: `error: <message>` on one line and exit status 2 (megatron.errors)."""


class BadRecord(Exception):
    """One input line (or Parquet row) that cannot be turned into a document."""


def compression_of(path: str) -> Optional[str]:
    """'gzip', 'zstd' or None, by the file's suffix."""
    return COMPRESSIONS.get(os.path.splitext(path)[1].lower())


def resolve_format(path: str, text_format: str) -> str:
    if text_format != "auto":
        return text_format
    name = path[: -len(os.path.splitext(path)[1])] if compression_of(path) else path
    if name.lower().endswith(".parquet"):
        return "parquet"
    return "jsonl" if name.lower().endswith((".jsonl", ".json")) else "lines"


@dataclass(frozen=True)
class Corpus:
    """A corpus file as it is read: format resolved, keys (jsonl keys, Parquet columns) checked."""
    path: str
    text_format: str  # jsonl, lines, paragraphs or parquet
    keys: Tuple[str, ...]
    compression: Optional[str] = None  # gzip, zstd or None

    def records(self) -> Iterator[Record]:
        """(first line number, raw bytes) of each document, or (row, values) for Parquet, read lazily."""
        if self.text_format == "parquet":
            return _parquet_records(self.path, self.keys)
        lines = _lines(self.path, self.compression)
        return _paragraphs(lines) if self.text_format == "paragraphs" else lines

    def parse(self, record: Record) -> Dict[str, str]:
        """Texts of one document by key; raises BadRecord naming the file and line (or row)."""
        position, raw = record
        if self.text_format == "parquet":
            return _parquet_texts(raw, position, self.path, self.keys)
        return _parse_line(raw, position, self.path, self.text_format, self.keys)


def open_corpus(path: str, text_format: str = "auto", keys: Sequence[str] = ("text",)) -> Corpus:
    """The corpus at `path`; raises InputError for a missing file, keys the format cannot have, or a Parquet
    file whose footer or columns are wrong (checked here, before any document is read)."""
    if not os.path.isfile(path):
        raise InputError(f"input file {path!r} not found")
    text_format = resolve_format(path, text_format)
    if text_format not in ("jsonl", "parquet") and len(keys) != 1:
        raise InputError(f"--text-format {text_format} has one text per document; got --json-keys {list(keys)}")
    if text_format == "parquet":
        _check_columns(_parquet_file(path), path, keys)
        return Corpus(path, text_format, tuple(keys))
    return Corpus(path, text_format, tuple(keys), compression_of(path))


def record_bytes(record: Record) -> int:
    """Input bytes of a record: the raw line(s), or the UTF-8 bytes of a Parquet row's texts."""
    raw = record[1]
    if isinstance(raw, bytes):
        return len(raw)
    return sum(len(value.encode("utf-8")) for value in raw if value is not None)


def iter_texts(path: str, key: str = "text", text_format: str = "auto") -> Iterator[str]:
    """Document texts of a corpus; raises InputError for a bad file at once, for a bad record when reached."""
    corpus = open_corpus(path, text_format, [key])

    def texts():
        for record in corpus.records():
            try:
                yield corpus.parse(record)[key]
            except BadRecord as e:
                raise InputError(str(e)) from None
    return texts()


# ---- line formats: plain, gzip or zstd ----

class _ZstdReader(io.RawIOBase):
    """Decompressed bytes of every zstd frame of a file, fed 64 KiB at a time: memory follows the compression
    ratio, not the file size.

    zstandard's own stream reader returns what it has when the file ends inside a frame; here that is an
    EOFError, and a damaged frame (or one whose checksum does not match) an OSError.
    """
    CHUNK = 1 << 16

    def __init__(self, f: BinaryIO):
        import zstandard
        self._f, self._error = f, zstandard.ZstdError
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = None  # the decompressor of the current frame
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            data = self._f.read(self.CHUNK)
            if not data:
                if self._frame is not None and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            self._out, self._pos = self._decompress(data), 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        try:
            while data:
                if self._frame is None or self._frame.eof:
                    self._frame = self._dctx.decompressobj()
                out.append(self._frame.decompress(data))
                data = self._frame.unused_data if self._frame.eof else b""
        except self._error as e:
            raise OSError(str(e)) from None
        return b"".join(out)


def _open(path: str, compression: Optional[str]) -> BinaryIO:
    if compression == "gzip":
        return gzip.open(path, "rb")
    f = open(path, "rb")
    if compression == "zstd":
        return io.BufferedReader(_ZstdReader(f), buffer_size=1 << 16)
    return f


def _lines(path: str, compression: Optional[str]) -> Iterator[Tuple[int, bytes]]:
    """(line number, line) of a file, decompressed; a damaged stream is an InputError naming the last line."""
    line_no = 0
    try:
        with _open(path, compression) as f:
            for line_no, line in enumerate(f, start=1):
                yield line_no, line
    except (OSError, EOFError, zlib.error) as e:
        what = f"damaged {compression} stream" if compression else "read error"
        where = f"after line {line_no}" if line_no else "before the first line"
        raise InputError(f"{path}: {what} {where}: {one_line(e)}") from None


def _paragraphs(lines: Iterator[Tuple[int, bytes]]) -> Iterator[Tuple[int, bytes]]:
    """(first line number, text) of each run of non-blank lines."""
    block, start = [], 0
    for line_no, line in lines:
        if line.strip():
            start = start or line_no
            block.append(line)
        elif block:
            yield start, b"".join(block)
            block, start = [], 0
    if block:
        yield start, b"".join(block)


def _parse_line(raw: bytes, line_no: int, path: str, text_format: str, keys: Sequence[str]) -> Dict[str, str]:
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


# ---- Parquet ----

def _parquet_file(path: str):
    import pyarrow
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable Parquet file: {one_line(e)}") from None


def _check_columns(parquet_file, path: str, keys: Sequence[str]) -> None:
    """Every key is a column of strings (plain, large, view or dictionary-encoded)."""
    import pyarrow.types as t
    schema = parquet_file.schema_arrow
    for key in keys:
        if key not in schema.names:
            raise InputError(f"{path}: no column {key!r} (columns: {', '.join(schema.names)}); see --json-keys")
        kind = schema.field(key).type
        value = kind.value_type if t.is_dictionary(kind) else kind
        if not (t.is_string(value) or t.is_large_string(value) or t.is_string_view(value)):
            raise InputError(f"{path}: column {key!r} holds {kind}, expected strings")


def _parquet_records(path: str, keys: Sequence[str]) -> Iterator[Record]:
    """(row, values of the keys' columns) of each row, one batch of rows in memory at a time."""
    import pyarrow
    parquet_file = _parquet_file(path)
    _check_columns(parquet_file, path, keys)
    row = 0
    try:
        for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=list(keys)):
            columns = [batch.column(key).to_pylist() for key in keys]
            for values in zip(*columns):
                yield row, values
                row += 1
    except (pyarrow.ArrowException, OSError, ValueError) as e:
        raise InputError(f"{path}: cannot read the rows from row {row} on: {one_line(e)}") from None


def _parquet_texts(values, row: int, path: str, keys: Sequence[str]) -> Dict[str, str]:
    texts = {}
    for key, value in zip(keys, values):
        if value is None:
            raise BadRecord(f"{path}: row {row}: column {key!r} is null")
        texts[key] = value
    return texts
