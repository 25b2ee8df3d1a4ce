"""Moving the declared tuple across one stage boundary: activations forward, gradients backward.

Both directions derive their tensor lists from the same declaration (`meta.TensorDecl` per position):

    forward : every position travels, with its dtype and shape (see "Shape exchange")
    backward: only positions with grad=True travel, in position order; a None gradient travels as zeros

Shape exchange. Sender and receiver both remember the (dtype, shape) list of the last activation hop, so
both predict that the next hop looks the same. Every activation hop starts with one message of
F = FLAG + max(S, H) bytes, S = packed payload size of the predicted layout, H = header size:

    [flag=0 | payload | padding]   the layout is as predicted: the whole hop is this one message
    [flag=1 | header  | padding]   the layout changed (or first hop): a second message with the payload
                                   follows, and both sides now predict the new layout

So shapes and dtypes may change between any two micro-batches with no flag from the user, and a steady
run pays FLAG bytes per hop and no extra message. Gradient hops need no exchange: the receiver knows the
shapes of the outputs it sent.

Partitioned positions (tp = tensor-parallel size > 1): the sender sends only its chunk
flatten(t)[tp_rank*c:(tp_rank+1)*c], c = ceil(numel/tp), to the peer with the same tp_rank; the receiver
all-gathers the tp chunks over the tensor-parallel group and drops the padding. Gradients of partitioned
positions are split and gathered the same way. This assumes, as Megatron does, that a partitioned tensor
and its gradient are replicated across the tensor-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import meta
from .p2p import P2P

FLAG = meta.ALIGN  # bytes in front of every first activation message; the first int64 is the flag


@dataclass
class Boundary:
    p2p: P2P
    decls: list[meta.TensorDecl]
    tp_group: object
    tp_size: int
    tp_rank: int
    device: torch.device
    _sent_layout: tuple | None = field(default=None, repr=False)   # (specs, was_tuple) last sent
    _recv_layout: tuple | None = field(default=None, repr=False)   # (specs, was_tuple) last received
    _next_first: tuple | None = field(default=None, repr=False)    # receive posted ahead of time

    def _split(self, decl: meta.TensorDecl, t: torch.Tensor) -> torch.Tensor:
        if decl.partitioned and self.tp_size > 1:
            return meta.split_for_rank(t, self.tp_size, self.tp_rank)
        return t.reshape(-1)

    def _wire(self, specs: list) -> list:
        """[(dtype, numel on the wire)] for [(dtype, shape)] per position."""
        out = []
        for d, (dt, shape) in zip(self.decls, specs):
            numel = _numel(shape)
            out.append((dt, meta.chunk_numel(numel, self.tp_size) if d.partitioned and self.tp_size > 1 else numel))
        return out

    def _first_size(self, layout: tuple | None) -> int:
        """Bytes F of the first message of an activation hop, given the predicted layout."""
        predicted = meta.packed_size(self._wire(layout[0])) if layout is not None else 0
        return FLAG + max(predicted, 8 * meta.header_len(len(self.decls)))

    def _assemble(self, decl: meta.TensorDecl, flat: torch.Tensor, shape: tuple) -> torch.Tensor:
        """Full tensor of `shape` from this rank's wire part (all-gather when partitioned)."""
        if decl.partitioned and self.tp_size > 1:
            chunks = [torch.empty_like(flat) for _ in range(self.tp_size)]
            dist.all_gather(chunks, flat.contiguous(), group=self.tp_group)
            flat = torch.cat(chunks)[:_numel(shape)]
        return flat.view(shape)

    # --- forward direction ---------------------------------------------------------------------------
    def send_activations(self, value, peer: int, what: str) -> None:
        """Check `value` against the declaration, then send it to `peer` (one message if the layout holds)."""
        tensors, was_tuple = meta.as_tuple(value)
        try:
            meta.check_layout(tensors, self.decls)
        except meta.PipelineLayoutError as e:
            raise meta.PipelineLayoutError(f"pipeline stage {self.p2p.stage_id}, {what}: {e}") from None
        layout = ([(t.dtype, tuple(t.shape)) for t in tensors], was_tuple)
        parts = [self._split(d, t.detach()) for d, t in zip(self.decls, tensors)]
        size = self._first_size(self._sent_layout)
        if layout == self._sent_layout:
            msg = meta.pack(parts, prefix=FLAG, total=size)
            msg[:8].view(torch.int64).fill_(0)
            self.p2p.send(msg, peer, what)
            return
        header = meta.encode_header(tensors, was_tuple).view(torch.uint8)
        msg = torch.zeros(size, dtype=torch.uint8, device=self.device)
        msg[:8].view(torch.int64).fill_(1)
        msg[FLAG:FLAG + header.numel()].copy_(header)
        self.p2p.send(msg, peer, what, header=True)
        self.p2p.send(meta.pack(parts), peer, what)
        self._sent_layout = layout

    def discard_posted(self) -> None:
        """Forget the receive posted ahead (after a failed batch; gloo cannot cancel it)."""
        self._next_first = None

    def _post_first(self, peer: int) -> tuple:
        buf = torch.empty(self._first_size(self._recv_layout), dtype=torch.uint8, device=self.device)
        return self.p2p.post_recv(buf, peer)

    def recv_activations(self, peer: int, what: str, training: bool, more: bool = False):
        """Receive one tuple; positions declared with grad require grad when `training`.

        With `more=True` (another activation follows in this batch) the next hop's first receive is
        posted right away, so its transfer does not wait for this stage to reach the next receive.
        """
        posted, self._next_first = self._next_first or self._post_first(peer), None
        first = self.p2p.wait_recv(posted, what)
        if first[:8].view(torch.int64).item() == 0:
            specs, was_tuple = self._recv_layout
            flats = meta.unpack(first[FLAG:], self._wire(specs))
        else:
            hlen = 8 * meta.header_len(len(self.decls))
            specs, was_tuple = meta.decode_header(first[FLAG:FLAG + hlen].view(torch.int64))
            self._recv_layout = (specs, was_tuple)
            wire = self._wire(specs)
            payload = torch.empty(meta.packed_size(wire), dtype=torch.uint8, device=self.device)
            flats = meta.unpack(self.p2p.recv(payload, peer, what), wire)
        out = []
        for d, (dt, shape), flat in zip(self.decls, specs, flats):
            t = self._assemble(d, flat, shape)
            out.append(t.requires_grad_() if training and d.grad else t)
        if more:
            self._next_first = self._post_first(peer)
        return tuple(out) if was_tuple else out[0]

    # --- backward direction --------------------------------------------------------------------------
    def send_grads(self, inputs, peer: int, what: str) -> None:
        """Send d(loss)/d(input) for each grad-declared position of `inputs` (zeros where it is None)."""
        tensors, _ = meta.as_tuple(inputs)
        parts = []
        for d, t in zip(self.decls, tensors):
            if d.grad:
                g = t.grad if t.grad is not None else torch.zeros_like(t)
                parts.append(self._split(d, g))
        if parts:  # one message: the flat gradient itself when there is one, else all packed into bytes
            self.p2p.send(parts[0].reshape(-1) if len(parts) == 1 else meta.pack(parts), peer, what)

    def recv_grads(self, outputs, peer: int, what: str) -> list:
        """Gradients for the grad-declared positions of `outputs`, in position order."""
        tensors, _ = meta.as_tuple(outputs)
        pos = [(d, t) for d, t in zip(self.decls, tensors) if d.grad]
        if not pos:
            return []
        wire = [(t.dtype, meta.chunk_numel(t.numel(), self.tp_size) if d.partitioned and self.tp_size > 1
                 else t.numel()) for d, t in pos]
        if len(wire) == 1:
            flats = [self.p2p.recv(torch.empty(wire[0][1], dtype=wire[0][0], device=self.device), peer, what)]
        else:
            payload = torch.empty(meta.packed_size(wire), dtype=torch.uint8, device=self.device)
            flats = meta.unpack(self.p2p.recv(payload, peer, what), wire)
        return [self._assemble(d, f, tuple(t.shape)) for (d, t), f in zip(pos, flats)]


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
