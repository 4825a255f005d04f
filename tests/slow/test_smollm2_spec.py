"""Speculative decoding on the embedded default: greedy tokens equal plain decoding."""

from __future__ import annotations

import pytest

from cluster.engine.llm import LLM
from cluster.shared.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is",
    "List the numbers from one to twenty: one, two, three, four, five,",
]
PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="128MiB")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_ngram_speculation_matches_plain_greedy(expected):
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="128MiB",
              method="ngram", num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens > 0
    llm.engine.check_invariants()


def test_self_draft_accepts_every_token(expected):
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_memory="128MiB",
              method="draft", draft_model="smollm2-135m-instruct", num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == expected
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0


def test_batch_invariant_bfloat16_keeps_greedy_output_at_batch_4():
    # bfloat16 rounding differs between the few-row and the oneDNN paths, so without
    # model.batch_invariant a batch of 4 verifying drafts often lands on other tokens.
    settings = dict(dtype="bfloat16", device="cpu", kv_cache_memory="128MiB", max_num_seqs=4, batch_invariant=True)
    alone = [LLM("smollm2-135m-instruct", **settings).generate([p], PARAMS)[0].outputs[0].token_ids
             for p in PROMPTS[:1]]
    plain = LLM("smollm2-135m-instruct", **settings)
    batched = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, PARAMS)]
    spec = LLM("smollm2-135m-instruct", method="ngram", num_speculative_tokens=4, **settings)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, PARAMS)] == batched
    assert batched[0] == alone[0]
    assert spec.engine.stats().spec.num_accepted_tokens > 0
