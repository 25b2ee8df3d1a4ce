"""`PipelineModule`: DeepSpeed's PipelineModule with the stage-boundary layout declared or inferred, explicit
partition boundaries, activation checkpointing that does not look at class names, and a quiet constructor.

Reused from DeepSpeed unchanged: LayerSpec/TiedLayerSpec building, 'parameters'/'uniform' partitioning,
the tied-weight broadcast, per-layer checkpoint files (`layer_XX[-model_YY]-model_states.pt`).
Every keyword of DeepSpeed 0.19's constructor is accepted; `dynamic_shape` is kept as an attribute and
changes nothing (shapes may always change between micro-batches here).

Partitioning (`partition_method`): stage s builds layers [parts[s], parts[s+1]).
- a list of num_stages+1 ints: the boundaries themselves, e.g. [0, 3, 7] for 2 stages;
- 'parameters': balance trainable parameter counts; 'uniform': balance layer counts (lambdas count);
- 'type:REGEX': balance the number of layers whose class name matches REGEX (case-insensitive);
  only LayerSpecs and nn.Modules are matched, plain functions and lambdas never count.

Virtual stages (`virtual_stages=v`, the interleaved schedule): the layers are cut into p*v parts by the
same methods (a list then holds p*v+1 boundaries), and stage s builds the v non-contiguous chunks
c = 0..v-1 made of parts c*p + s, i.e. virtual stage c*p + s. `forward(x, chunk=c)` runs chunk c alone;
`chunk_bounds` lists each chunk's global layer range. Layers keep their global index everywhere (module
names, `curr_layer`, checkpoint files `layer_XX-...` via `layer_index`), so the per-layer checkpoint files of
any v (or none) are the same files. A tied module used by two chunks of one stage is built once there.

Activation checkpointing: with `activation_checkpoint_interval = k > 0` the stage's layers are cut into runs of
k and a run is recomputed in backward when it is checkpointable (`_is_checkpointable`, DeepSpeed's rule
without its class-name special case): some layer of it holds parameters (an nn.Module with parameters, or
a TiedLayerSpec's forward_fn over one), or, with `checkpointable_layers=[names]`, every layer's class name
is listed. A run of parameterless layers such as `nn.ReLU(inplace=True)` runs plainly: recomputing it saves
nothing, and checkpointing an in-place layer breaks backward. Under no_grad nothing is checkpointed.
`activation_checkpoint_func(fn, *args)` defaults to `recompute.default_checkpoint` (torch's non-reentrant
checkpoint, or DeepSpeed's once deepspeed.checkpointing is configured); `reentrant_checkpoint`,
`deepspeed.checkpointing.checkpoint` or any function of that signature works: when no input of a run
requires grad, a dummy input that does is passed so that reentrant recomputation still reaches the run's
parameters. `set_checkpoint_interval(k)` and the cached `is_checkpointable_results` are DeepSpeed's API.

Process groups (`grid.py`): with `grid=ProcessGrid(...)` the module, its engine and DeepSpeed's optimizers use
the handed groups and the module builds none (its tied-weight groups come from `grid.subgroup`); with
`topology=` or `num_stages=` tds builds its own, once (`grid.build_grid`). `model.mpu()` is the grid.

Prints: DeepSpeed's constructor prints its seed settings, the topology and a per-stage layer listing on
rank 0; here they appear only with `verbose=True` or env TDS_VERBOSE=1.
"""
from __future__ import annotations

import functools
import glob
import os
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime import utils as ds_utils
from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule as _DSPipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from .. import device as tds_device
from . import recompute
from .grid import ProcessGrid, build_grid
from .meta import PipelineLayoutError, TensorDecl, make_declarations


