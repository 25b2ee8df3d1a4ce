"""The mutation campaign: every kind of file the project reads (harness/faults/kinds.py), mutated one file per case
(harness/faults/mutations.py) and driven through the user's command (harness/faults/drivers.py); each case ends in
one of the statuses harness/faults/judge.py decides:

    refused      the command refused in one line naming the mutated file
    unchanged    the whole result equals the pristine run's, under the normalization rule of results.py (the
                 absolute path of the case folder becomes "<case>"; nothing else is removed)
    as written   the result changed exactly as the file's owner reads the change (a DeepSpeed JSON value, a
                 merge rule, a SentencePiece score, an HF config value, a file path in megatron_args.json)

and never in traceback, hang, silent (a change accepted where it must be refused, or other than the file says)
or unnamed (refused without naming the file).

    inputs = build_inputs(root)      pristine corpus, tokenizers, DeepSpeed JSON, a trained checkpoint, its HF
                                     export; every path inside them relative, so the cases (their offsets) and
                                     the table are the same from any folder
    all_cases(inputs, seed)          every case (about 630); `subset(cases, n, seed)` n per (kind, command)
    run(inputs, cases, work) -> [Result]             each case in this process (--load: one spawned process)
    through_commands(inputs, results, work) -> [str]  cases again through the user's command line in a
                                     subprocess: exit 2 and one `error:` line, or the in-process status
    table(results) -> rows per kind
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from harness.faults import drivers, owners
from harness.faults.judge import OwnerView, judge, names_file, same_outcome
from harness.faults.kinds import BY_NAME, KINDS, LOAD, READS, FileKind, mutations_of, says
from harness.faults.mutations import Mutation, apply
from harness.faults.results import TEXT, normalized

ROOT = drivers.ROOT
STATUSES = ("refused", "unchanged", "as written", "traceback", "hang", "silent", "unnamed")
BAD = ("traceback", "hang", "silent", "unnamed")


@dataclass
class Inputs:
    root: str  # root/pristine/{data,bpe,spm,hf,ds.json,ckpt,export}
    _texts: Dict[str, List[str]] = field(default_factory=dict)
    _readings: Dict[str, Any] = field(default_factory=dict)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, "pristine", *parts)

    def texts(self, tokenizer: str) -> List[str]:
        """The texts a tokenizer's result holds the ids of: the fixed TEXT, then the text of every id of the
        pristine vocabulary (decoded by its owner), so that every piece and merge is used."""
        if tokenizer not in self._texts:
            owner = {"bpe": lambda: owners.bpe_tokenizer(self.path()), "hf": lambda: owners.hf_tokenizer(self.path()),
                     "spm": lambda: owners.spm_tokenizer(self.path(), 0)}[tokenizer]()
            self._texts[tokenizer] = [TEXT] + owner.vocabulary_texts()
        return self._texts[tokenizer]

    def reading(self, kind: FileKind) -> Any:
        """The owner's reading of the kind's pristine file."""
        if kind.name not in self._readings:
            self._readings[kind.name] = kind.owner(self.path(), self.texts(kind.tokenizer))
        return self._readings[kind.name]


def _tool(folder: str, *argv: str) -> None:
    """A tool of tools/ run in `folder` on one CPU (SentencePiece records its thread count in the model)."""
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", argv[0]), *argv[1:]], cwd=folder, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}))


def build_inputs(root: str) -> Inputs:
    """The pristine files, made with the project's own tools from inside the pristine folder, so that no file
    holds an absolute path (a few seconds, plus a 2-iteration training)."""
    from harness.dist import run_distributed
    from harness.example_data import build_data
    inputs = Inputs(root)
    top = inputs.path()
    build_data(inputs.path("data"))
    os.rename(inputs.path("data", "tok"), inputs.path("bpe"))
    for kind, vocab, out in (("sentencepiece", "600", "spm"), ("hf-bpe", "512", "hf")):
        _tool(top, "train_tokenizer.py", "--input", "data/corpus.jsonl", "--type", kind, "--vocab-size", vocab,
              "--output-dir", out)
    with open(os.path.join(ROOT, "examples", "ds_config_gpt2.json")) as f:
        ds = json.load(f)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
    with open(inputs.path("ds.json"), "w") as f:
        json.dump(ds, f, indent=2)
    argv = drivers.gpt_argv(extra=["--save", "ckpt", "--save-interval", "1", "--train-iters", "2", "--zero-stage", "1",
                                   "--log-interval", "1"])
    run_distributed(drivers.train_checkpoint, 1, argv, 1, top, timeout=300)
    with drivers.working_directory(top):
        drivers.tool(["export-hf", "--load", "ckpt", "--output", "export"])
    return inputs


# ---- the cases -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    mutation: Mutation
    command: str  # kinds.READS, LOAD, RESHAPE, EXPORT, IMPORT

    @property
    def name(self) -> str:
        return f"[{self.command}] {self.mutation.name}"

    @property
    def kind(self) -> FileKind:
        return BY_NAME[self.mutation.kind]


def all_cases(inputs: Inputs, seed: int = 0) -> List[Case]:
    """Every kind's seeded mutations, each through every command that reads the kind."""
    rng = random.Random(seed)
    return [Case(m, command) for kind in KINDS for m in mutations_of(kind, inputs.path(), rng)
            for command in kind.commands]


