"""Per-rank peak memory of a layout: the parts the code allocates, on the worst pipeline stage.

Notation: Psi = parameters of this rank's stage (its tp shard, `model_shape.layer_specs` summed over its chunks),
d = dp, e_w / e_a = bytes per weight / activation element, B = DeepSpeed's zero_optimization.reduce_bucket_size
(default 5e8 elements).

What each configuration holds (read from tds.pipe.engine and DeepSpeed 0.19's optimizers):

    fp32, ZeRO 0       weights 4 Psi; gradients 4 Psi (param.grad); torch AdamW moments 8 Psi;
                       dp > 1: buffered all-reduce flattens the gradients (one flat copy, 4 Psi) at the reduce
    ZeRO-1 (dp > 1)    weights e_w Psi; gradients e_w Psi; DeepSpeedZeroOptimizer: fp32 partition 4 Psi / d
                       and Adam moments 8 Psi / d; the PipelineEngine (every layout) makes it allocate two reduce
                       buckets of B' = min(B, Psi) elements (`reduce_gradients(pipeline_parallel=True)`,
                       `setup_buckets`; tds caps B at the rank's gradients, `tds.pipe.zero_buckets`):
                       2 B' e_w bytes at the reduce (bf16/fp16: + the partition's fp32 gradient 4 Psi / d,
                       made there)
    bf16, ZeRO 0       BF16_Optimizer: weights 2 Psi; fp32 master weights and moments and the flat bf16
                       gradient accumulators 14 Psi (measured with --log-memory: 4 + 8 + 2); gradients during
                       the iteration: the parameters' bf16 gradients 2 Psi before they are folded in and
                       released (DeepSpeed's clear_lp_grads). Checked on CPU (bench/memory_error.py) and on an
                       H100 (bench/gpu_throughput.py: GPT-2 medium, within +2.3 to +4.4 %)

A mixture of experts (`moe.py`): a MoE layer's parameters on this rank (its E / P routed experts, router, shared
expert), its saved bytes and backward working set from the rows its experts receive; at P > 1 the experts'
gradients reduce from a flat copy of their own, apart from the data-parallel buckets (`moe.moe_buffer_bytes`).

What a layer caches from its first forward on (the spec's `layer_cache_bytes`: GPT's rotary cos / sin tables,
2 s r e_a) is counted with the weights.

Activations: `activations.spec_activation_bytes` per chunk and micro-batch, run through this stage's
compute units (`tds.pipe.instructions.compute_order`, the order its `train_schedule` list runs them): + at each
FORWARD, - at each BACKWARD (ZB-H1:
most at B, the linears' inputs at W), so the peak is the schedule's own in-flight count weighted by what each
chunk holds. Plus, while a micro-batch runs backward, its working set: the gradient of one layer's
activations (~ one layer's saved bytes), with full recomputation one checkpointed chunk recomputed, with
selective recomputation one layer's attention core recomputed (CPU's math path; nothing on GPUs; under ZB-H1 with
the deferred linears' gradients kept beside it, `_zb_hold_in_backward`).
Boundary buffers: the stage output kept for backward (b s h e / t per in-flight micro-batch, not on the last
stage) and the received gradient; with gloo (CPU) every activation message the stage sends in an iteration
(`send_buffers`, counted with the weights: they live through the iteration).

The peak is the largest of three moments: the activation peak (weights, optimizer state, gradients, activations),
the gradient reduction (weights, optimizer, gradients, reduce buffers) and the optimizer step. Gradients that
param.grad holds (fp32, ZeRO-1) are made by the stage's first backward: at that moment they do not exist yet
(`unmade_gradients`), which decides the peak where no later backward has as many micro-batches in flight (as
many micro-batches as stages: the main job's layout, 7.6 % over before).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence

from tds.pipe.instructions import Op, compute_order
from tds.pipe.zero_buckets import DEFAULT_REDUCE_BUCKET, reduce_bucket_elements

from .activations import ActivationOptions, layer_bytes, recomputed_core_bytes, spec_activation_bytes
from .model_shape import ModelShape, layer_specs, partition, stage_chunks
from .moe import MoEPipeLayer, moe_buffer_bytes, moe_working_bytes
from .shared import SharedTerms

__all__ = ["Layout", "StageMemory", "stage_memory", "stage_parameters", "predict_memory", "compute_orders",
           "DEFAULT_REDUCE_BUCKET"]

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """A layout to plan: parallel sizes, batch, schedule, precision, memory options."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    gas: int = 1                     # micro-batches per iteration and replica (m)
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"          # none | selective | full
    recompute_num_layers: int = 1
    recompute_method: str = "uniform"  # full: uniform (runs of N layers) | block (first N layers of each chunk)
    zero_stage: int = 1
    precision: str = "fp32"          # fp32 | bf16 | fp16
    reduce_bucket: int = DEFAULT_REDUCE_BUCKET
    partition_method: object = "type:transformer"
    attention: str = "fused"         # fused (GPU memory-efficient SDPA) | math (CPU: s^2 probabilities kept)
    loss_fusion: bool = False        # --cross-entropy-loss-fusion
    ep: int = 1                      # --expert-model-parallel-size (a mixture of experts; folded out of tp x dp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def ds_zero_stage(self) -> int:
        """What DeepSpeed runs: ZeRO-1 with one replica runs as stage 0 (megatron.config.ds_config)."""
        return self.zero_stage if self.dp > 1 else 0

    def short(self) -> str:
        extra = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        sp = " sp" if self.sequence_parallel else ""
        rc = "" if self.recompute == "none" else f" rc-{self.recompute}"
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}{ep} mb{self.micro_batch} m{self.gas} {self.schedule}{extra}"
                f"{sp}{rc} zero{self.zero_stage} {self.precision}")


