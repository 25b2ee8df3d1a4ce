"""What GPTModelPipe and T5ModelPipe share: their process groups, recomputation with dropout replay, and the
gradient sum of the sequence-parallel parameters."""
from __future__ import annotations

from typing import Optional

from megatron import mpu
from megatron.errors import UserError
from .rng import dropout_sites, replay_checkpoint
from .transformer import mark_block_recompute as _mark_block


def pipe_groups(parallel_state: Optional[mpu.ParallelState], topology, num_stages: Optional[int],
                tp_group) -> tuple:
    """(the layers' tensor-parallel group, the PipelineModule's group keywords). By default both come from
    `parallel_state`, else mpu's current state: the module gets the state's grid (`ParallelState.grid()`, a
    view of its groups) and builds no group. With `topology` or `num_stages` tds builds the module's own groups
    (a bare num_stages grid has no model axis, so it is refused when tp > 1)."""
    if topology is None and num_stages is None:
        state = parallel_state if parallel_state is not None else mpu.get_parallel_state()
        return (state.tp_group if tp_group is None else tp_group), dict(grid=state.grid())
    if parallel_state is not None:
        raise ValueError(f"give parallel_state= or topology=/num_stages=, not both (got topology={topology}, "
                         f"num_stages={num_stages})")
    tp_group, _, tp_size = mpu.mappings.resolve_group(tp_group)
    if topology is None and tp_size > 1:
        raise ValueError(f"tensor-model-parallel size is {tp_size} but only num_stages={num_stages} was given; "
                         f"pass parallel_state= (or topology=) so the pipeline grid has the model axis")
    return tp_group, dict(topology=topology, num_stages=num_stages)


class ReplayCheckpoint:
    """`activation_checkpoint_func` for a PipelineModule: mpu.checkpoint with this stage's dropout counters
    rewound for the recomputation (see `rng.replay_checkpoint`)."""

    def _checkpoint(self, function, *args):
        return replay_checkpoint(function, dropout_sites(self), *args)


def check_sequence_parallel(sequence_parallel: bool, tp_group, *seq_lengths: int) -> bool:
    """Whether the sequence is split (asked for and tp > 1); a one-line error when a length does not divide."""
    _, _, tp_size = mpu.mappings.resolve_group(tp_group)
    if not sequence_parallel or tp_size == 1:
        return False
    for length in seq_lengths:
        if length % tp_size:
            raise UserError(f"--sequence-parallel splits the sequence over the {tp_size} tensor-parallel ranks, but "
                            f"the sequence length {length} is not divisible by {tp_size}; choose a sequence "
                            f"length that is a multiple of --tensor-model-parallel-size, or drop --sequence-parallel")
    return True


class SequenceParallelGrads:
    """With sequence parallelism a replicated parameter applied to this rank's part of the sequence
    (`param.sequence_parallel`: the norms, the row-parallel biases) gets a partial gradient; the full one is the
    sum over the tp group. The engine's tied-gradient step (REDUCE_TIED, before the data-parallel reduce) sums
    the (weight, group) pairs this returns, so these parameters are listed there with the tp group."""

    sequence_parallel_group = None  # the tp group when the sequence is split, else None

    def get_tied_weights_and_groups(self):
        tied = list(super().get_tied_weights_and_groups())
        if self.sequence_parallel_group is None:
            return tied
        return tied + [(p, self.sequence_parallel_group) for p in self.parameters()
                       if getattr(p, "sequence_parallel", False)]


def uniform_interval(config) -> int:
    """The PipelineModule's activation_checkpoint_interval: N for full uniform recomputation, else 0."""
    return config.checkpoint_num_layers if config.recompute_method == "uniform" else 0


def mark_block_recompute(module, config, layer_type: type) -> None:
    """Full block recomputation: the first config.checkpoint_num_layers layers of `layer_type` in each of this
    stage's chunks recompute whole (`transformer.recompute_whole`)."""
    if config.recompute_granularity != "full" or config.recompute_method != "block":
        return
    chunks = [[m for i in range(lo, hi) if isinstance(m := module._modules.get(str(i)), layer_type)]
              for lo, hi in module.chunk_bounds]
    _mark_block(chunks, config.checkpoint_num_layers)
