"""Acceptance set by hand for the timing rig (``cluster/runner/synthetic_acceptance.py``): the
accepted lengths the engine sees follow the setting (chi-square), every emitted count is the
drawn one, and an engine without the switch verifies as before."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.runner.synthetic_acceptance import SyntheticAcceptance
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion
from tests.goodness_of_fit import chi2_quantile, chi2_statistic

K = 4


class Recording(SyntheticAcceptance):
    """Keeps each draw's (drafts, accepted)."""

    def draw(self, k: int) -> int:
        accepted = super().draw(k)
        self.draws.append((k, accepted))
        return accepted


def test_the_setting_and_its_length_distribution():
    flat = SyntheticAcceptance.parse("0.7")
    assert flat.label() == "synthetic acceptance α = 0.7"
    assert flat.length_distribution(2) == pytest.approx([0.3, 0.7 * 0.3, 0.49])
    curve = SyntheticAcceptance.parse("0.9,0.5")
    assert curve.length_distribution(3) == pytest.approx([0.1, 0.9 * 0.5, 0.45 * 0.5, 0.45 * 0.5])
    assert SyntheticAcceptance.parse("1").draw(5) == 5 and SyntheticAcceptance.parse("0").draw(5) == 0
    for bad in ("", "1.5", "x", "0.5,-0.1"):
        with pytest.raises(ValueError, match="synthetic acceptance"):
            SyntheticAcceptance.parse(bad)


def test_the_engine_accepts_as_drawn_and_lengths_fit_the_setting(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, method="draft", draft_model=str(tiny_llama_dir), num_speculative_tokens=K,
                         controller="fixed", num_blocks=256)
    setting = Recording((0.85, 0.6, 0.5), seed=3)
    setting.draws = []
    engine.worker.runner.synthetic_acceptance = setting
    params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True)
    outputs = run_to_completion(engine, [f"prompt {i} " for i in range(12)], params)
    assert all(len(o) == 160 for o in outputs)
    # A self-draft would accept every position; the drawn lengths are what the engine counted.
    spec = engine.spec_stats
    assert spec.num_accepted_tokens == sum(accepted for _, accepted in setting.draws)
    assert spec.num_draft_tokens == sum(k for k, _ in setting.draws)
    full = [accepted for k, accepted in setting.draws if k == K]
    assert len(full) > 300
    counts = np.bincount(full, minlength=K + 1)
    statistic, df = chi2_statistic(counts, np.array(setting.length_distribution(K)))
    assert statistic < chi2_quantile(0.999, df), (counts.tolist(), setting.length_distribution(K))


def test_without_the_switch_drafts_are_verified(tiny_llama_dir):
    prompts = [f"prompt {i} " for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    speculative = make_engine(tiny_llama_dir, method="draft", draft_model=str(tiny_llama_dir),
                              num_speculative_tokens=K, controller="fixed")
    assert speculative.worker.runner.synthetic_acceptance is None
    assert run_to_completion(speculative, prompts, params) == run_to_completion(make_engine(tiny_llama_dir),
                                                                                prompts, params)
    assert speculative.spec_stats.num_accepted_tokens == speculative.spec_stats.num_draft_tokens  # self-draft


def test_a_profile_made_with_it_says_so_and_measures_the_setting(tiny_llama_dir, tmp_path):
    from cluster.cli import main
    from cluster.spec_decode.profile_data import SpeculationProfile

    out = tmp_path / "synthetic.json"
    assert main(["profile", "--model", str(tiny_llama_dir), "--max-k", "2", "--max-batch", "1", "--context-len", "8",
                 "--repeats", "1", "--synthetic-acceptance", "1,0", "--out", str(out)]) == 0
    profile = SpeculationProfile.load(out)
    assert profile.acceptance_prompts == "synthetic acceptance α = 1, 0"
    # The second position is never accepted; the first is whenever a draft was there to accept (the
    # profile's acceptance counts a position asked for but not proposed as rejected).
    assert profile.acceptance[1] == 0.0 and profile.acceptance[0] > 0.0
