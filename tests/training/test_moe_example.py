"""examples/ds_pretrain_moe.sh as a newcomer runs it, with its own CPU defaults: a fresh WORK_DIR, the default corpus,
a tokenizer.json trained on it (hf-bpe), the .bin/.idx, 8 CPU processes at (tp, pp, ep, dp) = (1, 2, 2, 4) of the
Llama-style mixture of experts (8 experts, top-2, aux and z losses, fp32, ZeRO stage 0), 20 iterations: the loss
falls, every log line carries the experts' statistics and `latest` names iteration 20. Its GPU defaults never pick
what expert parallelism refuses (bf16 / fp16, ZeRO-1 at ep > 1). The MoE layouts against one process:
tests/training/test_moe_pretrain.py."""
import os
import re

import pytest

from megatron.checkpointing import read_latest
from tests.training import test_example_gpu_defaults as gpu_defaults
from tests.training.test_example_script import _env
from tests.training.test_llama_example import _losses, _run

SCRIPT = "examples/ds_pretrain_moe.sh"
# the MoE part of an iteration's log line (megatron/training/moe_logging.format_moe)
MOE_PART = re.compile(r"iteration (\d+)/\d+ \|.*\| load balancing loss ([0-9.]+) \| z loss ([0-9.]+) \| "
                      r"dropped ([0-9.]+) \| overload avg ([0-9.]+) max ([0-9.]+)")
fake = gpu_defaults.fake  # the fixture: a stand-in torch that reports a GPU, a python that prints the command line


@pytest.mark.long
def test_moe_example_from_a_fresh_work_dir(tmp_path):
    env = _env(tmp_path / "work", SAMPLES="0")
    for name in ("TRAIN_ITERS", "LOG_INTERVAL", "EVAL_INTERVAL"):  # the script's own CPU defaults: 20, 1, 100
        del env[name]
    log = _run(["bash", SCRIPT], env)
    losses = _losses(log)
    assert sorted(losses) == list(range(1, 21)), log[-3000:]
    first, last = (sum(losses[i] for i in range(a, a + 5)) / 5 for a in (1, 16))
    assert last < first - 0.3, (first, last)  # it learns (7.59 -> 6.93 here)
    assert "Llama-style mixture of experts: tp=1, pp=2, ep=2, dp=4, 8 experts, top-2, 20 iterations" in log
    assert "(tp, pp, ep, dp) = (1, 2, 2, 4)" in log and "ZeRO stage 0" in log
    moe = {int(m[0]): [float(v) for v in m[1:]] for m in MOE_PART.findall(log)}
    assert sorted(moe) == list(range(1, 21)), log[-3000:]
    for balance, z, dropped, overload_avg, overload_max in moe.values():
        assert 0.5 < balance < 2 and z > 0 and dropped == 0 and 1 <= overload_avg <= overload_max  # dropless
    assert os.path.isfile(tmp_path / "work" / "data" / "tokenizer" / "tokenizer.json")
    assert read_latest(str(tmp_path / "work" / "checkpoints")) == "iter_0000020"


def test_moe_gpu_defaults_are_a_combination_expert_parallelism_runs(fake):
    """With GPUs, EP defaults to 1 with the GPU's precision and ZeRO-1; EP=2 runs fp32 with ZeRO stage 0."""
    ep1 = gpu_defaults._command_line(fake, "ds_pretrain_moe.sh", "9.0", NPROC="2").split()
    assert {"--bf16", "--sequence-parallel"} <= set(ep1)  # NPROC 2: tp 2
    assert ep1[ep1.index("--zero-stage") + 1] == "1"
    assert ep1[ep1.index("--expert-model-parallel-size") + 1] == "1"
    ep2 = gpu_defaults._command_line(fake, "ds_pretrain_moe.sh", "9.0", NPROC="2", EP="2").split()
    assert "--bf16" not in ep2 and "--fp16" not in ep2
    assert ep2[ep2.index("--zero-stage") + 1] == "0"
    assert ep2[ep2.index("--expert-model-parallel-size") + 1] == "2"
