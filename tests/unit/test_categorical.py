"""sample_categorical: draws follow the distribution (chi-square), never a token of
probability 0, one number per seeded row."""

from __future__ import annotations

import torch

from cluster.runner.categorical import sample_categorical
from tests.goodness_of_fit import chi2_quantile, chi2_statistic


def test_draws_follow_the_distribution_and_skip_zero_mass():
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0]) * 3.0  # unnormalized on purpose
    rows = probs.expand(40_000, -1).contiguous()
    ids = sample_categorical(rows, {}, batched=True)
    counts = torch.bincount(ids, minlength=probs.numel()).numpy()
    assert counts[[0, 2, 6]].sum() == 0
    statistic, df = chi2_statistic(counts, (probs / probs.sum()).numpy())
    assert statistic < chi2_quantile(0.999, df)


def test_a_uniform_of_one_lands_on_the_last_token_with_mass(monkeypatch):
    # Some devices' generators can return 1.0 (CUDA's have): the target must stay below the
    # total, or the search would land past the last token with mass.
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kwargs: torch.ones(*shape, device=kwargs.get("device")))
    assert sample_categorical(probs, {}, batched=True).tolist() == [1, 2]


def test_seeded_rows_draw_one_number_each_and_ignore_their_neighbours():
    probs = torch.rand(3, 50)
    first = sample_categorical(probs, {1: torch.Generator().manual_seed(7)}, batched=True)[1]
    other_rows = torch.rand(3, 50)
    other_rows[1] = probs[1]
    second = sample_categorical(other_rows, {1: torch.Generator().manual_seed(7)}, batched=True)[1]
    assert first == second
    generator = torch.Generator().manual_seed(7)
    sample_categorical(probs[1:2], {0: generator}, batched=False)
    expected = torch.Generator().manual_seed(7)
    torch.rand(1, generator=expected)
    assert torch.equal(generator.get_state(), expected.get_state())
