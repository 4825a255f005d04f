"""Drafts past the verified k: scored against the tokens the request goes on to produce, they say
what verifying them would have accepted (exactly, where they were verified), and the adaptive
controller learns the deep positions from them without verifying them."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.request import Request
from cluster.shared.sampling_params import SamplingParams
from cluster.shared.scheduled import ScheduledRequest
from cluster.spec_decode.controller import AdaptiveController, BatchState, StepObservation
from cluster.spec_decode.lookahead import LookaheadDrafts
from cluster.spec_decode.prior import prior_model
from cluster.spec_decode.stats import SpecDecodeStats
from tests.engine_helpers import make_engine, run_to_completion


class FixedDrafts:
    """A proposer that drafts the given tokens, as many as each request was asked for."""

    free_lookahead = True

    def __init__(self, drafts: dict[str, list[int]]) -> None:
        self.drafts = drafts
        self.asked: dict[str, int] = {}

    def propose(self, scheduled, block_tables) -> DraftProposal:
        self.asked = {s.request.request_id: s.num_draft_tokens for s in scheduled}
        return DraftProposal({s.request.request_id: self.drafts[s.request.request_id][: s.num_draft_tokens]
                              for s in scheduled if s.num_draft_tokens}, None)


def _decoding(rid: str, output: list[int], k: int) -> ScheduledRequest:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=64), eos_token_id=None)
    request.append_output_token_ids(output)
    return ScheduledRequest(request, request.num_tokens - 1, 1, k)


def test_the_step_verifies_k_and_the_rest_is_scored_as_the_request_goes_on():
    proposer = FixedDrafts({"a": [7, 8, 9, 10, 11], "b": [5, 5, 5, 5, 5], "c": []})
    ahead = LookaheadDrafts(proposer, depth=5)
    a, b, c = _decoding("a", [6], 2), _decoding("b", [4], 2), _decoding("c", [4], 2)
    drafts = ahead.propose([a, b, c], [[], [], []], lambda request, depth: depth if request.request_id != "b" else 4)
    assert proposer.asked == {"a": 5, "b": 4, "c": 5}  # asked for the depth (b: its room), verified k
    assert drafts.token_ids == {"a": [7, 8], "b": [5, 5]}
    a.request.append_output_token_ids([7, 8, 9])  # accepted 2 and the bonus token agreed with the draft
    b.request.append_output_token_ids([5, 6])  # rejected at position 2
    ahead.score([a.request, b.request, c.request])
    assert sorted(ahead.take()) == [(4, 4, 1), (5, 0, 0)]  # b's: 1 of its 4 tokens; c proposed nothing
    a.request.append_output_token_ids([10])
    ahead.score([a.request])
    assert ahead.take() == []  # a's fifth token is not known yet
    a.request.append_output_token_ids([11, 12])
    ahead.score([a.request])
    assert ahead.take() == [(5, 5, 5)]


def test_a_draft_that_differs_is_scored_at_once_and_an_ended_request_drops_the_rest():
    proposer = FixedDrafts({"a": [7, 8, 9]})
    ahead = LookaheadDrafts(proposer, depth=3)
    a = _decoding("a", [6], 0)
    assert ahead.propose([a], [[]], lambda request, depth: depth) is None  # k = 0: nothing verified
    a.request.append_output_token_ids([3])
    ahead.score([a.request])
    assert ahead.take() == [(3, 3, 0)]
    a2 = _decoding("a", [6, 3], 0)
    ahead.propose([a2], [[]], lambda request, depth: depth)
    a2.request.append_output_token_ids([7])
    ahead.score([a2.request])
    ahead.free("a")
    a2.request.append_output_token_ids([8, 9])
    ahead.score([a2.request])
    assert ahead.take() == []


def test_a_prompt_chunk_is_not_asked_for_drafts():
    proposer = FixedDrafts({"p": [1, 2]})
    ahead = LookaheadDrafts(proposer, depth=2)
    request = Request("p", list(range(10)), SamplingParams(max_tokens=8), eos_token_id=None)
    assert ahead.propose([ScheduledRequest(request, 0, 4, 0)], [[]], lambda r, d: d) is None
    assert proposer.asked == {}


@dataclass
class HeldK:
    """Holds one k and keeps what the engine reports."""

    k: int
    max_k: int
    drafts: list = field(default_factory=list)

    def choose_k(self, state) -> int:
        return self.k

    def observe(self, obs: StepObservation) -> None:
        self.drafts.extend(obs.drafts)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    motifs = [[rng.randrange(3, 256) for _ in range(4)] for _ in range(3)]
    return [m * 5 + [rng.randrange(3, 256) for _ in range(n)] for m, n in zip(motifs, (3, 7, 11))]


def _engine_held_at(tiny_llama_dir, method: str, k: int, depth: int):
    engine = make_engine(tiny_llama_dir, num_blocks=128, method=method, num_speculative_tokens=depth,
                         max_num_batched_tokens=512)
    engine.controller = HeldK(k, depth)
    engine.lookahead = LookaheadDrafts(engine.proposer, depth)
    return engine


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_scored_drafts_are_what_verification_accepted_where_they_were_verified(tiny_llama_dir, method, temperature):
    if method == "suffix":
        pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")
    engine = _engine_held_at(tiny_llama_dir, method, k=4, depth=4)
    params = SamplingParams(max_tokens=24, temperature=temperature, ignore_eos=True, seed=3)
    run_to_completion(engine, _prompts(0), params)
    scored = SpecDecodeStats()
    for asked, proposed, accepted in engine.controller.drafts + engine.lookahead.take():
        scored.record_request(proposed, accepted, asked)
    verified = engine.stats().spec
    assert verified.num_draft_tokens > 0
    if temperature == 0:
        assert verified.num_accepted_tokens > 0
    for name in ("asked_per_position", "proposed_per_position", "accepted_per_position",
                 "asked_reached_per_position"):
        assert getattr(scored, name) == getattr(verified, name), name


def test_a_small_k_learns_the_deep_positions_and_outputs_stay_the_targets(tiny_llama_dir):
    """Replayed prompts (their answers in the suffix trees) at k = 1: the drafts of 4 are scored."""
    pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = run_to_completion(make_engine(tiny_llama_dir, num_blocks=128), _prompts(1), greedy)
    engine = _engine_held_at(tiny_llama_dir, "suffix", k=1, depth=4)
    for _ in range(2):
        engine.controller.drafts.clear()
        engine.lookahead.take()
        assert run_to_completion(engine, _prompts(1), greedy) == plain
    records = engine.controller.drafts + engine.lookahead.take()
    deep = [accepted for asked, _, accepted in records if asked == 4]  # (less room near max_tokens)
    assert sum(accepted == 4 for accepted in deep) > len(deep) / 2  # past k = 1, seen as hits
    assert len(engine.stats().spec.asked_per_position) == 1  # yet only position 1 was verified


def test_the_controller_leaves_a_small_k_once_the_deep_positions_are_seen_to_pay():
    """The diagnosis this answers: on replayed agent turns a batch of 8 held k = 2 with positions 3-8
    at the prior's 0.5, never drafted, never learnt. Fed scored drafts of 8, it goes deep."""
    def controller() -> AdaptiveController:
        c = AdaptiveController(prior_model("suffix", "cpu"), [0.5] * 8, 8, calibration_steps=0,
                               explore_every=10 ** 9)
        c.acceptance[:2] = [0.85, 0.9]
        c.k = 2
        return c

    blind, seeing = controller(), controller()
    for _ in range(200):
        for c in (blind, seeing):
            c.choose_k(BatchState(8, 0))
        step = dict(batch_size=8, k=2, seconds=1.0 + 0.02 * 8 * 3)
        blind.observe(StepObservation(drafts=[(2, 2, 2)] * 8, **step))
        seeing.observe(StepObservation(drafts=[(8, 8, 8)] * 6 + [(8, 8, 1)] * 2, **step))
    assert blind.acceptance[2:] == [0.5] * 6 and blind.choose_k(BatchState(8, 0)) == 2
    assert min(seeing.acceptance) > 0.7
    assert seeing.choose_k(BatchState(8, 0)) > 4
