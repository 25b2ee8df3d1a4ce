"""MMIDIDX v1 .bin/.idx: our builder/reader against an independent reader/writer written from the format table."""
import os
import pickle
import struct

import numpy as np
import pytest

from megatron.data import indexed_dataset as ids

# ---- independent implementation, straight from the format table (no import of the module under test) ----
REF_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float64,
             8: np.uint16}


def ref_write(prefix, docs, dtype):
    """docs: list of documents, each a list of items (lists of ints)."""
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.int64): 5}[np.dtype(dtype)]
    items = [item for doc in docs for item in doc]
    sizes = [len(item) for item in items]
    itemsize = np.dtype(dtype).itemsize
    pointers, pos = [], 0
    for size in sizes:
        pointers.append(pos)
        pos += size * itemsize
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(prefix + ".bin", "wb") as f:
        for item in items:
            f.write(np.array(item, dtype=np.dtype(dtype).newbyteorder("<")).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sizes), len(doc_idx)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(sizes)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def ref_read(prefix):
    """-> (dtype, items as lists, doc_idx list)."""
    with open(prefix + ".idx", "rb") as f:
        data = f.read()
    assert data[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack("<QBQQ", data[9:34])
    assert version == 1 and len(data) == 34 + 12 * n + 8 * d
    sizes = struct.unpack(f"<{n}i", data[34:34 + 4 * n])
    pointers = struct.unpack(f"<{n}q", data[34 + 4 * n:34 + 12 * n])
    doc_idx = list(struct.unpack(f"<{d}q", data[34 + 12 * n:]))
    dtype = np.dtype(REF_CODES[code]).newbyteorder("<")
    with open(prefix + ".bin", "rb") as f:
        blob = f.read()
    items = [np.frombuffer(blob, dtype, count=s, offset=p).tolist() for s, p in zip(sizes, pointers)]
    return np.dtype(REF_CODES[code]), items, doc_idx


def random_docs(seed, n_docs=20, high=500):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, high, size=rng.integers(0, 30)).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(n_docs)]


def build(prefix, docs, dtype):
    builder = ids.MMapIndexedDatasetBuilder(ids.data_file_path(prefix), dtype=dtype)
    for doc in docs:
        for item in doc:
            builder.add_item(np.array(item, dtype=np.int64))
        builder.end_document()
    builder.finalize(ids.index_file_path(prefix))


def doc_index(docs):
    return np.cumsum([0] + [len(d) for d in docs]).tolist()


# ---- acceptance: both directions ----
@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_builder_output_read_by_independent_reader(tmp_path, dtype):
    docs = random_docs(0, high=60000 if dtype == np.uint16 else 2**31 - 1)
    build(str(tmp_path / "d"), docs, dtype)
    ref_dtype, items, doc_idx = ref_read(str(tmp_path / "d"))
    assert ref_dtype == np.dtype(dtype)
    assert items == [item for doc in docs for item in doc]
    assert doc_idx == doc_index(docs)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_independent_writer_read_by_our_reader(tmp_path, dtype):
    docs = random_docs(1)
    ref_write(str(tmp_path / "d"), docs, dtype)
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"), vocab_size=500)
    flat = [item for doc in docs for item in doc]
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(flat)
    assert [ds[i].tolist() for i in range(len(ds))] == flat
    assert ds.sizes.dtype == np.int32 and ds.sizes.tolist() == [len(x) for x in flat]
    assert ds.doc_idx.dtype == np.int64 and ds.doc_idx.tolist() == doc_index(docs)


def test_builder_bytes_equal_independent_writer(tmp_path):
    docs = random_docs(2)
    build(str(tmp_path / "ours"), docs, np.uint16)
    ref_write(str(tmp_path / "ref"), docs, np.uint16)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()


# ---- reader API ----
def test_items_are_views_and_slices_split(tmp_path):
    docs = random_docs(3)
    build(str(tmp_path / "d"), docs, np.uint16)
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"), skip_warmup=False)
    flat = [item for doc in docs for item in doc]
    item = ds[5]
    assert not item.flags.owndata and not item.flags.writeable
    assert ds[-1].tolist() == flat[-1]
    assert [x.tolist() for x in ds[3:9]] == flat[3:9]
    assert ds[4:4] == []
    with pytest.raises(ValueError, match="step"):
        ds[0:10:2]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_pickle_reopens_files(tmp_path):
    docs = random_docs(8)
    build(str(tmp_path / "d"), docs, np.uint16)
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"))
    blob = pickle.dumps(ds)
    assert len(blob) < 200  # the prefix, not the tokens
    copy = pickle.loads(blob)
    assert [copy[i].tolist() for i in range(len(copy))] == [item for doc in docs for item in doc]


def test_get_offset_length(tmp_path):
    build(str(tmp_path / "d"), [[list(range(10))], [list(range(100, 105))]], np.uint16)
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"))
    assert ds.get(0, offset=3, length=4).tolist() == [3, 4, 5, 6]
    assert ds.get(1, offset=2).tolist() == [102, 103, 104]
    with pytest.raises(IndexError, match="out of range"):
        ds.get(1, offset=3, length=5)


