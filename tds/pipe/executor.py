"""The executor of `PipelineEngine`: runs one stage's instruction list for one batch, one handler per `Op`.

Buffers are keyed by the unit (micro-batch, chunk) an instruction names (chunk 0 unless interleaved), and a
batch's state lives in a `BatchState` that is dropped when the batch ends. With v model chunks per stage the
"first unit" (stage 0, chunk 0) takes the inputs from the data iterator and the "last unit" (stage p-1,
chunk v-1) computes the loss; the other units receive activations from the previous virtual stage and send
gradients back to it, round the ring of stages (`schedule.route`).

Backward protocol (DeepSpeed's, on every stage):
    BACKWARD          the loss unit: DeepSpeedEngine.backward(loss); others: autograd.backward(outputs,
                      received grads) inside `_engine_backward()`, closed by `_backward_epilogue()`
    BACKWARD_INPUT    (B, ZB-H1) the same from the same roots (the loss scaled as DeepSpeedEngine.backward
                      scales it), but only what the stage inputs need (`graph_split.py`): the weight gradients
                      wait in `weight_grads` under the unit, with the deferring linears' (`weight_grad.py`)
    BACKWARD_WEIGHT   (W) `weight_grads.run(unit)` inside `_engine_backward()`, closed by
                      `_backward_epilogue()` too: BF16_Optimizer adds the low-precision gradients to its fp32
                      accumulators there, so W's gradients must reach them before the next B clears them

Counted per batch (`engine.last_batch_stats`): peak live activations = most units whose forward ran and whose
backward (B under ZB-H1) did not yet, measured by the buffers this stage holds, and the most units with
weight-gradient work pending (ZB-H1).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE, DeepSpeedEngine
from deepspeed.utils import logger

from .. import device as tds_device
from . import graph_split
from .instructions import Instruction, Op

Unit = tuple[int, int]  # (micro-batch, chunk)


@dataclass
class BatchState:
    """Per-batch buffers keyed by unit (freed as soon as the schedule is done with them)."""
    training: bool
    compute_loss: bool = True
    keep_logits: bool = False
    last_recv: Unit = (-1, -1)  # the batch's last activation receive: no receive is posted ahead after it
    grad_order: list = field(default_factory=list)   # the units of the batch's gradient receives, in order
    grads_posted: dict = field(default_factory=dict)  # unit -> gradient receive posted ahead
    inputs: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)       # micro-batch -> labels (last unit)
    outputs: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    loss_graphs: dict = field(default_factory=dict)  # micro-batch -> loss (last unit)
    losses: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    peak_live: int = 0       # most units holding activations (forward ran, backward / B not yet)
    peak_pending_w: int = 0  # most units with queued weight-gradient work (ZB-H1)


class Executor:
    """Mixin of `PipelineEngine`: `_run` and the instruction handlers (uses the engine's boundary, p2p,
    module, optimizer, grid, weight_grads and comm)."""

    def _run(self, instructions: list[Instruction], state: BatchState, recorder=None) -> None:
        """Run `instructions`; record their spans with `recorder` (a `timeline.TimelineRecorder`) if given."""
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
                with self.comm.guard(f"instruction {ins}", self._comm_in[ins.op]):
                    handlers[ins.op](ins, state)
                if recorder is not None:
                    recorder.record(ins, t0, clock())
            if self.p2p is not None:
                self.p2p.wait_sends()
        finally:
            self._force_grad_boundary = False
            if recorder is not None:
                recorder.end_batch()
        self.last_batch_stats = {"peak_live_activations": state.peak_live,
                                 "peak_pending_weight_grads": state.peak_pending_w}

    # --- where a unit sits in the pipeline ----------------------------------------------------------------
    def _first_unit(self, ins: Instruction) -> bool:
        """Stage 0, chunk 0: takes the inputs from the data iterator, sends no gradient back."""
        return self.is_first_stage() and ins.chunk == 0

    def _last_unit(self, ins: Instruction) -> bool:
        """Stage p-1, chunk v-1: computes the loss, sends no activation on."""
        return self.is_last_stage() and ins.chunk == self.virtual_stages - 1

    def _count_live(self, state: BatchState) -> None:
        state.peak_live = max(state.peak_live, len(state.outputs) + len(state.loss_graphs))
        pending = len(self.weight_grads.pending()) if self.weight_grads is not None else 0
        state.peak_pending_w = max(state.peak_pending_w, pending)

    # --- handlers ------------------------------------------------------------------------------------------
    def _exec_load(self, ins: Instruction, state: BatchState) -> None:
        if self.data_iterator is None:
            raise RuntimeError(f"pipeline stage {self.stage_id}, {ins}: no data iterator; pass one to "
                               f"train_batch()/eval_batch() on the first and last stage")
        batch = next(self.data_iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"pipeline stage {self.stage_id}, {ins}: the data iterator must yield (inputs, labels) "
                             f"per micro-batch, got {type(batch).__name__}")
        dev = tds_device.device()
        if self._first_unit(ins):
            # copied, as DeepSpeed does: a layer that changes its input in place (nn.ReLU(inplace=True),
            # partitioned activation checkpointing) must not change the user's batch
            # reentrant checkpointing (DeepSpeed's decision): float inputs require grad
            grad = self._reentrant_activation_checkpointing()
            state.inputs[(ins.micro_batch, ins.chunk)] = _to_device(batch[0], dev, detach=True, copy=True, grad=grad)
        if self._last_unit(ins):
            state.labels[ins.micro_batch] = _to_device(batch[1], dev, detach=True)

    def _exec_recv_act(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        more = unit != state.last_recv and self._receive_ahead
        state.inputs[unit] = self.boundary.recv_activations(self.prev_rank, str(ins), state.training, more)

    def _exec_forward(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        keep = state.training and not self._first_unit(ins)  # kept for send_grads
        inputs = state.inputs[unit] if keep else state.inputs.pop(unit)
        kwargs = {"chunk": ins.chunk} if self.virtual_stages > 1 else {}
        outputs = DeepSpeedEngine.forward(self, inputs, **kwargs)
        if not self._last_unit(ins):
            state.outputs[unit] = outputs
            self._count_live(state)
            return
        if state.keep_logits:
            state.logits.append(_detach(outputs))
        if not state.compute_loss:
            return
        loss = self.module.loss_fn(outputs, state.labels.pop(ins.micro_batch)) if self.module.loss_fn else outputs
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError(f"pipeline stage {self.stage_id}, {ins}: the loss must be a scalar tensor, got "
                             f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        state.losses.append(loss.detach().float().reshape(()))
        if state.training:
            state.loss_graphs[ins.micro_batch] = loss
            self._count_live(state)

    def _exec_send_act(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        out = state.outputs[unit] if state.training else state.outputs.pop(unit)
        self.boundary.send_activations(out, self.next_rank, str(ins))
        self._post_grads_ahead(state)

    def _exec_recv_grad(self, ins: Instruction, state: BatchState) -> None:
        unit = (ins.micro_batch, ins.chunk)
        posted = state.grads_posted.pop(unit, None)
        if posted is None and state.grad_order and state.grad_order[0] == unit:
            state.grad_order.pop(0)  # received now, not ahead
        state.grads[unit] = self.boundary.recv_grads(state.outputs[unit], self.next_rank, str(ins), posted)
        self._post_grads_ahead(state)

    def _post_grads_ahead(self, state: BatchState) -> None:
        """Post the gradient receives of the units whose activations left, in the order the schedule receives
        them, so that a gradient is taken in while the stage computes (as activations are, `recv_activations`)."""
        if not self._receive_ahead:
            return
        order = state.grad_order
        while order and order[0] in state.outputs:
            unit = order.pop(0)
            state.grads_posted[unit] = self.boundary.post_grads(state.outputs[unit], self.next_rank)

    def _exec_backward(self, ins: Instruction, state: BatchState) -> None:
        """DeepSpeed's backward protocol on every stage: the hooks DeepSpeedEngine.forward put on the stage's
        outputs run the prologue when the first gradient arrives, `_backward_epilogue` closes it (ZeRO's
        backward depth back to 0, BF16_Optimizer's fp32 accumulation), as `DeepSpeedEngine.backward` does."""
        if self._last_unit(ins):
            self._loss_backward = True
            try:
                DeepSpeedEngine.backward(self, self._fp16_scaled(state.loss_graphs.pop(ins.micro_batch)))
            finally:
                self._loss_backward = False
            return
        roots, grads = self._backward_roots(ins, state)
        if not roots:
            return  # no gradient reaches this stage's parameters: no prologue ran, nothing to close
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # as DeepSpeed's pipeline engine; the prologue hook repeats it
        with self._engine_backward():
            torch.autograd.backward(roots, grads)
            self._backward_epilogue()

    def _backward_roots(self, ins: Instruction, state: BatchState) -> tuple[list, list]:
        """(tensors, gradients) the unit's backward starts from: the loss (scaled as DeepSpeedEngine.backward
        scales it: 1/m, and the ZeRO or fp16 loss scale) or the outputs with the gradients received."""
        unit = (ins.micro_batch, ins.chunk)
        if self._last_unit(ins):
            loss = self._fp16_scaled(state.loss_graphs.pop(ins.micro_batch)) / self.gradient_accumulation_steps()
            return [self.optimizer.scale_if_loss(loss) if isinstance(self.optimizer, ZeROOptimizer) else loss], [None]
        outputs = (state.outputs.pop(unit),) if torch.is_tensor(state.outputs[unit]) else state.outputs.pop(unit)
        declared = [t for d, t in zip(self.boundary.decls, outputs) if d.grad]
        pairs = [(t, g) for t, g in zip(declared, state.grads.pop(unit)) if t.requires_grad]
        return [t for t, _ in pairs], [g for _, g in pairs]

    def _exec_backward_input(self, ins: Instruction, state: BatchState) -> None:
        """B: the backward without the weight gradients (`graph_split.py`), queued under this unit for W; the
        deferring linears of `weight_grad.py` queue theirs too."""
        unit = (ins.micro_batch, ins.chunk)
        roots, grads = self._backward_roots(ins, state)
        if roots:
            with self.weight_grads.defer(unit):
                if self.using_bf16_optimizer:
                    self.optimizer.clear_lp_grads()
                with self._engine_backward():
                    done = self._backward_input(roots, grads)
                    self._backward_epilogue()
                self.weight_grads.later(done.run)
            self._report_unsplit(done)
        self._count_live(state)

    def _exec_backward_weight(self, ins: Instruction, state: BatchState) -> None:
        """W: the unit's queued weight gradients, accumulated as a backward would (module docstring)."""
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # B's epilogue already moved the low-precision grads to fp32
        with self._engine_backward():
            self.weight_grads.run((ins.micro_batch, ins.chunk))
            self._backward_epilogue()

    def _backward_input(self, roots: list, grads: list) -> graph_split.BackwardInput:
        """B through the graph split, except on a stage whose store linears defer (weight_grad.py): the rest of
        its weights (norms, embeddings, biases) costs less in B than kept graphs and W calls would (README)."""
        stored = {id(p) for m in self.module.modules() if getattr(m, "weight_grad_store", None) is not None
                  for p in m.parameters(recurse=False)}
        if stored:
            return graph_split.backward_whole(roots, grads, [], "")
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.module.activation_checkpoint_interval > 0 and any(self.module.is_checkpointable_results):
            return graph_split.backward_whole(roots, grads, params, "activation checkpointing (W would recompute "
                                              "each checkpointed segment again)")
        return graph_split.backward_input(roots, grads, params)

    def _report_unsplit(self, done) -> None:
        """Once per stage: the parameters whose weight gradients B computed (no W of their own)."""
        if not done.unsplit or self._told_unsplit:
            return
        self._told_unsplit = True
        if self.grid.get_data_parallel_rank() == 0 and self.grid.get_slice_parallel_rank() == 0:
            names = {id(p): n for n, p in self.module.named_parameters()}
            listed = ", ".join(names.get(id(p), "?") for p in done.unsplit[:8])
            more = f" and {len(done.unsplit) - 8} more" if len(done.unsplit) > 8 else ""
            logger.warning(f"pipeline stage {self.stage_id}: ZB-H1 computes the weight gradients of {listed}{more} "
                           f"in B, not W: {done.reason}")

    def _exec_send_grad(self, ins: Instruction, state: BatchState) -> None:
        self.boundary.send_grads(state.inputs.pop((ins.micro_batch, ins.chunk)), self.prev_rank, str(ins))

    def _exec_reduce_tied(self, ins: Instruction, state: BatchState) -> None:
        """Sum tied-weight gradients over the stages that share them, keys in sorted order on every rank."""
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.requires_grad:  # frozen on every rank alike
                dist.all_reduce(self._tied_grad(weight), group=group)

    def _exec_reduce_grads(self, ins: Instruction, state: BatchState) -> None:
        if self.dp_world_size == 1 and not self.zero_optimization():
            return  # one replica: DeepSpeed would flatten, all-reduce over one rank and copy back, for nothing
        self._force_grad_boundary = True
        if self.using_bf16_optimizer:
            self.buffered_allreduce_fallback(grads=None, elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
        else:
            self.allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)
        self._force_grad_boundary = False  # (and in _run's finally, if this raises)

    def _exec_step(self, ins: Instruction, state: BatchState) -> None:
        self._force_grad_boundary = True
        self._take_model_step(None)
        self._force_grad_boundary = False


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
