"""Per-model name tables: every parameter's canonical name, partitioning and pipeline location.

The canonical name of a parameter is its name in the plain model (`GPTModel` / `T5Model`) state dict, and
its canonical value is the full (tp = 1) tensor. A `ModelTable` built from a checkpoint's arguments maps it to

    pipeline layer file    (layer, local): layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt, key `local`
    Pipe module, stage s   `{layer}.{local}`, or `tied_modules.{key}.{local}` for a TiedLayerSpec
    tp partition           (partition_dim, stride) of the mpu layer (None: replicated on every tp rank)

GPT-2 (L layers)                    pipeline layer          T5 (Le + Ld layers)           pipeline layer
    embedding.*                     0 (tied 'embed')        embedding.*                   0 (tied 'embed' in v1.0)
    layers.i.*                      1 + i                   encoder_layers.i.*            1 + i
    final_layernorm.*               L + 1 (kept prefixed)   encoder_final.*               Le + 1
    (LM head: the tied embedding)   L + 2, no file          decoder_layers.j.*            Le + 2 + j
    lm_head.* (untied)              L + 2
                                                            decoder_final.*               Le + Ld + 2
                                                            lm_head.* (v1.1, untied)      Le + Ld + 3 (tied: no file)

Partition attributes come from the model itself: a tiny model of the same structure (hidden = heads,
kv_channels = 1, one vocabulary row per tp rank) is built and its parameters' `partition_dim` /
`partition_stride` read, so a new layer type needs no table entry beyond its pipeline location.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron.errors import UserError
from megatron.model.specs import spec_for

PIPE_FORM = "pipe"  # the saved `module_form` of checkpoints whose every stage is a Pipe module
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "lm_head.weight")
# Model arguments added after the first checkpoints were written, with the value those checkpoints imply
# (T5 v1.0: ReLU feed-forward, tied head, 32 buckets up to distance 128, decoder as deep as the encoder).
LATER_ARGUMENTS = dict(decoder_num_layers=None, feed_forward_proj="relu", untie_embeddings_and_output_weights=False,
                       relative_attention_num_buckets=32, relative_attention_max_distance=128, gelu="tanh")


@dataclass(frozen=True)
class ParamInfo:
    name: str               # canonical (plain-model) name
    dim: Optional[int]      # tp partition dim, None = replicated
    stride: Any             # int, or a tuple of block weights (mpu.utils)
    layer: int              # pipeline layer (LayerSpec index)
    local: str              # name in the layer's module and file

    @property
    def vocab(self) -> bool:
        """Rows are the padded vocabulary (re-padded when tp changes)."""
        return self.name in VOCAB_PARAMS


def plain_pp1(args: Dict[str, Any]) -> bool:
    """A pp = 1 checkpoint of the earlier training path, which ran the plain model under DeepSpeed's engine:
    its optimizer state follows the plain model's parameter names and order (and, in bf16 without ZeRO,
    DeepSpeed's unfused layout). Every run now trains the Pipe model, one stage at pp = 1, and its
    checkpoints say so (`module_form` 'pipe')."""
    return args["pipe_parallel_size"] <= 1 and args.get("module_form") != PIPE_FORM


def virtual_stages(args: Dict[str, Any]) -> int:
    """Model chunks per pipeline stage of a run (interleaved schedule); 1 for checkpoints that predate them."""
    return int(args.get("virtual_pipe_stages") or 1)


def model_config(args: Dict[str, Any]):
    """GPTConfig / T5Config exactly as the model's spec builds it for training from these arguments.

    Arguments that a checkpoint predates take the value that reproduces the model it was trained as."""
    ns = argparse.Namespace(**{**LATER_ARGUMENTS, **args, "checkpoint_activations": False,
                               "recompute_granularity": None, "cross_entropy_loss_fusion": False, "compile": False,
                               "layout_invariant": False})
    return spec_for(args.get("model_type")).config(ns)


def model_record(args: Dict[str, Any]) -> Dict[str, Any]:
    """megatron_args.json's 'model' record: the model type and its config as the spec builds it (nanoGPT's
    `model_args`); derived from the flat arguments for checkpoints written before the record existed."""
    if "model" in args:
        return args["model"]
    config = dataclasses.asdict(model_config(args))
    return {"model_type": args.get("model_type"), **{k: v for k, v in config.items() if k != "params_dtype"}}


def layout_record(args: Dict[str, Any]) -> Dict[str, Any]:
    """megatron_args.json's 'layout' record: (tp, pp, dp), the ZeRO stage DeepSpeed ran, model chunks per stage
    and the partition; derived from the flat arguments for checkpoints written before the record existed."""
    if "layout" in args:
        return args["layout"]
    return dict(tp=args["tensor_model_parallel_size"], pp=max(1, args["pipe_parallel_size"]),
                dp=args["data_parallel_size"], zero_stage=args["ds_config"]["zero_optimization"]["stage"],
                virtual_pipe_stages=virtual_stages(args), partition_method=args.get("partition_method"))


def with_records(args: Dict[str, Any]) -> Dict[str, Any]:
    """`args` with its 'model' and 'layout' records derived afresh from its flat fields (what every writer of
    megatron_args.json stores: the records always describe the files beside them)."""
    flat = {k: v for k, v in args.items() if k not in ("model", "layout")}
    return {**flat, "model": model_record(flat), "layout": layout_record(flat)}


def _probe_config(config):
    """Same structure, tiny widths: partition attributes do not depend on sizes (rotary positions have no
    parameters, so a rope model is probed without them: one channel per head cannot rotate)."""
    heads = config.num_attention_heads
    rope = dict(position_embedding_type="none") if getattr(config, "position_embedding_type", None) == "rope" else {}
    return dataclasses.replace(config, hidden_size=heads, kv_channels=1, ffn_hidden_size=heads, vocab_size=1,
                               make_vocab_size_divisible_by=1, hidden_dropout=0.0, attention_dropout=0.0,
                               checkpoint_num_layers=0, recompute_granularity=None, **rope)


def _locate(name: str, rules) -> Tuple[int, str]:
    for pattern, where in rules:
        m = re.fullmatch(pattern, name)
        if m:
            return where(m)
    raise AssertionError(f"parameter {name} has no pipeline location in the name table")


class ModelTable:
    """Names, partitioning and pipeline placement of one model's parameters; see the module docstring."""

    def __init__(self, args: Dict[str, Any]):
        self.args, self.kind = args, args.get("model_type")
        self.spec = spec_for(self.kind)
        self.config = model_config(args)
        probe = self.spec.plain(_probe_config(self.config))
        rules = self.spec.locations(self.config)
        self.params: List[ParamInfo] = []
        for name, p in probe.named_parameters():
            split = getattr(p, "tensor_model_parallel", False)
            layer, local = _locate(name, rules)
            self.params.append(ParamInfo(name, p.partition_dim if split else None,
                                         getattr(p, "partition_stride", 1), layer, local))
        self.by_name = {p.name: p for p in self.params}
        self.by_location = {(p.layer, p.local): p for p in self.params}
        self.specs = self._specs()

    def full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every parameter's full (tp = 1) shape, from the spec's plain model built under torch's FakeTensorMode
        (no memory, no initialization: a 7B model in half a second)."""
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            model = self.spec.plain(self.config)
            return {name: tuple(p.shape) for name, p in model.named_parameters()}

    def _specs(self) -> list:
        return self.spec.pipe_layer_specs(self.config)

    # --- pipeline stages ----------------------------------------------------------------------------------
    def tied_key(self, layer: int) -> Optional[str]:
        return getattr(self.specs[layer], "key", None)

    def layer_params(self, layer: int) -> List[ParamInfo]:
        """Parameters stored in pipeline layer `layer`'s file (none for a tied layer's second use)."""
        key = self.tied_key(layer)
        if key is not None and self._first_of_key(key) != layer:
            return []
        return [p for p in self.params if p.layer == layer]

    def _first_of_key(self, key: str) -> int:
        return next(i for i, s in enumerate(self.specs) if getattr(s, "key", None) == key)

    def stage_bounds(self, pp: int, method=None, tp: int = 1,
                     shapes: Optional[Dict[str, Sequence[int]]] = None) -> List[int]:
        """Layer boundaries [b_0 = 0, ..., b_pp = number of layers] as the Pipe model computes them
        (DeepSpeed's partitioning for 'type:REGEX', 'uniform', explicit boundaries, or 'parameters', which
        needs the full `shapes`)."""
        from deepspeed.runtime import utils as ds_utils
        n = len(self.specs)
        method = method or "type:TransformerLayer"
        if pp == 1:
            return [0, n]
        if isinstance(method, (list, tuple)):
            bounds = [int(b) for b in method]
            if len(bounds) != pp + 1 or bounds[0] != 0 or bounds[-1] != n:
                raise UserError(f"--partition-method boundaries {bounds} do not fit pp = {pp} and {n} pipeline "
                                f"layers; give {pp + 1} boundaries from 0 to {n} or a method such as "
                                f"type:TransformerLayer")
            return bounds
        if pp > n:
            raise UserError(f"pp = {pp} is larger than the number of pipeline layers ({n}) of this model")
        if method == "uniform":
            return [int(b) for b in ds_utils.partition_uniform(n, pp)]
        if method == "parameters":
            weights = [self._local_numel(i, tp, shapes or {}) for i in range(n)]
        elif method.startswith("type:"):
            pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
            weights = [int(bool(pattern.search(s.typename.__name__))) for s in self.specs]
        else:
            raise UserError(f"--partition-method {method!r} is not one the checkpoint tools know")
        return [int(b) for b in ds_utils.partition_balanced(weights, pp)]

    def _local_numel(self, layer: int, tp: int, shapes: Dict[str, Sequence[int]]) -> int:
        """Trainable elements a tp rank holds for pipeline layer `layer` (DeepSpeed's 'parameters' weight)."""
        key = self.tied_key(layer)
        if key is not None:
            layer = self._first_of_key(key)
        total = 0
        for p in (q for q in self.params if q.layer == layer):
            numel = 1
            for s in shapes.get(p.name, (1,)):
                numel *= s
            total += numel // tp if p.dim is not None else numel
        return total

    @staticmethod
    def stage_layers(bounds: Sequence[int], stage: int, pp: Optional[int] = None) -> List[int]:
        """Pipeline layers stage `stage` builds. `bounds` cut the layers into pp x v parts (v = virtual stages,
        `virtual_stages(args)`); the stage holds parts stage, stage + pp, ... (pp None: one part per stage)."""
        pp = len(bounds) - 1 if pp is None else pp
        return [layer for part in range(stage, len(bounds) - 1, pp) for layer in range(bounds[part], bounds[part + 1])]

    def stage_param_names(self, bounds: Sequence[int], stage: int,
                          pp: Optional[int] = None) -> List[Tuple[str, ParamInfo]]:
        """(module name, info) of every parameter of pipeline stage `stage`, in the Pipe module's order:
        tied modules first (in order of first use on the stage), then the stage's other layers in order."""
        layers = self.stage_layers(bounds, stage, pp)
        tied_keys, order = [], []
        for layer in layers:
            key = self.tied_key(layer)
            if key is not None and key not in tied_keys:
                tied_keys.append(key)
        for key in tied_keys:
            first = self._first_of_key(key)
            order += [(f"tied_modules.{key}.{p.local}", p) for p in self.params if p.layer == first]
        for layer in layers:
            if self.tied_key(layer) is None:
                order += [(f"{layer}.{p.local}", p) for p in self.params if p.layer == layer]
        return order

    def unused_copies(self, bounds: Sequence[int], stage: int, pp: Optional[int] = None) -> List[str]:
        """Module names of a tied module's parameters that stage `stage` holds but never uses: the parts of a
        tied module other than its tied weight, on a stage without the module's first use (GPT-2's
        position table on the last stage). Their values and optimizer state are not carried by a reshape
        (the written copy is the first stage's)."""
        out = []
        layers = self.stage_layers(bounds, stage, pp)
        for name, p in self.stage_param_names(bounds, stage, pp):
            key = self.tied_key(p.layer)
            if key is not None and p.layer not in layers:
                if p.local not in self.specs[p.layer].tied_weight_attr:
                    out.append(name)
        return out

    def pipe_to_canonical(self, name: str) -> ParamInfo:
        """Canonical info of a Pipe module parameter name (`tied_modules.embed.x` or `3.x`)."""
        m = re.fullmatch(r"tied_modules\.([^.]+)\.(.+)", name)
        if m:
            return self.by_location[(self._first_of_key(m[1]), m[2])]
        layer, local = name.split(".", 1)
        return self.by_location[(int(layer), local)]
