"""The profile's table is read from its measured grid, not from the fitted line."""

import pytest

from cluster.spec_decode.latency_model import LatencyModel, expected_tokens
from cluster.spec_decode.profile_data import SpeculationProfile

# Made-up pass times (seconds), shaped like this CPU's: an extra token per request costs 0.1 ms
# at batch 1, 2 ms at batch 8 and 16 ms at batch 32, so no single per-token cost fits them all.
GRID = ([(1, n, 0.008 + 0.0001 * (n - 1)) for n in range(1, 6)] + [(8, n, 0.012 + 0.002 * (n - 1)) for n in range(1, 6)]
        + [(32, n, 0.030 + 0.016 * (n - 1)) for n in range(1, 6)])
DRAFT = [(1, 0.0002), (8, 0.0005), (32, 0.001)]


def _profile(acceptance, coverage=None) -> SpeculationProfile:
    model = LatencyModel.fit(GRID, DRAFT)
    return SpeculationProfile(device="cpu", target_model="t", draft="ngram", dtype="float32", max_k=4,
                              batch_sizes=[1, 8, 32], target_grid=GRID, draft_grid=DRAFT, acceptance=acceptance,
                              coverage=coverage, target_coef=model.target_coef, draft_coef=model.draft_coef,
                              table={}, fit_error=0.0)


def test_best_k_is_the_minimum_of_the_measured_grid():
    profile = _profile([0.8] * 4)
    passes = {(b, n): t for b, n, t in GRID}
    for b in (1, 8, 32):
        by_hand = [(passes[(b, k + 1)] + k * dict(DRAFT)[b]) / expected_tokens([0.8] * 4, k) for k in range(5)]
        assert [profile.measured_time_per_token(b, k) for k in range(5)] == pytest.approx(by_hand)
        assert profile.best_k(b) == by_hand.index(min(by_hand))
    assert [profile.best_k(b) for b in (1, 8, 32)] == [4, 4, 1]
    # The line fitted to the same grid picks 3 at batch 8 and 2 at batch 32: the table does
    # not come from it.
    assert [profile.latency_model.best_k(b, [0.8] * 4, 4) for b in (1, 8, 32)] == [4, 3, 2]


def test_partial_drafts_are_read_between_the_measured_token_counts():
    profile = _profile([0.5] * 4, coverage=[0.5] * 4)
    # k = 1 with half the requests proposed a token: 1.5 tokens per request, halfway between n = 1 and 2
    halfway = (0.030 + 0.046) / 2 + 0.001
    assert profile.measured_time_per_token(32, 1) == pytest.approx(halfway / 1.5)


def test_sizes_or_lengths_the_grid_lacks_fall_back_to_the_fitted_model():
    profile = _profile([0.6] * 4)
    model = profile.latency_model
    assert profile.best_k(4) == model.best_k(4, [0.6] * 4, 4)  # batch 4 was not measured
    assert profile.best_k(1, max_k=6) == model.best_k(1, [0.6] * 4, 6)  # 7 tokens per request were not
    with pytest.raises(ValueError, match="no batch size 4"):
        profile.measured_time_per_token(4, 1)
