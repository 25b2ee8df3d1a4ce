"""The drop-in promise and the DeepSpeed internals TDS builds on.

- Every attribute of `deepspeed` is reachable as `tds.<name>` (the same object, except the three TDS replaces).
- `tds.init_distributed` is the safe one: it never JIT-builds DeepSpeed's CPU shared-memory op.
- The engine follows DeepSpeed's backward protocol: after every batch, on every stage, ZeRO's backward depth is
  0 and the engine is out of backward (DeepSpeed's own hooks leave it 4, 8, 12 ... on non-last stages otherwise).
- `INTERNALS` lists each private DeepSpeed name the engine relies on, with what it must look like; one test per
  entry fails, naming it, when a DeepSpeed upgrade changes it (tds/README.md "DeepSpeed internals" lists the same).
"""
from __future__ import annotations

import importlib
import inspect
import os

import pytest

from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tests.tds import common, harness


def test_every_deepspeed_attribute_is_reachable_through_tds():
    import deepspeed

    import tds
    names = [n for n in dir(deepspeed) if not n.startswith("__")]
    assert len(names) > 50
    for name in names:
        assert hasattr(tds, name), name
        if name not in tds.REPLACED:
            assert getattr(tds, name) is getattr(deepspeed, name), name
    assert set(names) <= set(dir(tds))
    from tds import init_inference, log_dist  # noqa: F401 - `from tds import x` works for any name too
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        tds.no_such_name  # noqa: B018


def shm_rank() -> dict:
    import tds
    built = []
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # `import tds` alone loads no DeepSpeed (tds/lazy.py)
    original = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: built.append(1)  # what DeepSpeed calls on CPU; tds must replace it
    try:
        tds.init_distributed()
    finally:
        ds_torch.build_shm_op = original
    return {"built": len(built), "same": tds.init_distributed is tds.device.init_distributed}


def test_tds_init_distributed_never_builds_the_cpu_shm_op():
    r = run_distributed(shm_rank, 1, timeout=60)[0]
    assert r == {"built": 0, "same": True}


# --- DeepSpeed's backward protocol ----------------------------------------------------------------------
def protocol_rank(zero: int) -> dict:
    engine = harness.build(common.stack_specs(), ([True], ["float"], [False]), pp=2, dp=2, gas=4, zero=zero,
                           opt="adam")
    X, Y = common.make_data(3, 16)
    data = common.rank_iterator(X, Y, engine.grid.get_data_parallel_rank(), 2, 4, 2)
    after = []
    for _ in range(3):
        engine.train_batch(data)
        after.append((getattr(engine.optimizer, "_backward_active_depth", 0), engine._running_engine_backward,
                      engine._running_engine_backward_count, engine.is_gradient_accumulation_boundary()))
    return {"after": after, "optimizer": type(engine.optimizer).__name__, "global_steps": engine.global_steps,
            "global_samples": engine.global_samples, "stage": engine.stage_id}


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_engine_state_is_consistent_after_every_batch_on_every_stage(zero):
    for r in run_distributed(protocol_rank, 4, zero, timeout=120):
        assert r["after"] == [(0, False, 0, False)] * 3, r
        assert r["global_steps"] == 3 and r["global_samples"] == 3 * 16, r
        assert r["optimizer"] == ("DeepSpeedZeroOptimizer" if zero else "Adam"), r


