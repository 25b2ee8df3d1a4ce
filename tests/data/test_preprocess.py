"""tools/preprocess_data.py, tools/merge_datasets.py and tools/train_tokenizer.py end to end on a small corpus."""
import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron.data import preprocessing
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.errors import UserError
from megatron.tokenizer import build_tokenizer
from harness.corpus import make_bpe, make_corpus, make_spm, make_texts
from tools import merge_datasets, preprocess_data, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return make_bpe(str(tmp_path_factory.mktemp("bpe")), vocab_size=500)


def bpe_args(bpe_files, *extra):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe_files[0], "--merge-file", bpe_files[1],
            *extra]


def read_docs(prefix):
    ds = MMapIndexedDataset(prefix)
    assert ds.doc_idx.tolist() == list(range(len(ds) + 1))  # one item per document
    return [ds[i].tolist() for i in range(len(ds))]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_matches_direct_tokenization(tmp_path, bpe_files, workers):
    corpus = make_corpus(str(tmp_path))
    stats = preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "out"), "--append-eod",
                                  "--workers", str(workers), "--log-interval", "50", *bpe_args(bpe_files)])
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe_files)
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in make_texts()]
    assert read_docs(str(tmp_path / "out_text_document")) == expected
    assert MMapIndexedDataset(str(tmp_path / "out_text_document")).dtype == np.uint16
    assert (stats.docs, stats.tokens, stats.empty, stats.bad) == (300, sum(map(len, expected)), 0, 0)
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "out_text_document.bin", "out_text_document.crc.json",
                                       "out_text_document.idx"]


def test_multiple_keys_and_empty_documents(tmp_path, bpe_files):
    rows = [{"text": "hello world", "title": "A"}, {"text": "", "title": "B"}, {"text": "bye", "title": ""}, ""]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    stats = preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"),
                                  "--json-keys", "text", "title", *bpe_args(bpe_files)])
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe_files)
    assert read_docs(str(tmp_path / "o_text_document")) == [tokenizer.tokenize("hello world"),
                                                            tokenizer.tokenize("bye")]
    assert read_docs(str(tmp_path / "o_title_document")) == [tokenizer.tokenize("A"), tokenizer.tokenize("B")]
    assert (stats.docs, stats.empty) == (4, 4)  # the blank last line is an empty document for both keys


@pytest.mark.parametrize("text_format,expected", [
    ("lines", ["first doc", "second  doc", "", "third doc", "", "", "para two line two"]),
    ("paragraphs", ["first doc\nsecond  doc", "third doc", "para two line two"]),
])
def test_text_formats(tmp_path, bpe_files, text_format, expected):
    corpus = tmp_path / "c.txt"
    corpus.write_text("first doc\nsecond  doc\n\nthird doc\n\n\npara two line two\n", encoding="utf-8")
    stats = preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"),
                                  "--text-format", text_format, *bpe_args(bpe_files)])
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe_files)
    assert read_docs(str(tmp_path / "o_text_document")) == [tokenizer.tokenize(t) for t in expected if t]
    assert stats.empty == expected.count("")


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_fails_and_leaves_nothing(tmp_path, bpe_files, capsys, workers):
    rows = [{"text": f"document {i}"} for i in range(400)]
    rows[321] = '{"text": "unterminated'
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(UserError) as info:
        preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--workers",
                              str(workers), *bpe_args(bpe_files)])
    assert "c.jsonl:322: malformed JSON" in str(info.value) and "\n" not in str(info.value)
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_skip_bad_lines_counts(tmp_path, bpe_files):
    rows = [{"text": "good"}, "not json", {"other": "no text key"}, [1, 2], {"text": 3}, '{"text": "a\\ud800"}',
            '{"text": "emoji \\ud83d\\ude00 ok"}', {"text": "also good"}]
    corpus = write_jsonl(tmp_path / "c.jsonl", rows)
    with open(corpus, "ab") as f:
        f.write(b'{"text": "invalid utf-8 \xff"}\n')
    stats = preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--skip-bad-lines",
                                  "--workers", "2", *bpe_args(bpe_files)])
    assert (stats.docs, stats.bad) == (3, 6)
    assert len(read_docs(str(tmp_path / "o_text_document"))) == 3


def test_bad_key_names_line_and_keys(tmp_path, bpe_files):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"content": "x"}])
    with pytest.raises(UserError, match=r"c\.jsonl:1: no key 'text' \(keys: content\)"):
        preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), *bpe_args(bpe_files)])


def test_cli_errors_exit_nonzero_with_one_line(tmp_path, bpe_files):
    """Subprocess: the real exit status and stderr for a missing input and a missing vocab file."""
    corpus = make_corpus(str(tmp_path))
    cases = [(["--input", str(tmp_path / "missing.jsonl"), *bpe_args(bpe_files)], "missing.jsonl"),
             (["--input", corpus, *bpe_args((str(tmp_path / "nov.json"), bpe_files[1]))], "nov.json")]
    for argv, needle in cases:
        proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--output-prefix", str(tmp_path / "o"),
                               *argv], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr and proc.stderr.startswith("error: ")
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_sigterm_removes_temporary_outputs(tmp_path, bpe_files):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in make_texts(100) * 400])
    proc = subprocess.Popen([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
                             str(tmp_path / "out" / "o"), "--workers", "2", *bpe_args(bpe_files)],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out"):
        assert proc.poll() is None and time.time() < deadline, "preprocessing ended before it could be stopped"
        time.sleep(0.05)
    proc.terminate()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and stderr.strip().splitlines() == [
        "preprocess_data.py: error: terminated by signal 15; no output written"]
    assert os.listdir(tmp_path / "out") == []


def test_sentencepiece_with_extra_ids(tmp_path):
    model = make_spm(str(tmp_path), vocab_size=600)
    corpus = make_corpus(str(tmp_path))
    preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "o"), "--append-eod",
                          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                          "--vocab-extra-ids", "100", "--workers", "2"])
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model, vocab_extra_ids=100)
    docs = read_docs(str(tmp_path / "o_text_document"))
    assert docs == [tokenizer.tokenize(t) + [1] for t in make_texts()]
    assert [tokenizer.detokenize(d[:-1]) for d in docs[:20]] == make_texts()[:20]


