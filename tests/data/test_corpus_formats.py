"""Corpora as they ship: .jsonl.gz, .jsonl.zst and Parquet give the plain jsonl's .bin/.idx byte for byte, and a
damaged file is one line naming it, with nothing left behind."""
import gzip
import json
import os
import subprocess
import sys

import pytest

from megatron.data.corpus import resolve_format
from megatron.errors import UserError
from harness.corpus import make_bpe, make_texts
from tools import preprocess_data, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return make_bpe(str(tmp_path_factory.mktemp("bpe")), vocab_size=500)


def jsonl_bytes(texts):
    return "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(texts)).encode("utf-8")


def write_gz(path, texts):
    path.write_bytes(gzip.compress(jsonl_bytes(texts)))
    return path


def write_zst(path, texts, frames=3):
    """Several frames (as pzstd and concatenated shards give), each with its checksum (the zstd CLI's default)."""
    import zstandard

    step = len(texts) // frames + 1
    compressor = zstandard.ZstdCompressor(write_checksum=True)
    path.write_bytes(b"".join(compressor.compress(jsonl_bytes(texts[i:i + step])) for i in range(0, len(texts), step)))
    return path


def write_parquet(path, columns, row_group_size=64):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
    return path


WRITERS = {
    "corpus.jsonl.gz": write_gz,
    "corpus.jsonl.zst": write_zst,
    "corpus.parquet": lambda path, texts: write_parquet(path, {"n": list(range(len(texts))), "text": texts}),
}


def run(corpus, prefix, bpe_files, workers=1, *extra):
    return preprocess_data.main(["--input", str(corpus), "--output-prefix", str(prefix), "--append-eod",
                                 "--workers", str(workers), "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
                                 bpe_files[0], "--merge-file", bpe_files[1], "--log-interval", "100", *extra])


def test_auto_format_by_suffix():
    assert [resolve_format(p, "auto") for p in ("a.jsonl.gz", "a.json.zst", "a.JSONL.ZSTD", "a.parquet",
                                                "a.txt.gz", "a.gz", "a.jsonl")] == \
        ["jsonl", "jsonl", "jsonl", "parquet", "lines", "lines", "jsonl"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name", sorted(WRITERS))
def test_byte_identical_to_plain_jsonl(tmp_path, bpe_files, name, workers):
    texts = make_texts(700) + [""]  # the empty text is an empty document in every format
    plain = tmp_path / "corpus.jsonl"
    plain.write_bytes(jsonl_bytes(texts))
    expected = run(plain, tmp_path / "plain", bpe_files)
    stats = run(WRITERS[name](tmp_path / name, texts), tmp_path / "other", bpe_files, workers)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"other_text_document{suffix}").read_bytes() == \
            (tmp_path / f"plain_text_document{suffix}").read_bytes()
    assert (stats.docs, stats.tokens, stats.empty) == (expected.docs, expected.tokens, expected.empty) == \
        (701, expected.tokens, 1)


@pytest.mark.parametrize("text_format", ["lines", "paragraphs"])
def test_compressed_text_formats(tmp_path, bpe_files, text_format):
    text = "\n".join(make_texts(100)).encode("utf-8")
    (tmp_path / "c.txt").write_bytes(text)
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(text))
    for name in ("c.txt", "c.txt.gz"):
        run(tmp_path / name, tmp_path / name.replace(".", "-"), bpe_files, 1, "--text-format", text_format)
    assert (tmp_path / "c-txt-gz_text_document.bin").read_bytes() == (tmp_path / "c-txt_text_document.bin").read_bytes()


def test_parquet_several_columns(tmp_path, bpe_files):
    """--json-keys names the columns, one output each, as with jsonl keys."""
    texts = make_texts(50)
    titles = [t[:10] for t in texts]
    path = write_parquet(tmp_path / "c.parquet", {"title": titles, "text": texts}, row_group_size=7)
    run(path, tmp_path / "o", bpe_files, 2, "--json-keys", "text", "title")
    plain = tmp_path / "c.jsonl"
    plain.write_text("".join(json.dumps({"text": a, "title": b}) + "\n" for a, b in zip(texts, titles)))
    run(plain, tmp_path / "p", bpe_files, 1, "--json-keys", "text", "title")
    for key in ("text", "title"):
        assert (tmp_path / f"o_{key}_document.bin").read_bytes() == (tmp_path / f"p_{key}_document.bin").read_bytes()


