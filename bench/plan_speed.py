"""How long `tools/plan_layout.py` takes to rank the layouts of a cluster: the golden case of
harness/planner_case.py (Llama 3 8B from a config.json on 2 x 8 H100s, global batch 512, sequence 8192, bf16,
--json: 1,695 layouts), the whole command with its imports, on one CPU.

    python bench/plan_speed.py                                # this checkout
    python bench/plan_speed.py --b-tree /path/to/an/older/checkout   # and another one, interleaved: the ratio B / A
    [--rounds 3] [--cpu 0] [--table]

Protocol: one unmeasured run per tree (files into the page cache), then --rounds runs per tree, A and B
alternating, each a fresh process pinned to CPU --cpu (os.sched_setaffinity; -1 leaves it free) running the tree's
own tools/plan_layout.py (PYTHONPATH = the tree) on this checkout's config.json; the time is the process's wall
time from start to exit. Printed per tree: every round, the best and the median, and the layouts the output ranked
(--json's candidates, and how many fit); with two trees the ratio of the medians. --table prints the table instead of
the JSON (the top 20; the layouts are counted from its first line). The load average is printed before and after,
and the share of the machine's CPU time the hypervisor took meanwhile (steal, /proc/stat): on shared cores only the
best of a few runs, and a ratio within one run, mean something.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from harness.planner_case import argv

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))  # this checkout


def run_once(tree: str, cpu: int, table: bool) -> tuple:
    """(wall seconds, layouts ranked, layouts that fit) of one run of the tree's planner."""
    args = [a for a in argv() if not (table and a == "--json")]
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if cpu >= 0 else None
    start = time.perf_counter()
    out = subprocess.run([sys.executable, os.path.join(tree, "tools", "plan_layout.py"), *args], cwd=tree,
                         env=dict(os.environ, PYTHONPATH=tree), preexec_fn=pin, capture_output=True, text=True,
                         timeout=1800)
    wall = time.perf_counter() - start
    if out.returncode:
        raise RuntimeError(f"plan_layout.py in {tree} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    if table:
        fit, ranked = map(int, re.search(r"(\d+) of (\d+) layouts fit", out.stdout).groups())
        return wall, ranked, fit
    cands = json.loads(out.stdout)["candidates"]
    return wall, len(cands), sum(c["fits"] for c in cands)


def cpu_times() -> list:
    """The machine's CPU time counters (/proc/stat: user, nice, system, idle, iowait, irq, softirq, steal, ...)."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a-tree", default=ROOT, help="a checkout (default: this one)")
    ap.add_argument("--b-tree", default=None, help="another checkout, timed in the same run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", type=int, default=0, help="the CPU each run is pinned to (-1: not pinned)")
    ap.add_argument("--table", action="store_true", help="the table instead of --json")
    a = ap.parse_args()
    trees = {"A": os.path.abspath(a.a_tree), **({"B": os.path.abspath(a.b_tree)} if a.b_tree else {})}
    print(f"python tools/plan_layout.py {' '.join(x for x in argv() if not (a.table and x == '--json'))}")
    print(f"one CPU: {a.cpu}; load average before: {os.getloadavg()[0]:.2f}")
    before = cpu_times()
    for tree in trees.values():
        run_once(tree, a.cpu, a.table)  # warm-up, not measured
    walls = {name: [] for name in trees}
    counts = {}
    for _ in range(a.rounds):
        for name, tree in trees.items():
            wall, ranked, fit = run_once(tree, a.cpu, a.table)
            walls[name].append(wall)
            counts[name] = (ranked, fit)
    for name, tree in trees.items():
        w = walls[name]
        print(f"{name} ({tree}): " + " ".join(f"{x:.2f}" for x in w) +
              f" s; best {min(w):.2f} s, median {statistics.median(w):.2f} s; "
              f"{counts[name][0]} layouts ranked, {counts[name][1]} fit")
    if "B" in walls:
        print(f"B / A (medians): {statistics.median(walls['B']) / statistics.median(walls['A']):.3f}")
    after = [y - x for x, y in zip(before, cpu_times())]
    print(f"load average after: {os.getloadavg()[0]:.2f}; the hypervisor took {after[7] / max(1, sum(after)):.0%} of "
          f"the machine's CPU time meanwhile (steal)")


if __name__ == "__main__":
    main()
