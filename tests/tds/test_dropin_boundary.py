"""The inferred stage-boundary layout, in one process: stages are Boundary objects joined by an in-memory
transport that, like gloo, delivers messages in order and only into a buffer of the sent size and dtype.

What is checked: each boundary of a chain infers its own layout from what its sender sends (grad where the
tensor requires grad) and the receiver learns it from the header; gradients that come back equal one autograd
graph's; eval before training settles nothing; a received tensor may be modified in place; the cases that
cannot work undeclared are errors naming the position and the declaration to write."""
from __future__ import annotations

import logging
from collections import defaultdict, deque

import pytest
import torch

from tds.pipe import meta
from tds.pipe.boundary import FLAG, Boundary


class Wire:
    """In-order mailboxes between stage ids."""

    def __init__(self):
        self.inbox = defaultdict(deque)


class FakeP2P:
    batches_done = 0

    def __init__(self, stage_id: int, wire: Wire):
        self.stage_id, self.wire, self.headers, self.sizes = stage_id, wire, 0, []

    def send(self, t, peer, what, header=False):
        self.headers += header
        self.sizes.append(t.numel() * t.element_size())
        self.wire.inbox[(self.stage_id, peer)].append(t.detach().clone())

    def sent(self, work, generation):
        return True  # the message was copied when sent: its buffer may be written again

    def post_recv(self, buf, peer, header=False):
        return buf, peer

    def wait_recv(self, posted, what):
        buf, peer = posted
        msg = self.wire.inbox[(peer, self.stage_id)].popleft()
        assert (msg.dtype, msg.numel()) == (buf.dtype, buf.numel()), f"{what}: sent {msg.dtype} {msg.numel()}, " \
                                                                     f"posted {buf.dtype} {buf.numel()}"
        return buf.copy_(msg)

    def recv(self, t, peer, what, header=False):
        return self.wait_recv(self.post_recv(t, peer), what)


def chain(n: int, declared=None) -> list[Boundary]:
    wire = Wire()
    return [Boundary(FakeP2P(s, wire), declared, None, 1, 0, torch.device("cpu")) for s in range(n)]


def hop(src: Boundary, dst: Boundary, value, training: bool = True):
    src.send_activations(value, dst.p2p.stage_id, "send")
    return dst.recv_activations(src.p2p.stage_id, "recv", training)


def hop_back(src: Boundary, dst: Boundary, received, outputs):
    """`src` (downstream) sends the gradients of what it received; `dst` receives them for its outputs."""
    src.send_grads(received, dst.p2p.stage_id, "send_grads")
    return dst.recv_grads(outputs, src.p2p.stage_id, "recv_grads")


W0, W1, W2 = (torch.randn(4, 4, generator=torch.Generator().manual_seed(s)) for s in range(3))


def stage0(x, w0):  # (b, 4) -> (h grad, fmask float no grad, ids int64, keep bool)
    h = x @ w0  # (not tanh: the single-graph reference must allow relu_ on it too)
    return h, (x[:, :1] > 0).float(), (x[:, 0] > 0).long(), h > 0


def stage1(inp, w1):  # -> (h2 grad, ids): a different layout on the next boundary
    h, fmask, ids, keep = inp
    h = torch.relu_(h)  # in place on the received tensor
    return torch.tanh(h @ w1) * fmask + keep.float() * 0.1, ids + 1


def stage2(inp, w2):
    h2, ids = inp
    return ((h2 @ w2) ** 2).mean() + ids.float().mean() * 0


