"""Every checkpoint file is read with torch.load(weights_only=True) and an allowlist (tds/safe_load.py): a file whose
pickle would run a command (written here: `os.system("touch <marker>")`) is refused in one line naming the file and
the global by inspect, reshape, import-hf, import-megatron (legacy files, torch_dist's index, through the command
too, and a torch_dist item) and the
engine's own reads (DeepSpeed's state-dict loaders, and `--load` through the project's checkpoint engine); the command never
runs. A legacy file needing a global outside the allowlist loads with --trust-checkpoint. (`--load` through the
example script: tests/training/test_damaged_checkpoint.py.)"""
import os
import pickle

import pytest
import torch

from megatron.checkpointing.manifest import write_manifest
from megatron.errors import UserError
from tds.safe_load import SafeCheckpointEngine, UnsafeCheckpointError
from tests.checkpoint import megatron_fixtures as fx
from harness.synthetic import TAG, resolved_args, write_synthetic
from tools.convert_checkpoint import run


class Command:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class Custom:
    """A harmless class of no allowlist: what a legacy file from an unknown code base may hold."""

    def __init__(self):
        self.value = 3


@pytest.fixture
def marker(tmp_path):
    path = str(tmp_path / "command_ran")
    yield path
    assert not os.path.exists(path), "the pickled command ran"


def _poison(path: str, marker: str) -> None:
    torch.save({"weight": torch.zeros(2), "payload": Command(marker)}, path)


def _refused(argv, path: str) -> None:
    with pytest.raises(UserError) as err:
        run(argv)
    message = str(err.value)
    assert "\n" not in message and path in message and "system" in message and "--trust-checkpoint" in message, \
        message


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("poisoned") / "ckpt")
    return write_synthetic(save, resolved_args("gpt2", (1, 2, 1), 100))


def _poisoned_copy(checkpoint: str, tmp_path, name: str, marker: str) -> str:
    import shutil
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, ckpt)
    folder = os.path.join(ckpt, TAG)
    _poison(os.path.join(folder, name), marker)
    write_manifest(folder)  # sizes as listed: the file passes every check before it is read
    return os.path.join(folder, name)


def test_inspect_and_reshape_refuse(checkpoint, tmp_path, marker):
    path = _poisoned_copy(checkpoint, tmp_path, "layer_00-model_00-model_states.pt", marker)
    ckpt = os.path.dirname(os.path.dirname(path))
    _refused(["inspect", ckpt], path)
    _refused(["reshape", "--load", ckpt, "--save", str(tmp_path / "out"), "--tensor-model-parallel-size", "1",
              "--pipe-parallel-size", "1"], path)
    assert not os.path.exists(tmp_path / "out")


def test_trusted_file_reads_with_the_flag(checkpoint, tmp_path, capsys):
    """An engine file holding a global of no allowlist: refused by default, read with --trust-checkpoint."""
    import shutil
    from tds.safe_load import load as safe_load
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(checkpoint, ckpt)
    path = os.path.join(ckpt, TAG, "mp_rank_00_model_states.pt")
    state = safe_load(path)
    state["custom"] = Custom()
    torch.save(state, path)
    write_manifest(os.path.join(ckpt, TAG))
    with pytest.raises(UserError) as err:
        run(["inspect", ckpt])
    assert "Custom" in str(err.value) and path in str(err.value) and "\n" not in str(err.value)
    run(["inspect", ckpt, "--trust-checkpoint"])
    assert "iteration        10" in capsys.readouterr().out


def test_import_hf_refuses(tmp_path, marker):
    import json
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1,
                                                "vocab_size": 16, "n_positions": 8}))
    _poison(str(hf / "pytorch_model.bin"), marker)
    _refused(["import-hf", "--input", str(hf), "--save", str(tmp_path / "out"), "--tensor-model-parallel-size", "1",
              "--pipe-parallel-size", "1"], str(hf / "pytorch_model.bin"))


def _import_argv(src: str, out: str, *extra) -> list:
    return ["import-megatron", "--input", src, "--save", out, "--tensor-model-parallel-size", "1",
            "--pipe-parallel-size", "1", *extra]


