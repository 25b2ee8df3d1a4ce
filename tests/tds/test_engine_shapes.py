"""Points 4 and 5: shapes that change between micro-batches with no flag, and tensors partitioned across
the tensor-parallel group for the hop (gradients too). Also measures the shape-header cost."""
from __future__ import annotations

import math

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import harness, layers
from tests.tds.common import D_IN, D_OUT, H
from tests.tds.harness import Recorder
from tds.pipe import meta
from tds.pipe.boundary import FLAG

GAS = 3
SHAPES = [[(2, 3), (3, 5), (1, 4)], [(4, 2), (2, 3), (2, 6)]]  # (b, s) per micro-batch per step


def specs():
    from tds.pipe import LayerSpec
    return [LayerSpec(layers.SeqIn, 0), LayerSpec(layers.SeqMid, 10), LayerSpec(layers.SeqMid, 20),
            LayerSpec(layers.SeqHead, 99)]


def batches():
    g = torch.Generator().manual_seed(3)
    return [[(torch.randn(b, s, D_IN, generator=g), torch.randn(b, D_OUT, generator=g)) for b, s in step]
            for step in SHAPES]


def train_rank(tp: int) -> dict:
    Recorder.events.clear()
    engine = harness.build(specs(), layers.SEQ_DECL, pp=2, gas=GAS, mbs=2, tp=tp)
    losses = harness.train(engine, batches())
    return {"losses": losses, "params": harness.engine_params(engine), "events": list(Recorder.events),
            "stage": engine.stage_id, "stats": vars(engine.p2p.stats)}


def expected_stats(tp: int) -> dict:
    """p2p traffic of a stage-0 rank under boundary.py's protocol, every hop's layout differing from the last:
    per activation hop a flag+header message of FLAG + max(predicted payload, header) bytes and the payload
    (h chunk + bool mask, packed); per gradient hop the h chunk alone."""
    header = 8 * meta.header_len(2)
    stats = dict(header_msgs=0, header_bytes=0, payload_msgs=0, payload_bytes=0)
    predicted = 0
    for b, s in (bs for step in SHAPES for bs in step):
        chunk = math.ceil(b * s * H / tp)
        act = meta.packed_size([(torch.float32, chunk), (torch.bool, b * s)])
        stats["header_msgs"] += 1
        stats["header_bytes"] += FLAG + max(predicted, header)
        stats["payload_msgs"] += 2
        stats["payload_bytes"] += act + 4 * chunk
        predicted = act
    return stats


def run(tp: int) -> list:
    results = run_distributed(train_rank, 2 * tp, tp, timeout=120)
    ref_losses, ref_params = harness.reference(specs(), batches(), GAS)
    harness.assert_close(results, ref_losses, ref_params)
    return results


def test_point4_shapes_change_between_micro_batches():
    results = run(tp=1)
    stage1 = [r for r in results if r["stage"] == 1][0]
    seen = stage1["events"]  # stage 1 = [SeqMid, SeqHead]: SeqMid sees each received shape
    assert seen == [(b, s, H) for step in SHAPES for b, s in step]
    stats = [r for r in results if r["stage"] == 0][0]["stats"]
    assert {k: stats[k] for k in expected_stats(1)} == expected_stats(1)


@pytest.mark.parametrize("tp", [2])
def test_point5_partitioned_tensors_and_grads(tp):
    results = run(tp)
    for r in results:
        if r["stage"] == 0:
            assert r["stats"]["payload_bytes"] == expected_stats(tp)["payload_bytes"]
            assert expected_stats(tp)["payload_bytes"] < expected_stats(1)["payload_bytes"]


def mpu_rank(mismatch: bool) -> dict:
    """initialize(mpu=megatron.mpu) with the module built on the mpu's topology (or a mismatching one)."""
    import tds as deepspeed
    from megatron import mpu
    from tds.pipe import PipelineModule
    from tests.tds import common
    common.init_ds()
    mpu.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    topo = common.topology(2, 1, 2) if mismatch else mpu.get_topology()
    model = PipelineModule(specs(), topology=topo, loss_fn=common.mse, partition_method="uniform")
    model._input_grad, model._input_type, model._input_pipe_partitioned = layers.SEQ_DECL
    opt = harness.optimizer(model.parameters(), "sgd")
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, mpu=mpu,
                                               config=common.ds_config(2, GAS, 1 if not mismatch else 2, 1))
    except ValueError as e:
        return {"error": str(e)}
    losses = harness.train(engine, batches())
    return {"losses": losses, "params": harness.engine_params(engine), "error": None}


@pytest.mark.long
def test_point5_with_megatron_mpu():
    results = run_distributed(mpu_rank, 4, False, timeout=120)
    ref_losses, ref_params = harness.reference(specs(), batches(), GAS)
    harness.assert_close(results, ref_losses, ref_params)
    errors = [r["error"] for r in run_distributed(mpu_rank, 4, True, timeout=120)]
    assert all("mpu and the PipelineModule topology disagree" in e for e in errors), errors
