"""What GPT2ModelPipe and T5ModelPipe share: the topology default and checkpointing with dropout replay."""
from __future__ import annotations

from typing import Optional

from megatron import mpu
from .rng import dropout_sites, replay_checkpoint


def pipe_topology(topology, num_stages: Optional[int], tp_group):
    """The topology for a pipeline model: the given one, else mpu's (pipe, data, model) topology when no
    num_stages is given. A bare num_stages grid has no model axis, so it is refused when tp > 1."""
    tp_size = mpu.mappings.resolve_group(tp_group)[2]
    if topology is None and num_stages is None:
        return mpu.get_topology()
    if topology is None and tp_size > 1:
        raise ValueError(f"tensor-model-parallel size is {tp_size} but only num_stages={num_stages} was given; "
                         f"pass topology=mpu.get_topology() so the pipeline grid has the model axis")
    return topology


class ReplayCheckpoint:
    """`activation_checkpoint_func` for a PipelineModule: mpu.checkpoint with this stage's dropout counters
    rewound for the recomputation (see `rng.replay_checkpoint`)."""

    def _checkpoint(self, function, *args):
        return replay_checkpoint(function, dropout_sites(self), *args)
