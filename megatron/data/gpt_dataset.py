"""GPT dataset: Megatron's doc_idx / sample_idx / shuffle_idx indexing over an mmap indexed dataset.

Layout (compatible with Megatron v2.x `data/gpt_dataset.py` + `helpers.build_sample_idx`):

    documents       int32 (D,)       item ids of this split (a contiguous range of the indexed dataset)
    doc_idx         int32 (E*D,)     `documents` tiled over E epochs, shuffled (last epoch apart if separate)
    sample_idx      int32 (S+1, 2)   row j = (position in doc_idx, token offset) where sample j starts
    shuffle_idx     uint32 (S,)      sample order (int64 when S >= 2^32 - 1)

    T = tokens per epoch = sum(sizes[documents]),  L = seq_length,  S = (E*T - 1) // L.

Sample j holds the L+1 tokens at global positions [j*L, (j+1)*L] of the concatenation of the documents in
doc_idx order; consecutive samples share one token (the last input's label is the next sample's first input).

The three arrays are cached as `{prefix}_{name}_indexmap_{N}ns_{L}sl_{seed}s_{doc,sample,shuffle}_idx.npy`,
built by global rank 0 and loaded by every rank with mmap_mode='r'. Given a `TokenLimit`, the datasets
check the token ids of each prefix first, the same way (`megatron.data.token_ids`: cached range). Each prefix is
read against its own checksum sidecar (`megatron.data.checksums`); rank 0 names the prefixes without one.
"""
from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendableDataset, parse_blend
from megatron.data.checksums import unverified_note
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.token_ids import TokenLimit, cached_token_id_range, check_token_ids
from megatron.logging_utils import print_line, print_rank_0

SPLIT_NAMES = ("train", "valid", "test")
LAST_EPOCH_FRACTION = 0.80  # the last epoch is shuffled apart when it supplies < 80% of an epoch's samples


def parse_split(splits_string: str, num_items: int) -> List[int]:
    """Split boundaries [0, b1, b2, M] for "949,50,1" or "949/50/1" (Megatron's get_train_valid_test_split_).

    Weights are padded with zeros to three and normalised; b_i = sum_{k<i} round(w_k * M), then every
    boundary is shifted by the same amount so that the last one equals M.
    """
    separator = "," if "," in splits_string else "/"
    try:
        weights = [float(s) for s in splits_string.split(separator)]
    except ValueError:
        raise ValueError(f"split string {splits_string!r} must be numbers separated by ',' or '/', e.g. '949,50,1'")
    weights = (weights + [0.0, 0.0])[:3]
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"split weights {weights} from {splits_string!r} must be >= 0 with a positive sum")
    total = sum(weights)
    bounds = [0]
    for weight in weights:
        bounds.append(bounds[-1] + int(round(weight / total * float(num_items))))
    diff = bounds[-1] - num_items
    return [bounds[0]] + [b - diff for b in bounds[1:]]


def num_epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest E >= 1 with (E*T - 1) // L >= num_samples, i.e. E = ceil((num_samples*L + 1) / T)."""
    if tokens_per_epoch <= 0 or seq_length <= 0:
        raise ValueError(f"need a positive token count and seq_length, got {tokens_per_epoch} tokens, "
                         f"seq_length {seq_length}")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def separate_last_epoch_samples(tokens_per_epoch: int, seq_length: int, num_samples: int) -> Optional[int]:
    """Samples in the first E-1 epochs if the last epoch is shuffled apart, else None.

    The last epoch is separate when E > 1 and it supplies fewer than int(0.8 * per-epoch) samples.
    """
    epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    if epochs == 1:
        return None
    n_prev = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return n_prev if num_samples - n_prev < int(LAST_EPOCH_FRACTION * per_epoch) else None


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                  separate_last_epoch: bool) -> np.ndarray:
    """`documents` tiled num_epochs times and shuffled (int32); the last epoch shuffled on its own if separate."""
    if separate_last_epoch and num_epochs > 1:
        first = build_doc_idx(documents, num_epochs - 1, rng, False)
        last = build_doc_idx(documents, 1, rng, False)
        return np.concatenate((first, last))
    doc_idx = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(doc_idx)
    return doc_idx


