"""Language-model perplexity of a text file with Megatron's overlapping evaluation (its WikiText-103 task).

Shape legend: w windows in a batch, s = seq_length, V_r this tp rank's vocabulary slice.

The file's N tokens give T = N - 1 targets (token j predicted from tokens < j). Window k reads tokens
[k S, k S + s] (S = stride, `--overlapping-eval`): window 0 scores all its s targets, window k > 0 only
its last S, so every target is scored exactly once and, after the first window, with s - S tokens of
context at least. Windows needed: 1 + ceil(max(T - s, 0) / S) (Megatron also runs trailing windows
that score nothing; the sums are the same).

    loss = sum of target cross entropies / T          ppl = exp(loss)
    token ratio r = T / (W - 1),  W = words of the raw file, len(text.strip().split(" "))
    adjusted ppl = exp(loss * r)                      perplexity per original (WikiText) word

Per-window sums are computed in the same batches whatever the number of data-parallel ranks (batch k on
rank k % dp) and added exactly (math.fsum of float64), so the result does not depend on dp.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron import mpu
from megatron.errors import UserError
from . import detokenize
from .parallel import Parallel
from .prompts import right_pad


@dataclass
class LMText:
    tokens: List[int]
    num_original_tokens: int  # whitespace-separated words of the raw text


@dataclass
class LMResult:
    loss: float
    ppl: float
    adjusted_ppl: float
    token_ratio: float
    num_tokenized_tokens: int
    num_original_tokens: int
    windows: int
    seq_length: int
    stride: int

    def line(self) -> str:
        return (f"lm-ppl | loss {self.loss:.4f} | ppl {self.ppl:.4f} | adjusted ppl {self.adjusted_ppl:.4f} | "
                f"token ratio {self.token_ratio:.4f} ({self.num_tokenized_tokens} tokens / "
                f"{self.num_original_tokens} words) | {self.windows} windows of {self.seq_length}, "
                f"stride {self.stride}")

    def to_dict(self) -> dict:
        return asdict(self)


def read_lm_text(path: str, tokenizer, detokenizer: str = "auto", json_key: Optional[str] = None) -> LMText:
    """Plain text: the whole file is one text (Megatron). jsonl (.jsonl/.json or json_key given): the
    documents' texts, each detokenized and tokenized, joined by eod; words counted per document."""
    detok = detokenize.pick(detokenizer, path)
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
    except OSError as err:
        raise UserError(f"cannot read --data {path}: {err.strerror}") from None
    if json_key is None and not path.endswith((".jsonl", ".json")):
        return LMText(tokenizer.tokenize(detok(raw)), len(raw.strip().split(" ")))
    key, tokens, words = json_key or "text", [], 0
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)[key]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{path} line {n}: not a JSON object with a string field {key!r} "
                            f"(name the field with --json-key)") from None
        tokens += ([tokenizer.eod] if tokens else []) + tokenizer.tokenize(detok(text))
        words += len(text.strip().split(" "))
    return LMText(tokens, words)


def windows(num_tokens: int, seq_length: int, stride: int) -> List[Tuple[int, int]]:
    """(first token, first scored target position in the window) of each window."""
    targets = num_tokens - 1
    count = 1 + max(0, -(-(targets - seq_length) // stride))
    return [(0, 0)] + [(k * stride, seq_length - stride) for k in range(1, count)]


def _window_batch(tokens: Sequence[int], spans: Sequence[Tuple[int, int]], seq_length: int, pad: int, device):
    """inputs (w, s'), labels (w, s'), scored (w, s') bool; s' = longest window's length, at most s."""
    rows = [tokens[start:start + seq_length + 1] for start, _ in spans]
    data = right_pad(rows, pad, device)[0]  # (w, s' + 1)
    scored = torch.zeros(len(rows), data.size(1) - 1, dtype=torch.bool)
    for i, (row, (_, first)) in enumerate(zip(rows, spans)):
        scored[i, first:len(row) - 1] = True
    return data[:, :-1], data[:, 1:], scored.to(device)


@torch.no_grad()
def window_losses(model, tokens: Sequence[int], spans, seq_length: int, pad: int, tp_group=None) -> List[float]:
    """Sum of the scored targets' cross entropies (float64) of each window in `spans`."""
    device = model.embedding.word_embeddings.weight.device
    inputs, labels, scored = _window_batch(tokens, spans, seq_length, pad, device)
    logits = model(inputs)  # (w, s', V_r), causal
    losses = mpu.vocab_parallel_cross_entropy(logits.float(), labels, tp_group)  # (w, s') fp32
    return (losses.double() * scored).sum(-1).tolist()


def evaluate_lm(model, text: LMText, seq_length: int, stride: int, batch_size: int, pad: int,
                par: Optional[Parallel] = None, progress=None) -> LMResult:
    """Megatron's overlapping-window perplexity of `text`; the same result on every rank."""
    par = par or Parallel.single()
    if len(text.tokens) < 2:
        raise UserError(f"the data has {len(text.tokens)} token(s); perplexity needs at least 2")
    if not 1 <= stride <= seq_length:
        raise UserError(f"--overlapping-eval {stride} must be between 1 and the sequence length {seq_length}")
    spans = windows(len(text.tokens), seq_length, stride)
    mine: List[Tuple[int, float]] = []
    for k, first in enumerate(range(0, len(spans), batch_size)):
        if k % par.dp_size != par.dp_rank:
            continue
        batch = spans[first:first + batch_size]
        sums = window_losses(model, text.tokens, batch, seq_length, pad, par.tp_group)
        mine.extend(zip(range(first, first + len(batch)), sums))
        if progress is not None:
            progress.update(len(batch) * par.dp_size)
    by_window = dict(par.all_gather_objects(mine))
    total = math.fsum(by_window[i] for i in range(len(spans)))
    targets = len(text.tokens) - 1
    loss = total / targets
    ratio = targets / max(text.num_original_tokens - 1, 1)
    return LMResult(loss, _exp(loss), _exp(loss * ratio), ratio, len(text.tokens), text.num_original_tokens,
                    len(spans), seq_length, stride)


def _exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")
