"""The README's "Train on your own data" block, run as a newcomer runs it: its commands verbatim (read from
README.md), in a folder of one's own outside the repository (REPO names the clone; every relative path means
that folder), holding a jsonl corpus, shortened to 20 iterations by the environment: a tokenizer, the .bin/.idx,
the default layout's job, and a Hugging Face folder whose logits `--verify` compares with transformers'."""
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_block(title: str) -> str:
    """The first ```bash block of the README section `## title`."""
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def run_block(block: str, folder: str, env: dict, timeout: int = 900) -> str:
    """`block` run by bash (-euo pipefail) in `folder` with REPO set to this repository, CPU defaults and the
    test's Python first on PATH; the log (stdout + stderr), after asserting exit 0."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    full = dict(os.environ, REPO=ROOT, PYTHON=sys.executable, PATH=path, NGPUS="0", SAMPLES="0", **env)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=folder, env=full, capture_output=True,
                          text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


@pytest.mark.long
def test_train_on_your_own_data_then_export_to_hugging_face(tmp_path):
    block = readme_block("Train on your own data")
    assert "corpus.jsonl" in block and "export-hf" in block and "$REPO/examples/ds_pretrain_gpt2.sh" in block, block
    subprocess.run([sys.executable, "examples/make_default_corpus.py", "--output", str(tmp_path / "corpus.jsonl"),
                    "--max-mb", "0.5"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    log = run_block(block, str(tmp_path), dict(TRAIN_ITERS="20", LOG_INTERVAL="5", EVAL_INTERVAL="10",
                                               EVAL_ITERS="2", SAVE_INTERVAL="20"))
    assert "(tp, pp, dp) = (2, 2, 2)" in log and "iteration 20/20" in log, log[-4000:]
    losses = [float(x) for x in re.findall(r"iteration +\d+/20 \|.*?\| loss ([0-9.]+)", log)]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    config = json.loads((tmp_path / "runs" / "mine" / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and (tmp_path / "runs" / "mine" / "hf" / "model.safetensors").exists()
    difference = re.search(r"verified with transformers: logits max relative difference ([0-9.e+-]+)", log)
    assert difference and float(difference[1]) < 1e-4, log[-2000:]
