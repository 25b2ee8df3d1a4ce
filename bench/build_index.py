"""Time building the GPT sample index (doc_idx, sample_idx, shuffle_idx) for ~10^8 tokens, without a C++ helper.

Protocol: synthetic document sizes (uniform 1..999 tokens, seed 0, 200,000 documents ~ 10^8 tokens),
seq_length 1024. For 1 epoch and several epochs, the arrays are built `--repeats` times and the best time is
reported, split into the three arrays; then the cached build (build + atomic .npy writes) and the cached load
(mmap). The baseline is Megatron's sample_idx loop (the algorithm of helpers.cpp) in Python, timed on the
first `--loop-samples` samples of the 1-epoch index and extrapolated linearly to the full index.
Last, the blending indices (greedy loop) for `--blend-samples` samples over 2 and 3 datasets.

    python bench/build_index.py [--docs 200000] [--seq-length 1024] [--epochs 1 4 16]
"""
import argparse
import os
import tempfile
import time

import numpy as np

from megatron.data import gpt_dataset as gd
from megatron.data.blendable_dataset import build_blending_indices


def best_of(repeats, fn):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def loop_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Megatron's loop (helpers.cpp build_sample_idx), first num_samples rows."""
    sample_idx = np.zeros((num_samples + 1, 2), dtype=np.int32)
    i, offset = 0, 0
    for s in range(1, num_samples + 1):
        remaining = seq_length + 1
        while remaining != 0:
            doc_length = sizes[doc_idx[i]] - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                i += 1
                offset = 0
        sample_idx[s] = (i, offset)
    return sample_idx


def bench_epochs(sizes, documents, seq_length, epochs, repeats):
    tokens = int(sizes.sum(dtype=np.int64))
    num_samples = (epochs * tokens - 1) // seq_length - (1 if epochs > 1 else 0)
    seconds, arrays = best_of(repeats, lambda: gd.build_index_arrays(sizes, documents, num_samples, seq_length, 1))
    doc_idx = arrays[0]
    rng = np.random.RandomState(1)
    t_doc, _ = best_of(repeats, lambda: gd.build_doc_idx(documents, epochs, rng, False))
    t_sample, _ = best_of(repeats, lambda: gd.build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens))
    t_shuffle, _ = best_of(repeats, lambda: gd.build_shuffle_idx(len(arrays[2]), len(arrays[2]), rng))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "bench")
        t_cached, _ = best_of(1, lambda: gd.load_or_build_index(sizes, documents, prefix, "train", num_samples,
                                                                seq_length, 1))
        t_load, _ = best_of(repeats, lambda: gd.load_or_build_index(sizes, documents, prefix, "train",
                                                                    num_samples, seq_length, 1))
    print(f"epochs {epochs:3d}: {epochs * tokens / 1e6:8.1f}M tokens, {len(arrays[2]):9d} samples | "
          f"build {seconds:6.3f} s (doc_idx {t_doc:.3f}, sample_idx {t_sample:.3f}, shuffle_idx {t_shuffle:.3f}) | "
          f"build+save {t_cached:6.3f} s | load {t_load * 1e3:6.2f} ms", flush=True)
    return arrays, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=200_000)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--loop-samples", type=int, default=20_000)
    parser.add_argument("--blend-samples", type=int, default=1_000_000)
    args = parser.parse_args()

    sizes = np.random.RandomState(0).randint(1, 1000, size=args.docs).astype(np.int32)
    documents = np.arange(args.docs, dtype=np.int32)
    print(f"{args.docs} documents, {sizes.sum() / 1e6:.1f}M tokens per epoch, seq_length {args.seq_length}")
    results = {e: bench_epochs(sizes, documents, args.seq_length, e, args.repeats) for e in args.epochs}

    (doc_idx, sample_idx, _), tokens = results[args.epochs[0]]
    n = min(args.loop_samples, len(sample_idx) - 1)
    t_loop, loop_idx = best_of(1, lambda: loop_sample_idx(sizes, doc_idx, args.seq_length, n))
    assert np.array_equal(loop_idx, sample_idx[: n + 1]), "vectorised sample_idx differs from the loop"
    full = (args.epochs[0] * tokens - 1) // args.seq_length
    t_vec, _ = best_of(args.repeats, lambda: gd.build_sample_idx(sizes, doc_idx, args.seq_length,
                                                                 args.epochs[0], tokens))
    t_loop_full = t_loop * full / n
    print(f"baseline: Megatron's sample_idx loop in Python, {n} samples in {t_loop:.3f} s -> "
          f"~{t_loop_full:.1f} s for all {full}; vectorised {t_vec:.3f} s ({t_loop_full / t_vec:.0f}x faster)")
    for weights in ([0.3, 0.7], [0.2, 0.3, 0.5]):
        t_blend, _ = best_of(1, lambda: build_blending_indices(weights, args.blend_samples))
        print(f"blending indices: {args.blend_samples} samples over {len(weights)} datasets in {t_blend:.3f} s")


if __name__ == "__main__":
    main()
