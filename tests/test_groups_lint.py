"""Process groups are created in one module of megatron and one of tds, and "model parallel" has one meaning.

- `megatron/mpu/parallel_state.py` builds every group of a Megatron run once; `tds/pipe/grid.py` builds tds's
  own only for a program that hands it none. Nothing else calls `new_group(` or builds DeepSpeed's
  `PipelineParallelGrid(` (which would create a second set of groups).
- `get_model_parallel_*` is called only on a pipeline grid (`grid.get_model_parallel_group()`: pipe x tensor,
  DeepSpeed's meaning); Megatron 2019's tensor-parallel aliases of that name are defined and exported by
  megatron.mpu for ported code, and the project's own code says tensor.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CREATES_GROUPS = ("new_group(", "PipelineParallelGrid(")
ALIAS_HOMES = {"megatron/mpu/parallel_state.py", "megatron/mpu/__init__.py"}


def _sources(top: str):
    for folder, _, files in os.walk(os.path.join(ROOT, top)):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                yield os.path.relpath(path, ROOT), open(path).read()


def _group_builders(top: str) -> set:
    return {rel for rel, text in _sources(top) if any(p in text for p in CREATES_GROUPS)}


def test_groups_are_created_in_one_module_of_megatron_and_one_of_tds():
    assert _group_builders("megatron") == {"megatron/mpu/parallel_state.py"}
    assert _group_builders("tds") == {"tds/pipe/grid.py"}


def _model_parallel_uses(tree: ast.AST) -> list:
    """Lines that use a get_model_parallel_* name other than as a method of a grid."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("get_model_parallel_"):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id == "grid"
                    or isinstance(owner, ast.Attribute) and owner.attr == "grid"):
                out.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id.startswith("get_model_parallel_"):
            out.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name.startswith("get_model_parallel_") for a in node.names):
            out.append(node.lineno)
    return out


def test_model_parallel_means_pipe_x_tensor_outside_the_megatron_aliases():
    offenders = {rel: lines for top in ("megatron", "tds") for rel, text in _sources(top)
                 if rel not in ALIAS_HOMES and (lines := _model_parallel_uses(ast.parse(text)))}
    assert offenders == {}
