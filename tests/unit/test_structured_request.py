"""Output constraints of a request (cluster/api/structured_request.py): every shape of
``response_format`` and ``structured_outputs`` maps onto the StructuredOutputs the engine
takes, on both endpoints; bad shapes, bad schemas and two constraint sources are errors
naming the field. The response_format bodies are the ones the ``openai`` client itself
builds (``client.chat.completions.parse(response_format=<pydantic model>)``).
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field, ValidationError

from cluster.api.openai_protocol import ChatCompletionRequest, CompletionRequest, UnsupportedFieldError
from cluster.structured.constraint import ConstraintError, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]


class City(BaseModel):
    name: str = Field(max_length=10)


class Weather(BaseModel):
    city: City
    celsius: int = Field(ge=-50, le=60)
    sky: Literal["sunny", "cloudy"]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def constraints(**fields) -> list[StructuredOutputs | None]:
    """The constraint of the same fields on each endpoint."""
    return [completion(**fields).output_constraint(), chat(**fields).chat_constraint()]


# ---- response_format ---------------------------------------------------------------
def test_no_format_and_text_are_unconstrained():
    assert constraints() == [None, None]
    assert constraints(response_format={"type": "text"}) == [None, None]


def test_json_object_is_any_json_object():
    for constraint in constraints(response_format={"type": "json_object"}):
        assert constraint == StructuredOutputs(json=True, param="response_format")


def test_json_schema_is_that_schema():
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    for constraint in constraints(response_format=rf):
        assert constraint.json == SCHEMA and constraint.param == "response_format"
    missing = {"type": "json_schema", "json_schema": {"name": "w"}}
    assert constraints(response_format=missing)[0].json is True


def test_the_openai_clients_pydantic_format_is_taken_as_is():
    rf = type_to_response_format_param(Weather)
    assert rf["json_schema"]["strict"] is True and "$defs" in rf["json_schema"]["schema"]
    body = chat(response_format=json.loads(json.dumps(rf)))  # as it crosses HTTP
    constraint = body.chat_constraint()
    assert constraint.json == rf["json_schema"]["schema"]
    assert "City" in constraint.grammar_text()  # compiled, $ref and all


@pytest.mark.parametrize("response_format", [
    {"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    {"type": "json_schema", "json_schema": {"name": "w", "schema": "not an object"}}, "json", {},
])
def test_bad_response_format_shapes_are_validation_errors_at_the_field(response_format):
    for build in (completion, chat):
        with pytest.raises(ValidationError) as err:
            build(response_format=response_format)
        assert err.value.errors()[0]["loc"][0] == "response_format"


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                                    {"type": "frobnicate"}])
def test_a_schema_llguidance_cannot_compile_names_response_format(schema):
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for build, method in ((completion, "output_constraint"), (chat, "chat_constraint")):
        with pytest.raises(ConstraintError) as err:
            getattr(build(response_format=rf), method)()
        assert err.value.param == "response_format"


# ---- structured_outputs (vLLM's extra field) ---------------------------------------
@pytest.mark.parametrize("field, expected", [
    ({"json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ({"json": json.dumps(SCHEMA)}, StructuredOutputs(json=SCHEMA)),
    ({"regex": "[a-z]{3}"}, StructuredOutputs(regex="[a-z]{3}")),
    ({"choice": ["yes", "no"]}, StructuredOutputs(choice=("yes", "no"))),
    ({"grammar": 'start: "a" | "b"'}, StructuredOutputs(grammar='start: "a" | "b"')),
    ({"json_object": True}, StructuredOutputs(json=True)),
])
def test_structured_outputs_shapes(field, expected):
    for constraint in constraints(structured_outputs=field):
        assert constraint == expected and constraint.param == "structured_outputs"


@pytest.mark.parametrize("field", [
    {}, {"json_object": False}, {"regex": "a", "choice": ["a"]}, {"json": "{not json"}, {"json": "[1, 2]"},
    {"choice": []}, {"choice": ["a", ""]}, {"regex": "(unclosed"}, {"grammar": "start: undefined_rule"},
    {"json": {"type": "frobnicate"}},
])
def test_bad_structured_outputs_name_the_field(field):
    for build, method in ((completion, "output_constraint"), (chat, "chat_constraint")):
        with pytest.raises(ValueError) as err:
            getattr(build(structured_outputs=field), method)()
        assert err.value.param == "structured_outputs", err.value


@pytest.mark.parametrize("field", [{"whitespace_pattern": " "}, {"choice": "yes"}, {"regex": 5}, "json"])
def test_unknown_keys_and_wrong_types_in_structured_outputs_are_validation_errors(field):
    with pytest.raises(ValidationError) as err:
        chat(structured_outputs=field)
    assert err.value.errors()[0]["loc"][0] == "structured_outputs"


# ---- one constraint source ---------------------------------------------------------
def test_two_constraint_sources_are_refused_naming_the_later():
    both = {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}}
    for build, method in ((completion, "output_constraint"), (chat, "chat_constraint")):
        with pytest.raises(UnsupportedFieldError) as err:
            getattr(build(**both), method)()
        assert err.value.param == "structured_outputs"
    for fields in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a+"}}):
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            body = chat(tools=TOOLS, tool_choice=tool_choice, **fields)
            with pytest.raises(UnsupportedFieldError) as err:
                body.chat_constraint(body.tool_plan("hermes"))
            assert err.value.param == "tool_choice"


def test_text_format_and_auto_tools_go_with_a_constraint():
    body = chat(tools=TOOLS, tool_choice="auto", response_format={"type": "text"}, structured_outputs={"regex": "a"})
    assert body.chat_constraint(body.tool_plan("hermes")) == StructuredOutputs(regex="a")
    body = chat(tools=TOOLS, response_format={"type": "json_object"})
    assert body.chat_constraint(body.tool_plan("prompt")).param == "response_format"


def test_the_constraint_reaches_sampling_params():
    body = completion(structured_outputs={"choice": ["a", "b"]})
    params = body.sampling_params(16, None, 0, body.output_constraint())
    assert params.structured_outputs == StructuredOutputs(choice=("a", "b"))
    assert completion().sampling_params(16, None, 0).structured_outputs is None
