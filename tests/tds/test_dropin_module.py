"""DeepSpeed 0.19's PipelineModule surface on tds.pipe.PipelineModule: every constructor keyword, the quiet
constructor (`verbose` / TDS_VERBOSE), the checkpointing API, and DeepSpeed's activation-checkpointing settings
(partitioned activations really shrink what a checkpoint keeps at tp=2). One 2-rank run checks them all."""
from __future__ import annotations

import contextlib
import inspect
import io
import os

import pytest
import torch
import torch.nn as nn

from harness.dist import run_distributed
from tests.tds import common, dropin_programs, harness

DS_PRINTS = ("SEED_LAYERS=", "Using topology:", "stage=0 layers=", "  loss: ")


class Loud(nn.Linear):
    """A user's layer that prints while it is built: its line must survive the quiet constructor."""

    def __init__(self, *args):
        super().__init__(*args)
        print("built a Loud layer")


def all_keywords(values: dict) -> dict:
    """A value for every keyword of DeepSpeed's PipelineModule.__init__ (fails when DeepSpeed adds one)."""
    from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule
    names = [p for p in inspect.signature(DSPipelineModule.__init__).parameters if p != "self"]
    assert set(names) == set(values), f"DeepSpeed's keywords changed: {sorted(set(names) ^ set(values))}"
    return {k: values[k] for k in names}


def keywords_rank() -> dict:
    from deepspeed.runtime.pipe.module import PipelineModule as DSPipelineModule

    import tds
    common.init_ds()
    seeds = []
    values = {"layers": dropin_programs.cnn_layers(), "num_stages": 2, "topology": common.topology(2, 1, 1),
              "loss_fn": nn.CrossEntropyLoss(), "seed_layers": True, "seed_fn": seeds.append, "base_seed": 99,
              "partition_method": "uniform", "activation_checkpoint_interval": 1,
              "activation_checkpoint_func": tds.pipe.reentrant_checkpoint,
              "checkpointable_layers": ["Conv2d", "Linear"], "dynamic_shape": True}
    model = tds.pipe.PipelineModule(**all_keywords(values))
    results = {"attrs": (model.dynamic_shape, model.checkpointable_layers, model.base_seed, model.seed_layers,
                         model.activation_checkpoint_func is tds.pipe.reentrant_checkpoint,
                         model.activation_checkpoint_interval, model.parts),
               "seeds": list(seeds)}
    checkpointable = {}
    for layers in (["Conv2d", "Linear"], None):
        model.checkpointable_layers = layers
        for k in (1, 2, 3):
            model.set_checkpoint_interval(k)
            blocks = [model.forward_funcs[s:s + k] for s in range(0, len(model.forward_funcs), k)]
            checkpointable[(str(layers), k)] = (model.is_checkpointable_results,
                                                [DSPipelineModule._is_checkpointable(model, b) for b in blocks])
    results["checkpointable"] = checkpointable
    return results


def verbose_rank() -> dict:
    import tds
    common.init_ds()
    out = {}
    for case, kwargs, env in (("quiet", {}, None), ("verbose", {"verbose": True}, None), ("env", {}, "1")):
        if env is not None:
            os.environ["TDS_VERBOSE"] = env
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                tds.pipe.PipelineModule([tds.pipe.LayerSpec(Loud, 4, 4), nn.ReLU(), tds.pipe.LayerSpec(Loud, 4, 4)],
                                        num_stages=2, loss_fn=common.mse, **kwargs)
        finally:
            os.environ.pop("TDS_VERBOSE", None)
        out[case] = buf.getvalue()
    return out


def one_sided_declaration_rank() -> str:
    import tds
    common.init_ds()
    model = tds.pipe.PipelineModule(common.stack_specs(), num_stages=2, loss_fn=common.mse)
    model._input_grad = [True]
    try:
        model.declarations()
    except tds.pipe.PipelineLayoutError as e:
        return str(e)
    return "no error"


def deepspeeds_own_module_rank() -> str:
    """tds.initialize given a module built from the real deepspeed.pipe.PipelineModule."""
    import deepspeed

    import tds
    common.init_ds()
    model = deepspeed.pipe.PipelineModule(common.stack_specs(), num_stages=2, loss_fn=common.mse)
    try:
        tds.initialize(model=model, optimizer=harness.optimizer(model.parameters(), "sgd"),
                       config=common.ds_config(2, 2, 1, 0))
    except TypeError as e:
        return str(e)
    return "no error"


# --- activation checkpointing settings ------------------------------------------------------------------------
GAS = 2


def checkpoint_saved_bytes(engine) -> list[int]:
    """Activation bytes kept by DeepSpeed's checkpoint function (CheckpointFunction's saved float inputs, the
    partition where partitioned; not the int64 shape records) in each micro-batch's graph, read just before
    its backward; -1 where no DeepSpeed checkpoint is in the graph (torch's checkpoint ran)."""
    seen, original = [], engine.executor._exec_backward

    def measure(ins, state):
        seen.append(_saved_bytes(state.loss_graphs[ins.micro_batch].grad_fn))
        original(ins, state)
    engine.executor._exec_backward = measure
    return seen


