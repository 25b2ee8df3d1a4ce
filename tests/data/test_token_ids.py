"""Token ids against the tokenizer: the .bin scan, its cache beside the index maps, the document it names, and
the check the GPT and T5 datasets run (blends included). End to end through the example scripts:
tests/training/test_token_ids_e2e.py."""
import json
import os

import numpy as np
import pytest

from megatron.data import indexed_dataset as ids
from megatron.data import token_ids as ti
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.t5_dataset import build_t5_datasets
from megatron.tokenizer import build_tokenizer
from harness.corpus import make_bpe


def write_docs(prefix: str, docs, dtype=np.uint16) -> MMapIndexedDataset:
    """docs: documents, each a list of items (lists of ids); empty items and documents allowed."""
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for item in doc:
            builder.add_item(np.asarray(item, dtype=np.int64))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return MMapIndexedDataset(prefix)


DOCS = [[[1, 2, 3], []], [], [[4], [], [5, 900, 6]], [[7, 901]]]  # 900 is in document 2, 901 in document 3


@pytest.mark.parametrize("chunk", [1, 2, 1 << 26])
def test_range_and_first_outside_across_chunks_and_empty_items(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(ids, "_SCAN_CHUNK_TOKENS", chunk)
    ds = write_docs(str(tmp_path / "d"), DOCS)
    assert ds.token_id_range() == (1, 901)
    assert ds.first_token_outside(900) == (2, 900)
    assert ds.first_token_outside(901) == (3, 901)
    assert ds.first_token_outside(902) is None
    assert ds.first_token_outside(6) == (2, 900)  # the first id >= 6 is 900, ahead of 6 and 7


def test_negative_ids_and_empty_dataset(tmp_path):
    ds = write_docs(str(tmp_path / "n"), [[[3]], [[2, -1]]], dtype=np.int32)
    assert ds.token_id_range() == (-1, 3) and ds.first_token_outside(10) == (1, -1)
    empty = write_docs(str(tmp_path / "e"), [])
    assert empty.token_id_range() == (0, -1) and empty.first_token_outside(1) is None


def test_scan_is_cached_and_a_changed_bin_is_scanned_again(tmp_path, monkeypatch):
    prefix = str(tmp_path / "d")
    ds = write_docs(prefix, DOCS)
    assert ti.cached_token_id_range(prefix, ds) == (1, 901)
    cached = json.loads(open(ti.cache_path(prefix)).read())
    assert (cached["low"], cached["high"], cached["bin_bytes"]) == (1, 901, os.path.getsize(prefix + ".bin"))
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # written under a temporary name, renamed

    def no_scan(self):
        raise AssertionError("scanned although the cache is valid")
    monkeypatch.setattr(MMapIndexedDataset, "token_id_range", no_scan)
    assert ti.cached_token_id_range(prefix, ds) == (1, 901)
    monkeypatch.undo()

    # the same documents with other ids, same .bin size, written under a new name and renamed over the old
    ds = write_docs(str(tmp_path / "new"), [[[1, 2, 3], []], [], [[4], [], [5, 9, 6]], [[7, 8]]])
    os.replace(str(tmp_path / "new.bin"), prefix + ".bin")
    assert ti.cached_token_id_range(prefix, MMapIndexedDataset(prefix)) == (1, 9)

    with open(ti.cache_path(prefix), "w") as f:
        f.write("{not json")  # a damaged cache is scanned again, not trusted
    assert ti.cached_token_id_range(prefix, MMapIndexedDataset(prefix)) == (1, 9)


def test_check_names_prefix_document_id_and_vocabulary(tmp_path):
    prefix = str(tmp_path / "d")
    ds = write_docs(prefix, DOCS)
    ti.check_token_ids(prefix, ds, ti.TokenLimit(902, "the tokenizer has 902 tokens"))
    with pytest.raises(ti.TokenIdError) as info:
        ti.check_token_ids(prefix, ds, ti.TokenLimit(900, "the tokenizer has 900 tokens"))
    message = str(info.value)
    assert message.startswith(f"--data-path {prefix}: document 2 holds token id 900 but the tokenizer has 900 "
                              f"tokens (ids 0..899; the data's ids span 1..901)"), message
    assert "\n" not in message


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return make_bpe(str(tmp_path_factory.mktemp("bpe")), vocab_size=500)


def test_limits_of_a_tokenizer_with_sentinels(bpe):
    plain, t5 = build_tokenizer("GPT2BPETokenizer", *bpe), build_tokenizer("GPT2BPETokenizer", *bpe,
                                                                           vocab_extra_ids=8)
    assert ti.vocabulary_limit(plain).size == ti.text_limit(plain).size == 500
    assert ti.vocabulary_limit(t5).size == 508
    assert ti.text_limit(t5) == ti.TokenLimit(500, "the tokenizer has 500 text tokens (ids 500..507 are its 8 "
                                                   "<extra_id_*> sentinels)")


def _docs_up_to(high: int, n_docs: int = 60):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 400, size=40).tolist()] for _ in range(n_docs)]
    docs[-7][0][5] = high
    return docs


def test_gpt_blend_names_the_prefix_with_the_bad_id(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    write_docs(good, _docs_up_to(499))
    write_docs(bad, _docs_up_to(700))
    limit = ti.TokenLimit(500, "the tokenizer has 500 tokens")
    datasets = build_train_valid_test_datasets([good], "90,10,0", [20, 4, 0], 16, 1, token_limit=limit)
    assert len(datasets[0]) >= 20
    with pytest.raises(ti.TokenIdError, match=f"--data-path {bad}: document 53 holds token id 700 but the "
                                              f"tokenizer has 500 tokens"):
        build_train_valid_test_datasets(["0.5", good, "0.5", bad], "90,10,0", [20, 4, 0], 16, 1, token_limit=limit)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bad_") and "indexmap" in p]  # checked first


def test_t5_data_may_not_hold_sentinel_ids(tmp_path, bpe):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe, vocab_extra_ids=8)
    prefix = str(tmp_path / "d")
    write_docs(prefix, _docs_up_to(499))
    assert len(build_t5_datasets([prefix], "100,0,0", [5, 0, 0], 32, 16, 1, tokenizer)[0]) >= 5
    write_docs(prefix, _docs_up_to(503))
    with pytest.raises(ti.TokenIdError, match=r"document 53 holds token id 503 but the tokenizer has 500 text "
                                              r"tokens \(ids 500\.\.507 are its 8 <extra_id_\*> sentinels\)"):
        build_t5_datasets([prefix], "100,0,0", [5, 0, 0], 32, 16, 1, tokenizer)
