"""The planner's golden ranking: Llama 3 8B (tests/planning/llama3_8b_config.json) on 2 x 8 H100s, global batch 512,
sequence 8192, bf16 (the command: harness/planner_case.py). tests/golden/llama3_8b_plan.json holds the command's
first 20 layouts exactly as `--json` prints them, and the whole ranking, one row per layout: `Layout.short()`, fits, step time, peak (`ranking_rows`); tests/planning/test_plan_golden.py pins the ranking
to it and bench/plan_speed.py times the same command. Written by the planner of 2026-11-28, before the ranking was
made faster (issue 44):

    .venv/bin/python -m tests.planning.golden_plan
"""
from __future__ import annotations

import contextlib
import io
import json
import os

from harness.planner_case import CONFIG, argv

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "..", "golden", "llama3_8b_plan.json")
TOP = 20


def plan_json(config: str = CONFIG) -> dict:
    """The tool's --json output for the golden case, parsed."""
    from tools.plan_layout import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(argv(config))
    return json.loads(out.getvalue())


def ranking_rows(cands: list) -> list:
    """One line per layout in rank order: its short form, whether it fits, the step time and the peak (repr: exact)."""
    from megatron.planning.memory import Layout
    return [f"{Layout(**c['layout']).short()} | {'fits' if c['fits'] else 'no'} | {c['step']['total']!r} | "
            f"{c['peak']!r}" for c in cands]


def record(plan: dict) -> dict:
    cands = plan["candidates"]
    return dict(command="python tools/plan_layout.py " + " ".join(argv("tests/planning/llama3_8b_config.json")),
                regenerate=".venv/bin/python -m tests.planning.golden_plan", layouts=len(cands),
                fitting=sum(c["fits"] for c in cands), model=plan["model"], cluster=plan["cluster"],
                top=cands[:TOP], ranking=ranking_rows(cands))


def main() -> None:
    with open(GOLDEN, "w") as f:
        json.dump(record(plan_json()), f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.normpath(GOLDEN)}")


if __name__ == "__main__":
    main()
