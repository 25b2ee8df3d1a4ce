"""What GPT2ModelPipe and T5ModelPipe share: their process groups and checkpointing with dropout replay."""
from __future__ import annotations

from typing import Optional

from megatron import mpu
from .rng import dropout_sites, replay_checkpoint


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
