"""Vectorised GPT masks against a port of Megatron v2.6 utils.get_ltor_masks_and_position_ids (its loops)."""
import itertools

import pytest
import torch

from megatron.data.masks import get_ltor_masks_and_position_ids

EOD = 0


def ref_masks(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss):
    b, s = data.size()
    att_b = b if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_b, s, s))).view(att_b, 1, s, s)
    loss_mask = torch.ones(data.size(), dtype=torch.float)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long).unsqueeze(0).expand_as(data).clone()
    if reset_position_ids or reset_attention_mask:
        for row in range(b):
            eod_index = torch.arange(s)[data[row] == eod_token]
            prev_index = 0
            for i in eod_index.tolist():
                if reset_attention_mask:
                    attention_mask[row, 0, (i + 1):, :(i + 1)] = 0
                if reset_position_ids:
                    position_ids[row, (i + 1):] -= (i + 1 - prev_index)
                    prev_index = i + 1
    return attention_mask < 0.5, loss_mask, position_ids


@pytest.mark.parametrize("flags", list(itertools.product([False, True], repeat=3)))
def test_matches_megatron_loops(flags):
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 6, (4, 33), generator=gen)  # EOD = 0 about one token in six
    data[0, 0] = EOD
    data[1, -1] = EOD
    data[2] = 3  # a row without EOD
    got = list(get_ltor_masks_and_position_ids(data, EOD, *flags))
    want = ref_masks(data, EOD, *flags)
    if not flags[1]:  # no reset_attention_mask: no mask tensor (is_causal), where Megatron builds the causal one
        assert got[0] is None and torch.equal(want[0], torch.ones(1, 1, 33, 33, dtype=torch.bool).triu(1))
        got[0] = want[0]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


def test_convention_true_is_masked():
    data = torch.tensor([[5, 6, EOD, 7, 8]])
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(data, EOD, True, True, True)
    assert mask.shape == (1, 1, 5, 5) and mask.dtype == torch.bool
    assert not mask[0, 0, 2, 0] and mask[0, 0, 3, 2] and not mask[0, 0, 4, 3] and mask[0, 0, 0, 1]
    assert pos.tolist() == [[0, 1, 2, 0, 1]]
    assert loss_mask.tolist() == [[1, 1, 0, 1, 1]]