def test_chain_infers_each_boundary_and_gradients_match_one_graph():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    b0, b1, b2 = chain(3)
    w = [t.clone().requires_grad_() for t in (W0, W1, W2)]
    out0 = stage0(x, w[0])
    in1 = hop(b0, b1, out0)
    assert [t.requires_grad for t in in1] == [True, False, False, False]
    assert [t.dtype for t in in1] == [torch.float32, torch.float32, torch.int64, torch.bool]
    out1 = stage1(in1, w[1])
    in2 = hop(b1, b2, out1)
    assert [t.requires_grad for t in in2] == [True, False]
    assert [d.grad for d in b0.decls] == [True, False, False, False] and [d.grad for d in b1.decls] == [True, False]
    stage2(in2, w[2]).backward()
    g1 = hop_back(b2, b1, in2, out1)
    torch.autograd.backward([out1[0]], g1)
    g0 = hop_back(b1, b0, in1, out0)
    torch.autograd.backward([out0[0]], g0)

    ref = [t.clone().requires_grad_() for t in (W0, W1, W2)]
    stage2(stage1(stage0(x, ref[0]), ref[1]), ref[2]).backward()
    for got, want in zip(w, ref):
        assert torch.allclose(got.grad, want.grad, rtol=1e-6, atol=0), (got.grad, want.grad)


def test_eval_first_then_train_then_eval():
    """Eval hops carry no grad bits; the first training hop sends a header with them; later hops, eval included,
    are single messages."""
    b0, b1 = chain(2)
    x = torch.randn(2, 4)
    with torch.no_grad():
        got = hop(b0, b1, stage0(x, W0), training=False)
    assert not any(t.requires_grad for t in got) and b0.send_decls is None
    assert b0.p2p.sizes[0] == FLAG + 8 * meta.header_len(meta.MAX_INFERRED)  # n unknown to the receiver yet
    w0 = W0.clone().requires_grad_()
    got = hop(b0, b1, stage0(x, w0))
    assert [t.requires_grad for t in got] == [True, False, False, False] and b0.p2p.headers == 2
    with torch.no_grad():
        hop(b0, b1, stage0(x, W0), training=False)
    hop(b0, b1, stage0(x, w0))
    assert b0.p2p.headers == 2 and len(b0.p2p.sizes) == 6  # 2 header hops (2 messages each), 2 single messages


def test_in_place_on_received_tensor_and_unused_gradient_is_zeros(caplog):
    """A received tensor is not an autograd leaf: relu_ on it works. A grad position whose gradient never
    arrives travels back as zeros, with one line saying how to skip it."""
    b0, b1 = chain(2)
    a = torch.randn(2, 3, requires_grad=True)
    out = (a * 2, a * 3)  # both require grad; the receiver uses only the first
    h, unused = hop(b0, b1, out)
    torch.relu_(h).sum().backward()
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        g = hop_back(b1, b0, (h, unused), out)
    assert torch.equal(g[0], (a * 2 > 0).float()) and torch.equal(g[1], torch.zeros(2, 3))
    torch.autograd.backward(list(out), g)
    assert torch.equal(a.grad, 2 * (a * 2 > 0).float())
    assert "position 1 of the tuple it receives requires grad on the sending stage but got no gradient" in caplog.text
    assert "_input_grad[1]=False" in caplog.text


def _first_training_hop():
    b0, b1 = chain(2)
    a = torch.randn(2, 3, requires_grad=True)
    hop(b0, b1, (a * 2, (a > 0).float(), (a > 0).long()))
    return b0, b1, a


@pytest.mark.parametrize("case,pattern", [
    ("grad_later", r"position 1 requires grad but did not on the first training micro-batch.*declare "
                   r"model._input_grad = \[True, True, False\] and model._input_type = \['float', 'float', 'int'\]"),
    ("length", r"stage output has 2 tensors, the first training micro-batch sent 3"),
    ("family", r"position 2: got dtype torch.float32 shape \(2, 3\) where the first training micro-batch sent a "
               r"'int' tensor"),
    ("not_tensor", r"position 2: got NoneType"),
])
def test_what_cannot_be_inferred_is_an_error_naming_the_position(case, pattern):
    b0, _, a = _first_training_hop()
    value = {"grad_later": (a * 2, a * 5, (a > 0).long()), "length": (a * 2, a * 5),
             "family": (a * 2, (a > 0).float(), a.detach()), "not_tensor": (a * 2, (a > 0).float(), None)}[case]
    with pytest.raises(meta.PipelineLayoutError, match=r"pipeline stage 0, send: " + pattern):
        b0.send_activations(value, 1, "send")


