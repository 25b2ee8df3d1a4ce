"""Inference from checkpoints of this project: text generation and Megatron's zero-shot tasks.

    loading     checkpoint -> model (any saved layout, run at tp x dp, pp = 1) and tokenizer
    parallel    the tp x dp process layout of the tools
    prompts     prompt files, T5 sentinels, left / right padding
    kv_cache    per-layer key-value caches (self-attention, T5 cross-attention)
    runners     next-token logits step by step, with the cache or recomputing (GPT-2 and T5)
    sampling    greedy / temperature / top-k / top-p from the gathered full-vocabulary logits
    generate    batches of prompts -> completions (stop at eod, stop strings, length limits)
    lm_ppl      perplexity with overlapping windows, adjusted word-level perplexity (WikiText-103)
    lambada     last-word accuracy (LAMBADA), Megatron's default and strict targets
    detokenize  WikiText's detokenizer
    progress    a progress line on stderr

The tools `tools/generate.py` and `tools/evaluate.py` only parse flags and call these.
"""
from .generate import Completion, GenerationParams, generate  # noqa: F401
from .kv_cache import KVCache, LayerCache, StaticKV  # noqa: F401
from .lambada import evaluate_lambada, read_lambada  # noqa: F401
from .lm_ppl import evaluate_lm, read_lm_text  # noqa: F401
from .parallel import Parallel  # noqa: F401
from .runners import GPT2Runner, T5Runner, make_runner  # noqa: F401
from .sampling import Sampling  # noqa: F401
