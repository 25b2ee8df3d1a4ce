"""Text generation: batches of prompts through a runner, one token per step, until each row stops.

Shape legend: b prompts in a batch, V real vocabulary, V_r this tp rank's slice.

A row stops at the end-of-document id (GPT-2 `eod`, T5 `eos`), when its completion contains a `stop`
string (cut before it), or at its length limit: max_new_tokens, and for GPT-2 the model's positions
(prompt + completion <= max_position_embeddings); T5's decoder goes up to its decoder_seq_length.
Finished rows keep feeding the pad id until the whole batch is done; their output ignores it.

Parallelism: every tp rank runs the same steps on its slice of the model; the tokens chosen from the
gathered logits are broadcast from tp rank 0 so the ranks can never drift apart. With data parallelism
(world = tp x dp) batch k goes to data-parallel rank k % dp and the completions are gathered everywhere.
Prompts are sorted by length before batching (less padding); results come back in the input order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron.errors import UserError
from .parallel import Parallel
from .prompts import encode_gpt2, encode_t5
from .runners import make_runner
from .sampling import Sampling, draw_uniforms, gather_vocab, row_generators, sample


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int = 64
    sampling: Sampling = Sampling()
    seed: int = 1234
    stop: Sequence[str] = ()
    batch_size: int = 8
    use_cache: bool = True


@dataclass
class Completion:
    index: int
    prompt: str
    prompt_ids: List[int]
    ids: List[int] = field(default_factory=list)
    text: str = ""
    finish: str = "length"  # 'eod' | 'stop' | 'length'
    seconds: float = 0.0  # wall time of its batch

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.seconds if self.seconds > 0 else 0.0

    def record(self) -> dict:
        return dict(prompt=self.prompt, completion=self.text, prompt_tokens=len(self.prompt_ids),
                    completion_tokens=len(self.ids), finish=self.finish, seconds=round(self.seconds, 4),
                    tokens_per_s=round(self.tokens_per_s, 2))


def is_t5(config) -> bool:
    """T5Config (encoder-decoder) rather than GPTConfig."""
    return hasattr(config, "num_decoder_layers")


def encode_prompts(config, tokenizer, prompts: Sequence[str]) -> List[List[int]]:
    """Token ids of each prompt for a model of this config; UserError for one that leaves no room to
    generate (the tools call it before loading weights)."""
    if is_t5(config):
        ids = [encode_t5(p, tokenizer) for p in prompts]
        limit = config.seq_length
        what = f"the encoder takes at most {limit} (its encoder_seq_length)"
    else:
        ids = [encode_gpt2(p, tokenizer) for p in prompts]
        limit = config.max_position_embeddings - 1
        what = (f"the model has {limit + 1} positions (max_position_embeddings), so at most {limit} "
                f"leave room to generate")
    for n, (p, row) in enumerate(zip(prompts, ids)):
        if len(row) > limit:
            raise UserError(f"prompt {n} has {len(row)} tokens but {what}; shorten it: {p[:40]!r}...")
    return ids


def _row_limits(config, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> List[int]:
    if is_t5(config):
        return [min(max_new_tokens, config.decoder_seq_length)] * len(prompt_ids)
    positions = config.max_position_embeddings
    return [min(max_new_tokens, positions - len(row)) for row in prompt_ids]


def _end_id(config, tokenizer) -> int:
    return tokenizer.eos if is_t5(config) else tokenizer.eod


def _check_stop(c: Completion, tokenizer, stop: Sequence[str]) -> bool:
    """True (and the text cut) if the completion's text contains a stop string."""
    text = tokenizer.detokenize(c.ids)
    cuts = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if cuts:
        c.text, c.finish = text[:min(cuts)], "stop"
        return True
    return False


def _take(c: Completion, token: int, end_id: int, limit: int, tokenizer, stop: Sequence[str]) -> bool:
    """Add one generated token to a completion; True when the completion is finished."""
    if token == end_id:
        c.finish = "eod"
        return True
    c.ids.append(token)
    return (bool(stop) and _check_stop(c, tokenizer, stop)) or len(c.ids) >= limit


def _broadcast_tp(tokens: torch.Tensor, par: Parallel) -> torch.Tensor:
    if par.tp_size > 1:
        dist.broadcast(tokens, src=dist.get_global_rank(par.tp_group, 0), group=par.tp_group)
    return tokens


@torch.no_grad()
def generate_batch(model, tokenizer, batch: List[Completion], params: GenerationParams,
                   par: Parallel) -> None:
    """Fill in the completions of one batch (every tp rank of a replica calls it with the same batch)."""
    start = time.perf_counter()
    end_id, vocab = _end_id(model.config, tokenizer), model.config.vocab_size
    limits = _row_limits(model.config, [c.prompt_ids for c in batch], params.max_new_tokens)
    runner = make_runner(model, [c.prompt_ids for c in batch], max(limits), tokenizer.pad, params.use_cache)
    greedy = params.sampling.greedy
    generators = None if greedy else row_generators(params.seed, [c.index for c in batch])
    done = [limit <= 0 for limit in limits]
    logits = runner.first()  # (b, V_r)
    while not all(done):
        full = gather_vocab(logits, vocab, par.tp_group)  # (b, V)
        uniforms = None if greedy else draw_uniforms(generators)
        ids = _broadcast_tp(sample(full, params.sampling, uniforms).to(logits.device), par).tolist()
        for i, c in enumerate(batch):
            done[i] = done[i] or _take(c, ids[i], end_id, limits[i], tokenizer, params.stop)
        if all(done):
            break
        fed = [tokenizer.pad if d else t for d, t in zip(done, ids)]
        logits = runner.next(torch.tensor(fed, dtype=torch.long, device=logits.device))
    seconds = time.perf_counter() - start
    for c in batch:
        c.seconds = seconds
        if c.finish != "stop":
            c.text = tokenizer.detokenize(c.ids)


def batches_of(completions: List[Completion], batch_size: int) -> List[List[Completion]]:
    """Longest prompts first, `batch_size` at a time."""
    ordered = sorted(completions, key=lambda c: (-len(c.prompt_ids), c.index))
    return [ordered[k:k + batch_size] for k in range(0, len(ordered), batch_size)]


def generate(model, tokenizer, prompts: Sequence[str], params: GenerationParams,
             par: Optional[Parallel] = None, progress=None) -> List[Completion]:
    """Completions of `prompts`, in order, on every rank. `model` in eval mode, pp = 1."""
    par = par or Parallel.single()
    if params.max_new_tokens < 1 or params.batch_size < 1:
        raise UserError(f"--max-new-tokens ({params.max_new_tokens}) and --batch-size ({params.batch_size}) "
                        f"must be >= 1")
    ids = encode_prompts(model.config, tokenizer, prompts)
    completions = [Completion(n, p, row) for n, (p, row) in enumerate(zip(prompts, ids))]
    mine = []
    for k, batch in enumerate(batches_of(completions, params.batch_size)):
        if k % par.dp_size == par.dp_rank:
            generate_batch(model, tokenizer, batch, params, par)
            mine.extend(batch)
            if progress is not None:
                progress.update(len(batch) * par.dp_size)
    by_index = {c.index: c for c in par.all_gather_objects(mine)}  # tp ranks of a replica agree
    return [by_index[n] for n in range(len(completions))]
