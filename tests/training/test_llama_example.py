"""examples/ds_pretrain_llama.sh as a newcomer runs it: a fresh WORK_DIR, 20 iterations: the default corpus, a
tokenizer.json trained on it (hf-bpe), the .bin/.idx, 8 CPU processes (tp=2, pp=2, dp=2) of the Llama-style GPT;
the loss falls and `latest` names iteration 20. Continued pretraining through it:
tests/training/test_continued_pretraining.py."""
import os
import re
import subprocess

import pytest

from megatron.checkpointing import read_latest
from tests.training.test_example_script import ROOT, _env

SCRIPT = "examples/ds_pretrain_llama.sh"


def _losses(log: str) -> dict:
    return {int(i): float(loss) for i, loss in re.findall(r"iteration (\d+)/\d+ \|.*?\| loss ([0-9.]+)", log)}


def _run(args: list, env: dict, timeout: int = 400) -> str:
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)}: exit {proc.returncode}\n{log[-4000:]}"
    return log


@pytest.mark.long
def test_llama_example_from_a_fresh_work_dir(tmp_path):
    log = _run(["bash", SCRIPT], _env(tmp_path / "work", SAMPLES="0"))
    losses = _losses(log)
    assert sorted(losses) == list(range(1, 21)), log[-3000:]
    assert sum(losses[i] for i in range(16, 21)) < sum(losses[i] for i in range(1, 6)) - 1.0  # it learns
    assert "(tp, pp, dp) = (2, 2, 2)" in log
    assert os.path.isfile(tmp_path / "work" / "data" / "tokenizer" / "tokenizer.json")
    assert read_latest(str(tmp_path / "work" / "checkpoints")) == "iter_0000020"
