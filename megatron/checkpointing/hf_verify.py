"""export-hf --verify: load the exported folder with transformers and compare its logits with this project's
model (built at tp = 1 from the checkpoint) on random ids, fp32. Needs `transformers` (a test/optional
dependency). Ids and logits are compared in this project's numbering (`hf_tokenizer_files.sentinel_order`)."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron.errors import UserError
from .files import checkpoint_folder, read_args
from .hf_tokenizer_files import sentinel_order
from .names import model_config
from .weights import load_weights_into


def _ours(args: Dict, folder: str) -> torch.nn.Module:
    from megatron.model import GPTModel, T5Model
    model = (GPTModel if args["model_type"] == "gpt" else T5Model)(model_config(args))
    load_weights_into(model, folder, args)
    return model.float().eval()


@torch.no_grad()
def verify_export(load_dir: str, hf_dir: str, tag: Optional[str] = None, batch: int = 2, seq: int = 16) -> float:
    """Max |ours - HF| / max |ours| over the logits of `batch` random sequences."""
    try:
        import transformers
    except ImportError:
        raise UserError("export-hf --verify needs transformers (pip install transformers)") from None
    folder = checkpoint_folder(load_dir, tag)
    args = read_args(folder)
    ours, vocab = _ours(args, folder), args["vocab_size"]
    order = torch.tensor(sentinel_order(args, vocab) or list(range(vocab)))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    if args["model_type"] == "gpt":
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
        mine, theirs = ours(ids), hf(input_ids=order[ids]).logits
    else:
        hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).float().eval()
        dec = torch.randint(0, vocab, (batch, seq // 2), generator=g)
        q, k = dec.size(1), ids.size(1)
        causal = torch.triu(torch.ones(q, q, dtype=torch.bool), 1).expand(batch, 1, q, q)
        mine = ours(ids, dec, torch.zeros(batch, 1, k, k, dtype=torch.bool), causal,
                    torch.zeros(batch, 1, q, k, dtype=torch.bool))
        theirs = hf(input_ids=order[ids], decoder_input_ids=order[dec]).logits
    mine = mine[..., :vocab]
    theirs = theirs[..., order]
    return ((mine - theirs).abs().max() / mine.abs().max()).item()
