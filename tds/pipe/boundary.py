"""Moving the tuple across one stage boundary: activations forward, gradients backward.

Both directions derive their tensor lists from one layout (`meta.TensorDecl` per position):

    forward : every position travels, with its dtype and shape (see "Shape exchange")
    backward: only positions with grad=True travel, in position order; a None gradient travels as zeros

Where the layout comes from. Declared (`model._input_grad/_input_type/_input_pipe_partitioned`): the same
lists on both sides of every boundary, checked against every tuple sent. Undeclared: the sending stage infers
its outgoing layout from the tuple of its first training micro-batch (requires_grad -> grad; never
partitioned), logs it once with the declaration that would fix it, and keeps it for the run; the header tells
the receiver which positions carry a gradient. So in a chain each boundary has its own layout (stage 1 learns
stage 0's from the header and infers its own from what it sends to stage 2). Eval hops before the first
training hop carry no grad bits (nothing requires grad under no_grad, and nothing is sent back), so the
layout is settled by the first training hop, whatever ran before it. Later hops are checked against it: a
position that starts requiring grad, a changed dtype family or tuple length is an error naming the position.

Shape exchange. Sender and receiver both remember the (dtype, shape) list and grad bits of the last activation
hop, so both predict that the next hop looks the same. Every activation hop starts with one message of
F = FLAG + max(S, H) bytes, S = packed payload size of the predicted layout, H = header size:

    [flag=0 | payload | padding]   the layout is as predicted: the whole hop is this one message
    [flag=1 | header  | padding]   the layout changed (or first hop): a second message with the payload
                                   follows, and both sides now predict the new layout

So shapes and dtypes may change between any two micro-batches with no flag from the user, and a steady
run pays FLAG bytes per hop and no extra message.

The steady state costs a stage little Python where it matters: between a message's arrival and the work that
waits for it. The sender writes each tensor once into a first message built for the layout (flag and padding
already zero), reused once the transport has sent it (`P2P.sent`). The receiver, when it posts a first
message's receive (`post_activations`: the executor posts the next one after the stage's next send or before
its next wait, not on a hop's arrival), also builds what the message becomes if the layout holds: the views
shaped as the tensors, passed through `_Arrival` when training; on arrival it reads the flag and hands them
over.

Before the first hop an undeclared receiver does not know the tuple length n, so that one message is sized for
meta.MAX_INFERRED positions. Gradient hops need no exchange: the receiver knows the shapes of the outputs it
sent.

Received tensors that carry a gradient reach the stage as outputs of `_Arrival`, an identity whose backward
keeps d(loss)/d(input) for `send_grads`: they are not autograd leaves, so the stage's first layer may modify
them in place (`nn.ReLU(inplace=True)`), as with DeepSpeed, which clones every received tensor instead.

Partitioned positions (tp = tensor-parallel size > 1, declared only): the sender sends only its chunk
flatten(t)[tp_rank*c:(tp_rank+1)*c], c = ceil(numel/tp), to the peer with the same tp_rank; the receiver
all-gathers the tp chunks over the tensor-parallel group and drops the padding. Gradients of partitioned
positions are split and gathered the same way. This assumes, as Megatron does, that a partitioned tensor
and its gradient are replicated across the tensor-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.utils import logger

from . import meta
from .p2p import P2P

FLAG = meta.ALIGN  # bytes in front of every first activation message; the first int64 is the flag


class _Carrier:
    """Received grad-carrying tensors on their way through `_Arrival`, then the gradients that reached them."""

    def __init__(self, positions: list[int], tensors: list[torch.Tensor], chunked: list[bool]):
        self.positions, self.tensors, self.chunked = positions, tensors, chunked
        self.like = [(t.shape, t.dtype) for t in tensors]
        self.grads: list | None = None


class _Arrival(torch.autograd.Function):
    """Identity from received buffers to non-leaf stage inputs; backward keeps their gradients in the carrier."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, carrier: _Carrier):
        ctx.carrier = carrier
        ctx.set_materialize_grads(False)  # a gradient that never arrived stays None
        tensors, carrier.tensors = carrier.tensors, None
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.carrier.grads = list(grads)
        return None, None


