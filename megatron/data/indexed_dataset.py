"""Megatron's mmap indexed dataset (``MMIDIDX`` version 1), byte for byte.

A dataset is a pair of files ``<prefix>.bin`` / ``<prefix>.idx``.

``.bin``: the tokens of every item, back to back, raw little-endian values of one dtype.

``.idx`` (little-endian)::

    offset      size  field
    0           9     magic b"MMIDIDX\\x00\\x00"
    9           8     <Q version = 1
    17          1     <B dtype code (table below)
    18          8     <Q N = number of items
    26          8     <Q D = len(doc_idx) = number of documents + 1
    34          4N    int32 sizes[N]      tokens per item
    34+4N       8N    int64 pointers[N]   byte offset of item i in .bin = itemsize * sum(sizes[:i])
    34+12N      8D    int64 doc_idx[D]    item index where each document starts; doc_idx[0] = 0, doc_idx[-1] = N

Dtype codes are the old Megatron table (v1.x-v2.6): 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
6 float64 (np.float), 7 float64 (np.double), 8 uint16. A float64 dataset is written with code 6.

The reader validates the index when it opens it (header, file length, sizes >= 0, pointers equal to
the exclusive cumulative sum of sizes, doc_idx non-decreasing from 0 to N: O(N) numpy work) and that
the ``.bin`` length is what the index implies. With ``vocab_size`` it also checks every token id is in
``[0, vocab_size)``: one numpy max/min pass over the whole ``.bin`` at open time (the cost of a warm-up read).
``token_id_range`` is that pass, in chunks of 2^26 tokens; ``first_token_outside`` finds the document of
the first id outside a range (token position -> item by the running sum of ``sizes``, item -> document by
``doc_idx``).

A pair may have a checksum sidecar ``<prefix>.crc.json`` (``megatron.data.checksums``): the reader then checks the
``.idx`` against it at open, and each chunk of the ``.bin`` the first time a read touches it (``check_bytes``)."""
import os
import shutil
import struct
from array import array
from typing import Iterator, Optional, Sequence, Tuple, Union

import numpy as np

from megatron.data import checksums
from megatron.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 N + 8 D
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
          6: np.float64, 7: np.float64, 8: np.uint16}
_WARMUP_CHUNK = 100 * 1024 * 1024
_SCAN_CHUNK_TOKENS = 1 << 26


class IndexedDatasetError(UserError):
    """A .bin/.idx pair that is not a valid MMIDIDX v1 dataset (the message names the file)."""


def dtype_code(dtype) -> int:
    """Code of ``dtype`` in the old Megatron table (first match, so float64 -> 6)."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no MMIDIDX code; use one of "
                     f"{sorted({np.dtype(d).name for d in DTYPES.values()})}")


def best_fitting_dtype(vocab_size: Optional[int] = None) -> type:
    """uint16 when every token id fits comfortably (vocab_size < 65500), else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix_path: str) -> str:
    return prefix_path + ".bin"


def index_file_path(prefix_path: str) -> str:
    return prefix_path + ".idx"


def _exclusive_pointers(sizes: np.ndarray, itemsize: int) -> np.ndarray:
    """pointers[i] = itemsize * sum(sizes[:i]) as int64."""
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
    return pointers * itemsize


