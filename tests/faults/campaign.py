"""The mutation campaign: every kind of file the project reads, mutated one file per case (tests/faults/mutations.py)
and driven through the user's command (tests/faults/drivers.py); each case must end in one of

    refused      exit 2 with one `error:` line naming the mutated file (a UserError naming it)
    unchanged    a correct run: what it read equals what the unmutated run reads (the mutation did not matter)
    as written   a correct run of a file that says something else and has no integrity record to tell an edit
                 from damage (a DeepSpeed JSON value, a tokenizer piece, `latest` naming another intact
                 checkpoint, an HF config value): the run follows the file, as it must for an edit

and never in traceback (any other exception), hang (no result within drivers.CASE_TIMEOUT_S), silent (a changed
read accepted where the file has integrity records or internal consistency to check: data, checkpoints,
GPT-2 BPE files, safetensors) or unnamed (refused without naming the file).

    inputs = build_inputs(root)     pristine corpus, tokenizers, DeepSpeed JSON, a trained checkpoint, its HF export
    all_cases(inputs, seed)         every case (about 600); `subset(cases, n, seed)` n per (kind, command)
    run(inputs, cases) -> [Result]  ; table(results) -> rows per kind
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from tests.faults import drivers
from tests.faults.mutations import Mutation, apply, bin_mutations, flips, idx_mutations, truncations

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATUSES = ("refused", "unchanged", "as written", "traceback", "hang", "silent", "unnamed")
BAD = ("traceback", "hang", "silent", "unnamed")
# kinds whose content the run cannot check against anything: a changed read is the file as written
AS_WRITTEN = {"DeepSpeed JSON", "latest", "spiece.model", "tokenizer.json", "HF config.json"}
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--num-workers", "0", "--eval-iters", "0",
         "--make-vocab-size-divisible-by", "8", "--seed", "1234"]
GPT = ["--seq-length", "32", "--max-position-embeddings", "32"]
T5 = ["--encoder-seq-length", "32", "--decoder-seq-length", "16", "--max-position-embeddings", "32",
      "--ffn-hidden-size", "64", "--kv-channels", "8", "--vocab-extra-ids", "8"]


@dataclass
class Inputs:
    root: str  # root/pristine/{data,bpe,spm,hf,ds.json,ckpt,export}

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, "pristine", *parts)


@dataclass(frozen=True)
class Case:
    mutation: Mutation
    command: str  # "preflight + reads", "--load", "reshape", "export-hf", "import-hf"

    @property
    def name(self) -> str:
        return f"[{self.command}] {self.mutation.name}"


@dataclass
class Result:
    case: Case
    status: str
    detail: str


def _run(cmd: List[str]) -> None:
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def build_inputs(root: str) -> Inputs:
    """The pristine files, made with the project's own tools (a few seconds, plus a 2-iteration training)."""
    from tests.dist import run_distributed
    from tests.training.conftest import build_data
    inputs, py = Inputs(root), sys.executable
    data = build_data(inputs.path("data"))
    os.rename(os.path.join(inputs.path("data"), "tok"), inputs.path("bpe"))
    _run([py, "tools/train_tokenizer.py", "--input", os.path.join(inputs.path("data"), "corpus.jsonl"), "--type",
          "sentencepiece", "--vocab-size", "600", "--output-dir", inputs.path("spm")])
    _run([py, "tools/train_tokenizer.py", "--input", os.path.join(inputs.path("data"), "corpus.jsonl"), "--type",
          "hf-bpe", "--vocab-size", "512", "--output-dir", inputs.path("hf")])
    with open(os.path.join(ROOT, "examples", "ds_config_gpt2.json")) as f:
        ds = json.load(f)
    ds.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2, gradient_clipping=1.0)
    with open(inputs.path("ds.json"), "w") as f:
        json.dump(ds, f, indent=2)
    argv = gpt_argv(inputs.path(), extra=["--save", inputs.path("ckpt"), "--save-interval", "1", "--train-iters", "2",
                                          "--zero-stage", "1", "--log-interval", "1"])
    run_distributed(drivers.train_checkpoint, 1, argv, 1, timeout=300)
    drivers.tool(["export-hf", "--load", inputs.path("ckpt"), "--output", inputs.path("export")])
    assert data["data_prefix"].startswith(inputs.path("data"))
    return inputs


def gpt_argv(folder: str, tokenizer: str = "bpe", extra: Sequence[str] = ()) -> List[str]:
    """pretrain_gpt2.py's arguments on the case folder's files."""
    tok = {"bpe": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(folder, "bpe", "vocab.json"),
                   "--merge-file", os.path.join(folder, "bpe", "merges.txt")],
           "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                  os.path.join(folder, "hf", "tokenizer.json")]}[tokenizer]
    return MODEL + GPT + tok + ["--data-path", os.path.join(folder, "data", "docs_text_document"), *extra]


