"""One simulated replica against queueing worked out by hand, and speculation's token counts."""

import numpy as np
import pytest
from test_sim_helpers import constant_model, run, sim_config, workload

from cluster.routing.policy import expected_tokens_per_step


def one_replica(max_num_seqs=1, **group):
    return sim_config([{"name": "a", "device": "H100", "num_replicas": 1, "max_num_seqs": max_num_seqs, **group}])


def test_hand_computed_trace_single_slot():
    # Each step takes 0.25 s; a request of 3 output tokens takes 3 steps (prefill gives
    # the first token, two decode steps the rest): 0.75 s of service, one at a time.
    config = one_replica()
    result = run(config, {"a": constant_model(0.25)}, workload([0.0, 0.5, 0.6], 10, 3))
    t = result.requests
    np.testing.assert_allclose(t.first_token_s, [0.25, 1.0, 1.75])
    np.testing.assert_allclose(t.finish_s, [0.75, 1.5, 2.25])
    np.testing.assert_allclose(t.admitted_s, [0.0, 0.75, 1.5])


def test_batched_requests_share_steps():
    # Two slots: the second request joins at the next step boundary and both decode together.
    config = one_replica(max_num_seqs=2)
    result = run(config, {"a": constant_model(0.25)}, workload([0.0, 0.1], 10, 3))
    np.testing.assert_allclose(result.requests.finish_s, [0.75, 1.0])


def test_md1_mean_wait_matches_closed_form():
    # Poisson arrivals, deterministic service D = 4 steps x 0.05 s, one slot: M/D/1 with
    # rho = 0.5, whose mean wait in queue is rho D / (2 (1 - rho)) = 0.1 s. A server that
    # ignores the queue (wait 0) or serves twice too slowly would miss this by far.
    rng = np.random.default_rng(7)
    service = 4 * 0.05
    rate = 0.5 / service
    arrivals = np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, 8000 - 1))])
    config = one_replica()
    result = run(config, {"a": constant_model(0.05)}, workload(arrivals, 10, 4), router="round-robin")
    wait = result.requests.admitted_s - result.requests.arrival_s
    # An idle replica starts a step at once, a busy one admits at the end of the request
    # it serves: exactly first-come first-served with one server.
    expected = 0.5 * service / (2 * 0.5)
    assert wait.mean() == pytest.approx(expected, rel=0.15)


@pytest.mark.parametrize("acceptance, expected_steps", [((1.0,), 1 + 3), ((0.0,), 1 + 12)])
def test_speculation_tokens_per_step(acceptance, expected_steps):
    # k = 3: with acceptance 1 a decode step gains 4 tokens, with 0 it gains 1.
    config = one_replica()
    result = run(config, {"a": constant_model(0.01, acceptance=acceptance)}, workload([0.0], 10, 13),
                 controller="fixed:3")
    replica = result.groups[0].lives[0].replica
    assert replica.num_steps == expected_steps
    assert replica.num_output_tokens == 13
    decode_steps = expected_steps - 1
    assert replica.num_drafted == 3 * decode_steps
    assert replica.num_accepted == (3 * decode_steps if acceptance[0] == 1.0 else 0)


def test_tokens_add_up_and_every_request_finishes_under_kv_pressure():
    # A KV cache of 300 tokens for prompts of 50 and outputs of 40 forces preemptions.
    rng = np.random.default_rng(3)
    arrivals = np.sort(rng.uniform(0, 2, 60))
    config = one_replica(max_num_seqs=8)
    model = constant_model(0.01, acceptance=(0.6,), kv_capacity=300, per_token_s=1e-4)
    result = run(config, {"a": model}, workload(arrivals, 50, 40), controller="fixed:2")
    replica = result.groups[0].lives[0].replica
    assert not np.isnan(result.requests.finish_s).any()
    assert replica.num_output_tokens == 60 * 40
    assert replica.num_preemptions > 0
    assert np.all(result.requests.first_token_s >= result.requests.arrival_s)
    assert np.all(result.requests.finish_s >= result.requests.first_token_s)


