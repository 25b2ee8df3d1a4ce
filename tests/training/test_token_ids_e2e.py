"""Data tokenized with a bigger vocabulary than the one trained with, through the example scripts at tp=2, pp=2
(4 CPU processes): one `error:` line naming the prefix, the first offending document, its id and the
vocabulary; exit 2; not one iteration; no checkpoint. GPT-2: the stdlib-docstring corpus preprocessed with a
512-token BPE, trained with a 266-token BPE. T5: the same corpus preprocessed with a SentencePiece model of
about 1200 pieces, trained with one of about 400 (+ 8 sentinels)."""
import os
import subprocess
import sys

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer
from tests.training.test_user_errors import _assert_one_line, _env, _run_script

pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT = dict(NPROC="4", TP="2", PP="2", TRAIN_ITERS="2", LOG_INTERVAL="1", SAVE_INTERVAL="1", SAMPLES="0")


def _tool(*args) -> None:
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def _corpus(gpt_data) -> str:
    return os.path.join(os.path.dirname(gpt_data["data_prefix"]), "corpus.jsonl")


def first_document_over(prefix: str, limit: int) -> tuple:
    """(document, id) of the first token >= limit, by a plain walk over the documents."""
    ds = MMapIndexedDataset(prefix)
    for document in range(len(ds.doc_idx) - 1):
        for item in range(ds.doc_idx[document], ds.doc_idx[document + 1]):
            over = [int(t) for t in ds[int(item)] if t >= limit]
            if over:
                return document, over[0]
    raise AssertionError(f"{prefix} has no id >= {limit}")


def _assert_stopped_before_training(proc, work_dir, needle: str) -> None:
    _assert_one_line(proc, needle)
    out = proc.stdout + proc.stderr
    assert "launching:" in proc.stdout  # found inside pretrain_*.py under torchrun, not before the launch
    assert " iteration " not in out, out[-3000:]
    checkpoints = os.path.join(work_dir, "checkpoints")
    assert not os.path.isdir(checkpoints) or os.listdir(checkpoints) == [], os.listdir(checkpoints)


@pytest.fixture(scope="module")
def bpe_266(tmp_path_factory, gpt_data) -> dict:
    out = str(tmp_path_factory.mktemp("bpe266"))
    _tool("tools/train_tokenizer.py", "--input", _corpus(gpt_data), "--type", "bpe", "--vocab-size", "266",
          "--output-dir", out)
    return dict(vocab=os.path.join(out, "vocab.json"), merges=os.path.join(out, "merges.txt"))


def test_gpt2_data_of_a_bigger_vocabulary_stops_before_training(tmp_path, gpt_data, bpe_266):
    prefix = gpt_data["data_prefix"]
    document, token_id = first_document_over(prefix, 266)
    env = _env(tmp_path, DATA_PATH=prefix, VOCAB_FILE=bpe_266["vocab"], MERGE_FILE=bpe_266["merges"], **LAYOUT)
    proc = _run_script("ds_pretrain_gpt2.sh", env, timeout=400)
    _assert_stopped_before_training(proc, env["WORK_DIR"], f"--data-path {prefix}: document {document} holds "
                                                           f"token id {token_id} but the tokenizer has 266 tokens")


def _files(directory: str) -> dict:
    return {os.path.join(d, n): open(os.path.join(d, n), "rb").read() for d, _, names in os.walk(directory)
            for n in names}


def test_resuming_on_data_of_a_bigger_vocabulary_leaves_the_checkpoint_alone(tmp_path, gpt_data, bpe_266):
    """2 iterations on the corpus preprocessed with the 266-token BPE it trains with, then a resume to 4 on a
    blend that adds the 512-token preprocessing: stopped after the checkpoint is loaded, before any step; the
    checkpoint directory is byte for byte the same."""
    own = str(tmp_path / "own")
    _tool("tools/preprocess_data.py", "--input", _corpus(gpt_data), "--tokenizer-type", "GPT2BPETokenizer",
          "--vocab-file", bpe_266["vocab"], "--merge-file", bpe_266["merges"], "--append-eod", "--output-prefix",
          own, "--workers", "1")
    env = _env(tmp_path, DATA_PATH=own + "_text_document", VOCAB_FILE=bpe_266["vocab"],
               MERGE_FILE=bpe_266["merges"], **LAYOUT)
    first = _run_script("ds_pretrain_gpt2.sh", env, timeout=400)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    checkpoints = os.path.join(env["WORK_DIR"], "checkpoints")
    saved = _files(checkpoints)
    env.update(DATA_PATH=f"0.5 {own}_text_document 0.5 {gpt_data['data_prefix']}", TRAIN_ITERS="4")
    proc = _run_script("ds_pretrain_gpt2.sh", env, timeout=400)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert errors[0].startswith(f"error: --data-path {gpt_data['data_prefix']}: document "), errors
    assert "loaded checkpoint" in out and "built train index" not in out, out[-3000:]  # both prefixes checked first
    assert " iteration 3/4" not in out
    assert _files(checkpoints) == saved


@pytest.fixture(scope="module")
def t5_data(tmp_path_factory, gpt_data) -> dict:
    """The corpus preprocessed with a SentencePiece model of ~1200 pieces; a ~400-piece model to train with."""
    out = tmp_path_factory.mktemp("t5")
    for size in (1200, 400):
        _tool("tools/train_tokenizer.py", "--input", _corpus(gpt_data), "--type", "sentencepiece", "--vocab-size",
              str(size), "--output-dir", str(out / f"spm{size}"))
    _tool("tools/preprocess_data.py", "--input", _corpus(gpt_data), "--tokenizer-type", "SentencePieceTokenizer",
          "--tokenizer-model", str(out / "spm1200" / "spm.model"), "--append-eod", "--output-prefix",
          str(out / "docs"), "--workers", "1")
    return dict(prefix=str(out / "docs_text_document"), model=str(out / "spm400" / "spm.model"))


def test_t5_data_of_a_bigger_vocabulary_stops_before_training(tmp_path, t5_data):
    pieces = build_tokenizer("SentencePieceTokenizer", tokenizer_model=t5_data["model"]).vocab_size
    document, token_id = first_document_over(t5_data["prefix"], pieces)
    env = _env(tmp_path, DATA_PATH=t5_data["prefix"], TOKENIZER_MODEL=t5_data["model"], VOCAB_EXTRA_IDS="8",
               **LAYOUT)
    proc = _run_script("ds_pretrain_t5.sh", env, timeout=400)
    _assert_stopped_before_training(proc, env["WORK_DIR"], f"--data-path {t5_data['prefix']}: document {document} "
                                                           f"holds token id {token_id} but the tokenizer has "
                                                           f"{pieces} text tokens (ids {pieces}..{pieces + 7} are "
                                                           f"its 8 <extra_id_*> sentinels)")
