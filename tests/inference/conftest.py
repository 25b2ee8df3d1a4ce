"""Session fixtures: a SentencePiece model (T5 tokenizer) and real checkpoints written by pretraining."""
import os

import pytest


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
    from harness.corpus import make_spm
    return make_spm(str(tmp_path_factory.mktemp("inference_spm")))


def _with(argv, **values):
    """argv with each --flag's value replaced (or the flag appended)."""
    argv = list(argv)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = str(value)
        else:
            argv += [flag, str(value)]
    return argv


def _train_all(gpt_argv, llama_argv, t5_argv) -> None:
    from tests.training.golden_cases import rank_run
    rank_run("gpt2", gpt_argv, 2)
    rank_run("llama", llama_argv, 2)
    rank_run("t5", t5_argv, 2)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    """GPT-2 and the Llama-style GPT saved at (tp, pp, dp) = (2, 1, 1) and T5 (v1.0, 8 sentinels) at (1, 2, 1),
    3 iterations each of the golden-loss runs (tests/training/golden_cases.py: committed corpus and BPE
    tokenizer), dropout on."""
    from harness.dist import run_distributed
    from tests.training.golden_cases import argv, preprocess
    tmp = str(tmp_path_factory.mktemp("inference_checkpoints"))
    prefix = preprocess(tmp)
    paths = {kind: os.path.join(tmp, kind) for kind in ("gpt2", "llama", "t5")}
    common = dict(train_iters=3, eval_iters=0, hidden_dropout=0.1, attention_dropout=0.1)
    gpt = _with(argv("gpt2", prefix, tp=2, pp=1), save=paths["gpt2"], **common)
    llama = _with(argv("llama", prefix, tp=2, pp=1), save=paths["llama"], **common)
    t5 = _with(argv("t5", prefix, tp=1, pp=2), save=paths["t5"], **common)
    run_distributed(_train_all, 2, gpt, llama, t5, timeout=300)
    return paths