class PipelineModule(_DSPipelineModule):
    """DeepSpeed PipelineModule with a declared or inferred boundary layout; see the module docstring.

    DeepSpeed's arguments keep their meaning. Extra arguments (the first three may instead be set as the
    attribute of the same name with a leading underscore after construction, as TDS/CPM models do:
    `model._input_grad = [True, False]`):
        input_grad: per tuple position, whether a gradient flows back through it.
        input_type: per tuple position, 'float' | 'int' | 'bool' | a dtype name such as 'bfloat16'/'int64'.
        input_pipe_partitioned: per tuple position, whether the tensor is split across the tensor-parallel
            group for the hop (default: no position).
        verbose: let DeepSpeed's constructor prints through and list each stage's layers (also env
            TDS_VERBOSE=1).
        virtual_stages: model chunks per stage, v >= 1 (v >= 2 for the interleaved schedule, with
            config["pipeline"]["virtual_stages"] = v); see the module docstring.
        grid: a `tds.pipe.ProcessGrid` over groups built elsewhere, instead of num_stages / topology.
    Undeclared (neither _input_grad nor _input_type), each stage infers the layout of what it sends from its
    first training micro-batch (`boundary.py`).
    """

    def __init__(self, layers, num_stages: Optional[int] = None, topology=None, loss_fn=None,
                 seed_layers: bool = False, seed_fn=None, base_seed: int = 1234,
                 partition_method="parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable = recompute.default_checkpoint,
                 checkpointable_layers: Optional[list] = None, dynamic_shape: bool = False,
                 input_grad: Optional[Sequence[bool]] = None, input_type: Optional[Sequence[str]] = None,
                 input_pipe_partitioned: Optional[Sequence[bool]] = None, verbose: Optional[bool] = None,
                 virtual_stages: int = 1, grid: Optional[ProcessGrid] = None):
        verbose = os.environ.get("TDS_VERBOSE", "0") not in ("", "0") if verbose is None else verbose
        if int(virtual_stages) < 1:
            raise ValueError(f"virtual_stages must be >= 1 (model chunks per pipeline stage), got {virtual_stages}")
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise TypeError(f"checkpointable_layers must be a list of class names, got {checkpointable_layers!r}")
        torch.nn.Module.__init__(self)  # DeepSpeed's constructor, re-done without building groups of its own
        self.virtual_stages = int(virtual_stages)
        self.micro_offset, self.loss_fn, self.checkpointable_layers = 0, loss_fn, checkpointable_layers
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self._attach_grid(_grid(grid, num_stages, topology), verbose)
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.is_checkpointable_results, self.is_checkpointable_results_interval = [], None
        self._build_stage(layers, partition_method)
        self.dynamic_shape = dynamic_shape
        if verbose and self.global_rank == 0:
            print(self._listing(), flush=True)
        self._input_grad = input_grad
        self._input_type = input_type
        self._input_pipe_partitioned = input_pipe_partitioned
        self._chunk_calls = [0] * self.virtual_stages  # forward calls per chunk (DeepSpeed's micro_offset)
        self._site_keys, self._site_leaves, self._site_modules = {}, {}, {}  # split_tied_sites
        self._unslotted: list = []  # gradient_slots

    def _attach_grid(self, grid: ProcessGrid, verbose: bool) -> None:
        """The process groups are the grid's (handed, or tds's own); DeepSpeed's world group is torch's."""
        self._grid, self._topo, self.num_stages = grid, grid.topology(), grid.pipe_parallel_size
        self.world_group = dist.group.WORLD
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank, self.stage_id = tds_device.local_rank(), grid.get_stage_id()
        if verbose and self.global_rank == 0:
            print(f"SEED_LAYERS={self.seed_layers} BASE_SEED={self.base_seed} "
                  f"SEED_FN={getattr(self.seed_fn, '__name__', None)}\nUsing topology: {self._topo}", flush=True)

    def _build_stage(self, layers, partition_method) -> None:
        """As DeepSpeed's constructor: partition the layers, build this stage's, move them to the device, then
        index the tied weights over the grid's groups and broadcast them."""
        self._layer_specs = list(layers)
        self._num_layers, self._local_start, self._local_stop = len(self._layer_specs), 0, None
        self._partition_layers(method=partition_method)
        self.forward_funcs, self.fwd_map, self.tied_modules, self.tied_weight_attrs = [], {}, nn.ModuleDict(), {}
        self._build()
        self.to(get_accelerator().device_name(self.local_rank))
        self.tied_comms = self._index_tied_modules()
        self._synchronize_tied_weights()

    # --- boundary layout -------------------------------------------------------------------------------
    def declarations(self) -> Optional[list[TensorDecl]]:
        """The declared stage-boundary layout, or None when undeclared (each stage then infers its own)."""
        if self._input_grad is None and self._input_type is None:
            return None
        if self._input_grad is None or self._input_type is None:
            raise PipelineLayoutError(
                f"set both model._input_grad and model._input_type (or neither, to infer the layout from what each "
                f"stage sends), got _input_grad={self._input_grad}, _input_type={self._input_type}")
        return make_declarations(self._input_grad, self._input_type, self._input_pipe_partitioned)

    # --- partitioning ----------------------------------------------------------------------------------
    def _partition_layers(self, method="parameters"):
        """DeepSpeed's methods (without its prints) plus an explicit list of boundaries, over num_stages x
        virtual_stages parts; this stage's chunks are parts stage_id, stage_id + p, ..."""
        self.parts = self._parts(method)
        stage_id, p = self._topo.get_coord(self.global_rank).pipe, self.num_stages
        self.chunk_bounds = [(self.parts[c * p + stage_id], self.parts[c * p + stage_id + 1])
                             for c in range(self.virtual_stages)]
        self._set_bounds(start=self.chunk_bounds[0][0], stop=self.chunk_bounds[0][1])

    def _parts(self, method) -> list[int]:
        n, stages = len(self._layer_specs), self.num_stages * self.virtual_stages
        what = f"num_stages={self.num_stages}" + (f" x virtual_stages={self.virtual_stages}"
                                                  if self.virtual_stages > 1 else "")
        if isinstance(method, (list, tuple)):
            parts = [int(b) for b in method]
            ok = len(parts) == stages + 1 and parts[0] == 0 and parts[-1] == n
            if not ok or any(a > b for a, b in zip(parts, parts[1:])):
                raise ValueError(f"partition_method as a list must be {stages + 1} non-decreasing layer "
                                 f"boundaries from 0 to {n} ({what}, layers={n}), got {parts}")
            return parts
        name = str(method).lower()
        if name == "uniform":
            return ds_utils.partition_uniform(num_items=n, num_parts=stages)
        if name == "parameters":
            return ds_utils.partition_balanced(weights=self._count_layer_params(), num_parts=stages)
        if name.startswith("type:"):
            weights = [0] * n
            for idx in self._find_layer_type(name.split(":", 1)[1]):
                weights[idx] = 1
            return ds_utils.partition_balanced(weights=weights, num_parts=stages)
        raise NotImplementedError(f"partition_method {method!r} is not one of 'parameters', 'uniform', "
                                  f"'type:REGEX' or a list of {stages + 1} layer boundaries")

    def _listing(self) -> str:
        """DeepSpeed's per-stage layer listing (per stage and chunk with virtual stages)."""
        lines = []
        for part in range(len(self.parts) - 1):
            start, stop = self.parts[part], self.parts[part + 1]
            chunk = f" chunk={part // self.num_stages}" if self.virtual_stages > 1 else ""
            lines.append(f"stage={part % self.num_stages}{chunk} layers={stop - start}")
            for idx, layer in enumerate(self._layer_specs[start:stop], start):
                name = layer.typename.__name__ if isinstance(layer, LayerSpec) else \
                    getattr(layer, "__name__", type(layer).__name__)
                lines.append(f"    {idx:2d}: {name}")
        if self.loss_fn is not None:
            lines.append(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")
        return "\n".join(lines)

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

    # --- chunks (virtual stages) and global layer indices --------------------------------------------------
    def _build(self):
        """DeepSpeed's build, once per chunk; `layer_index[i]` is the global index of forward_funcs[i]."""
        self.layer_index: list[int] = []
        self._chunk_slices: list[tuple[int, int]] = []  # [first, stop) of each chunk in forward_funcs
        for lo, hi in self.chunk_bounds:
            first = len(self.forward_funcs)
            self._set_bounds(start=lo, stop=hi)
            super()._build()
            self.layer_index += [lo + i for i in range(len(self.forward_funcs) - first)]
            self._chunk_slices.append((first, len(self.forward_funcs)))
        self._set_bounds(start=self.chunk_bounds[0][0], stop=self.chunk_bounds[0][1])

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline stage that builds global layer `layer_idx` (part j belongs to stage j mod p)."""
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} is not in 0..{self._num_layers - 1}")
        part = next(j for j in range(len(self.parts) - 1) if self.parts[j] <= layer_idx < self.parts[j + 1])
        return part % self.num_stages

    def _index_tied_modules(self) -> dict:
        """DeepSpeed's tied-weight groups: per tied key and (data, tensor) coordinate, the ranks of the stages
        that hold the key, from the grid's `subgroup` (the handed state's groups, or tds's own)."""
        tied_comms = {}
        if self.num_stages == 1:
            return tied_comms
        tp = self._grid.get_slice_parallel_world_size()
        tied = [(i, s.key) for i, s in enumerate(self._layer_specs) if isinstance(s, TiedLayerSpec)]
        for key in sorted({k for _, k in tied}):  # the same order on every rank
            stages = sorted({self.stage_owner(i) for i, k in tied if k == key})
            for dp in range(self._grid.data_parallel_size):
                for tp_rank in range(tp):
                    coord = dict(data=dp, model=tp_rank) if tp > 1 else dict(data=dp)
                    ranks = [self._grid.stage_to_global(stage_id=s, **coord) for s in stages]
                    group = self._grid.subgroup(ranks)
                    if self.global_rank in ranks:
                        tied_comms[key] = dict(ranks=ranks, group=group, weight_attr=self.tied_weight_attrs[key],
                                               module=self.tied_modules[key])
                        for p in self.tied_modules[key].parameters():  # counted once by the fp16 optimizer
                            p.ds_pipe_replicated = self.global_rank != ranks[0]
        return tied_comms

    def ckpt_layer_path(self, ckpt_dir, local_layer_idx):
        """`layer_XX[-model_YY]-model_states.pt` of forward_funcs[local_layer_idx], XX its global index."""
        path = os.path.join(ckpt_dir, f"layer_{self.layer_index[local_layer_idx]:02d}")
        rank_repr = self._grid._topo.get_rank_repr(rank=self.global_rank)
        return path + (f"-{rank_repr}" if rank_repr != "" else "") + "-model_states.pt"

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx):
        """Every tensor-parallel rank's file of forward_funcs[local_layer_idx], sorted."""
        pattern = os.path.join(ckpt_dir, f"layer_{self.layer_index[local_layer_idx]:02d}-*model_states.pt")
        return sorted(glob.glob(pattern))

    @torch.no_grad()
    def _synchronize_tied_weights(self):
        """Broadcast tied weights from their lowest rank, in sorted key order on every rank, outside autograd
        (DeepSpeed broadcasts parameters in grad mode, which records the collective into the graph)."""
        for key in sorted(self.tied_comms):
            comm = self.tied_comms[key]
            for attr_name in comm['weight_attr']:
                torch.distributed.broadcast(self._recursive_getattr(comm['module'], attr_name),
                                            src=min(comm['ranks']), group=comm['group'])

    # --- activation checkpointing ------------------------------------------------------------------------
    def configure_checkpointing(self, ds_config) -> None:
        """Apply the DeepSpeed JSON: pipeline.activation_checkpoint_interval and use_reentrant, and the
        activation_checkpointing section (`recompute.configure_from_config`)."""
        pipe = ds_config.pipeline
        if pipe.get("activation_checkpoint_interval", 0) > 0:
            self.set_checkpoint_interval(pipe["activation_checkpoint_interval"])
        recompute.configure_from_config(ds_config, self._grid)
        use_reentrant = pipe.get("use_reentrant")
        if use_reentrant is not None and recompute.replaced_by_config(self.activation_checkpoint_func, use_reentrant):
            self.activation_checkpoint_func = recompute.by_reentrancy(use_reentrant)

    def set_checkpoint_interval(self, interval: int) -> None:
        if interval < 0:
            raise ValueError(f"activation checkpoint interval must be >= 0, got {interval}")
        self.activation_checkpoint_interval = interval
        self._precompute_checkpointable_values()

    def _precompute_checkpointable_values(self):
        """`is_checkpointable_results[j]`: whether the j-th run of k layers is recomputed (k = the interval);
        runs start at each chunk's first layer (`_segments[c]`: (start, end, recomputed) of chunk c)."""
        k = self.activation_checkpoint_interval
        if k > 0 and self.is_checkpointable_results_interval != k:
            self._segments = [[(s, min(s + k, hi), self._is_checkpointable(self.forward_funcs[s:min(s + k, hi)]))
                               for s in range(lo, hi, k)] for lo, hi in self._chunk_slices]
            self.is_checkpointable_results = [ckpt for chunk in self._segments for _, _, ckpt in chunk]
            self.is_checkpointable_results_interval = k

    def _is_checkpointable(self, funcs) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(_has_parameters(f) for f in funcs)

    def _run_layers(self, start: int, end: int, x, micro_offset: int):
        for idx, layer in enumerate(self.forward_funcs[start:end], start):
            self.curr_layer = self.layer_index[idx]
            if self.seed_layers:
                seed = self.base_seed * micro_offset + self.curr_layer
                (self.seed_fn or ds_utils.set_random_seed)(seed)
            x = layer(x) if idx not in self._site_leaves else self._site_call(idx, x)
        return x

    # --- layout-invariant sums (fixed_order.py): each use of a tied weight reads it through a leaf of its own -----
    def split_tied_sites(self) -> None:
        """From now on each use (site) of a tied weight on this stage reads the weight through a leaf tensor of its
        own that shares its storage, so that each site's gradient is kept apart: at one stage autograd would add the
        embedding's and the head's gradients per micro-batch, while across stages they are summed once per batch.
        `gather_site_grads` adds the sites' sums into the weight's .grad in global layer order."""
        self._site_keys = {idx: spec.key for idx, i in enumerate(self.layer_index)
                           if isinstance(spec := self._layer_specs[i], TiedLayerSpec)}
        self._site_leaves = {idx: {attr: _leaf(self._tied_param(key, attr))
                                   for attr in self.tied_weight_attrs[key]} for idx, key in self._site_keys.items()}
        self._site_modules = {idx: _Site(self.tied_modules[key], self.forward_funcs[idx])
                              for idx, key in self._site_keys.items()}

    def refresh_sites(self) -> None:
        """Point each site's leaf at its weight's current storage (an optimizer may have replaced .data)."""
        for idx, leaves in self._site_leaves.items():
            for attr, leaf in leaves.items():
                leaf.data = self._tied_param(self._site_keys[idx], attr).data

    def gradient_slots(self) -> list[list[torch.Tensor]]:
        """Per chunk, the tensors whose .grad a micro-batch's backward fills: its layers' trainable parameters, with
        each site of a tied weight as its leaf (`split_tied_sites`) instead of the weight."""
        tied = {id(self._tied_param(key, attr)) for key, attrs in self.tied_weight_attrs.items() for attr in attrs}
        seen, slots = set(tied), []
        for lo, hi in self._chunk_slices:
            chunk = []
            for idx in range(lo, hi):
                chunk += [leaf for leaf in self._site_leaves.get(idx, {}).values() if leaf.requires_grad]
                func = self.forward_funcs[idx]
                for p in func.parameters() if isinstance(func, torch.nn.Module) else ():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        chunk.append(p)
            slots.append(chunk)
        # a tied module reached only through a forward_fn (the head's copy of the embedding) has parameters no
        # layer here uses: they must get no gradient (`check_unslotted`)
        self._unslotted = [(n, p) for n, p in self.named_parameters() if p.requires_grad and id(p) not in seen]
        return slots

    def check_unslotted(self) -> None:
        """Raise if a parameter outside `gradient_slots` got a gradient (a forward_fn using more than the tied
        weights): it would be summed in the micro-batches' order, not the fixed one."""
        got = [n for n, p in self._unslotted if p.grad is not None]
        if got:
            raise ValueError(f"pipeline.layout_invariant: {', '.join(got)} got gradients through a tied layer's "
                             f"forward_fn; list them in the TiedLayerSpec's tied_weight_attr")

    def gather_site_grads(self) -> None:
        """Each tied weight's .grad = the sum of its sites' gradients on this stage, in global layer order."""
        for key, attrs in sorted(self.tied_weight_attrs.items()):
            for attr in attrs:
                grad = None
                for idx in sorted(i for i, k in self._site_keys.items() if k == key):
                    leaf = self._site_leaves[idx][attr]
                    if leaf.grad is not None:
                        grad = leaf.grad.clone() if grad is None else grad + leaf.grad
                    leaf.grad = None
                self._tied_param(key, attr).grad = grad

    def _tied_param(self, key: str, attr: str) -> torch.nn.Parameter:
        return self._recursive_getattr(self.tied_modules[key], attr)

    def _site_call(self, idx: int, x):
        leaves = {f"tied.{attr}": leaf for attr, leaf in self._site_leaves[idx].items()}
        return torch.func.functional_call(self._site_modules[idx], leaves, (x,))

    def forward(self, forward_input, chunk: int = 0):
        """This stage's layers (chunk `chunk` of them with virtual stages) on the tuple `forward_input`."""
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"chunk {chunk} is not in 0..{self.virtual_stages - 1} (virtual_stages="
                             f"{self.virtual_stages})")
        self._chunk_calls[chunk] += 1
        self.micro_offset = self._chunk_calls[chunk]  # DeepSpeed's per-micro-batch seed offset, per chunk
        offset = self.micro_offset + 1
        lo, hi = self._chunk_slices[chunk]
        if self.activation_checkpoint_interval <= 0 or not torch.is_grad_enabled():
            return self._run_layers(lo, hi, forward_input, offset)
        self._precompute_checkpointable_values()
        x = forward_input
        for start, end, checkpointable in self._segments[chunk]:
            x = self._checkpoint_segment(start, end, x, offset) if checkpointable else \
                self._run_layers(start, end, x, offset)
        return x

    def _checkpoint_segment(self, start: int, end: int, x, offset: int):
        was_tuple = isinstance(x, tuple)
        args = x if was_tuple else (x,)
        if any(torch.is_tensor(a) and a.requires_grad for a in args):
            def run(*inputs):
                inputs = _non_leaf(inputs)
                return self._run_layers(start, end, inputs if was_tuple else inputs[0], offset)
            return self.activation_checkpoint_func(run, *args)

        def run_with_dummy(_dummy, *inputs):
            return self._run_layers(start, end, inputs if was_tuple else inputs[0], offset)
        dummy = torch.ones(1, device=tds_device.device(), requires_grad=True)
        return self.activation_checkpoint_func(run_with_dummy, dummy, *args)


