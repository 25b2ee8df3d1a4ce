"""Weighted blending of several datasets (Megatron's BlendableDataset + helpers.build_blending_indices).

Blend sample k comes from dataset_index[k] at that dataset's sample dataset_sample_index[k]. The choice is
Megatron's greedy max-error rule with normalised weights w and counts c_d of samples taken so far:

    dataset_index[k] = argmax_d (w_d * max(k, 1) - c_d)      (first d on ties)

so every prefix of the blend holds w_d * k samples of dataset d to within one sample.
"""
from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

BLEND_OVERSAMPLE = 1.005  # each dataset is asked for ceil(n * w * 1.005) samples
_CHUNK = 1 << 20  # blend samples per pass of the greedy loop


def normalize_weights(weights: Sequence[float]) -> np.ndarray:
    """weights / sum(weights) as float64; all must be >= 0 with a positive sum."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"blend weights must be >= 0 with a positive sum, got {list(weights)}")
    return w / w.sum()


def parse_blend(data_prefix: Sequence[str], num_samples: Sequence[int]
                ) -> Tuple[List[str], List[float], List[List[int]]]:
    """[w1, p1, w2, p2, ...] -> (prefixes, normalised weights, per-prefix [ceil(n * w * 1.005) for n])."""
    if len(data_prefix) % 2 != 0:
        raise ValueError(f"a blend is 'weight prefix' pairs, got {len(data_prefix)} items: {list(data_prefix)}")
    try:
        raw = [float(w) for w in data_prefix[0::2]]
    except ValueError:
        raise ValueError(f"blend weights must be numbers, got {list(data_prefix[0::2])}")
    prefixes = [str(p).strip() for p in data_prefix[1::2]]
    weights = [float(w) for w in normalize_weights(raw)]
    per_prefix = [[int(math.ceil(n * w * BLEND_OVERSAMPLE)) for n in num_samples] for w in weights]
    return prefixes, weights, per_prefix


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 (size,), dataset_sample_index int64 (size,)) by the greedy max-error rule.

    A tight loop over Python floats (IEEE doubles, the same arithmetic as Megatron's C++ helper), run in
    chunks so that the Python lists stay small: about 0.3 s per 10^6 samples for two datasets.
    """
    w = [float(x) for x in normalize_weights(weights)]
    if len(w) >= np.iinfo(np.int16).max:
        raise ValueError(f"at most {np.iinfo(np.int16).max - 1} datasets can be blended, got {len(w)}")
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * len(w)
    for lo in range(0, size, _CHUNK):
        hi = min(lo + _CHUNK, size)
        chosen, taken = _greedy_chunk(w, counts, lo, hi)
        dataset_index[lo:hi] = chosen
        dataset_sample_index[lo:hi] = taken
    return dataset_index, dataset_sample_index


def _greedy_chunk(w: List[float], counts: List[int], lo: int, hi: int) -> Tuple[List[int], List[int]]:
    """Greedy picks for blend samples [lo, hi); updates `counts` in place."""
    chosen = [0] * (hi - lo)
    taken = [0] * (hi - lo)
    others = range(1, len(w))
    w0 = w[0]
    for j, k in enumerate(range(lo, hi)):
        kk = float(k) if k > 1 else 1.0
        best, best_err = 0, w0 * kk - counts[0]
        for d in others:
            err = w[d] * kk - counts[d]
            if err > best_err:
                best, best_err = d, err
        chosen[j] = best
        taken[j] = counts[best]
        counts[best] += 1
    return chosen, taken


class BlendableDataset(torch.utils.data.Dataset):
    """`size` samples drawn from `datasets` in the proportions `weights` (normalised)."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(datasets)} datasets, {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize_weights(weights)
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, (dataset, n) in enumerate(zip(self.datasets, needed)):
            if n > len(dataset):
                raise ValueError(f"blend of {self.size} samples needs {n} from dataset {d} "
                                 f"(weight {self.weights[d]:.4f}) but it has only {len(dataset)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        return self.datasets[self.dataset_index[idx]][int(self.dataset_sample_index[idx])]
