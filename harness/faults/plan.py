"""A fault plan for the training ranks (installed by harness/faults/inject/sitecustomize.py), as JSON in FAULTS:

    {"kills": [{"attempt": 0, "rank": 3, "iteration": 6, "at": "start"}, ...],   SIGKILL this rank, in torchrun's
                            restart `attempt` (TORCHELASTIC_RESTART_COUNT), when iteration N starts ("start"),
                            during the save of iteration N ("save": after its first file is written, or with
                            --async-save after its first state is copied), or after the background thread
                            of --async-save wrote its first file of iteration N ("async")
     "grad_nan": {"stage": 1, "iteration": 5},   a weight's gradient (not an activation) made NaN on that
                            pipeline stage in that iteration (a hook on the parameter)
     "slow_async": 2.0,    the background writer of --async-save sleeps this long before each file, after
                            printing "fault: async write of iter_N started" (a test sends its signal then)
     "slow_eval": 1.0,     each evaluation during training sleeps this long first, after printing (rank 0)
                            "fault: evaluation after iteration N started"
     "slow_iteration": 4,  each iteration starts with a sleep this long (a run long enough for a time limit)
     "fill_disk": {"iteration": 4, "path": DIR},   rank 0, after its first file of iteration N: a file in DIR
                            takes all but 4 kB of the file system's free space (another writer fills the disk;
                            with --async-save, after the background thread's first file)
     "flip_bit": {"iteration": 7, "rank": 1, "what": "parameter"},   that rank flips one bit of its first 2-D
                            weight ("parameter") or of that weight's Adam exp_avg ("optimizer") right after the
                            optimizer step of iteration N, in the first attempt (silent corruption of one replica)
     "late_signal": true,  a rank whose run a signal stopped gets one more copy of it right after its handlers are
                            restored (ExitConditions.close): the late copy a script or launcher forwards on a
                            loaded machine; it ends that rank at once (the default action)
     "report": DIR}         each rank writes DIR/rank_<r>.json at the end of pretrain(): the iteration it
                            stopped at (the iterations it completed), the optimizer steps it took, and how it
                            ended ("returned" / the exception)
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from typing import Any, Dict

PLAN: Dict[str, Any] = {}
NOW = {"iteration": 0, "started": 0, "steps": 0}  # iterations completed, the one running, optimizer steps


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _kill(where: str, iteration: int) -> None:
    for kill in PLAN.get("kills", []):
        if (kill["attempt"], kill["rank"], kill["iteration"], kill.get("at", "start")) == \
                (_attempt(), _rank(), iteration, where):
            print(f"fault: rank {_rank()} killed at {where} of iteration {iteration} (attempt {_attempt()})",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def _iteration_of(path: str) -> int:
    found = re.search(r"iter_(\d+)", str(path))
    return int(found.group(1)) if found else -1


def _fill(directory: str) -> None:
    from megatron.checkpointing.space import free_bytes
    room = free_bytes(directory) - 4096
    with open(os.path.join(directory, "filler"), "wb") as f:
        f.write(b"\0" * max(0, room))
    print(f"fault: filled {directory} ({room} bytes)", flush=True)


def _patch_writes() -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    original, written = TorchCheckpointEngine.save, {}

    def save(self, state_dict, path):
        background = threading.current_thread().name == "async-save"
        iteration = _iteration_of(path)
        if background and PLAN.get("slow_async"):
            if not written.get(("announced", iteration)):
                written[("announced", iteration)] = True
                print(f"fault: async write of iter_{iteration:07d} started", flush=True)
            import time
            time.sleep(float(PLAN["slow_async"]))
        out = original(self, state_dict, path)
        key = ("async" if background else "save", iteration)
        first = not written.get(key)
        written[key] = True
        if first:
            fill = PLAN.get("fill_disk")
            if fill and fill["iteration"] == iteration and _rank() == 0:
                _fill(fill["path"])
            _kill(key[0], iteration)
        return out
    TorchCheckpointEngine.save = save

    from megatron.checkpointing import async_save
    copy = async_save.snapshot

    def snapshot(obj, memo=None, storages=None):  # the main thread's copy of one file's state, --async-save
        out = copy(obj, memo, storages)
        if memo is None and not written.get(("copy", NOW["started"])):
            written[("copy", NOW["started"])] = True
            _kill("save", NOW["started"])
        return out
    async_save.snapshot = snapshot


def _patch_loop() -> None:
    from megatron.training import loop
    from tds.pipe.engine import PipelineEngine
    start, take_step, hooks = loop.start_iteration, PipelineEngine._take_model_step, []

    def start_iteration(module, iteration, replica=(0, 1)):
        NOW["iteration"], NOW["started"] = iteration, iteration + 1
        while hooks:
            hooks.pop().remove()
        _kill("start", iteration + 1)
        if PLAN.get("slow_iteration"):
            import time
            time.sleep(float(PLAN["slow_iteration"]))
        nan = PLAN.get("grad_nan")
        if nan and nan["iteration"] == iteration + 1:
            from megatron import mpu
            if mpu.get_pipeline_model_parallel_rank() == nan["stage"]:
                weight = [p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() == 2][-1]
                hooks.append(weight.register_hook(lambda g: g * float("nan")))
        return start(module, iteration, replica)

    def counted_step(self, *args, **kwargs):
        NOW["steps"] += 1
        out = take_step(self, *args, **kwargs)
        flip = PLAN.get("flip_bit")
        if flip and (flip["iteration"], flip["rank"], 0) == (NOW["started"], _rank(), _attempt()):
            _flip_bit(self, flip["what"])
        return out
    loop.start_iteration, PipelineEngine._take_model_step = start_iteration, counted_step
    evaluate = loop.evaluate_and_print

    def slow_evaluation(*args, **kwargs):
        if PLAN.get("slow_eval"):
            import time
            if _rank() == 0:
                print(f"fault: evaluation after iteration {NOW['iteration'] + 1} started", flush=True)
            time.sleep(float(PLAN["slow_eval"]))
        return evaluate(*args, **kwargs)
    loop.evaluate_and_print = slow_evaluation


def _flip_bit(engine, what: str) -> None:
    """One bit of the engine's first 2-D weight (or of its optimizer state exp_avg) flipped in place."""
    import torch
    name, weight = next((n, p) for n, p in engine.module.named_parameters() if p.dim() == 2)
    if what == "optimizer":
        inner = engine.optimizer if isinstance(engine.optimizer, torch.optim.Optimizer) else engine.optimizer.optimizer
        target, name = inner.state[weight]["exp_avg"], f"optimizer state exp_avg of {name}"
    else:
        target, name = weight.data, f"parameter {name}"
    words = target.view(-1).view(torch.int32)
    words[0] ^= 1 << 20
    print(f"fault: rank {_rank()} flipped a bit of {name} after the step of iteration {NOW['started']}", flush=True)


