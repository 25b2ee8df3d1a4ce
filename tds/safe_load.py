"""Checkpoint files read as untrusted: `torch.load(weights_only=True)` with the smallest allowlist of globals.

A pickle can call any function it names, so a downloaded checkpoint read with `weights_only=False` (what
DeepSpeed's engine does) runs whatever its author put there, on every rank. Here every read goes through
`load`: torch's weights-only unpickler, which builds tensors, containers and scalars and otherwise only the
globals allowed below. A file that names any other global is refused before anything of it is built, with
one line naming the file and the global (`UnsafeCheckpointError`).

    ENGINE_GLOBALS    what this project's files hold besides tensors: numpy's RNG state (ndarray, dtype),
                      DeepSpeed's loss scalers, ZeRO stage enum and optimizer fragment addresses
    load(path, allow=ENGINE_GLOBALS, stub_modules=())
                      `stub_modules`: globals of these packages (code that is not installed here, such as
                      Megatron-LM's enums in the arguments it pickles) become inert `Opaque` records, which
                      run nothing whatever the name
    trusted(on)       within it, `load` uses weights_only=False: the documented opt-in
                      (--trust-checkpoint) for a legacy file from a source the user trusts (globals of
                      `stub_modules` that are not installed still become `Opaque` records)
    SafeCheckpointEngine(inner)
                      DeepSpeed's checkpoint engine with `load` replaced: the engine's own reads (mp_rank files,
                      ZeRO partitions, per-layer files through its state-dict loaders) are safe too

torch >= 2.10 is required (CVE-2025-32434, fixed in 2.6: code execution through weights_only=True;
CVE-2026-24747, fixed in 2.10: memory corruption in the weights-only unpickler).
"""
from __future__ import annotations

import contextlib
import contextvars
import io
import os
import pickle
import types
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Union

import torch

PathOrFile = Union[str, os.PathLike, io.IOBase]
_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("tds_trusted_checkpoints", default=False)
TRUST_FLAG = "--trust-checkpoint"


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file whose pickle names a global outside the allowlist; the message is one line."""

    def __init__(self, where: str, names: Iterable[str]):
        self.where, self.names = where, sorted(names)
        super().__init__(f"{where}: refused, its pickle calls {', '.join(self.names)}, which a checkpoint file may "
                         f"not (read with torch.load(weights_only=True) and this project's allowlist); nothing of it "
                         f"was run. If you trust where the file comes from, load it with {TRUST_FLAG}")


class Opaque:
    """What a stubbed global becomes: its arguments and state kept as data, nothing called."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.args, self.kwargs = args, kwargs

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(cls)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"Opaque{self.args!r}"


def _numpy_globals() -> Dict[str, Any]:
    import numpy as np
    core = getattr(np, "_core", None) or np.core  # numpy 2 pickles numpy._core, numpy 1 numpy.core
    out = {"numpy.core.multiarray._reconstruct": core.multiarray._reconstruct,
           "numpy._core.multiarray._reconstruct": core.multiarray._reconstruct,
           "numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    dtypes = getattr(np, "dtypes", None)
    for name in ("UInt32DType", "Float64DType", "Int64DType"):  # np.random's state and saved scalars
        if dtypes is not None and hasattr(dtypes, name):
            out[f"numpy.dtypes.{name}"] = getattr(dtypes, name)
    return out


def _deepspeed_globals() -> Dict[str, Any]:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return {"deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
            "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
            "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
            "deepspeed.utils.tensor_fragment.fragment_address": fragment_address}


def engine_globals() -> Dict[str, Any]:
    """ENGINE_GLOBALS: full name -> object, for the files this project and DeepSpeed's engine write."""
    return {**_numpy_globals(), **_deepspeed_globals()}


@contextlib.contextmanager
def trusted(on: bool = True) -> Iterator[None]:
    """Within the block (when `on`), `load` reads with weights_only=False: only for files the user trusts."""
    token = _TRUSTED.set(bool(on) or _TRUSTED.get())
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_trusted() -> bool:
    return _TRUSTED.get()


def _name(f: PathOrFile, where: Optional[str]) -> str:
    return where or (os.fspath(f) if isinstance(f, (str, os.PathLike)) else "checkpoint stream")


def unsafe_globals(f: PathOrFile, allow: Dict[str, Any]) -> list:
    """Globals the pickle of `f` names beyond torch's defaults and `allow` (read statically, nothing built)."""
    with torch.serialization.safe_globals([(obj, name) for name, obj in allow.items()]):
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    if not isinstance(f, (str, os.PathLike)):
        f.seek(0)
    return names


def load(f: PathOrFile, map_location: Any = "cpu", mmap: bool = False, allow: Optional[Dict[str, Any]] = None,
         stub_modules: Iterable[str] = (), where: Optional[str] = None) -> Any:
    """torch.load of `f` with weights_only=True and the globals `allow` (default ENGINE_GLOBALS); see the module
    docstring. UnsafeCheckpointError (one line) for a file that names any other global."""
    kwargs = dict(map_location=map_location, mmap=mmap) if mmap else dict(map_location=map_location)
    stub_modules = tuple(stub_modules)
    if is_trusted():
        return torch.load(f, weights_only=False, pickle_module=_stubbing_pickle(stub_modules), **kwargs)
    allow = dict(engine_globals() if allow is None else allow)
    if stub_modules:
        extra = unsafe_globals(f, allow)
        allow.update({n: Opaque for n in extra if n.startswith(stub_modules)})
        refused = [n for n in extra if n not in allow]
        if refused:
            raise UnsafeCheckpointError(_name(f, where), refused)
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in allow.items()]):
            return torch.load(f, weights_only=True, **kwargs)
    except pickle.UnpicklingError:
        if not isinstance(f, (str, os.PathLike)):
            f.seek(0)
        try:
            refused = unsafe_globals(f, allow)
        except Exception:  # noqa: BLE001 (not even a readable pickle: the original error says more)
            refused = []
        if refused:
            raise UnsafeCheckpointError(_name(f, where), refused) from None
        raise


def _stubbing_pickle(stub_modules: tuple) -> Any:
    """A pickle module for a trusted load: globals of `stub_modules` that do not import become `Opaque`."""
    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                if module.startswith(stub_modules) and stub_modules:
                    return Opaque
                raise
    module = types.ModuleType("stubbing_pickle")
    module.Unpickler, module.load, module.loads = Unpickler, pickle.load, pickle.loads
    return module


class SafeCheckpointEngine:
    """A DeepSpeed checkpoint engine whose `load` is this module's `load` (every other attribute is the wrapped
    engine's), so that DeepSpeed's `load_checkpoint` and its state-dict loaders read safely."""

    def __init__(self, inner: Any, allow: Optional[Callable[[], Dict[str, Any]]] = None):
        self._inner, self._allow = inner, allow

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load(path, map_location=map_location, allow=self._allow() if self._allow else None)


def make_safe(engine: Any) -> Any:
    """Give a DeepSpeed engine a `SafeCheckpointEngine` (idempotent); returns the engine."""
    if not isinstance(engine.checkpoint_engine, SafeCheckpointEngine):
        engine.checkpoint_engine = SafeCheckpointEngine(engine.checkpoint_engine)
    return engine
