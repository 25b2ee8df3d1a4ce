"""Model FLOPs per iteration: the formulas live in `megatron.model.flops` (the planner below training uses them
too); re-exported here for the loop and for code written against this module."""
from megatron.model.flops import (cross_attention_flops, flops_per_iteration, gpt_flops_per_iteration,  # noqa: F401
                                  self_attention_layer_flops, t5_flops_per_iteration, tokens_per_sample)