def _saved_bytes(root) -> int:
    total, found, stack, visited = 0, False, [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in visited:
            continue
        visited.add(id(node))
        saved = getattr(node, "deepspeed_saved_tensors", None)
        if saved is not None:
            found = True
            for t in saved:
                if torch.is_tensor(t) and t.is_floating_point():
                    data = t.saved_data if getattr(t, "saved_data", None) is not None else t
                    total += data.numel() * data.element_size()
        stack += [f for f, _ in node.next_functions]
    return total if found else -1


def activation_settings_rank(case: str) -> dict:
    """tp=2, pp=1: the stack replicated on both tensor-parallel ranks, every layer its own checkpoint segment."""
    import deepspeed

    import tds
    from tds.pipe import recompute
    ckpt = deepspeed.checkpointing
    ckpt.deepspeed_checkpointing_enabled = False  # nothing configured before this case
    common.init_ds()
    model = tds.pipe.PipelineModule(common.stack_specs(), topology=common.topology(1, 2, 1), loss_fn=common.mse,
                                    activation_checkpoint_interval=1)
    cfg = common.ds_config(2, GAS, 1, 0)
    if case in ("json_off", "json_on"):
        cfg["activation_checkpointing"] = {"partition_activations": case == "json_on"}
    elif case == "user_configure":
        ckpt.configure(recompute.TensorParallelView(model.mpu()), partition_activations=True)
    engine, _, _, _ = tds.initialize(model=model, optimizer=harness.optimizer(model.parameters(), "sgd"), config=cfg)
    saved = checkpoint_saved_bytes(engine)
    losses = harness.train(engine, batches())
    return {"losses": losses, "params": harness.engine_params(engine), "saved": saved}


def use_reentrant_rank() -> dict:
    """pipeline.use_reentrant replaces a default checkpoint function, never one the model gave (GPT2ModelPipe's
    replays its dropout masks; torch's reentrant checkpoint would draw new ones in the recomputation)."""
    import tds
    from tds.pipe import recompute

    def models_own(fn, *args):
        return recompute.non_reentrant_checkpoint(fn, *args)

    out = {}
    for name, func in (("default", recompute.default_checkpoint), ("models_own", models_own)):
        model = tds.pipe.PipelineModule(common.stack_specs(), topology=common.topology(1, 2, 1), loss_fn=common.mse,
                                        activation_checkpoint_interval=1, activation_checkpoint_func=func)
        cfg = common.ds_config(2, GAS, 1, 0, use_reentrant=True)
        engine, _, _, _ = tds.initialize(model=model, optimizer=harness.optimizer(model.parameters(), "sgd"),
                                         config=cfg)
        out[name] = engine.module.activation_checkpoint_func is (recompute.reentrant_default if name == "default"
                                                                 else models_own)
    return out


def batches():
    X, Y = common.make_data(2, GAS * 2)
    return [[(X[t, i * 2:(i + 1) * 2], Y[t, i * 2:(i + 1) * 2]) for i in range(GAS)] for t in range(2)]


SETTINGS = ("torch_default", "json_off", "json_on", "user_configure")


def module_rank() -> dict:
    out = {"keywords": keywords_rank(), "verbose": verbose_rank(), "one_sided": one_sided_declaration_rank(),
           "deepspeeds_own": deepspeeds_own_module_rank()}
    out.update({case: activation_settings_rank(case) for case in SETTINGS})
    out["use_reentrant"] = use_reentrant_rank()
    return out


@pytest.fixture(scope="module")
def ranks() -> list:
    return run_distributed(module_rank, 2, timeout=300)


def test_every_deepspeed_keyword_is_accepted_and_kept(ranks):
    for r in ranks:
        k = r["keywords"]
        assert k["attrs"] == (True, ["Conv2d", "Linear"], 99, True, True, 1, [0, 8, 16])
        assert k["seeds"] and all(s >= 99 for s in k["seeds"])  # seed_fn(base_seed + layer) while building


def test_checkpointable_results_follow_deepspeeds_rule(ranks):
    """DeepSpeed's `_is_checkpointable` (the class-name-free part) and ours agree for every interval, with and
    without checkpointable_layers: runs of parameterless layers (in-place ReLUs, pooling) are not recomputed."""
    for r in ranks:
        for key, (ours, deepspeeds) in r["keywords"]["checkpointable"].items():
            assert ours == deepspeeds, key
        assert r["keywords"]["checkpointable"][("None", 1)][0].count(False) >= 3


def test_constructor_is_quiet_unless_asked(ranks):
    printed = ranks[0]["verbose"]  # DeepSpeed prints on global rank 0 only
    assert printed["quiet"].count("built a Loud layer") == printed["verbose"].count("built a Loud layer") > 0
    assert not any(p in printed["quiet"] for p in DS_PRINTS), printed["quiet"]
    for case in ("verbose", "env"):
        assert all(p in printed[case] for p in DS_PRINTS), printed[case]
        assert "    1: ReLU" in printed[case]


def test_one_sided_declaration_and_deepspeeds_own_module_are_errors(ranks):
    assert "set both model._input_grad and model._input_type (or neither" in ranks[0]["one_sided"]
    assert "is DeepSpeed's own PipelineModule; build it from tds.pipe.PipelineModule" in ranks[0]["deepspeeds_own"]


def test_activation_checkpointing_settings(ranks):
    """Nothing configured: torch's checkpoint. JSON section or deepspeed.checkpointing.configure: DeepSpeed's, and
    partition_activations at tp=2 keeps half the bytes per checkpoint. All four train like one process."""
    ref_losses, ref_params = harness.reference(common.stack_specs(), batches(), GAS)
    for case in SETTINGS:
        harness.assert_close([r[case] for r in ranks], ref_losses, ref_params)
    for r in ranks:
        assert set(r["torch_default"]["saved"]) == {-1}
        off, on, user = (r[c]["saved"] for c in ("json_off", "json_on", "user_configure"))
        assert min(off) > 0 and on == user
        assert all(b <= 0.55 * a for a, b in zip(off, on)), (off, on)


def test_use_reentrant_never_replaces_the_models_own_checkpoint_function(ranks):
    for r in ranks:
        assert r["use_reentrant"] == {"default": True, "models_own": True}
