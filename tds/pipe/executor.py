"""The executor of `PipelineEngine`: runs one stage's instruction list for one batch, one handler per `Op`.

Buffers are keyed by the unit (micro-batch, chunk) an instruction names (chunk 0 unless interleaved), and a
batch's state lives in a `BatchState` that is dropped when the batch ends. With v model chunks per stage the
"first unit" (stage 0, chunk 0) takes the inputs from the data iterator and the "last unit" (stage p-1,
chunk v-1) computes the loss; the other units receive activations from the previous virtual stage and send
gradients back to it, round the ring of stages (`schedule.route`).

Backward protocol (DeepSpeed's, on every stage):
    BACKWARD          the loss unit: DeepSpeedEngine.backward(loss); others: autograd.backward(outputs,
                      received grads) inside `_stage_backward()` (DeepSpeed's `_engine_backward` marker,
                      closed by `_backward_epilogue()`)
    BACKWARD_INPUT    (B, ZB-H1) the same from the same roots (the loss scaled as DeepSpeedEngine.backward
                      scales it), but only what the stage inputs need: the weight gradients wait in
                      `weight_grads` under the unit, those of the linears (`weight_grad.py`: store modules, and
                      every F.linear on the stage's weights, routed there during the unit's forward) or, on a
                      stage where none deferred, the rest of the graph (`graph_split.py`)
    BACKWARD_WEIGHT   (W) `weight_grads.run(unit)` inside `_stage_backward()` too: BF16_Optimizer adds the
                      low-precision gradients to its fp32 accumulators there, so W's gradients must reach them
                      before the next B clears them

The executor reads and calls nothing but its `StageContext`, built once by the engine:
    place         stage_id, num_stages, chunks (model chunks per stage), prev_rank / next_rank (round the
                  ring), receive_ahead
    objects       module, boundary, p2p, weight_grads, comm and comm_in (what communicates in each op)
    reports       whether this rank logs the stage's warnings
    engine        the DeepSpeed engine's side of a step (`EngineHooks`): _next_micro_batch,
                  _reentrant_activation_checkpointing, _stage_forward, _backward_loss, _scaled_loss,
                  _stage_backward, _micro_batch_done, _settle_grads, _tied_grad, _reduce_grads, _step_optimizer

Counted per batch (returned by `StageExecutor.run`, kept as `engine.last_batch_stats`): peak live activations
= most units whose forward ran and whose backward (B under ZB-H1) did not yet, measured by the buffers this
stage holds, and the most units with weight-gradient work pending (ZB-H1).
"""
from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from deepspeed.utils import logger

from .. import device as tds_device
from . import graph_split, weight_grad
from .boundary import Boundary
from .collectives import CommGuard
from .finite import FiniteCheck
from .instructions import Instruction, Op
from .p2p import P2P
from .weight_grad import WeightGradStore

Unit = tuple[int, int]  # (micro-batch, chunk)


@dataclass
class BatchState:
    """Per-batch buffers keyed by unit (freed as soon as the schedule is done with them)."""
    training: bool
    compute_loss: bool = True
    keep_logits: bool = False
    last_recv: Unit = (-1, -1)  # the batch's last activation receive: no receive is posted ahead after it
    activation_due: bool = False  # the next activation receive is to be posted ahead (`_post_ahead`)
    grad_order: list = field(default_factory=list)   # the units of the batch's gradient receives, in order
    grads_posted: dict = field(default_factory=dict)  # unit -> gradient receive posted ahead
    inputs: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)       # micro-batch -> labels (last unit)
    outputs: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    loss_graphs: dict = field(default_factory=dict)  # micro-batch -> loss (last unit)
    losses: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    routed: set = field(default_factory=set)  # ZB-H1: units whose forward routed F.linear through the store
    peak_live: int = 0       # most units holding activations (forward ran, backward / B not yet)
    peak_pending_w: int = 0  # most units with queued weight-gradient work (ZB-H1)


