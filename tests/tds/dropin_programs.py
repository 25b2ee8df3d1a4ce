"""DeepSpeed-0.19-style pipeline programs that declare nothing, run on TDS (or DeepSpeed's own engine) and on
one plain torch process for reference.

A program is what a DeepSpeed user writes: a layer list (nn.Modules, LayerSpecs, TiedLayerSpecs, lambdas),
a loss function, PipelineModule keywords, and (inputs, labels) micro-batches. The layer lists are built from
fixed seeds, so every rank and the reference hold the same initial weights.

Shapes: b = micro-batch (MBS), images (b, 3, 8, 8) -> 10 classes; the tuple programs use tests/tds/layers.py
(D_IN = 6, H = 8, D_OUT = 3).
"""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.tds import common, harness, layers
from tests.tds.common import D_IN, D_OUT, H

STEPS, GAS, MBS = 2, 2, 2
LR = 0.05


@dataclass
class Program:
    layers: Callable[[], list]            # a fresh layer list (same weights every call)
    batches: Callable[[int], list]        # n micro-batches per step -> [[(x, y)] * n] * STEPS
    loss_fn: Callable = common.mse
    module_kwargs: dict = field(default_factory=dict)
    pipeline: dict = field(default_factory=dict)  # the DeepSpeed JSON's "pipeline" section
    eval_first: bool = False                      # eval_batch on step 0's micro-batches before training


# --- an AlexNet-like CNN with in-place ReLUs (as DeepSpeed's own AlexNetPipe test model) -------------------
def cnn_layers() -> list:
    """16 layers; with 'uniform' partitioning every stage after the first starts with an in-place ReLU at pp=2
    (stage 1) and pp=4 (stages 1-3), and every stage holds parameters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),   # (b, 8, 4, 4)
                nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True),                   # (b, 16, 4, 4)
                nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(inplace=True),
                nn.Conv2d(16, 16, 1), nn.ReLU(inplace=True), nn.MaxPool2d(2),            # (b, 16, 2, 2)
                lambda x: x.flatten(1), nn.Linear(64, 32),                               # (b, 32)
                nn.ReLU(inplace=True), nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, 10)]  # (b, 10)


def cnn_batches(n: int) -> list:
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(MBS, 3, 8, 8, generator=g), torch.randint(0, 10, (MBS,), generator=g))
             for _ in range(n)] for _ in range(STEPS)]


def cnn(interval: int = 0, mode: str = "default") -> Program:
    """mode: the module's activation_checkpoint_func: 'default' (TDS's), 'non_reentrant', 'reentrant' (torch)
    or 'deepspeed' (deepspeed.checkpointing.checkpoint, unconfigured)."""
    kwargs = {"activation_checkpoint_interval": interval}
    if mode != "default":
        kwargs["activation_checkpoint_func"] = checkpoint_func(mode)
    return Program(cnn_layers, cnn_batches, nn.CrossEntropyLoss(), kwargs)


def checkpoint_func(mode: str) -> Callable:
    import deepspeed

    from tds.pipe import non_reentrant_checkpoint, reentrant_checkpoint
    return {"non_reentrant": non_reentrant_checkpoint, "reentrant": reentrant_checkpoint,
            "deepspeed": deepspeed.checkpointing.checkpoint}[mode]


# --- shapes that change per micro-batch: (h float, keep bool) with (b, s) varying ----------------------------
SEQ_SHAPES = [(2, 3), (3, 5), (1, 4), (4, 2), (2, 3), (2, 6)]


def seq_layers() -> list:
    from tds.pipe import LayerSpec
    return [LayerSpec(layers.SeqIn, 0), LayerSpec(layers.SeqMid, 10), LayerSpec(layers.SeqMid, 20),
            LayerSpec(layers.SeqHead, 99)]


def seq_batches(n: int) -> list:
    g = torch.Generator().manual_seed(3)
    shapes = iter(SEQ_SHAPES * n)
    return [[_seq_item(*next(shapes), g) for _ in range(n)] for _ in range(STEPS)]


def _seq_item(b: int, s: int, g):
    return torch.randn(b, s, D_IN, generator=g), torch.randn(b, D_OUT, generator=g)


# --- tied embedding and head, a tied hidden layer used twice -------------------------------------------------
class TiedEmbed(nn.Module):
    """weight (H, D_IN): x (b, D_IN) -> tanh(x W^T) (b, H); the head uses W^T."""

    def __init__(self, seed: int):
        super().__init__()
        self.weight = nn.Parameter(harness.seeded((H, D_IN), seed, D_IN ** -0.5))

    def forward(self, x):
        return torch.tanh(F.linear(x, self.weight))


def tied_head(module: TiedEmbed, h):
    return h @ module.weight  # (b, H) -> (b, D_IN)


def tied_layers() -> list:
    from tds.pipe import LayerSpec, TiedLayerSpec
    alpha = dict(tied_weight_attr=["lin.weight", "lin.bias"])
    return [TiedLayerSpec("embed", TiedEmbed, 0), TiedLayerSpec("alpha", layers.HiddenLayer, 5, **alpha),
            LayerSpec(layers.HiddenLayer, 10), LayerSpec(layers.HiddenLayer, 20),
            TiedLayerSpec("alpha", layers.HiddenLayer, 5, **alpha),
            TiedLayerSpec("embed", TiedEmbed, 0, forward_fn=tied_head)]


def tied_batches(n: int) -> list:
    g = torch.Generator().manual_seed(9)
    return [[(torch.randn(MBS, D_IN, generator=g), torch.randn(MBS, D_IN, generator=g)) for _ in range(n)]
            for _ in range(STEPS)]


# --- plain torch layers under ZB-H1 (issue 20): only the schedule key differs from a 1F1B program --------------
ZB = {"schedule": "zb-h1"}


def linear_layers() -> list:
    """nn.Linear / nn.LayerNorm: (b, D_IN) -> (b, D_OUT)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return [nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU(),
                nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, D_OUT)]


