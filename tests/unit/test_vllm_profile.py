"""The pure parts of ``tandem profile`` against vLLM (no vLLM needed): the whole-step fit,
effective acceptance, the prompt batches, and the profile's engine field."""

from __future__ import annotations

import json

import pytest

from cluster.profiling.vllm_profile import batches_of, effective_acceptance
from cluster.backends.vllm_stats import SpecCounters
from cluster.spec_decode.latency_model import expected_tokens, fit_steps
from cluster.spec_decode.profile_data import SpeculationProfile


def _true_step(b: int, k: int) -> float:
    """A target verifying b (k + 1) tokens plus k draft passes, in seconds."""
    return (0.020 + 0.003 * b + 0.001 * b * (k + 1)) + k * (0.004 + 0.0005 * b)


def test_fit_steps_predicts_whole_steps_it_never_saw():
    grid = [(b, k, _true_step(b, k)) for b in (1, 2, 4, 8) for k in range(4)]
    model = fit_steps(grid)
    for b, k in [(3, 2), (16, 5), (6, 0)]:
        assert model.step_time(b, k) == pytest.approx(_true_step(b, k), rel=1e-9)
    acceptance = [0.7, 0.6, 0.5]
    for b in (1, 3, 16):
        costs = [_true_step(b, k) / expected_tokens(acceptance, k) for k in range(4)]
        assert model.best_k(b, acceptance, 3) == costs.index(min(costs))


def test_fit_steps_puts_k_dependent_costs_in_the_draft_terms():
    model = fit_steps([(b, k, _true_step(b, k)) for b in (1, 2, 4) for k in range(3)])
    assert model.target_coef[2] == 0.0
    assert model.target_time(4, 1) == pytest.approx(_true_step(4, 0))


def test_effective_acceptance_chains_positions_from_counted_request_steps():
    counters = SpecCounters(accepted_per_position=[6, 3], drafted_per_position=[8, 6])
    rates = effective_acceptance(counters, request_steps=10, max_k=3)
    assert rates == pytest.approx([0.6, 0.5, 0.0])
    # E(k) from the rates is the tokens gained per request-step: (10 + 6 + 3) / 10.
    assert expected_tokens(rates, 3) == pytest.approx(1.9)


def test_effective_acceptance_of_nothing_counted_is_zero():
    assert effective_acceptance(SpecCounters(), request_steps=0, max_k=2) == [0.0, 0.0]


@pytest.mark.parametrize("batch_size", [1, 2, 5, 12, 16])
def test_batches_cover_every_prompt_with_full_batches(batch_size):
    prompts = [[i] for i in range(12)]
    batches = batches_of(prompts, batch_size)
    assert all(len(batch) == batch_size for batch in batches)
    assert {p[0] for batch in batches for p in batch} == set(range(12))
    assert len(batches) == -(-12 // batch_size)


def test_a_profile_without_engine_field_is_a_native_one(tmp_path):
    fields = dict(device="cpu", target_model="m", draft="ngram", dtype="float32", max_k=1, batch_sizes=[1],
                  target_grid=[(1, 1, 0.05)], draft_grid=[(1, 0.001)], acceptance=[0.5],
                  target_coef=[0.05, 0.0, 0.0], draft_coef=[0.001, 0.0], table={1: 1}, fit_error=0.0)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(fields))
    assert SpeculationProfile.load(path).engine == "native"
    path.write_text(json.dumps(fields | {"engine": "tensorrt"}))
    with pytest.raises(ValueError, match="engine"):
        SpeculationProfile.load(path)


def test_the_shipped_two_engine_config_gives_each_group_a_profile_of_its_own_engine():
    from pathlib import Path

    from cluster.config import group_engine_config, load_config

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "vllm-group.yaml")
    for name in ("native", "vllm"):
        group = group_engine_config(config, name)
        profile = SpeculationProfile.load(group.speculative.profile)
        assert (group.engine.backend, profile.engine) == (name, name)
        assert set(profile.table) == set(profile.batch_sizes) and max(profile.table.values()) <= 4
