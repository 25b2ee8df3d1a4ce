"""--fp16 on a CPU that DeepSpeed says lacks fp16 (no GPU, no oneDNN fp16 kernels, e.g. AMD EPYC): the user
gets one line naming the problem and the ways out (--bf16 or fp32), before any process group is built. The
capability is forced off (or on) here, so the test does not depend on the machine's CPU."""
import os
import subprocess
import sys

import pytest

from megatron.config.arguments import parse_args
from megatron.errors import UserError
from tests.training.runner import small_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESSAGE = "error: --fp16 (command line or DeepSpeed config) needs fp16 support, which this CPU lacks"

# pretrain_gpt2.py as a user runs it, on a CPU whose DeepSpeed accelerator refuses fp16; building a process
# group would fail loudly instead of reaching DeepSpeed's own error.
CLI_WITHOUT_CPU_FP16 = """
import runpy, sys
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
get_accelerator().is_fp16_supported = lambda: None
def no_group(*args, **kwargs):
    raise SystemExit("a process group was built before the fp16 check")
dist.init_process_group = no_group
sys.argv = sys.argv[1:]
runpy.run_path("pretrain_gpt2.py", run_name="__main__")
"""


def test_fp16_on_cpu_without_fp16_is_one_line_before_any_process_group(gpt_data):
    argv = small_argv(gpt_data, train_iters=2, extra=["--fp16"])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", CLI_WITHOUT_CPU_FP16, "pretrain_gpt2.py", *argv], cwd=ROOT,
                          env={**env, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(MESSAGE), proc.stderr[-3000:]
    assert "--bf16" in errors[0] and "fp32" in errors[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("supported", [True, None])
def test_check_follows_deepspeed_capability(gpt_data, monkeypatch, supported):
    from deepspeed.accelerator import get_accelerator

    from megatron.training.initialize import check_precision_supported
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: supported, raising=False)
    check_precision_supported(parse_args(small_argv(gpt_data), world_size=1))  # fp32: never refused
    check_precision_supported(parse_args(small_argv(gpt_data, extra=["--bf16"]), world_size=1))
    fp16 = parse_args(small_argv(gpt_data, extra=["--fp16"]), world_size=1)
    if supported:
        check_precision_supported(fp16)
    else:
        with pytest.raises(UserError, match="--fp16 .* this CPU lacks .* --bf16, or in fp32"):
            check_precision_supported(fp16)
