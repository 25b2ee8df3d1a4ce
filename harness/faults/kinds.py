"""The file kinds of the mutation campaign, one row of its table each: which files, which commands read them,
how they are mutated, who owns the format (owners.py) and how a command must follow a change (judge.py).

    FileKind(name, targets, commands, mutate, owner, follow, says, run_as)
    KINDS       every kind, in the table's order (the seeded cases are drawn in this order)

Adding a kind (another tokenizer file, say) is one FileKind here, and its pristine file in
campaign.build_inputs. `follow=None` means the file has integrity records or a format to check and nothing a user
edits: any change to the command's result must be refused. A kind the project follows as written (an edit) names
its owner's reader and the follow rule that says how the result must change.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from harness.faults import owners
from harness.faults.judge import follow_tokenizer, follow_values
from harness.faults.mutations import Mutation, bin_mutations, flips, idx_mutations, truncations
from harness.faults.results import changes, describe

READS, LOAD, RESHAPE, EXPORT, IMPORT = "preflight + reads", "--load", "reshape", "export-hf", "import-hf"
CHECKPOINT_COMMANDS = (LOAD, RESHAPE, EXPORT)
DATA = os.path.join("data", "docs_text_document")
T5_EXTRA_IDS = 8


@dataclass(frozen=True)
class FileKind:
    name: str                                   # the table's row
    targets: Callable[[str], List[str]]         # the pristine folder -> its files of this kind (relative)
    commands: Tuple[str, ...]                   # the commands each case goes through
    mutate: Callable[[str, str, str, random.Random], List[Mutation]]  # (kind, pristine folder, target, rng)
    owner: Optional[Callable[[str, Sequence[str]], Any]] = None  # (case folder, texts) -> the owner's reading
    follow: Optional[Callable] = None           # judge.follow_*; None: a changed result must be refused
    says: Optional[Callable[[str], Any]] = None  # case folder -> the owner's terms for the report (else `owner`)
    run_as: str = "gpt"                         # the reads' command line: gpt (GPT-2 BPE), gpt-ds, gpt-hf, t5

    @property
    def tokenizer(self) -> str:
        """The tokenizer the reads build (whose fixed texts a result holds)."""
        return {"gpt": "bpe", "gpt-ds": "bpe", "gpt-hf": "hf", "t5": "spm"}[self.run_as]


# ---- mutations -------------------------------------------------------------------------------------------------

def _size(top: str, target: str) -> int:
    return os.path.getsize(os.path.join(top, target))


def text_mutations(n_flips: int, *edits: Tuple[str, tuple]) -> Callable:
    """n seeded bit flips and 4 cuts anywhere in the file, then the named edits (what, op)."""
    def mutate(kind: str, top: str, target: str, rng: random.Random) -> List[Mutation]:
        size = _size(top, target)
        return flips(kind, target, size, n_flips, rng) + truncations(kind, target, size, 4, rng) + \
            [Mutation(kind, target, what, op) for what, op in edits]
    return mutate


def _idx(kind: str, top: str, target: str, rng: random.Random) -> List[Mutation]:
    from megatron.data.indexed_dataset import MMapIndexedDataset
    data = MMapIndexedDataset(os.path.join(top, DATA))
    return idx_mutations(target, len(data), len(data.doc_idx) - 1, _size(top, target), rng)


def _bin(kind: str, top: str, target: str, rng: random.Random) -> List[Mutation]:
    return bin_mutations(target, _size(top, target), rng)


def _pt(kind: str, top: str, target: str, rng: random.Random) -> List[Mutation]:
    """A torch zip: flips in its records (the first and last kB: headers, the pickle, the central directory) and
    in its tensor data, and cuts."""
    size = _size(top, target)
    return (flips(kind, target, size, 2, rng, 0, 1024, " (zip records)") +
            flips(kind, target, size, 2, rng, size - 1024, size, " (zip directory)") +
            flips(kind, target, size, 3, rng, 1024, size - 1024, " (tensor data)") +
            truncations(kind, target, size, 2, rng))


def _safetensors(kind: str, top: str, target: str, rng: random.Random) -> List[Mutation]:
    with open(os.path.join(top, target), "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")
    return (flips(kind, target, _size(top, target), 40, rng, 0, header, " (header)") +
            [Mutation(kind, target, f"cut to {n} bytes", ("truncate", n)) for n in (0, 7, header // 2)])


def _merges(kind: str, top: str, target: str, rng: random.Random) -> List[Mutation]:
    with open(os.path.join(top, target), "rb") as f:
        header = len(f.readline())
    return text_mutations(36)(kind, top, target, rng) + [Mutation(kind, target, "cut to its #version header line",
                                                                  ("truncate", header))]


# ---- targets ---------------------------------------------------------------------------------------------------

def _tag(top: str) -> str:
    with open(os.path.join(top, "ckpt", "latest")) as f:
        return f.read().strip()


def _fixed(path: str) -> Callable[[str], List[str]]:
    return lambda top: [path]


def _in_tag(name: str) -> Callable[[str], List[str]]:
    return lambda top: [os.path.join("ckpt", _tag(top), name)]


def _torch_files(top: str) -> List[str]:
    folder = os.path.join(top, "ckpt", _tag(top))
    return sorted(os.path.join("ckpt", _tag(top), n) for n in os.listdir(folder) if n.endswith(".pt"))


# ---- owners' readings ------------------------------------------------------------------------------------------

def _read(reader: Callable[[str], Any], target: str) -> Callable:
    """The owner's `reader` on the case folder's file `target`."""
    return lambda folder, texts: reader(os.path.join(folder, target))


def _read_in_tag(name: str) -> Callable:
    """json on the checkpoint folder's file `name` (the folder `latest` names)."""
    return lambda folder, texts: owners.read_json(os.path.join(folder, _in_tag(name)(folder)[0]))


