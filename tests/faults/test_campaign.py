"""The mutation campaign (tests/faults/campaign.py, bench/fault_campaign.py for every case): a seeded subset of
6 cases per (file kind, command), 126 cases, each ends refused with one line naming the file, or in a correct run
(unchanged, or a file without integrity records run as written); none in a traceback, a hang, a silently
accepted change or a refusal that does not name the file. FAULTS_SEED picks another subset.

In `long`: seeded mutations through the example script itself (its preflight, and a launch whose --load reads
a damaged checkpoint): one `error:` line naming the file, exit 2."""
from __future__ import annotations

import os
import random
import shutil

import pytest

from tests.faults.campaign import BAD, STATUSES, all_cases, build_inputs, run, subset, table
from tests.faults.mutations import apply, flips
from tests.faults.script import ROOT, run_script, script_env

SEED = int(os.environ.get("FAULTS_SEED", "0"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(str(tmp_path_factory.mktemp("campaign")))


def test_every_case_is_refused_by_name_or_runs_correctly(inputs, tmp_path):
    cases = subset(all_cases(inputs, SEED), 6, SEED)
    assert len(cases) >= 100 and len({c.command for c in cases}) == 5
    results = run(inputs, cases, str(tmp_path / "work"))
    bad = [f"{r.status}: {r.case.name}: {r.detail}" for r in results if r.status in BAD]
    assert not bad, f"seed {SEED}:\n" + "\n".join(bad)
    total = dict(zip(STATUSES, map(int, table(results)[-1][2:])))
    assert total["refused"] > len(cases) // 2 and sum(total.values()) == len(cases), total
    for r in results:
        if r.status == "refused":
            assert "\n" not in r.detail


def _line(run) -> str:
    errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
    assert run.rc == 2 and len(errors) == 1 and "Traceback" not in run.log, run.log[-3000:]
    return errors[0]


@pytest.mark.long
def test_damaged_inputs_through_the_example_script(inputs, tmp_path):
    """Four input files and two checkpoint files, each flipped at a seeded byte, through the script: the
    preflight refuses the first four before launching; the launch refuses the checkpoint on --load."""
    rng = random.Random(SEED)
    for name in ("data", "bpe"):
        shutil.copytree(inputs.path(name), str(tmp_path / name))
    data = dict(data_prefix=str(tmp_path / "data" / "docs_text_document"), vocab=str(tmp_path / "bpe" / "vocab.json"),
                merges=str(tmp_path / "bpe" / "merges.txt"))
    work = str(tmp_path / "work")
    first = run_script(script_env(data, work, TRAIN_ITERS="4", SAVE_INTERVAL="2"))
    assert first.rc == 0, first.log[-3000:]
    ds_json = str(tmp_path / "ds.json")
    shutil.copy(os.path.join(ROOT, "examples", "ds_config_gpt2.json"), ds_json)
    ckpt = os.path.join(work, "checkpoints", "iter_0000004")
    for target, lo, hi, launched in ((data["data_prefix"] + ".idx", 0, 34, False), (data["vocab"], 0, None, False),
                                     (data["merges"], 20, None, False), (ds_json, 0, None, False),
                                     (os.path.join(ckpt, "manifest.json"), 0, None, True),
                                     (os.path.join(work, "checkpoints", "latest"), 0, None, True)):
        backup = open(target, "rb").read()
        mutation = flips("file", os.path.basename(target), len(backup), 1, rng, lo, hi)[0]
        apply(mutation, os.path.dirname(target))
        env = script_env(data, work, TRAIN_ITERS="6", SAVE_INTERVAL="2", DS_CONFIG=ds_json)
        run = run_script(env)
        if run.rc == 0:  # the flipped byte did not matter (e.g. inside a merge rank the run never uses)
            assert not launched or "loaded checkpoint" in run.log, run.log[-3000:]
        else:
            line = _line(run)
            assert os.path.basename(target) in line, (mutation.what, line)
            assert ("launching:" in run.log) == launched, (mutation.what, run.log[-3000:])
        with open(target, "wb") as f:
            f.write(backup)
