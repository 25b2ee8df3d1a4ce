"""The checksum sidecar `<prefix>.crc.json` (megatron/data/checksums.py): written by preprocess_data.py,
merge_datasets.py and checksum_data.py; the .idx checked at open, each .bin chunk at its first read (DataLoader
workers too); the pair's bytes and reads unchanged. Expected checksums are computed here with zlib on the files'
bytes, and expected pairs with the independent MMIDIDX writer of test_indexed_dataset."""
import json
import os
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest

from megatron.data import checksums
from megatron.data.checksum_data import add_sidecar, verify_pair
from megatron.data.checksums import DataChecksumError
from megatron.data.gpt_dataset import build_train_valid_test_datasets
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.samplers import build_pretraining_data_loader
from megatron.errors import report_user_error, worker_message
from megatron.tokenizer import build_tokenizer
from harness.corpus import make_bpe, make_corpus, make_texts
from tests.data.test_indexed_dataset import random_docs, ref_read, ref_write
from tools import merge_datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK = 256  # bytes: the test pairs (~2 KB of .bin) span several chunks
FIX = "the file is damaged; re-copy it or re-run tools/preprocess_data.py"


def make_pair(prefix: str, seed: int = 0, chunk_bytes=CHUNK) -> str:
    """A uint16 pair of 20 documents (~1.7 KB of .bin) by the independent writer, with a sidecar unless
    chunk_bytes is None."""
    ref_write(prefix, random_docs(seed), np.uint16)
    if chunk_bytes is not None:
        add_sidecar(prefix, chunk_bytes)
    return prefix


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def crc(data: bytes) -> str:
    return f"0x{zlib.crc32(data):08x}"


def chunk_message(prefix: str, good: bytes, bad: bytes, chunk: int, chunk_bytes: int = CHUNK) -> str:
    start, stop = chunk * chunk_bytes, min((chunk + 1) * chunk_bytes, len(good))
    return (f"{prefix}.bin: bytes {start}..{stop - 1} (chunk {chunk}) fail their CRC-32 ({prefix}.crc.json says "
            f"{crc(good[start:stop])}, read {crc(bad[start:stop])}): {FIX}")


def item_spans(ds: MMapIndexedDataset) -> list:
    """[start, stop) bytes of each item in the .bin."""
    ends = np.cumsum(ds.sizes, dtype=np.int64) * ds.dtype.itemsize
    return list(zip([0, *ends[:-1].tolist()], ends.tolist()))


def test_the_sidecar_holds_a_crc_per_chunk_and_one_for_the_idx(tmp_path):
    prefix = make_pair(str(tmp_path / "d"))
    data, index = open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()
    assert json.load(open(prefix + ".crc.json")) == {
        "format": "megatron-tds-data-crc", "version": 1, "chunk_bytes": CHUNK, "bin_bytes": len(data),
        "idx_bytes": len(index), "idx_crc32": f"{zlib.crc32(index):08x}",
        "bin_crc32": [f"{zlib.crc32(data[i:i + CHUNK]):08x}" for i in range(0, len(data), CHUNK)]}
    assert len(data) > 5 * CHUNK and len(data) % CHUNK  # several chunks, the last one short


