"""OpenAI's Responses API: the request served as a chat completion, and the response and stream
events, checked against the openai client's own types."""

from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from cluster.api.errors import UnsupportedFieldError
from cluster.api.openai_responses import ChoiceState
from cluster.api.tool_calls import Parsed, ToolCall
from cluster.api.responses_output import ResponseEvents, ResponseIds, response_object
from cluster.api.responses_protocol import ResponsesRequest
from cluster.hosting.protocol import GenerateDelta
from cluster.shared.outputs import Logprob


def request(**fields) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_input_and_instructions_become_chat_messages():
    assert request(instructions="be brief").messages() == [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi"}]
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Tell "}, {"type": "input_text", "text": "me"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Once"}]},
             {"role": "developer", "content": "short"}]
    assert request(input=items).messages() == [{"role": "user", "content": "Tell me"},
                                               {"role": "assistant", "content": "Once"},
                                               {"role": "developer", "content": "short"}]
    chat = request(max_output_tokens=7, temperature=0, top_p=0.5, seed=3,
                   text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                                    "strict": True}}).as_chat_request()
    chat.check_supported()
    assert chat.requested_max_tokens() == 7 and chat.temperature == 0 and chat.top_p == 0.5 and chat.seed == 3
    assert chat.chat_constraint() is not None  # the schema constrains the output
    assert request(text={"format": {"type": "text"}}).as_chat_request().response_format is None


@pytest.mark.parametrize("fields, param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include"),
    ({"include": "message.output_text.logprobs"}, "include"),
])
def test_what_is_not_served_is_named(fields, param):
    with pytest.raises(UnsupportedFieldError) as err:
        request(**fields).check_supported()
    assert err.value.param == param


@pytest.mark.parametrize("items, words", [
    ([], "empty"),
    ([{"type": "reasoning", "summary": []}], "reasoning"),
    ([{"type": "function_call_output", "call_id": "c"}], "function_call_output"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input_image"),
])
def test_input_that_is_not_text_messages_is_refused(items, words):
    with pytest.raises(UnsupportedFieldError, match=words) as err:
        request(input=items).messages()
    assert err.value.param == "input"


def _finished(text: str, reason: str) -> ChoiceState:
    state = ChoiceState(0)
    state.add(GenerateDelta(text=text, token_ids=[1, 2], num_prompt_tokens=5, num_output_tokens=2,
                            num_cached_tokens=3, finish_reason=reason))
    return state


def test_the_response_parses_as_the_openai_clients_type():
    body = request(instructions="be brief", max_output_tokens=2, metadata={"k": "v"})
    got = Response.model_validate(response_object(ResponseIds(), body, "m", _finished("Hello", "length")))
    assert got.output_text == "Hello" and got.status == "incomplete"
    assert got.incomplete_details.reason == "max_output_tokens"
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == (5, 2, 7)
    assert got.usage.input_tokens_details.cached_tokens == 3
    done = Response.model_validate(response_object(ResponseIds(), body, "m", _finished("Hi.", "stop")))
    assert done.status == "completed" and done.incomplete_details is None and done.output[0].status == "completed"


def test_stream_events_in_openais_order_and_numbered():
    events = ResponseEvents(ResponseIds(), request(), "m")
    made = events.start() + events.text("Hel") + events.text("lo") + events.finish(_finished("Hello", "stop"))
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in made]
    assert [e.type for e in parsed] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert parsed[-1].response.output_text == "Hello" and parsed[0].response.status == "in_progress"


WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_function_tools_and_earlier_calls_become_the_chat_request():
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    body = request(input=items, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert body.messages()[1:] == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    chat = body.as_chat_request()
    chat.check_supported()
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.tool_choice.function.name == "get_weather"
    for fields, param in [({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
                          ({"input": [{"type": "function_call", "name": "f"}]}, "input")]:
        with pytest.raises(UnsupportedFieldError) as err:
            request(**fields).as_chat_request()
        assert err.value.param == param


def test_calls_are_function_call_items_whole_and_streamed():
    call = ToolCall("get_weather", '{"city": "Paris"}', "call_abc")
    state = _finished('<tool_call>{"name": "get_weather"}</tool_call>', "stop")
    state.set_parsed(Parsed("", [call]))
    whole = Response.model_validate(response_object(ResponseIds(), request(tools=[WEATHER]), "m", state))
    (item,) = whole.output  # no text: no message
    assert (item.type, item.call_id, item.name, item.arguments) == ("function_call", "call_abc", "get_weather",
                                                                    '{"city": "Paris"}')
    events = ResponseEvents(ResponseIds(), request(tools=[WEATHER]), "m")
    made = events.start() + events.text("Let me check.") + events.call(call) + events.finish(state)
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in made]
    assert [e.type for e in parsed][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = parsed[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == "Let me check."
    assert [e.output_index for e in parsed if e.type == "response.output_item.done"] == [0, 1]


def _with_logprobs(text_pieces: list[str], reason: str = "stop") -> tuple[ChoiceState, list[GenerateDelta]]:
    """A choice of one token per piece, each with the sampled token (rank 1) and two others."""
    deltas = []
    for i, piece in enumerate(text_pieces):
        entry = {10 + i: Logprob(-0.1 * (i + 1), 1, piece), 50: Logprob(-2.0, 2, "x"), 60: Logprob(-3.0, 3, "y")}
        deltas.append(GenerateDelta(text=piece, token_ids=[10 + i], logprobs=[entry], num_prompt_tokens=4,
                                    num_output_tokens=i + 1,
                                    finish_reason=reason if i == len(text_pieces) - 1 else None))
    state = ChoiceState(0)
    for delta in deltas:
        state.add(delta)
    return state, deltas


def test_output_logprobs_are_served_when_included():
    """include message.output_text.logprobs: the chat request asks for logprobs with top_logprobs
    alternatives; each output token's logprob is in the output_text part, in the openai client's
    types, whole and streamed (the deltas' logprobs together are the part's, less the bytes)."""
    body = request(include=["message.output_text.logprobs"], top_logprobs=2)
    chat = body.as_chat_request()
    chat.check_supported()
    assert chat.logprobs is True and chat.top_logprobs == 2
    assert not request(top_logprobs=2).as_chat_request().logprobs  # without include: none, as vLLM
    assert request(priority=-1).as_chat_request().priority == -1  # vLLM's priority, as on the chat route

    state, deltas = _with_logprobs(["Hel", "lo"])
    got = Response.model_validate(response_object(ResponseIds(), body, "m", state))
    part = got.output[0].content[0]
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [("Hel", -0.1), ("lo", -0.2)]
    assert [[(t.token, t.logprob) for t in lp.top_logprobs] for lp in part.logprobs] == \
        [[("Hel", -0.1), ("x", -2.0)], [("lo", -0.2), ("x", -2.0)]]
    assert part.logprobs[0].bytes == list(b"Hel")
    plain = Response.model_validate(response_object(ResponseIds(), request(), "m", state))
    assert plain.output[0].content[0].logprobs == []

    events = ResponseEvents(ResponseIds(), body, "m")
    from cluster.api.responses_output import output_logprobs
    made = events.start()
    for delta in deltas:
        made += events.text(delta.text, output_logprobs(body, delta.logprobs))
    made += events.finish(state)
    parsed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in made]
    streamed = [(lp.token, lp.logprob) for e in parsed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [(lp.token, lp.logprob) for lp in part.logprobs]
    done = next(e for e in parsed if e.type == "response.output_text.done")
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == streamed
    assert parsed[-1].response.output[0].content[0].logprobs == part.logprobs


def test_an_error_about_the_chat_request_is_told_in_the_responses_names():
    from cluster.api.errors import renamed_error

    names = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
             "messages": "input", "response_format": "text.format"}
    assert renamed_error("'max_tokens' or 'max_completion_tokens' is too large: 9.", "max_tokens", names) == (
        "'max_output_tokens' is too large: 9.", "max_output_tokens")
    assert renamed_error("response_format: Invalid type: bogus", "response_format", names) == (
        "text.format: Invalid type: bogus", "text.format")
    assert renamed_error("messages.0.role: bad", "messages", names) == ("input.0.role: bad", "input")
    # a field of another name, or one inside another field's path, is left as it is
    assert renamed_error("x.max_tokens and seed", "seed", names) == ("x.max_tokens and seed", "seed")
