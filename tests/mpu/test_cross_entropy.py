"""vocab_parallel_cross_entropy equals F.cross_entropy on the gathered logits, gradient included, in its eager and
its fused form (--cross-entropy-loss-fusion), which also equal each other bit for bit and save what the module
docstring says."""
import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from harness.dist import run_distributed

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


def _errors(tp, fused=False, chunk_elements=7 * V):
    mpu.initialize_model_parallel(tp)
    tp_rank = mpu.get_model_parallel_rank()
    errs = {}
    for scale, offset in ((1.0, 0.0), (1e3, 0.0), (30.0, 1e4)):  # ordinary, large spread, large offset
        logits, target, gl = _inputs(scale, offset)
        local = logits.chunk(tp, -1)[tp_rank].clone().requires_grad_(True)
        ref_logits = logits.clone().requires_grad_(True)
        loss = mpu.vocab_parallel_cross_entropy(local, target, fused=fused, chunk_elements=chunk_elements // tp)
        ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none").view(B, S)
        (loss * gl).sum().backward()
        (ref * gl).sum().backward()
        errs[f"loss scale={scale} offset={offset}"] = rel(loss, ref)
        errs[f"grad scale={scale} offset={offset}"] = rel(local.grad, ref_logits.grad.chunk(tp, -1)[tp_rank])
        assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    mpu.destroy_model_parallel()
    return errs


@pytest.mark.parametrize("tp,fused", [(1, False), (2, False), (4, False), (1, True), (2, True), (4, True)])
def test_matches_cross_entropy(tp, fused):
    for errs in run_distributed(_errors, tp, tp, fused):  # fused: 3 row chunks (7, 7, 1 of the 15 rows)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_equals_eager_bit_for_bit_and_saves_the_logits_in_their_dtype(dtype):
    """One process: same loss and gradient to the bit (the same operations on every row), over one or several row
    chunks; saved bytes per logit: eager 4 (the fp32 softmax), fused e (the logits) + 8 per token (m and S)."""
    logits, target, gl = _inputs(4.0, 0.0)
    logits = logits.to(dtype)
    results, saved = {}, {}
    for name, kwargs in (("eager", {}), ("fused", dict(fused=True)), ("chunked", dict(fused=True, chunk_elements=V))):
        x = logits.clone().requires_grad_(True)
        sizes = []

        def pack(t):
            if t.data_ptr() != x.data_ptr() or name != "eager":  # the eager form never keeps its input
                sizes.append(t.numel() * t.element_size())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = mpu.vocab_parallel_cross_entropy(x, target, **kwargs)
        (loss * gl).sum().backward()
        results[name], saved[name] = (loss.detach(), x.grad), sum(sizes)
    for name in ("fused", "chunked"):
        assert torch.equal(results[name][0], results["eager"][0]), name
        assert torch.equal(results[name][1], results["eager"][1]), name
    n = B * S
    per_token = 1 + 8  # the target mask (bool) and the local target (int64) in both forms
    assert saved["eager"] == n * V * 4 + n * per_token
    e = torch.finfo(dtype).bits // 8
    assert saved["fused"] == saved["chunked"] == n * V * e + n * (8 + per_token)
