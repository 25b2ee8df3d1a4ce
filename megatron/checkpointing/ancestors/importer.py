"""import-megatron: a checkpoint of this project's ancestors -> a checkpoint of this project at (tp, pp).

    detect(input)        the format from the files: Megatron-LM legacy (`legacy`), Megatron core torch_dist
                         (`torch_dist`), DeepSpeed pipeline files (`ds_pipe`); one line for anything else
    import_megatron(input, save, tp, pp, options[, data_path])
                         Source -> arguments of the GPT computing the same function (`args`) -> full
                         tensors (tp parts merged by the model's partition attributes, the QKV rows into
                         [Q; K; V] by their order, `qkv`) -> written by the same writer as every layout

What is carried: the weights; the iteration and consumed samples where the source records both (a Megatron-LM
or Megatron-DeepSpeed run that was not a `release`): the checkpoint then resumes there with a fresh optimizer
(its LR schedule at the same step: iterations, or samples for a run that counted samples), else it is weights
only (--load starts at iteration 0). Optimizer and RNG states are not carried (`Source.not_carried`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.errors import UserError
from ..consolidated import Consolidated
from ..files import CheckpointFileError, checkpoint_tag, new_checkpoint, read_args
from ..layouts import check_layout, layout_args, write_layout
from ..space import tensor_bytes
from .args import ImportOptions, gpt_args
from .qkv import ORDERS
from .source import Source, canonical_weights, check_complete
from ..names import ModelTable

ORDER_NAMES = {"0": "[3, np, hn], checkpoint_version 0", "1": "[np, hn, 3], checkpoint_version 1.0",
               "2": "[np, 3, hn] / grouped, checkpoint_version 2.0 and 3.0"}


@dataclass
class ImportReport:
    fmt: str
    tag: str
    args: Dict[str, Any]
    lines: List[str] = field(default_factory=list)


def detect(path: str) -> Tuple[str, Callable[[str], Source]]:
    """(format name, reader) of the checkpoint at `path`; CheckpointFileError naming it when none fits."""
    from .ds_pipe import is_ds_pipe, read_ds_pipe
    from .legacy import TRACKER, holds_ranks, iteration_folder, read_legacy
    from .torch_dist import is_torch_dist, read_torch_dist
    if not os.path.isdir(path):
        raise CheckpointFileError(f"--input {path} is not a folder")
    if is_torch_dist(path):
        return "torch_dist", read_torch_dist
    if is_ds_pipe(path):
        return "deepspeed", read_ds_pipe
    try:
        if holds_ranks(iteration_folder(path)):
            return "legacy", read_legacy
    except (OSError, ValueError):
        pass
    raise CheckpointFileError(f"{path} is no checkpoint format import-megatron knows: expected {TRACKER} with "
                              f"iter_*/mp_rank_*/model_optim_rng.pt (Megatron-LM), iter_*/metadata.json (Megatron core "
                              f"torch_dist) or latest with global_step*/mp_rank_*_model_states.pt (DeepSpeed); it "
                              f"holds {sorted(os.listdir(path))[:8]}")


def _engine(src: Source, margs: Dict[str, Any]) -> Dict[str, Any]:
    """The engine and client state of a checkpoint that resumes at the source's iteration (fresh optimizer)."""
    from deepspeed.git_version_info import version
    samples = bool(margs.get("train_samples"))
    steps = src.consumed_samples if samples else src.iteration
    lr = dict(num_steps=steps, max_lr=margs.get("lr"), min_lr=margs.get("min_lr", 0.0),
              warmup_iters=margs.get("lr_warmup_samples" if samples else "lr_warmup_iters") or 0,
              decay_iters=margs.get("lr_decay_samples" if samples else "lr_decay_iters") or 0,
              decay_style=margs.get("lr_decay_style", "linear"))
    return dict(buffer_names=[], lr_scheduler=lr, data_sampler=None, random_ltd=None, skipped_steps=0,
                global_steps=src.iteration, global_samples=src.consumed_samples, ds_version=version,
                iteration=src.iteration, consumed_train_samples=src.consumed_samples)


