"""The simulator's numpy workloads draw what the bench generators draw."""

import math

import numpy as np
import pytest

from cluster.bench.serve_workload import Phase, arrival_times, random_requests
from cluster.sim.config import WorkloadConfig
from cluster.sim.workload import build_workload, gamma_arrivals, phased_arrivals


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_gaps_have_the_bench_generators_mean_and_spread(burstiness):
    n, rate = 20000, 5.0
    ours = np.diff(gamma_arrivals(n, rate, burstiness, np.random.default_rng(0)))
    bench = np.diff(np.array(arrival_times(n, rate, burstiness, seed=0)))
    for gaps in (ours, bench):
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)


def test_random_lengths_span_the_bench_generators_range():
    config = WorkloadConfig(dataset="random", num_requests=5000, input_len=100, output_len=40, range_ratio=0.5,
                            rate=1.0)
    ours = build_workload(config, seed=0, capacity_rps=1.0)
    bench = random_requests(500, 100, 40, 0.5, seed=0)
    assert ours.prompt_len.min() == min(r.prompt_len for r in bench) == 50
    assert ours.prompt_len.max() == max(r.prompt_len for r in bench) == 150
    assert (ours.output_len.min(), ours.output_len.max()) == (20, 60)
    assert ours.arrival_s[0] == 0.0 and np.all(np.diff(ours.arrival_s) >= 0)


def test_phases_stay_inside_their_phase_at_their_rate():
    times = phased_arrivals([Phase(10.0, 100.0), Phase(0.0, 50.0), Phase(40.0, 50.0)], 1.0,
                            np.random.default_rng(1))
    assert np.all(np.diff(times) >= 0)
    assert not np.any((times >= 100) & (times < 150))
    assert np.count_nonzero(times < 100) == pytest.approx(1000, rel=0.1)
    assert np.count_nonzero(times >= 150) == pytest.approx(2000, rel=0.1)


def test_load_is_a_fraction_of_capacity_and_the_seed_fixes_everything():
    config = WorkloadConfig(num_requests=20000, load=0.5, input_len=10, output_len=10)
    first = build_workload(config, seed=3, capacity_rps=8.0)
    assert 1 / np.diff(first.arrival_s).mean() == pytest.approx(4.0, rel=0.05)
    again = build_workload(config, seed=3, capacity_rps=8.0)
    np.testing.assert_array_equal(first.arrival_s, again.arrival_s)
    assert not np.array_equal(first.arrival_s, build_workload(config, seed=4, capacity_rps=8.0).arrival_s)


def test_shared_prefix_requests_share_the_system_prompt():
    config = WorkloadConfig(dataset="shared-prefix", num_requests=400, num_prefixes=4, prefix_len=100,
                            question_len=10, rate=1.0)
    load = build_workload(config, seed=0, capacity_rps=1.0)
    assert set(load.prefix_id.tolist()) == {0, 1, 2, 3}
    assert np.all(load.shared_len >= 100) and np.all(load.prompt_len > load.shared_len)
