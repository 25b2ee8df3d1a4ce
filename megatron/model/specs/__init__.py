"""The model families, one spec each (base.ModelSpec lists what a spec answers): the registry every other part of
the project asks instead of branching on the model type.

    SPECS                  model_type -> spec: 'gpt' (gpt.py: GPT-2's layer and the Llama family's), 't5' (t5.py)
    spec_for(model_type)   the spec, or one line naming the types there are
    spec_of(config)        the spec whose configuration `config` is (a GPTConfig, a T5Config)

Importing this package imports no torch (the preflight and the planner read specs in about a second).
"""
from __future__ import annotations

from typing import Dict, Optional

from megatron.errors import UserError
from .base import ModelSpec
from .gpt import GPTSpec
from .t5 import T5Spec

SPECS: Dict[str, ModelSpec] = {spec.model_type: spec for spec in (GPTSpec(), T5Spec())}


def spec_for(model_type: Optional[str]) -> ModelSpec:
    if model_type not in SPECS:
        raise UserError(f"model_type {model_type!r} is not one this tool handles ({', '.join(SPECS)})")
    return SPECS[model_type]


def spec_of(config) -> ModelSpec:
    for spec in SPECS.values():
        if type(config) is spec.config_class:
            return spec
    raise UserError(f"{type(config).__name__} is no model family's configuration "
                    f"({', '.join(spec.config_class.__name__ for spec in SPECS.values())})")