def test_empty_dataset(tmp_path):
    build(str(tmp_path / "d"), [], np.uint16)
    ds = ids.MMapIndexedDataset(str(tmp_path / "d"), vocab_size=10)
    assert len(ds) == 0 and ds.doc_idx.tolist() == [0]
    assert ids.MMapIndexedDataset.exists(str(tmp_path / "d")) and not ids.MMapIndexedDataset.exists("nope")


def test_best_fitting_dtype_and_paths():
    assert ids.best_fitting_dtype(50257) == np.uint16
    assert ids.best_fitting_dtype(65499) == np.uint16
    assert ids.best_fitting_dtype(65500) == np.int32
    assert ids.data_file_path("a/b") == "a/b.bin" and ids.index_file_path("a/b") == "a/b.idx"


# ---- builder ----
def test_merge_file_appends_doc_idx(tmp_path):
    a, b = random_docs(4, n_docs=5), random_docs(5, n_docs=7)
    build(str(tmp_path / "a"), a, np.uint16)
    build(str(tmp_path / "b"), b, np.uint16)
    builder = ids.MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    builder.merge_file_(str(tmp_path / "a"))
    builder.merge_file_(str(tmp_path / "b"))
    builder.finalize(str(tmp_path / "m.idx"))
    _, items, doc_idx = ref_read(str(tmp_path / "m"))
    assert items == [item for doc in a + b for item in doc]
    assert doc_idx == doc_index(a + b)


def test_merge_rejects_other_dtype(tmp_path):
    build(str(tmp_path / "a"), random_docs(6, n_docs=2), np.int32)
    builder = ids.MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match="dtypes differ"):
        builder.merge_file_(str(tmp_path / "a"))


def test_builder_errors(tmp_path):
    builder = ids.MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.uint16)
    with pytest.raises(ValueError, match=r"\[0, 70000\].*uint16"):
        builder.add_item([0, 70000])
    builder.add_item([1, 2])
    with pytest.raises(ValueError, match="end_document"):
        builder.finalize(str(tmp_path / "d.idx"))
    with pytest.raises(ValueError, match="no MMIDIDX code"):
        ids.MMapIndexedDatasetBuilder(str(tmp_path / "e.bin"), dtype=np.float16)


# ---- validation: one-line errors naming the file ----
def _corrupt(tmp_path, edit):
    prefix = str(tmp_path / "d")
    ref_write(prefix, [[[1, 2, 3], [4]], [[5, 6]]], np.uint16)
    edit(prefix)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path, n_bytes):
    with open(path, "r+b") as f:
        f.truncate(n_bytes)


# N = 3 items, D = 3: sizes at 34, pointers at 46, doc_idx at 70, file length 94.
CORRUPTIONS = {
    "magic": (lambda p: _patch(p + ".idx", 0, b"TNTIDX\x00\x00\x00"), r"d\.idx: bad magic"),
    "version": (lambda p: _patch(p + ".idx", 9, struct.pack("<Q", 2)), r"d\.idx: unsupported index version 2"),
    "dtype code": (lambda p: _patch(p + ".idx", 17, bytes([9])), r"d\.idx: unknown dtype code 9"),
    "short header": (lambda p: _truncate(p + ".idx", 20), r"d\.idx: truncated index"),
    "short arrays": (lambda p: _truncate(p + ".idx", 90), r"d\.idx: corrupt index, 90 bytes"),
    "pointer": (lambda p: _patch(p + ".idx", 46 + 8, struct.pack("<q", 4)), r"d\.idx: corrupt index, pointer\[1\]"),
    "negative size": (lambda p: _patch(p + ".idx", 34, struct.pack("<i", -1)), r"d\.idx: .*negative item size"),
    "doc_idx": (lambda p: _patch(p + ".idx", 70 + 16, struct.pack("<q", 2)), r"d\.idx: corrupt index, doc_idx"),
    "bin size": (lambda p: _truncate(p + ".bin", 10), r"d\.bin: 10 bytes but .*d\.idx implies 12"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_files_are_rejected(tmp_path, name):
    edit, pattern = CORRUPTIONS[name]
    prefix = _corrupt(tmp_path, edit)
    with pytest.raises(ids.IndexedDatasetError, match=pattern) as info:
        ids.MMapIndexedDataset(prefix)
    assert "\n" not in str(info.value)


def test_vocab_size_check(tmp_path):
    prefix = _corrupt(tmp_path, lambda p: None)
    assert len(ids.MMapIndexedDataset(prefix, vocab_size=7)) == 3
    with pytest.raises(ids.IndexedDatasetError, match=r"d\.bin: token ids span \[1, 6\] but vocab_size is 6"):
        ids.MMapIndexedDataset(prefix, vocab_size=6)


def test_missing_files(tmp_path):
    prefix = _corrupt(tmp_path, lambda p: os.remove(p + ".bin"))
    with pytest.raises(FileNotFoundError, match=r"d\.bin"):
        ids.MMapIndexedDataset(prefix)
