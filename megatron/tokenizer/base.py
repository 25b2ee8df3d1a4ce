"""Shared tokenizer behaviour: extra ids (T5 sentinels) appended after the base vocabulary.

With a base vocabulary of V pieces and ``vocab_extra_ids = E``::

    id V + i  <->  "<extra_id_i>",  i = 0 .. E-1      vocab_size = V + E

Sentinels are never parsed out of plain text (``tokenize`` treats "<extra_id_0>" as ordinary characters);
``detokenize`` writes them back as their names.
"""
from typing import List, Sequence


class AbstractTokenizer:
    """Base of the tokenizers returned by ``build_tokenizer``; subclasses implement ``tokenize``/``_decode``."""

    def __init__(self, base_vocab_size: int, vocab_extra_ids: int = 0):
        if vocab_extra_ids < 0:
            raise ValueError(f"vocab_extra_ids must be >= 0, got {vocab_extra_ids}")
        self._base_vocab_size = base_vocab_size
        self.sentinel_ids: List[int] = list(range(base_vocab_size, base_vocab_size + vocab_extra_ids))

    @property
    def vocab_size(self) -> int:
        """Base vocabulary plus extra ids."""
        return self._base_vocab_size + len(self.sentinel_ids)

    def tokenize(self, text: str) -> List[int]:
        raise NotImplementedError

    def tokenize_continuation(self, text: str) -> List[int]:
        """Ids of text that continues other text: nothing a tokenizer adds at a sequence's start (a BOS)."""
        return self.tokenize(text)

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of ids that are all in the base vocabulary."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; runs of base ids are decoded together, sentinels become ``<extra_id_i>``."""
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        pieces, run = [], []
        for i in ids:
            if i < self._base_vocab_size:
                run.append(i)
                continue
            if run:
                pieces.append(self._decode(run))
                run = []
            pieces.append(f"<extra_id_{i - self._base_vocab_size}>")
        if run:
            pieces.append(self._decode(run))
        return "".join(pieces)
