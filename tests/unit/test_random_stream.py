"""Counter-based uniforms: uniform, keyed by (seed, lane, position) and nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.runner.random_stream import Lane, SeedKey, counter_uniforms, draw_seeded, keyed_exponentials, row_uniforms
from tests.goodness_of_fit import chi2_quantile, chi2_statistic


def test_uniforms_are_uniform_over_seeds_and_positions():
    seeds = [s for s in range(400) for _ in range(250)]
    positions = [p for _ in range(400) for p in range(250)]
    values = counter_uniforms(seeds, positions, Lane.SAMPLE)
    assert values.dtype == np.float32 and values.min() >= 0.0 and values.max() < 1.0
    counts = np.bincount((values * 100).astype(int), minlength=100)
    statistic, df = chi2_statistic(counts, np.full(100, 0.01))
    assert statistic < chi2_quantile(0.999, df)


def test_lanes_and_neighbouring_positions_are_independent():
    """The joint of (SAMPLE at p, ACCEPT at p) and of (SAMPLE at p, SAMPLE at p + 1) is uniform on a 10 x 10 grid."""
    seeds = [s for s in range(200) for _ in range(200)]
    positions = [p for _ in range(200) for p in range(200)]
    sample = counter_uniforms(seeds, positions, Lane.SAMPLE)
    pairs = {
        "lanes": counter_uniforms(seeds, positions, Lane.ACCEPT),
        "positions": counter_uniforms(seeds, [p + 1 for p in positions], Lane.SAMPLE),
    }
    for name, other in pairs.items():
        cells = (sample * 10).astype(int) * 10 + (other * 10).astype(int)
        statistic, df = chi2_statistic(np.bincount(cells, minlength=100), np.full(100, 0.01))
        assert statistic < chi2_quantile(0.999, df), name


def test_a_number_is_a_function_of_seed_lane_and_position():
    a = counter_uniforms([7, 7, 8, -3, 2**80], [0, 5, 0, 0, 0], Lane.SAMPLE)
    b = counter_uniforms([7], [5], Lane.SAMPLE)
    assert a[1] == b[0]
    assert len(set(a.tolist())) == 5  # other seeds, other positions: other numbers
    assert counter_uniforms([7], [5], Lane.DRAFT)[0] != b[0]
    with pytest.raises(ValueError, match="one position per seed"):
        counter_uniforms([1, 2], [0], Lane.SAMPLE)
    with pytest.raises(ValueError, match="positions are >= 0"):
        counter_uniforms([1], [-1], Lane.SAMPLE)


def test_row_uniforms_key_seeded_rows_by_position_and_leave_the_others_to_the_generator():
    torch.manual_seed(0)
    out = row_uniforms(3, 4, {1: SeedKey(9, 10)}, Lane.ACCEPT, torch.device("cpu"), draw_unseeded=True)
    expected = counter_uniforms([9] * 4, [10, 11, 12, 13], Lane.ACCEPT)
    assert out.shape == (3, 4) and torch.equal(out[1], torch.from_numpy(expected))
    assert (out[0] != out[2]).all()  # the generator's draws
    zeros = row_uniforms(2, 2, {0: SeedKey(9, 10)}, Lane.ACCEPT, torch.device("cpu"), draw_unseeded=False)
    assert torch.equal(zeros[1], torch.zeros(2)) and torch.equal(zeros[0], out[1, :2])


def test_keyed_exponentials_are_exponential_and_keyed():
    cpu = torch.device("cpu")
    keys = [SeedKey(5, 3), SeedKey(5, 4), SeedKey(6, 3), SeedKey(5, 3)]
    noise = keyed_exponentials(keys, Lane.SAMPLE, 20_000, cpu)
    assert torch.equal(noise[0], noise[3]) and not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2])
    assert not torch.equal(noise[0], keyed_exponentials(keys[:1], Lane.DRAFT, 20_000, cpu)[0])
    # 1 - exp(-x) of an Exponential(1) number is uniform
    cells = ((1 - torch.exp(-noise[:3].flatten())) * 50).long().numpy()
    statistic, df = chi2_statistic(np.bincount(cells, minlength=50), np.full(50, 0.02))
    assert statistic < chi2_quantile(0.999, df)


def test_draw_seeded_is_a_function_of_the_key():
    probs = torch.rand(2, 300)
    for race in (False, True):
        first = draw_seeded(probs, [SeedKey(1, 0), SeedKey(1, 1)], Lane.SAMPLE, race)
        again = draw_seeded(probs.flip(0), [SeedKey(1, 1), SeedKey(1, 0)], Lane.SAMPLE, race)
        assert first.tolist() == again.flip(0).tolist()