@dataclass
class StageMemory:
    """Predicted bytes of one rank of pipeline stage `stage` at its peak, by part."""
    stage: int
    params: int                      # elements on this rank
    weights: float
    gradients: float
    optimizer: float
    activations: float               # at the activation peak (in-flight micro-batches x their saved bytes)
    in_flight: int                   # micro-batch units alive at that peak
    working: float                   # backward working set and boundary buffers at that moment
    buffers: float                   # reduce buckets / flat all-reduce copy at the gradient reduction
    peak_moment: str = ""
    parts: Dict[str, float] = field(default_factory=dict)
    unmade_gradients: float = 0.0    # of `gradients`, what does not exist yet at the activation peak
    send_buffers: float = 0.0        # the pipeline's send messages held through the iteration (gloo)

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.send_buffers

    @property
    def peak(self) -> float:
        return max(self.static - self.unmade_gradients + self.activations + self.working, self.static + self.buffers)

    def as_dict(self) -> dict:
        """The fields and the peak (`dataclasses.asdict` without its deep copies, which cost a ranking's output)."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "parts": dict(self.parts), "peak": self.peak}


def _state_bytes(psi: int, lay: Layout) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer, reduce buffers) for `psi` parameters on this rank (module docstring)."""
    d, e = lay.dp, ELEMENT_BYTES[lay.precision]
    if lay.ds_zero_stage >= 1:  # DeepSpeedZeroOptimizer; two reduce buckets of B' = min(B, Psi) elements
        # bf16/fp16: the fp32 gradient of this rank's partition (4 Psi / d) appears at the reduce, not before
        partition_grads = 4 * psi / d if e == 2 else 0.0
        buckets = 2 * e * reduce_bucket_elements(lay.reduce_bucket, psi)
        return e * psi, e * psi, 12 * psi / d, buckets + partition_grads
    if e == 2:  # BF16_Optimizer: fp32 master and moments 12 Psi, flat bf16 gradients 2 Psi; fp32 accumulators
        return 2 * psi, 2 * psi, 14 * psi, 0.0
    return 4 * psi, 4 * psi, 8 * psi, (4 * psi if d > 1 else 0.0)


def _activation_options(lay: Layout) -> ActivationOptions:
    return ActivationOptions(lay.micro_batch, lay.tp, ELEMENT_BYTES[lay.precision], lay.sequence_parallel,
                             "selective" if lay.recompute == "selective" else "none", lay.attention, lay.loss_fusion)


