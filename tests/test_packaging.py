"""The project installs as a package: a wheel built from the repository converts a checkpoint from a directory
outside it, through `python -m megatron.checkpointing.cli` and the `megatron-convert-checkpoint` command. The wheel
holds the library (megatron, tds) and the test and benchmark harness (harness: setuptools installs the same
packages into a wheel and editable, and the editable install is what lets bench/ import it from any folder)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from harness.synthetic import resolved_args, write_synthetic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _wheel(source: str, out: str) -> str:
    """Build from a copy of the project's files (a build writes build/ and *.egg-info beside its sources)."""
    for name in ("megatron", "tds", "harness"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(source, name),
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "requirements.txt", "README.md"):
        shutil.copy(os.path.join(ROOT, name), source)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", out, source],
                   check=True, capture_output=True)
    (name,) = [f for f in os.listdir(out) if f.endswith(".whl")]
    return os.path.join(out, name)


@pytest.mark.long
def test_a_wheel_converts_a_checkpoint_outside_the_repository(tmp_path):
    target, elsewhere = str(tmp_path / "site"), tmp_path / "elsewhere"
    elsewhere.mkdir()
    wheel = _wheel(str(tmp_path / "source"), str(tmp_path / "dist"))
    with zipfile.ZipFile(wheel) as z:
        packages = {n.split("/")[0] for n in z.namelist() if n.endswith("/__init__.py") and n.count("/") == 1}
    assert packages == {"megatron", "tds", "harness"}, packages
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target, wheel], check=True,
                   capture_output=True)
    ckpt = write_synthetic(str(tmp_path / "ckpt"), resolved_args("gpt2", (2, 2, 1), vocab_size=60))
    env = dict(os.environ, PYTHONPATH=target)
    where = subprocess.run([sys.executable, "-c", "import megatron, tds; print(megatron.__file__, tds.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1].split()
    assert all(path.startswith(target) for path in where), where  # the installed copy, not the repository
    out = str(tmp_path / "tp1")
    run = subprocess.run([sys.executable, "-m", "megatron.checkpointing.cli", "reshape", "--load", ckpt, "--save", out,
                          "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1"],
                         cwd=elsewhere, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "from (tp, pp, dp) = (2, 2, 1) to (1, 1, 1)" in run.stdout
    with open(os.path.join(out, "iter_0000010", "megatron_args.json")) as f:
        assert json.load(f)["layout"]["tp"] == 1
    script = os.path.join(target, "bin", "megatron-convert-checkpoint")
    inspect = subprocess.run([sys.executable, script, "inspect", out], cwd=elsewhere, env=env, capture_output=True,
                             text=True)
    assert inspect.returncode == 0, inspect.stderr
    assert "(tp, pp, dp)     (1, 1, 1)" in inspect.stdout
