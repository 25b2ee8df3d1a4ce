"""tools/generate.py and tools/evaluate.py end to end on checkpoints written by pretraining (GPT-2 and the
Llama-style GPT saved at tp=2, T5 at pp=2; see conftest): the same completions at tp=2 (2 processes) and tp=1, the
same task results with 2 data-parallel processes and with one, and the bad inputs as one-line errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron.errors import UserError
from harness.dist import run_distributed
from megatron.checkpointing import read_latest
from tests.inference.common import ROOT, VOCAB

PROMPTS = ["The model", "Tensor parallel pipeline stage", "data"]
T5_PROMPT = "The <extra_id_0> parallel pipeline <extra_id_1> gradient"
SAMPLE = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "7"]


def _files(tmp: str, tag: str) -> dict:
    names = ("gen_greedy", "gen_sampled", "gen_t5", "lm", "lambada", "lm_tp", "lambada_tp", "gen_llama", "lm_llama")
    return {name: os.path.join(tmp, f"{name}_{tag}.json{'l' if name.startswith('gen') else ''}") for name in names}


def _data(tmp: str) -> dict:
    """A prompt file, a small text file and a LAMBADA-style jsonl."""
    paths = {k: os.path.join(tmp, name) for k, name in (("prompts", "prompts.jsonl"), ("text", "wiki.txt"),
                                                        ("lambada", "lambada.jsonl"))}
    with open(paths["prompts"], "w") as f:
        f.writelines(json.dumps({"q": p}) + "\n" for p in PROMPTS)
    with open(paths["text"], "w") as f:
        f.write(" ".join(PROMPTS * 12) + " @-@ end .\n")
    with open(paths["lambada"], "w") as f:
        f.writelines(json.dumps({"text": f"{p} and the model data"}) + "\n" for p in PROMPTS * 2)
    return paths


def _run_tools(ckpt: dict, data: dict, out: dict, tp: int) -> None:
    """Every tool: generation and the tasks at `tp`, the tasks also at tp 1 (data parallel over the
    processes when there are several)."""
    from tools import evaluate, generate
    gen = ["--load", ckpt["gpt2"], "--prompt-file", data["prompts"], "--json-key", "q", "--max-new-tokens", "8",
           "--tensor-model-parallel-size", str(tp), "--batch-size", "2"]
    generate.main(gen + ["--output", out["gen_greedy"]])
    generate.main(gen + SAMPLE + ["--output", out["gen_sampled"]])
    generate.main(["--load", ckpt["t5"], "--prompt", T5_PROMPT, "--prompt", "data", "--max-new-tokens", "6",
                   "--tensor-model-parallel-size", str(tp), "--output", out["gen_t5"]] + SAMPLE)
    llama = ["--load", ckpt["llama"], "--tensor-model-parallel-size", str(tp), "--batch-size", "2"]
    generate.main(llama + ["--prompt-file", data["prompts"], "--json-key", "q", "--max-new-tokens", "8",
                           "--output", out["gen_llama"]])
    evaluate.main(llama + ["--task", "lm-ppl", "--data", data["text"], "--overlapping-eval", "8",
                           "--output", out["lm_llama"]])
    for suffix, task_tp in (("", 1), ("_tp", tp)):
        common = ["--load", ckpt["gpt2"], "--batch-size", "2", "--tensor-model-parallel-size", str(task_tp)]
        evaluate.main(common + ["--task", "lm-ppl", "--data", data["text"], "--overlapping-eval", "8",
                                "--output", out["lm" + suffix]])
        evaluate.main(common + ["--task", "lambada", "--data", data["lambada"], "--strict",
                                "--output", out["lambada" + suffix]])


def _read(path: str):
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "tokens_per_s")}
                    for line in f]
        return json.load(f)


def test_tools_at_tp2_and_dp2_equal_one_process(checkpoints, tmp_path):
    data = _data(str(tmp_path))
    two, one = _files(str(tmp_path), "two"), _files(str(tmp_path), "one")
    run_distributed(_run_tools, 2, checkpoints, data, two, 2, timeout=300)
    _run_tools(checkpoints, data, one, 1)
    for name in ("gen_greedy", "gen_sampled", "gen_t5", "lm", "lambada", "lambada_tp", "gen_llama"):  # tp or dp 2
        assert _read(two[name]) == _read(one[name]), name
    llama_tp2, llama = _read(two["lm_llama"]), _read(one["lm_llama"])
    assert abs(llama_tp2["loss"] - llama["loss"]) <= 1e-5 * llama["loss"] and llama["windows"] > 2
    lm_tp2, lm = _read(two["lm_tp"]), _read(one["lm"])
    assert abs(lm_tp2["loss"] - lm["loss"]) <= 1e-5 * lm["loss"]
    greedy, sampled, t5 = _read(one["gen_greedy"]), _read(one["gen_sampled"]), _read(one["gen_t5"])
    assert [r["prompt"] for r in greedy] == PROMPTS and greedy != sampled
    assert all(r["completion_tokens"] == 8 or r["finish"] == "eod" for r in greedy)
    assert t5[0]["prompt"] == T5_PROMPT and t5[0]["prompt_tokens"] > 5
    assert lm["task"] == "lm-ppl" and lm["windows"] > 2 and lm["stride"] == 8 and lm["seq_length"] == 32
    assert _read(one["lambada"])["examples"] == 6 and _read(one["lambada"])["strict"]


def _no_tokenizer_copy(src: str, dst: str) -> str:
    """The checkpoint's `latest` and arguments without any tokenizer argument."""
    tag = read_latest(src)
    os.makedirs(os.path.join(dst, tag))
    shutil.copy(os.path.join(src, "latest"), dst)
    with open(os.path.join(src, tag, "megatron_args.json")) as f:
        saved = json.load(f)
    for key in ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model"):
        saved.pop(key, None)
    with open(os.path.join(dst, tag, "megatron_args.json"), "w") as f:
        json.dump(saved, f)
    return dst


