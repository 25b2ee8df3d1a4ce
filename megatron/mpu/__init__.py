"""Megatron tensor model parallelism: groups, autograd mappings, parallel layers, cross entropy, RNG."""
from .parallel_state import *  # noqa: F401,F403
from .parallel_state import ParallelDims, ParallelState  # noqa: F401
