"""``tandem profile`` against vLLM's own engine: the grid it measures hangs together, its
acceptance agrees with the tokens vLLM emitted, and the table it writes is the one a vLLM
group installs as ``num_speculative_tokens_per_batch_size``."""

from __future__ import annotations

import pytest

from cluster.config import with_overrides
from cluster.spec_decode.latency_model import expected_tokens

MAX_K = 1
BATCH_SIZES = [1, 2]


@pytest.fixture(scope="module")
def measured(serve_config, tmp_path_factory):
    from cluster.profiling.vllm_profile import run_vllm_profile

    config = with_overrides(serve_config, backend="vllm")
    profile, grid = run_vllm_profile(config, BATCH_SIZES, MAX_K, output_len=12)
    path = tmp_path_factory.mktemp("profile") / "vllm-profile.json"
    profile.save(path)
    return profile, grid, path


def test_every_cell_is_measured_from_decoding_steps(measured):
    profile, grid, _ = measured
    assert profile.engine == "vllm" and "vLLM" in profile.device
    assert sorted((s.batch_size, s.k) for s in grid) == [(b, k) for b in BATCH_SIZES for k in range(MAX_K + 1)]
    for s in grid:
        assert s.num_steps > 0
        assert 1.0 <= s.tokens_per_step <= s.k + 1
        if s.k == 0:
            assert s.tokens_per_step == 1.0
    assert all(0.0 <= a <= 1.0 for a in profile.acceptance) and len(profile.acceptance) == MAX_K


def test_acceptance_from_vllm_counters_matches_the_tokens_it_emitted(measured):
    """Two sources: vLLM's speculation counters (acceptance) and the outputs' token counts."""
    profile, grid, _ = measured
    cells = [s for s in grid if s.k == MAX_K]
    request_steps = sum(s.batch_size * s.num_steps for s in cells)
    tokens = sum(s.tokens_per_step * s.batch_size * s.num_steps for s in cells)
    assert expected_tokens(profile.acceptance, MAX_K) == pytest.approx(tokens / request_steps, rel=1e-6)


def test_the_table_is_the_measured_steps_choice_and_vllms_schedule(measured, serve_config):
    from cluster.backends.vllm import _profile, group_settings

    profile, grid, path = measured
    for b in BATCH_SIZES:  # step(b, k) / E(k) from the measured steps, the smallest k on a tie
        costs = [next(s.step_seconds for s in grid if (s.batch_size, s.k) == (b, k))
                 / expected_tokens(profile.acceptance, k) for k in range(MAX_K + 1)]
        assert profile.table[b] == costs.index(min(costs))
    config = with_overrides(serve_config, backend="vllm", controller="table", num_speculative_tokens=MAX_K,
                            profile=str(path))
    loaded = _profile(config)  # what a vLLM replica reads
    assert loaded == profile
    settings, _ = group_settings(config, 1, loaded.table)
    if any(loaded.table.values()):
        assert settings.spec.policy == "batch-size-table"
        spec_args = settings.engine_args["speculative_config"]
        assert spec_args["num_speculative_tokens_per_batch_size"] == loaded.vllm_schedule()
    else:  # speculation never pays on this device: vLLM runs a fixed k and says why
        assert settings.spec.policy == "fixed" and "never speculates" in settings.spec.note
