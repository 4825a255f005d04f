"""Coupled verification: exact output distribution, the acceptance it should have, plain sampling's tokens.

Every row has its own seed; a draft model's drafts are drawn as the engine draws them under
coupling (inverse CDF of the draft's distribution with the SAMPLE number of their position).
The reference for each emitted token is the target distribution at its position (chi-square
at p = 0.001); the acceptance of the first draft is compared (z-test at p = 0.001) with its
exact value: ``t(x)`` for a point mass, the overlap of the two distributions' CDF intervals for
a draft model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cluster.runner.categorical import sample_categorical
from cluster.runner.random_stream import Lane, SeedKey, counter_uniforms
from cluster.spec.rejection import rejection_sample
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


def _sample_lane(num_rows: int, position: int) -> torch.Tensor:  # [num_rows] row r's SAMPLE number at position
    return torch.from_numpy(counter_uniforms(list(range(num_rows)), [position] * num_rows, Lane.SAMPLE))


def _coupled(draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, target: torch.Tensor):
    num_rows = draft_ids.shape[0]
    return rejection_sample(
        draft_ids, [K] * num_rows,
        None if draft_probs is None else draft_probs[None].expand(num_rows, K, VOCAB),
        target[None].expand(num_rows, K + 1, VOCAB), torch.zeros(num_rows, dtype=torch.bool),
        {row: SeedKey(row, 0) for row in range(num_rows)}, coupled=True,
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


@pytest.mark.parametrize("drafts", ["draft-model", "point-mass"])
def test_every_position_follows_the_target(drafts):
    target, draft = _distributions()
    if drafts == "draft-model":
        draft_ids = torch.stack([sample_categorical(draft[j][None].expand(NUM_ROWS, VOCAB), _sample_lane(NUM_ROWS, j))
                                 for j in range(K)], dim=1)
        out = _coupled(draft_ids, draft, target)
        expected = _cdf_overlap(target[0], draft[0])
        assert expected < torch.minimum(target[0], draft[0]).sum().item()  # below rejection sampling's
    else:
        rows = torch.arange(NUM_ROWS)
        draft_ids = torch.stack([rows % VOCAB, (rows // VOCAB + 1) % VOCAB, rows % 2], dim=1)
        out = _coupled(draft_ids, None, target)
        expected = sum(target[0, x].item() for x in range(VOCAB)) / VOCAB  # x_0 cycles through the vocabulary
    for position in range(K + 1):
        _assert_fits([ids[position] for ids in out.output_token_ids if len(ids) > position], target[position])
    _assert_rate(sum(n >= 1 for n in out.num_accepted), expected)


def test_every_emitted_token_is_plain_samplings():
    """Whatever was drafted, position j emits the target's inverse-CDF draw with the SAMPLE number of j."""
    target, draft = _distributions()
    draft_ids = torch.randint(0, VOCAB, (500, K), generator=torch.Generator().manual_seed(3))
    out = _coupled(draft_ids, draft, target)
    for position in range(K + 1):
        plain = sample_categorical(target[position][None].expand(500, VOCAB), _sample_lane(500, position)).tolist()
        assert all(ids[position] == plain[row] for row, ids in enumerate(out.output_token_ids) if len(ids) > position)
