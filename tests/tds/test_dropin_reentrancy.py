"""Issue 18.4: `"pipeline": {"use_reentrant": ...}` and checkpointing switched on after `initialize` by
`module.set_checkpoint_interval(1)`, as a DeepSpeed 0.19.8 program does it, on TDS and on DeepSpeed's own
engine in the same processes (pp = 2).

For each checkpoint function a program may name (none, DeepSpeed's `checkpointing.checkpoint` given
explicitly, DeepSpeed's `non_reentrant_checkpoint`) and each use_reentrant (unset, false, true) the layers
record what they see in their first forward: whether autograd is on (a reentrant checkpoint runs the forward
under no_grad) and, on the first layer, whether the loaded input requires grad (DeepSpeed 0.19.8's
`_reentrant_activation_checkpointing()`: float inputs do when the function is reentrant). TDS must give
DeepSpeed's answers wherever the program names DeepSpeed's function; with no function named, TDS's default
is torch's non-reentrant checkpoint (tds/README.md) unless use_reentrant is true, and its engine answers accordingly.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from harness.dist import run_distributed
from tests.tds import common

FUNCS = ("none", "deepspeed", "deepspeed_non_reentrant")
USE_REENTRANT = (None, False, True)


class Probe(nn.Linear):
    """Linear layer recording (autograd on, input requires grad) at each call."""
    seen: list = []

    def forward(self, x):  # (b, n_in) -> (b, n_out)
        Probe.seen.append((torch.is_grad_enabled(), x.requires_grad))
        return torch.tanh(super().forward(x))


def _case(tds_engine: bool, func: str, use_reentrant) -> dict:
    import deepspeed as real_deepspeed

    import tds
    ds = tds if tds_engine else real_deepspeed
    common.init_ds()
    torch.manual_seed(0)
    kwargs = {"deepspeed": {"activation_checkpoint_func": ds.checkpointing.checkpoint},
              "deepspeed_non_reentrant": {"activation_checkpoint_func": ds.checkpointing.non_reentrant_checkpoint},
              "none": {}}[func]
    model = ds.pipe.PipelineModule([Probe(4, 4) for _ in range(4)], topology=common.topology(2, 1, 1),
                                   loss_fn=common.mse, partition_method="uniform", **kwargs)
    pipeline = {} if use_reentrant is None else {"use_reentrant": use_reentrant}
    engine, _, _, _ = ds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                    config=common.ds_config(2, 2, 1, 0, **pipeline))
    model.set_checkpoint_interval(1)
    Probe.seen.clear()
    g = torch.Generator().manual_seed(1)
    engine.train_batch(iter([(torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)) for _ in range(2)]))
    first_forward = Probe.seen[0]
    return {"answer": engine._reentrant_activation_checkpointing(), "grad_enabled": first_forward[0],
            "input_requires_grad": first_forward[1] if engine.is_first_stage() else None}


def reentrancy_rank() -> dict:
    return {(engine, func, use): _case(engine == "tds", func, use)
            for engine in ("tds", "deepspeed") for func in FUNCS for use in USE_REENTRANT}


@pytest.fixture(scope="module")
def ranks() -> list:
    return run_distributed(reentrancy_rank, 2, timeout=300)


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("use_reentrant", USE_REENTRANT)
def test_checkpointing_switched_on_later_follows_use_reentrant(ranks, func, use_reentrant):
    expected_reentrant = {"none": use_reentrant is True, "deepspeed": use_reentrant is not False,
                          "deepspeed_non_reentrant": False}[func]
    for r in ranks:
        got, theirs = r[("tds", func, use_reentrant)], r[("deepspeed", func, use_reentrant)]
        assert got["answer"] is expected_reentrant, got
        assert got["grad_enabled"] is not expected_reentrant, got  # a reentrant checkpoint's forward: no_grad
        if r is ranks[0]:
            assert got["input_requires_grad"] is expected_reentrant, got
        if func != "none":  # the program names DeepSpeed's function: DeepSpeed's answers
            assert got == theirs, (got, theirs)
