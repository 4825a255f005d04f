"""Rejection sampler tests: greedy fast path, the output distribution, seeds, shapes and padding.

The reference is the target distribution itself: every emitted token must follow
``target_probs`` at its position (chi-square goodness of fit at p = 0.001, fixed seeds), and a
sampler with a broken recovered-token formula must fail that same check.
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
    draft_token_ids = torch.tensor([[1, 2, 3], [1, 2, 3], [-1, -1, -1], [0, 0, -1]])
    num_draft_tokens = [3, 3, 0, 2]
    target_probs = torch.stack(
        [
            one_hots([1, 2, 3, 4]),  # all accepted, then the bonus argmax
            one_hots([1, 5, 3, 0]),  # mismatch at position 1: its argmax
            one_hots([2, 0, 0, 0]),  # k = 0: the argmax at position 0
            one_hots([3, 0, 1, 1]),  # mismatch at position 0
        ]
    )
    draft_probs = torch.rand(4, 3, VOCAB) if with_draft_probs else None  # ignored on greedy rows
    global_state = torch.get_rng_state()

    for coupled in (False, True):  # a seed on a greedy row changes nothing
        out = rejection_sample(draft_token_ids, num_draft_tokens, draft_probs, target_probs,
                               torch.ones(4, dtype=torch.bool), {0: SeedKey(5, 0)}, coupled)
        assert out.output_token_ids == [[1, 2, 3, 4], [1, 5], [2], [3]]
        assert out.num_accepted == [3, 1, 0, 0]
    assert torch.equal(torch.get_rng_state(), global_state), "an all-greedy batch drew random numbers"


# ---------------------------------------------------------------- the output distribution


def _first_token_chi2(rejection_fn=rejection_sample, num_rows: int = NUM_ROWS) -> Chi2:
    """k = 1, draft tokens drawn from DRAFT itself: the first output token must follow TARGET."""
    torch.manual_seed(0)
    draft_token_ids = draw_drafts(DRAFT[None], num_rows, torch.Generator().manual_seed(1))
    target_probs = torch.stack([TARGET, BONUS])[None].expand(num_rows, 2, VOCAB)
    draft_probs = DRAFT[None, None].expand(num_rows, 1, VOCAB)
    out = rejection_fn(draft_token_ids, [1] * num_rows, draft_probs, target_probs, no_greedy(num_rows), {})
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
    out = rejection_sample(
        draft_token_ids,
        [k] * NUM_ROWS,
        draft[None].expand(NUM_ROWS, k, VOCAB),
        target[None].expand(NUM_ROWS, k + 1, VOCAB),
        no_greedy(NUM_ROWS),
        {},
    )
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
    out = rejection_sample(
        draft_token_ids, [k] * NUM_ROWS, None, target[None].expand(NUM_ROWS, k + 1, VOCAB), no_greedy(NUM_ROWS), {}
    )
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


def padded_batch(rows: list[Row], max_k: int, pad_id: int = -1, pad_prob: float = float("nan")):
    """The arguments of rejection_sample, padding filled with ``pad_id`` and ``pad_prob``."""
    num_reqs = len(rows)
    draft_token_ids = torch.full((num_reqs, max_k), pad_id, dtype=torch.int64)
    draft_probs = torch.full((num_reqs, max_k, VOCAB), pad_prob)
    target_probs = torch.full((num_reqs, max_k + 1, VOCAB), pad_prob)
    for i, row in enumerate(rows):
        k = len(row.draft_token_ids)
        draft_token_ids[i, :k] = torch.tensor(row.draft_token_ids, dtype=torch.int64)
        draft_probs[i, :k] = row.draft_probs
        target_probs[i, : k + 1] = row.target_probs
    num_draft_tokens = [len(row.draft_token_ids) for row in rows]
    greedy = torch.tensor([row.greedy for row in rows])
    return draft_token_ids, num_draft_tokens, draft_probs, target_probs, greedy


def seeded_row_outputs(layout: list[Row | None], max_k: int, seed: int, global_seed: int,
                       coupled: bool) -> list[list[int]]:
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
        out = rejection_sample(*padded_batch(rows, max_k), seeded, coupled)
        tokens.append(out.output_token_ids[row])
        position += len(out.output_token_ids[row])
    return tokens


@pytest.mark.parametrize("coupled", [False, True])
def test_seeded_row_independent_of_position_and_other_rows(coupled):
    other = Row([0], DRAFT[None], torch.stack([TARGET, BONUS]))
    long = Row([1, 2, 3, 4], torch.stack([DRAFT] * 4), torch.stack([TARGET] * 4 + [BONUS]))
    greedy = Row([0, 0], torch.stack([DRAFT] * 2), one_hots([0, 1, 2]), greedy=True)
    empty = Row([], torch.empty(0, VOCAB), BONUS[None])
    # Batch a: the seeded row first, max_k 2. Batch b: fourth, max_k 4, a greedy row, a k = 0 row.
    tokens_a = seeded_row_outputs([None, other, other], max_k=2, seed=7, global_seed=1, coupled=coupled)
    tokens_b = seeded_row_outputs([long, greedy, empty, None, other], max_k=4, seed=7, global_seed=2,
                                  coupled=coupled)
    assert tokens_a == tokens_b
    assert len({tuple(t) for t in tokens_a}) > 1, "the numbers must move with the output position"
    assert seeded_row_outputs([None, other], max_k=2, seed=8, global_seed=1, coupled=coupled) != tokens_a


# ---------------------------------------------------------------- shapes and padding


@pytest.mark.parametrize(
    ("pad_id", "pad_prob"),
    [(-1, float("nan")), (VOCAB + 7, float("nan")), (0, 1.0 / VOCAB)],
    ids=["negative-nan", "out-of-vocab-nan", "valid-looking"],
)
def test_mixed_draft_counts_and_padding_ignored(pad_id, pad_prob):
    """Padding that would be accepted if it were read (id 0, draft == target) must not be."""
    uniform = torch.full((VOCAB,), 1.0 / VOCAB)
    rows = [
        # draft_probs == target_probs: always accepted, then the bonus (a one-hot at 4)
        Row([1, 5], torch.stack([TARGET, BONUS]), torch.stack([TARGET, BONUS, one_hots([4])[0]])),
        Row([], torch.empty(0, VOCAB), one_hots([2])),  # k = 0: plain sampling
        Row([1, 2, 3], torch.stack([uniform] * 3), one_hots([1, 2, 0, 5]), greedy=True),
        # target gives x_0 = 3 probability 0: rejected; the residual is all on token 5
        Row([3], uniform[None], one_hots([5, 0])),
        Row([4], uniform[None], one_hots([4, 0]), greedy=True),  # accepted; padding would match argmax 0
        Row([0], uniform[None], torch.stack([uniform, uniform])),  # always accepted, then a random bonus
    ]
    batch = padded_batch(rows, max_k=3, pad_id=pad_id, pad_prob=pad_prob)
    out = rejection_sample(*batch, {1: SeedKey(0, 0)})
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
        out = rejection_sample(*padded_batch(rows, max_k=1), {0: SeedKey(1, 0), 1: SeedKey(seed, 0)}, coupled)
        assert out.output_token_ids[1] == [1, 3]


def test_no_drafts_at_all_and_empty_batch():
    target_probs = torch.stack([one_hots([3]), one_hots([0])])  # [2, 1, VOCAB]
    empty_ids = torch.empty(2, 0, dtype=torch.int64)
    out = rejection_sample(empty_ids, [0, 0], torch.empty(2, 0, VOCAB), target_probs, no_greedy(2), {})
    assert out == RejectionOutput([[3], [0]], [0, 0])
    out = rejection_sample(empty_ids, [0, 0], None, target_probs, torch.tensor([True, False]), {})
    assert out == RejectionOutput([[3], [0]], [0, 0])
    none = rejection_sample(torch.empty(0, 2, dtype=torch.int64), [], None, torch.empty(0, 3, VOCAB), no_greedy(0), {})
    assert none == RejectionOutput([], [])


def test_bad_shapes_raise():
    ids = torch.zeros(2, 2, dtype=torch.int64)
    target_probs = torch.full((2, 3, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        rejection_sample(ids, [1, 3], None, target_probs, no_greedy(2), {})
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(ids, [1, 2], None, target_probs[:, :2], no_greedy(2), {})
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(ids, [1, 2], target_probs, target_probs, no_greedy(2), {})
    with pytest.raises(ValueError, match="seeded"):
        rejection_sample(ids, [1, 2], None, target_probs, no_greedy(2), {2: SeedKey(0, 0)})
