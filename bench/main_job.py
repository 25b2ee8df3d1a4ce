"""The main job (`examples/ds_pretrain_gpt2.sh`: tp = pp = dp = 2, 8 CPU processes) under two settings in one run:
tokens/s, interleaved rounds, medians, the ratio B / A.

    python bench/main_job.py --a-tree /path/to/an/older/checkout            # the defaults then and now
    python bench/main_job.py --b-env COMPILE=1                              # --compile off vs on
    [--rounds 3] [--iters 40] [--a-env K=V ...] [--b-env K=V ...]

Protocol: each run is the example script from a fresh WORK_DIR (no checkpoint to resume) on the same default corpus
(built once, under --data-dir), `SAMPLES=0`, evaluation and saving only at the end; A and B alternate, A first,
--rounds times. tokens/s of a run = the median of its log intervals (every 10 iterations) after the first (which
holds the start-up, and --compile's compilation); a setting's figure = the median over its rounds. Each tree runs
its own script and code (PYTHONPATH = the tree). The load average is printed before and after: on shared cores
only the ratio within one run means something.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
RATE = re.compile(r"\| ([0-9.]+) ms/iter \| ([0-9.]+) tokens/s")


def run_once(tree: str, env_extra: dict, data: str, iters: int) -> tuple:
    """(ms per iteration, tokens/s) medians over the log intervals after the first, of one run in `tree`."""
    with tempfile.TemporaryDirectory() as work:
        env = dict(os.environ, PYTHONPATH=tree, PYTHON=sys.executable, WORK_DIR=work, TRAIN_ITERS=str(iters),
                   LOG_INTERVAL="10", EVAL_INTERVAL=str(10 ** 6), SAVE_INTERVAL=str(10 ** 6), SAMPLES="0",
                   DATA_PATH=os.path.join(data, "stdlib_docs_text_document"),
                   VOCAB_FILE=os.path.join(data, "tokenizer", "vocab.json"),
                   MERGE_FILE=os.path.join(data, "tokenizer", "merges.txt"), **env_extra)
        out = subprocess.run(["bash", os.path.join(tree, "examples", "ds_pretrain_gpt2.sh")], env=env, cwd=tree,
                             capture_output=True, text=True, timeout=3600)
    rates = [(float(ms), float(tok)) for ms, tok in RATE.findall(out.stdout)][1:]
    if out.returncode or not rates:
        raise RuntimeError(f"run in {tree} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return statistics.median(r[0] for r in rates), statistics.median(r[1] for r in rates)


def build_data(folder: str) -> str:
    """The default corpus, tokenizer and .bin/.idx, built once by the script's DRY_RUN (nothing is trained)."""
    data = os.path.join(folder, "data")
    if not os.path.exists(os.path.join(data, "stdlib_docs_text_document.idx")):
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHON=sys.executable, WORK_DIR=folder, DRY_RUN="1")
        subprocess.run(["bash", os.path.join(ROOT, "examples", "ds_pretrain_gpt2.sh")], env=env, cwd=ROOT,
                       check=True, capture_output=True, text=True)
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a-tree", default=ROOT)
    ap.add_argument("--b-tree", default=ROOT)
    ap.add_argument("--a-env", nargs="*", default=[], help="K=V for A's runs")
    ap.add_argument("--b-env", nargs="*", default=[], help="K=V for B's runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "main_job_bench"))
    a = ap.parse_args()
    data = build_data(a.data_dir)
    settings = {"A": (a.a_tree, dict(kv.split("=", 1) for kv in a.a_env)),
                "B": (a.b_tree, dict(kv.split("=", 1) for kv in a.b_env))}
    print(f"A: {settings['A']}, B: {settings['B']}; {a.rounds} rounds of {a.iters} iterations; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results = {"A": [], "B": []}
    for r in range(a.rounds):
        for name, (tree, env) in settings.items():
            ms, tok = run_once(tree, env, data, a.iters)
            results[name].append(tok)
            print(f"round {r + 1} {name}: {ms:.1f} ms/iteration, {tok:.0f} tokens/s (load "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    med = {name: statistics.median(v) for name, v in results.items()}
    print(f"tokens/s median: A {med['A']:.0f}, B {med['B']:.0f}; B / A = {med['B'] / med['A']:.3f}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
