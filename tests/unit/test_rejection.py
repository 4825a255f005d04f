"""Rejection sampler tests: greedy fast path, the output distribution, seeds, shapes, ragged drafts.

Two references nobody here tuned: the target distribution itself (every emitted token must
follow ``target_probs`` at its position: chi-square goodness of fit at p = 0.001, fixed
seeds), and speculative sampling written plainly for one request
(``tests/speculative_reference.py``), whose outputs the batched sampler's must match in law
(two-sample chi-square). A sampler with a broken recovered-token formula fails both checks.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch

from cluster.runner.random_stream import SeedKey
from cluster.runner import rejection
from cluster.runner.rejection import RejectionOutput, recovered_probs, rejection_sample
from tests.goodness_of_fit import chi2_quantile
from tests.speculative_reference import greedy_verify_one, speculative_sample

VOCAB = 6
NUM_ROWS = 20_000

# A target and a quite different draft at one position: sum(min(target, draft)) = 0.5.
TARGET = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
DRAFT = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.25, 0.25])
BONUS = torch.tensor([0.10, 0.30, 0.05, 0.25, 0.20, 0.10])


# ---------------------------------------------------------------- statistics


class Chi2(NamedTuple):
    statistic: float
    critical: float  # the 0.999 quantile for df degrees of freedom
    df: int


def chi2_against(
    samples: torch.Tensor,  # [num_samples] int64
    probs: torch.Tensor,  # [vocab_size] float32
) -> Chi2:
    """Chi-square goodness of fit; a token outside the support must never appear."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"emitted a token of probability 0: {counts.tolist()}"
    expected = probs[support].double() / probs.sum().double() * samples.numel()
    assert expected.min() >= 5, "test setup: expected counts too small for chi-square"
    df = int(support.sum()) - 1
    assert df >= 2, "test setup: the support is too small to test anything"
    statistic = ((counts[support] - expected) ** 2 / expected).sum().item()
    return Chi2(statistic, chi2_quantile(0.999, df), df)


def assert_fits(samples: torch.Tensor, probs: torch.Tensor) -> None:  # [num_samples], [vocab_size]
    result = chi2_against(samples, probs)
    assert result.statistic < result.critical, result


def output_column(out: RejectionOutput, position: int) -> torch.Tensor:  # [num_rows_long_enough] int64
    """The token at ``position`` of every output long enough to have one."""
    return torch.tensor([ids[position] for ids in out.output_token_ids if len(ids) > position])