def test_bad_inputs_are_one_line_errors(checkpoints, tmp_path):
    from tools import evaluate, generate
    with pytest.raises(UserError, match="prompt 0 has .* tokens but the model has 32 positions"):
        generate.main(["--load", checkpoints["gpt2"], "--prompt", "data " * 40])
    with pytest.raises(UserError, match="unknown sentinel <extra_id_8>; this tokenizer has 8"):
        generate.main(["--load", checkpoints["t5"], "--prompt", "The <extra_id_8> sat"])
    with pytest.raises(UserError, match="--task lm-ppl evaluates a GPT checkpoint; .* is .t5."):
        evaluate.main(["--load", checkpoints["t5"], "--task", "lm-ppl", "--data", __file__])
    with pytest.raises(UserError, match="--tensor-model-parallel-size 2 needs 2 processes"):
        generate.main(["--load", checkpoints["gpt2"], "--prompt", "x", "--tensor-model-parallel-size", "2"])
    bare = _no_tokenizer_copy(checkpoints["gpt2"], str(tmp_path / "bare"))
    with pytest.raises(UserError, match="was saved without a tokenizer argument"):
        evaluate.main(["--load", bare, "--task", "lambada", "--data", __file__])
    moved = str(tmp_path / "moved")
    shutil.copytree(checkpoints["gpt2"], moved)
    with open(os.path.join(moved, read_latest(moved), "megatron_args.json")) as f:
        saved = json.load(f)
    saved["vocab_file"] = "/nowhere/vocab.json"  # trained on another machine
    with open(os.path.join(moved, read_latest(moved), "megatron_args.json"), "w") as f:
        json.dump(saved, f)
    with pytest.raises(UserError, match=f"checkpoint {moved} names '/nowhere/vocab.json' for vocab_file and no "
                                        f"such file exists here; pass --vocab-file FILE"):
        generate.main(["--load", moved, "--prompt", "x"])
    with pytest.raises(UserError, match="--merge-file /nowhere/merges.txt: no such file"):
        generate.main(["--load", moved, "--prompt", "x", "--vocab-file", VOCAB, "--merge-file", "/nowhere/merges.txt"])
    generate.main(["--load", moved, "--prompt", "x", "--vocab-file", VOCAB, "--max-new-tokens", "2",
                   "--output", str(tmp_path / "ok.jsonl")])  # the override finds the tokenizer
    assert _read(str(tmp_path / "ok.jsonl"))[0]["prompt"] == "x"


def test_cli_exit_status_and_message(checkpoints, tmp_path):
    """The tool as a user runs it: status 2 and one `error:` line on stderr, nothing on stdout but
    DeepSpeed's accelerator notice."""
    bare = _no_tokenizer_copy(checkpoints["gpt2"], str(tmp_path / "bare"))
    run = subprocess.run([sys.executable, "tools/generate.py", "--load", bare, "--prompt", "x"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "error" not in run.stdout
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: checkpoint {bare} was saved without a tokenizer argument (tokenizer_type); pass "
                      f"--tokenizer-type with --vocab-file/--merge-file or --tokenizer-model"]


@pytest.mark.slow
def test_torchrun_launch(checkpoints, tmp_path):
    """Launched by torchrun as a user would (the tool creates and destroys the process group): exit status 0
    and the completions of one process."""
    out = {n: str(tmp_path / f"{n}.jsonl") for n in ("two", "one")}
    argv = ["tools/generate.py", "--load", checkpoints["gpt2"], "--prompt", "The model", "--prompt", "data",
            "--max-new-tokens", "6"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                          *argv, "--tensor-model-parallel-size", "2", "--output", out["two"]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    subprocess.run([sys.executable, *argv, "--output", out["one"]], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=300)
    assert _read(out["two"]) == _read(out["one"])
