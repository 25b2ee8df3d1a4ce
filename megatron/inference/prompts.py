"""Prompts: reading them, turning them into token ids (T5 sentinels included), padding a batch.

Shape legend: b prompts in a batch, L the longest prompt of the batch.

GPT-2 batches are padded on the left, so every row's next token sits in the same column; T5 encoder
inputs are padded on the right (the padded keys are masked). A T5 prompt may contain sentinels
(`The <extra_id_0> sat on the mat`): each becomes its id, the text between them is tokenized on its own,
and `eos` ends the encoder input, as in the span-corruption training data.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from megatron.errors import UserError
from megatron.tokenizer import SentencePieceTokenizer

SENTINEL = re.compile(r"<extra_id_(\d+)>")


def read_prompt_file(path: str, json_key: Optional[str] = None) -> List[str]:
    """One prompt per non-blank line; jsonl (one object per line, the prompt under `json_key`, default
    'text') when json_key is given or the file ends in .jsonl / .json."""
    as_json = json_key is not None or path.endswith((".jsonl", ".json"))
    key = json_key or "text"
    try:
        with open(path, encoding="utf-8") as f:
            lines = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as err:
        raise UserError(f"cannot read --prompt-file {path}: {err.strerror}") from None
    if not as_json:
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path} line {n} is not valid JSON ({err.msg}); give one JSON object per line, "
                            f"or a plain-text file with one prompt per line") from None
        if not isinstance(record, dict) or not isinstance(record.get(key), str):
            raise UserError(f"{path} line {n} has no string field {key!r}; name the field with --json-key")
        prompts.append(record[key])
    return prompts


def check_sentinels(text: str, num_sentinels: int) -> None:
    """UserError naming the first `<extra_id_N>` with N >= num_sentinels."""
    for match in SENTINEL.finditer(text):
        if int(match.group(1)) >= num_sentinels:
            have = f"<extra_id_0> .. <extra_id_{num_sentinels - 1}>" if num_sentinels else "none"
            raise UserError(f"prompt {text!r}: unknown sentinel {match.group(0)}; this tokenizer has "
                            f"{num_sentinels} ({have}, --vocab-extra-ids of the checkpoint)")


def encode_t5(text: str, tokenizer) -> List[int]:
    """Encoder ids of a T5 prompt: text pieces, sentinel ids, then eos.

    Around a sentinel the whitespace belongs to the sentinel: the piece before it is right-stripped; the
    piece after keeps its leading space for byte-level BPE (' sat' is the word 'sat') and is stripped for
    SentencePiece, whose own word-start marker stands for it."""
    check_sentinels(text, len(tokenizer.sentinel_ids))
    parts = SENTINEL.split(text)  # [text, n, text, n, ..., text]
    strip_left = isinstance(tokenizer, SentencePieceTokenizer)
    ids: List[int] = []
    for k, piece in enumerate(parts):
        if k % 2:
            ids.append(tokenizer.sentinel_ids[int(piece)])
            continue
        if k + 1 < len(parts):
            piece = piece.rstrip()
        if k > 0 and strip_left:
            piece = piece.lstrip()
        if piece:
            ids.extend(tokenizer.tokenize(piece))
    return ids + [tokenizer.eos]


def encode_gpt2(text: str, tokenizer) -> List[int]:
    """GPT-2 context ids; an empty prompt becomes [eod] (an unconditional sample, as Megatron)."""
    return tokenizer.tokenize(text) or [tokenizer.eod]


@dataclass
class LeftPadded:
    """tokens (b, L) int64 with row i's prompt in its last lengths[i] columns; pads (b,) = L - lengths."""
    tokens: torch.Tensor
    pads: torch.Tensor


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None) -> LeftPadded:
    longest = max(len(r) for r in rows)
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, longest - len(r):] = torch.tensor(r, dtype=torch.long)
    pads = torch.tensor([longest - len(r) for r in rows], dtype=torch.long)
    return LeftPadded(tokens.to(device), pads.to(device))


def right_pad(rows: Sequence[Sequence[int]], pad_id: int, device=None):
    """(tokens (b, L) int64 with row i in its first len(rows[i]) columns, lengths (b,) int64)."""
    longest = max(len(r) for r in rows)
    tokens = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return tokens.to(device), torch.tensor([len(r) for r in rows], dtype=torch.long, device=device)