def draw_drafts(
    draft_probs: torch.Tensor,  # [k, vocab_size] one distribution per position
    num_rows: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [num_rows, k] int64
    return torch.multinomial(draft_probs, num_rows, replacement=True, generator=generator).T.contiguous()


def no_greedy(num_rows: int) -> torch.Tensor:  # [num_rows] bool
    return torch.zeros(num_rows, dtype=torch.bool)


# ---------------------------------------------------------------- greedy


def one_hots(ids: list[int]) -> torch.Tensor:  # [len(ids), VOCAB] float32
    return torch.nn.functional.one_hot(torch.tensor(ids), VOCAB).float()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_greedy_rows_exact(with_draft_probs):
    draft_token_ids = [[1, 2, 3], [1, 2, 3], [], [0, 0]]
    target_probs = torch.cat(
        [
            one_hots([1, 2, 3, 4]),  # all accepted, then the bonus argmax
            one_hots([1, 5, 3, 0]),  # mismatch at position 1: its argmax
            one_hots([2]),  # k = 0: the argmax at position 0
            one_hots([3, 0, 1]),  # mismatch at position 0
        ]
    )
    draft_probs = torch.rand(8, VOCAB) if with_draft_probs else None  # ignored on greedy rows
    global_state = torch.get_rng_state()

    for coupled in (False, True):  # a seed on a greedy row changes nothing
        out = rejection_sample(draft_token_ids, draft_probs, target_probs,
                               torch.ones(4, dtype=torch.bool), {0: SeedKey(5, 0)}, coupled)
        assert out.output_token_ids == [[1, 2, 3, 4], [1, 5], [2], [3]]
        assert out.num_accepted == [3, 1, 0, 0]
    assert torch.equal(torch.get_rng_state(), global_state), "an all-greedy batch drew random numbers"


# ---------------------------------------------------------------- the output distribution


def _first_token_chi2(rejection_fn=rejection_sample, num_rows: int = NUM_ROWS) -> Chi2:
    """k = 1, draft tokens drawn from DRAFT itself: the first output token must follow TARGET."""
    torch.manual_seed(0)
    draft_token_ids = draw_drafts(DRAFT[None], num_rows, torch.Generator().manual_seed(1)).tolist()
    target_probs = torch.stack([TARGET, BONUS]).repeat(num_rows, 1)
    draft_probs = DRAFT[None].expand(num_rows, VOCAB)
    out = rejection_fn(draft_token_ids, draft_probs, target_probs, no_greedy(num_rows), {})
    return chi2_against(output_column(out, 0), TARGET)


def test_first_token_follows_target():
    result = _first_token_chi2()
    assert result.statistic < result.critical, result


def test_broken_recovered_distribution_fails_the_check(monkeypatch):
    """Recovered tokens sampled from target_probs instead of the residual: the check must catch it."""
    monkeypatch.setattr(rejection, "recovered_probs", lambda target_probs, draft_probs: target_probs)
    result = _first_token_chi2(rejection.rejection_sample)
    assert result.statistic > result.critical, result


def per_position_distributions(kind: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target_probs [k + 1, VOCAB], draft_probs [k, VOCAB]), different at every position.

    ``softmax``: temperature-1-like, full support on both sides. ``top_p``: the target keeps
    only its 4 most likely tokens (as after top-p / top-k), and one draft position also has
    zeros, where the target does not.
    """
    generator = torch.Generator().manual_seed(11)
    target_logits = torch.randn(k + 1, VOCAB, generator=generator)
    draft_logits = target_logits[:k] + 1.2 * torch.randn(k, VOCAB, generator=generator)
    target_probs, draft_probs = target_logits.softmax(-1), draft_logits.softmax(-1)
    if kind == "top_p":
        smallest = target_probs.argsort(dim=-1)[:, :2]
        target_probs = target_probs.scatter(1, smallest, 0.0)
        target_probs /= target_probs.sum(-1, keepdim=True)
        draft_zeros = target_probs[1].argsort()[-2:]  # the target's two most likely tokens
        draft_probs[1, draft_zeros] = 0.0
        draft_probs[1] /= draft_probs[1].sum()
    return target_probs, draft_probs


def sum_min(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:  # [VOCAB], [VOCAB]
    return torch.minimum(target_probs, draft_probs).sum().item()


@pytest.mark.parametrize("kind", ["softmax", "top_p"])
def test_every_position_follows_target(kind):
    """Given x_0 .. x_{j-1} accepted, output position j follows target_probs[j] (bonus included)."""
    k = 3
    target, draft = per_position_distributions(kind, k)
    torch.manual_seed(2)
    draft_token_ids = draw_drafts(draft, NUM_ROWS, torch.Generator().manual_seed(3))
    out = rejection_sample(draft_token_ids.tolist(), draft.repeat(NUM_ROWS, 1), target.repeat(NUM_ROWS, 1),
                           no_greedy(NUM_ROWS), {})
    for position in range(k + 1):
        assert_fits(output_column(out, position), target[position])
    # The first draft is accepted with probability sum(min(target, draft)): z-test at p = 0.001.
    accept_rate = sum(n >= 1 for n in out.num_accepted) / NUM_ROWS
    expected = sum_min(target[0], draft[0])
    assert abs(accept_rate - expected) < 3.29 * math.sqrt(expected * (1 - expected) / NUM_ROWS)


@pytest.mark.parametrize("kind", ["softmax", "top_p"])
def test_deterministic_drafts_follow_target(kind):
    """draft_probs None (n-gram): drafts are one-hot, accepted with probability target_probs[x]."""
    k = 2
    target, _ = per_position_distributions(kind, k)
    torch.manual_seed(4)
    rows = torch.arange(NUM_ROWS)
    # Any fixed drafts work, including tokens the target gives probability 0.
    draft_token_ids = torch.stack([rows % VOCAB, (rows // VOCAB + 1) % VOCAB], dim=1)
    out = rejection_sample(draft_token_ids.tolist(), None, target.repeat(NUM_ROWS, 1), no_greedy(NUM_ROWS), {})
    for position in range(k + 1):
        assert_fits(output_column(out, position), target[position])


def test_recovered_probs_matches_reference():
    generator = torch.Generator().manual_seed(7)
    target_probs = torch.rand(5, VOCAB, generator=generator).softmax(-1)
    target_probs[0, :3] = 0.0
    target_probs[0] /= target_probs[0].sum()
    draft_probs = torch.rand(5, VOCAB, generator=generator).softmax(-1)
    draft_probs[4] = target_probs[4]  # target == draft: no residual, fall back to the target

    got = recovered_probs(target_probs, draft_probs)

    residual = np.maximum(0.0, target_probs[:4].double().numpy() - draft_probs[:4].double().numpy())
    expected = residual / residual.sum(-1, keepdims=True)
    np.testing.assert_allclose(got[:4].numpy(), expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(got[4], target_probs[4])
    assert not got.isnan().any()
    assert (got[0, :3] == 0).all()


# ---------------------------------------------------------------- seeds


class Row(NamedTuple):
    draft_token_ids: list[int]
    draft_probs: torch.Tensor  # [k, VOCAB]
    target_probs: torch.Tensor  # [k + 1, VOCAB]
    greedy: bool = False


def packed_batch(rows: list[Row]):
    """The arguments of rejection_sample: drafts per row, distributions packed row after row."""
    draft_probs = torch.cat([row.draft_probs for row in rows]) if rows else torch.empty(0, VOCAB)
    target_probs = torch.cat([row.target_probs for row in rows]) if rows else torch.empty(0, VOCAB)
    greedy = torch.tensor([row.greedy for row in rows], dtype=torch.bool)
    return [list(row.draft_token_ids) for row in rows], draft_probs, target_probs, greedy


def seeded_row_outputs(layout: list[Row | None], seed: int, global_seed: int, coupled: bool) -> list[list[int]]:
    """Run 8 steps; ``None`` in ``layout`` is the seeded row (k = 2, TARGET vs DRAFT), whose
    output position advances by the tokens it emitted."""
    torch.manual_seed(global_seed)
    row = layout.index(None)
    mine = Row([3, 4], torch.stack([DRAFT, DRAFT]), torch.stack([TARGET, TARGET, BONUS]))
    rows = [mine if r is None else r for r in layout]
    seeded = {i: SeedKey(100 + i, 0) for i, r in enumerate(layout) if r is not None}
    tokens, position = [], 0
    for _ in range(8):
        seeded[row] = SeedKey(seed, position)
        out = rejection_sample(*packed_batch(rows), seeded, coupled)
        tokens.append(out.output_token_ids[row])
        position += len(out.output_token_ids[row])
    return tokens


@pytest.mark.parametrize("coupled", [False, True])
def test_seeded_row_independent_of_position_and_other_rows(coupled):
    other = Row([0], DRAFT[None], torch.stack([TARGET, BONUS]))
    long = Row([1, 2, 3, 4], torch.stack([DRAFT] * 4), torch.stack([TARGET] * 4 + [BONUS]))
    greedy = Row([0, 0], torch.stack([DRAFT] * 2), one_hots([0, 1, 2]), greedy=True)
    empty = Row([], torch.empty(0, VOCAB), BONUS[None])
    # Batch a: the seeded row first, at most 2 drafts. Batch b: fourth, beside 4 drafts, a greedy row, a k = 0 row.
    tokens_a = seeded_row_outputs([None, other, other], seed=7, global_seed=1, coupled=coupled)
    tokens_b = seeded_row_outputs([long, greedy, empty, None, other], seed=7, global_seed=2, coupled=coupled)
    assert tokens_a == tokens_b
    assert len({tuple(t) for t in tokens_a}) > 1, "the numbers must move with the output position"
    assert seeded_row_outputs([None, other], seed=8, global_seed=1, coupled=coupled) != tokens_a


# ---------------------------------------------------------------- shapes and ragged drafts


def test_mixed_draft_counts():
    """Rows of 0 to 3 drafts in one batch, each read only through its own rows."""
    uniform = torch.full((VOCAB,), 1.0 / VOCAB)
    rows = [
        # draft_probs == target_probs: always accepted, then the bonus (a one-hot at 4)
        Row([1, 5], torch.stack([TARGET, BONUS]), torch.stack([TARGET, BONUS, one_hots([4])[0]])),
        Row([], torch.empty(0, VOCAB), one_hots([2])),  # k = 0: plain sampling
        Row([1, 2, 3], torch.stack([uniform] * 3), one_hots([1, 2, 0, 5]), greedy=True),
        # target gives x_0 = 3 probability 0: rejected; the residual is all on token 5
        Row([3], uniform[None], one_hots([5, 0])),
        Row([4], uniform[None], one_hots([4, 0]), greedy=True),  # accepted; then the argmax 0
        Row([0], uniform[None], torch.stack([uniform, uniform])),  # always accepted, then a random bonus
    ]
    out = rejection_sample(*packed_batch(rows), {1: SeedKey(0, 0)})
    assert out.output_token_ids[:5] == [[1, 5, 4], [2], [1, 2, 0], [5], [4, 0]]
    assert out.num_accepted == [2, 0, 2, 0, 1, 1]
    assert len(out.output_token_ids[5]) == 2 and out.output_token_ids[5][0] == 0


@pytest.mark.parametrize("coupled", [False, True])
def test_a_greedy_row_ignores_its_seed_in_a_mixed_batch(coupled):
    rows = [
        Row([1], DRAFT[None], torch.stack([TARGET, BONUS])),
        Row([1], DRAFT[None], one_hots([1, 3]), greedy=True),
    ]
    for seed in range(5):
        out = rejection_sample(*packed_batch(rows), {0: SeedKey(1, 0), 1: SeedKey(seed, 0)}, coupled)
        assert out.output_token_ids[1] == [1, 3]


def test_no_drafts_at_all_and_empty_batch():
    target_probs = one_hots([3, 0])  # two rows of k = 0
    out = rejection_sample([[], []], torch.empty(0, VOCAB), target_probs, no_greedy(2), {})
    assert out == RejectionOutput([[3], [0]], [0, 0])
    out = rejection_sample([[], []], None, target_probs, torch.tensor([True, False]), {})
    assert out == RejectionOutput([[3], [0]], [0, 0])
    none = rejection_sample([], None, torch.empty(0, VOCAB), no_greedy(0), {})
    assert none == RejectionOutput([], [])


def test_bad_shapes_raise():
    target_probs = torch.full((5, VOCAB), 1.0 / VOCAB)  # rows for drafts of 1 and 2
    with pytest.raises(ValueError, match="target_probs must be"):
        rejection_sample([[1], [2, 3]], None, target_probs[:4], no_greedy(2), {})
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample([[1], [2, 3]], target_probs, target_probs, no_greedy(2), {})
    with pytest.raises(ValueError, match="greedy must be"):
        rejection_sample([[1], [2, 3]], None, target_probs, no_greedy(3), {})
    with pytest.raises(ValueError, match="seeded"):
        rejection_sample([[1], [2, 3]], None, target_probs, no_greedy(2), {2: SeedKey(0, 0)})


# ---------------------------------------------------------------- the one-request reference


def two_sample_chi2(a: list[int], b: list[int], num_categories: int) -> Chi2:
    """Chi-square test that two samples come from one distribution (categories seen in neither
    are left out; one expected fewer than 5 times in either sample merges into a neighbour)."""
    counts = np.stack([np.bincount(a, minlength=num_categories), np.bincount(b, minlength=num_categories)])
    counts = counts[:, counts.sum(axis=0) > 0].astype(np.float64)
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
    while expected.shape[1] > 1 and expected.min() < 5:  # fold the smallest column into a neighbour
        col = int(expected.min(axis=0).argmin())
        counts[:, col + 1 if col + 1 < counts.shape[1] else col - 1] += counts[:, col]
        counts = np.delete(counts, col, axis=1)
        expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
    df = counts.shape[1] - 1
    assert df >= 1, "test setup: too few samples to test anything"
    return Chi2(float(((counts - expected) ** 2 / expected).sum()), chi2_quantile(0.999, df), df)


def _against_reference(kind: str, with_draft_probs: bool, num_rows: int = 6000) -> list[Chi2]:
    """The batched sampler and the one-request reference on the same rows (k = 3, ragged by
    drawing each row's k): the law of the number accepted and of the token at every position."""
    k = 3
    target, draft = per_position_distributions(kind, k)
    generator = torch.Generator().manual_seed(21)
    counts = torch.randint(0, k + 1, (num_rows,), generator=generator).tolist()
    full = draw_drafts(draft, num_rows, generator)  # without draft_probs: the same tokens read as one-hot
    drafts = [full[i, :n].tolist() for i, n in enumerate(counts)]
    torch.manual_seed(22)
    batched = rejection_sample(drafts, torch.cat([draft[:n] for n in counts]) if with_draft_probs else None,
                               torch.cat([target[: n + 1] for n in counts]), no_greedy(num_rows), {})
    reference = [speculative_sample(d, draft[: len(d)] if with_draft_probs else None, target[: len(d) + 1],
                                    generator) for d in drafts]
    results = [two_sample_chi2(batched.num_accepted, [n for _, n in reference], k + 1)]
    for position in range(k + 1):
        column = [ids[position] for ids in batched.output_token_ids if len(ids) > position]
        want = [ids[position] for ids, _ in reference if len(ids) > position]
        if min(len(column), len(want)) >= 200:  # a position reached too rarely is not tested
            results.append(two_sample_chi2(column, want, VOCAB))
    assert len(results) >= 3, "test setup: positions 0 and 1 must be tested"
    return results


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("kind", ["softmax", "top_p"])
def test_the_batched_sampler_follows_the_one_request_reference(kind, with_draft_probs):
    for result in _against_reference(kind, with_draft_probs):
        assert result.statistic < result.critical, result


def test_a_broken_recovered_distribution_departs_from_the_reference(monkeypatch):
    monkeypatch.setattr(rejection, "recovered_probs", lambda target_probs, draft_probs: target_probs)
    assert any(r.statistic > r.critical for r in _against_reference("softmax", True))


def test_greedy_rows_match_the_reference():
    generator = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(300):
        k = int(torch.randint(0, 5, (1,), generator=generator))
        target = torch.rand(k + 1, VOCAB, generator=generator)
        drafts = torch.where(torch.rand(k, generator=generator) < 0.7, target[:k].argmax(-1),
                             torch.randint(0, VOCAB, (k,), generator=generator)).tolist()
        rows.append(Row(drafts, torch.rand(k, VOCAB, generator=generator), target, greedy=True))
    out = rejection_sample(*packed_batch(rows), {})
    want = [greedy_verify_one(row.draft_token_ids, row.target_probs) for row in rows]
    assert out.output_token_ids == [ids for ids, _ in want]
    assert out.num_accepted == [n for _, n in want]
