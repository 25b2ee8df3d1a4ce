"""Megatron core's `torch_dist` checkpoints (PyTorch distributed checkpoint files) -> `Source`, in one process.

    <dir>/latest_checkpointed_iteration.txt, <dir>/iter_NNNNNNN/
        metadata.json        {"sharded_backend": "torch_dist", ...}
        .metadata            the distributed checkpoint's index: every tensor's global shape, its chunks (offsets,
                             sizes) and where each chunk's bytes are (file, offset, length); torch's Metadata
                             (core 0.16 and later: with every rank's SavePlan in it) or core 0.15's MCoreMetadata
        __R_N.distcp         the chunks, each a torch.save'd tensor (non-tensor items: torch.save'd objects)
        common.pt            the state that is not sharded: args, checkpoint_version, iteration (core before
                             0.19; 0.19 and later keep it as the item `common_state/shard_0_1`, a list [state])

Tensors are stored as global tensors, whatever tp and pp wrote them; a GPT's keys (`decoder.layers.` prefix
dropped, the rest as `source.RENAMES`):
    embedding.word_embeddings.weight, embedding.position_embeddings.weight
    decoder.layers.{self_attention.linear_qkv, self_attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2}.*,
        the norms as linear_qkv.layer_norm_* and linear_fc1.layer_norm_* (Transformer Engine's fused modules;
        core's local layer spec maps its input_layernorm / pre_mlp_layernorm to the same keys, which are also
        read); stacked along a leading layer axis (homogeneous layers, the default) or numbered
        decoder.layers.i.*
    decoder.layers.{mlp.router, mlp.experts.experts.linear_fc1, linear_fc2, mlp.shared_experts.linear_fc1,
        linear_fc2, gate_weight} of a MoE layer (core's MoELayer: the experts, SequentialMLP or grouped GEMM, as one
        tensor with a leading expert axis; in a model with dense layers too, the layers are numbered)
    decoder.final_layernorm.*, output_layer.weight (untied head)
linear_qkv rows are grouped per query group [q heads, k, v] (`qkv` order '2'); linear_fc1 of SwiGLU is
stored as [W_gate; W_up] (core's swiglu sharded factory), already the canonical layout.

Safety: PyTorch reads `.metadata` with pickle and non-tensor items with weights_only=False, so this module reads
neither through PyTorch: `.metadata` is unpickled with only the index's own records allowed (`_IndexUnpickler`),
every chunk and object through `tds.safe_load`; a file naming any other global is refused in one line naming
the file and the global, before anything of it is built. Proven against Megatron core's own files
(tests/checkpoint/test_megatron_core.py).
"""
from __future__ import annotations

import collections
import io
import json
import os
import pathlib
import pickle
import re
from typing import Any, Dict, Optional

import torch

from megatron.errors import UserError
from tds.safe_load import UnsafeCheckpointError, is_trusted
from ..files import CheckpointFileError, UntrustedCheckpointError
from .legacy import iteration_folder
from .qkv import order_of_version
from .source import IGNORED, Source, arguments, canonical_name, load_ancestor

BACKEND = "torch_dist"


def _index_globals() -> Dict[tuple, Any]:
    """The index's records: torch's distributed-checkpoint dataclasses (Metadata, its storage and chunk
    descriptors; the SavePlans of every rank that Megatron core >= 0.16 keeps in it), and Megatron core 0.15's
    subclasses of two of them (MCoreMetadata, MCoreSavePlan: read as the torch records they extend, their extra
    fields kept as data). Each is a dataclass or enum that pickle fills field by field: nothing runs."""
    from torch.distributed.checkpoint import filesystem, metadata, planner
    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
             "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    out = {("torch.distributed.checkpoint.metadata", n): getattr(metadata, n) for n in names if hasattr(metadata, n)}
    plans = ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
    out.update({("torch.distributed.checkpoint.planner", n): getattr(planner, n) for n in plans
                if hasattr(planner, n)})
    core = "megatron.core.dist_checkpointing.strategies.torch"
    out.update({(core, "MCoreMetadata"): metadata.Metadata, (core, "MCoreSavePlan"): planner.SavePlan})
    out.update({("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo,
                ("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                ("pathlib", "PosixPath"): pathlib.PurePosixPath, ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
                ("collections", "OrderedDict"): collections.OrderedDict})
    try:  # the index of torch < 2.4 names the sharded-tensor package's TensorProperties
        from torch.distributed._shard.sharded_tensor import metadata as sharded
        out[("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties")] = sharded.TensorProperties
    except ImportError:
        pass
    return out


class _IndexUnpickler(pickle.Unpickler):
    """pickle restricted to the index's records (`_index_globals`), dtypes and layouts; any other global is
    refused before anything is built. With --trust-checkpoint, any global the index names is found."""

    def __init__(self, f, where: str):
        super().__init__(f)
        self.where, self.allowed = where, _index_globals()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if is_trusted():
            return super().find_class(module, name)
        raise UnsafeCheckpointError(self.where, [f"{module}.{name}"])


def holds_metadata(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "metadata.json"))


def read_index(folder: str):
    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path} is missing: {folder} has metadata.json but no distributed-checkpoint index")
    try:
        with open(path, "rb") as f:
            return _IndexUnpickler(f, path).load()
    except UnsafeCheckpointError as err:
        raise UntrustedCheckpointError(str(err)) from None
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as err:
        raise CheckpointFileError(f"{path} cannot be read ({type(err).__name__}: {err}); it is damaged") from None


