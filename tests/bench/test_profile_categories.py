"""bench/profile_categories.py on a CPU run of the training path: the same code a GPU run of
bench/gpu_throughput.py --profile uses, with CPU time instead of device time."""
import os
import sys

import pytest

from harness.dist import run_distributed
from tests.training.runner import small_argv, train_state

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


def _categories():
    sys.path.insert(0, BENCH)
    import profile_categories
    return profile_categories


def profiled_rank(argv):
    from megatron.model.specs import spec_for
    from pretrain_gpt2 import DEFAULTS
    pc = _categories()
    with pc.profiled(device=False, wait=2, warmup=1, active=2) as result:
        train_state(argv, 1, spec_for("gpt"), DEFAULTS)
    return result.table, result.backend, pc.format_table(result.table, "CPU")


def test_category(data=None):
    pc = _categories()
    assert pc.category("aten::addmm") == pc.category("aten::mm") == "matrix products"
    assert pc.category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention forward"
    assert pc.category("aten::_scaled_dot_product_flash_attention_for_cpu_backward") == "attention backward"
    assert pc.category("flash_fwd_kernel<...>") == "attention forward"
    assert pc.category("ampere_bf16_s16816gemm_bf16_128x128") == "matrix products"
    assert pc.category("nccl:all_reduce") == pc.category("ncclDevKernel_AllReduce_Sum_f32") == "communication"
    assert pc.category("aten::copy_") == pc.category("Memcpy DtoD (Device -> Device)") == "copies"
    assert pc.category("aten::layer_norm") == pc.category("aten::add") == "elementwise / norms"
    assert pc.category("aten::mul", "tds::loss") == "loss"
    assert pc.category("aten::add_", "tds::step_tail") == "optimizer (step tail)"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from harness.example_data import build_data
    return build_data(str(tmp_path_factory.mktemp("profile_data")), max_mb=0.05, vocab_size=300)


def test_cpu_run_is_categorised(data):
    argv = small_argv(data, train_iters=6, extra=["--hidden-dropout", "0", "--attention-dropout", "0",
                                                  "--eval-iters", "0", "--cross-entropy-loss-fusion"])
    table, backend, text = run_distributed(profiled_rank, 1, argv, timeout=300)[0]
    assert table["iterations"] == 2
    for name in ("matrix products", "attention forward", "attention backward", "loss", "elementwise / norms",
                 "optimizer (step tail)"):
        assert table[name] > 0, (name, text)
    assert table["communication"] == 0  # one rank, no collectives
    assert 0 < table["busy"] <= table["wall"] and table["idle"] >= 0, text
    assert backend == "flash (CPU kernel)", backend  # no dropout: SDPA's CPU flash kernel
    assert "| matrix products |" in text and "idle" in text


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end


class _Event:
    def __init__(self, name, start, end, device=False, own=0.0, parent=None):
        import torch
        self.name, self.time_range, self.cpu_parent = name, _Range(start, end), parent
        self.device_type = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
        self.self_device_time_total, self.self_cpu_time_total = own, 0.0
        self.is_user_annotation, self.thread = False, 1


def test_gpu_steps_counted_once():
    """A GPU trace names each ProfilerStep twice (the CPU's range and a device-side one): two iterations of
    100 ms, each with a 60 ms matrix product (its CPU operator 60 ms of device time, its kernel 60 ms busy)."""
    pc = _categories()
    events = []
    for i in range(2):
        t = i * 100_000.0  # microseconds
        step = _Event(f"ProfilerStep#{i}", t, t + 100_000)
        events += [step, _Event(f"ProfilerStep#{i}", t + 10, t + 100_010, device=True),
                   _Event("aten::mm", t + 1_000, t + 2_000, own=60_000.0, parent=step),
                   _Event("nvjet_sm90_gemm", t + 5_000, t + 65_000, device=True)]
    table = pc.category_table(events, device=True)
    assert table["iterations"] == 2
    assert table["matrix products"] == 60.0 and table["wall"] == 100.0
    assert table["busy"] == 60.0 and table["idle"] == 40.0
