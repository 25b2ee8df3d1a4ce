"""Cost of the token-id check (megatron/data/token_ids.py) against the step time of the default job.

    python bench/token_id_check.py [--iters 20] [--synthetic-tokens 268435456] [--repeats 5]

Protocol:
  1. The default job: examples/ds_pretrain_gpt2.sh with its defaults (on CPU: 8 processes, tp=2, pp=2,
     dp=2; the default corpus with its 2048-token BPE, built under a temporary WORK_DIR) for --iters
     iterations, logged every 5; the step time is the median ms/iter of the intervals after the first.
  2. The check on that job's .bin, in this process, best of --repeats: the first check (cache file removed:
     the numpy min/max scan plus the atomic cache write; the .bin is in the page cache) and the cached check
     (stat + read of <prefix>_token_ids.json). The default job runs it once per prefix before its first step.
  3. The same on a synthetic .bin of --synthetic-tokens uint16 ids (512 MiB by default) for the scan rate,
     which is what a large corpus costs.
Prints each time, and the first and cached check as a fraction of one step and of the whole default run
(200 iterations on CPU); the target is < 1% of step time per step.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from megatron.data.indexed_dataset import MMapIndexedDataset, write_index
from megatron.data.token_ids import TokenLimit, cache_path, check_token_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULT_JOB_ITERS = 200  # examples/ds_pretrain_gpt2.sh without GPUs


def default_job_step_ms(work_dir: str, iters: int) -> float:
    env = dict(os.environ, WORK_DIR=work_dir, TRAIN_ITERS=str(iters), LOG_INTERVAL="5", SAMPLES="0",
               PYTHON=sys.executable, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    proc = subprocess.run(["bash", "examples/ds_pretrain_gpt2.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the default job failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    intervals = [float(ms) for ms in re.findall(r"\| ([0-9.]+) ms/iter \|", proc.stdout)]
    return statistics.median(intervals[1:])


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def check_times(prefix: str, repeats: int) -> tuple:
    """(first check, cached check) in ms."""
    dataset = MMapIndexedDataset(prefix)
    limit = TokenLimit(1 << 20, "bench")

    def first():
        if os.path.exists(cache_path(prefix)):
            os.remove(cache_path(prefix))
        check_token_ids(prefix, dataset, limit)
    first_s = best_of(repeats, first)
    cached_s = best_of(repeats, lambda: check_token_ids(prefix, dataset, limit))
    return 1e3 * first_s, 1e3 * cached_s


def synthetic_dataset(directory: str, tokens: int) -> str:
    prefix = os.path.join(directory, "synthetic")
    rng = np.random.default_rng(0)
    rng.integers(0, 50257, size=tokens, dtype=np.uint16).tofile(prefix + ".bin")
    sizes = np.full(tokens // 1024, 1024, dtype=np.int32)
    write_index(prefix + ".idx", np.uint16, sizes, np.arange(len(sizes) + 1))
    return prefix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--synthetic-tokens", type=int, default=1 << 28)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        step_ms = default_job_step_ms(work, a.iters)
        prefix = os.path.join(work, "data", "stdlib_docs_text_document")
        tokens = os.path.getsize(prefix + ".bin") // 2
        first_ms, cached_ms = check_times(prefix, a.repeats)
        big = synthetic_dataset(work, a.synthetic_tokens)
        big_first_ms, big_cached_ms = check_times(big, a.repeats)
    run_ms = step_ms * DEFAULT_JOB_ITERS
    print(f"default job (examples/ds_pretrain_gpt2.sh, {a.iters} iterations): {step_ms:.1f} ms/iter")
    print(f"default corpus, {tokens} tokens: first check {first_ms:.2f} ms = {100 * first_ms / step_ms:.2f}% of "
          f"one step ({100 * first_ms / run_ms:.4f}% of the {DEFAULT_JOB_ITERS}-iteration run); cached check "
          f"{cached_ms:.3f} ms = {100 * cached_ms / step_ms:.3f}% of one step")
    rate = a.synthetic_tokens * 2 / big_first_ms / 1e6
    print(f"synthetic, {a.synthetic_tokens} uint16 tokens: first check {big_first_ms:.1f} ms ({rate:.2f} GB/s, "
          f"{big_first_ms / step_ms:.2f} steps of the default job); cached check {big_cached_ms:.3f} ms")


if __name__ == "__main__":
    main()