@dataclass
class _Inbound:
    """A first-message receive posted ahead: P2P.post_recv's handle, the flag's view, the mode it was posted
    in and, where the layout was predicted, the tuple the message becomes if the flag says it held."""
    posted: tuple
    flag: torch.Tensor
    training: bool
    value: object = None


@dataclass
class Boundary:
    p2p: P2P
    declared: list[meta.TensorDecl] | None   # the model's declaration, or None: inferred per boundary
    tp_group: object
    tp_size: int
    tp_rank: int
    device: torch.device
    log_layout: bool = True                  # this rank logs its inferred layout (one rank per stage)
    send_decls: list[meta.TensorDecl] | None = None  # undeclared: the outgoing layout inferred when training
    _sent_layout: tuple | None = field(default=None, repr=False)   # (specs, was_tuple, grads) last sent
    _recv_layout: tuple | None = field(default=None, repr=False)   # (specs, was_tuple, grads) last received
    _next_first: _Inbound | None = field(default=None, repr=False)  # receive posted ahead of time
    _outbox: list = field(default_factory=list, repr=False)  # steady-state messages: [(buf, views, work, gen)]
    _told_unused: bool = field(default=False, repr=False)
    # derived from the layouts above when they change (not per hop): first-message bytes, wire, partitioning
    _sent_size: int = field(default=0, repr=False)
    _recv_size: int = field(default=0, repr=False)
    _recv_wire: list = field(default_factory=list, repr=False)
    _recv_parts: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        # per declared position: whether it travels as this rank's chunk (declared partitioned and tp > 1)
        self._declared_chunked = [d.partitioned and self.tp_size > 1 for d in self.declared or []]

    @property
    def decls(self) -> list[meta.TensorDecl]:
        """The layout of the tuple this stage sends (what its backward takes gradients for)."""
        return self.declared if self.declared is not None else self.send_decls or []

    def discard_posted(self) -> None:
        """Forget a receive posted ahead (after a failed batch)."""
        self._next_first = None

    def _chunked_positions(self, n: int) -> list[bool]:
        """Per position of an n-tuple: whether it travels as this rank's chunk (never when inferred or tp = 1)."""
        return self._declared_chunked if self.declared is not None else [False] * n

    def _split(self, chunked: bool, t: torch.Tensor) -> torch.Tensor:
        """What of `t` this rank puts on the wire: its chunk (`chunked`) or all of it, flat."""
        return meta.split_for_rank(t, self.tp_size, self.tp_rank) if chunked else t.reshape(-1)

    def _wire(self, specs: list) -> list:
        """[(dtype, numel on the wire)] for [(dtype, shape)] per position."""
        out = []
        for part, (dt, shape) in zip(self._chunked_positions(len(specs)), specs):
            numel = _numel(shape)
            out.append((dt, meta.chunk_numel(numel, self.tp_size) if part else numel))
        return out

    def _first_size(self, layout: tuple | None) -> int:
        """Bytes F of the first message of an activation hop, given the predicted layout."""
        if layout is None:
            n = len(self.declared) if self.declared is not None else meta.MAX_INFERRED
            return FLAG + 8 * meta.header_len(n)
        return FLAG + max(meta.packed_size(self._wire(layout[0])), 8 * meta.header_len(len(layout[0])))

    def _assemble(self, chunked: bool, flat: torch.Tensor, shape: tuple) -> torch.Tensor:
        """Full tensor of `shape` from this rank's wire part (all-gathered over the tp group when `chunked`)."""
        if chunked:
            chunks = [torch.empty_like(flat) for _ in range(self.tp_size)]
            dist.all_gather(chunks, flat.contiguous(), group=self.tp_group)
            flat = torch.cat(chunks)[:_numel(shape)]
        return flat.view(shape)

    # --- the outgoing layout -----------------------------------------------------------------------------
    def _outgoing(self, tensors: tuple) -> tuple[list[meta.TensorDecl], bool]:
        """(layout of this hop, whether its grad bits are settled): declared, inferred, or provisional in eval."""
        if self.declared is not None:
            meta.check_layout(tensors, self.declared)
            return self.declared, True
        if self.send_decls is not None:
            self._check_inferred(tensors)
            return self.send_decls, True
        decls = meta.infer_declarations(tensors)
        if self._sent_layout is not None and len(decls) != len(self._sent_layout[0]):
            raise meta.PipelineLayoutError(f"stage output has {len(decls)} tensors, the previous one had "
                                           f"{len(self._sent_layout[0])}; keep the tuple's length")
        if not torch.is_grad_enabled():
            return decls, False  # eval before any training hop: requires_grad says nothing yet
        self.send_decls = decls
        if self.log_layout:
            shown = ", ".join(f"{str(t.dtype)[6:]} {tuple(t.shape)}{' grad' if d.grad else ''}"
                              for d, t in zip(decls, tensors))
            logger.warning(f"pipeline stage {self.p2p.stage_id}: inferred the layout of the tuple it sends from its "
                           f"first training micro-batch ({shown}); to declare it: {meta.describe(decls)}")
        return decls, True

    def _check_inferred(self, tensors: tuple) -> None:
        decls = self.send_decls
        inferred = f"(layout inferred from the first training micro-batch: {meta.describe(decls)})"
        if len(tensors) != len(decls):
            raise meta.PipelineLayoutError(f"stage output has {len(tensors)} tensors, the first training micro-batch "
                                           f"sent {len(decls)} {inferred}; keep the tuple's length")
        for pos, (t, d) in enumerate(zip(tensors, decls)):
            if not torch.is_tensor(t) or meta.family(t.dtype) != d.type:
                got = f"dtype {t.dtype} shape {tuple(t.shape)}" if torch.is_tensor(t) else type(t).__name__
                raise meta.PipelineLayoutError(f"position {pos}: got {got} where the first training micro-batch "
                                               f"sent a {d.type!r} tensor {inferred}; keep each position's dtype "
                                               f"family")
            meta.check_ndim(pos, t)
            if t.requires_grad and not d.grad and torch.is_grad_enabled():
                grads = [e.grad or i == pos for i, e in enumerate(decls)]
                raise meta.PipelineLayoutError(
                    f"position {pos} requires grad but did not on the first training micro-batch, from which the "
                    f"layout was inferred, so its gradient would be lost {inferred}; declare "
                    f"model._input_grad = {grads} and model._input_type = {[e.type for e in decls]} before "
                    f"tds.initialize")

    # --- forward direction ---------------------------------------------------------------------------
    def send_activations(self, value, peer: int, what: object) -> None:
        """Check `value` against the layout, then send it to `peer` (one message if the layout holds)."""
        tensors, was_tuple = meta.as_tuple(value)
        if self._as_last_sent(tensors, was_tuple):  # the steady state: checked when the layout was set
            msg, views = self._steady_message()
            chunks = self._chunked_positions(len(tensors))
            for view, chunked, t in zip(views, chunks, tensors):  # (a chunk's view is flat)
                view.copy_(self._split(True, t.detach()) if chunked else t.detach())
            generation = self.p2p.batches_done
            self._outbox.append((msg, views, self.p2p.send(msg, peer, what), generation))
            return
        try:
            decls, settled = self._outgoing(tensors)
        except meta.PipelineLayoutError as e:
            raise meta.PipelineLayoutError(f"pipeline stage {self.p2p.stage_id}, {what}: {e}") from None
        grads = tuple(d.grad for d in decls) if settled else None
        layout = ([(t.dtype, tuple(t.shape)) for t in tensors], was_tuple, grads)
        parts = [self._split(chunked, t.detach()) for chunked, t in zip(self._chunked_positions(len(tensors)), tensors)]
        size = self._first_size(self._sent_layout)
        if layout == self._sent_layout:
            msg = meta.pack(parts, prefix=FLAG, total=size)
            msg[:8].view(torch.int64).fill_(0)
            self.p2p.send(msg, peer, what)
            return
        header = meta.encode_header(tensors, was_tuple, grads).view(torch.uint8)
        msg = torch.zeros(size, dtype=torch.uint8, device=self.device)
        msg[:8].view(torch.int64).fill_(1)
        msg[FLAG:FLAG + header.numel()].copy_(header)
        self.p2p.send(msg, peer, what, header=True)
        self.p2p.send(meta.pack(parts), peer, what)
        self._sent_layout, self._sent_size = layout, self._first_size(layout)
        self._outbox = []

    def _steady_message(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A first message [flag=0 | payload | padding] of the last sent layout and its payload views (shaped as
        the tensors, or flat chunks where partitioned), to be filled: the oldest one sent before, once the
        transport has sent it, else a new one. So a steady hop writes each tensor once into a ready buffer."""
        if self._outbox and self.p2p.sent(self._outbox[0][2], self._outbox[0][3]):
            msg, views, _, _ = self._outbox.pop(0)
            return msg, views
        specs = self._sent_layout[0]
        msg = torch.zeros(self._sent_size, dtype=torch.uint8, device=self.device)  # flag 0, zero padding
        flats = meta.unpack(msg[FLAG:], self._wire(specs))
        chunked = self._chunked_positions(len(specs))
        return msg, [f if part else f.view(shape) for f, part, (_, shape) in zip(flats, chunked, specs)]

    def _as_last_sent(self, tensors: tuple, was_tuple: bool) -> bool:
        """Whether `tensors` has the dtypes and shapes of the last hop, whose grad bits were settled, and (when
        the layout was inferred) no position requires grad that did not: then every check passed already."""
        last = self._sent_layout
        if last is None or last[2] is None or last[1] != was_tuple or len(last[0]) != len(tensors):
            return False
        inferred = self.declared is None and torch.is_grad_enabled()
        for t, (dtype, shape), d in zip(tensors, last[0], self.decls):
            if not torch.is_tensor(t) or t.dtype != dtype or t.shape != shape or (inferred and t.requires_grad
                                                                                and not d.grad):
                return False
        return True

    def post_activations(self, peer: int, training: bool) -> None:
        """Post the next activation receive ahead of its instruction, so its transfer does not wait for this
        stage to reach the receive; `training` as `recv_activations`' (the same batch's)."""
        if self._next_first is None:
            self._next_first = self._post_first(peer, training)

    def _post_first(self, peer: int, training: bool) -> _Inbound:
        """Post a first message's receive; where the layout is predicted (and nothing partitioned has to be
        gathered on arrival) also build the tuple it will become, so that arrival costs one flag read."""
        layout = self._recv_layout
        size = self._recv_size if layout is not None else self._first_size(None)
        buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        posted = _Inbound(self.p2p.post_recv(buf, peer), buf[:8].view(torch.int64), training)
        if layout is not None and not any(self._recv_parts):
            posted.value = self._received(meta.unpack(buf[FLAG:], self._recv_wire), training)
        return posted

    def recv_activations(self, peer: int, what: object, training: bool):
        """Receive one tuple (posted ahead by `post_activations`, or now); positions with grad require grad when
        `training`."""
        posted, self._next_first = self._next_first or self._post_first(peer, training), None
        first = self.p2p.wait_recv(posted.posted, what)
        if posted.flag.item() == 0:
            if posted.value is not None and posted.training == training:  # the steady state
                return posted.value
            flats = meta.unpack(first[FLAG:], self._recv_wire)
        else:
            n = int(first[FLAG + 8:FLAG + 16].view(torch.int64).item())
            specs, was_tuple, grads = meta.decode_header(first[FLAG:FLAG + 8 * meta.header_len(n)].view(torch.int64))
            self._recv_layout = (specs, was_tuple, grads)
            self._recv_wire, self._recv_parts = self._wire(specs), self._chunked_positions(len(specs))
            self._recv_size = self._first_size(self._recv_layout)
            payload = torch.empty(meta.packed_size(self._recv_wire), dtype=torch.uint8, device=self.device)
            flats = meta.unpack(self.p2p.recv(payload, peer, what), self._recv_wire)
        return self._received(flats, training)

    def _received(self, flats: list[torch.Tensor], training: bool):
        """The tuple (or tensor) that the wire parts `flats` of the received layout become: gathered where
        chunked, shaped, and the grad positions passed through `_Arrival` when `training`."""
        specs, was_tuple, grads = self._recv_layout
        parts = self._recv_parts
        out = [self._assemble(p, flat, shape) for p, (_, shape), flat in zip(parts, specs, flats)]
        if training:
            self._arrive(out, self._incoming_grads(specs, grads), parts)
        return tuple(out) if was_tuple else out[0]

    def _incoming_grads(self, specs: list, grads: tuple | None) -> list[bool]:
        if self.declared is not None:
            return [d.grad for d in self.declared]
        return list(grads) if grads is not None else [False] * len(specs)

    def _arrive(self, out: list, grads: list[bool], parts: list[bool]) -> None:
        """Route the grad-carrying tensors of `out` (in place in the list) through one `_Arrival`."""
        positions = [i for i, g in enumerate(grads) if g]
        if not positions:
            return
        carrier = _Carrier(positions, [out[i].detach() for i in positions], [parts[i] for i in positions])
        for i, t in zip(positions, _Arrival.apply(self._anchor, carrier)):
            t._tds_carrier = carrier
            out[i] = t

    # --- backward direction --------------------------------------------------------------------------
    def send_grads(self, inputs, peer: int, what: object) -> None:
        """Send d(loss)/d(input) for each grad position of `inputs` (zeros where none arrived)."""
        tensors, _ = meta.as_tuple(inputs)
        carrier = next((t._tds_carrier for t in tensors if hasattr(t, "_tds_carrier")), None)
        if carrier is None:
            return
        grads = carrier.grads or [None] * len(carrier.positions)
        parts = []
        for pos, g, (shape, dtype), part in zip(carrier.positions, grads, carrier.like, carrier.chunked):
            if g is None:
                self._tell_unused(pos)
                g = torch.zeros(shape, dtype=dtype, device=self.device)
            parts.append(self._split(part, g))
        # one message: the flat gradient itself when there is one, else all packed into bytes
        self.p2p.send(parts[0].reshape(-1) if len(parts) == 1 else meta.pack(parts), peer, what)

    def _tell_unused(self, pos: int) -> None:
        if self.declared is None and self.log_layout and not self._told_unused:
            self._told_unused = True
            logger.warning(f"pipeline stage {self.p2p.stage_id}: position {pos} of the tuple it receives requires grad "
                           f"on the sending stage but got no gradient here; zeros are sent back (declare "
                           f"_input_grad[{pos}]=False on the model to skip them)")

    def post_grads(self, outputs, peer: int):
        """Start receiving the gradients for the grad positions of `outputs` (None: there are none); finish
        with `recv_grads(..., posted=...)`. Receives from one peer complete in the order they are posted."""
        pos, wire = self._grad_wire(outputs)
        if not pos:
            return None
        if len(wire) == 1:
            return self.p2p.post_recv(torch.empty(wire[0][1], dtype=wire[0][0], device=self.device), peer)
        return self.p2p.post_recv(torch.empty(meta.packed_size(wire), dtype=torch.uint8, device=self.device), peer)

    def recv_grads(self, outputs, peer: int, what: object, posted=None) -> list:
        """Gradients for the grad positions of `outputs`, in position order (`posted`: from `post_grads`)."""
        pos, wire = self._grad_wire(outputs)
        if not pos:
            return []
        flat = self.p2p.wait_recv(posted or self.post_grads(outputs, peer), what)
        flats = [flat] if len(wire) == 1 else meta.unpack(flat, wire)
        return [self._assemble(chunked, f, tuple(t.shape)) for (chunked, t), f in zip(pos, flats)]

    def _grad_wire(self, outputs) -> tuple[list, list]:
        """([(chunked, tensor)] of the grad positions of `outputs`, [(dtype, numel on the wire)] of each)."""
        tensors, _ = meta.as_tuple(outputs)
        pos = [(c, t) for d, c, t in zip(self.decls, self._chunked_positions(len(tensors)), tensors) if d.grad]
        return pos, [(t.dtype, meta.chunk_numel(t.numel(), self.tp_size) if c else t.numel()) for c, t in pos]


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
