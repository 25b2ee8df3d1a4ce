"""What every model family's spec answers: the one place a model is described (torchtitan's `ModelSpec`, Megatron
core's `TransformerConfig` with layer specs). Everything outside the spec asks it; nothing else branches on the
model type.

    configuration   spec.config(args) -> the typed, torch-free configuration (`config_class`, validated once
                    in its __post_init__); spec.resolve(args) fills the family's defaults and checks its flags
                    (the command line's one `error:` line); spec.refuse_options(args, script) refuses this
                    family's options given to another family's script
    building        spec.plain(config, tp_group) the plain model; spec.build_pipe(cfg, state) the Pipe model of a
                    RunConfig; spec.pipe_layer_specs(config) its layer specs; spec.pipe_spec_count(args) their
                    number before anything is built; spec.pipe_layer_classes their class names
    data            spec.datasets(data, tokenizer, counts); spec.get_batch(raw, data, tokenizer, tp_group);
                    spec.synthetic_raw(b, data, vocab, gen) a random micro-batch (--log-memory)
    sizes           spec.transformer_layers(args); spec.sequence_flags (what sequence parallelism splits);
                    spec.tokens_per_sample(data); spec.decoder_length(data); spec.flops(config, batch, vocab)
    planner terms   spec.pipe_layers(config, tp) the layer specs with their parameters on one tp rank;
                    spec.saved_bytes(layer, config, options) what one micro-batch leaves saved for backward;
                    spec.chunk_bytes, spec.core_mask_bytes, spec.layer_cache_bytes, spec.linear_widths (the
                    family's other memory terms); spec.boundary_tokens / spec.output_length (what crosses a stage,
                    what the head sees); spec.tensor_parallel_sizes; spec.core_flops (megatron.planning asks these;
                    the records they use: specs/memory.py)
    checkpoints     spec.locations(config): canonical name -> (pipeline layer, name in its file)
    tools           spec.example_script(args); spec.zero_shot (lm-ppl and LAMBADA apply);
                    spec.completion(prompt, text) how generate.py prints one

A family is one file (gpt.py, t5.py) holding a subclass; `megatron.model.specs.SPECS` is the registry.
"""
from __future__ import annotations

import argparse
import re
from typing import Any, Callable, List, Optional, Sequence, Set, Tuple

from .memory import ActivationOptions, LinearWidths, PipeLayer

Location = List[Tuple[str, Callable[[re.Match], Tuple[int, str]]]]


