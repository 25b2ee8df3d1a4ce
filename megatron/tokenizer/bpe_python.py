"""Pure-Python byte-level BPE (the GPT-2 algorithm), and the vocab.json / merges.txt loaders.

Encoding a text:
1. split it with the GPT-2 pre-tokenisation regex ``GPT2_PATTERN`` (contractions, letter runs, digit runs,
   other-symbol runs, each optionally led by one space; whitespace runs);
2. map every UTF-8 byte of a piece to a printable character (``bytes_to_unicode``);
3. repeatedly merge the adjacent pair of lowest rank in merges.txt (all its occurrences, left to right)
   until no pair has a rank; each resulting symbol is a vocab.json key.
"""
import json
from functools import lru_cache
from typing import Dict, List, Sequence, Tuple

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache()
def bytes_to_unicode() -> Dict[int, str]:
    """Byte -> printable character: printable Latin-1 bytes map to themselves, the other 68 to U+0100...."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def _unique_keys(pairs: List[Tuple[str, object]]) -> Dict[str, object]:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the token {key!r} appears twice")
        out[key] = value
    return out


def load_vocab(path: str) -> Dict[str, int]:
    """token -> id; ValueError naming the file unless it is a JSON object of distinct tokens."""
    try:
        with open(path, "rb") as f:
            vocab = json.loads(f.read().decode("utf-8"), object_pairs_hook=_unique_keys)
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, a token twice
        raise ValueError(f"{path}: not a vocab.json ({type(err).__name__}: {str(err)[:120]})") from None
    if not isinstance(vocab, dict):
        raise ValueError(f"{path}: expected a JSON object token -> id, got {type(vocab).__name__}")
    return vocab


def check_ids(vocab: Dict[str, int], path: str) -> None:
    """The ids are exactly 0..N-1, once each (what a trained vocab.json holds: a changed id leaves a gap and a
    token outside the embedding's rows)."""
    ids = sorted(i if isinstance(i, int) and not isinstance(i, bool) else -1 for i in vocab.values())
    if ids != list(range(len(vocab))):
        wrong = next((i for n, i in enumerate(ids) if i != n), None)
        raise ValueError(f"{path}: the ids of its {len(vocab)} tokens are not 0..{len(vocab) - 1} once each "
                         f"(first out of place: {wrong}); the file is damaged")


def load_merges(path: str) -> List[Tuple[str, str]]:
    """Merges in rank order; a first line starting with ``#version`` is a header. ValueError naming the file
    when a line is not two symbols, or when there is no merge at all."""
    merges = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line_no == 1 and line.startswith("#version"):
                    continue
                parts = line.split()
                if not parts:
                    continue
                if len(parts) != 2:
                    raise ValueError(f"{path}:{line_no}: expected two symbols per merge, got {line.rstrip()!r}")
                merges.append((parts[0], parts[1]))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start} of a chunk); the file is "
                         f"damaged") from None
    if not merges:  # every text would encode byte by byte: no tokenizer anyone trained
        raise ValueError(f"{path}: no merges (the file is empty or holds only its '#version' header); a GPT-2 BPE "
                         f"merges.txt lists one merge per line, as tools/train_tokenizer.py --type bpe writes it")
    return merges


def check_byte_level(vocab: Dict[str, int], merges: Sequence[Tuple[str, str]], vocab_file: str,
                     merge_file: str = "merges.txt") -> None:
    """Every byte has a token and every merge result is a token, so every text has an encoding (and the two
    files agree: a token or merge changed in either shows here)."""
    missing = [c for c in bytes_to_unicode().values() if c not in vocab]
    if missing:
        raise ValueError(f"{vocab_file}: not a byte-level BPE vocab, {len(missing)} of the 256 byte symbols "
                         f"are missing (e.g. {missing[0]!r})")
    for rank, (a, b) in enumerate(merges):
        if a not in vocab or b not in vocab:
            raise ValueError(f"{merge_file} and {vocab_file} disagree: merge {rank} {a!r} {b!r} joins "
                             f"{a if a not in vocab else b!r}, which is not in the vocab (one of the two files is "
                             f"damaged or from another tokenizer)")
        if a + b not in vocab:
            raise ValueError(f"{merge_file} and {vocab_file} disagree: merge {rank} {a!r} {b!r} produces {a + b!r}, "
                             f"which is not in the vocab (one of the two files is damaged or from another "
                             f"tokenizer)")


class PythonByteLevelBPE:
    """Byte-level BPE encoder/decoder in pure Python (reference for the ``tokenizers`` backend)."""

    def __init__(self, vocab: Dict[str, int], merges: Sequence[Tuple[str, str]]):
        self.encoder = vocab
        self.decoder = {i: token for token, i in vocab.items()}
        self.bpe_ranks = {pair: rank for rank, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.cache: Dict[str, List[str]] = {}  # piece -> symbols; cleared at CACHE_LIMIT entries

    CACHE_LIMIT = 200_000

    def bpe(self, word: str) -> List[str]:
        """Merge the symbols of one byte-mapped piece."""
        if word in self.cache:
            return self.cache[word]
        symbols = list(word)
        while len(symbols) > 1:
            pairs = set(zip(symbols, symbols[1:]))
            best = min(pairs, key=lambda pair: self.bpe_ranks.get(pair, float("inf")))
            if best not in self.bpe_ranks:
                break
            merged, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        if len(self.cache) >= self.CACHE_LIMIT:
            self.cache.clear()
        self.cache[word] = symbols
        return symbols

    def encode(self, text: str) -> List[int]:
        ids = []
        for piece in self.pattern.findall(text):
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[symbol] for symbol in self.bpe(word))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        text = "".join(self.decoder[i] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