def t5_argv(folder: str) -> List[str]:
    return MODEL + T5 + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                         os.path.join(folder, "spm", "spm.model"), "--data-path",
                         os.path.join(folder, "data", "docs_text_document")]


# ---- the cases ---------------------------------------------------------------------------------------------------

def _size(inputs: Inputs, target: str) -> int:
    return os.path.getsize(inputs.path(target))


def _text(inputs: Inputs, kind: str, target: str, rng: random.Random, n_flips: int) -> List[Mutation]:
    size = _size(inputs, target)
    return flips(kind, target, size, n_flips, rng) + truncations(kind, target, size, 4, rng)


def _checkpoint_files(inputs: Inputs) -> List[str]:
    tag = open(inputs.path("ckpt", "latest")).read().strip()
    return sorted(os.path.join("ckpt", tag, n) for n in os.listdir(inputs.path("ckpt", tag)) if n.endswith(".pt"))


def _pt(inputs: Inputs, target: str, rng: random.Random) -> List[Mutation]:
    """A torch zip: flips in its records (the first and last kB: headers, the pickle, the central directory) and
    in its tensor data, and cuts."""
    size, kind = _size(inputs, target), "checkpoint .pt"
    return (flips(kind, target, size, 2, rng, 0, 1024, " (zip records)") +
            flips(kind, target, size, 2, rng, size - 1024, size, " (zip directory)") +
            flips(kind, target, size, 3, rng, 1024, size - 1024, " (tensor data)") + truncations(kind, target, size, 2, rng))


