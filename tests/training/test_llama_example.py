"""examples/ds_pretrain_llama.sh as a newcomer runs it, and continued pretraining through the tools and the script.

- A fresh WORK_DIR, 20 iterations: the default corpus, a tokenizer.json trained on it (hf-bpe), the .bin/.idx,
  8 CPU processes (tp=2, pp=2, dp=2) of the Llama-style GPT; the loss falls and `latest` names iteration 20.
- Continued pretraining from a test-made Llama folder as the hub ships it (weights, config.json, tokenizer.json
  with its tokenizer_config.json): `import-hf` at (1, 2), `preprocess_data.py` with the imported tokenizer,
  the script with PRETRAINED and the model flags import-hf printed, then `export-hf`, which transformers loads as a
  LlamaForCausalLM whose weights are the hub model's trained further (correlation > 0.9: 20 small steps from
  them, where a fresh initialisation would be uncorrelated); a second run of the script resumes from its own
  checkpoint, not from the import.
"""
import json
import os
import re
import subprocess
import sys

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


def _hub_llama(tmp_path) -> str:
    """A random Llama (2 key/value groups of 4 heads) with a Llama-3-like tokenizer.json, as the hub ships it."""
    import shutil
    import torch
    import transformers
    from megatron.tokenizer import build_tokenizer
    from tests.data.corpus import make_llama_like
    tok_dir = make_llama_like(str(tmp_path))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tok_dir)
    hf_dir = str(tmp_path / "hub_llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=tokenizer.bos,
        eos_token_id=tokenizer.eos)).save_pretrained(hf_dir)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), hf_dir)
    return hf_dir


@pytest.mark.long
def test_continued_pretraining_through_the_tools_and_the_script(tmp_path):
    from tests.data.corpus import make_corpus
    hf_dir, ckpt, out = _hub_llama(tmp_path), str(tmp_path / "imported"), str(tmp_path / "exported")
    env = _env(tmp_path / "work", SAMPLES="0", TP="1", PP="2", NPROC="2", MICRO_BATCH="2", GAS="4",
               SEQ_LEN="32")
    tools = [sys.executable, "tools/convert_checkpoint.py"]
    printed = _run(tools + ["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "1",
                            "--pipe-parallel-size", "2"], env)
    flags = re.search(r"^model flags: (.*)$", printed, re.M).group(1).split()
    tokenizer = os.path.join(ckpt, "iter_0000000", "tokenizer")
    prefix = str(tmp_path / "data" / "corpus")
    _run([sys.executable, "tools/preprocess_data.py", "--input", make_corpus(str(tmp_path)), "--tokenizer-type",
          "HuggingFaceTokenizer", "--tokenizer-model", tokenizer, "--append-eod", "--output-prefix", prefix], env)
    data = dict(DATA_PATH=prefix + "_text_document", TOKENIZER_MODEL=tokenizer, PRETRAINED=ckpt)
    log = _run(["bash", SCRIPT, *flags], dict(env, **data))
    assert "starting from the weights of --pretrained-checkpoint" in log, log[-3000:]
    continued = _losses(log)
    assert sorted(continued) == list(range(1, 21)) and continued[20] < continued[1]
    again = _run(["bash", SCRIPT, *flags], dict(env, **data, TRAIN_ITERS="22"))
    assert "pretrained-checkpoint" not in again and sorted(_losses(again)) == [21, 22], again[-3000:]
    save = str(tmp_path / "work" / "checkpoints")
    _run(tools + ["export-hf", "--load", save, "--output", out], env)
    import torch
    import transformers
    model, hub = (transformers.AutoModelForCausalLM.from_pretrained(d) for d in (out, hf_dir))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    trained, original = (m.model.embed_tokens.weight.detach().flatten() for m in (model, hub))
    assert torch.corrcoef(torch.stack([trained, original]))[0, 1] > 0.9
    assert not torch.equal(trained, original)
    with open(os.path.join(out, "config.json")) as f:
        bos = json.load(f)["bos_token_id"]
    assert transformers.AutoTokenizer.from_pretrained(out)("the model").input_ids[0] == bos
