"""Cost of the data checksum sidecar (megatron/data/checksums.py) on a ~1 GB .bin.

    python bench/data_checksum.py [--gib 1.0] [--rounds 5] [--random 10000]

Protocol (one run, in a temporary directory deleted at the end):
  1. A synthetic pair: --gib GiB of uint16 token ids (vocabulary 50257) in items of 1 to 2047 tokens (mean
     1024), one item per document; the .bin written 64 MiB at a time, the .idx by `write_index`. A second prefix
     hard-links the same two files without a sidecar, so both readers share one page cache. One untimed read
     of the .bin warms it.
  2. Writing the sidecar (`checksums.write`: a CRC-32 per 1 MiB chunk and one for the .idx), best of --rounds,
     against one plain pass reading the .bin (numpy sum over the mmap, 64 MiB at a time).
  3. One full pass reading every item through MMapIndexedDataset (`ds[i]`, copied to int64 as GPTDataset's
     samples are), with the sidecar (a fresh reader each round: every chunk is checked on its first touch)
     and without, interleaved, --rounds each; the ratio is the median of the rounds' ratios. The open of
     each reader (the .idx CRC with the sidecar) is timed apart (wall time).
  4. --random random items (the same indices for both), fresh readers, --rounds each: the first touch of each
     chunk in random order, where the checks are front-loaded; then the same items again on the same readers
     (every touched chunk already checked).
Steps 3 and 4 count this process's CPU time (time.process_time: the pass is CPU-bound on a warm page cache),
which other jobs on the shared cores disturb far less than wall time; steps 1 and 2 are wall time.
Prints the times and the ratios verified / unverified.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

from megatron.data import checksums
from megatron.data.indexed_dataset import MMapIndexedDataset, write_index
from token_id_check import best_of  # bench/ is on the path when a script runs

VOCAB = 50257
BLOCK_TOKENS = 1 << 25  # items are generated and written 64 MiB at a time


def make_pair(prefix: str, gib: float, seed: int = 0) -> int:
    """A uint16 pair of `gib` GiB of tokens, in items of 1 to 2047 tokens (one per document); returns the item
    count. The .bin is written 64 MiB at a time and the .idx by `write_index`, as the builder writes them."""
    rng = np.random.default_rng(seed)
    target = int(gib * (1 << 30)) // 2
    with open(prefix + ".bin", "wb") as f:
        for start in range(0, target, BLOCK_TOKENS):
            rng.integers(0, VOCAB, size=min(BLOCK_TOKENS, target - start), dtype=np.uint16).tofile(f)
    sizes = rng.integers(1, 2048, size=target // 1000 + 1000)  # mean 1024: more than enough tokens
    ends = np.cumsum(sizes)
    assert ends[-1] >= target
    n_items = int(np.searchsorted(ends, target)) + 1
    sizes = sizes[:n_items]
    sizes[-1] -= int(ends[n_items - 1]) - target  # the last item ends with the .bin
    write_index(prefix + ".idx", np.uint16, sizes, np.arange(n_items + 1))
    return n_items


def plain_read(path: str) -> None:
    data = np.memmap(path, mode="r", dtype=np.uint8)
    for start in range(0, len(data), 1 << 26):
        int(data[start:start + (1 << 26)].sum(dtype=np.uint64))


def timed_open(prefix: str) -> tuple:
    start = time.perf_counter()
    dataset = MMapIndexedDataset(prefix)
    return dataset, time.perf_counter() - start


def read_items(dataset: MMapIndexedDataset, indices) -> float:
    """CPU seconds of this process reading the items (steadier than wall time on shared cores)."""
    start = time.process_time()
    for i in indices:
        dataset[int(i)].astype(np.int64)
    return time.process_time() - start


def chunks_touched(dataset: MMapIndexedDataset, indices, chunk_bytes: int) -> int:
    """How many chunks the items `indices` overlap."""
    ends = np.cumsum(dataset.sizes, dtype=np.int64) * dataset.dtype.itemsize
    starts = ends - dataset.sizes.astype(np.int64) * dataset.dtype.itemsize
    return len({k for i in indices for k in range(starts[i] // chunk_bytes, (ends[i] - 1) // chunk_bytes + 1)})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="size of the synthetic .bin")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--random", type=int, default=10000, help="random items read in step 4")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        checked, plain = os.path.join(work, "checked"), os.path.join(work, "plain")
        start = time.perf_counter()
        items = make_pair(checked, a.gib)
        for ext in (".bin", ".idx"):
            os.link(checked + ext, plain + ext)
        bin_bytes, idx_bytes = os.path.getsize(checked + ".bin"), os.path.getsize(checked + ".idx")
        print(f"pair: {bin_bytes / 2**30:.2f} GiB .bin, {idx_bytes / 2**20:.1f} MiB .idx, {items} items "
              f"(made in {time.perf_counter() - start:.1f} s)")
        plain_read(checked + ".bin")  # warm the page cache

        read_s = best_of(a.rounds, lambda: plain_read(checked + ".bin"))
        write_s = best_of(a.rounds, lambda: checksums.write(checked))
        chunks = len(checksums.read(checked).bin_crc32)
        print(f"write the sidecar ({chunks} chunks): {write_s:.3f} s ({bin_bytes / write_s / 1e9:.2f} GB/s) = "
              f"{write_s / read_s:.2f} x one plain read of the .bin ({read_s:.3f} s, {bin_bytes / read_s / 1e9:.2f} "
              f"GB/s)")

        every = range(items)
        opens = {"verified": [], "unverified": []}
        passes = {"verified": [], "unverified": []}
        for _ in range(a.rounds):
            for name, prefix in (("unverified", plain), ("verified", checked)):
                dataset, open_s = timed_open(prefix)
                opens[name].append(open_s)
                passes[name].append(read_items(dataset, every))
        med = {name: statistics.median(times) for name, times in passes.items()}
        open_med = {name: statistics.median(times) for name, times in opens.items()}
        ratios = [v / u for v, u in zip(passes["verified"], passes["unverified"])]
        print(f"open: verified {1e3 * open_med['verified']:.1f} ms (the .idx CRC), unverified "
              f"{1e3 * open_med['unverified']:.1f} ms")
        print(f"full pass over {items} items: verified {med['verified']:.2f} s, unverified {med['unverified']:.2f} s "
              f"(medians) -> ratio {statistics.median(ratios):.3f} (median of the rounds: "
              f"{', '.join(f'{r:.3f}' for r in ratios)})")

        indices = np.random.default_rng(1).integers(0, items, size=a.random)
        first, again = {"verified": [], "unverified": []}, {"verified": [], "unverified": []}
        for _ in range(a.rounds):
            for name, prefix in (("unverified", plain), ("verified", checked)):
                dataset, _ = timed_open(prefix)
                first[name].append(read_items(dataset, indices))
                again[name].append(read_items(dataset, indices))
        touched = chunks_touched(dataset, indices, checksums.CHUNK_BYTES)
        f = {name: statistics.median(times) for name, times in first.items()}
        g = {name: statistics.median(times) for name, times in again.items()}
        print(f"{a.random} random items, fresh readers: verified {f['verified']:.3f} s ({touched} of {chunks} chunks "
              f"checked on first touch), unverified {f['unverified']:.3f} s -> ratio "
              f"{statistics.median(v / u for v, u in zip(first['verified'], first['unverified'])):.2f}; the same "
              f"items again: verified {g['verified']:.3f} s, unverified {g['unverified']:.3f} s -> ratio "
              f"{statistics.median(v / u for v, u in zip(again['verified'], again['unverified'])):.3f}")

if __name__ == "__main__":
    main()
