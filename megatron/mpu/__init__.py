"""Megatron tensor model parallelism: groups, autograd mappings, parallel layers, cross entropy, RNG, grads."""
from .cross_entropy import vocab_parallel_cross_entropy
from .data import broadcast_data
from .grads import clip_grad_norm, get_grad_norm
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, full_weight,
                     mark_sequence_parallel, param_is_not_tensor_parallel_duplicate, parallel_lm_logits,
                     set_full_weight, set_tensor_model_parallel_attributes)
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region, sum_over_tensor_model_parallel_region)
from .parallel_state import (ParallelDims, ParallelState, destroy_model_parallel, get_data_parallel_group,
                             get_data_parallel_rank, get_data_parallel_world_size, get_model_parallel_group,
                             get_model_parallel_rank, get_model_parallel_src_rank, get_model_parallel_world_size,
                             get_parallel_state, get_pipe_parallel_group, get_pipe_parallel_rank,
                             get_pipe_parallel_world_size, get_pipeline_model_parallel_group,
                             get_pipeline_model_parallel_rank, get_pipeline_model_parallel_world_size,
                             get_tensor_model_parallel_group, get_tensor_model_parallel_rank,
                             get_tensor_model_parallel_src_rank, get_tensor_model_parallel_world_size,
                             get_topology, initialize_model_parallel, model_parallel_is_initialized,
                             set_parallel_state, shutdown_distributed)
from .random import (RNGStatesTracker, checkpoint, get_cuda_rng_tracker, get_rng_tracker,
                     model_parallel_cuda_manual_seed, model_parallel_seed, rng_states, set_random_seed,
                     set_rng_states)
from .utils import (VocabUtility, divide, ensure_divisibility, merge_partitions, partition_master,
                    split_tensor_along_last_dim)

__all__ = [
    # parallel_state
    "ParallelDims", "ParallelState", "initialize_model_parallel", "destroy_model_parallel", "set_parallel_state",
    "shutdown_distributed",
    "model_parallel_is_initialized", "get_parallel_state", "get_topology",
    "get_model_parallel_group", "get_model_parallel_rank", "get_model_parallel_world_size",
    "get_model_parallel_src_rank", "get_tensor_model_parallel_group", "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_src_rank",
    "get_data_parallel_group", "get_data_parallel_rank", "get_data_parallel_world_size",
    "get_pipe_parallel_group", "get_pipe_parallel_rank", "get_pipe_parallel_world_size",
    "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    # utils
    "divide", "ensure_divisibility", "split_tensor_along_last_dim", "VocabUtility", "partition_master",
    "merge_partitions",
    # mappings
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "sum_over_tensor_model_parallel_region",
    # layers
    "VocabParallelEmbedding", "ColumnParallelLinear", "RowParallelLinear", "parallel_lm_logits",
    "full_weight", "set_full_weight", "set_tensor_model_parallel_attributes", "mark_sequence_parallel",
    "param_is_not_tensor_parallel_duplicate",
    # cross_entropy, random, grads, data
    "vocab_parallel_cross_entropy",
    "RNGStatesTracker", "get_rng_tracker", "get_cuda_rng_tracker", "model_parallel_seed", "set_random_seed",
    "rng_states", "set_rng_states",
    "model_parallel_cuda_manual_seed", "checkpoint",
    "clip_grad_norm", "get_grad_norm",
    "broadcast_data",
]
