"""Session fixtures: one GPT-2, one Llama-style GPT and one T5 training at (tp, pp, dp) = (2, 2, 2), 10 iterations with a checkpoint
at 5 and 10; every offline conversion test reads these (and never modifies them)."""
import os

import pytest

from tests.checkpoint.common import train
from tests.training.golden_cases import preprocess

ITERS, SAVE_AT = 10, 5


@pytest.fixture(scope="session")
def data_prefix(tmp_path_factory) -> str:
    return preprocess(str(tmp_path_factory.mktemp("ckpt_data")))


def _trained(model: str, data_prefix: str, root) -> dict:
    save = str(root / f"{model}_222")
    losses = train(model, data_prefix, (2, 2, 2), ITERS, ["--save", save, "--save-interval", str(SAVE_AT)])
    return dict(dir=save, losses=losses, tag5=os.path.join(save, f"iter_{SAVE_AT:07d}"))


@pytest.fixture(scope="session")
def gpt2_222(data_prefix, tmp_path_factory) -> dict:
    """{'dir': checkpoint directory (latest = iteration 10), 'tag5': the iteration-5 folder, 'losses': 10}"""
    return _trained("gpt2", data_prefix, tmp_path_factory.mktemp("gpt2_ckpt"))


@pytest.fixture(scope="session")
def llama_222(data_prefix, tmp_path_factory) -> dict:
    """The Llama-style GPT (tests/training/golden_cases.LLAMA) trained as gpt2_222."""
    return _trained("llama", data_prefix, tmp_path_factory.mktemp("llama_ckpt"))


@pytest.fixture(scope="session")
def t5_222(data_prefix, tmp_path_factory) -> dict:
    return _trained("t5", data_prefix, tmp_path_factory.mktemp("t5_ckpt"))
