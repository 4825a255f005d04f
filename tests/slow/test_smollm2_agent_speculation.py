"""Agent conversations on the embedded default (``tandem bench agent``'s loop, smaller): turns
whose tool_choice names a function, is ``required`` or ``auto``, over long tool results (file
contents, search hits, pytest reports), greedy and batch-invariant. With n-gram and suffix
drafts every turn's tokens equal plain decoding's, and no forced call ends in a grammar dead
end: drafts copy earlier calls and their end of text, which once broke the grammar (issue 71)."""

from __future__ import annotations

import pytest

from cluster.bench.agent import CHOICES, compare, play
from cluster.engine.llm import LLM

pytestmark = pytest.mark.slow

CONVERSATIONS, TURNS, MAX_TOKENS = 4, 3, 96


def _play(**speculation) -> tuple[list, LLM]:
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="512MiB", max_model_len=8192,
              batch_invariant=True, **speculation)
    try:
        return play(llm, CONVERSATIONS, TURNS, MAX_TOKENS, batch_size=1), llm
    finally:
        llm.engine.worker.close()


@pytest.fixture(scope="module")
def plain() -> list:
    records, _ = _play()
    result = compare(records, records)
    assert result["turns"] == CONVERSATIONS * TURNS and {r.choice for r in records} == set(CHOICES)
    assert result["dead_ends"] == 0 and result["forced_parsed"] == result["forced_calls"]
    return records


@pytest.mark.parametrize("speculation", [
    {"method": "ngram", "num_speculative_tokens": 6, "ngram_draft_per_match_token": None},
    {"method": "suffix", "num_speculative_tokens": 8},
], ids=["ngram", "suffix"])
def test_agent_turns_are_plain_decodings_tokens(plain, speculation):
    if speculation["method"] == "suffix":
        pytest.importorskip("arctic_inference", reason="arctic-inference is built by `make install`")
    records, llm = _play(controller="fixed", **speculation)
    result = compare(records, plain)
    assert result["first_differences"] == [] and result["same_as_plain"] == len(plain)
    assert result["dead_ends"] == 0 and result["forced_parsed"] == result["forced_calls"]
    assert llm.engine.spec_stats.num_accepted_tokens > 0