def _order(src: Source, opts: ImportOptions, losses: Optional[Dict[str, float]]) -> Tuple[str, str]:
    """(QKV order, why)."""
    if opts.qkv_order:
        return opts.qkv_order, "--qkv-order"
    if src.qkv_order:
        return src.qkv_order, "the checkpoint_version the files record"
    if losses:
        best = min(losses, key=losses.get)
        return best, "the lowest loss on --data-path (the files do not record it)"
    return "2", ("not recorded in the files (a run resumed in DeepSpeedExamples / CPM-Pretrain permuted it): "
                 "assumed 2.0's; check with --data-path PREFIX or choose with --qkv-order")


def import_megatron(input_dir: str, save_dir: str, tp: int, pp: int, opts: Optional[ImportOptions] = None,
                    data_path: Optional[str] = None) -> ImportReport:
    """Read the checkpoint at `input_dir`, write this project's checkpoint at (tp, pp, 1) into `save_dir`."""
    opts = opts or ImportOptions()
    if opts.qkv_order not in (None,) + ORDERS:
        raise UserError(f"--qkv-order {opts.qkv_order!r}: one of {', '.join(ORDERS)}")
    if os.path.exists(save_dir):
        raise UserError(f"--save {save_dir} already exists; choose a new directory (outputs are never overwritten)")
    _, reader = detect(input_dir)
    src = reader(input_dir)
    check_complete(src)
    args, gelu_why = gpt_args(src.margs, src.parts, opts, src.where)
    args.update(layout_args(args, tp, pp), megatron_source=src.fmt)
    check_layout(ModelTable(args), args, tp, pp)
    losses = None
    if data_path:
        from .probe import qkv_losses
        losses = qkv_losses(src, args, data_path)
    order, order_why = _order(src, opts, losses)
    weights = canonical_weights(src, args, order)
    resume = src.iteration is not None and src.consumed_samples is not None
    tag = checkpoint_tag(src.iteration if resume else 0)
    engine = _engine(src, src.margs) if resume else {}
    with new_checkpoint(save_dir, tag, tensor_bytes(weights)) as folder:
        write_layout(Consolidated(args=args, weights=weights, engine=engine), folder, args, with_optimizer=False)
    saved = read_args(os.path.join(save_dir, tag))
    return ImportReport(src.fmt, tag, saved, _lines(src, saved, order, order_why, gelu_why, losses, resume))


def _lines(src: Source, args, order: str, order_why: str, gelu_why: str, losses, resume: bool) -> List[str]:
    lines = [f"QKV rows: order {order} ({ORDER_NAMES[order]}): {order_why}"]
    if losses:
        lines.append("QKV order check on --data-path: mean loss " + ", ".join(
            f"{o} {loss:.4f}" for o, loss in sorted(losses.items(), key=lambda kv: kv[1]))
            + f"; plausible: {min(losses, key=losses.get)}")
    if not args.get("swiglu"):
        lines.append(f"GELU: {args['gelu']} ({gelu_why})")
    if resume:
        lines.append(f"--load resumes at iteration {src.iteration}, {src.consumed_samples} consumed samples, the LR "
                     f"schedule at the same step, with a fresh optimizer; {src.not_carried}")
    else:
        why = ("a release checkpoint records no iteration" if src.iteration is None else
               f"the source records iteration {src.iteration} but not its consumed samples")
        lines.append(f"weights only ({why}): --load starts at iteration 0; {src.not_carried}")
    rows = sum(p.size(0) for p in src.parts["embedding.word_embeddings.weight"])
    lines.append(f"vocabulary: {args['vocab_size']} ids (the source's table has {rows} rows; --vocab-size sets the "
                 f"tokenizer's), padded to {args['padded_vocab_size']}")
    return lines
