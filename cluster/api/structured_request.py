"""The request fields that constrain the output, mapped onto ``StructuredOutputs``.

Two fields say what the output must match, on /v1/completions and /v1/chat/completions alike:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``
  (any JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ...}}`` (an object matching the schema; a missing schema means any JSON object).
  The schema is always enforced, whatever ``strict`` says.
- vLLM's extra field ``structured_outputs``: exactly one of ``json`` (a schema, as an object or a
  JSON string), ``regex``, ``choice`` (a list of strings), ``grammar`` (a Lark grammar in
  llguidance's dialect) or ``json_object: true``. Other keys are a 400, so that a constraint
  Tandem does not know is never silently dropped.

A request may carry one constraint source: response_format (json kinds), structured_outputs or a
forced tool call (``tool_choice`` "required" or a named function). Two are a 400 naming the
later field. A schema or grammar that cannot be compiled is a 400 naming the field it came
from (``ConstraintError``, raised when ``StructuredOutputs`` is built).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from cluster.api.errors import UnsupportedFieldError
from cluster.structured.constraint import StructuredOutputs


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class TextFormat(_Body):
    type: Literal["text"]


class JsonObjectFormat(_Body):
    type: Literal["json_object"]


class JsonSchemaSpec(_Body):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr | None = None
    json_schema: dict | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class JsonSchemaFormat(_Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaFormat], Field(discriminator="type")]


class StructuredOutputsField(_Body):
    """vLLM's ``structured_outputs`` extra body field (the keys Tandem implements)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


def response_format_constraint(response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None
                               ) -> StructuredOutputs | None:
    """None for no format or ``text``; raises ConstraintError (param ``response_format``) on a bad schema."""
    if response_format is None or isinstance(response_format, TextFormat):
        return None
    if isinstance(response_format, JsonObjectFormat) or response_format.json_schema.json_schema is None:
        return StructuredOutputs(json=True, param="response_format")
    return StructuredOutputs(json=response_format.json_schema.json_schema, param="response_format")


def structured_outputs_constraint(field: StructuredOutputsField | None) -> StructuredOutputs | None:
    """Raises UnsupportedFieldError / ConstraintError with param ``structured_outputs``."""
    if field is None:
        return None
    param = "structured_outputs"
    given = [key for key in ("json", "regex", "choice", "grammar", "json_object")
             if getattr(field, "json_" if key == "json" else key) not in (None, False)]
    if len(given) != 1:
        raise UnsupportedFieldError(param, f"{param} must set exactly one of json, regex, choice, grammar or "
                                           f"json_object, got {', '.join(given) or 'none'}")
    if field.json_object:
        return StructuredOutputs(json=True, param=param)
    schema = field.json_
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise UnsupportedFieldError(param, f"{param}.json is a string but not JSON: {err}") from None
        if not isinstance(schema, dict):
            raise UnsupportedFieldError(param, f"{param}.json must be a JSON schema object")
    if field.choice is not None and not field.choice:
        raise UnsupportedFieldError(param, f"{param}.choice must list at least one string")
    return StructuredOutputs(json=schema, regex=field.regex, grammar=field.grammar,
                             choice=tuple(field.choice) if field.choice is not None else None, param=param)


def single_constraint(*sources: tuple[str, StructuredOutputs | None]) -> StructuredOutputs | None:
    """The one constraint among ``(field name, constraint)`` pairs, in request order; a 400
    (UnsupportedFieldError naming the later field) when two are set."""
    chosen: tuple[str, StructuredOutputs] | None = None
    for name, constraint in sources:
        if constraint is None:
            continue
        if chosen is not None:
            raise UnsupportedFieldError(name, f"{chosen[0]} and {name} both constrain the output; send only one")
        chosen = (name, constraint)
    return chosen[1] if chosen is not None else None