def _damaged(tmp_path, kind):
    """(path, words of the message) of a damaged file of each kind."""
    texts = make_texts(400)
    if kind == "gzip-truncated":
        blob = gzip.compress(jsonl_bytes(texts))
        return _write(tmp_path / "c.jsonl.gz", blob[: len(blob) // 2]), "damaged gzip stream after line"
    if kind == "gzip-crc":  # damage inside the deflate data may first show as a malformed line; the CRC is last
        blob = bytearray(gzip.compress(jsonl_bytes(texts)))
        blob[-8] ^= 0x55
        return _write(tmp_path / "c.jsonl.gz", bytes(blob)), "damaged gzip stream after line 400: CRC check failed"
    if kind == "gzip-not":
        return _write(tmp_path / "c.jsonl.gz", jsonl_bytes(texts)), "gzip stream before the first line: Not a gzip"
    if kind == "zstd-truncated":
        blob = write_zst(tmp_path / "c.jsonl.zst", texts, frames=2).read_bytes()
        return _write(tmp_path / "c.jsonl.zst", blob[: len(blob) * 3 // 4]), "ends inside a zstd frame (truncated)"
    if kind == "zstd-corrupt":
        blob = bytearray(write_zst(tmp_path / "c.jsonl.zst", texts, frames=1).read_bytes())
        blob[len(blob) // 2] ^= 0x55
        return _write(tmp_path / "c.jsonl.zst", bytes(blob)), "damaged zstd stream"
    path = write_parquet(tmp_path / "c.parquet", {"text": texts, "n": list(range(len(texts)))})
    if kind == "parquet-footer":
        return _write(path, path.read_bytes()[:-100]), "not a readable Parquet file"
    if kind == "parquet-column":
        return path, "c.parquet: no column 'body' (columns: text, n); see --json-keys"
    if kind == "parquet-type":
        return path, "c.parquet: column 'n' holds int64, expected strings"
    return write_parquet(path, {"text": texts[:300] + [None] + texts[301:]}), \
        "c.parquet: row 300: column 'text' is null; use --skip-bad-lines"


def _write(path, blob):
    path.write_bytes(blob)
    return path


DAMAGED = ["gzip-truncated", "gzip-crc", "gzip-not", "zstd-truncated", "zstd-corrupt", "parquet-footer",
           "parquet-column", "parquet-type", "parquet-null"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", DAMAGED)
def test_damaged_file_is_one_line_and_leaves_nothing(tmp_path, bpe_files, kind, workers):
    path, words = _damaged(tmp_path, kind)
    keys = {"parquet-column": ["body"], "parquet-type": ["n"]}.get(kind, ["text"])
    with pytest.raises(UserError) as info:
        run(path, tmp_path / "out" / "o", bpe_files, workers, "--json-keys", *keys)
    message = str(info.value)
    assert words in message and message.startswith(str(path)) and "\n" not in message, message
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_parquet_null_rows_can_be_skipped(tmp_path, bpe_files):
    path, _ = _damaged(tmp_path, "parquet-null")
    stats = run(path, tmp_path / "o", bpe_files, 2, "--skip-bad-lines")
    assert (stats.docs, stats.bad) == (399, 1)


@pytest.mark.parametrize("kind", ["zstd-truncated", "parquet-footer"])
def test_damaged_file_exits_2_from_the_cli(tmp_path, bpe_files, kind):
    path, words = _damaged(tmp_path, kind)
    proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(path), "--output-prefix",
                           str(tmp_path / "out" / "o"), "--workers", "2", "--tokenizer-type", "GPT2BPETokenizer",
                           "--vocab-file", bpe_files[0], "--merge-file", bpe_files[1]],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: {path}") and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_train_tokenizer_reads_each_format(tmp_path, name):
    texts = make_texts(200)
    plain = tmp_path / "corpus.jsonl"
    plain.write_bytes(jsonl_bytes(texts))
    paths = {}
    for corpus in (plain, WRITERS[name](tmp_path / name, texts)):
        out = tmp_path / f"tok-{corpus.name}"
        paths[corpus.name] = train_tokenizer.main(["--input", str(corpus), "--type", "hf-bpe", "--vocab-size", "400",
                                                   "--output-dir", str(out)])
        assert sorted(os.listdir(out)) == ["tokenizer.json", "tokenizer_config.json"]
    mine, reference = (open(paths[n][0], encoding="utf-8").read() for n in (name, plain.name))
    assert mine == reference


def test_train_tokenizer_damaged_file_is_one_line(tmp_path):
    path, words = _damaged(tmp_path, "gzip-truncated")
    with pytest.raises(UserError, match=words) as info:
        train_tokenizer.main(["--input", str(path), "--type", "hf-bpe", "--vocab-size", "400", "--output-dir",
                              str(tmp_path / "tok")])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "tok").exists() or os.listdir(tmp_path / "tok") == []
