"""OpenAI request bodies (cluster/api/openai_protocol.py) and response shapes
(cluster/api/openai_responses.py).

Requests: valid bodies parse; wrong types and out-of-range values are pydantic
ValidationErrors; unknown fields are ignored (the module's documented contract, as in
OpenAI and vLLM) while OpenAI fields Tandem does not implement raise
UnsupportedFieldError naming the field; ``sampling_params`` maps each field onto the
engine's SamplingParams. Responses: error bodies, usage, and (streamed) chunks have
OpenAI's keys and objects.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from cluster.api.openai_responses import (
    ChoiceState,
    Echo,
    chat_body,
    chat_chunk,
    completion_body,
    completion_chunk,
    echoed_chunk,
    error_body,
    usage,
    usage_chunk,
    with_token_id_names,
)
from cluster.shared.outputs import Logprob
from cluster.hosting.protocol import GenerateDelta

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def both(**fields):
    """The same fields in a completion and a chat body."""
    return [completion(**fields), chat(**fields)]


# ---- valid bodies ------------------------------------------------------------------
def test_completion_accepts_the_openai_fields():
    body = completion(max_tokens=5, temperature=0.7, top_p=0.9, n=3, stream=True,
                      stream_options={"include_usage": True}, stop=["\n", "END"], logprobs=2, seed=7,
                      presence_penalty=0.5, frequency_penalty=-0.5, user="u-1", echo=False, best_of=3)
    body.check_supported()
    assert body.stream_options.include_usage is True
    assert (body.n, body.logprobs, body.seed, body.user) == (3, 2, 7, "u-1")
    assert completion(stop="\n").stop == "\n"


def test_completion_prompt_forms():
    assert completion(prompt="hi").prompts() == ["hi"]
    assert completion(prompt=[5, 6, 7]).prompts() == [[5, 6, 7]]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    with pytest.raises(UnsupportedFieldError) as err:
        completion(prompt=[]).prompts()
    assert err.value.param == "prompt"


def test_chat_accepts_messages_parts_and_logprobs():
    body = chat(messages=[{"role": "developer", "content": "rules"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None}],
                logprobs=True, top_logprobs=3, max_completion_tokens=9, stream=True,
                stream_options={"include_usage": False}, response_format={"type": "text"}, seed=1, user="x")
    body.check_supported()
    assert [m.as_template_message() for m in body.messages] == [
        {"role": "system", "content": "rules"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""}]
    assert body.num_logprobs == 3
    assert chat(logprobs=True).num_logprobs == 0
    assert chat().num_logprobs is None


def test_unknown_fields_are_ignored():
    for body in both(frobnicate=1, metadata={"a": "b"}):
        assert not hasattr(body, "frobnicate")
        body.check_supported()


# ---- rejected bodies ---------------------------------------------------------------
@pytest.mark.parametrize("fields", [
    {"temperature": "0.5"}, {"temperature": 2.5}, {"temperature": -0.1},
    {"top_p": 0}, {"top_p": 1.5},
    {"n": 0}, {"n": 17}, {"n": 2.0}, {"n": True},
    {"max_tokens": -1}, {"max_tokens": "10"}, {"prompt_logprobs": "2"}, {"prompt_logprobs": 1.0},
    {"stop": 3}, {"stop": ["a", 1]},
    {"seed": "7"}, {"seed": 1.5},
    {"presence_penalty": 2.5}, {"frequency_penalty": -3},
    {"stream": "yes"}, {"stream_options": {"include_usage": "true"}},
    {"user": 5}, {"model": 1}, {"min_p": 2}, {"repetition_penalty": 0},
])
def test_bad_sampling_fields_are_validation_errors(fields):
    for build in (completion, chat):
        with pytest.raises(ValidationError) as err:
            build(**fields)
        assert err.value.errors()[0]["loc"][0] in fields


@pytest.mark.parametrize("fields", [{"logprobs": 21}, {"logprobs": -1}, {"logprobs": True}, {"prompt": 5},
                                    {"prompt": [1, "a"]}, {"echo": 1}])
def test_bad_completion_fields(fields):
    with pytest.raises(ValidationError):
        completion(**fields)


@pytest.mark.parametrize("fields", [{"messages": []}, {"messages": [{"role": "robot", "content": "x"}]},
                                    {"messages": [{"role": "user", "content": 5}]}, {"logprobs": 2},
                                    {"top_logprobs": 21}, {"max_completion_tokens": 0},
                                    {"tools": [{"type": "function"}]}])
def test_bad_chat_fields(fields):
    with pytest.raises(ValidationError):
        chat(**fields)


def test_required_fields():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m"})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": MESSAGES})


@pytest.mark.parametrize("build, fields, param", [
    (completion, {"stream_options": {"include_usage": True}}, "stream_options"),
    (completion, {"suffix": "tail"}, "suffix"),
    (completion, {"max_tokens": 0}, "max_tokens"),  # the prompt alone is echo's
    (chat, {"max_tokens": 0, "echo": True}, "max_tokens"),
    (completion, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (chat, {"prompt_logprobs": -1}, "prompt_logprobs"),  # vLLM's whole vocabulary: not served
    (completion, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: no place in a chunk
    (completion, {"n": 2, "best_of": 3}, "best_of"),
    (chat, {"functions": [{"name": "f"}]}, "functions"),
    (chat, {"function_call": "auto"}, "function_call"),
    (chat, {"top_logprobs": 2}, "top_logprobs"),
    (chat, {"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
    # vLLM's extras that Tandem does not implement: refused rather than silently ignored
    (chat, {"use_beam_search": True}, "use_beam_search"),
    (completion, {"logits_processors": ["x"]}, "logits_processors"),
    (chat, {"chat_template": "{{ messages }}"}, "chat_template"),
    (chat, {"continue_final_message": True}, "continue_final_message"),  # add_generation_prompt defaults on
    (chat, {"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),  # user last
    (chat, {"chat_template_kwargs": {"tokenize": True, "enable_thinking": False}}, "chat_template_kwargs"),
])
def test_unimplemented_openai_fields_are_named(build, fields, param):
    body = build(**fields)
    with pytest.raises(UnsupportedFieldError) as err:
        body.check_supported()
    assert err.value.param == param  # the HTTP error's "param"


def test_vllm_extras_at_their_defaults_are_accepted():
    for body in both(prompt_logprobs=None, use_beam_search=False,
                     logits_processors=None, priority=0, return_tokens_as_token_ids=False):
        body.check_supported()


def test_priority_reaches_the_sampling_params():
    """vLLM's priority goes to the engine, which serves it under scheduler.policy priority (and
    refuses it otherwise: tests/unit/test_priority_scheduling.py)."""
    for body in both(priority=-3):
        body.check_supported()
        assert body.sampling_params(4, None, 0).priority == -3
    with pytest.raises(ValidationError):
        chat(priority=False)  # a boolean is not a priority


def test_echo_and_prompt_logprobs_map_as_vllms():
    """echo with logprobs asks for the prompt's logprobs (completions: logprobs, chat: top_logprobs),
    an explicit prompt_logprobs wins, and echo with max_tokens 0 runs one token for the prompt alone."""
    def params(body):
        body.check_supported()
        return body.sampling_params(body.requested_max_tokens() or 16, None, 0)

    assert params(completion(prompt_logprobs=4)).prompt_logprobs == 4
    assert params(completion(logprobs=2)).prompt_logprobs is None
    assert params(completion(echo=True, logprobs=2)).prompt_logprobs == 2
    assert params(completion(echo=True, logprobs=2, prompt_logprobs=0)).prompt_logprobs == 0
    assert params(completion(echo=True)).prompt_logprobs is None
    echo_only = completion(echo=True, max_tokens=0, logprobs=1)
    assert echo_only.echo_only and params(echo_only).max_tokens == 1
    assert not completion(echo=True, max_tokens=3).echo_only
    assert params(chat(echo=True, logprobs=True, top_logprobs=3)).prompt_logprobs == 3
    assert params(chat(prompt_logprobs=0, stream=True)).prompt_logprobs == 0  # 0 streams (vLLM allows it)


def test_chat_echo_text_is_the_last_message_when_the_reply_continues_it():
    assert chat(echo=True).echo_text() == ""  # a user message last: the reply is a new message
    messages = MESSAGES + [{"role": "assistant", "content": [{"type": "text", "text": "Once"}]}]
    assert chat(messages=messages, echo=True, add_generation_prompt=False,
                continue_final_message=True).echo_text() == "Once"
    assert chat(messages=messages, echo=True).echo_text() == "Once"
    assert chat(echo=True, add_generation_prompt=False).echo_text() == MESSAGES[-1]["content"]


def test_chat_template_options():
    assert chat().template_options() == {"add_generation_prompt": True, "continue_final_message": False}
    messages = MESSAGES + [{"role": "assistant", "content": "Hel"}]
    body = chat(messages=messages, add_generation_prompt=False, continue_final_message=True,
                chat_template_kwargs={"enable_thinking": False})
    body.check_supported()
    assert body.template_options() == {"enable_thinking": False, "add_generation_prompt": False,
                                       "continue_final_message": True}


def test_prompt_fields_and_their_defaults():
    # vLLM's defaults: completions add the tokenizer's special tokens, chat leaves them to the template
    assert completion().add_special_tokens is True and chat().add_special_tokens is False
    assert completion(add_special_tokens=False).add_special_tokens is False
    for body in both(truncate_prompt_tokens=-1):
        assert body.truncate_prompt_tokens == -1
    for build in (completion, chat):
        with pytest.raises(ValidationError):
            build(truncate_prompt_tokens=-2)
        with pytest.raises(ValidationError):
            build(include_stop_str_in_output="yes")


# ---- translation to SamplingParams -------------------------------------------------
def test_sampling_params_map_every_field():
    for body in both(max_tokens=12, temperature=0.3, top_p=0.8, stop="END", seed=100, presence_penalty=0.4,
                     frequency_penalty=-0.2, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True,
                     min_tokens=2, stop_token_ids=[3, 4], skip_special_tokens=False, include_stop_str_in_output=True,
                     allowed_token_ids=[3, 9], bad_words=["no"]):
        params = body.sampling_params(body.requested_max_tokens(), num_logprobs=4, choice=0)
        assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == \
            (12, 0.3, 0.8, 5, 0.1)
        assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.4, -0.2, 1.2)
        assert params.stop == ["END"] and params.stop_token_ids == [3, 4]
        assert (params.seed, params.logprobs, params.min_tokens) == (100, 4, 2)
        assert params.ignore_eos is True and params.skip_special_tokens is False
        assert params.include_stop_str_in_output is True and params.allowed_token_ids == [3, 9]
        assert params.bad_words == ["no"]


def test_sampling_params_defaults():
    for body in both():
        params = body.sampling_params(16, num_logprobs=None, choice=0)
        assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (16, 1.0, 1.0, 0)
        assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
        assert params.stop == [] and params.seed is None and params.logprobs is None


def test_temperature_zero_is_greedy_not_the_default():
    assert completion(temperature=0).sampling_params(16, None, 0).greedy


def test_each_choice_gets_its_own_seed():
    body = completion(n=3, seed=10)
    assert [body.sampling_params(16, None, j).seed for j in range(3)] == [10, 11, 12]
    assert [completion(n=3).sampling_params(16, None, j).seed for j in range(3)] == [None] * 3


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens() == 7
    assert chat(max_tokens=5).requested_max_tokens() == 5
    assert chat().requested_max_tokens() is None


def test_values_the_engine_rejects_raise_value_error_naming_the_field():
    with pytest.raises(ValueError, match="min_tokens"):
        completion(max_tokens=2, min_tokens=5).sampling_params(2, None, 0)
    with pytest.raises(ValueError, match="stop"):
        completion(stop=[""]).sampling_params(16, None, 0)
    with pytest.raises(ValueError, match="top_k"):
        completion(top_k=-5).sampling_params(16, None, 0)


# ---- responses ---------------------------------------------------------------------
def test_error_body_shape():
    body = error_body("bad value", param="temperature")
    assert list(body) == ["error"]
    assert body["error"] == {"message": "bad value", "type": "invalid_request_error", "param": "temperature",
                             "code": None}


def finished_choice(index: int, prompt_tokens: int, output_tokens: int, cached: int = 0,
                    reason: str = "stop", stop_reason: int | str | None = None) -> ChoiceState:
    state = ChoiceState(index)
    state.add(GenerateDelta(text="ab", token_ids=[1, 2], num_prompt_tokens=prompt_tokens, num_output_tokens=2))
    state.add(GenerateDelta(text="c", token_ids=[3], finish_reason=reason, stop_reason=stop_reason,
                            num_prompt_tokens=prompt_tokens, num_output_tokens=output_tokens,
                            num_cached_tokens=cached))
    return state


def test_usage_counts_each_prompt_once():
    # Two prompts with n = 2: choices 0, 1 share prompt 0 and choices 2, 3 prompt 1.
    choices = [finished_choice(0, 5, 3), finished_choice(1, 5, 4, cached=16),
               finished_choice(2, 7, 3), finished_choice(3, 7, 2)]
    result = usage(choices, [0, 0, 1, 1])
    assert result == {"prompt_tokens": 12, "completion_tokens": 12, "total_tokens": 24,
                      "prompt_tokens_details": {"cached_tokens": 16}}


def test_usage_adds_cache_hits_of_different_prompts():
    choices = [finished_choice(0, 20, 3, cached=16), finished_choice(1, 40, 3, cached=32),
               finished_choice(2, 40, 3, cached=32)]
    result = usage(choices, [0, 1, 1])
    assert result["prompt_tokens"] == 60
    assert result["prompt_tokens_details"] == {"cached_tokens": 48}


def test_choice_state_accumulates_deltas():
    state = finished_choice(0, 5, 3, reason="abort")
    assert (state.text, state.token_ids, state.num_output_tokens) == ("abc", [1, 2, 3], 3)
    assert state.finish_reason == "stop"  # OpenAI knows only stop and length
    assert finished_choice(0, 5, 3, reason="length").finish_reason == "length"


def test_whole_bodies():
    choices = [finished_choice(0, 5, 3)]
    use = usage(choices, [0])
    body = completion_body("cmpl-1", 123, "m", choices, use, with_logprobs=False)
    assert body["object"] == "text_completion" and body["usage"] == use
    assert body["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None, "prompt_logprobs": None}]
    body = chat_body("chatcmpl-1", 123, "m", choices, use, num_logprobs=None)
    assert body["object"] == "chat.completion" and body["prompt_logprobs"] is None
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert body["choices"][0]["stop_reason"] is None
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


@pytest.mark.parametrize("stop_reason", ["END", 42])
def test_the_stop_reason_names_the_stop_string_or_token_everywhere(stop_reason):
    """vLLM's ``stop_reason``: whole bodies and the streamed chunk that finishes the choice."""
    choices = [finished_choice(0, 5, 3, stop_reason=stop_reason)]
    use = usage(choices, [0])
    assert completion_body("c", 1, "m", choices, use, False)["choices"][0]["stop_reason"] == stop_reason
    assert chat_body("c", 1, "m", choices, use, None)["choices"][0]["stop_reason"] == stop_reason
    last = GenerateDelta(finish_reason="stop", stop_reason=stop_reason)
    assert completion_chunk("c", 1, "m", 0, last, 0, False, False)["choices"][0]["stop_reason"] == stop_reason
    assert chat_chunk("c", 1, "m", 0, {}, last, None, False)["choices"][0]["stop_reason"] == stop_reason
    running = GenerateDelta(text="a", token_ids=[1])
    assert completion_chunk("c", 1, "m", 0, running, 0, False, False)["choices"][0]["stop_reason"] is None