def build_sample_idx(sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int,
                     tokens_per_epoch: int) -> np.ndarray:
    """sample_idx (S+1, 2) int32, vectorised.

    With cum[i] = sum(sizes[doc_idx[:i]]), sample j starts at global token p_j = j*L. Its row is the
    document position i = max{i : cum[i] <= p_j} (never an empty document, since p_j < cum[-1]) and the
    offset p_j - cum[i]. Row 0 is (0, 0) as in Megatron's loop, even if doc_idx[0] is an empty document.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    cum = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=cum[1:])
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(cum, starts, side="right") - 1
    index_dtype = np.int32 if len(doc_idx) < np.iinfo(np.int32).max else np.int64
    sample_idx = np.empty((num_samples + 1, 2), dtype=index_dtype)
    sample_idx[:, 0] = doc_pos
    sample_idx[:, 1] = starts - cum[doc_pos]
    sample_idx[0] = 0
    return sample_idx


def build_shuffle_idx(num_first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """arange(num_first) shuffled, then arange(num_first, total) shuffled on its own."""
    dtype = np.int64 if total >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_first, dtype=dtype)
    rng.shuffle(first)
    if num_first == total:
        return first
    last = np.arange(num_first, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_index_arrays(sizes: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int,
                       seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) exactly as Megatron v2.x builds them from RandomState(seed)."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    num_epochs = num_epochs_needed(tokens_per_epoch, seq_length, num_samples)
    n_prev = separate_last_epoch_samples(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed=seed)
    doc_idx = build_doc_idx(documents, num_epochs, rng, n_prev is not None)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch)
    total = sample_idx.shape[0] - 1
    shuffle_idx = build_shuffle_idx(total if n_prev is None else n_prev, total, rng)
    return doc_idx, sample_idx, shuffle_idx


def index_file_names(data_prefix: str, name: str, num_samples: int, seq_length: int, seed: int) -> List[str]:
    """Cache paths of doc_idx, sample_idx and shuffle_idx (old Megatron names)."""
    stem = f"{data_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s"
    return [f"{stem}_{kind}_idx.npy" for kind in ("doc", "sample", "shuffle")]


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _is_builder_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def load_or_build_index(sizes: np.ndarray, documents: np.ndarray, data_prefix: str, name: str,
                        num_samples: int, seq_length: int, seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cached index arrays: global rank 0 builds missing files, all ranks wait, then load with mmap_mode='r'.

    Collective when torch.distributed is initialised: every rank of the world must call it (global barrier).
    The cache files must be on a file system that all ranks see.
    """
    paths = index_file_names(data_prefix, name, num_samples, seq_length, seed)
    if _is_builder_rank() and not all(os.path.isfile(p) for p in paths):
        start = time.time()
        arrays = build_index_arrays(sizes, documents, num_samples, seq_length, seed)
        for path, array in zip(paths, arrays):
            _save_atomic(path, array)
        print_line(f" > built {name} index for {num_samples} samples of {seq_length} tokens "
                   f"({len(arrays[0])} docs, {len(arrays[2])} samples) in {time.time() - start:.2f} s")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    arrays = tuple(np.load(p, allow_pickle=False, mmap_mode="r") for p in paths)
    _check_cached_doc_idx(arrays[0], sizes, documents, num_samples, seq_length, paths[0])
    return arrays


def _check_cached_doc_idx(doc_idx: np.ndarray, sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                          seq_length: int, path: str) -> None:
    """The cache name does not say which documents (split) it indexes: check the epoch count and id range."""
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    expected = num_epochs_needed(tokens_per_epoch, seq_length, num_samples) * len(documents)
    lo, hi = int(np.min(documents)), int(np.max(documents))
    if len(doc_idx) != expected or int(doc_idx.min()) != lo or int(doc_idx.max()) != hi:
        raise ValueError(f"{path} indexes {len(doc_idx)} documents in [{doc_idx.min()}, {doc_idx.max()}] but this "
                         f"split needs {expected} in [{lo}, {hi}] (split or data changed?); delete the three "
                         f"*_idx.npy files of this name to rebuild")


class GPTDataset(torch.utils.data.Dataset):
    """Samples of seq_length+1 tokens: __getitem__(i) -> {'text': int64 (seq_length+1,)}."""

    def __init__(self, name: str, data_prefix: str, documents: np.ndarray, indexed_dataset, num_samples: int,
                 seq_length: int, seed: int):
        sizes = indexed_dataset.sizes
        if len(documents) == 0 or documents.min() < 0 or documents.max() >= sizes.shape[0]:
            raise ValueError(f"{name}: documents must be a non-empty subset of [0, {sizes.shape[0]}), "
                             f"got {len(documents)} ids")
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.doc_idx, self.sample_idx, self.shuffle_idx = load_or_build_index(
            sizes, documents, data_prefix, name, num_samples, seq_length, seed)

    def __len__(self) -> int:
        return self.sample_idx.shape[0] - 1

    def __getitem__(self, idx: int) -> dict:
        return {"text": self.tokens(int(self.shuffle_idx[idx]))}

    def tokens(self, sample: int) -> np.ndarray:
        """The L+1 tokens of unshuffled sample `sample`, int64."""
        doc_f, offset_f = (int(v) for v in self.sample_idx[sample])
        doc_l, offset_l = (int(v) for v in self.sample_idx[sample + 1])
        get = self.indexed_dataset.get
        if doc_f == doc_l:
            parts = [get(int(self.doc_idx[doc_f]), offset=offset_f, length=offset_l - offset_f + 1)]
        else:
            parts = [get(int(self.doc_idx[doc_f]), offset=offset_f)]
            parts += [get(int(self.doc_idx[i])) for i in range(doc_f + 1, doc_l)]
            parts.append(get(int(self.doc_idx[doc_l]), length=offset_l + 1))
        return np.concatenate(parts).astype(np.int64)


