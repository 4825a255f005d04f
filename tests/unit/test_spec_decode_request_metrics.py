"""Per-request speculation figures: the engine counts each request's drafts (``SpecDecodeCounts``),
which add up to its replica-wide counters; the last delta carries them across the engine core's hop;
asked for, the OpenAI bodies carry them in vLLM's ``metrics.speculative_decoding``."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import ValidationError

from cluster.api.openai_protocol import CompletionRequest
from cluster.api.openai_responses import ChoiceState, chat_body, completion_body, spec_decode_metrics, usage
from cluster.config_serve import ServeConfig
from cluster.hosting.engine_view import output_delta
from cluster.hosting.protocol import GenerateDelta, GenerateRequest, merge_deltas
from cluster.routing.group_router import GroupRouter
from cluster.routing.stats import RoutingRequest
from cluster.shared.outputs import SpecDecodeCounts
from cluster.shared.sampling_params import SamplingParams
from deployments import streams
from deployments.streams import ChoiceStream
from tests.engine_helpers import make_engine
from tests.unit.test_delta_feeds import _Backend, _Handle, _replica

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# Prompts that repeat themselves, so n-gram lookup finds matches to draft from.
PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [9], [20, 21] * 10, list(range(30, 60))]


def _run(engine, prompts, params=GREEDY):
    """Step to the end: every request's outputs in order, and its last one's delta (as the core sends it)."""
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
        engine.check_invariants()
    return [outputs[rid] for rid in ids]


@pytest.mark.parametrize("setup", ["ngram", "noisy-draft-preempted"])
def test_each_requests_counts_add_up_to_the_engines(setup, tiny_llama_dir, noisy_draft_dir):
    if setup == "ngram":
        engine = make_engine(tiny_llama_dir, num_blocks=128, method="ngram", num_speculative_tokens=3)
    else:  # few blocks: requests are preempted and recomputed, their counts go on
        engine = make_engine(tiny_llama_dir, num_blocks=14, block_size=8, num_speculative_tokens=3,
                             method="draft", draft_model=str(noisy_draft_dir))
    runs = _run(engine, PROMPTS)
    finals = [outs[-1].spec_decode for outs in runs]
    spec = engine.stats().spec
    assert spec.num_draft_tokens > 0
    assert sum(c.num_spec_steps for c in finals) == spec.num_drafts
    assert sum(c.num_draft_tokens for c in finals) == spec.num_draft_tokens
    assert sum(c.num_accepted_tokens for c in finals) == spec.num_accepted_tokens
    if setup != "ngram":
        assert engine.stats().num_preemptions > 0
    for outs in runs:
        counts = outs[-1].spec_decode
        assert sum(counts.acceptance_histogram) == counts.num_spec_steps
        assert sum(j * n for j, n in enumerate(counts.acceptance_histogram)) == counts.num_accepted_tokens
        assert len(counts.acceptance_histogram) <= 4  # up to k = 3 accepted
        steps = [o.spec_decode.num_spec_steps for o in outs]
        assert steps == sorted(steps)  # cumulative
        if counts.num_spec_steps:
            assert counts.mean_acceptance_length == 1 + counts.num_accepted_tokens / counts.num_spec_steps
        # Across the core's hop: only the last delta carries them.
        assert [output_delta(o).spec_decode for o in outs] == [None] * (len(outs) - 1) + [counts]


def test_without_speculation_the_counts_are_zero(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_blocks=64)
    runs = _run(engine, PROMPTS[:2])
    assert engine.stats().spec is None
    for outs in runs:
        assert all(o.spec_decode == SpecDecodeCounts() for o in outs)
        assert output_delta(outs[-1]).spec_decode == SpecDecodeCounts()


def test_counts_step_by_step_and_added_together():
    counts = SpecDecodeCounts().add_step(3, 3, 1).add_step(3, 0, 0).add_step(2, 2, 2)
    assert counts == SpecDecodeCounts(2, 5, 3, (0, 1, 1, 0))  # the step that proposed nothing does not count
    assert counts.mean_acceptance_length == 2.5 and counts.draft_acceptance_rate == 0.6
    assert SpecDecodeCounts().add_step(2, 0, 0) == SpecDecodeCounts(0, 0, 0, (0, 0, 0))
    assert SpecDecodeCounts().mean_acceptance_length is None and SpecDecodeCounts().draft_acceptance_rate is None
    both = counts + SpecDecodeCounts().add_step(1, 1, 0)
    assert both == SpecDecodeCounts(3, 6, 3, (1, 1, 1, 0))


def test_the_metrics_object_is_vllms():
    a, b = ChoiceState(0), ChoiceState(1)
    a.add(GenerateDelta(token_ids=[1], num_output_tokens=1))
    assert a.spec_decode is None
    a.add(GenerateDelta(token_ids=[2], finish_reason="length", num_output_tokens=2,
                        spec_decode=SpecDecodeCounts(2, 4, 3, (0, 1, 1))))
    b.add(GenerateDelta(finish_reason="length", spec_decode=SpecDecodeCounts(1, 2, 0, (1, 0, 0))))
    spec = spec_decode_metrics([a, b])["speculative_decoding"]
    assert spec == {"mean_acceptance_length": 2.0, "draft_acceptance_rate": 0.5, "acceptance_histogram": [1, 1, 1],
                    "num_spec_steps": 3, "num_accepted_draft_tokens": 3, "num_draft_tokens": 6, "num_spec_tokens": 2}
    # A group whose engine counts nothing per request (vLLM's): null, not zeros.
    assert spec_decode_metrics([ChoiceState(0)]) == {"speculative_decoding": None}
    zero = ChoiceState(0, spec_decode=SpecDecodeCounts())
    assert spec_decode_metrics([zero])["speculative_decoding"]["mean_acceptance_length"] is None
    use = usage([a, b], [0, 0])
    metrics = spec_decode_metrics([a, b])
    assert completion_body("c", 1, "m", [a, b], use, False, metrics=metrics)["metrics"] == metrics
    assert chat_body("c", 1, "m", [a], use, None, metrics=metrics)["metrics"] == metrics
    assert "metrics" not in completion_body("c", 1, "m", [a, b], use, False)
    assert "metrics" not in chat_body("c", 1, "m", [a], use, None)


def test_merged_deltas_keep_the_counts():
    counts = SpecDecodeCounts(1, 2, 2, (0, 0, 1))
    assert merge_deltas(GenerateDelta(token_ids=[1]), GenerateDelta(token_ids=[2], spec_decode=counts)).spec_decode \
        == counts
    assert merge_deltas(GenerateDelta(token_ids=[1]), GenerateDelta(token_ids=[2])).spec_decode is None


def test_the_request_field_and_the_server_setting():
    assert CompletionRequest(model="m", prompt="hi").return_spec_decode_metrics is False
    assert CompletionRequest(model="m", prompt="hi", return_spec_decode_metrics=True).return_spec_decode_metrics
    with pytest.raises(ValidationError):
        CompletionRequest(model="m", prompt="hi", return_spec_decode_metrics="yes")
    assert ServeConfig().per_request_spec_decode_metrics == "none"
    assert ServeConfig(per_request_spec_decode_metrics="summary").per_request_spec_decode_metrics == "summary"
    with pytest.raises(ValidationError, match="per_request_spec_decode_metrics"):
        ServeConfig(per_request_spec_decode_metrics="detailed")


class _CountingBackend(_Backend):
    """Three tokens, the last delta with the request's counts, as the engine core sends them."""

    COUNTS = SpecDecodeCounts(1, 2, 1, (0, 1, 0))

    async def generate(self, request: GenerateRequest):
        yield GenerateDelta(accepted=True, num_prompt_tokens=2)
        for i in range(3):
            await asyncio.sleep(0.001)
            last = i == 2
            yield GenerateDelta(text=f"t{i} ", token_ids=[i], num_prompt_tokens=2, num_output_tokens=i + 1,
                                finish_reason="length" if last else None, spec_decode=self.COUNTS if last else None)


