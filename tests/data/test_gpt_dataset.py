"""GPT sample indexing against a literal port of Megatron v2.x's loops, on small real .bin/.idx files."""
import json
import os

import numpy as np
import pytest

from megatron.data import gpt_dataset as gd
from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder, data_file_path, \
    index_file_path
from megatron.tokenizer import build_tokenizer
from harness.corpus import make_bpe, make_corpus
from harness.dist import run_distributed
from tools import preprocess_data


def write_dataset(prefix: str, docs, dtype=np.int32) -> MMapIndexedDataset:
    """One item per document."""
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=dtype)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    return MMapIndexedDataset(prefix)


def unique_token_docs(sizes):
    """Documents whose tokens are 0, 1, 2, ... across the whole dataset (every token is distinguishable)."""
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    return [np.arange(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


# ---- reference: Megatron v2.6 gpt_dataset.py, loops as written there ----

def ref_num_epochs(tokens_per_epoch, seq_length, num_samples):
    num_epochs, total_tokens = 0, 0
    while True:
        num_epochs += 1
        total_tokens += tokens_per_epoch
        if ((total_tokens - 1) // seq_length) >= num_samples:
            return num_epochs


def ref_doc_idx(documents, num_epochs, np_rng, separate_last_epoch):
    if not separate_last_epoch or num_epochs == 1:
        doc_idx = np.mgrid[0:num_epochs, 0:len(documents)][1]
        doc_idx[:] = documents
        doc_idx = doc_idx.reshape(-1).astype(np.int32)
        np_rng.shuffle(doc_idx)
        return doc_idx
    first = ref_doc_idx(documents, num_epochs - 1, np_rng, False)
    last = ref_doc_idx(documents, 1, np_rng, False)
    return np.concatenate((first, last))


def ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch):
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_idx = np.zeros([num_samples + 1, 2], dtype=np.int32)
    sample_index, doc_idx_index, doc_offset = 1, 0, 0
    while sample_index <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[doc_idx_index]] - doc_offset
            remaining -= doc_length
            if remaining <= 0:
                doc_offset += remaining + doc_length - 1
                remaining = 0
            else:
                doc_idx_index += 1
                doc_offset = 0
        sample_idx[sample_index] = (doc_idx_index, doc_offset)
        sample_index += 1
    return sample_idx


def ref_index_arrays(sizes, documents, num_samples, seq_length, seed):
    tokens_per_epoch = int(np.sum(sizes[documents]))
    num_epochs = ref_num_epochs(tokens_per_epoch, seq_length, num_samples)
    np_rng = np.random.RandomState(seed=seed)
    separate = False
    if num_epochs > 1:
        n_prev = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        separate = (num_samples - n_prev) < int(0.80 * ((tokens_per_epoch - 1) // seq_length))
    doc_idx = ref_doc_idx(documents, num_epochs, np_rng, separate)
    sample_idx = ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    first = np.arange(n_prev if separate else total, dtype=np.uint32)
    np_rng.shuffle(first)
    shuffle_idx = first
    if separate:
        last = np.arange(n_prev, total, dtype=np.uint32)
        np_rng.shuffle(last)
        shuffle_idx = np.concatenate((first, last))
    return doc_idx, sample_idx, shuffle_idx, separate


# ---- pure functions ----

@pytest.mark.parametrize("split, m, expected", [
    ("949,50,1", 1000, [0, 949, 999, 1000]),
    ("949/50/1", 1000, [0, 949, 999, 1000]),
    ("1,1,1", 10, [0, 4, 7, 10]),      # round(3.33) * 3 = 9, every boundary shifted by +1
    ("2,1,1", 6, [0, 2, 4, 6]),        # round(3.0)=3, round(1.5)=2, round(1.5)=2 -> 7, shifted by -1
    ("100", 7, [0, 7, 7, 7]),
    ("98,2", 50, [0, 49, 50, 50]),
])
def test_parse_split(split, m, expected):
    assert gd.parse_split(split, m) == expected


def test_parse_split_rejects_bad_strings():
    with pytest.raises(ValueError, match="949;50"):
        gd.parse_split("949;50", 10)
    with pytest.raises(ValueError, match="positive sum"):
        gd.parse_split("0,0,0", 10)


def test_num_epochs_matches_loop():
    for tokens in (1, 2, 7, 100, 1001):
        for seq in (1, 3, 64):
            for n in (0, 1, 5, 99, 1000):
                assert gd.num_epochs_needed(tokens, seq, n) == ref_num_epochs(tokens, seq, n), (tokens, seq, n)


@pytest.mark.parametrize("seq_length", [1, 2, 7, 64, 300])
@pytest.mark.parametrize("num_epochs", [1, 4])
def test_sample_idx_matches_reference_loop(seq_length, num_epochs):
    rng = np.random.RandomState(seq_length * 10 + num_epochs)
    sizes = rng.randint(0, 120, size=200).astype(np.int32)   # includes empty documents
    sizes[0] = 0                                             # row 0 stays (0, 0) even for an empty first doc
    documents = np.arange(200, dtype=np.int32)
    doc_idx = np.tile(documents, num_epochs)
    rng.shuffle(doc_idx)
    first_zero = int(np.flatnonzero(doc_idx == 0)[0])
    doc_idx[[0, first_zero]] = doc_idx[[first_zero, 0]]
    tokens = int(sizes.sum())
    got = gd.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens)
    want = ref_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("num_samples, separate", [(5, False), (89, False), (95, True), (170, False), (290, True)])
def test_index_arrays_match_reference(num_samples, separate):
    rng = np.random.RandomState(3)
    sizes = rng.randint(1, 60, size=120).astype(np.int32)
    documents = np.arange(10, 110, dtype=np.int32)
    seq_length = 37
    want = ref_index_arrays(sizes, documents, num_samples, seq_length, seed=1234)
    assert want[3] == separate  # the case exercises the intended branch
    n_prev = gd.separate_last_epoch_samples(int(sizes[documents].sum()), seq_length, num_samples)
    assert (n_prev is not None) == separate
    got = gd.build_index_arrays(sizes, documents, num_samples, seq_length, seed=1234)
    for g, w in zip(got, want[:3]):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


# ---- GPTDataset on real files ----

def make_gpt(tmp_path, sizes, num_samples, seq_length, seed=7, documents=None):
    prefix = str(tmp_path / "corpus")
    indexed = write_dataset(prefix, unique_token_docs(sizes))
    documents = np.arange(len(sizes), dtype=np.int32) if documents is None else documents
    return gd.GPTDataset("train", prefix, documents, indexed, num_samples, seq_length, seed), prefix


def stream(ds):
    """All samples in unshuffled order joined on their shared token: positions [0, S*L] of the doc stream."""
    parts = [ds.tokens(j)[:-1] for j in range(len(ds))] + [ds.tokens(len(ds) - 1)[-1:]]
    return np.concatenate(parts)


@pytest.mark.parametrize("num_samples", [10, 66, 75, 300])  # 1 epoch; 1 full; 2 (last separate); 5 epochs
def test_every_token_of_every_document_in_each_epoch(tmp_path, num_samples):
    rng = np.random.RandomState(0)
    sizes = rng.randint(1, 40, size=30)
    seq_length = 9
    sizes[-1] += (1 - sizes.sum()) % seq_length  # T - 1 divisible by L: one epoch is an exact number of samples
    tokens_per_epoch = int(sizes.sum())
    ds, _ = make_gpt(tmp_path, sizes, num_samples, seq_length)
    epochs = gd.num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    assert len(ds) >= num_samples and len(ds.doc_idx) == epochs * len(sizes)
    np.testing.assert_array_equal(np.bincount(ds.doc_idx, minlength=len(sizes)), np.full(len(sizes), epochs))
    docs = unique_token_docs(sizes)
    got = stream(ds)
    covered = len(ds) * seq_length + 1
    np.testing.assert_array_equal(got, np.concatenate([docs[d] for d in ds.doc_idx])[:covered])
    counts = np.bincount(got, minlength=tokens_per_epoch)
    assert counts.min() >= epochs - 1 and counts.max() == epochs
    assert np.sum(counts == epochs - 1) == epochs * tokens_per_epoch - covered < seq_length
    n_prev = gd.separate_last_epoch_samples(tokens_per_epoch, seq_length, num_samples)
    if n_prev is not None:  # the first E-1 epochs are complete before the separately shuffled last one starts
        prev = np.bincount(got[: (epochs - 1) * tokens_per_epoch], minlength=tokens_per_epoch)
        np.testing.assert_array_equal(prev, np.full(tokens_per_epoch, epochs - 1))


def test_samples_overlap_by_one_token(tmp_path):
    sizes = np.random.RandomState(1).randint(1, 50, size=40)
    ds, _ = make_gpt(tmp_path, sizes, 60, 16)
    for j in range(len(ds) - 1):
        a, b = ds.tokens(j), ds.tokens(j + 1)
        assert len(a) == 17 and a[-1] == b[0]
        assert len(np.intersect1d(a, b)) == 1  # unique tokens: nothing else is shared
    for i in range(len(ds)):
        text = ds[i]["text"]
        assert text.dtype == np.int64 and text.shape == (17,)
        np.testing.assert_array_equal(text, ds.tokens(int(ds.shuffle_idx[i])))


def test_index_cached_and_deterministic(tmp_path, monkeypatch):
    sizes = np.random.RandomState(2).randint(1, 50, size=40)
    ds1, prefix = make_gpt(tmp_path, sizes, 100, 16)
    paths = gd.index_file_names(prefix, "train", 100, 16, 7)
    assert [os.path.basename(p) for p in paths] == [
        f"corpus_train_indexmap_100ns_16sl_7s_{k}_idx.npy" for k in ("doc", "sample", "shuffle")]
    mtimes = [os.stat(p).st_mtime_ns for p in paths]
    first = [np.array(a) for a in (ds1.doc_idx, ds1.sample_idx, ds1.shuffle_idx)]

    def no_rebuild(*args, **kwargs):
        raise AssertionError("index rebuilt although cached files exist")
    monkeypatch.setattr(gd, "build_index_arrays", no_rebuild)
    ds2 = gd.GPTDataset("train", prefix, np.arange(40, dtype=np.int32), MMapIndexedDataset(prefix), 100, 16, 7)
    assert [os.stat(p).st_mtime_ns for p in paths] == mtimes
    assert isinstance(ds2.sample_idx, np.memmap)
    monkeypatch.undo()
    for p in paths:
        os.remove(p)
    ds3, _ = make_gpt(tmp_path, sizes, 100, 16)  # rebuilt from scratch: identical arrays
    for a, b in zip(first, (ds3.doc_idx, ds3.sample_idx, ds3.shuffle_idx)):
        np.testing.assert_array_equal(a, b)
    assert not [f for f in os.listdir(tmp_path) if ".tmp" in f]


def test_stale_cache_for_other_documents_is_rejected(tmp_path):
    sizes = np.full(40, 10)
    _, prefix = make_gpt(tmp_path, sizes, 20, 16)
    with pytest.raises(ValueError, match="split or data changed"):
        gd.GPTDataset("train", prefix, np.arange(30, dtype=np.int32), MMapIndexedDataset(prefix), 20, 16, 7)


def _build_on_ranks(prefix):
    calls = []
    real = gd.build_index_arrays
    gd.build_index_arrays = lambda *a, **k: calls.append(1) or real(*a, **k)
    ds = gd.GPTDataset("train", prefix, np.arange(20, dtype=np.int32), MMapIndexedDataset(prefix), 50, 8, 3)
    return len(calls), np.array(ds.shuffle_idx).tolist()


def test_index_built_by_rank_zero_only(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_dataset(prefix, unique_token_docs(np.full(20, 13)))
    results = run_distributed(_build_on_ranks, 2, prefix, timeout=120)
    assert [calls for calls, _ in results] == [1, 0]
    assert results[0][1] == results[1][1]


def test_build_train_valid_test_datasets(tmp_path):
    prefix = str(tmp_path / "a")
    write_dataset(prefix, unique_token_docs(np.full(100, 20)))
    train, valid, test = gd.build_train_valid_test_datasets([prefix], "80,10,10", [50, 10, 0], 32, seed=5)
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 0
    assert set(np.asarray(train.doc_idx)) == set(range(80))
    assert set(np.asarray(valid.doc_idx)) == set(range(80, 90))
    assert train[0]["text"].shape == (33,)
    none_test = gd.build_train_valid_test_datasets([prefix], "90,10", [5, 5, 5], 32, seed=5)[2]
    assert none_test is None


def test_build_blended_datasets(tmp_path):
    write_dataset(str(tmp_path / "a"), [np.full(20, 1)] * 100)
    write_dataset(str(tmp_path / "b"), [np.full(20, 2)] * 100)
    blend = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")]
    train, valid, test = gd.build_train_valid_test_datasets(blend, "90,10,0", [200, 20, 0], 16, seed=1)
    assert isinstance(train, BlendableDataset) and len(train) == 200 and len(valid) == 20 and test is None
    first_tokens = np.array([train[i]["text"][0] for i in range(200)])
    assert abs(np.sum(first_tokens == 1) - 60) <= 1
    assert os.path.isfile(gd.index_file_names(str(tmp_path / "a"), "train", 61, 16, 1)[0])  # ceil(200*.3*1.005)


def test_end_to_end_with_bpe_and_preprocess(tmp_path):
    vocab, merges = make_bpe(str(tmp_path), 500)
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    corpus = make_corpus(str(tmp_path))
    preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "gpt"), "--tokenizer-type",
                          "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges, "--append-eod"])
    prefix = str(tmp_path / "gpt_text_document")
    train, valid, _ = gd.build_train_valid_test_datasets([prefix], "90,10,0", [100, 10, 0], 64, seed=2)
    indexed = MMapIndexedDataset(prefix)
    assert len(indexed) == 300 and train[0]["text"].shape == (65,)
    joined = np.concatenate([indexed[int(d)] for d in train.doc_idx]).astype(np.int64)
    assert np.array_equal(stream(train), joined[: len(train) * 64 + 1])
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    first_doc = int(train.doc_idx[0])
    assert tokenizer.detokenize(train.tokens(0)[:20].tolist()) == tokenizer.detokenize(
        tokenizer.tokenize(texts[first_doc])[:20])
