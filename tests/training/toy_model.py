"""A tiny language model (embedding -> residual tanh blocks with dropout -> linear head) as a Pipe model,
for exercising the training driver without the real GPT-2: same data path, loss and batch layout.

Module k is built under torch.manual_seed(seed + k), so every layout starts from the same weights.
Shapes: b = micro-batch, s = sequence, h = hidden, V = padded vocabulary.
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn

import tds
from megatron import mpu
from megatron.data.masks import get_ltor_masks_and_position_ids
from megatron.model.specs.gpt import GPTSpec


def _seeded(seed: int, build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class ToyEmbed(nn.Module):
    def __init__(self, vocab: int, h: int, seed: int):
        super().__init__()
        self.emb = _seeded(seed, lambda: nn.Embedding(vocab, h))

    def forward(self, inputs):
        tokens = inputs[0] if isinstance(inputs, tuple) else inputs  # (b, s)
        return self.emb(tokens)  # (b, s, h)


class ToyBlock(nn.Module):
    def __init__(self, h: int, dropout: float, seed: int):
        super().__init__()
        self.linear = _seeded(seed, lambda: nn.Linear(h, h))
        self.dropout = dropout

    def forward(self, x):  # (b, s, h)
        return x + F.dropout(torch.tanh(self.linear(x)), self.dropout, self.training)


class ToyHead(nn.Module):
    def __init__(self, h: int, vocab: int, seed: int):
        super().__init__()
        self.out = _seeded(seed, lambda: nn.Linear(h, vocab))

    def forward(self, x):
        return self.out(x)  # (b, s, V)


def toy_loss(logits, labels):
    labels, loss_mask = labels  # (b, s), (b, s)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * loss_mask.reshape(-1)).sum() / loss_mask.sum()


def _specs(args):
    V, h, seed = args.padded_vocab_size, args.hidden_size, args.seed
    return ([tds.pipe.LayerSpec(ToyEmbed, V, h, seed)]
            + [tds.pipe.LayerSpec(ToyBlock, h, args.hidden_dropout, seed + 1 + i) for i in range(args.num_layers)]
            + [tds.pipe.LayerSpec(ToyHead, h, V, seed + 1 + args.num_layers)])


def toy_pipe(config, parallel_state=None, **_):
    state = parallel_state if parallel_state is not None else mpu.get_parallel_state()
    return tds.pipe.PipelineModule(_specs(config), grid=state.grid(), loss_fn=toy_loss,
                                   partition_method="uniform", input_grad=[True], input_type=["float"])


def toy_get_batch(raw, args, tokenizer, tp_group=None):
    data = mpu.broadcast_data(["text"], raw, torch.int64, tp_group)["text"]  # (b, s + 1)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    _, loss_mask, _ = get_ltor_masks_and_position_ids(tokens, tokenizer.eod, False, False, args.eod_mask_loss)
    return (tokens,), (labels, loss_mask)


def toy_config(args) -> argparse.Namespace:
    """The arguments, with the fields a GPTConfig resolves that the loop reads (the FLOP count's key/value heads,
    --compile)."""
    return argparse.Namespace(**{**vars(args), "num_query_groups": args.num_query_groups or args.num_attention_heads,
                                 "compile_layers": False})


class ToySpec(GPTSpec):
    """GPT's data and FLOP count, the toy model."""
    model_type = "toy"

    def config(self, args) -> argparse.Namespace:
        return toy_config(args)

    @property
    def plain(self) -> type:
        raise NotImplementedError("the toy model is a Pipe model only")

    def pipe(self, *args, **kwargs):
        return toy_pipe(*args, **kwargs)

    def get_batch(self, raw, data, tokenizer, tp_group=None):
        return toy_get_batch(raw, data, tokenizer, tp_group)


TOY_SPEC = ToySpec()
