"""Configuration fields every family builds alike from resolved arguments (or a record of them)."""
from __future__ import annotations


def recompute_fields(args) -> dict:
    """The config's recomputation fields from --recompute-* (resolved; older records: --checkpoint-*)."""
    granularity = getattr(args, "recompute_granularity", None) or ("full" if args.checkpoint_activations else None)
    layers = getattr(args, "recompute_num_layers", None) or args.checkpoint_num_layers or 1
    return dict(recompute_granularity=granularity, checkpoint_num_layers=layers if granularity == "full" else 0,
                recompute_method=getattr(args, "recompute_method", None) or "uniform")


def dropout_fields(args) -> dict:
    """The config's dropout rule from --keyed-dropout (False where args predate it)."""
    return dict(keyed_dropout=bool(getattr(args, "keyed_dropout", False)))


def speed_fields(args) -> dict:
    """The config's speed fields from --cross-entropy-loss-fusion, --compile and --layout-invariant (False where args
    predate them)."""
    return dict(cross_entropy_loss_fusion=bool(getattr(args, "cross_entropy_loss_fusion", False)),
                compile_layers=bool(getattr(args, "compile", False)),
                explicit_attention=bool(getattr(args, "layout_invariant", False)))
