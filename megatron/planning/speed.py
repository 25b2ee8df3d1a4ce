"""Predicted step time of a layout: compute, pipeline bubble, exposed communication.

    compute      model FLOPs per iteration (megatron.training.flops' convention: matmuls, 3x forward; full
                 recomputation adds one forward of the layers) / (world size x peak FLOP/s x efficiency)
    bubble       the schedule simulator's idle time (tds.pipe.schedule_sim) with per-chunk costs F, B = W = F
                 (ZB-H1 splits the backward into B and W), scaled to the compute time: a stage's busy time is
                 v m (F + B + W); bubble = compute x idle / busy
    tp comm      per layer and micro-batch 4 all-reduces of b s h elements in forward and backward (Narayanan
                 §3.2: 8 b s h (t-1)/t elements per device per layer) at the intra-node bandwidth, exposed
    dp comm      ring all-reduce 2 Psi (d-1)/d gradient bytes (ZeRO-1: reduce-scatter + all-gather, the same)
                 at the inter-node bandwidth when dp spans nodes, else intra-node, exposed (after the last B)
    pp comm      the hops and the send / receive instructions on the simulated schedule's critical path
                 (`exposed_hops`), each hop `hop_latency_ms` + b s h / t elements at the link's bandwidth
                 (inter-node when the job spans nodes), each instruction `instruction_ms` on its stage (the
                 engine's own time)

Efficiency x n / (n + 3700) for n = b s tokens per micro-batch (`gemm_efficiency`) is fitted to one GPU:
GPT-2 medium, bf16, flash attention, one H100 through `bench/gpu_throughput.py` reached 25.8 % of the dense
peak at n = 8192 and 30.6 % at n = 16384 (model FLOPs, the whole iteration: optimizer step, loss and the engine
included), which 0.38 x n / (n + 3700) reproduces (26.2 %, 31.0 %). Bandwidths are stated assumptions.
Selective recomputation adds the attention core's forward FLOPs, full recomputation a forward of the layers
(the flops convention above).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tds.pipe.schedule_sim import Costs, compute_windows

from .memory import ELEMENT_BYTES, Layout, compute_orders, stage_parameters
from .model_shape import ModelShape
from .moe import moe_flops_delta
from .shared import SharedTerms

__all__ = ["Cluster", "StepTime", "predict_step", "model_flops", "bubble_fraction", "exposed_hops", "GPUS"]


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    memory_gb: float = 80.0
    peak_tflops: float = 989.0          # dense bf16
    intra_gbps: float = 450.0           # GB/s per direction (NVLink)
    inter_gbps: float = 50.0            # GB/s per GPU (400 Gb/s InfiniBand)
    efficiency: float = 0.38            # achieved fraction of peak at large micro-batches (fitted on an H100)
    saturation_tokens: int = 3700       # tokens per micro-batch at which half of `efficiency` is reached
    allocator_overhead: float = 0.05    # fraction of memory the caching allocator loses to fragmentation
    hop_latency_ms: float = 0.02        # one point-to-point message besides its bytes (NCCL, assumed)
    instruction_ms: float = 0.0         # stage time of one send / receive instruction: on a GPU the engine's
    #                                     Python runs ahead of the queued kernels; on CPU (gloo) 0.3-1.5 ms

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


# name: (memory GB, dense bf16 TFLOP/s, NVLink GB/s, inter-node GB/s per GPU)
GPUS = {"a100-80": (80.0, 312.0, 300.0, 25.0), "a100-40": (40.0, 312.0, 300.0, 25.0),
        "h100": (80.0, 989.0, 450.0, 50.0), "rtx4090": (24.0, 165.0, 32.0, 12.5),
        "a10": (24.0, 125.0, 32.0, 12.5)}


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tp_comm: float
    dp_comm: float
    pp_comm: float
    bubble_fraction: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.dp_comm + self.pp_comm


def model_flops(m: ModelShape, lay: Layout) -> float:
    """FLOPs of one iteration (global batch micro x gas x dp), the spec's count (megatron.model.flops' convention)
    with the layout's full recomputation; a mixture of experts' MoE layers as `moe.moe_flops_delta` counts them."""
    B, V = lay.micro_batch * lay.gas * lay.dp, m.padded_vocab(lay.tp)
    full = lay.recompute == "full"
    return m.spec.flops(m.config, B, V, recompute=full) + moe_flops_delta(m.config, B, full)


def _schedule_terms(schedule: str, pp: int, gas: int, v: int, instructions: bool = True, orders=None) -> tuple:
    """(bubble fraction with F = B = W = 1 per chunk, hops on the critical path, send / receive instructions on
    it): the step grows by the last two per unit of hop time and of instruction time while those are small
    against a chunk's F (the critical path keeps its shape), which the derivatives at 1e-3 measure. The schedule
    runs once per cost set (`compute_windows`: the windows `simulate_timed` gives, to the bit); without
    `instructions` the last is not simulated and is 0 (for a cluster whose instructions take no time); `orders`:
    the stages' compute units where the caller has them."""
    eps, busy = 1e-3, 3.0 * gas * v
    costs = [Costs(1.0, 1.0, 1.0), Costs(1.0, 1.0, 1.0, comm=eps)]
    if instructions:
        costs.append(Costs(1.0, 1.0, 1.0, instruction=eps))
    window, *perturbed = compute_windows(schedule, pp, gas, v, costs, orders)
    per_hop = (perturbed[0] - window) / eps
    per_instruction = (perturbed[1] - window) / eps if instructions else 0.0
    return 1.0 - busy / window, round(per_hop), round(per_instruction)


