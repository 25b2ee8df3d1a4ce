"""GPT-2 byte-level BPE tokenizer (vocab.json + merges.txt).

Two backends give identical ids: the ``tokenizers`` library (Rust, used when importable) and
``bpe_python.PythonByteLevelBPE``. Force the Python one with ``backend="python"`` or the environment
variable ``MEGATRON_BPE_BACKEND=python``.

Special tokens: ``<|endoftext|>`` must be in vocab.json; eod = eos = pad = its id. Like Megatron's
GPT2Tokenizer, text is never scanned for special tokens: the literal string "<|endoftext|>" inside a
document is encoded as ordinary characters ("<|", "endoftext", "|>"), so a document cannot inject an
end-of-document token. Append ``eod`` explicitly where a document ends.
"""
import os
from typing import List, Optional, Sequence

from megatron.tokenizer.base import AbstractTokenizer
from megatron.tokenizer.bpe_python import (GPT2_PATTERN, PythonByteLevelBPE, check_byte_level, check_ids,
                                           load_merges, load_vocab)

EOD_TOKEN = "<|endoftext|>"
BACKENDS = ("auto", "tokenizers", "python")


def _tokenizers_backend(vocab, merges):
    """A ``tokenizers.Tokenizer`` with the GPT-2 pre-tokenizer, no special-token handling."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _tokenizers_available() -> bool:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return False
    return True


class GPT2BPETokenizer(AbstractTokenizer):
    """GPT-2 BPE; ``backend`` is "auto" (tokenizers if importable), "tokenizers" or "python"."""

    def __init__(self, vocab_file: str, merge_file: str, vocab_extra_ids: int = 0,
                 backend: Optional[str] = None):
        for name, path in (("vocab file", vocab_file), ("merge file", merge_file)):
            if not path or not os.path.isfile(path):
                raise FileNotFoundError(f"GPT2BPETokenizer: {name} {path!r} not found")
        backend = backend or os.environ.get("MEGATRON_BPE_BACKEND", "auto")
        if backend not in BACKENDS:
            raise ValueError(f"GPT2BPETokenizer: unknown backend {backend!r}, expected one of {BACKENDS}")
        vocab, merges = load_vocab(vocab_file), load_merges(merge_file)
        check_byte_level(vocab, merges, vocab_file, merge_file)
        if EOD_TOKEN not in vocab:
            raise ValueError(f"{vocab_file}: no {EOD_TOKEN} token; train with tools/train_tokenizer.py --type bpe")
        check_ids(vocab, vocab_file)
        super().__init__(len(vocab), vocab_extra_ids)
        self._eod = vocab[EOD_TOKEN]
        self._python = PythonByteLevelBPE(vocab, merges)
        if backend == "auto":
            backend = "tokenizers" if _tokenizers_available() else "python"
        self.backend = backend
        self._fast = _tokenizers_backend(vocab, merges) if backend == "tokenizers" else None

    def tokenize(self, text: str) -> List[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._python.encode(text)

    def _decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens=False)
        return self._python.decode(ids)

    @property
    def vocab(self):
        return self._python.encoder

    @property
    def inv_vocab(self):
        return self._python.decoder

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._eod
