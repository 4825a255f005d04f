"""Speculative decoding inside continuous batching: outputs are exactly the target's."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from cluster.shared.sampling_params import SamplingParams
from cluster.models.tiny import save_tiny_model, tiny_llama_config
from tests.engine_helpers import drain, make_engine, run_to_completion

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(seed=0, lengths=(5, 17, 30, 3, 44, 9)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def expected_greedy(tiny_llama_dir):
    return run_to_completion(make_engine(tiny_llama_dir, num_blocks=128), _prompts(), GREEDY)


SPEC_SETUPS = {  # (target, noisy draft, EAGLE-3 head) -> settings
    "self-draft": lambda t, d, h: dict(method="draft", draft_model=str(t)),
    "noisy-draft": lambda t, d, h: dict(method="draft", draft_model=str(d)),
    "ngram": lambda t, d, h: dict(method="ngram"),
    "suffix": lambda t, d, h: dict(method="suffix"),
    "eagle3": lambda t, d, h: dict(method="eagle3", draft_model=str(h)),
}


@pytest.mark.parametrize("setup", sorted(SPEC_SETUPS))
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_outputs_equal_plain_decoding(setup, k, tiny_llama_dir, noisy_draft_dir, tiny_head_dir,
                                             expected_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=128, num_speculative_tokens=k,
                     **SPEC_SETUPS[setup](tiny_llama_dir, noisy_draft_dir, tiny_head_dir))
    assert run_to_completion(engine, _prompts(), GREEDY) == expected_greedy
    spec = engine.stats().spec
    assert spec.num_draft_tokens > 0
    if setup == "self-draft":
        assert spec.num_accepted_tokens == spec.num_draft_tokens
    if setup in ("noisy-draft", "eagle3"):
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_preemption_and_small_budget(tiny_llama_dir, noisy_draft_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=14, block_size=8, max_num_batched_tokens=16,
                         num_speculative_tokens=3, method="draft", draft_model=str(noisy_draft_dir))
    assert run_to_completion(engine, _prompts(), GREEDY) == expected_greedy
    assert engine.stats().num_preemptions > 0


def test_prefix_cache_hits(tiny_llama_dir, noisy_draft_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=128, block_size=4, num_speculative_tokens=3,
                         method="draft", draft_model=str(noisy_draft_dir))
    assert run_to_completion(engine, _prompts(), GREEDY) == expected_greedy
    # Again, now with every prompt's full blocks in the prefix cache.
    assert run_to_completion(engine, _prompts(), GREEDY) == expected_greedy
    assert engine.stats().prefix_cache_hits > 0


@dataclass
class CyclingController:
    ks: tuple = (0, 3, 1, 0, 4, 2)
    step: int = 0

    def choose_k(self, state) -> int:
        self.step += 1
        return self.ks[self.step % len(self.ks)]

    def observe(self, obs) -> None:
        """Learns nothing."""


def test_k_changing_every_step_including_zero(tiny_llama_dir, noisy_draft_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=128, method="draft", draft_model=str(noisy_draft_dir))
    engine.controller = CyclingController()
    assert run_to_completion(engine, _prompts(), GREEDY) == expected_greedy
    assert set(engine.stats().spec.k_per_step) == {0, 1, 2, 3, 4}


def test_stops_inside_accepted_runs_and_limits(tiny_llama_dir, expected_greedy):
    engine = make_engine(tiny_llama_dir, num_blocks=128, num_speculative_tokens=4,
                     method="draft", draft_model=str(tiny_llama_dir))
    prompts = _prompts()
    stop_ids = [ref[7] for ref in expected_greedy]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[s]) for s in stop_ids]
    for got, ref, stop in zip(run_to_completion(engine, prompts, params), expected_greedy, stop_ids):
        assert got == ref[: ref.index(stop) + 1]
    for max_tokens in (1, 2, 6):
        short = run_to_completion(engine, prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        assert short == [ref[:max_tokens] for ref in expected_greedy]


def test_stop_string_inside_accepted_run_cuts_tokens_and_text(tiny_llama_dir):
    plain = make_engine(tiny_llama_dir, num_blocks=64)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain.add_request("The cat sat", params)
    text, ids = "", []
    while plain.has_unfinished():
        for out in plain.step():
            text, ids = out.outputs[0].text, out.outputs[0].token_ids
    stop = text[9:11]
    spec = make_engine(tiny_llama_dir, num_blocks=64, num_speculative_tokens=5, method="draft",
                   draft_model=str(tiny_llama_dir))
    spec.add_request("The cat sat", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    last = None
    while spec.has_unfinished():
        for out in spec.step():
            last = out.outputs[0]
    assert last.text == text[: text.index(stop)]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    # Token ids stop at the token that completed the stop string.
    decode = spec.tokenizer.decode
    completing = next(n for n in range(1, len(ids) + 1) if stop in decode(ids[:n], skip_special_tokens=True))
    assert last.token_ids == ids[:completing]


def test_seeded_sampling_with_speculation_is_reproducible(tiny_llama_dir, noisy_draft_dir):
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=s) for s in range(4)]
    runs = []
    for _ in range(2):
        engine = make_engine(tiny_llama_dir, num_blocks=128, num_speculative_tokens=3,
                         method="draft", draft_model=str(noisy_draft_dir))
        runs.append(run_to_completion(engine, _prompts(lengths=(4, 9, 14, 6)), params))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("setup", ["noisy-draft", "eagle3", "suffix"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_workload_with_speculation_and_aborts(tiny_llama_dir, noisy_draft_dir, tiny_head_dir, seed, setup):
    rng = random.Random(seed)
    engine = make_engine(tiny_llama_dir, num_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=32,
                     num_speculative_tokens=3, **SPEC_SETUPS[setup](tiny_llama_dir, noisy_draft_dir, tiny_head_dir))
    # what a proposer keeps per request: a head's target states, the suffix trees' prompt trees
    kept = getattr(engine.proposer, "states", None) or getattr(engine.proposer, "_active", {})
    engine.controller = CyclingController()
    live: set[str] = set()
    for step in range(250):
        if step < 120 and rng.random() < 0.4:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(max_tokens=rng.randint(1, 20), temperature=rng.choice([0, 1.0]),
                                    seed=rng.choice([None, 3]), ignore_eos=True)
            live.add(engine.add_request(prompt, params))
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                assert len(out.outputs[0].token_ids) <= 20
        engine.check_invariants()
        assert set(kept) <= set(engine.scheduler.requests)
    drain(engine, live)
    assert not live
    assert engine.block_manager.num_free_blocks == engine.block_manager.pool.num_blocks
    assert engine.stats().spec.num_draft_tokens > 0
    assert not kept


def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    other = save_tiny_model(tiny_llama_config(vocab_size=300), tmp_path / "other", seed=0)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine(tiny_llama_dir, num_blocks=32, method="draft", draft_model=str(other))


def test_draft_method_needs_a_draft_model(tiny_llama_dir):
    with pytest.raises(ValueError, match="draft_model"):
        make_engine(tiny_llama_dir, method="draft")
