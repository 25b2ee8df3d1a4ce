"""What manifest.json costs a save: the CRC-32 of every file against writing the files, both on W ranks.

Protocol: a GPT-2 checkpoint is made once at (tp, pp, dp) = (2, 2, 2) with ZeRO-1 (tests/checkpoint/synthetic.py,
the library's writer; ~2 GB by default) and its files are loaded into memory by W gloo ranks, rank r taking
files r, r + W, ... (as a training save spreads its files over the ranks). Then `--repeats` times, timed on the
wall clock between barriers: every rank torch.save's its files into a fresh tag folder (the save), and
`manifest.save_manifest` of that folder (every rank hashes its share of the files, rank 0 writes the manifest),
exactly the step `engine_io.save_checkpoint` adds after the save's barrier. The files were just written, so
the hashing reads them from the page cache, as it does after a save on a machine with enough memory.
Printed: GB, seconds of each (medians) and the ratio manifest / save.

    python bench/checkpoint_manifest.py                  # W = 2 (this machine's cores), hidden 768, 8 layers
    python bench/checkpoint_manifest.py --world 1 --hidden 512
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

# the repository root, for the test suite's synthetic checkpoints and gloo launcher (tests/ and tools/ are not in the installed package)
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.checkpointing.files import folder_bytes, load_file  # noqa: E402
from megatron.checkpointing.manifest import save_manifest, saved_files  # noqa: E402
from tests.checkpoint.synthetic import TAG, resolved_args, write_synthetic  # noqa: E402
from tests.dist import run_distributed  # noqa: E402


def _between_barriers(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank(src: str, root: str, repeats: int) -> list:
    """(save seconds, manifest seconds) of each repeat, on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {n: load_file(os.path.join(src, n), mmap=False) for n in saved_files(src)[rank::world]
            if n.endswith(".pt")}  # megatron_args.json, a few kB, is left out of the save and in the manifest
    times = []
    for r in range(repeats):
        folder = os.path.join(root, f"save{r}")
        os.makedirs(folder, exist_ok=True)
        save = _between_barriers(lambda: [torch.save(state, os.path.join(folder, n)) for n, state in mine.items()])
        manifest = _between_barriers(lambda: save_manifest(folder))
        times.append((save, manifest))
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
        save, manifest = (statistics.median(t[i] for t in times) for i in (0, 1))
        print(f"save (torch.save of every file): {save:.2f} s ({gb / save:.2f} GB/s); manifest (CRC-32 of every "
              f"file, rank 0 writes): {manifest:.2f} s ({gb / manifest:.2f} GB/s); medians of {a.repeats}")
        print(f"manifest / save = {manifest / save:.3f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
