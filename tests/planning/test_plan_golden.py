"""tools/plan_layout.py on the golden case (tests/planning/golden_plan.py: Llama 3 8B from a config.json on 2 x 8
H100s, global batch 512, sequence 8192, bf16) against tests/golden/llama3_8b_plan.json, recorded before the ranking
was made faster (issue 44): the same 1,695 layouts, the first 20 with every figure --json prints and the whole
ranking row by row, equal to the bit (the faster ranking makes the same floating-point operations in the same
order: `tds.pipe.schedule_sim.compute_windows` times the schedules as `simulate_timed` does).

How fast it is stays out of the assertions (a loaded 2-core machine doubles a time): what is bounded is the work,
counted by `megatron.planning.shared.SharedTerms` -- each pipeline schedule simulated once (the planner simulated
each three times and walked each stage's instruction list twice per layout), each activation walk shared by the
layouts that differ only in dp and ZeRO. bench/plan_speed.py prints the seconds.
"""
import json
import os
import subprocess
import sys

from megatron.planning.shared import SharedTerms
from tests.planning.golden_plan import GOLDEN, TOP, argv, ranking_rows
from tools import plan_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_command_ranks_as_recorded_and_shares_its_terms(monkeypatch, capsys):
    terms = SharedTerms()
    rank = plan_layout.rank_layouts
    monkeypatch.setattr(plan_layout, "rank_layouts", lambda *a, **kw: rank(*a, shared=terms, **kw))
    plan_layout.main(argv())
    plan = json.loads(capsys.readouterr().out)
    with open(GOLDEN) as f:
        golden = json.load(f)
    cands = plan["candidates"]
    assert (len(cands), sum(c["fits"] for c in cands)) == (golden["layouts"], golden["fitting"]) == (1695, 580)
    assert (plan["model"], plan["cluster"]) == (golden["model"], golden["cluster"])
    assert cands[:TOP] == golden["top"]
    assert ranking_rows(cands) == golden["ranking"]

    layouts = [c["layout"] for c in cands]
    schedules = {(x["schedule"], x["pp"], x["gas"], x["virtual_stages"]) for x in layouts}
    pipelined = {key for key in schedules if key[1] > 1}
    stages = sum(x["pp"] for x in layouts)
    assert terms.computed["schedule"] == len(pipelined) == 99  # one simulation (two cost sets) per schedule
    assert terms.computed["orders"] == len(schedules)
    assert terms.computed["peak"] <= stages // 2  # 2,750 activation walks for 6,210 stages (before: 20,325)


def test_the_planner_imports_neither_torch_nor_deepspeed():
    """The tool starts in a fraction of a second: the planning code, the schedules it simulates
    (tds.pipe.instructions, tds.pipe.schedule_sim) and the config.json reader import without torch."""
    probe = ("import sys, io, contextlib; from tools.plan_layout import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['--hf-config', sys.argv[1], '--global-batch-size', '64', '--bf16', '--gpus-per-node', '4'])\n"
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'deepspeed'}))")
    out = subprocess.run([sys.executable, "-c", probe, argv()[1]], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
