"""A package's exported names, imported on first use (PEP 562's module `__getattr__`).

`import tds` and `import tds.pipe.instructions` load neither DeepSpeed nor torch: the schedules as data
(`tds.pipe.instructions`, `tds.pipe.schedule_sim`) import in milliseconds, for a layout planner that runs in a
second or two, and the engine, DeepSpeed and torch load with the first name that needs them (`tds.initialize`,
`tds.pipe.PipelineModule`, any attribute of `deepspeed`).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, Dict, Optional

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Dict[str, str],
                 fallback: Optional[Callable[[str], Any]] = None) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`: `names` maps each exported name to the module that defines it
    (imported on first use, the value kept in the package); any other name is the package's submodule of that
    name, else `fallback(name)` (not kept), else AttributeError."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in names:
            value = namespace[name] = getattr(importlib.import_module(names[name]), name)
            return value
        if not name.startswith("__"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
