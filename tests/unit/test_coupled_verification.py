"""Coupled verification: exact output distribution, the acceptance it should have, plain sampling's tokens.

Every row has its own seed; a draft model's drafts are drawn as the engine draws them under
coupling (the draft's distribution with the SAMPLE numbers of their position, by the inverse
CDF or by an exponential race). The reference for each emitted token is the target
distribution at its position (chi-square at p = 0.001); the acceptance of the first draft is
compared (z-test at p = 0.001) with its exact value: ``t(x)`` for a point mass; for a draft
model, the overlap of the two distributions' CDF intervals (inverse CDF), or
``sum_i 1 / sum_j max(t_j / t_i, d_j / d_i)`` (race: both pick i when every other token's
exponential exceeds both thresholds).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cluster.runner.random_stream import Lane, SeedKey, draw_seeded
from cluster.runner.rejection import rejection_sample
from tests.goodness_of_fit import chi2_quantile, chi2_statistic

VOCAB = 6
NUM_ROWS = 20_000
K = 3


def _distributions() -> tuple[torch.Tensor, torch.Tensor]:  # target [K + 1, VOCAB], draft [K, VOCAB]
    generator = torch.Generator().manual_seed(11)
    target_logits = torch.randn(K + 1, VOCAB, generator=generator)
    draft_logits = target_logits[:K] + 1.2 * torch.randn(K, VOCAB, generator=generator)
    target = target_logits.softmax(-1)
    target[2, target[2].argmin()] = 0.0  # a token the target never emits, as after top-p
    return target / target.sum(-1, keepdim=True), draft_logits.softmax(-1)


def _draws(probs: torch.Tensor, num_rows: int, position: int, race: bool) -> torch.Tensor:  # [num_rows]
    """Row r's draw from ``probs`` with seed r's SAMPLE numbers at ``position``."""
    keys = [SeedKey(row, position) for row in range(num_rows)]
    return draw_seeded(probs[None].expand(num_rows, VOCAB).contiguous(), keys, Lane.SAMPLE, race)


def _coupled(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target: torch.Tensor, race: bool = False):
    num_rows = draft_ids.shape[0]
    return rejection_sample(
        draft_ids.tolist(), None if draft_probs is None else draft_probs.repeat(num_rows, 1),
        target.repeat(num_rows, 1), torch.zeros(num_rows, dtype=torch.bool),
        {row: SeedKey(row, 0) for row in range(num_rows)}, coupled=True, race=race,
    )


def _assert_fits(tokens: list[int], probs: torch.Tensor) -> None:
    counts = np.bincount(np.array(tokens), minlength=VOCAB)
    assert counts[(probs == 0).numpy()].sum() == 0, "emitted a token of probability 0"
    support = (probs > 0).numpy()
    statistic, df = chi2_statistic(counts[support], probs.numpy()[support] / probs.numpy()[support].sum())
    assert statistic < chi2_quantile(0.999, df), (statistic, df)


def _assert_rate(hits: int, expected: float) -> None:
    rate = hits / NUM_ROWS
    assert abs(rate - expected) < 3.29 * math.sqrt(expected * (1 - expected) / NUM_ROWS), (rate, expected)


def _cdf_overlap(a: torch.Tensor, b: torch.Tensor) -> float:
    """P(the inverse CDFs of a and b give the same token for one uniform number)."""
    a_hi, b_hi = a.double().cumsum(0), b.double().cumsum(0)
    a_lo, b_lo = a_hi - a.double(), b_hi - b.double()
    return (torch.minimum(a_hi, b_hi) - torch.maximum(a_lo, b_lo)).clamp(min=0).sum().item()


def _race_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """P(exponential races on a and b with the same noise pick the same token)."""
    a, b = a.double(), b.double()
    both = (a > 0) & (b > 0)
    return sum(1.0 / torch.maximum(a / a[i], b / b[i]).sum().item() for i in both.nonzero().flatten().tolist())


@pytest.mark.parametrize("drafts", ["draft-model", "draft-model-race", "point-mass", "point-mass-race"])
def test_every_position_follows_the_target(drafts):
    target, draft = _distributions()
    race = drafts.endswith("race")
    if drafts.startswith("draft-model"):
        draft_ids = torch.stack([_draws(draft[j], NUM_ROWS, j, race) for j in range(K)], dim=1)
        out = _coupled(draft_ids, draft, target, race)
        expected = (_race_agreement if race else _cdf_overlap)(target[0], draft[0])
        assert expected < torch.minimum(target[0], draft[0]).sum().item()  # below rejection sampling's
    else:
        rows = torch.arange(NUM_ROWS)
        draft_ids = torch.stack([rows % VOCAB, (rows // VOCAB + 1) % VOCAB, rows % 2], dim=1)
        out = _coupled(draft_ids, None, target, race)
        expected = sum(target[0, x].item() for x in range(VOCAB)) / VOCAB  # x_0 cycles through the vocabulary
    for position in range(K + 1):
        _assert_fits([ids[position] for ids in out.output_token_ids if len(ids) > position], target[position])
    _assert_rate(sum(n >= 1 for n in out.num_accepted), expected)


@pytest.mark.parametrize("race", [False, True])
def test_every_emitted_token_is_plain_samplings(race):
    """Whatever was drafted, position j emits the target's draw with the SAMPLE numbers of j."""
    target, draft = _distributions()
    draft_ids = torch.randint(0, VOCAB, (500, K), generator=torch.Generator().manual_seed(3))
    out = _coupled(draft_ids, draft, target, race)
    for position in range(K + 1):
        plain = _draws(target[position], 500, position, race).tolist()
        assert all(ids[position] == plain[row] for row, ids in enumerate(out.output_token_ids) if len(ids) > position)