def test_same_seed_same_run_other_seed_other_run():
    arrivals = np.linspace(0, 1, 40)
    model = {"a": constant_model(0.01, acceptance=(0.5,))}
    first = run(one_replica(max_num_seqs=4), model, workload(arrivals, 20, 30), controller="fixed:3")
    again = run(one_replica(max_num_seqs=4), model, workload(arrivals, 20, 30), controller="fixed:3")
    other = run(one_replica(max_num_seqs=4).model_copy(update={"seed": 1}), model, workload(arrivals, 20, 30),
                controller="fixed:3")
    np.testing.assert_array_equal(first.requests.finish_s, again.requests.finish_s)
    assert not np.array_equal(first.requests.finish_s, other.requests.finish_s)


def test_the_routers_tokens_per_step_match_what_the_replica_decodes():
    # Falling per-position acceptance (0.9, 0.6, 0.3) at k = 3: the router's E from the
    # replica's reported accepted/drafted fraction must equal the tokens a decode step gained.
    # (The geometric formula fed that fraction, used before, says 1.97 where steps gain 2.60.)
    config = one_replica()
    result = run(config, {"a": constant_model(0.01, acceptance=(0.9, 0.6, 0.3))}, workload([0.0], 10, 4000),
                 controller="fixed:3")
    replica = result.groups[0].lives[0].replica
    stats = replica.stats(1e9)  # refreshed after the run
    decode_steps = replica.num_steps - 1
    measured = (replica.num_output_tokens - 1) / decode_steps
    assert expected_tokens_per_step(stats.acceptance, 3) == pytest.approx(measured, rel=0.01)
    assert measured == pytest.approx(1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6 * 0.3, rel=0.05)


def test_partial_drafts_make_the_verifying_step_cheaper():
    import dataclasses

    from cluster.sim.device_model import StepModel
    from cluster.spec_decode.latency_model import LatencyModel

    full = StepModel(LatencyModel([0.01, 0.001, 0.0005], [0.0, 0.0]), (0.5,), 10**6, "measured: by hand", 1.0, 8)
    partial = dataclasses.replace(full, coverage=(0.5, 0.5, 0.25))  # n-gram lookup: half, half, a quarter
    assert full.step_seconds(4, 3, 0, 0) == pytest.approx(0.01 + 4 * 0.001 + 0.0005 * 4 * (1 + 3))
    assert partial.step_seconds(4, 3, 0, 0) == pytest.approx(0.01 + 4 * 0.001 + 0.0005 * 4 * (1 + 1.25))
    # positions past the list reuse its last value; no decoding request, no drafts
    assert partial.step_seconds(4, 5, 0, 0) == pytest.approx(0.01 + 4 * 0.001 + 0.0005 * 4 * (1 + 1.75))
    assert partial.step_seconds(0, 3, 100, 1) == full.step_seconds(0, 3, 100, 1)


def test_a_measured_groups_coverage_reaches_its_step_model_and_controller():
    from pathlib import Path

    from cluster.sim.device_model import DeviceTable, controller_prior, group_step_model
    from cluster.spec_decode.profile_data import SpeculationProfile

    path = Path(__file__).resolve().parents[2] / "configs" / "profiles" / "cpu-2core-avx512-smollm2-135m-ngram-bf16.json"
    profile = SpeculationProfile.load(path)
    assert profile.coverage is not None and min(profile.coverage) < 1
    config = one_replica(profile=str(path))
    group = config.groups[0]
    model = group_step_model(config, group, DeviceTable.load(config.devices))
    assert model.coverage == tuple(profile.coverage)
    assert model.drafted_per_request(2) == pytest.approx(profile.coverage[0] + profile.coverage[1])
    assert controller_prior(group, model)[2] == list(profile.coverage)