class MeanHead(nn.Linear):
    """(b, s, h) -> mean over s -> (b, D_OUT)."""

    def forward(self, x):
        return super().forward(x.mean(1))


def encoder_layers() -> list:
    """nn.TransformerEncoderLayer x 3 between linears: (b, s, D_IN) -> (b, s, 16) -> (b, D_OUT)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        return [nn.Linear(D_IN, 16)] + [nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
                                         for _ in range(3)] + [MeanHead(16, D_OUT)]


def encoder_batches(n: int) -> list:
    g = torch.Generator().manual_seed(4)
    return [[(torch.randn(MBS, 5, D_IN, generator=g), torch.randn(MBS, D_OUT, generator=g)) for _ in range(n)]
            for _ in range(STEPS)]


def zero_bubble_programs() -> dict[str, Program]:
    """ZB-H1 over layers whose weight gradients only the autograd graph can defer (graph_split.py); with
    reentrant checkpointing they cannot (B computes them, reported once per stage)."""
    cnn_ck = {name: cnn(1, mode) for name, mode in (("zb_cnn_k1_default", "default"),
                                                     ("zb_cnn_k1_reentrant", "reentrant"))}
    for program in cnn_ck.values():
        program.pipeline = ZB
    return {"zb_linear": Program(linear_layers, tuple_batches, pipeline=ZB),
            "zb_encoder": Program(encoder_layers, encoder_batches, pipeline=ZB),
            "zb_tied": Program(tied_layers, tied_batches, pipeline=ZB), **cnn_ck}


# --- the tuples DeepSpeed gets wrong (tests/tds/layers.py), undeclared -------------------------------------
def tuple_layers(kind: str) -> Callable[[], list]:
    from tests.tds import test_engine_tuples as tuples
    return lambda: tuples.specs_of(*tuples.KINDS[kind])


def tuple_batches(n: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(MBS, D_IN, generator=g), torch.randn(MBS, D_OUT, generator=g)) for _ in range(n)]
            for _ in range(STEPS)]


def programs() -> dict[str, Program]:
    """Every program of the acceptance runs, by name."""
    out = {"cnn": cnn(), "seq": Program(seq_layers, seq_batches, module_kwargs={"dynamic_shape": True}),
           "tied": Program(tied_layers, tied_batches),
           "two_interval2": Program(tuple_layers("two"), tuple_batches,
                                    module_kwargs={"activation_checkpoint_interval": 2}),
           "two_json_interval": Program(tuple_layers("two"), tuple_batches,
                                        pipeline={"activation_checkpoint_interval": 1, "use_reentrant": True})}
    out["mixed"] = Program(tuple_layers("mixed"), tuple_batches)
    out["unused_eval_first"] = Program(tuple_layers("unused"), tuple_batches, eval_first=True)
    for mode in ("default", "non_reentrant", "reentrant", "deepspeed"):
        out[f"cnn_k1_{mode}"] = cnn(1, mode)
    out["inplace_first_reentrant"] = Program(inplace_first_layers, tuple_batches, module_kwargs={
        "activation_checkpoint_interval": 2, "activation_checkpoint_func": checkpoint_func("reentrant")})
    out.update(zero_bubble_programs())
    return out


def inplace_first_layers() -> list:
    """An in-place ReLU first on stage 0 and first in a reentrant checkpointed run (at pp 2), whose
    recomputation gets inputs that require grad (the engine's `_reentrant_activation_checkpointing`)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        return [nn.ReLU(inplace=True), nn.Linear(D_IN, H), nn.Tanh(), nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H),
                nn.Tanh(), nn.Linear(H, D_OUT)]


