"""The import graph of the library, walked from the source (every import statement, also inside functions):

- dependencies point down: entry scripts / tools / bench -> megatron.training -> megatron.config ->
  checkpointing, inference -> model -> mpu, data, tokenizer -> errors, logging_utils -> tds;
- no library module imports an entry script, a tool, a benchmark, the harness or a test;
- tds never imports megatron (users copy tds/ alone);
- no import cycle between modules;
- the harness (harness/) imports the library and itself, never tests/, bench/, tools/ or an entry script; bench/
  imports the library, the harness and its own folder's scripts, never tests/ or tools/ (a tool's code is the
  library's: tools/ are thin command lines); neither bench/ nor tools/ edits sys.path.
"""
import ast
import os
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bottom first; a module may import its own layer and the ones below (prefixes: the longest match wins)
LAYERS: Dict[str, int] = {
    "tds": 0,
    "megatron.errors": 1, "megatron.logging_utils": 1,
    "megatron.mpu": 2, "megatron.data": 2, "megatron.tokenizer": 2,
    "megatron.model": 3,
    "megatron.checkpointing": 4, "megatron.inference": 4,
    "megatron.config": 5,
    "megatron.training": 6, "megatron": 6,
}
OUTSIDE = ("pretrain_gpt2", "pretrain_t5", "tools", "bench", "harness", "tests", "examples")


def _library(tops=("megatron", "tds")) -> Dict[str, str]:
    """module name -> path, for every module of megatron/ and tds/ (or of the folders `tops`)."""
    out = {}
    for top in tops:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    name = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                    out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = os.path.join(folder, f)
    return out


def _imported_names(module: str, path: str) -> Set[str]:
    """Everything `module` imports, as dotted names (`from a import b` gives a.b)."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = parent + ("." + base if base else "")
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def _graph() -> Dict[str, Dict[str, Set[str]]]:
    """module -> {'library': library modules it imports, 'outside': top-level names of OUTSIDE it imports}."""
    modules = _library()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in modules.items():
        names = _imported_names(module, path)
        graph[module] = dict(library={resolve(n) for n in names if resolve(n)} - {module},
                             outside={n.split(".")[0] for n in names if n.split(".")[0] in OUTSIDE})
    return graph


def _first_party(paths: Dict[str, str]) -> Dict[str, Set[str]]:
    """module -> the top-level names of this repository it imports (the library, the harness, OUTSIDE, and the
    scripts beside a bench/ script, which its folder on sys.path makes importable)."""
    out = {}
    for module, path in paths.items():
        beside = {f[:-3] for f in os.listdir(os.path.dirname(path)) if f.endswith(".py")}
        names = {n.split(".")[0] for n in _imported_names(module, path)}
        out[module] = {n for n in names if n in ("megatron", "tds") + OUTSIDE or
                       (module.startswith("bench.") and n in beside)}
    return out


def _layer(module: str) -> int:
    return LAYERS[max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)]


def test_no_library_module_imports_a_script_tool_benchmark_or_test():
    offenders = {m: sorted(g["outside"]) for m, g in _graph().items() if g["outside"]}
    assert offenders == {}


def test_tds_never_imports_megatron():
    assert {m: sorted(g["library"]) for m, g in _graph().items()
            if m.startswith("tds") and any(d.startswith("megatron") for d in g["library"])} == {}


def test_dependencies_point_down():
    upward = sorted(f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
                    for m, g in _graph().items() for d in g["library"] if _layer(d) > _layer(m))
    assert upward == []


def test_no_import_cycle():
    graph = {m: g["library"] for m, g in _graph().items()}
    cycles: List[List[str]] = []
    state: Dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(module: str, path: List[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [module, dep] if dep in path else [module, dep])
            elif dep not in state:
                visit(dep, path + [module])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert cycles == []


def test_the_harness_imports_the_library_and_itself_only():
    imports = _first_party(_library(("harness",)))
    assert {m: sorted(n) for m, n in imports.items() if n - {"megatron", "tds", "harness"}} == {}


def test_bench_imports_the_library_the_harness_and_its_own_scripts_never_tests():
    modules = _library(("bench",))
    assert modules  # the walk found the scripts
    offenders = {m: sorted(n & set(OUTSIDE) - {"harness"}) for m, n in _first_party(modules).items()}
    assert {m: n for m, n in offenders.items() if n} == {}


def _sys_path_edits(paths) -> List[str]:
    """'path:line' of every `sys.path.<method>(...)` call and assignment to `sys.path` in the files."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else \
                node.targets[0] if isinstance(node, ast.Assign) else None
            if isinstance(target, ast.Attribute) and target.attr == "path" and \
                    isinstance(target.value, ast.Name) and target.value.id == "sys":
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
    return found


def test_neither_bench_nor_tools_edits_sys_path():
    """They import the installed project (`pip install -e .`): megatron, tds and the harness."""
    assert _sys_path_edits(sorted(_library(("bench", "tools")).values())) == []


def _assignments_to(name: str, paths) -> List[str]:
    """`name.<field> = ...`, `name.<field> += ...` and `setattr(name, ...)` in the files, as 'path:line field'."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == name:
                    found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {t.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args and \
                    isinstance(node.args[0], ast.Name) and node.args[0].id == name:
                found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} setattr")
    return found


def _sources(*tops: str) -> List[str]:
    out = [os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")]
    for top in tops:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    return sorted(out)


def test_arguments_are_written_only_by_their_resolution():
    """The parser (megatron.config) fills its aliases and --use-checkpoint-args the checkpoint's model fields
    (checkpoint_args.py), resolution derives every value (each model family's options by its spec's `resolve`);
    nothing writes to the resolved arguments afterwards (the vocabulary is settled by `resolution.with_vocabulary`,
    which copies)."""
    owners = {os.path.join(ROOT, "megatron", "config", f)
              for f in ("arguments.py", "checkpoint_args.py", "resolution.py", "ds_config.py", "moe_args.py")}
    owners |= {os.path.join(ROOT, "megatron", "model", "specs", f) for f in ("gpt.py", "t5.py")}
    assert _assignments_to("args", [p for p in _sources("megatron", "tools") if p not in owners]) == []


def test_no_attribute_is_set_on_an_engine_instance():
    """The training path configures the engine through its config and constructor, never by setting
    attributes (methods patched per instance) on it."""
    assert _assignments_to("engine", _sources("megatron", "tools")) == []
