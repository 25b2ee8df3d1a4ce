"""The QKV row order a checkpoint was written in, told by the loss: the model under each candidate order on a few
sequences of a Megatron dataset (.bin/.idx, the source's tokenizer). The wrong orders mix queries, keys and
values across heads, which a trained model pays for in its loss; the plausible order is the lowest.

    qkv_losses(src, args, prefix)   {order: mean next-token loss} for every order the layer can be in
                                    (order '2' only with grouped-query attention)
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np
import torch
import torch.nn.functional as F

from megatron.errors import UserError
from .qkv import ORDERS
from .source import Source, canonical_weights
from ..names import model_config
from ..tp import resize_rows

SEQUENCES, MAX_LENGTH = 8, 128


def _sequences(prefix: str, vocab: int, length: int) -> torch.Tensor:
    """(n, length + 1) token ids: the dataset's first documents, concatenated and cut."""
    from megatron.data.indexed_dataset import MMapIndexedDataset
    data = MMapIndexedDataset(prefix, vocab_size=vocab)
    tokens, want = [], SEQUENCES * (length + 1)
    for i in range(len(data)):
        tokens.append(np.asarray(data[i], dtype=np.int64))
        if sum(len(t) for t in tokens) >= want:
            break
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int64)
    n = min(SEQUENCES, len(flat) // (length + 1))
    if n == 0:
        raise UserError(f"--data-path {prefix} holds {len(flat)} tokens, fewer than one sequence of {length + 1}")
    return torch.from_numpy(flat[:n * (length + 1)].reshape(n, length + 1))


@torch.no_grad()
def qkv_losses(src: Source, args: Dict[str, Any], prefix: str) -> Dict[str, float]:
    from megatron.model import GPTModel
    config = model_config(args)
    length = min(config.seq_length, MAX_LENGTH)
    batch = _sequences(prefix, args["vocab_size"], length)
    grouped = (args.get("num_query_groups") or args["num_attention_heads"]) != args["num_attention_heads"]
    model = GPTModel(config).eval()
    losses = {}
    for order in ("2",) if grouped else ORDERS:
        weights = canonical_weights(src, args, order)
        state = {k: resize_rows(v, model.state_dict()[k].size(0)) if k in ("embedding.word_embeddings.weight",
                                                                             "lm_head.weight") else v
                 for k, v in weights.items()}
        model.load_state_dict(state, strict=True)
        logits = model(batch[:, :-1]).float()[..., :args["vocab_size"]]
        losses[order] = float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)))
    return losses
