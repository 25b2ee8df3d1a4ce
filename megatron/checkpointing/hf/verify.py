"""export-hf --verify: load the exported folder with transformers and compare its logits with this project's
model (built at tp = 1 from the checkpoint) on random ids, fp32. Needs `transformers` (a test/optional
dependency). How both models run (a causal LM, or seq2seq with decoder ids) is the adapter's `logits`; ids and
logits are compared in this project's numbering (`tokenizer_files.sentinel_order`)."""
from __future__ import annotations

from typing import Optional

import torch

from megatron.errors import UserError
from megatron.model.specs import spec_for
from ..files import checkpoint_folder, read_args
from ..names import model_config
from ..weights import load_weights_into
from . import exporter
from .tokenizer_files import sentinel_order


@torch.no_grad()
def verify_export(load_dir: str, hf_dir: str, tag: Optional[str] = None, batch: int = 2, seq: int = 16) -> float:
    """Max |ours - HF| / max |ours| over the logits (b, s, V) of `batch` random sequences of `seq` ids."""
    try:
        import transformers  # noqa: F401 (the adapter loads the folder with it)
    except ImportError:
        raise UserError("export-hf --verify needs transformers (pip install transformers)") from None
    folder = checkpoint_folder(load_dir, tag)
    args = read_args(folder)
    config = model_config(args)
    ours = spec_for(args["model_type"]).plain(config)
    load_weights_into(ours, folder, args)
    ours, vocab = ours.float().eval(), args["vocab_size"]
    order = torch.tensor(sentinel_order(args, vocab) or list(range(vocab)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mine, theirs = exporter(args, config).logits(ours, hf_dir, ids, order, g)
    mine = mine[..., :vocab]
    theirs = theirs[..., order]
    return ((mine - theirs).abs().max() / mine.abs().max()).item()
