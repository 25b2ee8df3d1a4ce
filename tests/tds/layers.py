"""Tuple-passing test layers. Each takes and returns the tuple declared next to it; weights are seeded.

Shapes: b = micro-batch, s = sequence, D_IN = 6, H = 8, D_OUT = 3. Float tensors declared without grad are
made with .detach() so that the single-process reference computes the same function as the pipeline.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.tds.common import D_IN, D_OUT, H
from tests.tds.harness import Recorder, init_linear


def _lin(n_in: int, n_out: int, seed: int) -> nn.Linear:
    return init_linear(nn.Linear(n_in, n_out), seed)


# --- point 1: every dtype in one tuple ------------------------------------------------------------------
MIXED_DECL = ([True, True, False, False, False, False],
              ["float", "bfloat16", "int64", "int32", "bool", "float16"], [False] * 6)


class MixedIn(nn.Module):
    """x (b, D_IN) -> (h f32, hb bf16, ids i64 (b,1), cnt i32 (b,1), mask bool (b,H), h16 f16 no-grad)."""

    def __init__(self, seed: int):
        super().__init__()
        self.lin, self.lin2 = _lin(D_IN, H, seed), _lin(D_IN, H, seed + 7)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return (h, self.lin2(x).bfloat16(), (x[:, :1] > 0).long() * 3, (x > 0).sum(-1, keepdim=True).int(),
                h > 0, h.detach().half())


class MixedMid(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin, self.lin2 = _lin(H, H, seed), _lin(H, H, seed + 7)

    def forward(self, x):
        h, hb, ids, cnt, mask, h16 = x
        Recorder.events.append(tuple((t.dtype, t.requires_grad) for t in x))
        z = self.lin(h) + hb.float() * 0.5 + mask.float() * 0.1 + ids.float() * 0.01 + cnt.float() * 0.01
        h2 = torch.tanh(z + h16.float() * 0.1)
        return h2, self.lin2(h2).bfloat16(), ids + 1, cnt * 2, h2 > 0, h2.detach().half()


class MixedHead(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, D_OUT, seed)

    def forward(self, x):
        h, hb, ids, cnt, mask, h16 = x
        return self.lin(h * mask.float() + hb.float()) + ids.float() * 0.01 + cnt.float() * 0.01


# --- point 2: a grad-declared tensor unused downstream; a float tensor declared without grad -------------
UNUSED_DECL = ([True, True, False], ["float", "float", "float"], [False] * 3)


class UnusedIn(nn.Module):
    """x -> (h, e (grad declared, never used later), fmask (float, no grad))."""

    def __init__(self, seed: int):
        super().__init__()
        self.lin, self.lin2 = _lin(D_IN, H, seed), _lin(D_IN, H, seed + 7)

    def forward(self, x):
        return torch.tanh(self.lin(x)), self.lin2(x), (x[:, :1] > 0).float()


class UnusedMid(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, H, seed)

    def forward(self, x):
        h, e, fmask = x
        Recorder.events.append((fmask.requires_grad, e.requires_grad))
        return torch.tanh(self.lin(h)) * fmask, e, fmask   # e passes through untouched: its grad stays None


class UnusedHead(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, D_OUT, seed)

    def forward(self, x):
        h, e, fmask = x
        Recorder.events.append((fmask.requires_grad, e.requires_grad))
        return self.lin(h) + fmask


# --- point 3 / 5: two streams with gradients ------------------------------------------------------------
class TwoIn(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.a, self.b = _lin(D_IN, H, seed), _lin(D_IN, H, seed + 7)

    def forward(self, x):  # (b, ..., D_IN) -> 2 x (b, ..., H)
        return torch.tanh(self.a(x)), torch.tanh(self.b(x))


class TwoMid(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.a, self.b = _lin(H, H, seed), _lin(H, H, seed + 7)

    def forward(self, x):
        h1, h2 = x
        return torch.tanh(self.a(h1) + h2), torch.tanh(self.b(h2)) * h1


class TwoHead(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, D_OUT, seed)

    def forward(self, x):  # -> (b, D_OUT), averaging any sequence dims
        y = self.lin(x[0] + 2 * x[1])
        return y.reshape(y.shape[0], -1, D_OUT).mean(1)


# --- point 4: shapes change per micro-batch -------------------------------------------------------------
SEQ_DECL = ([True, False], ["float", "bool"], [True, False])


class SeqIn(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(D_IN, H, seed)

    def forward(self, x):  # x (b, s, D_IN) -> (h (b, s, H), keep bool (b, s))
        return torch.tanh(self.lin(x)), x[..., 0] > -1.0


class SeqMid(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, H, seed)

    def forward(self, x):
        h, keep = x
        Recorder.events.append(tuple(h.shape))
        return torch.tanh(self.lin(h)) * keep.unsqueeze(-1).float(), keep


class SeqHead(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, D_OUT, seed)

    def forward(self, x):
        return self.lin(x[0]).mean(1)  # (b, D_OUT)


# --- point 6: non-contiguous tensors --------------------------------------------------------------------
NONCONTIG_DECL = ([True, False], ["float", "float"], [False, False])


class NonContigIn(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(D_IN, H, seed)

    def forward(self, x):  # -> (h^T (H, b) transposed view, x[:, ::2] strided view, no grad)
        out = (torch.tanh(self.lin(x)).t(), x[:, ::2])
        assert not out[0].is_contiguous() and not out[1].is_contiguous()
        return out


class NonContigMid(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, H, seed)

    def forward(self, x):
        ht, xs = x
        return torch.tanh(self.lin(ht.t())).t(), xs[:, ::1].t().t()


class NonContigHead(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, D_OUT, seed)

    def forward(self, x):
        ht, xs = x
        return self.lin(ht.t()) + xs.sum(-1, keepdim=True)


# --- point 9: tied embedding / head ---------------------------------------------------------------------
class TiedProj(nn.Module):
    """weight (H, D_IN), bias (H): forward embeds x (b, D_IN) -> tanh(x W^T + bias) (b, H)."""

    def __init__(self, seed: int):
        super().__init__()
        lin = _lin(D_IN, H, seed)
        self.weight, self.bias = lin.weight, lin.bias

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight, self.bias))


def tied_head(module: TiedProj, h):
    """(b, H) -> (b, D_IN) with the transposed tied weight; the tied bias is unused here (None grad)."""
    return h @ module.weight


class HiddenLayer(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, H, seed)

    def forward(self, h):
        return torch.tanh(self.lin(h))


# --- point 10: item index travels with the activations --------------------------------------------------
INDEX_DECL = ([True, False], ["float", "int64"], [False, False])


class IndexIn(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(D_IN, H, seed)

    def forward(self, x):  # x = (features (b, D_IN), item index (b,) int64)
        return torch.tanh(self.lin(x[0])), x[1]


class IndexMid(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, H, seed)

    def forward(self, x):
        return torch.tanh(self.lin(x[0])), x[1]


class IndexHead(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        self.lin = _lin(H, D_OUT, seed)

    def forward(self, x):
        return self.lin(x[0]), x[1]


def index_loss(outputs, labels):
    """labels = (y (b, D_OUT), item index (b,)); the index must match the one that came from stage 0."""
    pred, idx = outputs
    y, label_idx = labels
    if not torch.equal(idx, label_idx):
        raise AssertionError(f"labels of items {label_idx.tolist()} met inputs of items {idx.tolist()}")
    return ((pred - y) ** 2).mean()


# --- point 11: count layer calls (recomputation) --------------------------------------------------------
class CountingLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, seed: int):
        super().__init__()
        self.lin = _lin(n_in, n_out, seed)

    def forward(self, h):
        Recorder.events.append(("call", torch.is_grad_enabled()))
        return torch.tanh(self.lin(h))
