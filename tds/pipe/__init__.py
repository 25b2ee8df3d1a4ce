"""TDS pipeline parallelism: `PipelineModule` with a declared or inferred boundary layout, its `PipelineEngine`.

LayerSpec, TiedLayerSpec and the topologies are DeepSpeed's own; DeepSpeed's schedule classes are in
`tds.pipe.schedule` (views of TDS's instruction lists, `ds_schedule.py`, beside the lists themselves from
`instructions.py`). The names load on first use: `tds.pipe.instructions` and `tds.pipe.schedule_sim` import without
DeepSpeed or torch.
"""
from ..lazy import lazy_exports

_FROM = {"LayerSpec": "deepspeed.runtime.pipe.module", "TiedLayerSpec": "deepspeed.runtime.pipe.module",
         **dict.fromkeys(("PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"),
                         "deepspeed.runtime.pipe.topology"),
         "PipelineEngine": "tds.pipe.engine", "NonFiniteError": "tds.pipe.finite", "ProcessGrid": "tds.pipe.grid",
         "PipelineLayoutError": "tds.pipe.meta", "TensorDecl": "tds.pipe.meta", "PipelineModule": "tds.pipe.module",
         **dict.fromkeys(("default_checkpoint", "non_reentrant_checkpoint", "reentrant_checkpoint"),
                         "tds.pipe.recompute"),
         "PipelineCommError": "tds.pipe.p2p", "add_stage_loss": "tds.pipe.stage_loss",
         **dict.fromkeys(("Instruction", "Op", "eval_schedule", "train_schedule"), "tds.pipe.instructions")}
__getattr__ = lazy_exports(__name__, _FROM)  # each name imported on first use (tds/lazy.py)

__all__ = ["PipelineModule", "PipelineEngine", "ProcessGrid", "LayerSpec", "TiedLayerSpec", "ProcessTopology",
           "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineLayoutError",
           "PipelineCommError", "NonFiniteError", "TensorDecl", "default_checkpoint", "non_reentrant_checkpoint",
           "reentrant_checkpoint", "Instruction", "Op", "train_schedule", "eval_schedule", "add_stage_loss"]