def _patch_report(directory: str) -> None:
    import importlib
    driver = importlib.import_module("megatron.training.pretrain")  # the package exports a function of that name
    inner = driver._pretrain

    def _pretrain(*args, **kwargs):
        outcome = "returned"
        try:
            state = inner(*args, **kwargs)
            NOW["iteration"] = state.iteration
            return state
        except BaseException as err:
            outcome = f"{type(err).__name__}: {err}"
            raise
        finally:
            with open(os.path.join(directory, f"rank_{_rank()}.json"), "w") as f:
                json.dump(dict(rank=_rank(), attempt=_attempt(), iteration=NOW["iteration"], steps=NOW["steps"],
                               outcome=outcome), f)
    driver._pretrain = _pretrain


def _patch_close() -> None:
    from megatron.training.exit_conditions import ExitConditions
    close = ExitConditions.close

    def close_then_signal(self, failed: bool = False) -> None:
        received = self.received
        close(self, failed)
        if received:
            print(f"fault: rank {_rank()} gets a late {signal.Signals(received).name}", flush=True)
            os.kill(os.getpid(), received)
    ExitConditions.close = close_then_signal


def install(spec: str) -> None:
    PLAN.update(json.loads(spec))
    if PLAN.get("faulthandler"):
        import faulthandler
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    _patch_writes()
    _patch_loop()
    if PLAN.get("late_signal"):
        _patch_close()
    if PLAN.get("report"):
        _patch_report(PLAN["report"])
    sys.stdout.flush()
