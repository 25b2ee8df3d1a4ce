"""The example scripts' GPU defaults, decided when they run: bf16 where the GPUs compute it natively (compute
capability 8.0 and up), else fp16 with the loss scale starting at 2^16; the fused loss everywhere; --compile on
request. A stand-in `torch` reports the GPU and the stand-in python prints the command line it would run
(DRY_RUN=1 launches one process with --dry-run)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_TORCH = """
import os
class cuda:
    @staticmethod
    def is_available():
        return True
    @staticmethod
    def get_device_capability():
        return tuple(int(x) for x in os.environ["FAKE_CAPABILITY"].split("."))
    @staticmethod
    def device_count():
        return 1
"""
FAKE_PYTHON = f"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then exec {sys.executable} "$@"; fi
echo "ARGS $*"
"""


@pytest.fixture()
def fake(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _command_line(fake, script: str, capability: str, **env) -> str:
    environ = dict(os.environ, PYTHON=str(fake / "python"), PYTHONPATH=str(fake), FAKE_CAPABILITY=capability,
                   NGPUS="1", DRY_RUN="1", CHECK_ARGS="0", DATA_PATH="data/x_text_document", VOCAB_FILE="v.json",
                   MERGE_FILE="m.txt", TOKENIZER_MODEL="t", WORK_DIR=str(fake / "run"), **env)
    out = subprocess.run(["bash", f"examples/{script}"], cwd=ROOT, env=environ, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("ARGS ")]
    assert len(lines) == 1, out.stdout
    return lines[0]


@pytest.mark.parametrize("script", ["ds_pretrain_gpt2.sh", "ds_pretrain_llama.sh", "ds_pretrain_t5.sh"])
def test_bf16_on_ampere_and_later_fp16_before(fake, script):
    hopper = _command_line(fake, script, "9.0")
    assert " --bf16" in hopper and "--fp16" not in hopper and "--initial-loss-scale" not in hopper
    assert "--cross-entropy-loss-fusion" in hopper and "--compile" not in hopper
    volta = _command_line(fake, script, "7.0")
    assert " --fp16" in volta and "--bf16" not in volta and "--initial-loss-scale 65536" in volta
    assert "--compile" in _command_line(fake, script, "8.0", COMPILE="1", LOSS_FUSION="0").split() and \
        "--cross-entropy-loss-fusion" not in _command_line(fake, script, "8.0", LOSS_FUSION="0")
    assert "--fp16" in _command_line(fake, script, "9.0", PRECISION="--fp16")  # the user's choice stands
