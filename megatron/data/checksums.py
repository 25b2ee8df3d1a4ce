"""The checksum sidecar of a ``.bin``/``.idx`` pair: ``<prefix>.crc.json``, a CRC-32 per chunk of the ``.bin``
and one for the whole ``.idx``, checked as training reads the pair.

The sidecar is a file of its own: the ``.bin`` and ``.idx`` are byte for byte what they are without it, and
Megatron-LM, which never opens it, reads the pair as before. Format (JSON, one object)::

    {"format": "megatron-tds-data-crc", "version": 1,
     "chunk_bytes": 1048576,           chunk k of the .bin is bytes [k * chunk_bytes, (k + 1) * chunk_bytes)
     "bin_bytes": ..., "idx_bytes": ...,
     "idx_crc32": "08x",               CRC-32 (zlib's) of the whole .idx, 8 hex digits
     "bin_crc32": ["08x", ...]}        one per chunk, ceil(bin_bytes / chunk_bytes) of them

1 GiB of tokens takes 1024 entries, about 12 KB. ``tools/preprocess_data.py`` and ``tools/merge_datasets.py``
write it beside their outputs; ``tools/checksum_data.py`` adds it to an existing pair or checks a pair against it.

What is checked, and when (``MMapIndexedDataset``, in every process that opens the pair):
  at open          the sidecar parses and names the pair's sizes, and the ``.idx`` matches its CRC-32 (the
                   index is small: ~12 bytes per document)
  at first read    chunk k of the ``.bin`` is checked the first time a read in this process touches it (a bit
                   per chunk; a DataLoader worker keeps its own)
A mismatch is a ``DataChecksumError`` (a UserError: one ``error:`` line, exit 2) naming the file, the byte
range and both checksums. A pair without a sidecar is read unverified, as before.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from megatron.errors import UserError

SUFFIX = ".crc.json"
FORMAT = "megatron-tds-data-crc"
VERSION = 1
CHUNK_BYTES = 1 << 20
_HEX = re.compile(r"[0-9a-f]{8}")
_FIX = "the file is damaged; re-copy it or re-run tools/preprocess_data.py"


class DataChecksumError(UserError):
    """A data file whose bytes differ from its sidecar's checksums, or a sidecar that is damaged or describes
    other files."""


def sidecar_path(prefix: str) -> str:
    return prefix + SUFFIX


@dataclass(frozen=True)
class Sidecar:
    """The checksums of one pair (see the module docstring for the file)."""
    chunk_bytes: int
    bin_bytes: int
    idx_bytes: int
    idx_crc32: int
    bin_crc32: Tuple[int, ...]

    def chunk_range(self, chunk: int) -> Tuple[int, int]:
        """[start, stop) of chunk `chunk` in the .bin."""
        start = chunk * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.bin_bytes)

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "chunk_bytes": self.chunk_bytes, "bin_bytes": self.bin_bytes,
                "idx_bytes": self.idx_bytes, "idx_crc32": f"{self.idx_crc32:08x}",
                "bin_crc32": [f"{crc:08x}" for crc in self.bin_crc32]}


def _crc32(data, chunk_bytes: int = CHUNK_BYTES) -> int:
    value = 0
    for start in range(0, len(data), chunk_bytes):
        value = zlib.crc32(data[start:start + chunk_bytes], value)
    return value


def _map(path: str) -> memoryview:
    """The file's bytes, read-only (numpy's memmap: no copy; empty files give an empty view)."""
    return memoryview(np.memmap(path, mode="r") if os.path.getsize(path) else b"")


def compute(prefix: str, chunk_bytes: int = CHUNK_BYTES) -> Sidecar:
    """The checksums of ``<prefix>.bin`` / ``<prefix>.idx`` as they are on disk."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    data, index = _map(prefix + ".bin"), _map(prefix + ".idx")
    crcs = tuple(zlib.crc32(data[start:start + chunk_bytes]) for start in range(0, len(data), chunk_bytes))
    return Sidecar(chunk_bytes, len(data), len(index), _crc32(index), crcs)


def write(prefix: str, chunk_bytes: int = CHUNK_BYTES) -> Sidecar:
    """Compute the pair's checksums and write them to ``<prefix>.crc.json`` atomically."""
    sidecar = compute(prefix, chunk_bytes)
    path = sidecar_path(prefix)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(sidecar.to_json(), f, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, path)
    return sidecar


