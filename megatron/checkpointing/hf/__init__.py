"""Hugging Face transformers folders <-> this project's checkpoints: one adapter file per architecture, one table.

    base             what an adapter answers (`Adapter`), the tensor `Rule`
    gpt2, t5, llama  the adapters: GPT2LMHeadModel, T5ForConditionalGeneration, the Llama family (Llama, Mistral,
                     Qwen2)
    qwen3            Qwen3ForCausalLM: the Llama family's layer with --qk-layernorm
    olmo2            Olmo2ForCausalLM: the Llama family's layer with --qk-layernorm-full --post-sublayer-norm
    moe              MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM: the family's
                     layer with experts
    ADAPTERS         config.json's model_type -> its adapter: the one table import-hf, export-hf, --verify and
                     tools/plan_layout.py --hf-config read
    adapter_for(cfg, where)   the adapter of a config.json; `exporter(args, config)` the one exporting a checkpoint
    convert          import_hf / export_hf: the drivers (weights, vocabulary rows, tokenizer files, atomic outputs)
    verify           export-hf --verify: transformers' logits against this project's model
    tokenizer_files  the tokenizer files each way (shared by every adapter)

Importing this package (the table and the adapters) imports no torch; `import_hf`, `export_hf`, `load_hf_state`
and `verify_export` import with their first use.
"""
from __future__ import annotations

from typing import Any, Dict

from megatron.errors import UserError
from tds.lazy import lazy_exports
from .base import Adapter
from .gpt2 import GPT2
from .llama import Llama, Mistral, Qwen2
from .moe import Mixtral, Olmoe, Qwen2Moe, Qwen3Moe
from .olmo2 import Olmo2
from .qwen3 import Qwen3
from .t5 import T5

ADAPTERS: Dict[str, Adapter] = {a.hf_model_type: a for a in (GPT2(), T5(), Llama(), Mistral(), Qwen2(), Qwen3(),
                                                               Olmo2(), Mixtral(), Qwen2Moe(),
                                                               Qwen3Moe(), Olmoe())}

__getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(("IMPORT_TAG", "export_hf", "import_hf", "load_hf_state"), "megatron.checkpointing.hf.convert"),
    "verify_export": "megatron.checkpointing.hf.verify"})


def adapter_for(cfg: Dict[str, Any], where: str, tool: str = "import-hf") -> Adapter:
    """The adapter of config.json `cfg` (read from `where`), or one line naming the model types there are."""
    kind = cfg.get("model_type")
    if kind not in ADAPTERS:
        raise UserError(f"{tool} handles model_type {', '.join(map(repr, ADAPTERS))}; {where} has model_type "
                        f"{kind!r}")
    return ADAPTERS[kind]


def exporter(args: Dict[str, Any], config) -> Adapter:
    """The adapter that writes a checkpoint (its saved `args`, its model's `config`): the architecture it was imported
    from, else the one default adapter that holds its model; one line saying why when there is none."""
    found = [a for a in ADAPTERS.values() if a.matches(args, config)]
    imported, kind = args.get("hf_architecture"), args.get("model_type")
    if len(found) > 1:  # two default adapters holding one model: the adapters' mistake, not the user's
        raise AssertionError(f"{', '.join(a.architecture for a in found)} all hold this {kind} model; one is default")
    if not found and imported:
        raise UserError(f"export-hf: the checkpoint was imported from {imported}, which no adapter in "
                        f"megatron/checkpointing/hf/ writes ({', '.join(a.architecture for a in ADAPTERS.values())})")
    if not found:
        why = [f"{a.architecture}: {'; '.join(a.cannot_hold(config))}" for a in ADAPTERS.values()
               if a.model_type == kind and a.default]
        raise UserError(f"export-hf: no Hugging Face architecture holds this {kind} model ({' | '.join(why)})")
    return found[0]
