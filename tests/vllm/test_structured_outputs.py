"""Structured outputs and forced tool calls behave alike on both engines: the ``vllm`` group gets
the same grammar (vLLM's llguidance backend, JSON sent as the native engine's bounded Lark
grammar), so outputs validate on both, carry the same compact separators, and greedy texts
agree (both engines run SmolLM2-135M-Instruct in float32)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serve.conftest import MODEL

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "area_km2": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["coastal", "capital", "historic"]}, "maxItems": 3},
    },
    "required": ["city", "population", "area_km2", "tags"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


def _json_completion(client) -> str:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    assert reply.choices[0].finish_reason == "stop"
    return reply.choices[0].message.content


def test_json_schema_validates_with_bounded_whitespace(client):
    text = _json_completion(client)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "\n" not in text and '", "' in text and '": ' in text  # the separators, nothing else


def test_regex_and_choice(client):
    regex = client.completions.create(model=MODEL, prompt="A code:", max_tokens=12, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert regex.choices[0].text[3] == "-" and regex.choices[0].text[:3].isupper()
    choice = client.completions.create(model=MODEL, prompt="Is the sky blue?", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")


def test_forced_tool_call_validates(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80, temperature=0)
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOL["function"]["parameters"])


@pytest.fixture(scope="module")
def native_json(server_url):
    import openai

    from tests.serve.conftest import API_KEY

    native = openai.OpenAI(base_url=f"{server_url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                           default_headers={"X-Tandem-Group": "native"})
    return _json_completion(native)


def test_greedy_json_agrees_between_engines(client, group, native_json):
    if group == "native":
        pytest.skip("the reference itself")
    assert _json_completion(client) == native_json
