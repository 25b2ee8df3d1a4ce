"""Every checkpoint file read is checked against manifest.json's CRC-32 while it is read (megatron/checkpointing/
reading.py): one flipped byte of tensor data (same size, loads without an error) is refused by the tools and the
weights-only load, in one line naming the file, what it holds and the newest checkpoint that verifies.
(--load through the example script: tests/training/test_damaged_checkpoint.py.)"""
import json
import os
import shutil

import pytest

from megatron.checkpointing import load_model_weights, read_checkpoint_args
from megatron.checkpointing.names import model_config
from megatron.checkpointing.reading import ChecksumError, load_file, read_verified
from megatron.errors import UserError
from harness.synthetic import resolved_args, write_synthetic
from tools.convert_checkpoint import run

LAYER = "layer_01-model_00-model_states.pt"


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def two_checkpoints(tmp_path) -> str:
    """iterations 5 and 10 (same files), `latest` = 10, at (1, 1, 1)."""
    ckpt = write_synthetic(str(tmp_path / "ckpt"), resolved_args("gpt2", (1, 1, 1), 500))
    shutil.copytree(os.path.join(ckpt, "iter_0000010"), os.path.join(ckpt, "iter_0000005"))
    return ckpt


def _line(ckpt: str, other: str = "iteration 5: load it with --ckpt-step 5 (the tools: --tag iter_0000005)") -> str:
    return (f"checkpoint file {ckpt}/iter_0000010/{LAYER} (weights of pipeline layer 1, tp rank 0) is damaged: "
            f"CRC-32 "), f"the newest verified checkpoint in {ckpt} is {other}"