def _logits_grad(m: ModelShape, lay: Layout, s_out: int) -> float:
    """The last stage's backward working set at the loss: its gradient of the logits, fp32 beside its cast to the
    logits' type in bf16/fp16 (4 + e per logit); fused (`mpu.cross_entropy`): in the logits' type (e per logit),
    in bf16/fp16 beside one fp32 chunk of at most CHUNK_ELEMENTS (fp32 computes each chunk in its place)."""
    e, rows, vocab = ELEMENT_BYTES[lay.precision], lay.micro_batch * s_out, m.padded_vocab(lay.tp) // lay.tp
    if not lay.loss_fusion:
        return rows * vocab * (4 + (e if e < 4 else 0))
    from megatron.mpu.cross_entropy import CHUNK_ELEMENTS  # here: the planner imports no torch for other layouts
    chunk_rows = min(rows, max(1, CHUNK_ELEMENTS // vocab)) if e < 4 else 0
    return rows * vocab * e + chunk_rows * vocab * 4


def _weight_grad_hold(m: ModelShape, lay: Layout, layers, head: bool) -> float:
    """ZB-H1: what a micro-batch keeps between its B and its W: each linear's input and output gradient, over the
    head's length s (the spec's `linear_widths`: a layer ~ (4h + (qkv + dense + fc1 + fc2)/t) b s e, GPT-2's
    (4h + 4w/t + 2f/t) b s e, a MoE layer its attention's (2h + (qkv + dense)/t) b s e; the head its input and the
    logits' gradient)."""
    e, b, t, h = ELEMENT_BYTES[lay.precision], lay.micro_batch, lay.tp, m.hidden
    s, widths = m.output_length, m.linear_widths
    per_layer = b * s * e * (4 * h + (widths.qkv + widths.dense + widths.fc1 + widths.fc2) / t)
    # a MoE layer's MLP is plain F.linear: its weight gradients are made in B, nothing held for W
    mlp = b * s * e * (2 * h + (widths.fc1 + widths.fc2) / t)
    moe = sum(isinstance(layer, MoEPipeLayer) for layer in layers)
    return len(layers) * per_layer - moe * mlp + (b * s * e * (h + m.padded_vocab(t) / t) if head else 0.0)


def _chunk_bytes(m: ModelShape, lay: Layout, specs, chunk: tuple[int, int], last: bool) -> tuple[float, ...]:
    """(bytes held per in-flight micro-batch, backward working set, held from B to W under ZB-H1) of a chunk."""
    o = _activation_options(lay)
    chosen = specs[chunk[0]:chunk[1]]
    layers = [s for s in chosen if s.transformer]
    others = sum(spec_activation_bytes(s, m, o) for s in chosen if not s.transformer)
    saved = {s: layer_bytes(s, m, o) for s in set(layers)}  # a chunk's layers are mostly one spec
    per_layer = [saved[s] for s in layers]
    e, b, h, t = o.element_bytes, lay.micro_batch, m.hidden, lay.tp
    s_out = m.output_length
    boundary = 0.0 if last else b * m.tokens * h * e  # the output kept for backward (T5: both stacks' states)
    if lay.sequence_parallel:
        boundary /= t  # each tp rank holds s / t of the sequence
    others += m.spec.chunk_bytes({s.kind for s in layers}, m.config, o)  # T5: the encoder output, once per chunk
    biggest = max(per_layer, default=0.0)
    # backward working set: a layer's activation gradients (about 3 MLP-sized tensors, measured), or on the
    # last stage the logits' gradient (`_logits_grad`)
    mlp_grads = max([3 * b * s_out * m.ffn * e / t] + [moe_working_bytes(s, m.config, o) for s in saved
                                                       if isinstance(s, MoEPipeLayer)])
    logits_grad = _logits_grad(m, lay, s_out) if last else 0.0
    hold = _weight_grad_hold(m, lay, layers, last) if lay.schedule == "zb-h1" else 0.0
    if lay.recompute == "full":
        # each checkpointed run of k layers keeps its input; in backward one run is recomputed at a time, after
        # the head's and final norm's activations (`others` on the last stage) are already freed. Block: the
        # first k layers of the chunk recompute one by one, the others keep everything.
        k = max(1, lay.recompute_num_layers)
        head = others if last else 0.0
        if lay.recompute_method == "block":
            # the first k layers are recomputed last in backward, after the kept layers' and the head's
            # activations of that micro-batch are freed: only what they add beyond those counts
            inputs, kept = min(k, len(layers)) * b * m.seq * h * e, sum(per_layer[k:])
            recomputed = max(0.0, sum(per_layer[:k]) - kept - head)
            held, working = others + inputs + kept + boundary, max(logits_grad, recomputed + mlp_grads)
        else:
            inputs = -(-len(layers) // k) * b * m.seq * h * e
            held, working = others + inputs + boundary, max(logits_grad, k * biggest + mlp_grads - head)
    else:
        # selective: a layer's attention core is recomputed while its backward runs, after the MLP's gradients
        # are freed
        recomputed = max((recomputed_core_bytes(s, m, o) for s in layers), default=0.0)
        if recomputed and lay.schedule == "zb-h1":  # the last stage's head and final norm bytes are freed by then
            recomputed += max(0.0, _zb_hold_in_backward(m, lay, per_layer) - (others if last else 0.0))
        held, working = others + sum(per_layer) + boundary, max(mlp_grads, recomputed, logits_grad)
    if chosen and chosen[0].lookup:  # the chunk's last backward: its embedding's
        working = max(working, _lookup_backward(m, lay, chosen[0]) + hold - held)
    return held, working, hold


def _lookup_backward(m: ModelShape, lay: Layout, embedding) -> float:
    """The moment an embedding runs its backward, the micro-batch's last: besides the ZB-H1 share its layers keep
    for W, only the embedding's own saved bytes, the gradient it receives (b s h e, T5: both stacks') and the
    dense gradient of its whole table (its parameters, in their dtype) that the backward makes before adding it
    to .grad are alive. Measured (bench/memory_error.py, tiny tp2 pp2 sp selective zb-h1): the first stage's peak,
    where the table is large against the activations (2 x V_p / t x h x 4 bytes live then: .grad and this one)."""
    o = _activation_options(lay)
    received = lay.micro_batch * m.tokens * m.hidden * o.element_bytes / (lay.tp if lay.sequence_parallel else 1)
    return spec_activation_bytes(embedding, m, o) + received + embedding.params * ELEMENT_BYTES[lay.precision]


def _zb_hold_in_backward(m: ModelShape, lay: Layout, per_layer: List[float]) -> float:
    """ZB-H1 with selective recomputation (CPU): when the first layer's attention core is recomputed in B, the
    deferred linears of every layer backwarded before it keep their output gradients and inputs for W (their
    other activations freed), and so do that layer's MLP and output projection: with sequence parallelism also
    the column linears' inputs re-gathered whole (the held part is s/t of them). Measured (bench/memory_error.py,
    gpt tp2 pp2 sp selective zb-h1): stage 0 was 12% under without this term."""
    e, b, t, h = ELEMENT_BYTES[lay.precision], lay.micro_batch, lay.tp, m.hidden
    s, widths = m.output_length, m.linear_widths
    sp = lay.sequence_parallel and t > 1
    grads = b * s * e * ((widths.qkv + widths.fc1) / t + 2 * h)  # dY of qkv, fc1 (split), dense, fc2
    gathered = 2 * b * s * h * e if sp else 0.0  # the inputs of qkv and fc1, all-gathered again in B
    kept = b * s * e * ((widths.dense + widths.fc2) / t + (0 if sp else 2 * h))  # inputs the held bytes hold
    later = sum(max(0.0, grads + gathered - (size - kept)) for size in per_layer[1:])
    first = b * s * e * (2 * h + widths.fc1 / t) + (b * s * h * e if sp else 0.0)  # dY of fc2, fc1, dense; its input
    return later + first


def _activation_peak(order: Sequence[tuple], chunks: Sequence[tuple]) -> tuple[tuple, tuple]:
    """Through the stage's compute units `order` (`compute_orders`), `chunks` each chunk's `_chunk_bytes` (a unit's
    activations from its F to its B; under ZB-H1 the W's share from B to W): the moment with the largest
    activations + working set up to the stage's first backward, and the one after it, each (activation bytes,
    units in flight, working set) at the first moment with its largest sum (`_peak_moment` picks one)."""
    forward, backward_input, weight = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT  # (enum reads are slow)
    live, units, k = 0.0, 0, 0  # k: 0 up to the first backward, 1 after it
    best, most = [(0.0, 0, 0.0), (0.0, 0, 0.0)], [0.0, 0.0]
    for op, _, chunk in order:
        held, working, hold = chunks[chunk]
        if op is forward:
            live, units = live + held, units + 1
            if live > most[k]:
                best[k], most[k] = (live, units, 0.0), live
        elif op is weight:
            live -= hold
        else:  # a backward, or ZB-H1's B
            if live + working > most[k]:
                best[k], most[k] = (live, units, working), live + working
            live, units, k = live - held + (hold if op is backward_input else 0.0), units - 1, 1
    return best[0], best[1]


def _peak_moment(first: tuple, later: tuple, unmade: float) -> tuple[tuple, float]:
    """(the activation peak, the gradient bytes not made yet then): the stage's first backward, before it has made
    the weight gradients that are allocated lazily (`unmade`), unless a later moment holds more."""
    if later[0] + later[2] > first[0] + first[2] - unmade:
        return later, 0.0
    return first, unmade


def _send_buffers(m: ModelShape, lay: Layout, stage: int) -> float:
    """gloo (CPU processes; `attention="math"` stands for them): a send completes only when waited for at the end
    of the batch, so every activation message of an iteration stays alive, and tds.pipe.boundary reuses them in
    the next: one per micro-batch and chunk that sends (every chunk but the model's last), each the hidden states
    of b x tokens positions this tp rank sends (its 1 / t part; T5's masks are not counted). Measured: the stage's
    storages at the start of an iteration hold all but one of them. On GPUs a send completes as it goes and its
    message is reused: not counted (not measured there)."""
    if lay.attention != "math" or lay.pp == 1:
        return 0.0
    sends = lay.gas * (lay.virtual_stages - (1 if stage == lay.pp - 1 else 0))
    return sends * lay.micro_batch * m.tokens * m.hidden * ELEMENT_BYTES[lay.precision] / lay.tp


def _unmade_gradients(grads: float, lay: Layout) -> float:
    """The gradient bytes the stage's first backward allocates (param.grad is None before it: torch's AdamW, the
    ZeRO-1 optimizer); BF16_Optimizer's bf16 gradients are views of one flat buffer made before it (measured with
    --log-memory: fp32 and ZeRO-1 ranks start an iteration with no gradient, bf16 ZeRO-0 ranks with all)."""
    return 0.0 if lay.ds_zero_stage == 0 and ELEMENT_BYTES[lay.precision] == 2 else grads


def _compute_orders(schedule: str, pp: int, gas: int, v: int) -> list:
    """Each stage's compute units (pp = 1: forward and backward of each micro-batch in turn)."""
    if pp == 1:
        return [[(op, i, 0) for i in range(gas) for op in (Op.FORWARD, Op.BACKWARD)]]
    return [compute_order(schedule, pp, stage, gas, v) for stage in range(pp)]


def compute_orders(lay: Layout, shared: SharedTerms) -> list:
    """Each stage's compute units under the layout's schedule (`tds.pipe.instructions.compute_order`), shared."""
    key = (lay.schedule, lay.pp, lay.gas, lay.virtual_stages)
    return shared.get("orders", key, lambda: _compute_orders(*key))


def stage_params(specs, chunks) -> int:
    """Parameters of this rank's chunks; layer specs tied to one module (a tied embedding and head) on one stage
    are that module once."""
    total, tied = 0, set()
    for i in (i for a, b in chunks for i in range(a, b)):
        if specs[i].tie and specs[i].tie in tied:
            continue
        tied.add(specs[i].tie)
        total += specs[i].params
    return total


def layer_caches(m: ModelShape, lay: Layout, layers: int) -> float:
    """What `layers` transformer layers cache from their first forward on, held like the weights (the spec's
    `layer_cache_bytes`: GPT's rotary cos / sin tables, (s, r) each in the activations' dtype)."""
    return layers * m.spec.layer_cache_bytes(m.config, ELEMENT_BYTES[lay.precision])


def _specs_and_chunks(m: ModelShape, lay: Layout, stage: int, shared: SharedTerms) -> tuple[list, list]:
    """(the model's layer specs at this tp, this stage's chunks as spec ranges)."""
    specs = shared.get("specs", (m, lay.tp, lay.ep), lambda: layer_specs(m, lay.tp, lay.ep))
    method = lay.partition_method
    parts = lay.pp * lay.virtual_stages
    key = (m, lay.tp, lay.ep, parts, tuple(method) if isinstance(method, list) else method)
    bounds = shared.get("partition", key, lambda: partition(specs, parts, method))
    return specs, stage_chunks(bounds, lay.pp, lay.virtual_stages, stage)


def stage_parameters(m: ModelShape, lay: Layout, shared: Optional[SharedTerms] = None) -> List[int]:
    """Parameters on one rank of each stage (`StageMemory.params`), without the rest of the prediction."""
    shared = shared or SharedTerms()
    return [stage_params(*_specs_and_chunks(m, lay, s, shared)) for s in range(lay.pp)]


def stage_memory(m: ModelShape, lay: Layout, stage: int, shared: Optional[SharedTerms] = None) -> StageMemory:
    """One rank of pipeline stage `stage`; `shared`: the terms other layouts of a ranking computed already."""
    shared = shared or SharedTerms()
    specs, chunks = _specs_and_chunks(m, lay, stage, shared)
    psi = stage_params(specs, chunks)
    weights, grads, opt, buffers = _state_bytes(psi, lay)
    if lay.ep > 1:  # the experts' gradients reduce on their own (`moe.moe_buffer_bytes`), not in the dp buckets
        experts = sum(specs[i].experts for a, b in chunks for i in range(a, b) if isinstance(specs[i], MoEPipeLayer))
        own = 4.0 * (psi - experts) if buffers and lay.ds_zero_stage == 0 and lay.precision == "fp32" else buffers
        buffers = max(own, moe_buffer_bytes(experts, lay.ep))
    weights += layer_caches(m, lay, sum(specs[i].transformer for a, b in chunks for i in range(a, b)))
    n = len(chunks)
    per_chunk = tuple(_chunk_bytes(m, lay, specs, ch, last=(stage == lay.pp - 1 and c == n - 1))
                      for c, ch in enumerate(chunks))
    order = compute_orders(lay, shared)[stage]
    schedule = (lay.schedule, lay.pp, stage, lay.gas, lay.virtual_stages)
    first, later = shared.get("peak", (schedule, per_chunk), lambda: _activation_peak(order, per_chunk))
    (act, units, work), unmade = _peak_moment(first, later, _unmade_gradients(grads, lay))
    if lay.ds_zero_stage >= 1:
        work += buffers / 2  # ZeRO-1: one of the two reduce buckets exists from the first backward on
    out = StageMemory(stage, psi, weights, grads, opt, act, units, work, buffers, unmade_gradients=unmade,
                      send_buffers=_send_buffers(m, lay, stage))
    out.peak_moment = "activations" if act + work - unmade >= buffers else "gradient reduction"
    return out


def predict_memory(m: ModelShape, lay: Layout, shared: Optional[SharedTerms] = None) -> List[StageMemory]:
    """Every pipeline stage's per-rank prediction (all tp and dp ranks of a stage hold the same)."""
    shared = shared or SharedTerms()
    return [stage_memory(m, lay, s, shared) for s in range(lay.pp)]


def layout_from_args(args, attention: str = "fused") -> Layout:
    """The Layout of resolved arguments (`megatron.config.arguments.parse_args`): the run's own layout.

    Recomputation: --recompute-granularity (selective | full) where the parser has it, else full with
    --checkpoint-activations. Sequence parallelism: --sequence-parallel where the parser has it."""
    granularity = getattr(args, "recompute_granularity", None)
    recompute = granularity or ("full" if getattr(args, "checkpoint_activations", False) else "none")
    method = getattr(args, "recompute_method", None) or "uniform"
    num_layers = getattr(args, "recompute_num_layers", None) or getattr(args, "checkpoint_num_layers", None) or 1
    bucket = args.ds_config.get("zero_optimization", {}).get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET) \
        if isinstance(getattr(args, "ds_config", None), dict) else DEFAULT_REDUCE_BUCKET
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    partition = args.partition_method or "type:transformer"
    if isinstance(partition, str) and partition.startswith("type:"):
        partition = "type:transformer"
    return Layout(tp=args.tensor_model_parallel_size, pp=args.pipe_parallel_size, dp=args.data_parallel_size,
                  micro_batch=args.micro_batch_size, gas=args.gas, schedule=args.pipeline_schedule,
                  virtual_stages=args.virtual_pipe_stages or 1,
                  sequence_parallel=bool(getattr(args, "sequence_parallel", False)), recompute=recompute,
                  recompute_num_layers=num_layers, recompute_method=method,
                  zero_stage=args.zero_stage, precision=precision, reduce_bucket=int(bucket),
                  partition_method=partition, attention=attention,
                  loss_fusion=bool(getattr(args, "cross_entropy_loss_fusion", False)),
                  ep=getattr(args, "expert_model_parallel_size", None) or 1)
