"""What a mixture of experts logs on each log line, as Megatron-LM logs it.

Every MoE layer tallies, per trained micro-batch, its balancing losses without their coefficients, its dropped
choices and the choices each expert kept (`megatron.model.moe.MoEMLP.tally`: this rank's share; under sequence
parallelism each tensor-parallel rank holds its part of the sequence, under data parallelism each replica its
micro-batches). At a log line `interval_moe_metrics` sums every layer's tally over all ranks (one all-reduce of a
(layers, 3 + E) tensor), resets them, and reports over the interval's N global micro-batches:

    load_balancing_loss   mean over MoE layers of sum / N          (1 at uniform routing, whatever the coefficient)
    z_loss                mean over MoE layers of sum / N
    dropped_fraction      dropped choices / all choices (T k)       (0 when dropless)
    overload_avg / _max   mean and max over MoE layers of max_e c_e / mean_e c_e, c_e the choices expert e kept

With `--moe-per-layer-logging` each layer's values too, as `layer_<l>/<name>` (l the layer's number).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron.model.moe import TALLY_FIELDS, MoEMLP, take_layer_table
from megatron.model.transformer import TransformerLayer


def moe_layers(module: torch.nn.Module) -> List[Tuple[int, MoEMLP]]:
    """(layer number, its MoE MLP) of every MoE layer this rank holds."""
    return [(m.layer_number, m.mlp) for m in module.modules()
            if isinstance(m, TransformerLayer) and isinstance(m.mlp, MoEMLP)]


def interval_moe_metrics(module: torch.nn.Module, num_layers: int, num_experts: int, micro_batches: int,
                         per_layer: bool = False) -> Dict[str, float]:
    """The module docstring's metrics, over all ranks (a collective: every rank of a MoE model calls it at the
    same log line, whether or not its stage holds a MoE layer)."""
    table = take_layer_table({number: mlp.tally for number, mlp in moe_layers(module)}, num_layers,
                             len(TALLY_FIELDS) + num_experts)
    per = {number: _layer_metrics(row, micro_batches) for number, row in enumerate(table.cpu().tolist(), 1)
           if any(row)}  # the MoE layers (a dense layer tallies nothing)
    if not per:
        return {}
    out = {name: sum(m[name] for m in per.values()) / len(per)
           for name in ("load_balancing_loss", "z_loss", "dropped_fraction")}
    out["overload_avg"] = sum(m["overload"] for m in per.values()) / len(per)
    out["overload_max"] = max(m["overload"] for m in per.values())
    if per_layer:
        for number, metrics in per.items():
            out.update({f"layer_{number}/{name}": value for name, value in metrics.items()})
    return out


def _layer_metrics(row: List[float], micro_batches: int) -> Dict[str, float]:
    fields = dict(zip(TALLY_FIELDS, row))
    kept = row[len(TALLY_FIELDS):]
    choices = fields["dropped"] + sum(kept)
    mean = sum(kept) / len(kept)
    return dict(load_balancing_loss=fields["load_balancing_loss"] / micro_batches,
                z_loss=fields["z_loss"] / micro_batches,
                dropped_fraction=fields["dropped"] / choices if choices else 0.0,
                overload=max(kept) / mean if mean else 0.0)


def format_moe(metrics: Dict[str, float]) -> str:
    """The log line's MoE part (`| load balancing loss ... | overload avg ... max ...`), '' without experts."""
    if not metrics:
        return ""
    return (f" | load balancing loss {metrics['load_balancing_loss']:.6f} | z loss {metrics['z_loss']:.6f} | "
            f"dropped {metrics['dropped_fraction']:.4f} | overload avg {metrics['overload_avg']:.3f} "
            f"max {metrics['overload_max']:.3f}")
