"""No silent hangs, no half-changed state.

- A rank of a pp=2, dp=2 run that dies (or stalls) in the middle of a batch makes every other rank exit non-zero
  within the configured timeout (+ 30 s) with a PipelineCommError naming its stage, the group or peer and the
  operation. The ranks are plain processes (not torchrun, which would kill the survivors before they report),
  so each survivor's own exit status and message are observed.
- An exception inside train_batch / eval_batch (a layer that raises) leaves the engine in its previous mode
  with its previous data iterator, nothing of the batch pending, and a multi-stage engine refusing further
  batches with the reason.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch

from harness.dist import free_port, run_distributed
from tests.tds import common, harness
from tests.tds.common import D_IN, D_OUT

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 4


def _launch(world: int, mode: str, victim: int, stamp: str) -> list:
    port = str(free_port())
    procs = []
    for global_rank in range(world):
        env = dict(os.environ, RANK=str(global_rank), WORLD_SIZE=str(world), LOCAL_RANK=str(global_rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.tds.failure_job", mode, str(victim),
                                       str(TIMEOUT_S), stamp], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _wait(procs: list, survivors: list, limit_s: float) -> dict:
    """{rank: (exit code, output, exit time)} for the survivors; kills everything at the end."""
    done, deadline = {}, time.monotonic() + limit_s
    try:
        while len(done) < len(survivors) and time.monotonic() < deadline:
            for global_rank in survivors:
                if global_rank not in done and procs[global_rank].poll() is not None:
                    done[global_rank] = (procs[global_rank].returncode, procs[global_rank].stdout.read(), time.time())
            time.sleep(0.1)
    finally:
        for proc in procs:
            proc.kill()
    return done


@pytest.mark.parametrize("mode", [pytest.param("die", marks=pytest.mark.long), pytest.param("stall", marks=pytest.mark.slow)])
def test_dead_or_stalled_rank_fails_every_peer_naming_stage_group_and_operation(mode, tmp_path):
    victim, stamp = 3, str(tmp_path / "failed_at")  # stage 1, data-parallel rank 1
    procs = _launch(4, mode, victim, stamp)
    survivors = [r for r in range(4) if r != victim]
    done = _wait(procs, survivors, limit_s=300)  # start-up on a loaded 2-core machine can take a minute
    assert sorted(done) == survivors, f"ranks {sorted(set(survivors) - set(done))} still running after 300 s"
    with open(stamp) as f:
        failed_at = float(f.read())
    for global_rank, (code, out, exited_at) in done.items():
        assert code != 0, f"rank {global_rank} exited 0:\n{out[-2000:]}"
        assert exited_at - failed_at <= TIMEOUT_S + 30, (global_rank, exited_at - failed_at)
        lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in out.splitlines()]  # torch's per-rank prefix
        errors = [line for line in lines if line.startswith("tds.pipe.p2p.PipelineCommError:")]
        assert errors, f"rank {global_rank} did not fail with a PipelineCommError:\n{out[-3000:]}"
        msg = errors[-1]
        assert "pipeline stage " in msg and f"after {TIMEOUT_S}s" in msg, msg
        assert (" group (ranks [" in msg) or (" with rank " in msg), msg  # the group, or the p2p peer
        assert any(op in msg for op in ("all_reduce", "receive", "send", "broadcast", "all_gather")), msg
        assert "instruction " in msg or "loss" in msg, msg


class Boom(torch.nn.Module):
    """A linear layer that raises in forward on call number `at` (counted per process)."""

    calls = 0

    def __init__(self, at: int):
        super().__init__()
        self.lin, self.at = harness.init_linear(torch.nn.Linear(D_IN, D_OUT), 3), at

    def forward(self, x):
        Boom.calls += 1
        if Boom.calls == self.at:
            raise ValueError("injected failure")
        return self.lin(x)


def specs(at: int):
    from tds.pipe import LayerSpec
    return [LayerSpec(common.SeededLinear, D_IN, D_IN, 0), LayerSpec(Boom, at)]


def inject_rank(pp: int, phase: str) -> dict:
    """Batch 1 trains; the failure hits the second forward of the last layer in `phase`'s batch."""
    Boom.calls = 0
    engine = harness.build(specs(at=3), ([True], ["float"], [False]), pp=pp, gas=2, mbs=2,
                           pipeline={"timeout_s": TIMEOUT_S})
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(2, D_IN, generator=g), torch.randn(2, D_OUT, generator=g)) for _ in range(8)]
    engine.train_batch(iter(data[:2]))
    before_iter = iter(data[2:])
    engine.set_dataiterator(before_iter)
    engine.module.train(phase == "eval")  # a mode the batch must not leave behind
    mode_before = engine.module.training
    try:
        engine.eval_batch(iter(data[4:])) if phase == "eval" else engine.train_batch(iter(data[4:]))
        error = None
    except Exception as e:  # noqa: BLE001 - the error is the result
        error = f"{type(e).__name__}: {e}"
    state = {"error": error, "mode_kept": engine.module.training == mode_before,
             "iter_kept": engine.data_iterator is before_iter or not (engine.is_first_stage() or
                                                                       engine.is_last_stage()),
             "grad_boundary": engine.is_gradient_accumulation_boundary(),
             "engine_backward": engine._running_engine_backward,
             "pending_sends": len(engine.p2p.pending) if engine.p2p else 0,
             "posted_recv": engine.boundary._next_first is not None,
             "grads": sum(int(p.grad is not None and bool(p.grad.abs().sum() > 0))
                          for p in engine.module.parameters())}
    try:
        engine.train_batch(iter(data[6:]))
        state["next"] = "ran"
    except Exception as e:  # noqa: BLE001
        state["next"] = f"{type(e).__name__}: {e}"
    return state


@pytest.mark.parametrize("phase", ["train", "eval"])
def test_failure_inside_a_batch_restores_mode_iterator_and_leaves_nothing_pending(phase):
    results = run_distributed(inject_rank, 2, 2, phase, timeout=120)
    last, first = results[1], results[0]
    assert last["error"] == "ValueError: injected failure", last["error"]
    assert first["error"].startswith("PipelineCommError: pipeline stage 0"), first["error"]
    for r in results:
        assert r["mode_kept"] and r["iter_kept"], r
        assert not r["grad_boundary"] and not r["engine_backward"], r
        assert r["pending_sends"] == 0 and not r["posted_recv"] and r["grads"] == 0, r
        assert r["next"].startswith("PipelineCommError") and "a previous batch failed" in r["next"], r["next"]


def test_failure_in_a_single_stage_engine_leaves_it_usable():
    r = run_distributed(inject_rank, 1, 1, "train", timeout=120)[0]
    assert r["error"] == "ValueError: injected failure" and r["mode_kept"] and r["iter_kept"], r
    assert r["grads"] == 0 and r["next"] == "ran", r