@pytest.mark.parametrize("where", ["first chunk", "middle chunk", "last byte"])
def test_a_flipped_bin_byte_is_refused_at_the_first_read_of_its_chunk_and_not_before(tmp_path, where):
    prefix = make_pair(str(tmp_path / "d"))
    good = open(prefix + ".bin", "rb").read()
    offset = {"first chunk": 5, "middle chunk": 3 * CHUNK + 17, "last byte": len(good) - 1}[where]
    flip(prefix + ".bin", offset)
    bad, chunk = open(prefix + ".bin", "rb").read(), offset // CHUNK
    message = chunk_message(prefix, good, bad, chunk)
    ds = MMapIndexedDataset(prefix)  # the .idx is intact: opening succeeds
    spans = item_spans(ds)
    touching = [i for i, (a, b) in enumerate(spans) if b > a and a // CHUNK <= chunk <= (b - 1) // CHUNK]
    for i in (i for i in range(len(ds)) if i not in touching):
        ds[i]  # every item outside the damaged chunk reads
    for i in touching:
        with pytest.raises(DataChecksumError) as info:
            ds[i]
        assert str(info.value) == message  # and again: a failed chunk is not marked as checked
    with pytest.raises(DataChecksumError, match=f"^{re.escape(message)}$"):
        ds[0:len(ds)]
    with pytest.raises(DataChecksumError):
        ds.get(touching[0], offset=0, length=int(ds.sizes[touching[0]]))


def test_a_flipped_idx_byte_is_refused_at_open(tmp_path):
    prefix = make_pair(str(tmp_path / "d"))
    good = open(prefix + ".idx", "rb").read()
    flip(prefix + ".idx", 40)  # inside sizes[]: named as damage, before the index is parsed
    bad = open(prefix + ".idx", "rb").read()
    with pytest.raises(DataChecksumError) as info:
        MMapIndexedDataset(prefix)
    assert str(info.value) == (f"{prefix}.idx: bytes 0..{len(good) - 1} fail their CRC-32 ({prefix}.crc.json says "
                               f"{crc(good)}, read {crc(bad)}): {FIX}")


def test_a_sidecar_of_other_sizes_is_refused_naming_both(tmp_path):
    prefix = make_pair(str(tmp_path / "d"))
    bin_bytes, idx_bytes = os.path.getsize(prefix + ".bin"), os.path.getsize(prefix + ".idx")
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(bin_bytes - 2)
    with pytest.raises(DataChecksumError) as info:
        MMapIndexedDataset(prefix)
    assert str(info.value) == (
        f"{prefix}.crc.json describes a .bin of {bin_bytes} bytes and a .idx of {idx_bytes} but {prefix}.bin has "
        f"{bin_bytes - 2} and {prefix}.idx has {idx_bytes}: a file was cut short or replaced; re-copy the pair, or if "
        f"it is right, write its sidecar again (python tools/checksum_data.py --overwrite --data-path {prefix})")


@pytest.mark.parametrize("edit,reason", [
    (lambda s: s[:-10], "line 1 column"),
    (lambda s: s.replace("megatron-tds-data-crc", "other"), 'no "format": "megatron-tds-data-crc"'),
    (lambda s: s.replace('"version":1', '"version":2'), "version 2, this reader knows version 1"),
    (lambda s: s.replace('"bin_crc32":["', '"bin_crc32":["x'), "bin_crc32 is not a list of 8-hex-digit"),
    (lambda s: s.replace('"bin_crc32":["', '"bin_crc32":["00000000","'), "chunk checksums for"),
])
def test_a_damaged_sidecar_is_refused_naming_it(tmp_path, edit, reason):
    prefix = make_pair(str(tmp_path / "d"))
    path = prefix + ".crc.json"
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(edit(text))
    with pytest.raises(DataChecksumError) as info:
        MMapIndexedDataset(prefix)
    message = str(info.value)
    assert message.startswith(f"{path}: not a readable checksum sidecar (") and reason in message, message
    assert message.endswith(f"a good copy of the pair (python tools/checksum_data.py --overwrite --data-path "
                            f"{prefix}), or delete it to read the pair unverified") and "\n" not in message


def test_reads_are_the_same_with_and_without_the_sidecar_and_each_chunk_is_checked_once(tmp_path, monkeypatch):
    prefix = make_pair(str(tmp_path / "d"))
    checked = []
    original = checksums.ChunkChecks._check
    monkeypatch.setattr(checksums.ChunkChecks, "_check", lambda self, k: (checked.append(k), original(self, k)))
    ds = MMapIndexedDataset(prefix)
    with_sidecar = [ds[i].tolist() for i in range(len(ds))] + [ds[i].tolist() for i in range(len(ds))]
    assert sorted(checked) == list(range(len(ds.sidecar.bin_crc32)))
    os.remove(prefix + ".crc.json")
    plain = MMapIndexedDataset(prefix)
    assert plain.sidecar is None and with_sidecar == [plain[i].tolist() for i in range(len(plain))] * 2
    assert ref_read(prefix)[1] == with_sidecar[:len(ds)]


def test_an_id_outside_the_vocabulary_in_a_damaged_chunk_is_named_as_damage(tmp_path):
    prefix = make_pair(str(tmp_path / "d"))
    good = open(prefix + ".bin", "rb").read()
    offset = 2 * CHUNK + 1  # the high byte of a uint16 token: its id becomes >= 4096
    flip(prefix + ".bin", offset)
    with pytest.raises(DataChecksumError) as info:
        MMapIndexedDataset(prefix, vocab_size=500)
    assert str(info.value) == chunk_message(prefix, good, open(prefix + ".bin", "rb").read(), 2)


def _gpt_splits(data_path, samples=200):
    return build_train_valid_test_datasets(data_path, "100,0,0", [samples, 0, 0], seq_length=16, seed=1)


def test_damage_read_in_a_dataloader_worker_is_one_line(tmp_path, capsys):
    """The worker checks the chunks it reads, in its own process; the error torch re-raises in the main process
    is reported as the worker's one line."""
    prefix = make_pair(str(tmp_path / "d"))
    good = open(prefix + ".bin", "rb").read()
    flip(prefix + ".bin", 4 * CHUNK + 3)
    train = _gpt_splits([prefix])[0]
    loader = build_pretraining_data_loader(train, 0, micro_batch_size=4, dp_rank=0, dp_size=1, num_workers=1)
    err = _first_error(loader)
    expected = chunk_message(prefix, good, open(prefix + ".bin", "rb").read(), 4)
    assert isinstance(err, DataChecksumError), err
    assert str(err).startswith("Caught DataChecksumError in DataLoader worker process 0.")
    assert worker_message(str(err)) == expected and worker_message(expected) == expected
    assert train.indexed_dataset._unchecked.remaining == len(train.indexed_dataset.sidecar.bin_crc32)  # main: none
    capsys.readouterr()
    report_user_error(err)
    assert capsys.readouterr().err == f"error: {expected}\n"


def _first_error(loader) -> Exception:
    """What iterating the loader raises; the iterator (and its worker) is gone when this returns."""
    batches, err = iter(loader), None
    try:
        for _ in batches:
            pass
    except Exception as caught:
        err = caught.with_traceback(None)  # its frames would keep the worker alive until a 5 s timeout
    del batches
    return err


def test_a_pair_without_sidecar_trains_as_before_and_says_so_once(tmp_path, capsys):
    checked, plain = make_pair(str(tmp_path / "a")), make_pair(str(tmp_path / "b"), seed=1, chunk_bytes=None)
    blend = _gpt_splits(["0.5", checked, "0.5", plain])[0]
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "sidecar" in line]
    assert notes == [f"note: no checksum sidecar (.crc.json) for {plain}: read unverified; add one with python "
                     f"tools/checksum_data.py --data-path {plain}"], out
    assert all(len(blend[i]["text"]) == 17 for i in range(len(blend)))
    _gpt_splits([checked])
    assert "sidecar" not in capsys.readouterr().out


