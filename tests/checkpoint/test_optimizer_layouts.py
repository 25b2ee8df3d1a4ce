"""Every optimizer layout this project runs (megatron/checkpointing/optim.py), written by `pretrain()` itself:

    zero pp=1 (1,1,2)    client pp=1 (1,1,1)    client pp=2 (1,2,1)                      fp32
    zero (1,2,2)         unfused pp=1 (1,1,1)   BF16_Optimizer pp=2 (1,2,1)              bf16
    zero (1,1,2)                                                                          fp16 (allow_cpu_fp16)

For each: resuming at the same layout reproduces the uninterrupted run's losses bit for bit, and reshaping the
checkpoint to its own layout rewrites DeepSpeed's files bit for bit (except the state of the unused copies,
`ModelTable.unused_copies`). Two loader fixes made resume exact (megatron/checkpointing/engine_io.py):
DeepSpeed 0.19 cannot load its own BF16_Optimizer layout (bf16, pp > 1, dp = 1) and would drop its fp32 master
weights; and a ZeRO optimizer loaded after the LR scheduler brings back the previous step's learning rate (the
first step after resuming at pp = 1 used lr 0 during warm-up). Slow: three short trainings per layout.
"""
import os

import pytest

from megatron.checkpointing.files import read_args, read_latest
from tests.checkpoint.common import _losses, argv, differences, load_all, mask_unused_copies, train
from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tools.convert_checkpoint import run

SLOW = pytest.mark.slow
CASES = [("zero_pp1", (1, 1, 2), []), ("client_pp1", (1, 1, 1), []), ("client_pp2", (1, 2, 1), []),
         ("zero_bf16", (1, 2, 2), ["--bf16"]), ("unfused_bf16", (1, 1, 1), ["--bf16"]),
         ("bf16_optimizer", (1, 2, 1), ["--bf16"]), ("zero_fp16", (1, 1, 2), ["--fp16"])]
LAYOUTS = [pytest.param(*case, id=case[0], marks=SLOW) for case in CASES]


def _fp16_losses(model, args, world):
    with allow_cpu_fp16():
        return _losses(model, args, world)


def _train(data_prefix, layout, iters, extra):
    if "--fp16" not in extra:
        return train("gpt2", data_prefix, layout, iters, extra)
    tp, pp, dp = layout
    world = tp * pp * dp
    return run_distributed(_fp16_losses, world, "gpt2", argv("gpt2", data_prefix, tp, pp, iters, extra), world,
                           timeout=600)[-1]


@pytest.mark.parametrize("name,layout,extra", LAYOUTS)
def test_resume_and_identity_reshape(name, layout, extra, data_prefix, tmp_path):
    save = str(tmp_path / "ckpt")
    straight = _train(data_prefix, layout, 4, extra)
    assert _train(data_prefix, layout, 2, extra + ["--save", save]) == straight[:2]
    assert _train(data_prefix, layout, 4, extra + ["--load", save]) == straight[2:]
    tp, pp, dp = layout
    same = str(tmp_path / "same")
    run(["reshape", "--load", save, "--save", same, "--tensor-model-parallel-size", str(tp),
         "--pipe-parallel-size", str(pp), "--data-parallel-size", str(dp)])
    folder = os.path.join(save, read_latest(save))
    original, rewritten = load_all(folder), load_all(os.path.join(same, read_latest(same)))
    for files in (original, rewritten):
        mask_unused_copies(files, read_args(folder))
    assert differences(original, rewritten) == []
    assert not os.path.exists(os.path.join(save, "zero_to_fp32.py"))