# --- running -----------------------------------------------------------------------------------------------
def build(program: Program, pp: int, dp: int = 1, tp: int = 1, deepspeed_engine: bool = False):
    """`deepspeed.initialize` of the program's PipelineModule, with `import tds as deepspeed` (or DeepSpeed)."""
    import deepspeed as real_deepspeed

    import tds
    ds = real_deepspeed if deepspeed_engine else tds
    common.init_ds()
    model = ds.pipe.PipelineModule(program.layers(), topology=common.topology(pp, tp, dp),
                                   loss_fn=program.loss_fn, partition_method="uniform", **program.module_kwargs)
    cfg = common.ds_config(MBS, GAS, dp, 1 if dp > 1 else 0, **program.pipeline)  # ZeRO-1 where it partitions
    engine, _, _, _ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=cfg)
    return engine


def train(program: Program, engine) -> tuple[list[float], float | None]:
    """(losses of the program's steps, eval loss of step 0 before training if program.eval_first).

    Data-parallel replica d reads micro-batches d*GAS .. d*GAS+GAS-1 of each step."""
    dp, d = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    steps = [step[d * GAS:(d + 1) * GAS] for step in program.batches(GAS * dp)]
    eval_loss = engine.eval_batch(iter(steps[0])).item() if program.eval_first else None
    layers.Recorder.events.clear()  # what the layers record is about training
    it = iter([mb for step in steps for mb in step])
    return [engine.train_batch(it).item() for _ in steps], eval_loss


def run(name: str, pp: int, dp: int = 1, deepspeed_engine: bool = False) -> dict:
    """Train one program on this rank; an exception is returned as text so other programs still run.
    Also returns the layout lines TDS logged and what the test layers recorded (layers.Recorder)."""
    from deepspeed.utils import logger
    layers.Recorder.events.clear()
    logged = _Collect()
    logger.addHandler(logged)
    try:
        program = programs()[name]
        engine = build(program, pp, dp, deepspeed_engine=deepspeed_engine)
        losses, eval_loss = train(program, engine)
    except Exception as e:  # noqa: BLE001 - reported per program by the test
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
    finally:
        logger.removeHandler(logged)
    return {"losses": losses, "eval_loss": eval_loss, "params": harness.engine_params(engine),
            "stage": engine.stage_id, "events": list(layers.Recorder.events), "error": None,
            "logs": [m for m in logged.messages if "layout" in m or "position" in m or "ZB-H1" in m]}


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


def reference(name: str, dp: int = 1) -> tuple[list[float], dict]:
    """Single process: each step's dp*GAS micro-batches, loss_i/(dp*GAS) accumulated, one SGD step."""
    program = programs()[name]
    funcs, params = _reference_layers(program.layers())
    opt = torch.optim.SGD([p for p in params.values()], lr=LR)
    losses = []
    for step in program.batches(GAS * dp):
        opt.zero_grad()
        total = 0.0
        for x, y in step:
            for f in funcs:
                x = f(x)
            loss = program.loss_fn(x, y)
            (loss / len(step)).backward()
            total += loss.item() / len(step)
        opt.step()
        losses.append(total)
    return losses, {k: p.detach().clone() for k, p in params.items()}


def _reference_layers(specs: list) -> tuple[list, dict]:
    """Callables in order and {'idx.param' | 'tied.key.param': parameter}, keyed as harness.engine_params."""
    from tds.pipe import LayerSpec, TiedLayerSpec
    tied, funcs, params = {}, [], {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            mod = tied.setdefault(spec.key, spec.build())
            funcs.append(mod if spec.forward_fn is None else (lambda x, m=mod, f=spec.forward_fn: f(m, x)))
            params.update({f"tied.{spec.key}.{n}": p for n, p in mod.named_parameters()})
            continue
        layer = spec.build() if isinstance(spec, LayerSpec) else spec
        funcs.append(layer)
        if isinstance(layer, nn.Module):
            params.update({f"{idx}.{n}": p for n, p in layer.named_parameters()})
    return funcs, params


def assert_matches(results: list, name: str, dp: int = 1, tol: float = 1e-5) -> None:
    """Every rank's losses and parameters equal the reference's (relative error < tol)."""
    errors = [r["error"] for r in results if r["error"]]
    assert not errors, f"{name}: {errors[0]}"
    ref_losses, ref_params = reference(name, dp)
    try:
        harness.assert_close(results, ref_losses, ref_params, tol)
    except AssertionError as e:
        raise AssertionError(f"{name}: {e}") from None