def write_index(idx_path: str, dtype, sizes: Sequence[int], doc_idx: Sequence[int]) -> None:
    """Write an ``.idx`` file for items of ``sizes`` tokens stored back to back."""
    sizes = np.asarray(sizes, dtype=np.int32)
    doc_idx = np.asarray(doc_idx, dtype=np.int64)
    pointers = _exclusive_pointers(sizes, np.dtype(dtype).itemsize)
    with open(idx_path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(sizes.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(doc_idx.astype("<i8").tobytes(order="C"))


class _Index:
    """Parsed and validated ``.idx`` file; arrays are views on an mmap of the file."""

    def __init__(self, path: str):
        self.path = path
        file_bytes = os.path.getsize(path)
        if file_bytes < HEADER_BYTES:
            raise IndexedDatasetError(f"{path}: truncated index, {file_bytes} bytes < {HEADER_BYTES}-byte header")
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        magic = header[:9]
        if magic != MAGIC:
            raise IndexedDatasetError(f"{path}: bad magic {magic!r}, expected {MAGIC!r} (not an mmap .idx file)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: unsupported index version {version}, expected {VERSION}")
        (code,) = struct.unpack("<B", header[17:18])
        if code not in DTYPES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code}, expected one of {sorted(DTYPES)}")
        self.dtype = np.dtype(DTYPES[code])
        n_items, n_doc_idx = struct.unpack("<QQ", header[18:34])
        expected = HEADER_BYTES + 12 * n_items + 8 * n_doc_idx
        if file_bytes != expected:
            raise IndexedDatasetError(f"{path}: corrupt index, {file_bytes} bytes but header (N={n_items}, "
                                      f"D={n_doc_idx}) implies {expected}")
        buffer = np.memmap(path, mode="r", order="C")
        self.sizes = np.frombuffer(buffer, dtype="<i4", count=n_items, offset=HEADER_BYTES)
        self.pointers = np.frombuffer(buffer, dtype="<i8", count=n_items, offset=HEADER_BYTES + 4 * n_items)
        self.doc_idx = np.frombuffer(buffer, dtype="<i8", count=n_doc_idx, offset=HEADER_BYTES + 12 * n_items)
        self._check_arrays()

    def _check_arrays(self) -> None:
        path, n_items = self.path, len(self.sizes)
        if n_items and self.sizes.min() < 0:
            raise IndexedDatasetError(f"{path}: corrupt index, negative item size {int(self.sizes.min())}")
        expected = _exclusive_pointers(self.sizes, self.dtype.itemsize)
        bad = np.flatnonzero(self.pointers != expected)
        if len(bad):
            i = int(bad[0])
            raise IndexedDatasetError(f"{path}: corrupt index, pointer[{i}]={int(self.pointers[i])} but sizes "
                                      f"imply {int(expected[i])}")
        doc_idx = self.doc_idx
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_items or np.any(np.diff(doc_idx) < 0):
            first, last = (int(doc_idx[0]), int(doc_idx[-1])) if len(doc_idx) else (None, None)
            raise IndexedDatasetError(f"{path}: corrupt index, doc_idx must rise from 0 to N={n_items} "
                                      f"(len {len(doc_idx)}, first {first}, last {last})")

    @property
    def data_bytes(self) -> int:
        """Length the .bin file must have."""
        return int(self.sizes.sum(dtype=np.int64)) * self.dtype.itemsize


def read_pair_index(prefix: str) -> _Index:
    """The pair's index, parsed and validated, after checking the .bin has the length it implies."""
    index = _Index(index_file_path(prefix))
    bin_path, bin_bytes = data_file_path(prefix), os.path.getsize(data_file_path(prefix))
    if bin_bytes != index.data_bytes:
        raise IndexedDatasetError(f"{bin_path}: {bin_bytes} bytes but {index_file_path(prefix)} implies "
                                  f"{index.data_bytes}")
    return index


def _warmup(path: str) -> None:
    """Read a file through once so the OS page cache holds it (Megatron's mmap warm-up)."""
    with open(path, "rb") as f:
        while f.read(_WARMUP_CHUNK):
            pass


class MMapIndexedDataset:
    """Read-only view of ``<prefix>.bin``/``<prefix>.idx``; items are numpy views on the mmap (no copy)."""

    def __init__(self, path_prefix: str, skip_warmup: bool = True, vocab_size: Optional[int] = None):
        self._open(path_prefix, skip_warmup, vocab_size)

    def __getstate__(self) -> str:
        """Pickle the prefix only (DataLoader workers re-open the files instead of copying the tokens)."""
        return self._prefix

    def __setstate__(self, path_prefix: str) -> None:
        self._open(path_prefix, skip_warmup=True, vocab_size=None)

    def _open(self, path_prefix: str, skip_warmup: bool, vocab_size: Optional[int]) -> None:
        self._prefix = path_prefix
        idx_path, bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: indexed dataset file not found")
        if not skip_warmup:
            _warmup(idx_path)
            _warmup(bin_path)
        self._sidecar = checksums.open_checks(path_prefix)  # before parsing: a damaged .idx is named as damaged
        self._index = read_pair_index(path_prefix)
        # np.memmap cannot map an empty file; an empty dataset reads from an empty buffer.
        self._bin = np.memmap(bin_path, mode="r", order="C") if self._index.data_bytes else np.zeros(0, np.uint8)
        self._unchecked = None  # the chunks of the .bin not checked yet against the sidecar; None: none left
        if self._sidecar is not None and self._sidecar.bin_crc32:
            self._unchecked = checksums.ChunkChecks(path_prefix, self._sidecar, self._bin)
        if vocab_size is not None:
            self._check_token_ids(bin_path, vocab_size)

    def _check_token_ids(self, bin_path: str, vocab_size: int) -> None:
        low, high = self.token_id_range()
        if low < 0 or high >= vocab_size:
            document, token_id = self.first_token_outside(vocab_size)
            raise IndexedDatasetError(f"{bin_path}: token ids span [{low}, {high}] but vocab_size is {vocab_size} "
                                      f"(first outside: id {token_id} in document {document})")

    def _token_chunks(self) -> Iterator[Tuple[int, np.ndarray]]:
        """(first token position, tokens) over the whole .bin, _SCAN_CHUNK_TOKENS at a time (views, no copy)."""
        tokens = np.frombuffer(self._bin, dtype=self.dtype)
        for start in range(0, len(tokens), _SCAN_CHUNK_TOKENS):
            yield start, tokens[start:start + _SCAN_CHUNK_TOKENS]

    def token_id_range(self) -> Tuple[int, int]:
        """(smallest, largest) token id in the .bin; (0, -1) for a dataset without tokens."""
        low, high = 0, -1
        for start, chunk in self._token_chunks():
            chunk_low, chunk_high = int(chunk.min()), int(chunk.max())
            low, high = (chunk_low, chunk_high) if start == 0 else (min(low, chunk_low), max(high, chunk_high))
        return low, high

    def first_token_outside(self, limit: int) -> Optional[Tuple[int, int]]:
        """(document index, token id) of the first token whose id is not in [0, limit); None if there is none."""
        for start, chunk in self._token_chunks():
            outside = (chunk < 0) | (chunk >= limit)
            if outside.any():
                position = start + int(np.argmax(outside))
                itemsize = self.dtype.itemsize
                self.check_bytes(position * itemsize, (position + 1) * itemsize)  # damage is named as such
                item_ends = np.cumsum(self.sizes, dtype=np.int64)  # an empty item ends where it starts
                item = int(np.searchsorted(item_ends, position, side="right"))
                document = int(np.searchsorted(self.doc_idx, item, side="right")) - 1
                return document, int(chunk[position - start])
        return None

    @property
    def sidecar(self) -> Optional[checksums.Sidecar]:
        """The pair's checksum sidecar (its reads are checked against it); None without one."""
        return self._sidecar

    def check_bytes(self, start: int = 0, stop: Optional[int] = None) -> None:
        """Check the chunks of .bin bytes [start, stop) (the whole .bin by default) that this process has not
        checked yet against the sidecar; a no-op without one. Every read does this for the bytes it returns."""
        if self._unchecked is None:
            return
        if not self._unchecked.touch(start, self._index.data_bytes if stop is None else stop):
            self._unchecked = None  # every chunk checked

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        """int32[N]: tokens per item."""
        return self._index.sizes

    @property
    def doc_idx(self) -> np.ndarray:
        """int64[D]: first item of each document, ending with N."""
        return self._index.doc_idx

    def __len__(self) -> int:
        return len(self._index.sizes)

    def __getitem__(self, idx: Union[int, slice]):
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices with step {step} are not supported; only contiguous slices")
            if start >= stop:
                return []
            sizes = self.sizes[start:stop]
            count, pointer = int(sizes.sum(dtype=np.int64)), int(self._index.pointers[start])
            stop_byte = pointer + count * self.dtype.itemsize
            if self._unchecked is not None and not self._unchecked.touch(pointer, stop_byte):
                self._unchecked = None
            tokens = np.frombuffer(self._bin, dtype=self.dtype, count=count, offset=pointer)
            return np.split(tokens, np.cumsum(sizes[:-1], dtype=np.int64))
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of item ``idx`` (to the end of the item if length is None)."""
        n_items = len(self)
        if not -n_items <= idx < n_items:
            raise IndexError(f"item {idx} out of range for dataset {self._prefix} with {n_items} items")
        idx = int(idx) % n_items
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for item {idx} of size {size}")
        pointer = int(self._index.pointers[idx]) + offset * self.dtype.itemsize
        if self._unchecked is not None and not self._unchecked.touch(pointer, pointer + length * self.dtype.itemsize):
            self._unchecked = None  # every chunk checked: reads cost nothing more
        return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=pointer)

    @property
    def supports_prefetch(self) -> bool:
        return False

    @staticmethod
    def exists(path_prefix: str) -> bool:
        return os.path.exists(index_file_path(path_prefix)) and os.path.exists(data_file_path(path_prefix))


class MMapIndexedDatasetBuilder:
    """Streams items to ``bin_path``; ``finalize(idx_path)`` writes the index.

    Sizes and doc_idx are kept in compact ``array`` buffers (4 + 8 bytes per item), not Python lists.
    """

    def __init__(self, bin_path: str, dtype=np.int64):
        self._dtype = np.dtype(dtype)
        dtype_code(self._dtype)  # reject dtypes the format cannot name before writing anything
        self._bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        self._sizes = array("i")
        self._doc_idx = array("q", [0])

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def add_item(self, tokens) -> None:
        """Append one item (a document, or a sentence of one); accepts lists, numpy arrays, torch tensors."""
        if hasattr(tokens, "numpy") and not isinstance(tokens, np.ndarray):
            tokens = tokens.detach().cpu().numpy()
        values = np.asarray(tokens)
        if values.dtype.kind in "iub" and self._dtype.kind in "iu" and values.size:
            info = np.iinfo(self._dtype)
            low, high = values.min(), values.max()
            if low < info.min or high > info.max:
                raise ValueError(f"{self._bin_path}: token ids span [{low}, {high}], outside {self._dtype} range "
                                 f"[{info.min}, {info.max}]")
        self._data_file.write(values.astype(self._dtype, copy=False).tobytes(order="C"))
        self._sizes.append(values.size)

    def end_document(self) -> None:
        """Close the current document: the next item starts a new one."""
        self._doc_idx.append(len(self._sizes))

    def _check_document_boundary(self, action: str) -> None:
        open_items = len(self._sizes) - self._doc_idx[-1]
        if open_items:
            raise ValueError(f"{self._bin_path}: {open_items} item(s) added after the last end_document(); "
                             f"call end_document() before {action}")

    def merge_file_(self, another_prefix: str) -> None:
        """Append the dataset at ``another_prefix`` (items, documents and tokens) to this one."""
        self._check_document_boundary("merge_file_()")
        other = read_pair_index(another_prefix)
        if other.dtype != self._dtype:
            raise ValueError(f"cannot merge {another_prefix} ({other.dtype}) into {self._bin_path} ({self._dtype}): "
                             f"dtypes differ")
        offset = len(self._sizes)
        self._sizes.extend(other.sizes.astype(np.int32).tolist())
        self._doc_idx.extend((offset + other.doc_idx[1:]).tolist())
        with open(data_file_path(another_prefix), "rb") as f:
            shutil.copyfileobj(f, self._data_file)

    def finalize(self, idx_path: str) -> None:
        self._check_document_boundary("finalize()")
        self._data_file.close()
        write_index(idx_path, self._dtype, np.frombuffer(self._sizes, dtype=np.int32),
                    np.frombuffer(self._doc_idx, dtype=np.int64))

    def abort(self) -> None:
        """Close the data file without writing an index (the caller removes partial files)."""
        self._data_file.close()
