"""TDS pipeline parallelism: `PipelineModule` with a declared boundary layout and its `PipelineEngine`.

LayerSpec, TiedLayerSpec and the topologies are DeepSpeed's own.
"""
from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec
from deepspeed.runtime.pipe.topology import (PipeDataParallelTopology, PipeModelDataParallelTopology,
                                             ProcessTopology)

from .engine import PipelineEngine
from .meta import PipelineLayoutError, TensorDecl
from .module import PipelineModule, non_reentrant_checkpoint, reentrant_checkpoint
from .p2p import PipelineCommError
from .schedule import Instruction, Op, eval_schedule, train_schedule

__all__ = ["PipelineModule", "PipelineEngine", "LayerSpec", "TiedLayerSpec", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineLayoutError",
           "PipelineCommError", "TensorDecl", "non_reentrant_checkpoint", "reentrant_checkpoint",
           "Instruction", "Op", "train_schedule", "eval_schedule"]