class ModelSpec:
    model_type: str = ""                    # what megatron_args.json stores: 'gpt', 't5'
    entry_script: str = ""                  # pretrain_gpt2.py, pretrain_t5.py
    config_class: type = object
    pipe_layer_classes: Tuple[str, ...] = ()
    sequence_flags: Tuple[str, ...] = ()    # the sequence lengths sequence parallelism splits over tp
    zero_shot: bool = False
    reference_vocab_size: int = 0           # the family's reference tokenizer (the planner's default vocabulary)

    # ---- configuration ---------------------------------------------------------------------------------------
    def resolve(self, args: argparse.Namespace) -> None:
        """Fill the family's defaults in resolved arguments and check its flags (UserError, one line)."""
        raise NotImplementedError

    def refuse_options(self, args: argparse.Namespace, script: str) -> None:
        """One line naming this family's options where another family's `script` was given them."""
        raise NotImplementedError

    def config(self, args: Any):
        """The typed configuration of resolved arguments (or a record of them)."""
        raise NotImplementedError

    # ---- building --------------------------------------------------------------------------------------------
    @property
    def plain(self) -> type:
        raise NotImplementedError

    def pipe(self, *args, **kwargs):
        raise NotImplementedError

    def pipe_layer_specs(self, config) -> list:
        raise NotImplementedError

    def pipe_spec_count(self, args: argparse.Namespace) -> int:
        raise NotImplementedError

    def build_pipe(self, cfg, parallel_state=None):
        """This rank's stage(s) of the Pipe model of RunConfig `cfg`, split over its pipeline stages, over
        `parallel_state`'s groups (default: mpu's current state); --compile compiles its transformer layers."""
        method = cfg.layout.partition_method
        pipe = self.pipe(cfg.model, parallel_state=parallel_state,
                         partition_method=list(method) if isinstance(method, tuple) else method or "type:TransformerLayer",
                         verbose=cfg.logging.deepspeed_verbose or None,  # None: tds default (env TDS_VERBOSE)
                         virtual_stages=cfg.layout.virtual_pipe_stages,
                         sequence_parallel=cfg.layout.sequence_parallel)
        if cfg.model.compile_layers:  # --compile, applied from outside the model (megatron.model.compile)
            from megatron.logging_utils import print_rank_0
            from megatron.model.compile import compile_layers
            print_rank_0(compile_layers(pipe, cfg.layout.pipeline_schedule))
        from tds import device as tds_device
        if getattr(cfg.model, "keyed_dropout", False):  # (a spec's own config may not have the field)
            from megatron.model.rng import use_keyed_masks
            use_keyed_masks(pipe)
        explicit = getattr(cfg.model, "explicit_attention", False)
        if explicit and cfg.model.attention_dropout > 0 and tds_device.device().type != "cpu":
            from megatron.logging_utils import print_rank_0
            print_rank_0("--layout-invariant: attention with dropout runs its explicit form, not SDPA's fused kernels "
                         "(they draw their own dropout masks)")
        return pipe

    # ---- data ------------------------------------------------------------------------------------------------
    def datasets(self, data, tokenizer, num_samples: List[int]) -> list:
        raise NotImplementedError

    def get_batch(self, raw: Optional[dict], data, tokenizer, tp_group=None) -> tuple:
        raise NotImplementedError

    def synthetic_raw(self, b: int, data, vocab: int, gen) -> dict:
        raise NotImplementedError

    # ---- sizes -----------------------------------------------------------------------------------------------
    def transformer_layers(self, args) -> int:
        raise NotImplementedError

    def tokens_per_sample(self, data) -> int:
        raise NotImplementedError

    def decoder_length(self, data) -> int:
        """The sequence length of the stack that feeds the LM head."""
        raise NotImplementedError

    def flops(self, config, global_batch_size: int, padded_vocab_size: int, recompute: Optional[bool] = None
              ) -> float:
        """Model FLOPs of one iteration (megatron.model.flops); `recompute` None: the config's full recomputation."""
        raise NotImplementedError

    def core_flops(self, config, global_batch_size: int) -> int:
        """Forward FLOPs of the attention cores of one iteration: what selective recomputation runs again."""
        raise NotImplementedError

    # ---- planner terms (megatron.planning) -------------------------------------------------------------------
    def pipe_layers(self, config, tp: int) -> List[PipeLayer]:
        """The Pipe model's layer specs in order (`pipe_layer_specs`), with their parameters on one tp rank."""
        raise NotImplementedError

    def saved_bytes(self, layer: PipeLayer, config, o: ActivationOptions) -> float:
        """Bytes one micro-batch leaves saved for backward in `layer` (without full recomputation)."""
        raise NotImplementedError

    def chunk_bytes(self, kinds: Set[str], config, o: ActivationOptions) -> float:
        """Bytes a pipeline chunk holding layers of `kinds` keeps once per micro-batch beside its layers' own."""
        return 0.0

    def core_mask_bytes(self, layer: PipeLayer, config, o: ActivationOptions) -> float:
        """Selective recomputation at tp > 1: the whole fp32 attention dropout mask a rank draws while `layer`'s
        core is recomputed, before it keeps its own heads (megatron/model/rng.py); 0 without one."""
        return 0.0

    def layer_cache_bytes(self, config, element_bytes: int) -> int:
        """Bytes each transformer layer caches from its first forward on, held like the weights."""
        return 0

    def linear_widths(self, config) -> LinearWidths:
        raise NotImplementedError

    def boundary_tokens(self, config) -> int:
        """Positions of one sample whose hidden states a pipeline stage sends on."""
        raise NotImplementedError

    def output_length(self, config) -> int:
        """The sequence length of the stack that feeds the LM head (`decoder_length` of a configuration)."""
        raise NotImplementedError

    def tensor_parallel_sizes(self, config) -> Tuple[int, ...]:
        """The sizes tensor parallelism splits, each of which tp must divide."""
        return (config.num_attention_heads, config.ffn_hidden_size)

    # ---- checkpoints and tools -------------------------------------------------------------------------------
    def locations(self, config) -> Location:
        raise NotImplementedError

    def example_script(self, args: dict) -> str:
        raise NotImplementedError

    def completion(self, prompt: str, text: str) -> str:
        raise NotImplementedError


def given(args: argparse.Namespace, names: Sequence[str]) -> List[str]:
    """The flags of `names` that `args` holds a value for (not None, not False)."""
    from megatron.errors import flag_name
    return [flag_name(n) for n in names if getattr(args, n, None) not in (None, False)]
