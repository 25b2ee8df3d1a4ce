"""The README's "Train on your own data" block, run as a newcomer runs it: its commands verbatim (read from
README.md), in a fresh folder holding the repository's scripts and a jsonl corpus of one's own, shortened to 20
iterations by the environment: a tokenizer, the .bin/.idx, the default layout's job, and a Hugging Face folder
whose logits `--verify` compares with transformers'."""
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


@pytest.mark.long
def test_train_on_your_own_data_then_export_to_hugging_face(tmp_path):
    block = readme_block("Train on your own data")
    assert "corpus.jsonl" in block and "export-hf" in block, block
    for name in ("tools", "examples", "megatron", "tds", "pretrain_gpt2.py"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)  # the block starts with `source .venv/bin/activate`
    (tmp_path / ".venv" / "bin" / "activate").write_text(f'export PATH="{os.path.dirname(sys.executable)}:$PATH"\n')
    subprocess.run([sys.executable, "examples/make_default_corpus.py", "--output", str(tmp_path / "corpus.jsonl"),
                    "--max-mb", "0.5"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    env = dict(os.environ, PYTHON=sys.executable, NGPUS="0", TRAIN_ITERS="20", LOG_INTERVAL="5",
               EVAL_INTERVAL="10", EVAL_ITERS="2", SAVE_INTERVAL="20", SAMPLES="0")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "(tp, pp, dp) = (2, 2, 2)" in log and "iteration 20/20" in log, log[-4000:]
    losses = [float(x) for x in re.findall(r"iteration +\d+/20 \|.*?\| loss ([0-9.]+)", log)]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    config = json.loads((tmp_path / "runs" / "mine" / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and (tmp_path / "runs" / "mine" / "hf" / "model.safetensors").exists()
    difference = re.search(r"verified with transformers: logits max relative difference ([0-9.e+-]+)", log)
    assert difference and float(difference[1]) < 1e-4, log[-2000:]
