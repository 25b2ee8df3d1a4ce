"""The mutation campaign (harness/faults/campaign.py): every kind of file the project reads, mutated one file per
case (flipped bits, cuts, header fields, named edits), each case driven through the user's command (the example
scripts' preflight and a training process's reads, pretrain's --load, tools/convert_checkpoint.py reshape,
export-hf and import-hf) and judged by harness/faults/judge.py. Prints the table of outcomes per file kind
(docs/long-runs.md, Faults) and every case that ended badly (a traceback, a hang, a silent acceptance, a refusal
that does not name the file); --show-accepted also lists the unchanged and as-written cases with what changed.

    python bench/fault_campaign.py                  # every case (631), seed 0; under a minute on 2 cores
    python bench/fault_campaign.py --per-group 6    # 6 seeded cases of each (file kind, command): make test's
                                                    # subset, without its named edits
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from harness.faults.campaign import BAD, STATUSES, all_cases, build_inputs, run, subset, table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-group", type=int, default=None, help="only this many cases per (file kind, command)")
    p.add_argument("--show-accepted", action="store_true", help="also list the unchanged and as-written cases")
    p.add_argument("--workdir", default=None, help="where to build the inputs and cases (default: a temporary "
                                                   "directory)")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="fault_campaign_", dir=a.workdir)
    try:
        start = time.perf_counter()
        inputs = build_inputs(root)
        cases = all_cases(inputs, a.seed)
        if a.per_group:
            cases = subset(cases, a.per_group, a.seed)
        built = time.perf_counter()
        results = run(inputs, cases, os.path.join(root, "work"), progress=lambda s: print(s, file=sys.stderr))
        seconds = time.perf_counter() - built
        header = ["file kind", "cases", *STATUSES]
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in table(results):
            print("| " + " | ".join(row) + " |")
        commands = sorted({r.case.command for r in results})
        print(f"{len(results)} cases (seed {a.seed}) through {', '.join(commands)}: {seconds:.0f} s "
              f"({built - start:.0f} s to build the inputs)")
        for r in results:
            if r.status in BAD or (a.show_accepted and r.status in ("unchanged", "as written")):
                print(f"{r.status}: {r.case.name}: {r.detail}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