def _parse(content) -> Sidecar:
    """The Sidecar of a parsed JSON object; ValueError saying what is wrong."""
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"no \"format\": \"{FORMAT}\"")
    if content.get("version") != VERSION:
        raise ValueError(f"version {content.get('version')!r}, this reader knows version {VERSION}")
    numbers = [content.get(k) for k in ("chunk_bytes", "bin_bytes", "idx_bytes")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers) or numbers[0] < 1:
        raise ValueError("chunk_bytes, bin_bytes and idx_bytes must be whole numbers (chunk_bytes >= 1)")
    chunk_bytes, bin_bytes, idx_bytes = numbers
    crcs, idx_crc = content.get("bin_crc32"), content.get("idx_crc32")
    if not isinstance(idx_crc, str) or not _HEX.fullmatch(idx_crc):
        raise ValueError("idx_crc32 is not 8 hex digits")
    if not isinstance(crcs, list) or not all(isinstance(c, str) and _HEX.fullmatch(c) for c in crcs):
        raise ValueError("bin_crc32 is not a list of 8-hex-digit checksums")
    chunks = -(-bin_bytes // chunk_bytes)
    if len(crcs) != chunks:
        raise ValueError(f"{len(crcs)} chunk checksums for {bin_bytes} bytes in chunks of {chunk_bytes} "
                         f"(needs {chunks})")
    return Sidecar(chunk_bytes, bin_bytes, idx_bytes, int(idx_crc, 16), tuple(int(c, 16) for c in crcs))


def read(prefix: str) -> Optional[Sidecar]:
    """The pair's sidecar; None when there is none; DataChecksumError naming it when it does not parse."""
    path = sidecar_path(prefix)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        return _parse(json.loads(raw.decode("utf-8")))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        reason = str(err).splitlines()[0]
        raise DataChecksumError(f"{path}: not a readable checksum sidecar ({reason}): it is damaged; write it again "
                                f"from a good copy of the pair (python tools/checksum_data.py --overwrite --data-path "
                                f"{prefix}), or delete it to read the pair unverified") from None


def check_sizes(prefix: str, sidecar: Sidecar) -> None:
    """The sidecar describes files of the pair's sizes (one stat each)."""
    bin_bytes, idx_bytes = os.path.getsize(prefix + ".bin"), os.path.getsize(prefix + ".idx")
    if (bin_bytes, idx_bytes) != (sidecar.bin_bytes, sidecar.idx_bytes):
        raise DataChecksumError(
            f"{sidecar_path(prefix)} describes a .bin of {sidecar.bin_bytes} bytes and a .idx of {sidecar.idx_bytes} "
            f"but {prefix}.bin has {bin_bytes} and {prefix}.idx has {idx_bytes}: a file was cut short or replaced; "
            f"re-copy the pair, or if it is right, write its sidecar again (python tools/checksum_data.py "
            f"--overwrite --data-path {prefix})")


def _mismatch(path: str, start: int, stop: int, what: str, prefix: str, expected: int, found: int) -> str:
    return (f"{path}: bytes {start}..{stop - 1}{what} fail their CRC-32 ({sidecar_path(prefix)} says "
            f"0x{expected:08x}, read 0x{found:08x}): {_FIX}")


def check_index(prefix: str, sidecar: Sidecar) -> None:
    """The whole .idx against the sidecar's CRC-32."""
    path = prefix + ".idx"
    found = _crc32(_map(path))
    if found != sidecar.idx_crc32:
        raise DataChecksumError(_mismatch(path, 0, sidecar.idx_bytes, "", prefix, sidecar.idx_crc32, found))


def open_checks(prefix: str) -> Optional[Sidecar]:
    """What opening a pair checks: the sidecar parses, names the pair's sizes, and the .idx matches its CRC-32.
    None for a pair without a sidecar."""
    sidecar = read(prefix)
    if sidecar is not None:
        check_sizes(prefix, sidecar)
        check_index(prefix, sidecar)
    return sidecar


class ChunkChecks:
    """Chunk k of the .bin checked against the sidecar the first time a read of this process touches it.

    ``data`` is the .bin's bytes (the reader's mmap). One byte per chunk says whether it was checked; the
    object lives in the process that reads (a forked DataLoader worker inherits the parent's record and
    extends its own copy; a pickled reader re-opens the pair and starts afresh)."""

    def __init__(self, prefix: str, sidecar: Sidecar, data):
        self.prefix, self.sidecar, self._data = prefix, sidecar, data
        self._chunk_bytes = sidecar.chunk_bytes
        self._checked = bytearray(len(sidecar.bin_crc32))
        self.remaining = len(self._checked)

    def touch(self, start: int, stop: int) -> int:
        """Bytes [start, stop) of the .bin are about to be read: check the chunks they overlap not checked yet.
        Returns how many chunks remain unchecked."""
        if stop > start:
            first, last = start // self._chunk_bytes, (stop - 1) // self._chunk_bytes
            if first == last:  # the common case, kept cheap: it runs on every read
                if not self._checked[first]:
                    self._check(first)
            else:
                for chunk in range(first, last + 1):
                    if not self._checked[chunk]:
                        self._check(chunk)
        return self.remaining

    def touch_all(self) -> None:
        self.touch(0, self.sidecar.bin_bytes)

    def _check(self, chunk: int) -> None:
        start, stop = self.sidecar.chunk_range(chunk)
        found = zlib.crc32(self._data[start:stop])
        expected = self.sidecar.bin_crc32[chunk]
        if found != expected:
            raise DataChecksumError(_mismatch(self.prefix + ".bin", start, stop, f" (chunk {chunk})", self.prefix,
                                              expected, found))
        self._checked[chunk] = 1
        self.remaining -= 1


def unverified_note(prefixes: List[str]) -> str:
    """The one line a run prints for the prefixes read without a sidecar."""
    names = " ".join(prefixes)
    return (f"note: no checksum sidecar ({SUFFIX}) for {names}: read unverified; add one with "
            f"python tools/checksum_data.py --data-path {names}")
