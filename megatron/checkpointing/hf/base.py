"""What a Hugging Face adapter answers: one transformers architecture <-> one of this project's model families.

    hf_model_type, architecture   config.json's model_type and architectures[0] ('gpt2', GPT2LMHeadModel)
    model_type                    the project spec it produces (megatron.model.specs: 'gpt', 't5')
    project_args(cfg, where)      config.json -> the saved arguments of the equivalent model (names as the
                                  project's flags); an option the model does not implement is one line naming the
                                  field and what is supported
    hf_config(config, rows, ids)  the project configuration (GPTConfig / T5Config) -> config.json
    rules(config)                 the tensor table, both ways: `Rule`s between canonical and HF names
    cannot_hold(config)           what config.json of this architecture cannot describe: the model fields that
                                  read back as another value (config -> hf_config -> project_args -> config)
    matches(args, config)         whether export-hf writes this checkpoint with this adapter: the architecture it
                                  was imported from (`hf_architecture`), else a `default` one that holds its model
    token_ids(tokenizer), model_max_length(config)     config.json's special ids, the tokenizer files' length
    logits(ours, hf_dir, ids, order, gen)              --verify: both models on the same random ids
                                                       (a causal LM here; T5 overrides it as seq2seq)

`FIELDS` maps the project's names (an argument and its config field alike) to config.json's keys, both ways;
`HF_DEFAULTS` are transformers' values for keys a config.json may leave out (what `from_pretrained` reads in their
place). The project's own defaults and derived sizes stay in its config (megatron.model.config). An adapter need
not check what it cannot export: whatever its config.json does not carry reads back otherwise, and export refuses
it naming the field (a layer option added later included); of the members of a family that hold the same layer,
one is the `default`.

Importing an adapter imports no torch (tools/plan_layout.py --hf-config reads config.json with it); the tensor
code (`Rule.split`, `logits`) runs on tensors it is given or imports torch where it runs.

A `Rule(canonical, hf, transpose, sizes, tied)`: the canonical full tensor is the concatenation along rows of the
HF tensors (each transposed first when `transpose`), so export splits (in proportion to `sizes`, equal parts by
default) and import concatenates; `tied` names the tensors import reads instead where the folder saved this one
tied to them (transformers 5 saves T5's head as the word table, and a mixture of experts' fused experts stand in for
the per-expert tensors); with `stack` E the canonical tensor is the concatenation viewed as (E, rows / E, cols), a
layer's experts stacked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from megatron.errors import UserError
from ..names import model_config


@dataclass(frozen=True)
class Rule:
    canonical: str
    hf: Tuple[str, ...]
    transpose: bool = False
    sizes: Optional[Tuple[int, ...]] = None  # relative row counts of the HF tensors (None: equal)
    tied: Tuple[str, ...] = ()                # read instead when `hf` is absent from the folder
    stack: int = 0                            # the canonical tensor is (stack, rows / stack, cols): stacked experts

    def split(self, full) -> tuple:
        """The canonical tensor cut into the HF tensors' rows."""
        if self.stack:
            full = full.reshape(-1, full.shape[-1])
        if self.sizes is None:
            return full.chunk(len(self.hf), dim=0)
        unit = full.size(0) // sum(self.sizes)
        return full.split([unit * s for s in self.sizes], dim=0)


def refuse(bad: List[str], where: str, supported: str = "") -> None:
    """One line naming every problem of `where` (nothing when `bad` is empty), and what is supported."""
    if bad:
        raise UserError(f"{where}: {'; '.join(bad)}" + (f" (supported: {supported})" if supported else ""))


class Adapter:
    hf_model_type: str = ""
    architecture: str = ""
    model_type: str = ""
    default: bool = True    # exports the checkpoints not imported from Hugging Face whose model it holds
    FIELDS: Dict[str, str] = {}
    HF_DEFAULTS: Dict[str, Any] = {}

    # ---- config.json <-> the project's arguments and configuration ---------------------------------------
    def project_args(self, cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
        raise NotImplementedError

    def hf_config(self, config, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        raise NotImplementedError

    def read_fields(self, cfg: Dict[str, Any]) -> Dict[str, Any]:
        """FIELDS read from config.json: {project name: value}, transformers' default where a key is absent."""
        return {name: cfg.get(key, self.HF_DEFAULTS.get(key)) for name, key in self.FIELDS.items()}

    def write_fields(self, config) -> Dict[str, Any]:
        """FIELDS written to config.json: {key: the configuration's value}."""
        return {key: getattr(config, name) for name, key in self.FIELDS.items()}

    def head(self, rows: int, ids: Dict[str, int]) -> Dict[str, Any]:
        """The keys every exported config.json starts with."""
        return {"architectures": [self.architecture], "model_type": self.hf_model_type, "vocab_size": rows, **ids}

    # ---- tensors -------------------------------------------------------------------------------------------
    def rules(self, config) -> List[Rule]:
        raise NotImplementedError

    # ---- which adapter exports a checkpoint ----------------------------------------------------------------
    def cannot_hold(self, config) -> List[str]:
        """What config.json of this architecture cannot describe of the model `config` (empty: it holds it): each
        shape or function field (weights.SHAPE_CONFIG_FIELDS, FUNCTION_CONFIG_FIELDS) whose value reads back
        otherwise, or the reader's own refusal."""
        from ..weights import FUNCTION_CONFIG_FIELDS, SHAPE_CONFIG_FIELDS
        try:
            args = self.project_args(self.hf_config(config, config.vocab_size, {}), f"{self.architecture} config.json")
        except UserError as err:
            return [str(err)]
        back = model_config(dict(args, vocab_size=config.vocab_size, seed=config.seed, checkpoint_num_layers=0,
                                 make_vocab_size_divisible_by=config.make_vocab_size_divisible_by))
        learned = getattr(config, "position_embedding_type", "learned_absolute") == "learned_absolute"
        fields = [f for f in SHAPE_CONFIG_FIELDS + FUNCTION_CONFIG_FIELDS
                  if f != "vocab_size" and (f != "max_position_embeddings" or learned)]
        return [f"{f} = {getattr(config, f, None)} (reads back as {getattr(back, f, None)})" for f in fields
                if getattr(config, f, None) != getattr(back, f, None)]

    def matches(self, args: Dict[str, Any], config) -> bool:
        if args.get("model_type") != self.model_type:
            return False
        imported = args.get("hf_architecture")
        return imported == self.architecture if imported else self.default and not self.cannot_hold(config)

    # ---- tokenizer and --verify ----------------------------------------------------------------------------
    def token_ids(self, tokenizer) -> Dict[str, int]:
        """config.json's special token ids from this project's tokenizer (a causal LM's: bos, eos)."""
        bos = getattr(tokenizer, "bos", None)
        return {"bos_token_id": tokenizer.eod if bos is None else bos, "eos_token_id": tokenizer.eod}

    def model_max_length(self, config) -> int:
        return config.max_position_embeddings

    def logits(self, ours, hf_dir: str, ids, order, gen) -> tuple:
        """(ours, transformers') logits (b, s, V) of random ids (b, s), fp32; transformers' ids in its numbering
        (`order`, tokenizer_files.sentinel_order)."""
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
        return ours(ids), hf(input_ids=order[ids]).logits
