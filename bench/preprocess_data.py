"""Benchmark tools/preprocess_data.py: throughput with 1 and 2 workers on the same corpus, in one run, read as
plain jsonl and as the .jsonl.gz, .jsonl.zst and Parquet files corpora ship as.

Protocol:
1. corpus: the Python standard library's own sources (code, comments, docstrings), split into documents
   at double blank lines, shuffled with a fixed seed, written as jsonl until ``--size-mb`` MB (offline);
2. tokenizer: byte-level BPE trained by tools/train_tokenizer.py on the first ``--train-mb`` MB;
3. warm-up: one preprocessing run on a 1 MB slice (imports, page cache);
4. measured: ``--repeats`` full runs per worker count, the fastest kept; docs/s, tokens/s and MB/s of input
   as the tool counts them (pool start-up included; MB/s: of the jsonl lines, of the texts for Parquet); `ratio`
   is against plain jsonl at the first worker count, `workers x` against the same format at the first worker
   count (the workers' speed-up), and the outputs of all runs (every format, every worker
   count) must be byte-identical. Each format is the same documents: gzip level 6, zstd level 3 with checksums,
   Parquet (pyarrow's defaults, snappy) in row groups of 10,000. The load average is printed before and after:
   on a shared machine other jobs skew the ratio.

    python bench/preprocess_data.py --size-mb 30 --workers 1 2 --repeats 2
"""
import argparse
import filecmp
import gzip
import json
import os
import random
import shutil
import sysconfig
import tempfile
from typing import Callable, Dict, List

from megatron.data import preprocessing as preprocess_data  # the code of tools/preprocess_data.py
from megatron.tokenizer import training as train_tokenizer  # the code of tools/train_tokenizer.py


def stdlib_documents() -> List[str]:
    """Chunks of the stdlib's .py files, split at double blank lines (one top-level block each)."""
    root = sysconfig.get_paths()["stdlib"]
    docs = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
                    docs.extend(chunk.strip("\n") for chunk in f.read().split("\n\n\n") if chunk.strip())
    return docs


def write_corpus(path: str, size_mb: float, seed: int = 0) -> int:
    """jsonl of shuffled stdlib documents (repeated if needed) up to size_mb; returns the document count."""
    docs = stdlib_documents()
    rng = random.Random(seed)
    target, written, count = size_mb * 1e6, 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            rng.shuffle(docs)
            for doc in docs:
                line = json.dumps({"text": doc}) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                count += 1
                if written >= target:
                    break
    return count


def head(src: str, dst: str, size_mb: float) -> str:
    with open(src, encoding="utf-8") as fin, open(dst, "w", encoding="utf-8") as fout:
        written = 0
        for line in fin:
            fout.write(line)
            written += len(line)
            if written >= size_mb * 1e6:
                break
    return dst


def to_gzip(src: str, dst: str) -> None:
    with open(src, "rb") as fin, gzip.open(dst, "wb", compresslevel=6) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)


def to_zstd(src: str, dst: str) -> None:
    import zstandard
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        zstandard.ZstdCompressor(level=3, write_checksum=True).copy_stream(fin, fout)


def to_parquet(src: str, dst: str, rows_per_group: int = 10_000) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    with open(src, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    pq.write_table(pa.table({"text": texts}), dst, row_group_size=rows_per_group)


CONVERTERS: Dict[str, Callable[[str, str], None]] = {
    "jsonl.gz": to_gzip, "jsonl.zst": to_zstd, "parquet": to_parquet}
FORMATS = ("jsonl",) + tuple(CONVERTERS)


def run(corpus: str, prefix: str, vocab: str, merges: str, workers: int) -> preprocess_data.Stats:
    return preprocess_data.main([
        "--input", corpus, "--output-prefix", prefix, "--append-eod", "--workers", str(workers),
        "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
        "--log-interval", "1000000"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=30.0)
    p.add_argument("--train-mb", type=float, default=5.0)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        n_docs = write_corpus(corpus, args.size_mb)
        inputs = {fmt: os.path.join(tmp, f"corpus.{fmt}") for fmt in FORMATS if fmt in args.formats}
        for fmt, path in inputs.items():
            if fmt != "jsonl":
                CONVERTERS[fmt](corpus, path)
        sizes = ", ".join(f"{fmt} {os.path.getsize(path) / 1e6:.1f} MB" for fmt, path in inputs.items())
        print(f"corpus: {n_docs} documents, {sizes} (Python stdlib sources)")
        train_text = train_tokenizer.iter_texts(head(corpus, os.path.join(tmp, "train.jsonl"), args.train_mb))
        vocab, merges = train_tokenizer.train_bpe(train_text, args.vocab_size, os.path.join(tmp, "bpe"))
        warmup = head(corpus, os.path.join(tmp, "warmup.jsonl"), 1.0)
        run(warmup, os.path.join(tmp, "warmup"), vocab, merges, max(args.workers))
        results, outputs = {}, []
        for fmt in inputs:
            for workers in args.workers:
                prefix = os.path.join(tmp, f"{fmt}-w{workers}")
                runs = [run(inputs[fmt], prefix, vocab, merges, workers) for _ in range(args.repeats)]
                results[fmt, workers] = min(runs, key=lambda stats: stats.seconds)
                outputs.append(prefix + "_text_document")
        identical = all(filecmp.cmp(outputs[0] + ext, other + ext, shallow=False)
                        for other in outputs[1:] for ext in (".bin", ".idx"))
        base = next(iter(results.values()))  # plain jsonl (when measured) at the first worker count
        print(f"\nBPE vocab {args.vocab_size}, {base.tokens} tokens, outputs (.bin and .idx) identical across "
              f"formats and runs: {identical}")
        print(f"{'format':>10} {'workers':>7} {'docs/s':>10} {'tokens/s':>12} {'MB/s':>8} {'ratio':>6} "
              f"{'workers x':>9}")
        for (fmt, workers), stats in results.items():
            s, first = stats.seconds, results[fmt, args.workers[0]].seconds
            print(f"{fmt:>10} {workers:>7} {stats.docs / s:>10.0f} {stats.tokens / s:>12.0f} "
                  f"{stats.n_bytes / s / 1e6:>8.2f} {base.seconds / s:>6.2f} {first / s:>9.2f}")
        print(f"cpu cores: {os.cpu_count()}, 1-min load average before/after: {load_before:.1f}/"
              f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
