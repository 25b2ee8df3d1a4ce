"""vocab_parallel_cross_entropy equals F.cross_entropy on the gathered logits, gradient included."""
import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from tests.dist import run_distributed

B, S, V, TOL = 3, 5, 32, 1e-5


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _inputs(scale, offset):
    """Logits (b, s, V) with entries of size `scale` around `offset`, targets on every rank's slice."""
    torch.manual_seed(11)
    logits = torch.randn(B, S, V) * scale + offset
    target = torch.randint(0, V, (B, S))
    target[0, :4] = torch.tensor([0, V // 4, V // 2, V - 1])  # first/last ids of the slices
    return logits, target, torch.randn(B, S)


def _errors(tp):
    mpu.initialize_model_parallel(tp)
    tp_rank = mpu.get_model_parallel_rank()
    errs = {}
    for scale, offset in ((1.0, 0.0), (1e3, 0.0), (30.0, 1e4)):  # ordinary, large spread, large offset
        logits, target, gl = _inputs(scale, offset)
        local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        ref_logits = logits.clone().requires_grad_(True)
        loss = mpu.vocab_parallel_cross_entropy(local, target)
        ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none").view(B, S)
        (loss * gl).sum().backward()
        (ref * gl).sum().backward()
        errs[f"loss scale={scale} offset={offset}"] = rel(loss, ref)
        errs[f"grad scale={scale} offset={offset}"] = rel(local.grad, ref_logits.grad.chunk(tp, -1)[tp_rank])
        assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    mpu.destroy_model_parallel()
    return errs


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_cross_entropy(tp):
    for errs in run_distributed(_errors, tp, tp):
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"relative errors above {TOL}: {bad}"


def test_half_precision_logits_give_fp32_loss_and_input_dtype_grad():
    logits, target, _ = _inputs(4.0, 0.0)
    half = logits.bfloat16().requires_grad_(True)
    loss = mpu.vocab_parallel_cross_entropy(half, target)
    ref = F.cross_entropy(half.detach().float().view(-1, V), target.view(-1), reduction="none").view(B, S)
    assert loss.dtype == torch.float32 and rel(loss, ref) < TOL
    loss.sum().backward()
    assert half.grad.dtype == torch.bfloat16
    assert torch.equal(half.detach(), logits.bfloat16()), "input logits must not be modified"
