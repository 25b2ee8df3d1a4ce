"""Tensor-parallel layers against dense single-process references (same seed), at TP 1, 2 and 4.

Each rank builds the TP=t layer and, with the parallel state switched off, the TP=1 layer from the same seed;
outputs and gradients of inputs, weights and biases must agree to relative error < 1e-5.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.mpu.utils import divide, ensure_divisibility
from harness.dist import run_distributed

SEED, B, S = 1234, 2, 3
TOL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _dense(cls, *args, **kwargs):
    """The TP=1 layer from SEED, built with the parallel state switched off."""
    state = mpu.get_parallel_state()
    mpu.set_parallel_state(None)
    try:
        torch.manual_seed(SEED)
        return cls(*args, **kwargs)
    finally:
        mpu.set_parallel_state(state)


def _parallel(cls, *args, **kwargs):
    torch.manual_seed(SEED)
    return cls(*args, **kwargs)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _chunk(t, dim):
    return t.chunk(mpu.get_model_parallel_world_size(), dim)[mpu.get_model_parallel_rank()]


def _random_bias(layer, ref):
    bias = torch.randn_like(ref.bias)
    with torch.no_grad():
        ref.bias.copy_(bias)
    mpu.set_full_weight(layer.bias, bias)


def _check_column(gather_output, errs):
    layer = _parallel(mpu.ColumnParallelLinear, 8, 16, gather_output=gather_output)
    ref = _dense(mpu.ColumnParallelLinear, 8, 16)
    assert torch.equal(mpu.full_weight(layer.weight), ref.weight.detach())
    assert layer.weight.shape == (16 // mpu.get_model_parallel_world_size(), 8)
    _random_bias(layer, ref)
    torch.manual_seed(7)
    x, gy = torch.randn(B, S, 8), torch.randn(B, S, 16)
    xp, xr = _leaf(x), _leaf(x)
    y, _ = layer(xp)
    yr = F.linear(xr, ref.weight, ref.bias)
    gy_local = gy if gather_output else _chunk(gy, -1)
    (y * gy_local).sum().backward()
    (yr * gy).sum().backward()
    key = f"column(gather_output={gather_output})"
    errs[key + " out"] = rel(y, yr if gather_output else _chunk(yr, -1))
    errs[key + " dx"] = rel(xp.grad, xr.grad)
    errs[key + " dW"] = rel(layer.weight.grad, _chunk(ref.weight.grad, 0))
    errs[key + " db"] = rel(layer.bias.grad, _chunk(ref.bias.grad, 0))


def _check_row(input_is_parallel, errs):
    layer = _parallel(mpu.RowParallelLinear, 16, 8, input_is_parallel=input_is_parallel)
    ref = _dense(mpu.RowParallelLinear, 16, 8)
    assert torch.equal(mpu.full_weight(layer.weight), ref.weight.detach())
    assert layer.weight.shape == (8, 16 // mpu.get_model_parallel_world_size())
    _random_bias(layer, ref)
    torch.manual_seed(7)
    x, gy = torch.randn(B, S, 16), torch.randn(B, S, 8)
    xp, xr = _leaf(_chunk(x, -1) if input_is_parallel else x), _leaf(x)
    y, _ = layer(xp)
    yr = F.linear(xr, ref.weight, ref.bias)
    (y * gy).sum().backward()
    (yr * gy).sum().backward()
    key = f"row(input_is_parallel={input_is_parallel})"
    errs[key + " out"] = rel(y, yr)
    errs[key + " dx"] = rel(xp.grad, _chunk(xr.grad, -1) if input_is_parallel else xr.grad)
    errs[key + " dW"] = rel(layer.weight.grad, _chunk(ref.weight.grad, 1))
    errs[key + " db"] = rel(layer.bias.grad, ref.bias.grad)


def _check_embedding_and_logits(errs):
    vocab, hidden = 16, 8
    emb = _parallel(mpu.VocabParallelEmbedding, vocab, hidden)
    ref = _dense(mpu.VocabParallelEmbedding, vocab, hidden)
    assert torch.equal(mpu.full_weight(emb.weight), ref.weight.detach())
    torch.manual_seed(7)
    ids = torch.randint(0, vocab, (B, S))
    gy = torch.randn(B, S, hidden)
    (emb(ids) * gy).sum().backward()
    wr = _leaf(ref.weight)
    yr = F.embedding(ids, wr)
    (yr * gy).sum().backward()
    errs["embedding out"] = rel(emb(ids), yr)
    errs["embedding dW"] = rel(emb.weight.grad, _chunk(wr.grad, 0))
    for parallel_output in (True, False):
        h, gl = torch.randn(B, S, hidden), torch.randn(B, S, vocab)
        hp, hr, wp, wr = _leaf(h), _leaf(h), _leaf(emb.weight), _leaf(ref.weight)
        logits = mpu.parallel_lm_logits(hp, wp, parallel_output)
        lr = F.linear(hr, wr)
        gl_local = _chunk(gl, -1) if parallel_output else gl
        (logits * gl_local).sum().backward()
        (lr * gl).sum().backward()
        key = f"lm_logits(parallel_output={parallel_output})"
        errs[key + " out"] = rel(logits, _chunk(lr, -1) if parallel_output else lr)
        errs[key + " dh"] = rel(hp.grad, hr.grad)
        errs[key + " dW"] = rel(wp.grad, _chunk(wr.grad, 0))


def _check_stride_and_skip_bias():
    """Fused QKV (stride 3): rank r keeps rows [j*h + r*h/p, j*h + (r+1)*h/p) for j = 0, 1, 2."""
    hidden, tp, tp_rank = 8, mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()
    layer = _parallel(mpu.ColumnParallelLinear, hidden, 3 * hidden, gather_output=False, stride=3)
    master = _dense(mpu.ColumnParallelLinear, hidden, 3 * hidden).weight.detach()
    n = hidden // tp
    rows = [j * hidden + tp_rank * n + i for j in range(3) for i in range(n)]
    assert torch.equal(layer.weight.detach(), master[rows])
    assert torch.equal(mpu.full_weight(layer.weight), master)
    assert layer.weight.partition_stride == 3 and layer.weight.partition_dim == 0
    col = _parallel(mpu.ColumnParallelLinear, hidden, hidden, skip_bias_add=True)
    x = torch.randn(B, S, hidden)
    out, bias = col(x)
    assert bias is col.bias and torch.allclose(out, F.linear(x, mpu.full_weight(col.weight)), rtol=TOL, atol=0)
    row = _parallel(mpu.RowParallelLinear, hidden, hidden, skip_bias_add=True)
    assert row(x)[1] is row.bias and not getattr(row.bias, "tensor_model_parallel", False)
    twin = copy.deepcopy(col)  # the process group is shared, the parameters copied
    assert twin.tp_group is col.tp_group and twin.weight is not col.weight
    assert torch.equal(twin(x)[0], out) and twin.weight.partition_dim == 0


def _errors_of(cls, *args):
    try:
        cls(*args)
    except ValueError as e:
        return str(e)
    return None


def _all_checks(tp):
    mpu.initialize_model_parallel(tp)
    errs = {}
    for flag in (True, False):
        _check_column(flag, errs)
        _check_row(flag, errs)
    _check_embedding_and_logits(errs)
    _check_stride_and_skip_bias()
    messages = [_errors_of(mpu.VocabParallelEmbedding, 10 * tp + 1, 8),
                _errors_of(mpu.ColumnParallelLinear, 8, 4 * tp + 1),
                _errors_of(mpu.RowParallelLinear, 4 * tp + 1, 8)]
    mpu.destroy_model_parallel()
    return errs, messages


@pytest.mark.parametrize("world,tp", [(1, 1), (4, 2), (4, 4)])
def test_layers_match_dense_reference(world, tp):
    results = run_distributed(_all_checks, world, tp)
    for errs, messages in results:
        bad = {k: v for k, v in errs.items() if not v < TOL}
        assert not bad, f"relative errors above {TOL}: {bad}"
        if tp > 1:
            assert messages[0] == (f"vocab size {10 * tp + 1} is not divisible by tensor-model-parallel size {tp}; "
                                   f"pad the vocabulary to a multiple of the tensor-model-parallel size")
            assert messages[1].startswith(f"ColumnParallelLinear output size {4 * tp + 1} is not divisible by "
                                          f"tensor-model-parallel size x stride = {tp} x 1 = {tp}")
            assert messages[2].startswith(f"RowParallelLinear input size {4 * tp + 1} is not divisible")


def test_single_process_without_distributed():
    """Before initialisation the layers are plain dense layers."""
    torch.manual_seed(SEED)
    col = mpu.ColumnParallelLinear(8, 6)
    x = torch.randn(2, 8)
    assert torch.equal(col(x)[0], F.linear(x, col.weight, col.bias))
    assert torch.equal(col.bias.detach(), torch.zeros(6))


def test_divisibility_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"^numerator 7 is not divisible by denominator 2$"):
        divide(7, 2)
    with pytest.raises(ValueError, match=r"^number of attention heads 6 is not divisible by "
                                         r"tensor-model-parallel size 4$"):
        ensure_divisibility(6, 4, "number of attention heads")
    assert divide(8, 2) == 4
