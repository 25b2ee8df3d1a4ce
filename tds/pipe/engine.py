"""TDS `PipelineEngine`: DeepSpeedEngine (ZeRO-1, fp16/bf16 optimizers, checkpoint files) driven by a
schedule from `schedule.py`, moving the model's declared boundary tuple with `boundary.py`.

Batch protocol (p stages, m = gradient_accumulation_steps micro-batches of train_micro_batch_size_per_gpu):
- The data iterator yields one `(inputs, labels)` pair per micro-batch. The first and the last stage each
  call `next()` exactly once per micro-batch, in micro-batch order, so with identical iterators (same data,
  same order, e.g. built from the same seed) stage 0 gets the inputs and stage p-1 the labels of the same
  item. Other stages never touch the iterator.
- The last stage computes one loss L_i per micro-batch; backward runs on L_i / m (scaled once, here, by
  DeepSpeedEngine.backward, which also applies the fp16 loss scale). Gradients reaching earlier stages
  are already scaled, so accumulated gradients equal those of one batch of m micro-batches.
- `train_batch` returns mean_i L_i, averaged over data-parallel replicas and broadcast to every stage.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE, DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineError

from .. import device as tds_device
from .boundary import Boundary
from .collectives import CommGuard, apply_timeout, resolve_timeout
from .module import PipelineModule
from .p2p import P2P, PipelineCommError
from .schedule import Instruction, Op, eval_schedule, train_schedule


@dataclass
class _BatchState:
    """Per-batch buffers keyed by micro-batch id (freed as soon as the schedule is done with them)."""
    training: bool
    compute_loss: bool = True
    keep_logits: bool = False
    last_recv: int = -1
    inputs: dict = field(default_factory=dict)
    labels: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    loss_graphs: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    logits: list = field(default_factory=list)


class PipelineEngine(DeepSpeedEngine):
    """Built by `tds.initialize` for a `tds.pipe.PipelineModule`; use `train_batch` / `eval_batch`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.module, PipelineModule):
            raise TypeError(f"model must be a tds.pipe.PipelineModule, got {type(self.module).__name__}")
        if self.zero_optimization_stage() >= 2:
            raise ValueError(f"ZeRO stage {self.zero_optimization_stage()} is not supported with pipeline "
                             f"parallelism; use zero_optimization.stage 0 or 1")
        self.enable_backward_allreduce = False  # the schedule reduces gradients once per batch
        self.using_bf16_optimizer = type(self.optimizer) == BF16_Optimizer
        self._force_grad_boundary = False
        self.grid = self.module._grid
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.get_stage_id()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator = None
        self.batch_fn = None
        self._configure_pipeline(self._config.pipeline)
        self.module.checkpoint_parallel_write_pipeline = self._config.checkpoint_parallel_write_pipeline
        if self.training_data:
            self._build_data_iter(self.training_data)

    def _configure_pipeline(self, cfg: dict) -> None:
        self.schedule_kind = str(cfg.get("schedule", "1f1b")).lower()
        train_schedule(self.schedule_kind, 1, 0, 1)  # validates the name
        timeout, source = resolve_timeout(cfg)
        self.module.configure_checkpointing(self._config)  # interval, use_reentrant, activation_checkpointing
        decls = self.module.declarations() if self.num_stages > 1 else []
        self.p2p = P2P.create(self.stage_id, timeout) if self.num_stages > 1 else None
        self.boundary = Boundary(self.p2p, decls, self.grid.get_slice_parallel_group(),
                                 self.grid.get_slice_parallel_world_size(), self.grid.get_slice_parallel_rank(),
                                 tds_device.device(), log_layout=self.grid.get_data_parallel_rank() == 0
                                 and self.grid.get_slice_parallel_rank() == 0)
        self.prev_rank = self.grid.stage_to_global(self.stage_id - 1) if not self.is_first_stage() else None
        self.next_rank = self.grid.stage_to_global(self.stage_id + 1) if not self.is_last_stage() else None
        groups = self._process_groups()
        apply_timeout(groups, timeout)
        self.comm = CommGuard(self.stage_id, timeout, source, groups)
        self._broken: str | None = None  # why point-to-point state is unknown after a failed batch

    def _process_groups(self) -> dict:
        """{name: group} of every group this engine (and the model's tied weights) runs collectives on."""
        groups = {"data-parallel": self.grid.get_data_parallel_group(),
                  "pipeline": self.grid.get_pipe_parallel_group(),
                  "tensor-parallel": self.grid.get_slice_parallel_group(),
                  "model-parallel": self.grid.get_model_parallel_group(),
                  "point-to-point": self.p2p.group if self.p2p is not None else None}
        for key in sorted(self.module.tied_comms):
            groups[f"tied-weight '{key}'"] = self.module.tied_comms[key]["group"]
        return groups

    # --- public API ------------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def set_dataiterator(self, iterator) -> None:
        """Iterator of (inputs, labels) per micro-batch; only the first and last stage keep it."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_dataloader(self, loader) -> None:
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the number of micro-batches (micro-batch size stays)."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def set_batch_fn(self, fn) -> None:
        """Post-process every loaded (inputs, labels) item with `fn` before use."""
        self.batch_fn = fn

    def _build_data_iter(self, dataset) -> None:
        from deepspeed.runtime.dataloader import RepeatingLoader
        sampler = torch.utils.data.distributed.DistributedSampler(
            dataset, num_replicas=self.dp_world_size, rank=self.grid.get_data_parallel_rank(), shuffle=False)
        self.set_dataloader(RepeatingLoader(self.deepspeed_io(dataset, data_sampler=sampler)))

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over m micro-batches; returns the mean micro-batch loss on every stage."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled; use eval_batch() for inference")
        state = _BatchState(training=True)
        with self._mode(training=True, data_iter=data_iter, keep_iter=True):
            self._run(train_schedule(self.schedule_kind, self.num_stages, self.stage_id, self.micro_batches),
                      state)
            return self._aggregate_loss(state.losses)

    def eval_batch(self, data_iter, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None):
        """Forward-only pass over `num_micro_batches` (default m) micro-batches; weights are not touched.

        Returns the mean loss (DP-averaged, broadcast to all stages when `bcast_loss`), or with
        `return_logits=True` the pair (loss, logits) where logits is the list of last-stage outputs per
        micro-batch on the last stage and None elsewhere. With `compute_loss=False` the loss is None.
        """
        if reduce_output != "avg":
            raise ValueError(f"reduce_output must be 'avg' (mean over micro-batches), got {reduce_output!r}")
        state = _BatchState(training=False, compute_loss=compute_loss, keep_logits=return_logits)
        m = self.micro_batches if num_micro_batches is None else num_micro_batches
        with self._mode(training=False, data_iter=data_iter), torch.no_grad():
            self._run(eval_schedule(self.num_stages, self.stage_id, m), state)
            loss = self._aggregate_loss(state.losses, broadcast=bcast_loss) if compute_loss else None
        if return_logits:
            return loss, (state.logits if self.is_last_stage() else None)
        return loss

    @contextlib.contextmanager
    def _mode(self, training: bool, data_iter=None, keep_iter: bool = False):
        """Run a batch in train/eval mode with `data_iter` (if given) as the data iterator. Afterwards the
        module's mode is what it was before, and so is the iterator, except that a successful train_batch
        keeps the one it was given (DeepSpeed's semantics). An exception restores both."""
        if self._broken is not None:
            raise PipelineCommError(self._broken)
        was_training, saved = self.module.training, (self.data_iterator, self.training_dataloader)
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train(training)
        ok = False
        try:
            yield
            ok = True
        except BaseException as err:
            self._abandon_batch(err)
            raise
        finally:
            self.module.train(was_training)
            if data_iter is not None and not (ok and keep_iter):
                self.data_iterator, self.training_dataloader = saved

    def forward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: use train_batch() or eval_batch()")

    def backward(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: use train_batch() or eval_batch()")

    def step(self, *args, **kwargs):
        raise PipelineError("a pipeline engine runs whole batches: use train_batch() or eval_batch()")

    def is_gradient_accumulation_boundary(self) -> bool:
        """True only while the schedule reduces gradients or steps the optimizer."""
        return self._force_grad_boundary

    def _backward_prologue_per_tensor(self, grad):
        # Gradients arriving from the next stage are already divided by m on the last stage.
        return super()._backward_prologue_per_tensor(grad) if self.is_last_stage() else grad

    # --- executor --------------------------------------------------------------------------------------
    def _run(self, instructions: list[Instruction], state: _BatchState) -> None:
        handlers = {Op.LOAD: self._exec_load, Op.RECV_ACT: self._exec_recv_act, Op.FORWARD: self._exec_forward,
                    Op.SEND_ACT: self._exec_send_act, Op.RECV_GRAD: self._exec_recv_grad,
                    Op.BACKWARD: self._exec_backward, Op.SEND_GRAD: self._exec_send_grad,
                    Op.REDUCE_TIED: self._exec_reduce_tied, Op.REDUCE_GRADS: self._exec_reduce_grads,
                    Op.STEP: self._exec_step}
        recvs = [ins.micro_batch for ins in instructions if ins.op == Op.RECV_ACT]
        state.last_recv = recvs[-1] if recvs else -1
        try:  # exceptions: see _mode
            for ins in instructions:
                with self.comm.guard(f"instruction {ins}", self._comm_in(ins.op)):
                    handlers[ins.op](ins, state)
            if self.p2p is not None:
                self.p2p.wait_sends()
        finally:
            self._force_grad_boundary = False

    def _reset_backward_state(self) -> None:
        """Undo what a backward interrupted by an exception leaves behind: partial gradients and ZeRO's
        backward depth (DeepSpeed itself leaves both)."""
        self._running_engine_backward, self._running_engine_backward_count = False, 0
        if isinstance(self.optimizer, ZeROOptimizer):
            self.optimizer._backward_active_depth = 0
        self.optimizer.zero_grad()

    def _comm_in(self, op: Op) -> str:
        """What communicates inside an instruction, for the error message when it fails."""
        c = self.comm
        return {Op.LOAD: f"a collective of the data iterator over {c.describe('tensor-parallel')}",
                Op.RECV_ACT: f"the activation receive / all_gather over {c.describe('tensor-parallel')}",
                Op.RECV_GRAD: f"the gradient receive / all_gather over {c.describe('tensor-parallel')}",
                Op.FORWARD: f"a collective inside the layers over {c.describe('tensor-parallel')}",
                Op.BACKWARD: f"a collective inside the layers over {c.describe('tensor-parallel')}",
                Op.SEND_ACT: "the activation send", Op.SEND_GRAD: "the gradient send",
                Op.REDUCE_TIED: "the tied-weight gradient all_reduce over "
                                + c.describe(*[n for n in c.groups if n.startswith("tied")]),
                Op.REDUCE_GRADS: f"the gradient all_reduce over {c.describe('data-parallel')}",
                Op.STEP: f"the optimizer step's all_gather / grad-norm all_reduce over "
                         f"{c.describe('data-parallel', 'model-parallel')}"}[op]

    def _abandon_batch(self, err: BaseException) -> None:
        """After a failure inside a batch: drop its receives posted ahead and sends in flight, and refuse
        further batches on a multi-stage pipeline (messages of the failed batch may still arrive and would
        be taken for the next batch's), with the reason."""
        self._reset_backward_state()
        if self.p2p is None:
            return
        self.p2p.pending.clear()
        self.boundary.discard_posted()
        self._broken = (f"pipeline stage {self.stage_id}: a previous batch failed ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); point-to-point messages of that batch "
                        f"may still be in flight, so this engine runs no further batch: restart the job (resume "
                        f"from the last checkpoint)")

    def _exec_load(self, ins: Instruction, state: _BatchState) -> None:
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
        if self.is_first_stage():
            # copied, as DeepSpeed does: a layer that changes its input in place (nn.ReLU(inplace=True),
            # partitioned activation checkpointing) must not change the user's batch
            state.inputs[ins.micro_batch] = _to_device(batch[0], dev, detach=True, copy=True)
        if self.is_last_stage():
            state.labels[ins.micro_batch] = _to_device(batch[1], dev, detach=True)

    def _exec_recv_act(self, ins: Instruction, state: _BatchState) -> None:
        more = ins.micro_batch != state.last_recv
        state.inputs[ins.micro_batch] = self.boundary.recv_activations(self.prev_rank, str(ins), state.training, more)

    def _exec_forward(self, ins: Instruction, state: _BatchState) -> None:
        mb = ins.micro_batch
        keep = state.training and not self.is_first_stage()  # kept for send_grads
        inputs = state.inputs[mb] if keep else state.inputs.pop(mb)
        outputs = DeepSpeedEngine.forward(self, inputs)
        if not self.is_last_stage():
            state.outputs[mb] = outputs
            return
        if state.keep_logits:
            state.logits.append(_detach(outputs))
        if not state.compute_loss:
            return
        loss = self.module.loss_fn(outputs, state.labels.pop(mb)) if self.module.loss_fn else outputs
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError(f"pipeline stage {self.stage_id}, {ins}: the loss must be a scalar tensor, got "
                             f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))}")
        state.losses.append(loss.detach().float().reshape(()))
        if state.training:
            state.loss_graphs[mb] = loss

    def _exec_send_act(self, ins: Instruction, state: _BatchState) -> None:
        out = state.outputs[ins.micro_batch] if state.training else state.outputs.pop(ins.micro_batch)
        self.boundary.send_activations(out, self.next_rank, str(ins))

    def _exec_recv_grad(self, ins: Instruction, state: _BatchState) -> None:
        state.grads[ins.micro_batch] = self.boundary.recv_grads(state.outputs[ins.micro_batch], self.next_rank,
                                                                str(ins))

    def _exec_backward(self, ins: Instruction, state: _BatchState) -> None:
        """DeepSpeed's backward protocol on every stage: the hooks DeepSpeedEngine.forward put on the stage's
        outputs run the prologue when the first gradient arrives, `_backward_epilogue` closes it (ZeRO's
        backward depth back to 0, BF16_Optimizer's fp32 accumulation), as `DeepSpeedEngine.backward` does."""
        mb = ins.micro_batch
        if self.is_last_stage():
            DeepSpeedEngine.backward(self, self._fp16_scaled(state.loss_graphs.pop(mb)))
            return
        outputs = (state.outputs.pop(mb),) if torch.is_tensor(state.outputs[mb]) else state.outputs.pop(mb)
        declared = [t for d, t in zip(self.boundary.decls, outputs) if d.grad]
        pairs = [(t, g) for t, g in zip(declared, state.grads.pop(mb)) if t.requires_grad]
        if not pairs:
            return  # no gradient reaches this stage's parameters: no prologue ran, nothing to close
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # as DeepSpeed's pipeline engine; the prologue hook repeats it
        with self._engine_backward():
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            self._backward_epilogue()

    @contextlib.contextmanager
    def _engine_backward(self):
        """DeepSpeedEngine.backward's marker: DeepSpeed's post-backward hook leaves the epilogue to us."""
        with self._running_engine_backward_lock:
            self._running_engine_backward_count += 1
            self._running_engine_backward = True
        try:
            yield
        finally:
            with self._running_engine_backward_lock:
                self._running_engine_backward_count -= 1
                self._running_engine_backward = self._running_engine_backward_count > 0

    def _fp16_scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed 0.19's engine.backward applies the fp16 loss scale only for ZeRO optimizers, while
        FP16_Optimizer / FP16_UnfusedOptimizer (ZeRO stage 0) unscale the gradients in step(): scale here."""
        cfg = getattr(self.optimizer, "loss_scale_config", None)
        if not self.fp16_enabled() or isinstance(self.optimizer, ZeROOptimizer) or cfg is None:
            return loss
        return loss.float() * cfg.cur_scale if cfg.use_grad_scaling else loss

    def _exec_send_grad(self, ins: Instruction, state: _BatchState) -> None:
        self.boundary.send_grads(state.inputs.pop(ins.micro_batch), self.prev_rank, str(ins))

    def _exec_reduce_tied(self, ins: Instruction, state: _BatchState) -> None:
        """Sum tied-weight gradients over the stages that share them, keys in sorted order on every rank."""
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.requires_grad:  # frozen on every rank alike
                dist.all_reduce(self._tied_grad(weight), group=group)

    def _tied_grad(self, weight: torch.nn.Parameter) -> torch.Tensor:
        """The gradient the optimizer reads for a tied weight; zeros where the weight was unused on this stage
        this batch, so the collective is never skipped. BF16_Optimizer reads its fp32 accumulator, which exists
        for every parameter (`_hp_grad` is only set once a gradient was accumulated)."""
        if self.using_bf16_optimizer:
            i, j = self._bf16_slot(weight)
            self.optimizer.fp32_groups_has_gradients[i][j] = True
            weight._hp_grad = self.optimizer.fp32_groups_gradients[i][j]
            return weight._hp_grad
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        return weight.grad

    def _bf16_slot(self, weight: torch.nn.Parameter) -> tuple[int, int]:
        for i, group in enumerate(self.optimizer.bf16_groups):
            for j, lp in enumerate(group):
                if lp is weight:
                    return i, j
        raise RuntimeError(f"pipeline stage {self.stage_id}: tied weight {tuple(weight.shape)} is not in the "
                           f"BF16 optimizer's parameter groups")

    def _exec_reduce_grads(self, ins: Instruction, state: _BatchState) -> None:
        self._force_grad_boundary = True
        if self.using_bf16_optimizer:
            self.buffered_allreduce_fallback(grads=None, elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
        else:
            self.allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)
        self._force_grad_boundary = False  # (and in _run's finally, if this raises)

    def _exec_step(self, ins: Instruction, state: _BatchState) -> None:
        self._force_grad_boundary = True
        self._take_model_step(None)
        self._force_grad_boundary = False

    # --- loss ------------------------------------------------------------------------------------------
    def _aggregate_loss(self, losses: list, broadcast: bool = True) -> torch.Tensor:
        """mean over micro-batches (last stage), mean over DP replicas, broadcast over the pipeline."""
        dev = tds_device.device()
        with self.comm.guard("loss", f"the loss all_reduce / broadcast over "
                                     f"{self.comm.describe('data-parallel', 'pipeline')}"):
            if self.is_last_stage():
                loss = torch.stack(losses).mean() if losses else torch.zeros((), device=dev)
                if self.dp_world_size > 1:
                    dist.all_reduce(loss, group=self.grid.get_data_parallel_group())
                    loss /= self.dp_world_size
            else:
                loss = torch.zeros((), dtype=torch.float32, device=dev)
            if broadcast and self.num_stages > 1:
                src = self.grid.stage_to_global(self.num_stages - 1)
                dist.broadcast(loss, src=src, group=self.grid.get_pipe_parallel_group())
        return loss

    # --- checkpoints: one file per layer (DeepSpeed's layout) ---------------------------------------------
    def module_state_dict(self, exclude_frozen_parameters: bool = False):
        """Called by save_checkpoint(): writes the per-layer files and returns None (DeepSpeed's protocol)."""
        self.module.save_state_dict(self._curr_ckpt_path, checkpoint_engine=self.checkpoint_engine,
                                    exclude_frozen_params=exclude_frozen_parameters)
        return None

    def load_module_state_dict(self, checkpoint, strict=True, custom_load_fn=None, fetch_z3_params=False,
                               z3_params_to_fetch=None, allowed_missing_keys=None):
        """Called by load_checkpoint(): reads the per-layer files of the checkpoint being loaded."""
        state_dict = checkpoint["module"] if isinstance(checkpoint, dict) else checkpoint
        if state_dict is not None and not isinstance(state_dict, str):
            return super().load_module_state_dict(checkpoint, strict)
        self.module.load_state_dir(load_dir=self._curr_ckpt_path, strict=strict,
                                   checkpoint_engine=self.checkpoint_engine)

    def load_module_weights(self, load_dir: str, tag: str | None = None, strict: bool = True) -> None:
        """Load only module weights from per-layer files, whatever pipeline degree wrote them."""
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        self.module.load_state_dir(load_dir=os.path.join(load_dir, str(tag)), strict=strict,
                                   checkpoint_engine=self.checkpoint_engine)
        self._sync_optimizer_weights()

    def _sync_optimizer_weights(self) -> None:
        """Copy freshly loaded module weights into the optimizer's master copies (fp16/bf16/ZeRO)."""
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()


def _to_device(value, dev: torch.device, detach: bool, copy: bool = False):
    if torch.is_tensor(value):
        value = value.to(dev, copy=copy)
        return value.detach() if detach else value
    if isinstance(value, (tuple, list)):
        return tuple(_to_device(v, dev, detach, copy) for v in value)
    return value


def _detach(value):
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return tuple(_detach(v) for v in value)
    return value
