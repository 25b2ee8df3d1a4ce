"""SentencePiece tokenizer (T5 style).

Ids come from the model: pad and eos as trained (``tools/train_tokenizer.py --type sentencepiece`` gives
pad=0, eos=1, unk=2, no bos); eod = eos; pad falls back to eos for a model without a pad piece.
``<extra_id_i>`` sentinels are appended after the model's pieces in increasing order
(``<extra_id_0>`` = number of pieces), as Megatron does; note that HF's T5Tokenizer numbers them
the other way round (``<extra_id_0>`` = last id), so an HF export must map ``sentinel_ids``.
"""
import os
from typing import List, Sequence

from megatron.tokenizer.base import AbstractTokenizer


class SentencePieceTokenizer(AbstractTokenizer):
    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        if not model_file or not os.path.isfile(model_file):
            raise FileNotFoundError(f"SentencePieceTokenizer: model file {model_file!r} not found")
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
            pieces = [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]
        except (RuntimeError, OSError, ValueError) as err:  # a damaged protobuf, pieces that are not UTF-8
            raise ValueError(f"{model_file}: not a SentencePiece model ({type(err).__name__}: "
                             f"{str(err).splitlines()[0][:120]}); the file is damaged or cut short") from None
        if len(set(pieces)) != len(pieces):
            raise ValueError(f"{model_file}: a piece appears twice; the file is damaged")
        if self._sp.eos_id() < 0:
            raise ValueError(f"{model_file}: the model has no eos piece (eos_id=-1); retrain with eos_id=1")
        super().__init__(self._sp.get_piece_size(), vocab_extra_ids)

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else self._sp.eos_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()
