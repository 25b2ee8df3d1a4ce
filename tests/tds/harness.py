"""Build a TDS pipeline from layer specs, train it on explicit micro-batches, and train the same layers in
one plain torch process for reference (same micro-batches, loss_i / m accumulated, same optimizer)."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests.tds import common

LR = 0.05


def optimizer(params, kind: str):
    return torch.optim.SGD(params, lr=LR) if kind == "sgd" else common.make_optimizer(params)


def build(specs, decl, pp: int, gas: int, mbs: int = 2, dp: int = 1, tp: int = 1, zero: int = 1,
          loss_fn=common.mse, opt: str = "sgd", partition_method="uniform", extra_cfg: dict | None = None,
          pipeline: dict | None = None, **module_kwargs):
    """(engine) for a PipelineModule over `specs` with declaration decl = (grad, type, partitioned)."""
    import tds as deepspeed
    from tds.pipe import PipelineModule
    common.init_ds()
    model = PipelineModule(specs, topology=common.topology(pp, tp, dp), loss_fn=loss_fn,
                           partition_method=partition_method, **module_kwargs)
    if decl is not None:
        model._input_grad, model._input_type, model._input_pipe_partitioned = decl
    cfg = common.ds_config(mbs, gas, dp, zero, **(pipeline or {}))
    cfg.update(extra_cfg or {})
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters(), opt), config=cfg)
    return engine


def build_deepspeed(specs, pp: int, gas: int, mbs: int = 2, tp: int = 1, opt: str = "sgd", **pipeline):
    """DeepSpeed's own PipelineEngine over the same specs (for the expected-failure comparisons)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    common.init_ds()
    model = PipelineModule(specs, topology=common.topology(pp, tp, 1), loss_fn=common.mse,
                           partition_method="uniform")
    cfg = common.ds_config(mbs, gas, 1, 1, **pipeline)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer(model.parameters(), opt), config=cfg)
    return engine


def engine_params(engine) -> dict:
    out = common.stage_params(engine)
    for key, mod in engine.module.tied_modules.items():
        for n, p in mod.named_parameters():
            out[f"tied.{key}.{n}"] = p.detach().float().clone()
    return out


def reference(specs, batches, gas: int, loss_fn=common.mse, opt: str = "sgd"):
    """batches: list over steps of lists of gas (x, y). Returns (per-step mean losses, params)."""
    losses, params, _ = reference_model(specs, batches, gas, loss_fn, opt)
    return losses, params


def reference_model(specs, batches, gas: int, loss_fn=common.mse, opt: str = "sgd"):
    """Like `reference`, also returning forward(x) of the trained single-process model."""
    from tds.pipe import TiedLayerSpec
    tied, funcs, named = {}, [], {}
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            mod = tied[spec.key]
            funcs.append(mod if spec.forward_fn is None else (lambda x, m=mod, f=spec.forward_fn: f(m, x)))
        elif hasattr(spec, "build"):
            funcs.append(spec.build())
            named[str(idx)] = funcs[-1]
        else:
            funcs.append(spec)
    params = [p for m in list(named.values()) + list(tied.values()) for p in m.parameters()]
    optim = optimizer(params, opt)
    losses = []
    for step in batches:
        optim.zero_grad()
        total = 0.0
        for x, y in step:
            for f in funcs:
                x = f(x)
            loss = loss_fn(x, y)
            (loss / gas).backward()
            total += loss.item() / gas
        optim.step()
        losses.append(total)
    out = {f"{i}.{n}": p.detach().clone() for i, m in named.items() for n, p in m.named_parameters()}
    out.update({f"tied.{k}.{n}": p.detach().clone() for k, m in tied.items() for n, p in m.named_parameters()})

    def forward(x):
        for f in funcs:
            x = f(x)
        return x
    return losses, out, forward


def train(engine, batches) -> list[float]:
    """Feed the same per-step micro-batch lists to the engine (every stage iterates; only 0 and p-1 read)."""
    it = iter([mb for step in batches for mb in step])
    return [engine.train_batch(it).item() for _ in batches]


class ResultMismatch(AssertionError):
    """The run finished but its losses or parameters differ from the reference."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ResultMismatch(message)


def assert_same_length(got: list, want: list, what: str = "losses") -> None:
    """Both lists non-empty and of one length (so a zip over them compares every item)."""
    _check(len(want) > 0 and len(got) == len(want), f"{len(got)} {what} vs {len(want)} in the reference")


def assert_close(results: list, ref_losses, ref_params, tol: float = 1e-5) -> None:
    """Every rank's per-step losses and its stage's parameters equal the reference's (relative error < tol);
    the stages together hold every reference parameter. Raises ResultMismatch."""
    _check(len(results) > 0 and len(ref_params) > 0, f"{len(results)} ranks, {len(ref_params)} reference params")
    for r in results:
        assert_same_length(r["losses"], ref_losses)
        for step, (got, want) in enumerate(zip(r["losses"], ref_losses)):
            _check(abs(got - want) <= tol * max(abs(want), 1e-6), f"step {step}: loss {got} vs {want}")
        for name, p in r["params"].items():
            err = common.max_rel_err(p, ref_params[name])
            _check(err < tol, f"param {name}: rel err {err:.2e}")
    seen = set().union(*[r["params"] for r in results])
    _check(seen == set(ref_params), f"parameters {sorted(seen ^ set(ref_params))} not on exactly one side")


class Recorder:
    """Per-process log that layers append to (read back by the test function on that rank)."""
    events: list = []


def seeded(shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def init_linear(lin: nn.Linear, seed: int) -> nn.Linear:
    with torch.no_grad():
        lin.weight.copy_(seeded(lin.weight.shape, seed, lin.in_features ** -0.5))
        lin.bias.copy_(seeded(lin.bias.shape, seed + 1, 0.1))
    return lin
