"""TDS `PipelineEngine`: DeepSpeedEngine (ZeRO-1, fp16/bf16 optimizers, checkpoint files) driven by a
schedule from `instructions.py`, moving the model's declared boundary tuple with `boundary.py`.

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

import torch
import torch.distributed as dist

from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE, DeepSpeedEngine
from deepspeed.runtime.pipe.module import PipelineError
from deepspeed.runtime.utils import is_model_parallel_parameter

from .. import device as tds_device
from ..safe_load import make_safe
from . import recompute, stage_loss
from .bf16_tail import FlatBF16Optimizer, adopt
from .boundary import Boundary
from .collectives import CommGuard, apply_timeout, resolve_timeout
from .executor import BatchState, StageContext, StageExecutor
from .expert_grads import ExpertParallelEngine, expert_params, is_expert, reduce_expert_grads, squares_summed
from .finite import FiniteCheck, local_grads
from .fixed_order import MicroBatchGrads, pairwise_sum_rows, power_of_two
from .fixed_zero import FixedOrderZero, adopt as adopt_fixed_zero, clip_coefficient
from .module import PipelineModule
from .p2p import P2P, PipelineCommError
from .instructions import Op, check_schedule, eval_schedule, train_schedule
from .timeline import StageTimeline
from .weight_grad import WeightGradStore, attach


class PipelineEngine(ExpertParallelEngine, DeepSpeedEngine):
    """Built by `tds.initialize` for a `tds.pipe.PipelineModule`; use `train_batch` / `eval_batch`."""

    def __init__(self, *args, checkpoint_engine_wrap=None, **kwargs):
        super().__init__(*args, **kwargs)
        make_safe(self)  # DeepSpeed's own checkpoint reads: weights_only=True and the allowlist
        if checkpoint_engine_wrap is not None:  # tds.initialize's: a program's own checks around every file
            self.checkpoint_engine = checkpoint_engine_wrap(self.checkpoint_engine)
        if not isinstance(self.module, PipelineModule):
            raise TypeError(f"model must be a tds.pipe.PipelineModule, got {type(self.module).__name__}")
        if self.zero_optimization_stage() >= 2:
            raise ValueError(f"ZeRO stage {self.zero_optimization_stage()} is not supported with pipeline "
                             f"parallelism; use zero_optimization.stage 0 or 1")
        self.enable_backward_allreduce = False  # the schedule reduces gradients once per batch
        self.using_bf16_optimizer = isinstance(self.optimizer, BF16_Optimizer)  # bf16_tail's subclass included
        self._force_grad_boundary = False
        self.grid = self.module._grid
        self.num_stages = self.grid.pipe_parallel_size
        self.stage_id = self.grid.get_stage_id()
        self.micro_batch_size = self.train_micro_batch_size_per_gpu()
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator = None
        self.batch_fn = None
        self._configure_pipeline(self._config.pipeline)
        self.fixed = self._configure_layout_invariant(self._config.pipeline)
        self._norm_index = None  # the fixed-order norm's positions (`_fixed_order_norm`)
        self.module.checkpoint_parallel_write_pipeline = self._config.checkpoint_parallel_write_pipeline
        if self.training_data:
            self._build_data_iter(self.training_data)

    def _configure_pipeline(self, cfg: dict) -> None:
        self._configure_schedule(cfg)
        timeout, source = resolve_timeout(cfg)
        self.module.configure_checkpointing(self._config)  # interval, use_reentrant, activation_checkpointing
        decls = self.module.declarations() if self.num_stages > 1 else []
        self.p2p = P2P(self.stage_id, timeout, self.grid.get_pipe_parallel_group()) if self.num_stages > 1 else None
        self.boundary = Boundary(self.p2p, decls, self.grid.get_slice_parallel_group(),
                                 self.grid.get_slice_parallel_world_size(), self.grid.get_slice_parallel_rank(),
                                 tds_device.device(), log_layout=self.grid.get_data_parallel_rank() == 0
                                 and self.grid.get_slice_parallel_rank() == 0)
        p = self.num_stages  # peers round the ring: interleaved chunks hop from stage p-1 to stage 0 and back
        self.prev_rank = self.grid.stage_to_global((self.stage_id - 1) % p) if p > 1 else None
        self.next_rank = self.grid.stage_to_global((self.stage_id + 1) % p) if p > 1 else None
        # A receive posted ahead takes the next message from the previous stage. With two stages and
        # interleaving that link also carries gradients (stage 1 -> 0), so receives are posted when reached.
        self._receive_ahead = not (p == 2 and self.virtual_stages > 1)
        groups = self._process_groups()
        apply_timeout(groups, timeout)
        self.comm = CommGuard(self.stage_id, timeout, source, groups)
        self._loss_comm = f"the loss all_reduce / broadcast over {self.comm.describe('data-parallel', 'pipeline')}"
        self._broken: str | None = None  # why point-to-point state is unknown after a failed batch
        self.timeline = StageTimeline.from_config(cfg, self.grid, self.comm)
        self.finite = FiniteCheck(self.stage_id, p, dist.get_rank(), dist.get_world_size(),
                                  (self.grid.get_model_parallel_group(), self.grid.get_data_parallel_group())) \
            if cfg.get("check_finite", False) else None
        self.executor = StageExecutor(StageContext(
            stage_id=self.stage_id, num_stages=p, chunks=self.virtual_stages, prev_rank=self.prev_rank,
            next_rank=self.next_rank, receive_ahead=self._receive_ahead, module=self.module, boundary=self.boundary,
            p2p=self.p2p, weight_grads=self.weight_grads, comm=self.comm, comm_in=self._describe_comms(),
            finite=self.finite,
            reports=self.grid.get_data_parallel_rank() == 0 and self.grid.get_slice_parallel_rank() == 0,
            engine=self))

    def _configure_schedule(self, cfg: dict) -> None:
        """pipeline.schedule (default: 'interleaved' for a module built with virtual stages, else '1f1b') and
        pipeline.virtual_stages (default: the module's), checked against the module and the batch."""
        built = self.module.virtual_stages
        self.schedule_kind = str(cfg.get("schedule", "interleaved" if built > 1 else "1f1b")).lower()
        self.virtual_stages = int(cfg.get("virtual_stages", built))
        if self.virtual_stages != built or (self.schedule_kind == "interleaved" and built == 1):
            v = max(self.virtual_stages, 2)
            raise ValueError(f"pipeline.schedule '{self.schedule_kind}' with pipeline.virtual_stages="
                             f"{self.virtual_stages} needs the model built with as many chunks per stage, but the "
                             f"PipelineModule has virtual_stages={built}; build it with "
                             f"PipelineModule(..., virtual_stages={v}) and set \"virtual_stages\": {v}")
        check_schedule(self.schedule_kind, self.num_stages, self.micro_batches, self.virtual_stages)
        self.weight_grads = WeightGradStore() if self.schedule_kind == "zb-h1" else None
        attach(self.module, self.weight_grads)  # layers with a weight_grad_store attribute (weight_grad.py)
        self._loss_backward = False  # inside the loss unit's DeepSpeedEngine.backward
        self.last_batch_stats: dict = {}

    def _configure_layout_invariant(self, cfg: dict) -> MicroBatchGrads | None:
        """pipeline.layout_invariant (fixed_order.py): gradients, the loss and the gradient norm summed in one fixed
        order over the batch's micro-batches, so that every (dp, gas, pp) split of one batch gives the same bits."""
        if not cfg.get("layout_invariant", False):
            return None
        dp, why = self.dp_world_size, None
        if not power_of_two(dp):
            why = (f"sums over the data-parallel replicas in a fixed tree, which needs their number to be a power of "
                   f"two; got data-parallel size {dp}")
        elif self.schedule_kind == "zb-h1":
            why = ("needs each micro-batch's gradients complete after its backward, and ZB-H1 defers the weight "
                   "gradients past the next one's; use the 1f1b, gpipe or interleaved schedule")
        elif self.fp16_enabled() or self.bfloat16_enabled():
            why = (f"runs in fp32 (the fp16 and bf16 optimizers sum and clip in their own order); got "
                   f"fp16={self.fp16_enabled()}, bf16={self.bfloat16_enabled()}")
        if why is not None:
            raise ValueError(f"pipeline.layout_invariant {why}")
        if self.zero_optimization():  # ZeRO-1: its partitioned step on the settled gradients (fixed_zero.py)
            adopt_fixed_zero(self.optimizer, self._fixed_order_norm)
        self.module.split_tied_sites()
        return MicroBatchGrads(self.module.gradient_slots(), self.grid.get_data_parallel_group(), dp)

    def _configure_bf16_optimizer(self, optimizer):
        """DeepSpeed's BF16_Optimizer with TDS's flat accumulation, foreach norm and device-side clip
        (`bf16_tail`): no Python loop over parameters per micro-batch, one host read per step.
        `"pipeline": {"flat_bf16_tail": false}` keeps DeepSpeed's own (to measure one against the other)."""
        built = super()._configure_bf16_optimizer(optimizer)
        return adopt(built) if self._config.pipeline.get("flat_bf16_tail", True) else built

    def _copy_recovery_script(self, save_path: str) -> None:
        """DeepSpeed copies zero_to_fp32.py into every save; `"pipeline": {"recovery_script": false}` skips it
        (for checkpoints the script cannot read, such as those whose layers are saved in another format)."""
        if self._config.pipeline.get("recovery_script", True):
            super()._copy_recovery_script(save_path)

    def _process_groups(self) -> dict:
        """{name: group} of every group this engine (and the model's tied weights) runs collectives on; the
        point-to-point transport runs on the pipeline group."""
        groups = {"data-parallel": self.grid.get_data_parallel_group(),
                  "pipeline": self.grid.get_pipe_parallel_group(),
                  "tensor-parallel": self.grid.get_slice_parallel_group(),
                  "model-parallel": self.grid.get_model_parallel_group()}
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
        micro_batches = train_batch_size // (self.micro_batch_size * self.dp_world_size)
        check_schedule(self.schedule_kind, self.num_stages, max(1, micro_batches), self.virtual_stages)
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def _reentrant_activation_checkpointing(self) -> bool:
        """DeepSpeed 0.19.8's decision: the module recomputes with a reentrant function, so the first stage's
        float inputs must require grad (a reentrant segment whose inputs do not is cut off from autograd).
        Read from the module at each call, so set_checkpoint_interval() after initialize counts."""
        if self.module.activation_checkpoint_interval <= 0:
            return False
        return recompute.is_reentrant(self.module.activation_checkpoint_func)

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
        state = BatchState(training=True)
        if self.finite is not None:
            self.finite.reset()
        if isinstance(self.optimizer, FlatBF16Optimizer):
            self.optimizer.attach()  # the bf16 gradients are views of its flat buffers (once per batch)
        if self.fixed is not None:
            self.module.refresh_sites()
            self.fixed.begin(self.micro_batches)
        one = torch.ones((), device=tds_device.device(), requires_grad=True).clone()  # a loss to DeepSpeed's scaler
        stage_loss.set_scale(self._scaled_loss(one).detach())  # what each micro-batch's loss is multiplied by
        with self._mode(training=True, data_iter=data_iter, keep_iter=True):
            recorder = self.timeline.begin(self.global_steps + 1) if self.timeline is not None else None
            self._run(train_schedule(self.schedule_kind, self.num_stages, self.stage_id, self.micro_batches,
                                     self.virtual_stages), state, recorder)
            if recorder is not None:
                self.timeline.maybe_write({"schedule": self.schedule_kind, "stages": self.num_stages,
                                           "micro_batches": self.micro_batches,
                                           "virtual_stages": self.virtual_stages, "time_unit": "s"})
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
        state = BatchState(training=False, compute_loss=compute_loss, keep_logits=return_logits)
        m = self.micro_batches if num_micro_batches is None else num_micro_batches
        if self.fixed is not None:
            self.module.refresh_sites()
        with self._mode(training=False, data_iter=data_iter), torch.no_grad():
            self._run(eval_schedule(self.num_stages, self.stage_id, m, self.virtual_stages), state)
            loss = self._aggregate_loss(state.losses, broadcast=bcast_loss) if compute_loss else None
        if return_logits:
            return loss, (state.logits if self.is_last_stage() else None)
        return loss

    def _run(self, instructions: list, state: BatchState, recorder=None) -> None:
        try:
            self.last_batch_stats = self.executor.run(instructions, state, recorder)
        finally:
            self._force_grad_boundary = False

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
        # Gradients arriving from the next (virtual) stage are already divided by m at the loss.
        return super()._backward_prologue_per_tensor(grad) if self._loss_backward else grad

    def clip_fp32_gradients(self) -> None:
        """Clip to `gradient_clipping` (fp32 without ZeRO) by the norm of the whole model, and record it.

        DeepSpeed's clip_grad_norm_, given the pipeline grid, counts a gradient that is not tensor-parallel only
        where the rank in the pipe x tensor group is 0, i.e. on pipeline stage 0: the other stages' norms and
        biases were left out of the norm. Here every stage counts its own parameters, tensor-parallel rank 0 the
        replicated ones, and a tied weight's later copies (`ds_pipe_replicated`) not at all:

            norm = sqrt( sum over the pipe x tensor group of the counted squared gradient norms )

        As foreach operations on the device, without a host read: one torch._foreach_norm, one all-reduce, the
        coefficient min(1, clip / (norm + 1e-6)) as a tensor, one torch._foreach_mul_ (the loop reads the norm
        after the step).
        """
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.fixed is not None:
            norm = self._fixed_order_norm()
        else:
            device, experts = tds_device.device(), self._expert_groups
            counted = [p for _, p in self._counted_params()]
            total = squares_summed(counted, self.grid.get_model_parallel_group(), device)
            if experts is not None:  # experts spread over ranks: each counted once (expert_grads.py)
                total = total + squares_summed(expert_params(self.module), experts["expert_model"], device)
            norm = total.sqrt()
        grads = [p.grad.detach() for p in params]
        if grads:
            torch._foreach_mul_(grads, clip_coefficient(self.gradient_clipping(), norm))
        self._global_grad_norm = norm

    def _counted_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of the gradients the norm counts on this rank (`clip_fp32_gradients`); the name
        carries the tensor-parallel rank where each rank holds a part."""
        tp_rank = self.grid.get_slice_parallel_rank()
        spread = self._expert_groups is not None  # experts spread over ranks are counted apart (`expert_grads`)
        return [(f"{name}#tp{tp_rank}" if is_model_parallel_parameter(p) else name, p)
                for name, p in self.module.named_parameters() if p.requires_grad
                and not getattr(p, "ds_pipe_replicated", False) and (tp_rank == 0 or is_model_parallel_parameter(p))
                and not (spread and is_expert(p))]

    def _fixed_order_norm(self) -> torch.Tensor:
        """The gradient norm with the squares summed in one order whatever the stages hold: each parameter's
        squared norm goes to its place in the sorted list of every counted name (the layers' global numbers name
        them alike at every pipeline split), the model-parallel ranks fill theirs (a + 0 == a), and the list is
        summed as fixed_order.pairwise_sum_rows sums."""
        counted = self._counted_params()
        group = self.grid.get_model_parallel_group()
        if self._norm_index is None:  # once: every model-parallel rank's names, in one sorted order
            names = [None] * dist.get_world_size(group=group)
            dist.all_gather_object(names, [n for n, _ in counted], group=group)
            order = {n: i for i, n in enumerate(sorted({n for ns in names for n in ns}))}
            self._norm_index = (len(order), torch.tensor([order[n] for n, _ in counted], dtype=torch.long,
                                                         device=tds_device.device()))
        size, where = self._norm_index
        squares = torch.zeros(size, dtype=torch.float32, device=tds_device.device())
        if counted:
            grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p) for _, p in counted]
            squares[where] = torch.stack(torch._foreach_norm(grads, 2.0)).float().pow(2)
        dist.all_reduce(squares, group=group)
        return pairwise_sum_rows(squares).sqrt()

    def _reset_backward_state(self) -> None:
        """Undo what a backward interrupted by an exception leaves behind: partial gradients and ZeRO's
        backward depth (DeepSpeed itself leaves both)."""
        self._running_engine_backward, self._running_engine_backward_count = False, 0
        if isinstance(self.optimizer, ZeROOptimizer):
            self.optimizer._backward_active_depth = 0
        self.optimizer.zero_grad()

    def _describe_comms(self) -> dict:
        """{Op: what communicates inside an instruction of that op}, for the error message when it fails."""
        c = self.comm
        return {Op.LOAD: f"a collective of the data iterator over {c.describe('tensor-parallel')}",
                Op.RECV_ACT: f"the activation receive / all_gather over {c.describe('tensor-parallel')}",
                Op.RECV_GRAD: f"the gradient receive / all_gather over {c.describe('tensor-parallel')}",
                Op.FORWARD: f"a collective inside the layers over {c.describe('tensor-parallel')}",
                Op.BACKWARD: f"a collective inside the layers over {c.describe('tensor-parallel')}",
                Op.BACKWARD_INPUT: f"a collective inside the layers over {c.describe('tensor-parallel')}",
                Op.BACKWARD_WEIGHT: "the weight-gradient computation (no collective)",
                Op.SEND_ACT: "the activation send", Op.SEND_GRAD: "the gradient send",
                Op.REDUCE_TIED: "the tied-weight gradient all_reduce over "
                                + c.describe(*[n for n in c.groups if n.startswith("tied")]),
                Op.REDUCE_GRADS: f"the gradient all_reduce over {c.describe('data-parallel')}",
                Op.STEP: f"the optimizer step's all_gather / grad-norm all_reduce over "
                         f"{c.describe('data-parallel', 'model-parallel')}"}

    def _abandon_batch(self, err: BaseException) -> None:
        """After a failure inside a batch: drop its receives posted ahead and sends in flight, and refuse
        further batches on a multi-stage pipeline (messages of the failed batch may still arrive and would
        be taken for the next batch's), with the reason."""
        self._reset_backward_state()
        if self.weight_grads is not None:
            self.weight_grads.clear()
        if self.p2p is None:
            return
        self.p2p.pending.clear()
        self.boundary.discard_posted()
        self._broken = (f"pipeline stage {self.stage_id}: a previous batch failed ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); point-to-point messages of that batch "
                        f"may still be in flight, so this engine runs no further batch: restart the job (resume "
                        f"from the last checkpoint)")

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

    # --- the executor's hooks (executor.EngineHooks) -------------------------------------------------------
    def _next_micro_batch(self, where: str):
        if self.data_iterator is None:
            raise RuntimeError(f"{where}: no data iterator; pass one to train_batch()/eval_batch() on the first "
                               f"and last stage")
        batch = next(self.data_iterator)
        return self.batch_fn(batch) if self.batch_fn is not None else batch

    def _stage_forward(self, inputs, **kwargs):
        return DeepSpeedEngine.forward(self, inputs, **kwargs)

    def _backward_loss(self, loss: torch.Tensor) -> None:
        self._loss_backward = True
        try:
            DeepSpeedEngine.backward(self, self._over_replicas(self._fp16_scaled(loss)))
        finally:
            self._loss_backward = False

    def _scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        loss = self._over_replicas(self._fp16_scaled(loss)) / self.gradient_accumulation_steps()
        return self.optimizer.scale_if_loss(loss) if isinstance(self.optimizer, ZeROOptimizer) else loss

    def _over_replicas(self, loss: torch.Tensor) -> torch.Tensor:
        """With fixed-order sums the replicas' gradients are summed, not averaged: each loss is divided by dp here
        (and by gas as before). dp is then a power of two, so (L / dp) / gas rounds once, to L / (dp gas)."""
        return loss / self.dp_world_size if self.fixed is not None and self.dp_world_size > 1 else loss

    def _micro_batch_done(self, chunk: int) -> None:
        """After each micro-batch's backward of model chunk `chunk`: fixed-order sums take its gradients."""
        if self.fixed is not None:
            self.fixed.take(chunk)

    def _settle_grads(self) -> None:
        """Before the tied-weight reduction: fixed-order sums write the batch's gradients into .grad."""
        if self.fixed is not None:
            self.fixed.settle()
            self.module.gather_site_grads()
            self.module.check_unslotted()

    @contextlib.contextmanager
    def _stage_backward(self):
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # as DeepSpeed's pipeline engine; the prologue hook repeats it
        with self._engine_backward():
            yield
            self._backward_epilogue()

    def _reduce_grads(self) -> None:
        if self.fixed is not None:  # summed over the replicas micro-batch by micro-batch (`_micro_batch_done`)
            if isinstance(self.optimizer, FixedOrderZero):
                self.optimizer.take_settled()  # ZeRO-1: this rank's partition, copied
            return
        if self._expert_groups is not None:  # experts spread over ranks: over their own group (expert_grads.py)
            reduce_expert_grads(expert_params(self.module), self._expert_groups["expert_data"], self.dp_world_size)
        if self.dp_world_size == 1 and not self.zero_optimization():
            return  # one replica: DeepSpeed would flatten, all-reduce over one rank and copy back, for nothing
        self._force_grad_boundary = True
        if self.using_bf16_optimizer:
            self.buffered_allreduce_fallback(grads=None, elements_per_buffer=MEMORY_OPT_ALLREDUCE_SIZE)
        else:
            self.allreduce_gradients(bucket_size=MEMORY_OPT_ALLREDUCE_SIZE)
        self._force_grad_boundary = False  # (and in _run's finally, if this raises)

    def _step_optimizer(self) -> None:
        tail = self.optimizer if isinstance(self.optimizer, FlatBF16Optimizer) else None
        if self.finite is not None:  # every rank agrees before any rank steps (finite.py)
            norm = tail.global_norm() if tail is not None else None
            self.finite.watch("gradients", local_grads(self.module, self.optimizer))
            value = self.finite.check(self.global_steps + 1, read=norm)  # the norm read with the agreement
            if tail is not None:
                tail.prepare(norm, value)
        self._force_grad_boundary = True
        self._take_model_step(None)
        self._force_grad_boundary = False

    # --- loss ------------------------------------------------------------------------------------------
    def _aggregate_loss(self, losses: list, broadcast: bool = True) -> torch.Tensor:
        """mean over micro-batches (last stage), mean over DP replicas, broadcast over the pipeline."""
        dev = tds_device.device()
        with self.comm.guard("loss", self._loss_comm):
            if self.is_last_stage() and self.fixed is not None and losses:
                loss = self._fixed_order_loss(torch.stack(losses))
            elif self.is_last_stage():
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

    def _fixed_order_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The mean of the batch's micro-batch losses, summed in the global micro-batch order j = k dp + r as the
        gradients are (fixed_order.py)."""
        dp = self.dp_world_size
        if dp > 1:
            rows = torch.empty(dp * local.numel(), dtype=local.dtype, device=local.device)
            dist.all_gather_into_tensor(rows, local, group=self.grid.get_data_parallel_group())
            local = rows.view(dp, -1).t().reshape(-1)
        return pairwise_sum_rows(local) / local.numel()

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
        with self.whole_experts(loading=True):
            self.module.load_state_dir(load_dir=os.path.join(load_dir, str(tag)), strict=strict,
                                       checkpoint_engine=self.checkpoint_engine)
        self._sync_optimizer_weights()

    def _sync_optimizer_weights(self) -> None:
        """Copy freshly loaded module weights into the optimizer's master copies (fp16/bf16/ZeRO)."""
        if hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()

