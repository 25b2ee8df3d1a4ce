"""T5 span-corruption dataset, corrupted at load time from GPT-style document .bin/.idx files.

Each sample is a window of R raw tokens laid out exactly like a GPT sample of seq_length R-1 (GPTDataset
index files, name `{split}_t5`). R is the T5 choice (t5.data.preprocessors.random_spans_helper):
the largest R whose corruption fits the encoder, reduced until the targets fit the decoder:

    noise = round(R * density), spans = round(noise / mean_span_length)
    encoder input = R - noise + spans + 1 <= enc_seq_length,  targets = noise + spans + 1 <= dec_seq_length

Spans follow T5's random_spans_noise_mask: the window alternates non-noise / noise spans (starting with
non-noise, ending with noise), both segmentations uniformly random; the generator is seeded by
(seed, sample index), so a sample is the same on every call, rank and worker. Span k becomes sentinel
<extra_id_k> in the encoder input and opens its tokens in the targets:

    tokens   a b c d e f g h                 noise:  . . x x . . . y
    encoder  a b <0> e f g <1> eos           targets <0> c d <1> h eos
    decoder  pad <0> c d <1> h               (= [pad] + targets[:-1])

Shapes: E = enc_seq_length, D = dec_seq_length. Bool masks are True = masked out; padded keys are masked
(padded queries are not, so no row is fully masked), the decoder mask is also causal.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np
import torch

from megatron.data.gpt_dataset import GPTDataset, build_split_datasets
from megatron.data.token_ids import text_limit


def t5_lengths(enc_seq_length: int, dec_seq_length: int, noise_density: float,
               mean_span_length: float) -> Tuple[int, int, int]:
    """(raw window length R, encoder input length, target length) for the given sequence lengths."""
    if not 0 < noise_density < 1 or mean_span_length < 1:
        raise ValueError(f"need 0 < noise_density < 1 and mean_span_length >= 1, "
                         f"got {noise_density} and {mean_span_length}")
    def corrupted(raw: int) -> Tuple[int, int]:
        noise, spans = _noise_and_spans(raw, noise_density, mean_span_length)
        return raw - noise + spans + 1, noise + spans + 1

    raw = enc_seq_length
    while corrupted(raw + 1)[0] <= enc_seq_length:
        raw += 1
    while raw > 2 and corrupted(raw)[1] > dec_seq_length:
        raw -= 1
    enc, dec = corrupted(raw)
    if raw <= 2 or enc > enc_seq_length or dec > dec_seq_length:
        raise ValueError(f"no T5 window fits encoder length {enc_seq_length} and decoder length {dec_seq_length} "
                         f"at noise density {noise_density}, mean span {mean_span_length}")
    return raw, enc, dec


def _noise_and_spans(length: int, noise_density: float, mean_span_length: float) -> Tuple[int, int]:
    """T5's counts: noise tokens in [1, length-1], noise spans >= 1."""
    noise = int(np.round(length * noise_density))
    noise = min(max(noise, 1), length - 1)
    spans = int(np.round(min(noise, length - noise) / mean_span_length))
    return noise, max(spans, 1)