# --- the internals ------------------------------------------------------------------------------------
# (dotted name, kind, requirement): "params" = these parameter names, in this order, after self;
# "attr" = exists (on the class, or on a live engine for "engine_attr"); "value" = importable constant.
INTERNALS = [
    ("deepspeed.runtime.engine.DeepSpeedEngine.__init__", "params_include",
     ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "mpu",
      "dist_init_required", "collate_fn", "config", "config_class"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine.forward", "params", ["inputs", "kwargs"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine.backward", "params", ["loss", "retain_graph", "scale_wrt_gas"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine._backward_epilogue", "params", []),
    ("deepspeed.runtime.engine.DeepSpeedEngine._backward_prologue_per_tensor", "params", ["grad"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine.allreduce_gradients", "params_include", ["bucket_size"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine.buffered_allreduce_fallback", "params_include",
     ["grads", "elements_per_buffer"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine._take_model_step", "params_include", ["lr_kwargs"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine._broadcast_model", "params", []),
    ("deepspeed.runtime.engine.DeepSpeedEngine._get_gradients_for_reduction", "params", []),
    ("deepspeed.runtime.engine.DeepSpeedEngine.is_gradient_accumulation_boundary", "params", []),
    ("deepspeed.runtime.engine.DeepSpeedEngine.module_state_dict", "params_include",
     ["exclude_frozen_parameters"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine.load_module_state_dict", "params_include",
     ["checkpoint", "strict", "custom_load_fn", "fetch_z3_params"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine.set_train_batch_size", "params", ["train_batch_size"]),
    ("deepspeed.runtime.engine.DeepSpeedEngine._configure_python_gc", "params", []),
    ("deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE", "value", int),
    ("deepspeed.set_optimizer_flags", "params", ["config_class", "model"]),
    ("deepspeed.runtime.tensor_parallel.init_utils.load_ds_config", "params", ["config"]),
    ("deepspeed.runtime.base_optimizer.ZeROOptimizer._backward_active_depth", "attr", None),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.clear_lp_grads", "params_include", ["set_to_none"]),
    ("deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer.step", "params_include", ["closure"]),
    ("deepspeed.comm.torch.build_shm_op", "params", []),
    ("torch.distributed.distributed_c10d._set_pg_timeout", "params", ["timeout", "group"]),
    ("deepspeed.runtime.pipe.topology.PipelineParallelGrid._build_p2p_groups", "params", []),
    ("deepspeed.runtime.pipe.module.PipelineModule._build", "params", []),
    ("deepspeed.runtime.pipe.module.PipelineModule._count_layer_params", "params", []),
    ("deepspeed.runtime.pipe.module.PipelineModule._set_bounds", "params", ["start", "stop"]),
    ("engine._running_engine_backward", "engine_attr", bool),
    ("engine._running_engine_backward_count", "engine_attr", int),
    ("engine._running_engine_backward_lock", "engine_attr", None),
    ("engine._curr_ckpt_path", "engine_attr_during_save", None),
    ("engine.checkpoint_engine", "engine_attr", None),
    ("engine._config.pipeline", "engine_attr", dict),
    ("engine._config.bfloat16_config", "engine_attr", None),
    ("engine.optimizer.bf16_groups", "bf16_attr", list),
    ("engine.optimizer.fp32_groups_gradients", "bf16_attr", list),
    ("engine.optimizer.fp32_groups_has_gradients", "bf16_attr", list),
    # bf16_tail.FlatBF16Optimizer: the flat layout, the step's parts, what decides whether it applies
    ("deepspeed.runtime.engine.DeepSpeedEngine._configure_bf16_optimizer", "params", ["optimizer"]),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.update_hp_grads", "params_include", ["clear_lp_grads"]),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.update_lp_params", "params", []),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer.clear_hp_grads", "params", []),
    ("deepspeed.runtime.bf16_optimizer.BF16_Optimizer._lazy_init_hp_params_optimizer_state", "params", []),
    ("engine.optimizer.bf16_groups_flat", "bf16_attr", list),
    ("engine.optimizer.fp32_groups_gradients_flat", "bf16_attr", list),
    ("engine.optimizer.fp32_groups_flat_partition", "bf16_attr", list),
    ("engine.optimizer.fp32_groups_gradient_flat_partition", "bf16_attr", list),
    ("engine.optimizer.optimizer", "bf16_attr", None),
    ("engine.optimizer.clip_grad", "bf16_attr", float),
    ("engine.optimizer.grad_acc_dtype", "bf16_attr", None),
    ("engine.optimizer.immediate_grad_update", "bf16_attr", bool),
    ("engine.optimizer.has_moe_layers", "bf16_attr", bool),
    ("engine.optimizer.using_real_optimizer", "bf16_attr", bool),
    ("engine.optimizer.loss_scale_config", "fp16_attr", None),
]


def _resolve(dotted: str):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = inspect.getattr_static(obj, attr) if isinstance(obj, type) else getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _unwrap(fn):
    """The function under DeepSpeed's `instrument_w_nvtx` (a `wrapped_fn` without functools.wraps)."""
    if getattr(fn, "__name__", None) != "wrapped_fn":
        return fn
    inner = [c.cell_contents for c in fn.__closure__ or () if inspect.isfunction(c.cell_contents)]
    return _unwrap(inner[0]) if inner else fn


def live_rank(tmp: str) -> dict:
    """Attributes of live engines: fp32 (with a save), bf16 (BF16_Optimizer), fp16 (FP16_UnfusedOptimizer)."""
    with allow_cpu_fp16():
        return _live(tmp)


def _live(tmp: str) -> dict:
    out = {}
    for kind, extra in (("engine", {}), ("bf16", {"bf16": {"enabled": True}}),
                        ("fp16", {"fp16": {"enabled": True}})):
        engine = harness.build(common.stack_specs(), None, pp=1, gas=1, zero=0, extra_cfg=extra)
        if kind == "engine":  # module_state_dict() reads _curr_ckpt_path while DeepSpeed saves
            seen = []
            save = engine.module.save_state_dict
            engine.module.save_state_dict = lambda path, **kw: (seen.append(path), save(path, **kw))[1]
            engine.save_checkpoint(tmp, tag="t")
            out["engine._curr_ckpt_path"] = seen == [os.path.join(tmp, "t")]
        for name, how, typ in INTERNALS:
            if how.startswith(kind) and how != "engine_attr_during_save":
                path = name.split(".")[1:]
                obj, ok = engine, True
                for attr in path:
                    ok = ok and hasattr(obj, attr)
                    obj = getattr(obj, attr, None)
                out[name] = ok and (typ is None or isinstance(obj, typ))
    return out


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    return run_distributed(live_rank, 1, str(tmp_path_factory.mktemp("ckpt")), timeout=120)[0]


@pytest.mark.parametrize("name,how,want", INTERNALS, ids=[i[0] for i in INTERNALS])
def test_deepspeed_internal_is_as_tds_expects(name, how, want, live):
    if how in ("engine_attr", "engine_attr_during_save", "bf16_attr", "fp16_attr"):
        assert live.get(name), f"DeepSpeed changed: {name} is missing or not a {want} (tds relies on it)"
        return
    obj = _resolve(name)
    if how == "value":
        assert isinstance(obj, want), f"DeepSpeed changed: {name} is {obj!r}, tds expects a {want.__name__}"
        return
    if how == "attr":
        return
    params = [p for p in inspect.signature(_unwrap(obj)).parameters if p != "self"]
    if how == "params":
        assert params == want, f"DeepSpeed changed the signature of {name}: {params}, tds expects {want}"
    else:
        missing = [p for p in want if p not in params]
        assert not missing, f"DeepSpeed changed the signature of {name}: no {missing} in {params}"