def subset(cases: Sequence[Case], per_group: int, seed: int) -> List[Case]:
    """`per_group` seeded cases of each (kind, command)."""
    groups: Dict[tuple, List[Case]] = defaultdict(list)
    for case in cases:
        groups[(case.mutation.kind, case.command)].append(case)
    rng = random.Random(seed)
    return [c for key in sorted(groups) for c in rng.sample(groups[key], min(per_group, len(groups[key])))]


# ---- running them in this process ------------------------------------------------------------------------------

@dataclass
class Result:
    case: Case
    status: str
    detail: str
    step: str = ""  # the step that refused (drivers.steps), for the comparison with the user's command


def case_folder(inputs: Inputs, folder: str, case: Case, mutated: bool = True) -> str:
    """A copy of the pristine files the case's command reads, with its mutation applied (unless not `mutated`)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    top = case.mutation.target.split(os.sep)[0]
    needed = {"ckpt": ["ckpt", "bpe"], "export": ["export"]}.get(top, ["data", "bpe", "spm", "hf", "ds.json"])
    for name in needed:
        src = inputs.path(name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(folder, name))
    if mutated:
        apply(case.mutation, folder)
    return folder


def _in_process(case: Case, folder: str, texts: Sequence[str]) -> Tuple[str, Any, str]:
    """(status, result or line, step) of the case's command in `folder`."""
    from megatron.errors import UserError, one_line
    step = ""
    try:
        with drivers.working_directory(folder), drivers.time_limit():
            value = None
            for step, function in drivers.steps(case.command, case.kind.run_as, texts):
                value = function()
            return "ok", value, ""
    except UserError as err:
        return "UserError", normalized(one_line(str(err)), folder), step
    except drivers.Hang as err:
        return "Hang", str(err), step
    except Exception as err:  # noqa: BLE001 - a traceback, counted
        return type(err).__name__, " | ".join(str(err).splitlines())[:300], step


def _owner_view(inputs: Inputs, kind: FileKind, folder: str) -> OwnerView:
    if kind.owner is None:
        return OwnerView()
    try:
        return OwnerView(inputs.reading(kind), kind.owner(folder, inputs.texts(kind.tokenizer)))
    except owners.OwnerRefuses as err:
        return OwnerView(inputs.reading(kind), refuses=str(err))


def _judged(inputs: Inputs, case: Case, folder: str, outcome: Tuple[str, Any, str], pristine: Any) -> Result:
    status, value, step = outcome
    kind = case.kind
    owner = _owner_view(inputs, kind, folder) if status == "ok" else OwnerView()
    verdict, detail = judge(case.mutation.target, status, value, pristine, kind.follow, owner)
    if verdict in ("as written", "unchanged") and kind.owner is not None:  # the change in the owner's terms
        detail = f"the file says {says(kind, inputs.path(), folder, inputs.texts(kind.tokenizer)) or 'the same'}"
    return Result(case, verdict, detail, step)


def _pristine_result(inputs: Inputs, case: Case, folder: str) -> Any:
    """The command's result on the unmutated files, run twice (the normalization rule claims no output holds
    a time or anything else that differs between two runs)."""
    texts = inputs.texts(case.kind.tokenizer)
    values = []
    for _ in range(2):
        status, value, _ = _in_process(case, case_folder(inputs, folder, case, mutated=False), texts)
        assert status == "ok", (case.command, status, value)
        values.append(value)
    assert values[0] == values[1], f"{case.command}: two pristine runs differ"
    return values[0]


