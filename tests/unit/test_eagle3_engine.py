"""EAGLE-3 heads in the engine: outputs exactly the target's, under preemption, prefix caching and
sampling (aborts: tests/unit/test_spec_decode.py), and heads that do not fit the target refused with
a clear error."""

from __future__ import annotations

import random

import pytest

from cluster.config import ConfigError
from cluster.models.tiny import save_tiny_model, tiny_llama_config
from cluster.models.tiny_head import save_random_head
from cluster.shared.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, run_to_completion
from tests.goodness_of_fit import chi2_quantile, chi2_statistic
from tests.unit.test_spec_decode import CyclingController
from tests.unit.test_spec_distribution import VOCAB, _reference_joint, sample_pairs

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _prompts(seed=0, lengths=(5, 17, 30, 3, 44, 9)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return run_to_completion(make_engine(tiny_llama_dir, num_blocks=128), _prompts(), GREEDY)


def _eagle3(head, **overrides) -> dict:
    return dict(method="eagle3", draft_model=str(head), **overrides)


def test_preemption_recomputes_the_heads_entries(tiny_llama_dir, tiny_head_dir, expected):
    engine = make_engine(tiny_llama_dir, **_eagle3(tiny_head_dir, num_blocks=14, block_size=8,
                                                   max_num_batched_tokens=16, num_speculative_tokens=3))
    assert run_to_completion(engine, _prompts(), GREEDY) == expected
    assert engine.stats().num_preemptions > 0
    assert engine.stats().spec.num_accepted_tokens > 0
    assert engine.proposer.states == {}


def test_prefix_cache_hits_keep_drafting(tiny_llama_dir, tiny_head_dir, expected):
    engine = make_engine(tiny_llama_dir, **_eagle3(tiny_head_dir, num_blocks=128, block_size=4,
                                                   num_speculative_tokens=3))
    assert run_to_completion(engine, _prompts(), GREEDY) == expected
    first = engine.stats().spec.num_accepted_tokens
    assert run_to_completion(engine, _prompts(), GREEDY) == expected
    assert engine.stats().prefix_cache_hits > 0
    # The cached blocks' head entries are the first run's: the second run accepts drafts as well.
    assert engine.stats().spec.num_accepted_tokens > first


def test_k_changing_every_step_including_zero(tiny_llama_dir, tiny_head_dir, expected):
    engine = make_engine(tiny_llama_dir, **_eagle3(tiny_head_dir, num_blocks=128))
    engine.controller = CyclingController()
    assert run_to_completion(engine, _prompts(), GREEDY) == expected
    assert set(engine.stats().spec.k_per_step) == {0, 1, 2, 3, 4}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    config = tiny_llama_config(vocab_size=VOCAB, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    target = save_tiny_model(config, tmp_path_factory.mktemp("head_dist_target"), seed=3)
    # A random head that can draft 8 of the 12 tokens: the others only ever come from the target.
    head = save_random_head(config, tmp_path_factory.mktemp("head_dist_head"), draft_vocab=8, seed=5)
    return target, head


@pytest.mark.parametrize("verification", ["auto", "rejection"])
def test_sampled_tokens_follow_the_target_joint_distribution(small_vocab, verification):
    """Two tokens per request, the second verified against a head's draft: their joint frequencies
    over 3000 seeded requests fit the target's own (transformers) joint distribution."""
    target, head = small_vocab
    joint = _reference_joint(target, 1.0, 1.0)
    counts = sample_pairs(target, _eagle3(head), 1.0, 1.0, verification)
    statistic, df = chi2_statistic(counts, joint)
    assert statistic < chi2_quantile(0.999, df), (statistic, df)


def test_heads_that_do_not_fit_the_target_are_refused(tiny_llama_dir, tiny_opt_dir, tmp_path):
    other_vocab = save_random_head(tiny_llama_config(vocab_size=300), tmp_path / "vocab", draft_vocab=300)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens"):
        make_engine(tiny_llama_dir, **_eagle3(other_vocab, num_blocks=32))
    wider = save_random_head(tiny_llama_config(hidden_size=128), tmp_path / "wide", draft_vocab=64)
    with pytest.raises(ConfigError, match="width 128"):
        make_engine(tiny_llama_dir, **_eagle3(wider, num_blocks=32))
    with pytest.raises(ConfigError, match="Llama-family target"):
        make_engine(tiny_opt_dir, **_eagle3(other_vocab, num_blocks=32))
    with pytest.raises(ConfigError, match="neither a shipped EAGLE-3 head"):
        make_engine(tiny_llama_dir, **_eagle3(tmp_path / "absent", num_blocks=32))
    with pytest.raises(ValueError, match="draft_model is required"):
        make_engine(tiny_llama_dir, method="eagle3")


def test_profiling_times_the_heads_passes(tiny_llama_dir, tiny_head_dir):
    from cluster.profiling.profiler import run_profile

    engine = make_engine(tiny_llama_dir, **_eagle3(tiny_head_dir, num_blocks=64, num_speculative_tokens=2))
    profile = run_profile(engine, [1, 2], 2, context_len=16, repeats=1)
    assert profile.draft == str(tiny_head_dir)
    assert [b for b, _ in profile.draft_grid] == [1, 2] and all(s > 0 for _, s in profile.draft_grid)
    assert len(profile.acceptance) == 2 and set(profile.table) == {1, 2}


def test_the_shipped_head_drafts_for_the_embedded_default():
    """The head trained for SmolLM2-135M-Instruct, on the benchmark's edit prompts (which it never
    trained on): greedy text equal to plain decoding's (float32), and first drafts accepted far
    more often than a head read wrongly would be (about a fifth here, where such a head gets none)."""
    from cluster.models.loader import load_tokenizer, resolve_model
    from cluster.profiling.edit_prompts import build_prompt_ids

    prompts, _ = build_prompt_ids(load_tokenizer(resolve_model("smollm2-135m-instruct")), 4)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    settings = dict(num_blocks=128, dtype="float32")
    plain = run_to_completion(make_engine("smollm2-135m-instruct", **settings), prompts, params)
    engine = make_engine("smollm2-135m-instruct", **_eagle3("smollm2-135m-instruct-eagle3", num_speculative_tokens=3,
                                                            **settings))
    assert run_to_completion(engine, prompts, params) == plain
    spec = engine.stats().spec
    assert spec.accepted_per_position[0] / spec.reached_per_position[0] > 0.1