class _Site(torch.nn.Module):
    """One use of a tied module: the module itself, or a TiedLayerSpec's forward_fn bound to it (`functools.partial`),
    called through `torch.func.functional_call` with the site's leaves in place of the tied weights."""

    def __init__(self, tied: torch.nn.Module, func) -> None:
        super().__init__()
        self.tied = tied
        self.__dict__["func"] = func  # not registered: a module here would be a second name for `tied`

    def forward(self, x):
        return self.func(x)


def _leaf(weight: torch.nn.Parameter) -> torch.Tensor:
    return weight.detach().requires_grad_(weight.requires_grad)


def _grid(grid: Optional[ProcessGrid], num_stages: Optional[int], topology) -> ProcessGrid:
    """The handed grid, else tds's own over `topology` (or a pipe x data topology of `num_stages` stages)."""
    if grid is not None:
        if num_stages is not None or topology is not None:
            raise ValueError(f"give a PipelineModule either grid= or num_stages=/topology=, not both (got "
                             f"num_stages={num_stages}, topology={topology})")
        return grid
    if topology is None:
        if num_stages is None:
            raise ValueError("a PipelineModule needs num_stages=, topology= or grid=")
        world = dist.get_world_size()
        if world % num_stages != 0:
            raise ValueError(f"num_stages ({num_stages}) must divide the world size ({world})")
        topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
    return build_grid(topology)


def _non_leaf(inputs: tuple) -> tuple:
    """A reentrant checkpoint recomputes on detached leaves that require grad, which an in-place first layer
    (nn.ReLU(inplace=True)) may not change: such a leaf is cloned (one copy of the segment input)."""
    return tuple(t.clone() if torch.is_tensor(t) and t.is_leaf and t.requires_grad else t for t in inputs)


def _has_parameters(f) -> bool:
    """An nn.Module with parameters, or a TiedLayerSpec's forward_fn bound to one (a functools.partial)."""
    if isinstance(f, functools.partial):
        return any(_has_parameters(a) for a in f.args)
    return isinstance(f, torch.nn.Module) and any(True for _ in f.parameters())
