"""`PipelineModule`: DeepSpeed's PipelineModule plus the declared stage-boundary layout, explicit partition
boundaries and activation checkpointing that does not look at class names.

Reused from DeepSpeed unchanged: LayerSpec/TiedLayerSpec building, 'parameters'/'uniform' partitioning,
tied-weight groups and broadcast, per-layer checkpoint files (`layer_XX[-model_YY]-model_states.pt`).

Partitioning (`partition_method`): stage s builds layers [parts[s], parts[s+1]).
- a list of num_stages+1 ints: the boundaries themselves, e.g. [0, 3, 7] for 2 stages;
- 'parameters': balance trainable parameter counts; 'uniform': balance layer counts (lambdas count);
- 'type:REGEX': balance the number of layers whose class name matches REGEX (case-insensitive);
  only LayerSpecs and nn.Modules are matched, plain functions and lambdas never count.

Activation checkpointing: with `activation_checkpoint_interval = k > 0` every run of k consecutive layers
is recomputed in backward, whatever the layers are. `activation_checkpoint_func(fn, *args)` defaults to
`non_reentrant_checkpoint`; `reentrant_checkpoint` (or any function with that signature, such as
`deepspeed.checkpointing.checkpoint`) also works: when no input of a segment requires grad, a dummy
input that does is passed so that reentrant recomputation still reaches the segment's parameters.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule as _DSPipelineModule

from .. import device as tds_device
from .meta import PipelineLayoutError, TensorDecl, make_declarations


def non_reentrant_checkpoint(fn: Callable, *args):
    """torch.utils.checkpoint without reentrancy (saves RNG state, inputs need not require grad)."""
    return torch_checkpoint(fn, *args, use_reentrant=False)


def reentrant_checkpoint(fn: Callable, *args):
    """torch.utils.checkpoint's reentrant variant."""
    return torch_checkpoint(fn, *args, use_reentrant=True)


class PipelineModule(_DSPipelineModule):
    """DeepSpeed PipelineModule with declared boundary tensors; see the module docstring.

    Extra arguments (each may instead be set as the attribute of the same name with a leading underscore
    after construction, as TDS/CPM models do: `model._input_grad = [True, False]`):
        input_grad: per tuple position, whether a gradient flows back through it.
        input_type: per tuple position, 'float' | 'int' | 'bool' | a dtype name such as 'bfloat16'/'int64'.
        input_pipe_partitioned: per tuple position, whether the tensor is split across the tensor-parallel
            group for the hop (default: no position).
    """

    def __init__(self, layers, num_stages: Optional[int] = None, topology=None, loss_fn=None,
                 seed_layers: bool = False, seed_fn=None, base_seed: int = 1234,
                 partition_method="parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = non_reentrant_checkpoint,
                 input_grad: Optional[Sequence[bool]] = None, input_type: Optional[Sequence[str]] = None,
                 input_pipe_partitioned: Optional[Sequence[bool]] = None):
        super().__init__(layers, num_stages=num_stages, topology=topology, loss_fn=loss_fn,
                         seed_layers=seed_layers, seed_fn=seed_fn, base_seed=base_seed,
                         partition_method=partition_method,
                         activation_checkpoint_interval=activation_checkpoint_interval,
                         activation_checkpoint_func=activation_checkpoint_func)
        self._input_grad = input_grad
        self._input_type = input_type
        self._input_pipe_partitioned = input_pipe_partitioned

    # --- declared layout -------------------------------------------------------------------------------
    def declarations(self) -> list[TensorDecl]:
        """The stage-boundary declaration; an error if a multi-stage pipeline has none."""
        if self._input_grad is None or self._input_type is None:
            if self.num_stages == 1:
                return []
            raise PipelineLayoutError(
                f"a {self.num_stages}-stage pipeline needs the layout of the tuple passed between stages: set "
                f"model._input_grad (e.g. [True, False]) and model._input_type (e.g. ['float', 'bool']) before "
                f"tds.initialize (got _input_grad={self._input_grad}, _input_type={self._input_type})")
        return make_declarations(self._input_grad, self._input_type, self._input_pipe_partitioned)

    # --- partitioning ----------------------------------------------------------------------------------
    def _partition_layers(self, method="parameters"):
        if not isinstance(method, (list, tuple)):
            return super()._partition_layers(method=method)
        parts = [int(b) for b in method]
        n = len(self._layer_specs)
        ok = len(parts) == self.num_stages + 1 and parts[0] == 0 and parts[-1] == n
        if not ok or any(a > b for a, b in zip(parts, parts[1:])):
            raise ValueError(f"partition_method as a list must be {self.num_stages + 1} non-decreasing layer "
                             f"boundaries from 0 to {n} (num_stages={self.num_stages}, layers={n}), got {parts}")
        self.parts = parts
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])

    def _find_layer_type(self, layername: str) -> list[int]:
        import regex
        pattern = regex.compile(layername, regex.IGNORECASE)
        idxs = []
        for idx, layer in enumerate(self._layer_specs):
            if isinstance(layer, LayerSpec):
                name = layer.typename.__name__
            elif isinstance(layer, torch.nn.Module):
                name = layer.__class__.__name__
            else:
                continue  # functions and lambdas never count
            if pattern.search(name):
                idxs.append(idx)
        if not idxs:
            raise RuntimeError(f"partition_method 'type:{layername}' matched no layer class names")
        return idxs

    # --- forward with activation checkpointing by interval -----------------------------------------------
    def _is_checkpointable(self, funcs) -> bool:
        return True  # every interval is checkpointed; eligibility never depends on class names

    def _precompute_checkpointable_values(self):
        pass  # forward() below needs no precomputed eligibility

    @torch.no_grad()
    def _synchronize_tied_weights(self):
        """Broadcast tied weights from their lowest rank, in sorted key order on every rank, outside autograd
        (DeepSpeed broadcasts parameters in grad mode, which records the collective into the graph)."""
        for key in sorted(self.tied_comms):
            comm = self.tied_comms[key]
            for attr_name in comm['weight_attr']:
                torch.distributed.broadcast(self._recursive_getattr(comm['module'], attr_name),
                                            src=min(comm['ranks']), group=comm['group'])

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval

    def _run_layers(self, start: int, end: int, x, micro_offset: int):
        for idx, layer in enumerate(self.forward_funcs[start:end]):
            self.curr_layer = start + idx + self._local_start
            if self.seed_layers:
                seed = self.base_seed * micro_offset + self.curr_layer
                (self.seed_fn or ds_utils.set_random_seed)(seed)
            x = layer(x)
        return x

    def forward(self, forward_input):
        self.micro_offset += 1
        offset = self.micro_offset + 1
        n, k = len(self.forward_funcs), self.activation_checkpoint_interval
        if k <= 0:
            return self._run_layers(0, n, forward_input, offset)
        x = forward_input
        for start in range(0, n, k):
            x = self._checkpoint_segment(start, min(start + k, n), x, offset)
        return x

    def _checkpoint_segment(self, start: int, end: int, x, offset: int):
        was_tuple = isinstance(x, tuple)
        args = x if was_tuple else (x,)
        if any(torch.is_tensor(a) and a.requires_grad for a in args):
            def run(*inputs):
                return self._run_layers(start, end, inputs if was_tuple else inputs[0], offset)
            return self.activation_checkpoint_func(run, *args)

        def run_with_dummy(_dummy, *inputs):
            return self._run_layers(start, end, inputs if was_tuple else inputs[0], offset)
        dummy = torch.ones(1, device=tds_device.device(), requires_grad=torch.is_grad_enabled())
        return self.activation_checkpoint_func(run_with_dummy, dummy, *args)
