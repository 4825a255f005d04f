"""Pass times read between a profile's measured points, and the adaptive controller standing on them."""

import random

import pytest

from cluster.spec_decode.controller import AdaptiveController, BatchState, StepObservation
from cluster.spec_decode.latency_model import LatencyModel
from cluster.spec_decode.pass_grid import PassGrid
from cluster.spec_decode.profile_data import SpeculationProfile

# Made-up pass times (seconds), shaped like this CPU's (as tests/unit/test_profile_table.py):
# an extra token per request costs 0.1 ms at batch 1, 2 ms at batch 8 and 16 ms at batch 32.
GRID = ([(1, n, 0.008 + 0.0001 * (n - 1)) for n in range(1, 6)] + [(8, n, 0.012 + 0.002 * (n - 1)) for n in range(1, 6)]
        + [(32, n, 0.030 + 0.016 * (n - 1)) for n in range(1, 6)])
DRAFT = [(1, 0.0002), (8, 0.0005), (32, 0.001)]


def _profile(acceptance) -> SpeculationProfile:
    model = LatencyModel.fit(GRID, DRAFT)
    return SpeculationProfile(device="cpu", target_model="t", draft="ngram", dtype="float32", max_k=4,
                              batch_sizes=[1, 8, 32], target_grid=GRID, draft_grid=DRAFT, acceptance=acceptance,
                              target_coef=model.target_coef, draft_coef=model.draft_coef, table={}, fit_error=0.0)


def test_measured_points_are_read_as_measured_and_linearly_between_them():
    grid = PassGrid(GRID, DRAFT, max_tokens=5)
    for b, n, t in GRID:
        assert grid.verify_time(b, n) == pytest.approx(t)
    assert grid.verify_time(1, 2.5) == pytest.approx(0.008 + 0.00015)  # between 2 and 3 tokens
    # batch 20 is halfway from 8 to 32: the mean of their passes, at each length
    assert grid.verify_time(20, 3) == pytest.approx((0.016 + 0.062) / 2)
    assert grid.verify_time(20, 1.5) == pytest.approx((0.013 + 0.038) / 2)
    assert grid.draft_time(8) == 0.0005 and grid.draft_time(20) == pytest.approx(0.00075)
    assert PassGrid(GRID, [], max_tokens=5).draft_time(8) == 0.0  # no draft model: drafting is free


def test_past_the_largest_size_the_last_line_carries_on():
    grid = PassGrid(GRID, DRAFT, max_tokens=5)
    # 32 -> 56 is as far again as 8 -> 32: each pass grows by as much again
    assert grid.verify_time(56, 1) == pytest.approx(0.030 + (0.030 - 0.012))
    assert grid.verify_time(56, 5) == pytest.approx(0.094 + (0.094 - 0.020))
    assert grid.draft_time(56) == pytest.approx(0.0015)
    # a size between measured ones never reads above its larger neighbour
    assert grid.verify_time(9, 5) < grid.verify_time(32, 5)


def test_a_grid_missing_lengths_is_refused_and_the_profile_falls_back_to_its_fit():
    with pytest.raises(ValueError, match="batch size 1 is measured at 1..5 tokens per request, the grid needs 1..7"):
        PassGrid(GRID, DRAFT, max_tokens=7)
    with pytest.raises(ValueError, match="needs measured passes"):
        PassGrid([], DRAFT, max_tokens=1)
    profile = _profile([0.8] * 4)
    assert profile.pass_grid(4) is not None and profile.pass_grid(6) is None
    fit_only = AdaptiveController.from_profile(profile, max_k=6)
    assert fit_only.grid is None and fit_only.model.target_coef == profile.target_coef


def test_adaptive_starts_from_the_grid_where_the_fit_picks_otherwise():
    profile = _profile([0.8] * 4)
    adaptive = AdaptiveController.from_profile(profile, max_k=4)
    grid_table = {b: profile.best_k(b) for b in (1, 8, 32)}
    assert grid_table == {1: 4, 8: 4, 32: 1}
    assert {b: profile.latency_model.best_k(b, [0.8] * 4, 4) for b in (1, 8, 32)} != grid_table
    assert adaptive.k_table([1, 8, 32]) == grid_table
    assert adaptive.choose_k(BatchState(32, 0)) == 1


def test_a_device_slower_than_the_profiled_one_is_read_within_a_few_steps():
    """The live device runs every pass 3x slower than the profile's (a profile measured on
    another machine): after 20 plain decoding steps at one batch size the controller prices
    drafting there 3x dearer too, not at the profile's milliseconds on top of a slower base,
    and picks the k that the slower device's own times call best."""
    profile = _profile([0.8] * 4)
    truth = LatencyModel([0.0, 0.0, 0.0], [0.0, 0.0], profile.pass_grid(4), grid_scale=3.0)
    adaptive = AdaptiveController.from_profile(profile, max_k=4, acceptance_ema=0.0)
    adaptive.acceptance = [0.3] * 4
    for _ in range(20):
        adaptive.observe(StepObservation(8, 0, truth.step_time(8, 0)))
    for k in range(5):
        assert adaptive.model.step_time(8, k) == pytest.approx(truth.step_time(8, k), rel=0.05)
    assert adaptive.k_table([8]) == {8: truth.best_k(8, [0.3] * 4, 4)}


def test_adaptive_learns_a_correction_to_the_grid():
    """The live steps cost what the grid says plus 3 ms per draft pass at every batch size
    (say, proposing is dearer than profiled): the correction is learnt, and with it the best
    k per batch size of the live steps, at sizes observed and between them."""
    profile = _profile([0.8] * 4)
    truth = LatencyModel([0.0, 0.0, 0.0], [0.003, 0.0], profile.pass_grid(4))
    adaptive = AdaptiveController.from_profile(profile, max_k=4)
    assert adaptive.k_table([1, 8]) != {b: truth.best_k(b, [0.8] * 4, 4) for b in (1, 8)}
    rng = random.Random(3)
    for _ in range(800):
        b, k = rng.choice([1, 2, 8, 16, 32]), rng.randint(0, 4)
        adaptive.observe(StepObservation(b, k, truth.step_time(b, k)))
    assert adaptive.model.draft_coef[0] == pytest.approx(0.003, rel=0.05)
    for b in (1, 4, 8, 20, 32):
        assert adaptive.model.step_time(b, 3) == pytest.approx(truth.step_time(b, 3), rel=0.02)
    sizes = [1, 4, 8, 20, 32]
    assert adaptive.k_table(sizes) == {b: truth.best_k(b, adaptive.acceptance, 4) for b in sizes}
