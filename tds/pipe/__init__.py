"""TDS pipeline parallelism: `PipelineModule` with a declared or inferred boundary layout, its `PipelineEngine`.

LayerSpec, TiedLayerSpec and the topologies are DeepSpeed's own; DeepSpeed's schedule classes are in
`tds.pipe.schedule` (views of TDS's instruction lists, `ds_schedule.py`, beside the lists themselves from
`instructions.py`).
"""
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                             ProcessTopology)

from .engine import PipelineEngine
from .finite import NonFiniteError
from .grid import ProcessGrid
from .meta import PipelineLayoutError, TensorDecl
from .module import PipelineModule
from .recompute import default_checkpoint, non_reentrant_checkpoint, reentrant_checkpoint
from .p2p import PipelineCommError
from .instructions import Instruction, Op, eval_schedule, train_schedule

__all__ = ["PipelineModule", "PipelineEngine", "ProcessGrid", "LayerSpec", "TiedLayerSpec", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineLayoutError",
           "PipelineCommError", "NonFiniteError", "TensorDecl", "default_checkpoint", "non_reentrant_checkpoint",
           "reentrant_checkpoint", "Instruction", "Op", "train_schedule", "eval_schedule"]