def _events(body: dict, spec_metrics: bool) -> list:
    """The server-sent events of a streamed completion of two choices, parsed (``[DONE]`` as a string)."""
    async def scenario():
        handle = _Handle(_replica(_CountingBackend()))
        router = GroupRouter({"g": 1}, policy="pow2", seed=0)
        choices = []
        for i in range(2):
            request = GenerateRequest(f"cmpl-x-{i}", [1, 2], SamplingParams(max_tokens=3),
                                      routing=RoutingRequest(num_prompt_tokens=2, expected_output_tokens=3))
            choice = ChoiceStream(i, 0, {"g": request}, {"g": handle})
            await choice.start(router)
            choices.append(choice)
        parsed = CompletionRequest(model="m", prompt="hi", n=2, stream=True, **body)
        return [event async for event in streams._sse(choices, parsed, False, "m", None, spec_metrics)]

    events = asyncio.run(scenario())
    return [e.removeprefix("data: ").strip() if "[DONE]" in e else json.loads(e.removeprefix("data: "))
            for e in events]


def test_streamed_the_figures_come_in_the_last_chunk_with_the_usage():
    *chunks, done = _events({}, spec_metrics=True)
    assert done == "[DONE]"
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6  # usage comes with them
    assert last["metrics"]["speculative_decoding"]["num_spec_steps"] == 2
    assert last["metrics"]["speculative_decoding"]["num_draft_tokens"] == 4
    assert all("metrics" not in c for c in chunks[:-1])
    with_usage = _events({"stream_options": {"include_usage": True}}, spec_metrics=True)
    assert with_usage[-2]["metrics"] == last["metrics"]
    # Not asked for: no metrics, and no usage chunk unless include_usage.
    *plain, _ = _events({}, spec_metrics=False)
    assert all("metrics" not in c for c in plain) and all(c["choices"] for c in plain)
    *usage_only, _ = _events({"stream_options": {"include_usage": True}}, spec_metrics=False)
    assert usage_only[-1]["choices"] == [] and "metrics" not in usage_only[-1]