def logprob_entry(token_id: int, text: str, logprob: float, alt_id: int, alt_text: str, alt_logprob: float):
    """One position: the sampled token first, then an alternative."""
    return {token_id: Logprob(logprob, rank=2, decoded_token=text),
            alt_id: Logprob(alt_logprob, rank=1, decoded_token=alt_text)}


def test_completion_chunk_shape_and_logprobs():
    delta = GenerateDelta(text="hi", token_ids=[7, 8], num_output_tokens=2,
                          logprobs=[logprob_entry(7, "h", -0.5, 9, "x", -0.1),
                                    logprob_entry(8, "i", -0.2, 9, "x", -1.0)])
    chunk = completion_chunk("cmpl-1", 123, "m", 2, delta, offset=10, with_logprobs=True, include_usage=True)
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    assert (chunk["id"], chunk["created"], chunk["model"]) == ("cmpl-1", 123, "m")
    (choice,) = chunk["choices"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (2, "hi", None)
    assert choice["logprobs"] == {"tokens": ["h", "i"], "token_logprobs": [-0.5, -0.2],
                                  "top_logprobs": [{"h": -0.5, "x": -0.1}, {"i": -0.2, "x": -1.0}],
                                  "text_offset": [10, 11]}
    last = completion_chunk("cmpl-1", 123, "m", 0, GenerateDelta(finish_reason="length"), 0, False, False)
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


def echo_deltas():
    """A prompt [5, 6] ("Hi") and an output [7, 8] ("hi"), with logprobs and prompt logprobs."""
    prompt_logprobs = [None, logprob_entry(6, "i", -3.0, 9, "x", -0.2)]
    first = GenerateDelta(text="h", token_ids=[7], num_output_tokens=1, num_prompt_tokens=2,
                          logprobs=[logprob_entry(7, "h", -0.5, 9, "x", -0.1)], prompt_logprobs=prompt_logprobs)
    second = GenerateDelta(text="i", token_ids=[8], num_output_tokens=2, finish_reason="length",
                           logprobs=[logprob_entry(8, "i", -0.2, 9, "x", -1.0)])
    return first, second


def test_echo_puts_the_prompt_and_its_logprobs_first():
    first, second = echo_deltas()
    state = ChoiceState(0)
    state.add(first)
    state.add(second)
    use = usage([state], [0])
    (choice,) = completion_body("c", 1, "m", [state], use, True, [Echo("Hi", "H")])["choices"]
    assert choice["text"] == "Hihi"
    assert choice["logprobs"] == {"tokens": ["H", "i", "h", "i"], "token_logprobs": [None, -3.0, -0.5, -0.2],
                                  "top_logprobs": [None, {"i": -3.0, "x": -0.2}, {"h": -0.5, "x": -0.1},
                                                   {"i": -0.2, "x": -1.0}],
                                  "text_offset": [0, 1, 2, 3]}
    assert choice["prompt_logprobs"] == [None, {"6": {"logprob": -3.0, "rank": 2, "decoded_token": "i"},
                                                "9": {"logprob": -0.2, "rank": 1, "decoded_token": "x"}}]
    (only,) = completion_body("c", 1, "m", [state], use, True, [Echo("Hi", "H", only=True)])["choices"]
    assert only["text"] == "Hi" and only["logprobs"]["tokens"] == ["H", "i"]
    body = chat_body("c", 1, "m", [state], use, None, Echo("Once "))
    assert body["choices"][0]["message"]["content"] == "Once hi"
    assert body["prompt_logprobs"][1]["6"]["logprob"] == -3.0


def test_streamed_echo_goes_before_the_first_chunk():
    first, second = echo_deltas()
    for echo, texts, tokens in [(Echo("Hi", "H"), ["Hih", "i"], [["H", "i", "h"], ["i"]]),
                                (Echo("Hi", "H", only=True), ["Hi", ""], [["H", "i"], []]),
                                (None, ["h", "i"], [["h"], ["i"]])]:
        state, chunks = ChoiceState(0), []
        for delta in (first, second):
            text, entries = echoed_chunk(state, delta, echo)
            state.add(delta)
            chunk = completion_chunk("c", 1, "m", 0, delta, state.next_offset, True, False, text=text,
                                     entries=entries, first_token=echo.first_token if echo else "")["choices"][0]
            state.sent(chunk["logprobs"])
            chunks.append(chunk)
        assert [c["text"] for c in chunks] == texts
        assert [c["logprobs"]["tokens"] for c in chunks] == tokens
        # offsets go on from the tokens sent (here their texts add up to the text)
        assert chunks[1]["logprobs"]["text_offset"] == ([3] if echo and not echo.only else [] if echo else [1])


def test_return_token_ids_and_tokens_as_token_ids():
    """vLLM's return_token_ids: output ids per choice (streamed: per chunk) and the prompt's (in each
    completion choice or its first chunk; at the top of a chat body or its role chunk);
    return_tokens_as_token_ids: logprobs name every token token_id:N."""
    first, second = echo_deltas()
    state = ChoiceState(0, prompt_token_ids=[5, 6])
    for delta in (first, second):
        state.add(with_token_id_names(delta))
    use = usage([state], [0])
    (choice,) = completion_body("c", 1, "m", [state], use, True, [None], token_ids=True)["choices"]
    assert (choice["token_ids"], choice["prompt_token_ids"]) == ([7, 8], [5, 6])
    assert choice["logprobs"]["tokens"] == ["token_id:7", "token_id:8"]
    assert choice["logprobs"]["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:9": -0.1}
    assert choice["prompt_logprobs"][1]["6"]["decoded_token"] == "token_id:6"
    assert "token_ids" not in completion_body("c", 1, "m", [state], use, False)["choices"][0]
    body = chat_body("c", 1, "m", [state], use, 1, token_ids=True)
    assert body["prompt_token_ids"] == [5, 6] and body["choices"][0]["token_ids"] == [7, 8]
    assert body["choices"][0]["logprobs"]["content"][0]["token"] == "token_id:7"
    chunk = completion_chunk("c", 1, "m", 0, first, 0, False, False, token_ids=True, prompt_token_ids=[5, 6])
    assert (chunk["choices"][0]["token_ids"], chunk["choices"][0]["prompt_token_ids"]) == ([7], [5, 6])
    later = completion_chunk("c", 1, "m", 0, second, 1, False, False, token_ids=True)["choices"][0]
    assert later["token_ids"] == [8] and "prompt_token_ids" not in later
    role = chat_chunk("c", 1, "m", 0, {"role": "assistant"}, None, None, False, prompt_token_ids=[5, 6])
    assert role["prompt_token_ids"] == [5, 6] and "token_ids" not in role["choices"][0]
    assert chat_chunk("c", 1, "m", 0, {}, second, None, False, token_ids=True)["choices"][0]["token_ids"] == [8]


def test_chat_chunk_shape_and_logprobs():
    delta = GenerateDelta(text="h", token_ids=[7], logprobs=[logprob_entry(7, "h", -0.5, 9, "x", -0.1)],
                          finish_reason="stop")
    chunk = chat_chunk("chatcmpl-1", 5, "m", 0, {"content": "h"}, delta, num_logprobs=1, include_usage=False)
    assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
    (choice,) = chunk["choices"]
    assert choice["delta"] == {"content": "h"} and choice["finish_reason"] == "stop"
    # The sampled token, then the top alternatives by rank.
    assert choice["logprobs"] == {"content": [{
        "token": "h", "logprob": -0.5, "bytes": [104],
        "top_logprobs": [{"token": "x", "logprob": -0.1, "bytes": [120]}]}]}
    role = chat_chunk("chatcmpl-1", 5, "m", 0, {"role": "assistant", "content": ""}, None, 1, True)
    assert role["choices"][0]["finish_reason"] is None and role["choices"][0]["logprobs"] is None
    assert role["usage"] is None


def test_usage_chunk_has_no_choices():
    use = usage([finished_choice(0, 4, 6)], [0])
    for obj in ("text_completion", "chat.completion.chunk"):
        chunk = usage_chunk("id-1", 1, "m", obj, use)
        assert chunk["object"] == obj and chunk["choices"] == []
        assert chunk["usage"]["prompt_tokens"] + chunk["usage"]["completion_tokens"] == \
            chunk["usage"]["total_tokens"] == 10


def test_logit_bias_maps_token_ids_and_clamps_as_vllm():
    for body in both(logit_bias={"5": 1.5, "7": -300.0, "9": 250}):
        params = body.sampling_params(16, num_logprobs=None, choice=0)
        assert params.logit_bias == {5: 1.5, 7: -100.0, 9: 100.0}
    for bad in ({"five": 1.0}, {"-3": 1.0}, {"5": float("nan")}):
        with pytest.raises(ValueError) as err:
            completion(logit_bias=bad).sampling_params(16, num_logprobs=None, choice=0)
        assert err.value.param == "logit_bias"
