"""A seeded request's text does not depend on speculation.

The reference is the same request decoded by the same engine without speculation (k = 0).
With coupled verification (the default for seeded requests) every draft length, controller,
batch partner and preemption must give that text token for token; rejection sampling
(``verification: rejection``) must not, or this test could not tell the two apart. An n-gram
engine samples as an engine without speculation does (inverse CDF); an engine with a draft model or
an EAGLE-3 head draws seeded tokens by an exponential race, so its text is its own. Float32 tiny models: bfloat16
numerics move with the batch shape.
"""

from __future__ import annotations

import random

import pytest

from cluster.shared.sampling_params import SamplingParams
from cluster.spec_decode.controller import AdaptiveController, TableController
from cluster.spec_decode.latency_model import LatencyModel
from tests.engine_helpers import make_engine, run_to_completion

SEEDED = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=1234, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9] * 4  # repeats, so n-gram lookup finds drafts
PROPOSERS = {
    "ngram": lambda target, noisy, head: dict(method="ngram"),
    "suffix": lambda target, noisy, head: dict(method="suffix"),
    "noisy-draft": lambda target, noisy, head: dict(method="draft", draft_model=str(noisy)),
    "self-draft": lambda target, noisy, head: dict(method="draft", draft_model=str(target)),
    "eagle3": lambda target, noisy, head: dict(method="eagle3", draft_model=str(head)),
}


class CyclingController:
    """k changes every step, 0 included."""

    def __init__(self) -> None:
        self.step = 0

    def choose_k(self, state) -> int:
        self.step += 1
        return (0, 3, 1, 8, 2, 0, 4)[self.step % 7]

    def observe(self, obs) -> None:
        """Learns nothing."""


def _controller(name: str):
    if name == "table":
        return TableController({1: 8, 2: 4, 4: 2, 6: 1})
    if name == "adaptive":  # switches and probes often
        model = LatencyModel([0.004, 0.001, 0.0005], [0.001, 0.0002])
        return AdaptiveController(model, [0.6] * 8, max_k=8, hysteresis=0.0, min_dwell_steps=1, explore_every=2,
                                  explore_budget=1.0)
    return CyclingController()


def _others(seed: int) -> tuple[list, list]:
    """Batch partners: unseeded, greedy and other seeded requests of several lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    params = [SamplingParams(max_tokens=rng.randint(4, 40), temperature=t, seed=s, ignore_eos=True)
              for t, s in ((1.0, None), (0.0, None), (0.9, 77), (1.0, None), (0.5, 3))]
    return prompts, params


def _run(target, alongside: bool, controller: str | None = None, num_blocks: int = 256, **overrides):
    engine = make_engine(target, num_blocks=num_blocks, block_size=4, **overrides)
    if controller is not None:
        engine.controller = _controller(controller)
    prompts, params = ([PROMPT], [SEEDED])
    if alongside:
        others, other_params = _others(len(overrides))
        prompts, params = others[:2] + prompts + others[2:], other_params[:2] + params + other_params[2:]
    outputs = run_to_completion(engine, prompts, params)
    return outputs[2 if alongside else 0], engine


@pytest.fixture(scope="module")
def plain(tiny_llama_dir, noisy_draft_dir, tiny_head_dir):
    """Per proposer, the seeded text at k = 0."""
    return {name: _run(tiny_llama_dir, False, num_speculative_tokens=0,
                       **settings(tiny_llama_dir, noisy_draft_dir, tiny_head_dir))[0]
            for name, settings in PROPOSERS.items()}


def test_plain_decoding_references(tiny_llama_dir, plain):
    """k = 0 with n-gram lookup is decoding without speculation; both draft-model engines race alike."""
    assert plain["ngram"] == _run(tiny_llama_dir, False)[0]
    assert plain["noisy-draft"] == plain["self-draft"] == plain["eagle3"] != plain["ngram"]


@pytest.mark.parametrize("alongside", [False, True], ids=["alone", "alongside"])
@pytest.mark.parametrize("proposer", sorted(PROPOSERS))
def test_every_fixed_k_gives_the_text_of_plain_decoding(tiny_llama_dir, noisy_draft_dir, tiny_head_dir, plain,
                                                         proposer, alongside):
    accepted = 0
    for k in (0, 1, 2, 4, 8):
        tokens, engine = _run(tiny_llama_dir, alongside, num_speculative_tokens=k,
                              **PROPOSERS[proposer](tiny_llama_dir, noisy_draft_dir, tiny_head_dir))
        assert tokens == plain[proposer], f"k={k}"
        accepted += engine.stats().spec.num_accepted_tokens
    assert accepted > 0, "no draft was accepted: the coupling was not exercised"


@pytest.mark.parametrize("controller", ["table", "adaptive", "cycling"])
@pytest.mark.parametrize("proposer", sorted(PROPOSERS))
def test_every_controller_gives_the_text_of_plain_decoding(tiny_llama_dir, noisy_draft_dir, tiny_head_dir, plain,
                                                            proposer, controller):
    tokens, engine = _run(tiny_llama_dir, True, controller, num_speculative_tokens=8,
                          **PROPOSERS[proposer](tiny_llama_dir, noisy_draft_dir, tiny_head_dir))
    assert tokens == plain[proposer]
    assert len(set(engine.stats().spec.k_per_step)) > 1, "the controller never changed k"


def test_preemption_keeps_the_text(tiny_llama_dir, noisy_draft_dir, plain):
    """A pool too small for the batch: requests are preempted and recomputed mid-stream."""
    tokens, engine = _run(tiny_llama_dir, True, "cycling", num_blocks=22, max_num_seqs=6,
                          method="draft", draft_model=str(noisy_draft_dir))
    assert engine.scheduler.num_preemptions > 0
    assert tokens == plain["noisy-draft"]


def test_rejection_sampling_depends_on_k(tiny_llama_dir, noisy_draft_dir, plain):
    """The check above can fail: verified by rejection sampling, the same seed walks another path."""
    texts = {tuple(_run(tiny_llama_dir, False, num_speculative_tokens=k, verification="rejection",
                        method="draft", draft_model=str(noisy_draft_dir))[0]) for k in (1, 2, 4)}
    assert texts - {tuple(plain["noisy-draft"])}


def test_unseeded_requests_keep_rejection_sampling(tiny_llama_dir, noisy_draft_dir):
    """auto couples seeded requests only: nothing is seeded on behalf of the others."""
    engine = make_engine(tiny_llama_dir, num_blocks=64, method="draft", draft_model=str(noisy_draft_dir))
    assert engine.worker.runner.own_seeds is None and engine.worker.runner.coupled
    run_to_completion(engine, [PROMPT] * 2, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    coupled = make_engine(tiny_llama_dir, num_blocks=64, verification="coupled", method="draft",
                          draft_model=str(noisy_draft_dir))
    coupled.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    coupled.step()
    assert len(coupled.worker.runner.own_seeds) == 1


def test_n_choices_with_a_seed_are_distinct_and_reproducible(tiny_llama_dir):
    """The API gives choice j the seed ``seed + j``: each its own stream."""
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=40 + j, ignore_eos=True) for j in range(4)]
    first = run_to_completion(make_engine(tiny_llama_dir, num_blocks=64, method="ngram"), [PROMPT] * 4, params)
    again = run_to_completion(make_engine(tiny_llama_dir, num_blocks=64), [PROMPT] * 4, params)
    assert first == again
    assert len({tuple(t) for t in first}) == 4
