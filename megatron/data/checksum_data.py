"""Add the checksum sidecar to existing ``.bin``/``.idx`` pairs, or check pairs against theirs: the library of
``tools/checksum_data.py`` (the sidecar's format and checks: ``megatron.data.checksums``).

    add_sidecar(prefix)    writes ``<prefix>.crc.json`` for a valid pair, from its bytes as they are now; an
                           existing sidecar is replaced only with ``overwrite`` (a sidecar rewritten from a
                           damaged copy would vouch for the damage)
    verify_pair(prefix)    the ``.idx`` and every chunk of the ``.bin`` against the sidecar, as training checks them
"""
from __future__ import annotations

import os

from megatron.data.checksums import CHUNK_BYTES, DataChecksumError, Sidecar, sidecar_path, write
from megatron.data.indexed_dataset import MMapIndexedDataset, read_pair_index
from megatron.errors import UserError


def _require_pair(prefix: str) -> None:
    if not MMapIndexedDataset.exists(prefix):
        hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
        raise UserError(f"{prefix}: {prefix}.bin and {prefix}.idx not found{hint}")


def add_sidecar(prefix: str, chunk_bytes: int = CHUNK_BYTES, overwrite: bool = False) -> Sidecar:
    """Write the pair's sidecar; the pair must open as a valid MMIDIDX pair."""
    _require_pair(prefix)
    path = sidecar_path(prefix)
    if os.path.exists(path) and not overwrite:
        raise DataChecksumError(f"{path} exists: --verify checks {prefix}.bin/.idx against it; --overwrite replaces "
                                f"it, from a good copy of the pair only (the new sidecar vouches for the bytes as "
                                f"they are)")
    if chunk_bytes < 1:
        raise UserError(f"--chunk-bytes must be >= 1, got {chunk_bytes}")
    read_pair_index(prefix)  # a pair that would not open gets no sidecar
    return write(prefix, chunk_bytes)


def verify_pair(prefix: str) -> Sidecar:
    """Open the pair (its sidecar, the sizes and the .idx checked) and check every chunk of its .bin."""
    _require_pair(prefix)
    dataset = MMapIndexedDataset(prefix)
    if dataset.sidecar is None:
        raise DataChecksumError(f"{sidecar_path(prefix)} not found: nothing to verify {prefix}.bin/.idx against; "
                                f"add it with python tools/checksum_data.py --data-path {prefix}")
    dataset.check_bytes()
    return dataset.sidecar
