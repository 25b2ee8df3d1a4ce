"""What the layouts of one ranking share: each term computed once, for every layout that needs it.

A ranking scores every layout of a cluster (1,695 for Llama 3 8B on 2 x 8 GPUs), and most of a layout's
prediction depends on a few of its sizes only:

    term        what it is                                          depends on
    schedule    bubble, hops and send / receive instructions on     schedule, pp, gas, v (`speed._schedule_terms`:
                the critical path                                   timed simulations of the whole pipeline)
    order       a stage's compute units                             schedule, pp, stage, gas, v
    specs       the Pipe model's layer specs                        the model, tp
    partition   their boundaries over pp x v chunks                 the specs, pp x v, the method
    peak        a stage's activation peak (`memory._activation_     its compute order and its chunks' bytes
                peak`: a walk through its compute units)            (neither dp nor ZeRO enters them)

`SharedTerms` keeps them for one ranking (`search.rank_layouts` makes one; nothing outlives it) and counts how
many of each it computed (`computed`), which tests/planning/test_plan_golden.py bounds.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable

__all__ = ["SharedTerms"]


@dataclass
class SharedTerms:
    """The terms one ranking has computed, by (term, key), and how many of each."""
    values: Dict[Hashable, Any] = field(default_factory=dict)
    computed: Counter = field(default_factory=Counter)

    def get(self, term: str, key: Hashable, compute: Callable[[], Any]) -> Any:
        """`term` at `key`: `compute()` the first time, the same value after."""
        k = (term, key)
        if k not in self.values:
            self.computed[term] += 1
            self.values[k] = compute()
        return self.values[k]