def _bpe_files(folder: str) -> dict:
    """vocab.json's map and merges.txt's lines, as json and the text read them (the report's terms)."""
    with open(os.path.join(folder, "bpe", "merges.txt"), "rb") as f:
        merges = f.read().decode("utf-8", errors="replace").splitlines()
    return dict(vocab=owners.read_json(os.path.join(folder, "bpe", "vocab.json")), merges=merges)


BPE = dict(owner=lambda folder, texts: owners.bpe_tokenizer(folder).result(texts), follow=follow_tokenizer,
           says=_bpe_files)

KINDS: List[FileKind] = [
    FileKind(".idx", _fixed(DATA + ".idx"), (READS,), _idx),
    FileKind(".bin", _fixed(DATA + ".bin"), (READS,), _bin),
    FileKind(".crc.json", _fixed(DATA + ".crc.json"), (READS,),
             text_mutations(20, ("version 1 -> 2", ("replace", b'"version":1', b'"version":2')),
                            ("bin_crc32 renamed bin_grc32", ("replace", b'"bin_crc32"', b'"bin_grc32"')))),
    FileKind("vocab.json", _fixed("bpe/vocab.json"), (READS,), text_mutations(36), **BPE),
    FileKind("merges.txt", _fixed("bpe/merges.txt"), (READS,), _merges, **BPE),
    FileKind("spiece.model", _fixed("spm/spm.model"), (READS,), text_mutations(36),
             owner=lambda folder, texts: owners.spm_tokenizer(folder, T5_EXTRA_IDS).result(texts),
             follow=follow_tokenizer, says=owners.spm_model_proto, run_as="t5"),
    FileKind("tokenizer.json", _fixed("hf/tokenizer.json"), (READS,), text_mutations(36),
             owner=lambda folder, texts: owners.hf_tokenizer(folder).result(texts), follow=follow_tokenizer,
             says=lambda folder: owners.read_json(os.path.join(folder, "hf", "tokenizer.json")), run_as="gpt-hf"),
    FileKind("DeepSpeed JSON", _fixed("ds.json"), (READS,),
             text_mutations(26, ("reduce_bucket_size renamed reduce_buciet_size",
                                 ("replace", b'"reduce_bucket_size"', b'"reduce_buciet_size"'))),
             owner=_read(owners.read_deepspeed_json, "ds.json"),
             follow=follow_values, run_as="gpt-ds"),
    FileKind("latest", _fixed("ckpt/latest"), CHECKPOINT_COMMANDS,
             text_mutations(8, ("names iter_0000003", ("write", 0, b"iter_0000003"))),
             owner=_read(owners.read_text, "ckpt/latest")),
    FileKind("megatron_args.json", _in_tag("megatron_args.json"), CHECKPOINT_COMMANDS, text_mutations(20),
             owner=_read_in_tag("megatron_args.json"), follow=follow_values),
    FileKind("manifest.json", _in_tag("manifest.json"), CHECKPOINT_COMMANDS,
             text_mutations(20, ("settings_crc32 renamed settings_grc32", ("replace", b'"settings_crc32"',
                                                                             b'"settings_grc32"'))),
             owner=_read_in_tag("manifest.json")),
    FileKind("checkpoint .pt", _torch_files, CHECKPOINT_COMMANDS, _pt),
    FileKind("safetensors header", _fixed("export/model.safetensors"), (IMPORT,), _safetensors,
             owner=_read(owners.read_safetensors, "export/model.safetensors")),
    FileKind("HF config.json", _fixed("export/config.json"), (IMPORT,),
             text_mutations(24, ("eos_token_id 0 -> 4", ("replace", b'"eos_token_id": 0', b'"eos_token_id": 4')),
                            ("layer_norm_epsilon 1e-05 -> 1e-04", ("replace", b"1e-05", b"1e-04"))),
             owner=_read(owners.read_json, "export/config.json"), follow=follow_values),
]
BY_NAME = {k.name: k for k in KINDS}


def mutations_of(kind: FileKind, top: str, rng: random.Random) -> List[Mutation]:
    """The kind's seeded mutations of each of its pristine files under `top`."""
    return [m for target in kind.targets(top) for m in kind.mutate(kind.name, top, target, rng)]


def says(kind: FileKind, pristine: str, folder: str, texts: Sequence[str]) -> str:
    """The mutated file's change in its owner's terms (pieces and scores, vocabulary and merges, JSON keys)."""
    read = kind.says or (lambda f: kind.owner(f, texts))
    return describe(changes(read(pristine), read(folder)))