def test_first_send_that_cannot_travel_is_named():
    b0, _ = chain(2)
    with pytest.raises(meta.PipelineLayoutError, match=r"position 1: dtype torch.complex64 cannot be sent"):
        b0.send_activations((torch.zeros(2), torch.zeros(2, dtype=torch.complex64)), 1, "send")


@pytest.mark.parametrize("after_first_hop", [False, True])
def test_undeclared_tensor_with_too_many_dims_is_named(after_first_hop):
    """A header holds meta.MAX_NDIM dims per position: a deeper tensor is an error naming its position, on the
    hop the layout is inferred from and on later hops, never a header whose shapes overrun the next position."""
    b0, b1 = chain(2)
    if after_first_hop:
        hop(b0, b1, (torch.zeros(2), torch.zeros(2)))
    sent = len(b0.p2p.sizes)
    deep = torch.zeros((2,) + (1,) * meta.MAX_NDIM)
    with pytest.raises(meta.PipelineLayoutError, match=rf"pipeline stage 0, send: position 1: {meta.MAX_NDIM + 1} "
                                                       rf"dims exceed MAX_NDIM={meta.MAX_NDIM} \(shape \(2, 1,"):
        b0.send_activations((torch.zeros(2), deep), 1, "send")
    assert len(b0.p2p.sizes) == sent  # nothing of the failed hop was sent


def test_declared_layout_stays_the_source_of_truth():
    """Declared: a tensor that requires grad at a position declared without grad gets none (as declared), and the
    header's grad bits match the declaration."""
    decls = meta.make_declarations([True, False], ["float", "float"], None)
    b0, b1 = chain(2, decls)
    a = torch.randn(2, 3, requires_grad=True)
    got = hop(b0, b1, (a * 2, a * 3))
    assert [t.requires_grad for t in got] == [True, False] and b1._recv_layout[2] == (True, False)
    with pytest.raises(meta.PipelineLayoutError, match=r"position 1: declared type 'float'.*got dtype torch.int64"):
        b0.send_activations((a * 2, (a > 0).long()), 1, "send")


def test_steady_hops_reuse_one_message_and_receives_posted_ahead_survive_a_layout_change():
    """Steady hops: the sender fills one reused first message, the receiver's tuple is built when its receive
    is posted ahead (as the executor posts it); every micro-batch still gets its own values (earlier ones not
    overwritten) and gradients, and a receive posted ahead for one layout takes a hop whose shape changed from
    its header."""
    b0, b1 = chain(2)
    w0 = W0.clone().requires_grad_()
    g = torch.Generator().manual_seed(7)
    outs, received = [], []
    b1.post_activations(0, True)
    for rows in (2, 2, 2, 3, 3):
        out = stage0(torch.randn(rows, 4, generator=g), w0)
        b0.send_activations(out, 1, "send")
        got = b1.recv_activations(0, "recv", True)
        b1.post_activations(0, True)
        assert got[0].requires_grad and got[0].grad_fn is not None  # not a leaf: in place allowed
        outs.append(out)
        received.append(got)
    assert b0.p2p.headers == 2 and len(b0._outbox) == 1  # first hop and the shape change; one message reused
    for out, got in zip(outs, received):
        assert all(torch.equal(a, b) for a, b in zip(out, got))
        (got[0] ** 2).sum().backward()
        (grad,) = hop_back(b1, b0, got, out)
        assert torch.equal(grad, 2 * out[0].detach())


def test_p2p_send_is_done_when_its_work_says_so_or_a_batch_ended():
    """A steady message may be written again once its send completed: gloo's work only says so after a wait,
    which `wait_sends` does for every send at the end of a batch."""
    from tds.pipe.p2p import P2P

    class Work:
        def __init__(self, done):
            self.done = done

        def is_completed(self):
            return self.done

    p2p = P2P(stage_id=0, timeout_s=1.0, group=None)
    assert p2p.sent(Work(True), 0) and not p2p.sent(Work(False), 0)
    p2p.wait_sends()
    assert p2p.sent(Work(False), 0) and not p2p.sent(Work(False), 1)