def test_each_prefix_of_a_blend_is_checked_against_its_own_sidecar(tmp_path):
    first, second = make_pair(str(tmp_path / "a")), make_pair(str(tmp_path / "b"), seed=1)
    good = open(second + ".bin", "rb").read()
    flip(second + ".bin", CHUNK + 9)
    blend = _gpt_splits(["0.5", first, "0.5", second])[0]
    with pytest.raises(DataChecksumError) as info:
        for i in range(len(blend)):
            blend[i]
    assert str(info.value) == chunk_message(second, good, open(second + ".bin", "rb").read(), 1)
    first_ds = blend.datasets[0].indexed_dataset
    first_ds.check_bytes()  # the other prefix is intact
    flip(first + ".idx", 50)
    with pytest.raises(DataChecksumError, match=f"^{first}.idx: bytes 0.."):
        _gpt_splits(["0.5", first, "0.5", second])


def test_merge_checks_its_inputs_and_writes_a_sidecar_for_the_merged_pair(tmp_path):
    parts = [make_pair(str(tmp_path / f"p{i}"), seed=i) for i in range(2)]
    merged = merge_datasets.merge_datasets(parts, str(tmp_path / "m"))
    assert merged.sidecar == checksums.compute(str(tmp_path / "m")) and verify_pair(str(tmp_path / "m"))
    assert merged.sidecar.chunk_bytes == checksums.CHUNK_BYTES
    good = open(parts[1] + ".bin", "rb").read()
    flip(parts[1] + ".bin", 3 * CHUNK)
    with pytest.raises(DataChecksumError) as info:
        merge_datasets.merge_datasets(parts, str(tmp_path / "m2"))
    assert str(info.value) == chunk_message(parts[1], good, open(parts[1] + ".bin", "rb").read(), 3)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("m2")]


