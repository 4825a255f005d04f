"""The suffix proposer: what it drafts from (other requests' responses, the request's own prompt),
how deep (its match's evidence, under the batch's k), and what it keeps (prompt trees freed at
the end, responses evicted first in, first out)."""

from __future__ import annotations

import pytest

from cluster.config import ConfigError, TandemConfig, with_overrides
from cluster.planning.cli import speculation_problems
from cluster.shared.request import Request
from cluster.shared.sampling_params import SamplingParams
from cluster.shared.scheduled import ScheduledRequest
from cluster.spec_decode.suffix import SuffixProposer
from cluster.spec_decode.suffix_stats import MATCH_LEN_BUCKETS
from tests.engine_helpers import make_engine, run_to_completion

pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")


def _request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=64), eos_token_id=None)
    request.append_output_token_ids(list(output))
    return request


def _step(request: Request, k: int) -> ScheduledRequest:
    return ScheduledRequest(request, request.num_tokens - 1, 1, k)


def _propose(proposer: SuffixProposer, *pairs: tuple[Request, int]) -> dict[str, list[int]]:
    return proposer.propose([_step(r, k) for r, k in pairs], [[] for _ in pairs]).token_ids


def test_a_response_drafts_for_another_request_while_it_grows():
    proposer = SuffixProposer()
    writer = _request("writer", [1, 2], [10, 11, 12, 13, 14, 15, 16, 17])
    reader = _request("reader", [7, 8, 9], [10, 11, 12, 13])
    drafts = _propose(proposer, (writer, 0), (reader, 8))
    # the reader matched 4 tokens of the writer's in-flight response: at most 4 x max_spec_factor drafts
    assert drafts == {"reader": [14, 15, 16, 17]}
    assert proposer.tree_stats.num_cached_tokens == 12
    assert proposer.tree_stats.num_active_requests == 2


def test_the_batch_k_caps_each_request_and_no_match_drafts_nothing():
    proposer = SuffixProposer(max_spec_factor=4.0)
    writer = _request("writer", [1], [10, 11, 12, 13, 14, 15, 16, 17, 18])
    reader = _request("reader", [5], [10, 11])
    stranger = _request("stranger", [6], [40, 41])
    drafts = _propose(proposer, (writer, 0), (reader, 3), (stranger, 3))
    assert drafts == {"reader": [12, 13, 14]}
    counts = proposer.tree_stats.match_len_counts
    assert sum(counts) == 2  # reader and stranger asked
    assert counts[MATCH_LEN_BUCKETS.index(2)] >= 1  # the reader's 2-token match (the stranger's own tail: 1-2)


def test_the_prompt_drafts_for_its_own_request_and_is_freed_at_the_end():
    proposer = SuffixProposer()
    prompt = [3, 4, 5, 6, 7, 8, 9, 20, 21, 22]
    request = _request("r", prompt, [5, 6, 7])
    assert _propose(proposer, (request, 3)) == {"r": [8, 9, 20]}
    other = _request("o", [30, 31], [5, 6, 7])
    assert _propose(proposer, (other, 3)) == {}  # another request's prompt is not its evidence
    proposer.free("r")
    assert "r" not in proposer.cache.active_requests and "r" in proposer.cache.cached_requests
    assert proposer.tree_stats.num_active_requests == 1


def test_the_last_tokens_join_the_tree_when_the_request_is_freed():
    proposer = SuffixProposer()
    first = _request("first", [1], [50, 51])
    _propose(proposer, (first, 2))
    first.append_output_token_ids([52, 53, 54])  # its last step: no proposal saw these
    proposer.free("first")
    later = _request("later", [2], [50, 51])
    assert _propose(proposer, (later, 3)) == {"later": [52, 53]}  # a 2-token match drafts up to 2


def test_finished_responses_are_evicted_first_in_first_out():
    proposer = SuffixProposer(max_cached_requests=2)
    for i in range(4):
        request = _request(f"r{i}", [1], [100 + i, 200 + i, 300 + i])
        _propose(proposer, (request, 0))
        proposer.free(f"r{i}")
    assert set(proposer.cache.cached_requests) == {"r2", "r3"}
    stats = proposer.tree_stats
    assert (stats.num_cached_requests, stats.num_cached_tokens, stats.num_evicted_requests) == (2, 6, 2)
    assert stats.num_active_requests == 0
    # a new request takes a place too: its start evicts r2, and r3's response still drafts
    assert _propose(proposer, (_request("q", [9], [103, 203]), 4)) == {"q": [303]}
    assert proposer.tree_stats.num_evicted_requests == 3
    assert _propose(proposer, (_request("q2", [9], [100, 200]), 4)) == {}  # r0's response is gone