DatasetFactory = Callable[[str, str, np.ndarray, object, int], torch.utils.data.Dataset]


def build_split_datasets(data_prefix: Sequence[str], splits_string: str, num_samples: Sequence[int],
                         make_dataset: DatasetFactory, skip_warmup: bool = True,
                         token_limit: Optional[TokenLimit] = None) -> list:
    """[train, valid, test] (None where a split is empty) from [prefix] or [w1, p1, w2, p2, ...].

    make_dataset(name, prefix, documents, indexed_dataset, n) builds one split of one prefix. When blending,
    each prefix is asked for ceil(n * w * 1.005) samples and the blend has exactly n samples. With a
    token_limit every prefix's ids must lie in [0, token_limit.size) (TokenIdError otherwise).
    """
    if len(num_samples) != 3:
        raise ValueError(f"need train/valid/test sample counts, got {list(num_samples)}")
    if len(data_prefix) == 1:
        indexed_dataset = _open_prefixes(data_prefix, skip_warmup, token_limit)[0]
        return _build_one_prefix(data_prefix[0], indexed_dataset, splits_string, num_samples, make_dataset)
    prefixes, weights, per_prefix_samples = parse_blend(data_prefix, num_samples)
    indexed = _open_prefixes(prefixes, skip_warmup, token_limit)  # every prefix checked before any index
    per_prefix = [_build_one_prefix(p, ds, splits_string, n, make_dataset)
                  for p, ds, n in zip(prefixes, indexed, per_prefix_samples)]
    blends = []
    for split, n in enumerate(num_samples):
        parts = [(ds[split], w) for ds, w in zip(per_prefix, weights) if ds[split] is not None]
        blends.append(BlendableDataset([d for d, _ in parts], [w for _, w in parts], n) if parts else None)
    return blends


def check_prefix_token_ids(prefix: str, indexed_dataset: MMapIndexedDataset, token_limit: TokenLimit) -> None:
    """Global rank 0 scans the .bin (or finds the cached range), all ranks wait, then every rank checks the
    cached range; collective like load_or_build_index."""
    if _is_builder_rank():
        cached_token_id_range(prefix, indexed_dataset)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    check_token_ids(prefix, indexed_dataset, token_limit)


def _open_prefixes(prefixes: Sequence[str], skip_warmup: bool,
                   token_limit: Optional[TokenLimit]) -> List[MMapIndexedDataset]:
    """Each prefix opened (its .idx checked against its own checksum sidecar) and its token ids checked; one line
    on rank 0 names the prefixes without a sidecar."""
    datasets = []
    for prefix in prefixes:
        datasets.append(MMapIndexedDataset(prefix, skip_warmup=skip_warmup))
        if token_limit is not None:
            check_prefix_token_ids(prefix, datasets[-1], token_limit)
    unverified = [prefix for prefix, dataset in zip(prefixes, datasets) if dataset.sidecar is None]
    if unverified:
        print_rank_0(unverified_note(unverified))
    return datasets


def _build_one_prefix(prefix: str, indexed_dataset: MMapIndexedDataset, splits_string: str,
                      num_samples: Sequence[int], make_dataset: DatasetFactory) -> list:
    bounds = parse_split(splits_string, indexed_dataset.sizes.shape[0])
    datasets = []
    for split, name in enumerate(SPLIT_NAMES):
        lo, hi = bounds[split], bounds[split + 1]
        documents = np.arange(lo, hi, dtype=np.int32)
        datasets.append(make_dataset(name, prefix, documents, indexed_dataset, num_samples[split]) if hi > lo else None)
    return datasets


def build_train_valid_test_datasets(data_prefix: Sequence[str], splits_string: str,
                                    train_valid_test_num_samples: Sequence[int], seq_length: int, seed: int,
                                    skip_warmup: bool = True, token_limit: Optional[TokenLimit] = None) -> list:
    """[train, valid, test] GPTDatasets (or BlendableDatasets when data_prefix = [w1, p1, w2, p2, ...])."""
    def make_dataset(name, prefix, documents, indexed_dataset, n):
        return GPTDataset(name, prefix, documents, indexed_dataset, n, seq_length, seed)
    return build_split_datasets(data_prefix, splits_string, train_valid_test_num_samples, make_dataset, skip_warmup,
                                token_limit)