def random_spans_noise_mask(length: int, noise_density: float, mean_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """bool (length,): T5's span mask, non-noise span first, last span noise."""
    noise, spans = _noise_and_spans(length, noise_density, mean_span_length)
    noise_lengths = _random_segmentation(noise, spans, rng)
    nonnoise_lengths = _random_segmentation(length - noise, spans, rng)
    interleaved = np.stack([nonnoise_lengths, noise_lengths], axis=1).reshape(-1)  # (2*spans,)
    span_starts = np.cumsum(interleaved)[:-1]
    start_indicator = np.zeros(length, dtype=np.int64)
    start_indicator[span_starts] = 1
    return np.cumsum(start_indicator) % 2 == 1


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths (num_segments,) >= 1 summing to num_items, a uniformly random composition."""
    first_in_segment = np.arange(num_items - 1) < num_segments - 1
    rng.shuffle(first_in_segment)
    segment_id = np.cumsum(np.concatenate(([0], first_in_segment)))
    return np.bincount(segment_id, minlength=num_segments)


def span_corrupt(tokens: np.ndarray, noise_mask: np.ndarray, sentinel_ids: Sequence[int],
                 eos: int) -> Tuple[np.ndarray, np.ndarray]:
    """(encoder input, targets) int64: span k -> sentinel_ids[k] in the input, sentinel_ids[k] + span in targets."""
    span_start = noise_mask & ~np.concatenate(([False], noise_mask[:-1]))
    num_spans = int(span_start.sum())
    if num_spans > len(sentinel_ids):
        raise ValueError(f"{num_spans} noise spans need as many sentinels, tokenizer has {len(sentinel_ids)}")
    sentinels = np.asarray(sentinel_ids[:num_spans], dtype=np.int64)
    span_id = np.cumsum(span_start) - 1  # (R,) span of each noise token
    tokens = np.asarray(tokens, dtype=np.int64)

    encoder = tokens.copy()
    encoder[span_start] = sentinels
    encoder = np.append(encoder[~noise_mask | span_start], eos)

    noise_pos = np.flatnonzero(noise_mask)
    rank = np.arange(len(noise_pos))
    targets = np.empty(len(noise_pos) + num_spans + 1, dtype=np.int64)
    targets[rank + span_id[noise_pos] + 1] = tokens[noise_pos]
    targets[rank[span_start[noise_pos]] + np.arange(num_spans)] = sentinels
    targets[-1] = eos
    return encoder, targets


def t5_sample(encoder: np.ndarray, targets: np.ndarray, enc_seq_length: int, dec_seq_length: int,
              pad: int) -> dict:
    """Padded model inputs and masks: text_enc (E,), text_dec (D,), labels (D,), loss_mask (D,), masks."""
    n_enc, n_dec = len(encoder), len(targets)
    text_enc = np.full(enc_seq_length, pad, dtype=np.int64)
    text_enc[:n_enc] = encoder
    labels = np.full(dec_seq_length, pad, dtype=np.int64)
    labels[:n_dec] = targets
    text_dec = np.full(dec_seq_length, pad, dtype=np.int64)
    text_dec[1:n_dec] = targets[:-1]
    loss_mask = (np.arange(dec_seq_length) < n_dec).astype(np.float32)
    enc_key_pad = np.arange(enc_seq_length) >= n_enc  # (E,)
    dec_pos = np.arange(dec_seq_length)
    dec_mask = (dec_pos[None, :] > dec_pos[:, None]) | (dec_pos >= n_dec)[None, :]  # (D, D)
    return {
        "text_enc": text_enc, "text_dec": text_dec, "labels": labels, "loss_mask": loss_mask,
        "enc_mask": np.broadcast_to(enc_key_pad, (enc_seq_length, enc_seq_length)).copy(),
        "dec_mask": dec_mask,
        "enc_dec_mask": np.broadcast_to(enc_key_pad, (dec_seq_length, enc_seq_length)).copy(),
    }


class T5Dataset(torch.utils.data.Dataset):
    """Span-corrupted windows of the documents; __getitem__(i) -> dict of numpy arrays (see module doc)."""

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray, indexed_dataset, num_samples: int,
                 tokenizer, enc_seq_length: int, dec_seq_length: int, seed: int, noise_density: float = 0.15,
                 mean_span_length: float = 3.0):
        self.raw_length, _, _ = t5_lengths(enc_seq_length, dec_seq_length, noise_density, mean_span_length)
        _, spans = _noise_and_spans(self.raw_length, noise_density, mean_span_length)
        if spans > len(tokenizer.sentinel_ids):
            raise ValueError(f"windows of {self.raw_length} tokens make {spans} noise spans but the tokenizer has "
                             f"{len(tokenizer.sentinel_ids)} sentinels; add <extra_id_*> tokens")
        self.windows = GPTDataset(f"{name}_t5", data_prefix, documents, indexed_dataset, num_samples,
                                  self.raw_length - 1, seed)
        self.tokenizer = tokenizer
        self.enc_seq_length, self.dec_seq_length = enc_seq_length, dec_seq_length
        self.seed = seed
        self.noise_density, self.mean_span_length = noise_density, mean_span_length

    def __len__(self) -> int:
        return len(self.windows)

    def corrupt(self, idx: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(raw window (R,), encoder input, targets) of sample idx, unpadded."""
        tokens = self.windows[idx]["text"]
        rng = np.random.default_rng([self.seed, idx])
        noise = random_spans_noise_mask(len(tokens), self.noise_density, self.mean_span_length, rng)
        encoder, targets = span_corrupt(tokens, noise, self.tokenizer.sentinel_ids, self.tokenizer.eos)
        return tokens, encoder, targets

    def __getitem__(self, idx: int) -> dict:
        _, encoder, targets = self.corrupt(int(idx))
        return t5_sample(encoder, targets, self.enc_seq_length, self.dec_seq_length, self.tokenizer.pad)


def build_t5_datasets(data_prefix: Sequence[str], splits_string: str, num_samples: Sequence[int],
                      enc_seq_length: int, dec_seq_length: int, seed: int, tokenizer, noise_density: float = 0.15,
                      mean_span_length: float = 3.0, skip_warmup: bool = True) -> list:
    """[train, valid, test] T5Datasets (BlendableDatasets when data_prefix = [w1, p1, w2, p2, ...]).

    The documents may hold only the tokenizer's text ids, below its first sentinel (`token_ids.text_limit`):
    span corruption gives sentinel ids their meaning."""
    def make_dataset(name, prefix, documents, indexed_dataset, n):
        return T5Dataset(name, prefix, documents, indexed_dataset, n, tokenizer, enc_seq_length, dec_seq_length,
                         seed, noise_density, mean_span_length)
    return build_split_datasets(data_prefix, splits_string, num_samples, make_dataset, skip_warmup,
                                text_limit(tokenizer))
