"""Issue 12, schedule-specific checks of the engine (tests/tds/test_schedules_engine.py has the equivalence grid):

- interleaved 1F1B with tied weights used on two stages and twice on one stage, and activation checkpointing
  (non-reentrant and reentrant); ZB-H1 with the same model: one process's losses and weights (fp32, < 1e-5);
  eval_batch with a micro-batch count that is not a multiple of the stages;
- ZB-H1 in bf16 and fp16 with ZeRO-1, in bf16 with ZeRO 0 (DeepSpeed's BF16_Optimizer), interleaved in bf16,
  at pp 2 x dp 2: the same run with 1F1B (which test_engine_mixed_precision.py checks against one process)
  within 4 units in the last place (eps); the ZeRO backward depth is back to 0;
- a checkpoint saved with 2 chunks per stage loads (module weights) with 1 chunk and with another pp;
- the timeline: "pipeline": {"timeline": ..., "timeline_batches": [...]} writes a Chrome trace of exactly those
  batches, every stage, every instruction, readable by tools/plot_pipeline.py;
- mistakes: a schedule that does not fit the model or the batch is a ValueError naming the values.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tests.tds import common, harness, layers

MBS, GAS, STEPS = 2, 4, 3
DECL = ([True], ["float"], [False])
EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}


class DeferredProj(layers.TiedProj):
    """TiedProj whose weight gradient ZB-H1 defers (the tied head's use, h @ W, is not deferred)."""
    weight_grad_store = None

    def forward(self, x):  # (b, D_IN) -> (b, H)
        from tds.pipe.weight_grad import linear
        return torch.tanh(linear(x, self.weight, self.bias, self.weight_grad_store))


class DeferredHidden(layers.HiddenLayer):
    weight_grad_store = None

    def forward(self, h):  # (b, H) -> (b, H)
        from tds.pipe.weight_grad import linear
        return torch.tanh(linear(h, self.lin.weight, self.lin.bias, self.weight_grad_store))


def tied_specs(mid: int = 2):
    """mid + 4 layers; 'embed' on the first and last layer (first and last stage), 'alpha' on layers 1 and
    mid + 2 (with 6 layers, pp 2 and 2 chunks: both on stage 0, one in each chunk)."""
    from tds.pipe import LayerSpec, TiedLayerSpec
    embed, alpha = ["weight", "bias"], ["lin.weight", "lin.bias"]
    return [TiedLayerSpec("embed", DeferredProj, 0, tied_weight_attr=embed),
            TiedLayerSpec("alpha", DeferredHidden, 5, tied_weight_attr=alpha),
            *(LayerSpec(DeferredHidden, 10 * (i + 1)) for i in range(mid)),
            TiedLayerSpec("alpha", DeferredHidden, 5, tied_weight_attr=alpha),
            TiedLayerSpec("embed", DeferredProj, 0, forward_fn=layers.tied_head, tied_weight_attr=embed)]


def batches(steps: int = STEPS, seed: int = 9, dtype=torch.float32, n: int = GAS):
    """steps lists of n micro-batches (x (MBS, D_IN) in `dtype`, y (MBS, D_IN))."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(MBS, common.D_IN, generator=g).to(dtype), torch.randn(MBS, common.D_IN, generator=g))
             for _ in range(n)] for _ in range(steps)]


def params(engine) -> dict:
    """Parameters keyed by global layer index (chunks are not contiguous) and tied key."""
    module, out = engine.module, {}
    tied = {id(m) for m in module.tied_modules.values()}
    for i, layer in enumerate(module.forward_funcs):
        if isinstance(layer, torch.nn.Module) and id(layer) not in tied:
            out.update({f"{module.layer_index[i]}.{n}": p.detach().float().clone()
                        for n, p in layer.named_parameters()})
    for key, mod in module.tied_modules.items():
        out.update({f"tied.{key}.{n}": p.detach().float().clone() for n, p in mod.named_parameters()})
    return out


def build(schedule: str, v: int = 1, pp: int = 2, dp: int = 1, zero: int = 1, extra: dict | None = None,
          pipeline: dict | None = None, mid: int = 2, **module_kwargs):
    pipe = dict(schedule=schedule, **({"virtual_stages": v} if v > 1 else {}), **(pipeline or {}))
    return harness.build(tied_specs(mid), DECL, pp=pp, dp=dp, gas=GAS, mbs=MBS, zero=zero, opt="adam",
                         partition_method="uniform", extra_cfg=extra, pipeline=pipe, virtual_stages=v,
                         **module_kwargs)


# --- fp32: tied weights x checkpointing x schedule, eval ------------------------------------------------------
FP32_CASES = [("interleaved", 2, 1, "non-reentrant"), ("interleaved", 2, 2, "reentrant"),
              ("zb-h1", 1, 1, "non-reentrant")]  # (schedule, v, checkpoint interval, checkpoint function)


def fp32_rank(cases, pp: int = 2, mid: int = 2) -> list:
    from tds.pipe import reentrant_checkpoint
    out = []
    for schedule, v, interval, fn in cases:
        kwargs = {"activation_checkpoint_interval": interval}
        if fn == "reentrant":
            kwargs["activation_checkpoint_func"] = reentrant_checkpoint
        engine = build(schedule, v, pp=pp, mid=mid, **kwargs)
        losses = harness.train(engine, batches())
        items = [mb for step in batches(1, seed=3) for mb in step][:3]  # 3 micro-batches: not a multiple of pp
        loss, logits = engine.eval_batch(iter(items), return_logits=True, num_micro_batches=3)
        out.append({"losses": losses, "params": params(engine), "eval": (loss.item(), logits)})
    return out


def test_tied_weights_and_checkpointing_under_interleaved_and_zb_h1():
    results = run_distributed(fp32_rank, 2, FP32_CASES, timeout=240)
    ref_losses, ref_params, forward = harness.reference_model(tied_specs(), batches(), GAS, opt="adam")
    items = [mb for step in batches(1, seed=3) for mb in step][:3]
    with torch.no_grad():
        outs = [forward(x) for x, _ in items]
    want = sum(common.mse(o, y).item() for o, (_, y) in zip(outs, items)) / 3
    for k, case in enumerate(FP32_CASES):
        runs = [r[k] for r in results]
        harness.assert_close(runs, ref_losses, ref_params)
        first, last = runs[0]["params"], runs[1]["params"]
        for name in (n for n in first if n.startswith("tied.embed")):
            assert torch.equal(first[name], last[name]), f"{case}: tied {name} differs between stages"
        for stage, r in enumerate(runs):
            loss, logits = r["eval"]
            assert abs(loss - want) < 1e-5 * want, case
            assert (logits is None) == (stage == 0) and (stage == 0 or all(
                torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(logits, outs))), case


# --- bf16 / fp16 with ZeRO-1: ZB-H1 and interleaved against 1F1B ------------------------------------------
HALF_CASES = [("bf16", "1f1b", 1, 1), ("bf16", "zb-h1", 1, 1), ("bf16", "interleaved", 2, 1),
              ("bf16", "1f1b", 1, 0), ("bf16", "zb-h1", 1, 0),  # ZeRO 0: DeepSpeed's BF16_Optimizer, flat tail
              ("fp16", "1f1b", 1, 1), ("fp16", "zb-h1", 1, 1)]  # (dtype, schedule, v, ZeRO stage)


def half_rank(cases) -> list:
    out = []
    with allow_cpu_fp16():
        for dtype, schedule, v, zero in cases:
            extra = {dtype: {"enabled": True, **({"initial_scale_power": 8} if dtype == "fp16" else {})}}
            engine = build(schedule, v, dp=2, zero=zero, extra=extra)
            dp_rank = engine.grid.get_data_parallel_rank()
            data = batches(dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype], n=2 * GAS)
            losses = harness.train(engine, [step[dp_rank * GAS:(dp_rank + 1) * GAS] for step in data])
            out.append({"losses": losses, "params": params(engine), "optimizer": type(engine.optimizer).__name__,
                        "depth": getattr(engine.optimizer, "_backward_active_depth", 0)})
    return out


@pytest.mark.long
def test_zb_h1_and_interleaved_in_bf16_and_fp16_with_zero1():
    results = run_distributed(half_rank, 4, HALF_CASES, timeout=300)
    merged = [{k: v for r in results for k, v in r[c]["params"].items()} for c in range(len(HALF_CASES))]
    for c, (dtype, schedule, v, zero) in enumerate(HALF_CASES):
        base = HALF_CASES.index((dtype, "1f1b", 1, zero))
        tol = 4 * EPS[dtype]
        assert set(merged[c]) == set(merged[base])
        for name, p in merged[c].items():
            err = common.max_rel_err(p, merged[base][name])
            assert err <= tol, f"{dtype} {schedule} {name}: rel err {err:.2e} vs 1f1b > {tol:.1e}"
        for r in results:
            got, want = r[c], r[base]
            # ZeRO 0: DeepSpeed's BF16_Optimizer with TDS's flat step tail (tds/pipe/bf16_tail.py), a subclass
            assert got["optimizer"] == ("FlatBF16Optimizer" if zero == 0 else "DeepSpeedZeroOptimizer"), got["optimizer"]
            assert got["depth"] == 0
            assert len(got["losses"]) == STEPS
            for step, (a, b) in enumerate(zip(got["losses"], want["losses"])):
                assert abs(a - b) <= tol * abs(b), f"{dtype} {schedule} step {step}: loss {a} vs 1f1b {b}"


# --- checkpoints across virtual stages, the timeline, mistakes ---------------------------------------------
def ckpt_timeline_rank(path: str) -> dict:
    engine = build("interleaved", 2, pipeline={"timeline": os.path.join(path, "trace.json"),
                                               "timeline_batches": [2, 3]})
    harness.train(engine, batches())
    engine.save_checkpoint(path, tag="v2")
    saved = params(engine)
    loaded = {}
    for label, pp, dp in (("pp2-v1", 2, 1), ("pp1-dp2", 1, 2)):
        other = build("1f1b", 1, pp=pp, dp=dp)
        other.load_module_weights(path, tag="v2")
        loaded[label] = params(other)
    torch.distributed.barrier()
    return {"saved": saved, "loaded": loaded, "errors": config_errors()}


def config_errors() -> list:
    out = []
    for kwargs in (dict(schedule="interleaved", v=1), dict(schedule="1f1b", v=1, pipeline={"virtual_stages": 2}),
                   dict(schedule="interleaved", v=2, pp=2, pipeline={}, gas=3)):
        gas = kwargs.pop("gas", GAS)
        try:
            pipe = dict(schedule=kwargs["schedule"], **kwargs.get("pipeline", {}))
            if kwargs["v"] > 1:
                pipe.setdefault("virtual_stages", kwargs["v"])
            harness.build(tied_specs(), DECL, pp=2, gas=gas, mbs=MBS, partition_method="uniform", pipeline=pipe,
                          virtual_stages=kwargs["v"])
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    engine = build("interleaved", 2)
    try:  # a batch-size change (Megatron's ramp-up) must keep m a multiple of the stages
        engine.set_train_batch_size(MBS * 5)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    out.append(engine.micro_batches)  # unchanged
    return out


def test_checkpoint_across_virtual_stages_timeline_and_mistakes(tmp_path):
    from tds.pipe.timeline import read_trace
    from tools import plot_pipeline
    results = run_distributed(ckpt_timeline_rank, 2, str(tmp_path), timeout=240)
    saved = {k: v for r in results for k, v in r["saved"].items()}
    for label in ("pp2-v1", "pp1-dp2"):
        loaded = {k: v for r in results for k, v in r["loaded"][label].items()}
        assert set(loaded) == set(saved), label
        for name, p in loaded.items():
            assert torch.equal(p, saved[name]), f"{label}: {name} differs from the saved v=2 model"
    spans, meta = read_trace(os.path.join(tmp_path, "trace.json"))
    assert meta["schedule"] == "interleaved" and meta["virtual_stages"] == 2 and meta["stages"] == 2
    assert {s.batch for s in spans} == {2, 3} and {s.stage for s in spans} == {0, 1}
    from tds.pipe.schedule import train_schedule
    for stage in (0, 1):
        want = [(i.op.value, i.micro_batch, i.chunk) for i in train_schedule("interleaved", 2, stage, GAS, 2)]
        got = [(s.op, s.micro_batch, s.chunk) for s in sorted(spans, key=lambda s: s.start)
               if s.stage == stage and s.batch == 2]
        assert got == want, f"stage {stage}: recorded instructions differ from the schedule"
    fractions = plot_pipeline.main([os.path.join(tmp_path, "trace.json"), "--batch", "3"])
    assert len(fractions) == 1 and all(0.0 <= f < 1.0 for f in fractions[0].values())
    errors = results[0]["errors"]
    assert "virtual_stages=1" in errors[0] and "PipelineModule(..., virtual_stages=2)" in errors[0]
    assert "pipeline.virtual_stages=2" in errors[1] and "virtual_stages=1" in errors[1]
    assert "micro_batches=3" in errors[2] and "multiple" in errors[2]
    assert "micro_batches=5" in errors[3] and errors[4] == GAS


@pytest.mark.slow
def test_tied_weights_and_checkpointing_at_four_stages():
    """pp 4, 8 layers: 'embed' on stages 0 and 3; interleaved (8 parts of one layer) and ZB-H1."""
    cases = [("interleaved", 2, 1, "non-reentrant"), ("interleaved", 2, 1, "reentrant"), ("zb-h1", 1, 2, "reentrant")]
    results = run_distributed(fp32_rank, 4, cases, 4, 4, timeout=300)
    ref_losses, ref_params = harness.reference(tied_specs(4), batches(), GAS, opt="adam")
    for k in range(len(cases)):
        harness.assert_close([r[k] for r in results], ref_losses, ref_params)