def run(inputs: Inputs, cases: Sequence[Case], work: str, progress: Optional[Callable[[str], None]] = None) \
        -> List[Result]:
    """Every case, results in the order of `cases`: in this process in the folder work/case (its pristine run
    there too), except --load's, which run together in one spawned process."""
    references: Dict[tuple, Any] = {}
    results: Dict[int, Result] = {}
    folder = os.path.join(work, "case")
    for i, case in enumerate(cases):
        if case.command == LOAD:
            continue
        key = (case.command, case.kind.run_as if case.command == READS else "")
        if key not in references:
            references[key] = _pristine_result(inputs, case, folder)
        case_folder(inputs, folder, case)
        outcome = _in_process(case, folder, inputs.texts(case.kind.tokenizer))
        results[i] = _judged(inputs, case, folder, outcome, references[key])
        if progress and len(results) % 50 == 0:
            progress(f"{len(results)} cases")
    loads = {str(i): case_folder(inputs, os.path.join(work, f"load{i}"), case) for i, case in enumerate(cases)
             if case.command == LOAD}
    if loads:
        out = drivers.run_load_cases(inputs.path(), list(loads.items()))
        assert out["pristine"] == out["pristine again"], "two pristine loads differ"
        for i, folder in loads.items():
            status, value = out[i]
            value = normalized(value, folder) if status == "UserError" else value
            results[int(i)] = _judged(inputs, cases[int(i)], folder, (status, value, ""), out["pristine"][1])
    return [results[i] for i in range(len(cases))]


# ---- through the user's command --------------------------------------------------------------------------------

def _through_command(inputs: Inputs, case: Case, folder: str, pristine: Any) -> Tuple[str, str]:
    """(status, line) of the case through the user's command line in a subprocess: refused / unnamed needs exit 2
    and exactly one stderr line, `error: <line>`; exit 0 is judged as in this process ("accepted" for the
    preflight, which gives no result)."""
    argv, step = drivers.through_command(case.command, case.kind.run_as)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, timeout=drivers.CASE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return "hang", f"no exit after {drivers.CASE_TIMEOUT_S} s"
    lines = proc.stderr.splitlines()
    if proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "):
        line = normalized(lines[0][len("error: "):], folder)
        return ("refused" if names_file(case.mutation.target, line) else "unnamed"), line
    if proc.returncode != 0:
        return "traceback", f"exit {proc.returncode}: {' | '.join(lines[-3:])[:300]}"
    if step == "preflight":
        return "accepted", ""
    from harness.faults.results import folder_result
    result = folder_result(os.path.join(folder, drivers.OUT))
    return _judged(inputs, case, folder, ("ok", result, ""), pristine).status, ""


def expected_through_command(result: Result) -> Tuple[str, str]:
    """What the user's command must give for a case whose in-process result is `result`: the same status and
    line; for the reads, whose command line is the preflight: refused where the preflight step refused,
    accepted otherwise."""
    if result.case.command == READS and not (result.status in ("refused", "unnamed") and result.step == "preflight"):
        return "accepted", ""
    return result.status, result.detail


def through_commands(inputs: Inputs, results: Sequence[Result], work: str, workers: int = 2) -> List[str]:
    """Each result's case again through the user's command in a subprocess, `workers` at a time (in work/sub<i>;
    the pristine runs in this process); the cases where it differs from `expected_through_command`."""
    from concurrent.futures import ThreadPoolExecutor
    from queue import Queue
    references = {r.case.command: _pristine_result(inputs, r.case, os.path.join(work, "pristine"))
                  for r in results if r.case.command != READS}
    folders: Queue = Queue()
    for i in range(workers):
        folders.put(os.path.join(work, f"sub{i}"))

    def one(r: Result) -> Optional[str]:
        folder = folders.get()
        try:
            case_folder(inputs, folder, r.case)
            problem = same_outcome(expected_through_command(r),
                                   _through_command(inputs, r.case, folder, references.get(r.case.command)))
        finally:
            folders.put(folder)
        return f"{r.case.name}: {problem}" if problem else None
    with ThreadPoolExecutor(workers) as pool:
        return [p for p in pool.map(one, results) if p]


def table(results: Sequence[Result]) -> List[List[str]]:
    """One row per file kind (in kinds.KINDS' order): cases, then the count of each status."""
    by_kind: Dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_kind[r.case.mutation.kind][r.status] += 1
    rows = [[k.name, str(sum(by_kind[k.name].values()))] + [str(by_kind[k.name][s]) for s in STATUSES]
            for k in KINDS if k.name in by_kind]
    total = Counter(r.status for r in results)
    rows.append(["all", str(len(results))] + [str(total[s]) for s in STATUSES])
    return rows
