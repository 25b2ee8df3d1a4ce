"""LAMBADA: predict the last word of a passage (Megatron's zero-shot task), greedy, exact match.

Shape legend: b examples in a batch, s' longest example in it (<= seq_length), V real vocabulary.

Each jsonl line {"text": ...} gives context ids and target ids (Megatron's two definitions):
    default    ids = tokenize(text): context = ids[:-1], target = ids[-1:]  (the final token)
    --strict   word = text.split()[-1]: context = tokenize(text before it, stripped),
               target = tokenize(" " + word)                               (the whole last word; no BOS)
An example is correct when, fed context + target[:-1] (teacher forcing), the argmax at every target
position is the target token. accuracy = correct / examples. An example longer than seq_length + 1 tokens
loses context from the left (counted in `truncated`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from megatron.errors import UserError
from .parallel import Parallel
from .prompts import right_pad
from .sampling import gather_vocab


@dataclass
class LambadaResult:
    correct: int
    examples: int
    accuracy: float
    strict: bool
    truncated: int

    def line(self) -> str:
        target = "last word (strict)" if self.strict else "last token"
        return (f"lambada | accuracy {self.accuracy:.4f} | {self.correct} / {self.examples} correct | "
                f"target: {target} | truncated {self.truncated}")

    def to_dict(self) -> dict:
        return asdict(self)


def split_example(text: str, tokenizer, strict: bool) -> Tuple[List[int], List[int]]:
    """(context ids, target ids) of one passage."""
    if not strict:
        ids = tokenizer.tokenize(text)
        return ids[:-1], ids[-1:]
    word = text.split()[-1]
    start = text.rfind(word)
    return tokenizer.tokenize(text[:start].strip()), tokenizer.tokenize_continuation(" " + word)


def read_lambada(path: str, tokenizer, strict: bool, json_key: str = "text") -> List[Tuple[List[int], List[int]]]:
    examples = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(enumerate(f, 1))
    except OSError as err:
        raise UserError(f"cannot read --data {path}: {err.strerror}") from None
    for n, line in lines:
        if not line.strip():
            continue
        try:
            text = json.loads(line)[json_key]
            context, target = split_example(text, tokenizer, strict)
        except (json.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError):
            raise UserError(f"{path} line {n}: not a JSON object with a non-empty string field {json_key!r} "
                            f"(LAMBADA's format is {{\"text\": ...}}; name the field with --json-key)") from None
        if not context or not target:
            raise UserError(f"{path} line {n}: needs context before the last {'word' if strict else 'token'}")
        examples.append((context, target))
    return examples


@torch.no_grad()
def correct_flags(model, batch: Sequence[Tuple[List[int], List[int]]], seq_length: int, pad: int,
                  tp_group=None) -> Tuple[List[bool], int]:
    """Per example: every target token is the argmax (teacher forcing); and how many were truncated."""
    rows = [(context + target)[-(seq_length + 1):] for context, target in batch]
    truncated = sum(len(c) + len(t) > seq_length + 1 for c, t in batch)
    device = model.embedding.word_embeddings.weight.device
    inputs = right_pad([r[:-1] for r in rows], pad, device)[0]
    logits = model(inputs)  # (b, s', V_r), causal: right padding never reaches real positions
    picks = [logits[i, len(r) - 1 - len(t):len(r) - 1] for i, (r, (_, t)) in enumerate(zip(rows, batch))]
    predicted = gather_vocab(torch.cat(picks), model.config.vocab_size, tp_group).argmax(-1).tolist()
    flags, at = [], 0
    for _, target in batch:
        flags.append(predicted[at:at + len(target)] == list(target))
        at += len(target)
    return flags, truncated


def evaluate_lambada(model, examples, seq_length: int, batch_size: int, pad: int, strict: bool,
                     par: Optional[Parallel] = None, progress=None) -> LambadaResult:
    """Accuracy over `examples` (from `read_lambada`); the same result on every rank."""
    par = par or Parallel.single()
    if not examples:
        raise UserError("the LAMBADA file has no examples")
    mine = []
    for k, first in enumerate(range(0, len(examples), batch_size)):
        if k % par.dp_size != par.dp_rank:
            continue
        flags, truncated = correct_flags(model, examples[first:first + batch_size], seq_length, pad,
                                         par.tp_group)
        mine.append((first, flags, truncated))
        if progress is not None:
            progress.update(len(flags) * par.dp_size)
    parts = {first: (flags, truncated) for first, flags, truncated in par.all_gather_objects(mine)}
    correct = sum(sum(flags) for flags, _ in parts.values())
    truncated = sum(t for _, t in parts.values())
    return LambadaResult(correct, len(examples), correct / len(examples), strict, truncated)
