"""Blending indices against a literal port of Megatron's helpers.cpp build_blending_indices."""
import numpy as np
import pytest

from megatron.data.blendable_dataset import BlendableDataset, build_blending_indices, parse_blend


def ref_blending_indices(weights, size):
    """helpers.cpp: for each sample pick argmax_d w_d * max(k, 1) - count_d (first on ties)."""
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    counts = np.zeros(len(weights), dtype=np.int64)
    dataset_index = np.zeros(size, dtype=np.int64)
    dataset_sample_index = np.zeros(size, dtype=np.int64)
    for k in range(size):
        kk = max(float(k), 1.0)
        best, best_err = 0, weights[0] * kk - float(counts[0])
        for d in range(1, len(weights)):
            err = weights[d] * kk - float(counts[d])
            if err > best_err:
                best, best_err = d, err
        dataset_index[k] = best
        dataset_sample_index[k] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


@pytest.mark.parametrize("weights", [[1.0], [0.5, 0.5], [0.3, 0.7], [3, 1, 1], [0.13, 0.2, 0.07, 0.6],
                                     [1, 0, 2], list(np.random.RandomState(0).rand(7))])
def test_matches_megatron_loop(weights):
    got_index, got_sample = build_blending_indices(weights, 3000)
    want_index, want_sample = ref_blending_indices(weights, 3000)
    np.testing.assert_array_equal(got_index, want_index)
    np.testing.assert_array_equal(got_sample, want_sample)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [5, 3, 2], [0.01, 0.49, 0.5]])
def test_every_prefix_hits_weights(weights):
    size = 20000
    dataset_index, dataset_sample_index = build_blending_indices(weights, size)
    w = np.asarray(weights) / np.sum(weights)
    one_hot = dataset_index[:, None] == np.arange(len(w))[None, :]  # (size, D)
    counts = np.cumsum(one_hot, axis=0)  # (size, D) samples per dataset in each prefix
    k = np.arange(1, size + 1)[:, None]
    assert np.abs(counts - w * k).max() <= 1.0 + 1e-9  # within one sample of the weights everywhere
    np.testing.assert_allclose(counts[-1] / size, w, rtol=0.01)
    for d in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == d], np.arange(counts[-1, d]))


def test_parse_blend():
    prefixes, weights, per_prefix = parse_blend(["2", "a", "6", " b "], [1000, 10, 0])
    assert prefixes == ["a", "b"] and weights == [0.25, 0.75]
    assert per_prefix == [[252, 3, 0], [754, 8, 0]]  # ceil(n * w * 1.005)
    with pytest.raises(ValueError, match="pairs"):
        parse_blend(["1", "a", "2"], [1, 1, 1])
    with pytest.raises(ValueError, match="positive sum"):
        parse_blend(["0", "a"], [1, 1, 1])


def test_blendable_dataset_reads_the_right_samples():
    datasets = [[("a", i) for i in range(40)], [("b", i) for i in range(70)]]
    blend = BlendableDataset(datasets, [4, 6], 100)
    assert len(blend) == 100
    samples = [blend[i] for i in range(100)]
    assert sum(name == "a" for name, _ in samples) == 40
    assert [i for name, i in samples if name == "b"] == list(range(60))


def test_blendable_dataset_too_small():
    with pytest.raises(ValueError, match="needs 60 from dataset 1"):
        BlendableDataset([list(range(100)), list(range(50))], [0.4, 0.6], 100)
