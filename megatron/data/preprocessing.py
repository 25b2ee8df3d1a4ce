"""Tokenizing a corpus into Megatron mmap datasets ``{output_prefix}_{key}_document.{bin,idx}``: the library of
``tools/preprocess_data.py`` (its command line and what the formats, outputs and checksum sidecar are: that
tool's help and docstring); bench/preprocess_data.py times it in process.

    main(argv)               the command line (`tools/preprocess_data.py` is this function)
    preprocess(args, stop)   the run (`args`: get_args' flags), returning its Stats
    StopSignals, Terminated  SIGINT / SIGTERM turned into a clean stop (nothing written)
"""
from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.pool
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional

import numpy as np

from megatron.data import checksums, indexed_dataset
from megatron.data.corpus import BadRecord, Corpus, InputError, Record, open_corpus, record_bytes
from megatron.data.corpus import TEXT_FORMATS
from megatron.errors import ArgumentParser
from megatron.tokenizer import TOKENIZER_TYPES, build_tokenizer

SUFFIXES = (".bin", ".idx", checksums.SUFFIX)  # the pair and its checksum sidecar
CHUNKSIZE = 25  # documents per task sent to a worker (Megatron's imap chunksize)
MAX_REPORTED_BAD_LINES = 5


class Terminated(BaseException):
    """SIGTERM/SIGINT in the main process, raised as an exception so that temporary outputs are removed."""


class StopSignals:
    """Turns SIGTERM/SIGINT into ``Terminated`` at safe points: the first signal only sets a flag, which
    ``check()`` (called between documents) raises, so no exception lands inside multiprocessing's internals;
    a second signal raises at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise Terminated(f"terminated by signal {signum}")
        self.signum = signum

    def check(self) -> None:
        if self.signum is not None:
            raise Terminated(f"terminated by signal {self.signum}")


def _pool_worker_init(encoder: "Encoder") -> None:
    """Workers leave SIGINT to the main process and die quietly on Pool.terminate()'s SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    encoder.initializer()


@dataclass
class Encoded:
    line_no: int
    n_bytes: int
    error: Optional[str] = None
    ids: Dict[str, Optional[np.ndarray]] = field(default_factory=dict)  # None: the document has no tokens


class Encoder:
    """Picklable per-process tokenizing function; ``initializer`` builds the tokenizer in each worker."""
    tokenizer = None

    def __init__(self, args: argparse.Namespace, corpus: Corpus, dtype):
        self.args, self.corpus, self.dtype = args, corpus, dtype

    def initializer(self) -> None:
        a = self.args
        Encoder.tokenizer = build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model,
                                            a.vocab_extra_ids)

    def encode(self, record: Record) -> Encoded:
        result = Encoded(record[0], record_bytes(record))
        try:
            texts = self.corpus.parse(record)
        except BadRecord as e:
            result.error = str(e)
            return result
        for key, text in texts.items():
            ids = Encoder.tokenizer.tokenize(text) if text else []  # a BOS-adding tokenizer gives [bos] for ""
            if ids and self.args.append_eod:
                ids.append(Encoder.tokenizer.eod)
            result.ids[key] = np.asarray(ids, dtype=self.dtype) if ids else None
        return result