def _item(folder: str, info, where: str) -> Any:
    """The torch.save'd bytes of one stored item (a tensor chunk or an object), read safely."""
    path = os.path.join(folder, info.relative_path)
    if getattr(info, "transform_descriptors", None):
        raise UserError(f"{where} is stored with transforms {list(info.transform_descriptors)} (compressed); "
                        f"import-megatron reads plain distributed checkpoints")
    if not os.path.isfile(path):
        raise CheckpointFileError(f"checkpoint file {path} is missing (the index {folder}/.metadata names it)")
    with open(path, "rb") as f:
        f.seek(info.offset)
        data = io.BytesIO(f.read(info.length))
    try:
        return _load_bytes(data, f"{path} (item {where})")
    except UnsafeCheckpointError as err:
        raise UntrustedCheckpointError(str(err)) from None


def _load_bytes(data: io.BytesIO, where: str) -> Any:
    """A stored object (torch.save'd; Transformer Engine's state inside is a BytesIO, kept as one)."""
    import argparse
    from tds.safe_load import engine_globals, load
    from .source import ANCESTOR_CODE
    return load(data, allow={**engine_globals(), "argparse.Namespace": argparse.Namespace, "_io.BytesIO": io.BytesIO},
                stub_modules=ANCESTOR_CODE, where=where)


def read_tensor(folder: str, index, key: str, where: Dict[tuple, Any]) -> torch.Tensor:
    """The global tensor `key`, assembled from its chunks (`where`: (key, chunk offsets) -> storage info)."""
    md = index.state_dict_metadata[key]
    out = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    for chunk in md.chunks:
        value = _item(folder, where[(key, tuple(chunk.offsets))], key)
        region = out
        for dim, (start, size) in enumerate(zip(chunk.offsets, chunk.sizes)):
            region = region.narrow(dim, start, size)
        region.copy_(value.reshape(tuple(chunk.sizes)))
    return out


def _common(folder: str, index) -> Dict[str, Any]:
    """The state that is not sharded: common.pt (Megatron core before 0.19; 0.19 and later still read it), or the
    `common_state` item, which core 0.19 and later store as every other ShardedObject, the torch.save'd list of its
    ranks' objects (one: [state]); `serialization.load_common_state_dict` takes item [0]."""
    path = os.path.join(folder, "common.pt")
    if os.path.isfile(path):
        common, where = load_ancestor(path, mmap=False), path
    else:
        key = next((k for k in index.storage_data if k.fqn.startswith("common_state")), None)
        if key is None:
            return {}
        where = f"{folder} (item {key.fqn})"
        common = _item(folder, index.storage_data[key], key.fqn)
        common = common[0] if isinstance(common, list) and len(common) == 1 else common
    if not isinstance(common, dict):
        raise CheckpointFileError(f"{where} holds a {type(common).__name__}, not the dict of arguments, iteration and "
                                  f"checkpoint_version that Megatron core stores there; it is damaged or not a "
                                  f"Megatron checkpoint")
    return common


def _model_keys(index) -> Dict[str, str]:
    """Stored key -> canonical name (stacked layers: 'layers.*.<rest>', unrolled on reading)."""
    out = {}
    for key, md in index.state_dict_metadata.items():
        if not hasattr(md, "chunks") or IGNORED.search(key) or key.startswith(("optimizer.", "rng_state", "rerun")):
            continue
        if key in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
            out[key] = key
        elif key == "output_layer.weight":
            out[key] = "lm_head.weight"
        elif key.startswith("decoder."):
            rest = key[len("decoder."):]
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest) or re.fullmatch(r"layers\.()(.+)", rest)
            if m:
                out[key] = f"layers.{m[1] or '*'}.{canonical_name(m[2], key)}"
            else:
                out[key] = canonical_name(rest, key)
        elif key.startswith(("embedding.", "mtp.", "encoder.", "lm_head.", "binary_head.", "pooler.")):
            raise UserError(f"{key} in a torch_dist checkpoint: import-megatron reads GPT models (no multi-token "
                            f"prediction, encoder, BERT heads)")
    return out


def read_torch_dist(root: str) -> Source:
    folder = iteration_folder(root, holds_metadata)
    meta_path = os.path.join(folder, "metadata.json")
    with open(meta_path) as f:
        backend = json.load(f).get("sharded_backend")
    if backend != BACKEND:
        raise UserError(f"{meta_path}: sharded_backend {backend!r}; import-megatron reads {BACKEND!r} checkpoints")
    index = read_index(folder)
    common = _common(folder, index)
    margs = arguments(common.get("args"))
    src = Source(fmt=f"Megatron core torch_dist checkpoint (checkpoint_version {common.get('checkpoint_version')}, "
                     f"written at tp {margs.get('tensor_model_parallel_size')}, pp "
                     f"{margs.get('pipeline_model_parallel_size')})", where=folder, margs=margs, tp=1, pp=1,
                 qkv_order=order_of_version(max(2.0, float(common.get("checkpoint_version") or 3.0))))
    where = {(k.fqn, tuple(k.offset or ())): v for k, v in index.storage_data.items()}
    for key, name in _model_keys(index).items():
        value = read_tensor(folder, index, key, where)
        if name.startswith("layers.*."):
            for i in range(value.size(0)):
                src.parts[name.replace("*", str(i), 1)] = [value[i].clone()]
        else:
            src.parts[name] = [value]
    src.iteration = common.get("iteration") if os.path.basename(folder) != "release" else None
    src.consumed_samples = margs.get("consumed_train_samples") if src.iteration is not None else None
    src.not_carried = "optimizer state (core's distributed optimizer), RNG and rerun states are not carried"
    return src


def is_torch_dist(folder: str) -> Optional[str]:
    """The iteration folder when `folder` (or the folder its tracker names) is a torch_dist checkpoint."""
    try:
        inner = iteration_folder(folder, holds_metadata)
    except (OSError, ValueError):
        return None
    return inner if holds_metadata(inner) else None
