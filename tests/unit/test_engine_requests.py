"""The ingress settles each choice's engine request once, per replica group: max_tokens
against the group's context, the routing description with the group's block hashes."""

from __future__ import annotations

import pytest

from cluster.api.engine_requests import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    ROUTING_DEFAULT_OUTPUT_TOKENS,
    GroupShape,
    choice_requests,
    truncated_prompt,
)
from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.errors import ParamError
from cluster.routing.prefix_hashes import leading_block_hashes

SHAPES = {"short": GroupShape(block_size=4, hash_seed=1, max_model_len=64),
          "long": GroupShape(block_size=8, hash_seed=2, max_model_len=4096)}
PROMPT = list(range(20))


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def build(body, chat_route: bool, prompt=PROMPT, choice: int = 0):
    return choice_requests(body, chat_route, "req-0", prompt, choice, SHAPES, prefix_blocks=3, num_logprobs=None)


def test_chat_without_max_tokens_gets_the_room_left_in_each_groups_context():
    requests = build(chat(), True)
    assert requests["short"].sampling_params.max_tokens == 64 - len(PROMPT)
    assert requests["long"].sampling_params.max_tokens == 4096 - len(PROMPT)
    # The router assumes a nominal length, not the bound, bounded by the room.
    assert requests["long"].routing.expected_output_tokens == ROUTING_DEFAULT_OUTPUT_TOKENS
    assert requests["short"].routing.expected_output_tokens == 64 - len(PROMPT)


def test_completion_without_max_tokens_gets_openais_16_everywhere():
    for request in build(completion(), False).values():
        assert request.sampling_params.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
        assert request.routing.expected_output_tokens == COMPLETION_DEFAULT_MAX_TOKENS


def test_a_given_max_tokens_is_kept_and_routed_by():
    for body, route in ((chat(max_completion_tokens=300), True), (completion(max_tokens=300), False)):
        for request in build(body, route).values():
            assert request.sampling_params.max_tokens == 300
            assert request.routing.expected_output_tokens == 300


def test_a_group_whose_context_cannot_hold_the_prompt_and_max_tokens_is_left_out():
    # 20 prompt tokens: "short" (64) holds 44 more, "long" (4096) 4076.
    for body, route in ((chat(max_completion_tokens=300), True), (completion(max_tokens=300), False)):
        assert list(build(body, route)) == ["long"]
    assert sorted(build(completion(max_tokens=44), False)) == ["long", "short"]
    assert list(build(chat(), True, prompt=list(range(100)))) == ["long"]  # the prompt alone is past "short"


@pytest.mark.parametrize("body, route, field", [(completion(max_tokens=5000), False, "max_tokens"),
                                                (chat(max_tokens=5000), True, "max_tokens"),
                                                (chat(max_completion_tokens=5000), True, "max_completion_tokens")])
def test_max_tokens_that_no_context_holds_is_refused_naming_the_numbers(body, route, field):
    with pytest.raises(ParamError) as err:
        build(body, route)
    assert err.value.param == field
    # vLLM's server's words, which clients parse to retry with a smaller max_tokens.
    assert str(err.value) == ("'max_tokens' or 'max_completion_tokens' is too large: 5000. This model's maximum "
                              "context length is 4096 tokens and your request has 20 input tokens (5000 > 4096 - 20)")


def test_a_prompt_past_every_context_still_gets_valid_requests_for_the_engines_to_refuse():
    requests = build(chat(max_tokens=10), True, prompt=list(range(5000)))
    assert sorted(requests) == ["long", "short"]
    assert all(r.sampling_params.max_tokens == 10 for r in requests.values())
    assert build(chat(), True, prompt=list(range(5000)))["short"].sampling_params.max_tokens == 1


def test_a_default_max_tokens_caps_min_tokens_but_a_given_one_is_checked():
    requests = build(chat(min_tokens=500), True)
    assert requests["short"].sampling_params.min_tokens == 64 - len(PROMPT)
    assert requests["long"].sampling_params.min_tokens == 500
    with pytest.raises(ParamError) as err:
        build(chat(min_tokens=500, max_tokens=10), True)
    assert err.value.param == "min_tokens"


def test_routing_carries_each_groups_own_block_hashes_and_the_prompt_length():
    body = chat(cache_salt="tenant-a")
    requests = build(body, True)
    for group, shape in SHAPES.items():
        routing = requests[group].routing
        assert routing.num_prompt_tokens == len(PROMPT)
        assert routing.prefix_hashes == leading_block_hashes(PROMPT, shape.block_size, shape.hash_seed, 3,
                                                             "tenant-a")
        assert len(routing.prefix_hashes) == min(3, len(PROMPT) // shape.block_size)
    assert requests["short"].routing.prefix_hashes != requests["long"].routing.prefix_hashes


def test_every_group_gets_the_same_request_id_prompt_and_choice_seed():
    requests = build(chat(seed=7, n=2), True, choice=1)
    assert {r.request_id for r in requests.values()} == {"req-0"}
    assert all(r.prompt_token_ids == PROMPT and r.sampling_params.seed == 8 for r in requests.values())
    assert all(r.cache_salt is None for r in requests.values())


def test_truncate_prompt_tokens_keeps_the_prompts_end():
    """vLLM's truncate_prompt_tokens: the last N tokens; -1 the context's length; None all."""
    prompt = list(range(100))
    assert truncated_prompt(prompt, None, 64) == prompt
    assert truncated_prompt(prompt, 5, 64) == [95, 96, 97, 98, 99]
    assert truncated_prompt(prompt, -1, 64) == prompt[-64:]
    assert truncated_prompt(prompt[:3], 10, 64) == [0, 1, 2]
    for keep in (0, 65):
        with pytest.raises(ParamError) as err:
            truncated_prompt(prompt, keep, 64)
        assert err.value.param == "truncate_prompt_tokens" and "[1, 64]" in str(err.value)
