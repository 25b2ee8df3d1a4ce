"""Points 7, 8, 10: gradient accumulation scales once, one loss per micro-batch averaged and broadcast,
and data read only by the first (inputs) and last (labels) stage from the same iterator position."""
from __future__ import annotations

import torch

from harness.dist import run_distributed
from tests.tds import common, harness, layers
from tests.tds.common import D_IN, D_OUT
from tests.tds.harness import Recorder

GAS, MBS = 4, 2


def grads_rank(gas: int, mbs: int) -> dict:
    """Gradients on every stage just before the optimizer step of the first batch."""
    engine = harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, gas=gas, mbs=mbs, zero=0)
    captured = {}
    reduce = engine.executor._exec_reduce_grads

    def spy(ins, state):
        module = engine.module
        for i, layer in enumerate(module.forward_funcs):
            for n, p in layer.named_parameters():
                captured[f"{i + module._local_start}.{n}"] = p.grad.detach().clone()
        reduce(ins, state)
    engine.executor._exec_reduce_grads = spy
    X, Y = common.make_data(1, gas * mbs)
    engine.train_batch(common.rank_iterator(X, Y, 0, 1, gas, mbs))
    return captured


def test_point7_grad_accumulation_scales_loss_once():
    X, Y = common.make_data(1, GAS * MBS)
    model = common.reference_model()
    common.mse(model(X[0]), Y[0]).backward()
    ref = {f"{i}.{n}": p.grad for i, layer in enumerate(model) for n, p in layer.named_parameters()}
    for gas, mbs in [(GAS, MBS), (1, GAS * MBS)]:  # accumulated micro-batches == one large batch
        got = {}
        for r in run_distributed(grads_rank, 2, gas, mbs, timeout=120):
            got.update(r)
        assert got.keys() == ref.keys()
        for name, g in got.items():
            assert common.max_rel_err(g, ref[name]) < 1e-5, f"gas={gas}: grad {name}"


def recording_mse(out, label):
    loss = common.mse(out, label)
    Recorder.events.append(loss.item())
    return loss


def losses_rank() -> dict:
    Recorder.events.clear()
    engine = harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, dp=2, gas=GAS, mbs=MBS,
                           loss_fn=recording_mse, opt="adam")
    X, Y = common.make_data(2, GAS * MBS * 2)
    it = common.rank_iterator(X, Y, engine.grid.get_data_parallel_rank(), 2, GAS, MBS)
    returned = [engine.train_batch(it).item() for _ in range(2)]
    return {"stage": engine.stage_id, "dp": engine.grid.get_data_parallel_rank(), "returned": returned,
            "per_mb": list(Recorder.events), "header_msgs": engine.p2p.stats.header_msgs}


def test_point8_one_loss_per_micro_batch_mean_broadcast():
    results = run_distributed(losses_rank, 4, timeout=120)
    X, Y = common.make_data(2, GAS * MBS * 2)
    ref_losses, _ = common.reference_train(X, Y, 2)  # Adam, whole global batch: same means
    last = [r for r in results if r["stage"] == 1]
    assert all(len(r["per_mb"]) == 2 * GAS for r in last)  # exactly one loss per micro-batch
    for step in range(2):
        mean = sum(sum(r["per_mb"][step * GAS:(step + 1) * GAS]) / GAS for r in last) / len(last)
        for r in results:  # every stage and replica returns the same mean
            assert abs(r["returned"][step] - mean) < 1e-6
            assert abs(r["returned"][step] - ref_losses[step]) < 1e-5 * ref_losses[step]
    assert all(not r["per_mb"] for r in results if r["stage"] == 0)
    # constant shapes: the sender exchanges the layout once, on the first hop; every later hop is one message
    assert all(r["header_msgs"] == 1 for r in results if r["stage"] == 0)


class CountingIterator:
    def __init__(self, items):
        self.items, self.calls = iter(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.calls += 1
        return next(self.items)


class ForbiddenIterator:
    def __next__(self):
        raise AssertionError("a middle stage touched the data iterator")


def index_specs():
    from tds.pipe import LayerSpec
    return [LayerSpec(layers.IndexIn, 0), LayerSpec(layers.IndexMid, 10), LayerSpec(layers.IndexMid, 20),
            LayerSpec(layers.IndexHead, 99)]


def index_batches(steps: int = 2):
    g = torch.Generator().manual_seed(5)
    out, item = [], 0
    for _ in range(steps):
        step = []
        for _ in range(GAS):
            idx = torch.arange(item, item + MBS)
            item += MBS
            step.append(((torch.randn(MBS, D_IN, generator=g), idx), (torch.randn(MBS, D_OUT, generator=g), idx)))
        out.append(step)
    return out


def data_rank() -> dict:
    engine = harness.build(index_specs(), layers.INDEX_DECL, pp=3, gas=GAS, mbs=MBS, loss_fn=layers.index_loss)
    items = [mb for step in index_batches() for mb in step]
    reads = engine.is_first_stage() or engine.is_last_stage()
    it = CountingIterator(items) if reads else ForbiddenIterator()
    losses = [engine.train_batch(it).item() for _ in range(2)]
    return {"losses": losses, "params": harness.engine_params(engine), "calls": getattr(it, "calls", 0)}


def test_point10_inputs_first_stage_labels_last_stage_same_item():
    results = run_distributed(data_rank, 3, timeout=120)
    assert [r["calls"] for r in results] == [2 * GAS, 0, 2 * GAS]  # one next() per micro-batch, in lock-step
    ref_losses, ref_params = harness.reference(index_specs(), index_batches(), GAS, loss_fn=layers.index_loss)
    harness.assert_close(results, ref_losses, ref_params)
