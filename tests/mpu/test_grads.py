"""clip_grad_norm over tp and pp ranks equals torch.nn.utils.clip_grad_norm_ on the dense model.

World 4 with tp=2, pp=2: stage 0 (ranks 0, 1) owns a layer norm and a ColumnParallelLinear, stage 1
(ranks 2, 3) a RowParallelLinear. Every rank runs the whole tp model and its dense twin (same seed), then
clips only its own stage's parameters; the norm must count each replicated grad once and sum both stages.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from harness.dist import run_distributed

SEED, TOL = 99, 1e-5


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _model():
    torch.manual_seed(SEED)
    norm = nn.LayerNorm(8)
    col = mpu.ColumnParallelLinear(8, 16, gather_output=False)
    row = mpu.RowParallelLinear(16, 8, input_is_parallel=True)
    with torch.no_grad():
        norm.weight.normal_()
    return norm, col, row


def _loss(norm, col, row):
    torch.manual_seed(5)
    x = torch.randn(4, 8)
    h, _ = col(norm(x))
    y, _ = row(F.gelu(h))
    return y.square().sum()


def _dense_twin():
    state = mpu.get_parallel_state()
    mpu.set_parallel_state(None)
    try:
        return _model()
    finally:
        mpu.set_parallel_state(state)


def _clip_case(max_norm, norm_type):
    tp, dense = _model(), _dense_twin()
    _loss(*tp).backward()
    _loss(*dense).backward()
    stage = mpu.get_pipe_parallel_rank()
    mine = [tp[0], tp[1]] if stage == 0 else [tp[2]]
    params = [p for m in mine for p in m.parameters()]
    norm = mpu.clip_grad_norm(params, max_norm, norm_type)
    ref_norm = torch.nn.utils.clip_grad_norm_([p for m in dense for p in m.parameters()], max_norm, norm_type)
    errs = {"norm": abs(norm - ref_norm.item()) / ref_norm.item()}
    pairs = [(tp[0], dense[0]), (tp[1], dense[1])] if stage == 0 else [(tp[2], dense[2])]
    for mod, ref in pairs:
        for (name, p), r in zip(mod.named_parameters(), ref.parameters()):
            errs[f"{type(mod).__name__}.{name}"] = rel(_full_grad(p), r.grad)
    return errs


def _full_grad(p):
    """The gathered gradient of a tp parameter (its grad tensor carries the parameter's split attributes)."""
    g = p.grad.detach()
    mpu.set_tensor_model_parallel_attributes(g, getattr(p, "tensor_model_parallel", False),
                                             getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1))
    return mpu.full_weight(g)


def _all_cases():
    mpu.initialize_model_parallel(2, 2)
    out = {f"max_norm={m} norm_type={q}": _clip_case(m, q) for m, q in ((0.5, 2), (1e6, 2), (0.5, math.inf))}
    mpu.destroy_model_parallel()
    return out


def test_clip_grad_norm_tp2_pp2_matches_torch():
    for rank_result in run_distributed(_all_cases, 4):
        for case, errs in rank_result.items():
            bad = {k: v for k, v in errs.items() if not v < TOL}
            assert not bad, f"{case}: relative errors above {TOL}: {bad}"


def test_get_grad_norm_single_process():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([3.0, -4.0, 0.0])
    assert mpu.get_grad_norm([p]) == 5.0 and mpu.get_grad_norm(p, math.inf) == 4.0
    tied_copy = nn.Parameter(torch.zeros(1))
    tied_copy.grad, tied_copy.shared = torch.tensor([12.0]), True
    assert mpu.clip_grad_norm([p, tied_copy], 1.0) == 5.0, "a shared (tied) copy is not counted"
    assert torch.allclose(p.grad, torch.tensor([0.6, -0.8, 0.0]))
    assert torch.allclose(tied_copy.grad, torch.tensor([2.4]))