def test_merge_datasets(tmp_path, bpe_files):
    parts = []
    for i in range(3):
        corpus = write_jsonl(tmp_path / f"c{i}.jsonl", [{"text": t} for t in make_texts(10 + i, seed=i)])
        preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "parts" / f"p{i}"),
                              *bpe_args(bpe_files)])
        parts.append(str(tmp_path / "parts" / f"p{i}_text_document"))
    merged = merge_datasets.main(["--input", *parts, "--output-prefix", str(tmp_path / "m")])
    expected = sum((read_docs(p) for p in parts), [])
    assert read_docs(str(tmp_path / "m")) == expected and len(merged.doc_idx) == 10 + 11 + 12 + 1
    merge_datasets.main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "m2")])
    assert (tmp_path / "m2.bin").read_bytes() == (tmp_path / "m.bin").read_bytes()
    assert (tmp_path / "m2.idx").read_bytes() == (tmp_path / "m.idx").read_bytes()


def _largest_id(prefix: str) -> int:
    return int(np.fromfile(prefix + ".bin", dtype=np.uint16).max())


def test_summary_lines_name_the_largest_id(tmp_path, bpe_files):
    """The CLIs' last line says the largest id written (preprocess: and the tokenizer's vocabulary)."""
    parts = []
    for i, n_docs in enumerate((40, 5)):
        corpus = write_jsonl(tmp_path / f"c{i}.jsonl", [{"text": t} for t in make_texts(n_docs, seed=i)])
        prefix = str(tmp_path / f"p{i}")
        proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
                               prefix, "--append-eod", *bpe_args(bpe_files)], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        parts.append(prefix + "_text_document")
        largest = _largest_id(parts[-1])
        assert f"(largest id {largest}, tokenizer vocabulary 500)" in proc.stderr.splitlines()[-1], proc.stderr
    proc = subprocess.run([sys.executable, "tools/merge_datasets.py", "--input", *parts, "--output-prefix",
                           str(tmp_path / "m")], cwd=REPO, capture_output=True, text=True, timeout=120)
    largest = max(map(_largest_id, parts))
    assert proc.returncode == 0 and largest == _largest_id(str(tmp_path / "m")) > _largest_id(parts[1])
    assert f"tokens (largest id {largest}) -> " in proc.stderr.splitlines()[-1], proc.stderr


def test_merge_rejects_mixed_dtypes(tmp_path):
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder

    for name, dtype in (("a", np.uint16), ("b", np.int32)):
        builder = MMapIndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=dtype)
        builder.add_item([1, 2])
        builder.end_document()
        builder.finalize(str(tmp_path / f"{name}.idx"))
    with pytest.raises(UserError, match=r"dtype mismatch: .*a is uint16 but .*b is int32"):
        merge_datasets.main(["--input", str(tmp_path / "a"), str(tmp_path / "b"), "--output-prefix",
                             str(tmp_path / "m")])
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx", "b.bin", "b.idx"]


def test_train_tokenizer_cli_on_text(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(make_texts(100)).replace("\n\n", "\n"), encoding="utf-8")
    vocab, merges = train_tokenizer.main(["--input", str(corpus), "--type", "bpe", "--vocab-size", "400",
                                          "--output-dir", str(tmp_path / "tok")])
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    assert tokenizer.vocab_size == 400 and tokenizer.eod == 0
    with pytest.raises(UserError, match="too small"):
        train_tokenizer.main(["--input", str(corpus), "--type", "bpe", "--vocab-size", "100",
                              "--output-dir", str(tmp_path / "tok2")])


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_train_tokenizer_bad_line_is_one_line_error(tmp_path, kind):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in make_texts(50)] + ['{"text": 1'])
    with pytest.raises(UserError, match=r"c\.jsonl:51: malformed JSON") as info:
        train_tokenizer.main(["--input", corpus, "--type", kind, "--vocab-size", "600", "--output-dir",
                              str(tmp_path / "tok")])
    assert "\n" not in str(info.value)
    assert not os.path.exists(tmp_path / "tok") or os.listdir(tmp_path / "tok") == []


def test_train_sentencepiece_too_small_vocab(tmp_path):
    corpus = make_corpus(str(tmp_path))
    with pytest.raises(UserError, match="sentencepiece training failed: .*Vocabulary size is smaller") as info:
        train_tokenizer.main(["--input", corpus, "--type", "sentencepiece", "--vocab-size", "100",
                              "--output-dir", str(tmp_path / "tok")])
    assert "\n" not in str(info.value)


def _square(x):
    time.sleep(0.0002)
    return x * x


def test_bounded_feeder_limits_read_ahead():
    """Pool.imap reads its whole input ahead unless fed through BoundedFeeder (the negative control)."""
    def run(limit):
        pulled, ahead = [0], 0

        def items():
            for i in range(2000):
                pulled[0] += 1
                yield i
        feeder = preprocessing.BoundedFeeder(items(), limit) if limit else items()
        with multiprocessing.Pool(2) as pool:
            for consumed, _ in enumerate(pool.imap(_square, feeder, 25), start=1):
                ahead = max(ahead, pulled[0] - consumed)
                time.sleep(0.0002)
                if limit:
                    feeder.done()
        return ahead
    assert run(limit=200) <= 200
    assert run(limit=None) > 1000
