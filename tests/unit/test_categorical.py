"""sample_categorical: draws follow the distribution (chi-square), never a token of
probability 0, and a row's token depends on its own distribution and number alone."""

from __future__ import annotations

import torch

from cluster.runner.categorical import sample_categorical, sample_race
from tests.goodness_of_fit import chi2_quantile, chi2_statistic


def test_draws_follow_the_distribution_and_skip_zero_mass():
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0]) * 3.0  # unnormalized on purpose
    rows = probs.expand(40_000, -1).contiguous()
    ids = sample_categorical(rows, torch.rand(rows.shape[0]))
    counts = torch.bincount(ids, minlength=probs.numel()).numpy()
    assert counts[[0, 2, 6]].sum() == 0
    statistic, df = chi2_statistic(counts, (probs / probs.sum()).numpy())
    assert statistic < chi2_quantile(0.999, df)


def test_a_uniform_of_one_lands_on_the_last_token_with_mass():
    # Some devices' generators can return 1.0 (CUDA's have): the target must stay below the
    # total, or the search would land past the last token with mass.
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    assert sample_categorical(probs, torch.ones(2)).tolist() == [1, 2]
    assert sample_categorical(probs, torch.zeros(2)).tolist() == [0, 2]


def test_a_row_depends_on_its_own_distribution_and_number_only():
    torch.manual_seed(1)
    probs = torch.rand(3, 50)
    uniforms = torch.tensor([0.1, 0.62, 0.9])
    first = sample_categorical(probs, uniforms)[1]
    other_rows = torch.rand(3, 50)
    other_rows[1] = probs[1]
    assert sample_categorical(other_rows, torch.tensor([0.5, 0.62, 0.2]))[1] == first
    # the inverse CDF: the first token whose running sum exceeds u * total
    cdf = probs[1].cumsum(0)
    assert first == int((cdf <= 0.62 * cdf[-1]).sum())


def test_race_draws_follow_the_distribution_and_skip_zero_mass():
    torch.manual_seed(2)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0]) * 3.0
    rows = probs.expand(40_000, -1).contiguous()
    ids = sample_race(rows, torch.empty_like(rows).exponential_())
    counts = torch.bincount(ids, minlength=probs.numel()).numpy()
    assert counts[[0, 2, 6]].sum() == 0
    statistic, df = chi2_statistic(counts, (probs / probs.sum()).numpy())
    assert statistic < chi2_quantile(0.999, df)
