"""Reshape throughput: GB of checkpoint converted per second, against a plain copy of the same files.

Protocol: a GPT-2 checkpoint of at least 1 GB is made on the fly at (tp, pp, dp) = (2, 2, 2) with ZeRO-1
(weights from the model's initialisation, random Adam state; harness/synthetic.py, written by the
library's writer, which the identity tests check against DeepSpeed's own files). Then, `--repeats` times:
`shutil.copytree` of the checkpoint (the I/O baseline) and `reshape` to each target layout, timed on the wall
clock; throughput = bytes of the source checkpoint / seconds. `inspect` (metadata only) is timed too. The
files were just written, so reads come from the page cache on a machine with enough memory: the figures
measure conversion work, not the disk.

    python bench/reshape_checkpoint.py                       # hidden 768, 8 layers, vocabulary 50257: ~1.5 GB
    python bench/reshape_checkpoint.py --hidden 1024 --layers 12 --targets 1,1,1 4,1,2
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from megatron.checkpointing.reshape import folder_bytes, reshape
from megatron.checkpointing.summary import inspect_lines
from harness.synthetic import TAG, resolved_args, write_synthetic


def _layout(text: str):
    return tuple(int(x) for x in text.split(","))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--targets", nargs="+", default=["4,1,2", "1,4,1"], help="tp,pp,dp of each reshape")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="reshape_bench_", dir=a.workdir)
    try:
        args = resolved_args("gpt2", (2, 2, 2), a.vocab, layers=a.layers, hidden=a.hidden, heads=a.heads)
        made = _timed(lambda: write_synthetic(os.path.join(root, "src"), args))
        src = os.path.join(root, "src")
        gb = folder_bytes(os.path.join(src, TAG)) / 1e9
        files = len(os.listdir(os.path.join(src, TAG)))
        print(f"source: GPT-2 hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}, (2, 2, 2) ZeRO-1: "
              f"{gb:.2f} GB in {files} files (made in {made:.1f} s)")
        inspect_s = _timed(lambda: inspect_lines(src))
        print(f"inspect: {inspect_s * 1e3:.0f} ms (metadata only)")
        copies, results = [], {t: [] for t in a.targets}
        for r in range(a.repeats):
            copies.append(_timed(lambda: shutil.copytree(src, os.path.join(root, f"copy{r}"))))
            shutil.rmtree(os.path.join(root, f"copy{r}"))
            for target in a.targets:
                out = os.path.join(root, f"out_{target.replace(',', '')}_{r}")
                results[target].append(_timed(lambda: reshape(src, out, *_layout(target))))
                shutil.rmtree(out)
        copy_s = statistics.median(copies)
        print(f"copy (baseline):       {gb / copy_s:6.2f} GB/s  (median of {a.repeats}: {copy_s:.1f} s)")
        for target, seconds in results.items():
            s = statistics.median(seconds)
            print(f"reshape -> ({target}): {gb / s:6.2f} GB/s  (median of {a.repeats}: {s:.1f} s; "
                  f"{copy_s / s:.2f} x the copy's speed)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
