"""--keyed-dropout (megatron/model/rng.py, philox.py): masks keyed by sample and position, drawn for a rank's part.

- Philox4x32-10 in int64 tensor ops gives Random123's known-answer vectors (on a tensor long enough for the
  vectorized kernels);
- a site that sees part r of t of a tensor (a tp rank's heads of the attention probabilities, its sequence rows under
  sequence parallelism, its columns of T5's inner feed-forward) draws exactly the whole mask's slice, and draws as
  many numbers as its part has elements, not the whole's;
- one sample's mask is the same at micro-batch 1 and 2 and on the data-parallel replica that holds it;
- the iteration, the layer and the site change the mask, and the kept fraction is 1 - p.
"""
from __future__ import annotations

import pytest
import torch

from megatron.model.philox import philox4x32
from megatron.model.rng import SeededDropout, start_iteration, use_keyed_masks

KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


@pytest.mark.parametrize("counter, key, want", KAT)
def test_philox_known_answers(counter, key, want):
    words = philox4x32([torch.full((67,), c, dtype=torch.int64) for c in counter], key)
    assert [set(w.tolist()) for w in words] == [{x} for x in want]


def _site(part=(0, 0, 1), p=0.1, module=3, site=0, iteration=5, replica=(0, 1)):
    drop = SeededDropout(p, 1234, module, site, part=part)
    use_keyed_masks(drop)
    start_iteration(drop, iteration, replica)
    return drop


def _masks(site, shape, calls):
    return [site.keep_mask(shape, torch.float32, "cpu") for _ in range(calls)]


@pytest.mark.parametrize("whole, dim", [((2, 4, 8, 8), 1), ((2, 16, 12), 1), ((2, 8, 24), 2), ((2, 8, 24), -1)])
def test_a_part_draws_its_slice_of_the_whole_and_only_its_numbers(whole, dim):
    one = _site()
    full = _masks(one, whole, 2)
    assert one.drawn == 2 * torch.Size(whole).numel()
    for t in (2, 4):
        size = whole[dim] // t
        shape = list(whole)
        shape[dim] = size
        for r in range(t):
            part = _site(part=(dim, r, t))
            got = _masks(part, shape, 2)
            assert part.drawn == 2 * torch.Size(shape).numel()
            for g, f in zip(got, full):
                assert torch.equal(g, f.narrow(dim, r * size, size)), (t, r)


def test_a_sample_has_one_mask_at_any_micro_batch_size_and_replica():
    per_sample = (4, 8, 8)
    two = torch.cat(_masks(_site(), (2, *per_sample), 2))  # samples 0..3 in micro-batches of 2
    one = torch.cat(_masks(_site(), (1, *per_sample), 4))  # the same samples one at a time
    assert torch.equal(one, two)
    for r in range(2):  # replica r of 2 holds micro-batches r, 2 + r of 1 sample
        held = _masks(_site(replica=(r, 2)), (1, *per_sample), 2)
        assert torch.equal(held[0][0], one[r]) and torch.equal(held[1][0], one[2 + r])


def test_iteration_layer_and_site_change_the_mask_and_p_is_kept():
    shape = (4, 64, 256)
    base = _masks(_site(), shape, 1)[0]
    for other in (_site(iteration=6), _site(module=4), _site(site=1)):
        assert not torch.equal(_masks(other, shape, 1)[0], base)
    assert abs((base == 0).float().mean().item() - 0.1) < 0.005
    assert set(base.unique().tolist()) == {0.0, torch.tensor(1 / 0.9, dtype=torch.float32).item()}
