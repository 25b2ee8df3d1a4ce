"""Seeded mutations of the files the project reads: one changed file per case, the way disks, copies and hands
damage them (a flipped bit, a file cut short, a header field out of range).

    Mutation(kind, target, what, op)   `target` is a path relative to the case folder, `op` one of
        ("flip", offset, bit)   the bit of the byte at offset flipped: a bad disk or copy; same size
        ("truncate", size)      the file cut to `size` bytes: an interrupted copy, a full disk
        ("append", data)        bytes added at the end
        ("write", offset, data) bytes overwritten in place (a header field set to another value)
        ("replace", old, new)   the first occurrence of bytes `old` replaced by `new` (a hand edit of a value)
    apply(mutation, folder)
    flips / truncations(kind, target, size, n, rng)   n random ones over the whole file or a byte range
    idx_mutations(target, header)                     the .idx header fields and arrays, one at a time
"""
from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class Mutation:
    kind: str    # the row of the table: ".idx", "vocab.json", "checkpoint .pt", ...
    target: str  # the file, relative to the case folder
    what: str    # in words, for reports
    op: Tuple

    @property
    def name(self) -> str:
        return f"{self.target}: {self.what}"


def apply(mutation: Mutation, folder: str) -> None:
    path = os.path.join(folder, mutation.target)
    kind = mutation.op[0]
    if kind == "flip":
        _, offset, bit = mutation.op
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
    elif kind == "truncate":
        with open(path, "r+b") as f:
            f.truncate(mutation.op[1])
    elif kind == "append":
        with open(path, "ab") as f:
            f.write(mutation.op[1])
    elif kind == "write":
        _, offset, data = mutation.op
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)
    elif kind == "replace":
        _, old, new = mutation.op
        with open(path, "rb") as f:
            content = f.read()
        if old not in content:
            raise ValueError(f"{path} holds no {old!r} to replace")
        with open(path, "wb") as f:
            f.write(content.replace(old, new, 1))
    else:
        raise ValueError(f"unknown mutation {mutation.op!r}")


def flips(kind: str, target: str, size: int, n: int, rng: random.Random, lo: int = 0,
          hi: Optional[int] = None, where: str = "") -> List[Mutation]:
    """n bit flips at random offsets of [lo, hi) (the whole file by default)."""
    hi = size if hi is None else min(hi, size)
    out = []
    for _ in range(n):
        offset, bit = rng.randrange(lo, hi), rng.randrange(8)
        out.append(Mutation(kind, target, f"bit {bit} of byte {offset}{where} flipped", ("flip", offset, bit)))
    return out


def truncations(kind: str, target: str, size: int, n: int, rng: random.Random) -> List[Mutation]:
    """n cuts: to 0 bytes, to one byte short, and at random lengths in between."""
    lengths = [0, size - 1] + [rng.randrange(1, size - 1) for _ in range(max(0, n - 2))] if size > 2 else [0]
    return [Mutation(kind, target, f"cut to {length} of {size} bytes", ("truncate", length)) for length in lengths[:n]]


def idx_mutations(target: str, n_items: int, n_docs: int, size: int, rng: random.Random) -> List[Mutation]:
    """A Megatron MMIDIDX .idx file: each header field set to another value or bit-flipped, then flips inside
    its sizes, pointers and doc_idx arrays (megatron/data/indexed_dataset.py has the layout)."""
    kind, out = ".idx", []
    out += flips(kind, target, size, 4, rng, 0, 9, " (magic)")
    out += [Mutation(kind, target, "version set to 2", ("write", 9, struct.pack("<Q", 2)))]
    out += flips(kind, target, size, 3, rng, 9, 17, " (version)")
    out += [Mutation(kind, target, f"dtype code set to {c}", ("write", 17, bytes([c]))) for c in (0, 4, 9)]
    out += flips(kind, target, size, 2, rng, 17, 18, " (dtype code)")
    out += [Mutation(kind, target, f"item count set to {n_items + d}", ("write", 18, struct.pack("<Q", n_items + d)))
            for d in (-1, 1)]
    out += [Mutation(kind, target, f"document count set to {n_docs + 1 + d}",
                     ("write", 26, struct.pack("<Q", n_docs + 1 + d))) for d in (-1, 1)]
    out += flips(kind, target, size, 3, rng, 18, 34, " (counts)")
    sizes, pointers = 34, 34 + 4 * n_items
    doc_idx = pointers + 8 * n_items
    out += flips(kind, target, size, 4, rng, sizes, pointers, " (sizes)")
    out += flips(kind, target, size, 4, rng, pointers, doc_idx, " (pointers)")
    out += flips(kind, target, size, 4, rng, doc_idx, size, " (doc_idx)")
    out += truncations(kind, target, size, 4, rng)
    out += [Mutation(kind, target, "8 bytes appended", ("append", b"\0" * 8))]
    return out


def bin_mutations(target: str, size: int, rng: random.Random) -> List[Mutation]:
    """A .bin cut short or grown (its length no longer what the .idx implies), and tokens flipped in place (the
    length kept: only the pair's checksum sidecar tells)."""
    return truncations(".bin", target, size, 5, rng) + \
        [Mutation(".bin", target, f"{n} bytes appended", ("append", b"\1" * n)) for n in (1, 2, 64)] + \
        flips(".bin", target, size, 6, rng, where=" (a token)")
