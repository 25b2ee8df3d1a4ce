"""Tokenizers: GPT-2 byte-level BPE, SentencePiece and Hugging Face tokenizer.json, built by name with
``build_tokenizer``.

Every tokenizer has ``vocab_size`` (extra ids included), ``tokenize(text) -> ids``,
``detokenize(ids) -> text``, ``eod``, ``eos``, ``pad`` and ``sentinel_ids`` (``<extra_id_0>`` first).
The model's padded vocabulary (``make_vocab_size_divisible_by``) is derived elsewhere.
"""
from typing import Optional

from megatron.tokenizer.base import AbstractTokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HuggingFaceTokenizer
from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer")


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_extra_ids: int = 0) -> AbstractTokenizer:
    """GPT2BPETokenizer needs vocab_file + merge_file; SentencePieceTokenizer needs tokenizer_model (a .model);
    HuggingFaceTokenizer needs tokenizer_model (a tokenizer.json or its folder)."""
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is None or merge_file is None:
            raise ValueError("GPT2BPETokenizer needs --vocab-file and --merge-file")
        return GPT2BPETokenizer(vocab_file, merge_file, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise ValueError("SentencePieceTokenizer needs --tokenizer-model")
        return SentencePieceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model, vocab_extra_ids=vocab_extra_ids)
    raise ValueError(f"unknown tokenizer type {tokenizer_type!r}, expected one of {TOKENIZER_TYPES}")


__all__ = ["build_tokenizer", "GPT2BPETokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer",
           "AbstractTokenizer", "TOKENIZER_TYPES"]
