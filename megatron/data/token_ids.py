"""Every token id of the training data is one the tokenizer has, checked once per dataset before training.

Why: an id >= the vocabulary size (a corpus tokenized with a bigger vocabulary than the one trained with)
falls outside every tensor-parallel rank's slice of the embedding and is masked to a zero row without a
word; the loss of its label is inf. The check refuses such data with one line naming the prefix, the first
offending document, its id and the vocabulary.

Cost: one vectorised numpy min/max pass over ``<prefix>.bin`` (`MMapIndexedDataset.token_id_range`), done
by global rank 0 and cached beside the index maps as ``<prefix>_token_ids.json``::

    {"bin_bytes": ..., "bin_mtime_ns": ..., "bin_inode": ..., "low": <smallest id>, "high": <largest id>}

The cache counts only while the .bin has the same size, mtime and inode (a rewritten or replaced .bin is
scanned again); it is written under a temporary name and renamed. Every rank then reads the cached range,
so every rank raises the same `TokenIdError` (printed once per launch by `megatron.errors`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path
from megatron.errors import UserError


class TokenIdError(UserError):
    """The data holds a token id the tokenizer does not have."""


@dataclass(frozen=True)
class TokenLimit:
    """The data may hold ids [0, size); `what` says where the bound comes from, for the message."""
    size: int
    what: str


def vocabulary_limit(tokenizer) -> TokenLimit:
    """Every id of the tokenizer (GPT-2: the embedding has a row for each)."""
    return TokenLimit(tokenizer.vocab_size, f"the tokenizer has {tokenizer.vocab_size} tokens")


def text_limit(tokenizer) -> TokenLimit:
    """The ids `tokenize` can write, i.e. those before the <extra_id_*> sentinels (T5: a data id equal to a
    sentinel's would read as that sentinel after span corruption)."""
    sentinels = tokenizer.sentinel_ids
    if not sentinels:
        return vocabulary_limit(tokenizer)
    first = sentinels[0]
    return TokenLimit(first, f"the tokenizer has {first} text tokens (ids {first}..{sentinels[-1]} are its "
                             f"{len(sentinels)} <extra_id_*> sentinels)")


def cache_path(prefix: str) -> str:
    return f"{prefix}_token_ids.json"


def _bin_stamp(prefix: str) -> dict:
    stat = os.stat(data_file_path(prefix))
    return {"bin_bytes": stat.st_size, "bin_mtime_ns": stat.st_mtime_ns, "bin_inode": stat.st_ino}


def read_cached_range(prefix: str) -> Optional[Tuple[int, int]]:
    """(low, high) from the cache if it describes the .bin as it is now, else None."""
    try:
        with open(cache_path(prefix)) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return None
    stamp = _bin_stamp(prefix)
    if not isinstance(cached, dict) or {key: cached.get(key) for key in stamp} != stamp:
        return None
    return int(cached["low"]), int(cached["high"])


def scan_and_cache(prefix: str, dataset: MMapIndexedDataset) -> Tuple[int, int]:
    """Scan the .bin for its (smallest, largest) id and write the cache atomically; returns the range."""
    stamp = _bin_stamp(prefix)
    low, high = dataset.token_id_range()
    tmp = f"{cache_path(prefix)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**stamp, "low": low, "high": high}, f)
    os.replace(tmp, cache_path(prefix))
    return low, high


def cached_token_id_range(prefix: str, dataset: MMapIndexedDataset) -> Tuple[int, int]:
    """The cached range, scanning (and caching) when the cache is missing or stale."""
    cached = read_cached_range(prefix)
    return cached if cached is not None else scan_and_cache(prefix, dataset)


def check_token_ids(prefix: str, dataset: MMapIndexedDataset, limit: TokenLimit) -> None:
    """Raise TokenIdError naming the first document with an id outside [0, limit.size)."""
    low, high = cached_token_id_range(prefix, dataset)
    if low >= 0 and high < limit.size:
        return
    document, token_id = dataset.first_token_outside(limit.size)
    raise TokenIdError(f"--data-path {prefix}: document {document} holds token id {token_id} but {limit.what} "
                       f"(ids 0..{limit.size - 1}; the data's ids span {low}..{high}): it was tokenized with "
                       f"another vocabulary; preprocess it again with the tokenizer you train with "
                       f"(tools/preprocess_data.py) or train with the tokenizer it was made with")