def _finish(proposer: SuffixProposer, rid: str, output: list[int]) -> None:
    _propose(proposer, (_request(rid, [1], output), 0))
    proposer.free(rid)


def test_a_new_replica_drafts_from_the_responses_another_gave_it():
    running = SuffixProposer(warm_start_requests=2)
    for i in range(3):
        _finish(running, f"r{i}", [60 + i, 70 + i, 80 + i, 90 + i])
    history = running.history(5)
    assert history == [[61, 71, 81, 91], [62, 72, 82, 92]]  # the latest two, oldest first
    assert running.history(1) == [[62, 72, 82, 92]] and running.history(0) == []

    cold, warm = SuffixProposer(), SuffixProposer(warm_start_requests=2)
    assert warm.seed(history + [[]]) == 2  # an empty response is skipped
    asker = _request("q", [5], [62, 72])
    assert _propose(cold, (asker, 4)) == {}
    assert _propose(warm, (_request("q", [5], [62, 72]), 4)) == {"q": [82, 92]}
    stats = warm.tree_stats
    assert (stats.num_cached_requests, stats.num_cached_tokens) == (3, 10)  # two seeded, and q itself
    assert warm.history(5) == history  # a seeded replica passes them on in turn


def test_seeded_responses_are_evicted_before_the_replicas_own():
    proposer = SuffixProposer(max_cached_requests=2)
    assert proposer.seed([[1, 2, 3], [4, 5, 6]]) == 2
    _finish(proposer, "own", [7, 8, 9])
    assert len(proposer.cache.cached_requests) == 2 and "own" in proposer.cache.cached_requests
    assert proposer.tree_stats.num_evicted_requests == 1
    assert proposer.history(5) == []  # warm_start_requests 0: nothing kept to give
    assert SuffixProposer(max_cached_requests=0).seed([[1, 2]]) == 0  # no replica-wide tree to seed


def test_the_engine_gives_and_takes_responses_only_with_suffix_drafts(tiny_llama_dir):
    giver = make_engine(tiny_llama_dir, method="suffix", num_blocks=64)
    run_to_completion(giver, [[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    [response] = giver.suffix_history(10)
    assert len(response) == 6
    taker = make_engine(tiny_llama_dir, method="suffix", num_blocks=64)
    assert taker.seed_suffix([response]) == 1
    assert taker.proposer.tree_stats.num_cached_tokens == 6
    plain = make_engine(tiny_llama_dir, num_blocks=64)
    assert plain.suffix_history(10) == [] and plain.seed_suffix([response]) == 0


def test_method_suffix_through_the_config_and_config_check(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64, method="suffix", suffix_decoding_max_tree_depth=8,
                         suffix_decoding_max_spec_factor=2.0, suffix_decoding_min_token_prob=0.3)
    proposer = engine.proposer
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.max_tree_depth, proposer.max_spec_factor, proposer.min_token_prob) == (8, 2.0, 0.3)
    config = with_overrides(TandemConfig(), method="suffix")
    assert speculation_problems(config) == []  # installed here
    with pytest.raises(ConfigError):
        with_overrides(TandemConfig(), method="suffix", suffix_decoding_min_token_prob=1.5)


def test_profiling_times_suffix_proposals_and_measures_their_acceptance(tiny_llama_dir):
    from cluster.profiling.profiler import run_profile

    engine = make_engine(tiny_llama_dir, num_blocks=64, method="suffix", num_speculative_tokens=2)
    profile = run_profile(engine, [1, 2], 2, context_len=16, repeats=1)
    assert profile.draft == "suffix"
    assert [b for b, _ in profile.draft_grid] == [1, 2] and all(s > 0 for _, s in profile.draft_grid)
    assert len(profile.acceptance) == 2 and len(profile.coverage) == 2 and set(profile.table) == {1, 2}
    assert not engine.proposer.cache.active_requests  # the timing trees are the profiler's own


def test_without_arctic_inference_config_check_and_the_start_say_so(tiny_llama_dir, monkeypatch):
    import importlib.util

    from cluster.spec_decode import suffix

    real = importlib.util.find_spec
    monkeypatch.setattr(suffix.importlib.util, "find_spec",
                        lambda name, *a: None if name == "arctic_inference" else real(name, *a))
    [line] = speculation_problems(with_overrides(TandemConfig(), method="suffix"))
    assert line.startswith("default: speculative.method suffix needs the arctic-inference package")  # the group
    assert speculation_problems(with_overrides(TandemConfig(), method="ngram")) == []
    monkeypatch.setitem(__import__("sys").modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ConfigError, match="arctic-inference"):
        make_engine(tiny_llama_dir, num_blocks=64, method="suffix")
