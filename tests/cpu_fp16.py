"""fp16 tests on any x86 CPU.

DeepSpeed's CPU accelerator reports fp16 support only where oneDNN has fp16 kernels
(`torch.ops.mkldnn._is_mkldnn_fp16_supported()`: True on recent Intel CPUs, False on AMD EPYC), and
`deepspeed.initialize` refuses an fp16 config elsewhere ("Type fp16 is not supported on your device").
torch computes fp16 on any x86 CPU (without those kernels it is slower, not different), so the fp16 path
(the model in fp16, dynamic loss scaling, overflow skips, DeepSpeed's fp16 ZeRO optimizer) can run the same
everywhere. Rank functions of fp16 tests run inside `with allow_cpu_fp16():`, which makes DeepSpeed's CPU
accelerator say yes for the block, so those tests run, never skip, on every CPU. Users on such a CPU get a
one-line error instead (`megatron.training.initialize.check_precision_supported`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def allow_cpu_fp16() -> Iterator[None]:
    """DeepSpeed's CPU accelerator reports fp16 support inside the block (no-op on a GPU accelerator)."""
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        yield
        return
    accelerator.is_fp16_supported = lambda: True  # the instance attribute shadows the method
    try:
        yield
    finally:
        del accelerator.is_fp16_supported
