"""What manifest.json costs: on a save, the CRC-32 of every file against writing the files; on a load, the check of
every file against the manifest's CRC-32 (while it is read) against the plain read; both on W ranks.

Protocol: a GPT-2 checkpoint is made once at (tp, pp, dp) = (2, 2, 2) with ZeRO-1 (harness/synthetic.py,
the library's writer; ~2 GB by default) and its files are loaded into memory by W gloo ranks, rank r taking
files r, r + W, ... (as a training save spreads its files over the ranks). Then `--repeats` times, timed on the
wall clock between barriers: every rank torch.save's its files into a fresh tag folder (the save), and
`manifest.save_manifest` of that folder (every rank hashes its share of the files, rank 0 writes the manifest),
exactly the step `engine_io.save_checkpoint` adds after the save's barrier. The files were just written, so
the hashing reads them from the page cache, as it does after a save on a machine with enough memory.
Then the load, as `--load` reads (every rank its own files, `torch.load` without mmap through the allowlist):
`reading.load_file(verify=False)` against `load_file(verify=True)` (the CRC-32 computed beside the read and
compared with manifest.json's), alternating, from the page cache (the worst case for the check: nothing else
to wait for).
Printed: GB, seconds of each (medians) and the ratios manifest / save and (checked load - load) / load.

    python bench/checkpoint_manifest.py                  # W = 2 (this machine's cores), hidden 768, 8 layers
    python bench/checkpoint_manifest.py --world 1 --hidden 512
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from megatron.checkpointing.files import folder_bytes
from megatron.checkpointing.reading import load_file
from megatron.checkpointing.manifest import save_manifest, saved_files
from harness.synthetic import TAG, resolved_args, write_synthetic
from harness.dist import run_distributed


def _between_barriers(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _load(folder: str, names: list, verify: bool) -> None:
    for n in names:
        load_file(os.path.join(folder, n), mmap=False, verify=verify)


def _rank(src: str, root: str, repeats: int) -> list:
    """(save, manifest, load, checked load) seconds of each repeat, on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: load_file(os.path.join(src, n), mmap=False) for n in saved_files(src)[rank::world]
            if n.endswith(".pt")}  # megatron_args.json, a few kB, is left out of the save and in the manifest
    times = []
    for r in range(repeats):
        folder = os.path.join(root, f"save{r}")
        os.makedirs(folder, exist_ok=True)
        save = _between_barriers(lambda: [torch.save(state, os.path.join(folder, n)) for n, state in mine.items()])
        manifest = _between_barriers(lambda: save_manifest(folder))
        names = sorted(mine)
        first, second = (False, True) if r % 2 == 0 else (True, False)  # alternate: neither always goes first
        loads = {first: _between_barriers(lambda: _load(folder, names, first)),
                 second: _between_barriers(lambda: _load(folder, names, second))}
        times.append((save, manifest, loads[False], loads[True]))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks that save (and hash) in parallel")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="manifest_bench_", dir=a.workdir)
    try:
        args = resolved_args("gpt2", (2, 2, 2), a.vocab, layers=a.layers, hidden=a.hidden, heads=a.heads)
        src = os.path.join(write_synthetic(os.path.join(root, "src"), args), TAG)
        gb = folder_bytes(src, saved_files(src)) / 1e9
        print(f"checkpoint: GPT-2 hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}, (2, 2, 2) ZeRO-1: "
              f"{gb:.2f} GB in {len(saved_files(src))} files; {a.world} ranks save and hash")
        times = run_distributed(_rank, a.world, src, root, a.repeats, timeout=1800)[0]
        save, manifest, load, checked = (statistics.median(t[i] for t in times) for i in range(4))
        print(f"save (torch.save of every file): {save:.2f} s ({gb / save:.2f} GB/s); manifest (CRC-32 of every "
              f"file, rank 0 writes): {manifest:.2f} s ({gb / manifest:.2f} GB/s); medians of {a.repeats}")
        print(f"load (every file read as --load does): {load:.2f} s ({gb / load:.2f} GB/s); the same checked "
              f"against manifest.json's CRC-32: {checked:.2f} s")
        print(f"manifest / save = {manifest / save:.3f}")
        print(f"CRC check on load: (checked load - load) / load = {(checked - load) / load:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
