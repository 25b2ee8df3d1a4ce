"""The mutation campaign (harness/faults/campaign.py; every case: bench/fault_campaign.py) in `make test`:

- a seeded subset, 6 cases per (file kind, command) (126 cases), and the named edits the campaign found, in this
  process: each ends refused in one line naming the file, unchanged or as written (harness/faults/judge.py decides),
  none in a traceback, a hang, a silent acceptance or a refusal that does not name the file;
- the inputs built again in a folder whose absolute path is longer: the same bytes, so the same cases; there,
  27 of the subset's cases through the user's command lines in subprocesses (the example scripts' preflight,
  tools/convert_checkpoint.py): exit 2 and exactly one stderr line `error: <the in-process line>`, or the
  in-process status. FAULTS_SEED picks another subset.

In `long`: seeded mutations through the example script itself (its preflight, and a launch whose --load reads
a damaged checkpoint): one `error:` line naming the file, exit 2."""
from __future__ import annotations

import os
import random
import shutil
from collections import Counter, defaultdict

import pytest

from harness.faults.campaign import BAD, all_cases, build_inputs, run, subset, through_commands
from harness.faults.kinds import KINDS, READS
from harness.faults.mutations import apply, flips
from harness.faults.script import ROOT, run_script, script_env

SEED = int(os.environ.get("FAULTS_SEED", "0"))
READ_KINDS = {k.name for k in KINDS if READS in k.commands}
# (kind, named edit, command) -> the status it must end in: the edits the campaign's figures turned on
NAMED = {("merges.txt", "cut to 0 of", READS): "refused",  # no merges: every text byte by byte
         ("merges.txt", "cut to its #version header line", READS): "refused",
         ("manifest.json", "settings_crc32 renamed settings_grc32", "reshape"): "refused",  # the settings check off
         ("manifest.json", "settings_crc32 renamed settings_grc32", "export-hf"): "refused",
         ("DeepSpeed JSON", "reduce_bucket_size renamed reduce_buciet_size", READS): "refused",  # DeepSpeed refuses
         ("HF config.json", "eos_token_id 0 -> 4", "import-hf"): "as written",
         ("HF config.json", "layer_norm_epsilon 1e-05 -> 1e-04", "import-hf"): "as written"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(str(tmp_path_factory.mktemp("campaign")))


@pytest.fixture(scope="module")
def cases(inputs):
    every = all_cases(inputs, SEED)
    named = [c for c in every for kind, what, command in NAMED
             if (c.mutation.kind, c.command) == (kind, command) and c.mutation.what.startswith(what)]
    assert len(named) == len(NAMED), [c.name for c in named]
    return subset(every, 6, SEED), named


@pytest.fixture(scope="module")
def results(inputs, cases, tmp_path_factory):
    return run(inputs, cases[0] + cases[1], str(tmp_path_factory.mktemp("work")))


def test_every_case_is_refused_by_name_or_runs_correctly(cases, results):
    picked, named = cases
    assert {(c.mutation.kind, c.command) for c in picked} == {(k.name, c) for k in KINDS for c in k.commands}
    bad = [f"{r.status}: {r.case.name}: {r.detail}" for r in results if r.status in BAD]
    assert not bad, f"seed {SEED}:\n" + "\n".join(bad)
    counts = Counter(r.status for r in results[:len(picked)])
    assert counts["refused"] > len(picked) // 2, counts
    for r in results[len(picked):]:
        expected = next(s for (kind, what, command), s in NAMED.items()
                        if r.case.mutation.what.startswith(what) and r.case.command == command)
        assert r.status == expected, (r.case.name, r.status, r.detail)


def _same_files(a: str, b: str) -> list:
    """The files whose bytes differ between two trees (the data's token-id cache records an inode and a time)."""
    differ = []
    for parent, _, names in os.walk(a):
        for name in names:
            path = os.path.join(parent, name)
            other = os.path.join(b, os.path.relpath(path, a))
            if not name.endswith("_token_ids.json") and open(path, "rb").read() != open(other, "rb").read():
                differ.append(os.path.relpath(path, a))
    return differ


def test_through_the_commands_from_another_folder(inputs, cases, results, tmp_path_factory):
    """The inputs hold no absolute path, so a folder of another length gives the same files and cases; the
    user's commands there agree with this process, two subprocesses at a time: 3 cases of each kind the preflight
    reads (0.3 s each) and 1 of each tools/convert_checkpoint.py command (4 s each, most of it importing torch;
    --load: the long test through the example script)."""
    other = build_inputs(str(tmp_path_factory.mktemp("campaign_from_a_folder_whose_path_is_longer_" + "x" * 40)))
    assert _same_files(inputs.path(), other.path()) == []
    assert all_cases(other, SEED) == all_cases(inputs, SEED)
    groups = defaultdict(list)  # read kinds by kind, the others by command
    for r in results[:len(cases[0])]:
        if r.case.command != "--load":
            groups[r.case.mutation.kind if r.case.command == READS else r.case.command].append(r)
    rng = random.Random(SEED)
    chosen = [r for key in sorted(groups) for r in rng.sample(groups[key], 3 if key in READ_KINDS else 1)]
    assert len(chosen) == 3 * len(READ_KINDS) + len(set(groups) - set(READ_KINDS)) == 27
    problems = through_commands(other, chosen, str(tmp_path_factory.mktemp("through")))
    assert not problems, "\n".join(problems)


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