@pytest.mark.parametrize("where", ["tensor data", "zip directory"])
def test_a_flipped_byte_is_refused_by_every_reader(two_checkpoints, tmp_path, where):
    ckpt = two_checkpoints
    path = os.path.join(ckpt, "iter_0000010", LAYER)
    _flip(path, os.path.getsize(path) // 2 if where == "tensor data" else os.path.getsize(path) - 30)
    start, hint = _line(ckpt)
    with pytest.raises(ChecksumError) as err:
        load_file(path)
    assert str(err.value).startswith(start) and hint in str(err.value) and "\n" not in str(err.value)
    for argv in (["reshape", "--load", ckpt, "--save", str(tmp_path / "r"), "--tensor-model-parallel-size", "1",
                  "--pipe-parallel-size", "1"], ["export-hf", "--load", ckpt, "--output", str(tmp_path / "hf")],
                 ["to-fp32", "--load", ckpt, "--output", str(tmp_path / "w.pt")], ["inspect", ckpt, "--verify"]):
        with pytest.raises(UserError) as err:
            run(argv)
        assert str(err.value).startswith(start) and hint in str(err.value), (argv, str(err.value))
    assert not any(os.path.exists(tmp_path / n) for n in ("r", "hf", "w.pt"))
    from megatron.model import GPT2Model
    model = GPT2Model(model_config(read_checkpoint_args(ckpt)))
    with pytest.raises(ChecksumError, match="is damaged: CRC-32"):
        load_model_weights(model, ckpt)  # the weights-only load (--finetune, generation, evaluation)
    if where == "tensor data":
        run(["inspect", ckpt])  # metadata only: reads no tensor data (sizes are checked)
    else:
        with pytest.raises(ChecksumError):  # the metadata cannot be read: the checksum says why
            run(["inspect", ckpt])
    run(["inspect", ckpt, "--tag", "iter_0000005", "--verify"])


def test_the_hint_skips_a_checkpoint_that_does_not_verify(two_checkpoints):
    ckpt = two_checkpoints
    for tag in ("iter_0000010", "iter_0000005"):
        path = os.path.join(ckpt, tag, LAYER)
        _flip(path, os.path.getsize(path) // 2)
    with pytest.raises(ChecksumError) as err:
        load_file(os.path.join(ckpt, "iter_0000010", LAYER))
    assert f"{ckpt} holds no other verified checkpoint: restore the file" in str(err.value)


def test_reads_outside_a_manifest_and_a_reader_that_fails(two_checkpoints, tmp_path):
    ckpt = two_checkpoints
    loose = str(tmp_path / "loose.pt")
    shutil.copy(os.path.join(ckpt, "iter_0000010", LAYER), loose)
    assert load_file(loose)  # no manifest beside it: read as it is
    path = os.path.join(ckpt, "iter_0000010", LAYER)
    _flip(path, 100)

    def fails():
        raise RuntimeError("the reader tripped over the damaged bytes")
    with pytest.raises(ChecksumError):  # the mismatch is reported rather than the reader's own error
        read_verified(path, fails)
    os.remove(os.path.join(ckpt, "iter_0000010", "manifest.json"))
    assert load_file(path)  # saved before manifests: no checksum to compare


def test_megatron_args_edits_of_paths_pass_and_others_are_refused(two_checkpoints, tmp_path):
    """manifest.json lists the CRC-32 of megatron_args.json's settings without its file paths: moving the
    tokenizer files (editing vocab_file) is fine, any other change is refused naming the file."""
    from megatron.checkpointing.files import read_args, write_args
    folder = os.path.join(two_checkpoints, "iter_0000010")
    args = read_args(folder)
    write_args(folder, {**args, "vocab_file": "/moved/vocab.json"})
    assert read_args(folder)["vocab_file"] == "/moved/vocab.json"
    write_args(folder, {**args, "hidden_size": 33})
    with pytest.raises(UserError, match=r"megatron_args.json was changed after the save in more than its file paths"):
        run(["inspect", two_checkpoints])
    write_args(folder, {k: v for k, v in args.items() if k != "pipe_parallel_size"})
    with pytest.raises(UserError, match=r"megatron_args.json has no 'pipe_parallel_size'"):
        run(["inspect", two_checkpoints])


def _edit_manifest(folder: str, edit) -> None:
    path = os.path.join(folder, "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)


def _rename(entry: dict, old: str, new: str) -> None:
    entry[new] = entry.pop(old)


MANIFEST_EDITS = [  # (what, the edit of the manifest's JSON, the line's words); each would turn a check off
    ("settings key renamed", lambda m: _rename(m["files"]["megatron_args.json"], "settings_crc32", "settings_grc32"),
     "the entry of megatron_args.json has the unknown key 'settings_grc32' (format 2: bytes, crc32, settings_crc32)"),
    ("settings key dropped", lambda m: m["files"]["megatron_args.json"].pop("settings_crc32"),
     "the entry of megatron_args.json lacks 'settings_crc32', which format 2 has"),
    ("CRC key renamed", lambda m: _rename(m["files"][LAYER], "crc32", "crc33"),
     f"the entry of {LAYER} has the unknown key 'crc33' (format 2: bytes, crc32)"),
    ("args entry dropped", lambda m: m["files"].pop("megatron_args.json"),
     "'files' has no entry for megatron_args.json, which format 2 lists"),
    ("layer entry dropped", lambda m: m["files"].pop(LAYER),
     f"damaged: it does not list {LAYER}, which the load reads (an entry lost)"),
    ("format 3", lambda m: m.update(format=3), "format 3: this version reads formats 1 and 2"),
    ("top-level key renamed", lambda m: _rename(m, "checksum", "checksun"),
     "the manifest has the unknown key 'checksun' (format 2: format, checksum, files)"),
]


@pytest.mark.parametrize("edit", MANIFEST_EDITS, ids=[e[0] for e in MANIFEST_EDITS])
def test_a_manifest_edit_that_turns_a_check_off_is_refused(two_checkpoints, tmp_path, edit):
    """A key missing, unknown or renamed in a manifest whose format says what it has: one line naming the
    manifest and the key, from every reader."""
    folder = os.path.join(two_checkpoints, "iter_0000010")
    _edit_manifest(folder, edit[1])
    for argv in (["inspect", two_checkpoints], ["export-hf", "--load", two_checkpoints, "--output", str(tmp_path / "hf")]):
        with pytest.raises(UserError) as err:
            run(argv)
        line = str(err.value)
        assert line.startswith(f"checkpoint file {folder}/manifest.json (") and edit[2] in line, line
        assert "\n" not in line


def test_a_manifest_entry_twice_is_refused(two_checkpoints):
    path = os.path.join(two_checkpoints, "iter_0000010", "manifest.json")
    with open(path) as f:
        text = f.read()
    first = text.index(f'"{LAYER}"')
    with open(path, "w") as f:  # the entry of layer 1 renamed to the name of another listed file
        f.write(text[:first] + '"mp_rank_00_model_states.pt"' + text[first + len(LAYER) + 2:])
    with pytest.raises(UserError, match=r"manifest.json \(.*\) is not a valid manifest: the key "
                                        r"'mp_rank_00_model_states.pt' appears twice"):
        run(["inspect", two_checkpoints])


def test_a_format_1_manifest_without_the_settings_key_is_accepted(two_checkpoints):
    """Saved before megatron_args.json's entry gained settings_crc32: format 1 without it loads (its settings
    are then not checked); format 1 with it is checked."""
    from megatron.checkpointing.files import read_args, write_args
    folder = os.path.join(two_checkpoints, "iter_0000010")
    _edit_manifest(folder, lambda m: (m.update(format=1), m["files"]["megatron_args.json"].pop("settings_crc32")))
    run(["inspect", two_checkpoints, "--verify"])
    args = read_args(folder)
    write_args(folder, {**args, "hidden_size": 33})
    read_args(folder)  # nothing to check it against
    write_args(folder, args)
    from megatron.checkpointing.manifest import write_manifest
    write_manifest(folder)
    _edit_manifest(folder, lambda m: m.update(format=1))
    write_args(folder, {**args, "hidden_size": 33})
    with pytest.raises(UserError, match="changed after the save in more than its file paths"):
        read_args(folder)


@pytest.mark.parametrize("content", [b"", b"\n", b"iter_00\xb00010", b"../iter_0000010", b".."])
def test_a_latest_that_names_no_folder_is_refused(two_checkpoints, content):
    with open(os.path.join(two_checkpoints, "latest"), "wb") as f:
        f.write(content)
    with pytest.raises(UserError, match=rf"{two_checkpoints}/latest holds .*, not the name of a checkpoint folder"):
        run(["inspect", two_checkpoints])
