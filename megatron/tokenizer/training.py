"""Training a tokenizer on a corpus, offline: the library of ``tools/train_tokenizer.py`` (the kinds and their files:
that tool's docstring).

    train_bpe(texts, vocab_size, output_dir)            byte-level BPE -> vocab.json, merges.txt
    train_hf_bpe(texts, vocab_size, output_dir)         the same as a Hugging Face tokenizer.json
    train_sentencepiece(texts, vocab_size, output_dir)  unigram SentencePiece -> spm.model
    main(argv)                                          the command line (`tools/train_tokenizer.py` is it)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterator, List, Optional, Tuple

from megatron.data.corpus import TEXT_FORMATS, InputError, iter_texts
from megatron.errors import ArgumentParser

EOD_TOKEN = "<|endoftext|>"
SPM_MODEL_NAME = "spm"
TYPES = ("bpe", "hf-bpe", "sentencepiece")

__all__ = ["iter_texts", "train_bpe", "train_hf_bpe", "train_sentencepiece", "main"]


class GuardedTexts:
    """Iterates texts for a native trainer, which would wrap or swallow Python errors: the first InputError
    ends the iteration and ``check()`` re-raises it after training."""

    def __init__(self, texts: Iterator[str]):
        self._texts, self.error = texts, None

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self._texts
        except InputError as e:
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise self.error


def _train_byte_level(texts: Iterator[str], vocab_size: int):
    """A trained ``tokenizers.ByteLevelBPETokenizer``: the 256 bytes, ``<|endoftext|>`` (id 0), merges."""
    from tokenizers import ByteLevelBPETokenizer

    if vocab_size < 257:
        raise InputError(f"--vocab-size {vocab_size} too small for byte-level BPE: need >= 257 "
                         f"(256 bytes + {EOD_TOKEN})")
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    guarded = GuardedTexts(texts)
    tokenizer.train_from_iterator(guarded, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
                                  show_progress=False)
    guarded.check()
    return tokenizer


def train_bpe(texts: Iterator[str], vocab_size: int, output_dir: str) -> Tuple[str, str]:
    """Byte-level BPE; returns (vocab.json, merges.txt) paths."""
    tokenizer = _train_byte_level(texts, vocab_size)
    os.makedirs(output_dir, exist_ok=True)
    vocab_file, merge_file = tokenizer.save_model(output_dir)
    return vocab_file, merge_file


def _write_atomically(contents: Dict[str, str]) -> None:
    """Write each path's text under a temporary name, then rename them all (none is left half-written)."""
    temps = {path: f"{path}.tmp{os.getpid()}" for path in contents}
    try:
        for path, text in contents.items():
            with open(temps[path], "w", encoding="utf-8") as f:
                f.write(text)
        for path, temp in temps.items():
            os.replace(temp, path)
    finally:
        for temp in temps.values():
            if os.path.exists(temp):
                os.remove(temp)


def train_hf_bpe(texts: Iterator[str], vocab_size: int, output_dir: str) -> Tuple[str, str]:
    """Byte-level BPE as a Hugging Face folder; returns (tokenizer.json, tokenizer_config.json) paths."""
    tokenizer = _train_byte_level(texts, vocab_size)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN}
    os.makedirs(output_dir, exist_ok=True)
    paths = (os.path.join(output_dir, "tokenizer.json"), os.path.join(output_dir, "tokenizer_config.json"))
    _write_atomically({paths[0]: tokenizer.to_str(), paths[1]: json.dumps(config, indent=2) + "\n"})
    return paths


def _lines(texts: Iterator[str]) -> Iterator[str]:
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def _usable_cpus() -> int:
    """The CPUs this process may run on (taskset, a SLURM allocation, a container's cpuset), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def train_sentencepiece(texts: Iterator[str], vocab_size: int, output_dir: str) -> str:
    """T5-style unigram SentencePiece; returns the .model path."""
    import sentencepiece

    os.makedirs(output_dir, exist_ok=True)
    prefix = os.path.join(output_dir, SPM_MODEL_NAME)
    guarded = GuardedTexts(texts)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=_lines(guarded), model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True, normalization_rule_name="identity",
            remove_extra_whitespaces=False, hard_vocab_limit=False, character_coverage=0.9995,
            minloglevel=2, num_threads=_usable_cpus())
    except RuntimeError as e:
        guarded.check()
        raise InputError(f"sentencepiece training failed: {str(e).splitlines()[0]}") from None
    if guarded.error is not None:
        for suffix in (".model", ".vocab"):
            os.remove(prefix + suffix)
    guarded.check()
    return prefix + ".model"


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = ArgumentParser(description="Train a tokenizer on a corpus, offline: jsonl, Parquet or text")
    p.add_argument("--input", required=True, help="jsonl, Parquet, or text with one document per line / paragraph; "
                   "jsonl and text may be .gz or .zst compressed")
    p.add_argument("--json-key", default="text", help="the JSON key (Parquet: the string column) of the text")
    p.add_argument("--text-format", choices=TEXT_FORMATS, default="auto",
                   help="auto: by the file's suffix (.jsonl/.json, .parquet, else lines), after .gz/.zst")
    p.add_argument("--type", choices=TYPES, required=True,
                   help="bpe: vocab.json + merges.txt (GPT2BPETokenizer); hf-bpe: tokenizer.json + "
                        "tokenizer_config.json (HuggingFaceTokenizer); sentencepiece: spm.model")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-dir", required=True)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> List[str]:
    """The CLI; a mistake raises InputError (run as a script: `error: ...`, exit 2)."""
    args = get_args(argv)
    texts = iter_texts(args.input, args.json_key, args.text_format)
    if args.type == "bpe":
        paths = list(train_bpe(texts, args.vocab_size, args.output_dir))
    elif args.type == "hf-bpe":
        paths = list(train_hf_bpe(texts, args.vocab_size, args.output_dir))
    else:
        paths = [train_sentencepiece(texts, args.vocab_size, args.output_dir)]
    print(f"wrote {', '.join(paths)}", file=sys.stderr)
    return paths
