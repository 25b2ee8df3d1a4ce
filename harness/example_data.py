"""The example script's data, small: a corpus (stdlib docstrings) -> BPE tokenizer -> .bin/.idx, by the same three
scripts as examples/ds_pretrain_gpt2.sh, run in the checkout (tests/conftest.py's `gpt_data` builds it once per
session; bench scripts build their own sizes)."""
import os
import shutil
import subprocess
import sys

from harness import ROOT


def build_data(out_dir: str, max_mb: float = 0.3, vocab_size: int = 512) -> dict:
    """Run the same three tools as examples/ds_pretrain_gpt2.sh; returns the paths pretrain needs."""
    corpus, tok = os.path.join(out_dir, "corpus.jsonl"), os.path.join(out_dir, "tok")
    prefix = os.path.join(out_dir, "docs")
    py = sys.executable
    steps = [
        [py, "examples/make_default_corpus.py", "--output", corpus, "--max-mb", str(max_mb)],
        [py, "tools/train_tokenizer.py", "--input", corpus, "--type", "bpe", "--vocab-size", str(vocab_size),
         "--output-dir", tok],
        [py, "tools/preprocess_data.py", "--input", corpus, "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", os.path.join(tok, "vocab.json"), "--merge-file", os.path.join(tok, "merges.txt"),
         "--append-eod", "--output-prefix", prefix, "--workers", "1"],
    ]
    for cmd in steps:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return dict(data_prefix=prefix + "_text_document", vocab=os.path.join(tok, "vocab.json"),
                merges=os.path.join(tok, "merges.txt"))


def own_copy(data: dict, folder) -> dict:
    """`data` with its .bin/.idx (and their checksum sidecar) copied into `folder`: the index maps a run caches
    beside them are named without the split, so runs with another split must not share them."""
    for ext in (".bin", ".idx", ".crc.json"):
        shutil.copy(data["data_prefix"] + ext, os.path.join(str(folder), "docs") + ext)
    return dict(data, data_prefix=os.path.join(str(folder), "docs"))
