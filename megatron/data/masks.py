"""Left-to-right (GPT) attention mask, loss mask and position ids, vectorised.

Shapes: b = micro-batch size, s = sequence length. Masks are bool with True = masked out.

With reset_attention_mask, query q may attend to key k only if k <= q and no EOD token lies in [k, q-1]
(each document attends only within itself; the EOD belongs to the document it ends). Without it the mask is
plain causal and is not built at all (None): attention runs with `is_causal=True`, which admits the flash
kernel, and no (s, s) tensor crosses a pipeline boundary. With reset_position_ids, positions restart at 0
after every EOD.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool
                                    ) -> Tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(attention_mask bool (b, 1, s, s) or None, loss_mask float (b, s), position_ids int64 (b, s)) for data (b, s).

    The mask exists only with reset_attention_mask (True = masked out); None means plain causal attention.
    """
    b, s = data.shape
    is_eod = data == eod_token  # (b, s)
    positions = torch.arange(s, device=data.device)  # (s,)
    attention_mask = None  # causal: is_causal=True in attention
    if reset_attention_mask:
        causal_masked = positions[None, :] > positions[:, None]  # (s, s): key after query
        doc_id = _eods_before(is_eod)  # (b, s)
        attention_mask = causal_masked[None] | (doc_id[:, :, None] != doc_id[:, None, :])  # (b, s, s)
        attention_mask = attention_mask[:, None]  # (b, 1, s, s)

    loss_mask = torch.ones((b, s), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0

    if reset_position_ids:
        # doc_start[t] = 1 + index of the last EOD before t (0 if none); position = t - doc_start[t].
        after_eod = torch.zeros_like(data)
        after_eod[:, 1:] = torch.where(is_eod[:, :-1], positions[1:], 0)
        doc_start = torch.cummax(after_eod, dim=1).values  # (b, s)
        position_ids = positions[None, :] - doc_start
    else:
        position_ids = positions[None, :].expand(b, s).clone()
    return attention_mask, loss_mask, position_ids.long()


def _eods_before(is_eod: torch.Tensor) -> torch.Tensor:
    """(b, s) number of EOD tokens strictly before each position."""
    counts = torch.cumsum(is_eod.long(), dim=1)
    return counts - is_eod.long()