def _terms(lay: Layout, shared: SharedTerms, instructions: bool = True) -> tuple:
    """`_schedule_terms` of the layout's schedule (shared by every layout with the same schedule, pp, gas, v)."""
    key = (lay.schedule, lay.pp, lay.gas, lay.virtual_stages, instructions)
    return shared.get("schedule", key, lambda: _schedule_terms(*key, orders=compute_orders(lay, shared)))


def bubble_fraction(lay: Layout, shared: Optional[SharedTerms] = None) -> float:
    """Idle / (busy + idle) of the simulated schedule, F = B = W per chunk."""
    return _terms(lay, shared or SharedTerms())[0] if lay.pp > 1 else 0.0


def exposed_hops(lay: Layout, shared: Optional[SharedTerms] = None) -> tuple:
    """(hops, send / receive instructions) on the simulated schedule's critical path."""
    return _terms(lay, shared or SharedTerms())[1:] if lay.pp > 1 else (0, 0)


def gemm_efficiency(m: ModelShape, lay: Layout, c: Cluster) -> float:
    """Achieved fraction of peak: `c.efficiency` for large GEMMs, lower for few rows per micro-batch,
    eff x n / (n + saturation_tokens) with n = b s tokens per micro-batch (module docstring: the fit)."""
    n = lay.micro_batch * m.seq
    return c.efficiency * n / (n + c.saturation_tokens)


def selective_recompute_flops(m: ModelShape, lay: Layout) -> float:
    """Selective recomputation runs the attention cores' forward again (the spec's `core_flops`: 4 b s^2 w per
    layer and micro-batch)."""
    if lay.recompute != "selective":
        return 0.0
    return m.spec.core_flops(m.config, lay.micro_batch * lay.gas * lay.dp)


def predict_step(m: ModelShape, lay: Layout, c: Cluster, shared: Optional[SharedTerms] = None) -> StepTime:
    """The step time's parts; `shared`: the terms other layouts of a ranking computed already."""
    shared = shared or SharedTerms()
    flops = model_flops(m, lay) + selective_recompute_flops(m, lay)
    compute = flops / (lay.world_size * c.peak_tflops * 1e12 * gemm_efficiency(m, lay, c))
    # with instructions of no time their count multiplies 0: not simulated
    frac, hops, instructions = _terms(lay, shared, c.instruction_ms != 0) if lay.pp > 1 else (0.0, 0, 0)
    bubble = compute * frac / (1 - frac)
    e, b, h, t = ELEMENT_BYTES[lay.precision], lay.micro_batch, m.hidden, lay.tp
    tokens = m.tokens  # positions per sample whose hidden states the layers and stages pass on (T5: both stacks')
    layers_per_stage = m.transformer_layers / lay.pp
    tp_bytes = 8 * b * tokens * h * e * (t - 1) / t * layers_per_stage * lay.gas
    tp_comm = tp_bytes / (c.intra_gbps * 1e9) if t > 1 else 0.0
    psi = max(stage_parameters(m, lay, shared))
    dp_bytes = 2 * psi * e * (lay.dp - 1) / lay.dp
    spans_nodes = lay.tp * lay.dp > c.gpus_per_node
    dp_comm = dp_bytes / ((c.inter_gbps if spans_nodes else c.intra_gbps) * 1e9)
    bandwidth = c.inter_gbps if lay.world_size > c.gpus_per_node else c.intra_gbps
    pp_comm = hops * (c.hop_latency_ms / 1e3 + b * tokens * h * e / t / (bandwidth * 1e9)) \
        + instructions * c.instruction_ms / 1e3
    return StepTime(compute, bubble, tp_comm, dp_comm, pp_comm, frac)
