"""The model as the planner sees it: its family's spec and the spec's configuration, the Pipe model's layer specs
with their parameters, the partition.

    ModelShape      (spec, config): `megatron.model.specs` owns the model; every size the planner reads is a
                    property of that configuration or a term the spec computes from it (nothing restated here)
    layer_specs     the spec's `pipe_layers(config, tp)`: each layer spec's kind and parameters on one tp rank
                    (the formulas: megatron/model/specs/gpt.py, t5.py); a mixture of experts' layers with their
                    experts on one rank of the expert-parallel group (`moe.py`)
    partition       tds's (`tds.pipe.module._parts`, DeepSpeed's `partition_balanced` over the transformer layers
                    for the default 'type:transformer'), re-implemented here without torch

Shape legend: h hidden, f ffn hidden, s the configuration's sequence (T5: the encoder's), V_p padded vocabulary.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, is_dataclass
from functools import cached_property, lru_cache
from typing import Any, List, Sequence, Tuple

from megatron.model.specs import ModelSpec, spec_for, spec_of
from megatron.model.specs.memory import PipeLayer

from .moe import moe_layers

__all__ = ["ModelShape", "PipeLayer", "layer_specs", "partition", "stage_chunks"]


@dataclass(frozen=True, eq=False)
class ModelShape:
    """A model family's spec and its configuration (GPTConfig, T5Config), the vocabulary included. Equal and
    hashed by the family and the configuration's fields, so that a ranking's shared terms key on it."""
    spec: ModelSpec
    config: Any
    _key: tuple = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_key", (self.spec.model_type, tuple(sorted(vars(self.config).items()))))

    def __eq__(self, other) -> bool:
        return isinstance(other, ModelShape) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    @classmethod
    def of(cls, config) -> "ModelShape":
        """The shape of a configuration (GPTConfig, T5Config: its family's spec by its class)."""
        return cls(spec_of(config), config)

    @classmethod
    def from_args(cls, args, vocab_size: int) -> "ModelShape":
        """From resolved arguments (`megatron.config.arguments.parse_args`, or a run's record) and the tokenizer's
        vocabulary: the spec's configuration of them, as the training ranks build it."""
        from megatron.config.resolution import with_vocabulary
        spec = spec_for(args.model_type)
        return cls(spec, spec.config(with_vocabulary(args, vocab_size)))

    @property
    def hidden(self) -> int:
        return self.config.hidden_size

    @property
    def ffn(self) -> int:
        return self.config.ffn_hidden_size

    @property
    def seq(self) -> int:
        """The configuration's sequence length (T5: the encoder's): what full recomputation keeps per layer run."""
        return self.config.seq_length

    @cached_property
    def tokens(self) -> int:
        """Positions of one sample crossing a pipeline stage boundary (T5: both stacks')."""
        return self.spec.boundary_tokens(self.config)

    @cached_property
    def output_length(self) -> int:
        """The LM head's sequence length (T5: the decoder's)."""
        return self.spec.output_length(self.config)

    @cached_property
    def linear_widths(self):
        """The widths of a transformer layer's linears (`megatron.model.specs.memory.LinearWidths`)."""
        return self.spec.linear_widths(self.config)

    @cached_property
    def transformer_layers(self) -> int:
        return sum(layer.transformer for layer in self.spec.pipe_layers(self.config, 1))

    def padded_vocab(self, tp: int) -> int:
        return self.config.padded_vocab_size(tp)

    def record(self) -> dict:
        """The model as --json prints it: its type and its configuration's fields (a mixture of experts' as a dict)."""
        fields = {k: asdict(v) if is_dataclass(v) else v for k, v in vars(self.config).items()}
        return {"model_type": self.spec.model_type, **fields}


def layer_specs(m: ModelShape, tp: int, ep: int = 1) -> List[PipeLayer]:
    """The Pipe model's layer specs in order (gpt2_pipe.gpt2_layer_specs, t5_pipe.t5_layer_specs), their parameters
    on one tp rank; a mixture of experts' layers on one rank of an expert-parallel group of `ep`
    (`moe.moe_layers`)."""
    return moe_layers(m.config, m.spec.pipe_layers(m.config, tp), tp, ep)


def _uniform(n: int, parts: int) -> List[int]:
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    size, extra = divmod(n, parts)
    bounds = [i * size for i in range(parts + 1)]
    for i in range(extra):
        bounds[i + 1:] = [b + 1 for b in bounds[i + 1:]]
    return bounds


@lru_cache(maxsize=None)
def _balanced(weights: Tuple[int, ...], parts: int) -> Tuple[int, ...]:
    """DeepSpeed's partition_balanced (the linear partition problem by dynamic programming), same tie-breaks."""
    n, inf = len(weights), float("inf")
    if n <= parts:
        return tuple(_uniform(n, parts))
    prefix = [0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    dp_max = [[inf] * (parts + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (parts + 1) for _ in range(n + 1)]
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    pos = [[0] * (parts + 1) for _ in range(n + 1)]
    dp_max[0][0], cost[0][0] = 0, 0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], seg), min(dp_min[k][j - 1], seg)
                if cost[i][j] >= hi - lo:
                    cost[i][j], dp_max[i][j], dp_min[i][j], pos[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(pos[bounds[-1]][j])
    return tuple(reversed(bounds))


def partition(specs: Sequence[PipeLayer], parts: int, method="type:transformer") -> List[int]:
    """Spec boundaries of `parts` = pp x v chunks, as tds computes them."""
    if isinstance(method, (list, tuple)):
        return list(method)
    if method == "uniform":
        return _uniform(len(specs), parts)
    if method == "parameters":
        return list(_balanced(tuple(s.params for s in specs), parts))
    return list(_balanced(tuple(int(s.transformer) for s in specs), parts))


def stage_chunks(bounds: Sequence[int], pp: int, v: int, stage: int) -> List[Tuple[int, int]]:
    """[start, stop) spec ranges of this stage's chunks c = 0..v-1 (part c*pp + stage)."""
    return [(bounds[c * pp + stage], bounds[c * pp + stage + 1]) for c in range(v)]