class EngineHooks(Protocol):
    """The DeepSpeed engine's side of a step, as the executor calls it (`PipelineEngine` implements it)."""

    def _next_micro_batch(self, where: str) -> Any:
        """The next (inputs, labels) item of the data iterator, after the engine's batch_fn."""

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether the first stage's float inputs must require grad (reentrant activation checkpointing)."""

    def _stage_forward(self, inputs, **kwargs):
        """DeepSpeedEngine.forward of the stage's module (its backward hooks on the outputs)."""

    def _backward_loss(self, loss: torch.Tensor) -> None:
        """DeepSpeedEngine.backward of a micro-batch's loss (1/m and the loss scale applied there)."""

    def _scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` scaled as DeepSpeedEngine.backward scales it (1/m, the ZeRO or fp16 loss scale)."""

    def _stage_backward(self) -> AbstractContextManager:
        """The block of a backward not started by DeepSpeedEngine.backward: the prologue's state, the
        engine-backward marker, and on leaving it without an exception the epilogue."""

    def _micro_batch_done(self, chunk: int) -> None:
        """After a micro-batch's BACKWARD of model chunk `chunk` (fixed-order sums take its gradients)."""

    def _settle_grads(self) -> None:
        """Before REDUCE_TIED: the batch's gradients in .grad (fixed-order sums write them there)."""

    def _tied_grad(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """The gradient tensor the optimizer reads for a tied weight (zeros where this stage did not use it)."""

    def _reduce_grads(self) -> None:
        """The data-parallel gradient all_reduce at the end of a batch."""

    def _step_optimizer(self) -> None:
        """The optimizer step (with the engine's clipping, loss scaling and LR schedule)."""


@dataclass(frozen=True)
class StageContext:
    """Everything a stage's executor reads, built once by the engine (module docstring)."""
    stage_id: int
    num_stages: int
    chunks: int                     # model chunks per stage (virtual stages)
    prev_rank: int | None           # global ranks of the previous / next stage round the ring; None at p = 1
    next_rank: int | None
    receive_ahead: bool             # post the next receive before it is reached
    module: torch.nn.Module         # the stage's `PipelineModule`
    boundary: Boundary
    p2p: P2P | None                 # None at p = 1
    weight_grads: WeightGradStore | None  # ZB-H1 only
    comm: CommGuard
    comm_in: dict                   # {Op: what communicates inside an instruction of that op}
    reports: bool                   # this rank logs the stage's warnings (data- and tensor-parallel rank 0)
    engine: EngineHooks
    finite: FiniteCheck | None = None  # pipeline.check_finite: watches sent activations and losses


class StageExecutor:
    """Runs one stage's instruction lists (`run`), one handler per `Op`, from its `StageContext` alone."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self._told_unsplit = False  # ZB-H1: parameters whose weight gradients B computes, reported once

    def run(self, instructions: list[Instruction], state: BatchState, recorder=None) -> dict:
        """Run `instructions`; record their spans with `recorder` (a `timeline.TimelineRecorder`) if given.
        Returns the batch's counts (module docstring)."""
        ctx = self.ctx
        handlers = {Op.LOAD: self._exec_load, Op.RECV_ACT: self._exec_recv_act, Op.FORWARD: self._exec_forward,
                    Op.SEND_ACT: self._exec_send_act, Op.RECV_GRAD: self._exec_recv_grad,
                    Op.BACKWARD: self._exec_backward, Op.BACKWARD_INPUT: self._exec_backward_input,
                    Op.BACKWARD_WEIGHT: self._exec_backward_weight, Op.SEND_GRAD: self._exec_send_grad,
                    Op.REDUCE_TIED: self._exec_reduce_tied, Op.REDUCE_GRADS: self._exec_reduce_grads,
                    Op.STEP: self._exec_step}
        recvs = [(ins.micro_batch, ins.chunk) for ins in instructions if ins.op == Op.RECV_ACT]
        state.last_recv = recvs[-1] if recvs else (-1, -1)
        state.grad_order = [(ins.micro_batch, ins.chunk) for ins in instructions if ins.op == Op.RECV_GRAD]
        clock = time.perf_counter
        try:  # exceptions: see PipelineEngine._mode
            for ins in instructions:
                t0 = clock()
                try:
                    handlers[ins.op](ins, state)
                except RuntimeError as err:  # a failed transfer or collective: name the instruction and group
                    failure = ctx.comm.failure(err, f"instruction {ins}", ctx.comm_in[ins.op])
                    if failure is None:
                        raise
                    raise failure from err
                if recorder is not None:
                    recorder.record(ins, t0, clock())
            if ctx.p2p is not None:
                ctx.p2p.wait_sends()
        finally:
            if recorder is not None:
                recorder.end_batch()
        return {"peak_live_activations": state.peak_live, "peak_pending_weight_grads": state.peak_pending_w}

    # --- where a unit sits in the pipeline ----------------------------------------------------------------
    def _first_unit(self, ins: Instruction) -> bool:
        """Stage 0, chunk 0: takes the inputs from the data iterator, sends no gradient back."""
        return self.ctx.stage_id == 0 and ins.chunk == 0

    def _last_unit(self, ins: Instruction) -> bool:
        """Stage p-1, chunk v-1: computes the loss, sends no activation on."""
        return self.ctx.stage_id == self.ctx.num_stages - 1 and ins.chunk == self.ctx.chunks - 1

    def _count_live(self, state: BatchState) -> None:
        state.peak_live = max(state.peak_live, len(state.outputs) + len(state.loss_graphs))
        pending = len(self.ctx.weight_grads.pending()) if self.ctx.weight_grads is not None else 0
        state.peak_pending_w = max(state.peak_pending_w, pending)

    # --- handlers ------------------------------------------------------------------------------------------
    def _exec_load(self, ins: Instruction, state: BatchState) -> None:
        where = f"pipeline stage {self.ctx.stage_id}, {ins}"
        batch = self.ctx.engine._next_micro_batch(where)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"{where}: the data iterator must yield (inputs, labels) per micro-batch, got "
                             f"{type(batch).__name__}")
        dev = tds_device.device()
        if self._first_unit(ins):
            # copied, as DeepSpeed does: a layer that changes its input in place (nn.ReLU(inplace=True),
            # partitioned activation checkpointing) must not change the user's batch
            # reentrant checkpointing (DeepSpeed's decision): float inputs require grad
            grad = self.ctx.engine._reentrant_activation_checkpointing()
            state.inputs[(ins.micro_batch, ins.chunk)] = _to_device(batch[0], dev, detach=True, copy=True, grad=grad)
        if self._last_unit(ins):
            state.labels[ins.micro_batch] = _to_device(batch[1], dev, detach=True)

    def _exec_recv_act(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        state.inputs[unit] = self.ctx.boundary.recv_activations(self.ctx.prev_rank, ins, state.training)
        state.activation_due = unit != state.last_recv and self.ctx.receive_ahead

    def _exec_forward(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        keep = state.training and not self._first_unit(ins)  # kept for send_grads
        inputs = state.inputs[unit] if keep else state.inputs.pop(unit)
        kwargs = {"chunk": ins.chunk} if self.ctx.chunks > 1 else {}
        if self.ctx.weight_grads is not None and state.training and not self._checkpoints():
            # ZB-H1: F.linear on the stage's weights defers its weight gradient through the store (weight_grad.py)
            weights = {id(p): p for p in self.ctx.module.parameters() if p.requires_grad}
            with weight_grad.route_linears(weights, self.ctx.weight_grads) as routed:
                outputs = self.ctx.engine._stage_forward(inputs, **kwargs)
            if routed:
                state.routed.add(unit)
        else:
            outputs = self.ctx.engine._stage_forward(inputs, **kwargs)
        if not self._last_unit(ins):
            state.outputs[unit] = outputs
            self._count_live(state)
            return
        if state.keep_logits:
            state.logits.append(_detach(outputs))
        if not state.compute_loss:
            return
        module = self.ctx.module
        loss = module.loss_fn(outputs, state.labels.pop(ins.micro_batch)) if module.loss_fn else outputs
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError(f"pipeline stage {self.ctx.stage_id}, {ins}: the loss must be a scalar tensor, got "
                             f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        state.losses.append(loss.detach().float().reshape(()))
        if self.ctx.finite is not None:
            self.ctx.finite.watch("forward", [loss])
        if state.training:
            state.loss_graphs[ins.micro_batch] = loss
            self._count_live(state)

    def _exec_send_act(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        out = state.outputs[unit] if state.training else state.outputs.pop(unit)
        if self.ctx.finite is not None:
            self.ctx.finite.watch("forward", (out,) if torch.is_tensor(out) else out)
        self.ctx.boundary.send_activations(out, self.ctx.next_rank, ins)
        self._post_ahead(state)

    def _exec_recv_grad(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        self._post_ahead(state)  # before this wait, not after it
        posted = state.grads_posted.pop(unit, None)
        if posted is None and state.grad_order and state.grad_order[0] == unit:
            state.grad_order.pop(0)  # received now, not ahead
        state.grads[unit] = self.ctx.boundary.recv_grads(state.outputs[unit], self.ctx.next_rank, ins, posted)

    def _post_ahead(self, state: BatchState) -> None:
        """Post the receives that are due ahead of their instructions: the next activation once the last one
        arrived, and `_post_grads_ahead`'s. Called after a send and before a wait, so that the posting does
        not delay a stage between a message's arrival and the work it waits for."""
        if state.activation_due:
            state.activation_due = False
            self.ctx.boundary.post_activations(self.ctx.prev_rank, state.training)
        self._post_grads_ahead(state)

    def _post_grads_ahead(self, state: BatchState) -> None:
        """Post the gradient receives of the units whose activations left, in the order the schedule receives
        them, so that a gradient is taken in while the stage computes."""
        if not self.ctx.receive_ahead:
            return
        order = state.grad_order
        while order and order[0] in state.outputs:
            unit = order.pop(0)
            state.grads_posted[unit] = self.ctx.boundary.post_grads(state.outputs[unit], self.ctx.next_rank)

    def _exec_backward(self, ins: Instruction, state: BatchState) -> None:
        """DeepSpeed's backward protocol on every stage: the hooks DeepSpeedEngine.forward put on the stage's
        outputs run the prologue when the first gradient arrives, `_backward_epilogue` closes it (ZeRO's
        backward depth back to 0, BF16_Optimizer's fp32 accumulation), as `DeepSpeedEngine.backward` does.
        Then the engine may take the micro-batch's gradients (fixed-order sums)."""
        self._backward(ins, state)
        self.ctx.engine._micro_batch_done(ins.chunk)

    def _backward(self, ins: Instruction, state: BatchState) -> None:
        if self._last_unit(ins):
            self.ctx.engine._backward_loss(state.loss_graphs.pop(ins.micro_batch))
            return
        roots, grads = self._backward_roots(ins, state)
        if not roots:
            return  # no gradient reaches this stage's parameters: no prologue ran, nothing to close
        with self.ctx.engine._stage_backward():
            torch.autograd.backward(roots, grads)

    def _backward_roots(self, ins: Instruction, state: BatchState) -> tuple[list, list]:
        """(tensors, gradients) the unit's backward starts from: the loss (scaled as DeepSpeedEngine.backward
        scales it: 1/m, and the ZeRO or fp16 loss scale) or the outputs with the gradients received."""
        unit = (ins.micro_batch, ins.chunk)
        if self._last_unit(ins):
            return [self.ctx.engine._scaled_loss(state.loss_graphs.pop(ins.micro_batch))], [None]
        outputs = (state.outputs.pop(unit),) if torch.is_tensor(state.outputs[unit]) else state.outputs.pop(unit)
        declared = [t for d, t in zip(self.ctx.boundary.decls, outputs) if d.grad]
        pairs = [(t, g) for t, g in zip(declared, state.grads.pop(unit)) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _exec_backward_input(self, ins: Instruction, state: BatchState) -> None:
        """B: the backward without the weight gradients (`graph_split.py`), queued under this unit for W; the
        deferring linears of `weight_grad.py` queue theirs too."""
        unit = (ins.micro_batch, ins.chunk)
        roots, grads = self._backward_roots(ins, state)
        routed = unit in state.routed
        state.routed.discard(unit)
        if roots:
            store = self.ctx.weight_grads
            with store.defer(unit):
                with self.ctx.engine._stage_backward():
                    done = self._backward_input(roots, grads, routed)
                store.later(done.run)
            self._report_unsplit(done)
        self._count_live(state)

    def _exec_backward_weight(self, ins: Instruction, state: BatchState) -> None:
        """W: the unit's queued weight gradients, accumulated as a backward would (module docstring); under
        BF16_Optimizer the low-precision gradients are cleared first, B's epilogue having moved them to fp32."""
        with self.ctx.engine._stage_backward():
            self.ctx.weight_grads.run((ins.micro_batch, ins.chunk))

    def _backward_input(self, roots: list, grads: list, routed: bool) -> graph_split.BackwardInput:
        """B through the graph split, except for a unit whose linears defer through the store (F.linear routed
        in its forward, or the store linears of weight_grad.py): the rest of its weights (norms, embeddings)
        costs less in B than kept graphs and W calls would (tds/README.md)."""
        module = self.ctx.module
        if routed or any(getattr(m, "weight_grad_store", None) is not None for m in module.modules()):
            return graph_split.backward_whole(roots, grads, [], "")
        params = [p for p in module.parameters() if p.requires_grad]
        if self._checkpoints():
            return graph_split.backward_whole(roots, grads, params, "activation checkpointing (W would recompute "
                                              "each checkpointed segment again)")
        return graph_split.backward_input(roots, grads, params)

    def _checkpoints(self) -> bool:
        """Whether the stage recomputes activations (read at each use: set_checkpoint_interval may change it)."""
        module = self.ctx.module
        if module.activation_checkpoint_interval <= 0:
            return False
        module._precompute_checkpointable_values()  # cached; before the first forward the list is empty
        return any(module.is_checkpointable_results)

    def _report_unsplit(self, done) -> None:
        """Once per stage: the parameters whose weight gradients B computed (no W of their own)."""
        if not done.unsplit or self._told_unsplit:
            return
        self._told_unsplit = True
        if self.ctx.reports:
            names = {id(p): n for n, p in self.ctx.module.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in done.unsplit[:8])
            more = f" and {len(done.unsplit) - 8} more" if len(done.unsplit) > 8 else ""
            logger.warning(f"pipeline stage {self.ctx.stage_id}: ZB-H1 computes the weight gradients of {listed}"
                           f"{more} in B, not W: {done.reason}")

    def _exec_send_grad(self, ins: Instruction, state: BatchState) -> None:
        self.ctx.boundary.send_grads(state.inputs.pop((ins.micro_batch, ins.chunk)), self.ctx.prev_rank, ins)
        self._post_ahead(state)

    def _exec_reduce_tied(self, ins: Instruction, state: BatchState) -> None:
        """Sum tied-weight gradients over the groups that share them, in the module's order on every rank: one
        all-reduce per run of consecutive pairs with the same group and dtype (the gradients flattened into
        one buffer), so many small tied tensors (e.g. a model's sequence-parallel norms) cost one collective."""
        self.ctx.engine._settle_grads()
        runs: list[tuple[Any, list[torch.Tensor]]] = []
        for weight, group in self.ctx.module.get_tied_weights_and_groups():
            if not weight.requires_grad:  # frozen on every rank alike
                continue
            grad = self.ctx.engine._tied_grad(weight)
            if runs and runs[-1][0] is group and runs[-1][1][0].dtype == grad.dtype and runs[-1][1][0].device == grad.device:
                runs[-1][1].append(grad)
            else:
                runs.append((group, [grad]))
        for group, grads in runs:
            if len(grads) == 1:
                dist.all_reduce(grads[0], group=group)
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))

    def _exec_reduce_grads(self, ins: Instruction, state: BatchState) -> None:
        self.ctx.engine._reduce_grads()

    def _exec_step(self, ins: Instruction, state: BatchState) -> None:
        self.ctx.engine._step_optimizer()


def _to_device(value, dev: torch.device, detach: bool, copy: bool = False, grad: bool = False):
    """`value` (a tensor or a tuple of them) on `dev`; with `grad`, each float tensor is the copy of a leaf
    that requires grad (a copy, not the leaf itself, so that an in-place first layer still works)."""
    if torch.is_tensor(value):
        if grad and value.is_floating_point():
            return value.detach().to(dev).requires_grad_().clone()
        value = value.to(dev, copy=copy)
        return value.detach() if detach else value
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, dev, detach, copy, grad) for v in value)
    return value


def _detach(value):
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return tuple(_detach(v) for v in value)
    return value
