"""Checkpoints made the way a user makes them: `pretrain()` of GPT-2 / T5 (default model code, tied weights)
on the committed golden corpus, fp32, ZeRO-1, global batch 8, gradient clipping active.

Dropout is 0 in the runs whose losses are compared across layouts (the golden runs' setting). On CPU the masks
do not depend on the layout (megatron/model/rng.py: every site draws the single process's mask of its part, and a
data-parallel replica the masks of the micro-batches it holds), nor on any saved RNG state; on GPUs SDPA's fused
kernels draw attention dropout per tp rank. A pp-only continuation with the default dropout is checked separately.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import torch

from tests.dist import run_distributed
from tests.training.golden_cases import DATA, rank_run, argv as golden_argv

# T5 gets 32 sentinels: vocabulary 512 + 32 = 544 pads to 544 at tp 1, 2 and 4 (divisor 8), so a chain of
# reshapes through those tp sizes keeps every row; padding changes are tested on their own.
T5_EXTRA_IDS = 32


def argv(model: str, data_prefix: str, tp: int, pp: int, iters: int, extra: Sequence[str] = ()) -> List[str]:
    """The golden runs' small model, without evaluation."""
    return golden_argv(model, data_prefix, tp, pp, iters, T5_EXTRA_IDS, (100, 1000, 0), extra)


def train(model: str, data_prefix: str, layout: Tuple[int, int, int], iters: int,
          extra: Sequence[str] = ()) -> List[float]:
    """Per-iteration losses of `pretrain()` at layout (tp, pp, dp) (last rank's view)."""
    tp, pp, dp = layout
    world = tp * pp * dp
    args = argv(model, data_prefix, tp, pp, iters, extra)
    return run_distributed(_losses, world, model, args, world, timeout=600)[-1]


def _losses(model: str, args: List[str], world: int) -> List[float]:
    return rank_run(model, args, world)[0]


def load_all(folder: str) -> Dict[str, object]:
    """Every file of a tag folder, loaded (json as dict), but manifest.json: its sizes and CRC-32s describe the
    files' bytes, and the tests compare loaded states (masking the parts a layout rebuilds), not bytes."""
    import json
    from tds.safe_load import load as safe_load
    out = {}
    for name in sorted(n for n in os.listdir(folder) if n != "manifest.json"):
        path = os.path.join(folder, name)
        with open(path, "rb") as f:
            out[name] = json.load(f) if name.endswith(".json") else safe_load(f)  # the allowlist covers them all
        _drop_derived_bucket(out[name])
    return out


def _drop_derived_bucket(state) -> None:
    """ZeRO-1's reduce_bucket_size in a saved ds_config is derived per stage from its gradients
    (tds.pipe.zero_buckets); a reshape writes the run's own config, so the field is not compared."""
    config = state.get("ds_config") if isinstance(state, dict) else None
    if isinstance(config, dict) and isinstance(config.get("zero_optimization"), dict):
        config["zero_optimization"].pop("reduce_bucket_size", None)


def differences(a, b, path: str = "") -> List[str]:
    """Paths where two nested checkpoint structures differ; tensors must be bit-identical (dtype, shape, values)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        same = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if hasattr(a, "__dict__") and type(a).__module__.startswith("deepspeed"):
        return [] if type(a) is type(b) and differences(vars(a), vars(b)) == [] else [path]
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays in RNG states
        import numpy as np
        return [] if np.array_equal(a, b) else [path]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def mask_unused_copies(files: Dict[str, object], args: Dict) -> None:
    """Zero, in place, the optimizer state of parameters a stage holds but never uses
    (`ModelTable.unused_copies`: GPT-2's position table on the last stage), which a reshape does not carry:
    in ZeRO / BF16_Optimizer flat partitions (by param_slice_mappings) and in stage-0 AdamW state (by index)."""
    from megatron.checkpointing.consolidated import layout_of
    from megatron.checkpointing.names import ModelTable
    from megatron.checkpointing.optim import make_groups
    table = ModelTable(args)
    tp, pp, _ = layout_of(args)
    bounds = table.stage_bounds(pp, args.get("partition_method"))
    for name, content in files.items():
        if "mp_rank_" not in name or pp == 1:
            continue
        stage = int(name.split("mp_rank_")[1][:2]) // tp
        unused = table.unused_copies(bounds, stage)
        sd = content["optimizer_state_dict"] if "zero_pp_rank_" in name else content.get("optimizer")
        if not unused or sd is None:
            continue
        if "param_slice_mappings" in sd:
            for g, mapping in enumerate(sd["param_slice_mappings"]):
                flats = [sd["single_partition_of_fp32_groups"][g]] + \
                    [sd["base_optimizer_state"]["state"][g][k] for k in ("exp_avg", "exp_avg_sq")]
                for param, frag in mapping.items():
                    if param in unused:
                        for flat in flats:
                            flat.data[frag.start:frag.start + frag.numel] = 0
        else:
            from megatron.checkpointing.files import layer_file
            tp_rank = int(name.split("mp_rank_")[1][:2]) % tp
            pairs = table.stage_param_names(bounds, stage)
            names = [n for n, _ in pairs]
            ndims = {n: files[layer_file(p.layer, tp_rank)][p.local].dim() for n, p in pairs}
            order = [n for _, group in make_groups(names, ndims) for n in group]
            for index, param in enumerate(order):
                if param in unused and index in sd["state"]:
                    for k in ("exp_avg", "exp_avg_sq"):
                        sd["state"][index][k].data.zero_()


def first_iteration_batches(model: str, args: List[str]) -> list:
    """The micro-batches (inputs, labels) of iteration 1 of `pretrain()` with `args` at (1, 1, 1), built by the
    same hooks and loader (run inside a 1-rank `run_distributed`)."""
    from functools import partial
    from megatron.config.arguments import parse_args
    from megatron.training.batches import BatchIterator
    from megatron.training.initialize import initialize_megatron
    from megatron.training.pretrain import data_loader, settle_config, split_sample_counts
    if model == "gpt2":
        from pretrain_gpt2 import DEFAULTS, SPEC
    else:
        from pretrain_t5 import DEFAULTS, SPEC
    cfg, tokenizer = settle_config(parse_args(args, defaults=DEFAULTS, world_size=1), SPEC)
    state = initialize_megatron(cfg)
    datasets = SPEC.datasets(cfg.data, tokenizer, split_sample_counts(cfg.batch, cfg.logging.eval_iters))
    batches = BatchIterator(data_loader(datasets[0], 0, cfg, state), partial(SPEC.get_batch, data=cfg.data,
                                                                      tokenizer=tokenizer))
    return [next(batches) for _ in range(cfg.batch.gas)]


def mean_loss(logits_fn, batches: list) -> float:
    """pretrain()'s reported loss: the mean over micro-batches of the loss-masked mean cross entropy."""
    import torch.nn.functional as F
    losses = []
    with torch.no_grad():
        for inputs, (labels, loss_mask) in batches:
            logits = logits_fn(*inputs).float()
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="none")
            losses.append((ce * loss_mask.reshape(-1)).sum() / loss_mask.sum())
    return float(torch.stack(losses).mean())