def _safetensors(inputs: Inputs, rng: random.Random) -> List[Mutation]:
    target = os.path.join("export", "model.safetensors")
    with open(inputs.path(target), "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    size = _size(inputs, target)
    return (flips("safetensors header", target, size, 40, rng, 0, header, " (header)") +
            [Mutation("safetensors header", target, f"cut to {n} bytes", ("truncate", n)) for n in (0, 7, header // 2)])


def all_cases(inputs: Inputs, seed: int = 0) -> List[Case]:
    rng = random.Random(seed)
    prefix = os.path.join("data", "docs_text_document")
    from megatron.data.indexed_dataset import MMapIndexedDataset
    data = MMapIndexedDataset(inputs.path(prefix))
    reads = "preflight + reads"
    cases = [Case(m, reads) for m in idx_mutations(prefix + ".idx", len(data), len(data.doc_idx) - 1,
                                                   _size(inputs, prefix + ".idx"), rng)]
    cases += [Case(m, reads) for m in bin_mutations(prefix + ".bin", _size(inputs, prefix + ".bin"), rng)]
    for kind, target in (("vocab.json", "bpe/vocab.json"), ("merges.txt", "bpe/merges.txt"),
                         ("spiece.model", "spm/spm.model"), ("tokenizer.json", "hf/tokenizer.json"),
                         ("DeepSpeed JSON", "ds.json")):
        cases += [Case(m, reads) for m in _text(inputs, kind, target, rng, 36 if kind != "DeepSpeed JSON" else 26)]
    tag = open(inputs.path("ckpt", "latest")).read().strip()
    ckpt = _text(inputs, "latest", "ckpt/latest", rng, 8)
    ckpt += [Mutation("latest", "ckpt/latest", "names iter_0000003", ("write", 0, b"iter_0000003"))]
    ckpt += _text(inputs, "megatron_args.json", f"ckpt/{tag}/megatron_args.json", rng, 20)
    ckpt += _text(inputs, "manifest.json", f"ckpt/{tag}/manifest.json", rng, 20)
    for target in _checkpoint_files(inputs):
        ckpt += _pt(inputs, target, rng)
    cases += [Case(m, command) for m in ckpt for command in ("--load", "reshape", "export-hf")]
    hf = _safetensors(inputs, rng) + _text(inputs, "HF config.json", "export/config.json", rng, 24)
    cases += [Case(m, "import-hf") for m in hf]
    return cases


def subset(cases: Sequence[Case], per_group: int, seed: int) -> List[Case]:
    """`per_group` seeded cases of each (kind, command)."""
    groups: Dict[tuple, List[Case]] = defaultdict(list)
    for case in cases:
        groups[(case.mutation.kind, case.command)].append(case)
    rng = random.Random(seed)
    return [c for key in sorted(groups) for c in rng.sample(groups[key], min(per_group, len(groups[key])))]


# ---- running them -----------------------------------------------------------------------------------------------

def _case_folder(inputs: Inputs, work: str, case: Case) -> str:
    """A copy of the pristine files the case needs, with its mutation applied."""
    shutil.rmtree(work, ignore_errors=True)
    top = case.mutation.target.split(os.sep)[0]
    needed = {"ckpt": ["ckpt"], "export": ["export"]}.get(top, ["data", "bpe", "spm", "hf", "ds.json"])
    for name in needed:
        src = inputs.path(name)
        (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, os.path.join(work, name))
    apply(case.mutation, work)
    return work


def _command(case: Case, folder: str) -> Callable[[], object]:
    """The user's command on `folder`, returning what it read."""
    kind, target = case.mutation.kind, case.mutation.target
    if case.command == "preflight + reads":
        if kind == "spiece.model":
            return lambda: drivers.preflight_and_reads(t5_argv(folder), "t5")
        extra = ["--deepspeed", "--deepspeed_config", os.path.join(folder, "ds.json")] if kind == "DeepSpeed JSON" else []
        tokenizer = "hf" if kind == "tokenizer.json" else "bpe"
        return lambda: drivers.preflight_and_reads(gpt_argv(folder, tokenizer, extra), "gpt")
    out = os.path.join(folder, "out")
    if case.command == "reshape":
        return lambda: (drivers.tool(["reshape", "--load", os.path.join(folder, "ckpt"), "--save", out,
                                      "--tensor-model-parallel-size", "2", "--pipe-parallel-size", "1"]),
                        drivers.checkpoint_fingerprint(out))[1]
    if case.command == "export-hf":
        return lambda: (drivers.tool(["export-hf", "--load", os.path.join(folder, "ckpt"), "--output", out]),
                        drivers.hf_fingerprint(out))[1]
    if case.command == "import-hf":
        return lambda: (drivers.tool(["import-hf", "--input", os.path.join(folder, "export"), "--save", out,
                                      "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1"]),
                        drivers.checkpoint_fingerprint(out))[1]
    raise ValueError(case.command)


def names_file(case: Case, message: str) -> bool:
    """The line names the mutated file (its path, or its name where the line names the folder's file)."""
    base = os.path.basename(case.mutation.target)
    return base in message or (base == "latest" and "'latest'" in message)


def classify(case: Case, status: str, value, reference) -> Result:
    if status == "ok":
        if value == reference:
            return Result(case, "unchanged", "")
        changed = sorted(k for k in value if value[k] != reference.get(k)) if isinstance(value, dict) else []
        return Result(case, "as written" if case.mutation.kind in AS_WRITTEN else "silent",
                      f"a changed read ({', '.join(map(str, changed))})")
    if status == "UserError":
        return Result(case, "refused" if names_file(case, value) else "unnamed", value)
    return Result(case, "hang" if status == "Hang" else "traceback", f"{status}: {value}")


def _in_process(case: Case, folder: str):
    from megatron.errors import UserError, one_line
    try:
        with drivers.time_limit():
            return "ok", _command(case, folder)()
    except UserError as err:
        return "UserError", one_line(str(err))
    except drivers.Hang as err:
        return "Hang", str(err)
    except Exception as err:  # noqa: BLE001 - a traceback, counted
        return type(err).__name__, " | ".join(str(err).splitlines())[:300]


def run(inputs: Inputs, cases: Sequence[Case], work: str, progress: Optional[Callable[[str], None]] = None) \
        -> List[Result]:
    """Every case: in this process, except --load's, which run together in one spawned process."""
    references: Dict[tuple, object] = {}
    results: List[Result] = []
    loads = [c for c in cases if c.command == "--load"]
    for i, case in enumerate(c for c in cases if c.command != "--load"):
        key = (case.command, case.mutation.kind if case.command == "preflight + reads" else "")
        if key not in references:
            pristine = _case_folder(inputs, os.path.join(work, "pristine"),
                                    Case(Mutation(case.mutation.kind, case.mutation.target, "none", ("append", b"")),
                                         case.command))
            status, value = _in_process(case, pristine)
            assert status == "ok", (case.command, status, value)
            references[key] = value
        folder = _case_folder(inputs, os.path.join(work, "case"), case)
        results.append(classify(case, *_in_process(case, folder), references[key]))
        if progress and i % 50 == 0:
            progress(f"{i} cases")
    if loads:
        folders = []
        for i, case in enumerate(loads):
            folders.append((str(i), os.path.join(_case_folder(inputs, os.path.join(work, f"load{i}"), case), "ckpt")))
        argv = gpt_argv(inputs.path(), extra=["--zero-stage", "1"])
        out = drivers.run_load_cases(argv, inputs.path("ckpt"), folders)
        reference = out["pristine"][1]
        results += [classify(case, *out[str(i)], reference) for i, case in enumerate(loads)]
    return results


def table(results: Sequence[Result]) -> List[List[str]]:
    """One row per file kind: cases, then the count of each status."""
    rows, by_kind = [], defaultdict(Counter)
    for r in results:
        by_kind[r.case.mutation.kind][r.status] += 1
    for kind in sorted(by_kind, key=lambda k: min(i for i, r in enumerate(results) if r.case.mutation.kind == k)):
        counts = by_kind[kind]
        rows.append([kind, str(sum(counts.values()))] + [str(counts[s]) for s in STATUSES])
    total = Counter(r.status for r in results)
    rows.append(["all", str(len(results))] + [str(total[s]) for s in STATUSES])
    return rows
