"""The Responses API store: what previous_response_id continues from, retrieval, deletion, the
least recently used dropped past the bound, and input items paged as the openai client reads them."""

from __future__ import annotations

import pytest
from openai.pagination import SyncCursorPage
from openai.types.responses import Response, ResponseItem
from pydantic import TypeAdapter

from cluster.api.errors import UnsupportedFieldError
from cluster.api.openai_responses import ChoiceState
from cluster.api.response_store import ResponseStore, input_items, items_page
from cluster.api.responses_output import ResponseIds, response_object
from cluster.api.responses_protocol import ResponsesRequest
from cluster.api.tool_calls import Parsed, ToolCall
from cluster.hosting.protocol import GenerateDelta


def answered(body: ResponsesRequest, text: str, calls: list[ToolCall] = ()) -> dict:
    state = ChoiceState(0)
    state.add(GenerateDelta(text=text, finish_reason="stop", num_prompt_tokens=3, num_output_tokens=2))
    if calls:
        state.set_parsed(Parsed(text, list(calls)))
    return response_object(ResponseIds(), body, "m", state)


def kept(store: ResponseStore, body: ResponsesRequest, text: str, calls: list[ToolCall] = ()) -> dict:
    """What the ingress does: answer ``body`` after its previous response's context, then store it."""
    context = store.context(body.previous_response_id) if body.previous_response_id else []
    response = answered(body, text, calls)
    items = input_items(body.input)
    store.put(response, items, [*context, *items, *response["output"]])
    return response


def test_a_continued_response_reads_the_whole_chain_but_not_earlier_instructions():
    store = ResponseStore(10)
    first = kept(store, ResponsesRequest(model="m", input="Hi", instructions="be brief"), "Hello!")
    second = kept(store, ResponsesRequest(model="m", input=[{"role": "user", "content": "Weather?"}],
                                          previous_response_id=first["id"]), "",
                  [ToolCall("weather", '{"city": "Paris"}', "call_1")])
    third = ResponsesRequest(model="m", instructions="be kind", previous_response_id=second["id"],
                             input=[{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert third.messages(store.context(second["id"])) == [
        {"role": "system", "content": "be kind"},  # this request's instructions only
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert second["previous_response_id"] == first["id"]
    Response.model_validate(second)
    assert store.response(first["id"]) == first
    assert store.delete(first["id"]) and store.response(first["id"]) is None and not store.delete(first["id"])
    assert store.context(second["id"]) is not None  # a continuation keeps its own copy of the chain


def test_past_the_bound_the_least_recently_used_is_dropped():
    store = ResponseStore(2)
    a, b = (kept(store, ResponsesRequest(model="m", input=word), word) for word in ("a", "b"))
    assert store.context(a["id"]) is not None  # a is now used more recently than b
    c = kept(store, ResponsesRequest(model="m", input="c"), "c")
    assert len(store) == 2 and store.response(b["id"]) is None
    assert store.response(a["id"]) == a and store.response(c["id"]) == c
    with pytest.raises(ValueError):
        ResponseStore(0)


def test_input_items_are_paged_as_the_openai_client_reads_them():
    items = input_items([{"role": "user", "content": "one"},
                         {"type": "message", "role": "assistant", "content": "two"},
                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_9"},
                         {"type": "function_call_output", "call_id": "c", "output": "three"}])
    assert items[0]["content"] == [{"type": "input_text", "text": "one"}] and items[0]["id"].startswith("msg_")
    assert items[1]["content"][0]["type"] == "output_text" and items[2]["id"] == "fc_9"
    assert len({item["id"] for item in items}) == 4
    for item in items:
        TypeAdapter(ResponseItem).validate_python(item)
    first = items_page(items, "resp_1", limit=3)  # newest first by default
    assert [i["id"] for i in first["data"]] == [i["id"] for i in items[::-1][:3]] and first["has_more"]
    page = SyncCursorPage[ResponseItem].model_validate(first)
    assert page.data[0].type == "function_call_output"
    rest = items_page(items, "resp_1", after=first["last_id"], limit=3)
    assert [i["id"] for i in rest["data"]] == [items[0]["id"]] and not rest["has_more"]
    assert items_page(items, "resp_1", order="asc")["data"] == items
    assert input_items("hi")[0]["role"] == "user"
    for fields, param in [({"order": "up"}, "order"), ({"limit": 0}, "limit"), ({"after": "msg_x"}, "after")]:
        with pytest.raises(UnsupportedFieldError) as err:
            items_page(items, "resp_1", **fields)
        assert err.value.param == param
