"""`tds.pipe.ProcessGrid` answers as DeepSpeed's `PipelineParallelGrid` for the same topology.

On every rank both grids are built (DeepSpeed's, and tds's own `build_grid`); every attribute of DeepSpeed's grid
and every method it has without arguments must give the same value on the view (a process group compared by
its ranks). A DeepSpeed upgrade that gives its grid something new fails here, naming it. Handed groups that
are not the topology's are refused.
"""
from __future__ import annotations

import pytest

from harness.dist import run_distributed


def _comparable(value):
    import torch.distributed as dist
    if isinstance(value, dist.ProcessGroup):
        return ("group", dist.get_process_group_ranks(value))
    return value


def _answers(grid) -> dict:
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid
    out = {f"attr {k}": _comparable(v) for k, v in vars(grid).items() if k != "subgroup"}
    for name in dir(PipelineParallelGrid):
        if name.startswith("get_") or name in ("topology", "_is_grid_valid"):
            out[f"{name}()"] = _comparable(getattr(grid, name)())
    out["stage_to_global(0)"] = grid.stage_to_global(0)
    return out


def _compare_rank(axes: tuple) -> dict:
    """{name: (DeepSpeed's, tds's)} for every answer that differs, plus the answers' names."""
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology
    from tds.pipe.grid import build_grid
    from tests.tds import common
    common.init_ds()
    topology = ProcessTopology(axes=[a for a, _ in axes], dims=[d for _, d in axes])
    ds, tds = _answers(PipelineParallelGrid(topology=topology)), _answers(build_grid(topology))
    keys = set(ds) | set(tds)
    return {"differ": {k: (ds.get(k), tds.get(k)) for k in keys if ds.get(k) != tds.get(k)}, "names": sorted(ds)}


@pytest.mark.parametrize("axes,world", [((("pipe", 2), ("data", 2), ("model", 2)), 8),
                                        ((("pipe", 2), ("data", 2)), 4)])
def test_the_view_answers_as_deepspeeds_grid(axes, world):
    results = run_distributed(_compare_rank, world, axes, timeout=120)
    for rank, r in enumerate(results):
        assert r["differ"] == {}, f"rank {rank}"
    assert "get_model_parallel_group()" in results[0]["names"] and "attr ds_model_proc_group" in results[0]["names"]


def _refused_rank() -> str:
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from tds.pipe.grid import ProcessGrid
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    groups = {kind: dist.new_group([0, 1, 2, 3]) for kind in ("tensor", "pipe", "data", "model")}
    try:
        ProcessGrid(topology, subgroup=dist.new_group, **groups)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_handed_groups_must_be_the_topologys():
    errors = run_distributed(_refused_rank, 4, timeout=120)
    assert "the tensor group handed to the grid holds ranks [0, 1, 2, 3], but the topology puts rank 0 in the " \
           "tensor group [0, 1]" in errors[0]
