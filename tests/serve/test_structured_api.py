"""Structured outputs and tool calls through the real ``openai`` client, on a running cluster.

The tiny random-weight model knows nothing: every structure in these outputs comes from the
grammar, so a schema that validates, a call that parses and a pydantic object that the
client builds show the whole path works (request fields -> constraint -> engine masks ->
parsing -> response shapes). Its template knows no tools, so tools take the ``prompt``
format (written into the system prompt, calls as <tool_call> blocks). Sampling is seeded,
so each output is fixed; streamed and whole responses of one seed must agree.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.serve.conftest import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Forecast(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)
    sunny: bool


def _check_calls(message, max_calls: int | None = None) -> list:
    """The message is only calls, each to a known tool with arguments valid for its schema."""
    calls = message.tool_calls
    assert calls and message.content is None
    assert max_calls is None or len(calls) <= max_calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(call.function.name, call.function.arguments) for call in calls]


# ---- response_format and structured_outputs ------------------------------------------
def test_parse_with_a_pydantic_model_gives_the_object(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Forecast,
                                               max_tokens=200, seed=1)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert choice.message.parsed == Forecast.model_validate_json(choice.message.content)


def test_json_schema_on_completions_and_json_object_on_both(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    text = client.completions.create(model=MODEL, prompt="Weather:", max_tokens=200, seed=2,  # not in the
                                     extra_body={"response_format": response_format}).choices[0].text  # client
    jsonschema.validate(json.loads(text), WEATHER)
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, seed=0,
                                          response_format={"type": "json_object"})
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    # Any object: a random model may write one longer than max_tokens; this seed's ends.
    done = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, seed=3,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(done.choices[0].text), dict)


def test_vllm_structured_outputs_field(client):
    choice = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=10, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, seed=3,
                                           extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    assert regex.choices[0].message.content[3] == "-" and regex.choices[0].message.content[:3].isdigit()
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, seed=3, stream=True,
                                              extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == regex.choices[0].message.content


def test_a_grammar_dead_end_stops_with_the_detail_in_stop_reason(client):
    # The serve model's character-level tokenizer has no token for "é": after "!" nothing can follow.
    # The finish reason is one OpenAI's schema knows; vLLM's stop_reason says why.
    dead = client.completions.create(model=MODEL, prompt="x", max_tokens=10,
                                     extra_body={"structured_outputs": {"regex": "!é"}})
    assert dead.choices[0].finish_reason == "stop" and dead.choices[0].text == "!"
    assert dead.choices[0].model_extra["stop_reason"] == "grammar_dead_end"
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=10, stream=True,
                                          extra_body={"structured_outputs": {"regex": "!é"}})
    last = [c for c in chat if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == "grammar_dead_end"


# ---- tool calls ---------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_whole_and_streamed_agree_and_validate(client, tool_choice):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
                   max_tokens=200, seed=4)
    whole = client.chat.completions.create(**request)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = _check_calls(whole.choices[0].message, max_calls=1)
    if isinstance(tool_choice, dict):
        assert calls[0][0] == "get_time"
    with client.chat.completions.stream(**request) as stream:  # the client's own accumulation of deltas
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _check_calls(streamed.choices[0].message, max_calls=1) == calls


def test_parallel_calls_and_pydantic_tools(client):
    # The prompt with the tools is 635 tokens of the 1024-token context: 389 are left.
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=380, seed=5)
    _check_calls(response.choices[0].message)

    class GetForecast(BaseModel):
        city: str = Field(max_length=8)
        days: int = Field(ge=1, le=7)

    tools = [openai.pydantic_function_tool(GetForecast)]  # strict, as parse() wants
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, tools=tools, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=200, seed=6)
    call = parsed.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetForecast)


def test_auto_tool_choice_serves_free_text(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, seed=7)
    choice = response.choices[0]
    assert choice.finish_reason in ("stop", "length")  # a random model writes no well-formed call
    streamed = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=12, seed=7,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == (choice.message.content or "")


def test_a_tool_result_conversation_round_trips(client, serve_config):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=200, seed=8)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, seed=8)
    assert second.choices[0].finish_reason in ("stop", "length")
    # After the first prompt's "<assistant>" come the call (a block, arguments as JSON), the
    # result (a <tool_response> user turn) and a new "<assistant>"; the tiny tokenizer has one
    # token per character.
    arguments = json.loads(call.function.arguments)
    replay = ('<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(arguments) + '}\n</tool_call>\n'
              '<user><tool_response>\n18 C, sunny\n</tool_response>\n<assistant>')
    assert second.usage.prompt_tokens == first.usage.prompt_tokens + len(replay)


# ---- errors -------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/gone"}}}}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"structured_outputs": {"regex": "a"}}},
     "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}}, "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "frobnicate"}}}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
])
def test_bad_constraints_and_tools_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)  # still serving


def test_responses_api_function_calls_whole_and_streamed(client):
    """/v1/responses with function tools (flat specs) and a forced call: function_call items whose
    arguments validate, the same whole and through the client's stream helper; the call and its
    output sent back as input items give the next turn."""
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
             for t in TOOLS]
    request = dict(model=MODEL, input="Weather in Paris?", tools=tools, parallel_tool_calls=False,
                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200, temperature=0)
    whole = client.responses.create(**request)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert whole.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert calls[0].call_id.startswith("call_")
    with client.responses.stream(**request) as stream:
        streamed = stream.get_final_response()
    assert [(i.name, i.arguments) for i in streamed.output if i.type == "function_call"] == \
        [(calls[0].name, calls[0].arguments)]
    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                  "arguments": calls[0].arguments},
                 {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}]
    answer = client.responses.create(model=MODEL, input=follow_up, tools=tools, tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": calls[0].call_id, "type": "function",
         "function": {"name": calls[0].name, "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert answer.output[0].type == "message" and answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