def test_import_megatron_refuses(tmp_path, marker):
    src = str(tmp_path / "legacy")
    os.makedirs(src)
    fx.write_legacy(src, fx.reference("gpt2"), 2, 1, 3.0)
    path = os.path.join(src, "iter_0000120", "mp_rank_01", "model_optim_rng.pt")
    _poison(path, marker)
    _refused(_import_argv(src, str(tmp_path / "out")), path)

    dist = str(tmp_path / "dist")
    os.makedirs(dist)
    fx.write_torch_dist(dist, fx.reference("gpt2"), 1, 1)
    index = os.path.join(dist, "iter_0000300", ".metadata")
    with open(index, "wb") as f:
        pickle.dump(Command(marker), f)
    _refused(_import_argv(dist, str(tmp_path / "out")), index)
    dist2 = str(tmp_path / "dist2")
    fx.write_torch_dist(dist2, fx.reference("gpt2"), 1, 1, common_extra=dict(payload=Command(marker)))
    _refused(_import_argv(dist2, str(tmp_path / "out")), os.path.join(dist2, "iter_0000300", "__0_0.distcp"))


def test_poisoned_torch_dist_index_through_the_command(tmp_path, marker):
    """Megatron core's index with one poisoned record among its real ones, through tools/convert_checkpoint.py in a
    subprocess: exit 2, one stderr line naming the file and the global; the command never runs."""
    import subprocess
    import sys
    from torch.distributed.checkpoint.metadata import Metadata
    dist = str(tmp_path / "dist")
    fx.write_torch_dist(dist, fx.reference("gpt2"), 1, 1)
    index = os.path.join(dist, "iter_0000300", ".metadata")
    with open(index, "rb") as f:
        real = pickle.load(f)
    assert isinstance(real, Metadata)
    real.storage_meta = Command(marker)
    with open(index, "wb") as f:
        pickle.dump(real, f)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, os.path.join(root, "tools", "convert_checkpoint.py"),
                           *_import_argv(dist, str(tmp_path / "out"))], capture_output=True, text=True, cwd=str(tmp_path))
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {index}: refused, its pickle calls posix.system"), lines[0]
    assert not os.path.exists(tmp_path / "out")


def test_trusted_legacy_file_loads_with_the_flag(tmp_path, capsys):
    src = str(tmp_path / "legacy")
    os.makedirs(src)
    fx.write_legacy(src, fx.reference("gpt2"), 1, 1, 3.0)
    path = os.path.join(src, "iter_0000120", "mp_rank_00", "model_optim_rng.pt")
    with fx.megatron_classes():
        state = torch.load(path, weights_only=False)
        state["optimizer"]["custom"] = Custom()
        torch.save(state, path)
    with pytest.raises(UserError) as err:
        run(_import_argv(src, str(tmp_path / "out")))
    assert "Custom" in str(err.value) and path in str(err.value)
    run(_import_argv(src, str(tmp_path / "out"), "--trust-checkpoint"))
    assert "imported Megatron-LM legacy checkpoint" in capsys.readouterr().out

    dist = str(tmp_path / "dist")  # a torch_dist index holding a record of no allowlist: the flag reads it too
    fx.write_torch_dist(dist, fx.reference("gpt2"), 1, 1)
    index = os.path.join(dist, "iter_0000300", ".metadata")
    with open(index, "rb") as f:
        real = pickle.load(f)
    real.storage_meta = Custom()
    with open(index, "wb") as f:
        pickle.dump(real, f)
    with pytest.raises(UserError) as err:
        run(_import_argv(dist, str(tmp_path / "out2")))
    assert "Custom" in str(err.value) and index in str(err.value) and "--trust-checkpoint" in str(err.value)
    run(_import_argv(dist, str(tmp_path / "out2"), "--trust-checkpoint"))
    assert "imported Megatron core torch_dist checkpoint" in capsys.readouterr().out


def test_engine_reads_are_safe(tmp_path, marker):
    """DeepSpeed's state-dict loader (what PipelineModule.load_state_dir uses) through the engine's checkpoint engine,
    and the error --load gives for it."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.state_dict_factory import SDLoaderFactory
    from megatron.checkpointing.engine_files import ProjectCheckpointEngine
    from megatron.checkpointing.files import UntrustedCheckpointError
    path = str(tmp_path / "layer_01-model_00-model_states.pt")
    _poison(path, marker)
    safe = SafeCheckpointEngine(TorchCheckpointEngine())
    with pytest.raises(UnsafeCheckpointError):
        SDLoaderFactory.get_sd_loader([path], checkpoint_engine=safe).load(1, 0, module_key=None, is_pipe_parallel=True)

    files = ProjectCheckpointEngine(safe)
    with pytest.raises(UntrustedCheckpointError) as err:
        with files.verified(str(tmp_path), {}):
            files.load(path)
    assert path in str(err.value) and "\n" not in str(err.value)