def _run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)


def _one_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0][len("error: "):]


def test_the_cli_adds_a_sidecar_and_verifies_a_pair(tmp_path):
    prefix = make_pair(str(tmp_path / "d"), chunk_bytes=None)
    size = os.path.getsize(prefix + ".bin")
    chunks = -(-size // CHUNK)
    proc = _run("tools/checksum_data.py", "--data-path", prefix, "--chunk-bytes", str(CHUNK))
    assert proc.returncode == 0 and proc.stderr == f"wrote {prefix}.crc.json: {chunks} chunks of {CHUNK} bytes " \
                                                   f"({size} bytes of .bin) and the .idx\n", proc.stderr
    assert checksums.read(prefix) == checksums.compute(prefix, CHUNK)
    proc = _run("tools/checksum_data.py", "--verify", "--data-path", prefix)
    assert proc.returncode == 0 and proc.stderr == f"ok: {prefix}.idx and the {chunks} chunks of {prefix}.bin " \
                                                   f"match {prefix}.crc.json\n", proc.stderr
    assert _one_error(_run("tools/checksum_data.py", "--data-path", prefix)).startswith(f"{prefix}.crc.json exists: ")
    good = open(prefix + ".bin", "rb").read()
    flip(prefix + ".bin", (chunks - 2) * CHUNK + 2)
    assert _one_error(_run("tools/checksum_data.py", "--verify", "--data-path", prefix)) == \
        chunk_message(prefix, good, open(prefix + ".bin", "rb").read(), chunks - 2)


def test_preprocess_writes_the_pair_as_before_and_the_preflight_refuses_a_flipped_idx_byte(tmp_path):
    """The user's commands: tools/preprocess_data.py, then the pre-launch check the example scripts run."""
    vocab, merges = make_bpe(str(tmp_path), vocab_size=500)
    corpus, prefix = make_corpus(str(tmp_path), n_docs=300), str(tmp_path / "d_text_document")
    tok = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    proc = _run("tools/preprocess_data.py", "--input", corpus, "--output-prefix", str(tmp_path / "d"),
                "--append-eod", *tok)
    assert proc.returncode == 0, proc.stderr
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    ref_write(str(tmp_path / "ref"), [[tokenizer.tokenize(t) + [tokenizer.eod]] for t in make_texts()], np.uint16)
    for ext in (".bin", ".idx"):  # Megatron-LM's bytes, the sidecar beside them
        assert open(prefix + ext, "rb").read() == open(str(tmp_path / "ref") + ext, "rb").read()
    assert checksums.read(prefix) == checksums.compute(prefix)
    preflight = ["-m", "megatron.config.preflight", "gpt", "--world-size", "1", "--num-layers", "1", "--hidden-size",
                 "8", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1", "--train-iters",
                 "1", "--data-path", prefix, *tok]
    assert _run(*preflight).returncode == 0
    good = open(prefix + ".idx", "rb").read()
    flip(prefix + ".idx", len(good) - 16)  # in doc_idx[]: named as damage, not as a corrupt index
    assert _one_error(_run(*preflight)) == (
        f"{prefix}.idx: bytes 0..{len(good) - 1} fail their CRC-32 ({prefix}.crc.json says {crc(good)}, read "
        f"{crc(open(prefix + '.idx', 'rb').read())}): {FIX}")