class BoundedFeeder:
    """Wraps an iterable so that at most ``limit`` items are taken but not yet ``done()``.

    Pool.imap's task thread otherwise reads the whole input ahead of the workers. ``stop()`` unblocks
    and ends the iteration so that Pool.terminate() can join that thread.
    """

    def __init__(self, items: Iterable, limit: int):
        self._items, self._limit = items, limit
        self._slots = threading.Semaphore(limit)
        self._stopped = False

    def __iter__(self):
        for item in self._items:
            self._slots.acquire()
            if self._stopped:
                return
            yield item

    def done(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        self._stopped = True
        self._slots.release(self._limit)


@dataclass
class Stats:
    docs: int = 0
    tokens: int = 0
    empty: int = 0
    bad: int = 0
    max_id: int = -1  # the largest token id written (-1: none)
    n_bytes: int = 0
    seconds: float = 0.0

    def rates(self) -> str:
        s = max(self.seconds, 1e-9)
        return (f"{self.docs / s:.0f} docs/s, {self.tokens / s:.0f} tokens/s, "
                f"{self.n_bytes / s / 1e6:.2f} MB/s")


class Outputs:
    """One builder per key, writing to temporary names that ``commit`` renames."""

    def __init__(self, prefix: str, keys: List[str], dtype):
        self.final = {key: f"{prefix}_{key}_document" for key in keys}
        self.temp = {key: f"{path}.tmp{os.getpid()}" for key, path in self.final.items()}
        self.builders = {}
        for key, temp in self.temp.items():
            self.builders[key] = indexed_dataset.MMapIndexedDatasetBuilder(temp + ".bin", dtype=dtype)

    def add(self, key: str, ids: np.ndarray) -> None:
        self.builders[key].add_item(ids)
        self.builders[key].end_document()

    def commit(self) -> None:
        for key, builder in self.builders.items():
            builder.finalize(self.temp[key] + ".idx")
            checksums.write(self.temp[key])
        for key, temp in self.temp.items():
            for suffix in SUFFIXES:
                os.replace(temp + suffix, self.final[key] + suffix)

    def discard(self) -> None:
        for key, builder in self.builders.items():
            builder.abort()
            for suffix in SUFFIXES:
                if os.path.exists(self.temp[key] + suffix):
                    os.remove(self.temp[key] + suffix)


def _consume(results: Iterable[Encoded], outputs: Outputs, stats: Stats, args, on_result, start: float,
             stop: StopSignals) -> None:
    """Write results in input order; ``on_result`` frees a feeder slot; rates count from ``start``."""
    for result in results:
        stop.check()
        on_result()
        stats.n_bytes += result.n_bytes
        if result.error is not None:
            if not args.skip_bad_lines:
                raise InputError(result.error + "; use --skip-bad-lines to skip such lines")
            stats.bad += 1
            if stats.bad <= MAX_REPORTED_BAD_LINES:
                print(f"skipping bad line: {result.error}", file=sys.stderr)
            continue
        stats.docs += 1
        for key, ids in result.ids.items():
            if ids is None:
                stats.empty += 1
                continue
            outputs.add(key, ids)
            stats.tokens += len(ids)
            stats.max_id = max(stats.max_id, int(ids.max()))
        if stats.docs % args.log_interval == 0:
            stats.seconds = time.perf_counter() - start
            print(f"Processed {stats.docs} documents ({stats.rates()}).", file=sys.stderr, flush=True)
    stats.seconds = time.perf_counter() - start


def _run(args, encoder: Encoder, outputs: Outputs, stop: StopSignals) -> Stats:
    stats, start = Stats(), time.perf_counter()
    records = encoder.corpus.records()
    if args.workers == 1:
        encoder.initializer()
        _consume(map(encoder.encode, records), outputs, stats, args, lambda: None, start, stop)
        return stats
    feeder = BoundedFeeder(records, limit=args.workers * CHUNKSIZE * 4)
    pool = multiprocessing.Pool(args.workers, initializer=_pool_worker_init, initargs=(encoder,))
    results = pool.imap(encoder.encode, feeder, CHUNKSIZE)
    try:
        _consume(results, outputs, stats, args, feeder.done, start, stop)
    finally:
        feeder.stop()
        _shutdown(pool, results)
    return stats


def _shutdown(pool: multiprocessing.pool.Pool, results: Iterator) -> None:
    """Let the tasks in flight finish (at most the feeder's limit), then close and join the pool.

    Pool.terminate() is kept for a second interrupt: it takes the task queue's reader lock, which an idle
    worker may hold, and has been seen to hang on a loaded machine.
    """
    try:
        while True:
            try:
                next(results)
            except StopIteration:
                break
            except Exception:  # a task that failed in a worker: the error being handled already stops the run
                continue
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


def preprocess(args: argparse.Namespace, stop: Optional[StopSignals] = None) -> Stats:
    """Run the tool on parsed arguments; raises InputError for bad input, Terminated when ``stop`` saw a signal."""
    if args.workers < 1 or args.log_interval < 1:
        raise InputError(f"--workers ({args.workers}) and --log-interval ({args.log_interval}) must be >= 1")
    corpus = open_corpus(args.input, args.text_format, args.json_keys)
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                                    args.vocab_extra_ids)
    except (OSError, ValueError) as e:
        raise InputError(f"cannot build the tokenizer: {e}") from None
    dtype = indexed_dataset.best_fitting_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    outputs = Outputs(args.output_prefix, args.json_keys, dtype)
    try:
        stats = _run(args, Encoder(args, corpus, dtype), outputs, stop or StopSignals())
        outputs.commit()
    except BaseException:
        outputs.discard()
        raise
    print(f"Done: {stats.docs} documents read, {stats.tokens} tokens written (largest id {stats.max_id}, "
          f"tokenizer vocabulary {tokenizer.vocab_size}), {stats.empty} empty skipped, "
          f"{stats.bad} bad lines skipped, {stats.n_bytes / 1e6:.1f} MB in {stats.seconds:.1f} s "
          f"({stats.rates()}) -> {', '.join(outputs.final.values())}", file=sys.stderr, flush=True)
    return stats


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = ArgumentParser(description="Tokenize a corpus into Megatron mmap datasets {output_prefix}_{key}_document.{bin,idx}")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="jsonl, Parquet, or text with one document per line / paragraph; "
                   "jsonl and text may be .gz or .zst compressed (e.g. corpus.jsonl.zst)")
    g.add_argument("--text-format", choices=TEXT_FORMATS, default="auto",
                   help="auto: by the file's suffix (.jsonl/.json, .parquet, else lines), after .gz/.zst")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract from each JSON object (Parquet: string columns)")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip and count malformed lines (Parquet: rows holding a null) instead of failing")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-model", default=None,
                   help="SentencePiece model file; HuggingFaceTokenizer: tokenizer.json or the folder holding it")
    g.add_argument("--vocab-extra-ids", type=int, default=0)
    g.add_argument("--append-eod", action="store_true",
                   help="append the end-of-document token (the tokenizer's eos) to each document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True)
    g.add_argument("--dataset-impl", choices=["mmap"], default="mmap", help="only mmap (kept for compatibility)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    g.add_argument("--log-interval", type=int, default=100000, help="documents between progress lines")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> Stats:
    """The CLI; a mistake raises InputError (run as a script: `error: ...`, exit 2), a signal exits 1."""
    args = get_args(argv)
    try:
        with StopSignals() as stop:
            return preprocess(args, stop)
    except Terminated as e:
        sys.exit(f"preprocess_data.py: error: {e}; no output written")
